"""The spool quota: refuse new captures while un-uploaded data fills it."""

from __future__ import annotations

from typing import Protocol

from profd.scheduling.refusal import Refused
from profd.store.index import FileRepo
from profd.textfmt import human_bytes
from profd_client.protocol import ErrorCode


class Pruner(Protocol):
    def prune(self) -> int: ...


class Quota:
    def __init__(self, max_bytes: int | None, files: FileRepo, uploads: Pruner | None) -> None:
        self.max_bytes = max_bytes
        self.files = files
        self.uploads = uploads

    def check(self) -> None:
        cap = self.max_bytes
        if cap is None:
            return
        if self.uploads is not None:
            self.uploads.prune()
        _, unsafe = self.files.spool_usage()
        if unsafe >= cap:
            raise Refused(
                ErrorCode.SPOOL_FULL,
                f"spool quota full: {human_bytes(unsafe)} not yet uploaded >= max_spool_bytes"
                f" {human_bytes(cap)};"
                " nothing will be deleted until it is uploaded (check S3 with profctl status)",
            )
