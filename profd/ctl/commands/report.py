"""profctl report / diff: the cross-rank report of a session, and what changed between two.

Both read the per-rank statistics the pipeline stored with each capture's result: from the
daemon (``show``), from every node (``--cluster``), or from the session's manifests in S3
(``--s3``: no daemon, no spool). Only ``--timeline`` reads the traces themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import click

from profd import control_schema as C
from profd.ctl.errors import CtlError
from profd.ctl.main import Env, command
from profd.ctl.render import document, emit_json, say
from profd_client.protocol.envelope import ErrorCode

S3_OPTION = click.option(
    "--s3", "s3_url", help="Read the session's manifests from S3 (no daemon needed)."
)


def load_session(env: Env, session: str, s3_url: str | None) -> dict[str, Any]:
    """The session with every target's results, as ``show --json`` gives it."""
    if s3_url:
        return _from_s3(session, s3_url)
    from profd.ctl.commands.sessions import show_session

    return show_session(env, session)


def _from_s3(session: str, s3_url: str) -> dict[str, Any]:
    from profd.ctl.commands.s3list import ctl_s3, find_sessions, read_manifests, s3_error
    from profd.report.model import merge_sessions

    client, cfg = ctl_s3(s3_url)
    bucket, prefix = cfg.bucket_prefix()
    try:
        pairs = sorted(set(find_sessions(client, bucket, prefix, session=session)))
        if not pairs:
            raise CtlError(
                f"no session {session!r} under {cfg.url}", code=ErrorCode.UNKNOWN_SESSION
            )
        if len({sid for _, sid in pairs}) > 1:
            ids = ", ".join(sorted({sid for _, sid in pairs}))
            raise CtlError(f"session {session!r} is ambiguous: {ids}")
        manifests = read_manifests(client, bucket, prefix, *pairs[0])
    except CtlError:
        raise
    except Exception as exc:
        raise s3_error(exc) from None
    if not manifests:
        raise CtlError(f"session {pairs[0][1]} has no manifest in S3 yet (still uploading?)")
    return merge_sessions(manifests)


@click.command()
@click.argument("session")
@click.option("-o", "--output", "out", help="Write the HTML page here ('-': stdout).")
@S3_OPTION
@click.option(
    "--timeline",
    is_flag=True,
    help="Also merge each cycle's traces into one Chrome trace (every rank a process).",
)
@click.option(
    "--timeline-dir",
    type=click.Path(file_okay=False),
    help="Where --timeline writes (default: beside each cycle dir; with --s3 the current dir).",
)
@click.pass_obj
@command
def report(
    env: Env,
    session: str,
    out: str | None,
    s3_url: str | None,
    timeline: bool,
    timeline_dir: str | None,
) -> None:
    """Which rank the others wait for, and where each rank's time goes.

    Prints a text summary (--json: the report as JSON) and writes a self-contained HTML page,
    to -o FILE or to profd-report-SESSION.html in the current directory.
    """
    from profd.report.model import build_report
    from profd.report.renderers import TextRenderer, renderers, report_doc

    s = load_session(env, session, s3_url)
    rep = build_report(s)
    label = str(s.get("label") or "")
    if label.startswith("incident:") and not s3_url:
        # An incident's capture: the page leads with the incident and what differs.
        from profd.ctl.commands.incidents import fetch_incident

        try:
            rep.incident = fetch_incident(env, label[len("incident:") :])
        except CtlError as exc:
            say(f"profctl: the incident of this capture is not readable: {exc}", err=True)
    if not rep.ranks:
        raise CtlError(
            f"session {rep.session} has no per-rank statistics"
            " (no trace processed yet, or captured by a profd without them)"
        )
    if not s3_url and any(r.memory_pages for r in rep.ranks):
        rep.page_links = _local_pages(env, rep)
    path = out or f"profd-report-{rep.session}.html"
    page = renderers()["html"].render(rep)
    if path == "-":
        document(page)
    elif out is not None or not env.json:
        Path(path).write_text(page, encoding="utf-8")
    written: list[str] = []
    if timeline:
        written = _timelines(env, rep, s3_url, timeline_dir)
    if env.json:
        doc = report_doc(rep)
        if timeline:
            doc["timelines"] = written
        emit_json(doc)
        return
    if path != "-":
        say(TextRenderer().render(rep), nl=False)
        say(f"\nreport: {path}")
    for w in written:
        say(f"timeline: {w}")


