"""A request the daemon will not serve, with its one-line reason (an ``error`` reply)."""

from __future__ import annotations


class Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
