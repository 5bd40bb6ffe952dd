"""profctl pull: copy a session's files into ``DIR/{session}/``, one ``c{cycle}/`` per cycle.

Files come from the local spool when they are still there, else from S3. With no daemon, or
a session this node does not know, ``--s3`` (or the daemon's own S3 location) finds the
session by its ``session.json`` in S3. The layout is the spool's minus the job directory, so
HTA and TensorBoard open ``DIR/{session}/c0`` directly.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import click

from profd import control_schema as C
from profd import fsutil
from profd.ctl.commands.s3list import child_dirs, ctl_s3, read_manifests, s3_error
from profd.ctl.errors import CtlCode, CtlError, NoDaemon
from profd.ctl.main import Env, command
from profd.ctl.render import emit_json, say, size
from profd.states import is_terminal
from profd.store import layout, s3
from profd_client.protocol.envelope import ErrorCode

_COPY_BUF = 1 << 20


@dataclass
class Item:
    dest: str  # relative to DIR: {session}/c0/main-r0.pt.trace.json.gz
    bytes: int | None
    local: Path | None  # copy from here when it still exists
    s3_uri: str | None  # else download from here


@dataclass
class Download:
    """One session's files to pull, and where each comes from."""

    session: str
    job: str
    items: list[Item]
    s3_url: str | None = None
    note: str | None = None


def below_job(rel: str) -> str:
    """``job/session/c0/x`` -> ``session/c0/x``, refusing anything that climbs out."""
    parts = PurePosixPath(rel).parts
    if len(parts) < 3 or any(p in ("..", "", "/") for p in parts):
        raise CtlError(f"unexpected file path {rel!r}")
    return str(PurePosixPath(*parts[1:]))


def download_from_nodes(env: Env, session: str) -> Download:
    """Every node's files of the session in one download: the cycle dirs merge (one file per
    rank). With --cluster each node's ``session.json`` becomes ``session.{node}.json``. A
    node's spool is read directly only when it is on this machine; otherwise its files come
    from S3."""
    from profd.ctl.commands.sessions import show_session

    s = show_session(env, session)
    sid = s["id"]
    statuses = {a.node: a.data for a in env.gather(C.C_STATUS).answered()}
    listed = env.gather(C.C_TRACES, filters={"session": sid, "limit": 100000})
    knows = {n["address"] for n in s["nodes"]}
    ended = is_terminal(s["state"])
    here = fsutil.boot_id()
    items: list[Item] = []
    origin: dict[str, str] = {}
    s3_url: str | None = None
    note = None
    for a in listed.answered():
        st = statuses.get(a.node)
        if st is None or a.node.address not in knows:
            continue  # did not answer both (named as missing already), or has no such session
        name = str(st.get("host") or a.node.address)
        spool = Path(st["spool_dir"])
        mine = a.node.local or (here is not None and st.get("boot_id") == here)
        node_s3 = st["s3"].get("url") if st["s3"].get("configured") else None
        s3_url = s3_url or node_s3
        node_items: list[Item] = []
        for r in a.data:
            for f in r["files"]:
                path = Path(f["path"])
                local = path if mine and not f["deleted"] else None
                node_items.append(
                    Item(below_job(str(path.relative_to(spool))), f["bytes"], local, f["s3_uri"])
                )
        manifest = spool.joinpath(*layout.manifest_parts(s["job"], sid))
        dest = f"{sid}/{layout.manifest_name(name if env.nodes.remote else None)}"
        if mine and manifest.exists():
            node_items.append(Item(dest, None, manifest, None))
        elif node_s3 and ended:
            bucket, prefix = s3.split_url(node_s3)
            # In S3 a cluster session's manifests carry the node's name already.
            cluster = layout.is_cluster_session(s.get("request") or {})
            key = s3.join_key(prefix, layout.manifest_key(s["job"], sid, name if cluster else None))
            node_items.append(Item(dest, None, None, s3.uri(bucket, key)))
        else:
            note = f"session {sid} is {s['state']}: no {layout.MANIFEST} yet"
        for it in node_items:
            if it.dest in origin:
                raise CtlError(f"{it.dest} comes from both {origin[it.dest]} and {name}")
            origin[it.dest] = name
        items += node_items
    return Download(sid, s["job"], items, s3_url, note)


def download_from_s3(client: Any, s3_url: str, session: str) -> Download:
    bucket, prefix = s3.split_url(s3_url)
    base = f"{prefix}/" if prefix else ""
    try:
        hits = []
        for job in child_dirs(client, bucket, base):
            # Ids starting with ``session``: the name is matched as a prefix.
            for sid in child_dirs(client, bucket, base + layout.session_key(job, session)):
                hits.append((job, sid))
        complete = [
            h for h in hits if _has_manifest(client, bucket, base + layout.session_key(*h) + "/")
        ]
        if len(complete) > 1 and session in {sid for _, sid in complete}:
            complete = [h for h in complete if h[1] == session]
        if not complete:
            what = "is not complete" if hits else "not found"
            raise CtlError(
                f"session {session!r} {what} in {s3_url} (no session.json)",
                code=ErrorCode.UNKNOWN_SESSION,
            )
        if len(complete) > 1:
            names = ", ".join(f"{j}/{s}" for j, s in complete)
            raise CtlError(f"session {session!r} is ambiguous in {s3_url}: {names}")
        job, sid = complete[0]
        read_manifests(client, bucket, prefix, job, sid)  # for its warning: nodes missing
        items = []
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=base + layout.session_key(job, sid) + "/"
        )
        for page in pages:
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/"):
                    continue
                items.append(
                    Item(below_job(key[len(base) :]), int(obj["Size"]), None, s3.uri(bucket, key))
                )
    except CtlError:
        raise
    except Exception as exc:
        raise s3_error(exc) from None
    return Download(sid, job, items, s3_url)


