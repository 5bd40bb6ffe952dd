"""profctl status: daemon health."""

from __future__ import annotations

from typing import Any

import click

from profd import control_schema as C
from profd.ctl.main import Env, command
from profd.ctl.render import Column, ago, emit_json, say, size, table


@click.command()
@click.pass_obj
@command
def status(env: Env) -> None:
    """Daemon health: version, uptime, clients, sessions, upload queue, spool, S3, the
    warehouse export (with --cluster: one row per node that answered)."""
    rows = [{**a.data, "address": a.node.address} for a in env.gather(C.C_STATUS).answered()]
    if env.json:
        emit_json(env.per_node(rows))
    elif env.nodes.remote:
        say(table(rows, CLUSTER_COLUMNS))
    else:
        say(status_text(rows[0]))


def status_text(st: dict[str, Any]) -> str:
    """One daemon's status, a line per part."""
    q, sp, s3 = st["queue"], st["spool"], st["s3"]
    lines = [
        f"profd {st['version']}  pid {st['pid']}  host {st['host']}  up {st['uptime_s']:.0f}s",
        f"runtime  {st['runtime_dir']}",
        f"spool    {st['spool_dir']}  {size(sp['bytes'])} ({size(sp['bytes_not_uploaded'])} not"
        f" uploaded, quota {size(sp['max_bytes']) if sp['max_bytes'] else 'none'})",
        f"clients  {st['clients']}" + heartbeat_text(st.get("heartbeat")),
        f"sessions {st['sessions']['live']} live"
        + "".join(f", {n} {k}" for k, n in sorted(st["sessions"]["by_state"].items())),
        pipeline_line(st["pipeline"]),
        f"uploads  {q['queued']} queued, {q['failed']} failed, {size(q['bytes_pending'])} pending,"
        f" {q['uploaded']} uploaded",
    ]
    if st.get("tcp"):
        tcp = st["tcp"]
        lines.append(f"tcp      {tcp['listen']} (CURVE), {tcp['refused']} refused connection(s)")
    if st.get("metrics"):
        lines.append(f"metrics  http://{st['metrics']['listen']}/metrics")
    if "storage" in st:  # a daemon older than 0.3 does not say
        lines += storage_lines(st["storage"])
    limited = limits_line(st.get("limits") or {})
    if limited:
        lines.append(limited)
    if st.get("gc"):  # a daemon older than 0.3 does not say
        lines.append(gc_line(st["gc"]))
    if s3.get("configured"):
        lines += s3_lines(s3)
    else:
        lines.append("s3       not configured (traces stay in the spool)")
    if "warehouse" in st:  # a daemon older than 0.3 does not say
        lines.append(warehouse_line(st["warehouse"]))
    return "\n".join(lines)


def warehouse_line(w: dict[str, Any]) -> str:
    """Where the export writes, what waits, when it last wrote and, while it fails, why."""
    if not w.get("enabled"):
        return "warehouse off"
    line = (
        f"warehouse {w['url']}  {w['pending_partitions']} partition(s) pending,"
        f" last written {ago(w.get('last_flush_at'))}"
    )
    if w.get("days_sealed"):
        line += f", {w['days_sealed']} day(s) sealed"
    if w.get("days_handed_to_fleet"):
        line += f", {w['days_handed_to_fleet']} handed to fleet objects"
    if w.get("failing"):
        line += f"  FAILING: {w.get('last_error') or '?'}"
    return line


#: ``s3.health`` as the text status shows it.
HEALTH = {
    "ok": "reachable",
    "uploads_failing": "UPLOADS FAILING",
    "unreachable": "UNREACHABLE",
    "unknown": "not checked yet",
}


def s3_lines(s3: dict[str, Any]) -> list[str]:
    """The store's health and, while uploads fail, the last upload error and its age."""
    err, last = s3.get("error"), s3.get("last_upload_error")
    line = f"s3       {s3['url']}  {HEALTH.get(s3.get('health', ''), 'not checked yet')}"
    if err and err != last:
        line += f"  ({err})"
    out = [line]
    err_at, ok_at = s3.get("last_upload_error_at"), s3.get("last_upload_at")
    if last and err_at and (ok_at is None or err_at > ok_at):
        out.append(f"         last upload error {ago(err_at)}: {last}")
    if s3.get("stale_multipart_aborted"):
        out.append(
            f"         aborted {s3['stale_multipart_aborted']} incomplete multipart upload(s)"
            " an earlier daemon left"
        )
    return out


