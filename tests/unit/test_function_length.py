"""No function in profd/ or client/ is longer than a screen: longer ones are split into
named steps, which a reader (and a reviewer) can follow one at a time."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 80


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """Every function in ``tree``, nested ones included: (qualified name, lines)."""
    out: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            assert node.end_lineno is not None
            out.append((name, node.end_lineno - node.lineno + 1))
            out += _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            out += _functions(node, prefix + node.name + ".")
        else:
            out += _functions(node, prefix)
    return out


def _long_functions() -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for top in ("profd", "client"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for name, lines in _functions(ast.parse(path.read_text(), rel)):
                if lines > MAX_LINES:
                    found[(rel, name)] = lines
    return found


def test_no_function_is_longer_than_the_limit() -> None:
    long = _long_functions()
    new = {f"{f}: {n} ({lines} lines)" for (f, n), lines in long.items()}
    assert not new, f"functions over {MAX_LINES} lines: split them: {sorted(new)}"


def test_the_walk_finds_nested_and_method_functions() -> None:
    body = "\n".join(f"            x = {i}" for i in range(MAX_LINES))
    src = f"class C:\n    def m(self):\n        def inner():\n{body}\n        return inner\n"
    lines = dict(_functions(ast.parse(src)))
    assert lines == {"C.m": MAX_LINES + 3, "C.m.inner": MAX_LINES + 1}
