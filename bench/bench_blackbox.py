"""The black box's cost to training (``profd_client/blackbox.py``), paired A/B in one run.

1. The step hook: ``Stepper.tick()`` (what ``profd_client.step()`` and the optimizer hook
   call) and a ``region()`` entry and exit, with a black box and without one, in alternating
   rounds of 200,000 calls. Target: the black box adds <= 1 us per step on the hook.
2. A CPU training loop of ~1 ms steps (a small MLP's forward, backward and optimizer step on
   one thread, a ``region("fwd")`` each step) with the black box and its sampler taking the
   training thread's stack at 10 Hz from another thread (as the agent thread does), against
   the same loop without a black box, in pairs of ~25 ms blocks (which half is on decided by
   a coin), with an A/A run of the same method as its floor, and the samples' share read
   from the steps they overlapped. Target: <= 0.5 % of step time.
3. Sampling, separately: one ``sys._current_frames()`` sample's time on the sampling thread,
   and py-spy's non-blocking dump (``py-spy dump --nonblocking``) of the same loop in a child
   process at 10 Hz from outside: each dump's wall time and the loop's slowdown (windows with
   and without dumps alternating).
4. Memory: the black box's allocation at attach and at its fullest (tracemalloc).
"""

from __future__ import annotations

import bisect
import functools
import json
import operator
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B

from profd_client.blackbox import MAX_FRAMES, MAX_STACKS, BlackBox
from profd_client.steps import RING, Stepper

LOOP = """
import json, sys, time, torch
torch.manual_seed(0)
torch.set_num_threads(1)
m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = torch.optim.SGD(m.parameters(), lr=1e-3)
# A batch of 112: ~1 ms steps on this 2-core VM, the step length the target names (a batch
# of 32 ran 0.49 ms steps, where a per-step cost weighs twice as much).
x, y = torch.randn(112, 256), torch.randint(0, 10, (112,))
def step():
    torch.nn.functional.cross_entropy(m(x), y).backward()
    opt.step()
    opt.zero_grad()
"""


