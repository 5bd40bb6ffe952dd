"""The training-thread step counter and armed sessions (``client/profd_client/steps.py``).

No threads and no daemon: the test plays the agent thread (``post``) and the training loop
(``tick``) in turn, and reads what the Stepper would send from its outbox. The Stepper has no
clock of its own: its time is the step count, driven here one ``tick`` at a time.

torch is replaced by a test double (``TorchDouble``) so the real ``TorchCapture`` and
``NsysRange`` run against it and the tests can see, for each global step, whether the
profiler was warming up or recording, and what was written.
"""

from __future__ import annotations

import enum
import json
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from profd_client import capture as capture_mod
from profd_client.steps import NEVER, ArmedSession, Stepper

#: next_event while no plan is held: no boundary for the rest of the run.
IDLE = NEVER - 1


# --- the torch double ---------------------------------------------------------------------------
class ProfilerAction(enum.Enum):
    NONE = 0
    WARMUP = 1
    RECORD = 2
    RECORD_AND_SAVE = 3


class ProfilerActivity(enum.Enum):
    CPU = 0
    CUDA = 1


W, R = ProfilerAction.WARMUP, ProfilerAction.RECORD


class ProfileDouble:
    """Stands in for ``torch.profiler.profile``: follows the schedule the way torch does
    (``schedule(step_num)`` at construction and after every ``step()``) and records which
    action was in force during each global step number."""

    def __init__(self, torch: TorchDouble, *, schedule: Callable[[int], Any], **kw: Any) -> None:
        self.torch = torch
        self.schedule = schedule
        self.kwargs = kw
        self.step_num = 0
        self.current = schedule(self.step_num)
        self.phases: dict[int, ProfilerAction] = {}
        self.started = self.stopped = False
        self.exported: list[str] = []
        torch.profiles.append(self)

    def start(self) -> None:
        if self.torch.fail_start:
            raise RuntimeError("profiler busy (double)")
        self.started = True
        self.phases[self.step_num] = self.current

    def step(self) -> None:
        if self.torch.fail_step:
            raise RuntimeError("step failed (double)")
        assert self.started and not self.stopped
        self.step_num += 1
        self.current = self.schedule(self.step_num)
        self.phases[self.step_num] = self.current

    def stop(self) -> None:
        assert self.started and not self.stopped, "stopped twice"
        self.stopped = True

    def export_chrome_trace(self, path: str) -> None:
        assert self.stopped
        Path(path).write_text(json.dumps({"traceEvents": [], "steps": sorted(self.phases)}))
        self.exported.append(path)

    def recorded(self) -> list[int]:
        return [s for s, a in sorted(self.phases.items()) if a == R]

    def warmed(self) -> list[int]:
        return [s for s, a in sorted(self.phases.items()) if a == W]


