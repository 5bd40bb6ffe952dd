"""One glob language in three places: the daemon's selector (``profctl ps``/``start``), the
SQLite index (``profctl traces``) and the S3 manifest listing (``profctl traces --s3``)."""

from __future__ import annotations

import fnmatch
import random
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from profd import globs
from profd.ctl.commands.s3list import keep
from profd.daemon.sessions.selector import Selector
from profd.store.index import Database, SessionRepo, TraceFilter, TraceRepo

# (pattern, name, matches)
TABLE: list[tuple[str, str, bool]] = [
    # A plain name is an exact, case-sensitive match.
    ("actor", "actor", True),
    ("actor", "Actor", False),
    ("actor", "ACTOR", False),
    ("actor", "actor2", False),
    ("actor", "my-actor", False),
    ("Actor", "actor", False),
    # SQL LIKE's wildcards are ordinary characters.
    ("act%", "actor", False),
    ("act%", "act%", True),
    ("act_r", "actor", False),
    ("act_r", "act_r", True),
    ("%", "", False),
    ("_", "a", False),
    ("a\\b", "a\\b", True),
    ("a\\*", "a\\xyz", True),
    # * and ?
    ("*", "", True),
    ("*", "anything at all", True),
    ("act*", "actor", True),
    ("act*", "Actor", False),
    ("*policy*", "dtensor_policy_worker", True),
    ("*POLICY*", "dtensor_policy_worker", False),
    ("*_worker", "dtensor_policy_worker", True),
    ("a*b*c", "aXbYc", True),
    ("a*b*c", "aXbY", False),
    ("act?r", "actor", True),
    ("act?r", "actr", False),
    ("??", "ab", True),
    ("??", "abc", False),
    ("?", "é", True),
    # Sets
    ("r[0-3]", "r2", True),
    ("r[0-3]", "r4", False),
    ("[aA]ctor", "Actor", True),
    ("[aA]ctor", "bctor", False),
    ("[!a]ctor", "Actor", True),
    ("[!a]ctor", "actor", False),
    ("[^a]x", "^x", True),  # ^ negates in SQLite, not here
    ("[^a]x", "bx", False),
    ("[]]", "]", True),
    ("[]a]", "a", True),
    ("[!]]", "]", False),
    ("[!]]", "a", True),
    ("[a-]", "-", True),
    ("[-a]", "-", True),
    ("[--/]", ".", True),
    ("[]-a]", "^", True),  # a range from ] to a
    ("[z-a]", "m", False),  # a reversed range is empty
    ("[z-a]", "z", False),
    ("[!z-a]", "m", True),
    ("[a-c-e]", "-", True),
    ("[a-c-e]", "d", False),
    ("[*]", "*", True),
    ("[*]", "x", False),
    ("[?]x", "?x", True),
    ("[[]", "[", True),
    ("[%_]", "_", True),
    ("[%_]", "x", False),
    ("[!%_]", "x", True),
    # A [ with no closing ] is an ordinary character.
    ("a[b", "a[b", True),
    ("a[b", "ab", False),
    ("[", "[", True),
    ("[!", "[!", True),
    ("a]", "a]", True),
    ("*[", "xx[", True),
]
NAMES = sorted({name for _, name, _ in TABLE})


def _row(role: str) -> dict[str, Any]:
    return {"role": role, "rank": 0, "host": "h", "created_at": 1.0}


def _client(role: str) -> Any:
    return SimpleNamespace(job="j", host="h", pid=1, role=role, rank=0)


def _db(names: list[str]) -> sqlite3.Connection:
    db = sqlite3.connect(":memory:")
    globs.register_sqlite(db)
    db.execute("CREATE TABLE t (name TEXT)")
    db.executemany("INSERT INTO t VALUES (?)", [(n,) for n in names])
    return db


def _sqlite_matches(db: sqlite3.Connection, pattern: str) -> set[str]:
    cond, args = globs.sqlite_condition("name", pattern)
    return {r[0] for r in db.execute(f"SELECT name FROM t WHERE {cond}", args)}


@pytest.mark.parametrize(("pattern", "name", "expected"), TABLE)
def test_every_implementation_agrees(pattern: str, name: str, expected: bool) -> None:
    assert globs.match(name, pattern) is expected
    assert fnmatch.fnmatchcase(name, pattern) is expected
    assert (name in _sqlite_matches(_db([name]), pattern)) is expected
    assert keep(_row(name), role=pattern) is expected
    assert Selector(roles=(pattern,)).matches(_client(name)) is expected


def test_sqlite_agrees_with_match_on_random_patterns() -> None:
    # Patterns built from the characters where the two languages differ (set syntax, escapes,
    # LIKE's wildcards, case), against names from the same characters.
    alphabet = "ab-]^![*?\\%_A\0é"
    rnd = random.Random(20250101)
    names = sorted(
        {
            "".join(rnd.choice(alphabet.replace("\0", "")) for _ in range(rnd.randrange(4)))
            for _ in range(400)
        }
    )
    db = _db(names)
    for _ in range(3000):
        pattern = "".join(rnd.choice(alphabet) for _ in range(rnd.randrange(1, 9)))
        want = {n for n in names if globs.match(n, pattern)}
        assert _sqlite_matches(db, pattern) == want, pattern