def _timelines(env: Env, rep: Any, s3_url: str | None, where: str | None) -> list[str]:
    from profd.report.timeline import RankTrace, write_timeline

    by_key = {(r.host, r.role, r.rank): r for r in rep.ranks}
    rows = _trace_rows(env, rep.session, s3_url)
    cycles: dict[int, list[RankTrace]] = {}
    dirs: dict[int, Path] = {}
    opener = _s3_opener(s3_url) if s3_url else None
    for row in rows:
        rd = by_key.get((row["host"], row["role"], row["rank"]))
        if rd is None:
            continue
        cycle, path = int(row["cycle"]), str(row["path"])
        if opener is not None:
            open_fn = opener(path)
        else:
            if not Path(path).is_file():
                continue  # another node's spool (--cluster): only S3 has every trace
            dirs.setdefault(cycle, Path(path).parent)
            open_fn = _local_opener(path)
        cycles.setdefault(cycle, []).append(RankTrace(rd, cycle, path, open_fn))
    if not cycles:
        hint = "" if s3_url else " (with --cluster, read them from S3: --s3)"
        raise CtlError(f"no trace of session {rep.session} is readable here{hint}")
    written = []
    for cycle, traces in sorted(cycles.items()):
        if where is not None:
            out = Path(where) / f"{rep.session}-c{cycle}.timeline.json.gz"
        elif cycle in dirs:
            # Beside the cycle dir, never in it: HTA takes every .json/.gz there for a rank.
            out = dirs[cycle].parent / f"{dirs[cycle].name}.timeline.json.gz"
        else:
            out = Path.cwd() / f"{rep.session}-c{cycle}.timeline.json.gz"
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            write_timeline(traces, out)
        except ValueError as exc:
            raise CtlError(f"cycle {cycle}: {exc}") from None
        except OSError as exc:
            why = exc.strerror or exc
            raise CtlError(f"cannot write {out}: {why} (try --timeline-dir)") from None
        written.append(str(out))
    return written


def _local_pages(env: Env, rep: Any) -> dict[str, str]:
    """The memory pages on this machine's disk, as file URIs: each lies beside its trace,
    whose path on disk the daemon's trace rows give (another node's are not here)."""
    dirs = {
        (row["host"], row["role"], row["rank"], int(row["cycle"])): Path(str(row["path"])).parent
        for row in _trace_rows(env, rep.session, None)
    }
    links: dict[str, str] = {}
    for r in rep.ranks:
        for cycle, rel in r.memory_pages:
            where = dirs.get((r.host, r.role, r.rank, cycle))
            page = where / Path(rel).name if where is not None else None
            if page is not None and page.is_file():
                links[rel] = page.resolve().as_uri()
    return links


def _trace_rows(env: Env, session: str, s3_url: str | None) -> list[dict[str, Any]]:
    if s3_url:
        from profd.ctl.commands.s3list import list_from_s3

        return list_from_s3(s3_url, session=session, limit=1_000_000)
    rows: list[dict[str, Any]] = env.rows(
        C.C_TRACES, filters={"session": session, "limit": 100_000}
    )
    return rows


def _local_opener(path: str) -> Any:
    return lambda: open(path, "rb")


def _s3_opener(s3_url: str) -> Any:
    from profd.ctl.commands.s3list import ctl_s3
    from profd.store import s3

    client, _ = ctl_s3(s3_url)

    def for_uri(uri: str) -> Any:
        bucket, key = s3.parse_uri(uri)

        @contextlib.contextmanager
        def open_body() -> Iterator[IO[bytes]]:
            body = client.get_object(Bucket=bucket, Key=key)["Body"]
            try:
                yield body
            finally:
                body.close()

        return open_body

    return for_uri


@click.command()
@click.argument("session_a")
@click.argument("session_b")
@S3_OPTION
@click.pass_obj
@command
def diff(env: Env, session_a: str, session_b: str, s3_url: str | None) -> None:
    """What changed from SESSION_A to SESSION_B: per operator and per step, biggest first."""
    from profd.report.diff import diff_reports, diff_text
    from profd.report.model import build_report

    a = build_report(load_session(env, session_a, s3_url))
    b = build_report(load_session(env, session_b, s3_url))
    for r in (a, b):
        if not r.ranks:
            raise CtlError(f"session {r.session} has no per-rank statistics")
    d = diff_reports(a, b)
    if env.json:
        emit_json(d)
    else:
        say(diff_text(d), nl=False)
