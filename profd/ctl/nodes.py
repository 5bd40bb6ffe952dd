"""The daemons one profctl command talks to, as one node set with two transports.

The local daemon is a cluster of one node, reached over its unix socket
(:class:`profd.ctl.connection.LocalDaemon`); ``--cluster`` names many nodes, reached over
TCP with CURVE (:class:`profd.ctl.cluster.TcpNodes`). Both answer :meth:`NodeSet.ask` with
one :class:`Answer` per node, so a command is written once: it asks, merges what the nodes
said, names each row's node (:meth:`NodeLike.named`) and prints.

This module stays light (no ZeroMQ, no subprocess): ``profctl ps`` imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from profd.control_schema import listing_rows
from profd.ctl.errors import EXIT_AUTH_FAILED, EXIT_NODES_MISSING, CtlError, NoAnswer
from profd_client.protocol.envelope import ErrorCode, ProtocolError


class NodeLike(Protocol):
    """One daemon of a node set."""

    #: The daemon on this machine over its unix socket: its spool paths are this machine's,
    #: and its rows keep the client's own hostname as ``host`` (one node: nothing to tell
    #: apart), so a ``--host`` filter can be left to it.
    @property
    def local(self) -> bool: ...

    #: Where it was reached (``host:port``, or the control socket's path).
    @property
    def address(self) -> str: ...

    def named(self, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` (changed in place) with ``host`` saying where it is."""
        ...


#: A request's fields: the same for every node, or made for each one.
Fields = Mapping[str, Any] | Callable[[Any], Mapping[str, Any]]


class NodeSet(Protocol):
    """The nodes a command asks, and the transport that reaches them."""

    @property
    def nodes(self) -> Sequence[NodeLike]: ...

    @property
    def remote(self) -> bool:
        """``--cluster``: tables name each row's node (HOST), a document every node answers
        prints as one row per node, and a start is planned here for all nodes at once (one
        daemon plans its own sessions; several must be given the same steps)."""
        ...

    def ask(self, t: str, fields: Fields, nodes: Sequence[NodeLike] | None = None) -> list[Answer]:
        """Request ``t`` of every node (or of ``nodes``): one :class:`Answer` each, in order.
        A transport that reaches one node raises when that node cannot answer (nothing else
        could be said); one that reaches many says so in the answers."""
        ...

    def close(self) -> None: ...


# Plain classes, not dataclasses: building a dataclass costs ``profctl ps`` a few tenths of
# a millisecond at import, and it has little to spare.
class Answer:
    """One node's outcome for one request."""

    __slots__ = ("data", "error", "failure", "node", "received_at", "why")

    def __init__(
        self,
        node: NodeLike,
        data: Any = None,
        error: CtlError | None = None,
        failure: str | None = None,
        why: str = "",
        received_at: float = 0.0,
    ) -> None:
        self.node = node
        self.data = data
        #: The daemon answered with a refusal (unknown session, bad request, ...).
        self.error = error
        #: Why it did not answer at all: ``"timeout"`` or ``"auth"``; with ``why``.
        self.failure = failure
        self.why = why
        #: ``time.monotonic()`` when the reply came (a planner ages each node's steps from
        #: it).
        self.received_at = received_at

    def __repr__(self) -> str:
        return f"Answer({self.node.address}, error={self.error!r}, failure={self.failure!r})"

    @property
    def ok(self) -> bool:
        return self.error is None and self.failure is None


class Gathered:
    """Every node's answer to one request, and what the command tells about the rest."""

    __slots__ = ("answers",)

    def __init__(self, answers: list[Answer]) -> None:
        self.answers = answers

    @property
    def ok(self) -> list[Answer]:
        return [a for a in self.answers if a.ok]

    @property
    def missing(self) -> list[Answer]:
        return [a for a in self.answers if a.failure is not None]

    @property
    def exit_code(self) -> int:
        if any(a.failure == "auth" for a in self.answers):
            return EXIT_AUTH_FAILED
        return EXIT_NODES_MISSING if self.missing else 0

    def answered(self) -> list[Answer]:
        """The nodes that answered; when none did, a refusal is the result: one that is not
        ``unknown_session`` first (a node that does not know a session is no error while
        another node might). A node that found a short session id ambiguous is the result
        whatever the others said."""
        errors = [a.error for a in self.answers if a.error is not None]
        ambiguous = [e for e in errors if e.code == ErrorCode.AMBIGUOUS]
        if ambiguous:
            # A short id one node cannot tell apart names no one session, whatever the
            # other nodes found for it.
            raise ambiguous[0]
        ok = self.ok
        if ok:
            return ok
        if errors:
            other = [e for e in errors if e.code != ErrorCode.UNKNOWN_SESSION]
            raise (other or errors)[0]
        self.require_some()
        raise CtlError("no node answered")

    def rows(self) -> list[dict[str, Any]]:
        """The answering nodes' row lists as one (each as a table or as maps), each row
        naming its node."""
        out: list[dict[str, Any]] = []
        for a in self.answered():
            try:
                rows = listing_rows(a.data)
            except ProtocolError as exc:
                raise CtlError(f"bad reply from {a.node.address}: {exc}", code=exc.code) from None
            out.extend(a.node.named(r) for r in rows)
        return out

    def require_some(self) -> None:
        """Nobody answered: that is the whole result, one line and the exit code."""
        if self.answers and not self.ok and not any(a.error for a in self.answers):
            raise NoAnswer("; ".join(a.why for a in self.missing), self.exit_code)


def on_node(row: dict[str, Any], node: NodeLike) -> dict[str, Any]:
    """A daemon's row as a cluster row: ``host`` is the daemon's node name (what it calls
    itself, else the address it was reached at); a client's own different hostname (a pod
    name) stays as ``client_host``."""
    name = row.pop("node", None) or node.address
    own = row.get("host")
    if own is not None and own != name:
        row["client_host"] = own
    row["host"] = name
    return row
