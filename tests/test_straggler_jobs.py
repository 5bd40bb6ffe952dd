"""The straggler rule on real jobs: gloo DDP on CPU at 2, 3 and 8 ranks.

One daemon, three jobs of ``tests/jobs/paced.py`` started together (8 ranks are 8 processes:
the step's work is a sleep, so they share two cores). A job rests (long, even steps that end
as soon as its mode changes) until its case comes; then the test switches what it does
through its mode file, captures :data:`ACTIVE` steps with ``profctl start``, rests the job
again as soon as every rank has captured them, and when the session is done asks
``profctl report --json``:

* one rank computes (``aten::mm``) 25 % of the step the same job takes without it more than
  the others, every rank's work jittering ±10 %: the report names exactly that rank;
* the same jitter and nobody slower: the report names nobody;
* the reported job, 2 ranks, rank 1 asleep 8 ms of a ~20 ms step after ``backward()``: named
  (over 40 steps: its lead is fixed while load doubles the step and its noise);
* a compute-bound job at 2 and 3 ranks (``work=compute``: DDP passes of a three-layer model,
  one bucket a layer, no sleep) whose slow rank sleeps 25 % of its own median step after
  ``backward()``: over 100 steps it is named, and even ranks name nobody; over 8 steps the
  report names it or says there are not enough steps to tell, leaning to it, with more steps
  than 8 needed (on a loaded machine 8 steps of this job seldom decide, see docs/reports.md).

Two compute-bound ranks share the two cores with whatever else runs there, and the scheduler
can hold one of them back for a whole capture: it then is the straggler, made by the machine,
and the report is right to name it. An even job may name a rank only where the kernel's count
of its training thread's time on a CPU or waiting for one (``/proc/self/task/TID/schedstat``),
logged by the job after every step and read over exactly the captured steps, shows that rank
spending more of each step on its work than its peers.

Every case repeats ``ROUNDS`` times (env ``STRAGGLER_JOB_ROUNDS``, default 1) on fresh
captures, as the rule must hold on each one, not on the average. On a loaded 2-core machine
(6 rounds of every case, 20 steps each) the slowed ranks led by about twice the threshold,
and the even jobs' thresholds were the 10 %-of-the-step floor: far from either edge.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import pytest
from harness import Daemon, Jobs, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("straggler_jobs")]

WAIT = 120.0
ACTIVE = 20
BASE_MS = 40.0
#: Between its cases a job rests on long steps that end as soon as its mode file changes: the
#: jobs not being captured then cost next to no CPU while the one being captured runs.
REST = "base_ms=1000 pause=1"
#: Until every rank is attached and stepping: short steps, so that they reach step 2 soon.
STARTING = "base_ms=150"
EVEN = f"base_ms={BASE_MS:g} jitter=0.1"


@dataclass(frozen=True)
class Case:
    name: str
    ranks: int
    mode: str  # the job's mode file; ``{extra_ms}``: 25 % of the even job's step
    expect: tuple[int, ...]  # the stragglers the report must name
    why: str = ""  # in the straggler's reason: what its extra time is
    active: int = ACTIVE  # steps captured
    job: str = "paced"  # which of the jobs of that size
    #: Too few steps to be sure: the report may instead say so (or see nothing), never name another.
    may_undecide: bool = False

    @property
    def job_name(self) -> str:
        return job_name(self.ranks, self.job)


def slowed(ranks: int, slow: int) -> Case:
    mode = f"{EVEN} slow={slow} extra_ms={{extra_ms}}"
    return Case(f"{ranks}-ranks-slow-{slow}", ranks, mode, (slow,), "most in aten::mm")


COMPUTE = "work=compute base_ms=12"
COMPUTE_ENV = {"WIDTH": "256", "BATCH": "64"}
#: Steps that decide the compute cases at a load average of 10 on two cores: there 40 steps
#: fell just short once (a 5 ms lead in a spread of 8.3 ms a step: about 41 needed).
COMPUTE_ACTIVE = 100


def napping(ranks: int, slow: int, active: int) -> Case:
    mode = f"{COMPUTE} slow={slow} nap_share=0.25"
    return Case(
        f"compute{ranks}-slow-{slow}-{active}-steps", ranks, mode, (slow,), "idle", active,
        "compute", may_undecide=active < ACTIVE,
    )  # fmt: skip


# Each size's even case comes first: it measures the step a slowed rank adds 25 % to.
CASES = [
    Case("2-ranks-even", 2, EVEN, ()),
    slowed(2, 1),
    Case(
        "2-ranks-issue-sleep-8-of-20ms",
        2,
        "base_ms=12 slow=1 extra_ms=8 extra=sleep",
        (1,),
        "idle",
        # Its lead is a fixed 8 ms, not a share of the step: on a loaded machine the step
        # doubles and its noise with it, and 20 steps once left the lead just under the
        # noise floor (8.4 against 8.8 ms). The floor falls with the square root of the steps.
        active=40,
    ),
    Case("3-ranks-even", 3, EVEN, ()),
    slowed(3, 0),
    Case("8-ranks-even", 8, EVEN, ()),
    slowed(8, 5),
    Case("compute2-even", 2, COMPUTE, (), active=COMPUTE_ACTIVE, job="compute"),
    napping(2, 1, 8),
    napping(2, 1, COMPUTE_ACTIVE),
    Case("compute3-even", 3, COMPUTE, (), active=COMPUTE_ACTIVE, job="compute"),
    napping(3, 2, 8),
    napping(3, 2, COMPUTE_ACTIVE),
]
#: Rounds of every case on fresh captures (more to measure how often a case fails).
ROUNDS = int(os.environ.get("STRAGGLER_JOB_ROUNDS", "1"))


@dataclass
class Run:
    root: Path
    daemon: Daemon
    docs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    even_step_ms: dict[int, float] = field(default_factory=dict)  # per size, last even capture


def job_name(ranks: int, job: str = "paced") -> str:
    return f"{job}{ranks}"


def job_rows(d: Daemon, job: str) -> list[dict[str, Any]]:
    # Polled: the daemon's answer as profctl gets it, without a profctl process each time.
    return [r for r in d.request("ps") if r["job"] == job]


def steps_on(d: Daemon, job: str, ranks: int, n: int) -> None:
    """Wait until every rank of the job is ``n`` steps past where the furthest one is now."""
    now = max(r["step"] for r in job_rows(d, job))

    def moved() -> bool:
        rows = job_rows(d, job)
        return len(rows) == ranks and all(r["step"] >= now + n for r in rows)

    wait_for(moved, WAIT, f"{job} {n} steps on", every=0.1)


def runnable_ms(run: Run, job: str, steps: list[int]) -> dict[int, float]:
    """Per rank, how long its training thread ran on a CPU or waited for one in a step's work,
    per step over exactly ``steps`` (ms): the kernel's counts as the job logged them for every
    step (paced.py, WAITS_DIR); ranks that have not logged every one of the steps are left out."""
    want = set(steps)
    out: dict[int, float] = {}
    for log in (run.root / f"waits-{job}").glob("r*.tsv"):
        per_step: dict[int, int] = {}
        for line in log.read_text().splitlines():
            fields = line.split()
            if len(fields) == 2 and all(f.isdigit() for f in fields):
                per_step[int(fields[0])] = int(fields[1])  # a step's last line
        if want <= per_step.keys():
            out[int(log.stem[1:])] = sum(per_step[s] for s in want) / 1e6 / len(want)
    return out


def capture_and_report(run: Run, case: Case, k: int) -> dict[str, Any]:
    d = run.daemon
    mode = run.root / f"mode-{case.job_name}"
    even = run.even_step_ms.get(case.ranks, 0.0)
    mode.write_text(case.mode.format(extra_ms=f"{0.25 * even:.1f}"))
    # Every rank has read the new mode, and a napping rank has measured its own steps.
    steps_on(d, case.job_name, case.ranks, 8 if case.job == "compute" else 3)
    res = d.ctl_json(
        "start", "--job", case.job_name, "--next", "--active", str(case.active),
        timeout=WAIT,
    )  # fmt: skip
    sid = res["session"]
    # The job rests as soon as every rank has captured its steps: a compute job would
    # otherwise keep both cores from the daemon while it takes in the traces (~10 s for 100
    # steps), and the capture would cost twice the CPU.
    d.wait_captured(sid, WAIT)
    mode.write_text(REST)
    final = d.wait_ended(sid, WAIT)
    if final["state"] != "done":
        # Seen once (partial) in a loaded suite: the whole session and what the daemon said,
        # where pytest's repr of the dict would cut the targets off.
        tail = d.log.read_text(errors="replace")[-4000:]
        raise AssertionError(
            f"{case.name}: session {final['state']}\n{json.dumps(final, indent=1)[:8000]}\n"
            f"daemon log:\n{tail}"
        )
    out = run.root / f"{case.name}-{k}.html"
    doc: dict[str, Any] = d.ctl_json("report", sid, "-o", str(out), timeout=WAIT)
    if case.mode == EVEN:
        run.even_step_ms[case.ranks] = median(x["step_ms"] for x in doc["ranks"])
    if doc["steps"]:
        doc["runnable_ms"] = runnable_ms(run, case.job_name, doc["steps"])
    return doc


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    root = tmp_path_factory.mktemp("straggler_jobs")
    d = Daemon(root / "profd")
    d.root.mkdir()
    d.start()
    jobs = Jobs(root)
    r = Run(root, d)
    try:
        started = sorted({(c.job, c.ranks) for c in CASES})
        for job, n in started:
            name = job_name(n, job)
            (root / f"mode-{name}").write_text(STARTING)
            env = COMPUTE_ENV if job == "compute" else {}
            (root / f"waits-{name}").mkdir()
            jobs.start(
                "paced.py", nproc=n, daemon=d, MODE_FILE=str(root / f"mode-{name}"),
                PROFD_JOB=name, WAITS_DIR=str(root / f"waits-{name}"), **env,
            )  # fmt: skip
        d.wait_attached(sum(n for _, n in started), timeout=WAIT, min_step=2)
        for job, n in started:
            (root / f"mode-{job_name(n, job)}").write_text(REST)
        for k in range(ROUNDS):
            for case in CASES:
                r.docs.setdefault(case.name, []).append(capture_and_report(r, case, k))
        yield r
    finally:
        jobs.kill_all()
        d.stop()


def table(doc: dict[str, Any]) -> str:
    rows = [
        f"r{x['rank']}: step {x['step_ms']:.1f} compute {x['compute_ms']:.1f} "
        f"coll {x['collective_ms']:.1f} idle {x['idle_ms']:.1f}"
        for x in doc["ranks"]
    ]
    return f"{doc['verdict']} (threshold {doc['threshold_ms']}; {len(doc['steps'])} steps)\n" + (
        "\n".join(rows)
    )


def assert_held_back_by_the_machine(case: Case, doc: dict[str, Any]) -> None:
    """An even job's rank is named only where the machine made it a straggler.

    Compute-bound ranks share two cores with whatever else runs there (the daemon taking in
    the traces, the other ranks), and one of them can be slower for a whole capture: held
    in the run queue, or running slower on a core it shares. That rank then really is the
    one the others wait for, and the report is right to name it. The kernel's own count of
    the named rank's training thread, on a CPU or waiting for one (not asleep, not blocked
    in a collective), must then be more per step than its peers', by at least half of the
    report's lead: time the rank spent on its step's work, which a rank that only happened
    to arrive last by chance would not show.
    """
    busy = doc["runnable_ms"]
    assert sorted(busy) == list(range(case.ranks)), f"{case.name}: runnable time logged {busy}"
    for s in doc["stragglers"]:
        held = busy[s["rank"]] - median(w for r, w in busy.items() if r != s["rank"])
        assert held >= s["lead_ms"] / 2, (
            f"{case.name}: {table(doc)}\nrunnable (on a CPU or waiting for one) per step: {busy}"
        )


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_report_names_exactly_the_slowed_rank(run: Run, case: Case) -> None:
    for doc in run.docs[case.name]:
        assert sorted(x["rank"] for x in doc["ranks"]) == list(range(case.ranks))
        assert len(doc["steps"]) >= case.active - 2, table(doc)
        named = tuple(s["rank"] for s in doc["stragglers"])
        if case.may_undecide and not named:
            # 8 steps on a loaded 2-core machine: a 25 % nap is often inside the noise (the
            # rule then says how many steps it needs, leaning to the slow rank in most runs
            # but not all: docs/reports.md has the rates). What must hold is that it never
            # names a rank that was not slowed; the 100-step case of the same job names it.
            if doc["verdict"].startswith("not enough steps to tell"):
                assert doc["need_steps"] > len(doc["steps"]), table(doc)
            else:
                assert doc["verdict"].startswith("no straggler"), table(doc)
            continue
        if named and not case.expect:
            assert_held_back_by_the_machine(case, doc)
            continue
        assert named == case.expect, table(doc)
        if case.expect:
            (s,) = doc["stragglers"]
            assert s["why"].startswith(f"rank {case.expect[0]} "), s["why"]
            assert case.why in s["why"], s["why"]
            assert s["lead_ms"] > doc["threshold_ms"]
        else:
            # An even job's rank may lead within the noise: "cannot tell" is an answer, a
            # name is not.
            verdict = doc["verdict"]
            assert verdict.startswith(("no straggler", "not enough steps to tell")), verdict
