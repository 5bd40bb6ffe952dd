"""``ps`` and ``top`` rows, one typed definition each, built on the daemon's loop and packed
in one C call.

``ps`` lists every attached process at once (1,024 rows at 1,024 clients), and ``top`` every
rank, on the loop that also reads every heartbeat. As dicts their rows were built field by
field, checked by the hand-written schema field by field and packed: ~5 ms for ``ps``, with
~3,000 new objects for the collector each time (its full passes, ~20 ms each, were the round
trip's p99). A :class:`PsRow` is a msgspec ``Struct`` the collector does not track
(``gc=False``): the hello's part of a client's row is made once and copied with the live
fields set (:meth:`profd.daemon.clients.registry.Client.ps_row`), and :func:`pack` encodes the
listing and checks it against this same definition, as a receiver would, in C. A
:class:`TopRow` is made the same way, whole, once its rank's ratio to its role is known.

A field the row does not have (an ``incompatible`` peer's, which lists only what it claimed)
is ``UNSET`` and left out of the map on the wire, as before: readers see the same rows as
from a daemon that built dicts. profctl reads them as plain maps and never loads this module
(msgspec is a fifth of its start-up).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Final

import msgspec
from msgspec import UNSET, Meta, UnsetType

from profd.control_schema import Packed
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


class PsRow(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One process in ``ps``. A peer of a protocol version the daemon does not serve is
    listed with state ``incompatible``, an ``error`` and only what it claimed; every other
    field is a served client's."""

    host: Annotated[str, Meta(min_length=1, max_length=MAX_HOST)]
    pid: _WireInt | None
    job: _Name
    role: _Name
    rank: _WireInt | None
    local_rank: Annotated[int, Meta(ge=0, le=MAX_RANK)] | UnsetType = UNSET
    world_size: Annotated[int, Meta(ge=1, le=MAX_RANK + 1)] | UnsetType = UNSET
    step: Annotated[int, Meta(ge=0, le=MAX_STEP)] | UnsetType = UNSET
    steps_per_s: _Rate | UnsetType = UNSET
    state: _Short
    step_mode: Annotated[str, Meta(max_length=16)] | UnsetType = UNSET
    allowed: bool | UnsetType = UNSET
    cpu_percent: _Rate | UnsetType | None = UNSET
    rss_bytes: _Count | UnsetType | None = UNSET
    gpu_util: _Rate | UnsetType | None = UNSET
    gpu_mem_bytes: _Count | UnsetType | None = UNSET
    torch: _Short | UnsetType | None = UNSET
    device: _Short | UnsetType | None = UNSET
    nsys_session: Annotated[str, Meta(max_length=MAX_NAME)] | UnsetType | None = UNSET
    attached_at: Annotated[float, Meta(ge=0.0, le=1e12)] | UnsetType = UNSET
    protocol: Annotated[int, Meta(ge=-(1 << 31), le=1 << 31)] | None
    client_version: _Short | UnsetType | None = UNSET
    uid: Annotated[int, Meta(ge=-1, le=(1 << 32) - 1)] | UnsetType = UNSET
    # Where each identity field came from (the hello's, as it checked them).
    identity_source: Annotated[dict[str, Any], Meta(max_length=64)] | UnsetType = UNSET
    # Another served process claims the same job, role and rank: every pid that claims it.
    duplicate: bool | UnsetType = UNSET
    claimed_by: Annotated[tuple[_Pid, ...], Meta(max_length=1 << 22)] | UnsetType = UNSET
    # ``step`` as of now: moved on from the last heartbeat's at the rank's rate (as in
    # ``top``); ``age_s``: seconds since the heartbeat that carried the step.
    step_extrapolated: bool | UnsetType = UNSET
    age_s: Annotated[float, Meta(ge=-_BIG, le=_BIG)] | UnsetType = UNSET
    error: Annotated[str, Meta(max_length=MAX_TEXT)] | UnsetType = UNSET
    # Which daemon listed it (``profctl --cluster``): a row's ``host`` is what the client
    # called its machine, which does not tell nodes apart.
    node: Annotated[str, Meta(min_length=1, max_length=MAX_TEXT)]


_Finite = Annotated[float, Meta(ge=-_BIG, le=_BIG)]


class TopRow(msgspec.Struct, frozen=True, gc=False, kw_only=True):
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
    node: Annotated[str, Meta(min_length=1, max_length=MAX_TEXT)]


_ENCODE: Final = msgspec.msgpack.Encoder().encode
_LISTING: Final = Meta(max_length=1 << 22)
_CHECKS: Final[dict[str, Any]] = {
    "ps": msgspec.msgpack.Decoder(Annotated[list[PsRow], _LISTING]).decode,
    "top": msgspec.msgpack.Decoder(Annotated[list[TopRow], _LISTING]).decode,
}


def pack(t: str, rows: list[PsRow] | list[TopRow]) -> Packed:
    """The listing of request ``t`` (``ps``, ``top``) packed, checked as profctl's side would
    read it: a row beyond its definition is a bug here (``ProtocolError``), never a reply
    nobody can read."""
    data = _ENCODE(rows)
    try:
        _CHECKS[t](data)
    except msgspec.ValidationError as exc:
        raise refusal(f"{t}.data", exc) from None
    return Packed(data)
