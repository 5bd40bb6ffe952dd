"""A DDP job (gloo, CPU) whose steps take a set time, one rank possibly slower.

Each step every rank runs a tiny DDP model forward and backward (DDP all-reduces the
gradients inside backward), then stands for the step's work: it sleeps ``base_ms`` times
1 ± ``jitter`` (uniform, drawn per rank and step), and rank ``slow`` spends ``extra_ms`` more
after it, either computing (``extra=mm``: ``aten::mm`` until the time is up) or asleep
(``extra=sleep``); then the optimizer steps. The others wait for the slow rank in the next
step's all-reduce. The work is sleep, not compute, so that eight ranks share two cores
without their steps depending on the scheduler.

With ``work=compute`` the step's work is the model's own instead: forward and backward passes
of micro-batches with DDP's gradient sync off (``no_sync``, gradient accumulation) until
``base_ms`` is up, then one synced pass, whose bucketed all-reduces run beside its backward
pass; and rank ``slow`` sleeps ``nap_share`` of its own median step (without the nap) after
``backward()``, before ``optimizer.step()``. The work is timed rather than counted: a count of
passes takes any time on a loaded machine, and the one neighbours slow down would be a real
straggler of its own.

What the job does can change while it runs: each step reads MODE_FILE, whose text is
``key=value`` pairs: ``base_ms`` (default 150), ``jitter`` (0.0), ``slow`` (-1: nobody),
``extra_ms`` (0), ``extra`` (``mm`` or ``sleep``), ``work`` (``sleep`` or ``compute``),
``nap_share`` (0), ``pause`` (0; 1: the step's sleep ends as soon as MODE_FILE changes, so a
job can rest on long steps that cost next to no CPU and still take up a new mode at once).
Env: MODE_FILE, STEPS (default 100000), WIDTH (0: the tiny model of two layers of 32; else
three layers of WIDTH, a bucket each), BATCH (16), WAITS_DIR (where each rank appends, for
every step, ``step runnable_ns``: the step's number as profd counts it and how long the
training thread ran on a CPU or waited for one during the step's work, up to its optimizer
step, from the kernel's scheduler statistics; a test reads them over exactly the steps a
capture took).
"""

import os
import random
import statistics
import threading
import time

import torch
import torch.distributed as dist
from ending import end_process_group

import profd_client

profd_client.attach()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
width = int(os.environ.get("WIDTH", "0"))
if width:
    layers = [m for _ in range(3) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 4))
    # Buckets of about one layer: DDP all-reduces each as its gradients are ready, beside
    # the rest of the backward pass, as it does for any model larger than one bucket.
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=width * width * 4 / 2**20)
else:
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=1e-6 if width else 1e-3)
x = torch.randn(int(os.environ.get("BATCH", "16")), width or 32)
#: The extra work's operand: a product takes ~50 us, so that the profiler records a few
#: hundred of them a step, not thousands of 64-wide ones (each one the daemon takes in).
a = torch.randn(128, 128)
rng = random.Random(rank)
mode_file = os.environ["MODE_FILE"]
DEFAULTS = {
    "base_ms": "150", "jitter": "0", "slow": "-1", "extra_ms": "0", "extra": "mm",
    "work": "sleep", "nap_share": "0", "pause": "0",
}  # fmt: skip
own_steps: list[float] = []  # this rank's recent steps without its nap, s
waits_dir = os.environ.get("WAITS_DIR")
# Open for the job's life, line-buffered: a line a step, each readable as soon as written.
waits_log = open(os.path.join(waits_dir, f"r{rank}.tsv"), "a", buffering=1) if waits_dir else None  # noqa: SIM115
#: The training thread's scheduler statistics (this thread runs every step).
schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"


def runnable_ns() -> int:
    """The training thread's time on a CPU and waiting for one so far (ns), as the kernel
    counts them."""
    with open(schedstat) as fh:
        on_cpu, waited = fh.read().split()[:2]
    return int(on_cpu) + int(waited)


def log_work(began: int) -> None:
    """Append the step being run and its work's runnable time (ns), from ``began`` to now.

    Called before ``opt.step()``: profd's step hook runs in it, and the hook that ends a
    capture stops the profiler and writes the trace in this thread, which is not the step's
    work and would count against whichever rank wrote the bigger trace."""
    if waits_log is not None:
        waits_log.write(f"{profd_client.current_step() + 1} {runnable_ns() - began}\n")


def mode_text() -> str | None:
    try:
        with open(mode_file) as fh:
            return fh.read()
    except OSError:
        return None


def read_mode() -> dict[str, str]:
    text = mode_text()
    if text is None:
        return DEFAULTS
    pairs = (kv.split("=", 1) for kv in text.split())
    return {**DEFAULTS, **dict(p for p in pairs if len(p) == 2)}


def pause(seconds: float) -> None:
    """Sleep until ``seconds`` are up or MODE_FILE changes, whichever comes first."""
    before = mode_text()
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        time.sleep(min(left, 0.05))
        if mode_text() != before:
            return


def busy(seconds: float) -> None:
    # Timed rather than counted: on a loaded machine a count of products takes any time.
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(a, a)


def compute_step(
    ddp: torch.nn.parallel.DistributedDataParallel,
    opt: torch.optim.Optimizer,
    mode: dict[str, str],
    start: float,
) -> None:
    began = runnable_ns()
    end = start + float(mode["base_ms"]) / 1000
    while time.perf_counter() < end:
        with ddp.no_sync():
            ddp(x).pow(2).mean().backward()
    ddp(x).pow(2).mean().backward()
    nap = 0.0
    if rank == int(mode["slow"]) and len(own_steps) >= 5:
        nap = float(mode["nap_share"]) * statistics.median(own_steps[-20:])
        time.sleep(nap)
    log_work(began)
    opt.step()
    opt.zero_grad()
    own_steps.append(time.perf_counter() - start - nap)


for _ in range(int(os.environ.get("STEPS", "100000"))):
    mode = read_mode()
    if mode["work"] == "compute":
        compute_step(ddp, opt, mode, time.perf_counter())
        continue
    own_steps.clear()  # a compute case measures its own steps afresh
    began = runnable_ns()
    loss = ddp(x).pow(2).mean()
    loss.backward()
    jitter = float(mode["jitter"])
    seconds = float(mode["base_ms"]) / 1000 * (1 + rng.uniform(-jitter, jitter))
    if mode["pause"] == "1":
        pause(seconds)
    else:
        time.sleep(seconds)
    if rank == int(mode["slow"]):
        extra = float(mode["extra_ms"]) / 1000
        if mode["extra"] == "sleep":
            time.sleep(extra)
        else:
            busy(extra)
    log_work(began)
    opt.step()
    opt.zero_grad()
del ddp, opt
end_process_group()
