"""``/metrics``' page from a hand-built snapshot: what prometheus-client's model gives, what the
server sends (the same bytes), and what a Prometheus parser reads back."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from profd.daemon.metrics import FAMILIES, INCIDENT_KINDS, LE, SnapshotCollector, render
from profd.watch.snapshot import RankSeries, Snapshot
from profd_client.protocol import STEP_BUCKETS

NB = len(STEP_BUCKETS) + 1


def rank(rank: int, buckets: tuple[int, ...] = (), **kw: Any) -> RankSeries:
    fields: dict[str, Any] = {
        "host": "node-a",
        "job": "j",
        "role": "trainer",
        "rank": rank,
        "buckets": buckets,
        "sum_s": 0.0,
        "steps": 0,
    }
    fields.update(kw)
    return RankSeries(**fields)


def hist(**at: int) -> tuple[int, ...]:
    """Per-bucket counts: ``hist(b3=2, inf=1)`` puts 2 steps in bucket 3 and 1 above the last."""
    counts = [0] * NB
    for k, n in at.items():
        counts[-1 if k == "inf" else int(k[1:])] = n
    return tuple(counts)


SNAP = Snapshot(
    at=1000.0,
    ranks=(
        rank(
            0, hist(b4=10, b5=5, inf=1), sum_s=0.9, steps=16, regions=(("fwd", 0.25), ("bwd", 0.5))
        ),
        rank(1, hist(b0=3), sum_s=0.002, steps=2_500_000),  # a count past Go's exponent switch
        rank(2, (), steps=7),  # protocol 2: counted, not timed
        # Labels that need escaping, and UTF-8.
        rank(
            0,
            hist(b6=1),
            host='h"1',
            job="j\\b",
            role="röle\nx",
            sum_s=0.07,
            steps=1,
            regions=(('r"e\\g\n', 1e-7),),
        ),
    ),
    attached=4,
    sessions=(("pending", 1), ("armed", 0), ("capturing", 2), ("processing", 0)),
    incidents=(("hang", 2),),
    upload_queue_bytes=123_456_789,
)
NOW = 1002.5


def families(page: bytes) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(page.decode())}


def samples(page: bytes, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample called ``name``: its sorted labels -> value."""
    out = {}
    for f in text_string_to_metric_families(page.decode()):
        for s in f.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def labels(**kw: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(kw.items()))


def test_the_served_page_is_what_prometheus_client_writes() -> None:
    collector = SnapshotCollector(lambda: SNAP, lambda: NOW)
    page = render(SNAP, NOW)
    assert page == generate_latest(collector)
    assert render(None, NOW) == b"" == generate_latest(SnapshotCollector(lambda: None, lambda: 0.0))
    empty = Snapshot(at=NOW)
    assert render(empty, NOW) == generate_latest(SnapshotCollector(lambda: empty, lambda: NOW))


def test_every_family_with_its_type_in_page_order() -> None:
    fams = list(text_string_to_metric_families(render(SNAP, NOW).decode()))
    # The parser names counters without their _total suffix.
    expected = [(n.removesuffix("_total") if k == "counter" else n, k) for n, k, _ in FAMILIES]
    assert [(f.name, f.type) for f in fams] == expected
    # An empty snapshot still declares every family (a dashboard's queries all resolve).
    empty = list(text_string_to_metric_families(render(Snapshot(at=NOW), NOW).decode()))
    assert [(f.name, f.type) for f in empty] == expected


def test_daemon_level_figures() -> None:
    page = render(SNAP, NOW)
    assert samples(page, "profd_attached_processes") == {(): 4.0}
    assert samples(page, "profd_upload_queue_bytes") == {(): 123_456_789.0}
    assert samples(page, "profd_snapshot_age_seconds") == {(): 2.5}
    assert samples(page, "profd_sessions") == {
        labels(state="pending"): 1.0,
        labels(state="armed"): 0.0,
        labels(state="capturing"): 2.0,
        labels(state="processing"): 0.0,
    }
    # Every kind is there at 0 until it happens; a kind the snapshot names is counted.
    assert samples(page, "profd_incidents_total") == {
        labels(kind=k): (2.0 if k == "hang" else 0.0) for k in INCIDENT_KINDS
    }
    assert samples(render(Snapshot(at=NOW + 5), NOW), "profd_snapshot_age_seconds") == {(): 0.0}


