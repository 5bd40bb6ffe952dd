"""boto3 plumbing shared by the daemon's uploaders and profctl's ``pull``/``traces --s3``.

Credentials come only from boto3's standard chain (env, shared files, SSO, instance/container
roles); nothing here reads, stores or prints them. Error text that leaves this module goes
through :func:`redact` in case a store echoes something it should not, and a
``user:password@`` in ``endpoint_url`` never reaches boto3 (see :func:`make_client`).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profd.config import ConfigError, S3Config
from profd.redact import RedactFilter, redact_url, strip_userinfo

log = logging.getLogger("profd.s3")
log.addFilter(RedactFilter())

#: S3's smallest part (all but the last); s3transfer raises smaller chunk sizes to this.
MIN_PART = 5 << 20
MAX_PARTS = 10_000
_MD5_ETAG = re.compile(r"^[0-9a-f]{32}(-\d+)?$")
_BUF = 1 << 20
_CONTENT_TYPES = {".gz": "application/gzip", ".json": "application/json", ".txt": "text/plain"}


class VerifyError(Exception):
    """The object in S3 is not the file that was uploaded."""


def quiet_sdk_logs() -> None:
    """botocore's debug log prints signed request headers, which name the access key id."""
    for name in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without slashes at either end)."""
    return S3Config(url=url).bucket_prefix()


def join_key(prefix: str, rel: str) -> str:
    rel = rel.lstrip("/")
    return f"{prefix}/{rel}" if prefix else rel


def uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def parse_uri(s3_uri: str) -> tuple[str, str]:
    if not s3_uri.startswith("s3://"):
        raise ConfigError(f"not an s3:// uri: {s3_uri!r}")
    bucket, _, key = s3_uri[5:].partition("/")
    return bucket, key


def shown_endpoint(endpoint: str | None) -> str | None:
    """The endpoint as status and logs show it: any userinfo as ``***``, so that an operator
    sees it is there (and ignored) without seeing it."""
    return redact_url(endpoint) if endpoint else endpoint


def has_userinfo(endpoint: str | None) -> bool:
    return bool(endpoint) and strip_userinfo(endpoint or "") != endpoint


def make_client(cfg: S3Config, *, probe: bool = False, pool: int = 10) -> Any:
    """An S3 client for ``cfg``; ``probe`` makes one that fails fast (no retries)."""
    import boto3
    from botocore.config import Config as BotoConfig

    s3opts: dict[str, Any] = {}
    if cfg.addressing_style:
        s3opts["addressing_style"] = cfg.addressing_style
    kw: dict[str, Any] = {
        "region_name": cfg.region,
        "retries": {"max_attempts": 1 if probe else 3, "mode": "standard"},
        "connect_timeout": 3 if probe else 10,
        "read_timeout": 5 if probe else 60,
        "max_pool_connections": pool,
        "user_agent_extra": "profd",
    }
    if s3opts:
        kw["s3"] = s3opts
    if cfg.checksum_when_required:
        # Many S3-compatible stores reject the CRC32 trailers boto3 sends by default.
        kw["request_checksum_calculation"] = "when_required"
        kw["response_checksum_validation"] = "when_required"
    session = boto3.session.Session()
    # botocore ignores userinfo for signing and connecting, but keeps it in the URL it names
    # in every error, and its endpoint rules prepend a virtual-hosted bucket to the whole
    # authority ("bkt.user:pw@host"), which sends the request to the host without its bucket.
    endpoint = strip_userinfo(cfg.endpoint_url) if cfg.endpoint_url else None
    return session.client("s3", endpoint_url=endpoint, config=BotoConfig(**kw))


def transfer_config(cfg: S3Config, concurrency: int = 10) -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=cfg.multipart_threshold,
        multipart_chunksize=cfg.multipart_chunksize,
        max_bandwidth=cfg.max_bandwidth,
        max_concurrency=concurrency,
        use_threads=True,
    )


def extra_args(cfg: S3Config, path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    ctype = _CONTENT_TYPES.get(path.suffix)
    if ctype:
        out["ContentType"] = ctype
    if cfg.storage_class:
        out["StorageClass"] = cfg.storage_class
    if cfg.sse:
        out["ServerSideEncryption"] = cfg.sse
    if cfg.sse_kms_key_id:
        out["SSEKMSKeyId"] = cfg.sse_kms_key_id
    return out


def part_size(chunksize: int, size: int) -> int:
    """The part size s3transfer will really use for a file of ``size`` bytes."""
    from s3transfer.utils import ChunksizeAdjuster  # type: ignore[import-untyped]

    return int(ChunksizeAdjuster().adjust_chunksize(chunksize, size))


@dataclass(frozen=True)
class Digest:
    md5: str  # the ETag S3 gives for this upload: plain MD5 or MD5-of-part-MD5s "-N"
    crc32: str | None  # base64, only for single-part uploads (multipart CRCs are composite)


def digest(path: Path, size: int, threshold: int, chunksize: int) -> Digest:
    multipart = size >= threshold
    psize = part_size(chunksize, size) if multipart else 0
    whole = hashlib.md5(usedforsecurity=False)
    crc = 0
    parts: list[bytes] = []
    part = hashlib.md5(usedforsecurity=False)
    in_part = 0
    with path.open("rb") as fh:
        while True:
            buf = fh.read(_BUF)
            if not buf:
                break
            if not multipart:
                whole.update(buf)
                crc = zlib.crc32(buf, crc)
                continue
            view = memoryview(buf)
            while view:
                take = min(len(view), psize - in_part)
                part.update(view[:take])
                in_part += take
                view = view[take:]
                if in_part == psize:
                    parts.append(part.digest())
                    part = hashlib.md5(usedforsecurity=False)
                    in_part = 0
    if not multipart:
        return Digest(whole.hexdigest(), base64.b64encode(crc.to_bytes(4, "big")).decode())
    if in_part or not parts:
        parts.append(part.digest())
    etag = hashlib.md5(b"".join(parts), usedforsecurity=False).hexdigest()
    return Digest(f"{etag}-{len(parts)}", None)


def transfer_manager(client: Any, cfg: S3Config, concurrency: int = 10) -> Any:
    """One manager per daemon, shared by every upload worker, so ``max_bandwidth`` caps the
    node's total upload rate rather than each transfer's."""
    from s3transfer.manager import TransferManager  # type: ignore[import-untyped]

    return TransferManager(client, transfer_config(cfg, concurrency))


def upload(
    manager: Any,
    cfg: S3Config,
    path: Path,
    bucket: str,
    key: str,
    started: Callable[[Any], None] | None = None,
) -> None:
    """One managed transfer: multipart above the threshold. The object appears only when the
    last request (PutObject or CompleteMultipartUpload) succeeds, never half-written; a
    failed or cancelled multipart upload is aborted by s3transfer. ``started`` gets the
    transfer future, whose ``cancel()`` interrupts it."""
    future = manager.upload(str(path), bucket, key, extra_args=extra_args(cfg, path) or None)
    if started is not None:
        started(future)
    future.result()


def verify(
    client: Any,
    cfg: S3Config,
    path: Path,
    bucket: str,
    key: str,
    local: Callable[[], Digest] | None = None,
) -> dict[str, Any]:
    """Compare the stored object with the local file: size always, then the checksums the
    store gives us. Returns what was checked; raises :class:`VerifyError` on a mismatch.
    ``local`` supplies the file's digest when the caller computed it during the upload."""
    size = path.stat().st_size
    head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    remote = int(head.get("ContentLength", -1))
    if remote != size:
        raise VerifyError(f"s3://{bucket}/{key}: size {remote} in S3, {size} local")
    checked = ["size"]
    etag = str(head.get("ETag", "")).strip('"').lower()
    # ETags of SSE-KMS/SSE-C objects are not MD5s; some stores never use MD5 at all.
    etag_is_md5 = bool(_MD5_ETAG.match(etag)) and cfg.sse != "aws:kms"
    remote_crc = head.get("ChecksumCRC32")
    crc_full = head.get("ChecksumType") in (None, "FULL_OBJECT")
    if etag_is_md5 or remote_crc:
        d = (
            local()
            if local is not None
            else digest(path, size, cfg.multipart_threshold, cfg.multipart_chunksize)
        )
        if etag_is_md5:
            want_parts = d.md5.partition("-")[2]
            got_parts = etag.partition("-")[2]
            # A store that split differently (or a file uploaded by another tool) can only
            # be compared by size.
            if want_parts == got_parts:
                if etag != d.md5:
                    raise VerifyError(f"s3://{bucket}/{key}: ETag {etag}, local file {d.md5}")
                checked.append("etag")
        if remote_crc and d.crc32 and crc_full and "-" not in str(remote_crc):
            if remote_crc != d.crc32:
                raise VerifyError(f"s3://{bucket}/{key}: CRC32 {remote_crc} in S3, {d.crc32} local")
            checked.append("crc32")
    return {"size": size, "etag": etag, "checked": checked}


