"""The profd wire protocol: the one place message types, their fields and limits are defined.

Every message is a msgpack map with ``v`` (protocol version) and ``t`` (type). Peers speak
ZeroMQ: training processes use a DEALER socket against the daemon's ROUTER on ``agent.sock``;
profctl uses a REQ socket against the daemon's ROUTER on ``control.sock``. This module knows
nothing about sockets or policy: it splits and joins routing envelopes, encodes, decodes and
validates, in both directions, and raises :class:`ProtocolError` for anything that does not
match the schemas below. Consumers may rely on a validated message: every integer is within
its declared range, every float is finite, every string and list is bounded, nested maps
(start specs, options, file entries, filters) have been checked field by field.

``docs/protocol.md`` describes every message listed here and the version history.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

#: The release of profd and profd_client (one distribution, one version string).
RELEASE: Final = "0.1.0"

#: The version this code speaks. A daemon serves every version in ``SUPPORTED_VERSIONS``
#: and answers each peer in the version the peer spoke (a job outlives daemon upgrades).
#: 2: ``welcome`` carries ``protocol`` (the daemon's supported range); fields are bounded.
VERSION: Final = 2
MIN_VERSION: Final = 1
SUPPORTED_VERSIONS: Final = range(MIN_VERSION, VERSION + 1)

#: Inbound frame limit, applied with ``zmq.MAXMSGSIZE`` on every daemon socket.
MAX_FRAME_BYTES: Final = 1 << 20
#: profctl accepts larger replies (trace listings).
MAX_REPLY_BYTES: Final = 256 << 20

AGENT_SOCKET: Final = "agent.sock"
CONTROL_SOCKET: Final = "control.sock"

# --- limits -----------------------------------------------------------------------------------
# Sane bounds, all far inside int64, so nothing derived from them (cycles, sums, SQLite
# integers, msgpack) can overflow, and nothing a peer sends can make the daemon loop or
# allocate for long.
MAX_STEP: Final = 1 << 48
MAX_RANK: Final = (1 << 24) - 1
MAX_PID: Final = (1 << 31) - 1
MAX_ID: Final = (1 << 63) - 1
MAX_CYCLES: Final = 1000  # cycles in one session (--repeat, --steps lists)
MAX_CYCLE_STEPS: Final = 10_000  # steps from a cycle's warm-up start to its stop
MAX_REVISION: Final = 1000
MAX_RATE: Final = 1e9  # steps per second
MAX_SECONDS: Final = 1e12  # timestamps and durations
MAX_NAME: Final = 200
MAX_HOST: Final = 255
MAX_CLUSTER_NODES: Final = 1 << 20
MAX_PATH: Final = 4096
MAX_TEXT: Final = 4096
MAX_ERROR_TEXT: Final = 64 << 10
MAX_FILES: Final = 64
MAX_PATTERNS: Final = 64
MAX_PIDS: Final = 4096


class ProtocolError(ValueError):
    """A frame that is not a valid message. ``code`` goes into the ``error`` reply."""

    def __init__(self, code: str, message: str, path: str = "", why: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.path = path  # the field, for bad_request: "start.spec.ranks"
        self.why = why


def _bad(where: str, why: str) -> ProtocolError:
    return ProtocolError("bad_request", f"{where}: {why}", where, why)


def _within(exc: ProtocolError, prefix: str) -> ProtocolError:
    """``exc`` about a nested field, named from ``prefix`` down. Paths are built only on
    error: formatting one per field and list item on every valid message is what a busy
    daemon would pay for otherwise."""
    if exc.code != "bad_request":
        return exc
    return _bad(prefix + exc.path, exc.why)


# --- field types --------------------------------------------------------------------------------
# A field type checks one value and returns it (possibly normalised: a msgpack list for a
# tuple-like value stays a list). ``where`` names the field in errors, e.g. ``start.spec.ranks``.


class Field:
    def check(self, value: object, where: str) -> Any:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Field):
    lo: int
    hi: int

    def check(self, value: object, where: str) -> Any:
        # ``type() is``: bool is an int subclass, and True where a step is wanted is still a
        # type error (msgpack never yields other int subclasses).
        if type(value) is not int:
            raise _bad(where, f"must be an integer, got {_kind(value)}")
        if not self.lo <= value <= self.hi:
            raise _bad(where, f"{value} is out of range {self.lo}..{self.hi}")
        return value

    def describe(self) -> str:
        return f"int {self.lo}..{self.hi}"


@dataclass(frozen=True)
class Num(Field):
    lo: float
    hi: float

    def check(self, value: object, where: str) -> Any:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _bad(where, f"must be a number, got {_kind(value)}")
        if not (math.isfinite(value) and self.lo <= value <= self.hi):
            raise _bad(where, f"{value!r} is not a finite number in {self.lo:g}..{self.hi:g}")
        return value

    def describe(self) -> str:
        return f"number {self.lo:g}..{self.hi:g}"


@dataclass(frozen=True)
class Str(Field):
    max_len: int
    min_len: int = 0
    choices: frozenset[str] | None = None
    #: Becomes one path component (job, role, session): see :func:`safe_name`.
    name: bool = False

    def check(self, value: object, where: str) -> Any:
        if type(value) is not str:
            raise _bad(where, f"must be a string, got {_kind(value)}")
        if self.name:
            problem = _name_problem(value)
            if problem:
                raise _bad(where, f"{value[:60]!r} {problem}")
        if not self.min_len <= len(value) <= self.max_len:
            raise _bad(where, f"length {len(value)} is not {self.min_len}..{self.max_len}")
        if self.choices is not None and value not in self.choices:
            raise _bad(where, f"{value[:60]!r} is not one of {', '.join(sorted(self.choices))}")
        return value

    def describe(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(sorted(self.choices))
        return f"string of {self.min_len}..{self.max_len}"


@dataclass(frozen=True)
class Bool(Field):
    def check(self, value: object, where: str) -> Any:
        if not isinstance(value, bool):
            raise _bad(where, f"must be true or false, got {_kind(value)}")
        return value

    def describe(self) -> str:
        return "bool"


@dataclass(frozen=True)
class Nullable(Field):
    inner: Field

    def check(self, value: object, where: str) -> Any:
        return None if value is None else self.inner.check(value, where)

    def describe(self) -> str:
        return f"null or {self.inner.describe()}"


@dataclass(frozen=True)
class OneOf(Field):
    alternatives: tuple[Field, ...]

    def check(self, value: object, where: str) -> Any:
        errors = []
        for alt in self.alternatives:
            try:
                return alt.check(value, where)
            except ProtocolError as exc:
                errors.append(exc)
        # The value had the right type for one alternative and broke its bounds: say that.
        for err in errors:
            if not err.why.startswith("must be "):
                raise err
        raise _bad(where, f"must be {self.describe()}, got {_kind(value)}")

    def describe(self) -> str:
        return " or ".join(a.describe() for a in self.alternatives)


@dataclass(frozen=True)
class ListOf(Field):
    item: Field
    max_len: int
    min_len: int = 0

    def check(self, value: object, where: str) -> Any:
        if not isinstance(value, list):
            raise _bad(where, f"must be a list, got {_kind(value)}")
        if not self.min_len <= len(value) <= self.max_len:
            raise _bad(where, f"{len(value)} items, not {self.min_len}..{self.max_len}")
        check = self.item.check
        try:
            # Field types return the value they were given: nothing to copy.
            for x in value:
                check(x, "")
            return value
        except ProtocolError as exc:
            i = next(i for i, x in enumerate(value) if _fails(check, x))
            raise _within(exc, f"{where}[{i}]") from None

    def describe(self) -> str:
        return f"list of {self.item.describe()}"


@dataclass(frozen=True)
class AnyValue(Field):
    """Reply payloads: their shape is the request's business, the frame limits bound them."""

    def check(self, value: object, where: str) -> Any:
        return value

    def describe(self) -> str:
        return "any"


