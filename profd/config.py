"""Daemon configuration: flags, else ``PROFD_*`` environment, else TOML file, else defaults.

``profd run`` and ``profctl`` both resolve locations through :func:`load`, so exporting one
variable (``PROFD_RUNTIME_DIR``) points both at the same daemon.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ConfigError is this module's error too (every reader of settings catches it from here).
from profd.config_file import ConfigError as ConfigError
from profd.config_file import config_path, profctl_config, read_toml
from profd.watch import sampling
from profd.watch.slowdown_rules import WatchRules
from profd_client.locations import runtime_dir as resolve_runtime_dir
from profd_client.locations import under_systemd
from profd_client.protocol.schema import MAX_CYCLE_STEPS, MAX_PIDS

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class S3Config:
    url: str | None = None  # s3://bucket/prefix
    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str | None = None  # "path" for most S3-compatible stores
    checksum_when_required: bool = False
    multipart_threshold: int = 64 << 20
    multipart_chunksize: int = 16 << 20
    max_bandwidth: int | None = None  # bytes/s, shared with NCCL on the NIC
    storage_class: str | None = None
    sse: str | None = None  # "AES256" or "aws:kms"
    sse_kms_key_id: str | None = None
    workers: int = 2
    max_attempts: int = 8
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    #: Retry delay cap for a file that used up ``max_attempts``: it is ``failed`` but, while
    #: its local file exists, still retried on the same backoff, capped at this.
    failed_backoff_max: float = 300.0

    @property
    def enabled(self) -> bool:
        return bool(self.url)

    def bucket_prefix(self) -> tuple[str, str]:
        if not self.url or not self.url.startswith("s3://"):
            raise ConfigError(f"s3 url must look like s3://bucket/prefix, got {self.url!r}")
        rest = self.url[5:]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ConfigError(f"s3 url has no bucket: {self.url!r}")
        return bucket, prefix.strip("/")


@dataclass(frozen=True)
class NsysConfig:
    """``[nsys]``: where the Nsight Systems CLI is and how long to wait for its reports."""

    path: str | None = None  # default: ``nsys`` on PATH
    #: Seconds after the last rank ends a range before profd forces ``nsys stop``: nsys
    #: writes a report only when its collection ends, and a big one takes minutes.
    finalize_timeout: float = 300.0
    #: Seconds any one nsys CLI call (start, stop, stats) may take.
    command_timeout: float = 120.0


def _nsys(table: Mapping[str, Any], env: Mapping[str, str]) -> NsysConfig:
    unknown = set(table) - set(NsysConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"[nsys]: unknown keys {sorted(unknown)}")
    kw: dict[str, Any] = dict(table)
    if env.get("PROFD_NSYS"):
        kw["path"] = env["PROFD_NSYS"]
    if env.get("PROFD_NSYS_FINALIZE_TIMEOUT"):
        kw["finalize_timeout"] = env["PROFD_NSYS_FINALIZE_TIMEOUT"]
    if "path" in kw:
        kw["path"] = _opt_str(kw["path"], "nsys.path")
    for k in ("finalize_timeout", "command_timeout"):
        if k in kw:
            kw[k] = _number(kw[k], f"nsys.{k}", float, 0)
    return NsysConfig(**kw)


#: The TCP port of ``[cluster] listen`` when a node list names a host without one.
DEFAULT_CLUSTER_PORT = 7717


@dataclass(frozen=True)
class ClusterConfig:
    """``[cluster]``: the daemon's authenticated TCP control socket, and profctl's keys.

    ``server_key`` is the daemon's secret key file for ``profd run`` and, for profctl, the
    file it takes the daemons' public key from (a ``.key`` or ``.key_secret`` file)."""

    listen: str | None = None  # tcp://*:7717
    server_key: Path | None = None
    authorized_keys: Path | None = None  # a directory of operators' public ``.key`` files
    key: Path | None = None  # profctl's own secret key file


def _cluster(table: Mapping[str, Any]) -> ClusterConfig:
    unknown = set(table) - set(ClusterConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"[cluster]: unknown keys {sorted(unknown)}")
    kw: dict[str, Any] = {}
    for k, v in table.items():
        text = _opt_str(v, f"cluster.{k}")
        if not text:
            continue
        kw[k] = text if k == "listen" else Path(text).expanduser()
    listen = kw.get("listen")
    if listen is not None and not listen.startswith("tcp://"):
        raise ConfigError(
            f"cluster.listen: must look like tcp://*:{DEFAULT_CLUSTER_PORT}, got {listen!r}"
        )
    return ClusterConfig(**kw)