class TorchDouble:
    """The parts of ``torch`` that profd_client touches, as modules in ``sys.modules``."""

    def __init__(self) -> None:
        self.profiles: list[ProfileDouble] = []
        self.regions: list[str] = []  # record_function names entered
        self.nvtx: list[str] = []  # "push NAME" / "pop"
        self.cuda_profiler: list[str] = []  # "start" / "stop"
        self.fail_start = False
        self.fail_step = False
        self.cuda = False

        torch = types.ModuleType("torch")
        torch.__version__ = "0.0+double"  # type: ignore[attr-defined]
        double = self

        class record_function:  # torch's name
            def __init__(self, name: str) -> None:
                self.name = name
                self.run_callbacks_on_exit = True
                self.record = None

            def __enter__(self) -> record_function:
                double.regions.append(self.name)
                return self

            def __exit__(self, *exc: object) -> None:
                return None

        profiler = types.ModuleType("torch.profiler")
        profiler.ProfilerAction = ProfilerAction  # type: ignore[attr-defined]
        profiler.ProfilerActivity = ProfilerActivity  # type: ignore[attr-defined]
        profiler.profile = lambda **kw: ProfileDouble(self, **kw)  # type: ignore[attr-defined]
        profiler.record_function = record_function  # type: ignore[attr-defined]
        autograd = types.ModuleType("torch.autograd")
        autograd_profiler = types.ModuleType("torch.autograd.profiler")
        autograd_profiler.record_function = record_function  # type: ignore[attr-defined]
        autograd.profiler = autograd_profiler  # type: ignore[attr-defined]
        cuda = types.ModuleType("torch.cuda")
        cuda.is_available = lambda: self.cuda  # type: ignore[attr-defined]
        cuda.is_initialized = lambda: False  # type: ignore[attr-defined]
        cuda.synchronize = lambda: None  # type: ignore[attr-defined]
        cuda.nvtx = types.SimpleNamespace(  # type: ignore[attr-defined]
            range_push=lambda name: self.nvtx.append(f"push {name}"),
            range_pop=lambda: self.nvtx.append("pop"),
        )
        cuda_profiler = types.ModuleType("torch.cuda.profiler")
        cuda_profiler.start = lambda: self.cuda_profiler.append("start")  # type: ignore[attr-defined]
        cuda_profiler.stop = lambda: self.cuda_profiler.append("stop")  # type: ignore[attr-defined]
        cuda.profiler = cuda_profiler  # type: ignore[attr-defined]
        torch.profiler = profiler  # type: ignore[attr-defined]
        torch.autograd = autograd  # type: ignore[attr-defined]
        torch.cuda = cuda  # type: ignore[attr-defined]
        self.modules = {
            "torch": torch,
            "torch.profiler": profiler,
            "torch.autograd": autograd,
            "torch.autograd.profiler": autograd_profiler,
            "torch.cuda": cuda,
            "torch.cuda.profiler": cuda_profiler,
        }

    @property
    def last(self) -> ProfileDouble:
        return self.profiles[-1]


@pytest.fixture
def torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[TorchDouble]:
    double = TorchDouble()
    for name, mod in double.modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    yield double
    # A test that failed mid-capture must not leave the double's record_function patched
    # into capture.py's module state for later tests in this process.
    capture_mod._scopes.uninstall()


