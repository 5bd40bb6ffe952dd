"""profd as users install it: two wheels (and their sdists) built from this tree.

``profd-client`` goes into training images and must need nothing of the daemon's;
``profd`` (daemon and profctl) requires exactly the same version of it. The wheels tested are
the ones ``dev.py test`` installed (``PROFD_DIST``), else ones built here from the clean tree.
The end-to-end tests install them into two fresh venvs: the daemon's by running
``deploy/Containerfile``'s own RUN commands, the client's with torch in it, and run a 2-rank
torchrun job from the one against a daemon from the other, with a capture.
"""

from __future__ import annotations

import email
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml
from devpy import ROOT, dev
from harness import BIN, JOBS, Daemon, Job, wait_for

from profd_client.protocol import RELEASE

#: What the daemon needs and a training process must not get with the client.
DAEMON_ONLY = {"boto3", "click", "prometheus-client", "py-spy", "psutil", "nvidia-ml-py"}
DAEMON_ONLY |= {"pyarrow", "duckdb"}
#: Everything the client may require.
CLIENT_DEPS = {"pyzmq", "msgpack", "msgspec"}
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
MANIFEST = ROOT / "deploy" / "kubernetes" / "profd.yaml"
#: The config path the image's CMD names; the test gives the daemon its own file there.
IMAGE_CONFIG = "/etc/profd/profd.toml"

INSTALL = pytest.mark.xdist_group("install_venvs")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requires(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(z.read(meta)).get_all("Requires-Dist") or []


def req_name(req: str) -> str:
    m = re.match(r"[A-Za-z0-9._-]+", req)
    assert m is not None, req
    return canonical(m[0])


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """This release's ``client``/``daemon`` wheels and ``client_sdist``/``daemon_sdist``."""
    given = os.environ.get("PROFD_DIST")
    out = Path(given) if given else tmp_path_factory.mktemp("dist")
    if not given:
        dev.build_dists(Path(sys.executable), out)
    names = {
        "client": f"profd_client-{RELEASE}-py3-none-any.whl",
        "daemon": f"profd-{RELEASE}-py3-none-any.whl",
        "client_sdist": f"profd_client-{RELEASE}.tar.gz",
        "daemon_sdist": f"profd-{RELEASE}.tar.gz",
    }
    found = {k: out / v for k, v in names.items()}
    missing = [str(p) for p in found.values() if not p.is_file()]
    assert not missing, f"not built: {missing}"
    return found


def test_client_wheel_requires_only_what_a_training_process_needs(
    dists: dict[str, Path],
) -> None:
    names = {req_name(r) for r in requires(dists["client"])}
    assert names == CLIENT_DEPS
    assert not names & (DAEMON_ONLY | {"profd", "torch"})


def test_daemon_wheel_requires_exactly_its_own_version_of_the_client(
    dists: dict[str, Path],
) -> None:
    reqs = [r for r in requires(dists["daemon"]) if "extra ==" not in r]
    assert f"profd-client=={RELEASE}" in [r.replace(" ", "") for r in reqs]
    assert {req_name(r) for r in reqs} >= DAEMON_ONLY
    assert "torch" not in {req_name(r) for r in reqs}


def opened_relative_to_code(source: Path) -> list[str]:
    """Names the module opens next to itself: string literals on a line that also uses
    ``__file__`` or ``importlib.resources`` (``Path(__file__).with_name("train_job.py")``)."""
    found = []
    for line in source.read_text().splitlines():
        if "__file__" in line or "resources.files" in line:
            found += re.findall(r"""["']([\w.-]+\.\w+)["']""", line)
    return found


def test_every_file_of_the_packages_and_every_file_the_code_opens_is_in_a_wheel(
    dists: dict[str, Path],
) -> None:
    packaged: set[str] = set()
    for kind in ("client", "daemon"):
        with zipfile.ZipFile(dists[kind]) as z:
            packaged |= {n for n in z.namelist() if ".dist-info/" not in n}
    tracked = [
        name
        for name in dev.tree_files(ROOT)
        if name.startswith(("profd/", "client/profd_client/")) and "__pycache__" not in name
    ]
    # Templates, schemas, scripts the demo runs: whatever sits in a package dir ships.
    in_wheel = {name.removeprefix("client/") for name in tracked}
    assert sorted(in_wheel - packaged) == []
    opened = []
    for name in tracked:
        if name.endswith(".py"):
            here = str(Path(name.removeprefix("client/")).parent)
            opened += [f"{here}/{f}" for f in opened_relative_to_code(ROOT / name)]
    assert "profd/demo/train_job.py" in opened  # the scan sees the one it must
    assert sorted(set(opened) - packaged) == []


def test_one_version_everywhere(dists: dict[str, Path]) -> None:
    named = dev.versions_named()
    assert {f: v for f, v in named.items() if v != {RELEASE}} == {}
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(RELEASE)} \(\d{{4}}-\d\d-\d\d\)$", changelog, re.M)
    for cmd in ("profd", "profctl"):
        out = subprocess.run(
            [str(BIN / cmd), "--version"], capture_output=True, text=True, check=True
        ).stdout
        assert out.split() == [f"{cmd},", "version", RELEASE]