#: The TCP port of ``[metrics] listen`` in the shipped deployment files.
DEFAULT_METRICS_PORT = 7718


@dataclass(frozen=True)
class MetricsConfig:
    """``[metrics]``: Prometheus' ``/metrics`` over HTTP; off unless ``listen`` is set."""

    listen: str | None = None  # "HOST:PORT" as written
    host: str = ""
    port: int = 0  # 0: a port the kernel picks (status shows the one bound)


def _metrics(table: Mapping[str, Any], env: Mapping[str, str]) -> MetricsConfig:
    unknown = set(table) - {"listen"}
    if unknown:
        raise ConfigError(f"[metrics]: unknown keys {sorted(unknown)}")
    listen = env.get("PROFD_METRICS_LISTEN") or _opt_str(table.get("listen"), "metrics.listen")
    if not listen:
        return MetricsConfig()
    host, port = parse_listen(listen)
    return MetricsConfig(listen=listen, host=host, port=port)


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for an IPv6 address) as (host, port)."""
    bad = ConfigError(
        f"metrics.listen: must look like HOST:PORT (127.0.0.1:{DEFAULT_METRICS_PORT},"
        f" 0.0.0.0:{DEFAULT_METRICS_PORT} for every interface, [::]:PORT), got {text!r}"
    )
    host, sep, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host:
            raise bad
    elif ":" in host or "[" in host or "]" in host:
        raise bad  # an IPv6 address without brackets: where its port starts is a guess
    if (
        not sep
        or not host
        or not (port.isascii() and port.isdigit())
        or any(c.isspace() for c in host)
    ):
        raise bad
    n = int(port)
    if n > 65535:
        raise bad
    return host, n


@dataclass(frozen=True)
class WatchConfig:
    """``[watch]``: what profd keeps of every rank's step times and what it notices by itself
    (docs/design.md "Watch"): durations in seconds, thresholds as fractions."""

    #: Seconds the index keeps each rank's per-minute step times (``profctl history``).
    keep_history: float = 604800.0
    #: The detectors run (incidents are listed either way).
    enabled: bool = True
    window: float = 60.0
    baseline: float = 600.0
    hold: float = 30.0
    regression: float = 0.2
    slow_rank: float = 0.25
    #: A step this many times its rank's median (and at least a second longer) is a spike.
    spike: float = 5.0
    #: Seconds after an automatic capture before the same job gets another.
    cooldown: float = 900.0
    #: A rank without a step for this long is stalled (the hang rule); None: the rule's own.
    stall_after: float | None = None
    #: Steps between two samples of every attached job (0: no samples).
    sample_every: int = 0
    sample_steps: int = 2
    keep_samples: float = 86400.0
    #: The least seconds a sample is given before it ends with what it got.
    sample_timeout: float = sampling.MIN_TIMEOUT_S
    #: Arm a capture on each incident.
    capture: bool = True
    #: Ranks a regression's capture takes at most.
    capture_ranks: int = 8

    def rules(self) -> WatchRules:
        """The detectors' thresholds and durations."""
        return WatchRules(
            window=self.window,
            baseline=self.baseline,
            hold=self.hold,
            regression=self.regression,
            slow_rank=self.slow_rank,
            spike=self.spike,
        )


#: ``[watch]`` keys by kind of value: (name, kind, lowest, lowest allowed itself).
_WATCH_NUMBERS: tuple[tuple[str, type[float] | type[int], float, bool], ...] = (
    ("keep_history", float, 0, False),
    ("window", float, 0, False),
    ("baseline", float, 0, False),
    ("hold", float, 0, True),
    ("regression", float, 0, False),
    ("slow_rank", float, 0, False),
    ("spike", float, 1, False),
    ("cooldown", float, 0, True),
    ("stall_after", float, 0, False),
    ("sample_every", int, 0, True),
    ("sample_steps", int, 1, True),
    ("keep_samples", float, 0, False),
    ("sample_timeout", float, 0, False),
    ("capture_ranks", int, 1, True),
)
_MAX_SAMPLE_STEPS = MAX_CYCLE_STEPS  # a sample is one capture cycle
_MAX_CAPTURE_RANKS = MAX_PIDS  # a capture selects its ranks by pid


