"""Turn one raw kineto Chrome trace into the files profd keeps and uploads.

Runs inside a daemon worker process (``ProcessPoolExecutor``, spawn context), never on the
training thread, so it may spend a few seconds of CPU and a few hundred MB of memory on a large
trace. It must not import torch: the daemon never does.

For one raw trace it writes, into ``final_dir``:

* ``{stem}.pt.trace.json.gz``: the trace with ``distributedInfo.rank`` guaranteed, gzipped;
* ``{stem}.summary.txt``: step time statistics and top operators by self time;
* ``{stem}.memory.html``: memory over time per device, when the trace has ``[memory]`` events
  (``--profile-memory``; see :mod:`.memory_report`);

moves the caller's extra files (memory snapshots...) next to them, and only then deletes the
raw trace, so a failure at any point leaves the raw trace in place to retry or inspect.

Errors: :class:`PipelineError` means the input itself is unusable (retrying will not help);
``OSError`` means the environment failed (disk full, permissions) and a retry may succeed.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from .memory_report import MEMORY_SUFFIX, memory_series, render_memory_html
from .spans import STEP_PREFIX, StepSpan, complete_events, step_spans

GZIP_LEVEL = 6
DEFAULT_TOP_N = 30
NAME_WIDTH = 60
TRACE_SUFFIX = ".pt.trace.json.gz"
SUMMARY_SUFFIX = ".summary.txt"

CPU_OP_CATS = frozenset({"cpu_op", "user_annotation", "python_function"})
GPU_OP_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


class PipelineError(Exception):
    pass


@dataclass(frozen=True)
class ProcessedFile:
    kind: str  # "trace" | "summary" | "memory" | whatever the caller passed for extras
    path: str
    bytes: int


@dataclass(frozen=True)
class ProcessedTrace:
    files: tuple[ProcessedFile, ...]
    trace_path: str
    steps_found: tuple[int, ...]
    step_ms_p50: float | None
    step_ms_p90: float | None
    step_ms_max: float | None
    raw_bytes: int  # size of the raw (uncompressed, kineto-indented) trace file


@dataclass(frozen=True)
class StepStats:
    durations_ms: tuple[tuple[int, float], ...]  # (step, ms), sorted by step
    p50_ms: float | None
    p90_ms: float | None
    max_ms: float | None

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(step for step, _ in self.durations_ms)


@dataclass(frozen=True)
class OpStat:
    name: str
    calls: int
    self_us: float
    total_us: float


# ---------------------------------------------------------------------------------------------
# Analysis


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    # Linear interpolation between closest ranks (numpy's default), defined for n == 1 too,
    # unlike statistics.quantiles.
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize_steps(events: Iterable[Any]) -> StepStats:
    """Step durations from the ``ProfilerStep#N`` annotations torch.profiler emits per step."""
    return step_stats(step_spans(events))


def step_stats(spans: Iterable[StepSpan]) -> StepStats:
    by_step: dict[int, float] = {}
    for span in spans:
        # A step number appears once per profiled process; should a merged trace repeat one,
        # the longest occurrence is the one that bounded the step.
        by_step[span.step] = max(by_step.get(span.step, 0.0), span.dur_us / 1000.0)
    if not by_step:
        return StepStats((), None, None, None)
    ordered = tuple(sorted(by_step.items()))
    values = sorted(by_step.values())
    return StepStats(ordered, _percentile(values, 0.5), _percentile(values, 0.9), values[-1])


