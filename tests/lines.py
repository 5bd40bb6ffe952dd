"""Reading a helper process's next line with a deadline.

A bare ``proc.stdout.readline()`` on a helper that never prints blocks the test, and the
suite, for good (pytest-timeout ends it only after 900 s, without saying what was awaited).
``select`` on the pipe is not enough: the file object may already hold the next lines in its
buffer while the pipe itself is empty. So the read runs in a thread, and the test waits for
that thread at most ``timeout`` seconds.
"""

from __future__ import annotations

import subprocess
import threading
from typing import AnyStr


def read_line(proc: subprocess.Popen[AnyStr], timeout: float) -> AnyStr:
    """The next line ``proc`` prints (empty at its end), or AssertionError after
    ``timeout`` seconds. A read that timed out ends when the process is killed."""
    out = proc.stdout
    assert out is not None
    got: list[AnyStr] = []
    reader = threading.Thread(target=lambda: got.append(out.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not got:
        raise AssertionError(
            f"pid {proc.pid} printed no line within {timeout:g}s (exit status {proc.poll()})"
        )
    return got[0]
