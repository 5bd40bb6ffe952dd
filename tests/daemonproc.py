"""A real ``profd run`` subprocess in directories of its own, and profctl against it.

Shared by the test fixtures (``conftest.py``) and the benchmarks (``bench/benchlib.py``), so
both launch and talk to the daemon the same way.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    """``pred()``'s first truthy value; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


@dataclass
class DaemonProcess:
    root: Path
    config: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    prefix: list[str] = field(default_factory=list)  # argv run before profd's (setpriv ...)
    bin: Path = BIN  # where profd and profctl are: another environment's, for an install test
    heartbeat: float = 0.5  # the clients' (PROFD_HEARTBEAT); the daemon's comes from config
    ctl_timeout: float = 60.0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def runtime_dir(self) -> Path:
        return self.root / "run"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def spool(self) -> Path:
        return self.state_dir / "spool"

    @property
    def log(self) -> Path:
        return self.root / "profd.log"

    def env(self) -> dict[str, str]:
        e = dict(os.environ)
        e.pop("PROFD_CONFIG", None)
        e.update(
            PROFD_RUNTIME_DIR=str(self.runtime_dir),
            PROFD_STATE_DIR=str(self.state_dir),
            PROFD_HEARTBEAT=str(self.heartbeat),
        )
        if self.config is not None:
            e["PROFD_CONFIG"] = str(self.config)
        e.update(self.extra_env)
        return e

    def launch(self, *args: str) -> None:
        with self.log.open("ab") as logf:
            self.proc = subprocess.Popen(
                [*self.prefix, str(self.bin / "profd"), "run", *args],
                env=self.env(),
                stdout=logf,
                stderr=logf,
            )

    def terminate(self, sig: int = signal.SIGTERM) -> int:
        """Signal the daemon and reap it (SIGKILL after 30 s); its exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.proc = None
        return rc

    def ctl(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / "profctl"), *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout or self.ctl_timeout,
        )

    def ctl_json(self, *args: str, timeout: float | None = None) -> Any:
        r = self.ctl(*args, "--json", timeout=timeout)
        if r.returncode != 0:
            raise AssertionError(f"profctl {args} failed ({r.returncode}): {r.stderr}{r.stdout}")
        return json.loads(r.stdout)
