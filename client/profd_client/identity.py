"""Who this process is in the job: explicit arguments, the job itself, then launcher variables.

:func:`detect` is pure: it takes the environment and what :func:`probe_dist` and
:func:`probe_ray` found, so every rule below is testable without a launcher. The agent thread
calls it again whenever :func:`probe_dist` changes (``init_process_group`` ran), so a process
that attached before any launcher told it its rank re-registers with the right one.

Every field's origin is kept in ``Identity.sources`` (``profctl ps --sources``): ``arg``,
``env:NAME``, ``torch.distributed``, ``ray``, ``process`` (a lone process's own id),
``launcher`` (the parent process, for launchers that name no job), ``rank`` (local rank taken
from the global rank) or ``default``.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .protocol import IDENTITY_FIELDS as FIELDS
from .protocol import MAX_NAME as _MAX_NAME

__all__ = ["FIELDS", "DistInfo", "Identity", "RayInfo", "detect", "probe_dist", "probe_ray"]


@dataclass(frozen=True)
class Identity:
    job: str
    role: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    #: Where each of ``FIELDS`` came from.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def key(self) -> tuple[str, str, int, int, int]:
        """What the daemon selects and names files by: a change means re-registering."""
        return (self.job, self.role, self.rank, self.local_rank, self.world_size)


@dataclass(frozen=True)
class DistInfo:
    """The default process group, once initialised: the job's own view of the rank."""

    rank: int
    world_size: int
    #: The rendezvous store's ``host:port`` (a TCPStore), shared by every rank of the job.
    store: str | None = None


@dataclass(frozen=True)
class RayInfo:
    """This process as Ray sees it (only when ``ray`` was already imported)."""

    job_id: str
    #: Ray numbers jobs per cluster from ``01000000``: the cluster's session name keeps two
    #: clusters on one node (or one restarted) from sharing ids.
    cluster: str | None = None
    #: The actor's class name; None in a driver or a plain task.
    actor_class: str | None = None


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[int, str] | None:
    for n in names:
        v = env.get(n)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v), f"env:{n}"
    return None


_UNSAFE = re.compile(r"[^A-Za-z0-9._+=@:-]")


def safe_name(text: str, fallback: str) -> str:
    """``text`` as a path-safe protocol name (see ``protocol.NAME``), else ``fallback``."""
    s = _UNSAFE.sub("_", text).lstrip(".")[:_MAX_NAME]
    return s or fallback


_ACRONYM_WORD = re.compile(r"([A-Z]{2,})([A-Z][a-z])")
_LOWER_UPPER = re.compile(r"([a-z0-9])([A-Z])")


def snake_case(name: str) -> str:
    """``DTensorPolicyWorker`` → ``dtensor_policy_worker``, ``HTTPServer`` → ``http_server``.

    A run of two capitals before a word stays one word (``DTensor``, NeMo RL's naming); a
    longer run is an acronym of its own (``FSDPWorker`` → ``fsdp_worker``).
    """
    s = _LOWER_UPPER.sub(r"\1_\2", _ACRONYM_WORD.sub(r"\1_\2", name)).lower()
    return safe_name(re.sub(r"_+", "_", s), "main")


def script_name(argv0: str | None = None) -> str:
    a = sys.argv[0] if argv0 is None else argv0
    return os.path.splitext(os.path.basename(a or "python"))[0] or "python"


