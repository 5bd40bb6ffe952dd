"""How every test job ends its gloo group.

Freeing a gloo group joins its worker threads while holding the GIL, and a group still
referenced at interpreter exit (DDP's reducer keeps one) has threads that outlive the
interpreter: "terminate called without an active exception" and SIGABRT in about one run in
a hundred under load (pytorch/pytorch#190489), or a deadlock when a worker still tearing down
the last collective needs the GIL. So: wait at a barrier with the GIL released until every
worker has finished, let the caller drop what holds the group, collect it, then destroy.
"""

import gc

import torch.distributed as dist


def end_process_group() -> None:
    """Barrier, collect what held the group, destroy it (callers ``del`` their DDP model first)."""
    if not dist.is_initialized():
        return
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
