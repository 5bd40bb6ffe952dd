"""The detectors on the loop (profd.daemon.watch.detector_runs) fed by a real step ledger from
synthetic heartbeats, one a second per rank, opening real incidents (SQLite, spool)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import msgspec
from incidentstore import incidents_on
from test_daemon_ledger import Clock, client, ledger

from profd.config import WatchConfig
from profd.daemon.clients.ledger import Ledgers
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.watch.detector_runs import Detectors
from profd.store.index import Database
from profd.watch.kinds import registry, regression, spike
from profd.watch.kinds.kind import Kind

CFG = WatchConfig(window=20.0, baseline=60.0, hold=10.0, cooldown=600.0)


class Rig:
    def __init__(self, tmp_path: Path, clients: list[Client], cfg: WatchConfig = CFG,
                 kinds: Sequence[Kind] = registry.ALL) -> None:  # fmt: skip
        self.unix = Clock(1_800_000_000.0)
        self.mono = 1000.0
        self.clients = clients
        self.ledgers = Ledgers(self.unix)
        spool = tmp_path / "spool"
        spool.mkdir()
        db = Database(tmp_path / "index.db")
        self.incidents = incidents_on(db, spool, cfg, clock=self.unix)
        self.registry = Registry()
        for c in clients:
            self.registry.add(c)
        self.detectors = Detectors(
            self.ledgers, self.registry, self.incidents, cfg.rules(), kinds=kinds
        )
        self.rng = random.Random(7)
        #: Tick in slices (as the loop does), counting them; else all at once.
        self.slices: list[int] | None = None
        self.steps = {c.key: 0 for c in clients}
        self.epochs = {c.key: 0 for c in clients}
        #: Seconds between a rank's heartbeats (the daemon's heartbeat pace); each rank at
        #: a phase of its own, as paced clients are.
        self.hb_every = 1

    def attach(self, c: Client) -> None:
        self.clients.append(c)
        self.registry.add(c)
        self.steps[c.key] = 0
        self.epochs[c.key] = 0

    def run(self, seconds: int, step_ms: dict[int, float], jitter: float = 0.1,
            wait_ms: dict[int, float] | None = None) -> None:  # fmt: skip
        """``seconds`` ticks; rank r's steps take ``step_ms[r]`` ± ``jitter``; with
        ``wait_ms``, its ledgers say it waits that long a step in collectives (± ``jitter``
        of the step)."""
        every = self.hb_every
        for _ in range(seconds):
            self.mono += 1.0
            self.unix.t += 1.0
            for c in self.clients:
                if (round(self.mono) + c.rank) % every:
                    continue  # paced: not this rank's second
                base = step_ms[c.rank] / 1000.0
                n = max(1, round(every / base))
                ds = [base * (1 + self.rng.uniform(-jitter, jitter)) for _ in range(n)]
                self.steps[c.key] += n
                c.step = self.steps[c.key]
                msg = ledger(ds, c.step, epoch=self.epochs[c.key])
                if wait_ms is not None:
                    w = sum(max(0.0, wait_ms[c.rank] / 1000.0 + self.rng.uniform(
                        -jitter, jitter) * base) for _ in range(n))  # fmt: skip
                    msg = msgspec.structs.replace(msg, wait=(w, n))
                self.ledgers.heartbeat(c, c.step, msg, self.mono)
            if self.slices is None:
                self.detectors.tick(self.mono)
            else:
                self.slices.append(sum(1 for _ in self.detectors.slices(self.mono)) + 1)
            self.incidents.tick()

    def found(self) -> list[tuple[str, list[int]]]:
        return sorted(
            (r["kind"], [s["rank"] for s in r["suspects"]]) for r in self.incidents.rows()
        )


def workers(n: int) -> list[Client]:
    return [client(rank=r, pid=100 + r, role="worker") for r in range(n)]


def test_a_steady_jittery_job_yields_nothing(tmp_path: Path) -> None:
    rig = Rig(tmp_path, workers(4))
    rig.run(400, dict.fromkeys(range(4), 30.0))
    assert rig.found() == []


def test_a_slow_worker_is_one_slow_rank_incident(tmp_path: Path) -> None:
    rig = Rig(tmp_path, workers(3))
    rig.run(100, {0: 30.0, 1: 42.0, 2: 30.0})
    assert rig.found() == [("slow_rank", [1])]
    (inc,) = rig.incidents.rows()
    assert inc["state"] == "open" and 1.3 < inc["evidence"]["ratio"] < 1.5
    # It catches up: the incident is resolved, and nothing else is opened.
    rig.run(60, dict.fromkeys(range(3), 30.0))
    (inc,) = rig.incidents.rows()
    assert inc["state"] == "resolved"


def test_the_detectors_run_the_rule_of_each_kind_they_are_given_and_no_other(
    tmp_path: Path,
) -> None:
    """Which rules run is the kinds' business: without ``slow_rank`` among them, a slow worker
    that the registry's kinds name (the test above) is nobody's finding."""
    (tmp_path / "without").mkdir()
    rig = Rig(tmp_path / "without", workers(3), kinds=(regression.KIND, spike.KIND))
    rig.run(100, {0: 30.0, 1: 30.0, 2: 42.0})
    assert rig.found() == []
    assert {name for name, _ in rig.detectors.jobs["j"].rules} == {"regression", "spike"}
    (tmp_path / "with").mkdir()
    rig = Rig(tmp_path / "with", workers(3))
    rig.run(100, {0: 30.0, 1: 30.0, 2: 42.0})
    assert rig.found() == [("slow_rank", [2])]


def test_a_pass_over_many_ranks_comes_in_slices_and_finds_the_same(tmp_path: Path) -> None:
    """The loop answers operators between slices of a pass; a pass in slices must decide
    exactly what one whole pass decides."""
    from profd.daemon.watch.detector_runs import SLICE
    from profd.watch.kinds.registry import ALL

    n = 2 * SLICE + 44
    tick_rules = sum(1 for k in ALL if k.tick_rule is not None)
    found = []
    for sliced in (False, True):
        (tmp_path / str(sliced)).mkdir()
        rig = Rig(tmp_path / str(sliced), workers(n))
        if sliced:
            rig.slices = []
        rig.run(100, {r: 42.0 if r == 7 else 30.0 for r in range(n)})
        found.append(rig.found())
        if rig.slices is not None:
            # Three slices of ranks (SLICE, SLICE, 44), then each kind's rule in one of its own.
            assert set(rig.slices) == {3 + tick_rules}, rig.slices
    assert found[0] == found[1] == [("slow_rank", [7])]


def test_a_job_that_slows_down_on_every_rank_is_one_regression(tmp_path: Path) -> None:
    rig = Rig(tmp_path, workers(3))
    rig.run(90, dict.fromkeys(range(3), 30.0))
    assert rig.found() == []
    slower_from = max(rig.steps.values())
    rig.run(60, dict.fromkeys(range(3), 45.0))
    assert rig.found() == [("regression", [])]
    (inc,) = rig.incidents.rows()
    assert 1.4 < inc["evidence"]["ratio"] < 1.6
    assert slower_from < inc["step"] < max(rig.steps.values())  # the job's step then


def test_a_step_count_jump_starts_the_baseline_again(tmp_path: Path) -> None:
    rig = Rig(tmp_path, workers(3))
    rig.run(90, dict.fromkeys(range(3), 30.0))
    # The job resumes from a checkpoint: step(n) on every rank, and its steps are slower
    # from then on (another phase of training): no baseline to compare them with.
    for c in rig.clients:
        rig.epochs[c.key] += 1
        rig.steps[c.key] += 100_000
    rig.run(25, dict.fromkeys(range(3), 45.0))
    assert rig.found() == []


def test_a_rank_alone_in_its_role_and_a_late_rank_fire_nothing(tmp_path: Path) -> None:
    clients = [*workers(2), client(rank=5, pid=200, role="learner")]
    rig = Rig(tmp_path, clients)
    # The learner is alone in its role: no peers to compare with, however slow.
    rig.run(60, {0: 30.0, 1: 30.0, 5: 300.0})
    rig.attach(client(rank=2, pid=102, role="worker"))
    rig.run(60, {0: 30.0, 1: 30.0, 2: 30.0, 5: 300.0})
    assert rig.found() == []


def test_processes_of_another_uid_than_the_jobs_owner_decide_nothing(tmp_path: Path) -> None:
    # The owner's ranks 0-2 step alike; two processes of another uid join the job as ranks
    # 3 and 4 claiming 5 ms steps. Judged with them, the owner's ranks are six times slower
    # than their role.
    owners = [client(rank=r, pid=100 + r, role="worker") for r in (0, 1, 2)]
    others = [client(rank=r, pid=100 + r, role="worker") for r in (3, 4)]
    for c in owners:
        c.uid = 1001
    for c in others:
        c.uid = 1002
    rig = Rig(tmp_path, [*owners, *others])
    assert [rig.registry.owned(c) for c in rig.clients] == [True] * 3 + [False] * 2
    rig.run(100, {0: 30.0, 1: 30.0, 2: 30.0, 3: 5.0, 4: 5.0})
    assert rig.found() == []
    # A real slow rank of the owner's is still found.
    rig.run(100, {0: 30.0, 1: 45.0, 2: 30.0, 3: 5.0, 4: 5.0})
    assert rig.found() == [("slow_rank", [1])]


def _stall(rig: Rig, stalled: set[int], seconds: float, step_ms: float) -> None:
    """One tick of ``seconds``: the ranks in ``stalled`` end one step that long, the others
    their usual steps (a lockstep job: every rank in ``stalled``)."""
    rig.mono += seconds
    rig.unix.t += seconds
    for c in rig.clients:
        if c.rank in stalled:
            ds = [seconds]
        else:
            ds = [step_ms / 1000.0] * round(seconds * 1000.0 / step_ms)
        rig.steps[c.key] += len(ds)
        c.step = rig.steps[c.key]
        rig.ledgers.heartbeat(c, c.step, ledger(ds, c.step), rig.mono)
    rig.detectors.tick(rig.mono)
    rig.incidents.tick()


def test_a_five_second_stall_of_one_rank_is_one_spike_naming_it(tmp_path: Path) -> None:
    rig = Rig(tmp_path, workers(3))
    rig.run(30, {0: 100.0, 1: 100.0, 2: 100.0})
    _stall(rig, {1}, 5.0, 100.0)
    rig.run(30, {0: 100.0, 1: 100.0, 2: 100.0})
    assert rig.found() == [("spike", [1])]
    (inc,) = rig.incidents.rows()
    assert inc["evidence"]["step_ms"] == 5000.0
    assert 90.0 <= inc["evidence"]["median_ms"] <= 110.0
    # Its cost: the excess over the median, for the one rank that sat it out.
    assert 4.85 <= inc["lost_rank_s"] <= 4.95


def test_a_lockstep_stall_names_every_rank_that_waited_in_one_incident(tmp_path: Path) -> None:
    rig = Rig(tmp_path, workers(3))
    rig.run(30, {0: 100.0, 1: 100.0, 2: 100.0})
    _stall(rig, {0, 1, 2}, 5.0, 100.0)
    rig.run(5, {0: 100.0, 1: 100.0, 2: 100.0})
    _stall(rig, {0, 1, 2}, 5.0, 100.0)  # inside the cooldown: the same incident again
    assert rig.found() == [("spike", [0, 1, 2])]
    (inc,) = rig.incidents.rows()
    assert 3 * 4.85 <= inc["lost_rank_s"] <= 3 * 4.95  # one spike's worth, not one a tick


def test_a_slow_job_with_long_steps_has_no_spike_at_four_times_its_median(tmp_path: Path) -> None:
    rig = Rig(tmp_path, workers(2))
    rig.run(60, {0: 500.0, 1: 500.0})
    _stall(rig, {0}, 2.0, 500.0)  # 4x: under the threshold, 1.5 s over: not enough alone
    assert rig.found() == []


def test_in_lockstep_the_rank_the_others_wait_for_is_one_slow_rank_incident(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path, workers(3))
    # Every step as long as the slowest rank's: the step times never differ, the waits do.
    rig.run(60, dict.fromkeys(range(3), 40.0), 0.02, wait_ms=dict.fromkeys(range(3), 13.0))
    assert rig.found() == []  # steady waits, every rank waiting alike: nothing
    rig.run(60, dict.fromkeys(range(3), 40.0), 0.02, wait_ms={0: 13.0, 1: 2.0, 2: 13.0})
    assert rig.found() == [("slow_rank", [1])]
    (inc,) = rig.incidents.rows()
    ev = inc["evidence"]
    assert ev["by"] == "wait" and ev["wait_ms"] < 4.0 < 10.0 < ev["peers_wait_ms"], ev
    assert abs(ev["step_ms"] - 40.0) < 2.0 and ev["waited"] >= 0.2, ev


def test_without_every_rank_s_wait_a_lockstep_job_yields_nothing(tmp_path: Path) -> None:
    rig = Rig(tmp_path, workers(3))
    rig.run(60, dict.fromkeys(range(3), 40.0), 0.02)  # no wait at all: samples' business
    rig.run(60, dict.fromkeys(range(3), 40.0), 0.02, wait_ms={0: 13.0, 1: 2.0, 2: 13.0})
    assert rig.found() == [("slow_rank", [1])]


#: A node past ``[daemon] max_heartbeats_per_s`` at 1 s: its ranks heartbeat every 4 s, each
#: at its own phase, so a tick hears from a quarter of them (profd/daemon/agent/pace.py).
PACED_RANKS, PACED_EVERY = 300, 4


def paced_rig(tmp_path: Path) -> Rig:
    rig = Rig(tmp_path, workers(PACED_RANKS))
    rig.hb_every = PACED_EVERY
    return rig


def test_paced_heartbeats_of_a_steady_jittery_job_yield_nothing(tmp_path: Path) -> None:
    rig = paced_rig(tmp_path)
    rig.run(400, dict.fromkeys(range(PACED_RANKS), 30.0))
    assert rig.found() == []


def test_paced_heartbeats_still_name_one_slow_rank(tmp_path: Path) -> None:
    rig = paced_rig(tmp_path)
    rig.run(100, {r: 42.0 if r == 7 else 30.0 for r in range(PACED_RANKS)})
    assert rig.found() == [("slow_rank", [7])]


def test_paced_heartbeats_still_show_a_job_slowing_on_every_rank(tmp_path: Path) -> None:
    rig = paced_rig(tmp_path)
    rig.run(90, dict.fromkeys(range(PACED_RANKS), 30.0))
    assert rig.found() == []
    rig.run(60, dict.fromkeys(range(PACED_RANKS), 45.0))
    assert rig.found() == [("regression", [])]
    (inc,) = rig.incidents.rows()
    assert 1.4 < inc["evidence"]["ratio"] < 1.6
