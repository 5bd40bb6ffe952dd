"""profctl errors and their exit codes.

0: ok. 1: refused or failed. 2: bad usage (click's, and :class:`BadUsage`). 3: no daemon
(:class:`NoDaemon`). 6: ``start --wait --timeout`` gave up on a session that is still live
(:class:`StillLive`). With ``--cluster``: 4: some nodes did not answer within
``--node-timeout`` (the output has what the others said), 5: some node refused this
profctl's key (authentication failed). docs/configuration.md has the table.
"""

from __future__ import annotations


class CtlError(Exception):
    exit_code = 1

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


#: Nothing answers on the local control socket: a script can tell "start the daemon" from
#: "fix the command line" (2) and "the daemon said no" (1).
EXIT_NO_DAEMON = 3
#: ``start --wait --timeout``: the wait ended, the session did not (it is still live).
EXIT_STILL_LIVE = 6


class NoDaemon(CtlError):
    exit_code = EXIT_NO_DAEMON

    def __init__(self, message: str) -> None:
        super().__init__(message, code="no_daemon")


class BadUsage(CtlError):
    """A bad argument found past click's own checks (a node list, a key file)."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message, code="usage")


#: ``--cluster``: at least one node did not answer in time (down, unreachable, wedged).
EXIT_NODES_MISSING = 4
#: ``--cluster``: at least one node refused the handshake (unknown key, wrong server key).
EXIT_AUTH_FAILED = 5


class StillLive(CtlError):
    """``--wait`` gave up before the session ended; the session goes on."""

    exit_code = EXIT_STILL_LIVE

    def __init__(self, message: str) -> None:
        super().__init__(message, code="timeout")


class NoAnswer(CtlError):
    """No node of the cluster answered: nothing to show, and the exit code says why."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message, code="auth" if exit_code == EXIT_AUTH_FAILED else "no_answer")
        self.exit_code = exit_code


def ranks_text(ranks: list[int]) -> str:
    """``rank 7`` or ``ranks 7,9``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def unmatched_refusal(ranks: list[int], where: str) -> CtlError:
    """``start --strict``: refused because some ``--ranks`` matched nothing (``where``)."""
    return CtlError(f"--strict: {ranks_text(ranks)} {where}; nothing started", code="no_match")
