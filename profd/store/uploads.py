"""The S3 uploader: worker threads draining the ``files`` upload queue in the index.

The queue is rows in SQLite, so every state change survives a crash: a row is ``uploading``
only while a worker holds it, and the next daemon puts such rows back to ``pending``. An
object becomes visible in S3 only when its PutObject or CompleteMultipartUpload succeeds, so
a daemon killed mid-upload leaves no complete-looking object; the retry uploads it again from
the start and aborts the orphaned multipart upload. Once the store answers after a start, the
incomplete multipart uploads an earlier daemon left for this node's files are aborted too,
those of files a later attempt uploaded included (an abort that failed in a network cut).

A file that used up ``max_attempts`` is ``failed`` but not abandoned while its local file
exists: it is retried on the same backoff capped at ``failed_backoff_max``, and at once when
the HeadBucket probe sees the store come back after it was unreachable. Only a file whose local
copy is gone stays failed until ``profctl retry`` or the next start.

Workers never touch the event loop's state; ``status()`` and ``prune()`` are called on the
event loop thread and only read cached values or use their own index connection.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profd.config import Config
from profd.reactor import Reactor
from profd.redact import RedactFilter
from profd.store import layout, s3
from profd.store.index import Database, FileRepo, UploadQueueRepo
from profd.textfmt import human_bytes

log = logging.getLogger("profd.uploads")
# Error text here is already redacted; the filter also covers tracebacks (log.exception).
log.addFilter(RedactFilter())

#: How long an idle worker sleeps when nothing is due and nobody kicks it.
IDLE_WAIT_S = 30.0
#: HeadBucket probe period while S3 answers, and while it does not (or is unknown).
PROBE_OK_S = 15.0
PROBE_DOWN_S = 2.0
STOP_JOIN_S = 5.0


class LocalFileMissing(Exception):
    pass


@dataclass(frozen=True)
class _Conn:
    """A thread's own connection to the index and the repositories the uploader uses."""

    db: Database
    queue: UploadQueueRepo
    files: FileRepo

    @classmethod
    def open(cls, path: Path) -> _Conn:
        db = Database(path)
        return cls(db, UploadQueueRepo(db), FileRepo(db))


