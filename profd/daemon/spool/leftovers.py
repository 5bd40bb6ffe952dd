"""Temporary files a killed daemon left in the sessions' directories, removed at start-up.

The pipeline writes a capture's outputs as temporary files beside their final names
(``profd.pipeline.files.Batch``), and ``session.json`` goes through ``fsutil.atomic_write``: a
daemon (and with it its workers) SIGKILLed in the middle leaves them behind, and nothing else
would ever remove them. Run before anything is written again and after the daemon holds its
runtime directory (a second daemon must not take a running one's files).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from profd.fsutil import is_temp_name

log = logging.getLogger("profd.spool")

#: Depths below the spool of a session's directories: ``{job}/{session}/`` and its ``c{cycle}/``.
SESSION_DEPTH = 2
CYCLE_DEPTH = 3


def remove_temp_files(spool: Path) -> int:
    """Remove the temporary files in ``{job}/{session}/`` and its cycle directories; how many.

    Links are never followed (``fwalk`` does not enter a linked directory) and only regular
    files are removed; ``.incoming`` (the clients' own directories) is left alone.
    """
    removed = 0
    size = 0
    try:
        for root, dirs, files, fd in os.fwalk(spool, follow_symlinks=False):
            depth = len(Path(root).relative_to(spool).parts)
            # Pruned in place (top-down): dot directories at the top are not sessions'.
            dirs[:] = [] if depth >= CYCLE_DEPTH else [d for d in dirs if not d.startswith(".")]
            if depth < SESSION_DEPTH:
                continue
            for name in filter(is_temp_name, files):
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        os.unlink(name, dir_fd=fd)
                        removed += 1
                        size += st.st_size
                except OSError as exc:
                    log.warning("cannot remove %s: %s", os.path.join(root, name), exc)
    except OSError as exc:
        log.warning("cannot look for temporary files in %s: %s", spool, exc)
    if removed:
        log.info("removed %d temporary file(s), %d bytes, left by a killed daemon", removed, size)
    return removed
