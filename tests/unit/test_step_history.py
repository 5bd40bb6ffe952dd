"""Per-minute step times in the index (``step_minutes``): aggregation per minute and role,
retention, the loop's writer (a failed write keeps its rows, bounded), the seed a restarted
daemon's ledger takes from it, and profctl's cluster merge. A real SQLite file each time."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from test_daemon_ledger import Clock, client, ledger

from profd import control_schema as C
from profd.ctl.cluster import Node
from profd.ctl.commands.history import _change, mark_slower, merge, parse_when
from profd.ctl.errors import BadUsage
from profd.ctl.nodes import Answer
from profd.daemon.clients import history as H
from profd.daemon.clients.history import StepHistory
from profd.daemon.clients.ledger import SEED_MAX_AGE_S, Ledgers, MinuteSummary
from profd.daemon.spool.storage import Storage
from profd.store.index import Database, StepMinuteRepo

T0 = 1_800_000_000  # a minute start (divisible by 60)


def minute(rank: int, p50: float | None, *, at: int = T0, role: str = "trainer",
           job: str = "j", host: str = "h1", steps: int = 100, p90: float | None = None,
           mx: float | None = None, pid: int | None = None) -> MinuteSummary:  # fmt: skip
    return MinuteSummary(
        minute=at, host=host, job=job, role=role, rank=rank, pid=pid or 1000 + rank,
        steps=steps, sum_s=steps * (p50 or 0.0) / 1000.0, p50_ms=p50,
        p90_ms=p90 if p90 is not None else (None if p50 is None else p50 * 1.2),
        max_ms=mx if mx is not None else (None if p50 is None else p50 * 2),
        regions={"data": 0.5},
    )  # fmt: skip


def minutes_at(path: Path) -> StepMinuteRepo:
    return StepMinuteRepo(Database(path))


def add(idx: StepMinuteRepo, *ms: MinuteSummary) -> None:
    idx.add_step_minutes([m.__dict__ for m in ms])


def hist(idx: StepMinuteRepo, since: float, until: float) -> list[dict[str, Any]]:
    rows, covered = idx.step_history("j", since, until)
    assert covered == since
    return rows


def test_a_minute_per_role_median_over_ranks_and_the_slowest_three(tmp_path: Path) -> None:
    idx = minutes_at(tmp_path / "index.db")
    add(
        idx,
        *(minute(r, p) for r, p in enumerate([30.0, 31.0, 29.0, 45.0, 33.0])),
        minute(0, 10.0, role="rollout", steps=7, mx=80.0),
        minute(0, 99.0, job="other"),  # another job is not this one's history
        *(minute(r, 60.0, at=T0 + 60) for r in range(4)),
    )
    rows = hist(idx, T0, T0 + 120)
    for r in rows:
        C.HISTORY_ROW.check(r, "row")
    assert [(r["minute"], r["role"]) for r in rows] == [
        (T0, "rollout"),
        (T0, "trainer"),
        (T0 + 60, "trainer"),
    ]
    rollout, trainer, later = rows
    assert trainer["ranks"] == 5 and trainer["steps"] == 500
    assert trainer["p50_ms"] == 31.0  # the median of 29, 30, 31, 33, 45
    assert trainer["p90_ms"] == pytest.approx(31.0 * 1.2)
    assert trainer["max_ms"] == 90.0
    assert trainer["slowest"] == [
        {"host": "h1", "role": "trainer", "rank": 3, "p50_ms": 45.0},
        {"host": "h1", "role": "trainer", "rank": 4, "p50_ms": 33.0},
        {"host": "h1", "role": "trainer", "rank": 1, "p50_ms": 31.0},
    ]
    assert (rollout["ranks"], rollout["steps"], rollout["max_ms"]) == (1, 7, 80.0)
    assert later["ranks"] == 4 and later["p50_ms"] == 60.0  # even: the mean of the middle two
    # A minute counts when it overlaps the range: [since, until) cuts no minute in half.
    assert [r["minute"] for r in hist(idx, T0 + 30, T0 + 61)] == [T0, T0, T0 + 60]
    assert [r["minute"] for r in hist(idx, T0 + 60, T0 + 600)] == [T0 + 60]
    assert hist(idx, T0 + 120, T0 + 600) == []
    assert idx.step_history("nobody", 0, T0 + 600)[0] == []


def test_a_rank_that_came_back_within_a_minute_counts_once(tmp_path: Path) -> None:
    idx = minutes_at(tmp_path / "index.db")
    # Rank 0 left and attached again (a restarted daemon): two rows for one minute.
    add(idx, minute(0, 30.0, steps=300), minute(0, 90.0, steps=100, pid=2000), minute(1, 40.0))
    (row,) = hist(idx, T0, T0 + 60)
    assert row["ranks"] == 2 and row["steps"] == 500
    assert row["slowest"][0] == {"host": "h1", "role": "trainer", "rank": 1, "p50_ms": 40.0}
    assert row["slowest"][1]["p50_ms"] == 30.0  # weighted by steps: 300 at 30 ms, 100 at 90


def test_rows_without_quantiles_are_counted_and_not_medianed(tmp_path: Path) -> None:
    idx = minutes_at(tmp_path / "index.db")
    add(idx, minute(0, None, steps=3), minute(1, 20.0))
    (row,) = hist(idx, T0, T0 + 60)
    assert row["ranks"] == 2 and row["steps"] == 103 and row["p50_ms"] == 20.0
    assert [s["rank"] for s in row["slowest"]] == [1]


def test_a_range_with_too_many_rows_is_answered_for_its_newest_whole_minutes(
    tmp_path: Path,
) -> None:
    idx = minutes_at(tmp_path / "index.db")
    add(idx, *(minute(r, 30.0, at=T0 + 60 * i) for i in range(5) for r in range(4)))
    rows, since = idx.step_history("j", T0, T0 + 300, max_rows=10)
    # 10 rows reach into minute T0 + 120, which would be half there: it is left out.
    assert [r["minute"] for r in rows] == [T0 + 180, T0 + 240]
    assert [r["ranks"] for r in rows] == [4, 4] and since == T0 + 180
    rows, since = idx.step_history("j", T0, T0 + 300, max_rows=20)
    assert len(rows) == 5 and since == T0


def test_retention_deletes_old_minutes_in_chunks(tmp_path: Path) -> None:
    idx = minutes_at(tmp_path / "index.db")
    add(idx, *(minute(0, 30.0, at=T0 + 60 * i) for i in range(10)))
    assert idx.prune_step_minutes(T0 + 60 * 7, chunk=3) == 7
    assert [r["minute"] for r in hist(idx, 0, T0 + 3600)] == [
        T0 + 420,
        T0 + 480,
        T0 + 540,
    ]


def test_the_writer_prunes_at_start_then_hourly(tmp_path: Path) -> None:
    idx = minutes_at(tmp_path / "index.db")
    clock = Clock(T0 + 3600.0)
    w = StepHistory(idx, Storage({"index": tmp_path}), keep_s=1800.0, clock=clock)
    add(idx, minute(0, 30.0, at=T0))  # older than keep_history when the daemon starts
    w.tick([minute(0, 30.0, at=T0 + 3000)])
    assert [r["minute"] for r in hist(idx, 0, T0 + 7200)] == [T0 + 3000]
    clock.t += 1800.0  # T0 + 3000 is now too old, but the last pass was half an hour ago
    w.tick([])
    assert len(hist(idx, 0, T0 + 7200)) == 1
    clock.t += 1800.0
    w.tick([])
    assert hist(idx, 0, T0 + 7200) == []


def _locked(path: Path) -> sqlite3.Connection:
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    return other


def test_a_failed_write_keeps_its_minutes_for_the_next_tick(tmp_path: Path) -> None:
    path = tmp_path / "index.db"
    idx = minutes_at(path)
    idx.conn.execute("PRAGMA busy_timeout = 20")  # a locked index fails fast, not in 30 s
    storage = Storage({"index": tmp_path})
    w = StepHistory(idx, storage, keep_s=1e9, clock=Clock(T0 + 60.0))
    w.tick([])  # the start's retention pass, while the index is free
    other = _locked(path)
    w.tick([minute(r, 30.0) for r in range(4)])
    assert len(w.pending) == 4 and not storage.status()["ok"]
    other.execute("ROLLBACK")
    other.close()
    w.tick([minute(0, 31.0, at=T0 + 60)])
    assert not w.pending and storage.status()["ok"]
    assert [r["ranks"] for r in hist(idx, T0, T0 + 120)] == [4, 1]


def test_minutes_waiting_on_an_unwritable_index_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(H, "MAX_PENDING", 10)
    path = tmp_path / "index.db"
    idx = minutes_at(path)
    idx.conn.execute("PRAGMA busy_timeout = 20")
    w = StepHistory(idx, Storage({"index": tmp_path}), keep_s=1e9, clock=Clock(T0 + 60.0))
    w.tick([])
    other = _locked(path)
    w.tick([minute(r, 30.0) for r in range(8)])
    w.tick([minute(r, 30.0) for r in range(8, 14)])
    assert len(w.pending) == 10 and w.dropped == 4
    other.execute("ROLLBACK")
    other.close()
    w.tick([])
    (row,) = hist(idx, T0, T0 + 60)
    # The oldest went first: ranks 4..13 are what the index has.
    assert row["ranks"] == 10 and {s["rank"] for s in row["slowest"]} <= set(range(4, 14))
    assert w.dropped == 0


def test_1024_ranks_minute_is_one_transaction(tmp_path: Path) -> None:
    idx = minutes_at(tmp_path / "index.db")
    w = StepHistory(idx, Storage({"index": tmp_path}), keep_s=1e9, clock=Clock(T0 + 60.0))
    w.tick([minute(r, 30.0 + r % 7) for r in range(1024)])
    (row,) = hist(idx, T0, T0 + 60)
    assert row["ranks"] == 1024 and row["steps"] == 102_400


# --- the seed of a restarted daemon's ledger ------------------------------------------------
def test_a_rank_shows_its_last_indexed_minute_until_its_ledger_comes(tmp_path: Path) -> None:
    idx = minutes_at(tmp_path / "index.db")
    clock = Clock(T0 + 100.0)
    w = StepHistory(idx, Storage({"index": tmp_path}), keep_s=1e9, clock=clock)
    # The daemon before the restart wrote rank 0's minute T0 (and an older, faster one).
    w.tick([minute(0, 20.0, at=T0 - 600), minute(0, 42.0, at=T0), minute(0, 99.0, role="x")])
    led = Ledgers(clock, seed=w.seed)
    c = client(rank=0, role="trainer")
    c.sps = 10.0  # its rate is known before its ledger: the index says more
    f = led.figures(c, 5.0)
    assert (f.source, f.p50_ms, f.p99_ms) == ("index", 42.0, None)
    led.heartbeat(c, 10, ledger([0.030] * 10, 10), 6.0)
    f = led.figures(c, 6.0)
    assert f.source == "ledger" and f.p50_ms == pytest.approx(30.0)


def test_a_stale_or_missing_minute_seeds_nothing(tmp_path: Path) -> None:
    idx = minutes_at(tmp_path / "index.db")
    clock = Clock(T0 + 60.0 + SEED_MAX_AGE_S + 1.0)  # minute T0 ended just too long ago
    w = StepHistory(idx, Storage({"index": tmp_path}), keep_s=1e9, clock=clock)
    w.tick([minute(0, 42.0, at=T0)])
    led = Ledgers(clock, seed=w.seed)
    c = client(rank=0, role="trainer")
    assert led.figures(c, 1.0).source is None
    c.sps = 25.0
    assert (led.figures(c, 1.0).source, led.figures(c, 1.0).p50_ms) == ("rate", 40.0)
    other = client(rank=1, role="trainer", pid=101)
    assert led.figures(other, 1.0).source is None  # rank 1 never had a minute


def test_a_seed_ages_out_while_the_rank_sends_no_ledger(tmp_path: Path) -> None:
    idx = minutes_at(tmp_path / "index.db")
    clock = Clock(T0 + 61.0)
    w = StepHistory(idx, Storage({"index": tmp_path}), keep_s=1e9, clock=clock)
    w.tick([minute(0, 42.0, at=T0)])
    led = Ledgers(clock, seed=w.seed)
    c = client(rank=0, role="trainer")
    led.tick([c])
    assert led.figures(c, 1.0).source == "index"
    clock.t += SEED_MAX_AGE_S
    assert led.figures(c, 1.0).source is None  # no ledger for two minutes: no figure
    led.tick([])  # it left: its seed is forgotten with it
    assert not led._seeded


# --- profctl: the cluster merge, the slower marker, --since -------------------------------
def _doc(node: str, minutes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"job": "j", "since": 0.0, "until": 1.0, "node": node, "minutes": minutes}


def _row(p50: float, ranks: int, at: int = T0, **kw: Any) -> dict[str, Any]:
    return {"minute": at, "role": "trainer", "ranks": ranks, "steps": 10 * ranks,
            "p50_ms": p50, "p90_ms": p50 * 1.5, "max_ms": p50 * 3,
            "slowest": [{"host": "pod", "role": "trainer", "rank": kw.get("rank", 0),
                         "p50_ms": p50 + 1}]}  # fmt: skip


def test_nodes_minutes_merge_per_minute_and_role() -> None:
    a, b, c = Node("n1"), Node("n2"), Node("n3")
    answers = [
        Answer(a, data=_doc("n1", [_row(30.0, 8, rank=0), _row(30.0, 8, at=T0 + 60)])),
        Answer(b, data=_doc("n2", [_row(31.0, 8, rank=8)])),
        Answer(c, data=_doc("n3", [_row(90.0, 2, rank=16)])),
    ]
    first, second = merge(answers)
    assert (first["ranks"], first["steps"], first["max_ms"]) == (18, 180, 270.0)
    assert first["p50_ms"] == 31.0  # weighted by ranks: 8 at 30, 8 at 31, 2 at 90
    assert first["p90_ms"] == 31.0 * 1.5
    assert [(s["host"], s["rank"], s["client_host"]) for s in first["slowest"]] == [
        ("n3", 16, "pod"),
        ("n2", 8, "pod"),
        ("n1", 0, "pod"),
    ]
    assert second["ranks"] == 8 and second["slowest"][0]["host"] == "n1"


def test_a_minute_slower_than_the_first_shown_is_marked() -> None:
    rows = [_row(30.0, 1), _row(35.0, 1, at=T0 + 60), _row(36.0, 1, at=T0 + 120)]
    rows.insert(1, {**_row(100.0, 1), "role": "rollout"})  # its own first minute
    mark_slower(rows)
    assert [r["vs_first"] for r in rows] == [None, None, pytest.approx(35 / 30), 1.2]
    assert [_change(r) for r in rows] == ["", "", "", "+20%"]  # 20 % and more is marked


def test_since_takes_durations_times_and_unix_seconds() -> None:
    now = 1_800_000_000.0
    assert parse_when("90s", "--since", now) == now - 90
    assert parse_when("2h", "--since", now) == now - 7200
    assert parse_when("7d", "--since", now) == now - 7 * 86400
    assert parse_when("1700000000", "--since", now) == 1_700_000_000.0
    assert parse_when("2026-01-31T14:00:00+00:00", "--since", now) == 1_769_868_000.0
    with pytest.raises(BadUsage, match="--until 'yesterday'"):
        parse_when("yesterday", "--until", now)


def test_ledger_minutes_close_into_rows_the_index_aggregates(tmp_path: Path) -> None:
    """The ledger's own MinuteSummary, not a hand-made one, is what the index takes."""
    rng = random.Random(3)
    clock = Clock(float(T0) + 1.0)
    led = Ledgers(clock)
    cs = [client(rank=r, pid=100 + r) for r in range(3)]
    for i in range(5):
        for c in cs:
            slow = 1.5 if c.rank == 2 else 1.0
            ds = [0.03 * slow * (1 + rng.uniform(-0.05, 0.05)) for _ in range(10)]
            led.heartbeat(c, 10 * (i + 1), ledger(ds, 10 * (i + 1)), 1000.0 + i)
    led.tick([])  # all left
    idx = minutes_at(tmp_path / "index.db")
    StepHistory(idx, Storage({"index": tmp_path}), keep_s=1e9, clock=clock).tick(led.take_minutes())
    (row,) = hist(idx, T0, T0 + 60)
    assert row["ranks"] == 3 and row["steps"] == 150
    assert 28.0 < row["p50_ms"] < 32.0
    assert row["slowest"][0]["rank"] == 2 and 42.0 < row["slowest"][0]["p50_ms"] < 48.0
