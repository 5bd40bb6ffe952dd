"""The agent messages: what a training process and its node's daemon say on ``agent.sock``.

Client to daemon: ``hello``, ``hb``, ``armed``, ``progress``, ``captured``, ``bye``,
``stacks_result``, ``blackbox_result``; daemon to client: ``welcome``, ``hb``, ``arm``,
``disarm``, ``ack``, ``error``, ``dump_stacks``, ``blackbox``. One definition per type, in
:data:`SCHEMAS`, checks a message both when it is sent and when it is received.
:func:`encode` writes a message in the current version's shape and lets :mod:`.adapter` turn
it into the peer's version.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from . import adapter
from .envelope import MAX_ERROR_TEXT, MAX_FRAME_BYTES, VERSION, Inbound, encode_with
from .schema import (
    MAX_CYCLE_STEPS,
    MAX_CYCLES,
    MAX_FILES,
    MAX_HOST,
    MAX_ID,
    MAX_NAME,
    MAX_PATH,
    MAX_PID,
    MAX_RANK,
    MAX_RATE,
    MAX_REVISION,
    MAX_SECONDS,
    MAX_STEP,
    MAX_TEXT,
    Cycles,
    Field,
    ListOf,
    Struct,
)
from .typed import Message, Typed, Version
from .vocabulary import (
    ACK,
    AGENT_MAX_FRAMES,
    AGENT_MAX_THREADS,
    AGENT_STACK_THREAD,
    ARM,
    ARMED,
    BLACKBOX_REQUEST,
    BLACKBOX_RESULT,
    BYE,
    CAPTURED,
    DISARM,
    ERROR,
    FLIGHT,
    HEARTBEAT,
    HELLO,
    IDENTITY_SOURCE,
    PROGRESS,
    STACKS_REQUEST,
    STACKS_RESULT,
    WELCOME,
    ReportState,
)

# --- the step ledger (protocol 3) ----------------------------------------------------------------
#: Upper bounds (seconds) of the step-time histogram buckets a client counts its steps into,
#: the same as ``profd_step_duration_seconds``' buckets: 1 ms to 10 min. A ledger's ``b``
#: holds one count per bound plus one for the steps above the last (Prometheus' ``+Inf``).
STEP_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
#: Regions a ledger names at most; a process with more sends the ones with most time.
MAX_LEDGER_REGIONS: Final = 32
#: The client's ring of step-end times: the steps a ledger's statistics are computed over
#: when more than this many steps ended between two heartbeats (``n`` counts them all).
LEDGER_RING: Final = 4096


# --- typed messages (msgspec): decoded and validated from msgpack in one pass -------------------
# Same bounds as the field types above; ``bench/bench_protocol.py`` measured each against its
# hand-written schema (docs/benchmarks.md, "Typed messages").
_Step = Annotated[int, Meta(ge=0, le=MAX_STEP)]
_Seconds = Annotated[float, Meta(ge=0.0, le=MAX_SECONDS)]
#: The name rule (``schema._SAFE_NAME``), anchored: msgspec searches.
_NAME_RE: Final = r"^[A-Za-z0-9_+=@:-][A-Za-z0-9._+=@:-]*$"
_BUCKETS: Final = len(STEP_BUCKETS) + 1
_Region = tuple[
    Annotated[str, Meta(min_length=1, max_length=MAX_NAME)],
    _Seconds,
    _Step,
]


class Ledger(msgspec.Struct, forbid_unknown_fields=False):
    """``hb``'s ``ledger``: the steps that ended since the previous heartbeat. ``n`` steps, the
    last of them step ``at``, taking ``sum`` seconds in all; ``q`` = [p50, p90, p99, max]
    seconds and ``b`` the histogram counts (see :data:`STEP_BUCKETS`) over those steps, or over
    the last :data:`LEDGER_RING` of them when more ended; ``r``: ``[[name, seconds, entries],
    ...]``, time spent inside each ``region(name)``. ``epoch`` changes when the process set its
    step count (``step(n)``): steps across that jump are not timed. ``wait``: ``[seconds,
    steps]``, the time this rank's collectives took as its flight recorder timed them, and
    the steps that ended meanwhile (since the last ``wait``: it may cover the steps of
    several heartbeats); absent where torch records no timings (``waits``)."""

    at: _Step
    n: _Step
    sum: _Seconds
    q: Annotated[list[_Seconds], Meta(min_length=4, max_length=4)]
    b: Annotated[list[_Step], Meta(min_length=_BUCKETS, max_length=_BUCKETS)]
    r: Annotated[list[_Region], Meta(max_length=MAX_LEDGER_REGIONS)] = msgspec.field(
        default_factory=list
    )
    epoch: Annotated[int, Meta(ge=0, le=1 << 31)] = 0
    # Optional, no version change: a daemon without it ignores it.
    wait: tuple[_Seconds, _Step] | None = None


class Heartbeat(Message, tag=HEARTBEAT):
    """Client -> daemon: alive, at ``step``; daemon -> client: the answer (no fields)."""

    v: Annotated[int, Version]
    step: _Step | UnsetType = UNSET
    sps: Annotated[float, Meta(ge=0.0, le=MAX_RATE)] | UnsetType = UNSET
    state: Annotated[str, Meta(max_length=64)] | UnsetType = UNSET
    # v3: the steps since the last heartbeat; a client sends it only to a daemon that speaks
    # version 3 (``adapter`` drops it for an older one).
    ledger: Ledger | UnsetType = UNSET
    training_tid: Annotated[int, Meta(ge=0, le=MAX_PID)] | UnsetType | None = UNSET  # as in hello


class Options(msgspec.Struct, forbid_unknown_fields=True):
    """An ``arm``'s ``options``: closed, since a misspelt option silently ignored would
    capture something else than asked."""

    activities: (
        Annotated[list[Literal["cpu", "cuda"]], Meta(min_length=1, max_length=2)] | UnsetType
    ) = UNSET
    record_shapes: bool | UnsetType = UNSET
    profile_memory: bool | UnsetType = UNSET
    with_stack: bool | UnsetType = UNSET
    with_flops: bool | UnsetType = UNSET
    with_modules: bool | UnsetType = UNSET
    memory_snapshot: bool | UnsetType = UNSET


_CYCLES: Final = Cycles()


class Arm(Message, tag=ARM):
    """Daemon -> client: capture ``cycles`` (``[warmup_start, start, stop]``, absolute steps)."""

    v: Annotated[int, Version]
    session: Annotated[str, Meta(pattern=_NAME_RE, min_length=1, max_length=MAX_NAME)]
    job: Annotated[str, Meta(pattern=_NAME_RE, max_length=MAX_NAME)]
    backend: Literal["torch", "nsys"]
    cycles: Annotated[
        list[Annotated[list[_Step], Meta(min_length=3, max_length=3)]],
        Meta(min_length=1, max_length=MAX_CYCLES),
    ]
    options: Options
    incoming: Annotated[str, Meta(min_length=1, max_length=MAX_PATH)]
    region: Annotated[str, Meta(min_length=1, max_length=MAX_NAME)] | None = None
    # The revision of ``cycles``: bumped each time the daemon moves a --next session's steps
    # (a rank got the first ones too late); a client replaces a session it holds only with a
    # higher revision. The wire keeps the name ``plan`` (docs/protocol.md).
    plan: Annotated[int, Meta(ge=0, le=MAX_REVISION)] = 0

    def __post_init__(self) -> None:
        _CYCLES.check(self.cycles, "arm.cycles")  # ordered, each span bounded


def _msg(open_: bool = True, **fields: tuple[Field, bool]) -> Struct:
    # Top-level messages are open: a newer peer may add fields an older one ignores.
    return Struct(fields, open=open_)


_R, _O = True, False  # required, optional

_AGENT_THREADS: Final = ListOf(AGENT_STACK_THREAD, AGENT_MAX_THREADS)


# --- the other agent messages, typed (see ``Heartbeat`` and ``Arm`` above) ---------------------
# Each bound is its hand-written field type's (``vocabulary``): ``_Name`` is ``NAME``, and so on.
_Name = Annotated[str, Meta(pattern=_NAME_RE, max_length=MAX_NAME)]
_SessionId = Annotated[str, Meta(pattern=_NAME_RE, min_length=1, max_length=MAX_NAME)]
_Short = Annotated[str, Meta(max_length=64)]
_Pid = Annotated[int, Meta(ge=1, le=MAX_PID)]
_Tid = Annotated[int, Meta(ge=0, le=MAX_PID)]
_Rank = Annotated[int, Meta(ge=0, le=MAX_RANK)]
_MsgId = Annotated[int, Meta(ge=0, le=MAX_ID)]
_Revision = Annotated[int, Meta(ge=0, le=MAX_REVISION)]
_Path = Annotated[str, Meta(min_length=1, max_length=MAX_PATH)]
_ErrorText = Annotated[str, Meta(max_length=MAX_ERROR_TEXT)]
_Cycles = Annotated[
    list[Annotated[list[_Step], Meta(min_length=3, max_length=3)]],
    Meta(min_length=1, max_length=MAX_CYCLES),
]


class Hello(Message, tag=HELLO):
    """Client -> daemon, first: who this process is. A ``hello`` from a registered process
    with another job, role, rank or world size re-registers it."""

    v: Annotated[int, Version]
    pid: _Pid
    host: Annotated[str, Meta(min_length=1, max_length=MAX_HOST)]
    job: _Name
    role: _Name
    rank: _Rank
    local_rank: _Rank
    world_size: Annotated[int, Meta(ge=1, le=MAX_RANK + 1)]
    step: _Step
    step_mode: Annotated[str, Meta(max_length=16)]
    allowed: bool
    client_version: _Short
    torch: _Short | None = None
    device: _Short | None = None
    # Sessions this process is still working on (armed), so a restarted daemon knows the
    # target is alive and busy.
    sessions: Annotated[
        list[Annotated[str, Meta(max_length=MAX_NAME)]], Meta(max_length=MAX_CYCLES)
    ] = msgspec.field(default_factory=list)
    # The Nsight Systems session the process runs under (``profctl run --nsys``), if any.
    nsys_session: _Name | None = None
    # attach() is blocked until the welcome (``attach(wait=...)``): step 1 has not begun, so
    # ``[[auto]]`` rules may arm it; their ``arm`` is sent before the ``welcome``.
    waiting: bool = False
    # Where each identity field came from (``profctl ps --sources``): the shape ``ps`` rows
    # carry it in too, so it is checked by that one definition (``IDENTITY_SOURCE``).
    identity_source: Annotated[dict[str, Any], Meta(max_length=64)] = msgspec.field(
        default_factory=dict
    )
    # The native id (``threading.get_native_id()``) of the thread that counts steps, so
    # ``stacks`` marks it; a heartbeat sends it again when the first step shows another
    # thread counts.
    training_tid: _Tid | None = None
    # Its flight recorder is on (``TORCH_FR_BUFFER_SIZE``): ``dump_stacks`` may ask for it.
    flight: bool = False
    # It keeps a black box: ``blackbox`` may ask for it (a client that does not say so is
    # never asked, and is named as having none).
    blackbox: bool = False
    # Its heartbeats need not each be answered: it waits for an answer every ``acks``
    # heartbeat intervals, as the welcome says (a client that does not say so gets one
    # answer per heartbeat, as before).
    quiet: bool = False

    def __post_init__(self) -> None:
        IDENTITY_SOURCE.check(self.identity_source, "hello.identity_source")


# ``plan`` in the reports: the revision of the session's steps they are about (``arm``'s).
class Armed(Message, tag=ARMED):
    """Client -> daemon: armed for ``session``'s ``cycles``."""

    v: Annotated[int, Version]
    session: _SessionId
    cycles: _Cycles
    plan: _Revision = 0

    def __post_init__(self) -> None:
        _CYCLES.check(self.cycles, "armed.cycles")


