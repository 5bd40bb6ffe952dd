"""An incident's black box frozen by a real daemon, with a rank that keeps none, and a daemon
killed between collecting the black box and writing it.

One raw peer (tests/rawpeer.py) speaks the agent protocol without a black box: 100 ms steps,
then one of 5 s, a ``spike``. The incident names the rank's missing black box instead of
waiting for it; a daemon killed (``PROFD_FAULT_KILL=blackbox-collected``) after collecting
keeps the incident it had stored and leaves no trace file, whole or half.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from harness import Daemon, wait_for
from rawpeer import HELLO, dealer, pack, reply

from profd_client import protocol as P

pytestmark = pytest.mark.xdist_group("blackbox_freeze")

WAIT = 60.0


def _ledger(durations: list[float], at: int) -> dict[str, Any]:
    s = sorted(durations)
    b = [0] * (len(P.STEP_BUCKETS) + 1)
    for x in durations:
        b[sum(1 for edge in P.STEP_BUCKETS if edge < x)] += 1
    q = [s[len(s) // 2], s[int(0.9 * len(s))], s[-1], s[-1]]
    return {"at": at, "n": len(s), "sum": sum(s), "q": q, "b": b, "r": [], "epoch": 0}


#: The step a :func:`spike` rank is at once it has sent its spike.
SPIKED_AT = 41


def spike(ctx: zmq.Context, d: Daemon, job: str) -> zmq.Socket:
    """A rank of ``job`` that steps every 100 ms for 40 steps, then once in 5 s."""
    a = dealer(ctx, d, "agent.sock")
    a.send(pack({**HELLO, "v": P.VERSION, "job": job}))
    assert reply(a, 10_000)["t"] == "welcome"
    step = 0
    for _ in range(8):
        step += 5
        a.send(pack({"v": P.VERSION, "t": P.HEARTBEAT, "step": step,
                     "ledger": _ledger([0.1] * 5, step)}))  # fmt: skip
        time.sleep(0.3)
    step += 1
    assert step == SPIKED_AT
    a.send(pack({"v": P.VERSION, "t": P.HEARTBEAT, "step": step, "ledger": _ledger([5.0], step)}))
    return a


def alive(a: zmq.Socket) -> None:
    """One more heartbeat from a :func:`spike` rank, at its step.

    The rank lives on, as a real one's agent thread does: with its heartbeats stopped, a
    loaded host could drop it as dead (3 missed) before the spike's incident opened, and an
    incident with no rank of its job attached freezes nothing.
    """
    # Never blocks: once the daemon is gone there may be no peer to queue for.
    with contextlib.suppress(zmq.Again):
        a.send(pack({"v": P.VERSION, "t": P.HEARTBEAT, "step": SPIKED_AT}), zmq.NOBLOCK)


def spikes(d: Daemon, job: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = d.ctl_json("incidents", "--job", job, "--kind", "spike")
    return rows


def files(d: Daemon, job: str) -> list[str]:
    folder = d.spool / job / "incidents"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_rank_without_a_black_box_is_named_not_waited_for(
    daemon_factory: Callable[..., Daemon], ctx: zmq.Context
) -> None:
    d = daemon_factory()
    a = spike(ctx, d, "nobox")

    def frozen() -> dict[str, Any] | None:
        alive(a)
        rows = spikes(d, "nobox")
        return rows[0] if rows and "blackbox" in rows[0]["evidence"] else None

    try:
        inc = wait_for(frozen, WAIT, "the spike's black box")
    except AssertionError as exc:
        every = d.ctl_json("incidents", "--job", "nobox")
        tail = d.log.read_text(errors="replace")[-4000:]
        raise AssertionError(f"{exc}\nincidents: {every}\ndaemon log:\n{tail}") from None
    bb = inc["evidence"]["blackbox"]
    assert bb["ranks_held"] == 0 and bb["collect_s"] < 1.0, bb
    [(missing)] = bb["missing"]
    assert missing["rank"] == 0 and "keeps no black box" in missing["why"], missing
    assert files(d, "nobox") == [f"{inc['id']}.blackbox.json.gz", f"{inc['id']}.json"]
    a.close(0)


def test_a_daemon_killed_while_freezing_keeps_the_incident_and_no_half_file(
    daemon_factory: Callable[..., Daemon], ctx: zmq.Context, tmp_path: Path
) -> None:
    d = daemon_factory(PROFD_FAULT_KILL="blackbox-collected")
    a = spike(ctx, d, "killed")
    assert d.proc is not None
    proc = d.proc
    # killed by its own fault point, once the black box was collected
    wait_for(lambda: alive(a) or proc.poll() is not None, WAIT, "the daemon's fault point")
    d.proc = None
    a.close(0)
    d.extra_env.pop("PROFD_FAULT_KILL")
    d.start()
    [inc] = spikes(d, "killed")
    assert inc["state"] == "open" and "blackbox" not in inc["evidence"], inc
    assert files(d, "killed") == [f"{inc['id']}.json"]  # no trace, and no temporary left
