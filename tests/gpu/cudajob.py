"""A small CUDA training loop with the two-line profd integration, for ``gpucheck.py``.

One process, one GPU, a single-rank NCCL process group (so ``distributedInfo`` is in its traces
and every step runs NCCL collectives). Each step: ``forward`` and ``backward`` regions, an
all-reduce and an all-to-all of the gradients' norms, an optimizer step, a host-to-device and a
device-to-host copy, and a ``torch.cuda.synchronize()`` so the step's GPU work ends inside it.

Env:
  STEPS (default 100000), STEP_SLEEP seconds per step (default 0.02).
  GATE: a file; the job attaches, then waits for it before step 1 (see tests/jobs/gate.py).
  STOP: a file; the job ends after the step during which it appeared.
  NCCL=0: no process group (the idle-cost runs, which time steps alone).
  TIMES: print per-step wall times (µs, after WARMUP steps) in the RESULT line.
  AB=N: after WARMUP steps, blocks of N steps with the client's training-thread side switched
      on and off in turn (``profd_client.api._measure_hooks``, the agent stays attached), in
      pairs whose order alternates (on-off, off-on, ...); the RESULT line has ``ab_blocks``,
      ``[hook on?, mean step µs]`` per block. STEPS should be WARMUP + a multiple of 2N.
  DEVICE=cpu: gloo and the CPU instead (``gpucheck.py --allow-cpu``, which tries the checks'
      plumbing on a machine without a GPU).

Prints ``RESULT {json}`` at the end: steps, the NVTX ranges the client pushed (counted by
wrapping ``torch.cuda.nvtx.range_push``), the step times asked for.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
from gate import wait_gate

import profd_client
from profd_client import api

pushes: dict[str, int] = {}
_push = torch.cuda.nvtx.range_push


def counted_push(msg: str) -> int:
    pushes[msg] = pushes.get(msg, 0) + 1
    return int(_push(msg))


# profd_client looks the function up on every region entry, so this sees every NVTX call it
# makes, and none of torch's own.
torch.cuda.nvtx.range_push = counted_push

profd_client.attach()
cuda = os.environ.get("DEVICE", "cuda") == "cuda"
dev = torch.device("cuda:0" if cuda else "cpu")
use_nccl = os.environ.get("NCCL", "1") != "0"
if use_nccl:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", os.environ.get("NCCL_PORT", "29533"))
    if cuda:
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024)
).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
host = torch.randn(64, 1024, pin_memory=cuda)
steps = int(os.environ.get("STEPS", "100000"))
pause = float(os.environ.get("STEP_SLEEP", "0.02"))
stop = os.environ.get("STOP")
warmup = int(os.environ.get("WARMUP", "20"))
times: list[float] = []
ab = int(os.environ.get("AB", "0"))
ab_on: list[bool] = []


def ab_block_on(block: int) -> bool:
    """Block ``block``'s arm: pairs on-off, off-on, on-off, ... (drift cancels in pairs)."""
    return (block % 2 == 0) == ((block // 2) % 2 == 0)


wait_gate()
for i in range(steps):
    if ab and i >= warmup and (i - warmup) % ab == 0:
        ab_on.append(ab_block_on(len(ab_on)))
        api._measure_hooks(ab_on[-1])
    t0 = time.perf_counter()
    x = host.to(dev, non_blocking=True)
    with profd_client.region("forward"):
        loss = model(x).square().mean()
    with profd_client.region("backward"):
        loss.backward()
    if use_nccl:
        norms = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
        dist.all_reduce(norms)
        dist.all_to_all_single(torch.empty_like(norms), norms)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()  # a device-to-host copy, and the step's kernels are done
    if cuda:
        torch.cuda.synchronize()
    if i >= warmup:
        times.append((time.perf_counter() - t0) * 1e6)
    if stop and os.path.exists(stop):
        break
    if pause:
        time.sleep(pause)

result = {
    "steps": profd_client.current_step(),
    "attached": profd_client.is_attached(),
    "nvtx_pushes": pushes,
    "pid": os.getpid(),
}
if ab:
    api._measure_hooks(True)
    blocks = [times[k * ab : (k + 1) * ab] for k in range(len(ab_on))]
    result["ab_blocks"] = [[on, sum(b) / len(b)] for on, b in zip(ab_on, blocks, strict=True) if b]
    result["steps"] = profd_client.current_step()
if os.environ.get("TIMES"):
    result["step_us"] = [round(t, 1) for t in times]
print("RESULT " + json.dumps(result), flush=True)
if use_nccl:
    dist.destroy_process_group()
