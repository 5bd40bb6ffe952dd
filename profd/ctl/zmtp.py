"""profctl's request to the local daemon, spoken on its unix socket without pyzmq.

The daemon's ``control.sock`` is a ZeroMQ ROUTER. A one-shot ``profctl`` needs one REQ
exchange with it, and importing pyzmq for that (its constants, its sugar, a context with an
I/O thread) cost ~30 ms of a ``profctl ps`` that has ~100 ms in all on a quick machine
(docs/benchmarks.md). This module is that one exchange in plain Python: ZMTP 3.0 (ZeroMQ
RFC 23) with the NULL mechanism, as a REQ socket speaks it, over ``AF_UNIX``. Everything
else (CURVE over TCP to other nodes, the daemon itself) stays with pyzmq.

One request at a time, in order, as REQ allows. What could go wrong is an :class:`Error`
with a sentence, never a hang: every read has the caller's deadline.
"""

from __future__ import annotations

# The C module: ``socket`` itself turns every constant into an enum as it is imported, ~10 ms
# of a command that has ~100 in all (the point of this module).
import _socket
import time
from typing import Final

#: Signature, version 3.0, mechanism NULL, not a server, filler (RFC 23: 64 bytes in all).
_GREETING: Final = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
#: The peer types a REQ may talk to.
_PEERS: Final = (b"ROUTER", b"REP")
#: The longest command taken (READY's metadata, a PING, an ERROR are a few dozen bytes).
_MAX_COMMAND: Final = 1 << 16
#: The most frames a reply may have (profd's: the delimiter and one).
_MAX_FRAMES: Final = 8
#: The most bytes asked of one ``recv``: a long frame is read in pieces, never allocated
#: whole on the word of its header.
_CHUNK: Final = 1 << 22


class Error(Exception):
    """The exchange failed; ``sent`` says whether the request may have reached the peer."""

    def __init__(self, why: str, sent: bool) -> None:
        super().__init__(why)
        self.sent = sent


class Timeout(Error):
    """No whole reply before the deadline."""


def _command(name: bytes, body: bytes) -> bytes:
    data = bytes([len(name)]) + name + body
    if len(data) > 255:
        return bytes([_COMMAND | _LONG]) + len(data).to_bytes(8, "big") + data
    return bytes([_COMMAND, len(data)]) + data


def _frame(payload: bytes, more: bool) -> bytes:
    flags = _MORE if more else 0
    if len(payload) > 255:
        return bytes([flags | _LONG]) + len(payload).to_bytes(8, "big") + payload
    return bytes([flags, len(payload)]) + payload


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + len(value).to_bytes(4, "big") + value


_READY: Final = _command(b"READY", _property(b"Socket-Type", b"REQ"))


def _properties(data: bytes) -> dict[bytes, bytes]:
    """A READY command's metadata: name (1-byte length), value (4-byte length), repeated."""
    out: dict[bytes, bytes] = {}
    i = 0
    while i < len(data):
        n = data[i]
        name = data[i + 1 : i + 1 + n]
        i += 1 + n
        if i + 4 > len(data):
            raise ValueError("truncated property")
        size = int.from_bytes(data[i : i + 4], "big")
        i += 4
        if i + size > len(data):
            raise ValueError("truncated property value")
        out[name.lower()] = data[i : i + size]
        i += size
    return out


