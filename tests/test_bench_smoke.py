"""Every benchmark in bench/ runs end to end on tiny sizes and writes its JSON result.

``--quick`` runs every code path of every benchmark (the torchrun job of bench_trigger, every
schedule form, several bulk batches, a multipart upload, ...) with tiny sizes, so a path that
``make bench`` takes cannot break without this file noticing. Each test checks that its
benchmark did all of that (counts and shapes in the result's ``details``), not only its exit
code. No timing assertions at all: the numbers of a ``--quick`` run on a shared machine mean
nothing. The benchmarks start in two lanes side by side (module fixture) so the whole file
stays around a minute; each test then waits for its own benchmark and checks its result.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
NAMES = (
    "idle", "trigger", "stall", "daemon", "index", "s3", "cluster", "report", "metrics", "stacks",
    "watch", "sampling", "hostile", "warehouse",
)  # fmt: skip
# Two lanes side by side, of about equal length in the full suite (~135 s each at its load
# of 4-5 on 2 cores; alone ~60 s each): bench_trigger (its torchrun job and sessions mostly
# wait) and bench_sampling (its runs last the seconds a sample needs) are the longest, so they
# share a lane with short ones; the other lane's benchmarks compute more, so a full suite
# slows them more (bench_idle ~5x its time alone, bench_trigger ~3x).
LANES = (
    ("trigger", "index", "watch", "sampling"),
    ("idle", "daemon", "stall", "cluster", "metrics", "stacks", "report", "hostile", "s3",
     "warehouse"),
)  # fmt: skip
#: More arguments for a benchmark: the daemon's runs its profd from a source tree (this
#: checkout), as a paired A/B against another commit does with that commit's worktree.
EXTRA = {"daemon": f"--daemon-from {ROOT}"}
#: One worker runs the lanes (``--dist loadgroup``): each worker given a test of this file
#: would otherwise start every benchmark again.
pytestmark = pytest.mark.xdist_group("bench_smoke")
RESULT_KEYS = {"name", "quick", "date", "machine", "params", "rows", "details", "wall_s"}
ROW_KEYS = {
    "metric",
    "target",
    "measured",
    "unit",
    "spread",
    "baseline",
    "baseline_what",
    "ratio",
    "met",
}
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("bench-results")
    procs = {}
    for lane in LANES:
        # One shell per lane runs its benchmarks one after another; each test waits for the
        # marker file its benchmark's exit code goes into.
        script = " ; ".join(
            f"{sys.executable} {BENCH / f'bench_{n}.py'} --quick --out {out} {EXTRA.get(n, '')}"
            f" > {out / f'{n}.log'} 2>&1 ; echo $? > {out / f'{n}.rc'}"
            for n in lane
        )
        procs[lane] = subprocess.Popen(["bash", "-c", script], cwd=ROOT, start_new_session=True)
    yield out
    # Lanes still running (only some benchmarks were selected): SIGTERM first, which a
    # benchmark takes as Ctrl-C, through the finally blocks that stop what it started in
    # sessions of its own (bench_trigger's torchrun job, which a SIGKILL to the lane's group
    # would leave training on); then the rest of the lane.
    running = [p for p in procs.values() if p.poll() is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for p in running:
        # The shell is reaped here; what ran under it may still be stopping.
        while time.monotonic() < deadline and (p.poll() is None or group_alive(p.pid)):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("name", NAMES)
def test_bench_quick(runs: Path, name: str) -> None:
    out = runs
    rc_file = out / f"{name}.rc"
    deadline = time.monotonic() + TIMEOUT_S
    while not (rc_file.exists() and rc_file.read_text().strip()):
        if time.monotonic() > deadline:
            pytest.fail(f"bench_{name} --quick still running after {TIMEOUT_S}s")
        time.sleep(0.2)
    rc = int(rc_file.read_text())
    text = (out / f"{name}.log").read_text(errors="replace")
    assert rc == 0, f"bench_{name} --quick failed ({rc}):\n{text[-4000:]}"
    res = json.loads((out / f"{name}.json").read_text())
    assert set(res) >= RESULT_KEYS, sorted(RESULT_KEYS - set(res))
    assert res["name"] == name
    assert res["quick"] is True
    assert res["rows"], "no result rows"
    for row in res["rows"]:
        assert set(row) >= ROW_KEYS, sorted(ROW_KEYS - set(row))
        assert row["measured"] is not None, row
    assert {"nproc", "cpu", "python", "torch"} <= set(res["machine"])
    CHECKS[name](res)


# --- what each benchmark must have done: every path it has at full size, on tiny sizes --------
# Counts and shapes only; never a measured value against a threshold.
def metrics(res: dict[str, Any]) -> list[str]:
    return [r["metric"] for r in res["rows"]]


def check_idle(res: dict[str, Any]) -> None:
    d = res["details"]
    assert set(d["plan_rounds_steps"]) == {"1ms", "10ms"}
    assert len(res["rows"]) == 4 + 3 * len(d["plan_rounds_steps"]), metrics(res)
    for key, (rounds, _steps) in d["plan_rounds_steps"].items():
        assert rounds >= 3, "every rotation of the three variants"
        # The in-process A/B: one pair per round, each one block on and one off.
        blocks = d["ab_blocks_us_per_step"][key]
        assert [on for on, _ in blocks].count(True) == rounds == len(blocks) // 2
        assert d["ab_verdicts"][key]["pairs"] == rounds
        for v in ("profd", "torchprof"):
            assert len(d["raw_ratio_vs_none"][key][v]) == rounds
        assert set(d["per_step_us"][key]) == {"none", "profd", "torchprof"}
    mb = d["micro_ns_best_median"]
    for k in (
        "tick_ns",
        "hook_call_ns",
        "hook_no_ledger_ns",
        "tick_no_ledger_ns",
        "clock_ns",
        "region_entry_ns",
        "region_no_op_ns",
        "region_not_attached_ns",
        "opt_step_ns",
        "opt_step_with_hook_ns",
        "torchprof_step_ns",
        "heartbeat_bytes_10k_sps",
        "ledger_take_us_10k_steps",
    ):
        assert k in mb, k


def schedule_form(spec: dict[str, Any]) -> str:
    if "steps" in spec:
        return "steps A:B" if ":" in spec["steps"] else "steps list"
    if "at_step" in spec:
        return "at_step+repeat" if spec.get("repeat", 1) > 1 else "at_step"
    return "next" if spec.get("next") else "?"


def check_trigger(res: dict[str, Any]) -> None:
    d = res["details"]
    sizes = res["params"]["sizes"]
    assert sorted(p for _, _, p in sizes) == [1, 2, 4], "1, 2 and 4 client processes"
    assert sorted(int(n) for n in d["latency"]) == sorted(n for n, _, _ in sizes)
    for n, rounds, _ in sizes:
        lat = d["latency"][str(n)]
        assert lat["per_client_ms"]["n"] == n * rounds, lat
    a = d["alignment"]
    assert a is not None, "the alignment part did not run"
    assert a["torchrun_ranks"] == 2 and a["sim_clients"] >= 1
    forms = [schedule_form(s["spec"]) for s in a["sessions"]]
    assert forms == ["steps A:B", "next", "at_step+repeat", "steps list"], forms
    world = a["torchrun_ranks"] + a["sim_clients"]
    for s in a["sessions"]:
        assert s["state"] in {"done", "partial", "failed", "cancelled"}, s["state"]
        ranks = sorted(t["rank"] for t in s["targets"])
        assert ranks == list(range(world)), f"torchrun ranks 0, 1 and the simulated ones: {ranks}"
    assert len(a["sessions"][2]["cycles"]) == 3, "--repeat 3 makes three cycles"
    # A capture that happened is on exactly the requested steps (index and trace markers).
    assert a["captured_cycles"] > 0
    assert a["captured_cycles_exact"] == a["captured_cycles"], a["failures"]
    assert len(res["rows"]) == 2 * len(sizes) + 2, metrics(res)


def check_stall(res: dict[str, Any]) -> None:
    d = dict(res["details"])
    snap = d.pop("memory_snapshot")
    assert set(d) == {"small", "large"}
    for name, x in d.items():
        assert x["repetitions"] >= 2, "both orders (profd first, torch first)"
        assert len(x["runs"]["profd"]) == len(x["runs"]["torch"]) == x["repetitions"], name
        assert x["profd_raw_bytes_p50"] > 0 and x["torch_gz_bytes_p50"] > 0
    assert d["large"]["profd_raw_bytes_p50"] > d["small"]["profd_raw_bytes_p50"]
    # With a snapshot: no snapshot, written off the training thread, written on it; every
    # written one was written whole by the client's writer thread and the loop went on.
    assert set(snap) == {"small", "large"}
    for name, x in snap.items():
        assert {v: len(r) for v, r in x["runs"].items()} == {"none": 3, "off": 3, "on": 3}, name
        assert all("steps_during_write" in r for r in x["runs"]["off"]), name
        assert all("steps_during_write" not in r for r in x["runs"]["none"]), name
    assert snap["large"]["pickle_bytes"] > snap["small"]["pickle_bytes"]
    assert len(res["rows"]) == 4, metrics(res)


def check_daemon(res: dict[str, Any]) -> None:
    d = res["details"]
    n = d["clients"]
    assert n > 4, "more clients than worker processes"
    assert res["params"]["daemon_from"] == str(ROOT)
    assert d["ps_busy"]["rows"] == n and d["ps_busy"]["cli_rows"] == n, d["ps_busy"]
    assert d["ps_idle"]["rows"] == 0
    assert d["busy"]["clients_cpu_percent"] is not None
    assert set(d["python_floor_ms"]) == {"python -c pass", "import profctl modules"}
    # The host's speed, timed before the daemon and after the busy phase.
    assert all(d["host_speed_ms"][k] > 0 for k in ("before", "after")), d["host_speed_ms"]
    # top as ps: every served rank, and its own row in the table.
    assert d["top_busy"]["rows"] == n and d["top_busy"]["cli_rows"] == n, d["top_busy"]
    assert d["top_idle"]["rows"] == 0
    # The collector's passes when the CPU window began and ended and after the requests,
    # told apart in the round trip's row.
    assert all(len(d["gc"][k]["passes"]) == 3 for k in ("busy_start", "busy_end", "after_requests"))
    assert "over the requests" in res["rows"][-1]["spread"], metrics(res)
    # The transport's floor in the same run: a bare ROUTER that received the same traffic,
    # sampled over the same window. (At the quick run's handful of clients its CPU over the
    # window can be under one clock tick of the kernel's accounting: 0.0 is a measurement.)
    floor = d["transport_floor"]
    assert floor["window_s"] > 0 and floor["cpu_percent_of_one_core"] >= 0
    assert floor["clients_cpu_percent"] is not None and floor["cpu_percent_per_1s"]["n"] > 0
    assert res["rows"][1]["baseline"] == round(floor["cpu_percent_of_one_core"], 4)
    assert len(res["rows"]) == 6, metrics(res)


def test_a_daemon_from_no_source_tree_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, BENCH / "bench_daemon.py", "--quick", "--out", tmp_path,
         "--daemon-from", tmp_path],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1, r
    assert r.stderr == f"--daemon-from {tmp_path}: no profd/ package there\n"
    assert not list(tmp_path.iterdir())


def check_index(res: dict[str, Any]) -> None:
    d = res["details"]
    assert d["bulk_transactions"] > 1, "several bulk batches, as at 1M rows"
    assert d["rows"] == res["params"]["rows"] and d["files_rows"] == 2 * d["rows"]
    kinds = {"job", "session", "rank+window"}
    assert set(d["indexed_ms"]) == set(d["no_index_ms"]) == kinds
    for k in kinds:
        assert d["indexed_ms"][k]["n"] == d["queries_per_kind"]["indexed"]
        assert d["no_index_ms"][k]["n"] == d["queries_per_kind"]["no_index"]
    assert len(res["rows"]) == len(kinds) + 1, metrics(res)


def check_s3(res: dict[str, Any]) -> None:
    d = res["details"]
    sets = res["params"]["sets"]
    reps = res["params"]["reps"]
    assert reps >= 2, "both orders (raw first, profd first)"
    assert set(d) == set(sets)
    for name, x in d.items():
        assert len(x["wall_s"]["profd"]) == len(x["wall_s"]["raw"]) == reps, name
    # One set of several single-PUT files and one file profd sends in parts.
    assert sorted(x["profd_multipart"] for x in d.values()) == [False, True]
    assert any(count > 1 for count, _ in sets.values())
    assert len(res["rows"]) == len(sets), metrics(res)


def check_cluster(res: dict[str, Any]) -> None:
    d, p = res["details"], res["params"]
    assert len(res["rows"]) == 3, metrics(res)
    for k in ("ps_s", "armed_p50_s", "armed_p99_s", "armed_max_s", "start_wall_s"):
        assert len(d[k]) == p["trials"], k
    # Every trial's session reached every simulated node (checked inside the benchmark too).
    assert d["serial_per_host_s"] > 0 and d["serial_inproc_all_armed_s"] > 0


def check_warehouse(res: dict[str, Any]) -> None:
    d, p = res["details"], res["params"]
    assert len(res["rows"]) == 4, metrics(res)
    # Every table was written, the incidents went to S3 whole, each query ran every time
    # and answered rows (the benchmark itself checks local, S3 and fan-out agree).
    assert all(n > 0 for n in d["objects"].values()), d["objects"]
    assert d["s3_objects"] == d["objects"]["incidents"]
    assert all(q["n"] == p["repeat"] for q in d["query_s"].values()), d["query_s"]
    assert d["fan_out_s"]["n"] == p["repeat"]
    assert d["fan_out_rows"] == d["rows"]["incidents"]["rows"] == p["incidents"]
    assert all(n > 0 for n in d["answers"].values()), d["answers"]


def check_report(res: dict[str, Any]) -> None:
    d, p = res["details"], res["params"]
    assert len(res["rows"]) == 5, metrics(res)
    assert len(d["report_cmd_s"]) == len(d["report_inproc_s"]) == p["reps"]
    assert len(d["straggler_rule_s"]) == p["reps"]
    assert len(d["pipeline_with_s"]) == len(d["pipeline_without_s"]) == p["pairs"]


def check_metrics(res: dict[str, Any]) -> None:
    d, p = res["details"], res["params"]
    assert len(res["rows"]) == 6, metrics(res)
    assert d["scrape_plain_s"]["n"] == d["scrape_gzip_s"]["n"] == p["reps"]
    assert d["publish_hook_s"]["n"] == d["publish_full_s"]["n"] == p["reps"]
    assert 0 < d["gzip_bytes"] < d["plain_bytes"]
    assert d["families"] == 8
    # Per rank: 19 buckets (+Inf among them), count and sum, the step counter, each region;
    # and the daemon's 12: attached, 4 session states, 5 incident kinds, queue, age.
    assert d["samples"] == p["ranks"] * (19 + 2 + 1 + p["regions"]) + 12


def check_stacks(res: dict[str, Any]) -> None:
    d, p = res["details"], res["params"]
    assert len(res["rows"]) == 5, metrics(res)
    # Every trial read every local rank by py-spy and grouped every simulated node's ranks
    # with the stuck one alone (both checked inside the benchmark too).
    assert len(d["wall_s"]) == len(d["cluster_wall_s"]) == len(d["group_s"]) == p["trials"]
    assert d["read_ms"]["n"] == d["gap_during_ms"]["n"] == p["trials"] * p["ranks"]
    assert d["gap_quiet_ms"]["n"] == p["trials"] * p["ranks"]
    assert 0 <= d["stuck_node"] < p["nodes"]


def check_watch(res: dict[str, Any]) -> None:
    d, p = res["details"], res["params"]
    assert len(res["rows"]) == 10, metrics(res)
    for shape in ("one_job", "jobs_of_8"):
        for k in ("tick_s", "loop_with_s", "loop_without_s"):
            assert d[f"{shape}_{k}"]["n"] == p["ticks"], (shape, k)
    found = d["detection"]
    # Steady jittery ranks fire nothing; the slowed worker is named alone (even at the
    # smoke's sizes: its hold and window are the defaults').
    assert found["steady_workers"]["incidents"] == found["steady_lockstep"]["incidents"] == []
    assert [x["ranks"] for x in found["slow_rank_25pct"]["incidents"]] == [[7]]
    assert [x["kind"] for x in found["regression_20pct"]["incidents"]] == ["regression"]
    # The straggler rule over samples, at 2 ranks and at the bench's size.
    assert [x["ranks"] for x in d["straggler_samples"]] == [2, p["ranks"]]
    for x in d["straggler_samples"]:
        assert x["named_on_sample"] is not None and x["named"] == [x["straggler"]], x


def check_sampling(res: dict[str, Any]) -> None:
    d, p = res["details"], res["params"]
    assert len(res["rows"]) == 3, metrics(res)
    assert len(d["sps_on"]) == len(d["sps_off"]) == len(d["samples_per_run"]) == p["runs_each"]
    assert len(d["steps_per_cpu_s_on"]) == len(d["steps_per_cpu_s_off"]) == p["runs_each"]
    assert all(x > 0 for x in d["sps_on"] + d["sps_off"])
    # A/B/B/A: as many runs of each condition, each paired with its neighbour.
    assert sorted(d["order"]) == ["off"] * p["runs_each"] + ["on"] * p["runs_each"]
    assert d["order"][:4] == ["off", "on", "on", "off"]
    assert len(d["paired_ratios"]) == p["runs_each"]


def check_hostile(res: dict[str, Any]) -> None:
    f, p, par = res["details"]["flood"], res["details"]["peers"], res["params"]
    assert len(res["rows"]) == 11, metrics(res)
    # The flood was sent, bounded by the defaults, and never cost the peer its attachment.
    assert f["region_names_sent"] == f["heartbeats"] * par["names_per_hb"] > 64
    assert f["metrics"]["regions"] == 65 and f["still_attached"]
    assert f["limits"]["regions_folded"] == f["region_names_sent"] - 64
    # One process asked for more peers than it may have: the default 16, then one-line refusals.
    assert p["asked"] == par["peers"] > 16 and p["accepted"] == 16
    assert p["limits"]["peers_refused"] == par["peers"] - 16
    assert "max_peers_per_process" in p["refusal"] and "\n" not in p["refusal"]
    assert p["metrics"]["jobs"] == 16 and p["top_reply_bytes"] > 0


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "hostile": check_hostile,
    "sampling": check_sampling,
    "watch": check_watch,
    "stacks": check_stacks,
    "cluster": check_cluster,
    "report": check_report,
    "idle": check_idle,
    "trigger": check_trigger,
    "stall": check_stall,
    "daemon": check_daemon,
    "index": check_index,
    "warehouse": check_warehouse,
    "s3": check_s3,
    "metrics": check_metrics,
}


def test_driver_prints_table(tmp_path: Path) -> None:
    """bench/run.py reads results back and prints one table (index only: the fastest)."""
    r = subprocess.run(
        [
            sys.executable,
            str(BENCH / "run.py"),
            "--quick",
            "--only",
            "index",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "query by job" in r.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rows"] and summary["failed"] == []


def test_the_typed_message_comparison_runs_and_both_paths_agree() -> None:
    # bench_protocol checks, before it times anything, that the hand-written and the typed
    # decoders accept the same frames and refuse the same bad ones: a failed check exits 1.
    out = subprocess.run(
        [sys.executable, str(BENCH / "bench_protocol.py"), "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line.split()[0] for line in out.stdout.splitlines() if " new/old " in line]
    assert {"hb", "arm", "hello", "armed"} <= set(rows), out.stdout
