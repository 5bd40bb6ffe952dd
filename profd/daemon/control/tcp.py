"""The daemon's TCP control socket: CURVE-encrypted, every operator key checked over ZAP.

Opt-in with ``[cluster] listen``. The daemon proves itself with ``server_key`` (a pyzmq
``.key_secret`` file, 0600) and serves only clients whose public key is a ``.key`` file in
``authorized_keys``. It serves control requests, never the agent protocol: training
processes talk to ``agent.sock`` only, where the kernel vouches for them.

libzmq asks the ZAP handler (RFC 27) about every CURVE handshake; this module answers on
the daemon's own event loop, so a refused key is logged with the address it came from and
the keys are re-read when the directory changes, with no thread and no restart.
Handshakes that never reach ZAP (a client without CURVE, one that has a wrong server key)
are logged from a socket monitor.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

from profd.config import ClusterConfig, ConfigError
from profd_client import protocol as P

log = logging.getLogger("profd.tcp")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"profd"
#: The same refusal (address, reason, key) is logged at most once in this many seconds, and
#: at most ``LOG_BURST`` refusals in all: a scanner or a cron job with a stale key must not
#: flood the log.
LOG_EVERY = 60.0
LOG_BURST = 50
#: libzmq's ZMQ_PROTOCOL_ERROR_ZMTP_* values in EVENT_HANDSHAKE_FAILED_PROTOCOL.
_CRYPTOGRAPHIC = 0x11000001
_MECHANISM_MISMATCH = 0x11000002
_HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes


def _monitor_message(frames: list[bytes]) -> dict[str, Any]:
    # zmq.auth and zmq.utils.monitor (which loads asyncio) are loaded by a daemon that
    # listens on TCP only: imported at the top they were ~10 ms of every daemon's start
    # (importing the loop: 212 -> 205 ms p50 of 8 runs each, docs/benchmarks.md).
    from zmq.utils.monitor import parse_monitor_message

    return dict(parse_monitor_message(frames))


def load_server_key(path: Path) -> ServerKeys:
    """The daemon's key pair; refused unless the file is a secret key only its owner reads."""
    import zmq.auth  # only with TCP: _monitor_message says why

    try:
        st = path.stat()
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        msg = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(f"cluster.server_key {path}: {msg}") from None
    if not secret or not public:
        raise ConfigError(
            f"cluster.server_key {path} holds no secret key: give the .key_secret file"
        )
    if st.st_mode & 0o077:
        raise ConfigError(
            f"cluster.server_key {path} is readable by group or others"
            f" (mode {stat.S_IMODE(st.st_mode):04o}): chmod 600 it"
        )
    return ServerKeys(public, secret)