# --- helpers ---------------------------------------------------------------------------------
class Run:
    """One Stepper and what it sent."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.notified = 0
        self.st = Stepper("main-r0", self._notify)
        self.sent: list[dict[str, Any]] = []

    def _notify(self) -> None:
        self.notified += 1

    def armed(
        self,
        session: str,
        *cycles: tuple[int, int, int],
        revision: int = 0,
        region: str | None = None,
        backend: str = "torch",
        options: dict[str, Any] | None = None,
    ) -> ArmedSession:
        return ArmedSession(
            session=session,
            job="job1",
            backend=backend,
            cycles=list(cycles),
            options=options if options is not None else {"activities": ["cpu"]},
            incoming=self.tmp / "incoming" / session,
            region=region,
            revision=revision,
        )

    def arm(self, armed: ArmedSession) -> None:
        self.st.post("arm", armed)

    def ticks(self, n: int) -> None:
        for _ in range(n):
            self.st.tick()

    def until(self, done: int) -> None:
        """Train until ``done`` steps are complete."""
        assert self.st.count <= done
        self.ticks(done - self.st.count)

    def drain(self) -> list[dict[str, Any]]:
        out = list(self.st.outbox)
        self.st.outbox.clear()
        self.sent += out
        return out

    def reports(self) -> list[tuple[Any, ...]]:
        """(session, state) for progress, (session, 'captured', cycle, steps) for captures."""
        out: list[tuple[Any, ...]] = []
        for m in self.drain():
            if m["t"] == "progress":
                out.append((m["session"], m["state"]))
            else:
                out.append((m["session"], "captured", m["cycle"], m["steps"]))
        return out


@pytest.fixture
def run(tmp_path: Path, torch: TorchDouble) -> Run:
    return Run(tmp_path)


# --- idle ------------------------------------------------------------------------------------
class CountingStepper(Stepper):
    """Counts boundary entries (a subclass, so it has a ``__dict__`` for the counter)."""

    def __init__(self) -> None:
        super().__init__("main-r0", lambda: None)
        self.boundaries = 0

    def _boundary(self) -> None:
        self.boundaries += 1
        super()._boundary()


def test_idle_ticks_only_count() -> None:
    st = CountingStepper()
    for _ in range(10_000):
        st.tick()
    assert st.count == 10_000
    # The first step's end starts the step ledger (one boundary); after it the idle hot path
    # never leaves tick().
    assert st.boundaries == 1
    assert st.next_event == IDLE
    assert not st.outbox and st.live is None
    assert st.state() == "idle" and st.busy_sessions() == []


def test_a_post_is_applied_at_the_next_tick_only() -> None:
    st = CountingStepper()
    st.tick()  # step 1's end: the ledger's start
    st.post("disarm", ("nothing", True))
    assert st.next_event == 0 and st.boundaries == 1  # the agent thread does no work
    st.tick()
    assert st.boundaries == 2 and not st.inbox
    assert st.next_event == IDLE  # idle again
    st.tick()
    assert st.boundaries == 2


def test_no_torch_is_imported_while_idle(run: Run, torch: TorchDouble) -> None:
    run.ticks(100)
    run.st.post("disarm", ("s", True))
    run.ticks(1)
    assert torch.profiles == [] and run.drain() == []


# --- arming and capturing -------------------------------------------------------------------------
def test_plan_captures_exactly_its_steps(run: Run, torch: TorchDouble) -> None:
    run.until(2)
    run.arm(run.armed("s1", (5, 5, 8)))
    run.ticks(1)  # boundary before step 4: the plan is taken, nothing starts yet
    assert run.st.state() == "armed" and run.st.busy_sessions() == ["s1"]
    assert run.st.next_event == 4  # the next boundary is the one before step 5
    assert torch.profiles == []
    run.until(4)
    assert run.st.state() == "capturing"  # started at the boundary before step 5
    assert run.reports() == [("s1", "capturing")]
    run.until(7)
    prof = torch.last
    assert prof.recorded() == [5, 6, 7] and prof.warmed() == []
    assert prof.stopped and run.st.live is None
    assert run.reports() == [("s1", "captured", 0, [5, 6, 7]), ("s1", "done")]
    assert run.st.state() == "idle" and run.st.next_event == IDLE
    assert run.st.busy_sessions() == []


def test_captured_report_names_the_raw_trace(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 3)))
    run.until(2)
    m = next(m for m in run.drain() if m["t"] == "captured")
    trace = run.tmp / "incoming" / "s1" / "c0" / "main-r0.pt.trace.json"
    assert m["files"] == [{"kind": "trace", "path": str(trace)}]
    assert trace.is_file()
    assert m["job"] == "job1" and m["region"] is None and m["error"] is None
    assert m["torch"] == "0.0+double" and m["device"] == "cpu"
    assert m["stall_ms"] >= 0 and m["ended_at"] >= m["started_at"] > 0
    assert m["plan"] == 0


def test_warmup_steps_are_profiled_but_not_recorded(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (3, 5, 7)))
    run.until(6)
    prof = torch.last
    assert prof.warmed() == [3, 4]
    assert prof.recorded() == [5, 6]
    assert 7 not in prof.phases  # stopped at the boundary before step 7
    assert run.reports()[-2:] == [("s1", "captured", 0, [5, 6]), ("s1", "done")]


def test_repeated_cycles(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 3, 5), (5, 6, 8)))
    run.until(7)
    first, second = torch.profiles
    assert (first.warmed(), first.recorded()) == ([2], [3, 4])
    assert (second.warmed(), second.recorded()) == ([5], [6, 7])
    assert run.reports() == [
        ("s1", "capturing"),
        ("s1", "captured", 0, [3, 4]),
        ("s1", "capturing"),  # the next cycle's warm-up starts at the same boundary
        ("s1", "captured", 1, [6, 7]),
        ("s1", "done"),
    ]
    assert {Path(p).parent.name for p in first.exported + second.exported} == {"c0", "c1"}


def test_options_reach_the_profiler(run: Run, torch: TorchDouble) -> None:
    opts = {"activities": ["cpu", "cuda"], "record_shapes": True, "with_stack": True}
    run.arm(run.armed("s1", (2, 2, 3), options=opts))
    run.until(2)
    prof = torch.last
    assert prof.kwargs["activities"] == [ProfilerActivity.CPU]  # no CUDA on this process
    assert prof.kwargs["record_shapes"] and prof.kwargs["with_stack"]
    assert not prof.kwargs["profile_memory"]
    m = next(m for m in run.drain() if m["t"] == "captured")
    assert m["notes"] == ["cuda activity requested but CUDA is not available"]


def test_arm_before_the_first_step(run: Run, torch: TorchDouble) -> None:
    # attach(wait=...): the agent applies the plan at once, before step 1 runs.
    run.arm(run.armed("s1", (1, 1, 3)))
    run.st.boundary_now()
    assert run.st.state() == "capturing"
    run.until(2)
    assert torch.last.recorded() == [1, 2]
    assert run.reports()[-2:] == [("s1", "captured", 0, [1, 2]), ("s1", "done")]


def test_arm_at_the_last_possible_boundary(run: Run) -> None:
    run.until(4)
    run.arm(run.armed("s1", (6, 6, 7)))
    run.ticks(1)  # boundary after step 5, before step 6: just in time
    assert run.reports() == [("s1", "capturing")]


def test_late_plan_is_reported_and_dropped(run: Run, torch: TorchDouble) -> None:
    run.until(4)
    run.arm(run.armed("s1", (5, 5, 7), revision=2))
    run.ticks(1)  # applied at the boundary after step 5: step 5 has begun and ended
    msgs = run.drain()
    assert [(m["state"], m["step"], m["plan"]) for m in msgs] == [("late", 5, 2)]
    assert msgs[0]["error"] == "steps already passed: at step 5"
    assert run.st.busy_sessions() == [] and run.st.next_event == IDLE
    run.ticks(5)
    assert torch.profiles == []


def test_a_late_warmup_makes_the_plan_late(run: Run) -> None:
    run.until(3)
    run.arm(run.armed("s1", (4, 6, 7)))  # steps 6 are ahead, but its warm-up began at 4
    run.ticks(1)
    assert run.reports() == [("s1", "late")]


def test_overlapping_sessions_miss_not_shift(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("a", (2, 2, 6)))
    run.arm(run.armed("b", (4, 4, 5), (8, 8, 9)))
    run.until(8)
    assert [p.recorded() for p in torch.profiles] == [[2, 3, 4, 5], [8]]
    assert run.reports() == [
        ("a", "capturing"),
        ("a", "captured", 0, [2, 3, 4, 5]),
        ("a", "done"),
        ("b", "missed"),  # cycle 0 (step 4) passed while a captured: missed, not moved
        ("b", "capturing"),
        ("b", "captured", 1, [8]),
        ("b", "done"),
    ]
    missed = next(m for m in run.sent if m.get("state") == "missed")
    assert missed["error"] == "cycle 0 (4:5) missed"


def test_two_sessions_back_to_back(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("a", (2, 2, 4)))
    run.arm(run.armed("b", (4, 4, 5)))
    run.until(4)
    assert [p.recorded() for p in torch.profiles] == [[2, 3], [4]]
    assert run.reports() == [
        ("a", "capturing"),
        ("a", "captured", 0, [2, 3]),
        ("a", "done"),
        ("b", "capturing"),
        ("b", "captured", 0, [4]),
        ("b", "done"),
    ]


def test_profiler_that_fails_to_start_fails_the_plan(run: Run, torch: TorchDouble) -> None:
    torch.fail_start = True
    run.arm(run.armed("s1", (2, 2, 3), (5, 5, 6)))
    run.until(6)
    msgs = run.drain()
    assert [(m["state"], m["error"]) for m in msgs] == [
        ("failed", "torch.profiler start failed: profiler busy (double)")
    ]
    assert run.st.busy_sessions() == [] and run.st.state() == "idle"


def test_an_error_inside_a_capture_fails_it_without_raising(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 5)))
    run.until(2)
    torch.fail_step = True
    run.ticks(1)  # the profiler raises inside the boundary: training must not see it
    msgs = run.drain()
    assert msgs[-1]["state"] == "failed"
    assert msgs[-1]["error"] == "client error: RuntimeError('step failed (double)')"
    assert run.st.live is None and torch.last.stopped  # abandoned
    assert torch.last.exported == []


# --- manual steps ------------------------------------------------------------------------------
def test_set_step_resumes_the_count(run: Run, torch: TorchDouble) -> None:
    run.st.set_step(1000)
    assert run.st.count == 1000 and run.st.next_event == IDLE
    run.arm(run.armed("s1", (1002, 1002, 1003)))
    run.ticks(2)
    assert torch.last.recorded() == [1002]
    assert run.reports()[-2:] == [("s1", "captured", 0, [1002]), ("s1", "done")]


def test_set_step_past_a_pending_plan_misses_it(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (5, 5, 6), (50, 50, 51)))
    run.ticks(1)
    run.st.set_step(20)
    assert run.reports() == [("s1", "missed")]
    run.until(50)
    assert torch.last.recorded() == [50]


def test_set_step_backwards_rearms_nothing(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (3, 3, 4)))
    run.until(3)
    run.st.set_step(0)  # a restarted loop: the plan is done, nothing captures again
    run.until(5)
    assert len(torch.profiles) == 1
    assert run.reports()[-1] == ("s1", "done")


def test_set_step_jump_during_a_capture_reports_only_steps_that_ran(
    run: Run, torch: TorchDouble
) -> None:
    run.arm(run.armed("s1", (3, 3, 8)))
    run.until(4)  # steps 3 and 4 captured so far
    run.st.set_step(100)
    got = run.reports()
    assert got[-2:] == [("s1", "captured", 0, [3, 4]), ("s1", "done")]
    assert run.st.live is None
    m = next(m for m in run.sent if m["t"] == "captured")
    assert any("100" in n for n in m["notes"])


def test_set_step_jump_during_warmup_misses_the_cycle(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (3, 6, 8)))
    run.until(4)  # warming up
    run.st.set_step(100)
    assert run.reports()[-2:] == [("s1", "missed"), ("s1", "done")]
    assert torch.last.stopped and torch.last.exported == []
    assert "step count set from 4 to 100" in run.sent[-2]["error"]


def test_set_step_to_the_next_step_is_a_tick(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (3, 3, 6)))
    run.until(3)
    run.st.set_step(4)
    run.st.set_step(4)  # no change
    run.until(5)
    assert torch.last.recorded() == [3, 4, 5]
    assert run.reports()[-2:] == [("s1", "captured", 0, [3, 4, 5]), ("s1", "done")]


# --- replacement, disarm, shutdown ---------------------------------------------------------------
def test_repeated_arm_is_ignored(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (5, 5, 6), revision=1))
    run.ticks(1)
    run.arm(run.armed("s1", (3, 3, 4), revision=1))  # re-sent after a reconnect
    run.arm(run.armed("s1", (3, 3, 4), revision=0))  # an older revision
    run.until(5)
    assert [p.recorded() for p in torch.profiles] == [[5]]


def test_higher_revision_replaces_a_pending_plan(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (5, 5, 6)))
    run.ticks(1)
    run.arm(run.armed("s1", (9, 9, 11), revision=1))
    run.until(10)
    assert [p.recorded() for p in torch.profiles] == [[9, 10]]
    got = run.drain()
    assert [(m["state"] if m["t"] == "progress" else "captured", m["plan"]) for m in got] == [
        ("capturing", 1),
        ("captured", 1),
        ("done", 1),
    ]


def test_higher_revision_discards_a_live_capture(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 6)))
    run.until(3)
    run.arm(run.armed("s1", (8, 8, 9), revision=1))
    run.until(8)
    old, new = torch.profiles
    assert old.stopped and old.exported == []  # abandoned without a report
    assert new.recorded() == [8]
    assert run.reports() == [
        ("s1", "capturing"),
        ("s1", "capturing"),
        ("s1", "captured", 0, [8]),
        ("s1", "done"),
    ]


def test_higher_revision_that_is_late(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (8, 8, 9)))
    run.until(5)
    run.arm(run.armed("s1", (6, 6, 7), revision=1))
    run.ticks(1)
    assert run.reports() == [("s1", "late")]
    run.until(10)
    assert torch.profiles == []  # the old plan was void, the new one too late


@pytest.mark.parametrize(("keep", "state"), [(True, "stopped"), (False, "cancelled")])
def test_disarm_a_pending_plan(run: Run, torch: TorchDouble, keep: bool, state: str) -> None:
    run.arm(run.armed("s1", (5, 5, 6)))
    run.arm(run.armed("s2", (7, 7, 8)))
    run.ticks(1)
    run.st.post("disarm", ("s1", keep))
    run.ticks(1)
    assert run.reports() == [("s1", state)]
    run.until(7)
    assert [p.recorded() for p in torch.profiles] == [[7]]


def test_disarm_keep_delivers_the_steps_so_far(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 10), (12, 12, 13)))
    run.until(3)
    run.st.post("disarm", ("s1", True))
    run.ticks(1)  # applied after step 4
    assert run.reports()[-2:] == [("s1", "captured", 0, [2, 3, 4]), ("s1", "stopped")]
    assert torch.last.exported
    run.until(13)
    assert len(torch.profiles) == 1  # the later cycle is dropped too


def test_disarm_discard_abandons_the_capture(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 10)))
    run.until(3)
    run.st.post("disarm", ("s1", False))
    run.ticks(1)
    assert run.reports()[-1] == ("s1", "cancelled")
    assert torch.last.stopped and torch.last.exported == []
    assert run.st.state() == "idle"


def test_disarm_of_another_session_leaves_the_capture(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 5)))
    run.arm(run.armed("s2", (9, 9, 10)))
    run.until(3)
    run.st.post("disarm", ("s2", False))
    run.ticks(1)
    run.until(4)
    assert run.reports() == [
        ("s1", "capturing"),
        ("s2", "cancelled"),
        ("s1", "captured", 0, [2, 3, 4]),
        ("s1", "done"),
    ]


def test_shutdown_keeps_the_capture_and_ends_every_plan(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 10)))
    run.arm(run.armed("s2", (20, 20, 21)))
    run.until(3)
    run.st.post("shutdown", None)
    run.st.boundary_now()  # detach(): at once, not at the next step
    assert run.reports()[-3:] == [
        ("s1", "captured", 0, [2, 3]),
        ("s1", "stopped"),
        ("s2", "stopped"),
    ]
    assert run.st.state() == "idle" and run.st.busy_sessions() == []


# --- regions -------------------------------------------------------------------------------------
def test_region_window_captures_each_entry(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (3, 3, 5), region="rollout"))
    run.until(2)
    assert run.st.state() == "region-wait"
    assert run.reports() == [("s1", "capturing")]
    with run.st.region("train"):  # another region: not captured, not even marked
        pass
    assert torch.profiles == []
    for _ in range(2):  # step 3: two rollouts
        with run.st.region("rollout"):
            assert run.st.state() == "capturing"
    run.ticks(1)
    with run.st.region("rollout"):  # step 4
        pass
    run.ticks(1)
    assert run.st.live is None
    assert [p.recorded() for p in torch.profiles] == [[3], [3], [4]]
    assert run.reports() == [
        ("s1", "captured", 0, [3]),
        ("s1", "captured", 1, [3]),
        ("s1", "captured", 2, [4]),
        ("s1", "done"),
    ]
    assert {m["region"] for m in run.sent if m["t"] == "captured"} == {"rollout"}
    assert torch.regions.count("rollout") == 3
    with run.st.region("rollout"):  # after the window
        pass
    assert len(torch.profiles) == 3


def test_regions_are_timed_whether_captured_or_not(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 3), region="gen"))
    with run.st.timer("gen"):  # idle (what region() returns then)
        pass
    run.until(1)
    # Captured: one trace, and timed as well; the nested entry adds neither.
    with run.st.region("gen"), run.st.region("gen"):
        pass
    run.ticks(1)
    assert len(torch.profiles) == 1 and run.st.live is None
    assert run.st.regions["gen"].entries == 2


def test_region_window_closes_after_its_last_step(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 3), region="gen"))
    run.until(1)
    for _ in range(2):  # the window stays open for the whole of step 2
        with run.st.region("gen"):
            pass
    assert run.st.live is not None
    run.ticks(1)
    assert run.st.live is None
    assert run.reports()[-3:] == [
        ("s1", "captured", 0, [2]),
        ("s1", "captured", 1, [2]),
        ("s1", "done"),
    ]


def test_region_window_without_an_entry(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 4), region="gen"))
    run.until(5)
    assert torch.profiles == []
    assert run.reports() == [("s1", "capturing"), ("s1", "done")]


def test_steps_inside_a_region_capture(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 4), region="fwd_bwd"))
    run.until(1)
    with run.st.region("fwd_bwd"):
        run.ticks(1)  # optimizer.step() inside the region: the window stays on this capture
        assert run.st.state() == "capturing"
    run.ticks(1)
    assert run.st.live is None
    assert len(torch.profiles) == 1 and torch.last.exported


def test_regions_inside_a_capture_are_marked(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 3)))
    run.until(1)
    with run.st.region("fwd"):
        pass
    assert torch.regions == ["fwd"]
    run.until(2)
    with run.st.region("fwd"):  # capture over: a plain block
        pass
    assert torch.regions == ["fwd"]


@pytest.mark.parametrize(("keep", "state"), [(True, "stopped"), (False, "cancelled")])
def test_disarm_inside_a_region_capture(
    run: Run, torch: TorchDouble, keep: bool, state: str
) -> None:
    # stop/cancel reaches the training thread at a step that ends inside the region: the
    # region's own exit closes its capture, once.
    run.arm(run.armed("s1", (2, 2, 5), region="fwd_bwd"))
    run.until(1)
    with run.st.region("fwd_bwd"):
        run.st.post("disarm", ("s1", keep))
        run.ticks(1)
        assert torch.last.stopped is False  # never inside the open region
    prof = torch.last
    assert prof.stopped
    assert bool(prof.exported) == keep
    assert run.reports() == [
        ("s1", "capturing"),
        *([("s1", "captured", 0, [2])] if keep else []),
        ("s1", state),  # after the capture, as for a capture stopped at a step boundary
    ]
    assert run.st.live is None and run.st.state() == "idle"
    run.until(6)
    assert len(torch.profiles) == 1


def test_superseded_region_plan_inside_its_region(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 5), region="gen"))
    run.until(1)
    with run.st.region("gen"):
        run.arm(run.armed("s1", (9, 9, 10), region="gen", revision=1))
        run.ticks(1)
        assert torch.last.stopped is False
    assert torch.last.stopped and torch.last.exported == []  # discarded, as for torch plans
    assert [g for g in run.reports() if g[1] == "captured"] == []
    run.until(8)
    with run.st.region("gen"):
        pass
    assert run.reports()[-1] == ("s1", "captured", 0, [9])


def test_error_at_a_boundary_inside_a_region_capture(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (2, 2, 5), region="gen"))
    run.until(1)
    with run.st.region("gen"):
        run.st.post("bogus", None)  # an inbox item the Stepper does not know is ignored
        run.st.inbox.append(("arm", None))  # a broken one raises inside the boundary
        run.st.next_event = 0
        run.ticks(1)
        assert torch.last.stopped is False
    assert torch.last.stopped and torch.last.exported == []
    assert run.reports()[-1] == ("s1", "failed")
    assert run.st.live is None


# --- nsys ----------------------------------------------------------------------------------------
def test_nsys_range_marks_exactly_the_steps(run: Run, torch: TorchDouble) -> None:
    run.arm(run.armed("s1", (3, 3, 5), backend="nsys"))
    run.until(4)
    assert torch.cuda_profiler == ["start", "stop"]
    assert torch.nvtx == ["push ProfilerStep#3", "pop", "push ProfilerStep#4", "pop"]
    assert torch.profiles == []
    m = next(m for m in run.drain() if m["t"] == "captured")
    assert (m["steps"], m["files"], m["error"]) == ([3, 4], [], None)


# --- reports -------------------------------------------------------------------------------------
def test_every_report_has_a_new_id_and_wakes_the_agent(run: Run) -> None:
    run.arm(run.armed("s1", (2, 2, 3)))
    run.until(2)
    msgs = run.drain()
    ids = [m["id"] for m in msgs]
    assert len(msgs) == 3 and ids == sorted(set(ids))
    assert run.notified == 3