@dataclass(frozen=True)
class OpenUpload:
    """An incomplete multipart upload: it holds storage and never becomes an object."""

    key: str
    upload_id: str
    initiated: float | None  # unix time, by the store's clock; None if it did not say


def open_uploads(client: Any, bucket: str, prefix: str) -> Iterator[OpenUpload]:
    """Every incomplete multipart upload whose key starts with ``prefix``, page by page (a
    listing gives at most 1000)."""
    kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        resp = client.list_multipart_uploads(**kw)
        for u in resp.get("Uploads", []):
            at = u.get("Initiated")
            yield OpenUpload(
                str(u.get("Key", "")),
                str(u.get("UploadId", "")),
                at.timestamp() if hasattr(at, "timestamp") else None,
            )
        marker = (resp.get("NextKeyMarker"), resp.get("NextUploadIdMarker"))
        # A store that says "truncated" without moving its markers would loop forever.
        if (
            not resp.get("IsTruncated")
            or not marker[0]
            or marker
            == (
                kw.get("KeyMarker"),
                kw.get("UploadIdMarker"),
            )
        ):
            return
        kw["KeyMarker"] = marker[0]
        if marker[1]:
            kw["UploadIdMarker"] = marker[1]
        else:
            kw.pop("UploadIdMarker", None)


