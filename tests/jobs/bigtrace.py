"""A job whose traces are large and barely compressible: for multipart S3 upload tests.

While a profiler records, every step opens BIG_EVENTS ``record_function`` ranges with random
BIG_NAME_CHARS-character names, so the gzipped trace is roughly
BIG_EVENTS * BIG_NAME_CHARS * 0.75 bytes a step. Idle steps cost nothing extra.
Env: STEPS (default 100000), STEP_SLEEP (default 0.02), BIG_EVENTS, BIG_NAME_CHARS.
"""

import base64
import os
import time

import torch
import torch.distributed as dist
from ending import end_process_group

import profd_client

profd_client.attach()
dist.init_process_group("gloo")
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps = int(os.environ.get("STEPS", "100000"))
pause = float(os.environ.get("STEP_SLEEP", "0.02"))
events = int(os.environ.get("BIG_EVENTS", "6000"))
chars = int(os.environ.get("BIG_NAME_CHARS", "1000"))
for _ in range(steps):
    if torch.autograd._profiler_enabled():
        for _ in range(events):
            name = base64.b64encode(os.urandom(chars * 3 // 4)).decode()
            with torch.profiler.record_function(name):
                pass
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(pause)
end_process_group()