def _watch(table: Mapping[str, Any]) -> WatchConfig:
    unknown = set(table) - set(WatchConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"[watch]: unknown keys {sorted(unknown)}")
    kw: dict[str, Any] = {}
    for k, kind, low, zero_ok in _WATCH_NUMBERS:
        if k in table:
            kw[k] = _number(table[k], f"watch.{k}", kind, low, zero_ok=zero_ok)
    for k in ("enabled", "capture"):
        if k in table:
            if not isinstance(table[k], bool):
                raise ConfigError(f"watch.{k}: must be true or false, got {table[k]!r}")
            kw[k] = table[k]
    if kw.get("sample_steps", 1) > _MAX_SAMPLE_STEPS:
        raise ConfigError(f"watch.sample_steps: at most {_MAX_SAMPLE_STEPS}")
    if kw.get("capture_ranks", 1) > _MAX_CAPTURE_RANKS:
        raise ConfigError(f"watch.capture_ranks: at most {_MAX_CAPTURE_RANKS}")
    w = WatchConfig(**kw)
    why = sampling.problem(w.sample_every, w.sample_steps)
    if why:
        raise ConfigError(f"[watch]: {why}")
    return w


def reload_watch(path: Path | None) -> WatchConfig:
    """``[watch]`` read again from the config file (SIGHUP); the rest of the file is not
    looked at. No file: the defaults. :class:`ConfigError` if it cannot be used."""
    if path is None:
        return WatchConfig()
    table = _table(read_toml(path), "watch")
    try:
        return _watch(table)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"[watch]: {exc}") from None


@dataclass(frozen=True)
class BlackboxConfig:
    """``[blackbox]``: what every attached rank keeps of its last steps (its welcome says so;
    the rank's own ``PROFD_BLACKBOX*`` environment wins)."""

    enabled: bool = True
    keep_steps: int = 512
    keep_seconds: float = 120.0
    sample_hz: float = 10.0

    def welcome(self) -> dict[str, Any]:
        """As a ``welcome`` carries it."""
        return {
            "enabled": self.enabled,
            "keep_steps": self.keep_steps,
            "keep_seconds": self.keep_seconds,
            "sample_hz": self.sample_hz,
        }


def _blackbox(table: Mapping[str, Any]) -> BlackboxConfig:
    unknown = set(table) - set(BlackboxConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"[blackbox]: unknown keys {sorted(unknown)}")
    enabled = table.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"blackbox.enabled: must be true or false, got {enabled!r}")
    keep_steps = _number(table.get("keep_steps", 512), "blackbox.keep_steps", int, 0)
    keep_seconds = _number(
        table.get("keep_seconds", 120.0), "blackbox.keep_seconds", float, 0, zero_ok=True
    )
    sample_hz = _number(table.get("sample_hz", 10.0), "blackbox.sample_hz", float, 0, zero_ok=True)
    # The welcome's bounds (``protocol.BlackboxSettings``).
    if keep_steps > 1 << 20 or keep_seconds > 86400.0 or sample_hz > 1000.0:
        raise ConfigError(
            "[blackbox]: keep_steps at most 1048576, keep_seconds at most 86400,"
            " sample_hz at most 1000"
        )
    return BlackboxConfig(enabled, keep_steps, keep_seconds, sample_hz)


#: The least ``[warehouse] seal_after``: a node's reader takes a closed day's unflushed rows
#: as the whole day and an open day's hour by hour (profd/warehouse/seal.py), so a seal of a
#: day that was open when the reader asked must not land before the reader lists the objects.
MIN_SEAL_AFTER = 300.0
#: The least ``[warehouse] merge_after``: an hour's last rows reach its objects a flush or
#: two after it ends, and each later row costs a merged object's rewrite.
MIN_MERGE_AFTER = 600.0


@dataclass(frozen=True)
class WarehouseConfig:
    """``[warehouse]``: where this daemon exports its rows as Parquet (docs/warehouse.md)."""

    enabled: bool = True
    #: ``s3://bucket/prefix/`` or an absolute directory, always ending in ``/``; None only
    #: before :func:`load` fills in the default.
    url: str | None = None
    #: Seconds between two flushes of the partitions whose rows changed.
    flush_every: float = 60.0
    #: Days of date partitions kept (``rank_minutes``: ``keep_rank_days``).
    keep_days: int = 400
    keep_rank_days: int = 30
    #: Seconds after a UTC day closes before this node seals it (one object per hourly
    #: table for the day), and after a seal before the hourly objects it superseded are
    #: deleted (docs/warehouse.md "Layout").
    seal_after: float = 3600.0
    sweep_after: float = 3600.0
    #: Whether writers' objects are merged into fleet objects (every writer's rows of a
    #: table's date in one object), and how long after an hour (an hourly object) or a date
    #: (a day object) ends (docs/warehouse.md "Layout").
    merge: bool = True
    merge_after: float = 1800.0

    @property
    def is_s3(self) -> bool:
        return bool(self.url) and str(self.url).startswith("s3://")


