"""Secrets in URLs: a ``user:password@`` in ``[s3] endpoint_url`` must not
reach ``profctl status``, ``profctl traces`` (``last_error``), the index or the daemon log.

The end-to-end test runs a real daemon, a real torchrun job and profctl against moto's
standalone server; the unit tests call :mod:`profd.redact` and :func:`profd.store.s3.make_client`
directly (a real boto3 client, stopped just before it would send).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from harness import Daemon, wait_for
from s3fixtures import BUCKET, MotoServer, credentials_env, moto_server

from profd.config import S3Config
from profd.redact import REDACTED, redact_url, strip_userinfo
from profd.store import s3

__all__ = ["moto_server"]  # the fixture, imported so pytest finds it

PASSWORD = "SECRETPW"
USER = "someuser"
PREFIX = "secrets"
URL = f"s3://{BUCKET}/{PREFIX}"
WAIT = 120.0


# --- unit: the redaction itself ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("http://u:pw@host:9000", "http://***@host:9000"),
        ("https://user:p%40ss%2Fw@rgw.internal/base?x=1", "https://***@rgw.internal/base?x=1"),
        ("http://token@host", "http://***@host"),  # a user name alone can be the secret
        ("http://:pw@host", "http://***@host"),
        ("http://u:@host", "http://***@host"),
        ("http://u:p@ss@host:1/k", "http://***@host:1/k"),  # unencoded "@": up to the last one
        ("HTTPS://U:P@HOST", "HTTPS://***@HOST"),
        ("s3+https://u:p@host/b", "s3+https://***@host/b"),
        ("http://u:pw@[::1]:9000/b", "http://***@[::1]:9000/b"),
        ("http://u:pw@[fe80::1%25eth0]/", "http://***@[fe80::1%25eth0]/"),
        (
            'Could not connect to the endpoint URL: "http://u:pw@10.0.0.1:9000/bkt/key"',
            'Could not connect to the endpoint URL: "http://***@10.0.0.1:9000/bkt/key"',
        ),
        (
            "repr 'http://u:pw@h/x' and \"https://a:b@g\"",
            "repr 'http://***@h/x' and \"https://***@g\"",
        ),
        (
            "first http://a:1@h1:1/x then https://b:2@h2/y and ftp://c@h3",
            "first http://***@h1:1/x then https://***@h2/y and ftp://***@h3",
        ),
    ],
)
def test_redact_url_hides_userinfo(text: str, want: str) -> None:
    assert redact_url(text) == want


@pytest.mark.parametrize(
    "text",
    [
        "",
        "http://host:9000",
        "http://[::1]:9000/bucket",
        "s3://bucket/prefix/key@v1",  # "@" in a path is not userinfo
        "https://www.npmjs.com/package/@types/node",
        "http://host/?q=a@b#frag@x",
        "mail bob@example.com about http://host:9000",
        "http://host:9000 (owner root@node1)",
        "no url at all: user:pw@host",  # no scheme: not a URL profd would ever configure
    ],
)
def test_redact_url_leaves_other_text_alone(text: str) -> None:
    assert redact_url(text) == text


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("http://u:pw@host:9000", "http://host:9000"),
        ("http://u:p@ss@host:9000/base/?x#y", "http://host:9000/base/?x#y"),
        ("https://token@host", "https://host"),
        ("http://u:pw@[::1]:9000", "http://[::1]:9000"),
        ("http://[::1]:9000", "http://[::1]:9000"),
        ("http://host:9000/a@b", "http://host:9000/a@b"),
        ("host-without-scheme", "host-without-scheme"),
    ],
)
def test_strip_userinfo(url: str, want: str) -> None:
    assert strip_userinfo(url) == want


def test_describe_redacts_exception_text() -> None:
    exc = ConnectionError(f'Could not connect to "http://{USER}:{PASSWORD}@h:1/b" \n (x)')
    text = s3.describe(exc)
    assert PASSWORD not in text and USER not in text
    assert text == 'ConnectionError: Could not connect to "http://***@h:1/b" (x)'


@pytest.mark.parametrize("name", ["profd.s3", "profd.uploads"])
def test_s3_loggers_redact_message_args_and_traceback(name: str) -> None:
    """The filter is on the loggers the S3 code really logs to, and covers tracebacks."""
    import profd.store.uploads  # noqa: F401  (installs its logger's filter)

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    logger = logging.getLogger(name)
    handler = Keep(logging.DEBUG)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    secret = f"http://{USER}:{PASSWORD}@h:1"
    try:
        logger.debug("endpoint %s", secret)
        logger.warning(f"inline {secret}")
        try:
            raise ValueError(f"Invalid endpoint: {secret}")
        except ValueError:
            logger.exception("client failed")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    text = "\n".join(records)
    assert PASSWORD not in text and USER not in text
    assert text.count(f"http://{REDACTED}@h:1") == 3
    assert "Traceback" in text and "ValueError: Invalid endpoint" in text


class _Sent(Exception):
    """Stops a request at ``before-send``: the URL was built, nothing went out."""


def _request_url(endpoint: str, addressing_style: str) -> str:
    """The URL a real boto3 client from :func:`s3.make_client` would send a PutObject to."""
    cfg = S3Config(
        url="s3://bkt/p",
        endpoint_url=endpoint,
        region="us-east-1",
        addressing_style=addressing_style,
    )
    client = s3.make_client(cfg, probe=True)
    assert USER not in client.meta.endpoint_url and PASSWORD not in client.meta.endpoint_url
    seen: list[str] = []

    def stop(request: Any, **_: Any) -> None:
        seen.append(request.url)
        raise _Sent

    client.meta.events.register("before-send.s3.PutObject", stop)
    with pytest.raises(_Sent):
        client.put_object(Bucket="bkt", Key="k", Body=b"x")
    return seen[0]


def test_client_never_gets_userinfo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k, v in credentials_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    secret = f"http://{USER}:{PASSWORD}@minio.internal:9000"
    assert _request_url(secret, "path") == "http://minio.internal:9000/bkt/k"
    # With the userinfo left in, botocore builds "http://bkt.someuser:SECRETPW@minio..." for
    # virtual-hosted style: the bucket lands in the userinfo and the request loses it.
    assert _request_url(secret, "virtual") == "http://bkt.minio.internal:9000/k"
    assert _request_url(f"http://{USER}:{PASSWORD}@[::1]:9000", "path") == "http://[::1]:9000/bkt/k"


# --- end to end ---------------------------------------------------------------------------------
def _config(endpoint: str) -> str:
    return f"""
