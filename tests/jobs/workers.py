"""A configurable CPU job (gloo) for the capture tests.

Env:
  STEPS (default 200), STEP_SLEEP seconds per step (default 0.05).
  GATE: a file path; every rank attaches, then waits for the file before its first step, so a
      test can arm explicit steps (``--steps 3:5``) before step 1 without racing the job.
  ROLES: comma-separated roles, one per rank (``actor,rollout``); passed to ``attach(role=)``.
      Unset: ``attach()`` picks the role itself (``PROFD_ROLE`` or ``main``).
  MANUAL_ROLES: comma-separated roles that count steps with ``profd_client.step()`` and run
      forward only, with no optimizer (rollout/inference workers).
  DDP=1: data parallel with a collective every step. Otherwise every rank trains alone, so a
      rank killed mid-run cannot stall the others.
  KEEP_ON_SIGTERM=1: ignore torchrun's SIGTERM (sent to the survivors when one rank dies) and
      finish the remaining steps; torchrun waits 30 s before SIGKILL.

Prints ``RESULT {json}`` per rank at the end.
"""

import json
import os
import signal
import time

import torch
import torch.distributed as dist
from ending import end_process_group
from gate import wait_gate

import profd_client

rank_env = int(os.environ.get("RANK", "0"))
roles = [r for r in os.environ.get("ROLES", "").split(",") if r]
role = roles[rank_env % len(roles)] if roles else None
manual_roles = {r for r in os.environ.get("MANUAL_ROLES", "").split(",") if r}
manual = role in manual_roles
profd_client.attach(role=role, step="manual" if manual else "optimizer")

if os.environ.get("KEEP_ON_SIGTERM") == "1":
    signal.signal(signal.SIGTERM, lambda *_: None)

dist.init_process_group("gloo")
rank = dist.get_rank()
use_ddp = os.environ.get("DDP") == "1"
torch.manual_seed(0)
model: torch.nn.Module = torch.nn.Sequential(
    torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)
)
if use_ddp:
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = None if manual else torch.optim.SGD(model.parameters(), lr=0.01)
steps = int(os.environ.get("STEPS", "200"))
pause = float(os.environ.get("STEP_SLEEP", "0.05"))

wait_gate()

for _ in range(steps):
    if opt is None:
        with torch.no_grad(), profd_client.region("forward"):
            model(torch.randn(32, 64))
        profd_client.step()
    else:
        with profd_client.region("forward"):
            loss = model(torch.randn(32, 64)).pow(2).mean()
        with profd_client.region("backward"):
            loss.backward()
        opt.step()
        opt.zero_grad()
    time.sleep(pause)

print(
    "RESULT " + json.dumps({"rank": rank, "role": role, "steps": profd_client.current_step()}),
    flush=True,
)
if use_ddp:
    del model, opt
    end_process_group()