def test_bump_sets_one_new_version_in_every_place(tmp_path: Path) -> None:
    places = [name for name, _ in dev.VERSIONED]
    places += [str(dev.RELEASE_FILE.relative_to(ROOT)), "dev.py", "CHANGELOG.md"]
    for name in places:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    subprocess.run([sys.executable, "dev.py", "bump", "9.8.7"], cwd=tmp_path, check=True)
    assert set(map(frozenset, dev.versions_named(tmp_path).values())) == {frozenset({"9.8.7"})}
    log = (tmp_path / "CHANGELOG.md").read_text()
    unreleased, bumped = log.index("## Unreleased\n"), log.index("\n## 9.8.7 (")
    assert unreleased < bumped < log.index(f"\n## {RELEASE} (")
    for name in places:  # nothing names the old release as profd's any more
        text = (tmp_path / name).read_text()
        old = re.escape(RELEASE)
        assert not re.search(rf"(profd-client==|profd:|RELEASE: Final = \"){old}", text), name


# --- deploy/Containerfile -----------------------------------------------------------------


@dataclass
class Containerfile:
    base: str
    env: dict[str, str]
    copies: list[tuple[list[str], str]]  # (sources in the build context, destination)
    runs: list[str]
    entry: list[str]  # ENTRYPOINT + CMD

    @classmethod
    def parse(cls, path: Path) -> Containerfile:
        text = re.sub(r"\\\n", " ", path.read_text())
        c = cls("", {}, [], [], [])
        cmd: list[str] = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            word, _, rest = line.partition(" ")
            rest = rest.strip()
            if word == "FROM":
                c.base = rest
            elif word == "ENV":
                c.env.update(dict(kv.split("=", 1) for kv in shlex.split(rest)))
            elif word == "COPY":
                *sources, dest = shlex.split(rest)
                c.copies.append((sources, dest))
            elif word == "RUN":
                c.runs.append(rest)
            elif word == "ENTRYPOINT":
                c.entry = list(json.loads(rest)) + c.entry
            elif word == "CMD":
                cmd = list(json.loads(rest))
            else:
                assert word in ("LABEL", "EXPOSE", "ARG", "WORKDIR"), f"not run by the test: {line}"
        c.entry = c.entry + cmd
        return c


def test_containerfile_runs_what_the_daemonset_runs_on_a_slim_python() -> None:
    image = Containerfile.parse(CONTAINERFILE)
    m = re.fullmatch(r"python:3\.(\d+)-slim", image.base)
    assert m and int(m[1]) >= 11, image.base
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    ds = next(d for d in docs if d and d["kind"] == "DaemonSet")
    container = ds["spec"]["template"]["spec"]["containers"][0]
    assert image.entry == container["command"] == ["profd", "run", "--config", IMAGE_CONFIG]
    assert container["image"].endswith(f"/profd:{RELEASE}")
    for cap in container["securityContext"]["capabilities"]["add"]:
        assert re.search(rf"^#\s+{cap}\s", CONTAINERFILE.read_text(), re.M), cap


def fresh_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin"


def venv_env(bin_dir: Path) -> dict[str, str]:
    """The environment of a command in that venv: its bin first, nothing of this checkout."""
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PROFD_CONFIG")}
    e.update(VIRTUAL_ENV=str(bin_dir.parent), PATH=f"{bin_dir}{os.pathsep}{e.get('PATH', '')}")
    return e