class Progress(Message, tag=PROGRESS):
    """Client -> daemon: where its part of ``session`` is (acked by ``id``)."""

    v: Annotated[int, Version]
    id: _MsgId
    session: _SessionId
    state: ReportState
    step: _Step
    error: _ErrorText | None = None
    plan: _Revision = 0


class FileEntry(msgspec.Struct, forbid_unknown_fields=False):
    """A file a ``captured`` names: its ``kind`` (trace, memory, ...) and ``path``."""

    kind: Annotated[str, Meta(min_length=1, max_length=32)]
    path: _Path


class Captured(Message, tag=CAPTURED):
    """Client -> daemon: one cycle captured, its files written (acked by ``id``)."""

    v: Annotated[int, Version]
    id: _MsgId
    session: _SessionId
    job: _Name
    cycle: Annotated[int, Meta(ge=0, le=1 << 31)]
    steps: Annotated[list[_Step], Meta(max_length=MAX_CYCLE_STEPS)]
    files: Annotated[list[FileEntry], Meta(max_length=MAX_FILES)]
    started_at: _Seconds
    ended_at: _Seconds
    stall_ms: _Seconds
    error: _ErrorText | None = None
    region: Annotated[str, Meta(max_length=MAX_NAME)] | None = None
    torch: _Short | None = None
    device: _Short | None = None
    notes: Annotated[list[Annotated[str, Meta(max_length=MAX_TEXT)]], Meta(max_length=64)] = (
        msgspec.field(default_factory=list)
    )
    plan: _Revision = 0


