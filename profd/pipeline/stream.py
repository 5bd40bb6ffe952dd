"""Reading a raw kineto Chrome trace one event at a time, in bounded memory.

A kineto trace is one JSON object: a few small top-level values (``schemaVersion``,
``deviceProperties``, ``distributedInfo``, ``traceName``...) and ``traceEvents``, an array
that holds nearly all of the file. ``json.loads`` on a 1 GB trace keeps every event as a dict
(several GB); :class:`TraceReader` instead reads the file in chunks and hands out the events
one by one, so what it holds at any time is one chunk and the top-level values.

Each event is decoded by the C scanner behind ``json.loads`` (``JSONDecoder.scan_once``) on
a sliding text buffer; only the punctuation between events is looked at in Python. The bytes
are decoded incrementally as UTF-8 with ``errors="replace"``, like ``bytes.decode`` on the
whole file would: a multi-byte character split between two chunks is put back together, and
an undecodable byte in some op name costs that character, not the trace.

Use: :meth:`TraceReader.head` (the keys before ``traceEvents``), then :meth:`events`, then
:meth:`tail` (the keys after it, up to the end of the file). Anything that is not a JSON
object with a ``traceEvents`` array raises :class:`TraceFormatError` saying where.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, cast

#: Bytes read from the file at a time.
CHUNK_BYTES = 1 << 20
#: No single JSON value (an event, a top-level value) may be longer than this: a value that
#: does not end within it is malformed, and reading on would hold the rest of the file.
MAX_VALUE_CHARS = 64 << 20
# A scan error this close to the end of the buffer may only mean the value goes on in the next
# chunk ("tru", "-Infin", "\u12"...); further in, it is an error in the file.
_NEAR_END = 16
# Matches at every position (maybe nothing), so the match is never None.
_ws = cast("Callable[[str, int], re.Match[str]]", re.compile(r"[ \t\n\r]*").match)
_Scan = Callable[[str, int], tuple[Any, int]]


class TraceFormatError(ValueError):
    """The file is not a Chrome trace JSON object; the message says where and why."""


class TraceReader:
    """One pass over a raw Chrome trace; ``head``, ``events`` and ``tail``, in that order."""

    def __init__(
        self, raw: BinaryIO, name: str = "raw trace", chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self._raw = raw
        self._name = name
        self._chunk = max(1, chunk_bytes)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # The C scanner json.loads runs on (set up by JSONDecoder.__init__; not in typeshed).
        self._scan: _Scan = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
        self._buf = ""
        self._pos = 0  # next unread character of _buf
        self._base = 0  # characters of the file before _buf[0], for error positions
        self._eof = False
        self._state = "start"
        self.events_read = 0  # elements of traceEvents handed out so far

    # --- the three parts, in file order ---------------------------------------------------------
    def head(self) -> dict[str, Any]:
        """The top-level keys before ``traceEvents``, in file order; stops at its ``[``.

        Raises if the object ends without a ``traceEvents`` key or its value is no array.
        """
        self._expect_state("start", "head")
        self._skip_ws()
        if self._peek() == "\ufeff":  # a BOM is no JSON, but no reason to drop a trace either
            self._pos += 1
            self._skip_ws()
        c = self._peek()
        if c == "":
            raise self._error("not a Chrome trace (the file is empty)")
        if c != "{":
            raise self._error("not a Chrome trace (no JSON object at the top)")
        self._pos += 1
        out: dict[str, Any] = {}
        first = True
        while True:
            key = self._key(first)
            if key is None:
                raise self._error("not a Chrome trace (no traceEvents list)")
            first = False
            if key == "traceEvents":
                self._skip_ws()
                if self._peek() != "[":
                    raise self._error("not a Chrome trace (traceEvents is not a list)")
                self._pos += 1
                self._state = "events"
                return out
            out[key] = self._value()
            if not self._comma_or_end("}"):
                raise self._error("not a Chrome trace (no traceEvents list)")

    def events(self) -> Iterator[Any]:
        """The elements of ``traceEvents``, decoded one at a time, in file order."""
        self._expect_state("events", "events")
        self._state = "events-running"
        self._skip_ws()
        if self._peek() == "]":
            self._pos += 1
            self._state = "tail"
            return
        scan, ws = self._scan, _ws
        while True:
            # The hot path: the value and the delimiter after it are both inside the buffer.
            buf, pos = self._buf, self._pos
            n = len(buf)
            try:
                value, end = scan(buf, pos)
            except (StopIteration, json.JSONDecodeError, RecursionError):
                value, end = self._value_slow(), -1
            else:
                if end >= n - _NEAR_END:  # a number ("1e" + "5") may go on in the next chunk
                    value, end = self._value_slow(), -1
            if end < 0:
                buf, pos = self._buf, self._pos
                n = len(buf)
            else:
                pos = end
            self.events_read += 1
            yield value
            pos = ws(buf, pos).end()
            if pos < n:
                c = buf[pos]
                if c == ",":
                    self._pos = ws(buf, pos + 1).end()
                    if self._pos >= n:
                        self._skip_ws()
                    continue
                if c == "]":
                    self._pos = pos + 1
                    self._state = "tail"
                    return
            self._pos = pos
            if not self._comma_or_end("]"):
                self._state = "tail"
                return
            self._skip_ws()

    def tail(self) -> dict[str, Any]:
        """The top-level keys after ``traceEvents``, in file order, up to the end of the file."""
        self._expect_state("tail", "tail")
        out: dict[str, Any] = {}
        if self._comma_or_end("}"):
            while True:
                key = self._key(False)
                if key is None:
                    break
                if key == "traceEvents":
                    raise self._error("not a Chrome trace (traceEvents appears twice)")
                out[key] = self._value()
                if not self._comma_or_end("}"):
                    break
        self._skip_ws()
        if self._peek() != "":
            raise self._error("not valid JSON (extra data after the top-level object)")
        self._state = "done"
        return out

    # --- tokens -------------------------------------------------------------------------------
    def _key(self, first: bool) -> str | None:
        """The next key and its colon, or None at the object's ``}`` (only where allowed)."""
        self._skip_ws()
        c = self._peek()
        if c == "}" and first:
            self._pos += 1
            return None
        if c != '"':
            raise self._error("not valid JSON (expecting a property name in double quotes)")
        key = self._value()
        self._skip_ws()
        if self._peek() != ":":
            raise self._error("not valid JSON (expecting ':' delimiter)")
        self._pos += 1
        self._skip_ws()
        assert isinstance(key, str)
        return key

    def _comma_or_end(self, close: str) -> bool:
        """After a value: True past a ``,``, False past ``close``; anything else is an error."""
        self._skip_ws()
        c = self._peek()
        if c == ",":
            self._pos += 1
            return True
        if c == close:
            self._pos += 1
            return False
        if c == "":
            raise self._error("not valid JSON (the file ends early: truncated?)")
        raise self._error(f"not valid JSON (expecting ',' or '{close}' delimiter)")

    def _value(self) -> Any:
        self._skip_ws()
        return self._value_slow()

    def _value_slow(self) -> Any:
        """The JSON value at the current position, reading more of the file while it may go on."""
        while True:
            buf, pos = self._buf, self._pos
            n = len(buf)
            try:
                value, end = self._scan(buf, pos)
            except StopIteration as stop:
                # The scanner stops with where it found no value: in a nested one, that is
                # inside this value, not at its start.
                at = stop.value if isinstance(stop.value, int) else pos
                if not self._eof and at >= n - _NEAR_END:
                    self._more()
                    continue
                if self._eof and at >= n:
                    raise self._error("not valid JSON (the file ends early: truncated?)") from None
                raise self._error("not valid JSON (expecting a value)", at) from None
            except json.JSONDecodeError as exc:
                if not self._eof and (
                    exc.msg.startswith("Unterminated string") or exc.pos >= n - _NEAR_END
                ):
                    self._more()
                    continue
                if self._eof and exc.msg.startswith("Unterminated string"):
                    raise self._error(
                        "not valid JSON (the file ends inside a string: truncated?)"
                    ) from None
                msg = exc.msg.removesuffix(" at")  # "Invalid control character at"
                raise self._error(f"not valid JSON ({msg})", exc.pos) from None
            except RecursionError:
                raise self._error("not a Chrome trace (a value nested too deeply)") from None
            # A value that ends near the end of the buffer may be a number cut short ("1" of
            # "1e-5"): it is read again with more text behind it.
            if end >= n - _NEAR_END and not self._eof:
                self._more()
                continue
            self._pos = end
            return value

    # --- the buffer ----------------------------------------------------------------------------
    def _peek(self) -> str:
        """The character at the current position, reading on if needed; "" at the end."""
        if self._pos >= len(self._buf):
            while not self._eof and self._pos >= len(self._buf):
                self._read()
            if self._pos >= len(self._buf):
                return ""
        return self._buf[self._pos]

    def _skip_ws(self) -> None:
        while True:
            self._pos = _ws(self._buf, self._pos).end()
            if self._pos < len(self._buf) or self._eof:
                return
            self._read()

    def _more(self) -> None:
        """Read at least as much again as the value under way holds (so retries stay linear)."""
        pending = len(self._buf) - self._pos
        if pending > MAX_VALUE_CHARS:
            raise self._error(
                f"not valid JSON (a value longer than {MAX_VALUE_CHARS:,} characters: malformed?)"
            )
        target = pending + max(pending, self._chunk)
        while not self._eof and len(self._buf) - self._pos < target:
            self._read()

    def _read(self) -> None:
        data = self._raw.read(self._chunk)
        text = self._utf8.decode(data, final=not data)
        if not data:
            self._eof = True
        # Drop what was consumed before appending: the buffer holds one value and one chunk.
        if self._pos:
            self._base += self._pos
            self._buf = self._buf[self._pos :] + text
            self._pos = 0
        else:
            self._buf += text

    # --- errors --------------------------------------------------------------------------------
    def _expect_state(self, state: str, what: str) -> None:
        if self._state != state:
            raise RuntimeError(f"TraceReader.{what}() called in state {self._state}")

    def _error(self, msg: str, pos: int | None = None) -> TraceFormatError:
        at = self._base + (self._pos if pos is None else pos)
        return TraceFormatError(f"{self._name}: {msg} at character {at}")
