"""profctl errors and their exit codes (1: refused or failed, 2: no daemon or bad usage)."""

from __future__ import annotations


class CtlError(Exception):
    exit_code = 1

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


class NoDaemon(CtlError):
    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message, code="no_daemon")