class ReqSocket:
    """A REQ peer on the unix socket at ``path``: :meth:`request` sends one message and
    returns the one reply. Replies over ``max_reply`` bytes are refused."""

    def __init__(self, path: str, max_reply: int) -> None:
        self.path = path
        self.max_reply = max_reply
        self._sock: _socket.socket | None = None
        self._buf = bytearray()
        self._deadline = 0.0
        self._sent = False

    # --- the exchange -------------------------------------------------------------------
    def request(self, payload: bytes, timeout_s: float) -> bytes:
        """Send ``payload`` and return the reply. :class:`Error` when the connection fails or
        closes, :class:`Timeout` when no reply came in ``timeout_s``; after either the
        connection is closed, and the next request makes a new one."""
        self._deadline = time.monotonic() + timeout_s
        self._sent = False
        if self._sock is not None and self._gone():
            self.close()  # the daemon restarted since the last request: a new connection
        kept = self._sock is not None
        try:
            if self._sock is None:
                self._connect()
            self._send(_frame(b"", more=True) + _frame(payload, more=False))
            self._sent = True
            return self._reply()
        except Error as exc:
            self.close()
            if kept and not exc.sent:
                # A kept connection the peer closed after sending something unread: the
                # request never left, so it goes once more, on a new connection.
                return self.request(payload, max(0.0, self._deadline - time.monotonic()))
            raise
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buf.clear()

    # --- the connection -----------------------------------------------------------------
    def _connect(self) -> None:
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        self._sock = s
        try:
            s.settimeout(self._left())
            s.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise Error("nothing listens on it", sent=False) from None
        except TimeoutError:
            raise Timeout("the connection was not accepted in time", sent=False) from None
        except PermissionError:
            raise  # as it is: the caller says whose directory it is
        except OSError as exc:  # a full listen backlog (EAGAIN), say
            raise Error(f"cannot connect: {exc.strerror or exc}", sent=False) from None
        # The greeting and READY in one write, and the peer's read back: one round trip
        # through the daemon's I/O thread (busy at 1,024 clients) instead of two. libzmq
        # reads a READY that follows the greeting as the handshake goes on (the request in
        # that same write made it drop the connection: it waits for the READY back).
        self._send(_GREETING + _READY)
        greeting = self._read(64)
        if greeting[0] != 0xFF or greeting[9] & 1 != 1 or greeting[10] < 3:
            raise Error("the peer does not speak ZMTP 3 (is it a profd daemon?)", sent=False)
        if greeting[12:32].rstrip(b"\0") != b"NULL":
            raise Error("the peer wants a security mechanism other than NULL", sent=False)
        name, body = self._next_command()
        if name != b"READY":
            raise Error(f"the peer sent {name!r} instead of READY", sent=False)
        try:
            kind = _properties(body).get(b"socket-type")
        except ValueError as exc:
            raise Error(f"the peer's READY is malformed: {exc}", sent=False) from None
        if kind not in _PEERS:
            raise Error(f"the peer is a {kind!r} socket, not a ROUTER", sent=False)

    def _gone(self) -> bool:
        """Whether the peer closed a connection kept from an earlier request (readable with
        nothing to read: the end of the stream)."""
        assert self._sock is not None
        self._sock.setblocking(False)
        try:
            return self._sock.recv(1, _socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _reply(self) -> bytes:
        frames: list[bytes] = []
        total = 0
        while True:
            flags, size = self._header()
            if flags & _COMMAND:
                self._on_command(self._read(size))
                continue
            total += size
            if total > self.max_reply:
                raise Error(f"a reply of {total} bytes (the limit is {self.max_reply})", True)
            frames.append(self._read(size))
            if not flags & _MORE:
                break
            if len(frames) >= _MAX_FRAMES:
                raise Error(f"a reply of more than {_MAX_FRAMES} frames", sent=True)
        # A REQ reply is the empty delimiter, then the message: profd's is one frame.
        if len(frames) != 2 or frames[0] != b"":
            raise Error(f"a reply of {len(frames)} frames is not a profd reply", sent=True)
        return frames[1]

    def _on_command(self, data: bytes) -> None:
        n = data[0] if data else 0
        name, body = data[1 : 1 + n], data[1 + n :]
        if name == b"PING" and len(body) >= 2:  # ZMTP 3.1 heartbeat: PONG with its context
            self._send(_command(b"PONG", body[2:18]))
        elif name == b"ERROR":
            why = body[1 : 1 + body[0]].decode(errors="replace") if body else ""
            raise Error(f"the peer refused the connection: {why}", sent=self._sent)

    def _next_command(self) -> tuple[bytes, bytes]:
        flags, size = self._header()
        data = self._read(size)
        if not flags & _COMMAND or not data or len(data) < 1 + data[0]:
            raise Error("the peer sent a message before its READY", sent=False)
        return data[1 : 1 + data[0]], data[1 + data[0] :]

    def _header(self) -> tuple[int, int]:
        flags = self._read(1)[0]
        if flags & ~(_MORE | _LONG | _COMMAND):
            raise Error(f"a frame with unknown flags {flags:#x}", sent=self._sent)
        size = int.from_bytes(self._read(8 if flags & _LONG else 1), "big")
        if flags & _COMMAND and size > _MAX_COMMAND:
            raise Error(f"a command of {size} bytes from the peer", sent=self._sent)
        return flags, size

    # --- bytes ----------------------------------------------------------------------------
    def _left(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise Timeout("no answer in time", sent=self._sent)
        return left

    def _send(self, data: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.settimeout(self._left())
            self._sock.sendall(data)
        except TimeoutError:
            raise Timeout("the peer took no more of the request", sent=self._sent) from None
        except (BrokenPipeError, ConnectionResetError):
            raise Error("the peer closed the connection", sent=self._sent) from None
        except OSError as exc:
            raise Error(f"cannot send: {exc.strerror or exc}", sent=self._sent) from None

    def _read(self, n: int) -> bytes:
        assert self._sock is not None
        buf = self._buf
        while len(buf) < n:
            try:
                self._sock.settimeout(self._left())
                chunk = self._sock.recv(min(_CHUNK, max(65536, n - len(buf))))
            except TimeoutError:
                raise Timeout("no answer in time", sent=self._sent) from None
            except ConnectionResetError:
                chunk = b""
            except OSError as exc:
                raise Error(f"cannot read: {exc.strerror or exc}", sent=self._sent) from None
            if not chunk:
                raise Error("the peer closed the connection", sent=self._sent)
            buf += chunk
        out = bytes(buf[:n])
        del buf[:n]
        return out
