"""``/metrics``: Prometheus' text format, rendered from the snapshot the event loop publishes.

The loop calls :meth:`MetricsServer.publish` once a tick with a new immutable
:class:`~profd.watch.snapshot.Snapshot`; a scrape runs on the HTTP server's threads and
reads that one reference, so it never touches the loop's state and never waits for it.

The page has two renderings. :class:`SnapshotCollector` is prometheus-client's own model
(metric families, through ``generate_latest``); :func:`render` writes the same bytes about
25 times faster, and it is what the server sends. At 1024 ranks the page holds ~28,000
samples; ``generate_latest`` formats each sample's label set anew (~220 ms for the page),
while :func:`render` formats each rank's labels once (~8 ms). The unit tests hold the two
byte for byte equal.
"""

from __future__ import annotations

import gzip
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.exposition import ThreadingWSGIServer, gzip_accepted
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from profd.watch.kinds import registry as kinds
from profd.watch.snapshot import RankSeries, Snapshot
from profd_client.protocol import STEP_BUCKETS

log = logging.getLogger("profd.metrics")

#: prometheus-client's number format (Go's: ``1e+06`` from a million on), typed.
_go: Final[Callable[[float], str]] = floatToGoString

#: Every family on the page, in page order: (name as exposed, type, help).
FAMILIES: Final = (
    ("profd_attached_processes", "gauge", "Training processes attached to this daemon."),
    ("profd_sessions", "gauge", "Live capture sessions, by state."),
    ("profd_incidents_total", "counter", "Incidents detected since the daemon started, by kind."),
    (
        "profd_upload_queue_bytes",
        "gauge",
        "Bytes of trace files not yet uploaded to S3 (pending, uploading or failed).",
    ),
    (
        "profd_snapshot_age_seconds",
        "gauge",
        "Seconds since the daemon's event loop published the figures on this page.",
    ),
    (
        "profd_step_duration_seconds",
        "histogram",
        "Step times of each attached rank since it attached, as its client measured them.",
    ),
    ("profd_steps_total", "counter", "Steps each attached rank completed."),
    (
        "profd_region_seconds_total",
        "counter",
        "Seconds each attached rank spent inside each profd_client.region().",
    ),
)
#: Incident kinds' labels (docs/design.md, Watch): each is on the page, at 0 until one happens.
INCIDENT_KINDS: Final = kinds.labels()
#: The text format :func:`render` writes (prometheus-client's 0.0.4 output).
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
#: ``le`` of each bucket as prometheus-client spells it, ``+Inf`` last.
LE: Final = (*(_go(b) for b in STEP_BUCKETS), "+Inf")
_HELP: Final = {name: (kind, text) for name, kind, text in FAMILIES}
_RANK_LABELS: Final = ["host", "job", "role", "rank"]


def unique_ranks(snap: Snapshot) -> list[RankSeries]:
    """The snapshot's ranks, one per label set: two processes that claim one host, job, role
    and rank (a restarted rank whose old process has not been dropped yet) would be two
    series with the same labels, which Prometheus refuses; the later one in the snapshot is
    the newer attach, and wins."""
    by: dict[tuple[str, str, str, int], RankSeries] = {}
    for r in snap.ranks:
        by[(r.host, r.job, r.role, r.rank)] = r
    return list(by.values())


def incident_counts(snap: Snapshot) -> list[tuple[str, int]]:
    """Every known kind (0 when absent), then any other kind the snapshot names."""
    counts = dict.fromkeys(INCIDENT_KINDS, 0)
    counts.update(snap.incidents)
    return list(counts.items())


def _has_histogram(r: RankSeries) -> bool:
    # A protocol-2 client sends no ledger: its steps are counted, not timed.
    return len(r.buckets) == len(LE)


# --- the reference: prometheus-client's model --------------------------------------------------
class SnapshotCollector:
    """A prometheus-client ``Collector`` over whatever ``latest()`` returns now."""

    def __init__(self, latest: Callable[[], Snapshot | None], clock: Callable[[], float]) -> None:
        self._latest = latest
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        snap = self._latest()
        if snap is None:
            return
        now = self._clock()
        yield GaugeMetricFamily(
            "profd_attached_processes", _doc("profd_attached_processes"), snap.attached
        )
        sessions = GaugeMetricFamily("profd_sessions", _doc("profd_sessions"), labels=["state"])
        for state, n in snap.sessions:
            sessions.add_metric([state], n)
        yield sessions
        incidents = CounterMetricFamily(
            "profd_incidents_total", _doc("profd_incidents_total"), labels=["kind"]
        )
        for kind, n in incident_counts(snap):
            incidents.add_metric([kind], n)
        yield incidents
        yield GaugeMetricFamily(
            "profd_upload_queue_bytes", _doc("profd_upload_queue_bytes"), snap.upload_queue_bytes
        )
        yield GaugeMetricFamily(
            "profd_snapshot_age_seconds", _doc("profd_snapshot_age_seconds"), _age(snap, now)
        )
        ranks = unique_ranks(snap)
        hist = HistogramMetricFamily(
            "profd_step_duration_seconds", _doc("profd_step_duration_seconds"), labels=_RANK_LABELS
        )
        steps = CounterMetricFamily(
            "profd_steps_total", _doc("profd_steps_total"), labels=_RANK_LABELS
        )
        regions = CounterMetricFamily(
            "profd_region_seconds_total",
            _doc("profd_region_seconds_total"),
            labels=[*_RANK_LABELS, "region"],
        )
        for r in ranks:
            labels = [r.host, r.job, r.role, str(r.rank)]
            if _has_histogram(r):
                cumulative, acc = [], 0
                for le, n in zip(LE, r.buckets, strict=True):
                    acc += n
                    cumulative.append((le, float(acc)))
                hist.add_metric(labels, cumulative, r.sum_s)
            steps.add_metric(labels, r.steps)
            for name, seconds in r.regions:
                regions.add_metric([*labels, name], seconds)
        yield hist
        yield steps
        yield regions