@pytest.mark.parametrize("text", ["actor", "a*b", "[x]", "a[b", "?", "[!]", "%_", "a-]^"])
def test_escape_matches_only_itself(text: str) -> None:
    pattern = globs.escape(text)
    assert globs.match(text, pattern)
    assert globs.literal(pattern) == text
    assert not globs.match(text + "x", pattern)


def test_literal_patterns_compare_with_equals() -> None:
    assert globs.literal("actor") == "actor"
    assert globs.literal("a[*]") == "a*"
    assert globs.literal("a[b") == "a[b"
    assert globs.literal("act*") is None
    assert globs.literal("[ab]") is None
    assert globs.sqlite_condition("role", "actor") == ("role = ?", ("actor",))
    assert globs.sqlite_condition("role", "act*") == ("role GLOB ?", ("act*",))
    assert globs.sqlite_condition("role", "[z-a]") == ("0", ())


# --- the index, on a real SQLite file -----------------------------------------------------------

ROLES = ["actor", "Actor", "ACTOR", "act_r", "act%r", "actxr", "critic", "dtensor_policy_worker"]
PATTERNS = ["actor", "Actor", "act*", "ACT*", "act_r", "act%r", "act?r", "[aA]ctor", "*or", "*"]


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Database]:
    idx = Database(tmp_path / "index.db")
    for i, role in enumerate(ROLES):
        sid = f"20250101-12000{i}-abc{i}"
        TraceRepo(idx).add_trace(
            {
                "session": sid,
                "job": "job-1" if i % 2 else "job-2",
                "host": "node0",
                "pid": 100 + i,
                "role": role,
                "rank": i,
                "cycle": 0,
                "region": None,
                "steps": [3, 4],
                "path": f"/spool/{sid}/{role}-r{i}.pt.trace.json.gz",
                "bytes": 1000,
                "state": "ok",
                "stall_ms": None,
                "step_ms_p50": None,
                "step_ms_max": None,
                "torch": None,
                "device": None,
                "created_at": 1000.0 + i,
            },
            [],
        )
    yield idx
    idx.close()


@pytest.mark.parametrize("pattern", PATTERNS)
def test_index_role_filter_is_the_same_glob(index: Database, pattern: str) -> None:
    rows = TraceRepo(index).traces(TraceFilter(role=pattern, limit=1000))
    want = [r for r in ROLES if globs.match(r, pattern)]
    assert sorted(r["role"] for r in rows) == sorted(want)
    assert sorted(r["role"] for r in rows if keep(r, role=pattern)) == sorted(want)


def test_index_role_pattern_with_nul(index: Database, tmp_path: Path) -> None:
    # GLOB would stop reading at the NUL and match "act" alone; the registered function does not.
    assert TraceRepo(index).traces(TraceFilter(role="act\0*", limit=1000)) == []
    assert len(TraceRepo(index).traces(TraceFilter(role="[!\0]ctor", limit=1000))) == 2
    ro = Database(tmp_path / "index.db", readonly=True)
    try:
        assert len(TraceRepo(ro).traces(TraceFilter(role="[!\0]ctor", limit=1000))) == 2
    finally:
        ro.close()


def _plan(index: Database, sql: str, args: tuple[Any, ...]) -> str:
    return " ".join(r[3] for r in index.conn.execute("EXPLAIN QUERY PLAN " + sql, args))


def test_index_queries_keep_their_indexes(index: Database) -> None:
    cond, args = globs.sqlite_condition("t.role", "act*")
    sql = f"SELECT * FROM traces t WHERE t.job = ? AND {cond} ORDER BY t.created_at DESC"
    assert "USING INDEX traces_job" in _plan(index, sql, ("job-1", *args))
    # A session short id is a prefix: a range on the primary key, not a scan as LIKE was.
    cond, args = globs.sqlite_condition("id", globs.escape("2025") + "*")
    assert "SEARCH sessions USING INDEX" in _plan(
        index, f"SELECT * FROM sessions WHERE {cond}", args
    )


def test_session_short_ids_are_literal_prefixes(index: Database) -> None:
    now = time.time()
    for sid in ("20250101-120000-ab_d", "20250101-120000-abXd"):
        SessionRepo(index).save_session(
            {
                "id": sid,
                "job": "j",
                "state": "done",
                "backend": "torch",
                "label": None,
                "region": None,
                "request": {},
                "cycles": [],
                "plan": 0,
                "error": None,
                "created_at": now,
                "updated_at": now,
            }
        )
    found = SessionRepo(index).session("20250101-120000-ab_")
    assert found is not None and found["id"] == "20250101-120000-ab_d"
    assert SessionRepo(index).session("20250101-120000-ABX") is None  # ids are case-sensitive
    assert SessionRepo(index).session("20250101-120000-ab") is None  # ambiguous