def _warehouse(table: Mapping[str, Any], s3: S3Config, state_dir: Path) -> WarehouseConfig:
    unknown = set(table) - set(WarehouseConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"[warehouse]: unknown keys {sorted(unknown)}")
    kw: dict[str, Any] = {}
    if "enabled" in table:
        if not isinstance(table["enabled"], bool):
            raise ConfigError(f"warehouse.enabled: must be true or false, got {table['enabled']!r}")
        kw["enabled"] = table["enabled"]
    if "flush_every" in table:
        kw["flush_every"] = _number(table["flush_every"], "warehouse.flush_every", float, 0)
    for k in ("keep_days", "keep_rank_days"):
        if k in table:
            kw[k] = _number(table[k], f"warehouse.{k}", int, 1, zero_ok=True)
    if "seal_after" in table:
        kw["seal_after"] = _number(
            table["seal_after"], "warehouse.seal_after", float, MIN_SEAL_AFTER, zero_ok=True
        )
    if "sweep_after" in table:
        kw["sweep_after"] = _number(table["sweep_after"], "warehouse.sweep_after", float, 0, True)
    if "merge" in table:
        if not isinstance(table["merge"], bool):
            raise ConfigError(f"warehouse.merge: must be true or false, got {table['merge']!r}")
        kw["merge"] = table["merge"]
    if "merge_after" in table:
        kw["merge_after"] = _number(
            table["merge_after"], "warehouse.merge_after", float, MIN_MERGE_AFTER, zero_ok=True
        )
    url = _opt_str(table.get("url"), "warehouse.url")
    kw["url"] = _warehouse_url(url, s3, state_dir)
    return WarehouseConfig(**kw)


def _warehouse_url(url: str | None, s3: S3Config, state_dir: Path) -> str:
    """The url as given (checked), else ``{[s3] url}/warehouse/``, else the state dir's
    ``warehouse/``; always ending in ``/``."""
    if not url:
        if s3.url:
            bucket, prefix = s3.bucket_prefix()
            return f"s3://{bucket}/{prefix + '/' if prefix else ''}warehouse/"
        return str(state_dir.absolute() / "warehouse") + "/"
    if url.startswith("s3://"):
        S3Config(url=url).bucket_prefix()  # the same checks as [s3] url
        return url.rstrip("/") + "/"
    if "://" in url or not url.startswith("/"):
        raise ConfigError(
            f"warehouse.url: must be s3://bucket/prefix or an absolute directory, got {url!r}"
        )
    return url.rstrip("/") + "/"


@dataclass(frozen=True)
class PeerLimits:
    """What one local process can make the daemon keep (``[daemon]`` keys): every attached
    rank costs memory, ``/metrics`` series, ``top`` rows and index rows."""

    #: Region names kept per rank; time in any other region counts as ``(other)``.
    max_regions_per_rank: int = 64
    #: Heartbeats a second whose ledgers each become an interval of a rank's step times;
    #: more are coalesced into the next one. Never below twice the daemon's heartbeat rate.
    max_heartbeat_rate: float = 10.0
    #: Peers (attached ranks) one process may register.
    max_peers_per_process: int = 16
    #: Peers the processes of one uid may register together.
    max_peers_per_user: int = 1024

    def heartbeat_rate(self, heartbeat_interval: float) -> float:
        """The rate a peer's ledger is taken at: an honest client sends one heartbeat an
        interval, so twice that is always allowed."""
        return max(self.max_heartbeat_rate, 2.0 / heartbeat_interval)


#: ``[daemon]`` keys of :class:`PeerLimits`: (name, kind).
_LIMITS: tuple[tuple[str, type[float] | type[int]], ...] = (
    ("max_regions_per_rank", int),
    ("max_heartbeat_rate", float),
    ("max_peers_per_process", int),
    ("max_peers_per_user", int),
)


def _limits(daemon: Mapping[str, Any]) -> PeerLimits:
    kw = {k: _number(daemon[k], k, kind, 0) for k, kind in _LIMITS if k in daemon}
    return PeerLimits(**kw)


@dataclass(frozen=True)
class AutoRule:
    """A standing ``[[auto]]`` rule: a start spec applied to every matching client on attach."""

    spec: Mapping[str, Any]


