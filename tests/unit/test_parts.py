"""The loop's periodic work as parts (``profd/daemon/parts.py``), on a real daemon built from
a real config file (constructed, not run: no socket is bound)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from profd.config import load
from profd.daemon import parts
from profd.daemon.loop import Daemon
from profd.watch.sampling import SampleRules

BEFORE = """
[metrics]
listen = "127.0.0.1:0"

[watch]
keep_history = 100.0
hold = 3.0
cooldown = 10.0
stall_after = 5.0
sample_every = 0
keep_samples = 50.0
"""

AFTER = """
[metrics]
listen = "127.0.0.1:0"

[watch]
enabled = false
keep_history = 200.0
hold = 4.0
cooldown = 20.0
stall_after = 7.0
sample_every = 10
keep_samples = 60.0
"""


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    conf = tmp_path / "profd.toml"
    conf.write_text(BEFORE)
    cfg = load(
        conf,
        runtime_dir=tmp_path / "run",
        state_dir=tmp_path / "state",
        spool_dir=tmp_path / "spool",
        env={},
    )
    d = Daemon(cfg, None)
    yield d
    d.captures.shutdown()
    d.rank_stacks.reader.close()
    d.index.close()


def test_the_loop_runs_every_periodic_unit_as_a_part(daemon: Daemon) -> None:
    kinds = [type(p) for p in daemon.parts.parts]
    assert kinds == [
        parts.HeartbeatAnswers,
        parts.Pacing,
        parts.Housekeeping,
        parts.StackExpiry,
        parts.LedgerMinutes,
        parts.MinuteWriter,
        parts.Detecting,
        parts.StallWatch,
        parts.IncidentKeeping,
        parts.FrozenBoxes,
        parts.NsysPolling,
        parts.Sampling,
        parts.MetricsPublisher,
        parts.DeferredReports,
        parts.ParkedCaptures,
        parts.OwedManifests,
    ]
    daemon.parts.tick(time.monotonic(), time.time())
    assert set(daemon.parts.failures.values()) == {0}


def test_a_failing_part_is_logged_counted_and_the_others_still_run(
    daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    assert daemon.metrics is not None
    daemon.parts.tick(time.monotonic(), time.time())
    first = daemon.metrics.latest()
    assert first is not None
    # An index that cannot be read: sampling (it ages sample files by the index) raises.
    daemon.index.close()
    later = time.time() + 100.0
    with caplog.at_level(logging.ERROR, logger="profd"):
        daemon.parts.tick(time.monotonic() + 100.0, later)
        daemon.parts.tick(time.monotonic() + 200.0, later + 100.0)
    assert daemon.parts.failures["sampling"] == 2
    assert [r.getMessage() for r in caplog.records].count("error sampling") == 2
    # Publishing metrics comes after sampling, and ran on both ticks.
    snap = daemon.metrics.latest()
    assert snap is not None and snap.at == later + 100.0


def test_reconfigure_reaches_every_part_that_has_a_setting(daemon: Daemon) -> None:
    assert daemon.cfg.config_file is not None
    daemon.cfg.config_file.write_text(AFTER)
    daemon.reload()
    watch = daemon.cfg.watch
    assert watch.keep_history == 200.0 and not watch.enabled  # the new file was read
    assert daemon.history.keep_s == 200.0
    assert daemon.detectors.rules == watch.rules() and not daemon.detectors.enabled
    assert daemon.hangs.stall_after == 7.0 and not daemon.hangs.enabled
    assert daemon.incidents.cfg == watch
    want = SampleRules(10, watch.sample_steps, 60.0, watch.sample_timeout)
    assert daemon.samples.arming.rules == want and daemon.samples.bound.rules == want
    assert daemon.samples.aging.keep_s == 60.0
    assert set(daemon.parts.failures.values()) == {0}
    # Every part with a setting of its own is checked above: a new one must be added here.
    own = {type(p) for p in daemon.parts.parts if type(p).reconfigure is not parts.Part.reconfigure}
    assert own == {
        parts.MinuteWriter,
        parts.Detecting,
        parts.StallWatch,
        parts.IncidentKeeping,
        parts.Sampling,
    }


def test_operators_are_answered_after_every_part_even_one_that_failed(daemon: Daemon) -> None:
    """The loop answers waiting requests between parts: one waits for a part, not a tick."""
    daemon.index.close()  # sampling raises, as above
    answered: list[int] = []

    def between() -> bool:
        answered.append(1)
        return False  # nothing was waiting

    daemon.parts.tick(time.monotonic(), time.time(), between)
    assert len(answered) == len(daemon.parts.parts) and daemon.parts.failures["sampling"] == 1


class _Sliced:
    """A part whose work comes in ``n`` slices, the last one raising when ``fail``."""

    what = "slicing"

    def __init__(self, n: int, fail: bool, log: list[str]) -> None:
        self.n, self.fail, self.log = n, fail, log

    def tick(self, mono: float, wall: float) -> Iterator[None]:
        for i in range(self.n):
            if i:
                yield
            self.log.append(f"slice {i}")
        if self.fail:
            raise RuntimeError("a bug in the last slice")

    def reconfigure(self, watch: object) -> None:
        return None


class _Whole:
    what = "whole"

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def tick(self, mono: float, wall: float) -> None:
        self.log.append("whole")

    def reconfigure(self, watch: object) -> None:
        return None


@pytest.mark.parametrize("fail", [False, True])
def test_operators_are_answered_between_the_slices_of_a_sliced_part(fail: bool) -> None:
    log: list[str] = []
    ps = parts.Parts([_Sliced(3, fail, log), _Whole(log)])

    def between() -> bool:
        log.append("operators")
        return False

    ps.tick(time.monotonic(), time.time(), between)
    assert log == [
        "slice 0", "operators", "slice 1", "operators", "slice 2",
        "operators",  # after the part, failed or not
        "whole", "operators",
    ]  # fmt: skip
    assert ps.failures == {"slicing": int(fail), "whole": 0}