def load_authorized(directory: Path) -> dict[bytes, str]:
    """Public keys (z85) allowed to connect, each with its file's name for the log."""
    import zmq.auth  # only with TCP: _monitor_message says why

    try:
        st = directory.stat()
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise ConfigError(f"cluster.authorized_keys {directory}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"cluster.authorized_keys {directory}: not a directory")
    if st.st_mode & 0o002:
        # Anyone could add a key and become an operator of this daemon.
        raise ConfigError(f"cluster.authorized_keys {directory} is writable by others")
    keys: dict[bytes, str] = {}
    for name in names:
        if not name.endswith(".key"):
            continue
        path = directory / name
        if path.stat().st_mode & 0o002:
            raise ConfigError(f"cluster.authorized_keys: {path} is writable by others")
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cluster.authorized_keys: {path}: {exc}") from None
        if public:
            keys[public] = name[: -len(".key")]
    return keys


class TcpControl:
    """Owns the TCP ROUTER, its ZAP handler and its monitor; the loop polls all three."""

    def __init__(self, ctx: Any, cfg: ClusterConfig) -> None:
        if cfg.listen is None:
            raise ValueError("no [cluster] listen")
        if cfg.server_key is None or cfg.authorized_keys is None:
            raise ConfigError(
                "[cluster] listen needs server_key (the daemon's .key_secret file) and"
                " authorized_keys (a directory of operators' .key files)"
            )
        self.ctx = ctx
        self.listen = cfg.listen
        self.keys = load_server_key(cfg.server_key)
        self.keys_dir = cfg.authorized_keys
        self.authorized = load_authorized(self.keys_dir)
        self._keys_mtime = self._dir_mtime()
        if not self.authorized:
            log.warning("no operator keys in %s: every TCP client will be refused", self.keys_dir)
        self.zap: Any = None
        self.sock: Any = None
        self.monitor: Any = None
        self._logged: dict[tuple[str, str, str], float] = {}
        self.refused = 0

    def bind(self) -> None:
        # The ZAP handler first: a CURVE socket with no handler in its context lets any
        # key in.
        self.zap = self.ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        s.curve_server = True
        s.curve_publickey = self.keys.public
        s.curve_secretkey = self.keys.secret
        s.zap_domain = ZAP_DOMAIN
        self.monitor = s.get_monitor_socket(_HANDSHAKE_EVENTS)
        try:
            s.bind(self.listen)
        except zmq.ZMQError as exc:
            s.close(0)
            raise OSError(f"cannot listen on {self.listen}: {exc}") from None
        self.sock = s
        log.info(
            "control over TCP on %s (CURVE, %d operator key(s) in %s)",
            self.endpoint,
            len(self.authorized),
            self.keys_dir,
        )

    @property
    def endpoint(self) -> str:
        if self.sock is None:
            return self.listen
        return str(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def close(self) -> None:
        for s in (self.sock, self.monitor, self.zap):
            if s is not None:
                s.close(0)
        self.sock = self.monitor = self.zap = None

    # --- ZAP --------------------------------------------------------------------------------
    def handle_zap(self) -> None:
        while True:
            try:
                req = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.zap.send_multipart(self.answer(req))

    def answer(self, req: list[bytes]) -> list[bytes]:
        """One ZAP request -> its reply: ``200`` with the key's name as user id, or ``400``."""
        if len(req) < 6:
            return [b"1.0", req[1] if len(req) > 1 else b"", b"500", b"bad request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = req[:6]
        creds = req[6:]
        where = address.decode("utf-8", "replace")
        if version != b"1.0" or domain != ZAP_DOMAIN or mechanism != b"CURVE" or len(creds) != 1:
            self._refusal(where, "mechanism", mechanism.decode("ascii", "replace"))
            return [b"1.0", request_id, b"400", b"CURVE only", b"", b""]
        z85_key = z85.encode(creds[0])
        self._reload_if_changed()
        name = self.authorized.get(z85_key)
        if name is None:
            self._refusal(where, "unknown key", z85_key.decode("ascii"))
            return [b"1.0", request_id, b"400", b"Unknown key", b"", b""]
        log.debug("operator %s connected from %s", name, where)
        return [b"1.0", request_id, b"200", b"OK", name.encode(), b""]

    def _dir_mtime(self) -> float:
        try:
            return self.keys_dir.stat().st_mtime
        except OSError:
            return 0.0

    def _reload_if_changed(self) -> None:
        mtime = self._dir_mtime()
        if mtime == self._keys_mtime:
            return
        self._keys_mtime = mtime
        try:
            self.authorized = load_authorized(self.keys_dir)
        except ConfigError as exc:
            # Keep serving the keys that were valid; a half-copied directory is not a reason
            # to lock every operator out (nor to let anyone in).
            log.warning("keeping the previous operator keys: %s", exc)
            return
        log.info("operator keys reloaded: %d in %s", len(self.authorized), self.keys_dir)

    # --- handshakes ZAP never sees --------------------------------------------------------
    def handle_monitor(self) -> None:
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ev = _monitor_message(frames)
            # libzmq names the listening endpoint here, not the peer.
            if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._refusal("a TCP client", "handshake failed", "(closed during the handshake)")
            elif ev["value"] == _MECHANISM_MISMATCH:
                self._refusal("a TCP client", "handshake failed", "(no CURVE: not a profctl?)")
            elif ev["value"] == _CRYPTOGRAPHIC:
                self._refusal("a TCP client", "handshake failed", "(it has another server key)")
            else:
                self._refusal("a TCP client", "handshake failed", f"(error {ev['value']:#x})")

    def _refusal(self, where: str, kind: str, detail: str) -> None:
        self.refused += 1
        now = time.monotonic()
        self._logged = {k: t for k, t in self._logged.items() if now - t < LOG_EVERY}
        k = (where, kind, detail)
        if k in self._logged:
            return
        if len(self._logged) >= LOG_BURST:
            # Counted in status (tcp.refused) even when not logged.
            return
        self._logged[k] = now
        log.warning("refused control connection from %s: %s %s", where, kind, detail)
