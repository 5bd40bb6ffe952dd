"""Who this process is in the job: detected from launcher environments, explicit args win."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Identity:
    job: str
    role: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int


def _first_int(env: Mapping[str, str], *names: str) -> int | None:
    for n in names:
        v = env.get(n)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return None


def _default_job(env: Mapping[str, str]) -> str:
    run_id = env.get("TORCHELASTIC_RUN_ID")
    # torchrun without --rdzv-id reports "none"; that would merge unrelated jobs.
    if run_id and run_id != "none":
        return run_id
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID")
        return env["SLURM_JOB_ID"] + (f".{step}" if step else "")
    script = os.path.splitext(os.path.basename(sys.argv[0] or "python"))[0] or "python"
    # Local ranks of one torchrun/mpirun share the launcher as parent.
    return f"{script}-{os.getppid()}"


def detect(
    env: Mapping[str, str] | None = None,
    *,
    job: str | None = None,
    role: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> Identity:
    """Identity from torchrun/elastic, SLURM, MPI, then ``PROFD_*``; explicit arguments win.

    ``PROFD_JOB``/``PROFD_ROLE``/``PROFD_RANK`` override launcher variables: a user who
    exports them under torchrun means them.
    """
    e = os.environ if env is None else env
    r = rank
    if r is None:
        r = _first_int(e, "PROFD_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    ws = world_size
    if ws is None:
        ws = _first_int(
            e, "PROFD_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"
        )
    lr = _first_int(
        e, "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"
    )
    return Identity(
        job=job or e.get("PROFD_JOB") or _default_job(e),
        role=role or e.get("PROFD_ROLE") or "main",
        rank=r if r is not None else 0,
        local_rank=lr if lr is not None else (r if r is not None else 0),
        world_size=ws if ws is not None else 1,
        host=socket.gethostname(),
        pid=os.getpid(),
    )