def abort_upload(client: Any, bucket: str, up: OpenUpload) -> bool:
    """Abort ``up``; False if it was gone already (completed or aborted meanwhile)."""
    from botocore.exceptions import ClientError

    try:
        client.abort_multipart_upload(Bucket=bucket, Key=up.key, UploadId=up.upload_id)
    except ClientError as exc:
        if str(exc.response.get("Error", {}).get("Code", "")) in ("NoSuchUpload", "404"):
            return False
        raise
    return True


def abort_stale(client: Any, bucket: str, key: str) -> int:
    """Abort multipart uploads of ``key`` left by a killed daemon. Best effort: the
    permission to list them is often missing."""
    n = 0
    try:
        for u in open_uploads(client, bucket, key):
            if u.key == key:
                n += abort_upload(client, bucket, u)
    except Exception as exc:
        log.debug("could not abort stale multipart uploads of %s: %s", key, describe(exc))
    return n


def describe(exc: BaseException) -> str:
    """One line for logs, ``last_error`` and status; no credentials."""
    text = str(exc) or type(exc).__name__
    name = type(exc).__name__
    if name not in text:
        text = f"{name}: {text}"
    return redact(" ".join(text.split()))[:500]


def is_unreachable(exc: BaseException) -> bool:
    """The store did not answer (as opposed to answering with an error)."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError

    if isinstance(exc, BotoConnectionError | HTTPClientError | ConnectionError | TimeoutError):
        return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_unreachable(cause)


_secrets: list[str] = []


def remember_secrets() -> None:
    """Learn the current credential values so :func:`redact` can scrub them."""
    try:
        import boto3

        creds = boto3.session.Session().get_credentials()
        if creds is None:
            return
        frozen = creds.get_frozen_credentials()
    except Exception:
        return
    for v in (frozen.access_key, frozen.secret_key, frozen.token):
        if v and len(v) >= 4 and v not in _secrets:
            _secrets.append(v)


def credential_source() -> str | None:
    """Where the chain found credentials ("env", "shared-credentials-file", "iam-role"...)."""
    try:
        import boto3

        creds = boto3.session.Session().get_credentials()
    except Exception:
        return None
    return getattr(creds, "method", None) if creds is not None else None


def redact(text: str) -> str:
    """``text`` without URL userinfo or the chain's credential values."""
    text = redact_url(text)
    for s in _secrets:
        text = text.replace(s, "***")
    return text
