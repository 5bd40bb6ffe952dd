"""A ``torch.multiprocessing.spawn`` job (gloo, CPU), as in PyTorch's DDP tutorial.

Each child calls the two profd lines first, then sets ``MASTER_ADDR``/``MASTER_PORT`` and
passes its rank to ``init_process_group`` itself: nothing tells profd the rank before the
process group exists. Env: PORT (the rendezvous port), STEPS (default 8), NPROC (default 2),
GATE (as in workers.py, waited for after ``init_process_group``), PREINIT_GATE (the same,
waited for between ``attach()`` and ``init_process_group``), PARENT_MASTER=1 (the parent
exports ``MASTER_ADDR``/``MASTER_PORT`` before spawning, as many scripts do: the children then
attach under the job's id already, as rank 0 of 1). Prints ``RESULT {json}`` per rank.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ending import end_process_group
from gate import wait_gate


def worker(rank: int, world: int) -> None:
    import profd_client

    profd_client.attach()

    wait_gate("PREINIT_GATE")
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = os.environ["PORT"]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wait_gate("GATE")
    for _ in range(int(os.environ.get("STEPS", "8"))):
        model(torch.randn(32, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    ident = profd_client.identity()
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": rank,
                "profd_rank": ident.rank if ident else None,
                "steps": profd_client.current_step(),
            }
        ),
        flush=True,
    )
    del model, opt
    end_process_group()


if __name__ == "__main__":
    n = int(os.environ.get("NPROC", "2"))
    if os.environ.get("PARENT_MASTER") == "1":
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = os.environ["PORT"]
    mp.spawn(worker, args=(n,), nprocs=n)
