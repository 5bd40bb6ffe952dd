"""Every incident kind, in the order ``/metrics`` and ``profctl incidents --kind`` list them.
Everything that names kinds (the incident store, its automatic capture, ``/metrics``,
profctl) reads them here."""

from __future__ import annotations

from profd.watch.kinds import hang, regression, slow_rank, spike, straggler
from profd.watch.kinds.kind import Kind, plain_text, rule_grace

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


def known(name: str) -> Kind:
    """The kind called ``name``, or for a kind this version does not know (a newer daemon's,
    in the index) one that is none of the flags: one open per job and rank, no capture, its
    name as its text, no loss of its own."""
    kind = _BY_NAME.get(name)
    if kind is None:
        kind = Kind(name, name, job_wide=False, captures=False, grace=rule_grace, text=plain_text)
    return kind