# Ranks set by a launcher that starts every local rank itself, so the ranks on one node share
# it as parent (the last resort when it names no job).
_LAUNCHER_RANKS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _job(
    env: Mapping[str, str],
    dist: DistInfo | None,
    ray: RayInfo | None,
    script: str,
    pid: int,
    ppid: int,
) -> tuple[str, str]:
    run_id = env.get("TORCHELASTIC_RUN_ID")
    # torchrun without --rdzv-id reports "none"; that would merge unrelated jobs.
    if run_id and run_id != "none":
        return run_id, "env:TORCHELASTIC_RUN_ID"
    if ray is not None:
        # Before SLURM: a Ray worker inherits the SLURM job of the allocation the Ray cluster
        # runs in, which may hold several Ray jobs.
        tag = f"-{zlib.crc32(ray.cluster.encode()):08x}" if ray.cluster else ""
        return f"ray-{ray.job_id}{tag}", "ray"
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID")
        return env["SLURM_JOB_ID"] + (f".{step}" if step else ""), "env:SLURM_JOB_ID"
    if env.get("PMIX_NAMESPACE"):  # one per mpirun/prterun job, on every node
        return env["PMIX_NAMESPACE"], "env:PMIX_NAMESPACE"
    # What every rank of one job shares, on every node: the rendezvous address. The store
    # the process group really met at wins over the variables that may have pointed there.
    if dist is not None and dist.store:
        return f"{script}-{dist.store.replace(':', '-')}", "torch.distributed"
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if addr and port:
        return f"{script}-{addr}-{port}", "env:MASTER_ADDR+MASTER_PORT"
    if any(env.get(n) for n in _LAUNCHER_RANKS):
        return f"{script}-{ppid}", "launcher"
    # Nothing shared to go by: a lone process is its own job (never its parent's pid, which
    # two unrelated jobs started from one shell share).
    return f"{script}-{pid}", "process"


def detect(
    env: Mapping[str, str] | None = None,
    *,
    job: str | None = None,
    role: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    dist: DistInfo | None = None,
    ray: RayInfo | None = None,
    argv0: str | None = None,
    pid: int | None = None,
    ppid: int | None = None,
) -> Identity:
    """This process's identity; each field from the first source that has it.

    job: ``job=``, ``PROFD_JOB``, ``TORCHELASTIC_RUN_ID``, Ray's job, SLURM's job (and step),
    ``PMIX_NAMESPACE``, the process group's rendezvous store, ``MASTER_ADDR``/``MASTER_PORT``,
    then the launcher's pid (a rank variable is set) or this process's pid.
    rank/world size: the argument, ``PROFD_RANK``/``PROFD_WORLD_SIZE``, the initialised
    process group, then torchrun, SLURM and MPI variables. role: the argument,
    ``PROFD_ROLE``, a Ray actor's class in snake_case, ``main``.

    ``PROFD_*`` variables override launcher variables and the process group: a user who
    exports them means them. Inside a Ray actor SLURM's variables describe the Ray cluster's
    allocation, not the actor, and are ignored.
    """
    e = os.environ if env is None else env
    src: dict[str, str] = {}
    in_actor = ray is not None and ray.actor_class is not None
    r, lr, ws = _ranks(e, src, rank=rank, world_size=world_size, dist=dist, in_actor=in_actor)
    own_pid = os.getpid() if pid is None else pid
    if job:
        j, src["job"] = job, "arg"
    elif e.get("PROFD_JOB"):
        j, src["job"] = e["PROFD_JOB"], "env:PROFD_JOB"
    else:
        # Only a derived name is made path-safe: an explicit one is the user's to get right.
        ppid_ = os.getppid() if ppid is None else ppid
        j, src["job"] = _job(e, dist, ray, script_name(argv0), own_pid, ppid_)
        j = safe_name(j, "python")
    ro, src["role"] = _role(e, role, ray if in_actor else None)
    return Identity(
        job=j,
        role=ro,
        rank=r,
        local_rank=lr,
        world_size=ws,
        host=socket.gethostname(),
        pid=own_pid,
        sources=src,
    )


def _pick_int(
    env: Mapping[str, str],
    src: dict[str, str],
    name: str,
    explicit: int | None,
    own: str,
    from_dist: int | None,
    launch: tuple[str, ...],
) -> int | None:
    """One of rank/world size, its origin recorded in ``src[name]``; None when nothing has it.

    Order: the argument, profd's own variable, the process group, then launcher variables.
    """
    if explicit is not None:
        src[name] = "arg"
        return explicit
    hit = _first_int(env, (own,))
    if hit is None and from_dist is not None:
        src[name] = "torch.distributed"
        return from_dist
    hit = hit or _first_int(env, launch)
    if hit is not None:
        src[name] = hit[1]
        return hit[0]
    return None