class Bye(Message, tag=BYE):
    """Client -> daemon: detaching."""

    v: Annotated[int, Version]


class StacksResult(Message, tag=STACKS_RESULT):
    """Client -> daemon: the answer to ``dump_stacks`` ``id``. ``threads`` and ``flight`` go
    on into control replies as maps, checked by their one definition (``AGENT_STACK_THREAD``,
    ``FLIGHT``)."""

    v: Annotated[int, Version]
    id: _MsgId
    threads: Annotated[list[dict[str, Any]], Meta(max_length=AGENT_MAX_THREADS)]
    flight: dict[str, Any] | UnsetType = UNSET
    flight_error: Annotated[str, Meta(max_length=MAX_TEXT)] | UnsetType = UNSET

    def __post_init__(self) -> None:
        _AGENT_THREADS.check(self.threads, "stacks_result.threads")
        if self.flight is not UNSET:
            FLIGHT.check(self.flight, "stacks_result.flight")


class BlackboxSettings(msgspec.Struct, forbid_unknown_fields=False):
    """``[blackbox]`` as a daemon tells its clients (``welcome``)."""

    enabled: bool = True
    keep_steps: Annotated[int, Meta(ge=1, le=1 << 20)] = 512
    keep_seconds: Annotated[float, Meta(ge=0.0, le=86400.0)] = 120.0
    sample_hz: Annotated[float, Meta(ge=0.0, le=1000.0)] = 10.0


