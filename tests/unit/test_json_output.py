"""profctl's ``--json`` text: rows one per line, anything else indented; both parse back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from profd.ctl.render import json_text


def test_a_list_of_rows_is_one_sorted_row_per_line() -> None:
    text = json_text([{"pid": 2, "host": "a", "files": [1]}, {"pid": None}])
    assert text.splitlines() == [
        "[",
        '  {"files": [1], "host": "a", "pid": 2},',
        '  {"pid": null}',
        "]",
    ]


#: Lists of rows, some with what a row boundary reads like inside them.
_ROWS = [
    [{"a": 1}, {}, {}, {"b": [1, {"c": 2}]}],
    [{"s": "}, {"}, {"t": "x}, {y"}],
    [{"files": [{"p": 1}, {"p": 2}]}, {"files": []}],
    [{"path": Path("/x"), "n": float("nan")}, {"é": "ü\n"}],
]


@pytest.mark.parametrize("rows", _ROWS)
def test_rows_are_jsons_own_text_one_per_line(rows: list[dict[str, Any]]) -> None:
    row = json.JSONEncoder(sort_keys=True, default=str).encode
    assert json_text(rows) == "[\n" + ",\n".join("  " + row(r) for r in rows) + "\n]"


@pytest.mark.parametrize(
    "doc",
    [[], {"session": "s", "targets": [{"rank": 0}]}, [1, 2], [{"path": Path("/x")}], [{}]],
)
def test_every_shape_parses_back(doc: Any) -> None:
    assert json.loads(json_text(doc)) == json.loads(json.dumps(doc, default=str))


def test_a_single_document_stays_indented() -> None:
    assert json_text({"b": 1, "a": 2}) == '{\n  "a": 2,\n  "b": 1\n}'


_NESTED_DOCS = [
    {"ranks": [{"rank": 0, "regions": {"fwd": 0.5, "bwd": 0.25}, "vs_role": None}, {"rank": 1}]},
    {"a": [[[]]], "b": [[{}]], "c": {"d": {"e": [1, (2, 3)]}}},
    {"x": float("nan"), "y": float("-inf"), "z": 1e300, "t": True, "n": None},
    {"path": Path("/x"), "é": 'ü\n"\t', "when": [Path("/y"), {"k": Path("/z")}]},
    # Strings that encode like the stand-in for a nested container.
    {"s": "\x00", "l": ["\x00", [1]], "m": {"a": ["\x00", {"b": "\x00"}]}},
    {1: [2], 2.5: "x", 3: {"k": [3]}},
    [[1, [2, [3, [4, {}]]]], "tail"],
]


@pytest.mark.parametrize("doc", _NESTED_DOCS)
def test_a_document_is_written_as_jsons_own_indent(doc: Any) -> None:
    assert json_text(doc) == json.dumps(doc, indent=2, sort_keys=True, default=str)


def test_a_reference_cycle_is_jsons_own_error() -> None:
    doc: dict[str, Any] = {"a": [1]}
    doc["a"].append(doc)
    with pytest.raises(ValueError, match="Circular reference"):
        json_text(doc)