[s3]
url = "{URL}"
endpoint_url = "{endpoint}"
region = "us-east-1"
addressing_style = "path"
checksum_when_required = true
backoff_base = 0.2
backoff_max = 1.0
max_attempts = 1000
"""


def _files(d: Daemon) -> list[dict[str, Any]]:
    db = sqlite3.connect(f"file:{d.state_dir / 'index.db'}?mode=ro", uri=True, timeout=30)
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute("SELECT * FROM files")]
    finally:
        db.close()


def _index_bytes(d: Daemon) -> bytes:
    """index.db and its WAL as they are on disk, free pages included."""
    out = b""
    for name in ("index.db", "index.db-wal", "index.db-journal"):
        p = d.state_dir / name
        if p.exists():
            out += p.read_bytes()
    return out


def _leaks(data: str | bytes) -> bool:
    text = data.decode("latin-1") if isinstance(data, bytes) else data
    return PASSWORD in text or USER in text


def test_endpoint_userinfo_never_leaks(
    daemon_factory: Any, torchrun: Any, moto_server: MotoServer
) -> None:
    host = f"127.0.0.1:{moto_server.port}"
    redacted = f"http://{REDACTED}@{host}"
    # Only the fake credentials and the config file: PROFD_S3_ENDPOINT_URL would override it.
    env = {**credentials_env(moto_server.root), "PROFD_S3_ENDPOINT_URL": ""}
    d = daemon_factory(config=_config(f"http://{USER}:{PASSWORD}@{host}"), **env)
    job = torchrun("train.py", nproc=1, daemon=d, STEPS="30000")
    try:
        d.wait_attached(1, timeout=WAIT, min_step=1)

        # The daemon still reaches the store: the userinfo is not part of where it connects.
        first = d.ctl_json("start", "--active", "2", "--wait", timeout=WAIT)
        assert first["state"] == "done", first
        wait_for(
            lambda: (
                [f for f in _files(d) if f["session"] == first["session"]]
                and all(f["upload_state"] == "uploaded" for f in _files(d))
            ),
            WAIT,
            "the first capture uploaded",
            every=0.3,
        )
        assert any(k.startswith(f"{PREFIX}/") for k in moto_server.objects())

        # The store goes away: uploads and the HeadBucket probe fail with errors that name
        # the endpoint URL.
        moto_server.stop()
        second = d.ctl_json("start", "--active", "2", "--wait", timeout=WAIT)
        assert second["state"] == "done", second

        def failed_with_error() -> list[dict[str, Any]] | None:
            rows = [f for f in _files(d) if f["session"] == second["session"]]
            return rows if any(f["last_error"] and f["attempts"] >= 2 for f in rows) else None

        failed = wait_for(failed_with_error, WAIT, "an upload to fail twice", every=0.3)

        def down() -> dict[str, Any] | None:
            st: dict[str, Any] = d.ctl_json("status")
            return st if st["s3"]["reachable"] is False and st["s3"]["error"] else None

        st = wait_for(down, 60, "status to show S3 unreachable")
        status_json = d.ctl("status", "--json").stdout
        status_human = d.ctl("status").stdout
        traces_json = d.ctl("traces", "--json").stdout
        index_live = _index_bytes(d)
    finally:
        job.kill()

    assert d.stop() == 0
    index_stopped = _index_bytes(d)
    log = d.log.read_text(errors="replace")
    leaks = [
        where
        for where, data in (
            ("profctl status --json", status_json),
            ("profctl status", status_human),
            ("profctl traces --json", traces_json),
            ("the index (running daemon)", index_live),
            ("the index (after shutdown)", index_stopped),
            ("the daemon log", log),
        )
        if _leaks(data)
    ]
    assert leaks == [], f"the endpoint's userinfo leaked into {leaks}"

    # Where the endpoint is shown, it is shown redacted; where boto3 names the URL in an
    # error, it names the one it connected to, which never had the userinfo.
    assert st["s3"]["endpoint_url"] == redacted
    assert f"endpoint {redacted}" in log
    assert host in st["s3"]["error"]
    errors = [f["last_error"] for row in json.loads(traces_json) for f in row["files"]]
    assert any(errors) and all(host in e for e in errors if e), errors
    assert any(host in f["last_error"] for f in failed)
    assert "upload of" in log and "failed" in log
