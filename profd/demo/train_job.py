"""The demo's training job: data-parallel CPU training (gloo) with the two profd lines.

Once the file ``DEMO_SLOW_FILE`` exists, rank ``DEMO_SLOW_RANK`` (1) spends ``DEMO_SLOW_MS``
(60) more in its forward pass every step: a straggler the other rank waits for in the
all-reduce, provoked so that the demo can show profd noticing it by itself. Once
``DEMO_STALL_FILE`` exists, that rank sits 3 s in ``load_batch`` for one step, then removes
the file: a spike, which the black box explains."""

import os
import time

import torch
import torch.distributed as dist

import profd_client

profd_client.attach(role=os.environ.get("DEMO_ROLE", "trainer"))

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 512),
    torch.nn.ReLU(),
    torch.nn.Linear(512, 256),
    torch.nn.ReLU(),
    torch.nn.Linear(256, 10),
)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
slow_file = os.environ.get("DEMO_SLOW_FILE")
slow_s = float(os.environ.get("DEMO_SLOW_MS", "60")) / 1000
slowed = dist.get_rank() == int(os.environ.get("DEMO_SLOW_RANK", "1")) and bool(slow_file)
stall_file = os.environ.get("DEMO_STALL_FILE") or ""


def load_batch() -> tuple[torch.Tensor, torch.Tensor]:
    if slowed and os.path.exists(stall_file):
        time.sleep(3.0)  # a data loader that stalls once
        os.remove(stall_file)
    return torch.randn(64, 256), torch.randint(0, 10, (64,))


for _ in range(int(os.environ.get("DEMO_STEPS", "400"))):
    with profd_client.region("data"):
        x, y = load_batch()
    with profd_client.region("forward"):
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        if slowed and os.path.exists(slow_file or ""):
            time.sleep(slow_s)
    with profd_client.region("backward"):
        loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad()
    time.sleep(0.02)
dist.destroy_process_group()
