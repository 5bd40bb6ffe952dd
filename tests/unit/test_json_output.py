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


@pytest.mark.parametrize(
    "doc",
    [[], {"session": "s", "targets": [{"rank": 0}]}, [1, 2], [{"path": Path("/x")}], [{}]],
)
def test_every_shape_parses_back(doc: Any) -> None:
    assert json.loads(json_text(doc)) == json.loads(json.dumps(doc, default=str))


def test_a_single_document_stays_indented() -> None:
    assert json_text({"b": 1, "a": 2}) == '{\n  "a": 2,\n  "b": 1\n}'
