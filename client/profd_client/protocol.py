"""The profd wire protocol: the one place message types and their fields are defined.

Every message is a msgpack map with ``v`` (protocol version) and ``t`` (type). Peers speak
ZeroMQ: training processes use a DEALER socket against the daemon's ROUTER on ``agent.sock``;
profctl uses a REQ socket against the daemon's ROUTER on ``control.sock``. This module knows
nothing about sockets or policy: it encodes, decodes and validates, and raises
:class:`ProtocolError` for anything that does not match the schema below.

``docs/protocol.md`` describes every message listed here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import msgpack

VERSION: Final = 1

#: Inbound frame limit, applied with ``zmq.MAXMSGSIZE`` on every daemon socket.
MAX_FRAME_BYTES: Final = 1 << 20
#: profctl accepts larger replies (trace listings).
MAX_REPLY_BYTES: Final = 256 << 20

AGENT_SOCKET: Final = "agent.sock"
CONTROL_SOCKET: Final = "control.sock"


class ProtocolError(ValueError):
    """A frame that is not a valid message. ``code`` goes into the ``error`` reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# --- schema ---------------------------------------------------------------------------------
# A field spec is (accepted python types, required). msgpack gives int/float/str/bool/None/
# list/dict/bytes; the validator checks types only one level deep on purpose: nested maps are
# checked by the code that consumes them (schedules, options) where the rules live.

_Spec = tuple[tuple[type, ...], bool]
_INT: Final = (int,)
_NUM: Final = (int, float)
_STR: Final = (str,)
_OPT_STR: Final = (str, type(None))
_OPT_INT: Final = (int, type(None))
_LIST: Final = (list,)
_MAP: Final = (dict,)
_BOOL: Final = (bool,)

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

SCHEMAS: Final[dict[str, dict[str, _Spec]]] = {
    HELLO: {
        "pid": (_INT, True),
        "host": (_STR, True),
        "job": (_STR, True),
        "role": (_STR, True),
        "rank": (_INT, True),
        "local_rank": (_INT, True),
        "world_size": (_INT, True),
        "step": (_INT, True),
        "step_mode": (_STR, True),
        "allowed": (_BOOL, True),
        "client_version": (_STR, True),
        "torch": (_OPT_STR, False),
        "device": (_OPT_STR, False),
        # Sessions this process is still working on (armed plans), so a restarted daemon
        # knows the target is alive and busy.
        "sessions": (_LIST, False),
        # The Nsight Systems session the process runs under (``profctl run --nsys``), if any.
        "nsys_session": (_OPT_STR, False),
        # attach() is blocked until the welcome (``attach(wait=...)``): step 1 has not begun,
        # so ``[[auto]]`` rules may arm it; their ``arm`` is sent before the ``welcome``.
        "waiting": (_BOOL, False),
    },
    HEARTBEAT: {"step": (_INT, False), "sps": (_NUM, False), "state": (_STR, False)},
    # ``plan``: the revision of the session's steps the message is about (``arm``'s ``plan``).
    ARMED: {"session": (_STR, True), "cycles": (_LIST, True), "plan": (_INT, False)},
    PROGRESS: {
        "id": (_INT, True),
        "session": (_STR, True),
        "state": (_STR, True),
        "step": (_INT, True),
        "error": (_OPT_STR, False),
        "plan": (_INT, False),
    },
    CAPTURED: {
        "id": (_INT, True),
        "session": (_STR, True),
        "job": (_STR, True),
        "cycle": (_INT, True),
        "steps": (_LIST, True),
        "files": (_LIST, True),
        "started_at": (_NUM, True),
        "ended_at": (_NUM, True),
        "stall_ms": (_NUM, True),
        "error": (_OPT_STR, False),
        "region": (_OPT_STR, False),
        "torch": (_OPT_STR, False),
        "device": (_OPT_STR, False),
        "notes": (_LIST, False),
        "plan": (_INT, False),
    },
    BYE: {},
    WELCOME: {
        "spool": (_STR, True),
        "hb_interval": (_NUM, True),
        "daemon": (_STR, True),
    },
    ARM: {
        "session": (_STR, True),
        "job": (_STR, True),
        "backend": (_STR, True),
        "cycles": (_LIST, True),
        "options": (_MAP, True),
        "region": (_OPT_STR, False),
        "incoming": (_STR, True),
        # Bumped each time the daemon moves a --next session's steps (a rank got the first
        # plan too late); a client replaces a held plan only with a higher revision.
        "plan": (_INT, False),
    },
    DISARM: {"session": (_STR, True), "keep": (_BOOL, True)},
    ACK: {"id": (_INT, True)},
    ERROR: {"code": (_STR, True), "msg": (_STR, True)},
    OK: {"data": ((object,), False)},
    C_STATUS: {},
    C_PS: {"job": (_OPT_STR, False), "role": (_OPT_STR, False)},
    C_START: {"spec": (_MAP, True)},
    C_STOP: {"session": (_STR, True)},
    C_CANCEL: {"session": (_STR, True)},
    C_SESSIONS: {
        "state": (_OPT_STR, False),
        "job": (_OPT_STR, False),
        "limit": (_OPT_INT, False),
    },
    C_SHOW: {"session": (_STR, True)},
    C_TRACES: {"filters": (_MAP, True)},
    C_RETRY: {"session": (_OPT_STR, False)},
}

