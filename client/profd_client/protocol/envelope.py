"""The envelope: versions, framing, and reading and writing one message.

Every message is a msgpack map with ``v`` (protocol version) and ``t`` (type). Peers speak
ZeroMQ: training processes use a DEALER socket against the daemon's ROUTER on ``agent.sock``;
profctl uses a REQ socket against the daemon's ROUTER on ``control.sock``. This module knows
nothing about sockets, policy or any one message: it splits and joins routing envelopes,
unpacks with limits, checks ``v`` and ``t``, and hands the rest to the schema of the type
(``accept``, a mapping from type to schema, names the types a receiver takes). Anything that
does not match raises :class:`ProtocolError`, whose ``code`` is an :class:`ErrorCode`.
"""

from __future__ import annotations

import enum
import gc
from collections.abc import Mapping
from typing import Any, Final, Protocol, Union

import msgpack

#: The release of profd and profd_client (one distribution, one version string).
RELEASE: Final = "0.3.0"

#: The version this code speaks. A daemon serves every version in ``SUPPORTED_VERSIONS``
#: and answers each peer in the version the peer spoke (a job outlives daemon upgrades);
#: ``adapter`` turns messages into and out of an older version's shape.
#: 2: ``welcome`` carries ``protocol`` (the daemon's supported range); fields are bounded.
#: 3: ``hb`` carries ``ledger`` (the step times and region times since the last heartbeat).
VERSION: Final = 3
MIN_VERSION: Final = 1
SUPPORTED_VERSIONS: Final = range(MIN_VERSION, VERSION + 1)

#: Inbound frame limit, applied with ``zmq.MAXMSGSIZE`` on every daemon socket.
MAX_FRAME_BYTES: Final = 1 << 20
#: profctl accepts larger replies (trace listings).
MAX_REPLY_BYTES: Final = 256 << 20
MAX_ERROR_TEXT: Final = 64 << 10
MAX_ERROR_CODE: Final = 64

AGENT_SOCKET: Final = "agent.sock"
CONTROL_SOCKET: Final = "control.sock"

#: The one message type this module writes itself: the answer to a refused frame.
ERROR: Final = "error"


class ErrorCode(enum.StrEnum):
    """The ``code`` of an ``error`` message, on both sockets. A ``StrEnum``: members are
    the strings on the wire, so a code read from a frame compares equal to its member.
    ``docs/protocol.md`` ("Error codes") lists each; a unit test keeps the two the same."""

    # A frame refused by the protocol itself, by any receiver.
    MALFORMED = "malformed"
    VERSION = "version"
    TYPE = "type"
    BAD_REQUEST = "bad_request"
    TOO_LARGE = "too_large"
    # The daemon's answers on agent.sock.
    UNKNOWN_CLIENT = "unknown_client"
    IDENTITY = "identity"
    LIMIT = "limit"
    # A client's refusal of an arm, in the ``error`` of its ``progress``.
    NOT_ALLOWED = "not_allowed"
    # The daemon's answers on control.sock.
    NO_MATCH = "no_match"
    STEPS_PASSED = "steps_passed"
    BUSY = "busy"
    SPOOL_FULL = "spool_full"
    UNSUPPORTED = "unsupported"
    UNREACHABLE = "unreachable"
    UNKNOWN_SESSION = "unknown_session"
    AMBIGUOUS = "ambiguous"
    FINISHED = "finished"
    NOT_FOUND = "not_found"
    PERMISSION = "permission"
    UNSERVABLE = "unservable"
    INTERNAL = "internal"


