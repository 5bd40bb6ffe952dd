"""Rank-seconds an incident cost (``Incident.lost_rank_s``): each kind's formula
(profd.watch.kinds) on synthetic ticks from 2 to 8,192 ranks, its count over the detectors'
ticks from a real step ledger (each step once, none after the incident is resolved), and
its record in a real index across a daemon restart."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from incidentstore import incidents_on
from test_detector_runs import Rig, workers

from profd.config import WatchConfig
from profd.ctl.commands.incidents import lost_text, text
from profd.daemon.watch.incident_store import LOSS_SAVE_S, Incidents
from profd.watch import hang_diagnosis
from profd.watch.incident_record import OPEN, RESOLVED, Incident, Suspect
from profd.watch.kinds import registry as kinds
from profd.watch.kinds.kind import JobTick, RankSteps, no_loss

T0 = 1_800_000_000.0
RANKS = [2, 3, 64, 1024, 8192]


def incident(kind: str, evidence: dict[str, object], suspects: Sequence[Suspect] = ()) -> Incident:
    return Incident(
        id=f"20270115-080000-{kind}-abcdef",
        kind=kind,
        job="train",
        role="worker",
        host="n1",
        suspects=list(suspects),
        detected_at=T0,
        step=100,
        evidence=evidence,
    )


def loss(inc: Incident, ranks: list[RankSteps], at: float = T0 + 1.0) -> float:
    kind = kinds.get(inc.kind)
    assert kind is not None
    return kind.loss(inc, JobTick(at, ranks))


def jittered(n: int, ms: float, steps: int, role: str = "worker", seed: int = 1) -> list[RankSteps]:
    """``n`` ranks stepping ``steps`` times at ``ms`` ± 10 %, symmetric around ``ms``."""
    rng = random.Random(seed)
    out = []
    for r in range(n):
        d = rng.uniform(0.0, 0.1) * ms
        out.append(RankSteps(role, r, ms + d if r % 2 else ms - d, steps))
    if n % 2:  # the middle one exactly at ``ms``: the median is ``ms``
        out[-1] = RankSteps(role, n - 1, ms, steps)
    return out


# --- each kind's formula ---------------------------------------------------------------------
@pytest.mark.parametrize("n", RANKS)
def test_regression_is_the_excess_over_its_baseline_times_steps_times_ranks(n: int) -> None:
    inc = incident("regression", {"baseline_ms": 30.0, "window_ms": 45.0})
    inc.lost_rank_s = 7.0  # what earlier ticks counted
    ranks = jittered(n, 45.0, 22)
    assert loss(inc, ranks) == pytest.approx(7.0 + 0.015 * 22 * n, rel=0.1)
    # Faster than the baseline, or no step in the tick (a pause): nothing added, nothing
    # paid back.
    assert loss(inc, jittered(n, 25.0, 40)) == 7.0
    assert loss(inc, [RankSteps("worker", r, None, 0) for r in range(n)]) == 7.0
    # The resolution's tick has no ranks: nothing more.
    assert loss(inc, []) == 7.0


@pytest.mark.parametrize("n", RANKS)
def test_slow_rank_is_its_excess_times_its_steps_times_the_others_of_its_role(n: int) -> None:
    inc = incident("slow_rank", {"step_ms": 42.0, "peers_ms": 30.0}, [Suspect("n1", "worker", 1)])
    ranks = jittered(n, 30.0, 33)
    ranks[1] = RankSteps("worker", 1, 42.0, 24)
    # Another role's ranks neither wait for it nor are its peers.
    others = [RankSteps("server", r, 300.0, 3) for r in range(4)]
    got = loss(inc, ranks + others)
    assert got == pytest.approx(0.012 * 24 * (n - 1), rel=0.1 if n > 2 else 0.15)
    # It caught up (or is faster): nothing more.
    assert loss(inc, [RankSteps("worker", r, 30.0 - (r == 1), 33) for r in range(n)]) == 0.0


@pytest.mark.parametrize("n", RANKS)
def test_a_straggler_is_the_wait_it_causes_per_step_times_steps_times_ranks_waiting(
    n: int,
) -> None:
    # Two stragglers of one sample: the others wait for the later one, once.
    ev = {"wait_ms": [8.0, 5.0], "lead_ms": [9.0, 6.0], "ranks": n + 2}
    inc = incident("straggler", ev, [Suspect("n1", "worker", 0), Suspect("n1", "worker", 1)])
    got = loss(inc, jittered(n + 2, 40.0, 25))
    assert got == pytest.approx(0.008 * 25 * n)
    assert loss(inc, [RankSteps("server", 0, 40.0, 25)]) == 0.0  # not its role's steps


@pytest.mark.parametrize("n", RANKS)
def test_a_hang_is_how_long_the_job_has_not_stepped_times_its_ranks(n: int) -> None:
    inc = incident("hang", {"stalled_s": 40.0, "ranks_here": n})
    # Detected 40 s after the last step: at the first tick 10 s later, 50 s of every rank.
    assert loss(inc, [], at=T0 + 10.0) == pytest.approx(50.0 * n)
    inc.lost_rank_s, inc.lost_at = 50.0 * n, T0 + 10.0
    assert loss(inc, [], at=T0 + 25.0) == pytest.approx(65.0 * n)
    inc.resolve(T0 + 20.0)
    inc.lost_rank_s, inc.lost_at = 60.0 * n, T0 + 20.0
    assert loss(inc, [], at=T0 + 99.0) == pytest.approx(60.0 * n)  # resolved: final


def test_every_kind_has_a_loss_of_its_own_and_none_from_nothing() -> None:
    for kind in kinds.ALL:
        assert kind.loss is not no_loss, kind.name
        inc = incident(kind.name, {})
        assert kind.loss(inc, JobTick(T0 + 1.0, jittered(4, 30.0, 10))) == 0.0, kind.name


# --- counted over the detectors' ticks, from a real step ledger -------------------------------
def test_a_regression_counts_each_step_once_and_stops_when_resolved(tmp_path: Path) -> None:
    rig = Rig(tmp_path, workers(3))
    rig.run(90, dict.fromkeys(range(3), 30.0))
    for _ in range(60):
        rig.run(1, dict.fromkeys(range(3), 45.0))
        if rig.incidents.held:
            break
    (inc,) = rig.incidents.held.values()
    assert inc.kind == "regression" and inc.state == OPEN
    # The slower pace becomes the rule's baseline: it stops reporting, and after its hold
    # the incident is resolved, although the job is still as slow as it was.
    while inc.state == OPEN:
        rig.run(1, dict.fromkeys(range(3), 45.0))
    assert inc.resolved_at is not None
    ticks = round(inc.resolved_at - inc.detected_at)  # one a second
    assert ticks > 20
    # 45 ms a step, 22 steps a tick per rank: (45 - baseline) ms x 22 x 3 ranks a tick.
    # Counted from the ledger's windows (20 s here, read again every tick) it would be about
    # 20 times as much.
    per_tick = (45.0 - inc.evidence["baseline_ms"]) / 1000.0 * 22 * 3
    assert inc.lost_rank_s == pytest.approx(ticks * per_tick, rel=0.15)
    # Resolved: its loss is final, and in the index as it is in memory.
    final = inc.lost_rank_s
    rig.run(20, dict.fromkeys(range(3), 45.0))
    assert inc.lost_rank_s == final
    row = rig.incidents.store.incident(inc.id)
    assert row is not None and row["lost_rank_s"] == final


def test_a_slow_rank_counts_what_its_peers_waited(tmp_path: Path) -> None:
    rig = Rig(tmp_path, workers(4))
    rig.run(60, {0: 30.0, 1: 42.0, 2: 30.0, 3: 30.0})
    (inc,) = rig.incidents.held.values()
    assert inc.kind == "slow_rank"
    before = inc.lost_rank_s
    rig.run(30, {0: 30.0, 1: 42.0, 2: 30.0, 3: 30.0})
    # 12 ms a step x 24 steps a tick x 3 peers.
    assert inc.lost_rank_s - before == pytest.approx(30 * 0.012 * 24 * 3, rel=0.15)


# --- its record: written now and then, current when read, kept across a restart ----------------
CFG = WatchConfig(window=6.0, baseline=12.0, hold=3.0, cooldown=60.0)


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


def store(tmp_path: Path, clock: Clock) -> Incidents:
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    return incidents_on(tmp_path / "index.db", spool, CFG, clock=clock)


def indexed(incidents: Incidents, iid: str) -> float:
    row = incidents.store.incident(iid)
    assert row is not None
    return float(row["lost_rank_s"])


def test_it_is_written_now_and_then_read_current_and_kept_across_a_restart(
    tmp_path: Path,
) -> None:
    clock = Clock()
    incidents = store(tmp_path, clock)
    inc = incidents.open("regression", "train", "worker", [], 100, {"baseline_ms": 30.0})
    assert inc is not None and inc.lost_rank_s == 0.0
    # 10 ms x 25 steps x 8 ranks: 2 rank-seconds a tick.
    ticks = [RankSteps("worker", r, 40.0, 25) for r in range(8)]

    def tick(n: int) -> None:
        for _ in range(n):
            clock.t += 1.0
            incidents.still("regression", "train")
            incidents.count_loss("train", ticks)
            incidents.tick()

    tick(10)
    assert inc.lost_rank_s == pytest.approx(20.0)
    # Written at its first figure (2.0, the first tick), then not every tick; what the
    # daemon answers is current all the same.
    assert indexed(incidents, inc.id) == pytest.approx(2.0)
    (row,) = incidents.rows()
    assert row["lost_rank_s"] == pytest.approx(20.0)
    assert incidents.find(inc.id)["lost_rank_s"] == pytest.approx(20.0)
    tick(int(LOSS_SAVE_S))
    # Written once it grew and LOSS_SAVE_S passed since it was last written (its first
    # figure, at the first tick).
    assert indexed(incidents, inc.id) == pytest.approx(2.0 * (LOSS_SAVE_S + 1))
    # A daemon stopping writes it as it is; the next one holds it again and goes on.
    incidents.save_open()
    kept = inc.lost_rank_s
    incidents.store.conn.close()
    clock.t += 5.0
    incidents = store(tmp_path, clock)
    assert incidents.restore() == 1
    again = incidents.held[inc.id]
    assert again.state == OPEN and again.lost_rank_s == pytest.approx(kept)
    tick(3)
    assert again.lost_rank_s == pytest.approx(kept + 6.0)
    # Resolved (no longer reported): final, and written at once.
    clock.t += 100.0
    incidents.tick()
    assert again.state == RESOLVED
    final = again.lost_rank_s
    assert indexed(incidents, inc.id) == final
    incidents.count_loss("train", ticks)
    assert again.lost_rank_s == final


def test_a_hang_restored_after_a_restart_counts_the_time_down_and_ends_at_its_step(
    tmp_path: Path,
) -> None:
    clock = Clock()
    incidents = store(tmp_path, clock)
    ev = {"stalled_s": 40.0, "ranks_here": 4}
    inc = incidents.open("hang", "train", "worker", [], 100, ev)
    assert inc is not None
    clock.t += 10.0
    incidents.count_loss("train", [])
    assert inc.lost_rank_s == pytest.approx(50.0 * 4)
    incidents.save_open()
    incidents.store.conn.close()
    # Down for 20 s, the job still stalled; stepping again 5 s after the restart.
    clock.t += 20.0
    incidents = store(tmp_path, clock)
    incidents.restore()
    clock.t += 5.0
    assert incidents.clear("hang", "train")
    done = incidents.held[inc.id]
    assert done.lost_rank_s == pytest.approx(75.0 * 4)
    assert indexed(incidents, inc.id) == pytest.approx(75.0 * 4)
    # Stalled again inside the cooldown: it opens again and counts from then on.
    clock.t += 10.0
    assert incidents.open("hang", "train", "worker", [], 200, ev) is None
    clock.t += 3.0
    incidents.count_loss("train", [])
    assert done.state == OPEN and done.lost_rank_s == pytest.approx(78.0 * 4)


def test_a_record_without_it_reads_as_nothing_counted() -> None:
    inc = incident("slow_rank", {"ratio": 1.4}, [Suspect("n1", "worker", 1)])
    inc.lost_rank_s, inc.lost_at = 12.5, T0 + 3.0
    assert Incident.from_dict(inc.to_dict()) == inc
    old = inc.to_dict()
    del old["lost_rank_s"], old["lost_at"]
    back = Incident.from_dict(old)
    assert back.lost_rank_s == 0.0 and back.lost_at is None


def test_profctl_says_it_in_the_unit_that_reads_best() -> None:
    assert lost_text(6480.0) == "1.8 rank-hours"
    assert lost_text(300.0) == "5.0 rank-minutes"
    assert lost_text(42.4) == "42 rank-seconds"
    assert lost_text(None) == "0 rank-seconds"
    inc = incident("regression", {"baseline_ms": 30.0})
    inc.lost_rank_s = 6480.0
    assert "lost      1.8 rank-hours so far" in text(inc.to_dict())
    inc.resolve(T0 + 60.0)
    assert "lost      1.8 rank-hours\n" in text(inc.to_dict()) + "\n"


def test_a_hang_merged_across_nodes_lost_what_each_node_counted() -> None:
    docs = []
    for host, lost in (("n1", 120.0), ("n2", 80.0)):
        d = incident("hang", {"stalled_s": 40.0, "ranks_here": 2}).to_dict()
        docs.append({**d, "id": f"{d['id']}-{host}", "host": host, "lost_rank_s": lost})
    assert hang_diagnosis.merge(docs)["lost_rank_s"] == 200.0


def test_a_spike_costs_its_excess_once_per_rank_it_held_up() -> None:
    spike = kinds.get("spike")
    assert spike is not None
    ranks = [RankSteps("main", r, 30.0, 30) for r in range(3)]
    alone = incident("spike", {"excess_ms": 5000.0, "spiked": {"worker:1": [5030.0, 30.0]}})
    assert spike.loss(alone, JobTick(1.0, ranks)) == pytest.approx(5.0)  # itself only
    together = incident("spike", {"excess_ms": 5000.0, "spiked": {"main:0": [], "main:1": []}})
    assert spike.loss(together, JobTick(1.0, ranks)) == pytest.approx(15.0)  # lockstep
    # Only one rank's long step reached the rule first; its black box shows the others
    # waited for one rank: every rank of the job here lost the excess, and no tick adds more.
    first = incident("spike", {"excess_ms": 5000.0, "spiked": {"main:0": []}})
    assert spike.loss(first, JobTick(1.0, ranks)) == pytest.approx(5.0)
    first.lost_rank_s = 5.0
    first.evidence["blackbox"] = {"held_up_by": [{"role": "main", "rank": 1}], "ranks_held": 3}
    first.lost_rank_s = spike.loss(first, JobTick(2.0, ranks))
    assert first.lost_rank_s == pytest.approx(15.0)
    assert spike.loss(first, JobTick(3.0, ranks)) == pytest.approx(15.0)
