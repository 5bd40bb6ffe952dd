"""``ps`` and ``top`` rows, one typed definition each, built on the daemon's loop and packed
in one C call, as a table.

``ps`` lists every attached process at once (1,024 rows at 1,024 clients), and ``top`` every
rank, on the loop that also reads every heartbeat. As dicts their rows were built field by
field, checked by the hand-written schema field by field and packed: ~5 ms for ``ps``, with
~3,000 new objects for the collector each time (its full passes, ~20 ms each, were the round
trip's p99). A :class:`PsRow` is a msgspec ``Struct`` the collector does not track
(``gc=False``): the hello's part of a client's row is made once and copied with the live
fields set (:meth:`profd.daemon.clients.registry.Client.ps_row`), and :func:`pack` encodes the
listing and checks it against this same definition, as a receiver would, in C. A
:class:`TopRow` is made the same way, whole, once its rank's ratio to its role is known.

**The table form.** A request with ``form: "table"`` gets ``{"columns": [...], "rows":
[[...], ...], "others": [{...}, ...]}``: the column names once and each row as an array of
their values (rows are ``array_like``), then rows of another shape as maps (a peer of a
protocol version the daemon does not serve: :class:`PeerRow`, only what it claimed). At 1,024
rows that is 177 KB instead of 445 KB of maps, which a reader unpacks in a third of the time
(docs/benchmarks.md). A request without it (profctl from before) gets the same rows as a list
of maps, exactly as before; profctl reads either (``control_schema.listing_rows``). profctl
never loads this module (msgspec is a fifth of its start-up).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from operator import add
from typing import Annotated, Any, Final, get_type_hints

import msgspec
from msgspec import Meta
from msgspec.structs import asdict, astuple

from profd.control_schema import Packed
from profd_client.protocol.envelope import ProtocolError, bad
from profd_client.protocol.schema import MAX_HOST, MAX_NAME, MAX_PID, MAX_RANK, MAX_STEP, MAX_TEXT
from profd_client.protocol.typed import refusal

_BIG: Final = sys.float_info.max  # finite: NaN and infinities fail every bound
_Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
_Short = Annotated[str, Meta(max_length=64)]
_Count = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
_Rate = Annotated[float, Meta(ge=0.0, le=_BIG)]
_Pid = Annotated[int, Meta(ge=1, le=MAX_PID)]
# What an incompatible peer claimed is unchecked by any schema: any integer msgpack carries.
_WireInt = int
_Node = Annotated[str, Meta(min_length=1, max_length=MAX_TEXT)]


class PsHello(msgspec.Struct, frozen=True, gc=False, kw_only=True, array_like=True):
    """The part of a ``ps`` row its client's hello fixed (a new hello makes a new client): made,
    packed and checked once per client (:func:`hello_part`), then reused by every ``ps``."""

    host: Annotated[str, Meta(min_length=1, max_length=MAX_HOST)]
    pid: _Pid
    job: _Name
    role: _Name
    rank: Annotated[int, Meta(ge=0, le=MAX_RANK)]
    local_rank: Annotated[int, Meta(ge=0, le=MAX_RANK)]
    world_size: Annotated[int, Meta(ge=1, le=MAX_RANK + 1)]
    step_mode: Annotated[str, Meta(max_length=16)]
    allowed: bool
    torch: _Short | None
    device: _Short | None
    nsys_session: Annotated[str, Meta(max_length=MAX_NAME)] | None
    attached_at: Annotated[float, Meta(ge=0.0, le=1e12)]
    protocol: Annotated[int, Meta(ge=-(1 << 31), le=1 << 31)]
    client_version: _Short | None
    uid: Annotated[int, Meta(ge=-1, le=(1 << 32) - 1)]
    # Where each identity field came from (the hello's, as it checked them).
    identity_source: Annotated[dict[str, Any], Meta(max_length=64)]
    # Which daemon listed it (``profctl --cluster``): a row's ``host`` is what the client
    # called its machine, which does not tell nodes apart.
    node: _Node


class PsRow(PsHello, frozen=True, gc=False, kw_only=True, array_like=True):
    """One served process in ``ps``: its hello's part, then what changes between two
    listings (its columns in this order: a table's rows are the two parts joined)."""

    step: Annotated[int, Meta(ge=0, le=MAX_STEP)]
    steps_per_s: _Rate
    state: _Short
    cpu_percent: _Rate | None
    rss_bytes: _Count | None
    gpu_util: _Rate | None
    gpu_mem_bytes: _Count | None
    # Another served process claims the same job, role and rank: every pid that claims it.
    duplicate: bool
    claimed_by: Annotated[tuple[_Pid, ...], Meta(max_length=1 << 22)]
    # ``step`` as of now: moved on from the last heartbeat's at the rank's rate (as in
    # ``top``); ``age_s``: seconds since the heartbeat that carried the step.
    step_extrapolated: bool
    age_s: Annotated[float, Meta(ge=-_BIG, le=_BIG)]


#: A ``ps`` row's columns: the hello's part, then the live part (:func:`pack_ps`).
PS_HELLO: Final = PsHello.__struct_fields__
PS_LIVE: Final = PsRow.__struct_fields__[len(PS_HELLO) :]
_PS_HINTS: Final = get_type_hints(PsRow, include_extras=True)
#: The live columns alone, as one definition checks them (made from PsRow's, not restated).
_PsLive: Final[Any] = msgspec.defstruct(
    "_PsLive", [(n, _PS_HINTS[n]) for n in PS_LIVE], frozen=True, gc=False, array_like=True
)


class PeerRow(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """A peer of a protocol version the daemon does not serve, in ``ps``: listed so nobody
    wonders where a job went, with state ``incompatible``, an ``error`` and only what it
    claimed (unchecked by any schema: any integer msgpack carries)."""

    host: Annotated[str, Meta(min_length=1, max_length=MAX_HOST)]
    pid: _WireInt | None
    job: _Name
    role: _Name
    rank: _WireInt | None
    state: _Short
    protocol: Annotated[int, Meta(ge=-(1 << 31), le=1 << 31)] | None
    client_version: _Short | None
    error: Annotated[str, Meta(max_length=MAX_TEXT)]
    node: _Node


_Finite = Annotated[float, Meta(ge=-_BIG, le=_BIG)]


class TopRow(msgspec.Struct, frozen=True, gc=False, kw_only=True, array_like=True):
    """One served rank in ``top``: its step times over the last minute (``window_s``: what
    the figures cover), ``step`` as of now (``step_extrapolated``: moved on from the last
    heartbeat's at the rank's rate) and ``age_s`` (seconds since that heartbeat). ``source``:
    ``ledger`` (step times the client measured), ``rate`` (a protocol-2 client: 1/steps per
    second), ``index`` (the last minute the index holds, right after a daemon restart) or
    None. ``vs_role``: the rank's p50 over its role's median p50 on this node; ``marked``: far
    from it (``profd.watch.stats.FAR``). ``regions``: each region's share of the step time.
    ``wait_ms``: its collective wait per step over the window, as its flight recorder timed
    it (None: unknown, see docs/operations.md)."""

    host: Annotated[str, Meta(min_length=1, max_length=MAX_HOST)]
    pid: _Pid
    job: _Name
    role: _Name
    rank: Annotated[int, Meta(ge=0, le=MAX_RANK)]
    world_size: Annotated[int, Meta(ge=1, le=MAX_RANK + 1)]
    # As of now (moved on at the rank's rate, as in ``ps``), and seconds since its heartbeat.
    step: Annotated[int, Meta(ge=0, le=MAX_STEP)]
    step_extrapolated: bool
    age_s: _Finite | None
    sps: _Rate
    step_ms_p50: _Finite | None
    step_ms_p99: _Finite | None
    window_s: _Finite | None
    source: _Short | None  # "ledger", "index", "rate"; None: nothing yet
    regions: dict[str, _Finite]  # share of the step time in the window, by region
    wait_ms: _Finite | None  # collective wait per step; None: unknown
    cpu_percent: _Rate | None
    rss_bytes: _Count | None
    gpu_util: _Rate | None
    gpu_mem_bytes: _Count | None
    # Its p50 over the median p50 of its role's other ranks here, and slower by far.
    vs_role: _Finite | None
    marked: bool
    node: _Node


_ENCODE: Final = msgspec.msgpack.Encoder().encode
_LISTING: Final = Meta(max_length=1 << 22)


class _PsTable(msgspec.Struct, frozen=True, gc=False):
    columns: tuple[str, ...]
    rows: Annotated[list[PsRow], _LISTING]
    others: Annotated[list[PeerRow], _LISTING]


class _TopTable(msgspec.Struct, frozen=True, gc=False):
    columns: tuple[str, ...]
    rows: Annotated[list[TopRow], _LISTING]
    others: Annotated[list[PeerRow], Meta(max_length=0)]


_TABLES: Final[dict[str, tuple[tuple[str, ...], Any]]] = {
    "ps": (PsRow.__struct_fields__, msgspec.msgpack.Decoder(_PsTable).decode),
    "top": (TopRow.__struct_fields__, msgspec.msgpack.Decoder(_TopTable).decode),
}


def pack(
    t: str, rows: list[PsRow] | list[TopRow], others: Sequence[PeerRow] = (), table: bool = True
) -> Packed:
    """The listing of request ``t`` (``ps``, ``top``) packed, checked as profctl's side would
    read it: a row beyond its definition is a bug here (``ProtocolError``), never a reply
    nobody can read. ``table``: in the table form; else as the list of maps a profctl from
    before the table form reads (the same rows, checked the same way)."""
    columns, check = _TABLES[t]
    data = _ENCODE({"columns": columns, "rows": rows, "others": others})
    try:
        check(data)
    except msgspec.ValidationError as exc:
        raise _refusal(t, exc, columns, len(rows)) from None
    if table:
        return Packed(data)
    return Packed(_ENCODE([*map(asdict, rows), *map(asdict, others)]))


_CHECK_HELLO: Final = msgspec.msgpack.Decoder(PsHello).decode
_CHECK_LIVE: Final = msgspec.msgpack.Decoder(list[_PsLive]).decode
_CHECK_OTHERS: Final = msgspec.msgpack.Decoder(list[PeerRow]).decode
_COLUMN: Final = re.compile(r"^\$(?:\[(\d+)\])?\[(\d+)\](.*)`$")


def hello_part(hello: PsHello) -> tuple[Any, ...]:
    """``hello`` as the first columns of a ``ps`` row, checked as profctl's side would read
    it. Made once per client: a field beyond its definition is ``RowFault`` (the field's
    name, why), which the listing names with the row it would have been."""
    try:
        _CHECK_HELLO(_ENCODE(hello))
    except msgspec.ValidationError as exc:
        raise _fault(exc, PS_HELLO) from None
    return astuple(hello)


def pack_ps(
    hellos: Sequence[tuple[Any, ...]],
    lives: list[tuple[Any, ...]],
    others: Sequence[PeerRow] = (),
    table: bool = True,
) -> Packed:
    """The ``ps`` listing from each row's two parts: ``hellos`` (:func:`hello_part`, checked
    when made) and ``lives`` (the :data:`PS_LIVE` columns as of now, checked here, in C, with
    ``others``). The same bytes as :func:`pack` of the same rows, for a third of the check:
    1,024 rows' hello parts are most of their bytes and never change (docs/benchmarks.md)."""
    try:
        _CHECK_LIVE(_ENCODE(lives))
    except msgspec.ValidationError as exc:
        f = _fault(exc, PS_LIVE)
        raise bad(f"ps.data[{f.row}].{f.field}", f.why) from None
    if others:
        try:
            _CHECK_OTHERS(_ENCODE(others))
        except msgspec.ValidationError as exc:
            why, _, path = str(exc).partition(" - at `$[")
            i, _, rest = path.partition("]")
            raise bad(f"ps.data[{len(lives) + int(i)}]{rest.rstrip('`')}", why) from None
    rows = list(map(add, hellos, lives))
    columns = PsRow.__struct_fields__
    if table:
        return Packed(_ENCODE({"columns": columns, "rows": rows, "others": others}))
    maps = [dict(zip(columns, r, strict=True)) for r in rows]
    return Packed(_ENCODE([*maps, *map(asdict, others)]))


class RowFault(Exception):
    """A row's field beyond its definition: which row (of the parts checked together), which
    field (and any path inside it), why."""

    def __init__(self, row: int, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.row, self.field, self.why = row, field, why


def _fault(exc: msgspec.ValidationError, columns: tuple[str, ...]) -> RowFault:
    why, sep, path = str(exc).partition(" - at `")
    m = _COLUMN.match(path) if sep else None
    if m is None:
        return RowFault(0, "", why)
    row, column, rest = m.groups()
    return RowFault(int(row or 0), columns[int(column)] + rest, why)


#: Where msgspec found a table's fault: ``$.rows[5][1]`` (row 5, its second column) or
#: ``$.others[0].pid``, then any path inside that value.
_AT = re.compile(r"\$\.(rows|others)\[(\d+)\](?:\[(\d+)\])?(.*)`$")


def _refusal(
    t: str, exc: msgspec.ValidationError, columns: tuple[str, ...], n_rows: int
) -> ProtocolError:
    """The fault named as in the listing the rows make (``ps.data[5].pid``: the rows, then
    the others), not by the table's positions."""
    why, sep, path = str(exc).partition(" - at `")
    m = _AT.match(path) if sep else None
    if m is None:
        return refusal(f"{t}.data", exc)
    part, i, column, rest = m.groups()
    if part == "rows":
        where = f"{t}.data[{i}]" + (f".{columns[int(column)]}" if column is not None else "")
    else:
        where = f"{t}.data[{n_rows + int(i)}]" + (f"[{column}]" if column is not None else "")
    return bad(where + rest, why)
