"""A listing row the reply schema refuses costs that row's fields (or, if even that is not
enough, that row), never the listing."""

from __future__ import annotations

from typing import Any

import pytest

from profd import control_schema as C
from profd.daemon.control import servable
from profd.daemon.control.handler import ControlHandler
from profd_client import protocol as P


def _trace(**over: Any) -> dict[str, Any]:
    row = {
        "id": 1,
        "session": "s1",
        "job": "j",
        "host": "h",
        "pid": 10,
        "role": "main",
        "rank": 0,
        "cycle": 0,
        "region": None,
        "steps": [3, 4],
        "path": "/spool/j/s1/c0/main-r0.pt.trace.json.gz",
        "bytes": 100,
        "state": "done",
        "stall_ms": None,
        "step_ms_p50": 1.0,
        "step_ms_max": None,
        "torch": "2.13",
        "device": None,
        "created_at": 1000.0,
        "stats": {"comm_ms": [1.0]},
        "files": [],
        "upload_state": "pending",
        "s3_uri": None,
        "node": "n1",
    }
    return {**row, **over}


def test_a_clean_listing_is_served_as_it_is() -> None:
    rows = [_trace(id=i) for i in range(40)]
    assert servable.rows(rows, C.TRACE_ROW) == rows
    frame = ControlHandler._reply({"v": P.VERSION, "t": C.C_TRACES}, rows)
    assert P.decode(frame, C.REPLY_INBOUND, reply=True)["data"] == rows


def test_the_reply_repairs_only_rows_from_the_index() -> None:
    """A listing that cannot be sent is repaired on its way out; any other reply that breaks
    its schema stays a bug (raised, answered as "internal")."""
    rows = [_trace(id=i) for i in range(40)]
    rows[5] = _trace(id=5, stats={"step": [10**30]})  # inside a map: only msgpack refuses it
    frame = ControlHandler._reply({"v": P.VERSION, "t": C.C_TRACES}, rows)
    sent = P.decode(frame, C.REPLY_INBOUND, reply=True)["data"]
    assert len(sent) == 40 and sent[5]["stats"] is None and "stats" in sent[5]["skipped"]
    with pytest.raises(P.ProtocolError):
        ControlHandler._reply({"v": P.VERSION, "t": C.C_INCIDENTS}, [{"host": "h", "pid": "x"}])


def test_values_beyond_msgpack_or_the_schema_are_emptied_and_named() -> None:
    huge = 10**30
    rows = [_trace(id=i) for i in range(40)]
    rows[3] = _trace(id=3, steps=[huge], stats={"step": [huge]})  # msgpack cannot carry it
    rows[7] = _trace(id=7, steps=[P.MAX_STEP + 1], stall_ms=float("nan"))  # the schema refuses it
    out = servable.rows(rows, C.TRACE_ROW)
    assert len(out) == 40
    assert out[3]["steps"] == [] and out[3]["stats"] is None
    assert "steps" in out[3]["skipped"] and "stats" in out[3]["skipped"]
    assert out[7]["steps"] == [] and out[7]["stall_ms"] is None
    assert "skipped" not in out[0]
    C.reply({"v": P.VERSION, "t": C.C_TRACES}, out)  # and the whole listing can be sent


def test_a_row_that_breaks_its_schema_even_emptied_is_left_out() -> None:
    rows = [_trace(id=i) for i in range(3)]
    rows[1] = _trace(id=1, rank=10**30)  # rank cannot be null
    out = servable.rows(rows, C.TRACE_ROW)
    assert [r["id"] for r in out] == [0, 2]
    C.reply({"v": P.VERSION, "t": C.C_TRACES}, out)
