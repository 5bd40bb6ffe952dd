"""A job whose steps take a known time, for the step ledger's tests (gloo, CPU).

Each step sleeps ``STEP_MS`` * (1 ± ``JITTER``), the first ``DATA_SHARE`` of it inside
``profd_client.region("data")``; rank ``SLOW_RANK`` sleeps ``SLOW_FACTOR`` times as long.
``DDP=1``: a tiny DDP model all-reduces every step, so the ranks run in lockstep (the slowest
sets the pace); otherwise every rank steps alone (rollout workers). Every rank measures its
own step times (from one optimizer step to the next) and writes the median of its last
``WINDOW`` steps to ``OUT_DIR/rank{R}.json`` every second, so a test can compare what profd
says with what the job measured itself.

``SLOWER_AFTER_S``: from that many seconds after its first step, every rank's steps take
``SLOWER_FACTOR`` times as long (a regression of the whole job).

``STALL_RANK``: once ``OUT_DIR/stall`` appears, that rank sits ``STALL_S`` (5) seconds in
``stuck_in_data_loading`` inside its data region, for one step (a spike; in a DDP job the
others wait for it in their backward's all-reduce), then removes the file.

Env: STEP_MS (30), JITTER (0.1), SLOW_RANK (-1), SLOW_FACTOR (1.4), DATA_SHARE (0.25),
DDP (0), STEPS (100000), OUT_DIR, WINDOW (300), SLOWER_AFTER_S (never), SLOWER_FACTOR (1.5),
STALL_RANK (-1), STALL_S (5).
"""

import json
import os
import random
import statistics
import time
from collections import deque

import torch
import torch.distributed as dist
from ending import end_process_group

import profd_client

profd_client.attach()
dist.init_process_group("gloo")
rank = dist.get_rank()
step_s = float(os.environ.get("STEP_MS", "30")) / 1000.0
jitter = float(os.environ.get("JITTER", "0.1"))
if rank == int(os.environ.get("SLOW_RANK", "-1")):
    step_s *= float(os.environ.get("SLOW_FACTOR", "1.4"))
share = float(os.environ.get("DATA_SHARE", "0.25"))
slower_after = float(os.environ.get("SLOWER_AFTER_S", "inf"))
slower = float(os.environ.get("SLOWER_FACTOR", "1.5"))
use_ddp = os.environ.get("DDP") == "1"
out = os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json")
rng = random.Random(rank)
torch.manual_seed(0)
model: torch.nn.Module = torch.nn.Linear(8, 2)
if use_ddp:
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(4, 8)
stall_flag = os.path.join(os.environ["OUT_DIR"], "stall")
stalls = rank == int(os.environ.get("STALL_RANK", "-1"))
stall_s = float(os.environ.get("STALL_S", "5"))


def stuck_in_data_loading() -> None:
    time.sleep(stall_s)
    os.remove(stall_flag)


durations: deque[float] = deque(maxlen=int(os.environ.get("WINDOW", "300")))
last = time.perf_counter()
written = last
slower_at = time.monotonic() + slower_after

slowed = False
for i in range(int(os.environ.get("STEPS", "100000"))):
    work = step_s * (1 + rng.uniform(-jitter, jitter))
    if time.monotonic() >= slower_at:
        work *= slower
        if not slowed:  # the first slower step, for a test to find in the black box
            slowed = True
            with open(os.path.join(os.environ["OUT_DIR"], f"slower{rank}.json"), "w") as fh:
                json.dump({"step": i + 1}, fh)
    with profd_client.region("data"):
        time.sleep(work * share)
        if stalls and os.path.exists(stall_flag):
            stuck_in_data_loading()
    time.sleep(work * (1 - share))
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    now = time.perf_counter()
    durations.append(now - last)
    last = now
    if now - written >= 1.0 and len(durations) >= 10:
        tmp = out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"rank": rank, "p50_ms": statistics.median(durations) * 1000.0}, fh)
        os.replace(tmp, out)
        written = now
if use_ddp:
    del model, opt
    end_process_group()
