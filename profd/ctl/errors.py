"""profctl errors and their exit codes.

0: ok. 1: refused or failed. 2: bad usage (click's, and :class:`BadUsage`). 3: no daemon
(:class:`NoDaemon`). 6: ``start --wait --timeout`` gave up on a session that is still live
(:class:`StillLive`). With ``--cluster``: 4: some nodes did not answer within
``--node-timeout`` (the output has what the others said), 5: some node refused this
profctl's key (authentication failed). docs/configuration.md has the table.
"""

from __future__ import annotations

import enum

from profd_client.protocol.envelope import ErrorCode


class CtlCode(enum.StrEnum):
    """The ``code`` of a failure profctl finds itself (the ``code`` in ``--json``'s
    ``{"error", "code"}``); a daemon's refusal keeps the daemon's code (``ErrorCode``, or
    one this profctl does not know, passed on as it came). Where a daemon's code means the
    same, profctl uses it (``ErrorCode.PERMISSION``, ``ErrorCode.NOT_FOUND``).
    docs/configuration.md lists them; a unit test keeps the two the same."""

    ERROR = "error"  # any other failure
    NO_DAEMON = "no_daemon"  # nothing answers on the local control socket (exit 3)
    USAGE = "usage"  # a bad argument found past click's checks (exit 2)
    TIMEOUT = "timeout"  # ``start --wait --timeout`` gave up; the session is live (exit 6)
    AUTH = "auth"  # ``--cluster``: no node answered, and some refused the key (exit 5)
    NO_ANSWER = "no_answer"  # ``--cluster``: no node answered in time (exit 4)
    UNTRUSTED = "untrusted"  # the control socket is not the daemon's (its owner, its mode)
    PROTOCOL = "protocol"  # the daemon's warehouse reply, or the warehouse, unreadable
    SQL = "sql"  # ``query``: DuckDB refused the SQL
    IO = "io"  # ``query``: the warehouse could not be read
    BAD_CONFIG = "bad_config"  # a bad S3 setting (``--s3``, ``PROFD_S3_URL``)
    S3 = "s3"  # S3 refused or could not be reached
    EMPTY = "empty"  # ``pull``: the session has no files to copy


class CtlError(Exception):
    exit_code = 1

    def __init__(self, message: str, code: str = CtlCode.ERROR) -> None:
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
        super().__init__(message, code=CtlCode.NO_DAEMON)


class BadUsage(CtlError):
    """A bad argument found past click's own checks (a node list, a key file)."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message, code=CtlCode.USAGE)


#: ``--cluster``: at least one node did not answer in time (down, unreachable, wedged).
EXIT_NODES_MISSING = 4
#: ``--cluster``: at least one node refused the handshake (unknown key, wrong server key).
EXIT_AUTH_FAILED = 5


class StillLive(CtlError):
    """``--wait`` gave up before the session ended; the session goes on."""

    exit_code = EXIT_STILL_LIVE

    def __init__(self, message: str) -> None:
        super().__init__(message, code=CtlCode.TIMEOUT)


class NoAnswer(CtlError):
    """No node of the cluster answered: nothing to show, and the exit code says why."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(
            message, code=CtlCode.AUTH if exit_code == EXIT_AUTH_FAILED else CtlCode.NO_ANSWER
        )
        self.exit_code = exit_code


def ranks_text(ranks: list[int]) -> str:
    """``rank 7`` or ``ranks 7,9``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def unmatched_refusal(ranks: list[int], where: str) -> CtlError:
    """``start --strict``: refused because some ``--ranks`` matched nothing (``where``)."""
    return CtlError(
        f"--strict: {ranks_text(ranks)} {where}; nothing started", code=ErrorCode.NO_MATCH
    )
