#!/usr/bin/env python3
"""Set up and run profd from a fresh clone with nothing but Python 3.11+.

    python3 dev.py demo        # daemon + 2-rank CPU torchrun job + capture + indexed result
    python3 dev.py test        # the test suite (what CI runs)
    python3 dev.py wheelhouse  # fill .wheelhouse/ for test-gpu (needs PyPI; not torch)
    python3 dev.py test-gpu    # every CUDA path on a real GPU; writes docs/gpu.md

demo/test/setup create ./.venv on first use and install torch 2.13.0 (CPU build, pinned: an
unpinned torch pulls gigabytes of CUDA packages) and profd with its test extra, then reinstall
only when pyproject.toml changes.

test-gpu runs on a machine with an NVIDIA GPU and a torch already installed (it never installs
torch) that reaches no package registry. It uses the python that has torch, creates
./.gpu-venv on top of it (--system-site-packages, so that torch is the one used), installs
profd's own dependencies from ./.wheelhouse with ``pip install --no-index`` (packages the
system python already has at a fitting version are used as they are), installs profd itself
(--no-deps --no-build-isolation -e .), and runs tests/gpu/gpucheck.py, which prints one
PASS/FAIL/SKIP line per check and writes docs/gpu.md. The whole run takes a few minutes.

Fill the wheelhouse here (with network), then hand the tree and the ignored .wheelhouse to the
GPU machine; with the device tool that is one call:

    run(carry=[".wheelhouse"], command="python3 dev.py test-gpu", timeout_s=600)

The PASS/FAIL/SKIP lines are in the reply's output, and the report is copied into $OUT (the
device tool's folder of files that come back) as gpu.md: copy it over docs/gpu.md here.

Exit codes of test-gpu: 0 every check passed or was skipped with its reason, 1 a check
failed, 2 set-up failed (no python with torch, no wheelhouse, pip failed), 3 no GPU here
(one line says why; nothing is installed or written).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
TORCH = "torch==2.13.0"

WHEELHOUSE = ROOT / ".wheelhouse"
GPU_VENV = ROOT / ".gpu-venv"
GPU_PY = GPU_VENV / "bin" / "python"
#: Pythons the wheelhouse holds binary wheels for: profd needs 3.11+, and the GPU machine's
#: python version is not known in advance.
WHEEL_PYTHONS = ("3.11", "3.12", "3.13", "3.14")
#: Platform tags the wheelhouse takes wheels for, newest first. torch 2.6+ wheels need glibc
#: 2.28, so every machine with a current torch accepts all of them. ``pip download
#: --platform`` matches tags exactly (it does not widen manylinux_2_28 to the older ones), and
#: some dependencies publish only old tags: py-spy's wheels are
#: ``manylinux1_x86_64.manylinux_2_5_x86_64`` alone. So every manylinux level up to 2.28 is
#: named, in both spellings where a legacy alias exists (manylinux2014 = 2.17,
#: manylinux2010 = 2.12, manylinux1 = 2.5).
WHEEL_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_12_x86_64",
    "manylinux2010_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)
#: Installed into .gpu-venv beside profd's own dependencies: what an offline editable
#: install of profd builds with.
BUILD_REQS = ("setuptools>=68", "wheel", "pip")
NO_GPU, SETUP_FAILED = 3, 2


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
    # What pip does for an installed package, and an editable install skips: without it a
    # PYTHONDONTWRITEBYTECODE=1 shell compiles profd again in every profctl command.
    subprocess.run([str(PY), "-m", "compileall", "-q", "profd", "client"], cwd=ROOT, check=True)
    stamp.write_text(want)


def dependencies() -> list[str]:
    """profd's runtime requirements, as pyproject.toml lists them (never torch)."""
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # dev.py itself may run on an older python3 than the one with torch
        block = text.split("\ndependencies = [", 1)[1].split("]", 1)[0]
        deps = [line.strip().strip(",").strip('"') for line in block.splitlines()]
    else:
        deps = tomllib.loads(text)["project"]["dependencies"]
    return [d for d in deps if d and not d.startswith("torch")]


def download_command(version: str, reqs: list[str]) -> list[str]:
    """The ``pip download`` that fetches binary wheels of ``reqs`` for CPython ``version``
    on x86_64 Linux into the wheelhouse: one ``--platform`` per tag in WHEEL_PLATFORMS."""
    platforms = [arg for tag in WHEEL_PLATFORMS for arg in ("--platform", tag)]
    return [
        sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
        "--dest", str(WHEELHOUSE), "--only-binary=:all:", *platforms,
        "--implementation", "cp", "--python-version", version, *reqs,
    ]  # fmt: skip


def fill_wheelhouse() -> None:
    """``pip download`` profd's dependencies (and what installs profd) into .wheelhouse/,
    binary wheels for every python in WHEEL_PYTHONS on x86_64 Linux."""
    WHEELHOUSE.mkdir(exist_ok=True)
    reqs = [*dependencies(), *BUILD_REQS]
    for version in WHEEL_PYTHONS:
        print(f"dev.py: wheels for python {version}", file=sys.stderr, flush=True)
        subprocess.run(download_command(version, reqs), check=True)
    wheels = sorted(WHEELHOUSE.glob("*.whl"))
    total = sum(p.stat().st_size for p in wheels)
    print(f"dev.py: {len(wheels)} wheels, {total / 2**20:.1f} MiB in {WHEELHOUSE}")


