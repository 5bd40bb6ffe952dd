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

import functools
import itertools
import math
import operator
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
#: 3: ``hb`` carries ``ledger`` (the step times and region times since the last heartbeat).
VERSION: Final = 3
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
        #: Set by :func:`decode`: what the frame unpacked to (None if it was not msgpack),
        #: and the version to answer in, so a peer of another version can read why.
        self.raw: object = None
        self.reply_v: int = VERSION

    def reply(self) -> bytes:
        """The ``error`` frame that answers the refused frame."""
        return error(self.code, str(self), v=self.reply_v)


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
#
# Long lists (the rows of a ``ps`` or ``traces`` reply, a report's steps) are checked column
# by column first (:meth:`Field.all_valid`): one pass of C-level builtins (``map``, ``min``,
# ``max``, ``set``) per field instead of a Python call per value. That pass only ever says
# "all valid" or "not sure"; on "not sure" the values are checked one by one, which finds
# and names the bad one, so both paths accept exactly the same values.

#: Lists at least this long are tried column by column first.
_COLUMNS: Final = 16


class Field:
    def check(self, value: object, where: str) -> Any:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def all_valid(self, values: list[Any]) -> bool:
        """True if :meth:`check` passes every one of ``values``; False: maybe not."""
        check = self.check
        try:
            for x in values:
                check(x, "")
        except ProtocolError:
            return False
        return True


def _types(values: list[Any]) -> set[type]:
    return set(map(type, values))


_not_none = functools.partial(operator.is_not, None)


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

    def all_valid(self, values: list[Any]) -> bool:
        if not values:
            return True
        return _types(values) == {int} and self.lo <= min(values) and max(values) <= self.hi


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

    def all_valid(self, values: list[Any]) -> bool:
        if not values:
            return True
        if not _types(values) <= {int, float}:
            return False
        try:
            # NaN slips through min/max, but not through the sum: any NaN or infinity makes
            # it non-finite (so does an overflowing sum of finite values: "not sure").
            return self.lo <= min(values) and max(values) <= self.hi and math.isfinite(sum(values))
        except OverflowError:
            return False


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

    def all_valid(self, values: list[Any]) -> bool:
        if not values:
            return True
        if self.name or _types(values) != {str}:
            return super().all_valid(values)
        if max(map(len, values)) > self.max_len:
            return False
        if self.choices is not None and not set(values) <= self.choices:
            return False
        # Most strings may be anything but empty: a scan for "" is cheaper than min(len).
        if self.min_len == 1:
            return "" not in values
        return self.min_len == 0 or min(map(len, values)) >= self.min_len


@dataclass(frozen=True)
class Bool(Field):
    def check(self, value: object, where: str) -> Any:
        if not isinstance(value, bool):
            raise _bad(where, f"must be true or false, got {_kind(value)}")
        return value

    def describe(self) -> str:
        return "bool"

    def all_valid(self, values: list[Any]) -> bool:
        return not values or _types(values) == {bool}


@dataclass(frozen=True)
class Nullable(Field):
    inner: Field

    def check(self, value: object, where: str) -> Any:
        return None if value is None else self.inner.check(value, where)

    def describe(self) -> str:
        return f"null or {self.inner.describe()}"

    def all_valid(self, values: list[Any]) -> bool:
        return self.inner.all_valid(list(filter(_not_none, values)))


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
        if len(value) >= _COLUMNS and self.item.all_valid(value):
            return value
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

    def all_valid(self, values: list[Any]) -> bool:
        if not values:
            return True
        if _types(values) != {list}:
            return False
        if not (self.min_len <= min(map(len, values)) and max(map(len, values)) <= self.max_len):
            return False
        # Every list's items as one column: a ``traces`` reply's files, say, in one pass.
        return self.item.all_valid(list(itertools.chain.from_iterable(values)))