def _doc(name: str) -> str:
    return _HELP[name][1]


def _age(snap: Snapshot, now: float) -> float:
    return max(0.0, now - snap.at)


# --- the page as served -----------------------------------------------------------------------
def _esc(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return v


def _num(v: float) -> str:
    # floatToGoString's own result for the common case (an integer below 10^6), without
    # its call: most numbers on the page are bucket counts.
    if type(v) is int and 0 <= v < 1_000_000:
        return f"{v}.0"
    return _go(v)


def _head(out: list[str], name: str) -> None:
    kind, text = _HELP[name]
    out.append(f"# HELP {name} {text}\n# TYPE {name} {kind}\n")


def render(snap: Snapshot | None, now: float) -> bytes:
    """The page for ``snap`` at unix time ``now``: exactly what ``generate_latest`` writes
    for :class:`SnapshotCollector` (labels sorted by name, as it sorts them)."""
    if snap is None:
        return b""
    out: list[str] = []
    add = out.append
    _head(out, "profd_attached_processes")
    add(f"profd_attached_processes {_num(snap.attached)}\n")
    _head(out, "profd_sessions")
    for state, n in snap.sessions:
        add(f'profd_sessions{{state="{_esc(state)}"}} {_num(n)}\n')
    _head(out, "profd_incidents_total")
    for kind, n in incident_counts(snap):
        add(f'profd_incidents_total{{kind="{_esc(kind)}"}} {_num(n)}\n')
    _head(out, "profd_upload_queue_bytes")
    add(f"profd_upload_queue_bytes {_num(snap.upload_queue_bytes)}\n")
    _head(out, "profd_snapshot_age_seconds")
    add(f"profd_snapshot_age_seconds {_num(_age(snap, now))}\n")

    ranks = unique_ranks(snap)
    # Sorted label names: host, job, [le,] rank, [region,] role.
    labelled = [
        (
            r,
            f'host="{_esc(r.host)}",job="{_esc(r.job)}"',
            f'rank="{r.rank}"',
            f'role="{_esc(r.role)}"',
        )
        for r in ranks
    ]
    _head(out, "profd_step_duration_seconds")
    for r, hj, rank, role in labelled:
        if not _has_histogram(r):
            continue
        acc = 0
        bucket = f"profd_step_duration_seconds_bucket{{{hj},le="
        tail = f",{rank},{role}}} "
        for le, n in zip(LE, r.buckets, strict=True):
            acc += n
            add(f'{bucket}"{le}"{tail}{_num(acc)}\n')
        plain = f"{{{hj},{rank},{role}}}"
        add(f"profd_step_duration_seconds_count{plain} {_num(acc)}\n")
        add(f"profd_step_duration_seconds_sum{plain} {_num(r.sum_s)}\n")
    _head(out, "profd_steps_total")
    for r, hj, rank, role in labelled:
        add(f"profd_steps_total{{{hj},{rank},{role}}} {_num(r.steps)}\n")
    _head(out, "profd_region_seconds_total")
    for r, hj, rank, role in labelled:
        for name, seconds in r.regions:
            region = f'region="{_esc(name)}"'
            add(f"profd_region_seconds_total{{{hj},{rank},{region},{role}}} {_num(seconds)}\n")
    return "".join(out).encode()


# --- the server -------------------------------------------------------------------------------
class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


#: gzip level of a compressed page: 1 compresses the page's repetitive text 17x in ~5 ms at
#: 1024 ranks, where the default 9 takes ~80 ms for 26x.
GZIP_LEVEL: Final = 1


class MetricsServer:
    """``/metrics`` over HTTP on its own threads; :meth:`publish` is all the loop calls."""

    def __init__(self, host: str, port: int, clock: Callable[[], float]) -> None:
        self.host = host
        self.port = port
        self._clock = clock
        self._snapshot: Snapshot | None = None
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def publish(self, snap: Snapshot) -> None:
        # One reference swap: a scrape in flight keeps rendering the snapshot it took.
        self._snapshot = snap

    def latest(self) -> Snapshot | None:
        return self._snapshot

    def start(self) -> None:
        """Bind and serve; an ``OSError`` in one line when the address cannot be had."""
        where = f"{self.host}:{self.port}"
        try:
            infos = socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            family, _, _, _, sockaddr = infos[0]

            class Server(ThreadingWSGIServer):
                address_family = family

            httpd = make_server(str(sockaddr[0]), self.port, self._app, Server, _Quiet)
        except OSError as exc:
            raise OSError(
                f"metrics.listen: cannot listen on {where}: {exc.strerror or exc}"
            ) from None
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, name="profd-metrics", daemon=True
        )
        self._thread.start()
        log.info("metrics on http://%s/metrics", self.address)

    @property
    def address(self) -> str:
        """``host:port`` as bound (the port the kernel chose for port 0)."""
        if self._httpd is None:
            return f"{self.host}:{self.port}"
        sockname = self._httpd.socket.getsockname()
        host, port = str(sockname[0]), int(sockname[1])
        shown = f"[{host}]" if ":" in host else host
        return f"{shown}:{port}"

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self._httpd = self._thread = None

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"profd serves /metrics\n"]
        body = render(self._snapshot, self._clock())
        headers = [("Content-Type", CONTENT_TYPE)]
        if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
            body = gzip.compress(body, compresslevel=GZIP_LEVEL)
            headers.append(("Content-Encoding", "gzip"))
        headers.append(("Content-Length", str(len(body))))
        start_response("200 OK", headers)
        return [b"" if method == "HEAD" else body]
