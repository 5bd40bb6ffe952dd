"""Where the warehouse's objects go: a directory (written to a temporary file in the same
directory, then renamed over the object) or an S3 bucket (one PutObject, which replaces the
object whole). Either way a reader sees the old object or the new one, never a part."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

from profd.config import S3Config
from profd.store import s3
from profd.warehouse.tables import Listed, disk_token, hourly_names


class Sink(Protocol):
    def put(self, key: str, data: bytes) -> None:
        """Replace the object at ``key`` (relative to the warehouse root) whole."""
        ...

    def dates(self, table: str) -> list[str]:
        """The ``date=`` partitions of ``table`` there are (``YYYY-MM-DD``)."""
        ...

    def delete_date(self, table: str, date: str, stem: str | None) -> int:
        """Delete the objects of ``table``'s ``date`` (only those named by ``stem`` unless
        it is None); how many."""
        ...

    def delete_hours(self, table: str, date: str, stem: str) -> int:
        """Delete the hourly objects ``stem`` wrote for ``table``'s ``date``; how many."""
        ...

    def folder(self, table: str, date: str) -> dict[str, Listed]:
        """The ``.parquet`` objects of ``table``'s ``date`` by file name."""
        ...

    def put_new(self, key: str, path: Path) -> bool:
        """Create the object at ``key`` from the file ``path`` only if there is none (False
        if there was one: another writer took that name first)."""
        ...

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """The object's bytes ``start``..``end`` (a ``FileNotFoundError`` if it is gone)."""
        ...

    def delete(self, key: str) -> None:
        """Delete one object (nothing if it is gone)."""
        ...

    def fetch(self, key: str, dest: Path) -> None:
        """The object copied to the local file ``dest``, streamed (a ``FileNotFoundError``
        if it is gone)."""
        ...


class LocalSink:
    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def dates(self, table: str) -> list[str]:
        try:
            names = os.listdir(self.root / table)
        except FileNotFoundError:
            return []
        return sorted(n[5:] for n in names if n.startswith("date="))

    def delete_date(self, table: str, date: str, stem: str | None) -> int:
        d = self.root / table / f"date={date}"
        n = 0
        for f in list(d.glob("*.parquet")) + list(d.glob(".tmp-*")):
            if stem is None or f.name.startswith(stem + "~") or f.name == f"{stem}.parquet":
                f.unlink(missing_ok=True)
                n += 1
        with contextlib.suppress(OSError):
            d.rmdir()  # only once empty: other writers' objects stay
        return n

    def delete_hours(self, table: str, date: str, stem: str) -> int:
        d = self.root / table / f"date={date}"
        n = 0
        for name in hourly_names(stem):
            with contextlib.suppress(FileNotFoundError):
                (d / name).unlink()
                n += 1
        return n

    def folder(self, table: str, date: str) -> dict[str, Listed]:
        out: dict[str, Listed] = {}
        try:
            entries = list(os.scandir(self.root / table / f"date={date}"))
        except FileNotFoundError:
            return out
        for e in entries:
            if e.name.endswith(".parquet") and not e.name.startswith("."):
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                out[e.name] = Listed(st.st_size, disk_token(st))
        return out

    def put_new(self, key: str, path: Path) -> bool:
        dest = self.root / key
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as f, open(path, "rb") as src:
                while chunk := src.read(1 << 20):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            try:
                os.link(tmp, dest)  # fails if the name is taken: create-if-absent, atomic
            except FileExistsError:
                return False
            return True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        with open(self.root / key, "rb") as f:
            f.seek(start)
            return f.read() if end is None else f.read(end - start)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / key).unlink()

    def fetch(self, key: str, dest: Path) -> None:
        shutil.copyfile(self.root / key, dest)


