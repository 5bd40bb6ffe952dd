"""Another user's runtime dir: clients and profctl never connect to it, the daemon never uses it.

CI runs as root, for whom every file is trusted, so these tests make two unprivileged users
and run the attacker's listener, the victim's training job and the victim's profctl as
those users, with no ``PROFD_RUNTIME_DIR`` or ``XDG_RUNTIME_DIR``: the victim falls back to
``/tmp/profd-<uid>``, which the attacker created first.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import BIN, Daemon
from lines import read_line

from profd_client import locations


@pytest.fixture(autouse=True)
def one_at_a_time() -> Iterator[None]:
    """Every test here uses the fixed paths /tmp/profd-<uid> of the same two users (and
    root's): two xdist workers running them at once recreated each other's squatted dir.
    An exclusive lock makes them take turns, whichever worker runs them."""
    with open("/tmp/profd-tests-runtime-trust.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


ATTACKER = "profd-attacker"
VICTIM = "profd-victim"
PYTHON = str(BIN / "python")
BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}

# The attacker's fake daemon: both sockets, open to everyone, and one stdout line per frame.
LISTENER = r"""
import os, sys, zmq
d = sys.argv[1]
os.mkdir(d, 0o755)
ctx = zmq.Context()
poller = zmq.Poller()
names = {}
for name in ("agent.sock", "control.sock"):
    s = ctx.socket(zmq.ROUTER)
    s.bind(f"ipc://{d}/{name}")
    os.chmod(f"{d}/{name}", 0o777)
    poller.register(s, zmq.POLLIN)
    names[s] = name
print("ready", flush=True)
while True:
    for s, _ in poller.poll():
        print(names[s], s.recv_multipart()[-1][:64].hex(), flush=True)
"""

# The victim's training loop: manual steps, no optimizer, a fast heartbeat so that the agent
# runs many heartbeat rounds during the run.
JOB = r"""
import time, profd_client
profd_client.attach(job="victim-job", step="manual", heartbeat=0.1)
for _ in range(30):
    profd_client.step()
    time.sleep(0.05)
profd_client.detach()
print("trained", flush=True)
"""


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int

    def run(self, args: list[str], env: dict[str, str], timeout: float = 60) -> Result:
        r = subprocess.run(
            args,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            user=self.uid,
            group=self.gid,
            extra_groups=[],
            cwd="/tmp",
        )
        return Result(r.returncode, r.stdout, r.stderr)


@dataclass(frozen=True)
class Result:
    rc: int
    out: str
    err: str


@pytest.fixture(scope="module")
def users() -> tuple[User, User]:
    """(attacker, victim): created if missing, left in place afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create users and run processes as them")
    made = []
    for name in (ATTACKER, VICTIM):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True)
            pw = pwd.getpwnam(name)
        made.append(User(name, pw.pw_uid, pw.pw_gid))
    attacker, victim = made
    probe = victim.run([PYTHON, "-c", "import profd_client, zmq, msgpack"], BASE_ENV)
    if probe.rc != 0:
        pytest.fail(f"the venv is not usable by {VICTIM}: {probe.err.strip()}")
    return attacker, victim


@dataclass
class Squat:
    """The attacker's listener on ``dir``; ``received()`` stops it and returns what it got."""

    dir: Path
    proc: subprocess.Popen[str]

    def received(self) -> list[str]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=10)
        return [line for line in out.splitlines() if line and line != "ready"]


