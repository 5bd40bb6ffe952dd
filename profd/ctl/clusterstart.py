"""``profctl --cluster start``: one plan for every node, one session id, the same steps.

Three rounds over the nodes, each in parallel: ``probe`` (every node's matching targets with
their last step, rate and its age), a plan resolved once here by the daemon's own planner,
then ``start`` with that session id and those absolute cycles, each node limited to the
processes it reported. ``--wait`` then follows every node's copy of the session. Nothing is
retried behind the operator's back: a node that does not answer is named, left out, and the
session's result says ``partial``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from profd import control_schema as C
from profd.ctl.cluster import Node
from profd.ctl.commands.wait import Followed
from profd.ctl.errors import CtlError, unmatched_refusal
from profd.ctl.main import Env
from profd.ctl.nodes import Answer, NodeLike, on_node
from profd.ctl.render import say
from profd.ids import new_session_id
from profd.scheduling import planner
from profd.scheduling import schedule as sch
from profd.scheduling.refusal import Refused
from profd.states import combine, is_terminal
from profd_client import protocol as P
from profd_client.protocol.envelope import ErrorCode
from profd_client.ranks import unmatched


@dataclass
class ClusterPlan:
    """What the coordinator resolved: the session, its steps, and who runs it where."""

    session: str
    job: str
    cycles: list[sch.Cycle]
    #: Each node's planned processes (its own rows, ``host`` as the client sent it).
    targets: dict[NodeLike, list[dict[str, Any]]]
    #: Nodes left out, with why (no answer, or a refusal).
    left_out: dict[str, str] = field(default_factory=dict)
    missing_ranks: list[int] = field(default_factory=list)


def plan_cluster(spec: dict[str, Any], answers: list[Answer]) -> ClusterPlan:
    """The plan from every node's ``probe`` answer (pure but for the session id and clock)."""
    found: list[tuple[NodeLike, dict[str, Any], float]] = []
    left_out: dict[str, str] = {}
    for a in answers:
        if a.ok:
            found += [(a.node, c, a.received_at) for c in a.data["candidates"]]
        elif a.error is not None:
            # The same request fails the same way everywhere (a bad spec, a permission):
            # one line, as on one node.
            raise a.error
        else:
            left_out[a.node.address] = a.why
    if not found:
        raise CtlError("no attached process matches on any answering node", code=ErrorCode.NO_MATCH)
    jobs = sorted({c["job"] for _, c, _ in found})
    if len(jobs) > 1:
        raise CtlError(
            f"selector matches several jobs ({', '.join(jobs)}): add --job", code=ErrorCode.NO_MATCH
        )
    states = [
        planner.TargetState(
            name=f"{c['role']} rank {c['rank']} (pid {c['pid']} on {node.address})",
            step=c["step"],
            sps=c["sps"],
            step_at=received - c["age_s"],
            busy_until=c["busy_until"],
            attaching=c["attaching"],
        )
        for node, c, received in found
    ]
    try:
        sched = sch.parse(spec)
        cycles = planner.plan(
            sched, states, time.monotonic(), spec.get("backend") or P.DEFAULT_BACKEND
        )
    except Refused as exc:
        raise CtlError(str(exc), code=exc.code) from None
    except sch.ScheduleError as exc:
        raise CtlError(str(exc), code=ErrorCode.BAD_REQUEST) from None
    targets: dict[NodeLike, list[dict[str, Any]]] = {}
    for node, c, _ in found:
        targets.setdefault(node, []).append(c)
    return ClusterPlan(
        session=new_session_id(),
        job=jobs[0],
        cycles=cycles,
        targets=targets,
        left_out=left_out,
        # Ranks named by --ranks that no answering node has (a down node's, say).
        missing_ranks=unmatched(spec.get("ranks"), [c["rank"] for _, c, _ in found]),
    )


