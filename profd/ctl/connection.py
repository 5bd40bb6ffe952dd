"""profctl's side of control.sock: one request, one reply, clear errors; and the local
daemon as a node set of one (:class:`LocalDaemon`), the unix socket its transport."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from profd import control_schema as C
from profd.ctl import zmtp
from profd.ctl.errors import CtlCode, CtlError, NoDaemon
from profd.ctl.nodes import Answer, Fields, NodeLike
from profd_client.locations import locate_socket
from profd_client.protocol import envelope as P

DEFAULT_TIMEOUT_MS = 10_000


class Connection:
    def __init__(self, runtime_dir: str | None, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        found = locate_socket(P.CONTROL_SOCKET, runtime_dir)
        self.looked = found.looked
        self.path = found.path if found.path is not None else found.looked[0]
        #: Where a socket someone else controls was found: a forged daemon could answer there.
        self.untrusted = found.untrusted
        #: Nothing trusted to connect to: the request is refused without connecting.
        self.refused = found.path is None
        self.timeout_ms = timeout_ms
        self._sock: zmtp.ReqSocket | None = None

    def _untrusted(self) -> CtlError:
        return CtlError(
            f"refusing {self.untrusted}; set --runtime-dir or PROFD_RUNTIME_DIR to the"
            " daemon's runtime dir",
            code=CtlCode.UNTRUSTED,
        )

    def _missing(self) -> CtlError:
        if self.untrusted is not None:
            # "No daemon" would hide that someone else's dir is where the daemon's should be.
            return self._untrusted()
        for p in self.looked:
            d = Path(p).parent
            if d.is_dir() and not os.access(d, os.X_OK):
                # The daemon's runtime dir exists but is closed to us: say so, not "no daemon".
                return _denied(d)
        where = ", ".join(str(p) for p in self.looked)
        return NoDaemon(f"no profd daemon running (looked for {where})")

    @property
    def where(self) -> str:
        """The daemon as messages name it."""
        return f"profd at {self.path}"

    def request(self, t: str, **fields: Any) -> Any:
        """The reply's ``data``; any failure, the daemon's refusal included, as CtlError."""
        return decode_reply(self.exchange(t, **fields), self.where)

    def exchange(self, t: str, **fields: Any) -> bytes:
        """Send request ``t`` and return the reply frame undecoded; CtlError (NoDaemon when
        nothing answers) if there is no reply."""
        if self.refused and self.untrusted is not None:
            raise self._untrusted()
        try:
            os.stat(self.path)
        except PermissionError:
            raise _denied(Path(self.path).parent) from None
        except OSError:
            raise self._missing() from None
        if not os.access(self.path, os.R_OK | os.W_OK):
            raise _denied(Path(self.path))
        try:
            request = C.encode(t, **fields)
        except P.ProtocolError as exc:
            # The daemon would refuse it the same way: say so without a round trip.
            raise CtlError(str(exc), code=exc.code) from None
        if self._sock is None:
            self._sock = zmtp.ReqSocket(str(self.path), P.MAX_REPLY_BYTES)
        try:
            return self._sock.request(request, self.timeout_ms / 1000)
        except zmtp.Timeout:
            seconds = self.timeout_ms / 1000
            raise NoDaemon(f"{self.where} did not answer in {seconds:.0f}s") from None
        except PermissionError:
            raise _denied(Path(self.path)) from None
        except zmtp.Error as exc:
            if not exc.sent:
                # Nothing answers there (a socket file a killed daemon left, say): said at
                # once, where pyzmq retried the connect in silence until the timeout.
                raise NoDaemon(f"no profd daemon running at {self.path}: {exc}") from None
            raise NoDaemon(f"{self.where} did not answer: {exc}") from None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class LocalNode:
    """The daemon on this machine, reached at its control socket."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    @property
    def local(self) -> bool:
        return True

    @property
    def address(self) -> str:
        return self.path

    def named(self, row: dict[str, Any]) -> dict[str, Any]:
        # A row keeps what the daemon said (the client's own ``host``, the daemon's
        # ``node``); one without a host (a session) is on the daemon's node.
        if "host" not in row and "node" in row:
            row["host"] = row["node"]
        return row


class LocalDaemon:
    """The local daemon as a node set of one: as cheap as one :class:`Connection`
    (``profctl ps`` at a thousand clients has little time to spare)."""

    remote = False

    def __init__(self, runtime_dir: str | None, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        self.conn = Connection(runtime_dir, timeout_ms)
        self.nodes: Sequence[NodeLike] = [LocalNode(str(self.conn.path))]

    def ask(self, t: str, fields: Fields, nodes: Sequence[NodeLike] | None = None) -> list[Answer]:
        out: list[Answer] = []
        for node in self.nodes if nodes is None else nodes:
            frame = self.conn.exchange(t, **(fields(node) if callable(fields) else fields))
            a = Answer(node, received_at=time.monotonic())
            try:
                a.data = decode_reply(frame, self.conn.where)
            except CtlError as exc:
                a.error = exc
            out.append(a)
        return out

    def close(self) -> None:
        self.conn.close()


def decode_reply(frame: bytes, where: str) -> Any:
    """A control reply's ``data``; the daemon's refusal or an unreadable reply as CtlError.
    ``where`` names the daemon in messages: ``profd at /run/profd/control.sock``."""
    try:
        msg = P.decode(frame, C.REPLY_INBOUND, reply=True)
    except P.ProtocolError as exc:
        if exc.code == P.ErrorCode.VERSION:
            raise CtlError(
                f"{where} answered in another protocol version ({exc});"
                " upgrade profctl or the daemon so they match",
                code=P.ErrorCode.VERSION,
            ) from None
        raise CtlError(f"bad reply from {where}: {exc}", code=exc.code) from None
    if msg["t"] == P.ERROR:
        if msg["code"] == P.ErrorCode.VERSION:
            raise CtlError(
                f"{where} does not speak this profctl's protocol: {msg['msg']}",
                code=P.ErrorCode.VERSION,
            )
        raise CtlError(msg["msg"], code=msg["code"])
    return msg.get("data")


def _denied(path: Path) -> CtlError:
    return CtlError(
        f"permission denied on {path}: run as the daemon's user or a member of its group"
        " ([daemon] group in profd.toml)",
        code=P.ErrorCode.PERMISSION,
    )
