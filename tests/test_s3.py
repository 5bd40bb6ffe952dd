"""S3 uploads, pull and listing against moto's standalone server over HTTP.

Real daemon, real torchrun jobs, real profctl; the only stand-in is the S3 server itself.
No assertion depends on how fast anything runs: waits have generous timeouts, and the one
test that must interrupt an upload makes it slow with ``max_bandwidth`` and then checks that
it really was interrupted.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sqlite3
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from harness import BIN, Daemon, Daemons, Jobs, wait_for
from rawpeer import TracePeer, small_trace
from s3fixtures import ACCESS_KEY, BUCKET, REGION, SECRET_KEY, MotoServer, moto_server

__all__ = ["moto_server"]  # the fixture, imported so pytest finds it

PREFIX = "cluster-a/profiles"
URL = f"s3://{BUCKET}/{PREFIX}"
WAIT = 120.0
MB = 1 << 20
#: Long enough for any test, finite so a job that escapes ``reap`` still ends (~10 min).
LONG_JOB_STEPS = "30000"


@pytest.fixture
def reap() -> Iterator[list[int]]:
    """Worker pids to kill at the end. torchrun's workers run in their own sessions, so
    killing torchrun's process group leaves them running; these jobs never end by
    themselves, because a test needs them alive across daemon restarts."""
    pids: list[int] = []
    yield pids
    kill_workers(pids)


def kill_workers(pids: list[int]) -> None:
    """Kill those of ``pids`` that are still test job workers (a pid may have been reused)."""
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"tests/jobs/" in cmd:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def attached(d: Daemon, n: int, reap: list[int], min_step: int = 1) -> None:
    rows = d.wait_attached(n, timeout=WAIT, min_step=min_step)
    reap.extend(r["pid"] for r in rows)


def s3_config(
    extra: str = "", max_attempts: int = 1000, backoff_base: float = 0.2, backoff_max: float = 2.0
) -> str:
    return f"""
