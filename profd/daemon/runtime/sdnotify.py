"""A dependency-free client of systemd's notify protocol (``sd_notify(3)``).

The unit runs profd with ``Type=notify`` and ``WatchdogSec=``. systemd then treats the daemon
as started only once it says ``READY=1`` (after its sockets are bound, so units ordered after
it find ``agent.sock``), and restarts it when ``WATCHDOG=1`` stops arriving, which is what a
wedged event loop looks like from outside: the process is alive, nothing is served.

The protocol is a datagram of ``KEY=VALUE`` lines sent to the ``AF_UNIX`` socket named in
``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace). libsystemd is not a
dependency: the protocol is a dozen lines, and profd must run the same way outside systemd
(the tests, a developer's shell), where ``$NOTIFY_SOCKET`` is unset and every call here does
nothing.

Nothing here raises into the daemon. Telling systemd is worth a log line when it fails, never
a crash: the first failure is a warning, later ones are debug lines.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger("profd")


def parse_address(value: str | None) -> str | None:
    """The ``AF_UNIX`` address in ``$NOTIFY_SOCKET``, or None when there is none we can use.

    ``@name`` is the abstract namespace, which the socket API spells with a leading NUL.
    Other schemes newer systemd versions may hand out (``vsock:...``) are not spoken here.
    """
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_timeout(env: Mapping[str, str], pid: int) -> float | None:
    """The watchdog timeout systemd enforces, in seconds, or None when there is none for us.

    ``$WATCHDOG_USEC`` is the timeout. ``$WATCHDOG_PID``, when set, names the process the
    watchdog is meant for; a child that inherited the environment must not ping for it.
    """
    usec = env.get("WATCHDOG_USEC", "")
    owner = env.get("WATCHDOG_PID", "")
    try:
        timeout = int(usec)
        if owner and int(owner) != pid:
            return None
    except ValueError:
        return None
    return timeout / 1_000_000 if timeout > 0 else None


def _message(fields: Mapping[str, str | int]) -> bytes:
    # One assignment per line: a newline inside a value would start a bogus assignment.
    lines = (f"{k}={' '.join(str(v).splitlines())}" for k, v in fields.items())
    return "\n".join(lines).encode("utf-8", "replace")


class Notifier:
    """Tells systemd the daemon's state; does nothing when not started with ``Type=notify``.

    The watchdog is pinged at half the timeout (what ``sd_watchdog_enabled(3)`` advises), so
    one late loop iteration does not get the daemon killed but a stuck one does.
    """

    def __init__(self, env: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        env = os.environ if env is None else env
        self.pid = os.getpid() if pid is None else pid
        self.address = parse_address(env.get("NOTIFY_SOCKET"))
        timeout = watchdog_timeout(env, self.pid) if self.address is not None else None
        self.ping_every = timeout / 2 if timeout is not None else None
        self.next_ping = -math.inf if self.ping_every is not None else math.inf
        self._sock: socket.socket | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, fields: Mapping[str, str | int]) -> bool:
        """Send one notification; True when it was handed to the socket."""
        if self.address is None:
            return False
        try:
            if self._sock is None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # A receiver that stops reading must not block the event loop: drop instead.
                s.setblocking(False)
                self._sock = s
            self._sock.sendto(_message(fields), self.address)
            return True
        except (OSError, ValueError) as exc:
            where = self.address.replace("\0", "@")
            if not self._failed:
                self._failed = True
                log.warning("cannot notify systemd at %s: %s (later failures at debug)", where, exc)
            else:
                log.debug("cannot notify systemd at %s: %s", where, exc)
            return False

    def ready(self, status: str = "") -> bool:
        """``READY=1``: the sockets are bound and the loop is about to serve."""
        fields: dict[str, str | int] = {"READY": 1, "MAINPID": self.pid}
        if status:
            fields["STATUS"] = status
        return self.send(fields)

    def stopping(self, status: str = "") -> bool:
        """``STOPPING=1``: shutdown has begun; systemd stops watching the watchdog and times
        the stop with ``TimeoutStopSec=`` instead."""
        fields: dict[str, str | int] = {"STOPPING": 1}
        if status:
            fields["STATUS"] = status
        return self.send(fields)

    def watchdog(self, now: float | None = None) -> bool:
        """``WATCHDOG=1`` when half the watchdog timeout has passed since the last ping.

        Cheap enough to call on every loop iteration: without a watchdog, or before the ping
        is due, it is one comparison. ``now`` is a ``time.monotonic()`` value.
        """
        now = time.monotonic() if now is None else now
        if now < self.next_ping or self.ping_every is None:
            return False
        self.next_ping = now + self.ping_every
        return self.send({"WATCHDOG": 1})

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
