"""A request the daemon will not serve, with its one-line reason (an ``error`` reply)."""

from __future__ import annotations

from profd_client.protocol import ErrorCode


class Refused(Exception):
    def __init__(self, code: ErrorCode | str, message: str) -> None:
        super().__init__(message)
        # A code the protocol does not list is a bug here, caught where it is raised.
        self.code = ErrorCode(code)