class Welcome(Message, tag=WELCOME):
    """Daemon -> client: registered; heartbeat every ``hb_interval`` seconds; keep a black
    box as ``blackbox`` says (absent: the client's defaults)."""

    v: Annotated[int, Version]
    spool: _Path
    hb_interval: Annotated[float, Meta(ge=0.01, le=3600.0)]
    daemon: _Short
    # v2: the daemon's supported protocol versions, [oldest, newest].
    protocol: (
        Annotated[list[Annotated[int, Meta(ge=0, le=1 << 16)]], Meta(min_length=2, max_length=2)]
        | UnsetType
    ) = UNSET
    blackbox: BlackboxSettings | UnsetType = UNSET
    # To a ``quiet`` hello: heartbeats are answered once every ``acks`` intervals, so the
    # client takes the daemon for silent only after that many times its usual wait.
    acks: Annotated[int, Meta(ge=1, le=60)] | UnsetType = UNSET


class Disarm(Message, tag=DISARM):
    """Daemon -> client: drop ``session`` (``keep``: what it captured so far stays)."""

    v: Annotated[int, Version]
    session: _SessionId
    keep: bool


class Ack(Message, tag=ACK):
    """Daemon -> client: report ``id`` is stored; stop resending it."""

    v: Annotated[int, Version]
    id: _MsgId


class Error(Message, tag=ERROR):
    """Either way: a refusal (``code``: an ``ErrorCode``), and why in one line."""

    v: Annotated[int, Version]
    code: _Short
    msg: _ErrorText


class DumpStacks(Message, tag=STACKS_REQUEST):
    """Daemon -> client: send your threads' stacks (``stacks``) and flight recorder's
    summary (``flight``), answered by a ``stacks_result`` with this ``id``."""

    v: Annotated[int, Version]
    id: _MsgId
    stacks: bool = True
    flight: bool = False


class Blackbox(Message, tag=BLACKBOX_REQUEST):
    """Daemon -> client: send your black box, answered by a ``blackbox_result`` with this
    ``id``."""

    v: Annotated[int, Version]
    id: _MsgId


#: The most collectives, region names, frames and stacks a ``blackbox_result`` carries.
BLACKBOX_MAX_COLLECTIVES: Final = 2048
BLACKBOX_MAX_FRAMES: Final = 4096
BLACKBOX_MAX_STACKS: Final = 2048
_Bin = Annotated[bytes, Meta(max_length=MAX_FRAME_BYTES)]
_Wall = Annotated[float, Meta(ge=0.0)] | None


