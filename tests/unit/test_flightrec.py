"""Flight recorder summaries (profd_client.flight.condense) and where ranks part
(profd.watch.flightrec.divergence), on dumps constructed from torch's documented format
(tests/data/flightrec, named as such) and on synthetic summaries from 2 to 1,024 ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from profd.watch import flightrec
from profd.watch import hang_diagnosis as hang
from profd.watch.stackrows import StackRank, to_maps
from profd_client import flight
from profd_client import protocol as P

DATA = Path(__file__).resolve().parent.parent / "data" / "flightrec"


def _row(rank: int, summary: dict[str, Any] | None, host: str = "a", **kw: Any) -> StackRank:
    return StackRank(
        host=host,
        role="trainer",
        rank=rank,
        pid=100 + rank,
        source=None,
        threads=(),
        flight=summary,
        **kw,
    )


def test_a_constructed_nccl_dump_condenses_and_names_the_rank_behind() -> None:
    rows = []
    for rank in range(4):
        doc = json.loads((DATA / f"nccl-constructed-rank{rank}.json").read_text())
        summary = flight.condense(doc)
        P.FLIGHT.check(summary, "flight")  # what the client sends passes the protocol
        rows.append(_row(rank, summary))
    assert rows[0].flight is not None and rows[0].flight["pgs"] == [
        {"pg": "0", "desc": "default_pg", "enqueued": 42, "started": 42, "completed": 41}
    ]
    assert rows[0].flight["entries"][-1] == {
        "pg": "0", "seq": 42, "p2p": False, "op": "nccl:all_reduce", "state": "started",
        "sizes": [[1024, 1024]],
    }  # fmt: skip
    found = flightrec.divergence(rows)
    assert found is not None
    (g,) = found.groups
    assert (g.kind, g.seq, g.op) == ("behind", 42, "nccl:all_reduce")
    assert [m.rank for m in g.behind] == [3] and g.behind[0].last == 41
    assert [m.rank for m in g.ahead] == [0, 1, 2]
    assert flightrec.text(found) == [
        "flight recorder: process group 0 (default_pg): rank 3 never reached collective #42"
        " (nccl:all_reduce) that ranks 0-2 entered"
    ]


def _summary(last: int, ops: dict[int, str] | None = None, pg: str = "0") -> dict[str, Any]:
    ops = ops or {}
    return {
        "version": "2.10",
        "pgs": [{"pg": pg, "desc": "", "enqueued": last, "started": -1, "completed": last - 1}],
        "entries": [
            {
                "pg": pg,
                "seq": s,
                "p2p": False,
                "op": ops.get(s, "gloo:all_reduce"),
                "state": "scheduled",
                "sizes": [[4]],
            }
            for s in range(max(1, last - 5), last + 1)
        ],
    }


@pytest.mark.parametrize("n", [2, 3, 64, 1024])
def test_one_rank_behind_among_n(n: int) -> None:
    odd = n // 2
    found = flightrec.divergence([_row(i, _summary(99 if i == odd else 100)) for i in range(n)])
    assert found is not None and found.ranks == n
    (g,) = found.groups
    assert g.seq == 100 and [m.rank for m in g.behind] == [odd]
    assert len(g.ahead) == n - 1


def test_ranks_that_agree_differ_nowhere_and_missing_summaries_are_listed() -> None:
    rows = [_row(i, _summary(100)) for i in range(4)]
    rows.append(_row(4, None, flight_error="no flight recorder: its agent thread did not answer"))
    found = flightrec.divergence(rows)
    assert found is not None and found.groups == ()
    assert [w.rank for w in found.without] == [4]
    lines = flightrec.text(found)
    assert lines[0] == "flight recorder: the 4 ranks that sent one agree on every collective"
    assert lines[1].startswith("flight recorder: none from rank 4: no flight recorder")
    assert flightrec.divergence([_row(0, None), _row(1, None)]) is None


def test_different_operations_under_one_number_are_a_mismatch() -> None:
    rows = [_row(0, _summary(100)), _row(1, _summary(100, {98: "gloo:broadcast"}))]
    found = flightrec.divergence(rows)
    assert found is not None
    (g,) = found.groups
    assert g.kind == "mismatch" and g.seq == 98
    assert sorted(g.ops) == ["gloo:all_reduce [[4]]", "gloo:broadcast [[4]]"]


def test_groups_are_judged_apart_and_across_nodes() -> None:
    rows = [_row(i, _summary(100), host="a") for i in range(2)]
    rows += [_row(2 + i, _summary(100 if i else 97), host="b") for i in range(2)]
    rows += [_row(4, _summary(7, pg="tp"), host="b"), _row(5, _summary(7, pg="tp"), host="b")]
    found = flightrec.divergence(rows)
    assert found is not None
    (g,) = found.groups  # the "tp" group agrees
    assert g.pg == "0" and g.seq == 98
    assert [(m.host, m.rank) for m in g.behind] == [("b", 2)]
    assert "rank 2 on b never reached collective #98" in flightrec.text(found)[0]


def test_an_incident_keeps_only_the_newest_entries() -> None:
    s = _summary(100)
    s["entries"] = s["entries"] * 20
    kept = hang.kept(_row(0, s)).flight
    assert kept is not None
    assert len(kept["entries"]) == flightrec.KEEP_ENTRIES and kept["pgs"] == s["pgs"]


def test_condense_bounds_what_a_huge_or_odd_dump_gives() -> None:
    doc = json.loads((DATA / "nccl-constructed-rank0.json").read_text())
    doc["entries"] = doc["entries"] * 1000 + ["not a map"]
    doc["entries"][0]["input_sizes"] = [[1] * 50] * 50
    doc["pg_status"]["x"] = "not a map"
    summary = flight.condense(doc)
    P.FLIGHT.check(summary, "flight")
    assert len(summary["entries"]) <= P.FLIGHT_MAX_ENTRIES
    assert flight.condense({}) == {"version": "", "pgs": [], "entries": []}


def test_the_divergence_keeps_its_map_shape_on_the_wire_and_in_the_evidence() -> None:
    rows = [_row(i, _summary(99 if i == 1 else 100)) for i in range(3)]
    rows.append(_row(3, None, flight_error="off"))
    doc = to_maps(flightrec.divergence(rows))
    assert doc == {
        "groups": [{
            "pg": "0", "desc": "", "seq": 100, "kind": "behind", "op": "gloo:all_reduce",
            "ahead": [{"host": "a", "role": "trainer", "rank": r} for r in (0, 2)],
            "behind": [{"host": "a", "role": "trainer", "rank": 1, "last": 99}], "ops": {},
        }],
        "without": [{"host": "a", "role": "trainer", "rank": 3, "why": "off"}],
        "ranks": 3,
    }  # fmt: skip