def imports(python: Path, module: str) -> bool:
    # From the venv's own dir: ``-c`` puts the working directory, this checkout, on sys.path.
    r = subprocess.run(
        [str(python), "-c", f"import {module}"], env=venv_env(python.parent), cwd=python.parent
    )
    return r.returncode == 0


def installed(python: Path) -> set[str]:
    code = "import importlib.metadata as m\nfor d in m.distributions(): print(d.metadata['Name'])"
    env, here = venv_env(python.parent), python.parent  # not the checkout's *.egg-info
    out = subprocess.run(
        [str(python), "-c", code], env=env, cwd=here, capture_output=True, text=True
    )
    return {canonical(n) for n in out.stdout.split()}


@pytest.fixture(scope="module")
def daemon_venv(tmp_path_factory: pytest.TempPathFactory, dists: dict[str, Path]) -> Path:
    """A fresh venv where the Containerfile's COPY and RUN lines ran, as written: its bin.

    The paths the file names are put under a stage dir, and the image's ENV applies except
    PIP_NO_CACHE_DIR (the image keeps no cache; the test reuses pip's)."""
    base = tmp_path_factory.mktemp("image")
    image = Containerfile.parse(CONTAINERFILE)
    context, stage = base / "context", base / "stage"
    (context / "dist").mkdir(parents=True)
    for kind in ("client", "daemon"):
        shutil.copy2(dists[kind], context / "dist")
    moved: dict[str, str] = {}
    for sources, dest in image.copies:
        target = stage / dest.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        for pattern in sources:
            matched = list(context.glob(pattern))
            assert len(matched) == 1, f"COPY {pattern}: {matched}"
            shutil.copy2(matched[0], target)
        moved[dest.rstrip("/")] = str(target)
    bin_dir = fresh_venv(base / "venv")
    env = venv_env(bin_dir)
    env.update({k: v for k, v in image.env.items() if k != "PIP_NO_CACHE_DIR"})
    for run in image.runs:
        for dest, there in moved.items():
            run = run.replace(dest, there)
        r = subprocess.run(["bash", "-c", run], env=env, capture_output=True, text=True)
        assert r.returncode == 0, f"RUN {run}\n{r.stdout}{r.stderr}"
    return bin_dir


def torch_closure() -> list[metadata.Distribution]:
    """torch and what it requires (no extras), as installed in this environment."""
    seen: dict[str, metadata.Distribution] = {}
    todo = ["torch"]
    while todo:
        name = canonical(todo.pop())
        if name in seen:
            continue
        dist = metadata.distribution(name)
        seen[name] = dist
        todo += [req_name(r) for r in dist.requires or [] if "extra ==" not in r]
    return list(seen.values())


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory, dists: dict[str, Path]) -> Path:
    """A fresh venv with torch, then ``pip install`` of the client wheel: its bin.

    torch (and what it requires) is this environment's, linked in through a ``.pth`` (pip
    and importlib see it installed) rather than unpacked again: 1 GB per test run. A real
    ``pip install torch`` into such a venv is measured in docs/benchmarks.md."""
    base = tmp_path_factory.mktemp("training")
    bin_dir = fresh_venv(base / "venv")
    overlay = base / "torch-site"
    overlay.mkdir()
    for dist in torch_closure():
        files = [str(f) for f in dist.files or [] if not str(f).startswith("..")]
        tops = {Path(f).parts[0] for f in files} - {"__pycache__"}
        for top in tops:
            src = Path(str(dist.locate_file(top)))
            if src.exists() and not (overlay / top).exists():
                (overlay / top).symlink_to(src)
    py = bin_dir / "python"
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True)
    Path(site.stdout.strip(), "_torch.pth").write_text(f"{overlay}\n")
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, str(dists["client"])], env=venv_env(bin_dir), check=True)
    return bin_dir


