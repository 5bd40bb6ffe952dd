"""Hangs (docs/design.md "Hangs"): when a job counts as stalled, what its grouped stacks say,
and one job's hang incidents from several nodes merged into one view. Pure: the daemon (one node)
and profctl (``--cluster``) use the same functions.

A hang incident's evidence keeps, per rank, only the training thread's stack (innermost
frames first, at most :data:`KEEP_FRAMES`): enough to group the ranks again with every other
node's, small enough for the index. ``profctl stacks`` reads every thread, live.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

import msgspec
from msgspec.structs import replace

from profd.watch import flightrec
from profd.watch import stackgroups as sg
from profd.watch.incident_record import is_withheld
from profd.watch.kinds.hang import KIND as HANG
from profd.watch.stackrows import Frame, Group, Member, StackRank, Thread, ranks_of, to_maps

#: The least ``stall_after`` may be by default, and how many of the job's typical steps it
#: waits (docs/design.md: "the larger of 60 s and 20 x the job's median step time").
MIN_STALL_S = 60.0
STALL_STEPS = 20
#: Frames kept of each rank's training thread in an incident: Python frames, and native
#: ones (py-spy --native) beside them.
KEEP_FRAMES = 48
KEEP_NATIVE = 16
#: Hang incidents of one job detected within this many seconds of each other (on any
#: nodes) are one hang: each node notices its own ranks' stall a few seconds apart.
MERGE_S = 300.0


def stall_limit(stall_after: float | None, step_s: float | None) -> float:
    """Seconds without a step after which a job counts as stalled: ``[watch] stall_after``
    when set, else the larger of 60 s and 20 of its typical steps."""
    if stall_after is not None:
        return stall_after
    return max(MIN_STALL_S, STALL_STEPS * (step_s or 0.0))


@dataclass
class _Rank:
    step: int
    since: float  # when its step last changed, or it was first seen
    stepped: bool  # its step was seen to change at least once


class StallClock:
    """One job's ranks on one node: how long since any of them finished a step.

    Fed once a tick with each rank's step as its heartbeats last said (and the rate the
    daemon measured). A job none of whose ranks was seen to step is not judged (loading,
    compiling, or stuck before the daemon started: nothing says how long its steps take);
    a rank that attached since the job's last step counts from its attach."""

    def __init__(self) -> None:
        self.ranks: dict[Hashable, _Rank] = {}
        #: The job's typical step (seconds), measured while it stepped.
        self.step_s: float | None = None

    def observe(self, now: float, ranks: Iterable[tuple[Hashable, int, float]]) -> float | None:
        """``ranks``: (key, step, measured steps/s) of every rank now attached. Seconds
        since the job last stepped here, or None when it cannot be judged."""
        seen = set()
        rates = []
        for key, step, sps in ranks:
            seen.add(key)
            r = self.ranks.get(key)
            if r is None:
                self.ranks[key] = _Rank(step, now, False)
            elif step != r.step:
                r.step, r.since, r.stepped = step, now, True
            if sps > 0:
                rates.append(sps)
        for key in [k for k in self.ranks if k not in seen]:
            del self.ranks[key]
        if rates:  # a stalled rank's measured rate falls to 0 within seconds
            self.step_s = 1.0 / median(rates)
        if not any(r.stepped for r in self.ranks.values()):
            return None
        return now - max(r.since for r in self.ranks.values())


def kept(rank: StackRank) -> StackRank:
    """A rank row as an incident keeps it: who, its source (or why none), and its training
    thread's innermost frames (not how long the read took, nor which daemon listed it)."""
    training = rank.training
    threads = (
        ()
        if training is None
        else (
            Thread(
                name=training.name,
                tid=training.tid,
                frames=_innermost(training.frames),
                training=True,
            ),
        )
    )
    return replace(
        rank,
        threads=threads,
        error=rank.error or None,
        read_ms=None,
        flight=None if rank.flight is None else flightrec.kept(rank.flight),
        flight_error=rank.flight_error or None,
        node=None,
    )


def _innermost(frames: Sequence[Frame]) -> tuple[Frame, ...]:
    out, py, native = [], 0, 0
    for f in frames:
        if f.native:
            native += 1
            if native > KEEP_NATIVE:
                continue
        else:
            py += 1
            if py > KEEP_FRAMES:
                break
        out.append(f)
    return tuple(out)


class Diagnosis(msgspec.Struct, frozen=True, kw_only=True):
    """What a stalled job's ranks say: the ranks outside the majority group (``suspects``),
    the groups (each with ``where``), the ranks as an incident keeps them (:func:`kept`),
    the summary's lines, the verdict a human reads first, and where the ranks' flight
    recorders part (``flightrec.divergence``; None where none is on)."""

    suspects: tuple[Member, ...]
    groups: tuple[Group, ...]
    ranks: tuple[StackRank, ...]
    summary: list[str]
    verdict: str
    flight: flightrec.Divergence | None

    def evidence(self) -> dict[str, Any]:
        """Everything but the suspects (the incident's own field), as a hang incident's
        evidence keeps it: maps, for its JSON."""
        out: dict[str, Any] = to_maps(self)
        del out["suspects"]
        return out


def diagnose(ranks: Sequence[StackRank]) -> Diagnosis:
    """What a stalled job's ranks say (:class:`Diagnosis`)."""
    rows = [kept(r) for r in ranks]
    groups = sg.group(rows)
    flight = flightrec.divergence(rows)
    return Diagnosis(
        suspects=tuple(m for g in groups if not g.majority for m in g.ranks),
        groups=tuple(replace(g, where=sg.where(g.frames)) for g in groups),
        ranks=tuple(rows),
        summary=sg.summary(rows, groups) + flightrec.text(flight),
        verdict=verdict(groups, rows),
        flight=flight,
    )


