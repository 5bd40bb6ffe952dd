"""The schema library: hand-written field types that check a decoded message in place.

A field type checks one value and returns it; a :class:`Struct` checks a map field by field
and names the bad one in one line (``hb.ledger.q[2]: ...``). Long lists are checked column
by column first (:meth:`Field.all_valid`). Consumers may rely on a validated message: every
integer is within its declared range, every float is finite, every string and list is
bounded, nested maps have been checked field by field.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import re
import zlib
from collections.abc import Callable, Mapping
from typing import Any, Final

from .envelope import ProtocolError
from .envelope import bad as _bad
from .envelope import within as _within

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
MAX_FILES: Final = 64
MAX_PATTERNS: Final = 64
MAX_PIDS: Final = 4096


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
    # Plain classes with slots, not dataclasses: every profctl command and every training
    # job imports these, and ``dataclasses`` (with ``inspect``) plus the code it generates
    # per class was ~10 ms of profctl's start-up.
    __slots__ = ()

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


class Int(Field):
    __slots__ = ("hi", "lo")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def check(self, value: object, where: str) -> Any:
        # ``type() is``: bool is an int subclass, and True where a step is wanted is still a
        # type error (msgpack never yields other int subclasses).
        if type(value) is not int:
            raise _not_a(where, "an integer", value)
        if not self.lo <= value <= self.hi:
            raise _bad(where, f"{value} is out of range {self.lo}..{self.hi}")
        return value

    def describe(self) -> str:
        return f"int {self.lo}..{self.hi}"

    def all_valid(self, values: list[Any]) -> bool:
        if not values:
            return True
        return _types(values) == {int} and self.lo <= min(values) and max(values) <= self.hi


class Num(Field):
    __slots__ = ("hi", "lo")

    def __init__(self, lo: float, hi: float) -> None:
        self.lo, self.hi = lo, hi

    def check(self, value: object, where: str) -> Any:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _not_a(where, "a number", value)
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


class Str(Field):
    __slots__ = ("choices", "max_len", "min_len", "name")

    def __init__(
        self,
        max_len: int,
        min_len: int = 0,
        choices: frozenset[str] | None = None,
        name: bool = False,
    ) -> None:
        self.max_len, self.min_len, self.choices = max_len, min_len, choices
        #: Becomes one path component (job, role, session): see :func:`safe_name`.
        self.name = name

    def check(self, value: object, where: str) -> Any:
        if type(value) is not str:
            raise _not_a(where, "a string", value)
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


class Bool(Field):
    __slots__ = ()

    def check(self, value: object, where: str) -> Any:
        if not isinstance(value, bool):
            raise _not_a(where, "true or false", value)
        return value

    def describe(self) -> str:
        return "bool"

    def all_valid(self, values: list[Any]) -> bool:
        return not values or _types(values) == {bool}


class Nullable(Field):
    __slots__ = ("inner",)

    def __init__(self, inner: Field) -> None:
        self.inner = inner

    def check(self, value: object, where: str) -> Any:
        return None if value is None else self.inner.check(value, where)

    def describe(self) -> str:
        return f"null or {self.inner.describe()}"

    def all_valid(self, values: list[Any]) -> bool:
        return self.inner.all_valid(list(filter(_not_none, values)))


class OneOf(Field):
    __slots__ = ("alternatives",)

    def __init__(self, alternatives: tuple[Field, ...]) -> None:
        self.alternatives = alternatives

    def check(self, value: object, where: str) -> Any:
        errors = []
        for alt in self.alternatives:
            try:
                return alt.check(value, where)
            except ProtocolError as exc:
                errors.append(exc)
        # The value had the right type for one alternative and broke its bounds: say that.
        for err in errors:
            if not err.wrong_type:
                raise err
        raise _not_a(where, self.describe(), value)

    def describe(self) -> str:
        return " or ".join(a.describe() for a in self.alternatives)


class ListOf(Field):
    __slots__ = ("item", "max_len", "min_len")

    def __init__(self, item: Field, max_len: int, min_len: int = 0) -> None:
        self.item, self.max_len, self.min_len = item, max_len, min_len

    def check(self, value: object, where: str) -> Any:
        if not isinstance(value, list):
            raise _not_a(where, "a list", value)
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


class AnyValue(Field):
    """Reply payloads: their shape is the request's business, the frame limits bound them."""

    __slots__ = ()

    def check(self, value: object, where: str) -> Any:
        return value

    def describe(self) -> str:
        return "any"

    def all_valid(self, values: list[Any]) -> bool:
        return True


class Struct(Field):
    """A map with known keys. ``open``: unknown keys are ignored (a newer peer's additions);
    closed structs (start specs, options, filters) refuse them, since a misspelt option
    silently ignored would capture something else than asked."""

    __slots__ = ("_checks", "_columns", "fields", "open", "rule")

    def __init__(
        self,
        fields: Mapping[str, tuple[Field, bool]],
        open: bool = False,
        rule: Callable[[dict[str, Any], str], None] | None = None,
    ) -> None:
        self.fields, self.open = fields, open
        #: Cross-field rule run after every field passed, e.g. a cycle's ordering.
        self.rule = rule
        # Bound methods looked up once: this loop runs for every message on both sockets.
        self._checks: tuple[tuple[str, Callable[[object, str], Any], bool], ...] = tuple(
            (n, f.check, r) for n, (f, r) in fields.items()
        )
        # Fields that can fail, for column checks (an optional ``any`` never does).
        self._columns: tuple[tuple[str, Callable[[Any], Any], Field, bool], ...] = tuple(
            (n, operator.itemgetter(n), f, r)
            for n, (f, r) in fields.items()
            if r or not isinstance(f, AnyValue)
        )

    def check(self, value: object, where: str) -> Any:
        if not isinstance(value, dict):
            raise _not_a(where, "a map", value)
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


class Cycles(Field):
    """``[warmup_start, start, stop)`` triples of absolute 1-indexed steps, in order."""

    __slots__ = ()

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


def _not_a(where: str, what: str, value: object) -> ProtocolError:
    """``value`` at ``where`` is not ``what`` at all (its type, not its bounds)."""
    exc = _bad(where, f"must be {what}, got {_kind(value)}")
    exc.wrong_type = True
    return exc


# --- names ---------------------------------------------------------------------------------------
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


_CYCLE_LIST: Final = ListOf(ListOf(Int(0, MAX_STEP), 3, 3), MAX_CYCLES, 1)


def cycles(value: object) -> list[tuple[int, int, int]]:
    """Cycles are ``[warmup_start, start, stop]`` triples of absolute 1-indexed steps."""
    return [(w, a, b) for w, a, b in Cycles().check(value, "cycles")]
