"""Configuration (``profd/config.py``): TOML + environment + flags into frozen dataclasses.

Every test runs with a clean environment and no ``/etc/profd/profd.toml``, so what the
machine running the tests has set cannot leak in.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from profd import config as C
from profd import config_file
from profd.config import (
    Config,
    ConfigError,
    NsysConfig,
    PeerLimits,
    S3Config,
    WarehouseConfig,
    WatchConfig,
    load,
    reload_watch,
)
from profd.config_file import configured_runtime_dir

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(autouse=True)
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for k in list(os.environ):
        if k.startswith(("PROFD_", "XDG_")) or k in (
            "INVOCATION_ID",
            "RUNTIME_DIRECTORY",
            "STATE_DIRECTORY",
        ):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(config_file, "DEFAULT_CONFIG", tmp_path / "etc" / "profd.toml")
    yield


def toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "profd.toml"
    p.write_text(text)
    return p


def error_of(tmp_path: Path, text: str, **env: str) -> str:
    with pytest.raises(ConfigError) as exc:
        load(toml(tmp_path, text), env=env)
    msg = str(exc.value)
    assert msg and "\n" not in msg, msg  # profd run prints it as one line
    return msg


# --- defaults ----------------------------------------------------------------------------------
def test_defaults_without_a_config_file(tmp_path: Path) -> None:
    cfg = load(env={})
    state = tmp_path / "home" / ".local" / "state" / "profd"
    assert cfg == Config(
        runtime_dir=Path(f"/tmp/profd-{os.getuid()}"),
        state_dir=state,
        spool_dir=state / "spool",
        config_file=None,
        warehouse=WarehouseConfig(url=f"{state}/warehouse/"),
    )
    assert cfg.index_path == state / "index.db"
    assert (cfg.heartbeat_interval, cfg.sample_interval, cfg.pipeline_workers) == (1.0, 3.0, 2)
    assert cfg.max_spool_bytes is None and cfg.group is None and cfg.log_level == "info"
    assert cfg.s3 == S3Config() and not cfg.s3.enabled
    assert cfg.nsys == NsysConfig()
    assert cfg.auto == ()


def test_empty_config_file_is_all_defaults(tmp_path: Path) -> None:
    p = toml(tmp_path, "")
    cfg = load(p, env={})
    assert cfg.config_file == p
    assert cfg == Config(
        runtime_dir=cfg.runtime_dir,
        state_dir=cfg.state_dir,
        spool_dir=cfg.spool_dir,
        config_file=p,
        warehouse=WarehouseConfig(url=f"{cfg.state_dir.absolute()}/warehouse/"),
    )


def test_warehouse_url_defaults_below_the_s3_url_else_the_state_dir(tmp_path: Path) -> None:
    s3 = load(toml(tmp_path, '[s3]\nurl = "s3://bkt/some/prefix/"\n'), env={})
    assert s3.warehouse.url == "s3://bkt/some/prefix/warehouse/" and s3.warehouse.is_s3
    bare = load(toml(tmp_path, '[s3]\nurl = "s3://bkt"\n'), env={})
    assert bare.warehouse.url == "s3://bkt/warehouse/"
    given = load(
        toml(tmp_path, '[warehouse]\nurl = "/data/wh"\nflush_every = 0.5\nkeep_days = 7\n'),
        env={},
    )
    assert given.warehouse == WarehouseConfig(url="/data/wh/", flush_every=0.5, keep_days=7)
    off = load(toml(tmp_path, "[warehouse]\nenabled = false\n"), env={})
    assert not off.warehouse.enabled


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('url = "wh"', "warehouse.url: must be s3://bucket/prefix or an absolute directory"),
        ('url = "s3://"', "s3 url has no bucket"),
        ("flush_every = 0", "warehouse.flush_every: must be a number > 0"),
        ("keep_days = 0", "warehouse.keep_days: must be an integer >= 1"),
        ('keep_rank_days = "x"', "warehouse.keep_rank_days: must be an integer >= 1"),
        ('enabled = "yes"', "warehouse.enabled: must be true or false"),
        ("flush = 1", "[warehouse]: unknown keys ['flush']"),
    ],
)
def test_bad_warehouse_settings_are_one_line_errors(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load(toml(tmp_path, f"[warehouse]\n{text}\n"), env={})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_xdg_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xr"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xs"))
    cfg = load(env={})
    assert cfg.runtime_dir == tmp_path / "xr" / "profd"
    assert cfg.state_dir == tmp_path / "xs" / "profd"


def test_systemd_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INVOCATION_ID", "abc")
    cfg = load(env={})
    assert cfg.runtime_dir == Path("/run/profd")
    assert cfg.state_dir == Path("/var/lib/profd")
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/a:/run/b")
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/a:/var/lib/b")
    cfg = load(env={})
    assert (cfg.runtime_dir, cfg.state_dir) == (Path("/run/a"), Path("/var/lib/a"))
    assert cfg.spool_dir == Path("/var/lib/a/spool")


def test_default_config_file_is_read_when_present(tmp_path: Path) -> None:
    config_file.DEFAULT_CONFIG.parent.mkdir()
    config_file.DEFAULT_CONFIG.write_text('[daemon]\nlog_level = "debug"\n')
    cfg = load(env={})
    assert cfg.config_file == config_file.DEFAULT_CONFIG and cfg.log_level == "debug"


# --- the file ---------------------------------------------------------------------------------
FULL = """
[daemon]
runtime_dir = "/r"
state_dir = "/s"
spool_dir = "/sp"
group = "profd"
heartbeat_interval = 0.5
sample_interval = 2
pipeline_workers = 4
max_spool_bytes = "200GB"
log_level = "warning"