#: Which types each socket accepts from its peers: agent peers can only report about
#: themselves; only control peers can start or stop sessions.
AGENT_INBOUND: Final = frozenset({HELLO, HEARTBEAT, ARMED, PROGRESS, CAPTURED, BYE})
CLIENT_INBOUND: Final = frozenset({WELCOME, HEARTBEAT, ARM, DISARM, ACK, ERROR})
CONTROL_INBOUND: Final = frozenset(
    {C_STATUS, C_PS, C_START, C_STOP, C_CANCEL, C_SESSIONS, C_SHOW, C_TRACES, C_RETRY}
)
REPLY_INBOUND: Final = frozenset({OK, ERROR})


def encode(t: str, **fields: Any) -> bytes:
    """Pack one message of type ``t``."""
    msg: dict[str, Any] = {"v": VERSION, "t": t}
    msg.update(fields)
    data: bytes = msgpack.packb(msg, use_bin_type=True)
    return data


def decode(frame: bytes, accept: frozenset[str]) -> dict[str, Any]:
    """Unpack and validate one frame; only types in ``accept`` pass."""
    if len(frame) > MAX_REPLY_BYTES:
        raise ProtocolError("too_large", f"frame of {len(frame)} bytes")
    try:
        # Limits stop a small hostile frame from declaring huge containers.
        msg = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=1 << 20,
            max_bin_len=1 << 20,
            max_array_len=1 << 17,
            max_map_len=1 << 12,
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
    return validate(msg, accept)


def validate(msg: object, accept: frozenset[str]) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise ProtocolError("malformed", "message is not a map")
    v = msg.get("v")
    if v != VERSION:
        raise ProtocolError("version", f"unsupported protocol version {v!r} (want {VERSION})")
    t = msg.get("t")
    if not isinstance(t, str) or t not in accept:
        raise ProtocolError("type", f"unexpected message type {t!r}")
    for name, (types, required) in SCHEMAS[t].items():
        if name not in msg:
            if required:
                raise ProtocolError("field", f"{t}: missing field {name!r}")
            continue
        value = msg[name]
        # bool is an int subclass; a bool where an int is wanted is still a type error.
        if types != (object,) and (
            not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        ):
            raise ProtocolError("field", f"{t}: field {name!r} has type {type(value).__name__}")
    return msg


def error(code: str, message: str) -> bytes:
    return encode(ERROR, code=code, msg=message)


def ok(data: object = None) -> bytes:
    return encode(OK, data=data)


def str_list(value: object, name: str) -> list[str]:
    """A nested list of strings from a validated message, or ProtocolError."""
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ProtocolError("field", f"{name} must be a list of strings")
    return value


def int_list(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    ):
        raise ProtocolError("field", f"{name} must be a list of integers")
    return value


def cycles(value: object) -> list[tuple[int, int, int]]:
    """Cycles are ``[warmup_start, start, stop)`` triples of absolute 1-indexed steps."""
    if not isinstance(value, list):
        raise ProtocolError("field", "cycles must be a list")
    out = []
    for c in value:
        if not (isinstance(c, list) and len(c) == 3):
            raise ProtocolError("field", "each cycle is [warmup_start, start, stop]")
        w, a, b = int_list(c, "cycle")
        if not (1 <= w <= a < b):
            raise ProtocolError("field", f"cycle {c} is not 1 <= warmup_start <= start < stop")
        out.append((w, a, b))
    return out


def options(value: Mapping[str, Any]) -> dict[str, Any]:
    """Capture options: known keys only, each a bool except ``activities``."""
    out: dict[str, Any] = {}
    for k, v in value.items():
        if k == "activities":
            acts = str_list(v, "activities")
            bad = [a for a in acts if a not in ACTIVITIES]
            if bad or not acts:
                raise ProtocolError("field", f"activities must be from {sorted(ACTIVITIES)}")
            out[k] = acts
        elif k in BOOL_OPTIONS:
            if not isinstance(v, bool):
                raise ProtocolError("field", f"option {k} must be a bool")
            out[k] = v
        else:
            raise ProtocolError("field", f"unknown option {k!r}")
    return out


_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-+=@:")


def safe_name(value: str, what: str) -> str:
    """Names that become path components (job, role, session) must stay one component."""
    if not value or len(value) > 200 or value[0] == "." or not set(value) <= _SAFE:
        raise ProtocolError(
            "field", f"{what} {value[:60]!r} must be 1-200 of [A-Za-z0-9._-+=@:], not starting '.'"
        )
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
#: Set by ``profctl run --nsys`` for the launched job: the nsys session to drive.
NSYS_SESSION_ENV: Final = "PROFD_NSYS_SESSION"
