"""``profd_client.api._measure_hooks``: the measurement-only switch the in-process idle-cost A/B
uses (tests/gpu/cudajob.py, bench/bench_idle.py). Real torch, a real attached agent (no
daemon: it keeps trying in the background, as it does in training)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import profd_client
from profd_client import api


@pytest.fixture
def attached(tmp_path: Path) -> Iterator[None]:
    assert profd_client.attach(job="ab", role="main", rank=0, world_size=1,
                               runtime_dir=str(tmp_path))  # fmt: skip
    try:
        yield
    finally:
        profd_client.detach()
    assert api._stepper is None and api._paused is None and api._hook is None


def test_the_switch_stops_and_resumes_the_training_thread_side(attached: None) -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)

    def steps(n: int) -> None:
        for _ in range(n):
            p.grad = torch.ones(2)
            opt.step()

    steps(3)
    assert profd_client.current_step() == 3
    agent = api._agent
    assert api._measure_hooks(False)
    assert not api._measure_hooks(False)  # already off
    steps(5)
    profd_client.step()
    assert profd_client.region("fwd") is api._NULL
    assert api._agent is agent and agent is not None and agent.is_alive()
    assert api._measure_hooks(True)
    assert not api._measure_hooks(True)
    assert profd_client.current_step() == 3  # nothing counted while off
    steps(2)
    with profd_client.region("fwd"):
        pass
    assert profd_client.current_step() == 5
    st = api._stepper
    assert st is not None and st.regions["fwd"].entries == 1


def test_detach_while_switched_off_ends_everything(attached: None) -> None:
    agent = api._agent
    assert api._measure_hooks(False)
    profd_client.detach()
    assert agent is not None and not agent.is_alive()
    assert not api._measure_hooks(True)


def test_the_switch_does_nothing_when_not_attached() -> None:
    assert api._agent is None
    assert not api._measure_hooks(False) and not api._measure_hooks(True)