class Uploads:
    def __init__(self, cfg: Config, reactor: Reactor) -> None:
        self.cfg = cfg
        self.s3cfg = cfg.s3
        self.bucket, self.prefix = cfg.s3.bucket_prefix()
        self.reactor = reactor
        self.workers = max(1, cfg.s3.workers)
        self.concurrency = 10  # part uploads in flight, shared by all workers
        self._cv = threading.Condition()
        self._gen = 0
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._local = threading.local()
        self._client_lock = threading.Lock()
        self._client_obj: Any = None
        self._manager: Any = None
        self._inflight: set[Any] = set()
        self._prune_lock = threading.Lock()
        self._health_lock = threading.Lock()
        self._reachable: bool | None = None
        self._error: str | None = None
        self._checked_at: float | None = None
        self._cred_source: str | None = None
        #: The last upload that failed (store errors only, not a missing local file), when,
        #: and whether the store answered it; the last upload that succeeded.
        self._upload_error: str | None = None
        self._upload_error_at: float | None = None
        self._upload_error_answered = False
        self._upload_ok_at: float | None = None
        #: Set when the store is found unreachable; the next probe that gets an answer
        #: clears it and requeues what failed in the meantime.
        self._down_seen = False
        self._active = 0
        #: Files a killed daemon was uploading: their multipart uploads may still be open.
        self._interrupted: set[int] = set()
        #: Set at start: multipart uploads initiated before it are no transfer of this daemon.
        self._started_at = time.time()
        #: Keys a worker is uploading now, which the start-up sweep leaves alone whatever the
        #: store's clock says. Guarded by ``_client_lock``.
        self._busy_keys: set[str] = set()
        #: The start-up sweep of stale multipart uploads is done (or cannot be done).
        self._swept = False
        self._stale_aborted = 0  # stale multipart uploads aborted since start
        self._hasher = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.workers, thread_name_prefix="profd-hash"
        )
        s3.quiet_sdk_logs()

    # --- lifecycle (event loop thread) ---------------------------------------------------------
    def start(self) -> None:
        self._started_at = time.time()
        queue = self._conn().queue
        self._interrupted = {r["id"] for r in queue.uploading()}
        n = queue.requeue(include_failed=True)
        if n:
            log.info("requeued %d upload(s) left unfinished or failed by an earlier run", n)
        endpoint = s3.shown_endpoint(self.s3cfg.endpoint_url)
        log.info(
            "uploading to %s (endpoint %s, %d worker(s))",
            self.s3cfg.url,
            endpoint or "AWS",
            self.workers,
        )
        if s3.has_userinfo(self.s3cfg.endpoint_url):
            log.warning(
                "s3 endpoint_url %s has a user name or password in it, which is ignored:"
                " credentials come only from boto3's standard chain (AWS_ACCESS_KEY_ID, ...)",
                endpoint,
            )
        for i in range(self.workers):
            t = threading.Thread(target=self._work, name=f"profd-upload-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._probe_loop, name="profd-s3-probe", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self._stopping.set()
        self.kick()
        # Transfers in flight are cancelled (s3transfer aborts their multipart uploads); their
        # rows go back to the queue and the next daemon uploads them again.
        with self._client_lock:
            manager = self._manager
            inflight = list(self._inflight)
        # TransferManager.shutdown(cancel=True) is broken in some s3transfer releases (it
        # passes its arguments in the wrong order), so cancel each transfer ourselves.
        for future in inflight:
            try:
                future.cancel()
            except Exception as exc:
                log.debug("cancelling an upload: %s", s3.describe(exc))
        if manager is not None:
            threading.Thread(target=manager.shutdown, name="profd-s3-shutdown", daemon=True).start()
        deadline = time.monotonic() + STOP_JOIN_S
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._hasher.shutdown(wait=False, cancel_futures=True)
        busy = [t.name for t in self._threads if t.is_alive()]
        if busy:
            log.info(
                "%d upload thread(s) still busy at shutdown; unfinished uploads restart with"
                " the next daemon",
                len(busy),
            )

    def kick(self) -> None:
        with self._cv:
            self._gen += 1
            self._cv.notify_all()

    def status(self) -> dict[str, Any]:
        with self._health_lock:
            health, error = self._health_word()
            return {
                "configured": True,
                "url": self.s3cfg.url,
                "bucket": self.bucket,
                "prefix": self.prefix,
                "endpoint_url": s3.shown_endpoint(self.s3cfg.endpoint_url),
                "region": self.s3cfg.region,
                "health": health,
                "reachable": self._reachable,
                "error": error,
                "checked_at": self._checked_at,
                "last_upload_error": self._upload_error,
                "last_upload_error_at": self._upload_error_at,
                "last_upload_at": self._upload_ok_at,
                "workers": self.workers,
                "active": self._active,
                "credentials": self._cred_source,  # where they came from, never the values
                "stale_multipart_aborted": self._stale_aborted,
            }

    def _health_word(self) -> tuple[str, str | None]:
        """(health, the error that explains it); called with ``_health_lock`` held.

        ``unreachable``: the store does not answer (probe or upload). ``uploads_failing``: it
        answers, but the last upload failed since the last one that succeeded (wrong
        credentials, a policy that allows HeadBucket but not PutObject, a verify mismatch).
        ``ok``: it answers and uploads work or have not failed yet. ``unknown``: not checked."""
        if self._reachable is False:
            return "unreachable", self._error
        failing = self._upload_error_at is not None and (
            self._upload_ok_at is None or self._upload_error_at > self._upload_ok_at
        )
        if failing and self._upload_error_answered:
            return "uploads_failing", self._upload_error
        if self._reachable is True:
            return "ok", self._error
        return "unknown", self._error

    # --- quota ---------------------------------------------------------------------------------
    def prune(self) -> int:
        """Delete verified-uploaded files, oldest first, until the spool fits its quota."""
        cap = self.cfg.max_spool_bytes
        if cap is None:
            return 0
        files = self._conn().files
        with self._prune_lock:
            total, _ = files.spool_usage()
            if total <= cap:
                return 0
            n = freed = 0
            for f in files.prunable():
                if total <= cap:
                    break
                path = Path(f["path"])
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:
                    log.warning("could not prune %s: %s", path, exc)
                    continue
                files.mark_deleted(f["id"])
                total -= f["bytes"]
                freed += f["bytes"]
                n += 1
                if path.name == layout.MANIFEST:
                    self._remove_empty_dirs(path.parent)
        if n:
            log.info(
                "pruned %d uploaded file(s), %s, to stay under max_spool_bytes %s",
                n,
                human_bytes(freed),
                human_bytes(cap),
            )
        return n

    def _remove_empty_dirs(self, session_dir: Path) -> None:
        # Only once session.json is gone: the session is finished, so no pipeline worker can
        # still be writing into these directories.
        with contextlib.suppress(OSError):
            for d in session_dir.iterdir():
                if d.is_dir():
                    with contextlib.suppress(OSError):
                        d.rmdir()
            session_dir.rmdir()

    # --- workers -------------------------------------------------------------------------------
    def _conn(self) -> _Conn:
        conn: _Conn | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = _Conn.open(self.cfg.index_path)
        return conn

    def _client(self) -> Any:
        with self._client_lock:
            if self._client_obj is None:
                s3.remember_secrets()
                self._cred_source = s3.credential_source()
                self._client_obj = s3.make_client(
                    self.s3cfg, pool=self.concurrency + self.workers + 2
                )
                self._manager = s3.transfer_manager(self._client_obj, self.s3cfg, self.concurrency)
            return self._client_obj

    def _work(self) -> None:
        conn = self._conn()
        queue = conn.queue
        while not self._stopping.is_set():
            with self._cv:
                seen = self._gen
            try:
                now = time.time()
                row = queue.claim_upload(now)
                if row is not None:
                    self._upload(queue, row)
                    continue
                self.prune()
                due = queue.next_upload_due(now)
            except Exception:
                log.exception("upload worker error")
                self._stopping.wait(1.0)
                continue
            wait = IDLE_WAIT_S if due is None else min(IDLE_WAIT_S, max(0.05, due - time.time()))
            with self._cv:
                if self._gen == seen and not self._stopping.is_set():
                    self._cv.wait(wait)
        conn.db.close()

    def _upload(self, queue: UploadQueueRepo, row: dict[str, Any]) -> None:
        key = s3.join_key(self.prefix, row["rel"])
        with self._health_lock:
            self._active += 1
        with self._client_lock:
            self._busy_keys.add(key)
        t0 = time.monotonic()
        try:
            checked = self._transfer(row, Path(row["path"]), key)
        except Exception as exc:
            self._upload_failed(queue, row, exc)
        else:
            self._upload_succeeded(queue, row, key, checked, t0)
        finally:
            with self._client_lock:
                self._busy_keys.discard(key)
                self._drop_done()
            with self._health_lock:
                self._active -= 1
            # A finished file may unblock its session.json for another worker.
            self.kick()

    def _transfer(self, row: dict[str, Any], path: Path, key: str) -> dict[str, Any]:
        """Upload ``path`` to ``key`` and verify it there; what :func:`s3.verify` checked."""
        client = self._client()
        if not path.is_file():
            raise LocalFileMissing(f"local file {path} is missing")
        if row["id"] in self._interrupted:
            aborted = s3.abort_stale(client, self.bucket, key)
            if aborted:
                with self._health_lock:
                    self._stale_aborted += aborted
                log.info("aborted %d unfinished multipart upload(s) of %s", aborted, key)
        # Hash the file while it uploads (hashlib and zlib release the GIL), so the
        # verification read overlaps the network instead of following it.
        size = path.stat().st_size
        cfg = self.s3cfg
        hashed = self._hasher.submit(
            s3.digest, path, size, cfg.multipart_threshold, cfg.multipart_chunksize
        )
        s3.upload(self._manager, cfg, path, self.bucket, key, self._started)
        return s3.verify(client, cfg, path, self.bucket, key, local=hashed.result)

    def _upload_failed(self, queue: UploadQueueRepo, row: dict[str, Any], exc: Exception) -> None:
        """Requeue (with backoff) or fail the row, and note what the store said."""
        if self._stopping.is_set():
            queue.upload_retry(row["id"], "interrupted by daemon shutdown", 0.0, False)
            log.info("upload of %s interrupted by shutdown", row["rel"])
            return
        err = s3.describe(exc)
        now = time.time()
        if isinstance(exc, LocalFileMissing):
            # Nothing a retry can fix: failed until profctl retry or the next start.
            queue.upload_retry(row["id"], err, 0.0, True)
            log.warning(
                "upload of %s failed: %s; giving up (profctl retry requeues it)",
                row["rel"],
                err,
            )
            return
        attempt, limit = int(row["attempts"]), self.s3cfg.max_attempts
        give_up = attempt >= limit
        delay = self._backoff(attempt, give_up)
        queue.upload_retry(row["id"], err, now + delay, give_up)
        unreachable = s3.is_unreachable(exc)
        with self._health_lock:
            self._upload_error, self._upload_error_at = err, now
            self._upload_error_answered = not unreachable
        if unreachable:
            self._health(False, err)
        if give_up:
            # Once failed, it keeps failing quietly until it uploads.
            level = logging.DEBUG if row["upload_state"] == "failed" else logging.WARNING
            log.log(
                level,
                "upload of %s failed (attempt %d, max_attempts %d): %s; marked failed, retried"
                " in %.1fs, or when S3 comes back, or now with profctl retry",
                row["rel"],
                attempt,
                limit,
                err,
                delay,
            )
        else:
            log.warning(
                "upload of %s failed (attempt %d/%d): %s; retry in %.1fs",
                row["rel"],
                attempt,
                limit,
                err,
                delay,
            )

    def _upload_succeeded(
        self,
        queue: UploadQueueRepo,
        row: dict[str, Any],
        key: str,
        checked: dict[str, Any],
        t0: float,
    ) -> None:
        queue.upload_done(row["id"], s3.uri(self.bucket, key))
        self._interrupted.discard(row["id"])
        self._health(True, None)
        with self._health_lock:
            self._upload_ok_at = time.time()
        if row["upload_state"] == "failed":
            log.info("uploaded %s, which had failed before", row["rel"])
        log.debug(
            "uploaded %s (%d bytes, verified %s) in %.2fs",
            key,
            checked["size"],
            "+".join(checked["checked"]),
            time.monotonic() - t0,
        )
        if row["kind"] == "session":
            log.info("session %s complete in %s", row["session"], s3.uri(self.bucket, key))

    def _backoff(self, attempt: int, failed: bool) -> float:
        """Seconds before the next try: ``backoff_base * 2^(attempt-1)`` capped at
        ``backoff_max`` (``failed_backoff_max`` once the file is failed), less up to 25% so
        that files (and nodes) that failed together do not all retry together."""
        cfg = self.s3cfg
        cap = max(cfg.backoff_max, cfg.failed_backoff_max) if failed else cfg.backoff_max
        # The exponent is bounded so a file failing for weeks cannot overflow the float.
        grown = cfg.backoff_base * 2.0 ** min(attempt - 1, 64)
        return min(cap, grown) * (1 - 0.25 * random.random())

    def _started(self, future: Any) -> None:
        with self._client_lock:
            self._inflight.add(future)
            if self._stopping.is_set():
                future.cancel()  # stop() ran between claim and submit

    def _drop_done(self) -> None:
        self._inflight = {f for f in self._inflight if not f.done()}

    # --- reachability ----------------------------------------------------------------------------
    def _health(self, reachable: bool | None, error: str | None) -> None:
        with self._health_lock:
            self._reachable = reachable
            self._error = error
            self._checked_at = time.time()
            if reachable is False:
                self._down_seen = True

    def _probe_loop(self) -> None:
        client: Any = None
        while not self._stopping.is_set():
            up = False
            try:
                self._client()  # resolves credentials off the event loop
                if client is None:
                    client = s3.make_client(self.s3cfg, probe=True, pool=1)
                up = self._probe(client)
                if up and not self._swept:
                    self._sweep_stale()
            except Exception as exc:
                self._health(False, s3.describe(exc))
            if up:
                # The store answers after the probe or an upload found it unreachable.
                with self._health_lock:
                    back, self._down_seen = self._down_seen, False
                if back:
                    try:
                        self._recovered()
                    except Exception:
                        log.exception("requeueing uploads after an outage (again next probe)")
                        with self._health_lock:
                            self._down_seen = True
            self._stopping.wait(PROBE_OK_S if self._reachable else PROBE_DOWN_S)
        conn: _Conn | None = getattr(self._local, "conn", None)
        if conn is not None:  # opened by _recovered or _sweep_stale
            conn.db.close()

    def _sweep_stale(self) -> None:
        """Abort the incomplete multipart uploads an earlier daemon left for this node's files:
        a daemon killed mid-upload, or an abort that failed in a network cut (its file uploaded
        later). Only keys of files in this index: other nodes share the bucket and prefix.
        Once per start; again at the next probe only if the store stopped answering."""
        base = f"{self.prefix}/" if self.prefix else ""
        n = 0
        try:
            client = self._client()
            old = [
                u
                for u in s3.open_uploads(client, self.bucket, base)
                if u.initiated is not None and u.initiated < self._started_at
            ]
            ours = self._conn().queue.known_rels(u.key[len(base) :] for u in old)
            for u in old:
                with self._client_lock:
                    busy = u.key in self._busy_keys
                if (
                    u.key[len(base) :] in ours
                    and not busy
                    and s3.abort_upload(client, self.bucket, u)
                ):
                    n += 1
                    with self._health_lock:
                        self._stale_aborted += 1
            done = True
        except Exception as exc:
            # Unreachable: the next probe that gets an answer tries again. Anything else is
            # for good: listing them needs s3:ListBucketMultipartUploads, which an upload-only
            # role may lack (a lifecycle rule on the bucket then cleans them).
            done = not s3.is_unreachable(exc)
            if done:
                log.info("could not abort stale multipart uploads: %s", s3.describe(exc))
        if n:
            log.info(
                "aborted %d incomplete multipart upload(s) of this node's files left by an"
                " earlier daemon",
                n,
            )
        self._swept = done

    def _recovered(self) -> None:
        """The store answers again: what failed or backed off while it did not is due now."""
        n = self._conn().queue.requeue_recovered(lambda p: Path(p).is_file())
        log.info("S3 answers again: %d failed upload(s) requeued, backed-off uploads due now", n)
        self.kick()

    def _probe(self, client: Any) -> bool:
        """One HeadBucket; whether the store answered (even if it refused)."""
        from botocore.exceptions import ClientError, NoCredentialsError

        try:
            client.head_bucket(Bucket=self.bucket)
        except NoCredentialsError:
            self._health(False, "no credentials found in boto3's standard chain")
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("403", "AccessDenied", "Forbidden"):
                # HeadBucket needs s3:ListBucket, which an upload-only role may lack. Wrong
                # credentials get this too: status says so once an upload fails.
                self._health(True, "HeadBucket denied (uploads may still work)")
                return True
            if code in ("404", "NoSuchBucket", "NotFound"):
                self._health(False, f"bucket {self.bucket!r} does not exist")
            else:
                self._health(False, s3.describe(exc))
        except Exception as exc:
            self._health(False, s3.describe(exc))
        else:
            # Upload errors are kept apart (status' last_upload_error), so this clears only
            # what a probe or an unreachable store said.
            self._health(True, None)
            return True
        return False
