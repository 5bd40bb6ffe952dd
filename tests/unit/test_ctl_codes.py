"""profctl's own failure codes (``--json``'s ``code``): one closed set, documented, never a
bare string, and never one of the daemon's codes under another meaning."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from profd.ctl.errors import CtlCode
from profd_client.protocol.envelope import ErrorCode

ROOT = Path(__file__).resolve().parents[2]


def _documented() -> list[str]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text.split("`--json`'s `code`", 1)[1].split("\n- ", 1)[0]
    return re.findall(r"^  \| `([a-z_0-9]+)` \|", section, flags=re.M)


def test_the_documented_codes_are_the_enum() -> None:
    documented = _documented()
    assert len(documented) == len(set(documented)), "a code listed twice"
    assert documented == [c.value for c in CtlCode]


def test_profctls_codes_are_not_the_daemons() -> None:
    assert not {c.value for c in CtlCode} & {c.value for c in ErrorCode}


def test_no_failure_is_given_a_code_as_a_bare_string() -> None:
    found = []
    for path in sorted((ROOT / "profd" / "ctl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "code" and isinstance(kw.value, ast.Constant):
                        found.append(f"{path.relative_to(ROOT)}:{kw.value.lineno}")
    assert not found, found
