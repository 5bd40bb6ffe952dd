#!/usr/bin/env python3
"""Set up and run profd from a fresh clone with nothing but Python 3.11+.

    python3 dev.py demo        # daemon + 2-rank CPU torchrun job + capture + indexed result
    python3 dev.py test        # the test suite (what CI runs), against the installed wheels
    python3 dev.py dist        # the two wheels and two sdists into ./dist (setuptools 77+: .venv's)
    python3 dev.py bump 0.4.0  # one new version everywhere (code, pins, manifest, docs, CHANGELOG)
    python3 dev.py wheelhouse  # fill .wheelhouse/ for test-gpu (needs PyPI; not torch)
    python3 dev.py test-gpu    # every CUDA path on a real GPU; writes docs/gpu.md

demo/test/setup create ./.venv on first use and install torch 2.13.0 (CPU build, pinned: an
unpinned torch pulls gigabytes of CUDA packages) and the dependencies of profd[test], again
only when a pyproject.toml changes. Every time, they then build the sdists of profd-client
(client/) and profd (.) from the files git tracks, build each wheel from its sdist (so a file
the sdist lacks fails here, not in a user's pip), and install both wheels into ./.venv: the
tests and the demo run the installed packages, never the checkout (tests/conftest.py takes
the checkout off sys.path and checks). That takes seconds.

test-gpu runs on a machine with an NVIDIA GPU and a torch already installed (it never installs
torch) that reaches no package registry. It uses the python that has torch, creates
./.gpu-venv on top of it (--system-site-packages, so that torch is the one used), installs
profd's own dependencies from ./.wheelhouse with ``pip install --no-index`` (packages the
system python already has at a fitting version are used as they are), builds the two wheels
there and installs them with --no-deps, and runs tests/gpu/gpucheck.py, which prints one
PASS/FAIL/SKIP line per check and writes docs/gpu.md. The whole run takes a few minutes.
The warehouse's dependencies (pyarrow, duckdb: 80 MB) are neither in the wheelhouse nor
installed there (the device tool carries 64 MiB): gpucheck runs its daemon with
``[warehouse] enabled = false``, and nothing it checks reads the warehouse.

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

import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
TORCH = "torch==2.13.0"
DIST = ROOT / "dist"
#: The two projects of this repository, the client's first (the daemon's requires it).
PROJECTS = (ROOT / "client", ROOT)
#: The daemon's fleet warehouse needs these (80 MB of wheels): left out of the GPU machine's
#: wheelhouse and install, where the daemon runs with ``[warehouse] enabled = false``.
WAREHOUSE_DEPS = ("pyarrow", "duckdb")
#: Where the one version string lives; ``bump`` rewrites it and every copy in VERSIONED.
RELEASE_FILE = ROOT / "client" / "profd_client" / "protocol" / "envelope.py"
RELEASE_RE = r'^(RELEASE: Final = ")([^"]+)(")'
#: Every other place that names the release, as (file, pattern whose group 2 is the version).
VERSIONED = (
    ("pyproject.toml", r'("profd-client==)([^"]+)(")'),
    ("deploy/kubernetes/profd.yaml", r"(image: registry\.example\.com/profd:)(\S+)()"),
    ("README.md", r"(profd-client==|profd==|/profd:)([0-9][^\s\\`\"]*)()"),
    ("client/README.md", r"(profd-client==)([0-9][^\s`]*)()"),
    ("docs/operations.md", r"(profd-client==|profd==|/profd:)([0-9][^\s\\`\"]*)()"),
)

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
#: Installed into .gpu-venv beside profd's own dependencies: what the two wheels are built
#: with there, offline.
BUILD_REQS = ("setuptools>=77", "wheel", "pip")
NO_GPU, SETUP_FAILED = 3, 2


def ensure_env() -> None:
    """./.venv with torch and profd[test]'s dependencies, and the wheels of this tree in it."""
    if sys.version_info < (3, 11):  # noqa: UP036 - dev.py may be run by an older python3
        raise SystemExit("profd needs Python 3.11 or newer")
    stamp = VENV / ".profd-installed"
    want = hashlib.sha256(b"".join((p / "pyproject.toml").read_bytes() for p in PROJECTS))
    fresh = not (stamp.exists() and stamp.read_text() == want.hexdigest() and PY.exists())
    if not PY.exists():
        print("dev.py: creating .venv", file=sys.stderr, flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if fresh:
        print("dev.py: installing torch and profd[test] into .venv", file=sys.stderr, flush=True)
        # What builds the wheels below, without build isolation (seconds, and offline).
        subprocess.run([*pip, TORCH, BUILD_REQS[0]], check=True)
    client, daemon = build_dists(PY, DIST)
    if fresh:
        # The wheels with every dependency; torch named again so nothing moves it.
        subprocess.run([*pip, str(client), f"{daemon}[test]", TORCH], check=True)
        stamp.write_text(want.hexdigest())
    else:
        # Same dependencies: only this tree's code is new.
        subprocess.run([*pip, "--no-deps", "--force-reinstall", str(client), str(daemon)],
                       check=True)  # fmt: skip


def tree_files(root: Path) -> list[str]:
    """The files of a clean checkout of ``root``: what git tracks (as they are now) and new
    files it does not ignore. Builds see nothing else: no .venv, no stale build/, no
    *.egg-info. Outside a git checkout (an unpacked sdist), every file."""
    try:
        listing = ["ls-files", "-z", "--cached", "--others", "--exclude-standard"]
        out = subprocess.run(["git", "-C", str(root), *listing], capture_output=True, check=True)
        names = out.stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        # A copy with no .git (the GPU machine's): every file but what .gitignore names.
        files = [p.relative_to(root) for p in root.rglob("*") if p.is_file()]
        return [str(f) for f in files if not any(_ignored(part) for part in f.parts)]
    return sorted({f for f in names if f and (root / f).is_file()})


def _ignored(part: str) -> bool:
    """A path part .gitignore keeps out of the tree (its patterns, by hand)."""
    made = ("dist", "build", "demo-out", "__pycache__")
    return part in made or part.endswith(".egg-info") or (part.startswith(".") and part != ".ci")


_BUILD = (
    "import sys\n"
    "from setuptools import build_meta as b\n"
    "print(getattr(b, 'build_' + sys.argv[1])(sys.argv[2]))\n"
)


def build_dists(python: Path, out: Path) -> tuple[Path, Path]:
    """The sdist and the wheel of profd-client and of profd in ``out`` (earlier ones there
    removed), built by ``python``'s setuptools from a copy of the clean tree; each wheel is
    built from its unpacked sdist, as pip builds one from PyPI. Returns the two wheels."""
    out.mkdir(parents=True, exist_ok=True)
    for old in {*out.glob("profd-*"), *out.glob("profd_client-*")}:
        old.unlink()
    wheels: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="profd-build-") as tmp:
        tree = Path(tmp, "tree")
        for name in tree_files(ROOT):
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
        for project in PROJECTS:
            src = tree / project.relative_to(ROOT)
            sdist = out / _build(python, "sdist", src, out)
            unpacked = Path(tmp, sdist.name.removesuffix(".tar.gz"))
            with tarfile.open(sdist) as tar:
                # The data filter where this python has it (3.11.4+; test-gpu's may be older).
                safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                tar.extractall(tmp, **safe)  # type: ignore[arg-type]
            wheels.append(out / _build(python, "wheel", unpacked, out))
    return wheels[0], wheels[1]