def cpu_op_stats(events: Iterable[Any]) -> list[OpStat]:
    """Per-name CPU operator stats with self time = duration minus direct children.

    Nesting is resolved per (pid, tid) with one sort and a stack sweep, O(n log n), because a
    large trace holds hundreds of thousands of events. ProfilerStep annotations take part in
    the nesting (so they do not leak into the self time of anything) but are left out of the
    result, since they are whole steps, not operators.
    """
    by_thread: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    for ev in complete_events(events):
        if ev.get("cat") not in CPU_OP_CATS:
            continue
        key = (ev.get("pid"), ev.get("tid"))
        by_thread.setdefault(key, []).append(
            (float(ev["ts"]), float(ev["dur"]), str(ev.get("name", "")))
        )

    calls: dict[str, int] = {}
    self_us: dict[str, float] = {}
    total_us: dict[str, float] = {}
    for intervals in by_thread.values():
        # Parents before children: earlier start first, and at equal start the longer one.
        intervals.sort(key=lambda iv: (iv[0], -iv[1]))
        children_us = [0.0] * len(intervals)
        stack: list[tuple[float, int]] = []  # (end, index)
        for i, (ts, dur, _) in enumerate(intervals):
            # Compare starts against ends, not ends against ends: kineto rounds timestamps to
            # ns in floating point, so a child's end may overshoot its parent's by a hair.
            while stack and stack[-1][0] <= ts:
                stack.pop()
            if stack:
                children_us[stack[-1][1]] += dur
            stack.append((ts + dur, i))
        for (_, dur, name), child in zip(intervals, children_us, strict=True):
            if name.startswith(STEP_PREFIX):
                continue
            calls[name] = calls.get(name, 0) + 1
            self_us[name] = self_us.get(name, 0.0) + max(dur - child, 0.0)
            total_us[name] = total_us.get(name, 0.0) + dur
    return _sorted_stats(calls, self_us, total_us)


def gpu_op_stats(events: Iterable[Any]) -> list[OpStat]:
    """Per-name GPU kernel/memcpy/memset stats; device activities do not nest, self == total."""
    calls: dict[str, int] = {}
    dur_us: dict[str, float] = {}
    for ev in complete_events(events):
        if ev.get("cat") not in GPU_OP_CATS:
            continue
        name = str(ev.get("name", ""))
        calls[name] = calls.get(name, 0) + 1
        dur_us[name] = dur_us.get(name, 0.0) + float(ev["dur"])
    return _sorted_stats(calls, dur_us, dur_us)


def _sorted_stats(
    calls: Mapping[str, int], self_us: Mapping[str, float], total_us: Mapping[str, float]
) -> list[OpStat]:
    stats = [OpStat(name, calls[name], self_us[name], total_us[name]) for name in calls]
    stats.sort(key=lambda s: (-s.self_us, s.name))
    return stats


# ---------------------------------------------------------------------------------------------
# Rendering


def inject_rank(doc: dict[str, Any], rank: int, world_size: int) -> bool:
    """Make sure ``doc`` carries ``distributedInfo.rank``; return whether anything was added.

    HTA refuses to tell ranks apart without it, and a non-distributed (or single-process)
    kineto trace has no distributedInfo at all. An existing rank is trusted over ours: kineto
    took it from the live process group.
    """
    info = doc.get("distributedInfo")
    if isinstance(info, dict) and "rank" in info:
        return False
    if not isinstance(info, dict):
        info = {}
    info.setdefault("world_size", world_size)
    info["rank"] = rank
    doc["distributedInfo"] = info
    return True


def _trace_chunks(doc: Mapping[str, Any]) -> Iterator[str]:
    """Compact JSON for ``doc``, with distributedInfo alone on the first line.

    HTA maps files to ranks with ``re.search(r'"rank":\\s+(\\d+)')`` over the file's lines, up
    to the first line that matches: plain compact JSON (``"rank":3``) does not match at all and
    HTA silently files every trace under rank 0, and a one-line file would make it search the
    whole trace. So distributedInfo goes first, with rank as its first key and ": " separators,
    and a newline follows it; the rest stays compact.
    """
    compact = (",", ":")
    info = doc.get("distributedInfo")
    first = True
    yield "{"
    if isinstance(info, dict):
        ordered = {"rank": info["rank"], **info} if "rank" in info else info
        yield '"distributedInfo": ' + json.dumps(ordered, separators=(", ", ": ")) + "\n"
        first = False
    for key, value in doc.items():
        if key == "distributedInfo" and isinstance(info, dict):
            continue
        yield ("" if first else ",") + json.dumps(key) + ":" + json.dumps(value, separators=compact)
        first = False
    yield "}"


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _clip(name: str) -> str:
    name = " ".join(name.split())  # op names can carry newlines (python_function, annotations)
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."