@dataclass(frozen=True)
class AnyValue(Field):
    """Reply payloads: their shape is the request's business, the frame limits bound them."""

    def check(self, value: object, where: str) -> Any:
        return value

    def describe(self) -> str:
        return "any"

    def all_valid(self, values: list[Any]) -> bool:
        return True


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

    _columns: tuple[tuple[str, Callable[[Any], Any], Field, bool], ...] = field(
        default=(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        # Bound methods looked up once: this loop runs for every message on both sockets.
        checks = tuple((n, f.check, r) for n, (f, r) in self.fields.items())
        object.__setattr__(self, "_checks", checks)
        # Fields that can fail, for column checks (an optional ``any`` never does).
        columns = tuple(
            (n, operator.itemgetter(n), f, r)
            for n, (f, r) in self.fields.items()
            if r or not isinstance(f, AnyValue)
        )
        object.__setattr__(self, "_columns", columns)

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

    def all_valid(self, values: list[Any]) -> bool:
        if not values:
            return True
        if self.rule is not None:
            return super().all_valid(values)
        if _types(values) != {dict}:
            return False
        if not self.open and not set().union(*values) <= self.fields.keys():
            return False
        for name, get, f, required in self._columns:
            try:
                column = list(map(get, values))
            except KeyError:
                if required:
                    return False
                column = [x[name] for x in values if name in x]
            if not f.all_valid(column):
                return False
        return True


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
#: A native thread id (Linux: at most pid_max, like a pid).
TID: Final = Int(0, MAX_PID)
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


@dataclass(frozen=True)
class RegionTimes(Field):
    """A ledger's ``r``: ``[[name, seconds, entries], ...]``, time spent inside each
    ``region(name)`` since the last heartbeat."""

    def check(self, value: object, where: str) -> Any:
        if type(value) is not list or len(value) > MAX_LEDGER_REGIONS:
            raise _bad(where, f"must be a list of at most {MAX_LEDGER_REGIONS} regions")
        for i, item in enumerate(value):
            if (
                type(item) is not list
                or len(item) != 3
                or type(item[0]) is not str
                or not 1 <= len(item[0]) <= MAX_NAME
                or type(item[1]) not in (int, float)
                or not 0.0 <= item[1] <= MAX_SECONDS  # also refuses NaN
                or type(item[2]) is not int
                or not 0 <= item[2] <= MAX_STEP
            ):
                raise _bad(f"{where}[{i}]", "must be [name, seconds, entries]")
        return value

    def describe(self) -> str:
        return "list of [name, seconds, entries]"


#: ``hb``'s ``ledger``: the steps that ended since the previous heartbeat. ``n`` steps, the
#: last of them step ``at``, taking ``sum`` seconds in all; ``q`` = [p50, p90, p99, max]
#: seconds and ``b`` the histogram counts (see :data:`STEP_BUCKETS`) over those steps, or
#: over the last :data:`LEDGER_RING` of them when more ended. ``epoch`` changes when the
#: process set its step count (``step(n)``): steps across that jump are not timed.
LEDGER: Final = Struct(
    {
        "at": (Int(0, MAX_STEP), True),
        "n": (Int(0, MAX_STEP), True),
        "sum": (Num(0.0, MAX_SECONDS), True),
        "q": (ListOf(Num(0.0, MAX_SECONDS), 4, 4), True),
        "b": (ListOf(Int(0, MAX_STEP), len(STEP_BUCKETS) + 1, len(STEP_BUCKETS) + 1), True),
        "r": (RegionTimes(), False),
        "epoch": (Int(0, 1 << 31), False),
    },
    open=True,
)

# --- message types ------------------------------------------------------------------------------
# Client -> daemon, on agent.sock.
HELLO: Final = "hello"
HEARTBEAT: Final = "hb"
ARMED: Final = "armed"
PROGRESS: Final = "progress"
CAPTURED: Final = "captured"
BYE: Final = "bye"
STACKS_RESULT: Final = "stacks_result"  # the answer to ``stacks``: this process's threads
# Daemon -> client, on agent.sock.
WELCOME: Final = "welcome"
ARM: Final = "arm"
DISARM: Final = "disarm"
ACK: Final = "ack"
#: Daemon -> client: send every thread's stack (when the daemon may not trace the process);
#: not named ``stacks``, which is the control request.
STACKS_REQUEST: Final = "dump_stacks"
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
C_TOP: Final = "top"  # every rank's recent step times (the step ledger)
C_HISTORY: Final = "history"  # a job's per-minute step times, from the index
C_INCIDENTS: Final = "incidents"  # what the detectors noticed, from the index
C_INCIDENT: Final = "incident"  # one incident, with its capture's state
C_STACKS: Final = "stacks"  # every thread's stack of every attached rank, grouped


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
        # Sessions this process is still working on (armed), so a restarted daemon
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
        # The native id (``threading.get_native_id()``) of the thread that counts steps,
        # so ``stacks`` marks it; a heartbeat sends it again when the first step shows
        # another thread counts.
        training_tid=(Nullable(TID), _O),
        # Its flight recorder is on (``TORCH_FR_BUFFER_SIZE``): ``dump_stacks`` may ask for it.
        flight=(Bool(), _O),
    ),
    HEARTBEAT: _msg(
        step=(STEP, _O),
        sps=(Num(0.0, MAX_RATE), _O),
        state=(SHORT, _O),
        # v3: the steps since the last heartbeat (``LEDGER``); a client sends it only to a
        # daemon that speaks version 3, and a version-2 daemon would ignore it anyway.
        ledger=(LEDGER, _O),
        training_tid=(Nullable(TID), _O),  # as in ``hello``, when it changed
    ),
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
        # The revision of ``cycles``: bumped each time the daemon moves a --next session's
        # steps (a rank got the first ones too late); a client replaces a session it holds
        # only with a higher revision. The wire keeps the name ``plan`` (docs/protocol.md).
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
    C_TOP: _msg(job=(Nullable(Str(MAX_TEXT)), _O), role=(Nullable(Str(MAX_TEXT)), _O)),
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
}

