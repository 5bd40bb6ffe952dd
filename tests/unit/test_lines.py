"""The tests' bounded line reader (tests/lines.py): lines a helper printed at once all come
back, and a helper that prints nothing fails the read instead of blocking it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from lines import read_line


def test_lines_printed_at_once_all_come_back_though_the_pipe_is_empty() -> None:
    code = "import sys, time; print('\\n'.join(map(str, range(7))), flush=True); time.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        # The first read buffers all seven lines: the next six come from the buffer.
        assert [read_line(p, 30).strip() for _ in range(7)] == [str(i) for i in range(7)]
    finally:
        p.kill()
        p.wait()


def test_a_helper_that_prints_nothing_fails_the_read_within_its_timeout() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                         stdout=subprocess.PIPE)  # fmt: skip
    try:
        # Blocked instead, the read would end with the helper, 30 s later, on an empty line.
        with pytest.raises(AssertionError, match=r"printed no line within 0\.5s"):
            read_line(p, 0.5)
    finally:
        p.kill()
        p.wait()