def _op_table(title: str, stats: Sequence[OpStat], top_n: int) -> list[str]:
    grand_self = sum(s.self_us for s in stats) or 1.0
    shown = stats[:top_n]
    lines = [
        f"{title} (top {len(shown)} of {len(stats)} by self time)",
        f"{'name':<{NAME_WIDTH}} {'calls':>8} {'self_ms':>12} {'self_avg_us':>12} "
        f"{'total_ms':>12} {'self_%':>7}",
    ]
    for s in shown:
        lines.append(
            f"{_clip(s.name):<{NAME_WIDTH}} {s.calls:>8} {s.self_us / 1000.0:>12.3f} "
            f"{s.self_us / s.calls:>12.1f} {s.total_us / 1000.0:>12.3f} "
            f"{100.0 * s.self_us / grand_self:>7.2f}"
        )
    return lines


def header_lines(title: str, header: Mapping[str, str]) -> list[str]:
    """A summary's title and aligned ``key: value`` lines, then a blank line."""
    lines = [title]
    width = max((len(k) for k in header), default=0)
    for key, value in header.items():
        # A stray newline in a caller's value would otherwise forge extra header lines.
        lines.append(f"{key + ':':<{width + 1}} {' '.join(str(value).splitlines())}")
    lines.append("")
    return lines


def render_summary(
    header: Mapping[str, str],
    steps: StepStats,
    cpu_ops: Sequence[OpStat],
    gpu_ops: Sequence[OpStat],
    top_n: int,
) -> str:
    lines = header_lines("# profd trace summary", header)
    lines.append("## step time (ProfilerStep#N)")
    lines.append(
        f"count {len(steps.durations_ms)}  p50 {_fmt_ms(steps.p50_ms)} ms  "
        f"p90 {_fmt_ms(steps.p90_ms)} ms  max {_fmt_ms(steps.max_ms)} ms"
    )
    if steps.durations_ms:
        lines.append(f"{'step':>10} {'duration_ms':>14}")
        lines.extend(f"{step:>10} {ms:>14.3f}" for step, ms in steps.durations_ms)
    lines.append("")
    lines.append("## CPU operators")
    if cpu_ops:
        lines.extend(_op_table("CPU ops", cpu_ops, top_n))
    else:
        lines.append("(no CPU operator events)")
    if gpu_ops:
        lines.append("")
        lines.append("## GPU kernels, memcpy and memset")
        lines.extend(_op_table("GPU ops", gpu_ops, top_n))
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Files


def _current_umask() -> int:
    # os.umask() can only be read by setting it, which races with threads creating files
    # elsewhere in the process; Linux exposes it read-only in /proc instead.
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