@INSTALL
def test_client_venv_has_the_client_and_torch_and_nothing_of_the_daemons(
    client_venv: Path,
) -> None:
    py = client_venv / "python"
    have = installed(py)
    assert {"profd-client", "torch", *CLIENT_DEPS} <= have
    assert have & (DAEMON_ONLY | {"profd"}) == set()
    assert imports(py, "profd_client, profd_client.protocol")
    assert not imports(py, "profd")
    # Its site-packages, not this environment's or the checkout's.
    where = subprocess.run(
        [str(py), "-c", "import profd_client; print(profd_client.__file__)"],
        env=venv_env(client_venv), cwd=client_venv, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert where.startswith(str(client_venv.parent)), where


@INSTALL
def test_daemon_venv_from_the_containerfile_has_no_torch_and_says_its_version(
    daemon_venv: Path,
) -> None:
    py = daemon_venv / "python"
    assert not imports(py, "torch")
    assert {"profd", "profd-client", "py-spy"} <= installed(py)
    for cmd in ("profd", "profctl"):
        out = subprocess.run(
            [str(daemon_venv / cmd), "--version"], env=venv_env(daemon_venv),
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert out.split() == [f"{cmd},", "version", RELEASE]


@dataclass
class InstalledDaemon(Daemon):
    """The daemon of another venv: its environment carries nothing of this checkout."""

    def env(self) -> dict[str, str]:
        e = super().env()
        e.pop("PYTHONPATH", None)
        return e


@pytest.fixture
def image_daemon(tmp_path: Path, daemon_venv: Path) -> Iterator[InstalledDaemon]:
    """The daemon as the image's entry command starts it, its config file in tmp_path."""
    d = InstalledDaemon(tmp_path / "profd", bin=daemon_venv)
    d.root.mkdir()
    config = d.root / "profd.toml"
    config.write_text("[daemon]\nheartbeat_interval = 0.5\n")
    entry = Containerfile.parse(CONTAINERFILE).entry
    assert entry[:2] == ["profd", "run"]
    d.launch(*[config.as_posix() if a == IMAGE_CONFIG else a for a in entry[2:]])
    try:
        wait_for(lambda: d.ctl("status").returncode == 0, 30, "the image's daemon to answer")
        yield d
    finally:
        d.stop()


@INSTALL
def test_torchrun_from_the_client_venv_is_captured_by_the_image_daemon(
    tmp_path: Path, client_venv: Path, image_daemon: InstalledDaemon
) -> None:
    env = image_daemon.env()
    env.update(venv_env(client_venv), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(PROFD_JOB="installed", STEPS="400", STEP_SLEEP="0.02")
    launcher = [str(client_venv / "python"), "-m", "torch.distributed.run", "--standalone"]
    cmd = [*launcher, "--nproc-per-node=2", str(JOBS / "train.py")]
    job = Job.spawn(cmd, env, tmp_path / "job.log")
    try:
        rows = image_daemon.wait_attached(2, min_step=3)
        sourced = image_daemon.ctl_json("ps", "--sources")
        assert {r["client_version"] for r in sourced} == {RELEASE}
        assert {r["job"] for r in rows} == {"installed"}
        r = image_daemon.ctl(
            "start", "--job", "installed", "--next", "--wait", "--timeout", "90", "--json",
            timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr + r.stdout
        res: dict[str, Any] = json.loads(r.stdout)
        assert res["state"] == "done", res
        traces = image_daemon.ctl_json("traces", "--session", res["session"])
        assert sorted(t["rank"] for t in traces) == [0, 1]
        assert all(Path(t["path"]).is_file() for t in traces)
        assert job.wait(timeout=180) == 0, job.output()
    finally:
        job.kill()


def test_readme_sets_up_with_two_commands_and_installs_both_packages_at_the_release() -> None:
    text = (ROOT / "README.md").read_text()
    try_it = text.split("## Try it", 1)[1].split("\n## ", 1)[0]
    block = try_it.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [ln.split("#", 1)[0].strip() for ln in block.splitlines()]
    assert [c for c in commands if c] == ["python3 dev.py demo", "python3 dev.py test"]
    install = text.split("## Install on a cluster", 1)[1].split("\n## ", 1)[0]
    for line in (
        f"pip install profd-client=={RELEASE}",
        f"pip install profd=={RELEASE}",
        "kubectl apply -f deploy/kubernetes/profd.yaml",
        "systemctl enable --now profd",
        "profctl ps",
    ):
        assert line in install, line
    assert len(install.strip().splitlines()) <= 40  # one screen
