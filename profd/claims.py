"""Processes that claim one identity (job, role, rank), and how their files are told apart. PURE.

A launcher bug, an elastic restart whose old process is still exiting, or two runs sharing
``PROFD_JOB`` make two live processes register the same job, role and rank, with no malice
at all. Neither can be trusted over the other, so both are profiled and both are named: a
unique identity keeps ``{role}-r{rank}`` (HTA and TensorBoard read the rank from it), each
claimant of a shared one gets ``{role}-r{rank}-p{pid}``. The daemon (``ps``, sessions) and
profctl (``start``'s warning) word it with the same functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

#: (job, role, rank): what one process, and only one, should claim.
Identity = tuple[str, str, int]


def stem(role: str, rank: int, pid: int | None = None) -> str:
    """The name a process's files share in a cycle dir; ``pid`` when its identity is claimed
    by another process too."""
    base = f"{role}-r{rank}"
    return base if pid is None else f"{base}-p{pid}"


def claimants(procs: Iterable[tuple[Identity, int]]) -> dict[Identity, list[int]]:
    """Identities that more than one of ``procs`` (identity, pid) claim, with their pids in
    ascending order."""
    # A set only for an identity claimed twice: ``ps`` asks this of every process at once.
    first: dict[Identity, int] = {}
    more: dict[Identity, set[int]] = {}
    for ident, pid in procs:
        seen = first.setdefault(ident, pid)
        if seen != pid:
            more.setdefault(ident, {seen}).add(pid)
    return {k: sorted(v) for k, v in sorted(more.items())}


def note(role: str, rank: int, named: Sequence[tuple[int, str]]) -> str:
    """What a session and ``start`` say about processes (pid, stem) claiming one role and rank."""
    named = sorted(named)
    pids = ", ".join(str(p) for p, _ in named)
    stems = ", ".join(s for _, s in named)
    return f"{len(named)} processes claim {role} rank {rank} (pids {pids}): their files are {stems}"


def notes(targets: Iterable[tuple[str, int, int, str]]) -> list[str]:
    """:func:`note` for every role and rank claimed by more than one of ``targets`` (role, rank,
    pid, stem): a session's targets share one job."""
    by: dict[tuple[str, int], list[tuple[int, str]]] = {}
    for role, rank, pid, name in targets:
        by.setdefault((role, rank), []).append((pid, name))
    return [note(role, rank, named) for (role, rank), named in sorted(by.items()) if len(named) > 1]
