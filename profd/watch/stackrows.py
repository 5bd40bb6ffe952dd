"""Stack rows, one typed definition each (docs/design.md "Hangs"): a frame, a thread, one
rank's stacks, a rank named in a group, a group of ranks with the same stack and a call
tree's node. The daemon builds them (py-spy's dump, an agent thread's answer), groups them
and keeps them in a hang incident's evidence; profctl decodes every node's reply and every
node's stored evidence into the same types and groups them again. Pure.

On the wire (a ``stacks`` reply, ``profd.control_schema.STACK_RANK``) and in the index (a
hang's evidence, JSON) they are the maps :func:`to_maps` gives, field for field as before
they were typed, so a profctl or daemon of an earlier release reads them unchanged:
optional fields are left out rather than sent as null. :func:`ranks_of` reads them back,
rank by rank: a row another node or an old record holds that does not decode is left out
and counted, not trusted.
"""

from __future__ import annotations

import enum
import gc
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import msgspec.msgpack
from msgspec import UNSET, UnsetType


class Source(enum.Enum):
    """Who read a rank's stacks."""

    PYSPY = "py-spy"
    AGENT = "agent"


class Frame(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """One frame, as py-spy or the agent gives it; a thread's frames are innermost first."""

    function: str
    file: str
    line: int = 0
    #: A C/C++ frame (py-spy ``--native``): never part of a group's key.
    native: bool = False


class Thread(msgspec.Struct, frozen=True, kw_only=True):
    """One thread's stack. ``training`` is always on the wire (older readers require it);
    ``owns_gil`` only where py-spy said."""

    name: str = ""
    tid: int = 0
    frames: tuple[Frame, ...] = ()
    #: The thread that counts the rank's steps (``stackgroups.mark_training``).
    training: bool = False
    owns_gil: bool | UnsetType = UNSET


class Member(msgspec.Struct, frozen=True, gc=False, order=True):
    """A rank as a group, a suspect or a tree branch names it; ordered by (host, role,
    rank), the order every listing of them keeps."""

    host: str
    role: str
    rank: int


class StackRank(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One rank's stacks: who, who read them (``source`` None: nobody could, ``error`` says
    why) and its threads. ``flight``: its flight recorder's summary (``profd.watch.flightrec``:
    a map checked by the protocol's ``FLIGHT``), or why there is none (``flight_error``).
    ``client_host``: the name the rank's own host gave it, where it is named by its node;
    ``node``: which daemon listed it (profctl)."""

    host: str
    role: str
    rank: int
    pid: int
    source: Source | None
    threads: tuple[Thread, ...]
    error: str | None = None
    read_ms: float | None = None
    flight: dict[str, Any] | None = None
    flight_error: str | None = None
    client_host: str | None = None
    node: str | None = None

    @property
    def member(self) -> Member:
        return Member(self.host, self.role, self.rank)

    @property
    def training(self) -> Thread | None:
        """Its training thread, when its stacks were read."""
        if self.source is None:
            return None
        return next((t for t in self.threads if t.training), None)


def rank_order(r: StackRank) -> tuple[str, int, str, int]:
    """The order a ``stacks`` reply and profctl list a job's ranks in: by role, then rank
    (then host and pid, where two processes claim one rank)."""
    return (r.role, r.rank, r.host, r.pid)


class Group(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Ranks whose training threads have the same Python stack (``frames``, innermost
    first); the largest group is the ``majority``. ``where``: that stack for a human, in a
    hang's evidence."""

    ranks: tuple[Member, ...]
    majority: bool
    frames: tuple[Frame, ...]
    where: str | None = None


class TreeNode(msgspec.Struct, kw_only=True):
    """One frame of the merged call tree (``stackgroups.tree``), the ranks that passed
    through it and the frames they called next."""

    frame: Frame
    ranks: list[Member]
    children: list[TreeNode]


def to_maps(value: Any) -> Any:
    """Stack rows (or any structure holding them) as the maps of the wire and the index,
    exactly as a reader unpacks them (arrays as lists: what the control schema checks)."""
    return _unpack(_pack(value))


_pack = msgspec.msgpack.Encoder().encode
_unpack = msgspec.msgpack.Decoder().decode


def ranks_of(maps: Iterable[object]) -> list[StackRank | None]:
    """Rank maps (a reply's or a stored hang's) as rows, in their order; None for a map that
    does not decode. The collector is paused meanwhile, as it is while the reply is unpacked
    (``envelope.unpack``): the reply (100,000s of maps and lists at a cluster's 4,096 ranks)
    is alive, and each of its passes would walk it all again (docs/benchmarks.md, "Typed
    stack rows")."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        out: list[StackRank | None] = []
        for m in maps:
            try:
                out.append(msgspec.convert(m, StackRank))
            except msgspec.ValidationError:
                out.append(None)
        return out
    finally:
        if paused:
            gc.enable()


def threads_of(maps: Iterable[Mapping[str, Any]]) -> list[Thread]:
    """An agent thread's answer's threads, none marked the training thread yet. Only what
    the protocol checked of each (``AGENT_STACK_THREAD``: its name, tid and frames) is read:
    the rest of an open map is the peer's, unchecked."""
    return [
        Thread(name=t["name"], tid=t["tid"], frames=msgspec.convert(t["frames"], _Frames))
        for t in maps
    ]


_Frames = tuple[Frame, ...]
