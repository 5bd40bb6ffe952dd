"""Which write errors are a full disk: by errno and by SQLite's result code, never by the
text of the message (a real SQLite file filled to its page limit, real ``OSError``s)."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

import pytest

from profd.daemon.spool.storage import describe, is_disk_full


def _full_sqlite(tmp_path: Path) -> sqlite3.OperationalError:
    db = sqlite3.connect(tmp_path / "small.db")
    db.execute("PRAGMA max_page_count = 8")
    db.execute("CREATE TABLE t (x BLOB)")
    with pytest.raises(sqlite3.OperationalError) as got:
        for _ in range(64):
            db.execute("INSERT INTO t VALUES (?)", (b"x" * 4096,))
    db.close()
    return got.value


def test_a_sqlite_database_that_cannot_grow_is_a_full_disk(tmp_path: Path) -> None:
    exc = _full_sqlite(tmp_path)
    assert exc.sqlite_errorcode == sqlite3.SQLITE_FULL
    assert is_disk_full(exc)
    assert describe(exc, tmp_path).startswith(f"disk full in {tmp_path} (")


def test_another_sqlite_error_is_not_a_full_disk_whatever_its_text_says(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "a.db")
    with pytest.raises(sqlite3.OperationalError) as got:
        db.execute("SELECT * FROM the_disk_is_full")  # "no such table: ...", SQLITE_ERROR
    db.close()
    assert "disk_is_full" in str(got.value)
    assert not is_disk_full(got.value)


def test_a_sqlite_error_raised_by_python_code_has_no_result_code_and_is_no_full_disk() -> None:
    exc = sqlite3.OperationalError("database or disk is full")  # as a test double raises it
    assert not hasattr(exc, "sqlite_errorcode")
    assert not is_disk_full(exc)
    assert describe(exc) == "OperationalError: database or disk is full"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_no_space_or_no_quota_is_a_full_disk(code: int) -> None:
    assert is_disk_full(OSError(code, "whatever"))


def test_other_os_errors_are_not_a_full_disk() -> None:
    assert not is_disk_full(OSError(errno.EACCES, "disk is full"))
    assert not is_disk_full(ValueError("disk is full"))
