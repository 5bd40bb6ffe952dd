"""The demo's training job: data-parallel CPU training (gloo) with the two profd lines.

Once the file ``DEMO_SLOW_FILE`` exists, rank ``DEMO_SLOW_RANK`` (1) spends ``DEMO_SLOW_MS``
(60) more in its forward pass every step: a straggler the other rank waits for in the
all-reduce, provoked so that the demo can show profd noticing it by itself."""

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
for _ in range(int(os.environ.get("DEMO_STEPS", "400"))):
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
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
