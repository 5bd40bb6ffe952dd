"""The public API of :mod:`profd_client` (see the package docstring); loaded on first use."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

# None of these import zmq or torch; importing them here keeps attach() itself cheap.
from . import protocol as P
from .agent import Agent, Explicit
from .blackbox import BlackBox, env_overrides
from .identity import Identity, detect, probe_dist, probe_ray
from .locations import find_socket, locate_socket
from .ranks import RankSpecError, parse_ranks
from .steps import NULL_REGION, Stepper

__all__ = ["attach", "current_step", "detach", "identity", "is_attached", "region", "step"]

log = logging.getLogger("profd_client")

_stepper: Stepper | None = None
_agent: Agent | None = None
_identity: Identity | None = None
_hook: Any = None
#: The Stepper while :func:`_measure_hooks` has the training-thread side switched off.
_paused: Stepper | None = None
_NULL: AbstractContextManager[None] = NULL_REGION


def attach(
    *,
    role: str | None = None,
    job: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    step: str = "optimizer",
    runtime_dir: str | None = None,
    heartbeat: float | None = None,
    wait: float | None = None,
) -> bool:
    """Register this process with the node's profd daemon; returns at once by default.

    Args:
        role: worker role (``actor``, ``rollout``, ...); default ``PROFD_ROLE``, a Ray
            actor's class in snake_case (``DTensorPolicyWorker`` → ``dtensor_policy_worker``),
            or ``"main"``.
        job: job name; default ``PROFD_JOB``, torchrun's run id, Ray's job, SLURM's job, or
            the job's rendezvous address (``MASTER_ADDR``/``MASTER_PORT``, or the process
            group's store), so every rank of one job has the same one.
        rank: global rank; default ``PROFD_RANK``, the process group's rank once
            ``torch.distributed`` is initialised, ``RANK``/``SLURM_PROCID``/MPI.
        world_size: default ``PROFD_WORLD_SIZE``, the process group's size,
            ``WORLD_SIZE``/``SLURM_NTASKS``/MPI.
        step: ``"optimizer"`` (every ``optimizer.step()`` ends a step) or ``"manual"``
            (call :func:`step` yourself, e.g. in rollout/inference loops).
        runtime_dir: where the daemon's sockets are; default as ``profd`` resolves it.
        heartbeat: heartbeat interval in seconds (default ``PROFD_HEARTBEAT`` or 1).
        wait: block up to this many seconds until the daemon has welcomed this process
            (default ``PROFD_ATTACH_WAIT`` or 0: do not wait). Only a process that waits can
            have step 1 captured, by an ``[[auto]]`` rule: the daemon arms the rule before its
            welcome, and the arm is applied here, at the boundary before step 1. Without a
            daemon socket there is nothing to wait for and attach() returns at once.

    Returns ``True`` if the agent started, ``False`` when disabled (``PROFD_DISABLE=1``) or
    already attached. A daemon that is not running yet is not an error: the agent keeps
    trying in the background.

    ``attach()`` may run before a launcher has told the process its rank (Lightning,
    ``torch.multiprocessing.spawn``): once ``torch.distributed``'s default process group is
    initialised, the agent thread notices at its next heartbeat and re-registers with the
    rank, world size and job the group implies. Arguments given here always win.
    """
    global _stepper, _agent, _identity, _hook
    if os.environ.get("PROFD_DISABLE", "").strip() not in ("", "0"):
        return False
    if _agent is not None:
        return False
    if step not in ("optimizer", "manual"):
        raise ValueError(f"step must be 'optimizer' or 'manual', not {step!r}")
    try:
        explicit = Explicit(job=job, role=role, rank=rank, world_size=world_size)
        ray, dist = probe_ray(), probe_dist()
        ident = detect(job=job, role=role, rank=rank, world_size=world_size, dist=dist, ray=ray)
        allow = _allowlist()
        allowed = allow(ident.rank)
        interval = heartbeat or float(os.environ.get("PROFD_HEARTBEAT", "1.0"))
        st = Stepper(stem=f"{ident.role}-r{ident.rank}", notify=lambda: None)
        overrides = env_overrides()
        box = BlackBox(st, overrides) if overrides.get("enabled", True) else None
        agent = Agent(
            ident, st, step, allowed, runtime_dir, interval, explicit, ray, dist, allow, box
        )
        st._notify = agent.notify
        if step == "optimizer":
            _hook = _install_optimizer_hook(st)
        _stepper, _agent, _identity = st, agent, ident
        wait_s = _attach_wait(wait)
        agent.attaching = allowed and wait_s > 0
        _say_if_no_daemon(runtime_dir)
        agent.start()
        atexit.register(detach)
        if agent.attaching:
            _await_welcome(agent, st, runtime_dir, wait_s)
        return True
    except Exception as exc:  # attach must never break the training script
        log.warning("profd_client: attach failed, profiling disabled: %r", exc)
        return False


def _say_if_no_daemon(runtime_dir: str | None) -> None:
    """One info line when no daemon listens where this process looks: a PROFD_RUNTIME_DIR
    that points elsewhere costs a newcomer minutes otherwise. An untrusted place is the
    agent's to warn about."""
    found = locate_socket(P.AGENT_SOCKET, runtime_dir)
    if found.path is None or found.path.exists():
        return
    log.info(
        "profd_client: no profd daemon in %s; training goes on, and this process attaches"
        " when one starts there (set PROFD_RUNTIME_DIR to the daemon's runtime dir)",
        ", ".join(str(p.parent) for p in found.looked),
    )


