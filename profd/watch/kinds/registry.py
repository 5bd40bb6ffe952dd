"""Every incident kind, in the order ``/metrics`` and ``profctl incidents --kind`` list them.
Everything that names kinds (the incident store, its automatic capture, ``/metrics``,
profctl) reads them here."""

from __future__ import annotations

from profd.watch.kinds import hang, regression, slow_rank, spike, straggler
from profd.watch.kinds.kind import Kind

ALL: tuple[Kind, ...] = (
    regression.KIND,
    slow_rank.KIND,
    straggler.KIND,
    hang.KIND,
    spike.KIND,
)
_BY_NAME = {k.name: k for k in ALL}


def names() -> tuple[str, ...]:
    return tuple(k.name for k in ALL)


def labels() -> tuple[str, ...]:
    """The ``kind`` labels of ``profd_incidents_total``, in page order."""
    return tuple(k.label for k in ALL)


def get(name: str) -> Kind | None:
    """The kind called ``name``; None for a kind this version does not know (an incident
    a newer daemon wrote into the index)."""
    return _BY_NAME.get(name)


def job_wide(name: str) -> bool:
    kind = get(name)
    return kind is not None and kind.job_wide


def captures(name: str) -> bool:
    kind = get(name)
    return kind is not None and kind.captures


def job_changed(name: str) -> bool:
    kind = get(name)
    return kind is not None and kind.job_changed


def suspects_from_blackbox(name: str) -> bool:
    kind = get(name)
    return kind is not None and kind.suspects_from_blackbox
