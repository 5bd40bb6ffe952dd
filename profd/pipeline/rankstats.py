"""Per-rank statistics of one capture, for reports across ranks (``profctl report``).

Computed in the pipeline from the columns the other analyses already keep (see
:mod:`.parsed`), while the trace is open once anyway, so a report over thousands of ranks
reads a few kilobytes per rank from the index or from S3 manifests, never the traces.

Each step (a ``ProfilerStep#N`` span) is split into three parts that add up to its length:

* **compute**: the training thread inside a ``cpu_op`` that is no collective (or, when the
  trace has GPU activities, the device busy with non-collective kernels, memcpys, memsets).
  Annotations and Python frames do not count: a collective waited for inside a
  ``record_function`` block would otherwise pass for compute.
* **collective**: a collective in flight (``c10d::``, ``record_param_comms``, ``gloo:``/``nccl:``
  ranges on any thread, NCCL kernels, and any other GPU activity a collective range launched:
  at world size 1 NCCL copies an all-reduce's buffer with a device-to-device memcpy and runs
  no kernel) while nothing counted as compute runs. Compute wins the
  overlap: DDP's allreduce runs beside the backward pass, and only the wait it adds is a cost.
  gloo runs its collectives on threads of its own while the training thread blocks, which is
  why every thread's ranges are taken.
* **idle**: the rest: Python between operators, data loading, sleeps.

Besides the three parts, each step keeps its **wait**: the wall-clock time with a collective
in flight, compute *not* subtracted. DDP all-reduces a bucket as soon as its gradients are
ready, so a rank that arrives early waits for the others while its backward pass goes on: the
collective part above hides that wait behind compute, the wait shows it. It is what the
straggler rule compares across ranks, step by step.

In a synchronous job the ranks that arrive first at a collective wait there for the last one,
so the rank everyone waits for is the one with the least collective time (see
:mod:`profd.report.straggler`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from profd.pipeline.columns import Intervals, sorted_order, wall_us
from profd.pipeline.spans import StepSpan

if TYPE_CHECKING:
    from profd.pipeline.parsed import ParsedTrace

#: Bump when the meaning of a field changes; readers skip versions they do not know.
STATS_VERSION = 1
#: Operators kept per list: a rank's statistics stay a few kilobytes however large its trace.
STATS_TOP_N = 20
#: Steps kept (the first ones); ``steps_total`` says how many the trace had.
MAX_STEPS = 128
MAX_NAME = 160
STEP_COLUMNS = (
    "step",
    "start_us",
    "ms",
    "compute_ms",
    "collective_ms",
    "idle_ms",
    "gap_ms",
    "wait_ms",
)

_CPU_COLLECTIVE_PREFIXES = ("c10d::", "gloo:", "nccl:", "mpi:", "ucc:", "record_param_comms")


def is_cpu_collective(name: str) -> bool:
    return name.startswith(_CPU_COLLECTIVE_PREFIXES)


def is_gpu_collective(name: str) -> bool:
    return "nccl" in name.lower()


def _training_thread(parsed: ParsedTrace) -> Hashable | None:
    """The thread that holds the most ``ProfilerStep`` spans (the one that calls ``step()``)."""
    counts = parsed.groups.step_threads
    return max(counts, key=lambda k: counts[k]) if counts else None


def _parts(parsed: ParsedTrace) -> tuple[str, Intervals, Intervals, dict[str, list[float]]]:
    """(mode, compute, collective, per collective name [calls, µs]).

    A collective's µs are wall-clock: gloo runs one on several threads at once, and their sum
    would exceed the time it took (see :mod:`.ops`)."""
    cpu = parsed.groups.cpu
    coll_ids = {i for i, n in enumerate(cpu.names) if is_cpu_collective(n)}
    compute_ids = {i for i, c in enumerate(cpu.cats) if c == "cpu_op" and i not in coll_ids}
    main = _training_thread(parsed)
    calls: dict[str, list[tuple[float, float]]] = {}
    coll_pairs: list[tuple[float, float]] = []
    cpu_compute = Intervals()
    cpu_coll: dict[Hashable, list[tuple[float, float]]] = {}  # per thread, for launches

    def note(name: str, start: float, end: float, thread: Hashable = None) -> None:
        calls.setdefault(name, []).append((start, end))
        coll_pairs.append((start, end))
        if thread is not None:
            cpu_coll.setdefault(thread, []).append((start, end))

    for key, thread in cpu.threads.items():
        ts, dur, nid = thread.ts, thread.dur, thread.name
        if key == main:
            for i in thread.order():
                n = nid[i]
                if n in compute_ids:
                    cpu_compute.extend_sorted(ts[i], ts[i] + dur[i])
                elif n in coll_ids:
                    note(cpu.names[n], ts[i], ts[i] + dur[i], key)
        elif coll_ids and any(thread.name.count(c) for c in coll_ids):
            # Only threads that hold a collective are walked in Python: gloo's own threads.
            for i, n in enumerate(nid):
                if n in coll_ids:
                    note(cpu.names[n], ts[i], ts[i] + dur[i], key)

    gpu = parsed.groups.gpu
    if not gpu.ts:
        return "cpu", cpu_compute, Intervals.of(coll_pairs), _by_name(calls)
    gpu_coll = [is_gpu_collective(n) for n in gpu.names]
    launched: set[int] = set()
    for key, spans in cpu_coll.items():
        launched |= parsed.groups.launches.within(key, spans)
    gpu_compute = Intervals()
    for i in sorted_order(gpu.ts):
        n = gpu.name[i]
        start, end = gpu.ts[i], gpu.ts[i] + gpu.dur[i]
        if gpu_coll[n] or (launched and gpu.corr[i] in launched):
            note(gpu.names[n], start, end)
        else:
            gpu_compute.extend_sorted(start, end)
    return "gpu", gpu_compute, Intervals.of(coll_pairs), _by_name(calls)


def _by_name(calls: Mapping[str, list[tuple[float, float]]]) -> dict[str, list[float]]:
    return {name: [len(pairs), wall_us(pairs)] for name, pairs in calls.items()}


def _ms(us: float) -> float:
    return round(us / 1000.0, 3)


def _clip(name: str) -> str:
    name = " ".join(name.split())
    return name if len(name) <= MAX_NAME else name[: MAX_NAME - 3] + "..."


def step_table(
    spans: Sequence[StepSpan], compute: Intervals, collective: Intervals
) -> dict[str, list[float]]:
    """Per step: start (µs, the trace's clock), length, compute, collective, idle, the
    longest stretch with neither, and the time with a collective in flight, in ms."""
    both = compute.intersection(collective)
    busy = compute.union(collective)
    cols: dict[str, list[float]] = {k: [] for k in STEP_COLUMNS}
    seen: set[int] = set()
    for sp in spans:
        if sp.step in seen or len(seen) >= MAX_STEPS:
            continue
        seen.add(sp.step)
        lo, hi = sp.start_us, sp.end_us
        comp = compute.measure(lo, hi)
        in_flight = collective.measure(lo, hi)
        coll = in_flight - both.measure(lo, hi)
        idle = max(sp.dur_us - comp - coll, 0.0)
        cols["step"].append(sp.step)
        cols["start_us"].append(round(lo, 3))
        cols["ms"].append(_ms(sp.dur_us))
        cols["compute_ms"].append(_ms(comp))
        cols["collective_ms"].append(_ms(coll))
        cols["idle_ms"].append(_ms(idle))
        cols["gap_ms"].append(_ms(busy.longest_gap(lo, hi)))
        cols["wait_ms"].append(_ms(in_flight))
    return cols


def rank_stats(parsed: ParsedTrace, top_n: int = STATS_TOP_N) -> dict[str, Any]:
    """The statistics of one capture as a small JSON-able dict (see the module doc)."""
    mode, compute, collective, by_name = _parts(parsed)
    spans = parsed.spans
    steps = step_table(spans, compute, collective)
    out: dict[str, Any] = {
        "v": STATS_VERSION,
        "mode": mode,
        "steps": steps,
        "steps_total": len({sp.step for sp in spans}),
        "ops": [
            [_clip(o.name), o.calls, _ms(o.self_us), _ms(o.total_us)]
            for o in parsed.cpu_ops[:top_n]
        ],
        "gpu_ops": [[_clip(o.name), o.calls, _ms(o.self_us)] for o in parsed.gpu_ops[:top_n]],
        "collectives": [
            [_clip(name), int(calls), _ms(us)]
            for name, (calls, us) in sorted(by_name.items(), key=lambda kv: (-kv[1][1], kv[0]))[
                :top_n
            ]
        ],
    }
    memory = _peaks(parsed.groups.memory.peaks())
    if memory:
        out["memory"] = memory
    return out


def _peaks(peaks: Mapping[str, tuple[int, int]]) -> dict[str, dict[str, int]]:
    return {
        dev: {"peak_allocated": alloc, "peak_reserved": res}
        for dev, (alloc, res) in sorted(peaks.items())
    }


class RankStatistics:
    """The result plug-in behind ``stats`` in each capture's result (see :mod:`.outputs`)."""

    key = "stats"

    def __init__(self, top_n: int = STATS_TOP_N) -> None:
        self.top_n = top_n

    def compute(self, parsed: ParsedTrace) -> dict[str, Any]:
        return rank_stats(parsed, self.top_n)
