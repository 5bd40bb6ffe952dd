#!/usr/bin/env python3
"""Set up and run profd from a fresh clone with nothing but Python 3.11+.

    python3 dev.py demo    # daemon + 2-rank CPU torchrun job + capture + indexed result
    python3 dev.py test    # the test suite (what CI runs)

Creates ./.venv on first use and installs torch 2.13.0 (CPU build, pinned: an unpinned torch
pulls gigabytes of CUDA packages) and profd with its test extra, then reinstalls only when
pyproject.toml changes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
TORCH = "torch==2.13.0"


def ensure_env() -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 - dev.py may be run by an older python3
        raise SystemExit("profd needs Python 3.11 or newer")
    stamp = VENV / ".profd-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == want and PY.exists():
        return
    if not PY.exists():
        print("dev.py: creating .venv", file=sys.stderr, flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    print("dev.py: installing torch and profd[test] into .venv", file=sys.stderr, flush=True)
    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, "-e", f"{ROOT}[test]", TORCH], check=True)
    stamp.write_text(want)


def main() -> None:
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    rest = sys.argv[2:]
    if cmd not in ("demo", "test", "setup"):
        raise SystemExit(__doc__)
    ensure_env()
    os.chdir(ROOT)
    if cmd == "setup":
        return
    if cmd == "demo":
        args = [str(PY), "-m", "profd.demo", *rest]
    else:
        args = [str(PY), "-m", "pytest", "-n", "2", "-q", *rest]
    os.execv(args[0], args)


if __name__ == "__main__":
    main()
