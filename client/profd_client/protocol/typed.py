"""Typed messages: a message type defined once as a msgspec ``Struct``, decoded and validated
from msgpack in one pass, and read by attribute.

A typed type's :class:`Typed` schema stands where a hand-written ``Struct`` would (in
``agent.SCHEMAS`` and the receivers' inbound maps): ``check`` validates a map being sent,
``type`` lets :func:`.envelope.decode` read a frame straight into the ``Struct``. Errors
name the field in one line, as the hand-written schemas do: ``hb.ledger.n: Expected `int`,
got `str```. Messages are open maps (a newer peer's extra fields are ignored); a closed
nested map says ``forbid_unknown_fields=True``.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from .envelope import MIN_VERSION, VERSION, ErrorCode, ProtocolError, bad

#: The ``v`` every typed message carries; a bad one is refused as ``version`` before any
#: typed decoding is trusted (see ``envelope.decode``).
Version = msgspec.Meta(ge=MIN_VERSION, le=VERSION)


class Message(msgspec.Struct, tag_field="t", forbid_unknown_fields=False):
    """A typed message; subclasses set ``tag`` (the wire's ``t``)."""

    v: int

    @property
    def t(self) -> str:
        tag: str = self.__struct_config__.tag  # type: ignore[assignment]
        return tag

    # What a generic receiver reads of any message, typed or not: ``msg["t"]``, ``msg["v"]``.
    def __getitem__(self, key: str) -> Any:
        value = getattr(self, key)
        if value is msgspec.UNSET:
            raise KeyError(key)
        return value

    def __contains__(self, key: str) -> bool:
        return getattr(self, key, msgspec.UNSET) is not msgspec.UNSET


def fields_of(s: msgspec.Struct) -> dict[str, Any]:
    """A nested ``Struct``'s fields that were sent (unset ones left out), as a map."""
    return {k: x for k, x in msgspec.structs.asdict(s).items() if x is not msgspec.UNSET}


_AT: Final = " - at `$"


def refusal(t: str, exc: msgspec.ValidationError) -> ProtocolError:
    """msgspec's "Expected `int`, got `str` - at `$.ledger.n`" as the one-line
    ``bad_request`` the hand-written schemas give: ``hb.ledger.n: Expected ...``."""
    text = str(exc)
    if text.startswith(t + ".") or text.startswith(t + ":"):
        return ProtocolError(ErrorCode.BAD_REQUEST, text)  # a rule's own, already named
    why, sep, path = text.partition(_AT)
    return bad(t + (path.rstrip("`") if sep else ""), why)


class Typed:
    """The schema of a typed message type, for the envelope and for senders."""

    def __init__(self, type_: type[Message]) -> None:
        self.type = type_
        #: Its type name on the wire (``t``).
        self.t: str = type_.__struct_config__.tag  # type: ignore[assignment]
        #: Its fields but ``v``, as a hand-written ``Struct``'s ``fields`` names them.
        self.fields: tuple[str, ...] = tuple(f for f in type_.__struct_fields__ if f != "v")

    def check(self, value: object, where: str) -> Any:
        try:
            return msgspec.convert(value, self.type)
        except msgspec.ValidationError as exc:
            raise refusal(where, exc) from None