def _has_manifest(client: Any, bucket: str, session_dir: str) -> bool:
    """``session.json`` is there, or (a cluster session) some node's ``session.{node}.json``."""
    if _exists(client, bucket, session_dir + layout.MANIFEST):
        return True
    listed = client.list_objects_v2(Bucket=bucket, Prefix=session_dir + "session.", Delimiter="/")
    return any(layout.is_manifest(o["Key"][len(session_dir) :]) for o in listed.get("Contents", []))


def _exists(client: Any, bucket: str, key: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        client.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return True


def copy_local(src: Path, tmp: Path, progress: Callable[[int], None]) -> None:
    with src.open("rb") as fi, tmp.open("wb") as fo:
        while True:
            buf = fi.read(_COPY_BUF)
            if not buf:
                break
            fo.write(buf)
            progress(len(buf))


def fetch(
    download: Download, out: Path, client_for: Callable[[], Any], quiet: bool
) -> list[dict[str, Any]]:
    root = out.resolve()
    known = sum(i.bytes or 0 for i in download.items)
    done: list[dict[str, Any]] = []
    bar: Any = (
        contextlib.nullcontext(None)
        if quiet
        else click.progressbar(
            length=max(known, 1), label=f"pulling {download.session}", file=sys.stderr
        )
    )
    with bar as b:
        update: Callable[[int], None] = (lambda n: None) if b is None else b.update
        for it in download.items:
            dest = (root / it.dest).resolve()
            if root not in dest.parents:
                raise CtlError(f"refusing to write outside {root}: {it.dest}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            with fsutil.atomic_path(dest) as tmp:
                if it.local is not None and it.local.is_file():
                    copy_local(it.local, tmp, update)
                    source, origin = "spool", str(it.local)
                elif it.s3_uri:
                    bucket, key = s3.parse_uri(it.s3_uri)
                    try:
                        client_for().download_file(bucket, key, str(tmp), Callback=update)
                    except CtlError:
                        raise
                    except Exception as exc:
                        raise s3_error(exc) from None
                    source, origin = "s3", it.s3_uri
                else:
                    raise CtlError(f"{it.dest}: not in the spool and not uploaded to S3")
                got = tmp.stat().st_size
                if it.bytes is not None and got != it.bytes:
                    raise CtlError(f"{it.dest}: got {got} bytes from {origin}, expected {it.bytes}")
            done.append({"path": str(dest), "bytes": got, "source": source, "from": origin})
    return done


@click.command()
@click.argument("session")
@click.option(
    "-o",
    "--output",
    "out_dir",
    default=".",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Files go to DIR/SESSION/.",
)
@click.option("--s3", "s3_url", help="s3://bucket/prefix to pull from when the daemon cannot.")
@click.pass_obj
@command
def pull(env: Env, session: str, out_dir: str, s3_url: str | None) -> None:
    """Copy a session's traces (spool, else S3) into DIR, one directory per cycle.

    With --cluster, every node's files of the session go into the same DIR/SESSION."""
    download: Download | None = None
    daemon_s3: str | None = None
    try:
        download = download_from_nodes(env, session)
    except NoDaemon:
        if not s3_url:
            raise
    except CtlError as exc:
        if exc.code != ErrorCode.UNKNOWN_SESSION:
            raise
        try:
            urls = [a.data["s3"].get("url") for a in env.gather(C.C_STATUS).answered()]
            daemon_s3 = next((u for u in urls if u), None)
        except CtlError:
            daemon_s3 = None
        if not (s3_url or daemon_s3):
            raise
    clients: dict[str, Any] = {}

    def client_for() -> Any:
        if "c" not in clients:
            clients["c"] = ctl_s3(s3_url or (download.s3_url if download else None) or daemon_s3)[0]
        return clients["c"]

    if download is None:
        url = s3_url or daemon_s3
        assert url is not None
        download = download_from_s3(client_for(), url, session)
    if download.note:
        say(f"profctl: {download.note}", err=True)
    if not download.items:
        raise CtlError(f"session {download.session} has no files", code=CtlCode.EMPTY)
    files = fetch(download, Path(out_dir), client_for, quiet=env.json)
    total = sum(f["bytes"] for f in files)
    dest = Path(out_dir).resolve() / download.session
    if env.json:
        emit_json(
            {
                "session": download.session,
                "job": download.job,
                "dir": str(dest),
                "files": files,
                "bytes": total,
                "from_spool": sum(f["source"] == "spool" for f in files),
                "from_s3": sum(f["source"] == "s3" for f in files),
            }
        )
    else:
        say(f"pulled {len(files)} file(s), {size(total)}, into {dest}")
