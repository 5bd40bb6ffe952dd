"""``profctl status``'s text lines built from a daemon's ``status`` answer."""

from __future__ import annotations

import time

from profd.ctl.commands.status import warehouse_line


def test_the_warehouse_line_says_where_it_writes_what_waits_and_why_it_fails() -> None:
    now = time.time()
    ok = {
        "enabled": True, "url": "s3://b/wh/", "pending_partitions": 2, "last_flush_at": now - 600,
        "days_sealed": 10, "failing": False, "last_error": None,
    }  # fmt: skip
    assert warehouse_line(ok) == (
        "warehouse s3://b/wh/  2 partition(s) pending, last written 10m ago, 10 day(s) sealed"
    )
    merged = {**ok, "days_handed_to_fleet": 4}
    assert warehouse_line(merged).endswith("10 day(s) sealed, 4 handed to fleet objects")
    down = {**ok, "days_sealed": 0, "failing": True, "last_error": "cannot reach s3"}
    assert warehouse_line(down).endswith("last written 10m ago  FAILING: cannot reach s3")
    assert warehouse_line({**ok, "last_flush_at": None}).split(", ")[1] == "last written -"
    assert warehouse_line({"enabled": False}) == "warehouse off"
