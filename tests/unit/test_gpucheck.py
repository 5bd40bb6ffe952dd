"""tests/gpu/gpucheck.py (``python3 dev.py test-gpu``) without a GPU: how it reads traces and
nsys output, finds nsys, writes docs/gpu.md, and how it says there is no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS / "gpu"))
sys.path.insert(0, str(TESTS))

import gpucheck as G  # noqa: E402
from kineto_synth import single_rank_nccl_events, sync_job_events, trace_bytes  # noqa: E402

from profd.pipeline.parsed import ParsedTrace  # noqa: E402
from profd.pipeline.rankstats import rank_stats  # noqa: E402


def synth(first_step: int = 100) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(trace_bytes(1_500_000, first_step=first_step))
    return doc


def complete(cat: str, name: str, ts: float, dur: float, **kw: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, **kw}


# --- traces ---------------------------------------------------------------------------------------
def test_kernels_and_memcpys_are_placed_in_the_step_that_launched_them() -> None:
    doc = synth()
    events = G.trace_events(doc)
    pl = G.place_gpu_events(events)
    n = len(pl.steps)
    assert n >= 2 and pl.steps == list(range(100, 100 + n))
    assert pl.steps_with("kernel") == pl.steps == pl.steps_with("gpu_memcpy")
    gpu = [e for e in events if e.get("cat") in G.GPU_CATS]
    assert pl.total("kernel") + pl.total("gpu_memcpy") == len(gpu)
    assert pl.outside == pl.unlinked == 0 and pl.gpu_step_annotations == 0
    assert 0 < pl.ran_inside <= len(gpu)


def test_gpu_step_annotations_are_not_steps_and_strays_are_counted() -> None:
    doc = synth()
    events = G.trace_events(doc)
    want = G.place_gpu_events(events).steps
    first = next(e for e in events if e.get("name") == f"ProfilerStep#{want[0]}")
    # kineto's copy of a step on a GPU stream, a kernel whose launch is in no step, and one
    # whose launch is not in the trace at all.
    events.append({**first, "cat": "gpu_user_annotation", "pid": 0, "tid": 7})
    end = max(float(e["ts"]) + float(e.get("dur", 0)) for e in events if G._complete(e))
    stray = {"correlation": -1}
    events.append(complete("cuda_runtime", "cudaLaunchKernel", end + 10, 5, args=stray))
    events.append(complete("kernel", "late", end + 20, 5, args=stray))
    events.append(complete("kernel", "orphan", end + 30, 5, args={"correlation": -2}))
    pl = G.place_gpu_events(events)
    assert pl.steps == want
    assert (pl.gpu_step_annotations, pl.outside, pl.unlinked) == (1, 1, 1)


#: What NCCL runs for a reduction on a one-rank communicator: no "nccl" in its name.
ONE_RANK = "(anonymous namespace)::oneRankReduce"


def test_collectives_name_what_they_launched() -> None:
    events = [
        complete("user_annotation", "ProfilerStep#7", 0, 1000),
        complete("cpu_op", "aten::mm", 10, 50),
        complete("cuda_runtime", "cudaLaunchKernel", 20, 5, args={"correlation": 1}),
        complete("cpu_op", "nccl:all_reduce", 100, 50),
        complete("cuda_runtime", "cudaLaunchKernel", 110, 5, args={"correlation": 2}),
        complete("cpu_op", "c10d::alltoall_base_", 200, 50),
        complete("cuda_runtime", "cudaLaunchKernel", 210, 5, args={"correlation": 3}),
    ]
    gpu = {"pid": 0, "tid": 7}
    events += [
        complete("kernel", "sm90_gemm", 30, 40, args={"correlation": 1}, **gpu),
        complete("kernel", ONE_RANK, 120, 9, args={"correlation": 2}, **gpu),
        complete("kernel", "ncclDevKernel_SendRecv(x)", 220, 9, args={"correlation": 3}, **gpu),
    ]
    c = G.collectives(events)
    assert c.cpu_ops == {"nccl:all_reduce": 1, "c10d::alltoall_base_": 1}
    assert c.launched == {ONE_RANK: 1, "ncclDevKernel_SendRecv(x)": 1}
    assert c.nccl_kernels == {"ncclDevKernel_SendRecv(x)": 1}
    assert G.annotations_by_step(events, "nccl:all_reduce") == {}  # a cpu_op, not a region
    events.append(complete("user_annotation", "forward", 5, 80))
    assert G.annotations_by_step(events, "forward") == {7: 1}


def _nccl(events: list[dict[str, Any]], world: int) -> tuple[list[str], str]:
    """The nccl check's verdict on a trace, with the pipeline's own statistics of it."""
    st = rank_stats(ParsedTrace.from_events(events, "t", {}, 30))
    return G.nccl_problems(
        G.collectives(events), st["collectives"], st["steps"]["collective_ms"], world
    )


def test_nccl_at_world_size_1_is_a_dtod_memcpy_the_statistics_count_as_collective() -> None:
    events = single_rank_nccl_events(steps=3)
    problems, did = _nccl(events, world=1)
    assert problems == [], problems
    assert did.startswith("world size 1: NCCL copied on the device, no kernel")
    assert "Memcpy DtoD (Device -> Device)': 3" in did
    # With 2 ranks NCCL must run kernels: a memcpy alone is no collective there.
    problems, _ = _nccl(events, world=2)
    assert problems == ["no GPU activity named NCCL (world size 2)"]
    # Ids the pipeline cannot read (negative): the check still ties the memcpy to the
    # collective, the statistics do not, and the check says so.
    for ev in events:
        if ev["cat"] in ("cuda_runtime", "gpu_memcpy", "kernel"):
            ev["args"] = {"correlation": -ev["args"]["correlation"]}  # type: ignore[index]
    problems, _ = _nccl(events, world=1)
    assert problems == [
        "the collectives' DtoD memcpy not among the pipeline's collectives",
        "no collective time in any step",  # its CPU ranges ran under the kernel
    ]


def test_nccl_kernels_pass_when_the_statistics_count_them() -> None:
    (events, _) = sync_job_events([[1000.0] * 3, [2000.0] * 3], gpu=True)
    events = [*events, {"ph": "X", "cat": "cpu_op", "name": "nccl:all_reduce", "ts": 1e6,
                        "dur": 1.0, "pid": 100, "tid": 100}]  # fmt: skip
    problems, did = _nccl(events, world=2)
    assert problems == [] and did.startswith("NCCL kernels {'ncclDevKernel_AllReduce"), did


# --- time boxes -----------------------------------------------------------------------------------
def test_time_left_is_cut_to_the_check_box_and_the_budget_and_says_which_ran_out() -> None:
    assert G.time_left(100.0, 1000.0, 190.0, 300.0) == 90.0  # the nsys box
    assert G.time_left(100.0, 150.0, 190.0, 300.0) == 50.0  # the budget ends first
    assert G.time_left(100.0, 1000.0, None, 30.0) == 30.0
    with pytest.raises(G.OutOfTime) as box:
        G.time_left(189.0, 1000.0, 190.0, 30.0)
    assert box.value.box
    with pytest.raises(G.OutOfTime) as budget:
        G.time_left(149.0, 150.0, 190.0, 30.0)
    assert not budget.value.box


def test_every_check_has_a_box_nsys_at_most_90_s_and_the_run_fits_in_5_minutes() -> None:
    names = [name for name, _ in G.plan(None, "")]  # type: ignore[arg-type]
    assert set(names) == set(G.LIMITS)
    assert G.LIMITS["nsys"] <= 90
    # The budget bounds the whole run whatever the boxes add up to; set-up takes the rest.
    assert G.BUDGET_S <= 260


class _Daemon:
    log = Path("/nonexistent/profd.log")


class _Bench:
    """What run_checks reads of a Bench: the time box, and what to clean up after a failure."""

    def __init__(self) -> None:
        self.box_end: float | None = None
        self.deadline = G.time.monotonic() + 600
        self.jobs: list[Any] = []
        self.main_job = None
        self.d = _Daemon()
        self.cancelled = 0

    def left(self, want: float) -> float:
        return G.time_left(G.time.monotonic(), self.deadline, self.box_end, want)

    def cancel_live(self) -> None:
        self.cancelled += 1


def test_run_checks_prints_each_line_as_it_ends_and_fails_a_check_past_its_box(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    b = _Bench()
    monkeypatch.setitem(G.LIMITS, "quick", 60.0)
    monkeypatch.setitem(G.LIMITS, "hung", 0.0)  # spent before its first wait
    monkeypatch.setitem(G.LIMITS, "between", 60.0)
    boxes: list[float | None] = []

    def quick() -> G.Result:
        boxes.append(b.box_end)
        return G.Result("quick", G.PASS, "fine")

    def hung() -> G.Result:
        b.left(300)  # what every wait of a check asks first
        raise AssertionError("not reached")

    def job_timed_out() -> G.Result:
        # A job's wait cut to the box raises its own timeout, not OutOfTime.
        raise G.subprocess.TimeoutExpired(["cudajob.py"], b.left(300))

    monkeypatch.setitem(G.LIMITS, "slow-job", G.SPENT_S + 1)
    results = G.run_checks(
        b,  # type: ignore[arg-type]
        [("quick", quick), ("between", lambda: None), ("hung", hung), ("slow-job", job_timed_out)],
    )
    assert [(r.name, r.status) for r in results] == [
        ("quick", G.PASS),
        ("hung", G.FAIL),
        ("slow-job", G.FAIL),
    ]
    assert results[1].evidence.startswith("did not finish within its 0 s time box")
    assert results[2].evidence.startswith("did not finish within its 3 s time box")
    assert "TimeoutExpired" in results[2].evidence
    assert boxes[0] is not None and b.box_end is None
    assert b.cancelled == 2  # each failed check's sessions were cancelled
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("PASS quick: fine [") and lines[0].endswith(" s]")
    assert lines[1].startswith("  between: done in ")
    assert lines[2].startswith("FAIL hung: did not finish within its 0 s time box")
    assert lines[3].startswith("FAIL slow-job: did not finish within its 3 s time box")
    # A budget that ran out skips, saying so; an error long before the box ends is no timeout.
    assert G.out_of_time("nsys", 5.0, "the time budget is spent").status == G.SKIP
    assert not G.boxed_out(100.0, 190.0) and G.boxed_out(187.5, 190.0)
    assert not G.boxed_out(100.0, None)


def test_annotations_by_step_on_a_kineto_like_trace() -> None:
    events = G.trace_events(synth())
    steps = G.place_gpu_events(events).steps
    assert G.annotations_by_step(events, "Optimizer.step#SGD.step") == {s: 1 for s in steps}


def test_job_result_reads_the_last_result_line_with_nested_objects() -> None:
    out = (
        "USDT: profiler_start\n"
        'RESULT {"steps": 1}\n'
        'noise RESULT {"steps": 9, "nvtx_pushes": {"forward": 3}, "pid": 5}\n'
        "RESULT {broken\n"
    )
    assert G.job_result(out) == {"steps": 9, "nvtx_pushes": {"forward": 3}, "pid": 5}
    assert G.job_result("nothing here") is None


NSYS_STATS = """# profd nsys report summary
session:    s1