def no_gpu_reason() -> str | None:
    """Why this machine has no usable NVIDIA GPU, from what costs nothing to look at (no
    import of torch, nothing installed); None when there seems to be one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    driver = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0")
    if not any(os.path.exists(p) for p in driver) and shutil.which("nvidia-smi") is None:
        return "no NVIDIA driver (no /proc/driver/nvidia, no /dev/nvidia*, no nvidia-smi)"
    return None


_PROBE = (
    "import json, sys\n"
    "try:\n"
    "    import torch\n"
    "    t = torch.__version__\n"
    "    cuda = bool(torch.cuda.is_available())\n"
    "except Exception as e:\n"
    "    t, cuda = None, repr(e)\n"
    "print(json.dumps({'py': list(sys.version_info[:2]), 'torch': t, 'cuda': cuda}))\n"
)


def torch_python() -> tuple[str, dict[str, object]] | None:
    """The first python with torch importable: this one, then the usual system ones."""
    seen: set[str] = set()
    names = [sys.executable, "python3", "python", "/usr/bin/python3", "/usr/local/bin/python3"]
    names += ["/opt/conda/bin/python", "/usr/local/bin/python"]
    for name in names:
        exe = shutil.which(name) if os.sep not in name else name
        if exe is None or not os.access(exe, os.X_OK) or os.path.realpath(exe) in seen:
            continue
        seen.add(os.path.realpath(exe))
        try:
            out = subprocess.run(
                [exe, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True
            ).stdout
            info: dict[str, object] = json.loads(out.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            continue
        if info["torch"]:
            return exe, info
    return None


def ensure_gpu_env(base: str) -> None:
    """.gpu-venv on top of ``base`` with profd installed, from the wheelhouse only."""
    stamp = GPU_VENV / ".profd-installed"
    listing = sorted(p.name for p in WHEELHOUSE.glob("*.whl")) if WHEELHOUSE.is_dir() else []
    want = hashlib.sha256(
        "\n".join([base, (ROOT / "pyproject.toml").read_text(), *listing]).encode()
    ).hexdigest()
    if stamp.exists() and stamp.read_text() == want and GPU_PY.exists():
        return
    if GPU_VENV.exists():
        shutil.rmtree(GPU_VENV)
    print(f"dev.py: creating .gpu-venv on {base}", file=sys.stderr, flush=True)
    # No ensurepip (Debian's pythons may lack it): pip comes from the base python or the
    # wheelhouse's pip wheel, which runs from the wheel file itself.
    subprocess.run([base, "-m", "venv", "--system-site-packages", "--without-pip", str(GPU_VENV)],
                   check=True)  # fmt: skip
    # --system-site-packages sees the base *interpreter's* packages: where torch lives in a
    # venv, a conda env or the user site instead, a .pth names the base's own directories
    # (after the venv's, so what gets installed here wins).
    code = "import sys; print('\\n'.join(p for p in sys.path if p.endswith('-packages')))"
    dirs = subprocess.run([base, "-c", code], capture_output=True, text=True, check=True).stdout
    site = subprocess.run(
        [str(GPU_PY), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(site, "_profd_base_python.pth").write_text(dirs)
    pip_wheels = sorted(WHEELHOUSE.glob("pip-*.whl")) if WHEELHOUSE.is_dir() else []
    runner = [str(pip_wheels[-1] / "pip")] if pip_wheels else ["-m", "pip"]
    pip = [str(GPU_PY), *runner, "install", "--disable-pip-version-check", "-q", "--no-index"]
    if listing:
        pip += ["--find-links", str(WHEELHOUSE)]
    # Requirements the system python already meets are left as they are; the rest comes
    # from the wheelhouse. torch is never named, so never touched.
    subprocess.run([*pip, *BUILD_REQS[:2], *dependencies()], check=True)
    subprocess.run([*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)], check=True)
    subprocess.run([str(GPU_PY), "-c", "import torch, profd, profd_client"], check=True)
    stamp.write_text(want)


def test_gpu(rest: list[str]) -> None:
    why = no_gpu_reason()
    if why is not None:
        print(f"test-gpu: no GPU: {why}", flush=True)
        raise SystemExit(NO_GPU)
    found = torch_python()
    if found is None:
        print("test-gpu: set-up failed: no python here can import torch", flush=True)
        raise SystemExit(SETUP_FAILED)
    base, info = found
    if info["cuda"] is not True:
        print(f"test-gpu: no GPU: torch.cuda.is_available() is {info['cuda']} in {base}")
        raise SystemExit(NO_GPU)
    py = info["py"]
    if not isinstance(py, list) or tuple(py) < (3, 11):
        print(f"test-gpu: set-up failed: {base} (with torch) is python {py}; profd needs 3.11+")
        raise SystemExit(SETUP_FAILED)
    try:
        ensure_gpu_env(base)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(
            f"test-gpu: set-up failed: {exc} (is .wheelhouse/ here? fill it with"
            " `python3 dev.py wheelhouse` where PyPI is reachable and carry it along)",
            flush=True,
        )
        raise SystemExit(SETUP_FAILED) from None
    args = [str(GPU_PY), str(ROOT / "tests" / "gpu" / "gpucheck.py"), *rest]
    os.execv(args[0], args)


def main() -> None:
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    rest = sys.argv[2:]
    if cmd == "test-gpu":
        os.chdir(ROOT)
        test_gpu(rest)
        return
    if cmd == "wheelhouse":
        fill_wheelhouse()
        return
    if cmd not in ("demo", "test", "setup"):
        raise SystemExit(__doc__)
    ensure_env()
    os.chdir(ROOT)
    if cmd == "setup":
        return
    if cmd == "demo":
        args = [str(PY), "-m", "profd.demo", *rest]
    else:
        # loadgroup: tests marked with one xdist_group (those sharing a module-scoped job)
        # stay on one worker. pytest 9.2 silently breaks it: pyproject.toml pins it below.
        args = [str(PY), "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", *rest]
    os.execv(args[0], args)


if __name__ == "__main__":
    main()
