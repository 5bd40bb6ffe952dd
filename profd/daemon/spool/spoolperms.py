"""Who may read and write what in the spool; applied by whoever creates a spool path."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from profd.daemon.spool.clientfiles import DirSpec


@dataclass(frozen=True)
class SpoolPerms:
    """Who may read what in the spool: the owner of a capture, and the group if configured.

    Directories the daemon shares between users (the spool, ``.incoming`` and each job's)
    are not listable by others; a process's own incoming directory is its uid's alone; the
    files of a capture are that uid's, readable by the group where there is one. Nothing is
    writable by anyone but its owner: no member of the group can rename what another wrote.
    """

    group: int | None  # gid of ``[daemon] group``

    @property
    def root_mode(self) -> int:
        return 0o750 if self.group is not None else 0o711

    @property
    def dir_mode(self) -> int:
        return 0o750 if self.group is not None else 0o755

    @property
    def file_mode(self) -> int:
        return 0o640 if self.group is not None else 0o600

    def prepare_root(self, spool: Path) -> None:
        """The spool itself: nobody but the daemon writes it, others only pass through."""
        if self.group is not None:
            with contextlib.suppress(PermissionError):  # a daemon outside its group
                os.chown(spool, -1, self.group)
        os.chmod(spool, self.root_mode)

    def owner_gid(self, gid: int) -> int:
        return self.group if self.group is not None else gid

    def shared(self, name: str) -> DirSpec:
        return DirSpec(name, PASS_MODE, gid=self.group if self.group is not None else -1)

    def final(self, name: str) -> DirSpec:
        return DirSpec(name, self.dir_mode, gid=self.group if self.group is not None else -1)


#: Traverse-only: processes reach their own directory below, nobody lists the others.
PASS_MODE = 0o711