@dataclass(frozen=True)
class Struct(Field):
    """A map with known keys. ``open``: unknown keys are ignored (a newer peer's additions);
    closed structs (start specs, options, filters) refuse them, since a misspelt option
    silently ignored would capture something else than asked."""

    fields: Mapping[str, tuple[Field, bool]]
    open: bool = False
    #: Cross-field rule run after every field passed, e.g. a cycle's ordering.
    rule: Callable[[dict[str, Any], str], None] | None = None
    _checks: tuple[tuple[str, Callable[[object, str], Any], bool], ...] = field(
        default=(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        # Bound methods looked up once: this loop runs for every message on both sockets.
        checks = tuple((n, f.check, r) for n, (f, r) in self.fields.items())
        object.__setattr__(self, "_checks", checks)

    def check(self, value: object, where: str) -> Any:
        if not isinstance(value, dict):
            raise _bad(where, f"must be a map, got {_kind(value)}")
        if not self.open:
            unknown = [k for k in value if k not in self.fields]
            if unknown:
                raise _bad(where, f"unknown field(s) {', '.join(map(repr, sorted(unknown)))}")
        for name, check, required in self._checks:
            if name in value:
                try:
                    check(value[name], "")
                except ProtocolError as exc:
                    raise _within(exc, f"{where}.{name}") from None
            elif required:
                raise _bad(where, f"missing field {name!r}")
        if self.rule is not None:
            self.rule(value, where)
        return value

    def describe(self) -> str:
        return "map"


@dataclass(frozen=True)
class Cycles(Field):
    """``[warmup_start, start, stop)`` triples of absolute 1-indexed steps, in order."""

    def check(self, value: object, where: str) -> Any:
        if not isinstance(value, list) or not 1 <= len(value) <= MAX_CYCLES:
            return _CYCLE_LIST.check(value, where)  # raises, naming what is wrong
        prev = 0
        for i, c in enumerate(value):
            if type(c) is not list or len(c) != 3 or not all(type(x) is int for x in c):
                _CYCLE_LIST.check(value, where)  # raises, naming what is wrong
            w, a, b = c
            if b > MAX_STEP:
                raise _bad(f"{where}[{i}]", f"goes beyond step {MAX_STEP}")
            if not (1 <= w <= a < b):
                raise _bad(f"{where}[{i}]", "is not 1 <= warmup_start <= start < stop")
            if b - w > MAX_CYCLE_STEPS:
                raise _bad(f"{where}[{i}]", f"spans {b - w} steps (at most {MAX_CYCLE_STEPS})")
            if w < prev:
                raise _bad(f"{where}[{i}]", "overlaps the cycle before it")
            prev = b
        return value

    def describe(self) -> str:
        return "list of [warmup_start, start, stop]"


def _fails(check: Callable[[object, str], Any], x: object) -> bool:
    try:
        check(x, "")
    except ProtocolError:
        return True
    return False


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


# --- vocabulary ---------------------------------------------------------------------------------
_SAFE_NAME = re.compile(r"[A-Za-z0-9_+=@:-][A-Za-z0-9._+=@:-]*")


def _name_problem(value: str) -> str | None:
    if len(value) > MAX_NAME or _SAFE_NAME.fullmatch(value) is None:
        return f"must be 1-{MAX_NAME} of [A-Za-z0-9._-+=@:], not starting '.'"
    return None


def target_dir(host: str, pid: int) -> str:
    """The name of a process's own directory under an arm's ``incoming`` (protocol 2+).

    The daemon creates it, owned by the process's uid, before it sends the arm; the process
    writes its captures below it, and nobody else can. Both sides derive the name from the
    hello's ``host`` and ``pid`` (the pid alone repeats across containers on one node; a
    host name need not be a safe path component, so it is hashed).
    """
    return f"p{pid}-{zlib.crc32(host.encode('utf-8', 'surrogateescape')):08x}"


def safe_name(value: str, what: str) -> str:
    """Names that become path components (job, role, session) must stay one component."""
    problem = _name_problem(value)
    if problem:
        raise _bad(what, f"{value[:60]!r} {problem}")
    return value


ACTIVITIES: Final = frozenset({"cpu", "cuda"})
BOOL_OPTIONS: Final = frozenset(
    {
        "record_shapes",
        "profile_memory",
        "with_stack",
        "with_flops",
        "with_modules",
        "memory_snapshot",
    }
)
BACKENDS: Final = frozenset({"torch", "nsys"})
DEFAULT_BACKEND: Final = "torch"
#: Set by ``profctl run --nsys`` for the launched job: the nsys session to drive.
NSYS_SESSION_ENV: Final = "PROFD_NSYS_SESSION"

#: Session states; a session ends in one of the terminal ones.
SESSION_STATES: Final = frozenset(
    {"pending", "armed", "capturing", "processing", "done", "partial", "failed", "cancelled"}
)
SESSION_TERMINAL: Final = frozenset({"done", "partial", "failed", "cancelled"})
#: Per-target states (a target is one process in a session).
TARGET_TERMINAL: Final = frozenset({"done", "failed", "cancelled"})
#: What a client reports in ``progress``; the terminal ones end its part of a session.
REPORT_STATES: Final = frozenset(
    {"capturing", "done", "failed", "stopped", "cancelled", "missed", "late"}
)
REPORT_TERMINAL: Final = frozenset({"done", "failed", "stopped", "cancelled"})

# Reusable field types.
STEP: Final = Int(0, MAX_STEP)
_CYCLE_LIST: Final = ListOf(ListOf(STEP, 3, 3), MAX_CYCLES, 1)
RANK: Final = Int(0, MAX_RANK)
PID: Final = Int(1, MAX_PID)
MSG_ID: Final = Int(0, MAX_ID)
REVISION: Final = Int(0, MAX_REVISION)
NAME: Final = Str(MAX_NAME, name=True)
#: One bound for session ids wherever they appear: the name rule's (docs/protocol.md).
SESSION_ID: Final = Str(MAX_NAME, min_len=1, name=True)
HOST: Final = Str(MAX_HOST, min_len=1)
PATH: Final = Str(MAX_PATH, min_len=1)
TEXT: Final = Str(MAX_TEXT)
SHORT: Final = Str(64)
SECONDS: Final = Num(0.0, MAX_SECONDS)
#: ``--steps``: "A:B" or "1,2,5" (profctl, rule tables) or one step.
STEPS_TEXT: Final = OneOf((Str(16 << 10, min_len=1), Int(1, MAX_STEP)))

OPTIONS: Final = Struct(
    {
        "activities": (ListOf(Str(8, choices=ACTIVITIES), len(ACTIVITIES), 1), False),
        **{k: (Bool(), False) for k in sorted(BOOL_OPTIONS)},
    }
)


#: Where each identity field of a ``hello`` came from (``env:RANK``, ``torch.distributed``,
#: ``ray``, ...); open, so a newer client may name more fields.
IDENTITY_FIELDS: Final = ("job", "role", "rank", "local_rank", "world_size")
IDENTITY_SOURCE: Final = Struct({k: (Str(64), False) for k in IDENTITY_FIELDS}, open=True)


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

FILE_ENTRY: Final = Struct({"kind": (Str(32, 1), True), "path": (PATH, True)}, open=True)

# --- message types ------------------------------------------------------------------------------
# Client -> daemon, on agent.sock.
HELLO: Final = "hello"
HEARTBEAT: Final = "hb"
ARMED: Final = "armed"
PROGRESS: Final = "progress"
CAPTURED: Final = "captured"
BYE: Final = "bye"
# Daemon -> client, on agent.sock.
WELCOME: Final = "welcome"
ARM: Final = "arm"
DISARM: Final = "disarm"
ACK: Final = "ack"
# Both directions / control.
ERROR: Final = "error"
OK: Final = "ok"

# Control requests (profctl -> daemon, on control.sock).
C_STATUS: Final = "status"
C_PS: Final = "ps"
C_START: Final = "start"
C_STOP: Final = "stop"
C_CANCEL: Final = "cancel"
C_SESSIONS: Final = "sessions"
C_SHOW: Final = "show"
C_TRACES: Final = "traces"
C_RETRY: Final = "retry"


def _msg(open_: bool = True, **fields: tuple[Field, bool]) -> Struct:
    # Top-level messages are open: a newer peer may add fields an older one ignores.
    return Struct(fields, open=open_)


_R, _O = True, False  # required, optional

SCHEMAS: Final[dict[str, Struct]] = {
    HELLO: _msg(
        pid=(PID, _R),
        host=(HOST, _R),
        job=(NAME, _R),
        role=(NAME, _R),
        rank=(RANK, _R),
        local_rank=(RANK, _R),
        world_size=(Int(1, MAX_RANK + 1), _R),
        step=(STEP, _R),
        step_mode=(Str(16), _R),
        allowed=(Bool(), _R),
        client_version=(SHORT, _R),
        torch=(Nullable(SHORT), _O),
        device=(Nullable(SHORT), _O),
        # Sessions this process is still working on (armed plans), so a restarted daemon
        # knows the target is alive and busy.
        sessions=(ListOf(Str(MAX_NAME), MAX_CYCLES), _O),
        # The Nsight Systems session the process runs under (``profctl run --nsys``), if any.
        nsys_session=(Nullable(NAME), _O),
        # attach() is blocked until the welcome (``attach(wait=...)``): step 1 has not begun,
        # so ``[[auto]]`` rules may arm it; their ``arm`` is sent before the ``welcome``.
        waiting=(Bool(), _O),
        # Where each identity field came from, for ``profctl ps --sources``. A ``hello`` from
        # a registered process with another job, role, rank or world size re-registers it.
        identity_source=(IDENTITY_SOURCE, _O),
    ),
    HEARTBEAT: _msg(step=(STEP, _O), sps=(Num(0.0, MAX_RATE), _O), state=(SHORT, _O)),
    # ``plan``: the revision of the session's steps the message is about (``arm``'s ``plan``).
    ARMED: _msg(session=(SESSION_ID, _R), cycles=(Cycles(), _R), plan=(REVISION, _O)),
    PROGRESS: _msg(
        id=(MSG_ID, _R),
        session=(SESSION_ID, _R),
        state=(Str(16, choices=REPORT_STATES), _R),
        step=(STEP, _R),
        error=(Nullable(Str(MAX_ERROR_TEXT)), _O),
        plan=(REVISION, _O),
    ),
    CAPTURED: _msg(
        id=(MSG_ID, _R),
        session=(SESSION_ID, _R),
        job=(NAME, _R),
        cycle=(Int(0, 1 << 31), _R),
        steps=(ListOf(STEP, MAX_CYCLE_STEPS), _R),
        files=(ListOf(FILE_ENTRY, MAX_FILES), _R),
        started_at=(SECONDS, _R),
        ended_at=(SECONDS, _R),
        stall_ms=(SECONDS, _R),
        error=(Nullable(Str(MAX_ERROR_TEXT)), _O),
        region=(Nullable(Str(MAX_NAME)), _O),
        torch=(Nullable(SHORT), _O),
        device=(Nullable(SHORT), _O),
        notes=(ListOf(Str(MAX_TEXT), 64), _O),
        plan=(REVISION, _O),
    ),
    BYE: _msg(),
    WELCOME: _msg(
        spool=(PATH, _R),
        hb_interval=(Num(0.01, 3600.0), _R),
        daemon=(SHORT, _R),
        # v2: the daemon's supported protocol versions, [oldest, newest].
        protocol=(ListOf(Int(0, 1 << 16), 2, 2), _O),
    ),
    ARM: _msg(
        session=(SESSION_ID, _R),
        job=(NAME, _R),
        backend=(Str(16, choices=BACKENDS), _R),
        cycles=(Cycles(), _R),
        options=(OPTIONS, _R),
        region=(Nullable(Str(MAX_NAME, 1)), _O),
        incoming=(PATH, _R),
        # Bumped each time the daemon moves a --next session's steps (a rank got the first
        # plan too late); a client replaces a held plan only with a higher revision.
        plan=(REVISION, _O),
    ),
    DISARM: _msg(session=(SESSION_ID, _R), keep=(Bool(), _R)),
    ACK: _msg(id=(MSG_ID, _R)),
    ERROR: _msg(code=(SHORT, _R), msg=(Str(MAX_ERROR_TEXT), _R)),
    OK: _msg(data=(AnyValue(), _O)),
    C_STATUS: _msg(),
    C_PS: _msg(job=(Nullable(Str(MAX_TEXT)), _O), role=(Nullable(Str(MAX_TEXT)), _O)),
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
}

#: Which types each socket accepts from its peers: agent peers can only report about
#: themselves; only control peers can start or stop sessions.
AGENT_INBOUND: Final = frozenset({HELLO, HEARTBEAT, ARMED, PROGRESS, CAPTURED, BYE})
CLIENT_INBOUND: Final = frozenset({WELCOME, HEARTBEAT, ARM, DISARM, ACK, ERROR})
CONTROL_INBOUND: Final = frozenset(
    {C_STATUS, C_PS, C_START, C_STOP, C_CANCEL, C_SESSIONS, C_SHOW, C_TRACES, C_RETRY}
)
REPLY_INBOUND: Final = frozenset({OK, ERROR})


# --- envelopes, encoding, decoding --------------------------------------------------------------
def split_envelope(frames: list[bytes]) -> tuple[list[bytes], bytes]:
    """A ROUTER's ``[routing id, (empty delimiter,) payload]`` as (envelope, payload).

    REQ peers (profctl) add the empty delimiter, DEALER peers (clients) do not; replies go
    back in the same envelope. Anything else is not a message.
    """
    if len(frames) == 2 or (len(frames) == 3 and frames[1] == b""):
        return frames[:-1], frames[-1]
    raise ProtocolError("malformed", f"expected one payload frame, got {len(frames) - 1}")


def join_envelope(envelope: list[bytes], payload: bytes) -> list[bytes]:
    return [*envelope, payload]


def encode(t: str, *, v: int = VERSION, **fields: Any) -> bytes:
    """Pack one message of type ``t``, validated: a message this side would refuse to
    receive is a bug here, and must not leave (``ProtocolError``)."""
    msg: dict[str, Any] = {"v": v, "t": t}
    msg.update(fields)
    schema = SCHEMAS.get(t)
    if schema is None:
        raise ProtocolError("type", f"no message type {t!r}")
    schema.check(msg, t)
    data: bytes = msgpack.packb(msg, use_bin_type=True)
    return data


def unpack(frame: bytes, reply: bool = False) -> object:
    """msgpack with limits that stop a small hostile frame from declaring huge containers.

    ``reply``: a daemon's reply to profctl, which may list many traces.
    """
    limit = MAX_REPLY_BYTES if reply else MAX_FRAME_BYTES
    if len(frame) > limit:
        raise ProtocolError("too_large", f"frame of {len(frame)} bytes (at most {limit})")
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_FRAME_BYTES,
            max_bin_len=MAX_FRAME_BYTES,
            max_array_len=(1 << 22) if reply else (1 << 17),
            max_map_len=(1 << 22) if reply else (1 << 12),
            max_ext_len=0,
        )
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
        RecursionError,
    ) as exc:  # msgpack raises several types
        raise ProtocolError("malformed", f"not msgpack: {type(exc).__name__}") from None