def _build(python: Path, kind: str, src: Path, out: Path) -> str:
    """setuptools' ``build_sdist``/``build_wheel`` of ``src`` into ``out``: the file's name."""
    cmd = [str(python), "-c", _BUILD, kind, str(out)]
    built = subprocess.run(cmd, cwd=src, capture_output=True, text=True)
    if built.returncode != 0:
        # setuptools says why on stderr (a too-old setuptools, a bad pyproject.toml).
        sys.stderr.write(built.stdout + built.stderr)
        raise subprocess.CalledProcessError(built.returncode, cmd)
    return built.stdout.strip().splitlines()[-1]


def release() -> str:
    """The one version string (RELEASE in the client's protocol/envelope.py)."""
    m = re.search(RELEASE_RE, RELEASE_FILE.read_text(), re.M)
    assert m is not None, f"no RELEASE in {RELEASE_FILE}"
    return m[2]


def versions_named(root: Path = ROOT) -> dict[str, set[str]]:
    """Every version each file of VERSIONED (and the RELEASE file) under ``root`` names."""
    places = ((str(RELEASE_FILE.relative_to(ROOT)), RELEASE_RE), *VERSIONED)
    return {
        name: {m[2] for m in re.finditer(pattern, (root / name).read_text(), re.M)}
        for name, pattern in places
    }