#: Which types each socket accepts from its peers: agent peers can only report about
#: themselves; only control peers can start or stop sessions.
AGENT_INBOUND: Final = frozenset({HELLO, HEARTBEAT, ARMED, PROGRESS, CAPTURED, BYE, STACKS_RESULT})
CLIENT_INBOUND: Final = frozenset({WELCOME, HEARTBEAT, ARM, DISARM, ACK, ERROR, STACKS_REQUEST})
CONTROL_INBOUND: Final = frozenset(
    {
        C_STATUS,
        C_PS,
        C_START,
        C_STOP,
        C_CANCEL,
        C_SESSIONS,
        C_SHOW,
        C_TRACES,
        C_RETRY,
        C_TOP,
        C_HISTORY,
        C_INCIDENTS,
        C_INCIDENT,
        C_STACKS,
    }
)
REPLY_INBOUND: Final = frozenset({OK, ERROR})

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


#: One process in ``ps``. A peer of a protocol version the daemon does not serve is listed
#: with state ``incompatible``, an ``error``, and only what it claimed (unchecked by any
#: schema, hence the wide ``pid`` and ``rank``); the other fields are every served client's.
PS_ROW: Final = _row(
    host=(HOST, _R),
    pid=(Nullable(WIRE_INT), _R),
    job=(Str(MAX_NAME, 1), _R),
    role=(Str(MAX_NAME, 1), _R),
    rank=(Nullable(WIRE_INT), _R),
    state=(SHORT, _R),
    protocol=(Nullable(Int(-(1 << 31), 1 << 31)), _R),
    node=(NODE, _R),
    error=(TEXT, _O),
    local_rank=(RANK, _O),
    world_size=(Int(1, MAX_RANK + 1), _O),
    step=(STEP, _O),
    # ``step`` as of now: moved on from the last heartbeat's at the rank's rate (as in
    # ``TOP_ROW``); ``age_s``: seconds since the heartbeat that carried the step.
    step_extrapolated=(Bool(), _O),
    age_s=(FINITE, _O),
    steps_per_s=(Num(0.0, math.inf), _O),
    step_mode=(Str(16), _O),
    allowed=(Bool(), _O),
    cpu_percent=(Nullable(Num(0.0, math.inf)), _O),
    rss_bytes=(Nullable(BYTES), _O),
    gpu_util=(Nullable(Num(0.0, math.inf)), _O),
    gpu_mem_bytes=(Nullable(BYTES), _O),
    torch=(Nullable(SHORT), _O),
    device=(Nullable(SHORT), _O),
    nsys_session=(Nullable(NAME), _O),
    attached_at=(WHEN, _O),
    uid=(UID, _O),
    identity_source=(IDENTITY_SOURCE, _O),
    # Another served process claims the same job, role and rank; every pid that claims it.
    duplicate=(Bool(), _O),
    claimed_by=(ListOf(PID, 1 << 22), _O),
)

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
    # ``implausible_steps``: step jumps a rank's rate cannot explain, left out of samples.
    watch=(_row(implausible_steps=(COUNT, _R)), _O),
)