class S3Sink:
    def __init__(self, url: str, cfg: S3Config) -> None:
        self.bucket, self.prefix = s3.split_url(url)
        self.cfg = cfg
        self._client: Any = None

    def client(self) -> Any:
        if self._client is None:
            s3.quiet_sdk_logs()
            self._client = s3.make_client(self.cfg, pool=2)
        return self._client

    def _key(self, rel: str) -> str:
        return s3.join_key(self.prefix, rel)

    def _extra(self) -> dict[str, str]:
        extra: dict[str, str] = {}
        if self.cfg.storage_class:
            extra["StorageClass"] = self.cfg.storage_class
        if self.cfg.sse:
            extra["ServerSideEncryption"] = self.cfg.sse
        if self.cfg.sse_kms_key_id:
            extra["SSEKMSKeyId"] = self.cfg.sse_kms_key_id
        return extra

    def put(self, key: str, data: bytes) -> None:
        self.client().put_object(
            Bucket=self.bucket,
            Key=self._key(key),
            Body=data,
            ContentType="application/vnd.apache.parquet",
            **self._extra(),
        )

    def put_new(self, key: str, path: Path) -> bool:
        # S3's conditional write (If-None-Match: *): the store refuses a second object of the
        # same name, so two writers racing for one serial cannot both win.
        from botocore.exceptions import ClientError

        try:
            with open(path, "rb") as body:
                self.client().put_object(
                    Bucket=self.bucket,
                    Key=self._key(key),
                    Body=body,
                    IfNoneMatch="*",
                    ContentType="application/vnd.apache.parquet",
                    **self._extra(),
                )
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise
        return True

    def folder(self, table: str, date: str) -> dict[str, Listed]:
        base = self._key(f"{table}/date={date}/")
        return {
            o["Key"][len(base) :]: Listed(int(o["Size"]), str(o["ETag"]).strip('"'))
            for o in self._list(base, delimiter=False)
            if o["Key"].endswith(".parquet") and "/" not in o["Key"][len(base) :]
        }

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        from botocore.exceptions import ClientError

        kw: dict[str, Any] = {}
        if start or end is not None:
            kw["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        try:
            got = self.client().get_object(Bucket=self.bucket, Key=self._key(key), **kw)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise FileNotFoundError(key) from None
            raise
        data: bytes = got["Body"].read()
        return data

    def delete(self, key: str) -> None:
        self.client().delete_object(Bucket=self.bucket, Key=self._key(key))

    def fetch(self, key: str, dest: Path) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client().download_file(self.bucket, self._key(key), str(dest))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise FileNotFoundError(key) from None
            raise

    def _list(self, prefix: str, delimiter: bool) -> list[dict[str, Any]]:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            kw["Delimiter"] = "/"
        out: list[dict[str, Any]] = []
        for page in self.client().get_paginator("list_objects_v2").paginate(**kw):
            out.extend(page.get("CommonPrefixes", []) if delimiter else page.get("Contents", []))
        return out

    def dates(self, table: str) -> list[str]:
        base = self._key(f"{table}/date=")
        found = self._list(base, delimiter=True)
        return sorted(p["Prefix"][len(base) :].rstrip("/") for p in found)

    def delete_date(self, table: str, date: str, stem: str | None) -> int:
        base = self._key(f"{table}/date={date}/")
        keys = [o["Key"] for o in self._list(base, delimiter=False)]
        if stem is not None:
            keys = [k for k in keys if k[len(base) :].startswith((stem + "~", stem + "."))]
        self._delete(keys)
        return len(keys)

    def delete_hours(self, table: str, date: str, stem: str) -> int:
        # One listing of the writer's hourly prefix: no stem holds a "~", so only its hours.
        base = self._key(f"{table}/date={date}/{stem}~")
        keys = [o["Key"] for o in self._list(base, delimiter=False)]
        self._delete(keys)
        return len(keys)

    def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            self.client().delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
            )


def make_sink(url: str, cfg: S3Config) -> Sink:
    if url.startswith("s3://"):
        return S3Sink(url, cfg)
    return LocalSink(Path(url))
