"""The spool side that training processes write into, and where their outputs go.

Each armed process gets its own directory below the session's incoming dir, its uid's alone,
made before the arm is sent; the daemon reads, moves and deletes in it only through
:mod:`~profd.daemon.spool.clientfiles`. Paths come from :mod:`profd.store.layout`; this
module applies the permissions (:class:`SpoolPerms`) as it creates them. Owned by the loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from profd.daemon.spool import clientfiles
from profd.daemon.spool.clientfiles import DirSpec
from profd.daemon.spool.spoolperms import SpoolPerms
from profd.pipeline.files import FilePerms
from profd.store import layout
from profd_client import protocol as P

log = logging.getLogger("profd.spool")


class Incoming:
    def __init__(self, spool: Path, perms: SpoolPerms) -> None:
        self.spool = spool
        self.perms = perms
        self._homes: set[tuple[str, int, str]] = set()  # (session, revision, target dir) made

    def incoming_dir(self, job: str, session: str) -> Path:
        """The session's incoming dir, as arms name it (revision 0's)."""
        return self.spool.joinpath(*layout.incoming_parts(job, session))

    def _levels(self, job: str, session: str, revision: int) -> list[DirSpec]:
        return [self.perms.shared(n) for n in layout.incoming_parts(job, session, revision)]

    def home(self, job: str, session: str, revision: int, host: str, pid: int) -> Path:
        """The directory only this process writes its captures into (made by :meth:`make_home`)."""
        return self.spool.joinpath(*layout.home_parts(job, session, revision, host, pid))

    def make_home(
        self, job: str, session: str, revision: int, host: str, pid: int, uid: int, gid: int
    ) -> None:
        """Create the process's own directory (its uid's, mode 0700) before it is armed."""
        name = P.target_dir(host, pid)
        if (session, revision, name) not in self._homes:
            with clientfiles.made_dir(
                self.spool, [*self._levels(job, session, revision), self._own(name, uid, gid)]
            ):
                pass
            self._homes.add((session, revision, name))

    def make_homes(
        self, job: str, session: str, revision: int, procs: Iterable[tuple[str, int, int, int]]
    ) -> None:
        """:meth:`make_home` for many processes (host, pid, uid, gid) in one walk of the
        shared levels. Best effort: one that fails here is tried alone when it is armed."""
        todo = [
            self._own(name, uid, gid)
            for host, pid, uid, gid in procs
            if (session, revision, name := P.target_dir(host, pid)) not in self._homes
        ]
        if not todo:
            return
        try:
            made = clientfiles.make_children(self.spool, self._levels(job, session, revision), todo)
        except (OSError, clientfiles.UnsafeFile):
            return
        self._homes.update((session, revision, name) for name in made)

    @staticmethod
    def _own(name: str, uid: int, gid: int) -> DirSpec:
        root = os.geteuid() == 0
        return DirSpec(name, 0o700, uid if root else -1, gid if root else -1)

    def own_files(self, raw_dir: layout.Parts, stem: str) -> dict[str, Path]:
        """The only files a process may report for a cycle (``raw_dir``), by kind."""
        d = self.spool.joinpath(*raw_dir)
        return {kind: d / name for kind, name in layout.raw_names(stem).items()}

    def discard(self, raw_dir: layout.Parts, names: Sequence[str], what: str) -> None:
        """Delete files in a process's ``raw_dir`` (its own only; a missing one is fine)."""
        try:
            with clientfiles.opened_dir(self.spool, raw_dir) as src:
                for name in names:
                    clientfiles.unlink(src, name)
        except (OSError, clientfiles.UnsafeFile) as exc:
            log.warning("could not delete %s: %s", what, exc)

    def remove_incoming(self, job: str, session: str) -> None:
        """Drop a finished session's emptied incoming dirs; any holding a file stay."""
        self._homes = {k for k in self._homes if k[0] != session}
        inc, job_dir, sess = layout.incoming_parts(job, session)
        try:
            with clientfiles.opened_dir(self.spool, [inc, job_dir]) as jfd:
                clientfiles.remove_empty_tree(jfd, sess)
            with clientfiles.opened_dir(self.spool, [inc]) as ifd:
                clientfiles.remove_empty_tree(ifd, job_dir)
        except (OSError, clientfiles.UnsafeFile):
            pass

    def nsys_dir(self, job: str, session: str) -> Path:
        return self.spool.joinpath(*layout.nsys_parts(job, session))

    def final_dir(self, job: str, session: str, cycle: int) -> Path:
        return self.spool.joinpath(*layout.cycle_parts(job, session, cycle))

    def final_levels(self, job: str, session: str, cycle: int) -> tuple[DirSpec, ...]:
        """The cycle's final dir, level by level, with the modes it is made with."""
        job_dir, sess, cyc = layout.cycle_parts(job, session, cycle)
        return (self.perms.shared(job_dir), self.perms.final(sess), self.perms.final(cyc))

    def file_perms(self, uid: int, gid: int) -> FilePerms:
        """Mode and owner of the outputs of a capture by process ``uid``/``gid`` (-1: unknown).

        A root daemon gives them the process's uid; otherwise only the group it can set."""
        if os.geteuid() == 0:
            return FilePerms(
                self.perms.file_mode, uid, self.perms.owner_gid(gid) if gid >= 0 else -1
            )
        group = self.perms.group
        return FilePerms(
            self.perms.file_mode, -1, group if group is not None and group in os.getgroups() else -1
        )
