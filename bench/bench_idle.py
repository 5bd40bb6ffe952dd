"""Idle overhead: the same CPU training loop with no profd, attached to a live daemon, and with
a torch.profiler object waiting in its schedule (the baseline).

Three long-lived worker processes (one per variant) build the same model; the coordinator
runs blocks of N steps in them one at a time, rotating the order every round (ABC, BCA, CAB,
...), so drift and noise on the shared machine show up as spread of the paired per-round
ratios instead of as a bias. Then it microbenchmarks the hot path itself with timeit: the
optimizer hook as installed (hook + ``Stepper.tick`` + the step ledger's clock read into its
ring), the same hook calling a tick without the ledger (a count-only stand-in defined here:
the step before the ledger, for the difference), the clock alone, and one ``region()`` entry
while nothing is captured (timed since the ledger) against the no-op it replaced.

In-process A/B: the attached worker also runs pairs of blocks of the same steps with the
client's training-thread side switched on and off (``profd_client.api._measure_hooks``; the
agent thread stays attached), the order alternating per pair; the ratio is the median of the
per-pair ratios with a bootstrap 95 % interval (``ab_verdict`` of tests/gpu/gpucheck.py, the
same statistics the GPU check fails on). It compares the same process with itself, so what
differs between processes (placement, allocation addresses, a noisy neighbour's timing)
cannot pass for a cost; it leaves out what the agent thread costs (in both arms).

Target: <= 1 us a step; loop time ratio attached / not attached <= 1.01 at 1 ms steps.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import time
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B

sys.path.insert(0, str(B.ROOT / "tests" / "gpu"))
from gpucheck import ab_verdict

VARIANTS = ("none", "profd", "torchprof")
LABEL = {
    "none": "no profd",
    "profd": "attach() + live daemon",
    "torchprof": "torch.profiler waiting in schedule",
}


# --- worker -----------------------------------------------------------------------------------
def worker(variant: str, quick: bool) -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    models: dict[str, Any] = {}
    prof = None
    if variant == "profd":
        import profd_client

        profd_client.attach(job="bench-idle", role="main", rank=0, world_size=1)
        B.wait_for(profd_client.is_attached, 30, "attach")
    elif variant == "torchprof":
        from torch.profiler import ProfilerActivity, profile, schedule

        prof = profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=10**9, warmup=1, active=1),
        )
        prof.start()

    def build(dim: int, batch: int) -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        m = torch.nn.Linear(dim, dim)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        x = torch.randn(batch, dim)
        return m, opt, x

    def run(key: str, n: int) -> float:
        m, opt, x = models[key]
        # A full collection costs ~80 ms of CPU with torch loaded: worth it before a block
        # that is timed, not before each of a smoke run's ~50 tiny ones.
        if not quick:
            gc.collect()
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
            opt.step()
            if prof is not None:
                prof.step()
        return time.perf_counter() - t0

    def calibrate(target_s: float, batch: int, iters: int) -> int:
        dim = 64
        for _ in range(iters):
            models["cal"] = build(dim, batch)
            run("cal", 5)
            per = min(run("cal", 10) / 10 for _ in range(3))
            if abs(per - target_s) / target_s < 0.05:
                break
            # Cost grows ~ dim^2 above the fixed per-step overhead.
            dim = max(8, int(dim * min(4.0, max(0.25, (target_s / per) ** 0.5))))
        return dim

    print(json.dumps({"ready": variant}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "calibrate":
            out = {k: calibrate(v, cmd["batch"], cmd["iters"]) for k, v in cmd["targets"].items()}
            print(json.dumps(out), flush=True)
        elif cmd["op"] == "build":
            for k, dim in cmd["dims"].items():
                models[k] = build(dim, cmd["batch"])
                run(k, cmd["warmup"])
            print(json.dumps({"ok": True}), flush=True)
        elif cmd["op"] == "run":
            print(json.dumps({"s": run(cmd["key"], cmd["n"])}), flush=True)
        elif cmd["op"] == "ab":
            print(json.dumps({"blocks": ab(run, cmd["key"], cmd["n"], cmd["pairs"])}), flush=True)
        elif cmd["op"] == "micro":
            print(json.dumps(micro(cmd["quick"])), flush=True)
    if prof is not None:
        prof.stop()


def ab(run: Any, key: str, n: int, pairs: int) -> list[tuple[bool, float]]:
    """Pairs of ``n``-step blocks with the client on and off (on-off, off-on, ...): per block,
    (on?, µs a step)."""
    from profd_client import api

    out: list[tuple[bool, float]] = []
    try:
        for p in range(pairs):
            for on in (True, False) if p % 2 == 0 else (False, True):
                api._measure_hooks(on)
                out.append((on, run(key, n) / n * 1e6))
    finally:
        api._measure_hooks(True)
    return out


# --- hot path microbenchmarks ---------------------------------------------------------------
class CountOnly:
    """``Stepper.tick`` without the step ledger: what a step cost before it (the comparison
    for the hook-alone figure; not client code)."""

    __slots__ = ("count", "next_event")

    def __init__(self) -> None:
        self.count = 0
        self.next_event = 1 << 62

    def tick(self) -> None:
        self.count += 1
        if self.count >= self.next_event:
            raise AssertionError("no boundary in this benchmark")


def best_ns(stmt: Any, number: int, repeat: int) -> tuple[float, float]:
    times = timeit.repeat(stmt, number=number, repeat=repeat)
    per = sorted(t / number * 1e9 for t in times)
    return per[0], B.pct(per, 50)


def micro(quick: bool) -> dict[str, Any]:
    import torch
    from torch.optim.optimizer import _global_optimizer_post_hooks

    import profd_client
    from profd_client.steps import Stepper

    torch.set_num_threads(1)
    n = 50_000 if quick else 2_000_000
    rep = 3 if quick else 9
    out: dict[str, Any] = {}
    st = Stepper("main-r0", notify=lambda: None)
    out["tick_ns"] = best_ns(st.tick, n, rep)

    def empty() -> None:
        pass

    out["empty_call_ns"] = best_ns(empty, n, rep)
    out["clock_ns"] = best_ns(time.perf_counter, n, rep)
    handle = profd_client._install_optimizer_hook(st)
    hook = list(_global_optimizer_post_hooks.values())[-1]
    out["hook_call_ns"] = best_ns(functools.partial(hook, None, (), {}), n, rep)
    handle.remove()
    # The hook alone: the same installed hook calling a tick without the ledger's ring write.
    handle = profd_client._install_optimizer_hook(CountOnly())  # type: ignore[arg-type]
    hook = list(_global_optimizer_post_hooks.values())[-1]
    out["hook_no_ledger_ns"] = best_ns(functools.partial(hook, None, (), {}), n, rep)
    handle.remove()
    out["tick_no_ledger_ns"] = best_ns(CountOnly().tick, n, rep)

    # region() while nothing is captured: the name's timer (entered and left), against the
    # shared no-op every idle region() returned before regions were timed.
    from profd_client import api

    def region_block() -> None:
        with profd_client.region("fwd"):
            pass

    def noop_block() -> None:
        with no_op_region("fwd"):
            pass

    def no_op_region(name: str) -> Any:
        st_ = api._stepper
        if st_ is None or st_.live is None:
            return api._NULL
        return st_.region(name)

    saved, api._stepper = api._stepper, st
    try:
        out["region_entry_ns"] = best_ns(region_block, n, rep)
        out["region_no_op_ns"] = best_ns(noop_block, n, rep)
    finally:
        api._stepper = saved
    out["region_not_attached_ns"] = best_ns(region_block, n, rep)

    out.update(heartbeat_size())

    # The whole cost a step pays, as torch dispatches it: a tiny optimizer's step() with and
    # without profd's global post-hook, interleaved, min of repeats.
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    opt = torch.optim.SGD([p], lr=0.0)
    m = 200 if quick else 5000
    without, with_hook = [], []
    for _ in range(rep):
        without.append(min(timeit.repeat(opt.step, number=m, repeat=3)) / m * 1e9)
        h = profd_client._install_optimizer_hook(st)
        with_hook.append(min(timeit.repeat(opt.step, number=m, repeat=3)) / m * 1e9)
        h.remove()
    out["opt_step_ns"] = (min(without), B.pct(without, 50))
    out["opt_step_with_hook_ns"] = (min(with_hook), B.pct(with_hook, 50))
    out["hook_dispatch_delta_ns"] = min(with_hook) - min(without)

    from torch.profiler import ProfilerActivity, profile, schedule

    prof = profile(
        activities=[ProfilerActivity.CPU], schedule=schedule(wait=10**9, warmup=1, active=1)
    )
    prof.start()
    out["torchprof_step_ns"] = best_ns(prof.step, m, rep)
    prof.stop()
    return out


def heartbeat_size() -> dict[str, Any]:
    """A heartbeat's bytes after one second at 10,000 steps/s with the most regions a ledger
    names, each with the longest name (32 x 200 characters), and what reading the ring for it
    costs the agent thread."""
    from profd_client import protocol as P
    from profd_client.ledger import Reader
    from profd_client.steps import Stepper

    now = [0.0]
    st = Stepper("main-r0", notify=lambda: None, clock=lambda: now[0])
    rd = Reader(st)
    names = [f"{i:02d}" + "r" * (P.MAX_NAME - 2) for i in range(P.MAX_LEDGER_REGIONS)]
    for i in range(10_000):
        with st.timer(names[i % len(names)]) if i < len(names) else st.regions[names[i % 32]]:
            now[0] += 0.00005
        now[0] += 0.00005
        st.tick()
    t0 = time.perf_counter()
    ledger = rd.take()
    take_us = (time.perf_counter() - t0) * 1e6
    assert ledger is not None and len(ledger["r"]) == P.MAX_LEDGER_REGIONS
    frame = P.encode(P.HEARTBEAT, step=st.count, sps=10_000.0, state="idle", ledger=ledger)
    return {"heartbeat_bytes_10k_sps": len(frame), "ledger_take_us_10k_steps": take_us}


# --- coordinator ------------------------------------------------------------------------------
def main() -> None:
    ap = B.parser(__doc__)
    ap.add_argument("--worker", choices=VARIANTS, help=argparse_hidden())
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.quick)
        return
    started = time.monotonic()
    quick = args.quick
    step_targets = {"1ms": 0.001, "10ms": 0.010}
    batch = 64
    plan = (
        {"1ms": (3, 50), "10ms": (3, 10)} if quick else {"1ms": (30, 1000), "10ms": (24, 100)}
    )  # rounds, steps per block
    daemon = B.Daemon().start()
    env = daemon.env()
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    ws: dict[str, Any] = {}
    try:
        for v in VARIANTS:
            wargs = ["--worker", v, *(["--quick"] if quick else [])]
            ws[v] = B.spawn_worker(Path(__file__), wargs, env=env)
        for v in VARIANTS:
            B.read_reply(ws[v])
        dims = B.ask(
            ws["none"],
            {
                "op": "calibrate",
                "targets": step_targets,
                "batch": batch,
                # Two rounds at least, so --quick builds a model from a re-sized guess too.
                "iters": 2 if quick else 12,
            },
        )
        print(f"calibrated dims {dims} (batch {batch})", file=sys.stderr)
        for v in VARIANTS:
            B.ask(
                ws[v], {"op": "build", "dims": dims, "batch": batch, "warmup": 5 if quick else 50}
            )
        per_step: dict[str, dict[str, list[float]]] = {k: {v: [] for v in VARIANTS} for k in plan}
        ratios: dict[str, dict[str, list[float]]] = {
            k: {"profd": [], "torchprof": []} for k in plan
        }
        delta_us: dict[str, dict[str, list[float]]] = {
            k: {"profd": [], "torchprof": []} for k in plan
        }
        for key, (rounds, n) in plan.items():
            for r in range(rounds):
                order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
                got = {v: B.ask(ws[v], {"op": "run", "key": key, "n": n})["s"] for v in order}
                for v in VARIANTS:
                    per_step[key][v].append(got[v] / n * 1e6)
                for v in ("profd", "torchprof"):
                    ratios[key][v].append(got[v] / got["none"])
                    delta_us[key][v].append((got[v] - got["none"]) / n * 1e6)
        # The same steps in the attached worker, its client switched on and off in turn.
        ab_blocks = {
            key: B.ask(ws["profd"], {"op": "ab", "key": key, "n": n, "pairs": rounds})["blocks"]
            for key, (rounds, n) in plan.items()
        }
        load_during = [round(x, 2) for x in os.getloadavg()]
        # The hot path in isolation, in the worker that has no profd or profiler installed,
        # after the loop blocks (so nothing else of ours runs meanwhile).
        for v in ("profd", "torchprof"):
            B.finish_workers([ws.pop(v)])
        mb = B.ask(ws["none"], {"op": "micro", "quick": quick})
    finally:
        B.finish_workers(ws.values())
        daemon.stop()

    rows = []
    hook_ns = mb["hook_call_ns"][0]
    rows.append(
        B.row(
            "idle cost/step: optimizer hook + tick + ledger clock (timeit)",
            "<= 1 us",
            hook_ns / 1000,
            "us",
            baseline=mb["torchprof_step_ns"][0] / 1000,
            baseline_what="prof.step() waiting",
            met=hook_ns <= 1000,
            spread=f"Stepper.tick alone {mb['tick_ns'][0]:.0f} ns,"
            f" perf_counter() alone {mb['clock_ns'][0]:.0f} ns",
        )
    )
    rows.append(
        B.row(
            "idle cost/step: hook alone, tick without the ledger (timeit)",
            "(reference)",
            mb["hook_no_ledger_ns"][0] / 1000,
            "us",
            baseline=hook_ns / 1000,
            baseline_what="with the ledger",
            met=None,
            spread=f"count-only tick alone {mb['tick_no_ledger_ns'][0]:.0f} ns",
        )
    )
    rows.append(
        B.row(
            "region() entry while idle, timed (timeit)",
            "(measure)",
            mb["region_entry_ns"][0] / 1000,
            "us",
            baseline=mb["region_no_op_ns"][0] / 1000,
            baseline_what="the shared no-op before",
            met=None,
            spread=f"not attached {mb['region_not_attached_ns'][0]:.0f} ns",
        )
    )
    rows.append(
        B.row(
            "heartbeat size, 10,000 steps/s, 32 regions of 200 chars",
            "<= 16 KiB",
            mb["heartbeat_bytes_10k_sps"] / 1024,
            "KiB",
            met=mb["heartbeat_bytes_10k_sps"] <= 16 * 1024,
            spread=f"agent thread reads the ring in {mb['ledger_take_us_10k_steps']:.0f} us",
        )
    )
    for key in plan:
        d = B.summary(delta_us[key]["profd"], 2)
        db = B.summary(delta_us[key]["torchprof"], 2)
        rows.append(
            B.row(
                f"idle cost/step in loop, {key} steps",
                "<= 1 us",
                d["p50"],
                "us",
                baseline=db["p50"],
                baseline_what="torch.profiler",
                ratio=None,
                met=None,
                spread=f"p10..p90 {d['p10']}..{d['p90']}",
            )
        )
        rs = B.summary(ratios[key]["profd"], 4)
        rb = B.summary(ratios[key]["torchprof"], 4)
        rows.append(
            B.row(
                f"loop time ratio vs no profd, {key} steps",
                "<= 1.01" if key == "1ms" else "(<= 1.01 at 1ms)",
                rs["p50"],
                "x",
                baseline=rb["p50"],
                baseline_what="torch.profiler",
                met=rs["p50"] <= 1.01 if key == "1ms" else None,
                spread=f"p10..p90 {rs['p10']}..{rs['p90']}",
            )
        )
    verdicts = {k: ab_verdict([(bool(on), us) for on, us in b]) for k, b in ab_blocks.items()}
    for key, v in verdicts.items():
        rows.append(
            B.row(
                f"loop time ratio, client on/off in one process (A/B pairs), {key} steps",
                "(measure)",
                round(v.ratio, 4),
                "x",
                met=None,
                spread=f"95 % interval {v.low:.4f}..{v.high:.4f}, IQR {v.q1:.4f}..{v.q3:.4f}",
            )
        )
    details = {
        "ab_blocks_us_per_step": ab_blocks,
        "ab_verdicts": {
            k: {
                "ratio": v.ratio,
                "interval": [v.low, v.high],
                "iqr": [v.q1, v.q3],
                "pairs": v.pairs,
            }
            for k, v in verdicts.items()
        },
        "dims": dims,
        "batch": batch,
        "plan_rounds_steps": plan,
        "per_step_us": {k: {v: B.summary(x, 2) for v, x in d.items()} for k, d in per_step.items()},
        "ratio_vs_none": {k: {v: B.summary(x, 4) for v, x in d.items()} for k, d in ratios.items()},
        "delta_us_per_step": {
            k: {v: B.summary(x, 2) for v, x in d.items()} for k, d in delta_us.items()
        },
        "raw_ratio_vs_none": ratios,
        "micro_ns_best_median": mb,
        "loadavg_after_loop": load_during,
        "note": "hook_dispatch_delta_ns is below the noise of a tiny optimizer step; "
        "the table uses hook_call_ns (the installed hook called directly, best of repeats)",
    }
    params = {"variants": LABEL, "step_targets_s": step_targets, "threads": 1}
    B.write_result("idle", args.out, quick, params, rows, details, started)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
