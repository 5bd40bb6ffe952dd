"""A gloo DDP job in which one rank gets stuck loading data, for ``profctl stacks``.

Every step sleeps STEP_MS, runs a tiny DDP model's backward (its gradients all-reduced)
and steps the optimizer. From step STUCK_AT on, rank STUCK_RANK calls
``stuck_in_data_loading()``, which sleeps STUCK_S before it returns, so the other ranks wait
for it in the all-reduce of that step's backward. The job then runs STEPS steps in all.

``THREAD=1``: the steps run on a thread named ``trainer`` (the main thread only waits for
it), so the training thread is not the main thread.

``STUCK_HOW=gil``: ``stuck_in_data_loading()`` spins in one regular-expression match
instead (catastrophic backtracking: minutes in one C call that never releases the GIL), so
the process's own threads (its agent thread too) cannot run; only a reader from outside
sees where it is.

``STUCK_UNTIL``: a path; the stuck rank comes back as soon as it exists (or STUCK_S is up),
so that a test need not wait out a STUCK_S long enough for a loaded machine.

``PAUSE_AT``: at that step every rank calls ``save_checkpoint()``, which sleeps STUCK_S (a
pause on purpose: every rank in the same place, none waiting for another).

Env: STUCK_HOW (sleep), STEP_MS (20), STUCK_RANK (-1: nobody; or several, "2,3"),
STUCK_AT (20), STUCK_S (600), STUCK_UNTIL (none), PAUSE_AT (0: never), STEPS (100000),
THREAD (0).
"""

import os
import re
import threading
import time

import torch
import torch.distributed as dist
from ending import end_process_group

import profd_client

profd_client.attach()
dist.init_process_group("gloo")
rank = dist.get_rank()
step_s = float(os.environ.get("STEP_MS", "20")) / 1000.0
stuck_ranks = {int(r) for r in os.environ.get("STUCK_RANK", "-1").split(",")}
pause_at = int(os.environ.get("PAUSE_AT", "0"))
stuck_at = int(os.environ.get("STUCK_AT", "20"))
stuck_s = float(os.environ.get("STUCK_S", "600"))
release = os.environ.get("STUCK_UNTIL", "")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(4, 8)


def stuck_in_data_loading() -> None:
    if os.environ.get("STUCK_HOW") == "gil":
        re.match(r"(a*)*b", "a" * 40)  # ~2^40 steps inside the regex engine, GIL held
    elif release:
        # Polled with os.stat (no Python frame of its own): a reader of the stack from
        # outside sees this function, as it does in the plain sleep.
        end = time.monotonic() + stuck_s
        while time.monotonic() < end:
            try:
                os.stat(release)
                return
            except FileNotFoundError:
                time.sleep(0.1)
    else:
        time.sleep(stuck_s)


def save_checkpoint() -> None:
    time.sleep(stuck_s)


def load_batch(step: int) -> torch.Tensor:
    if rank in stuck_ranks and step == stuck_at:
        stuck_in_data_loading()
    if step == pause_at:
        save_checkpoint()
    time.sleep(step_s)
    return x


def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for step in range(1, int(os.environ.get("STEPS", "100000")) + 1):
        batch = load_batch(step)
        model(batch).sum().backward()
        opt.step()
        opt.zero_grad()


if os.environ.get("THREAD") == "1":
    trainer = threading.Thread(target=train, args=(model, opt), name="trainer")
    trainer.start()
    trainer.join()
else:
    train(model, opt)
del model, opt
end_process_group()
