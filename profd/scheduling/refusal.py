"""A request the daemon will not serve, with its one-line reason (an ``error`` reply)."""

from __future__ import annotations

from profd_client.protocol import ErrorCode


class Refused(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        # The enum, not its string: a code the protocol does not list fails ``mypy``.
        self.code = code
