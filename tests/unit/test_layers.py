"""profd's shape: no import cycle, arrows that point one way, and one owner for each piece of
state. Imports are read from the source (lazy and type-only ones included), so a cycle hidden
inside a function still counts."""

from __future__ import annotations

import ast
from pathlib import Path

PROFD = Path(__file__).resolve().parents[2] / "profd"
DAEMON = PROFD / "daemon"

#: Bottom to top: a daemon package may import only the packages before it in this list.
DAEMON_LAYERS = ["runtime", "metrics", "spool", "clients", "captures", "sessions", "watch", "agent",
                 "control", "results", "parts", "loop"]  # fmt: skip

#: Packages that never reach into the daemon (profctl, storage and pure logic).
NEVER_DAEMON = ["ctl", "store", "pipeline", "report", "scheduling", "reactor", "states",
                "claims"]  # fmt: skip
#: Pure logic shared by the daemon and profctl: the standard library and the protocol only.
PURE = ["scheduling", "states", "claims"]

#: Fields of Session/Target (owned by sessions/state.py) and Client (owned by clients/registry.py).
OWNED = {
    "sessions/state.py": {"state", "error", "client_final", "outstanding", "traces", "gone",
                          "hold", "stop_asked", "results", "cycles", "revision", "armed_at",
                          "stem"},
    "clients/registry.py": {"step", "step_at", "sps", "cpu", "rss", "gpu_util", "gpu_mem",
                            "attaching", "last_seen", "state"},
}  # fmt: skip


def _name(p: Path) -> str:
    parts = list(p.relative_to(PROFD.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_name(p): p for p in PROFD.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            assert not (isinstance(node, ast.ImportFrom) and node.level), (
                f"{name}: relative import (profd imports absolutely, so the layers read plainly)"
            )
            found: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                found = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            deps.update(f for f in found if f in modules and f != name)
        graph[name] = deps
    return graph


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_profd_has_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        if state.get(n) == 2:
            return
        assert state.get(n) != 1, "import cycle: " + " -> ".join([*path, n])
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            # a package's __init__ importing its own submodules is not an arrow between layers
            visit(m, [*path, n])
        state[n] = 2

    for n in sorted(graph):
        visit(n, [])


def test_ctl_store_and_pure_logic_never_import_the_daemon() -> None:
    offenders = [
        f"{m} -> {d}"
        for m, deps in _graph().items()
        for d in deps
        if any(_under(m, f"profd.{p}") for p in NEVER_DAEMON) and _under(d, "profd.daemon")
    ]
    assert not offenders, offenders


def test_storage_and_analysis_never_import_profctl() -> None:
    offenders = [
        f"{m} -> {d}"
        for m, deps in _graph().items()
        for d in deps
        if not _under(m, "profd.ctl")
        and not _under(m, "profd.cli")
        and _under(d, "profd.ctl")
        and not _under(m, "profd.demo")
    ]
    assert not offenders, offenders


def test_pure_packages_import_only_the_standard_library_and_the_protocol() -> None:
    for pkg in PURE:
        root = PROFD / pkg
        for path in [*root.rglob("*.py")] if root.is_dir() else [root.with_suffix(".py")]:
            for node in ast.walk(ast.parse(path.read_text())):
                mods = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    mods = [node.module]
                elif isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                for m in mods:
                    top = m.split(".")[0]
                    assert top not in ("zmq", "psutil", "pynvml", "boto3", "torch", "sqlite3"), (
                        f"{path.name} imports {m}"
                    )
                    assert top != "profd" or any(_under(m, f"profd.{p}") for p in PURE), (
                        f"{path.name} imports {m}"
                    )
                    assert top != "profd_client" or m == "profd_client.protocol", m


def test_daemon_packages_point_down() -> None:
    rank = {p: i for i, p in enumerate(DAEMON_LAYERS)}
    offenders = []
    for m, deps in _graph().items():
        if not _under(m, "profd.daemon") or m == "profd.daemon":
            continue
        mine = m.split(".")[2]
        assert mine in rank, f"{m}: a daemon package missing from DAEMON_LAYERS"
        for d in deps:
            if _under(d, "profd.daemon") and d != "profd.daemon":
                theirs = d.split(".")[2]
                if theirs != mine and rank[theirs] > rank[mine]:
                    offenders.append(f"{m} -> {d}")
    assert not offenders, offenders


def test_nothing_but_the_cli_imports_the_loop() -> None:
    importers = [m for m, deps in _graph().items() if "profd.daemon.loop" in deps]
    assert importers == ["profd.cli"], importers


def test_only_owners_assign_session_target_and_client_state() -> None:
    owned = set().union(*OWNED.values())
    offenders = []
    for path in DAEMON.rglob("*.py"):
        rel = path.relative_to(DAEMON).as_posix()
        allowed = OWNED.get(rel, set())
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
                        offenders.append(f"{rel}:{node.lineno} .{el.attr}")
    assert not offenders, offenders


def test_handlers_never_see_the_daemon() -> None:
    for path in DAEMON.rglob("*.py"):
        if path.name == "loop.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                assert not (node.value.attr == "d" and isinstance(node.value.value, ast.Name)), (
                    f"{path} reaches through self.d"
                )


#: The longest a function of the daemon, profctl or the client may be: past it, a reader
#: has to hold more than one screen of steps to follow one (docs/architecture.md, "The map").
MAX_FUNCTION_LINES = 80


def test_no_function_of_profd_or_the_client_is_longer_than_a_screen() -> None:
    long = []
    for root in (PROFD, PROFD.parent / "client"):
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        where = path.relative_to(PROFD.parent)
                        long.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
