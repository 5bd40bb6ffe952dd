"""A small data-parallel CPU training job (gloo) with the two-line profd integration.

Env: STEPS (default 200), STEP_SLEEP seconds per step (default 0.02), ROLE.
Prints ``RESULT {json}`` per rank at the end.
"""

import json
import os
import time

import torch
import torch.distributed as dist
from ending import end_process_group

import profd_client

attached = profd_client.attach()
connected = profd_client.is_attached()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
steps = int(os.environ.get("STEPS", "200"))
pause = float(os.environ.get("STEP_SLEEP", "0.02"))
for _ in range(steps):
    with profd_client.region("forward"):
        loss = ddp(torch.randn(32, 64)).pow(2).mean()
    with profd_client.region("backward"):
        loss.backward()
    opt.step()
    opt.zero_grad()
    time.sleep(pause)
dist.barrier()
print(
    "RESULT "
    + json.dumps(
        {
            "rank": rank,
            "steps": profd_client.current_step(),
            "attached": attached,
            "connected": connected,
        }
    ),
    flush=True,
)
del ddp, opt
end_process_group()