def bump(new: str) -> None:
    """Make ``new`` the version everywhere: RELEASE, the daemon's pin of the client, the
    image tag, the install lines of the docs, and CHANGELOG.md's "Unreleased" heading, which
    becomes ``new`` with today's date under a fresh, empty "Unreleased"."""
    if not re.fullmatch(r"\d+\.\d+\.\d+([a-z]+\d+)?", new):
        raise SystemExit(f"dev.py bump: {new!r} is not a version like 0.4.0 or 0.4.0rc1")
    for name, pattern in ((str(RELEASE_FILE.relative_to(ROOT)), RELEASE_RE), *VERSIONED):
        path = ROOT / name
        text, count = re.subn(pattern, lambda m: m[1] + new + m[3], path.read_text(), flags=re.M)
        if count == 0:
            raise SystemExit(f"dev.py bump: no version found in {name}")
        path.write_text(text)
    log = ROOT / "CHANGELOG.md"
    today = datetime.date.today().isoformat()
    text = log.read_text().replace(
        "## Unreleased\n", f"## Unreleased\n\nNothing yet.\n\n## {new} ({today})\n", 1
    )
    log.write_text(text)
    print(f"dev.py: version {new} in {len(VERSIONED) + 2} files; CHANGELOG.md: fill in {new}")


def dependencies() -> list[str]:
    """The runtime requirements of both distributions, as their pyproject.toml files list
    them: never torch, never profd-client (built from this tree)."""
    deps: list[str] = []
    for project in PROJECTS:
        text = (project / "pyproject.toml").read_text()
        try:
            import tomllib
        except ImportError:  # dev.py itself may run on an older python3 than the one with torch
            block = text.split("\ndependencies = [", 1)[1].split("]", 1)[0]
            lines = [ln.split("#", 1)[0].strip().strip(",").strip('"') for ln in block.splitlines()]
        else:
            lines = tomllib.loads(text)["project"]["dependencies"]
        deps += [d for d in lines if d and d not in deps]
    return [d for d in deps if not d.startswith(("torch", "profd-client"))]


def gpu_dependencies() -> list[str]:
    """What the GPU machine installs beside the two wheels: all but the warehouse's."""
    return [d for d in dependencies() if not d.startswith(WAREHOUSE_DEPS)]


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
    """``pip download`` the dependencies test-gpu installs (gpu_dependencies, and what builds
    the wheels) into .wheelhouse/, binary wheels for every python in WHEEL_PYTHONS on x86_64
    Linux."""
    WHEELHOUSE.mkdir(exist_ok=True)
    reqs = [*gpu_dependencies(), *BUILD_REQS]
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
    projects = [(p / "pyproject.toml").read_text() for p in PROJECTS]
    want = hashlib.sha256("\n".join([base, *projects, *listing]).encode()).hexdigest()
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
    subprocess.run([*pip, *BUILD_REQS[:2], *gpu_dependencies()], check=True)
    # --no-deps: the daemon's pyarrow and duckdb are not here (see WAREHOUSE_DEPS).
    wheels = build_dists(GPU_PY, GPU_VENV / "dist")
    subprocess.run([*pip, "--no-deps", *map(str, wheels)], check=True)
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
    if cmd == "bump" and len(rest) == 1:
        bump(rest[0])
        return
    if cmd == "dist":
        # .venv's setuptools (77+, dev.py installs it) where there is one, else this python's.
        build_dists(PY if PY.exists() else Path(sys.executable), DIST)
        print("\n".join(str(p) for p in sorted(DIST.glob("profd*"))))
        return
    if cmd not in ("demo", "test", "setup"):
        raise SystemExit(__doc__)
    ensure_env()
    os.chdir(ROOT)
    if cmd == "setup":
        return
    # The installed wheels, not this checkout (tests/conftest.py drops it from sys.path and
    # fails when profd would still come from it); the tests of the wheels read them in DIST.
    os.environ.update(PROFD_TEST_INSTALLED="1", PROFD_DIST=str(DIST))
    os.environ.pop("PYTHONPATH", None)
    if cmd == "demo":
        args = [str(PY), "-P", "-m", "profd.demo", *rest]
    else:
        # loadgroup: tests marked with one xdist_group (those sharing a module-scoped job)
        # stay on one worker. pytest 9.2 silently breaks it: pyproject.toml pins it below.
        # --durations: the slowest tests, for keeping the suite within its 15 minutes.
        args = [str(PY), "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q",
                "--durations=30", *rest]  # fmt: skip
    os.execv(args[0], args)


if __name__ == "__main__":
    main()