[s3]
url = "s3://ml-traces/profd/"
endpoint_url = "https://minio.internal:9000"
addressing_style = "path"
checksum_when_required = true
region = "us-east-1"
multipart_threshold = "64MiB"
multipart_chunksize = 8388608
max_bandwidth = "200MB"
storage_class = "STANDARD_IA"
sse = "aws:kms"
sse_kms_key_id = "k1"
workers = 3
max_attempts = 5
backoff_base = 0.5
backoff_max = 10
failed_backoff_max = 120

[nsys]
path = "/opt/nsys"
finalize_timeout = 600
command_timeout = 60.5

[[auto]]
roles = ["*policy_worker"]
ranks = "0,1"
steps = "3:5"
options = { activities = ["cpu"], record_shapes = true }

[[auto]]
at_step = 3
"""


def test_every_key(tmp_path: Path) -> None:
    cfg = load(toml(tmp_path, FULL), env={})
    assert (cfg.runtime_dir, cfg.state_dir, cfg.spool_dir) == (Path("/r"), Path("/s"), Path("/sp"))
    assert cfg.group == "profd"
    assert cfg.heartbeat_interval == 0.5 and cfg.sample_interval == 2.0
    assert isinstance(cfg.sample_interval, float)
    assert cfg.pipeline_workers == 4
    assert cfg.max_spool_bytes == 200 * GiB
    assert cfg.log_level == "warning"
    assert cfg.s3 == S3Config(
        url="s3://ml-traces/profd/",
        endpoint_url="https://minio.internal:9000",
        region="us-east-1",
        addressing_style="path",
        checksum_when_required=True,
        multipart_threshold=64 * MiB,
        multipart_chunksize=8 * MiB,
        max_bandwidth=200 * MiB,
        storage_class="STANDARD_IA",
        sse="aws:kms",
        sse_kms_key_id="k1",
        workers=3,
        max_attempts=5,
        backoff_base=0.5,
        backoff_max=10,
        failed_backoff_max=120,
    )
    assert cfg.s3.enabled
    assert cfg.s3.bucket_prefix() == ("ml-traces", "profd")
    assert cfg.nsys == NsysConfig(path="/opt/nsys", finalize_timeout=600.0, command_timeout=60.5)
    assert [dict(a.spec) for a in cfg.auto] == [
        {
            "roles": ["*policy_worker"],
            "ranks": "0,1",
            "steps": "3:5",
            "options": {"activities": ["cpu"], "record_shapes": True},
        },
        {"at_step": 3},
    ]


def test_watch_keeps_a_week_of_history_unless_told(tmp_path: Path) -> None:
    assert load(env={}).watch.keep_history == 604800.0
    cfg = load(toml(tmp_path, "[watch]\nkeep_history = 3600\n"), env={})
    assert cfg.watch.keep_history == 3600.0 and isinstance(cfg.watch.keep_history, float)


def test_watch_has_design_defaults_and_takes_every_key(tmp_path: Path) -> None:
    w = load(env={}).watch
    assert (w.enabled, w.window, w.baseline, w.hold, w.regression, w.slow_rank) == (
        True, 60.0, 600.0, 30.0, 0.2, 0.25,
    )  # fmt: skip
    assert (w.cooldown, w.stall_after, w.sample_every, w.sample_steps) == (900.0, None, 0, 2)
    assert (w.keep_samples, w.capture, w.capture_ranks) == (86400.0, True, 8)
    text = (
        "[watch]\nenabled = false\nwindow = 6\nbaseline = 12\nhold = 0\nregression = 0.5\n"
        "slow_rank = 0.3\ncooldown = 0\nstall_after = 120\nsample_every = 1000\n"
        "sample_steps = 3\nkeep_samples = 3600\ncapture = false\ncapture_ranks = 2\n"
    )
    w = load(toml(tmp_path, text), env={}).watch
    assert w == WatchConfig(
        enabled=False, window=6.0, baseline=12.0, hold=0.0, regression=0.5, slow_rank=0.3,
        cooldown=0.0, stall_after=120.0, sample_every=1000, sample_steps=3,
        keep_samples=3600.0, capture=False, capture_ranks=2,
    )  # fmt: skip
    assert isinstance(w.window, float) and isinstance(w.sample_every, int)
    assert w.rules().window == 6.0 and w.rules().regression == 0.5


def test_watch_is_read_again_alone(tmp_path: Path) -> None:
    path = toml(tmp_path, "[daemon]\nlog_level = 'loud'\n[watch]\nhold = 5\n")
    assert reload_watch(path).hold == 5.0  # the rest of the file is not looked at
    assert reload_watch(None) == WatchConfig()
    path.write_text("[watch]\nhold = 'x'\n")
    with pytest.raises(ConfigError, match=r"watch\.hold"):
        reload_watch(path)
    path.write_text("[watch\n")
    with pytest.raises(ConfigError, match="config file"):
        reload_watch(path)


def test_config_is_frozen(tmp_path: Path) -> None:
    cfg = load(env={})
    with pytest.raises(AttributeError):
        cfg.log_level = "debug"  # type: ignore[misc]


def test_spool_defaults_to_the_state_dir(tmp_path: Path) -> None:
    cfg = load(toml(tmp_path, '[daemon]\nstate_dir = "/s"\n'), env={})
    assert cfg.spool_dir == Path("/s/spool")


def test_unknown_daemon_keys_and_tables_are_ignored(tmp_path: Path) -> None:
    # Documented: a newer config file still starts an older daemon.
    cfg = load(toml(tmp_path, "[daemon]\nfuture_key = 1\n[future]\nlisten = 'x'\n"), env={})
    assert cfg.heartbeat_interval == 1.0


def test_node_name_and_cluster(tmp_path: Path) -> None:
    assert load(env={}).node_name == socket.gethostname()
    assert load(env={}).cluster == C.ClusterConfig()
    p = toml(
        tmp_path,
        '[daemon]\nnode_name = "gpu07"\n[cluster]\nlisten = "tcp://*:7717"\n'
        'server_key = "/etc/profd/keys/daemon.key_secret"\nauthorized_keys = "/etc/profd/ops"\n'
        'key = "~/.config/profd/me.key_secret"\n',
    )
    cfg = load(p, env={})
    assert cfg.node_name == "gpu07"
    assert cfg.cluster.listen == "tcp://*:7717"
    assert cfg.cluster.server_key == Path("/etc/profd/keys/daemon.key_secret")
    assert cfg.cluster.authorized_keys == Path("/etc/profd/ops")
    assert cfg.cluster.key == Path.home() / ".config/profd/me.key_secret"
    assert load(p, env={"PROFD_NODE_NAME": "n3"}).node_name == "n3"
    assert C.configured_cluster(str(p)) == cfg.cluster


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[cluster]\nlisten = "ipc:///tmp/x"\n', "cluster.listen: must look like tcp://"),
        ('[cluster]\nauthorised_keys = "/x"\n', "[cluster]: unknown keys ['authorised_keys']"),
        ("[cluster]\nlisten = 7717\n", "cluster.listen: must be a string"),
        ('[daemon]\nnode_name = " "\n', "node_name: must not be empty"),
    ],
)
def test_bad_cluster_config(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(error)):
        load(toml(tmp_path, text), env={})


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("123", 123),
        ('"123"', 123),
        ('"512B"', 512),
        ('"4KB"', 4 << 10),
        ('"4kib"', 4 << 10),
        ('"512MiB"', 512 * MiB),
        ('"20GB"', 20 * GiB),
        ('" 20 gb "', 20 * GiB),
        ('"1.5GB"', 3 * GiB // 2),
        ('"2TB"', 2 << 40),
        ("0", 0),
    ],
)
def test_sizes(tmp_path: Path, text: str, size: int) -> None:
    cfg = load(toml(tmp_path, f"[daemon]\nmax_spool_bytes = {text}\n"), env={})
    assert cfg.max_spool_bytes == size


# --- environment and flags ---------------------------------------------------------------------
def test_env_overrides_file_and_flags_override_env(tmp_path: Path) -> None:
    p = toml(
        tmp_path,
        '[daemon]\nruntime_dir = "/fr"\nstate_dir = "/fs"\nspool_dir = "/fsp"\n'
        'max_spool_bytes = "1GB"\n[s3]\nurl = "s3://file/p"\nendpoint_url = "http://file"\n'
        '[nsys]\npath = "/file/nsys"\nfinalize_timeout = 1\n',
    )
    env = {
        "PROFD_RUNTIME_DIR": "/er",
        "PROFD_STATE_DIR": "/es",
        "PROFD_SPOOL_DIR": "/esp",
        "PROFD_MAX_SPOOL_BYTES": "2GB",
        "PROFD_S3_URL": "s3://env/p",
        "PROFD_S3_ENDPOINT_URL": "http://env",
        "PROFD_NSYS": "/env/nsys",
        "PROFD_NSYS_FINALIZE_TIMEOUT": "7.5",
    }
    cfg = load(p, env=env)
    assert (cfg.runtime_dir, cfg.state_dir, cfg.spool_dir) == (
        Path("/er"),
        Path("/es"),
        Path("/esp"),
    )
    assert cfg.max_spool_bytes == 2 * GiB
    assert (cfg.s3.url, cfg.s3.endpoint_url) == ("s3://env/p", "http://env")
    assert (cfg.nsys.path, cfg.nsys.finalize_timeout) == ("/env/nsys", 7.5)
    cfg = load(
        p, runtime_dir="/xr", state_dir="/xs", spool_dir="/xsp", s3_url="s3://flag/p", env=env
    )
    assert (cfg.runtime_dir, cfg.state_dir, cfg.spool_dir) == (
        Path("/xr"),
        Path("/xs"),
        Path("/xsp"),
    )
    assert cfg.s3.url == "s3://flag/p"


def test_empty_env_vars_count_as_unset(tmp_path: Path) -> None:
    p = toml(tmp_path, '[daemon]\nstate_dir = "/fs"\nmax_spool_bytes = 10\n[s3]\nurl = "s3://b"\n')
    env = dict.fromkeys(
        ["PROFD_STATE_DIR", "PROFD_MAX_SPOOL_BYTES", "PROFD_S3_URL", "PROFD_NSYS", "PROFD_CONFIG"],
        "",
    )
    cfg = load(p, env=env)
    assert (cfg.state_dir, cfg.max_spool_bytes, cfg.s3.url) == (Path("/fs"), 10, "s3://b")
    assert cfg.nsys.path is None


def test_config_file_from_env_and_flag(tmp_path: Path) -> None:
    a = tmp_path / "a.toml"
    a.write_text('[daemon]\nlog_level = "debug"\n')
    b = tmp_path / "b.toml"
    b.write_text('[daemon]\nlog_level = "error"\n')
    assert load(env={"PROFD_CONFIG": str(a)}).log_level == "debug"
    assert load(b, env={"PROFD_CONFIG": str(a)}).log_level == "error"


def test_spool_follows_a_state_dir_from_env(tmp_path: Path) -> None:
    cfg = load(env={"PROFD_STATE_DIR": "/es"})
    assert cfg.spool_dir == Path("/es/spool")


def test_s3_url_from_env_alone(tmp_path: Path) -> None:
    cfg = load(env={"PROFD_S3_URL": "s3://bucket"})
    assert cfg.s3.enabled and cfg.s3.bucket_prefix() == ("bucket", "")


def test_configured_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert configured_runtime_dir() is None  # no file anywhere
    p = toml(tmp_path, '[daemon]\nruntime_dir = "/cr"\n')
    assert configured_runtime_dir(str(p)) == "/cr"
    monkeypatch.setenv("PROFD_CONFIG", str(p))
    assert configured_runtime_dir() == "/cr"
    q = tmp_path / "q.toml"
    q.write_text("[s3]\n")
    assert configured_runtime_dir(str(q)) is None
    q.write_text("daemon = 3\n")
    assert configured_runtime_dir(str(q)) is None
    with pytest.raises(ConfigError, match="config file not found"):
        configured_runtime_dir(str(tmp_path / "missing.toml"))


# --- errors ------------------------------------------------------------------------------------
def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"config file not found: {tmp_path}/nope.toml"):
        load(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="config file not found"):
        load(env={"PROFD_CONFIG": str(tmp_path / "nope.toml")})


def test_bad_toml_names_the_file_and_place(tmp_path: Path) -> None:
    msg = error_of(tmp_path, "[daemon]\nheartbeat_interval 1\n")
    assert msg.startswith(f"config file {tmp_path / 'profd.toml'}: ")
    assert "line 2" in msg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("daemon = 1\n", r"\[daemon\] must be a table"),
        ("s3 = 'x'\n", r"\[s3\] must be a table"),
        ("nsys = []\n", r"\[nsys\] must be a table"),
        ("auto = 'x'\n", r"\[\[auto\]\] must be an array of tables"),
        ("[auto]\nsteps = '3:5'\n", r"\[\[auto\]\] must be an array of tables"),
        ("auto = [1]\n", r"\[\[auto\]\] must be an array of tables"),
        ("[s3]\nbucket = 'x'\n", r"\[s3\]: unknown keys \['bucket'\]"),
        ("[s3]\nzz = 1\naa = 2\n", r"\[s3\]: unknown keys \['aa', 'zz'\]"),
        ("[nsys]\nbinary = 'x'\n", r"\[nsys\]: unknown keys \['binary'\]"),
        (
            "[s3]\nurl = 'http://b/p'\n",
            "s3 url must look like s3://bucket/prefix, got 'http://b/p'",
        ),
        ("[s3]\nurl = 's3://'\n", "s3 url has no bucket: 's3://'"),
        ("[s3]\nurl = 's3:///p'\n", "s3 url has no bucket"),
        ("[daemon]\nmax_spool_bytes = 'lots'\n", "max_spool_bytes: not a size: 'lots'"),
        ("[daemon]\nmax_spool_bytes = '5XB'\n", "max_spool_bytes: not a size"),
        ("[daemon]\nmax_spool_bytes = 'GB'\n", "max_spool_bytes: not a size"),
        ("[daemon]\nmax_spool_bytes = 1.5\n", "max_spool_bytes: not a size"),
        ("[s3]\nmultipart_threshold = '5 parsecs'\n", "s3.multipart_threshold: not a size"),
        ("[s3]\nmax_bandwidth = [1]\n", "s3.max_bandwidth: not a size"),
        ("[daemon]\nmax_spool_bytes = true\n", "max_spool_bytes: not a size: True"),
        ("[daemon]\nmax_spool_bytes = -1\n", "max_spool_bytes: must be at least 0 bytes"),
        ("[daemon]\nmax_spool_bytes = '-5GB'\n", "max_spool_bytes: must be at least 0"),
        ("[daemon]\nmax_spool_bytes = 'infGB'\n", "max_spool_bytes: not a size: 'infGB'"),
        ("[daemon]\nmax_spool_bytes = '1e400B'\n", "max_spool_bytes: not a size"),
        ("[daemon]\nmax_spool_bytes = 'nanMB'\n", "max_spool_bytes: not a size"),
        ("[s3]\nmultipart_chunksize = 0\n", "s3.multipart_chunksize: must be at least 1 bytes"),
        ("[s3]\nmax_bandwidth = '0MB'\n", "s3.max_bandwidth: must be at least 1"),
        # Numbers name their key; a bool, a zero or a wrong type is refused.
        ("[daemon]\nheartbeat_interval = 'fast'\n", "heartbeat_interval: must be a number > 0"),
        ("[daemon]\nheartbeat_interval = 0\n", "heartbeat_interval: must be a number > 0, got 0"),
        ("[daemon]\nheartbeat_interval = -1.5\n", "heartbeat_interval: .*got -1.5"),
        ("[daemon]\nheartbeat_interval = true\n", "heartbeat_interval: .*got True"),
        ("[daemon]\nheartbeat_interval = nan\n", "heartbeat_interval: .*got nan"),
        ("[daemon]\nsample_interval = [1]\n", r"sample_interval: .*got \[1\]"),
        ("[daemon]\npipeline_workers = 'many'\n", "pipeline_workers: must be an integer > 0"),
        ("[daemon]\npipeline_workers = 0\n", "pipeline_workers: must be an integer > 0"),
        ("[daemon]\npipeline_workers = 2.5\n", "pipeline_workers: must be an integer"),
        ("[daemon]\ngroup = 1000\n", "group: must be a string, got 1000"),
        ("[daemon]\nlog_level = 'loud'\n", "log_level: must be one of debug, info, warning,"),
        ("[daemon]\nlog_level = 10\n", "log_level: must be one of"),
        ("[s3]\nurl = 5\n", "s3.url: must be a string, got 5"),
        ("[s3]\nregion = ['a']\n", "s3.region: must be a string"),
        ("[s3]\nworkers = 'two'\n", "s3.workers: must be an integer > 0, got 'two'"),
        ("[s3]\nworkers = 0\n", "s3.workers: must be an integer > 0"),
        ("[s3]\nmax_attempts = 0\n", "s3.max_attempts: must be an integer > 0"),
        ("[s3]\nbackoff_base = '1s'\n", "s3.backoff_base: must be a number >= 0"),
        ("[s3]\nbackoff_max = -1\n", "s3.backoff_max: must be a number >= 0"),
        ("[s3]\nfailed_backoff_max = 0\n", "s3.failed_backoff_max: must be a number > 0"),
        ("[s3]\nchecksum_when_required = 'yes'\n", "s3.checksum_when_required: must be true or"),
        ("[nsys]\npath = 1\n", "nsys.path: must be a string"),
        ("[nsys]\nfinalize_timeout = 'soon'\n", "nsys.finalize_timeout: must be a number > 0"),
        ("[nsys]\ncommand_timeout = 0\n", "nsys.command_timeout: must be a number > 0"),
        ("[watch]\nkeep_history = 0\n", "watch.keep_history: must be a number > 0, got 0"),
        ("[watch]\nkeep_history = '7d'\n", "watch.keep_history: must be a number > 0"),
        ("[watch]\nkeep = 1\n", r"\[watch\]: unknown keys \['keep'\]"),
        ("[watch]\nwindow = 0\n", "watch.window: must be a number > 0, got 0"),
        ("[watch]\nbaseline = -1\n", "watch.baseline: must be a number > 0"),
        ("[watch]\nhold = -1\n", "watch.hold: must be a number >= 0"),
        ("[watch]\nregression = 0\n", "watch.regression: must be a number > 0"),
        ("[watch]\nslow_rank = nan\n", "watch.slow_rank: must be a number > 0, got nan"),
        ("[watch]\ncooldown = '15m'\n", "watch.cooldown: must be a number >= 0"),
        ("[watch]\nstall_after = 0\n", "watch.stall_after: must be a number > 0"),
        ("[watch]\nsample_every = 1.5\n", "watch.sample_every: must be an integer >= 0"),
        ("[watch]\nsample_steps = 0\n", "watch.sample_steps: must be an integer >= 1"),
        ("[watch]\nsample_steps = 10001\n", "watch.sample_steps: at most 10000"),
        ("[watch]\nkeep_samples = 0\n", "watch.keep_samples: must be a number > 0"),
        ("[watch]\nenabled = 'yes'\n", "watch.enabled: must be true or false"),
        ("[watch]\ncapture = 1\n", "watch.capture: must be true or false"),
        ("[watch]\ncapture_ranks = 0\n", "watch.capture_ranks: must be an integer >= 1"),
        ("watch = 1\n", r"\[watch\] must be a table"),
    ],
)
def test_errors_are_one_line_config_errors(tmp_path: Path, text: str, message: str) -> None:
    msg = error_of(tmp_path, text)
    assert re.search(message, msg), msg


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PROFD_MAX_SPOOL_BYTES": "lots"}, "max_spool_bytes: not a size: 'lots'"),
        ({"PROFD_S3_URL": "bucket/prefix"}, "s3 url must look like s3://bucket/prefix"),
        ({"PROFD_NSYS_FINALIZE_TIMEOUT": "soon"}, "nsys.finalize_timeout: must be a number > 0"),
        ({"PROFD_MAX_SPOOL_BYTES": "-1"}, "max_spool_bytes: not a size: '-1'"),
    ],
)
def test_bad_env_values(tmp_path: Path, env: dict[str, str], message: str) -> None:
    assert message in error_of(tmp_path, "", **env)


def test_env_fixes_a_bad_file_value(tmp_path: Path) -> None:
    # The environment wins before the file's value is ever parsed.
    cfg = load(
        toml(tmp_path, "[daemon]\nmax_spool_bytes = 'lots'\n"), env={"PROFD_MAX_SPOOL_BYTES": "1KB"}
    )
    assert cfg.max_spool_bytes == 1024


def test_numbers_accept_numeric_strings_and_ints(tmp_path: Path) -> None:
    cfg = load(
        toml(
            tmp_path,
            "[daemon]\nheartbeat_interval = '0.25'\npipeline_workers = ' 3 '\n"
            "[s3]\nworkers = '4'\nbackoff_base = 0\nbackoff_max = '0.5'\n"
            "[nsys]\ncommand_timeout = 30\n",
        ),
        env={},
    )
    assert (cfg.heartbeat_interval, cfg.pipeline_workers) == (0.25, 3)
    assert (cfg.s3.workers, cfg.s3.backoff_base, cfg.s3.backoff_max) == (4, 0.0, 0.5)
    assert cfg.nsys.command_timeout == 30.0 and isinstance(cfg.nsys.command_timeout, float)


@pytest.mark.parametrize("level", ["debug", "INFO", "Warning", "error"])
def test_log_levels(tmp_path: Path, level: str) -> None:
    assert load(toml(tmp_path, f"[daemon]\nlog_level = '{level}'\n"), env={}).log_level == level


def test_a_directory_as_config_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "conf.d").mkdir()
    with pytest.raises(ConfigError, match=r"config file .*conf\.d: Is a directory"):
        load(tmp_path / "conf.d", env={})


# --- [metrics] ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("listen", "host", "port"),
    [
        ("127.0.0.1:7718", "127.0.0.1", 7718),
        ("0.0.0.0:0", "0.0.0.0", 0),
        ("[::1]:9100", "::1", 9100),
        ("localhost:65535", "localhost", 65535),
    ],
)
def test_metrics_listen(tmp_path: Path, listen: str, host: str, port: int) -> None:
    assert load(env={}).metrics == C.MetricsConfig()  # off unless asked for
    cfg = load(toml(tmp_path, f'[metrics]\nlisten = "{listen}"\n'), env={})
    assert (cfg.metrics.listen, cfg.metrics.host, cfg.metrics.port) == (listen, host, port)
    env = load(toml(tmp_path, ""), env={"PROFD_METRICS_LISTEN": listen}).metrics
    assert (env.host, env.port) == (host, port)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[metrics]\nlisten = "7718"\n', "metrics.listen: must look like HOST:PORT"),
        ('[metrics]\nlisten = ":7718"\n', "metrics.listen: must look like HOST:PORT"),
        ('[metrics]\nlisten = "127.0.0.1:"\n', "metrics.listen: must look like HOST:PORT"),
        ('[metrics]\nlisten = "127.0.0.1:65536"\n', "got '127.0.0.1:65536'"),
        ('[metrics]\nlisten = "127.0.0.1:-1"\n', "metrics.listen: must look like HOST:PORT"),
        ('[metrics]\nlisten = "::1:7718"\n', "metrics.listen: must look like HOST:PORT"),
        ('[metrics]\nlisten = "[]:7718"\n', "metrics.listen: must look like HOST:PORT"),
        ('[metrics]\nlisten = "http://h:1"\n', "metrics.listen: must look like HOST:PORT"),
        ("[metrics]\nlisten = 7718\n", "metrics.listen: must be a string"),
        ("[metrics]\nport = 7718\n", "[metrics]: unknown keys ['port']"),
        ('metrics = "127.0.0.1:1"\n', "[metrics] must be a table"),
    ],
)
def test_bad_metrics_listen(tmp_path: Path, text: str, error: str) -> None:
    assert error in error_of(tmp_path, text)


def test_peer_limits(tmp_path: Path) -> None:
    assert load(env={}).limits == PeerLimits(64, 10.0, 16, 1024)
    text = (
        "[daemon]\nmax_regions_per_rank = 8\nmax_heartbeat_rate = 2\n"
        "max_peers_per_process = 1\nmax_peers_per_user = '3'\n"
    )
    lim = load(toml(tmp_path, text), env={}).limits
    assert lim == PeerLimits(8, 2.0, 1, 3)
    # An honest client sends one heartbeat an interval: twice that is always taken.
    assert (lim.heartbeat_rate(1.0), lim.heartbeat_rate(0.1)) == (2.0, 20.0)
    for key, bad, kind in (
        ("max_regions_per_rank", "0", "an integer"),
        ("max_heartbeat_rate", "-1", "a number"),
        ("max_peers_per_process", "1.5", "an integer"),
        ("max_peers_per_user", "true", "an integer"),
    ):
        msg = error_of(tmp_path, f"[daemon]\n{key} = {bad}\n")
        assert msg.startswith(f"{key}: must be {kind} > 0"), msg