def _allowlist() -> Callable[[int], bool]:
    """``PROFD_RANKS`` as a test on a rank (asked again when the rank changes)."""
    text = os.environ.get("PROFD_RANKS")
    if not text:
        return lambda _rank: True
    try:
        ranks = parse_ranks(text)
    except RankSpecError as exc:
        log.warning("profd_client: ignoring PROFD_RANKS: %s; profiling disabled", exc)
        return lambda _rank: False
    if ranks is None:
        return lambda _rank: True
    return lambda rank: rank in ranks


def _attach_wait(wait: float | None) -> float:
    if wait is not None:
        return max(0.0, float(wait))
    text = os.environ.get("PROFD_ATTACH_WAIT", "").strip()
    try:
        return max(0.0, float(text)) if text else 0.0
    except ValueError:
        log.warning("profd_client: ignoring PROFD_ATTACH_WAIT=%r: not a number", text)
        return 0.0


def _await_welcome(agent: Agent, st: Stepper, runtime_dir: str | None, wait_s: float) -> None:
    path, _ = find_socket(P.AGENT_SOCKET, runtime_dir)
    if path.exists():  # no socket, no daemon: waiting could only cost time
        agent.connected.wait(wait_s)
    # A hello sent from now on no longer offers step 1; an arm for it that comes later is
    # reported as a missed cycle, never captured late.
    agent.attaching = False
    st.boundary_now()


def _install_optimizer_hook(st: Stepper) -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        import torch
    tick = st.tick

    def _post_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
        tick()

    from torch.optim.optimizer import register_optimizer_step_post_hook

    return register_optimizer_step_post_hook(_post_step)


def _measure_hooks(on: bool) -> bool:
    """For measurement only (the in-process idle-cost A/B of ``tests/gpu/gpucheck.py`` and
    ``bench/bench_idle.py``), not for training code: switch off, or back on, everything the
    client does on the training thread (the optimizer post-hook, :func:`step`,
    :func:`region`'s timers) while the agent thread stays attached, so blocks of the same
    steps can be timed with and without it in one process. Steps taken while it is off are
    not counted. Returns False when there is nothing to switch (not attached, or already in
    that state)."""
    global _stepper, _hook, _paused
    if on and _paused is not None and _agent is not None:
        _stepper, _paused = _paused, None
        if _agent.step_mode == "optimizer":
            _hook = _install_optimizer_hook(_stepper)
        return True
    if not on and _stepper is not None:
        _stepper, _paused = None, _stepper
        if _hook is not None:
            _hook.remove()
            _hook = None
        return True
    return False


def step(n: int | None = None) -> None:
    """End the current step (manual mode), or with ``n`` declare that ``n`` steps are done.

    ``step(n)`` is for resumed runs: after ``step(1000)`` the next step is number 1001. It works
    in either step mode. Without ``attach()`` (or with ``PROFD_DISABLE=1``) this does nothing.
    """
    st = _stepper
    if st is None:
        return
    if n is None:
        st.tick()
    else:
        st.set_step(int(n))


def region(name: str) -> AbstractContextManager[None]:
    """Mark a phase (``with profd_client.region("rollout"):``).

    Every block is timed, captured or not: the time spent inside each name and how often
    it was entered go to the daemon with the step ledger (``profctl top``'s region shares,
    ``profd_region_seconds_total``). Nested entries of the same name count once. The first
    ``MAX_LEDGER_REGIONS`` (32) distinct names are timed; later names, and names that are not
    1..200-character strings, are not. While idle this returns the name's reusable timer
    (two clock reads, no allocation beyond them).

    While a capture is running the block also becomes a ``record_function`` range (and an
    NVTX range where CUDA exists); a session started with ``--region NAME`` records one trace
    per entry into the region. Without ``attach()`` this returns a shared no-op context
    manager.
    """
    st = _stepper
    if st is None:
        return _NULL
    if st.live is None:
        try:
            t = st.regions.get(name)
        except TypeError:  # unhashable: st.timer() says no to it
            return _NULL
        return t if t is not None else st.timer(name)
    return st.region(name)


def current_step() -> int:
    """Number of steps completed so far (0 before the first, or when not attached)."""
    st = _stepper
    return 0 if st is None else st.count


def identity() -> Identity | None:
    """The identity this process registered with, or ``None`` when not attached.

    It changes when the process re-registers (``torch.distributed`` initialised after
    ``attach()``); ``identity().sources`` says where each field came from.
    """
    agent = _agent
    return agent.who if agent is not None else _identity


def is_attached() -> bool:
    """True while the agent is registered with a live daemon."""
    return _agent is not None and _agent.connected.is_set()


def detach() -> None:
    """Say goodbye to the daemon and stop the agent thread (also run at exit).

    A capture still running is stopped and its trace is kept and delivered.
    """
    global _stepper, _agent, _hook, _paused
    agent, st = _agent, _stepper or _paused
    if agent is None or st is None:
        return
    try:
        if st.live is not None:
            st.post("shutdown", None)
            st.boundary_now()
        if _hook is not None:
            _hook.remove()
        agent.stop()
    except Exception as exc:
        log.debug("profd_client: detach error: %r", exc)
    _stepper, _agent, _hook, _paused = None, None, None, None
