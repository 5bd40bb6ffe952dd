"""profctl's words for protocol refusals (``profd/ctl/flags.py``), and session ids found by
any unique part (``SessionRepo.session``/``session_ids``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from profd import control_schema as C
from profd.ctl.flags import FLAGS, human, user_text
from profd.store.index import Database, SessionRepo
from profd_client import protocol as P


@pytest.mark.parametrize(
    ("message", "text"),
    [
        (
            "start.spec.at_step: 0 is out of range 1..281474976710656",
            "--at-step must be at least 1 (got 0)",
        ),
        ("start.spec.pids[2]: 0 is out of range 1..4194304", "--pid must be at least 1 (got 0)"),
        (
            "start.spec.ranks: 16777216 is out of range 0..16777215",
            "--ranks must be at most 2^24-1 (got 16777216)",
        ),
        (
            "start.spec.label: length 300 is not 0..200",
            "--label takes at most 200 characters (got 300)",
        ),
        ("start.spec.pids: 5000 items, not 0..4096", "--pid takes at most 4096 values (got 5000)"),
        (
            "start.spec.options.activities[0]: 'x' is not one of cpu, cuda",
            "--activities 'x': must be one of cpu, cuda",
        ),
        ("sessions.job: must be a string, got int", "--job: must be a string, got int"),
    ],
)
def test_user_text(message: str, text: str) -> None:
    assert user_text(message) == text


def test_other_messages_are_left_as_they_were() -> None:
    # Not a request field, or no field's refusal at all.
    for message in (
        "no session 'x'",
        "start.spec.cycles[0]: overlaps the cycle before it",
        "--steps 0:10: steps are 1-indexed, start must be >= 1",
    ):
        assert user_text(message) == message


def test_every_flagged_field_is_a_request_field() -> None:
    """A renamed field would silently fall back to its path: the table follows the protocol."""
    for path in FLAGS:
        t, *names = path.split(".")
        field: object = C.SCHEMAS[t]
        for name in names:
            while isinstance(field, P.Nullable):
                field = field.inner
            assert isinstance(field, P.Struct) and name in field.fields, path
            field = field.fields[name][0]


def test_human_limits() -> None:
    assert [human(n) for n in (0, 1000, 1 << 20, (1 << 24) - 1, 1 << 48, 123456789)] == [
        "0", "1000", "2^20", "2^24-1", "2^48", "123456789",
    ]  # fmt: skip


def test_an_id_matches_exactly_first_then_by_any_unique_part(tmp_path: Path) -> None:
    db = Database(tmp_path / "index.db")
    ix = SessionRepo(db)
    now = time.time()
    for i, sid in enumerate(("abc", "xabcx", "20261124-190243-9f0904")):
        ix.save_session(
            {"id": sid, "job": "j", "state": "done", "backend": "torch", "label": None,
             "region": None, "request": {}, "cycles": [], "plan": 0, "error": None,
             "created_at": now + i, "updated_at": now + i}
        )  # fmt: skip
    try:
        assert ix.session("abc")["id"] == "abc"  # type: ignore[index]
        assert ix.session("bcx")["id"] == "xabcx"  # type: ignore[index]
        assert ix.session("9f0904")["id"] == "20261124-190243-9f0904"  # type: ignore[index]
        assert ix.session("bc") is None  # two ids hold it
        assert ix.session_ids("bc", 5) == ["xabcx", "abc"]  # newest first
        assert ix.session("%") is None and ix.session_ids("_", 5) == []  # literal text
    finally:
        db.close()