class ProtocolError(ValueError):
    """A frame that is not a valid message. ``code`` goes into the ``error`` reply."""

    def __init__(self, code: ErrorCode, message: str, path: str = "", why: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.path = path  # the field, for bad_request: "start.spec.ranks"
        self.why = why
        #: The value was not of the kind its field takes at all (a string for a number), as
        #: opposed to out of its bounds: an alternative of a ``OneOf`` that is not the
        #: value's kind is passed over on this, never on the text.
        self.wrong_type = False
        #: Set by :func:`decode`: what the frame unpacked to (None if it was not msgpack),
        #: and the version to answer in, so a peer of another version can read why.
        self.raw: object = None
        self.reply_v: int = VERSION

    def reply(self) -> bytes:
        """The ``error`` frame that answers the refused frame."""
        return error(self.code, str(self), v=self.reply_v)


def bad(where: str, why: str) -> ProtocolError:
    """A ``bad_request`` naming the field, in one line: ``hb.ledger.n: why``."""
    return ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: {why}", where, why)


def within(exc: ProtocolError, prefix: str) -> ProtocolError:
    """``exc`` about a nested field, named from ``prefix`` down. Paths are built only on
    error: formatting one per field and list item on every valid message is what a busy
    daemon would pay for otherwise."""
    if exc.code != ErrorCode.BAD_REQUEST:
        return exc
    return bad(prefix + exc.path, exc.why)


class Schema(Protocol):
    """What a message type's definition offers the envelope: check a whole message (its
    ``v`` and ``t`` included) and return it, or raise :class:`ProtocolError` naming the
    field, ``where`` being the message type. A typed one (``typed.Typed``) also has
    ``type``, the msgspec ``Struct`` a frame is decoded into."""

    def check(self, value: object, where: str) -> Any: ...


class Inbound(dict[str, Schema]):
    """The types a receiver accepts, each with its schema. The typed ones are read by one
    msgspec decoder over the tagged union of their ``Struct``s (``t`` the tag): frame to
    validated message in one pass, whatever the order of its keys. A frame it refuses is
    read again the hand-written way, which says why (the code and the one-line text) as
    for any other frame; so is a frame of a type without a ``Struct``."""

    def __init__(self, schemas: Mapping[str, Schema]) -> None:
        super().__init__(schemas)
        types = tuple(s.type for s in schemas.values() if hasattr(s, "type"))
        self.fast: Any = None
        if types:
            # Here, not at the top: profctl reads replies without msgspec (a fifth of its
            # start-up), and only typed receivers build this.
            import msgspec

            union: Any = types[0] if len(types) == 1 else Union[types]  # noqa: UP007
            self.fast = msgspec.msgpack.Decoder(union)


# --- envelopes, encoding, decoding --------------------------------------------------------------
def split_envelope(frames: list[bytes]) -> tuple[list[bytes], bytes]:
    """A ROUTER's ``[routing id, (empty delimiter,) payload]`` as (envelope, payload).

    REQ peers (profctl) add the empty delimiter, DEALER peers (clients) do not; replies go
    back in the same envelope. Anything else is not a message.
    """
    if len(frames) == 2 or (len(frames) == 3 and frames[1] == b""):
        return frames[:-1], frames[-1]
    raise ProtocolError(ErrorCode.MALFORMED, f"expected one payload frame, got {len(frames) - 1}")


def join_envelope(envelope: list[bytes], payload: bytes) -> list[bytes]:
    return [*envelope, payload]


def encode_with(schemas: Mapping[str, Schema], t: str, v: int, fields: dict[str, Any]) -> bytes:
    """Pack one message of type ``t`` with ``fields``, validated against ``schemas``: a
    message this side would refuse to receive is a bug here, and must not leave
    (``ProtocolError``)."""
    msg: dict[str, Any] = {"v": v, "t": t}
    msg.update(fields)
    schema = schemas.get(t)
    if schema is None:
        raise ProtocolError(ErrorCode.TYPE, f"no message type {t!r}")
    schema.check(msg, t)
    data: bytes = msgpack.packb(msg, use_bin_type=True)
    return data


def unpack(frame: bytes, reply: bool = False) -> object:
    """msgpack with limits that stop a small hostile frame from declaring huge containers.

    ``reply``: a daemon's reply to profctl, which may list many traces.
    """
    limit = MAX_REPLY_BYTES if reply else MAX_FRAME_BYTES
    if len(frame) > limit:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {len(frame)} bytes (at most {limit})")
    # A reply may hold 100,000s of maps and lists, all alive until it is read: the collector
    # would walk them dozens of times while they are made (msgpack's own advice; a fifth of
    # reading 1,024 ``ps`` rows). A frame to the daemon or a client is small.
    paused = reply and gc.isenabled()
    if paused:
        gc.disable()
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
        raise ProtocolError(ErrorCode.MALFORMED, f"not msgpack: {type(exc).__name__}") from None
    finally:
        if paused:
            gc.enable()


def decode(frame: bytes, accept: Mapping[str, Schema], reply: bool = False) -> Any:
    """Unpack one frame, check its version and validate it; only types in ``accept`` pass.

    Every receiver (both daemon sockets, the client, profctl) reads frames through here. A
    frame refused raises :class:`ProtocolError` with ``raw`` (what it unpacked to) and
    ``reply_v`` (the version to answer in) set: ``exc.reply()`` is the answer.

    The message is a map, or for a typed type (``typed.Message``) its ``Struct``, which
    also answers ``msg["t"]``, ``msg["v"]`` and ``key in msg``.
    """
    fast = accept.fast if isinstance(accept, Inbound) else None
    if fast is not None and len(frame) <= MAX_FRAME_BYTES:
        import msgspec  # loaded already: ``fast`` is its decoder

        try:
            return fast.decode(frame)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            # Read again below, which says why in the usual words (a frame nested too deep,
            # even in a field nobody reads, is ``malformed``, never an escaping exception).
            pass
    raw: object = None
    try:
        raw = unpack(frame, reply)
        return validate(raw, accept)
    except ProtocolError as exc:
        exc.raw, exc.reply_v = raw, reply_version(raw)
        raise


def check_header(msg: object, accept: Mapping[str, Schema]) -> dict[str, Any]:
    """The envelope fields alone: a map, a supported ``v``, an accepted ``t``."""
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "message is not a map")
    v = msg.get("v")
    if not isinstance(v, int) or isinstance(v, bool) or v not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            ErrorCode.VERSION,
            f"unsupported protocol version {v!r}: this side speaks {MIN_VERSION}..{VERSION}",
        )
    t = msg.get("t")
    if not isinstance(t, str) or t not in accept:
        raise ProtocolError(ErrorCode.TYPE, f"unexpected message type {str(t)[:40]!r}")
    return msg


def validate(msg: object, accept: Mapping[str, Schema]) -> dict[str, Any]:
    m = check_header(msg, accept)
    t = m["t"]
    out: dict[str, Any] = accept[t].check(m, t)
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


def error(code: ErrorCode | str, message: str, *, v: int = VERSION) -> bytes:
    """The ``error`` message. Built here rather than through a schema: it is valid by
    construction (``code`` and ``message`` cut to their bounds), and every receiver checks
    it against ``agent.SCHEMAS[ERROR]`` all the same."""
    if not 0 <= v < (1 << 16):
        raise ProtocolError(ErrorCode.VERSION, f"no version {v!r} to answer in")
    msg = {"v": v, "t": ERROR, "code": str(code)[:MAX_ERROR_CODE], "msg": message[:MAX_ERROR_TEXT]}
    data: bytes = msgpack.packb(msg, use_bin_type=True)
    return data
