"""The gates of test jobs: wait until the test creates the file ``$GATE`` (or another
variable) names.

Tests open it once the daemon has armed what they want armed, so steps are not run before.
A test that died never opens it: give up after ten minutes rather than train forever.
"""

import os
import time


def wait_gate(var: str = "GATE") -> None:
    """Wait for the file the environment variable ``var`` names (none named: no wait)."""
    gate = os.environ.get(var)
    give_up = time.monotonic() + 600
    while gate and not os.path.exists(gate):
        if time.monotonic() > give_up:
            raise SystemExit("gate never opened")
        time.sleep(0.05)
