"""``/metrics`` over real HTTP: the server on its own, then a real daemon with real clients
attaching and leaving, every page read whole by prometheus-client's parser."""

from __future__ import annotations

import gzip
import http.client
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import JOBS, Daemon, Job, wait_for
from prometheus_client.parser import text_string_to_metric_families

from profd.daemon.metrics import FAMILIES, INCIDENT_KINDS, MetricsServer, render
from profd.states import LIVE
from profd.store.index import Database, FileRepo, UploadQueueRepo
from profd.watch.snapshot import RankSeries, Snapshot

CONFIG = '[metrics]\nlisten = "127.0.0.1:0"\n'
RANK_LABELS = {"host", "job", "role", "rank"}


def get(url: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def parse(page: bytes) -> dict[str, list[Any]]:
    """Every sample of the page by sample name; the parser reads the whole page or raises."""
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(page.decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


# --- the server on its own ---------------------------------------------------------------------
@pytest.fixture
def server() -> Iterator[MetricsServer]:
    m = MetricsServer("127.0.0.1", 0, time.time)
    m.start()
    try:
        yield m
    finally:
        m.stop()


def series(steps: int) -> RankSeries:
    return RankSeries("h", "j", "r", 0, (1,) * 19, 0.5, steps, (("fwd", 0.25),))


def test_the_server_serves_the_latest_snapshot(server: MetricsServer) -> None:
    url = f"http://{server.address}/metrics"
    assert server.address.startswith("127.0.0.1:") and not server.address.endswith(":0")
    status, headers, body = get(url)
    assert (status, body) == (200, b"")  # nothing published yet: an empty page, not an error
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"

    first = Snapshot(at=time.time(), ranks=(series(5),), attached=1)
    server.publish(first)
    status, headers, body = get(url)
    assert status == 200 and "Content-Encoding" not in headers
    assert [s.value for s in parse(body)["profd_steps_total"]] == [5.0]
    # Compressed when asked, as Prometheus asks; the same page.
    status, headers, zipped = get(url, **{"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip"
    assert parse(gzip.decompress(zipped)).keys() == parse(body).keys()

    server.publish(Snapshot(at=time.time(), ranks=(series(9),), attached=1))
    assert [s.value for s in parse(get(url)[2])["profd_steps_total"]] == [9.0]
    server.publish(Snapshot(at=time.time()))  # the rank left
    assert "profd_steps_total" not in parse(get(url)[2])

    assert get(f"http://{server.address}/")[0] == 200
    assert get(f"http://{server.address}/other")[0] == 404
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/metrics", body=b"x")
    assert conn.getresponse().status == 405
    conn.close()
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("HEAD", "/metrics")
    r = conn.getresponse()
    assert r.status == 200 and r.read() == b"" and int(r.headers["Content-Length"]) > 0
    conn.close()


def test_a_scrape_renders_the_snapshot_it_took(server: MetricsServer) -> None:
    """The page is the snapshot at one tick: published after a scrape began, a newer one
    only shows in the next scrape (and the old one is never mixed into it)."""

    def without_age(page: bytes) -> list[bytes]:
        return [x for x in page.splitlines() if not x.startswith(b"profd_snapshot_age_seconds ")]

    url = f"http://{server.address}/metrics"
    for n in range(50):
        snap = Snapshot(at=time.time(), ranks=(series(n),), attached=1)
        server.publish(snap)
        assert without_age(get(url)[2]) == without_age(render(snap, snap.at))


def test_stop_releases_the_port() -> None:
    m = MetricsServer("127.0.0.1", 0, time.time)
    m.start()
    host, port = m.address.rsplit(":", 1)
    m.stop()
    with socket.socket() as s:
        s.bind((host, int(port)))  # free again: a restarted daemon can have it


def test_a_taken_port_is_a_one_line_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        m = MetricsServer("127.0.0.1", port, time.time)
        with pytest.raises(OSError, match=rf"metrics.listen: cannot listen on 127.0.0.1:{port}: "):
            m.start()


# --- a real daemon -----------------------------------------------------------------------------
def spawn_rank(d: Daemon, log: Path, job: str, role: str, rank: int) -> Job:
    """``tests/jobs/lone.py``: a real client process stepping every 50 ms."""
    env = d.env()
    for name in [n for n in env if n.startswith(("SLURM_", "TORCHELASTIC_"))]:
        env.pop(name)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(
        PROFD_JOB=job,
        PROFD_ROLE=role,
        PROFD_RANK=str(rank),
        PROFD_WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return Job.spawn([sys.executable, str(JOBS / "lone.py")], env, log)


def scraper(d: Daemon) -> Callable[[], dict[str, list[Any]]]:
    listen = d.ctl_json("status")["metrics"]["listen"]
    host, port = listen.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0  # the port the kernel chose, not 0

    def scrape() -> dict[str, list[Any]]:
        status, headers, body = get(f"http://{listen}/metrics", **{"Accept-Encoding": "gzip"})
        assert status == 200, status
        if headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        return parse(body)

    return scrape


def ranks_of(page: dict[str, list[Any]]) -> dict[tuple[str, str, str, str], float]:
    out = {}
    for s in page.get("profd_steps_total", []):
        assert set(s.labels) == RANK_LABELS, s.labels
        out[(s.labels["host"], s.labels["job"], s.labels["role"], s.labels["rank"])] = s.value
    return out


def check_histograms(page: dict[str, list[Any]]) -> None:
    """Every rank (each sends a step ledger) has a histogram beside its step counter, and
    its ``+Inf`` bucket is its count."""
    steps = {tuple(sorted(s.labels.items())) for s in page.get("profd_steps_total", [])}
    inf = {
        tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")): s.value
        for s in page.get("profd_step_duration_seconds_bucket", [])
        if s.labels["le"] == "+Inf"
    }
    counts = {
        tuple(sorted(s.labels.items())): s.value
        for s in page.get("profd_step_duration_seconds_count", [])
    }
    assert inf == counts and set(counts) == steps, (counts, steps)


def test_a_real_daemon_serves_every_rank_and_drops_those_that_leave(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    d = daemon_factory(CONFIG)
    scrape = scraper(d)

    page = scrape()
    names = {n for n, _, _ in FAMILIES}
    assert {"profd_attached_processes", "profd_snapshot_age_seconds"} <= page.keys()
    assert [s.value for s in page["profd_attached_processes"]] == [0.0]
    assert [s.value for s in page["profd_upload_queue_bytes"]] == [0.0]
    assert {s.labels["state"]: s.value for s in page["profd_sessions"]} == dict.fromkeys(LIVE, 0.0)
    assert {s.labels["kind"]: s.value for s in page["profd_incidents_total"]} == dict.fromkeys(
        INCIDENT_KINDS, 0.0
    )
    assert "profd_steps_total" in names and "profd_steps_total" not in page  # no rank yet

    ranks = {
        ("trainer", 0): spawn_rank(d, tmp_path / "t0.log", "mjob", "trainer", 0),
        ("trainer", 1): spawn_rank(d, tmp_path / "t1.log", "mjob", "trainer", 1),
        ("rollout", 0): spawn_rank(d, tmp_path / "r0.log", "mjob", "rollout", 0),
    }
    try:
        host = d.wait_attached(3, min_step=1)[0]["host"]
        want = {(host, "mjob", role, str(rank)) for role, rank in ranks}

        def stepping() -> dict[str, list[Any]] | None:
            p = scrape()
            seen = ranks_of(p)
            return p if set(seen) == want and all(v > 0 for v in seen.values()) else None

        page = wait_for(stepping, 30, "three ranks' step counters on /metrics")
        assert [s.value for s in page["profd_attached_processes"]] == [3.0]
        check_histograms(page)
        # Counters only go up while a rank lives.
        before = ranks_of(page)

        def moved_on() -> dict[tuple[str, str, str, str], float] | None:
            now = ranks_of(scrape())
            return now if all(now.get(k, 0) > v for k, v in before.items()) else None

        later = wait_for(moved_on, 30, "step counters to move on")
        assert set(later) == want

        # One leaves with a bye (SIGINT: atexit detaches), one is killed (no bye at all).
        ranks[("trainer", 1)].proc.send_signal(signal.SIGINT)
        ranks[("rollout", 0)].kill()
        left = {(host, "mjob", "trainer", "1"), (host, "mjob", "rollout", "0")}

        def gone() -> dict[str, list[Any]] | None:
            p = scrape()
            return p if set(ranks_of(p)) == want - left else None

        page = wait_for(gone, 30, "the ranks that left to disappear from /metrics")
        assert [s.value for s in page["profd_attached_processes"]] == [1.0]
        check_histograms(page)
    finally:
        for job in ranks.values():
            job.kill()
    assert d.stop() == 0
    with pytest.raises(urllib.error.URLError):
        scrape()  # the port closed with the daemon


def test_a_daemon_refuses_to_start_on_a_taken_port(daemon_factory: Callable[..., Daemon]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        d = daemon_factory(f'[metrics]\nlisten = "127.0.0.1:{port}"\n', start=False)
        d.launch()
        assert d.proc is not None
        assert d.proc.wait(30) == 1
    lines = d.log.read_text().strip().splitlines()
    assert (
        lines[-1]
        == f"profd: metrics.listen: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


def test_status_says_null_without_metrics(daemon: Daemon) -> None:
    assert daemon.ctl_json("status")["metrics"] is None


def test_upload_queue_bytes_is_what_status_counts(tmp_path: Path) -> None:
    """The loop's cheap query for ``profd_upload_queue_bytes`` agrees with ``status``'."""
    db = Database(tmp_path / "index.db")
    idx, files = UploadQueueRepo(db), FileRepo(db)
    try:

        def add(name: str, size: int, state: str) -> None:
            files.add_file(
                {"session": "s", "job": "j", "kind": "trace", "path": f"/spool/{name}",
                 "rel": name, "bytes": size, "upload_state": state}
            )  # fmt: skip

        assert idx.queue_bytes() == 0 == idx.queue_stats()["bytes_pending"]
        for i, state in enumerate(("pending", "pending", "local", "pending", "pending")):
            add(f"f{i}", 10**i, state)
        assert idx.queue_bytes() == 1 + 10 + 1000 + 10000
        first = idx.claim_upload(time.time())  # uploading: still queued
        assert first is not None
        second = idx.claim_upload(time.time())
        assert second is not None
        idx.upload_done(second["id"], "s3://b/f1")  # uploaded: no longer
        third = idx.claim_upload(time.time())
        assert third is not None
        idx.upload_retry(third["id"], "boom", 0, give_up=True)  # failed: still queued
        last = idx.claim_upload(time.time())
        assert last is not None
        files.mark_deleted(last["id"])  # deleted: gone
        assert idx.queue_bytes() == idx.queue_stats()["bytes_pending"] == 1 + 1000
    finally:
        db.close()
