"""profctl's text output escapes what a terminal would act on in names from peers, at the one
layer every command prints through (``profd.ctl.render``); ``--json`` stays exact."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from profd.ctl import render
from profd.ctl.commands import incidents, stacks
from profd.watch.stackrows import ranks_of

CTL = Path(render.__file__).parent
EVIL_HOST = "node\x1b]52;c;SGVsbG8=\x07\nforged-node  666  evil"
EVIL_REGION = "fwd\u202e\x1b[2J\r"


def _writes(tree: ast.AST) -> list[str]:
    """Calls that print without going through render: click.echo, print, sys.std*.write."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = ast.unparse(f)
        if name in ("click.echo", "click.secho", "print") or (
            isinstance(f, ast.Attribute)
            and f.attr == "write"
            and ast.unparse(f.value) in ("sys.stdout", "sys.stderr")
        ):
            found.append(f"line {node.lineno}: {name}")
    return found


def test_no_profctl_module_prints_but_through_render() -> None:
    modules = [p for p in CTL.rglob("*.py") if p.name != "render.py"]
    assert len(modules) > 20, modules
    offenders = {
        str(p.relative_to(CTL)): w for p in modules if (w := _writes(ast.parse(p.read_text())))
    }
    assert offenders == {}


def test_table_cells_are_one_escaped_line_each() -> None:
    rows = [{"host": EVIL_HOST, "rank": 0}, {"host": "plain", "rank": 1}]
    text = render.table(rows, [("HOST", lambda r: r["host"]), ("RANK", lambda r: r["rank"])])
    assert len(text.split("\n")) == 3
    assert "\x1b" not in text and "\x07" not in text and "\\x1b]52" in text
    assert "\\x0aforged-node" in text


def test_say_escapes_everything_but_newlines(capsys: pytest.CaptureFixture[str]) -> None:
    render.say(f"a\n{EVIL_REGION}", eol="<EOL>")
    render.say(EVIL_HOST, err=True)
    out, err = capsys.readouterr()
    assert out == "a<EOL>\nfwd\\u202e\\x1b[2J\\x0d\n"
    assert err.count("\n") == 2 and "\x1b" not in err


def test_incident_and_stacks_text_escape_hostile_names_and_json_stays_exact() -> None:
    # ps and top: tests/test_top.py, on a real daemon and a real peer.
    incident = {
        "id": "i1", "kind": "straggler", "state": "open", "job": "j", "role": "r",
        "detected_at": 1.0, "host": EVIL_HOST, "step": 3, "suspects": [
            {"role": "r", "rank": 1, "host": EVIL_HOST}
        ], "evidence": {"why": "rank 1 \x1b[31mslow\n"}, "notes": ["n\u202e"],
    }  # fmt: skip
    text = incidents.text(incident)
    assert "\x1b" not in text and "\u202e" not in text
    assert all(not line.startswith("forged") for line in text.split("\n"))
    frames = [{"function": "f\x1b]0;title\x07\nforged", "file": "a.py", "line": 1}]
    row = {
        "host": EVIL_HOST, "role": "r", "rank": 0, "pid": 1, "source": "py-spy",
        "threads": [{"tid": 1, "name": "t\x1b", "training": True, "frames": frames}],
    }  # fmt: skip
    (typed,) = ranks_of([row])
    assert typed is not None
    text = stacks.render(stacks.Stacks("j", [(row, typed)], []), full=True, tree=False)
    assert "\x1b" not in text and "\x07" not in text
    assert all(not line.startswith("forged") for line in text.split("\n"))
    row = {"host": EVIL_HOST, "regions": {EVIL_REGION: 0.5}}
    assert json.loads(render.json_text([row]))[0] == row  # --json: the exact names
