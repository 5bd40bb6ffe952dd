"""Version adaptation: an older peer's messages in the current version's shape, and back.

A daemon answers each peer in the version it spoke, and a client steps down to an older
daemon's version; the code on either side builds and reads messages in the current
version's shape only, and what differs between versions is said here, once. Each version
step is one :class:`_Step` (what version ``n`` added over ``n - 1``); :func:`downgrade`
applies the steps from the current version down to the peer's, as jupyter_client's
``adapter.adapt`` does between its message specs.

Reading needs no conversion so far: every field a later version added is optional, so an
older peer's message already has the current shape, and the receiver treats a missing field
as the older version meant it (no ``ledger``: the daemon falls back to the rate). The one
field whose meaning changed, an ``arm``'s ``incoming``, is read through :func:`home`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any, Final, NamedTuple

from .schema import target_dir
from .vocabulary import ARM, HEARTBEAT, WELCOME


class Peer(NamedTuple):
    """The process an agent message is for or from (the ``hello``'s ``host`` and ``pid``)."""

    host: str
    pid: int


Fields = dict[str, Any]
_Down = Callable[[Fields, "Peer | None"], Fields]


def _drop(*names: str) -> _Down:
    def down(fields: Fields, peer: Peer | None) -> Fields:
        return {k: x for k, x in fields.items() if k not in names}

    return down


def _arm_to_v1(fields: Fields, peer: Peer | None) -> Fields:
    # From version 2 ``incoming`` is the session's directory and each process writes into
    # its own below it; a version-1 process writes straight into ``incoming``: name its own.
    if peer is None:
        raise ValueError("a version-1 arm names its process's own directory: give the peer")
    own = PurePosixPath(fields["incoming"]) / target_dir(peer.host, peer.pid)
    return {**fields, "incoming": str(own)}


class _Step(NamedTuple):
    """What version ``version`` changed over the one before it, per message type."""

    version: int
    down: dict[str, _Down]
    #: Types whose older shape depends on the peer, so one frame cannot serve every peer.
    per_peer: frozenset[str] = frozenset()


_STEPS: Final = (
    # 2: ``welcome`` carries ``protocol``; an arm's ``incoming`` is the session's directory.
    _Step(2, {WELCOME: _drop("protocol"), ARM: _arm_to_v1}, frozenset({ARM})),
    # 3: ``hb`` carries ``ledger``.
    _Step(3, {HEARTBEAT: _drop("ledger")}),
)


def downgrade(t: str, fields: Fields, v: int, peer: Peer | None = None) -> Fields:
    """``fields`` of a message of type ``t`` in the current version's shape, as version ``v``
    has them (``peer``: the process the message is for)."""
    for step in reversed(_STEPS):
        if step.version <= v:
            break
        down = step.down.get(t)
        if down is not None:
            fields = down(fields, peer)
    return fields


def per_peer(t: str, v: int) -> bool:
    """Whether a message of type ``t`` in version ``v`` differs from peer to peer (then a
    frame made for one peer must not be sent to another)."""
    return any(v < step.version and t in step.per_peer for step in _STEPS)


def home(incoming: str, v: int, peer: Peer) -> str:
    """The directory ``peer`` writes an ``arm``'s captures into, as the arm's version ``v``
    means its ``incoming``: its own directory below it from version 2, ``incoming`` itself
    before."""
    if v < 2:
        return incoming
    return str(PurePosixPath(incoming) / target_dir(peer.host, peer.pid))