@dataclass(frozen=True)
class Config:
    runtime_dir: Path
    state_dir: Path
    spool_dir: Path
    config_file: Path | None = None
    group: str | None = None
    #: Members may act on every user's processes and sessions from a non-root profctl.
    admin_group: str | None = None
    #: Raw traces larger than this are refused, not read (a sparse or runaway file).
    max_trace_bytes: int = 8 << 30
    heartbeat_interval: float = 1.0
    #: Heartbeats a second the attached processes send before the daemon paces them (0:
    #: never): past it, their interval doubles (docs/design.md "Heartbeat pace").
    max_heartbeats_per_s: float = 256.0
    sample_interval: float = 3.0
    pipeline_workers: int = 2
    max_spool_bytes: int | None = None
    log_level: str = "info"
    s3: S3Config = field(default_factory=S3Config)
    nsys: NsysConfig = field(default_factory=NsysConfig)
    auto: tuple[AutoRule, ...] = ()
    #: This daemon's name in a cluster: the ``host`` of every row it reports.
    node_name: str = field(default_factory=socket.gethostname)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    limits: PeerLimits = field(default_factory=PeerLimits)
    blackbox: BlackboxConfig = field(default_factory=BlackboxConfig)
    warehouse: WarehouseConfig = field(default_factory=WarehouseConfig)

    @property
    def index_path(self) -> Path:
        return self.state_dir / "index.db"


def _default_state_dir() -> Path:
    if under_systemd():
        sd = os.environ.get("STATE_DIRECTORY")
        return Path(sd.split(":")[0]) if sd else Path("/var/lib/profd")
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "profd"


def _size(value: object, name: str, minimum: int = 0) -> int | None:
    """Sizes accept plain bytes or strings like ``"20GB"``/``"512MiB"``."""
    if value is None:
        return None
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        text = value.strip().upper().replace("IB", "B")
        units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40, "B": 1}
        for suffix, mult in units.items():
            if text.endswith(suffix):
                try:
                    n = int(float(text[: -len(suffix)]) * mult)
                except (ValueError, OverflowError):  # "xGB", "nanGB", "infGB"
                    pass
                break
        else:
            if text.isdigit():
                n = int(text)
    if n is None:
        raise ConfigError(f"{name}: not a size: {value!r}")
    if n < minimum:
        raise ConfigError(f"{name}: must be at least {minimum} bytes, got {value!r}")
    return n


def _number(
    value: object, name: str, kind: type[float] | type[int], low: float, zero_ok: bool = False
) -> Any:
    """An int or float setting above ``low`` (or equal to it with ``zero_ok``); numeric
    strings (environment variables) are accepted, booleans are not."""
    n: float | int | None = None
    try:
        if isinstance(value, str):
            n = kind(value.strip())
        elif isinstance(value, int) and not isinstance(value, bool):
            n = kind(value)
        elif isinstance(value, float) and kind is float:
            n = value
    except (ValueError, OverflowError):
        pass
    what = "an integer" if kind is int else "a number"
    # Written as "not (...)" so that NaN is refused too.
    if n is None or not (n >= low if zero_ok else n > low):
        raise ConfigError(f"{name}: must be {what} {'>=' if zero_ok else '>'} {low}, got {value!r}")
    return n


def _opt_str(value: object, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{name}: must be a string, got {value!r}")
    return value


def _s3(table: Mapping[str, Any], url: str | None, endpoint: str | None) -> S3Config:
    known = set(S3Config.__dataclass_fields__)
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"[s3]: unknown keys {sorted(unknown)}")
    kw: dict[str, Any] = dict(table)
    for k, v in kw.items():
        name = f"s3.{k}"
        if k in ("multipart_threshold", "multipart_chunksize", "max_bandwidth"):
            kw[k] = _size(v, name, minimum=1)
        elif k in ("workers", "max_attempts"):
            kw[k] = _number(v, name, int, 0)
        elif k in ("backoff_base", "backoff_max"):
            kw[k] = _number(v, name, float, 0, zero_ok=True)  # 0: retry at once
        elif k == "failed_backoff_max":
            kw[k] = _number(v, name, float, 0)  # never 0: failed files would retry in a loop
        elif k == "checksum_when_required":
            if not isinstance(v, bool):
                raise ConfigError(f"{name}: must be true or false, got {v!r}")
        else:
            _opt_str(v, name)
    if url:
        kw["url"] = url
    if endpoint:
        kw["endpoint_url"] = endpoint
    cfg = S3Config(**kw)
    if cfg.url:
        cfg.bucket_prefix()
    return cfg


