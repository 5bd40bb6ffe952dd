"""The daemon package's shape: a DAG of modules, and one owner for each piece of state."""

from __future__ import annotations

import ast
from pathlib import Path

DAEMON = Path(__file__).resolve().parents[2] / "profd" / "daemon"

#: Fields of Session/Target (owned by sessions.py) and Client (owned by registry.py).
OWNED = {
    "sessions.py": {"state", "error", "client_final", "outstanding", "traces", "gone", "hold",
                    "results", "cycles", "revision", "armed_at"},
    "registry.py": {"step", "step_at", "sps", "cpu", "rss", "gpu_util", "gpu_mem", "attaching",
                    "last_seen", "state"},
}  # fmt: skip


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in DAEMON.glob("*.py")}


def _imports(tree: ast.Module) -> set[str]:
    """Sibling modules imported, type-only imports included."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return out


def test_daemon_modules_form_a_dag() -> None:
    graph = {name: _imports(tree) for name, tree in _modules().items()}
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        if state.get(n) == 2:
            return
        assert state.get(n) != 1, "import cycle: " + " -> ".join([*path, n])
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            visit(m, [*path, n])
        state[n] = 2

    for n in sorted(graph):
        visit(n, [])
    assert not any("loop" in deps for deps in graph.values()), "nothing may import the loop"


def test_only_owners_assign_session_target_and_client_state() -> None:
    owned = set().union(*OWNED.values())
    offenders = []
    for path in DAEMON.glob("*.py"):
        allowed = OWNED.get(path.name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if (
                        isinstance(el, ast.Attribute)
                        and el.attr in owned
                        and el.attr not in allowed
                        and not (isinstance(el.value, ast.Name) and el.value.id == "self")
                    ):
                        offenders.append(f"{path.name}:{node.lineno} .{el.attr}")
    assert not offenders, offenders


def test_handlers_never_see_the_daemon() -> None:
    for name, tree in _modules().items():
        if name == "loop":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                assert not (node.value.attr == "d" and isinstance(node.value.value, ast.Name)), (
                    f"{name}.py reaches through self.d"
                )
