"""GPU truth: every CUDA path of profd, checked on a real GPU, written to docs/gpu.md.

Run it as ``python3 dev.py test-gpu`` (which sets up the environment offline; see dev.py),
or directly with a python that has torch with CUDA and profd installed::

    python tests/gpu/gpucheck.py [--out docs/gpu.md] [--budget 250]

It starts a real ``profd run`` in a temporary directory and a small CUDA training job
(``cudajob.py``, one process, a single-rank NCCL process group) attached to it, then checks,
each as one ``PASS``/``FAIL``/``SKIP`` line with what was seen:

1. ``capture``: ``profctl start --activities cpu,cuda --steps 3:6 --wait``: the trace has
   exactly ProfilerStep#3..5, CUDA kernels and memcpys launched inside each of them,
   ``distributedInfo``, and the pipeline's per-rank statistics count GPU time as compute.
2. ``regions``: ``profd_client.region()`` blocks as NVTX ranges: in the nsys report where
   nsys exists; otherwise the ``record_function`` ranges in the trace plus the NVTX calls the
   client made (counted in the job), said so.
3. ``memory-snapshot``: ``--memory-snapshot`` writes a pickle that torch's memory_viz loads,
   with allocations recorded during the capture.
4. ``nvml-ps``: ``profctl ps --json`` shows GPU utilisation and memory for the job's pid.
5. ``nsys``: with a real nsys, ``profctl run --nsys`` and ``start --backend nsys``: the
   ``.nsys-rep`` in the spool, ``nsys stats`` run by the pipeline, the steps as NVTX ranges.
   With an nsys that cannot write reports (no ``QdstrmImporter``, as the copy inside Nsight
   Compute): that the session fails within seconds saying so.
6. ``nccl``: the job's collectives as NCCL kernels (at world size 1, the device-to-device
   memcpy NCCL does instead), counted as collective time;
   ``flight-recorder``: the job's NCCL flight recorder, dumped by its agent thread for
   ``profctl stacks``, lists its NCCL collectives.
7. ``idle-cost`` and ``stall``: in one attached process, blocks of the same CUDA steps with
   the client's training-thread side switched on and off in turn; fails when the blocks with
   it are slower by more than 1 % beyond the spread of the per-pair ratios. And the training
   stall the client reported at capture end, with and without a memory snapshot; fails when
   the snapshot adds more than 50 ms.

Each check has a time box (:data:`LIMITS`; a check past it fails) and prints its line as it
ends; the whole run has :data:`BUDGET_S`. Exit status: 0 nothing failed (skips say why), 1 a
check failed, 3 no GPU (one line).
``--allow-cpu`` runs the same plumbing on a machine without a GPU (the job on the CPU with
gloo), for working on this script; its CUDA checks fail there, as they should.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import pickle
import platform
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
ROOT = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from daemonproc import BIN, DaemonProcess, free_port, wait_for  # noqa: E402
from harness import Job  # noqa: E402

from profd import nsys as nsys_cli  # noqa: E402
from profd.pipeline.rankstats import is_cpu_collective, is_gpu_collective  # noqa: E402
from profd.pipeline.spans import step_spans  # noqa: E402

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
#: Seconds each check may take (its time box), and the whole run's budget: on an H100 the
#: checks took 11 s (capture), 1, 3, 9 (flight recorder) and 53 s (idle cost); nsys gets 90
#: s; the run, set-up included, stays under 5 minutes so it can be re-run in one GPU window.
LIMITS: dict[str, float] = {
    "capture": 60,
    "nvml-ps": 30,
    "memory-snapshot": 45,
    "job-exit": 30,
    "nccl": 10,
    "flight-recorder": 45,
    "idle-cost+stall": 120,
    "nsys": 90,
    "regions": 10,
}
BUDGET_S = 250.0
#: A check box or budget with this little left is spent: no wait worth starting fits.
SPENT_S = 2.0
#: What NCCL launches for a collective at world size 1: a copy on the device, no kernel.
DTOD_MEMCPY = "Memcpy DtoD"
TERMINAL = {"done", "partial", "failed", "cancelled"}
EXIT_FAILED, EXIT_NO_GPU = 1, 3
JOB = HERE / "cudajob.py"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
#: Where NVIDIA installs put nsys besides PATH (relative to /): the CUDA toolkit, Nsight Systems'
#: own folder, and the copy some Nsight Compute installs carry.
NSYS_GLOBS = (
    "usr/local/cuda*/bin/nsys",
    "usr/local/cuda*/nsight-systems*/bin/nsys",
    "usr/local/cuda*/nsight-systems*/**/nsys",
    "opt/nvidia/nsight-systems*/bin/nsys",
    "opt/nvidia/nsight-systems*/*/bin/nsys",
    "opt/nvidia/nsight-systems*/**/nsys",
    "opt/nvidia/nsight-compute*/**/nsys",
    "usr/local/cuda*/nsight-compute*/**/nsys",
    "usr/lib/nsight-systems*/**/nsys",
    "usr/local/nsight-systems*/**/nsys",
    "opt/nvidia/**/nsys",
)


@dataclass
class Result:
    name: str
    status: str
    evidence: str
    seen: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.evidence}"


# --- idle cost: the in-process A/B (pure: unit-tested) --------------------------------------------
#: Attached blocks may be this much slower than the blocks without the client, beyond the spread.
AB_TOLERANCE = 0.01
#: What a memory snapshot may add to the stall at capture end.
SNAPSHOT_STALL_MS = 50.0


@dataclass(frozen=True)
class ABVerdict:
    """Blocks of the same steps with the client on and off, in pairs: the median over pairs
    of (on block's mean step / off block's), its bootstrap 95 % interval and the per-pair
    ratios' interquartile range. ``failed``: the whole interval lies above 1 + tolerance."""

    ratio: float
    low: float
    high: float
    q1: float
    q3: float
    pairs: int
    tolerance: float

    @property
    def failed(self) -> bool:
        return self.low > 1.0 + self.tolerance

    def text(self) -> str:
        return (
            f"attached/off step time {self.ratio:.4f} (95 % interval {self.low:.4f}.."
            f"{self.high:.4f}, per-pair IQR {self.q1:.4f}..{self.q3:.4f}, {self.pairs} pairs); "
            f"fails above {1 + self.tolerance:.2f} beyond the interval"
        )


