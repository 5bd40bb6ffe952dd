"""What the black boxes frozen into an incident show about it: per rank, the slowest step near
the incident's step and where its time went; the step where the job's step time changed (a
regression's onset); and, when several ranks' steps were long together, which of them held
the others up.

In a lockstep job a rank that stalls makes every rank's step long: the others wait for it in a
collective (a DDP all-reduce runs inside ``backward``, so a Python stack shows only that).
The stack samples of the long step tell them apart: a rank whose samples in it sit mostly in a
collective waited; one whose samples sit elsewhere (a data loader, a checkpoint write, a sleep)
is what the others waited for.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from profd.blackbox.box import label, steps_of
from profd.blackbox.summary import slowest
from profd.watch.kinds import registry as kinds
from profd.watch.stackgroups import waits_for_peers
from profd.watch.stackrows import Frame

#: Steps before the incident's step searched for its slowest step (a rule reports a few
#: heartbeats after the step, and the job's step count has moved on by then).
LOOK_BACK = 256
#: Steps a rolling median spans when looking for where the step time changed.
ROLLING = 8
#: Steps from a change's first step that must mostly be slow too: a burst shorter than half
#: of it is not where the step time changed.
SUSTAINED = 4 * ROLLING
#: Ranks an incident's evidence keeps (the slowest first); the trace has them all.
KEEP_RANKS = 16


def _frame(text: str) -> Frame:
    # Frames are kept as "function (file:line)".
    function, _, rest = text.partition(" (")
    file = rest.rsplit(":", 1)[0] if rest else ""
    return Frame(function, file)


def waited(box: dict[str, Any], step: int) -> bool | None:
    """Whether most of ``box``'s samples in ``step`` wait for peers (None: no sample)."""
    inside = waits = 0
    for _t, s, sid in box["samples"]:
        if s != step or sid < 0:
            continue
        inside += 1
        frames = [_frame(box["frames"][f]) for f in box["stacks"][sid]]
        waits += waits_for_peers(frames)
    return None if not inside else waits * 2 > inside


def _rank(box: dict[str, Any], step: int | None) -> dict[str, Any] | None:
    steps = steps_of(box)
    if not steps:
        return None
    near = steps if step is None else [s for s in steps if step - LOOK_BACK <= s[0] <= step]
    near = near or steps
    s, start, end = max(near, key=lambda x: x[2] - x[1])
    out = slowest(box, s, start, end)
    out.update(
        name=label(box),
        role=box.get("role"),
        rank=box.get("rank"),
        host=box.get("host"),
        median_s=round(statistics.median(e - b for _, b, e in steps), 6),
        waited=waited(box, s),
    )
    return out


def change_step(box: dict[str, Any], ratio: float) -> dict[str, Any] | None:
    """The first step from which the rolling median of ``box``'s step times stays above its
    first quarter's median by half of ``ratio``'s rise (the median of the next
    :data:`SUSTAINED` steps above it too, all of them in the box); None when it never
    does."""
    steps = steps_of(box)
    times = [e - b for _, b, e in steps]
    if len(times) < 4 * SUSTAINED // 3:
        return None
    before = statistics.median(times[: len(times) // 4])
    bar = before * (1.0 + max(0.05, (ratio - 1.0) / 2.0))
    # Only where a whole SUSTAINED span follows: a burst in the box's last steps would
    # otherwise be all of a short span (a regression is reported long after its onset).
    for i in range(len(times) // 4, len(times) - SUSTAINED + 1):
        # Stays above: the steps of a longer span from here are mostly slow too. A burst
        # of slow steps (a neighbour's work on a shared machine) crosses the bar and falls
        # back; taking it would put the onset hundreds of steps before the real one.
        if (
            statistics.median(times[i : i + ROLLING]) > bar
            and statistics.median(times[i : i + SUSTAINED]) > bar
        ):
            after = statistics.median(times[i:])
            return {
                "step": steps[i][0],
                "before_ms": round(before * 1e3, 3),
                "after_ms": round(after * 1e3, 3),
            }
    return None


def onset(
    boxes: Sequence[dict[str, Any]], step: int | None, kind: str, ratio: float = 1.0
) -> dict[str, Any]:
    """What ``boxes`` show around ``step`` for an incident of ``kind``."""
    ranks = [r for r in (_rank(b, step) for b in boxes) if r is not None]
    out: dict[str, Any] = {"ranks": ranks}
    long = [r for r in ranks if r["median_s"] and r["seconds"] >= 2 * r["median_s"]]
    if len(long) > 1:
        held = [r for r in long if r["waited"] is False]
        if held and len(held) < len(long):
            out["held_up_by"] = [
                {"host": r["host"], "role": r["role"], "rank": r["rank"]} for r in held
            ]
    if kinds.known(kind).job_changed:
        changes = [c for c in (change_step(b, ratio) for b in boxes) if c is not None]
        # A regression slows every rank of the job: a change seen by fewer than half of the
        # boxes is those ranks' own noise, and of the ranks that see it the median onset
        # is the job's (the earliest one is whichever rank had a burst just before it; of
        # two, the later: a burst makes a rank's onset early, nothing makes it late).
        if changes and 2 * len(changes) >= len(boxes):
            changes.sort(key=lambda c: c["step"])
            out["change"] = changes[len(changes) // 2]
    out["paragraph"] = paragraph(out)
    out["ranks_held"] = len(ranks)
    out["ranks"] = sorted(ranks, key=lambda r: -r["seconds"])[:KEEP_RANKS]
    return out


def paragraph(doc: dict[str, Any]) -> str:
    """The black box in a few sentences, as ``profctl incident`` shows it."""
    parts = []
    change = doc.get("change")
    if change:
        parts.append(
            f"Step times rose at step {change['step']}: {change['before_ms']:.1f} ms before,"
            f" {change['after_ms']:.1f} ms after."
        )
    for r in sorted(doc["ranks"], key=lambda r: -r["seconds"])[:4]:
        where = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in list(r["regions"].items())[:3])
        text = (
            f"{r['name']}: slowest step {r['step']} took {r['seconds'] * 1e3:.0f} ms"
            f" (median {r['median_s'] * 1e3:.1f} ms)"
        )
        if where:
            text += f", in {where}"
        if r["frames"]:
            f = r["frames"][0]
            seen = "" if f["elsewhere"] is None else f", {f['elsewhere']:.0%} of other steps"
            text += f"; sampled mostly in {f['frame']} ({f['share']:.0%} of it{seen})"
        if r["waited"]:
            text += "; waiting for its peers"
        parts.append(text + ".")
    held = doc.get("held_up_by")
    if held:
        who = ", ".join(f"{h['role']} rank {h['rank']}" for h in held)
        parts.append(f"The others waited for {who}.")
    if len(doc["ranks"]) > 4:
        parts.append(f"({len(doc['ranks']) - 4} more ranks in the trace.)")
    return " ".join(parts) or "The black box holds no steps."
