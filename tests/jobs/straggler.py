"""A synchronous CPU job (gloo) in which one rank may do extra work before the collective.

Each step every rank computes for BASE_MS (``aten::mm``), the slow rank computes EXTRA_MS more,
then all ranks all-reduce their gradient and step the optimizer, so the others wait for the
slow rank in the collective. What is slow can change while the job runs: each step reads
MODE_FILE (when set), whose text is ``straggler R`` (rank R does EXTRA_MS more ``aten::mm``),
``slow`` (every rank does EXTRA_MS more ``aten::addmm``), ``rest`` (no work at all: steps of a
50 ms sleep, so that the job costs next to no CPU between captures) or anything else (no extra
work).
Env: STEPS (default 100000), BASE_MS (10), EXTRA_MS (40), MODE_FILE, MODE (when no file).
"""

import os
import time

import torch
import torch.distributed as dist
from ending import end_process_group

import profd_client

profd_client.attach()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
steps = int(os.environ.get("STEPS", "100000"))
base = float(os.environ.get("BASE_MS", "10")) / 1000
extra = float(os.environ.get("EXTRA_MS", "40")) / 1000
mode_file = os.environ.get("MODE_FILE")
mode = os.environ.get("MODE", "")
w = torch.nn.Parameter(torch.randn(128, 128))
opt = torch.optim.SGD([w], lr=1e-6)
a = torch.randn(128, 128)
#: The products' operand: large enough that one takes about a third of a millisecond. The profiler
#: records every product, and 150 ms of 128-wide ones (~50 us each) made traces of tens of
#: thousands of events that the daemon took seconds to take in.
big = torch.randn(256, 256)


def work(seconds: float, op: str = "mm") -> None:
    # Timed rather than counted: on a loaded machine a count of products takes any time,
    # and the straggler must stay the straggler.
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if op == "addmm":
            torch.addmm(big, big, big)
        else:
            torch.mm(big, big)


for _ in range(steps):
    if mode_file:
        try:
            with open(mode_file) as fh:
                mode = fh.read().strip()
        except OSError:
            mode = ""
    loss = (a @ w).pow(2).mean()
    loss.backward()
    if mode == "rest":
        time.sleep(0.05)
    else:
        work(base)
    if mode == f"straggler {rank}":
        work(extra)
    elif mode == "slow":
        work(extra, "addmm")
    dist.all_reduce(w.grad)
    opt.step()
    opt.zero_grad()
end_process_group()
