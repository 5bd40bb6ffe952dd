"""profctl start: ask for a capture; optionally follow it to the end (--wait)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import click

from profd import claims
from profd import control_schema as C
from profd.ctl.commands.wait import Followed, echo_end, follow
from profd.ctl.errors import ranks_text, unmatched_refusal
from profd.ctl.main import Env, command
from profd.ctl.render import emit_json, say, steps_text
from profd_client import protocol as P
from profd_client.ranks import unmatched


@click.command()
@click.option("--job", help="Target job (required when several jobs are attached).")
@click.option("--role", "roles", multiple=True, help="Role glob (fnmatch); repeatable.")
@click.option("--ranks", help="Ranks: 0,2-5 or all (default: every allowed rank).")
@click.option("--host", help="Only processes on this host.")
@click.option("--pid", "pids", type=int, multiple=True, help="Only this pid; repeatable.")
@click.option("--steps", help="A:B (1-indexed, B excluded) or a list 1,2,5.")
@click.option(
    "--next", "next_", is_flag=True, help="The first step every target can make (default)."
)
@click.option("--at-step", type=int, help="Start at this step.")
@click.option("--active", type=int, help="Steps per cycle with --next/--at-step (default 1).")
@click.option("--warmup", type=int, help="Warm-up steps before each cycle (not recorded).")
@click.option("--repeat", type=int, help="Number of cycles.")
@click.option("--roundup", type=int, help="Start at a multiple of N (--next/--at-step).")
@click.option("--activities", default="cpu,cuda", show_default=True, help="cpu,cuda")
@click.option("--record-shapes", is_flag=True)
@click.option("--profile-memory", is_flag=True)
@click.option("--with-stack", is_flag=True)
@click.option("--with-flops", is_flag=True)
@click.option("--with-modules", is_flag=True)
@click.option("--memory-snapshot", is_flag=True, help="CUDA memory snapshot for memory_viz.")
@click.option("--region", help="One trace per entry into profd_client.region(NAME).")
@click.option("--label", help="Free text stored with the session.")
@click.option(
    "--backend",
    type=click.Choice(["torch", "nsys"]),
    default="torch",
    show_default=True,
    help="nsys needs the job launched with `profctl run --nsys -- CMD`.",
)
@click.option(
    "--strict",
    is_flag=True,
    help="Refuse (start nothing) when a --ranks rank matches no process; else warn.",
)
@click.option("--wait", "wait_", is_flag=True, help="Follow progress until the session ends.")
@click.option(
    "--timeout",
    type=float,
    default=0,
    help="With --wait: give up after N seconds (exit 6; the session goes on).",
)
@click.pass_obj
@command
def start(env: Env, /, **kw: Any) -> None:
    """Capture steps on matching ranks; prints the session id and resolved steps.

    With --cluster: every node is asked for its matching ranks, the steps are resolved once
    for all of them (--ranks are global ranks), and every node starts the same session on
    the same steps; --wait ends done, partial (naming what is missing) or failed.

    --ranks that match no process are named on stderr (and in --json as missing_ranks);
    with --strict they refuse the start instead.
    """
    spec: dict[str, Any] = {
        "job": kw["job"],
        "roles": list(kw["roles"]) or None,
        "ranks": kw["ranks"],
        "host": kw["host"],
        "pids": list(kw["pids"]) or None,
        "steps": kw["steps"],
        "next": kw["next_"] or None,
        "at_step": kw["at_step"],
        "active": kw["active"],
        "warmup": kw["warmup"],
        "repeat": kw["repeat"],
        "roundup": kw["roundup"],
        "region": kw["region"],
        "label": kw["label"],
        "backend": kw["backend"],
        "options": {
            "activities": [a.strip() for a in kw["activities"].split(",") if a.strip()],
            # Each boolean option has a flag of the same name (--record-shapes ...).
            **{k: True for k in sorted(P.BOOL_OPTIONS) if kw[k]},
        },
    }
    spec = {k: v for k, v in spec.items() if v is not None}
    if env.nodes.remote:
        from profd.ctl.clusterstart import final_everywhere, start_everywhere

        res = start_everywhere(env, spec, strict=kw["strict"])
        final_of: Callable[[Followed], dict[str, Any]] = partial(final_everywhere, res)
    else:
        res = start_here(env, spec, strict=kw["strict"])
        final_of = partial(_final_here, res["session"])
    warn_duplicates(res, by_node=env.nodes.remote)
    if not env.json:
        echo_started(res, by_node=env.nodes.remote)
    warn_missing(res["missing_ranks"], by_node=env.nodes.remote)
    if kw["wait_"]:
        started = {n["address"] for n in res["nodes"] if n["state"] == "started"}
        nodes = [n for n in env.nodes.nodes if n.address in started]
        final = final_of(follow(env, res["session"], nodes, kw["timeout"], steps=res["steps"]))
        # The steps actually captured: --next steps move if a rank got them too late.
        res.update(state=final["state"], steps=final["steps"], cycles=final["cycles"])
        res["final"] = final
        if not env.json:
            say(f"session {res['session']}: {final['state']}")
        echo_end(final, by_node=env.nodes.remote)
    if env.json:
        emit_json(res)
    if kw["wait_"] and res["state"] != "done":
        raise SystemExit(1)


def start_here(env: Env, spec: dict[str, Any], strict: bool = False) -> dict[str, Any]:
    """A session on one daemon, which plans it itself; the ``start`` reply with the shape of
    a cluster start's (``nodes``, ``missing_ranks``: --ranks that matched no process).
    ``strict``: such ranks refuse the start; the daemon is asked who matches first."""
    if strict and spec.get("ranks") is not None:
        [probe] = env.gather(C.C_START, spec={**spec, "probe": True}).answered()
        found = [c["rank"] for c in probe.data["candidates"]]
        # No match at all: the start below refuses it, naming what is attached.
        missing = unmatched(spec["ranks"], found) if found else []
        if missing:
            raise unmatched_refusal(missing, "matched no attached process")
    [a] = env.gather(C.C_START, spec=spec).answered()
    res: dict[str, Any] = dict(a.data)
    res["targets"] = [a.node.named(t) for t in res["targets"]]
    name = next((t["node"] for t in a.data["targets"] if t.get("node")), None)
    res["nodes"] = [
        {
            "address": a.node.address,
            "host": name or a.node.address,
            "state": "started",
            "error": None,
        }
    ]
    res["missing_ranks"] = unmatched(spec.get("ranks"), [t["rank"] for t in res["targets"]])
    return res


def _final_here(session: str, followed: Followed) -> dict[str, Any]:
    from profd.ctl.commands.sessions import merge_shown

    return merge_shown(followed.answers, session)


def warn_duplicates(res: dict[str, Any], by_node: bool) -> None:
    """On stderr, also with --json: processes that claim one identity (each is captured, under
    a name of its own, but one of them is probably not what the operator meant)."""
    for d in res.get("duplicates") or []:
        where = f"{d['host']}: " if by_node else ""
        what = claims.note(d["role"], d["rank"], list(zip(d["pids"], d["stems"], strict=True)))
        say(f"profctl: warning: {where}job {d['job']}: {what}", err=True)


def echo_started(res: dict[str, Any], by_node: bool) -> None:
    """The text form of a start (``by_node``: its targets on each node)."""
    by_host: dict[str, list[str]] = {}
    for t in res["targets"]:
        by_host.setdefault(t["host"] if by_node else "", []).append(f"{t['role']}:{t['rank']}")
    on = f"  on {len(by_host)} node(s)" if by_node else ""
    say(f"session {res['session']}  job {res['job']}{on}")
    say(f"steps   {steps_text(res['steps'])}  ({len(res['cycles'])} cycle(s))")
    for host, targets in sorted(by_host.items()):
        say(f"targets {host + ': ' if host else ''}{', '.join(targets)}")
    for n in res["nodes"]:
        if n["state"] != "started":
            say(f"profctl: {n['host']} left out ({n['state']}): {n['error']}", err=True)


def warn_missing(missing: list[int], by_node: bool) -> None:
    """--ranks that matched nothing, on stderr (with --json too: its stdout is the JSON)."""
    if missing:
        where = "are on no answering node" if by_node else "matched no attached process"
        if len(missing) == 1:
            where = where.replace("are", "is")
        them = "it" if len(missing) == 1 else "them"
        say(
            f"profctl: {ranks_text(missing)} {where}: the session runs without {them}"
            " (--strict refuses instead)",
            err=True,
        )