def _quantile(v: Sequence[float], q: float) -> float:
    s = sorted(v)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ab_verdict(
    blocks: Sequence[tuple[bool, float]],
    tolerance: float = AB_TOLERANCE,
    resamples: int = 2000,
    seed: int = 0,
) -> ABVerdict:
    """The verdict on ``blocks``: ``(client on?, mean step time)`` in the order they ran,
    consecutive blocks forming pairs of one on and one off. Pairing adjacent blocks cancels
    drift slower than a pair; the median over pairs ignores a pair that a hiccup hit; the
    interval comes from resampling pairs (seeded: the same blocks give the same verdict)."""
    if len(blocks) < 2 or len(blocks) % 2:
        raise ValueError(f"{len(blocks)} blocks: need pairs, at least one")
    ratios = []
    for a, b in zip(blocks[::2], blocks[1::2], strict=True):
        if a[0] == b[0]:
            raise ValueError(f"a pair of blocks both {'on' if a[0] else 'off'}")
        on, off = (a[1], b[1]) if a[0] else (b[1], a[1])
        if not (on > 0 and off > 0):
            raise ValueError(f"block times must be positive: {on}, {off}")
        ratios.append(on / off)
    rng = random.Random(seed)
    meds = sorted(median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return ABVerdict(
        ratio=median(ratios),
        low=_quantile(meds, 0.025),
        high=_quantile(meds, 0.975),
        q1=_quantile(ratios, 0.25),
        q3=_quantile(ratios, 0.75),
        pairs=len(ratios),
        tolerance=tolerance,
    )


def stall_verdict(stalls: Mapping[str, float | None]) -> str | None:
    """Why the stalls fail (a memory snapshot adds more than SNAPSHOT_STALL_MS), or None."""
    plain = stalls.get("cpu,cuda capture")
    snap = stalls.get("cpu,cuda capture + memory snapshot")
    if plain is None or snap is None:
        return None
    if snap - plain > SNAPSHOT_STALL_MS:
        return (
            f"a memory snapshot adds {snap - plain:.1f} ms to the stall (> {SNAPSHOT_STALL_MS:.0f})"
        )
    return None


# --- reading traces (pure: unit-tested on synthetic traces) ------------------------------------
def trace_events(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [e for e in doc.get("traceEvents", []) if isinstance(e, dict)]


def _complete(ev: Mapping[str, Any]) -> bool:
    return ev.get("ph") == "X" and isinstance(ev.get("ts"), int | float)


def cpu_step_spans(events: Iterable[Mapping[str, Any]]) -> list[tuple[int, float, float]]:
    """(step, start, end) of the ProfilerStep#N spans on CPU threads (kineto also writes them
    as ``gpu_user_annotation`` on GPU streams; those are not where the steps were taken)."""
    raw = [
        (str(e["name"]), float(e["ts"]), float(e.get("dur", 0)))
        for e in events
        if _complete(e)
        and str(e.get("name", "")).startswith("ProfilerStep#")
        and not str(e.get("cat", "")).startswith("gpu")
    ]
    return [(s.step, s.start_us, s.end_us) for s in step_spans(raw)]


def _step_at(spans: Sequence[tuple[int, float, float]], ts: float) -> int | None:
    for step, lo, hi in spans:
        if lo <= ts <= hi:
            return step
    return None


@dataclass
class Placement:
    """Where a trace's GPU activities belong: each is put in the ProfilerStep span that holds
    the CUDA runtime call that launched it (matched by correlation id)."""

    steps: list[int]  # the CPU ProfilerStep spans, in time order
    launched: dict[int, dict[str, int]]  # step -> GPU category -> count
    ran_inside: int  # of the placed activities, how many also ran inside that span
    outside: int  # launched outside every step span
    unlinked: int  # no launch with its correlation id
    gpu_step_annotations: int  # ProfilerStep spans on GPU tracks

    def steps_with(self, cat: str) -> list[int]:
        return sorted(s for s, c in self.launched.items() if c.get(cat))

    def total(self, cat: str) -> int:
        return sum(c.get(cat, 0) for c in self.launched.values())


def _correlation(ev: Mapping[str, Any]) -> Any:
    args = ev.get("args")
    return args.get("correlation") if isinstance(args, dict) else None


def place_gpu_events(events: Sequence[Mapping[str, Any]]) -> Placement:
    spans = cpu_step_spans(events)
    span_of = {step: (lo, hi) for step, lo, hi in spans}
    launches = {
        _correlation(e): e
        for e in events
        if _complete(e) and e.get("cat") in LAUNCH_CATS and _correlation(e) is not None
    }
    placed: dict[int, dict[str, int]] = {}
    ran_inside = outside = unlinked = 0
    for e in events:
        if not _complete(e) or e.get("cat") not in GPU_CATS:
            continue
        launch = launches.get(_correlation(e))
        if launch is None:
            unlinked += 1
            continue
        step = _step_at(spans, float(launch["ts"]))
        if step is None:
            outside += 1
            continue
        per = placed.setdefault(step, {})
        per[str(e["cat"])] = per.get(str(e["cat"]), 0) + 1
        lo, hi = span_of[step]
        if lo <= float(e["ts"]) and float(e["ts"]) + float(e.get("dur", 0)) <= hi:
            ran_inside += 1
    gpu_steps = sum(
        1
        for e in events
        if _complete(e)
        and str(e.get("name", "")).startswith("ProfilerStep#")
        and str(e.get("cat", "")).startswith("gpu")
    )
    return Placement([s for s, _, _ in spans], placed, ran_inside, outside, unlinked, gpu_steps)


@dataclass
class Collectives:
    cpu_ops: dict[str, int]  # collective CPU ranges (nccl:*, c10d::*, record_param_comms)
    launched: dict[str, int]  # GPU activities launched from inside them, by name
    nccl_kernels: dict[str, int]  # GPU activities whose name says NCCL (what profd counts)


def collectives(events: Sequence[Mapping[str, Any]]) -> Collectives:
    """The collectives in a trace, and the GPU work they launched (by correlation id)."""
    ranges: dict[tuple[Any, Any], list[tuple[float, float]]] = {}
    ops: dict[str, int] = {}
    for e in events:
        name = str(e.get("name", ""))
        cpu = _complete(e) and e.get("cat") in ("cpu_op", "user_annotation")
        if cpu and is_cpu_collective(name):
            ops[name] = ops.get(name, 0) + 1
            ts = float(e["ts"])
            ranges.setdefault((e.get("pid"), e.get("tid")), []).append(
                (ts, ts + float(e.get("dur", 0)))
            )
    from_collective: set[Any] = set()
    for e in events:
        if _complete(e) and e.get("cat") in LAUNCH_CATS:
            ts = float(e["ts"])
            if any(lo <= ts <= hi for lo, hi in ranges.get((e.get("pid"), e.get("tid")), [])):
                from_collective.add(_correlation(e))
    launched: dict[str, int] = {}
    nccl: dict[str, int] = {}
    for e in events:
        if not _complete(e) or e.get("cat") not in GPU_CATS:
            continue
        name = str(e.get("name", ""))
        if _correlation(e) in from_collective:
            launched[name] = launched.get(name, 0) + 1
        if is_gpu_collective(name):
            nccl[name] = nccl.get(name, 0) + 1
    return Collectives(ops, launched, nccl)


def nccl_problems(
    c: Collectives, counted: Sequence[Sequence[Any]], coll_ms: Sequence[float] | None, world: int
) -> tuple[list[str], str]:
    """What is wrong with the collectives the trace and the pipeline's statistics show, and
    what NCCL was seen doing. NCCL runs its collectives as kernels named ``ncclDevKernel_*``,
    except at world size 1, where it copies the buffer with a device-to-device memcpy
    (``cudaMemcpyAsync``, seen as ``Memcpy DtoD``) and launches no kernel; the statistics must
    count whichever it was as collective time."""
    problems = []
    counted_names = {str(x[0]) for x in counted}
    copies = {n: k for n, k in c.launched.items() if n.startswith(DTOD_MEMCPY)}
    if not c.cpu_ops:
        problems.append("no collective ranges in the trace")
    if c.nccl_kernels:
        did = f"NCCL kernels {c.nccl_kernels}"
        if not any(n in counted_names for n in c.nccl_kernels):
            problems.append("NCCL kernels not among the pipeline's collectives")
    elif world == 1 and copies:
        did = f"world size 1: NCCL copied on the device, no kernel ({copies})"
        if not any(n in counted_names for n in copies):
            problems.append("the collectives' DtoD memcpy not among the pipeline's collectives")
    else:
        did = "no NCCL kernel"
        problems.append(
            "no GPU activity named NCCL"
            + (", and no DtoD memcpy launched by a collective" if world == 1 else "")
            + f" (world size {world})"
        )
    if not coll_ms or not any(x > 0 for x in coll_ms):
        problems.append("no collective time in any step")
    return problems, did


def time_left(now: float, budget_end: float, box_end: float | None, want: float) -> float:
    """Seconds a wait may take: ``want``, cut to what is left of the check's time box and of
    the run's budget. Raises :class:`OutOfTime` (saying which ran out) when nothing is."""
    box = float("inf") if box_end is None else box_end - now
    budget = budget_end - now
    if box <= SPENT_S and box <= budget:
        raise OutOfTime("its time box is spent", box=True)
    if budget <= SPENT_S:
        raise OutOfTime("the time budget is spent", box=False)
    return max(0.0, min(want, box, budget))


def annotations_by_step(events: Sequence[Mapping[str, Any]], name: str) -> dict[int, int]:
    """How many CPU ``record_function`` ranges named ``name`` start in each step span."""
    spans = cpu_step_spans(events)
    out: dict[int, int] = {}
    for e in events:
        if _complete(e) and e.get("name") == name and e.get("cat") == "user_annotation":
            step = _step_at(spans, float(e["ts"]))
            if step is not None:
                out[step] = out.get(step, 0) + 1
    return out


def job_result(output: str) -> dict[str, Any] | None:
    """The last ``RESULT {json}`` line a job printed (one process: lines do not interleave)."""
    found = None
    for line in output.splitlines():
        at = line.find("RESULT {")
        if at >= 0:
            try:
                found = json.loads(line[at + len("RESULT ") :])
            except ValueError:
                continue
    return found if isinstance(found, dict) else None


def load_trace(path: Path) -> dict[str, Any]:
    opener: Any = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        doc: dict[str, Any] = json.load(fh)
    return doc


def nsys_section(text: str, report: str) -> list[str]:
    """The lines of one ``nsys stats`` report (``nvtx_sum``, ``cuda_gpu_kern_sum``) in the
    output the pipeline kept: from its ``** ... (report):`` header to the next header."""
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.lstrip().startswith("** "):
            inside = f"({report})" in line
            continue
        if line.startswith("Processing ["):  # nsys announces the next report
            inside = False
        if inside and line.strip():
            out.append(line)
    return out


# --- finding nsys (pure: unit-tested on a fake tree) -------------------------------------------
def _version_key(path: Path) -> tuple[int, int, tuple[int, ...], str]:
    # One that can write reports (its importer is there) first, then bin/nsys (the launcher
    # NVIDIA documents) before target-*/nsys, newer versions first.
    nums = tuple(int(n) for n in re.findall(r"\d+", str(path)))
    importer = 1 if nsys_cli.import_problem(str(path)) else 0
    return (importer, 0 if path.parent.name == "bin" else 1, tuple(-n for n in nums), str(path))


def find_nsys(env: Mapping[str, str], root: Path = Path("/")) -> tuple[str | None, str]:
    """The nsys binary to use and where it was found, or None and everywhere that was looked.

    ``PROFD_NSYS`` (profd's own setting) wins, then ``PATH``, then NVIDIA's install folders
    under ``root`` (:data:`NSYS_GLOBS`)."""
    configured = env.get("PROFD_NSYS")
    if configured:
        if os.access(configured, os.X_OK) and os.path.isfile(configured):
            return configured, "PROFD_NSYS"
        return None, f"PROFD_NSYS={configured} is not an executable file"
    on_path = shutil.which("nsys", path=env.get("PATH", ""))
    if on_path:
        return on_path, "PATH"
    found: set[Path] = set()
    for pattern in NSYS_GLOBS:
        for p in root.glob(pattern):
            if p.name == "nsys" and p.is_file() and os.access(p, os.X_OK):
                found.add(p)
    if found:
        best = sorted(found, key=_version_key)[0]
        return str(best), f"{len(found)} found under {', '.join(sorted(_tops(found, root)))}"
    looked = sorted(
        {str(root.joinpath(*(p for p in Path(g).parts[:3] if p != "**"))) for g in NSYS_GLOBS}
    )
    return None, f"none on PATH, nor in {', '.join(looked)} (searched recursively)"


def _tops(paths: Iterable[Path], root: Path) -> set[str]:
    return {str(root.joinpath(*p.relative_to(root).parts[:3])) for p in paths}


# --- docs/gpu.md (pure: unit-tested) -----------------------------------------------------------
def render(machine: Mapping[str, str], results: Sequence[Result], when: str, cmd: str) -> str:
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
    lines = [
        "# profd on a real GPU",
        "",
        f"Recorded {when} by `{cmd}` (tests/gpu/gpucheck.py; how to run it: see the end).",
        "",
        f"**{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped.**",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {_cell(v)} |" for k, v in machine.items()),
        "",
        "## Checks",
        "",
        "| check | result | what was seen |",
        "|---|---|---|",
        *(f"| {r.name} | {r.status} | {_cell(r.evidence)} |" for r in results),
        "",
        *HISTORY.splitlines(),
        "",
        "## Details",
        "",
    ]
    for r in results:
        lines += [f"### {r.name}: {r.status}", "", r.evidence, ""]
        if r.seen:
            lines += ["```json", json.dumps(r.seen, indent=1, sort_keys=True, default=str)]
            lines += ["```", ""]
    lines += [*TWO_GPUS.splitlines(), ""]
    lines += HOW_TO_RUN.splitlines()
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


#: What earlier GPU runs found and what was changed for it: kept in every report, since a
#: report alone says only what passes now.
HISTORY = """## What the GPU runs found, and the fixes

The first run (2026-11-26, the same kind of H100 machine, profd 94af0d0) passed 6 of 8
checks and showed four more problems; each is fixed, and the run above checks the fixes.

- **nsys** sat in `processing` until the check gave up at 300 s: the nsys found (inside
  Nsight Compute 2025.3.1) printed "Unable to retrieve the importer version" and left only a
  `.qdstrm`, and the armed rank's training thread sat ~2 min inside `cudaProfilerStop`
  (nsys's own wait: docs/operations.md). That nsys *has* a `QdstrmImporter`, which cannot
  load (`libdw.so.1` missing). Fixed: the daemon runs `QdstrmImporter --version` once before
  an nsys session and refuses `start --backend nsys` at once, in one line naming the missing
  library and what to install; `profctl run --nsys` warns at launch; a hang incident inside
  `cudaProfilerStop` says so instead of "paused on purpose".
- **The memory snapshot** stalled training 1,723.7 ms at capture end (8.7 ms without).
  Fixed: it is pickled and written on a thread of its own, and the allocator history keeps
  Python frames only (symbolising C++ frames in `_snapshot()` was the stall;
  `PROFD_MEMORY_STACKS=all` keeps them): 7.2 ms with a snapshot, 7.6 ms without, above.
- **The idle-cost check** passed whatever it measured (across processes the noise was
  ±30 %). Fixed: one process, 20 pairs of 100-step blocks with the client's hooks on and off
  in alternation; the ratio with a bootstrap interval, failing above 1.01 beyond it.
- **The nccl check** wanted NCCL kernels; at world size 1 NCCL copies on the device instead.
  Fixed: the check accepts that memcpy at world size 1, and the statistics count GPU work a
  collective launched (by correlation id) as collective time, not compute.
- **`dev.py wheelhouse`** found no py-spy wheel (it asked for `manylinux_2_28` only; py-spy
  ships `manylinux1`). Fixed: every manylinux tag up to 2_28 is asked for.
- **The run took 417 s**, 305 of them waiting on nsys. Fixed: each check is time-boxed (nsys
  90 s) and prints its line as it ends; the run takes under a minute once `.gpu-venv` exists
  (2.5 min with its set-up).
- **After the typed-messages change** (2026-11-26, H100, profd 1651f5d: the protocol a
  package, `hb` and `arm` decoded by msgspec, the control schemas out of the client, the
  daemon's loop and index split): 8 of 8 passed, the client's CUDA paths unchanged; and
  again at 167a5fd with every agent message typed.
- **With the black box on** (2026-11-27, an H200, profd dc293ec: every rank keeps its last
  two minutes of steps, regions and samples in rings, on by default): 8 of 8 passed. Its
  20-pair idle A/B read 1.0285 (interval 0.988..1.054), too wide to tell the box
  from noise, so four longer runs followed on the same machine (`--only idle-cost+stall
  --idle-pairs 100`, box on and `PROFD_BLACKBOX=0` in turn): on 1.0072 (0.982..1.044) and
  1.0119 (0.987..1.047), off 1.0078 (0.994..1.036) and 0.9920 (0.975..1.016). On ~1 ms GPU
  steps the box is not told apart from the client without it; each pair's own spread (IQR
  about ±5 %) is what limits the check, not the client.
- **Again the next session** (2026-11-27, an H200, profd 131e3eb; no change to the client's
  CUDA paths since): 8 of 8 passed, idle A/B 0.9965 (0.974..1.031).
- **Again** (2026-11-27 15:06, an H200, profd 70a7eb5: the warehouse's sealed days, no change
  to the client's CUDA paths): 8 of 8 passed (the run above), idle A/B 1.0210
  (0.968..1.064): inside noise, as the longer runs above showed."""


TWO_GPUS = """## Two GPUs (manual)

The checks run on one GPU, where NCCL runs no collective kernel: at world size 1 (torch 2.11,
NCCL 2.28.9) the job's all-reduce and all-to-all launched one `Memcpy DtoD (Device -> Device)`
a step between them, from inside their `nccl:` ranges, and no `ncclDevKernel_*`. The `nccl`
check accepts that at world size 1 (`distributedInfo.world_size`), and requires the pipeline's
statistics to count the memcpy as collective time: they tie a GPU activity to the collective
CPU range whose CUDA call launched it, by kineto's correlation id. It therefore relies on
kineto writing `args.correlation` on both the CUDA runtime call and the activity, and on torch
recording the collectives as `nccl:*` / `c10d::*` ranges on the calling thread.

NCCL's kernels, and where ranks part, need 2 GPUs; run by hand on such a machine:

1. `profctl run --job two -- torchrun --standalone --nproc-per-node 2 TRAIN.py` (any DDP job
   on NCCL), then `profctl start --job two --activities cpu,cuda --steps 20:23 --wait`:
   `profctl traces --session ID --json` must list `ncclDevKernel_AllReduce_*` among each
   rank's `stats.collectives`, and `collective_ms` above 0 in every step.
2. With `TORCH_NCCL_TRACE_BUFFER_SIZE=200`, hold one rank before an all-reduce (a `sleep` on
   rank 1): `profctl stacks --job two` must say rank 1 never reached the collective that
   rank 0 entered (tested without a GPU on gloo dumps and on NCCL dumps built from the
   documented format).
"""

HOW_TO_RUN = """## How to run

On a machine with an NVIDIA GPU and torch installed (torch is never installed by this; the
machine needs no network):

    python3 dev.py wheelhouse   # once, where PyPI is reachable: fills .wheelhouse/ (~25 MiB)
    python3 dev.py test-gpu     # on the GPU machine, with .wheelhouse/ carried along

The wheelhouse holds profd's dependencies (not torch) as wheels for CPython 3.11 to 3.14 on
x86_64 Linux (every manylinux tag up to 2_28, which every torch 2.6+ machine meets: pip
matches platform tags exactly, and py-spy ships manylinux1 wheels only), plus setuptools,
wheel and pip. profd needs Python 3.11+: a GPU machine whose torch is on an older python is a set-up
failure (exit 2), said in one line.

`test-gpu` finds the python that has torch, makes `.gpu-venv` on top of it
(`--system-site-packages`), installs profd's dependencies from `.wheelhouse/` with
`pip install --no-index` (or uses the ones the system python has), installs profd with
`--no-deps --no-build-isolation -e .`, runs `tests/gpu/gpucheck.py` (a few minutes), prints
one PASS/FAIL/SKIP line per check and rewrites this file. Exit status: 0 nothing failed,
1 a check failed, 2 set-up failed, 3 no GPU (one line says why; nothing installed).

From an agent session with the device tool (the wheelhouse is an ignored folder, so it
travels only when named; docs/gpu.md comes back through `$OUT`):

    run(carry=[".wheelhouse"], command="python3 dev.py test-gpu", timeout_s=600)

The checks print their lines as they go (the tool returns the output's tail) and the report
is copied into `$OUT`, so it comes back as `gpu.md` among the returned files; copy it over
docs/gpu.md here and commit it.
"""


# --- the machine -------------------------------------------------------------------------------
def _run_text(argv: Sequence[str], timeout: float = 30) -> str:
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({exc})"
    return " ".join((p.stdout or p.stderr).split())


def machine_info(nsys: str | None, nsys_where: str) -> dict[str, str]:
    import torch

    info = {
        "host": socket.gethostname(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "torch CUDA": str(torch.version.cuda),
    }
    try:
        info["NCCL"] = ".".join(str(x) for x in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
    except Exception as exc:
        info["NCCL"] = f"({exc})"
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        info["GPU"] = f"{pynvml.nvmlDeviceGetName(h)} ({int(mem.total) / 2**30:.0f} GiB)"
        info["GPUs"] = str(pynvml.nvmlDeviceGetCount())
        info["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion_v2())
        info["driver CUDA"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
    except Exception as exc:
        info["GPU"] = f"(NVML: {exc})"
    info["nsys"] = f"{nsys} ({_run_text([nsys, '--version'])})" if nsys else "none"
    info["nsys search"] = nsys_where
    cannot = nsys_cli.import_problem(nsys) if nsys else None
    if cannot:
        info["nsys importer"] = f"cannot write reports: {cannot}"
    from profd_client.protocol import RELEASE

    # PROFD_REV: the commit the tree was copied from, where the copy's own git says another
    # (a device machine given a working tree over a checkout of the last landed commit).
    rev = os.environ.get("PROFD_REV") or _run_text(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
    )
    info["profd"] = f"{RELEASE} ({rev})" if re.fullmatch(r"[0-9a-f]+", rev) else RELEASE
    return info


# --- the bench: the daemon, the jobs, the sessions ---------------------------------------------
class Bench:
    """One daemon under ``tmp``, jobs of ``cudajob.py`` against it, and what earlier checks
    found that later ones read."""

    def __init__(self, tmp: Path, nsys: str | None, cpu: bool, budget_s: float) -> None:
        self.tmp = tmp
        self.nsys = nsys
        self.cpu = cpu
        self.deadline = time.monotonic() + budget_s
        self.box_end: float | None = None  # the running check's time box
        env = {"PROFD_NSYS": nsys} if nsys else {}
        self.d = DaemonProcess(tmp / "profd", extra_env=env, ctl_timeout=120)
        self.jobs: list[Job] = []
        self.main_job: Job | None = None  # the job checks 1, 3 and 4 share
        self.main_stop = tmp / "stop"
        self.trace: dict[str, Any] | None = None  # check 1's trace, for checks 2 and 6
        self.row: dict[str, Any] | None = None  # check 1's traces row
        self.job_result: dict[str, Any] | None = None
        self.nsys_summary: str | None = None
        self.stalls: dict[str, float | None] = {}
        self.snapshot_notes: list[str] = []  # what the snapshot capture's report noted

    def left(self, want: float) -> float:
        return time_left(time.monotonic(), self.deadline, self.box_end, want)

    def start(self) -> None:
        self.d.root.mkdir(parents=True)
        # dev.py test-gpu installs the daemon without the warehouse's pyarrow and duckdb
        # (too large for what the GPU machine is handed), and nothing here reads it.
        self.d.config = self.d.root / "profd.toml"
        self.d.config.write_text("[warehouse]\nenabled = false\n")
        self.d.launch("-v")
        wait_for(lambda: self.d.ctl("status").returncode == 0, 30, "the daemon to answer")

    def stop(self) -> None:
        for j in self.jobs:
            j.kill()
        self.d.terminate()

    def job_env(self, **extra: str) -> dict[str, str]:
        e = self.d.env()
        e.update(PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", NCCL_PORT=str(free_port()))
        if self.cpu:
            e["DEVICE"] = "cpu"
        e.update(extra)
        return e

    def job(self, name: str, env: Mapping[str, str], under_nsys: bool = False) -> Job:
        """``cudajob.py`` as job ``name`` with ``env`` on top of the daemon's environment."""
        cmd = [sys.executable, str(JOB)]
        if under_nsys:
            cmd = [str(BIN / "profctl"), "run", "--nsys", "--job", name, "--", *cmd]
        log = self.tmp / f"{name}-{len(self.jobs)}.log"
        j = Job.spawn(cmd, self.job_env(PROFD_JOB=name, **env), log)
        self.jobs.append(j)
        return j

    def attached(self, job: str, timeout: float, min_step: int = 0) -> dict[str, Any]:
        def row() -> dict[str, Any] | None:
            for r in self.d.ctl_json("ps"):
                if r["job"] == job and r["step"] >= min_step:
                    return dict(r)
            return None

        found: dict[str, Any] = wait_for(row, self.left(timeout), f"job {job} to attach")
        return found

    def session(self, gate: Path | None, *args: str, timeout: float = 180) -> dict[str, Any]:
        """``profctl start ARGS --wait --json``; with ``gate``, the job's gate is opened once
        every target is armed. The final --json document."""
        t = self.left(timeout)
        argv = [str(BIN / "profctl"), "start", *args, "--wait", "--timeout", f"{t:.0f}", "--json"]
        p = subprocess.Popen(
            argv, env=self.d.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            if gate is not None:
                wait_for(self._armed, t, "the session to be armed", every=0.2)
                gate.touch()
            out, err = p.communicate(timeout=self.left(t) + 10)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        if p.returncode != 0:
            raise CheckFailed(f"profctl start {' '.join(args)} exited {p.returncode}: "
                              f"{_clip(err + out, 800)}")  # fmt: skip
        doc: dict[str, Any] = json.loads(out)
        return doc

    def cancel_live(self) -> None:
        """Cancel every session still running (a timed-out check's)."""
        try:
            for sess in self.d.ctl_json("sessions"):
                if sess["state"] not in TERMINAL:
                    self.d.ctl("cancel", sess["id"])
        except Exception as exc:  # the daemon itself may be what failed
            print(f"  could not cancel live sessions: {exc}", flush=True)

    def _armed(self) -> bool:
        """Some live session has every target armed (the one just started: one at a time)."""
        for s in self.d.ctl_json("sessions"):
            if s["state"] not in TERMINAL:
                targets = self.d.ctl_json("show", s["id"])["targets"]
                if targets and all(t["state"] == "armed" for t in targets):
                    return True
        return False

    def rows(self, session: str) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.d.ctl_json("traces", "--session", session)
        return rows

    def end_job(self, job: Job, stop: Path, timeout: float = 60) -> dict[str, Any]:
        stop.touch()
        rc = job.wait(self.left(timeout))
        result = job_result(job.output())
        if rc != 0 or result is None:
            raise CheckFailed(f"the job exited {rc}: {_clip(job.output(), 600)}")
        return result


class CheckFailed(Exception):
    pass


class OutOfTime(Exception):
    def __init__(self, why: str, box: bool) -> None:
        super().__init__(why)
        self.box = box  # the check's own time box ran out, not the run's budget


def _clip(text: str, n: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else "..." + text[-n:]


def _files(row: Mapping[str, Any]) -> dict[str, str]:
    return {f["kind"]: f["path"] for f in row.get("files", [])}


def _abs(b: Bench, path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else b.d.spool / p


# --- the checks --------------------------------------------------------------------------------
STEPS = (3, 6)  # the capture: ProfilerStep#3..5


def check_capture(b: Bench) -> Result:
    gate = b.tmp / "gate"
    b.main_job = b.job(
        "gpucheck", {"GATE": str(gate), "STOP": str(b.main_stop), "STEP_SLEEP": "0.02"}
    )
    b.attached("gpucheck", 120)
    lo, hi = STEPS
    res = b.session(gate, "--job", "gpucheck", "--steps", f"{lo}:{hi}", "--activities", "cpu,cuda")
    want = list(range(lo, hi))
    (row,) = b.rows(res["session"])
    b.row = row
    b.stalls["cpu,cuda capture"] = row.get("stall_ms")
    path = _abs(b, row["path"])
    doc = load_trace(path)
    b.trace = doc
    events = trace_events(doc)
    pl = place_gpu_events(events)
    stats = row.get("stats") or {}
    st = stats.get("steps") or {}
    seen = {
        "session": res["session"],
        "steps": row.get("steps"),
        "trace": f"{path.name} {path.stat().st_size} bytes",
        "profiler_steps": pl.steps,
        "gpu_launched_per_step": pl.launched,
        "gpu_ran_inside_launching_step": pl.ran_inside,
        "gpu_launched_outside_steps": pl.outside,
        "gpu_without_launch": pl.unlinked,
        "gpu_step_annotations": pl.gpu_step_annotations,
        "distributedInfo": doc.get("distributedInfo"),
        "stats_mode": stats.get("mode"),
        "stats_steps": st,
        "stall_ms": row.get("stall_ms"),
        "device": row.get("device"),
    }
    problems = []
    if pl.steps != want:
        problems.append(f"ProfilerStep spans {pl.steps}, asked for {want}")
    for cat in ("kernel", "gpu_memcpy"):
        if pl.steps_with(cat) != want:
            problems.append(f"{cat} launched in steps {pl.steps_with(cat)}, want {want}")
    if not doc.get("distributedInfo"):
        problems.append("no distributedInfo")
    if stats.get("mode") != "gpu":
        problems.append(f"pipeline stats mode {stats.get('mode')!r}, want 'gpu'")
    if st.get("step") != want:
        problems.append(f"pipeline stats steps {st.get('step')}, want {want}")
    elif not all(c > 0 for c in st.get("compute_ms", [])):
        problems.append(f"pipeline compute_ms {st.get('compute_ms')} (GPU time not compute)")
    dist = doc.get("distributedInfo")
    evidence = (
        f"steps {pl.steps}; {pl.total('kernel')} kernels, {pl.total('gpu_memcpy')} memcpys "
        f"launched in them ({pl.ran_inside} also ran inside their step, {pl.outside} launched "
        f"outside any step); distributedInfo "
        f"{'backend=' + str(dist.get('backend')) if isinstance(dist, dict) else 'missing'}; "
        f"stats mode {stats.get('mode')}, compute_ms {st.get('compute_ms')}"
    )
    if problems:
        return Result("capture", FAIL, "; ".join(problems) + f" | {evidence}", seen)
    return Result("capture", PASS, evidence, seen)


def check_nvml_ps(b: Bench) -> Result:
    row = b.attached("gpucheck", 30)
    pid = row["pid"]
    samples: list[dict[str, Any]] = []

    def sampled() -> dict[str, Any] | None:
        for r in b.d.ctl_json("ps"):
            if r["pid"] == pid:
                samples.append({k: r.get(k) for k in ("gpu_util", "gpu_mem_bytes", "step")})
                if r.get("gpu_mem_bytes") and r.get("gpu_util") is not None:
                    return dict(r)
        return None

    try:
        got = wait_for(sampled, b.left(30), "GPU columns for the job's pid", every=1.0)
    except AssertionError:
        got = None
    nvml_pids = _nvml_pids()
    seen = {"pid": pid, "samples": samples[-10:], "nvml_compute_pids": nvml_pids}
    if got is None:
        why = f"no GPU util+memory in ps for pid {pid} in 30 s; NVML lists the pids {nvml_pids}"
        return Result("nvml-ps", FAIL, why, seen)
    human = b.d.ctl("ps").stdout
    seen["ps"] = human.splitlines()
    mem = int(got["gpu_mem_bytes"])
    return Result(
        "nvml-ps",
        PASS,
        f"pid {pid}: gpu_util {got['gpu_util']}%, gpu_mem {mem / 2**20:.0f} MiB "
        f"(NVML compute pids {nvml_pids})",
        seen,
    )


def _nvml_pids() -> list[int] | str:
    try:
        import pynvml

        pynvml.nvmlInit()
        out: list[int] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out += [int(p.pid) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
        return out
    except Exception as exc:
        return f"NVML: {exc}"


def check_memory_snapshot(b: Bench) -> Result:
    res = b.session(None, "--job", "gpucheck", "--next", "--active", "2", "--memory-snapshot")
    (row,) = b.rows(res["session"])
    b.stalls["cpu,cuda capture + memory snapshot"] = row.get("stall_ms")
    b.snapshot_notes = [n for n in row.get("notes") or () if "memory snapshot" in n]
    files = _files(row)
    seen: dict[str, Any] = {"session": res["session"], "files": files, "steps": row.get("steps")}
    if "memory" not in files:
        notes = b.d.ctl_json("show", res["session"])
        return Result("memory-snapshot", FAIL, f"no memory file; files {sorted(files)}; "
                      f"session {_clip(json.dumps(notes), 400)}", seen)  # fmt: skip
    path = _abs(b, files["memory"])
    with path.open("rb") as fh:
        snap = pickle.load(fh)
    from torch.cuda import _memory_viz as viz

    segments = snap.get("segments", [])
    traces = snap.get("device_traces", [])
    actions: dict[str, int] = {}
    for dev in traces:
        for ev in dev:
            actions[ev.get("action", "?")] = actions.get(ev.get("action", "?"), 0) + 1
    html = viz.trace_plot(snap)  # type: ignore[no-untyped-call]
    seg_html = viz.segment_plot(snap)
    seen.update(
        bytes=path.stat().st_size,
        segments=len(segments),
        trace_actions=actions,
        trace_plot_chars=len(html),
        segment_plot_chars=len(seg_html),
    )
    evidence = (
        f"{path.name} {path.stat().st_size} bytes: {len(segments)} segments, trace actions "
        f"{actions}; memory_viz trace_plot {len(html)} chars, segment_plot {len(seg_html)}"
    )
    if not segments or not actions.get("alloc"):
        return Result("memory-snapshot", FAIL, "no allocations recorded | " + evidence, seen)
    return Result("memory-snapshot", PASS, evidence, seen)


def finish_main_job(b: Bench) -> None:
    if b.main_job is not None:
        b.job_result = b.end_job(b.main_job, b.main_stop)


def check_nsys(b: Bench, where: str) -> Result:
    if b.nsys is None:
        return Result("nsys", SKIP, f"no nsys on this machine: {where}")
    gate, stop = b.tmp / "nsys-gate", b.tmp / "nsys-stop"
    env = {"GATE": str(gate), "STOP": str(stop), "STEP_SLEEP": "0.02"}
    job = b.job("gpunsys", env, under_nsys=True)
    ps = b.attached("gpunsys", 60)
    cannot = nsys_cli.import_problem(b.nsys)
    if cannot is not None:
        # No report can come, and such an nsys holds the armed rank inside cudaProfilerStop
        # for minutes: what is checked is that profd refuses the capture at once, saying why.
        t0 = time.monotonic()
        try:  # (no gate: nothing is armed, so nothing would ever open it)
            b.session(None, "--backend", "nsys", "--job", "gpunsys", "--steps", "3:5")
        except CheckFailed as exc:
            said = str(exc)
        else:
            return Result("nsys", FAIL, f"{cannot}, yet the session succeeded")
        finally:
            job.kill()
        took = time.monotonic() - t0
        found = {"import_problem": cannot, "refusal": said, "seconds_to_refuse": round(took, 1)}
        ok = "cannot convert a capture into a report" in said and took < 10
        evidence = (
            f"{cannot}: the capture was refused in {took:.1f} s"
            f" {'saying so' if ok else 'without saying so'}; no .nsys-rep to read on this"
            " machine: install Nsight Systems (or what its importer lacks) to check reports"
        )
        return Result("nsys", PASS if ok else FAIL, evidence, found)
    res = b.session(gate, "--backend", "nsys", "--job", "gpunsys", "--steps", "3:5")
    rows = b.rows(res["session"])
    result = b.end_job(job, stop, timeout=120)
    seen: dict[str, Any] = {"session": res["session"], "nsys_session": ps.get("nsys_session")}
    seen["job_nvtx_pushes"] = result.get("nvtx_pushes")
    if len(rows) != 1:
        return Result("nsys", FAIL, f"{len(rows)} trace rows for the session: {rows}", seen)
    row = rows[0]
    files = _files(row)
    seen["files"] = files
    if "nsys" not in files or "summary" not in files:
        return Result("nsys", FAIL, f"files {files}: want an nsys report and a summary", seen)
    rep = _abs(b, files["nsys"])
    summary = _abs(b, files["summary"]).read_text(errors="replace")
    b.nsys_summary = summary
    nvtx = nsys_section(summary, "nvtx_sum")
    kern = nsys_section(summary, "cuda_gpu_kern_sum")
    seen.update(nvtx_sum=nvtx[:30], cuda_gpu_kern_sum=kern[:15], report_bytes=rep.stat().st_size)
    problems = []
    if "(nsys stats failed" in summary:
        problems.append(summary[summary.index("(nsys stats failed") :].splitlines()[0])
    if not rep.is_relative_to(b.d.spool) or rep.suffix != ".nsys-rep":
        problems.append(f"report {rep} is not an .nsys-rep in the spool")
    for step in ("ProfilerStep#3", "ProfilerStep#4"):
        if not any(step in line for line in nvtx):
            problems.append(f"{step} not in nvtx_sum")
    if any("ProfilerStep#5" in line or "ProfilerStep#2" in line for line in nvtx):
        problems.append("nvtx_sum holds steps outside 3:5")
    if len(kern) < 2:
        problems.append("cuda_gpu_kern_sum lists no kernels")
    evidence = (
        f"{rep.name} {rep.stat().st_size} bytes in the spool; nvtx_sum {len(nvtx)} lines, "
        f"cuda_gpu_kern_sum {max(len(kern) - 2, 0)} kernel rows (by {b.nsys})"
    )
    if problems:
        return Result("nsys", FAIL, "; ".join(problems) + " | " + evidence, seen)
    return Result("nsys", PASS, evidence, seen)


def check_regions(b: Bench) -> Result:
    pushes = (b.job_result or {}).get("nvtx_pushes", {})
    seen: dict[str, Any]
    if b.nsys_summary is not None:
        nvtx = nsys_section(b.nsys_summary, "nvtx_sum")
        found = {r: any(r in line for line in nvtx) for r in ("forward", "backward")}
        seen = {"nvtx_sum": nvtx[:30]}
        if all(found.values()):
            return Result("regions", PASS, "forward and backward are NVTX ranges in the nsys "
                          "report's nvtx_sum", seen)  # fmt: skip
        return Result("regions", FAIL, f"regions in nvtx_sum: {found}", seen)
    if b.trace is None:
        return Result("regions", FAIL, "no trace from the capture check to read")
    events = trace_events(b.trace)
    per = {r: annotations_by_step(events, r) for r in ("forward", "backward")}
    want = list(range(*STEPS))
    seen = {"record_function_per_step": per, "job_nvtx_pushes": pushes}
    evidence = (
        f"{'no nsys' if b.nsys is None else 'no nsys report (see nsys)'}, so not seen as NVTX:"
        f" record_function ranges per step {per}; the client "
        f"called torch.cuda.nvtx.range_push {pushes} times in the job (over all captures)"
    )
    ok = all(sorted(p) == want and all(n == 1 for n in p.values()) for p in per.values())
    ok = ok and all(pushes.get(r, 0) >= len(want) for r in ("forward", "backward"))
    return Result("regions", PASS if ok else FAIL, evidence, seen)


def check_nccl(b: Bench) -> Result:
    if b.trace is None or b.row is None:
        return Result("nccl", FAIL, "no trace from the capture check to read")
    c = collectives(trace_events(b.trace))
    stats = b.row.get("stats") or {}
    counted = stats.get("collectives") or []
    coll_ms = (stats.get("steps") or {}).get("collective_ms")
    seen = {
        "collective_cpu_ops": c.cpu_ops,
        "gpu_launched_by_collectives": c.launched,
        "nccl_named_gpu_activities": c.nccl_kernels,
        "stats_collectives": counted,
        "stats_collective_ms": coll_ms,
        "distributedInfo": b.trace.get("distributedInfo"),
    }
    evidence = (
        f"collective ops {c.cpu_ops}; they launched {c.launched}; NCCL kernels {c.nccl_kernels};"
        f" pipeline collectives {counted}, collective_ms per step {coll_ms}"
    )
    world = int((b.trace.get("distributedInfo") or {}).get("world_size") or 0)
    problems, did = nccl_problems(c, counted, coll_ms, world)
    evidence = f"{did}; {evidence}"
    if problems:
        return Result("nccl", FAIL, "; ".join(problems) + " | " + evidence, seen)
    return Result("nccl", PASS, evidence, seen)


def check_flight_recorder(b: Bench) -> Result:
    """A single-rank NCCL job with ``TORCH_NCCL_TRACE_BUFFER_SIZE`` set: ``profctl stacks``
    asks its agent thread for the flight recorder's summary, which must list NCCL
    collectives. (Where ranks part needs 2 GPUs and a stuck rank: on this one-GPU check
    the summary's content is what is checked; the divergence rule is tested on gloo dumps
    and constructed NCCL ones.)"""
    if b.cpu:
        return Result("flight-recorder", SKIP, "no GPU: NCCL's flight recorder needs one")
    j = b.job("flight", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "200", "STEP_SLEEP": "0.05"})
    try:
        b.attached("flight", 60, min_step=5)
        r = b.d.ctl("stacks", "--job", "flight", "--json")
        if r.returncode != 0:
            return Result("flight-recorder", FAIL, f"profctl stacks: {r.stderr.strip()}")
        (row,) = json.loads(r.stdout)["ranks"]
        summary = row.get("flight")
        seen = {"flight": summary, "flight_error": row.get("flight_error")}
        if summary is None:
            why = row.get("flight_error") or "no flight field (did the hello say flight?)"
            return Result("flight-recorder", FAIL, f"no summary: {why}", seen)
        ops = sorted({e["op"] for e in summary["entries"]})
        evidence = f"{len(summary['entries'])} entries, ops {ops}, groups {summary['pgs']}"
        ok = any(op.startswith("nccl:") for op in ops)
        return Result("flight-recorder", PASS if ok else FAIL, evidence, seen)
    finally:
        j.kill()


def check_idle_and_stall(b: Bench, pairs: int = 20, block: int = 100, warmup: int = 200) -> Result:
    """The client's idle cost inside one attached process: ``pairs`` pairs of ``block``-step
    blocks with its training-thread side on and off (``cudajob.py`` with ``AB``); and the
    stalls the captures reported, with and without a memory snapshot."""
    env = {"NCCL": "0", "STEPS": str(warmup + 2 * pairs * block), "STEP_SLEEP": "0"}
    env.update(WARMUP=str(warmup), AB=str(block))
    j = b.job("idle-ab", env)
    rc = j.wait(b.left(180))
    res = job_result(j.output())
    if rc != 0 or res is None:
        raise CheckFailed(f"the idle A/B run exited {rc}: {_clip(j.output(), 600)}")
    if not res.get("attached"):
        raise CheckFailed("the idle A/B run never attached")
    blocks = [(bool(on), float(us)) for on, us in res["ab_blocks"]]
    v = ab_verdict(blocks)
    on_us = median(us for on, us in blocks if on)
    off_us = median(us for on, us in blocks if not on)
    stalls = ", ".join(
        f"{k} {x:.1f} ms" if isinstance(x, int | float) else f"{k} n/a" for k, x in b.stalls.items()
    )
    stall_bad = stall_verdict(b.stalls)
    seen = {
        "ab_blocks": blocks,
        "block_steps": block,
        "ratio": v.ratio,
        "interval": [v.low, v.high],
        "iqr": [v.q1, v.q3],
        "failed": v.failed,
        "stall_ms": b.stalls,
        "snapshot_notes": b.snapshot_notes,
    }
    evidence = (
        f"{v.text()}; median block step {on_us:.1f} us on, {off_us:.1f} us off; stall at capture "
        f"end: {stalls or 'no capture ran'}"
        + (f" ({'; '.join(b.snapshot_notes)})" if b.snapshot_notes else "")
    )
    why = [w for w in ("the client's idle cost is above 1 %" if v.failed else None, stall_bad) if w]
    if why:
        return Result("idle-cost+stall", FAIL, " and ".join(why) + " | " + evidence, seen)
    return Result("idle-cost+stall", PASS, evidence, seen)


def idle_check(b: Bench, pairs: int | None) -> Result:
    # About 5 s of 1 ms steps on a GPU; --allow-cpu only tries the plumbing (slow CPU steps).
    if b.cpu:
        return check_idle_and_stall(b, pairs=pairs or 3, block=4, warmup=5)
    return check_idle_and_stall(b, pairs=pairs or 20)


# --- running them ------------------------------------------------------------------------------
Check = tuple[str, Callable[[], Result | None]]


def plan(b: Bench, nsys_where: str, idle_pairs: int | None = None) -> list[Check]:
    """The checks in the order they run (each name has its box in :data:`LIMITS`)."""
    return [
        ("capture", lambda: check_capture(b)),
        ("nvml-ps", lambda: check_nvml_ps(b)),
        ("memory-snapshot", lambda: check_memory_snapshot(b)),
        ("job-exit", lambda: finish_main_job(b)),
        ("nccl", lambda: check_nccl(b)),
        ("flight-recorder", lambda: check_flight_recorder(b)),
        ("idle-cost+stall", lambda: idle_check(b, idle_pairs)),
        # Last: a slow nsys must not leave the others without time.
        ("nsys", lambda: check_nsys(b, nsys_where)),
        ("regions", lambda: check_regions(b)),
    ]


def run_checks(b: Bench, checks: Sequence[Check]) -> list[Result]:
    """Run ``checks`` each in its time box, printing its line as it ends."""
    results: list[Result] = []
    for name, fn in checks:
        t0 = time.monotonic()
        b.box_end = t0 + LIMITS[name]
        jobs_before = len(b.jobs)
        try:
            r = fn()
        except OutOfTime as exc:
            r = out_of_time(name, time.monotonic() - t0, None if exc.box else str(exc))
        except Exception as exc:
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            r = Result(name, FAIL, _clip(detail, 800), {"traceback": traceback.format_exc()})
            if boxed_out(time.monotonic(), b.box_end):
                # A wait cut to the box (a job's, a subprocess's) ran out, not the check.
                r.evidence = f"{out_of_time(name, time.monotonic() - t0).evidence}: {r.evidence}"
        finally:
            b.box_end = None
        took = time.monotonic() - t0
        if r is None:
            print(f"  {name}: done in {took:.0f} s", flush=True)
            continue
        r.seen.setdefault("seconds", round(took, 1))
        if r.status == FAIL:
            r.seen.setdefault("job_logs", _job_logs(b))
            # What a failed check left running must not eat the next one's time.
            for j in b.jobs[jobs_before:]:
                if j is not b.main_job:
                    j.kill()
            b.cancel_live()
        print(f"{r.line()} [{took:.0f} s]", flush=True)
        results.append(r)
    return results


def out_of_time(name: str, took: float, budget: str | None = None) -> Result:
    """A check stopped by its time box fails (it hung or is too slow to re-run in one GPU
    window); one the run's ``budget`` never let finish is skipped, saying so."""
    if budget is None:
        return Result(name, FAIL, f"did not finish within its {LIMITS[name]:.0f} s time box"
                      f" (stopped after {took:.0f} s)")  # fmt: skip
    return Result(name, SKIP, f"not run: {budget}")


def boxed_out(now: float, box_end: float | None) -> bool:
    """Whether a check's time box is (all but) spent at ``now``: a wait cut to it ended."""
    return box_end is not None and now >= box_end - SPENT_S - 1


def _job_logs(b: Bench) -> dict[str, str]:
    logs = {j.out.name: _clip(j.output(), 2000) for j in b.jobs if j.out.exists()}
    if b.d.log.exists():
        logs["profd.log"] = _clip(b.d.log.read_text(errors="replace"), 2000)
    return logs


def cuda_ok() -> str | None:
    """Why CUDA cannot be used here, or None."""
    try:
        import torch
    except Exception as exc:
        return f"torch cannot be imported: {exc!r}"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() false)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="report file (default docs/gpu.md)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all checks")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--allow-cpu", action="store_true", help="run the plumbing without a GPU")
    ap.add_argument(
        "--only",
        action="append",
        choices=sorted(LIMITS),
        metavar="CHECK",
        help="run only this check (repeatable); the others are not in the report",
    )
    ap.add_argument(
        "--idle-pairs",
        type=int,
        metavar="N",
        help="pairs of on/off blocks in idle-cost+stall (default 20); a longer run"
        " narrows its interval (its time box grows with it)",
    )
    args = ap.parse_args(argv)
    why = cuda_ok()
    if why is not None and not args.allow_cpu:
        print(f"gpucheck: no GPU: {why}", flush=True)
        return EXIT_NO_GPU
    if not (BIN / "profd").exists():
        print(f"gpucheck: no profd in {BIN}: install profd into this python first", flush=True)
        return 2
    out = args.out or (ROOT / "docs" / "gpu.md" if why is None else None)
    nsys, where = find_nsys(os.environ)
    started = datetime.datetime.now(datetime.UTC)
    machine = machine_info(nsys, where)
    if why is not None:
        machine["note"] = f"--allow-cpu: {why}"
    for k, v in machine.items():
        print(f"  {k}: {v}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="profd-gpucheck-"))
    b = Bench(tmp, nsys, cpu=why is not None, budget_s=args.budget)
    try:
        b.start()
        checks = plan(b, where, args.idle_pairs)
        if args.only:
            checks = [c for c in checks if c[0] in args.only]
        if args.idle_pairs:
            # The box grows with the run: ~0.23 s a pair of 100 one-millisecond steps, and slack.
            LIMITS["idle-cost+stall"] = max(LIMITS["idle-cost+stall"], 60 + 0.5 * args.idle_pairs)
        results = run_checks(b, checks)
    finally:
        b.stop()
        if args.keep:
            print(f"gpucheck: kept {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    took = (datetime.datetime.now(datetime.UTC) - started).total_seconds()
    when = f"{started:%Y-%m-%d %H:%M} UTC ({took:.0f} s)"
    if out is not None:
        out.write_text(render(machine, results, when, "python3 dev.py test-gpu"))
        print(f"gpucheck: wrote {out}", flush=True)
        # On the device tool's machine only what lands in $OUT comes back.
        dest = os.environ.get("OUT")
        if dest and os.path.isdir(dest) and out.resolve().parent != Path(dest).resolve():
            shutil.copy(out, Path(dest) / out.name)
            print(f"gpucheck: copied it to {dest}", flush=True)
    failed = [r.name for r in results if r.status == FAIL]
    print(f"gpucheck: {len(results) - len(failed)} of {len(results)} without failure"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)  # fmt: skip
    return EXIT_FAILED if failed else 0


if __name__ == "__main__":
    sys.exit(main())
