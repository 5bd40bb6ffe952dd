"""The control protocol's schemas: profctl's requests and the daemon's replies.

The daemon side of ``control.sock`` (and its TCP twin) and profctl read and write these; a
training process never does, so they live here, outside ``profd_client``, which a training
job imports. Built from the same schema library and vocabulary as the agent messages
(``profd_client.protocol``), and framed by the same envelope.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

import msgpack

from profd.states import STATES as SESSION_STATES
from profd_client.protocol.envelope import (
    ERROR,
    MAX_FRAME_BYTES,
    VERSION,
    encode_with,
)
from profd_client.protocol.envelope import bad as _bad
from profd_client.protocol.schema import (
    MAX_CLUSTER_NODES,
    MAX_CYCLE_STEPS,
    MAX_CYCLES,
    MAX_NAME,
    MAX_PATTERNS,
    MAX_PIDS,
    MAX_RANK,
    MAX_STEP,
    MAX_TEXT,
    AnyValue,
    Bool,
    Cycles,
    Field,
    Int,
    ListOf,
    Nullable,
    Num,
    OneOf,
    Str,
    Struct,
    _kind,
)
from profd_client.protocol.vocabulary import (
    BACKENDS,
    ERROR_SCHEMA,
    FLIGHT,
    HOST,
    NAME,
    OPTIONS,
    PATH,
    PID,
    RANK,
    REVISION,
    SECONDS,
    SESSION_ID,
    SHORT,
    STACK_FRAME,
    STEP,
    TEXT,
)

# Control requests (profctl -> daemon, on control.sock), answered with ``ok`` or ``error``.
C_STATUS: Final = "status"
C_PS: Final = "ps"
C_START: Final = "start"
C_STOP: Final = "stop"
C_CANCEL: Final = "cancel"
C_SESSIONS: Final = "sessions"
C_SHOW: Final = "show"
C_TRACES: Final = "traces"
C_RETRY: Final = "retry"
C_TOP: Final = "top"  # every rank's recent step times (the step ledger)
C_HISTORY: Final = "history"  # a job's per-minute step times, from the index
C_INCIDENTS: Final = "incidents"  # what the detectors noticed, from the index
C_INCIDENT: Final = "incident"  # one incident, with its capture's state
C_STACKS: Final = "stacks"  # every thread's stack of every attached rank, grouped
C_BLACKBOX: Final = "blackbox"  # a job's ranks' black boxes (their last steps)
C_WAREHOUSE: Final = "warehouse"  # the export's url and its rows not written yet
OK: Final = "ok"

#: ``--steps``: "A:B" or "1,2,5" (profctl, rule tables) or one step.
STEPS_TEXT: Final = OneOf((Str(16 << 10, min_len=1), Int(1, MAX_STEP)))

START_SPEC: Final = Struct(
    {
        "job": (Nullable(NAME), False),
        "roles": (
            Nullable(OneOf((Str(MAX_NAME, 1), ListOf(Str(MAX_NAME, 1), MAX_PATTERNS)))),
            False,
        ),
        "ranks": (Nullable(OneOf((Str(MAX_TEXT, 1), Int(0, MAX_RANK)))), False),
        "host": (Nullable(HOST), False),
        "pids": (Nullable(ListOf(PID, MAX_PIDS)), False),
        "steps": (Nullable(STEPS_TEXT), False),
        "next": (Nullable(Bool()), False),
        "at_step": (Nullable(OneOf((Int(1, MAX_STEP), Str(32, 1)))), False),
        "active": (Nullable(Int(1, MAX_CYCLE_STEPS)), False),
        "warmup": (Nullable(Int(0, MAX_CYCLE_STEPS)), False),
        "repeat": (Nullable(Int(1, MAX_CYCLES)), False),
        "roundup": (Nullable(Int(1, MAX_STEP)), False),
        "options": (Nullable(OPTIONS), False),
        "region": (Nullable(Str(MAX_NAME, 1)), False),
        "label": (Nullable(Str(MAX_NAME)), False),
        "backend": (Nullable(Str(16, choices=BACKENDS)), False),
        # From a cluster coordinator (profctl --cluster start): ``probe`` asks only for the
        # matching targets and their steps; ``session`` and ``cycles`` are the id and the
        # absolute steps it resolved once for every node.
        "probe": (Nullable(Bool()), False),
        "session": (Nullable(SESSION_ID), False),
        "cycles": (Nullable(Cycles()), False),
        # How many nodes it started the session on: each node's manifest carries it, so a
        # reader of S3 knows when every node's is there.
        "nodes": (Nullable(Int(1, MAX_CLUSTER_NODES)), False),
    }
)
#: Keys only a cluster coordinator sends (never in an ``[[auto]]`` rule).
COORDINATOR_KEYS: Final = frozenset({"probe", "session", "cycles", "nodes"})
#: The keys a start spec may hold (profctl start, ``[[auto]]`` rules, the cluster planner).
START_KEYS: Final = frozenset(START_SPEC.fields)


def start_spec(value: object, where: str = "spec") -> dict[str, Any]:
    """A validated copy of a start spec; raises :class:`ProtocolError` naming the field."""
    if not isinstance(value, dict):
        raise _bad(where, f"must be a map, got {_kind(value)}")
    out: dict[str, Any] = START_SPEC.check(dict(value), where)
    return out


TRACE_FILTERS: Final = Struct(
    {
        "job": (Nullable(Str(MAX_TEXT)), False),
        "session": (Nullable(Str(MAX_NAME)), False),
        "rank": (Nullable(RANK), False),
        "role": (Nullable(Str(MAX_TEXT)), False),
        "host": (Nullable(Str(MAX_TEXT)), False),
        "state": (Nullable(SHORT), False),
        "since": (Nullable(SECONDS), False),
        "until": (Nullable(SECONDS), False),
        "limit": (Nullable(Int(1, 1_000_000)), False),
    }
)


#: ``form`` of a ``ps`` or ``top`` request: ``table`` asks for the rows as column names and
#: one array of values per row (``profd.control_rows``), a third of the bytes of maps and
#: unpacked in a third of the time. A daemon from before ignores the field (requests are open
#: maps) and answers with maps: :func:`listing_rows` reads both.
FORM_TABLE: Final = "table"
FORM: Final = Str(16, choices=frozenset(("rows", FORM_TABLE)))


def listing_rows(data: Any) -> list[dict[str, Any]]:
    """A listing reply's rows as maps, whether it came as a table or (from a daemon before the
    table form) as a list of maps. A table that is not one is refused (``ProtocolError``)."""
    if not isinstance(data, dict):
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise _bad("data", "a listing must be a table or a list of maps")
        return data
    columns, rows, others = data.get("columns"), data.get("rows"), data.get("others", [])
    if not (
        isinstance(columns, list)
        and all(isinstance(c, str) for c in columns)
        and isinstance(rows, list)
        and all(isinstance(r, list) and len(r) == len(columns) for r in rows)
        and isinstance(others, list)
        and all(isinstance(r, dict) for r in others)
    ):
        raise _bad(
            "data",
            "a table needs columns (names), rows (each one value a column) and others (maps)",
        )
    return [dict(zip(columns, r, strict=True)) for r in rows] + others


def _msg(**fields: tuple[Field, bool]) -> Struct:
    # Top-level messages are open: a newer peer may add fields an older one ignores.
    return Struct(fields, open=True)


_R, _O = True, False  # required, optional

SCHEMAS: Final[dict[str, Struct]] = {
    ERROR: ERROR_SCHEMA,
    OK: _msg(data=(AnyValue(), _O)),
    C_STATUS: _msg(),
    C_PS: _msg(
        job=(Nullable(Str(MAX_TEXT)), _O),
        role=(Nullable(Str(MAX_TEXT)), _O),
        form=(Nullable(FORM), _O),
    ),
    C_START: _msg(spec=(START_SPEC, _R)),
    C_STOP: _msg(session=(SESSION_ID, _R)),
    C_CANCEL: _msg(session=(SESSION_ID, _R)),
    C_SESSIONS: _msg(
        state=(Nullable(Str(16, choices=SESSION_STATES)), _O),
        job=(Nullable(Str(MAX_TEXT)), _O),
        limit=(Nullable(Int(1, 100_000)), _O),
    ),
    C_SHOW: _msg(session=(SESSION_ID, _R)),
    C_TRACES: _msg(filters=(TRACE_FILTERS, _R)),
    C_RETRY: _msg(session=(Nullable(SESSION_ID), _O)),
    C_TOP: _msg(
        job=(Nullable(Str(MAX_TEXT)), _O),
        role=(Nullable(Str(MAX_TEXT)), _O),
        form=(Nullable(FORM), _O),
    ),
    C_HISTORY: _msg(
        job=(Str(MAX_TEXT, 1), _R),
        since=(Nullable(SECONDS), _O),  # unix seconds; default: an hour ago
        until=(Nullable(SECONDS), _O),
    ),
    C_INCIDENTS: _msg(
        job=(Nullable(Str(MAX_TEXT)), _O),
        kind=(Nullable(Str(MAX_NAME)), _O),
        since=(Nullable(SECONDS), _O),  # unix seconds: detected then or later
        limit=(Nullable(Int(1, 100_000)), _O),
    ),
    C_INCIDENT: _msg(id=(Str(MAX_NAME, 1), _R)),  # the id or any unique part of it
    C_STACKS: _msg(
        job=(Nullable(Str(MAX_TEXT)), _O), rank=(Nullable(RANK), _O), native=(Bool(), _O)
    ),
    C_BLACKBOX: _msg(
        job=(Str(MAX_TEXT, 1), _R),
        ranks=(Nullable(ListOf(RANK, 1 << 16)), _O),  # only these (default: every rank)
    ),
    C_WAREHOUSE: _msg(),
}

CONTROL_INBOUND: Final[Mapping[str, Struct]] = MappingProxyType(
    {t: s for t, s in SCHEMAS.items() if t not in (OK, ERROR)}
)
#: What profctl accepts in answer.
REPLY_INBOUND: Final[Mapping[str, Struct]] = MappingProxyType({t: SCHEMAS[t] for t in (OK, ERROR)})

# --- reply data ---------------------------------------------------------------------------------
# The ``data`` of the ``ok`` reply to each control request, checked by the daemon before it
# sends (``reply``). Rows are open maps, like top-level messages: a newer daemon may add
# columns an older profctl ignores. Bounds are what the daemon guarantees: fields it took
# from validated messages keep those messages' bounds; what it reads from the system (clock,
# disk, psutil) or keeps for users (error text, stored requests) is bounded only by what
# profctl unpacks (a string of at most ``MAX_FRAME_BYTES``). ``docs/protocol.md`` lists them.

#: Any integer a frame can carry: an incompatible peer's own claims, SQLite integers.
WIRE_INT: Final = Int(-(1 << 63), (1 << 64) - 1)
COUNT: Final = Int(0, (1 << 63) - 1)
BYTES: Final = COUNT
#: A finite number: durations measured from clocks that may step.
FINITE: Final = Num(-math.inf, math.inf)
WHEN: Final = SECONDS  # unix time
LONG_TEXT: Final = Str(MAX_FRAME_BYTES)
#: The daemon's node name (``[daemon] node_name``), stamped on rows as ``node``.
NODE: Final = Str(MAX_TEXT, min_len=1)
UID: Final = Int(-1, (1 << 32) - 1)  # -1: not known (a report stored by an older daemon)
#: A map whose keys and values are the reader's business (a stored start spec, statistics).
MAP: Final = Struct({}, open=True)
_ANY_DATA: Final = AnyValue()


def _row(**fields: tuple[Field, bool]) -> Struct:
    return Struct(fields, open=True)


_SESSION_FIELDS: Final[dict[str, tuple[Field, bool]]] = {
    "id": (Str(MAX_NAME, 1), _R),
    "job": (Str(MAX_NAME, 1), _R),
    "state": (SHORT, _R),
    "backend": (SHORT, _R),
    "label": (Nullable(Str(MAX_NAME)), _R),
    "region": (Nullable(Str(MAX_NAME)), _R),
    "request": (MAP, _R),  # the start spec as given
    "cycles": (ListOf(ListOf(STEP, 3, 3), MAX_CYCLES), _R),
    # The revision of ``cycles`` (see "Revisions" in docs/protocol.md).
    "plan": (REVISION, _R),
    "owner": (Nullable(UID), _R),
    "error": (Nullable(LONG_TEXT), _R),
    "created_at": (WHEN, _R),
    "updated_at": (WHEN, _R),
    "node": (NODE, _R),
}
#: One session in ``sessions``.
SESSION_ROW: Final = Struct(_SESSION_FIELDS, open=True)

#: One process of a session in ``show``.
TARGET_ROW: Final = _row(
    session=(Str(MAX_NAME, 1), _R),
    host=(HOST, _R),
    pid=(PID, _R),
    job=(Str(MAX_NAME, 1), _R),
    role=(Str(MAX_NAME, 1), _R),
    rank=(RANK, _R),
    world_size=(Int(0, MAX_RANK + 1), _R),
    state=(SHORT, _R),
    error=(Nullable(LONG_TEXT), _R),
    traces=(COUNT, _R),
    final=(Nullable(SHORT), _R),  # the client's own last word (done, stopped, ...)
    results=(ListOf(MAP, 1 << 22), _R),  # per cycle, as session.json lists them
    updated_at=(WHEN, _R),
    node=(NODE, _R),
    # The name its files share: ``{role}-r{rank}``, ``-p{pid}`` added when claimed twice.
    stem=(Str(MAX_FRAME_BYTES, 1), _O),
)

#: ``show``: one session with its resolved steps and its targets.
SESSION_DOC: Final = Struct(
    {
        **_SESSION_FIELDS,
        "steps": (ListOf(STEP, MAX_CYCLES * MAX_CYCLE_STEPS), _R),
        "targets": (ListOf(TARGET_ROW, 1 << 22), _R),
        # What the session says beside its state ("2 processes claim main rank 0 ...").
        "notes": (ListOf(LONG_TEXT, 1 << 22), _O),
    },
    open=True,
)

#: One file of a trace in ``traces``.
FILE_ROW: Final = _row(
    kind=(SHORT, _R),
    path=(PATH, _R),
    bytes=(BYTES, _R),
    upload_state=(SHORT, _R),
    s3_uri=(Nullable(LONG_TEXT), _R),
    last_error=(Nullable(LONG_TEXT), _R),
    deleted=(Int(0, 1), _R),
)

#: One capture in ``traces``.
TRACE_ROW: Final = _row(
    id=(COUNT, _R),
    session=(Str(MAX_NAME, 1), _R),
    job=(Str(MAX_NAME, 1), _R),
    host=(HOST, _R),
    pid=(PID, _R),
    role=(Str(MAX_NAME, 1), _R),
    rank=(RANK, _R),
    cycle=(Int(0, 1 << 31), _R),
    region=(Nullable(Str(MAX_NAME)), _R),
    steps=(ListOf(STEP, MAX_CYCLE_STEPS), _R),
    path=(PATH, _R),
    bytes=(BYTES, _R),
    state=(SHORT, _R),
    stall_ms=(Nullable(FINITE), _R),
    step_ms_p50=(Nullable(FINITE), _R),
    step_ms_max=(Nullable(FINITE), _R),
    torch=(Nullable(SHORT), _R),
    device=(Nullable(SHORT), _R),
    created_at=(WHEN, _R),
    stats=(Nullable(MAP), _R),  # the pipeline's per-rank statistics
    files=(ListOf(FILE_ROW, 1 << 16), _R),
    upload_state=(SHORT, _R),  # the files' combined
    s3_uri=(Nullable(LONG_TEXT), _R),  # the trace file's
    node=(NODE, _R),
)

_COUNTS: Final = Struct({}, open=True)  # name -> count maps (sessions by state)

#: ``status``: the daemon itself. ``pipeline``, ``storage`` and ``s3`` are its parts' own
#: reports (maps); ``tcp`` is null unless ``[cluster] listen`` is set.
STATUS_DOC: Final = _row(
    version=(SHORT, _R),
    protocol=(ListOf(Int(0, 1 << 16), 2, 2), _R),
    pid=(PID, _R),
    host=(NODE, _R),
    boot_id=(Nullable(SHORT), _R),
    uptime_s=(FINITE, _R),
    runtime_dir=(PATH, _R),
    state_dir=(PATH, _R),
    spool_dir=(PATH, _R),
    clients=(COUNT, _R),
    incompatible_clients=(COUNT, _R),
    sessions=(_row(live=(COUNT, _R), by_state=(_COUNTS, _R)), _R),
    spool=(
        _row(
            bytes=(BYTES, _R),
            bytes_not_uploaded=(BYTES, _R),
            max_bytes=(Nullable(BYTES), _R),
        ),
        _R,
    ),
    queue=(
        _row(
            queued=(COUNT, _R),
            failed=(COUNT, _R),
            bytes_pending=(BYTES, _R),
            uploaded=(COUNT, _R),
        ),
        _R,
    ),
    tcp=(Nullable(_row(listen=(LONG_TEXT, _R), refused=(COUNT, _R))), _R),
    # ``[metrics] listen`` as bound (``host:port``, the kernel's port for port 0), or None.
    metrics=(Nullable(_row(listen=(LONG_TEXT, _R))), _O),
    pipeline=(MAP, _R),
    storage=(MAP, _R),
    s3=(_row(configured=(Bool(), _R)), _R),
    rejected_messages=(COUNT, _R),
    # What the peer limits ([daemon] max_regions_per_rank, max_heartbeat_rate,
    # max_peers_per_process, max_peers_per_user) turned away since the daemon started.
    limits=(
        _row(
            regions_folded=(COUNT, _R),
            heartbeats_coalesced=(COUNT, _R),
            peers_refused=(COUNT, _R),
        ),
        _O,
    ),
    # The clients' heartbeat interval now (paced past ``[daemon] max_heartbeats_per_s``),
    # the configured one, and that rate.
    heartbeat=(
        _row(interval_s=(FINITE, _R), base_s=(FINITE, _R), max_per_s=(FINITE, _R)),
        _O,
    ),
    # ``implausible_steps``: step jumps a rank's rate cannot explain, left out of samples.
    watch=(_row(implausible_steps=(COUNT, _R)), _O),
    # The garbage collector's pauses by generation (profd/daemon/runtime/gcpauses.py).
    gc=(MAP, _O),
)

#: One role of a job in one minute, in ``history``: ``ranks`` ranks that stepped, ``steps``
#: steps in all; ``p50_ms``/``p90_ms`` the median over ranks of each rank's own p50/p90,
#: ``max_ms`` the longest step; ``slowest``: the ranks with the highest p50 (at most 3).
HISTORY_ROW: Final = _row(
    minute=(WHEN, _R),
    role=(Str(MAX_NAME, 1), _R),
    ranks=(COUNT, _R),
    steps=(COUNT, _R),
    p50_ms=(Nullable(FINITE), _R),
    p90_ms=(Nullable(FINITE), _R),
    max_ms=(Nullable(FINITE), _R),
    slowest=(ListOf(MAP, 16), _R),
)
HISTORY_DOC: Final = _row(
    job=(Str(MAX_TEXT, 1), _R),
    since=(WHEN, _R),
    until=(WHEN, _R),
    node=(NODE, _R),
    minutes=(ListOf(HISTORY_ROW, 1 << 22), _R),
)

#: A rank an incident names.
SUSPECT: Final = _row(host=(HOST, _R), role=(Str(MAX_NAME, 1), _R), rank=(RANK, _R))

#: One incident (docs/design.md "Watch"): ``kind`` one of regression, slow_rank, straggler, hang;
#: ``host`` the node that detected it; ``step`` the job's step then; ``evidence`` what the
#: detector saw (its figures and thresholds); ``session`` the automatic capture, if armed;
#: ``state`` open or resolved; ``comparison`` what differs, once the capture is processed.
INCIDENT_ROW: Final = _row(
    id=(Str(MAX_NAME, 1), _R),
    kind=(SHORT, _R),
    job=(Str(MAX_NAME, 1), _R),
    role=(Nullable(Str(MAX_NAME)), _R),
    host=(NODE, _R),
    suspects=(ListOf(SUSPECT, MAX_PIDS), _R),
    detected_at=(WHEN, _R),
    step=(Nullable(STEP), _R),
    evidence=(MAP, _R),
    session=(Nullable(Str(MAX_NAME)), _R),
    state=(SHORT, _R),
    resolved_at=(Nullable(WHEN), _R),
    comparison=(Nullable(MAP), _R),
    notes=(ListOf(LONG_TEXT, 1 << 16), _R),
    node=(NODE, _R),
    # The uid owning the job (its first process here); null: not known (an older record).
    # Whoever else asks gets a hang's stacks withheld from ``evidence``.
    owner=(Nullable(UID), _O),
)
#: ``incident``: one incident and ``session_state``, its capture's state (null: none).
INCIDENT_DOC: Final = Struct(
    {**INCIDENT_ROW.fields, "session_state": (Nullable(SHORT), _R)}, open=True
)

#: ``stacks`` (``profd.watch.stackgroups``): per job, every rank's threads and the groups of
#: ranks whose training threads have the same stack (largest first, the majority). A rank
#: whose stacks could not be read has ``source`` null and ``error``.
MAX_FRAMES: Final = 4096
MAX_THREADS: Final = 4096
STACK_FRAMES: Final = ListOf(STACK_FRAME, MAX_FRAMES)
STACK_WHO: Final = _row(host=(HOST, _R), role=(Str(MAX_NAME, 1), _R), rank=(RANK, _R))
STACK_THREAD: Final = _row(
    name=(Str(MAX_TEXT), _R),
    tid=(WIRE_INT, _R),
    training=(Bool(), _R),
    frames=(STACK_FRAMES, _R),
    owns_gil=(Bool(), _O),  # py-spy: the thread held the GIL when read
)
STACK_RANK: Final = _row(
    host=(HOST, _R),
    role=(Str(MAX_NAME, 1), _R),
    rank=(RANK, _R),
    pid=(PID, _R),
    source=(Nullable(Str(16, choices=frozenset({"py-spy", "agent"}))), _R),
    threads=(ListOf(STACK_THREAD, MAX_THREADS), _R),
    error=(TEXT, _O),
    read_ms=(FINITE, _O),  # how long the read took, py-spy's start included
    flight=(FLIGHT, _O),  # its flight recorder's summary, where it is on
    flight_error=(TEXT, _O),  # why there is none although it is on
)
STACK_GROUP: Final = _row(
    ranks=(ListOf(STACK_WHO, 1 << 22), _R), majority=(Bool(), _R), frames=(STACK_FRAMES, _R)
)
STACKS_DOC: Final = _row(
    job=(Str(MAX_TEXT, 1), _R),
    node=(NODE, _O),
    groups=(ListOf(STACK_GROUP, 1 << 22), _R),
    ranks=(ListOf(STACK_RANK, 1 << 22), _R),
)

#: A rank's black box (``profd.blackbox.box``): its shape is that module's, checked by the
#: client's ``blackbox_result`` it was made from.
BLACKBOX_BOX: Final = _row(
    job=(Str(MAX_TEXT), _R),
    node=(NODE, _R),
    host=(HOST, _R),
    role=(Str(MAX_NAME, 1), _R),
    rank=(RANK, _R),
    pid=(PID, _R),
    step0=(WIRE_INT, _R),
    ends=(ListOf(AnyValue(), 1 << 24), _R),
    records=(ListOf(AnyValue(), 1 << 24), _R),
    samples=(ListOf(AnyValue(), 1 << 24), _R),
)
BLACKBOX_MISSING: Final = _row(
    node=(NODE, _R),
    host=(HOST, _R),
    role=(Str(MAX_NAME, 1), _R),
    rank=(RANK, _R),
    pid=(PID, _R),
    why=(TEXT, _R),
)
BLACKBOX_DOC: Final = _row(
    job=(Str(MAX_TEXT, 1), _R),
    node=(NODE, _R),
    boxes=(ListOf(BLACKBOX_BOX, 1 << 16), _R),
    missing=(ListOf(BLACKBOX_MISSING, 1 << 16), _R),
    collect_s=(FINITE, _R),
)
#: ``warehouse``: where the export writes and, per partition not written yet, its rows as
#: columns: a map of each column of the table (profd/warehouse/tables.py) to its values.
WAREHOUSE_OVERLAY: Final = _row(
    table=(Str(MAX_NAME, 1), _R),
    part=(Str(16, 10), _R),
    stem=(Str(MAX_TEXT, 1), _R),
    columns=(AnyValue(), _R),
)
WAREHOUSE_DOC: Final = _row(
    url=(LONG_TEXT, _R),
    node=(NODE, _R),
    instance=(Str(MAX_NAME, 1), _R),
    stem=(Str(MAX_TEXT, 1), _R),
    flush_every=(FINITE, _R),
    overlays=(ListOf(WAREHOUSE_OVERLAY, 100_000), _R),
)

#: The ``ok`` reply's ``data`` for each control request; others (``start``, ``stop``,
#: ``cancel``, ``retry``: small maps) are not described here.
REPLIES: Final[dict[str, Field]] = {
    C_STATUS: STATUS_DOC,
    # C_PS, C_TOP: their rows are typed (profd.control_rows) and come packed.
    C_SESSIONS: ListOf(SESSION_ROW, 100_000),
    C_SHOW: SESSION_DOC,
    C_TRACES: ListOf(TRACE_ROW, 1_000_000),
    C_HISTORY: HISTORY_DOC,
    C_INCIDENTS: ListOf(INCIDENT_ROW, 100_000),
    C_INCIDENT: INCIDENT_DOC,
    C_STACKS: ListOf(STACKS_DOC, 1 << 16),
    C_BLACKBOX: BLACKBOX_DOC,
    C_WAREHOUSE: WAREHOUSE_DOC,
}


def encode(t: str, *, v: int = VERSION, **fields: Any) -> bytes:
    """Pack one control message of type ``t`` (a request, or ``ok``/``error``), validated:
    a message this side would refuse to receive is a bug here (``ProtocolError``)."""
    return encode_with(SCHEMAS, t, v, fields)


class Packed(bytes):
    """A reply's ``data`` packed already, and checked against its type by whoever packed it
    (typed rows, ``profd.control_rows``): :func:`reply` frames it as it is."""


def reply(request: Mapping[str, Any], data: object) -> bytes:
    """The ``ok`` answer to a validated control request, in the request's version. ``data``
    is checked against the request type's reply schema (:data:`REPLIES`) like any message
    this side sends: a reply that breaks it is a bug here (``ProtocolError``)."""
    if isinstance(data, Packed):
        # The same bytes as packing the map with ``data`` unpacked: its last value, nil (one
        # byte), replaced by ``data``.
        head: bytes = msgpack.packb({"v": request["v"], "t": OK, "data": None})
        return head[:-1] + data
    t = request["t"]
    REPLIES.get(t, _ANY_DATA).check(data, f"{t}.data")
    return encode(OK, v=request["v"], data=data)
