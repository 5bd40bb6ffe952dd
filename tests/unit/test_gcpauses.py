"""The collector's pauses as ``status`` reports them: real collections, counted and timed."""

from __future__ import annotations

import gc

import pytest

from profd.ctl.commands.status import gc_line
from profd.daemon.runtime.gcpauses import GcPauses, deferred


def _cycles(n: int) -> None:
    for _ in range(n):
        a: list[object] = []
        a.append(a)


def test_each_generation_is_counted_and_timed_while_installed() -> None:
    g = GcPauses()
    g.install()
    try:
        g.install()  # a second install does not count each pass twice
        _cycles(1000)
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        g.uninstall()
    assert g.count[2] == 2 and g.count[0] >= 1
    assert 0 < g.longest_s[2] <= g.total_s[2]
    gc.collect(2)  # after uninstall: not seen
    assert g.count[2] == 2
    st = g.status()
    assert st["passes"][2] == 2 and len(st["total_ms"]) == len(st["longest_ms"]) == 3
    assert st["tracked_objects"] > 0 and st["frozen_objects"] >= 0


def test_status_line_names_the_full_passes() -> None:
    line = gc_line(
        {
            "passes": [900, 80, 3],
            "total_ms": [40.0, 20.0, 21.4],
            "longest_ms": [0.5, 1.2, 9.75],
            "tracked_objects": 19063,
            "frozen_objects": 120000,
        }
    )
    assert line == (
        "gc       3 full pass(es), 21 ms in all, longest 9.8 ms; 19,063 objects watched,"
        " 120,000 frozen at start"
    )


def test_a_reply_built_inside_deferred_starts_no_collection_and_leaves_none_owed() -> None:
    """What a control request for 1,024 ranks allocates (here 60,000 rows of containers, a
    young collection every 700) starts no pass inside the block, nor one after it for what
    it freed: the allocation count is back where it was."""
    g = GcPauses()
    gc.collect()
    g.install()
    try:
        with deferred():
            assert not gc.isenabled()
            rows = [{"pid": i, "regions": [i]} for i in range(30_000)]
            del rows
        assert gc.isenabled()
        during = list(g.count)
        for _ in range(200):  # fewer than a young collection's threshold of allocations
            [].append({})
        after = list(g.count)
        built = [{"pid": i} for i in range(30_000)]  # outside: the collector runs as ever
        del built
    finally:
        g.uninstall()
    assert during == [0, 0, 0] and after == [0, 0, 0]
    assert g.count[0] >= 10


def test_deferred_leaves_a_disabled_collector_disabled_and_reenables_after_an_error() -> None:
    with pytest.raises(ValueError), deferred():
        raise ValueError("a handler failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with deferred():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