def test_histograms_are_cumulative_and_count_is_the_inf_bucket() -> None:
    page = render(SNAP, NOW)
    buckets: dict[tuple[tuple[str, str], ...], dict[str, float]] = defaultdict(dict)
    for key, v in samples(page, "profd_step_duration_seconds_bucket").items():
        le = dict(key)["le"]
        buckets[tuple(kv for kv in key if kv[0] != "le")][le] = v
    counts = samples(page, "profd_step_duration_seconds_count")
    sums = samples(page, "profd_step_duration_seconds_sum")
    r0 = labels(host="node-a", job="j", role="trainer", rank="0")
    r1 = labels(host="node-a", job="j", role="trainer", rank="1")
    odd = labels(host='h"1', job="j\\b", role="röle\nx", rank="0")
    # No histogram for the protocol-2 rank; every other rank has all buckets.
    assert set(buckets) == set(counts) == set(sums) == {r0, r1, odd}
    for series in buckets.values():
        assert list(series) == list(LE)
        values = list(series.values())
        assert values == sorted(values)  # cumulative
    assert buckets[r0][LE[3]] == 0 and buckets[r0][LE[4]] == 10 and buckets[r0][LE[5]] == 15
    assert buckets[r0]["600.0"] == 15 and buckets[r0]["+Inf"] == 16 == counts[r0]
    assert buckets[r1]["0.001"] == 3 == counts[r1] == buckets[r1]["+Inf"]
    assert sums[r0] == 0.9 and sums[r1] == 0.002 and counts[odd] == 1
    assert [float(le) for le in LE[:-1]] == list(STEP_BUCKETS)


def test_counters_per_rank_and_region() -> None:
    page = render(SNAP, NOW)
    steps = samples(page, "profd_steps_total")
    assert steps == {
        labels(host="node-a", job="j", role="trainer", rank="0"): 16.0,
        labels(host="node-a", job="j", role="trainer", rank="1"): 2_500_000.0,
        labels(host="node-a", job="j", role="trainer", rank="2"): 7.0,
        labels(host='h"1', job="j\\b", role="röle\nx", rank="0"): 1.0,
    }
    assert b"profd_steps_total{" in page and b"2.5e+06" in page  # prometheus-client's spelling
    assert samples(page, "profd_region_seconds_total") == {
        labels(host="node-a", job="j", role="trainer", rank="0", region="fwd"): 0.25,
        labels(host="node-a", job="j", role="trainer", rank="0", region="bwd"): 0.5,
        labels(host='h"1', job="j\\b", role="röle\nx", rank="0", region='r"e\\g\n'): 1e-7,
    }


def test_one_series_per_label_set_the_newest_attach_wins() -> None:
    old = rank(0, hist(b1=1), steps=900, sum_s=0.002)
    new = rank(0, (), steps=3)  # the same rank restarted, as a protocol-2 client
    page = render(Snapshot(at=NOW, ranks=(old, rank(1), new)), NOW)
    assert samples(page, "profd_steps_total") == {
        labels(host="node-a", job="j", role="trainer", rank="0"): 3.0,
        labels(host="node-a", job="j", role="trainer", rank="1"): 0.0,
    }
    assert samples(page, "profd_step_duration_seconds_count") == {}


@pytest.mark.parametrize("n", [0, 1, 999_999, 1_000_000, 123_456_789, 2**53 + 1])
def test_numbers_as_prometheus_client_spells_them(n: int) -> None:
    snap = Snapshot(at=NOW, ranks=(rank(0, hist(b0=n), steps=n, sum_s=n / 3),), attached=n)
    assert render(snap, NOW) == generate_latest(SnapshotCollector(lambda: snap, lambda: NOW))
