"""The demo's training job: data-parallel CPU training (gloo) with the two profd lines."""

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
for _ in range(int(os.environ.get("DEMO_STEPS", "400"))):
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    with profd_client.region("forward"):
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
    with profd_client.region("backward"):
        loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad()
    time.sleep(0.02)
dist.destroy_process_group()
