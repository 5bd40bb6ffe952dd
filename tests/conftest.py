"""Fixtures that run real things: a profd daemon process, profctl, torchrun jobs.

Only fixture definitions live here; what they wrap is in ``harness.py``, which is also what
test modules import from.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from clusters import Cluster, keys_new
from harness import Daemon, Daemons, Job, Jobs

CHECKOUT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("PROFD_TEST_INSTALLED"):
        return
    # ``dev.py test`` installed the wheels: ``python -m pytest`` put the checkout first on
    # sys.path, where ``profd/`` would shadow them in this process (subprocesses run the
    # installed entry points anyway). Off it goes before any test module imports profd, and
    # a stray import fails the session.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != CHECKOUT]
    import profd
    import profd_client

    # dev.py's .venv lives inside the checkout too: compare with the source dirs themselves.
    for mod, source in ((profd, CHECKOUT / "profd"), (profd_client, CHECKOUT / "client")):
        if source in Path(str(mod.__file__)).resolve().parents:
            raise pytest.UsageError(f"{mod.__name__} imports from the checkout, not the wheel")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A started daemon under ``tmp_path/profd``, stopped after the test."""
    d = Daemon(tmp_path / "profd")
    d.root.mkdir()
    try:
        yield d.start()
    finally:
        d.stop()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """For tests that need a config file or want to start the daemon themselves:
    ``daemon_factory(config=None, start=True, **env)`` (see :meth:`harness.Daemons.make`)."""
    daemons = Daemons(tmp_path)
    try:
        yield daemons.make
    finally:
        daemons.stop_all()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    """A ZeroMQ context for raw peers of the daemon (see ``rawpeer.py``)."""
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def torchrun(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """Start ``torchrun --nproc-per-node N tests/jobs/SCRIPT`` against a daemon (gloo, CPU):
    ``torchrun(script, nproc=2, daemon=None, args=(), **env)`` (see :meth:`harness.Jobs.start`)."""
    jobs = Jobs(tmp_path)
    try:
        yield jobs.start
    finally:
        jobs.kill_all()


@pytest.fixture
def cluster(tmp_path: Path, daemon_factory: Callable[..., Daemon]) -> Cluster:
    """Daemons added by ``cluster.add(name)`` answer ``cluster.ctl(...)`` over TCP with CURVE:
    key ``daemon`` is theirs, ``alice`` is authorized, ``mallory`` is not."""
    c = Cluster(tmp_path, daemon_factory, [])
    for name in ("daemon", "alice", "mallory"):
        keys_new(name, c.keys)
    (tmp_path / "authorized").mkdir()
    (tmp_path / "authorized" / "alice.key").write_bytes((c.keys / "alice.key").read_bytes())
    return c