def decode(frame: bytes, accept: frozenset[str], reply: bool = False) -> dict[str, Any]:
    """Unpack and validate one frame; only types in ``accept`` pass."""
    return validate(unpack(frame, reply), accept)


def check_header(msg: object, accept: frozenset[str]) -> dict[str, Any]:
    """The envelope fields alone: a map, a supported ``v``, an accepted ``t``."""
    if not isinstance(msg, dict):
        raise ProtocolError("malformed", "message is not a map")
    v = msg.get("v")
    if not isinstance(v, int) or isinstance(v, bool) or v not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            "version",
            f"unsupported protocol version {v!r}: this side speaks {MIN_VERSION}..{VERSION}",
        )
    t = msg.get("t")
    if not isinstance(t, str) or t not in accept:
        raise ProtocolError("type", f"unexpected message type {str(t)[:40]!r}")
    return msg


def validate(msg: object, accept: frozenset[str]) -> dict[str, Any]:
    m = check_header(msg, accept)
    out: dict[str, Any] = SCHEMAS[m["t"]].check(m, m["t"])
    return out


def version_of(msg: object) -> int | None:
    """The ``v`` a peer spoke, even in a message this side cannot serve."""
    if isinstance(msg, dict):
        v = msg.get("v")
        if isinstance(v, int) and not isinstance(v, bool) and -(1 << 31) < v < (1 << 31):
            return v
    return None


def error(code: str, message: str, *, v: int = VERSION) -> bytes:
    return encode(ERROR, v=v, code=code[:64], msg=message[:MAX_ERROR_TEXT])


def ok(data: object = None) -> bytes:
    return encode(OK, data=data)


def cycles(value: object) -> list[tuple[int, int, int]]:
    """Cycles are ``[warmup_start, start, stop]`` triples of absolute 1-indexed steps."""
    return [(w, a, b) for w, a, b in Cycles().check(value, "cycles")]