def heartbeat_text(hb: dict[str, Any] | None) -> str:
    """The clients' heartbeat interval, when the daemon paces them past its base."""
    if not hb or hb["interval_s"] <= hb["base_s"]:
        return ""
    return (
        f"  (heartbeats every {hb['interval_s']:g} s, not {hb['base_s']:g} s: more than"
        f" [daemon] max_heartbeats_per_s = {hb['max_per_s']:g} at {hb['base_s']:g} s)"
    )


def limits_line(lim: dict[str, Any]) -> str | None:
    """What the peer limits turned away since the daemon started; None while nothing."""
    parts = [
        f"{n} {what}"
        for what, n in (
            ("region entries counted as (other)", lim.get("regions_folded", 0)),
            ("heartbeat(s) coalesced", lim.get("heartbeats_coalesced", 0)),
            ("peer(s) refused", lim.get("peers_refused", 0)),
        )
        if n
    ]
    return "limits   " + ", ".join(parts) if parts else None


def gc_line(g: dict[str, Any]) -> str:
    """The garbage collector's full passes (generation 2): how many and how long they
    stopped the daemon, with what it watches."""
    n, total, longest = g["passes"][2], g["total_ms"][2], g["longest_ms"][2]
    return (
        f"gc       {n} full pass(es), {total:.0f} ms in all, longest {longest:.1f} ms;"
        f" {g['tracked_objects']:,} objects watched, {g['frozen_objects']:,} frozen at start"
    )


def pipeline_line(p: dict[str, Any]) -> str:
    line = f"pipeline {p['in_flight']} in flight"
    if p.get("waiting_for_space"):
        line += f", {p['waiting_for_space']} waiting for disk space"
    if p.get("restarts"):
        death = p.get("last_worker_death") or {}
        line += f", {p['restarts']} worker restarts (last: {death.get('cause', '?')})"
    return line


def storage_lines(st: dict[str, Any]) -> list[str]:
    """Free space where the daemon writes and, while a write fails, what and since when."""
    free = st.get("free_bytes") or {}
    line = "disk     " + ", ".join(
        f"{area} {size(n) if n is not None else '?'} free" for area, n in sorted(free.items())
    )
    out = [line]
    for area, p in sorted((st.get("problems") or {}).items()):
        out.append(f"         {area.upper()} NOT WRITABLE since {ago(p['since'])}: {p['error']}")
    waiting = [
        f"{n} {what}"
        for what, n in (
            ("capture reports", st.get("reports_waiting", 0)),
            ("session.json", st.get("manifests_waiting", 0)),
        )
        if n
    ]
    if waiting:
        out.append(f"         waiting to be written: {', '.join(waiting)}")
    if st.get("temp_files_removed"):
        out.append(
            f"         removed at start: {st['temp_files_removed']} temporary file(s)"
            " a killed daemon left in the spool"
        )
    return out


CLUSTER_COLUMNS: list[Column] = [
    ("HOST", lambda r: r["host"]),
    ("ADDRESS", lambda r: r["address"]),
    ("VERSION", lambda r: r["version"]),
    ("UP", lambda r: f"{r['uptime_s']:.0f}s"),
    ("CLIENTS", lambda r: r["clients"]),
    ("SESSIONS", lambda r: r["sessions"]["live"]),
    ("SPOOL", lambda r: size(r["spool"]["bytes"])),
    ("UPLOADS", lambda r: f"{r['queue']['queued']} queued, {r['queue']['failed']} failed"),
    ("S3", lambda r: _s3_cell(r["s3"])),
]


def _s3_cell(s3: dict[str, Any]) -> str:
    return HEALTH.get(s3.get("health", ""), "-") if s3.get("configured") else "-"