#: One rank in ``top``: its step times over the last minute (``window_s``: what the figures
#: cover), ``step`` as of now (``step_extrapolated``: moved on from the last heartbeat's at
#: the rank's rate) and ``age_s`` (seconds since that heartbeat). ``source``: ``ledger``
#: (step times the client measured), ``rate`` (a protocol-2 client: 1/steps-per-second),
#: ``index`` (the last minute the index holds, right after a daemon restart) or null.
#: ``vs_role``: the rank's p50 over its role's median p50 on this node; ``marked``: far
#: from it (``profd.watch.stats.FAR``). ``regions``: each region's share of the step time.
TOP_ROW: Final = _row(
    host=(HOST, _R),
    node=(NODE, _R),
    pid=(PID, _R),
    job=(Str(MAX_NAME, 1), _R),
    role=(Str(MAX_NAME, 1), _R),
    rank=(RANK, _R),
    world_size=(Int(1, MAX_RANK + 1), _R),
    step=(STEP, _R),
    step_extrapolated=(Bool(), _R),
    age_s=(Nullable(FINITE), _R),
    sps=(Num(0.0, math.inf), _R),
    step_ms_p50=(Nullable(FINITE), _R),
    step_ms_p99=(Nullable(FINITE), _R),
    window_s=(Nullable(FINITE), _R),
    source=(Nullable(SHORT), _R),
    vs_role=(Nullable(FINITE), _R),
    marked=(Bool(), _R),
    regions=(MAP, _R),
    cpu_percent=(Nullable(Num(0.0, math.inf)), _O),
    rss_bytes=(Nullable(BYTES), _O),
    gpu_util=(Nullable(Num(0.0, math.inf)), _O),
    gpu_mem_bytes=(Nullable(BYTES), _O),
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
#: What a client sends of its own stacks: innermost frames first, so what is cut is the
#: outermost (an agent frame is at most ``MAX_FRAME_BYTES``).
AGENT_MAX_FRAMES: Final = 128
AGENT_MAX_THREADS: Final = 64
STACK_FRAME: Final = _row(
    function=(Str(MAX_TEXT), _R),
    file=(Str(MAX_PATH), _R),
    line=(Int(0, 1 << 31), _R),
    native=(Bool(), _O),  # a C/C++ frame (py-spy --native): not part of a group's key
)
STACK_FRAMES: Final = ListOf(STACK_FRAME, MAX_FRAMES)
STACK_WHO: Final = _row(host=(HOST, _R), role=(Str(MAX_NAME, 1), _R), rank=(RANK, _R))
STACK_THREAD: Final = _row(
    name=(Str(MAX_TEXT), _R),
    tid=(WIRE_INT, _R),
    training=(Bool(), _R),
    frames=(STACK_FRAMES, _R),
    owns_gil=(Bool(), _O),  # py-spy: the thread held the GIL when read
)
#: A flight recorder's summary (``profd_client.flight``): what a rank's last collectives were.
FLIGHT_MAX_PGS: Final = 64
FLIGHT_MAX_ENTRIES: Final = 256
FLIGHT_SEQ: Final = Int(-1, MAX_STEP)  # -1: none yet
FLIGHT_PG: Final = _row(
    pg=(Str(MAX_NAME), _R),
    desc=(Str(MAX_NAME), _R),
    enqueued=(FLIGHT_SEQ, _R),
    started=(FLIGHT_SEQ, _R),
    completed=(FLIGHT_SEQ, _R),
)
FLIGHT_ENTRY: Final = _row(
    pg=(Str(MAX_NAME), _R),
    seq=(FLIGHT_SEQ, _R),
    p2p=(Bool(), _R),
    op=(Str(MAX_NAME), _R),
    state=(Str(16), _R),
    sizes=(ListOf(ListOf(FLIGHT_SEQ, 8), 4), _R),
)
FLIGHT: Final = _row(
    version=(Str(32), _R),
    pgs=(ListOf(FLIGHT_PG, FLIGHT_MAX_PGS), _R),
    entries=(ListOf(FLIGHT_ENTRY, FLIGHT_MAX_ENTRIES), _R),
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

#: A process's own threads (``stacks_result``), bounded to fit one agent frame.
AGENT_STACK_THREAD: Final = _row(
    name=(Str(MAX_NAME), _R),
    tid=(TID, _R),
    frames=(ListOf(STACK_FRAME, AGENT_MAX_FRAMES), _R),
)
#: ``stacks`` (default true): the threads' stacks; ``flight``: the flight recorder's summary
#: (asked only of a client whose ``hello`` said ``flight``).
SCHEMAS[STACKS_REQUEST] = _msg(id=(MSG_ID, _R), stacks=(Bool(), _O), flight=(Bool(), _O))
SCHEMAS[STACKS_RESULT] = _msg(
    id=(MSG_ID, _R),
    threads=(ListOf(AGENT_STACK_THREAD, AGENT_MAX_THREADS), _R),
    flight=(FLIGHT, _O),
    flight_error=(Str(MAX_TEXT), _O),
)

#: The ``ok`` reply's ``data`` for each control request; others (``start``, ``stop``,
#: ``cancel``, ``retry``: small maps) are not described here.
REPLIES: Final[dict[str, Field]] = {
    C_STATUS: STATUS_DOC,
    C_PS: ListOf(PS_ROW, 1 << 22),
    C_SESSIONS: ListOf(SESSION_ROW, 100_000),
    C_SHOW: SESSION_DOC,
    C_TRACES: ListOf(TRACE_ROW, 1_000_000),
    C_TOP: ListOf(TOP_ROW, 1 << 22),
    C_HISTORY: HISTORY_DOC,
    C_INCIDENTS: ListOf(INCIDENT_ROW, 100_000),
    C_INCIDENT: INCIDENT_DOC,
    C_STACKS: ListOf(STACKS_DOC, 1 << 16),
}


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
    """Unpack one frame, check its version and validate it; only types in ``accept`` pass.

    Every receiver (both daemon sockets, the client, profctl) reads frames through here. A
    frame refused raises :class:`ProtocolError` with ``raw`` (what it unpacked to) and
    ``reply_v`` (the version to answer in) set: ``exc.reply()`` is the answer.
    """
    raw: object = None
    try:
        raw = unpack(frame, reply)
        return validate(raw, accept)
    except ProtocolError as exc:
        exc.raw, exc.reply_v = raw, reply_version(raw)
        raise


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


def reply_version(msg: object) -> int:
    """The version to answer ``msg`` in: the peer's own, so a peer of another version can
    read the answer, unless it is not one a frame can carry (then ours)."""
    v = version_of(msg)
    return v if v is not None and 0 <= v < (1 << 16) else VERSION


def error(code: str, message: str, *, v: int = VERSION) -> bytes:
    return encode(ERROR, v=v, code=code[:64], msg=message[:MAX_ERROR_TEXT])


def reply(request: Mapping[str, Any], data: object) -> bytes:
    """The ``ok`` answer to a validated control request, in the request's version. ``data``
    is checked against the request type's reply schema (:data:`REPLIES`) like any message
    this side sends: a reply that breaks it is a bug here (``ProtocolError``)."""
    t = request["t"]
    REPLIES.get(t, _ANY_DATA).check(data, f"{t}.data")
    return encode(OK, v=request["v"], data=data)


def cycles(value: object) -> list[tuple[int, int, int]]:
    """Cycles are ``[warmup_start, start, stop]`` triples of absolute 1-indexed steps."""
    return [(w, a, b) for w, a, b in Cycles().check(value, "cycles")]