Processing [/spool/main-r0.sqlite] with [/opt/nvidia/nsight-systems/2024.5.1/.../nvtx_sum.py]...

 ** NVTX Range Summary (nvtx_sum):

 Time (%)  Total Time (ns)  Instances  Style    Range
 --------  ---------------  ---------  -------  ---------------
     60.0         12000000          1  PushPop  :ProfilerStep#3
     40.0          8000000          1  PushPop  :forward

Processing [/spool/main-r0.sqlite] with [.../cuda_gpu_kern_sum.py]...

 ** CUDA GPU Kernel Summary (cuda_gpu_kern_sum):

 Time (%)  Total Time (ns)  Instances  Name
 --------  ---------------  ---------  ----------------
    100.0           500000         12  sm90_xmma_gemm
"""


def test_nsys_section_splits_the_stats_output_by_report() -> None:
    nvtx = G.nsys_section(NSYS_STATS, "nvtx_sum")
    assert len(nvtx) == 4 and nvtx[2].endswith(":ProfilerStep#3") and "forward" in nvtx[3]
    kern = G.nsys_section(NSYS_STATS, "cuda_gpu_kern_sum")
    assert len(kern) == 3 and "sm90_xmma_gemm" in kern[2]
    assert G.nsys_section(NSYS_STATS, "osrt_sum") == []
    double = "** NVTX Range Summary (nvtx_sum) [test double]\nProfilerStep#3\t1\n** pids: 4\n"
    assert G.nsys_section(double, "nvtx_sum") == ["ProfilerStep#3\t1"]


# --- finding nsys ---------------------------------------------------------------------------------
def touch_exe(path: Path, mode: int = 0o755) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(mode)
    return path


def test_find_nsys_prefers_profd_nsys_then_path_then_the_newest_install(tmp_path: Path) -> None:
    root = tmp_path / "root"
    old = touch_exe(root / "opt/nvidia/nsight-systems/2023.4.1/bin/nsys")
    new = touch_exe(root / "opt/nvidia/nsight-systems/2024.5.1/bin/nsys")
    touch_exe(root / "opt/nvidia/nsight-systems/2024.5.1/target-linux-x64/nsys")
    touch_exe(root / "opt/nvidia/nsight-systems/2099.1.1/bin/nsys", mode=0o644)  # not executable
    found, where = G.find_nsys({"PATH": ""}, root)
    assert found == str(new), where
    assert "3 found under" in where and str(root / "opt/nvidia/nsight-systems") in where
    assert G.find_nsys({"PATH": str(old.parent)}, root) == (str(old), "PATH")
    assert G.find_nsys({"PROFD_NSYS": str(old), "PATH": str(new.parent)}, root) == (
        str(old),
        "PROFD_NSYS",
    )
    missing, why = G.find_nsys({"PROFD_NSYS": str(tmp_path / "nope")}, root)
    assert missing is None and "is not an executable file" in why


def test_find_nsys_looks_in_nsight_compute_and_the_cuda_toolkit(tmp_path: Path) -> None:
    root = tmp_path / "root"
    found, why = G.find_nsys({"PATH": ""}, root)
    assert found is None
    assert why.startswith("none on PATH") and str(root / "opt/nvidia") in why, why
    inside = touch_exe(root / "opt/nvidia/nsight-compute/2025.1.0/host/target-linux-x64/nsys")
    assert G.find_nsys({"PATH": ""}, root)[0] == str(inside)
    toolkit = touch_exe(root / "usr/local/cuda-12.8/bin/nsys")
    assert G.find_nsys({"PATH": ""}, root)[0] == str(toolkit)  # bin/nsys first
    # An Nsight Systems whose importer is there wins over copies that cannot write reports.
    systems = touch_exe(root / "opt/nvidia/nsight-systems/2024.1.1/target-linux-x64/nsys")
    touch_exe(root / "opt/nvidia/nsight-systems/2024.1.1/host-linux-x64/QdstrmImporter")
    assert G.find_nsys({"PATH": ""}, root)[0] == str(systems)


# --- docs/gpu.md ----------------------------------------------------------------------------------
def test_render_lists_the_machine_every_result_and_how_to_run() -> None:
    results = [
        G.Result("capture", G.PASS, "steps [3, 4, 5]; 120 kernels", {"kernels": 120}),
        G.Result("nvml-ps", G.FAIL, "no util | pid 5", {}),
        G.Result("nsys", G.SKIP, "no nsys on this machine: none on PATH"),
    ]
    machine = {"GPU": "NVIDIA H100 80GB HBM3 (79 GiB)", "driver": "570.1", "nsys": "none"}
    text = G.render(machine, results, "2026-01-02 03:04 UTC (99 s)", "python3 dev.py test-gpu")
    assert "Recorded 2026-01-02 03:04 UTC (99 s) by `python3 dev.py test-gpu`" in text
    assert "**1 passed, 1 failed, 1 skipped.**" in text
    assert "| GPU | NVIDIA H100 80GB HBM3 (79 GiB) |" in text
    assert "| capture | PASS | steps [3, 4, 5]; 120 kernels |" in text
    assert "| nvml-ps | FAIL | no util \\| pid 5 |" in text  # a pipe cannot end the cell
    assert "### nsys: SKIP" in text and '"kernels": 120' in text
    assert 'run(carry=[".wheelhouse"]' in text and "## How to run" in text
    assert [r.line() for r in results][1] == "FAIL nvml-ps: no util | pid 5"


def test_the_committed_docs_gpu_md_says_how_to_run_it() -> None:
    text = (ROOT / "docs" / "gpu.md").read_text()
    assert G.HOW_TO_RUN.strip() in text
    assert G.TWO_GPUS.strip() in text
    assert G.HISTORY.strip() in text
    assert "## Two GPUs (manual)" in G.render({}, [], "now", "x")


# --- no GPU ---------------------------------------------------------------------------------------
def test_dev_py_test_gpu_without_a_gpu_says_so_in_one_line_and_installs_nothing() -> None:
    venv = ROOT / ".gpu-venv"
    existed = venv.exists()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(
        [sys.executable, str(ROOT / "dev.py"), "test-gpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert r.stdout.splitlines() == ["test-gpu: no GPU: CUDA_VISIBLE_DEVICES='' hides every GPU"]
    assert r.stderr == ""
    assert venv.exists() == existed


@pytest.mark.parametrize("visible", ["", "-1"])
def test_gpucheck_itself_exits_3_when_torch_sees_no_gpu(visible: str, tmp_path: Path) -> None:
    out = tmp_path / "gpu.md"
    r = subprocess.run(
        [sys.executable, str(TESTS / "gpu" / "gpucheck.py"), "--out", str(out)],
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=visible),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == G.EXIT_NO_GPU, (r.stdout, r.stderr)
    (line,) = r.stdout.splitlines()
    assert line.startswith("gpucheck: no GPU: ") and "is_available() false" in line
    assert not out.exists()


# --- idle cost: the in-process A/B ----------------------------------------------------------------
def ab_blocks(
    ratios: list[float], base: float = 1000.0, drift: float = 0.0
) -> list[tuple[bool, float]]:
    """Blocks in the order cudajob.py runs them (on-off, off-on, ...), each pair's off block at
    ``base`` plus ``drift`` per pair and its on block ``ratio`` times that."""
    out: list[tuple[bool, float]] = []
    for p, r in enumerate(ratios):
        off = base + drift * p
        pair = [(True, off * r), (False, off)]
        out += pair if p % 2 == 0 else pair[::-1]
    return out


def test_ab_passes_a_client_that_costs_nothing_whatever_the_drift() -> None:
    noise = [1.0 + 0.004 * ((i * 7) % 5 - 2) for i in range(20)]  # +-0.8 %, centred on 1
    v = G.ab_verdict(ab_blocks(noise, drift=50.0))
    assert v.pairs == 20 and abs(v.ratio - 1.0) < 0.005
    assert v.low <= 1.0 <= v.high and v.q1 <= v.ratio <= v.q3
    assert not v.failed and "20 pairs" in v.text()


def test_ab_fails_a_client_that_costs_three_percent() -> None:
    noise = [1.03 + 0.003 * ((i * 7) % 5 - 2) for i in range(20)]
    v = G.ab_verdict(ab_blocks(noise))
    assert v.failed and v.low > 1.01 and abs(v.ratio - 1.03) < 0.004


def test_ab_does_not_fail_what_the_spread_cannot_tell_from_one_percent() -> None:
    # 1.5 % slower on median, but the pairs scatter by +-10 %: not beyond the spread.
    noisy = [1.015 + 0.1 * ((i * 7) % 5 - 2) / 2 for i in range(12)]
    v = G.ab_verdict(ab_blocks(noisy))
    assert v.ratio > 1.01 and v.low <= 1.01 and not v.failed


def test_ab_is_robust_to_a_hiccup_and_deterministic() -> None:
    ratios = [1.0] * 15 + [3.0]  # one pair hit by something else entirely
    blocks = ab_blocks(ratios)
    v = G.ab_verdict(blocks)
    assert v.ratio == 1.0 and not v.failed
    assert G.ab_verdict(blocks) == v


def test_ab_refuses_blocks_that_are_not_pairs_of_on_and_off() -> None:
    with pytest.raises(ValueError, match="need pairs"):
        G.ab_verdict([(True, 1.0), (False, 1.0), (True, 1.0)])
    with pytest.raises(ValueError, match="both on"):
        G.ab_verdict([(True, 1.0), (True, 1.0)])
    with pytest.raises(ValueError, match="positive"):
        G.ab_verdict([(True, 1.0), (False, 0.0)])


def test_the_stall_fails_when_a_memory_snapshot_adds_more_than_50_ms() -> None:
    ok = {"cpu,cuda capture": 8.7, "cpu,cuda capture + memory snapshot": 40.0}
    assert G.stall_verdict(ok) is None
    bad = {"cpu,cuda capture": 8.7, "cpu,cuda capture + memory snapshot": 1723.7}
    assert G.stall_verdict(bad) == "a memory snapshot adds 1715.0 ms to the stall (> 50)"
    assert G.stall_verdict({"cpu,cuda capture": 8.7}) is None