@pytest.fixture
def squat(users: tuple[User, User]) -> Iterator[Squat]:
    """The attacker got to ``/tmp/profd-<victim uid>`` first and listens on agent.sock there."""
    attacker, victim = users
    d = Path(f"/tmp/profd-{victim.uid}")
    shutil.rmtree(d, ignore_errors=True)
    proc = subprocess.Popen(
        [PYTHON, "-c", LISTENER, str(d)],
        env=BASE_ENV,
        stdout=subprocess.PIPE,
        text=True,
        user=attacker.uid,
        group=attacker.gid,
        extra_groups=[],
        umask=0o022,
        cwd="/tmp",
    )
    try:
        assert read_line(proc, 120).strip() == "ready", "the attacker's listener did not start"
        assert d.stat().st_uid == attacker.uid
        yield Squat(d, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("how", ["default", "explicit"])
def test_a_job_never_connects_to_a_runtime_dir_another_user_created(
    users: tuple[User, User], squat: Squat, how: str
) -> None:
    attacker, victim = users
    env = dict(BASE_ENV)
    if how == "explicit":
        env["PROFD_RUNTIME_DIR"] = str(squat.dir)
    r = victim.run([PYTHON, "-c", JOB], env)
    got = squat.received()
    # Before the fix the job said hello on agent.sock at once: this list was not empty.
    assert got == [], f"the victim's job talked to the attacker's listener: {got}"
    assert r.rc == 0 and "trained" in r.out, (r.rc, r.out, r.err)
    warnings = [line for line in r.err.splitlines() if "profd_client" in line]
    assert len(warnings) == 1, r.err
    assert str(squat.dir) in warnings[0], warnings
    assert f"owned by uid {attacker.uid}, not root or you" in warnings[0], warnings
    assert "Traceback" not in r.err, r.err


def test_profctl_refuses_a_runtime_dir_another_user_created(
    users: tuple[User, User], squat: Squat
) -> None:
    attacker, victim = users
    r = victim.run([str(BIN / "profctl"), "status"], dict(BASE_ENV))
    got = squat.received()
    # Before the fix profctl sent its request to the attacker and, with no answer, gave up
    # after 10 s with "did not answer" (exit 2).
    assert r.rc == 1, (r.rc, r.out, r.err)
    assert got == [], f"profctl talked to the attacker's listener: {got}"
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.err, r.err
    assert str(squat.dir) in lines[0], lines
    assert f"owned by uid {attacker.uid}, not root or you" in lines[0], lines


@pytest.mark.parametrize("case", ["symlink-to-roots-dir", "symlink-to-users-dir", "users-dir"])
def test_the_daemon_refuses_a_symlinked_or_foreign_runtime_dir(
    users: tuple[User, User], tmp_path: Path, case: str
) -> None:
    attacker, _victim = users
    target = tmp_path / "target"
    target.mkdir()
    target.chmod(0o755)
    if case != "symlink-to-roots-dir":
        os.chown(target, attacker.uid, attacker.gid)
    rdir = target
    if case.startswith("symlink"):
        rdir = tmp_path / "run"
        rdir.symlink_to(target)
    env = dict(BASE_ENV, PROFD_RUNTIME_DIR=str(rdir), PROFD_STATE_DIR=str(tmp_path / "state"))
    proc = subprocess.Popen(
        [str(BIN / "profd"), "run"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=20)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        rc = None  # it started and served on the dir
    # Before the fix a root daemon chmod'ed the symlink's target to 0700 and served there.
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert rc == 1, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(rdir) in lines[0] and "refusing" in lines[0], lines
    assert not (target / "agent.sock").exists()


def test_a_job_attaches_to_a_root_daemon_shared_with_its_group(users: tuple[User, User]) -> None:
    # The systemd set-up: a root daemon whose runtime dir (root's, group-writable) and
    # sockets belong to a group the job's user is in. The checks must let it through.
    _attacker, victim = users
    root = Path(tempfile.mkdtemp(prefix="profd-trust-"))
    root.chmod(0o711)
    d = Daemon(root)
    d.config = root / "profd.toml"
    d.config.write_text(f'[daemon]\ngroup = "{VICTIM}"\n')
    try:
        d.start()
        mode = d.runtime_dir.stat().st_mode
        assert stat.S_IMODE(mode) == 0o1770 and d.runtime_dir.stat().st_gid == victim.gid
        env = dict(BASE_ENV, PROFD_RUNTIME_DIR=str(d.runtime_dir))
        job = JOB.replace("range(30)", "range(100)")  # long enough to be seen attached
        proc = subprocess.Popen(
            [PYTHON, "-c", job], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, user=victim.uid, group=victim.gid, extra_groups=[], cwd="/tmp",
        )  # fmt: skip
        try:
            rows = d.wait_attached(1, timeout=30)
            assert rows[0]["job"] == "victim-job", rows
            r = victim.run([str(BIN / "profctl"), "ps"], env)
            assert r.rc == 0 and "victim-job" in r.out, (r.rc, r.out, r.err)
        finally:
            out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "trained" in out, (out, err)
        assert "profd_client" not in err, err
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def _st(mode: int, uid: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("mode", "uid", "problem"),
    [
        (stat.S_IFDIR | 0o700, 1000, None),  # a daemon of this user
        (stat.S_IFDIR | 0o1770, 0, None),  # systemd's, with a group
        (stat.S_IFDIR | 0o755, 1234, "owned by uid 1234, not root or you"),
        (stat.S_IFDIR | 0o1777, 0, "writable by others (mode 1777)"),
        (stat.S_IFDIR | 0o770, 1000, "group-writable (mode 0770) and not owned by root"),
        (stat.S_IFLNK | 0o777, 1000, "a symbolic link, not a directory"),
    ],
)
def test_which_runtime_dirs_are_trusted(
    monkeypatch: pytest.MonkeyPatch, mode: int, uid: int, problem: str | None
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert locations.dir_problem(_st(mode, uid)) == problem


def test_an_existing_run_profd_is_searched_before_tmp(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in ("PROFD_RUNTIME_DIR", "INVOCATION_ID", "RUNTIME_DIRECTORY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    system = tmp_path / "run-profd"
    monkeypatch.setattr(locations, "SYSTEMD_RUNTIME_DIR", system)
    tmp = Path(f"/tmp/profd-{os.getuid()}")
    # A user's own daemon in $XDG_RUNTIME_DIR comes first: nobody else can create it there.
    assert locations.search_dirs() == [tmp_path / "xdg/profd", tmp, system]
    system.mkdir()
    assert locations.search_dirs() == [tmp_path / "xdg/profd", system, tmp]
    # A daemon started here still defaults to the user's own dir.
    assert locations.runtime_dir() == tmp_path / "xdg/profd"