@contextlib.contextmanager
def _temp_in(final_dir: str, stem: str) -> Iterator[tuple[str, IO[bytes]]]:
    """A temp file next to its destination, removed again unless the caller renamed it away.

    The name is a dotfile ending in ``.tmp-XXXX`` so that neither HTA (which loads every
    ``*.json``/``*.gz`` in a directory) nor torch-tb-profiler (which matches
    ``*.pt.trace.json[.gz]``) picks up a half-written file.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.tmp-", dir=final_dir)
    try:
        with os.fdopen(fd, "wb") as fh:
            # mkstemp creates 0600; the final files should be as readable as any other file
            # the daemon writes (people inspect them on the node, uploaders may be other users).
            os.fchmod(fh.fileno(), 0o666 & ~_current_umask())
            yield tmp, fh
            fh.flush()
            # Without fsync a crash shortly after the rename can leave an empty file under
            # the final name, and the raw trace will already have been deleted.
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _move_into(src: str, final_dir: str) -> str:
    dest = os.path.join(final_dir, os.path.basename(src))
    if os.path.abspath(src) == os.path.abspath(dest):
        return dest
    if not os.path.exists(src) and os.path.exists(dest):
        return dest  # moved by an earlier attempt that failed later on; keep retries working
    try:
        os.replace(src, dest)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        tmp: str | None = None
        try:
            with _temp_in(final_dir, os.path.basename(src)) as (tmp, fh), open(src, "rb") as inp:
                shutil.copyfileobj(inp, fh, 1 << 20)
            os.replace(tmp, dest)
        except BaseException:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            raise
        os.unlink(src)
    return dest


def _load(raw_trace: str) -> dict[str, Any]:
    # errors="replace": one undecodable byte in some op name must not cost the whole trace.
    with open(raw_trace, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PipelineError(f"{raw_trace}: not valid JSON ({exc})") from None
    del text
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise PipelineError(f"{raw_trace}: not a Chrome trace (no traceEvents list)")
    return doc


def process_trace(
    raw_trace: str,
    final_dir: str,
    stem: str,
    rank: int,
    world_size: int,
    extra_files: Sequence[tuple[str, str]] = (),
    top_n: int = DEFAULT_TOP_N,
    header: Mapping[str, str] | None = None,
) -> ProcessedTrace:
    """Finalize one raw trace; see the module docstring. The raw file goes last, on success."""
    if not stem or os.sep in stem or stem.startswith("."):
        raise ValueError(f"bad stem {stem!r}")
    for kind, path in extra_files:
        moved = os.path.join(final_dir, os.path.basename(path))
        if not os.path.exists(path) and not os.path.exists(moved):
            raise PipelineError(f"extra {kind} file {path} does not exist")

    raw_bytes = os.path.getsize(raw_trace)
    doc = _load(raw_trace)
    inject_rank(doc, rank, world_size)
    events: list[Any] = doc["traceEvents"]
    spans = step_spans(events)
    steps = step_stats(spans)
    cpu_ops = cpu_op_stats(events)
    gpu_ops = gpu_op_stats(events)

    final_dir = os.path.abspath(final_dir)
    os.makedirs(final_dir, exist_ok=True)
    trace_path = os.path.join(final_dir, stem + TRACE_SUFFIX)
    summary_path = os.path.join(final_dir, stem + SUMMARY_SUFFIX)

    head: dict[str, str] = dict(header or {})
    head.setdefault("rank", str(rank))
    head.setdefault("world_size", str(world_size))
    head.setdefault("trace", os.path.basename(trace_path))
    head.setdefault("raw_bytes", str(raw_bytes))
    head.setdefault("events", str(len(events)))
    summary = render_summary(head, steps, cpu_ops, gpu_ops, top_n).encode("utf-8")
    where = ", ".join(f"{k} {head[k]}" for k in ("session", "cycle") if head.get(k))
    memory = render_memory_html(
        f"{stem} memory" + (f" ({where})" if where else ""),
        memory_series(events),
        spans,
    )
    memory_path = os.path.join(final_dir, stem + MEMORY_SUFFIX)

    # Both outputs are complete on disk before either takes its final name, which keeps the
    # window where only one of them exists as small as possible.
    with contextlib.ExitStack() as cleanup:
        trace_tmp, trace_fh = cleanup.enter_context(_temp_in(final_dir, stem))
        # filename: gzip headers record the original name; the temp name would be misleading.
        with gzip.GzipFile(
            filename=stem + ".pt.trace.json",
            mode="wb",
            fileobj=trace_fh,
            compresslevel=GZIP_LEVEL,
        ) as gz:
            for chunk in _trace_chunks(doc):
                gz.write(chunk.encode("utf-8"))
        del doc, events
        summary_tmp, summary_fh = cleanup.enter_context(_temp_in(final_dir, stem))
        summary_fh.write(summary)
        outputs = [(trace_tmp, trace_path), (summary_tmp, summary_path)]
        if memory is not None:
            memory_tmp, memory_fh = cleanup.enter_context(_temp_in(final_dir, stem))
            memory_fh.write(memory.encode("utf-8"))
            outputs.append((memory_tmp, memory_path))
    try:
        for tmp, final in outputs:
            os.replace(tmp, final)
    except BaseException:
        for tmp, _ in outputs:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise

    files = [
        ProcessedFile("trace", trace_path, os.path.getsize(trace_path)),
        ProcessedFile("summary", summary_path, os.path.getsize(summary_path)),
    ]
    if memory is not None:
        files.append(ProcessedFile("memory_report", memory_path, os.path.getsize(memory_path)))
    for kind, path in extra_files:
        dest = _move_into(path, final_dir)
        files.append(ProcessedFile(kind, dest, os.path.getsize(dest)))

    os.unlink(raw_trace)
    return ProcessedTrace(
        files=tuple(files),
        trace_path=trace_path,
        steps_found=steps.steps,
        step_ms_p50=steps.p50_ms,
        step_ms_p90=steps.p90_ms,
        step_ms_max=steps.max_ms,
        raw_bytes=raw_bytes,
    )