[s3]
url = "{URL}"
region = "us-east-1"
addressing_style = "path"
checksum_when_required = true
backoff_base = {backoff_base}
backoff_max = {backoff_max}
max_attempts = {max_attempts}
{extra}
"""


# --- helpers -----------------------------------------------------------------------------------
def capture(d: Daemon, *args: str) -> dict[str, Any]:
    res: dict[str, Any] = d.ctl_json("start", "--active", "2", *args, "--wait", timeout=WAIT)
    assert res["state"] == "done", res
    return res


def traces(d: Daemon, sid: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = d.ctl_json("traces", "--session", sid)
    return rows


def files_of(d: Daemon, sid: str) -> list[dict[str, Any]]:
    """Every file row of a session in the index, session.json included."""
    db = sqlite3.connect(f"file:{d.state_dir / 'index.db'}?mode=ro", uri=True, timeout=30)
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute("SELECT * FROM files WHERE session = ?", (sid,))]
    finally:
        db.close()


def wait_uploaded(d: Daemon, sid: str, timeout: float = WAIT) -> list[dict[str, Any]]:
    def done() -> list[dict[str, Any]] | None:
        rows = files_of(d, sid)
        kinds = {r["kind"] for r in rows}
        ok = "session" in kinds and all(r["upload_state"] == "uploaded" for r in rows)
        return rows if ok else None

    rows: list[dict[str, Any]] = wait_for(done, timeout, f"session {sid} uploaded", every=0.3)
    return rows


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def status(d: Daemon) -> dict[str, Any]:
    st: dict[str, Any] = d.ctl_json("status")
    return st


def assert_no_credentials(text: str, *keys: tuple[str, str]) -> None:
    assert ACCESS_KEY not in text
    assert SECRET_KEY not in text
    assert SECRET_KEY.split("/")[1] not in text
    for key_id, secret in keys:
        assert key_id not in text and secret not in text


def s3_status(d: Daemon, health: str) -> dict[str, Any]:
    """``profctl status --json`` once ``s3.health`` is ``health``."""

    def seen() -> dict[str, Any] | None:
        st = status(d)
        return st if st["s3"]["health"] == health else None

    st: dict[str, Any] = wait_for(seen, WAIT, f"status to show S3 {health}", every=0.3)
    return st


def trace_files(d: Daemon, sid: str, state: str, min_attempts: int = 1) -> list[dict[str, Any]]:
    """The session's files other than session.json, once all are in ``state`` with at least
    ``min_attempts`` tries each."""

    def seen() -> list[dict[str, Any]] | None:
        rows = [f for f in files_of(d, sid) if f["kind"] != "session"]
        ok = all(f["upload_state"] == state and f["attempts"] >= min_attempts for f in rows)
        return rows if rows and ok else None

    what = f"session {sid}'s files {state} after {min_attempts}+ tries"
    rows: list[dict[str, Any]] = wait_for(seen, WAIT, what, every=0.3)
    return rows


# --- moto's IAM: credentials it refuses, and a user that may HeadBucket but not PutObject ---
Keys = tuple[str, str]


def iam(srv: MotoServer, keys: Keys = (ACCESS_KEY, SECRET_KEY)) -> Any:
    import boto3

    session = boto3.session.Session(
        aws_access_key_id=keys[0], aws_secret_access_key=keys[1], region_name=REGION
    )
    return session.client("iam", endpoint_url=srv.endpoint)


def allow(
    srv: MotoServer, user: str, actions: list[str], keys: Keys = (ACCESS_KEY, SECRET_KEY)
) -> None:
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}],
    }
    iam(srv, keys).put_user_policy(
        UserName=user, PolicyName="profd-test", PolicyDocument=json.dumps(policy)
    )


def iam_user(srv: MotoServer, name: str, actions: list[str]) -> Keys:
    """A user allowed ``actions``, and its access key (made before :func:`auth_on`)."""
    iam(srv).create_user(UserName=name)
    allow(srv, name, actions)
    key = iam(srv).create_access_key(UserName=name)["AccessKey"]
    return key["AccessKeyId"], key["SecretAccessKey"]


def auth_on(srv: MotoServer) -> None:
    """From now on moto checks every request against its IAM users: the fixture's own key,
    which no user has, is refused (InvalidAccessKeyId). A restart turns it off again."""
    req = urllib.request.Request(
        srv.endpoint + "/moto-api/reset-auth",
        data=b"0",
        method="POST",
        headers={"Content-Type": "text/plain"},  # moto reads the raw body, not a form
    )
    urllib.request.urlopen(req, timeout=30).close()


def s3_as(srv: MotoServer, keys: Keys) -> Any:
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(
        aws_access_key_id=keys[0], aws_secret_access_key=keys[1], region_name=REGION
    )
    return session.client(
        "s3", endpoint_url=srv.endpoint, config=Config(s3={"addressing_style": "path"})
    )


# --- tests -------------------------------------------------------------------------------------
def test_capture_lands_in_s3_and_pulls_back(
    daemon_factory: Any, torchrun: Any, moto_server: MotoServer, tmp_path: Path, reap: list[int]
) -> None:
    d = daemon_factory(config=s3_config(), **moto_server.env())
    torchrun("train.py", nproc=2, daemon=d, STEPS=LONG_JOB_STEPS)
    attached(d, 2, reap)
    res = capture(d)
    sid, job = res["session"], res["job"]
    files = wait_uploaded(d, sid)

    # Keys mirror the spool, session.json included, and every object is the spool's file.
    session_dir = d.spool / job / sid
    local = tree(session_dir)
    assert "session.json" in local
    assert {"c0/main-r0.pt.trace.json.gz", "c0/main-r1.pt.trace.json.gz"} <= set(local)
    objects = moto_server.objects(f"{PREFIX}/{job}/{sid}/")
    assert set(objects) == {f"{PREFIX}/{job}/{sid}/{rel}" for rel in local}
    for rel, data in local.items():
        assert moto_server.get(f"{PREFIX}/{job}/{sid}/{rel}") == data
    by_kind = {f["kind"] for f in files}
    assert {"trace", "session"} <= by_kind
    manifest = next(f for f in files if f["kind"] == "session")
    # session.json is uploaded last: its presence means the session is complete in S3.
    assert manifest["uploaded_at"] >= max(f["uploaded_at"] for f in files)

    rows = traces(d, sid)
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        assert r["upload_state"] == "uploaded"
        assert r["s3_uri"] == f"{URL}/{job}/{sid}/c0/main-r{r['rank']}.pt.trace.json.gz"
        for f in r["files"]:
            assert f["upload_state"] == "uploaded"
            assert f["s3_uri"].startswith(f"{URL}/{job}/{sid}/c0/main-r{r['rank']}.")

    st = status(d)
    assert st["s3"]["configured"] is True
    assert st["s3"]["url"] == URL
    assert st["queue"]["queued"] == 0 and st["queue"]["failed"] == 0
    wait_for(lambda: status(d)["s3"]["reachable"] is True, 60, "S3 reachable in status")
    human = d.ctl("status")
    assert human.returncode == 0 and f"{URL}  reachable" in human.stdout

    # pull from the spool, then from S3 once the local copy is gone.
    out = tmp_path / "pull-spool"
    doc = d.ctl_json("pull", sid, "-o", str(out))
    assert doc["from_spool"] == len(local) and doc["from_s3"] == 0
    assert tree(out / sid) == local
    shutil.rmtree(session_dir)
    out = tmp_path / "pull-s3"
    doc = d.ctl_json("pull", sid[:12], "-o", str(out))
    assert doc["from_s3"] == len(local) and doc["session"] == sid
    assert tree(out / sid) == local
    r = d.ctl("pull", sid, "-o", str(tmp_path / "pull-human"))  # progress bar on stderr
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path / "pull-human" / sid) == local

    # With no daemon at all: list and pull straight from the S3 manifests.
    daemon_rows = {r["rank"]: r for r in rows}
    d.stop()
    listed = d.ctl_json("traces", "--s3", URL)
    assert sorted(r["rank"] for r in listed) == [0, 1]
    for r in listed:
        want = daemon_rows[r["rank"]]
        for k in ("session", "job", "host", "pid", "role", "cycle", "steps", "bytes", "s3_uri"):
            assert r[k] == want[k], k
        assert r["upload_state"] == "uploaded"
        assert {f["s3_uri"] for f in r["files"]} == {f["s3_uri"] for f in want["files"]}
    assert d.ctl_json("traces", "--s3", URL, "--rank", "1")[0]["rank"] == 1
    assert d.ctl_json("traces", "--s3", URL, "--job", "no-such-job") == []
    out = tmp_path / "pull-direct"
    doc = d.ctl_json("pull", sid, "-o", str(out), "--s3", URL)
    assert doc["from_s3"] == len(local)
    assert tree(out / sid) == local
    r = d.ctl("pull", "20000101-000000-000000", "--s3", URL)
    assert r.returncode != 0 and "not found" in r.stderr

    # Credentials never show up in what the daemon says or logs.
    assert_no_credentials(json.dumps(st))
    assert_no_credentials(d.log.read_text(errors="replace"))


# --- an outage, then the spool quota ---------------------------------------------------------
# One daemon, S3 server and 2-rank job go through an outage and three spool quotas; each test
# checks one behaviour on the way. They share the module's setup (one xdist group, so one
# worker runs them in file order), and each asks the story for the phases it needs: a phase
# runs once, the first time a test needs it, so any test also runs alone (-k).
ON_STORY = pytest.mark.xdist_group("s3_outage_story")


class Story:
    """The shared daemon ``d`` (S3 ``srv``), with sessions ``a`` and ``b`` uploaded."""

    def __init__(self, d: Daemon, srv: MotoServer, a: str, b: str) -> None:
        self.d, self.srv, self.a, self.b = d, srv, a, b
        self._done: dict[str, Any] = {}

    def _once(self, phase: str, run: Callable[[], Any]) -> Any:
        if phase not in self._done:
            self._done[phase] = run()
        return self._done[phase]

    def files(self, sid: str) -> list[dict[str, Any]]:
        return files_of(self.d, sid)

    def on_disk(self, sid: str) -> list[bool]:
        return [Path(f["path"]).is_file() for f in self.files(sid)]

    def size(self, sid: str) -> int:
        return sum(f["bytes"] for f in self.files(sid))

    def outage(self) -> str:
        """S3 stops; a capture is made while it is down: its session id (S3 stays down)."""

        def run() -> str:
            self.srv.stop()
            return str(capture(self.d)["session"])

        return str(self._once("outage", run))

    def recovered(self) -> str:
        """S3 back after :meth:`outage`, its capture uploaded: that capture's session id."""

        def run() -> str:
            c = self.outage()
            self.srv.start()  # empty again: the fixture recreates the bucket
            wait_uploaded(self.d, c)
            return c

        return str(self._once("recovered", run))

    def quota_but_oldest(self) -> str:
        """Another outage leaves session ``e`` un-uploaded; the daemon restarts with room for
        everything but the oldest uploaded session, giving a file up after one try with its
        next try by backoff 750 s or more away: ``e``'s id (S3 stays down)."""

        def run() -> str:
            c = self.recovered()
            self.srv.stop()
            e = str(capture(self.d)["session"])
            assert all(f["upload_state"] != "uploaded" for f in self.files(e))
            d = self.d
            assert d.config is not None
            d.stop()
            d.config.write_text(s3_config(max_attempts=1, backoff_base=1000, backoff_max=1000))
            quota = self.size(self.b) + self.size(c) + self.size(e)
            d.extra_env["PROFD_MAX_SPOOL_BYTES"] = str(quota)
            d.start()
            return e

        return str(self._once("quota_but_oldest", run))

    def e_failed(self, before: dict[int, float]) -> list[dict[str, Any]] | None:
        """``e``'s trace files, once every one has failed with a retry time other than
        ``before``'s (id -> next_attempt_at): a new retry time can only come from a new try."""
        rows = [f for f in self.files(self.quota_but_oldest()) if f["kind"] != "session"]
        ok = all(
            f["upload_state"] == "failed" and f["next_attempt_at"] != before.get(f["id"])
            for f in rows
        )
        return rows if rows and ok else None

    def quota_below_unuploaded(self) -> str:
        """The daemon restarts with a quota of half of ``e`` (not uploaded), retrying its
        uploads until S3 is back: ``e``'s id (S3 stays down)."""

        def run() -> str:
            e = self.quota_but_oldest()
            wait_for(lambda: self.e_failed({}), WAIT, "e's uploads failed for good")
            d = self.d
            assert d.config is not None
            d.stop()
            d.config.write_text(s3_config())
            d.extra_env["PROFD_MAX_SPOOL_BYTES"] = str(self.size(e) // 2)
            d.start()
            d.wait_attached(2, timeout=WAIT)
            return e

        return str(self._once("quota_below_unuploaded", run))


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    root = tmp_path_factory.mktemp("s3-story")
    (root / "moto").mkdir()
    srv = MotoServer(root / "moto").start()
    daemons, jobs = Daemons(root), Jobs(root)
    pids: list[int] = []
    try:
        d = daemons.make(config=s3_config(), **srv.env())
        jobs.start("train.py", nproc=2, daemon=d, STEPS=LONG_JOB_STEPS)
        # Ten steps in: each rank's rate is measured, so the plan's first step leaves room
        # for a loaded machine (at step 1 a rank once passed it before its arm arrived).
        attached(d, 2, pids, min_step=10)
        sids = []
        for _ in range(2):
            sids.append(capture(d)["session"])
            wait_uploaded(d, sids[-1])
        yield Story(d, srv, *sids)
    finally:
        kill_workers(pids)
        jobs.kill_all()
        daemons.stop_all()
        srv.stop()


@ON_STORY
def test_an_outage_shows_in_status_without_credentials(story: Story) -> None:
    c = story.outage()
    st = wait_for(
        lambda: (lambda s: s if s["s3"]["reachable"] is False else None)(status(story.d)),
        60,
        "status to show S3 unreachable",
    )
    assert st["s3"]["error"]
    assert st["queue"]["bytes_pending"] > 0
    assert_no_credentials(json.dumps(st))
    c_files = story.files(c)
    assert c_files and all(f["upload_state"] != "uploaded" for f in c_files)


@ON_STORY
def test_files_whose_uploads_keep_failing_stay_on_disk(story: Story) -> None:
    c = story.outage()  # S3 is down until the next test brings it back
    trace_files(story.d, c, "pending", min_attempts=3)
    assert all(story.on_disk(c)), "deleted while pending"


@ON_STORY
def test_a_capture_made_during_an_outage_uploads_once_s3_is_back(story: Story) -> None:
    c = story.recovered()
    for f in story.files(c):
        assert Path(f["path"]).is_file()
        assert story.srv.get(f"{PREFIX}/{f['rel']}") == Path(f["path"]).read_bytes()
    wait_for(lambda: status(story.d)["s3"]["reachable"] is True, 60, "S3 reachable again")


@ON_STORY
def test_over_the_quota_the_oldest_uploaded_session_is_pruned_first(story: Story) -> None:
    e = story.quota_but_oldest()
    a, b, c = story.a, story.b, story.recovered()
    wait_for(lambda: not any(story.on_disk(a)), 60, "oldest uploaded session pruned")
    assert all(f["deleted"] == 1 for f in story.files(a))
    assert all(story.on_disk(b)) and all(story.on_disk(c)) and all(story.on_disk(e))


@ON_STORY
def test_failed_uploads_wait_for_backoff_and_session_json_for_its_session(story: Story) -> None:
    e = story.quota_but_oldest()
    failed = wait_for(lambda: story.e_failed({}), WAIT, "e's uploads failed for good")
    # session.json waits for the rest of its session, so it is pending, not failed.
    manifest = [f for f in story.files(e) if f["kind"] == "session"]
    assert len(manifest) == 1 and manifest[0]["upload_state"] == "pending"
    assert status(story.d)["queue"]["failed"] == len(failed)
    assert all(f["next_attempt_at"] > time.time() + WAIT for f in failed)


@ON_STORY
def test_retry_by_short_id_requeues_exactly_that_sessions_failed_files(story: Story) -> None:
    e = story.quota_but_oldest()
    failed = wait_for(lambda: story.e_failed({}), WAIT, "e's uploads failed for good")
    before = {f["id"]: f["next_attempt_at"] for f in failed}
    assert story.d.ctl_json("retry", e[:-2])["requeued"] == len(failed)
    wait_for(lambda: story.e_failed(before), WAIT, "e's requeued uploads tried again")
    # Uploaded (and pruned): nothing to retry.
    assert story.d.ctl_json("retry", story.a)["requeued"] == 0


@ON_STORY
def test_unuploaded_data_over_the_quota_is_kept_and_refuses_captures(story: Story) -> None:
    e = story.quota_below_unuploaded()
    b, c = story.b, story.recovered()
    wait_for(lambda: not any(story.on_disk(b) + story.on_disk(c)), 60, "uploaded sessions pruned")
    r = story.d.ctl("start", "--active", "1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "spool quota full" in r.stderr
    assert all(story.on_disk(e))
    assert status(story.d)["spool"]["bytes_not_uploaded"] == story.size(e)


@ON_STORY
def test_a_pending_session_is_pruned_to_fit_the_quota_once_uploaded(story: Story) -> None:
    e = story.quota_below_unuploaded()
    size = story.size(e)
    story.srv.start()
    wait_uploaded(story.d, e)
    for f in story.files(e):
        assert story.srv.get(f"{PREFIX}/{f['rel']}")

    def e_on_disk() -> int:
        return sum(f["bytes"] for f in story.files(e) if Path(f["path"]).is_file())

    wait_for(lambda: e_on_disk() <= size // 2, 60, "uploaded session pruned to fit the quota")
    assert e_on_disk() > 0  # no more than needed


def test_multipart_upload_survives_sigkill(
    daemon_factory: Any, torchrun: Any, moto_server: MotoServer, reap: list[int]
) -> None:
    part = 5 * MB
    multipart = 'multipart_threshold = "5MB"\nmultipart_chunksize = "5MB"\nworkers = 1\n'
    d = daemon_factory(config=s3_config(multipart + 'max_bandwidth = "2MB"'), **moto_server.env())
    torchrun("bigtrace.py", nproc=1, daemon=d, BIG_EVENTS="6000", STEP_SLEEP="0.1", STEPS="5000")
    attached(d, 1, reap, min_step=3)
    res = d.ctl_json("start", "--active", "3", "--wait", timeout=WAIT)
    assert res["state"] == "done", res
    sid, job = res["session"], res["job"]
    trace = next(f for f in files_of(d, sid) if f["kind"] == "trace")
    data = Path(trace["path"]).read_bytes()
    assert len(data) > 2 * part  # at least three parts
    key = f"{PREFIX}/{trace['rel']}"
    assert key == f"{PREFIX}/{job}/{sid}/c0/main-r0.pt.trace.json.gz"
    s3c = moto_server.client()

    def in_flight() -> list[dict[str, Any]]:
        ups = s3c.list_multipart_uploads(Bucket=BUCKET, Prefix=key).get("Uploads", [])
        return [u for u in ups if u["Key"] == key]

    wait_for(in_flight, WAIT, "the multipart upload to start", every=0.05)
    time.sleep(1.0)
    assert key not in moto_server.objects(), "upload finished before the kill: raise the size"
    d.kill9()
    assert key not in moto_server.objects(), "a killed upload left an object"
    assert next(f for f in files_of(d, sid) if f["id"] == trace["id"])["upload_state"] == (
        "uploading"
    )

    d.config.write_text(s3_config(multipart))  # full speed after the restart
    d.start()
    wait_uploaded(d, sid)
    head = s3c.head_object(Bucket=BUCKET, Key=key)
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith(f"-{math.ceil(len(data) / part)}")
    assert moto_server.get(key) == data
    assert in_flight() == [], "the killed daemon's multipart upload was not aborted"
    rows = [f for f in files_of(d, sid) if f["rel"] == trace["rel"]]
    assert len(rows) == 1 and rows[0]["upload_state"] == "uploaded"
    assert rows[0]["s3_uri"] == f"s3://{BUCKET}/{key}"
    assert rows[0]["attempts"] >= 2
    log = d.log.read_text(errors="replace")
    assert f"uploaded {key} ({len(data)} bytes, verified size+etag)" in log
    assert traces(d, sid)[0]["upload_state"] == "uploaded"


def test_stale_multipart_uploads_of_this_node_are_aborted_at_start(
    daemon_factory: Any, moto_server: MotoServer, ctx: zmq.Context
) -> None:
    """An incomplete multipart upload an earlier daemon left (a network cut made its abort
    fail, the file uploaded later, then the daemon was killed) holds storage for ever. The
    next daemon aborts it, but never one of a key that is not its own: other nodes share the
    bucket and prefix, and their uploads may be in flight."""
    d = daemon_factory(config=s3_config(), **moto_server.env())
    peer = TracePeer(ctx, d, "mp")
    sid, _ = peer.capture(small_trace)
    peer.sock.close(0)
    trace = next(f for f in wait_uploaded(d, sid) if f["kind"] == "trace")
    ours = f"{PREFIX}/{trace['rel']}"
    assert ours.endswith("/c0/r-r0.pt.trace.json.gz"), ours
    # Another node's rank in the same session directory, and a key ours is a prefix of.
    theirs = [ours.replace("/r-r0.", "/r-r1."), ours + ".other"]
    s3c = moto_server.client()
    for key in (ours, *theirs):
        s3c.create_multipart_upload(Bucket=BUCKET, Key=key)

    def open_keys() -> list[str]:
        ups = s3c.list_multipart_uploads(Bucket=BUCKET, Prefix=PREFIX).get("Uploads", [])
        return sorted(u["Key"] for u in ups)

    assert open_keys() == sorted([ours, *theirs])
    d.kill9()
    d.start()
    wait_for(
        lambda: status(d)["s3"]["stale_multipart_aborted"],
        WAIT,
        "the stale multipart upload to be aborted",
    )
    assert open_keys() == sorted(theirs)
    assert status(d)["s3"]["stale_multipart_aborted"] == 1
    assert moto_server.get(ours) == Path(trace["path"]).read_bytes()  # the object stays
    log = d.log.read_text(errors="replace")
    line = "aborted 1 incomplete multipart upload(s) of this node's files left by an earlier daemon"
    assert log.count(line) == 1, log
    assert "aborted 1 incomplete multipart upload(s)" in d.ctl("status").stdout


def put_manifest(srv: MotoServer, job: str, sid: str, created_at: float) -> None:
    rel = f"{job}/{sid}/c0/main-r0.pt.trace.json.gz"
    doc = {
        "id": sid,
        "job": job,
        "finished_at": created_at,
        "targets": [
            {
                "host": "h",
                "pid": 1,
                "role": "main",
                "rank": 0,
                "world_size": 1,
                "results": [{"path": rel, "cycle": 0, "steps": [3], "created_at": created_at}],
            }
        ],
    }
    key = f"{PREFIX}/{job}/{sid}/session.json"
    srv.client().put_object(Bucket=BUCKET, Key=key, Body=json.dumps(doc).encode())


def s3_traces(srv: MotoServer, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **srv.env(), "PROFD_RUNTIME_DIR": str(tmp_path / "no-daemon")}
    env.pop("PROFD_CONFIG", None)
    return subprocess.run(
        [str(BIN / "profctl"), "--json", "traces", "--s3", URL, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_s3_listing_reads_newest_sessions_first(moto_server: MotoServer, tmp_path: Path) -> None:
    """--limit stops reading manifests once older sessions cannot make the cut."""
    now = time.time()
    fresh = [time.strftime("%Y%m%d-%H%M%S", time.gmtime(now - 60 * i)) for i in range(40)]
    for i, stamp in enumerate(fresh):
        put_manifest(moto_server, f"job{i % 3}", f"{stamp}-{i:06x}", now - 60 * i)
    # A year old by its id, but claiming a trace from just now: only a reader that fetched
    # it would list it, and with --limit 5 nothing that old is fetched.
    put_manifest(moto_server, "job0", "20250101-000000-0000aa", now + 3600)
    # A damaged manifest is skipped with a warning, not fatal to the listing.
    moto_server.client().put_object(
        Bucket=BUCKET, Key=f"{PREFIX}/job1/20250102-000000-0000bb/session.json", Body=b"{"
    )

    r = s3_traces(moto_server, tmp_path, "--limit", "5")
    assert r.returncode == 0, r.stderr
    got = [row["session"] for row in json.loads(r.stdout)]
    assert got == [f"{fresh[i]}-{i:06x}" for i in range(5)]

    r = s3_traces(moto_server, tmp_path, "--limit", "1000")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows[0]["session"] == "20250101-000000-0000aa" and len(rows) == 41
    assert "skipping" in r.stderr and "0000bb/session.json" in r.stderr


def test_outage_longer_than_retry_budget(
    daemon_factory: Any, torchrun: Any, moto_server: MotoServer, reap: list[int]
) -> None:
    """Files that failed for good while S3 was down upload once it is back, with no retry.

    One try each, then ``failed``, with the next try by backoff at least 750 s away: within
    WAIT only the requeue that follows the probe finding the store back can upload them."""
    cfg = s3_config(
        "failed_backoff_max = 3600", max_attempts=1, backoff_base=1000, backoff_max=1000
    )
    d = daemon_factory(config=cfg, **moto_server.env())
    torchrun("train.py", nproc=1, daemon=d, STEPS=LONG_JOB_STEPS)
    attached(d, 1, reap)

    moto_server.stop()
    sid = capture(d)["session"]
    failed = trace_files(d, sid, "failed")
    assert all(f["next_attempt_at"] > time.time() + WAIT for f in failed)
    assert all(f["last_error"] for f in failed)
    st = s3_status(d, "unreachable")
    assert st["queue"]["failed"] == len(failed)
    assert st["s3"]["reachable"] is False and st["s3"]["error"]
    assert st["s3"]["last_upload_error"] and st["s3"]["last_upload_at"] is None
    human = d.ctl("status").stdout
    assert f"{URL}  UNREACHABLE" in human and "last upload error" in human

    moto_server.start()  # empty again: the fixture recreates the bucket
    rows = wait_uploaded(d, sid)
    for f in rows:
        assert moto_server.get(f"{PREFIX}/{f['rel']}") == Path(f["path"]).read_bytes()
        # Requeued with a fresh budget (as profctl retry does), and uploaded at the first try.
        assert f["attempts"] == 1, f
    log = d.log.read_text(errors="replace")
    assert f"S3 answers again: {len(failed)} failed upload(s) requeued" in log
    st = s3_status(d, "ok")
    assert st["queue"]["failed"] == 0 and st["s3"]["last_upload_at"] > time.time() - WAIT
    human = d.ctl("status").stdout
    assert f"{URL}  reachable" in human and "last upload error" not in human
    assert_no_credentials(json.dumps(st) + human + log)


def test_wrong_credentials_are_not_reachable(
    daemon_factory: Any, torchrun: Any, moto_server: MotoServer, reap: list[int]
) -> None:
    """HeadBucket answers (403) with a key the store does not know; every upload fails."""
    auth_on(moto_server)
    cfg = s3_config("failed_backoff_max = 0.5", max_attempts=2)
    d = daemon_factory(config=cfg, **moto_server.env())
    torchrun("train.py", nproc=1, daemon=d, STEPS=LONG_JOB_STEPS)
    attached(d, 1, reap)
    started = time.time()
    sid = capture(d)["session"]

    st = s3_status(d, "uploads_failing")
    s3st = st["s3"]
    assert s3st["reachable"] is True  # all that HeadBucket can tell
    assert "InvalidAccessKeyId" in s3st["last_upload_error"]
    assert s3st["error"] == s3st["last_upload_error"]
    assert s3st["last_upload_error_at"] >= started and s3st["last_upload_at"] is None
    human = d.ctl("status")
    assert human.returncode == 0, human.stderr
    assert f"{URL}  UPLOADS FAILING" in human.stdout, human.stdout
    assert "last upload error" in human.stdout and "InvalidAccessKeyId" in human.stdout
    assert f"{URL}  reachable" not in human.stdout

    # Failed after max_attempts, and still tried: retrying costs little and may yet work.
    trace_files(d, sid, "failed", min_attempts=4)
    assert s3_status(d, "uploads_failing")["queue"]["failed"] > 0
    assert_no_credentials(json.dumps(st) + human.stdout + d.log.read_text(errors="replace"))


def test_denied_uploads_fail_then_upload_once_allowed(
    daemon_factory: Any, torchrun: Any, moto_server: MotoServer, reap: list[int]
) -> None:
    """A role that may HeadBucket but not PutObject: status says uploads fail, and once the
    policy allows them, the failed files upload by their own backoff. The store never went
    away, so no outage requeue (and no profctl retry) is involved."""
    admin = iam_user(moto_server, "admin", ["*"])
    readonly = ["s3:HeadBucket", "s3:ListBucket", "s3:GetObject"]
    uploader = iam_user(moto_server, "uploader", readonly)
    auth_on(moto_server)
    cfg = s3_config("failed_backoff_max = 1", max_attempts=1, backoff_max=1.0)
    creds = {"AWS_ACCESS_KEY_ID": uploader[0], "AWS_SECRET_ACCESS_KEY": uploader[1]}
    d = daemon_factory(config=cfg, **{**moto_server.env(), **creds})
    torchrun("train.py", nproc=1, daemon=d, STEPS=LONG_JOB_STEPS)
    attached(d, 1, reap)
    sid = capture(d)["session"]

    failed = trace_files(d, sid, "failed")
    st = s3_status(d, "uploads_failing")
    assert st["s3"]["reachable"] is True
    assert "AccessDenied" in st["s3"]["last_upload_error"]
    human = d.ctl("status").stdout
    assert f"{URL}  UPLOADS FAILING" in human and "AccessDenied" in human

    allow(moto_server, "uploader", ["s3:*"], keys=admin)
    rows = wait_uploaded(d, sid)
    s3c = s3_as(moto_server, admin)
    for f in rows:
        body = s3c.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{f['rel']}")["Body"].read()
        assert body == Path(f["path"]).read_bytes()
    assert all(f["attempts"] >= 2 for f in rows if f["id"] in {g["id"] for g in failed})
    log = d.log.read_text(errors="replace")
    assert "S3 answers again" not in log
    assert "which had failed before" in log
    st = s3_status(d, "ok")
    assert st["s3"]["last_upload_at"] > st["s3"]["last_upload_error_at"]
    human = d.ctl("status").stdout
    assert f"{URL}  reachable" in human and "last upload error" not in human
    assert_no_credentials(json.dumps(st) + human + log, admin, uploader)
