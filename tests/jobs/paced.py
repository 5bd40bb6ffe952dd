"""A DDP job (gloo, CPU) whose steps take a set time, one rank possibly slower.

Each step every rank runs a tiny DDP model forward and backward (DDP all-reduces the
gradients inside backward), then stands for the step's work: it sleeps ``base_ms`` times
1 ± ``jitter`` (uniform, drawn per rank and step), and rank ``slow`` spends ``extra_ms`` more
after it, either computing (``extra=mm``: ``aten::mm`` until the time is up) or asleep
(``extra=sleep``); then the optimizer steps. The others wait for the slow rank in the next
step's all-reduce. The work is sleep, not compute, so that eight ranks share two cores
without their steps depending on the scheduler.

What the job does can change while it runs: each step reads MODE_FILE, whose text is
``key=value`` pairs: ``base_ms`` (default 150), ``jitter`` (0.0), ``slow`` (-1: nobody),
``extra_ms`` (0), ``extra`` (``mm`` or ``sleep``). Env: MODE_FILE, STEPS (default 100000).
"""

import os
import random
import time

import torch
import torch.distributed as dist
from ending import end_process_group

import profd_client

profd_client.attach()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
x = torch.randn(16, 32)
a = torch.randn(64, 64)
rng = random.Random(rank)
mode_file = os.environ["MODE_FILE"]
DEFAULTS = {"base_ms": "150", "jitter": "0", "slow": "-1", "extra_ms": "0", "extra": "mm"}


def read_mode() -> dict[str, str]:
    try:
        with open(mode_file) as fh:
            pairs = (kv.split("=", 1) for kv in fh.read().split())
            return {**DEFAULTS, **dict(p for p in pairs if len(p) == 2)}
    except OSError:
        return DEFAULTS


def busy(seconds: float) -> None:
    # Timed rather than counted: on a loaded machine a count of products takes any time.
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(a, a)


for _ in range(int(os.environ.get("STEPS", "100000"))):
    mode = read_mode()
    loss = ddp(x).pow(2).mean()
    loss.backward()
    jitter = float(mode["jitter"])
    time.sleep(float(mode["base_ms"]) / 1000 * (1 + rng.uniform(-jitter, jitter)))
    if rank == int(mode["slow"]):
        extra = float(mode["extra_ms"]) / 1000
        if mode["extra"] == "sleep":
            time.sleep(extra)
        else:
            busy(extra)
    opt.step()
    opt.zero_grad()
del ddp, opt
end_process_group()
