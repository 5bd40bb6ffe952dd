"""profctl as the coordinator of many daemons: node lists, CURVE keys, and the fan-out that
sends one control request to every node in parallel and collects what each one said.

A node's outcome is one of: its answer, its refusal (the daemon's error, e.g. an unknown
session), or no answer: down or too slow (``--node-timeout``), or the handshake refused
(unknown key, wrong server key), seen on a socket monitor as it happens rather than as a
timeout.
"""

from __future__ import annotations

import contextlib
import copy
import os
import resource
import shutil
import stat
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profd import control_schema as C
from profd.config import DEFAULT_CLUSTER_PORT
from profd.ctl.connection import decode_reply
from profd.ctl.errors import BadUsage, CtlError
from profd.ctl.nodes import Answer, Fields, NodeLike, on_node
from profd_client import protocol as P

DEFAULT_NODE_TIMEOUT = 5.0
#: Descriptors a node costs while its request is open: its TCP connection, and slack.
_FDS_PER_NODE = 2


@dataclass(frozen=True)
class Node:
    host: str
    port: int = DEFAULT_CLUSTER_PORT

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.address}"

    @property
    def local(self) -> bool:
        return False

    def named(self, row: dict[str, Any]) -> dict[str, Any]:
        return on_node(row, self)


def parse_node(text: str) -> Node:
    """``host``, ``host:port``, ``[v6addr]:port``."""
    t = text.strip()
    host, port = t, DEFAULT_CLUSTER_PORT
    if t.startswith("["):
        end = t.find("]")
        if end < 0:
            raise BadUsage(f"bad node {text!r}: no closing ]")
        host, rest = t[1:end], t[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise BadUsage(f"bad node {text!r}")
            port = _port(rest[1:], text)
    elif t.count(":") == 1:
        host, p = t.split(":")
        port = _port(p, text)
    if not host or any(c.isspace() for c in host):
        raise BadUsage(f"bad node {text!r}")
    return Node(host, port)


def _port(p: str, text: str) -> int:
    if not p.isdigit() or not 0 < int(p) < 65536:
        raise BadUsage(f"bad node {text!r}: port must be 1-65535")
    return int(p)


def parse_nodes(
    spec: str,
    env: Mapping[str, str] | None = None,
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> list[Node]:
    """``--cluster``: ``host[:port],...``, ``@FILE`` (one per line, ``#`` comments), or
    ``slurm[:JOBID]`` (``scontrol show hostnames``; the job is ``SLURM_JOB_ID`` when not
    given). Duplicates are dropped, order kept."""
    e = os.environ if env is None else env
    s = spec.strip()
    if s.startswith("@"):
        try:
            lines = Path(s[1:]).expanduser().read_text().splitlines()
        except OSError as exc:
            raise BadUsage(f"--cluster {s}: {exc.strerror or exc}") from None
        items = [ln.split("#", 1)[0].strip() for ln in lines]
    elif s == "slurm" or s.startswith("slurm:"):
        job = s[len("slurm:") :]
        if not job and e.get("SLURM_JOB_NODELIST"):
            # Inside the allocation: its own node list, no lookup of the job.
            items = _scontrol(["show", "hostnames", e["SLURM_JOB_NODELIST"]], "slurm", run).split()
        else:
            items = slurm_hosts(job or e.get("SLURM_JOB_ID") or "", run)
    else:
        items = s.split(",")
    nodes = list(dict.fromkeys(parse_node(i) for i in items if i.strip()))
    if not nodes:
        raise BadUsage(f"--cluster {spec!r} names no nodes")
    return nodes


def slurm_hosts(
    job: str, run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run
) -> list[str]:
    if not job:
        raise CtlError("--cluster slurm: no job id (give slurm:JOBID or set SLURM_JOB_ID)")
    if not job.isdigit() and not job.replace("_", "").isdigit():
        raise BadUsage(f"--cluster slurm:{job}: not a job id")
    # The job's nodelist (``gpu[01-04]``) expanded by SLURM itself: no home-made parser.
    hosts_of = _nodelist(_scontrol(["show", "job", job], f"slurm:{job}", run))
    if hosts_of is None:
        raise CtlError(f"--cluster slurm:{job}: the job has no nodes (yet)")
    return _scontrol(["show", "hostnames", hosts_of], f"slurm:{job}", run).split()


def _scontrol(
    args: list[str], what: str, run: Callable[..., subprocess.CompletedProcess[str]]
) -> str:
    exe = shutil.which("scontrol")
    if exe is None:
        raise CtlError(f"--cluster {what}: scontrol not found on PATH")
    try:
        r = run([exe, *args], capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CtlError(f"--cluster {what}: scontrol: {exc}") from None
    if r.returncode != 0:
        why = (r.stderr or r.stdout).strip().splitlines()
        raise CtlError(f"--cluster {what}: {why[-1] if why else 'scontrol failed'}")
    return str(r.stdout)


def _nodelist(show_job: str) -> str | None:
    """``NodeList=gpu[01-04]`` from ``scontrol show job``; None while it has none."""
    for word in show_job.split():
        if word.startswith("NodeList="):
            value = word[len("NodeList=") :]
            return value if value and value != "(null)" else None
    return None


# --- keys --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server: bytes  # the daemons' public key
    #: No ``--key``: a throwaway key pair, which no daemon knows; said in the refusal.
    ephemeral: bool = False


def load_keys(key_file: str | None, server_key_file: str | None) -> ClientKeys:
    import zmq
    import zmq.auth

    if not server_key_file:
        raise BadUsage(
            "--cluster needs the daemons' public key: --server-key FILE, PROFD_SERVER_KEY or"
            " [cluster] server_key"
        )
    try:
        server, _ = zmq.auth.load_certificate(server_key_file)
    except (OSError, ValueError) as exc:
        raise BadUsage(f"--server-key {server_key_file}: {exc}") from None
    if not key_file:
        public, secret = zmq.curve_keypair()
        return ClientKeys(public, secret, server, ephemeral=True)
    try:
        mode = os.stat(key_file).st_mode
        public, secret_or_none = zmq.auth.load_certificate(key_file)
    except (OSError, ValueError) as exc:
        raise BadUsage(f"--key {key_file}: {exc}") from None
    if secret_or_none is None:
        raise CtlError(f"--key {key_file}: not a secret key (give the .key_secret file)")
    if mode & 0o077:
        raise CtlError(
            f"--key {key_file} is readable by group or others (mode"
            f" {stat.S_IMODE(mode):04o}): chmod 600 it"
        )
    return ClientKeys(public, secret_or_none, server)


# --- the fan-out -------------------------------------------------------------------------
@dataclass
class _Conn:
    """One node's connection on the fan-out's socket, kept across requests."""

    node: Node
    #: The routing id the socket gives this connection: a reply names its node by it. New
    #: for every connection, so a reply a dropped connection still delivers is recognised
    #: as stale.
    rid: bytes


@dataclass
class _Pending:
    conn: _Conn
    index: int
    deadline: float


class _Round:
    """One :meth:`Fanout.ask`: an answer per node, and the requests still open."""

    __slots__ = ("answers", "by_deadline", "keep", "pending")

    def __init__(self, nodes: Sequence[Node], keep: bool) -> None:
        self.answers = [Answer(n) for n in nodes]
        #: At most one request per node is open (a node listed twice is asked once).
        self.pending: dict[Node, _Pending] = {}
        # In deadline order (one timeout for all, so the order sent in): expiring and the
        # next wake-up look at its head, not at every node.
        self.by_deadline: deque[_Pending] = deque()
        #: Whether connections stay open after the round (all fit in the window).
        self.keep = keep


def _window(n: int) -> int:
    """How many nodes may have a request open at once: as many as descriptors allow."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n * _FDS_PER_NODE + 64
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (OSError, ValueError):
            pass
    if soft == resource.RLIM_INFINITY:
        return n
    return max(1, min(n, (soft - 64) // _FDS_PER_NODE))


class Fanout:
    """Requests to many nodes at once, over connections kept for the whole command.

    One ROUTER socket connects to every node, naming each connection with its own routing
    id (``ZMQ_CONNECT_ROUTING_ID``): a request goes to a node by that id and its reply
    comes back with it. A socket per node cost more in Python than the handshakes do in
    C at a thousand nodes (making, polling and closing two thousand sockets). One monitor
    on that socket reports failed handshakes by endpoint, so a refused key is named at
    once instead of timing out.

    A cluster ``start`` asks every node twice (probe, then start) and ``--wait`` many more
    times: each CURVE handshake is CPU work on both sides, so a node's connection is made
    once and reused, unless there are more nodes than descriptors for all of them (then
    each request's connections close after it). A node that timed out or failed its
    handshake is disconnected: a late reply must not answer the next request.
    """

    def __init__(self, keys: ClientKeys, timeout: float = DEFAULT_NODE_TIMEOUT) -> None:
        import zmq

        self.keys = keys
        self.timeout = timeout
        self._zmq = zmq
        self._ctx: Any = None
        self._sock: Any = None
        self._monitor: Any = None
        self._poller: Any = None
        self._conns: dict[Node, _Conn] = {}
        self._by_rid: dict[bytes, _Conn] = {}
        self._serial = 0
        #: Resolved ``tcp://ip:port`` endpoints, for monitor events that name those instead
        #: of the address connected to (libzmq does after a reconnect).
        self._resolved: dict[str, Node] = {}

    def __enter__(self) -> Fanout:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._ctx is None:
            return
        self._conns.clear()
        self._by_rid.clear()
        self._monitor.close(0)
        self._sock.close(0)
        self._ctx.term()
        self._ctx = self._sock = self._monitor = self._poller = None

    def ask(
        self,
        nodes: Sequence[Node],
        t: str,
        fields: Mapping[str, Any] | Callable[[Node], Mapping[str, Any]],
    ) -> list[Answer]:
        """Send request ``t`` to every node at once and wait up to the timeout for each; one
        :class:`Answer` per node, in the nodes' order. ``fields`` may differ per node."""
        unique = list(dict.fromkeys(nodes))
        if len(unique) < len(nodes):
            # A node listed twice is asked once: two requests in flight on one connection
            # could not be told apart.
            by_node = {a.node: a for a in self.ask(unique, t, fields)}
            return [copy.copy(by_node[n]) for n in nodes]
        frames = self._encode(nodes, t, fields)
        reach = len(set(nodes) | set(self._conns))
        window = _window(reach)
        rnd = _Round(nodes, keep=reach <= window)
        sock = self._socket()
        todo = list(range(len(nodes)))
        todo.reverse()
        try:
            while todo or rnd.pending:
                while todo and len(rnd.pending) < window:
                    i = todo.pop()
                    self._send(rnd, sock, nodes[i], i, frames[i])
                while rnd.by_deadline and rnd.by_deadline[0].conn.node not in rnd.pending:
                    rnd.by_deadline.popleft()  # answered already
                now = time.monotonic()
                first = rnd.by_deadline[0].deadline if rnd.by_deadline else now
                ready = dict(self._poller.poll(max(0, int((first - now) * 1000) + 1)))
                if self._monitor in ready:
                    for node, why in self._auth_failures():
                        found = rnd.pending.get(node)
                        if found is not None:
                            a = rnd.answers[found.index]
                            a.failure, a.why = "auth", why
                            self._settle(rnd, found, drop=True)
                if sock in ready:
                    self._take_replies(rnd, sock)
                self._expire(rnd)
        except BaseException:
            self.close()
            raise
        return rnd.answers

    def _encode(
        self,
        nodes: Sequence[Node],
        t: str,
        fields: Mapping[str, Any] | Callable[[Node], Mapping[str, Any]],
    ) -> dict[int, bytes]:
        """Each node's request frame, by its index in ``nodes``."""
        frames: dict[int, bytes] = {}
        for i, n in enumerate(nodes):
            f = fields(n) if callable(fields) else fields
            try:
                frames[i] = C.encode(t, **f)
            except P.ProtocolError as exc:
                # The daemons would refuse it the same way: say so without a round trip.
                raise CtlError(str(exc), code=exc.code) from None
        return frames

    def _send(self, rnd: _Round, sock: Any, node: Node, i: int, frame: bytes) -> None:
        c = self._conns.get(node) or self._connect(node)
        p = _Pending(c, i, time.monotonic() + self.timeout)
        # The empty frame makes the envelope a REQ's, which the daemon expects.
        sock.send_multipart([c.rid, b"", frame])
        rnd.pending[c.node] = p
        rnd.by_deadline.append(p)

    def _settle(self, rnd: _Round, p: _Pending, drop: bool) -> None:
        """``p`` is answered (or failed): its node may be asked again; its connection is
        dropped when it failed, or when the connections are not kept."""
        del rnd.pending[p.conn.node]
        if drop or not rnd.keep:
            self._drop(p.conn)

    def _take_replies(self, rnd: _Round, sock: Any) -> None:
        """Every reply waiting on the socket into its answer; stale ones are dropped."""
        zmq = self._zmq
        while True:
            try:
                reply = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            conn = self._by_rid.get(reply[0])
            found = rnd.pending.get(conn.node) if conn is not None else None
            if conn is None or found is None or found.conn is not conn:
                continue  # no request open on that connection now: stale
            a = rnd.answers[found.index]
            a.received_at = time.monotonic()
            try:
                a.data = decode_reply(reply[-1], f"profd at {conn.node.address}")
            except CtlError as exc:
                a.error = exc
            self._settle(rnd, found, drop=False)

    def _expire(self, rnd: _Round) -> None:
        """Fail the open requests whose deadline has passed."""
        now = time.monotonic()
        while rnd.by_deadline and rnd.by_deadline[0].deadline <= now:
            p = rnd.by_deadline.popleft()
            if rnd.pending.get(p.conn.node) is not p:
                continue
            a = rnd.answers[p.index]
            a.failure = "timeout"
            a.why = f"{p.conn.node.address} did not answer within {self.timeout:g}s"
            self._settle(rnd, p, drop=True)

    def _socket(self) -> Any:
        if self._sock is not None:
            return self._sock
        zmq = self._zmq
        self._ctx = zmq.Context(io_threads=2)  # CURVE handshakes are CPU work
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, P.MAX_REPLY_BYTES)
        # A request to a connection that is gone fails loudly instead of vanishing.
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.curve_publickey = self.keys.public
        s.curve_secretkey = self.keys.secret
        s.curve_serverkey = self.keys.server
        self._monitor = s.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        self._poller = zmq.Poller()
        self._poller.register(s, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._sock = s
        return s

    def _connect(self, node: Node) -> _Conn:
        self._serial += 1
        c = _Conn(node, b"n%d" % self._serial)
        # Set before connect: the pipe is made, and named, by connect() itself, so a request
        # sent now waits in it for the handshake.
        self._sock.setsockopt(self._zmq.CONNECT_ROUTING_ID, c.rid)
        self._sock.connect(node.endpoint)
        self._conns[node] = c
        self._by_rid[c.rid] = c
        return c

    def _drop(self, c: _Conn) -> None:
        if self._conns.get(c.node) is not c:
            return
        del self._conns[c.node]
        del self._by_rid[c.rid]
        with contextlib.suppress(self._zmq.ZMQError):
            self._sock.disconnect(c.node.endpoint)

    def _auth_failures(self) -> list[tuple[Node, str]]:
        """The nodes whose handshake the monitor saw fail, each with why."""
        from zmq.utils.monitor import parse_monitor_message

        zmq = self._zmq
        out: list[tuple[Node, str]] = []
        while True:
            try:
                ev = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return out
            node = self._node_at(ev["endpoint"].decode(errors="replace"))
            if node is None:
                continue
            if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                why = f"authentication failed for {node.address}: " + (
                    "no --key given, and the daemon accepts only its authorized keys"
                    if self.keys.ephemeral
                    else "the daemon does not know this profctl's key"
                )
            elif ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                why = (
                    f"authentication failed for {node.address}: the handshake failed"
                    " (is --server-key that daemon's public key?)"
                )
            else:
                why = (
                    f"authentication failed for {node.address}: not a profd TCP control"
                    " socket (no CURVE)"
                )
            out.append((node, why))

    def _node_at(self, endpoint: str) -> Node | None:
        """The connected node a monitor event's endpoint names."""
        for node in self._conns:
            if node.endpoint == endpoint:
                return node
        if endpoint not in self._resolved:
            import socket

            for node in self._conns:
                try:
                    found = socket.getaddrinfo(node.host, node.port, type=socket.SOCK_STREAM)
                except OSError:
                    continue
                for *_, addr in found:
                    ip = str(addr[0])
                    ip = f"[{ip}]" if ":" in ip else ip
                    self._resolved.setdefault(f"tcp://{ip}:{node.port}", node)
        node_at = self._resolved.get(endpoint)
        return node_at if node_at in self._conns else None


class TcpNodes:
    """``--cluster``'s nodes as a node set: TCP with CURVE, one :class:`Fanout` for the
    command. The node list is resolved (SLURM asked) and the keys read when first needed."""

    remote = True

    def __init__(
        self,
        spec: str,
        key_file: str | None,
        server_key_file: str | None,
        timeout: float = DEFAULT_NODE_TIMEOUT,
    ) -> None:
        self.spec = spec
        self._keys = (key_file, server_key_file)
        self.timeout = timeout
        self._nodes: list[Node] | None = None
        self._fanout: Fanout | None = None

    @property
    def nodes(self) -> Sequence[NodeLike]:
        if self._nodes is None:
            self._nodes = parse_nodes(self.spec)
        return self._nodes

    def ask(self, t: str, fields: Fields, nodes: Sequence[NodeLike] | None = None) -> list[Answer]:
        asked = [_tcp(n) for n in (self.nodes if nodes is None else nodes)]
        if self._fanout is None:
            self._fanout = Fanout(load_keys(*self._keys), self.timeout)
        return self._fanout.ask(asked, t, fields)

    def close(self) -> None:
        if self._fanout is not None:
            self._fanout.close()
            self._fanout = None


def _tcp(node: NodeLike) -> Node:
    if not isinstance(node, Node):
        raise TypeError(f"{node.address} is not a TCP node")
    return node