def verdict(groups: Sequence[Group], rows: Sequence[StackRank]) -> str:
    """One sentence a human reads first."""
    hosts = len({r.host for r in rows}) > 1
    silent = sg.not_answering(rows)
    if not groups:
        return "no rank's stacks could be read: " + (
            "; ".join(sorted({r.error or "no answer" for r in rows})) or "no ranks"
        )
    unread = f"; {sg.label([r.member for r in silent], hosts)} gave no stacks" if silent else ""
    if len(groups) > 1:
        odd = [g for g in groups if not g.majority]
        names = "; ".join(f"{sg.label(g.ranks, hosts)} {sg.where(g.frames)}" for g in odd)
        major = groups[0]
        return f"{names}, while {sg.label(major.ranks, hosts)} {sg.where(major.frames)}" + unread
    only = groups[0]
    where = sg.where(only.frames)
    if silent:
        return f"{sg.label(only.ranks, hosts)} {where}{unread}: no majority to compare with"
    if sg.in_nsys_stop(only.frames):
        return (
            f"every rank is inside cudaProfilerStop while nsys flushes ({where}): nsys holds"
            " the call that ends an nsys capture range until it has written or given up on"
            " its capture, which can take minutes; not a hang of the job. No suspect"
        )
    if sg.waits_for_peers(only.frames):
        return (
            f"every rank here waits for its peers ({where}): the rank they wait for is not"
            " among them (another node: `profctl --cluster incident ID` merges every node's"
            " view)"
        )
    return (
        f"every rank is in the same place and none waits for a peer ({where}): paused on"
        " purpose (a checkpoint, an evaluation)? No suspect"
    )


def _near(incidents: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """One job's hang incidents in runs detected within :data:`MERGE_S` of the previous."""
    runs: list[list[dict[str, Any]]] = []
    for inc in sorted(incidents, key=lambda i: (i["detected_at"], i["host"], i["id"])):
        if runs and inc["detected_at"] - runs[-1][-1]["detected_at"] <= MERGE_S:
            runs[-1].append(inc)
        else:
            runs.append([inc])
    return runs


def merge(incidents: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several nodes' hang incidents of one job (one run of :func:`merged`) as one incident
    of the same shape: every node's ranks grouped together, so a node whose ranks all sit
    elsewhere stands out even though it looked uniform alone. ``hosts`` and ``merged`` (the
    node incidents' ids) are added."""
    first = min(incidents, key=lambda i: (i["detected_at"], i["id"]))
    rows: list[StackRank] = []
    unread = 0
    for inc in incidents:
        maps = (inc.get("evidence") or {}).get("ranks") or ()
        # An older record may name a rank's node only on the incident.
        got = ranks_of(
            {**m, "host": m.get("host") or inc["host"]} if isinstance(m, dict) else m for m in maps
        )
        rows += (r for r in got if r is not None)
        unread += got.count(None)
    diagnosis = diagnose(rows)
    found = diagnosis.evidence()
    suspects: list[Any] = to_maps(diagnosis.suspects)
    if unread:
        # A node's stored rows that are not rank rows (a lying peer, a damaged record):
        # left out of the grouping, and said.
        found["ranks_unread"] = unread
    withheld = [i for i in incidents if is_withheld(i.get("evidence") or {})]
    if withheld:
        # Some nodes' stacks are another user's (``incident.seen_by``): their ranks are not
        # in the grouping, and neither the suspects nor the verdict may be guessed without
        # them; each node's own suspects stand.
        suspects = [s for i in incidents for s in i.get("suspects") or ()]
        found["verdict"] = withheld[0]["evidence"]["verdict"]
        found["withheld"] = True
    evidence = {
        **found,
        "stalled_s": max(float((i.get("evidence") or {}).get("stalled_s") or 0) for i in incidents),
        "nodes": len({i["host"] for i in incidents}),
    }
    steps = [i["step"] for i in incidents if i.get("step") is not None]
    return {
        **first,
        "host": first["host"] if len({i["host"] for i in incidents}) == 1 else "",
        "hosts": sorted({i["host"] for i in incidents}),
        "merged": [i["id"] for i in sorted(incidents, key=lambda i: (i["host"], i["id"]))],
        "suspects": suspects,
        "step": max(steps) if steps else None,
        "evidence": evidence,
        "state": "open" if any(i["state"] == "open" for i in incidents) else "resolved",
        "resolved_at": None
        if any(i["state"] == "open" for i in incidents)
        else max(float(i.get("resolved_at") or 0) for i in incidents),
        "notes": [n for i in incidents for n in i.get("notes") or ()],
        # Each node counts its own ranks: the job's loss is their sum.
        "lost_rank_s": sum(float(i.get("lost_rank_s") or 0.0) for i in incidents),
    }


def merged(incidents: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Incidents from every node, each job's hangs merged (:func:`merge`) where several
    nodes saw the same one; every other incident as it was."""
    out: list[dict[str, Any]] = []
    hangs: dict[str, list[dict[str, Any]]] = {}
    for inc in incidents:
        if inc["kind"] == HANG.name:
            hangs.setdefault(inc["job"], []).append(inc)
        else:
            out.append(inc)
    for job_hangs in hangs.values():
        for run in _near(job_hangs):
            out.append(run[0] if len(run) == 1 else merge(run))
    return out


def merged_with(incident: dict[str, Any], peers: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The merged view of the hang that ``incident`` is part of (``peers``: the job's hang
    incidents from every node, ``incident`` among them)."""
    for run in _near([i for i in peers if i["job"] == incident["job"]]):
        if any(i["id"] == incident["id"] and i["host"] == incident["host"] for i in run):
            return run[0] if len(run) == 1 else merge(run)
    return incident