def start_everywhere(env: Env, spec: dict[str, Any], strict: bool = False) -> dict[str, Any]:
    """Probe, plan, start; the ``start`` reply of a cluster session (``--json`` shape: the
    single-node one plus ``nodes``, ``missing_ranks`` and ``host`` on every target).
    ``strict``: ranks no answering node has refuse the start before any node starts it."""
    p = plan_cluster(spec, _probe(env, spec))
    if strict and p.missing_ranks:
        raise unmatched_refusal(p.missing_ranks, "on no answering node")
    cycles = [list(c) for c in p.cycles]

    def node_spec(node: NodeLike) -> dict[str, Any]:
        pids = sorted(c["pid"] for c in p.targets[node])
        return {
            "spec": {
                **spec,
                "session": p.session,
                "cycles": cycles,
                "pids": pids,
                "nodes": len(p.targets),
            }
        }

    started = env.gather(C.C_START, nodes=list(p.targets), each=node_spec)
    nodes: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    duplicates: list[dict[str, Any]] = []
    for a in started.answers:
        row: dict[str, Any] = {"address": a.node.address, "state": "started", "error": None}
        if a.ok:
            mine = [on_node(dict(t), a.node) for t in a.data["targets"]]
            targets += mine
            row["host"] = mine[0]["host"] if mine else None
            # (An older daemon says nothing of them.)
            duplicates += [on_node(dict(d), a.node) for d in a.data.get("duplicates") or []]
        else:
            row["state"] = "not started"
            row["error"] = str(a.error) if a.error is not None else a.why
        row["host"] = row.get("host") or a.node.address
        nodes.append(row)
    for address, why in p.left_out.items():
        nodes.append({"address": address, "host": address, "state": "no answer", "error": why})
    if not targets:
        raise CtlError("no node started the session: " + "; ".join(str(n["error"]) for n in nodes))
    return {
        "session": p.session,
        "job": p.job,
        "steps": sch.steps_of(p.cycles),
        "cycles": cycles,
        "state": "pending",
        "targets": targets,
        "nodes": nodes,
        "missing_ranks": p.missing_ranks,
        "duplicates": duplicates,
    }


def final_everywhere(res: dict[str, Any], followed: Followed) -> dict[str, Any]:
    """The session's end from every started node's last ``show``: ``done`` only if every
    node and every asked-for rank is, ``partial`` naming what is missing, else ``failed``
    (``cancelled`` if every node cancelled)."""
    last = {a.node.address: a.data for a in followed.answers}
    return _final(res, last, sorted(n.address for n in followed.lost))


def _probe(env: Env, spec: dict[str, Any]) -> list[Answer]:
    """Every node's matching targets, as fresh as the slowest answering node allows."""
    probe = {**spec, "probe": True}
    answers = env.gather(C.C_START, spec=probe).answers
    answered = [a.node for a in answers if a.ok]
    if answered and any(a.failure == "timeout" for a in answers):
        # The plan extrapolates each rank's step from its node's answer at the rank's last
        # rate; after waiting out silent nodes (--node-timeout) that guess is seconds old,
        # and a rank that sped up since would be past the steps before they reach it. Ask
        # the answering nodes again, over the connections just made, and plan from now.
        say(f"profctl: asking the {len(answered)} answering node(s) again", err=True)
        again = env.nodes.ask(C.C_START, {"spec": probe}, answered)
        fresh = {a.node: a for a in again if a.ok}
        answers = [fresh.get(a.node, a) for a in answers]
    return answers


def _final(res: dict[str, Any], last: dict[str, dict[str, Any]], lost: list[str]) -> dict[str, Any]:
    node_by_addr = {n["address"]: n for n in res["nodes"]}
    targets = []
    for addr, s in last.items():
        node = next(n for n in _nodes_of(res) if n.address == addr)
        targets += [on_node(dict(t), node) for t in s["targets"]]
        node_by_addr[addr].update(state=s["state"], error=s.get("error"))
    for addr in lost:
        node_by_addr[addr].update(state="no answer", error=f"{addr} stopped answering")
    missing = [n for n in node_by_addr.values() if n["state"] in ("no answer", "not started")]
    # Every node's last word counts (one that ended before it stopped answering has its
    # traces; one still live then never finished), and so does each part that never ran: a
    # node that did not start or stopped answering, and ranks no node had.
    parts = [s["state"] if is_terminal(s["state"]) else "failed" for s in last.values()]
    parts += ["failed"] * (len(missing) + bool(res["missing_ranks"]))
    state = combine(parts)
    why = [f"{n['host']}: {n['error']}" for n in missing]
    if res["missing_ranks"]:
        why.append(f"ranks {','.join(map(str, res['missing_ranks']))} not found on any node")
    return {
        "id": res["session"],
        "session": res["session"],
        "job": res["job"],
        "state": state,
        "steps": res["steps"],
        "cycles": res["cycles"],
        "targets": targets,
        "nodes": list(node_by_addr.values()),
        "missing_ranks": res["missing_ranks"],
        "error": "; ".join(why) or None,
    }


def _nodes_of(res: dict[str, Any]) -> list[Node]:
    from profd.ctl.cluster import parse_node

    return [parse_node(n["address"]) for n in res["nodes"]]