class Collective(msgspec.Struct, forbid_unknown_fields=False):
    """One flight-recorder entry with its timings (``flight.timed``), wall-clock seconds."""

    pg: Annotated[str, Meta(max_length=MAX_NAME)]
    seq: Annotated[int, Meta(ge=-1, le=MAX_STEP)]
    op: Annotated[str, Meta(max_length=MAX_NAME)]
    state: Annotated[str, Meta(max_length=16)]
    created: _Wall = None
    started: _Wall = None
    completed: _Wall = None
    ms: _Wall = None


class BlackboxResult(Message, tag=BLACKBOX_RESULT):
    """Client -> daemon: the answer to ``blackbox`` ``id``. Arrays are little-endian bytes:
    ``ends`` (float64) the end times of steps ``step0``, ``step0 + 1``, ...; each region
    exit's step (int64), region index into ``regions`` (int16), end time and duration
    (float64); each stack sample's time (float64), step (int64) and index into ``stacks``
    (int32, -1: not recorded), each stack a list of indexes into ``frames``, innermost
    first. Times are the process's ``perf_counter``; ``clock`` added makes them wall-clock
    seconds. At most one frame: a client sends fewer steps rather than a larger one."""

    v: Annotated[int, Version]
    id: _MsgId
    clock: float
    settings: BlackboxSettings
    step0: _Step
    ends: _Bin
    regions: Annotated[list[Annotated[str, Meta(max_length=MAX_NAME)]], Meta(max_length=64)]
    region_steps: _Bin
    region_ids: _Bin
    region_ends: _Bin
    region_seconds: _Bin
    frames: Annotated[
        list[Annotated[str, Meta(max_length=MAX_TEXT)]], Meta(max_length=BLACKBOX_MAX_FRAMES)
    ]
    stacks: Annotated[
        list[Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=AGENT_MAX_FRAMES)]],
        Meta(max_length=BLACKBOX_MAX_STACKS),
    ]
    sample_t: _Bin
    sample_steps: _Bin
    sample_stacks: _Bin
    collectives: Annotated[list[Collective], Meta(max_length=BLACKBOX_MAX_COLLECTIVES)] | None = (
        None
    )
    collectives_error: Annotated[str, Meta(max_length=MAX_TEXT)] | None = None


#: Every agent message type, both directions: one definition each, which checks a message
#: both when it is sent (:func:`encode`) and when it is received (:func:`.envelope.decode`).
TYPES: Final[tuple[type[Message], ...]] = (
    Hello,
    Heartbeat,
    Armed,
    Progress,
    Captured,
    Bye,
    StacksResult,
    Welcome,
    Arm,
    Disarm,
    Ack,
    Error,
    DumpStacks,
    Blackbox,
    BlackboxResult,
)
SCHEMAS: Final[dict[str, Typed]] = {(s := Typed(k)).t: s for k in TYPES}

#: Which types each end of agent.sock accepts, with their schemas: a daemon takes only what
#: a process reports about itself, a client only what its daemon says.
AGENT_INBOUND: Final[Inbound] = Inbound(
    {
        t: SCHEMAS[t]
        for t in (
            HELLO,
            HEARTBEAT,
            ARMED,
            PROGRESS,
            CAPTURED,
            BYE,
            STACKS_RESULT,
            BLACKBOX_RESULT,
        )
    }
)
CLIENT_INBOUND: Final[Inbound] = Inbound(
    {
        t: SCHEMAS[t]
        for t in (WELCOME, HEARTBEAT, ARM, DISARM, ACK, ERROR, STACKS_REQUEST, BLACKBOX_REQUEST)
    }
)


def encode(t: str, *, v: int = VERSION, peer: adapter.Peer | None = None, **fields: Any) -> bytes:
    """Pack one agent message of type ``t`` for a peer speaking version ``v``.

    ``fields`` are in the current version's shape; :func:`.adapter.downgrade` makes them the
    shape version ``v`` has (``peer``: the process the message is for, which a version-1
    ``arm`` names its directory after). The result is validated: a message this side would
    refuse to receive is a bug here, and must not leave (``ProtocolError``).
    """
    if v != VERSION:
        fields = adapter.downgrade(t, fields, v, peer)
    return encode_with(SCHEMAS, t, v, fields)