def configured_cluster(config_file: str | None = None) -> ClusterConfig:
    """``[cluster]`` from the config file profd would read, for profctl's keys."""
    return _cluster(_table(profctl_config(config_file), "cluster"))


def load(
    config_file: str | os.PathLike[str] | None = None,
    *,
    runtime_dir: str | os.PathLike[str] | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
    s3_url: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    e = os.environ if env is None else env
    path = config_path(config_file, e)
    data = read_toml(path) if path else {}
    daemon = _table(data, "daemon")

    def pick(flag: object, env_name: str, key: str) -> str | None:
        if flag:
            return str(flag)
        if e.get(env_name):
            return e[env_name]
        v = daemon.get(key)
        return str(v) if v else None

    rdir = pick(runtime_dir, "PROFD_RUNTIME_DIR", "runtime_dir")
    sdir = Path(pick(state_dir, "PROFD_STATE_DIR", "state_dir") or _default_state_dir())
    spdir = pick(spool_dir, "PROFD_SPOOL_DIR", "spool_dir")
    # Every table is checked before any of its keys, in this order, so that a file with
    # several mistakes always reports the same one first.
    s3_table, nsys_table, cluster_table, watch_table, metrics_table, warehouse_table = (
        _table(data, name) for name in ("s3", "nsys", "cluster", "watch", "metrics", "warehouse")
    )
    blackbox_table = _table(data, "blackbox")
    node_name = _node_name(e, daemon)
    auto = _auto(data)
    log_level = _log_level(daemon)
    try:
        s3 = _s3(s3_table, s3_url or e.get("PROFD_S3_URL"), e.get("PROFD_S3_ENDPOINT_URL"))
        return Config(
            runtime_dir=resolve_runtime_dir(rdir),
            state_dir=sdir,
            spool_dir=Path(spdir) if spdir else sdir / "spool",
            config_file=path,
            group=_opt_str(daemon.get("group"), "group"),
            admin_group=_opt_str(daemon.get("admin_group"), "admin_group"),
            max_trace_bytes=_size(daemon.get("max_trace_bytes"), "max_trace_bytes") or (8 << 30),
            heartbeat_interval=_number(
                daemon.get("heartbeat_interval", 1.0), "heartbeat_interval", float, 0
            ),
            max_heartbeats_per_s=_number(
                daemon.get("max_heartbeats_per_s", 256.0), "max_heartbeats_per_s", float, 0, True
            ),
            sample_interval=_number(
                daemon.get("sample_interval", 3.0), "sample_interval", float, 0
            ),
            pipeline_workers=_number(daemon.get("pipeline_workers", 2), "pipeline_workers", int, 0),
            max_spool_bytes=_size(
                e.get("PROFD_MAX_SPOOL_BYTES") or daemon.get("max_spool_bytes"), "max_spool_bytes"
            ),
            log_level=log_level,
            s3=s3,
            nsys=_nsys(nsys_table, e),
            auto=tuple(AutoRule(spec=a) for a in auto),
            node_name=node_name or socket.gethostname(),
            cluster=_cluster(cluster_table),
            watch=_watch(watch_table),
            metrics=_metrics(metrics_table, e),
            limits=_limits(daemon),
            blackbox=_blackbox(blackbox_table),
            warehouse=_warehouse(warehouse_table, s3, sdir),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"config: {exc}") from None


def _table(data: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``[name]`` of the file (empty when absent)."""
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}] must be a table")
    return table


def _node_name(env: Mapping[str, str], daemon: Mapping[str, Any]) -> str | None:
    node_name = _opt_str(env.get("PROFD_NODE_NAME") or daemon.get("node_name"), "node_name")
    if node_name is not None and not node_name.strip():
        raise ConfigError("node_name: must not be empty")
    return node_name


def _auto(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    auto = data.get("auto", [])
    if not isinstance(auto, list) or not all(isinstance(a, dict) for a in auto):
        raise ConfigError("[[auto]] must be an array of tables")
    return auto


def _log_level(daemon: Mapping[str, Any]) -> str:
    log_level = daemon.get("log_level", "info")
    if not isinstance(log_level, str) or log_level.upper() not in _LOG_LEVELS:
        levels = ", ".join(_LOG_LEVELS).lower()
        raise ConfigError(f"log_level: must be one of {levels}, got {log_level!r}")
    return log_level