def hook_cost(rounds: int, n: int) -> dict[str, Any]:
    """Per-call ns of tick() and of a region's enter+exit, without and with a black box."""
    out: dict[str, list[float]] = {"tick_off": [], "tick_on": [], "region_off": [], "region_on": []}
    for r in range(rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            st = Stepper("main-r0", notify=lambda: None)
            if on:
                BlackBox(st, {})
            tick, timer = st.tick, st.timer("fwd")
            st.next_event = 1 << 62  # the hot path only, as in a running job
            t0 = time.perf_counter_ns()
            for _ in range(n):
                tick()
            t1 = time.perf_counter_ns()
            for _ in range(n):
                with timer:
                    pass
            t2 = time.perf_counter_ns()
            tag = "on" if on else "off"
            out[f"tick_{tag}"].append((t1 - t0) / n)
            out[f"region_{tag}"].append((t2 - t1) / n)
    return {k: statistics.median(v) for k, v in out.items()} | {"raw": out}


def _pairs_pct(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """The relative difference of each (on, off) pair of blocks, in %: mean, its 95 %
    confidence half-width, median."""
    d = [(on / off - 1) * 100 for on, off in pairs]
    half = 1.96 * statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else None
    return {"mean": statistics.fmean(d), "ci95": half, "median": statistics.median(d), "n": len(d)}


def training(seconds: float, aa_seconds: float, block_steps: int = 40) -> dict[str, Any]:
    """Step time of the ~1 ms loop with the black box (region records, samples at 10 Hz)
    against without, in blocks of ``block_steps`` steps (~25 ms) taken in pairs, on then off
    or off then on by a coin, for ``seconds``: the machine's drift, which in longer windows
    is as large as the effect, is the same for both halves of a pair. Then ``aa_seconds`` of
    the same with nothing different (A/A): what this method reads when there is nothing."""
    ns: dict[str, Any] = {}
    exec(LOOP, ns)
    step = ns["step"]
    for _ in range(300):
        step()
    st = Stepper("main-r0", notify=lambda: None)
    box = BlackBox(st, {})
    box.log.on = False
    sampling = threading.Event()
    stop = threading.Event()
    sample_s: list[float] = []
    held: list[tuple[float, float]] = []  # each sample's start and end

    def sampler() -> None:  # the agent thread's part: asleep until a sample is due
        while not stop.is_set():
            if not sampling.is_set():
                time.sleep(0.1)
                continue
            t = time.perf_counter()
            box.sample(t)
            if box.sampler.n > len(sample_s):
                sample_s.append(time.perf_counter() - t)
                held.append((t, t + sample_s[-1]))
            time.sleep(box.due(time.perf_counter()) or 0.1)

    st.training_ident = threading.get_ident()
    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    timer = st.timer("fwd")
    coin = random.Random(0)
    on_steps: list[list[float]] = []  # the step end times of each "on" block

    def block(on: bool) -> float:
        box.log.on = on
        (sampling.set if on else sampling.clear)()
        ends = [time.perf_counter()]
        for _ in range(block_steps):
            with timer:
                step()
            st.tick()
            ends.append(time.perf_counter())
        if on:
            on_steps.append(ends)
        return (ends[-1] - ends[0]) / block_steps

    def run(for_s: float, differ: bool) -> list[tuple[float, float]]:
        pairs = []
        end = time.perf_counter() + for_s
        while time.perf_counter() < end:
            first_on = coin.random() < 0.5
            a = block(differ and first_on)
            b = block(differ and not first_on)
            pairs.append((a, b) if first_on else (b, a))
        return pairs

    pairs = run(seconds, True)
    aa = run(aa_seconds, False)
    stop.set()
    th.join()
    sample = statistics.median(sample_s) if sample_s else 0.0
    return {
        **attributed(on_steps, held),
        "step_ms_off": statistics.median(off for _, off in pairs) * 1e3,
        "blocks": _pairs_pct(pairs),
        "aa": _pairs_pct(aa),
        "samples": len(sample_s),
        "sample_us_p50": sample * 1e6,
        "sample_us_p99": B.pct(sample_s, 99) * 1e6 if sample_s else None,
        # What the parts cost, measured apart: a sample holds the GIL for its time, 10 times
        # a second.
        "derived_pct": (sample * 10.0) * 100,
    }


def attributed(windows: list[list[float]], held: list[tuple[float, float]]) -> dict[str, Any]:
    """What the samples cost the training thread, read from its own step times: the steps a
    sample overlapped (the sample's own time, the GIL handed over and back, the caches it
    cooled) against the other steps of the same windows, as extra time per sample and as a
    share of the time at the rate sampled. Drift between windows (the machine's load) does
    not enter, as it does in the off/on comparison."""
    hit: list[float] = []
    clean: list[float] = []
    samples = 0
    span = 0.0
    starts = [s for s, _ in held]
    for ends in windows:
        lo, hi = ends[0], ends[-1]
        span += hi - lo
        i0, i1 = bisect.bisect_left(starts, lo), bisect.bisect_right(starts, hi)
        samples += i1 - i0
        touched: set[int] = set()
        for s, e in held[i0:i1]:
            first = max(0, bisect.bisect_right(ends, s) - 1)
            last = min(len(ends) - 2, bisect.bisect_left(ends, e) - 1)
            touched.update(range(first, last + 1))
        for k in range(len(ends) - 1):
            (hit if k in touched else clean).append(ends[k + 1] - ends[k])
    if not samples or not clean:
        return {"attributed_us_per_sample": None, "attributed_pct": None}
    extra = (sum(hit) - len(hit) * statistics.fmean(clean)) / samples
    return {
        "attributed_us_per_sample": extra * 1e6,
        "attributed_pct": extra * samples / span * 100,
        "attributed_samples": samples,
    }


CHILD = (
    LOOP
    + """
import threading
print(json.dumps({"ready": True}), flush=True)
n = 0
while True:
    step()
    n += 1
    if n % 100 == 0:
        print(json.dumps({"t": time.time(), "n": n}), flush=True)
"""
)


def pyspy(windows: int, window_s: float) -> dict[str, Any] | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        return None
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert child.stdout is not None
    child.stdout.readline()
    marks: list[dict[str, Any]] = []
    reader = threading.Thread(
        target=lambda: [marks.append(json.loads(line)) for line in child.stdout],  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()
    time.sleep(1.0)
    spans: list[tuple[str, float, float]] = []
    dumps: list[float] = []
    order = ["off", "on", "on", "off"]
    try:
        for w in range(windows):
            cond = order[w % 4]
            t0 = time.time()
            while time.time() - t0 < window_s:
                if cond == "on":
                    d0 = time.perf_counter()
                    subprocess.run(
                        [exe, "dump", "--nonblocking", "--pid", str(child.pid)],
                        capture_output=True,
                        check=False,
                    )
                    dumps.append(time.perf_counter() - d0)
                    time.sleep(max(0.0, 0.1 - (time.perf_counter() - d0)))
                else:
                    time.sleep(0.1)
            spans.append((cond, t0, time.time()))
    finally:
        child.kill()
        child.wait()
    per: dict[str, list[float]] = {"off": [], "on": []}
    for cond, a, b in spans:
        inside = [m for m in marks if a <= m["t"] <= b]
        if len(inside) >= 2:
            steps = inside[-1]["n"] - inside[0]["n"]
            per[cond].append((inside[-1]["t"] - inside[0]["t"]) / steps)
    off, on = statistics.median(per["off"]), statistics.median(per["on"])
    return {
        "step_ms_off": off * 1e3,
        "step_ms_on": on * 1e3,
        "overhead_pct": (on / off - 1) * 100,
        "dumps": len(dumps),
        "dump_ms_p50": statistics.median(dumps) * 1e3,
        "dumps_per_s": len(dumps) / (windows / 2 * window_s),
    }


def _ci(r: dict[str, Any]) -> str:
    return "-" if r["ci95"] is None else f"{r['ci95']:.3f}"


def _within(r: dict[str, Any], limit: float) -> bool | None:
    """Met when the whole 95 % interval is under ``limit``; None when it straddles it."""
    if r["ci95"] is None:
        return None
    if r["mean"] + r["ci95"] <= limit:
        return True
    return False if r["mean"] - r["ci95"] > limit else None


def trace_size(ranks: int, steps: int) -> dict[str, Any]:
    """The Perfetto file of ``ranks`` boxes of ``steps`` steps each (3 regions a step, 10 Hz
    samples of 40-frame stacks over 1 s steps), made by the real client and conversion."""
    from profd.blackbox import perfetto
    from profd.blackbox.box import from_result
    from profd_client import protocol as P

    boxes = []
    code = compile("def f(): pass", "/opt/venv/lib/python3.11/site-packages/model.py", "exec")
    for rank in range(ranks):
        now = [1000.0]
        st = Stepper(
            "main-r0", notify=lambda: None, clock=functools.partial(operator.getitem, now, 0)
        )
        box = BlackBox(st, {})
        box.configure({"keep_steps": steps, "keep_seconds": 0.0})
        smp = box.sampler
        timers = [st.timer(n) for n in ("data", "forward", "backward")]
        for i in range(steps + 2):
            for t in timers:
                with t:
                    now[0] += 0.25
            now[0] += 0.25
            for k in range(10):
                key = tuple(smp.frame_id((code, (i * 7 + k + d) % 300)) for d in range(40))
                j = smp.n % len(smp.t)
                smp.t[j], smp.step[j], smp.stack[j] = now[0], st.count + 1, smp.stack_id(key)
                smp.n += 1
            st.tick()
        m = P.decode(P.encode(P.BLACKBOX_RESULT, id=1, **box.snapshot()), P.AGENT_INBOUND)
        boxes.append(from_result(m, {"node": "n", "host": "h", "role": "main", "rank": rank}))
    path = Path(tempfile.mkdtemp()) / "bb.json.gz"
    t0 = time.perf_counter()
    size = perfetto.write(boxes, path)
    took = time.perf_counter() - t0
    shutil.rmtree(path.parent)
    return {"ranks": ranks, "steps": steps, "gz_mib": size / 2**20, "write_s": took}


def memory() -> dict[str, Any]:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    st = Stepper("main-r0", notify=lambda: None)
    box = BlackBox(st, {})
    at_attach = tracemalloc.get_traced_memory()[0] - before
    t = st.timer("fwd")
    for _ in range(RING + 10):
        with t:
            pass
        st.tick()
    smp = box.sampler
    code = compile("def f(): pass", "x" * 300, "exec")
    ids = [smp.frame_id((code, i)) for i in range(MAX_FRAMES)]
    for i in range(MAX_STACKS):
        smp.stack_id(tuple(ids[(i + k) % MAX_FRAMES] for k in range(64)))
    full = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"at_attach_mib": at_attach / 2**20, "full_mib": full / 2**20}


def main() -> None:
    p = B.parser(__doc__)
    args = p.parse_args()
    started = time.monotonic()
    q = args.quick
    hook = hook_cost(4 if q else 10, 50_000 if q else 200_000)
    train = training(3.0 if q else 120.0, 2.0 if q else 60.0)
    spy = pyspy(4 if q else 8, 1.0 if q else 3.0)
    mem = memory()
    size = trace_size(8 if q else 64, 64 if q else 512)
    added = hook["tick_on"] - hook["tick_off"]
    # One region a step: its record's time, and the tick's, over the step's.
    step_ns = train["step_ms_off"] * 1e6
    region_ns = hook["region_on"] - hook["region_off"]
    derived = train["derived_pct"] + (max(0.0, region_ns) + max(0.0, added)) / step_ns * 100
    rows = [
        B.row("tick() with black box", "<= 1 us added", hook["tick_on"], "ns",
              hook["tick_off"], "without", met=added <= 1000),
        B.row("region enter+exit with black box", "-", hook["region_on"], "ns",
              hook["region_off"], "without"),
        B.row("~1 ms step, black box + 10 Hz samples", "<= 0.5 %", train["blocks"]["mean"],
              "%", met=_within(train["blocks"], 0.5),
              spread=f"95 % CI +-{_ci(train['blocks'])}, {train['blocks']['n']} block pairs; "
              f"A/A {train['aa']['mean']:.3f} +-{_ci(train['aa'])}"),
        B.row("the samples' share, from the step times", "<= 0.5 %", train["attributed_pct"],
              "%", spread=f"{train['attributed_us_per_sample']:.0f} us a sample, "
              f"{train['attributed_samples']} samples"),
        B.row("the same, from its parts", "<= 0.5 %", derived, "%", met=derived <= 0.5,
              spread="samples x 10 Hz + region record + tick"),
        B.row("one sys._current_frames sample", "-", train["sample_us_p50"], "us",
              spread=f"p99 {train['sample_us_p99']:.0f}"),
        B.row("black box memory, full", "<= 8 MiB", mem["full_mib"], "MiB",
              met=mem["full_mib"] <= 8),
        B.row(f"trace of {size['ranks']} ranks x {size['steps']} steps, gzipped", "<= 20 MB",
              size["gz_mib"], "MiB", met=size["gz_mib"] <= 20,
              spread=f"written in {size['write_s']:.1f} s"),
    ]  # fmt: skip
    if spy is not None:
        rows += [
            B.row("~1 ms step, py-spy dump at 10 Hz", "-", spy["overhead_pct"], "%"),
            B.row("one py-spy --nonblocking dump", "-", spy["dump_ms_p50"], "ms",
                  spread=f"{spy['dumps_per_s']:.1f}/s reached"),
        ]  # fmt: skip
    B.write_result(
        "blackbox",
        args.out,
        q,
        {"quick": q},
        rows,
        {"hook": hook, "training": train, "pyspy": spy, "memory": mem, "trace": size},
        started,
    )


if __name__ == "__main__":
    main()