def _ranks(
    env: Mapping[str, str],
    src: dict[str, str],
    *,
    rank: int | None,
    world_size: int | None,
    dist: DistInfo | None,
    in_actor: bool,
) -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)``, each origin recorded in ``src``.

    Inside a Ray actor SLURM's variables describe the allocation, not the actor: skipped.
    """
    slurm = () if in_actor else ("SLURM_PROCID",)
    mpi = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")
    r = _pick_int(
        env, src, "rank", rank, "PROFD_RANK", dist.rank if dist else None, ("RANK", *slurm, *mpi)
    )
    ws = _pick_int(
        env,
        src,
        "world_size",
        world_size,
        "PROFD_WORLD_SIZE",
        dist.world_size if dist else None,
        (
            "WORLD_SIZE",
            *(() if in_actor else ("SLURM_NTASKS",)),
            "OMPI_COMM_WORLD_SIZE",
            "PMI_SIZE",
        ),
    )
    local_names = ("LOCAL_RANK", *(() if in_actor else ("SLURM_LOCALID",)))
    lr_hit = _first_int(env, (*local_names, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"))
    if lr_hit is not None:
        lr, src["local_rank"] = lr_hit
    else:
        lr, src["local_rank"] = (r if r is not None else 0), "rank"
    if r is None:
        r, src["rank"] = 0, "default"
    if ws is None:
        ws, src["world_size"] = 1, "default"
    return r, lr, ws


def _role(env: Mapping[str, str], role: str | None, actor: RayInfo | None) -> tuple[str, str]:
    """The role and its origin; ``actor`` is this process's Ray info only inside an actor."""
    if role:
        return role, "arg"
    if env.get("PROFD_ROLE"):
        return env["PROFD_ROLE"], "env:PROFD_ROLE"
    if actor is not None and actor.actor_class:
        return snake_case(actor.actor_class), "ray"
    return "main", "default"


def probe_dist() -> DistInfo | None:
    """The default process group's rank, size and store, or None before it exists.

    Never imports: a process that has not imported ``torch.distributed`` has no group. Cheap
    enough for the agent thread to ask at every heartbeat (a module-global check until the
    group exists).
    """
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not dist.is_available() or not dist.is_initialized():
            return None
        rank, size = int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # being torn down, or a torch without these
        return None
    if rank < 0 or size < 1:
        return None
    return DistInfo(rank, size, _store_address(dist))


def _store_address(dist: Any) -> str | None:
    try:
        store = dist.distributed_c10d._get_default_store()
        for _ in range(8):  # PrefixStores around the TCPStore the group met at
            inner = getattr(store, "underlying_store", None)
            if inner is None:
                break
            store = inner
        host, port = store.host, store.port
    except Exception:  # a FileStore, HashStore, or a torch that moved these
        return None
    if not isinstance(host, str) or not host or not isinstance(port, int) or port <= 0:
        return None
    return f"{host}:{port}"


def probe_ray() -> RayInfo | None:
    """Ray's job and actor class for this process, if ``ray`` is imported and initialised.

    Never imports ray: a process that has not imported it is not part of a Ray job.
    """
    ray: Any = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        ctx = ray.get_runtime_context()
        job_id = str(ctx.get_job_id())
    except Exception:
        return None
    cluster: str | None = None
    try:
        cluster = str(ctx.get_session_name())
    except Exception:  # older Ray: no public accessor
        cluster = None
    return RayInfo(job_id=job_id, cluster=cluster, actor_class=_actor_class(ctx))


def _actor_class(ctx: Any) -> str | None:
    try:
        if ctx.get_actor_id() is None:
            return None
    except Exception:
        return None
    try:
        # The actor's own handle names the class it was created from, whatever thread asks.
        name = ctx.current_actor._ray_actor_creation_function_descriptor.class_name
        if isinstance(name, str) and name:
            return name.rsplit(".", 1)[-1]
    except Exception:
        pass
    try:
        # "module.Class.method" while an actor task (``__init__`` too) runs on this thread.
        parts = str(ctx.get_task_function_name() or "").split(".")
        if len(parts) >= 2 and parts[-2].isidentifier():
            return parts[-2]
    except Exception:
        pass
    return None
