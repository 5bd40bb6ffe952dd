"""Every rank's stacks, grouped as LLNL's STAT does: one group per distinct training-thread
stack, the largest the majority, every other a suspect group named by its ranks and where
in user code they are. Pure: the daemon (one node) and profctl (``--cluster``, every node's
ranks together) group with the same functions.

A rank is a :class:`~profd.watch.stackrows.StackRank`: its threads, each a list of frames
innermost first, and who read them (``source`` None: the rank gave no stacks, ``error`` says
why, and it is in no group).
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable, Iterable, Sequence

from msgspec.structs import replace

from profd.watch.stackrows import Frame, Group, Member, StackRank, Thread, TreeNode

#: Directories whose frames are library code: never what names a group.
_LIBRARY_DIRS = tuple(
    os.path.join(p, "")
    for p in {sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib")}
    if p
)
#: Path parts of library code wherever it is installed (a venv, a container's /opt/conda).
_LIBRARY_PARTS = ("site-packages", "dist-packages")
#: Packages whose frames are not the user's, from a checkout or an install alike.
_LIBRARY_PACKAGES = frozenset({"torch", "profd", "profd_client", "importlib", "threading"})
#: What one reply may hold (``protocol.STACK_RANK``): longer names (C++ templates from
#: ``--native``) are cut, and the outermost frames of a deeper stack dropped.
MAX_NAME_CHARS = 4096
MAX_FRAMES = 4096
MAX_THREADS = 4096
#: Decorator frames that stand between a call site and what it calls: skipped when a
#: group is named after the function user code called.
_WRAPPERS = frozenset({"wrapper", "inner", "_fn", "decorate_context", "wrapped", "<lambda>"})


# --- py-spy ---------------------------------------------------------------------------------------
def parse_pyspy(doc: object) -> list[Thread]:
    """The threads of ``py-spy dump --json``'s output (a list of traces, one per thread),
    ``tid`` the native thread id (what ``threading.get_native_id()`` says), frames
    innermost first as py-spy gives them; none marked the training thread yet."""
    if not isinstance(doc, list):
        raise ValueError(f"py-spy dump: expected a list of threads, got {type(doc).__name__}")
    threads = []
    for t in doc[:MAX_THREADS]:
        if not isinstance(t, dict):
            raise ValueError("py-spy dump: a thread is not a map")
        tid = next(
            (x for x in (t.get("os_thread_id"), t.get("thread_id")) if isinstance(x, int)), 0
        )
        frames = []
        for f in (t.get("frames") or ())[:MAX_FRAMES]:
            if not isinstance(f, dict):
                continue
            line = f.get("line")
            frames.append(
                Frame(
                    str(f.get("name") or "?")[:MAX_NAME_CHARS],
                    str(f.get("filename") or "?")[:MAX_NAME_CHARS],
                    line if isinstance(line, int) and line >= 0 else 0,
                    # --native: a frame of a shared object, not Python
                    native=bool(f.get("module")),
                )
            )
        name = t.get("thread_name")
        gil = t.get("owns_gil")
        threads.append(
            Thread(
                name=name[:MAX_NAME_CHARS] if isinstance(name, str) else "",
                tid=tid,
                frames=tuple(frames),
                **({"owns_gil": gil} if isinstance(gil, bool) else {}),
            )
        )
    return threads


def mark_training(
    threads: Sequence[Thread], training_tid: int | None, pid: int | None = None
) -> tuple[Thread, ...]:
    """``threads`` with exactly one marked the training thread (the one the client said
    counts steps; else the main thread: its native id is the pid on Linux, and it is named
    ``MainThread`` where py-spy finds names; else the first), so grouping never depends on
    the order threads were listed in."""
    if not threads:
        return ()

    def first(pred: Callable[[Thread], bool]) -> Thread | None:
        return next((t for t in threads if pred(t)), None)

    chosen = (
        (first(lambda t: t.tid == training_tid) if training_tid is not None else None)
        or (first(lambda t: t.tid == pid) if pid is not None else None)
        or first(lambda t: t.name == "MainThread")
        or threads[0]
    )
    return tuple(
        t if t.training == (t is chosen) else replace(t, training=t is chosen) for t in threads
    )


# --- grouping -------------------------------------------------------------------------------------
def training_frames(rank: StackRank) -> tuple[Frame, ...] | None:
    """The rank's training-thread stack, or None when it gave no stacks."""
    t = rank.training
    return None if t is None else t.frames


def _key(frames: Sequence[Frame]) -> tuple[Frame, ...]:
    # Python frames only: a native frame's function moves while C code runs (a regex
    # engine's recursion, a spin), and the agent thread's stacks have none.
    return tuple(f for f in frames if not f.native)


#: Where torch waits for other ranks: a collective, or a DDP backward (its reducer's
#: all-reduce runs inside autograd, so a Python stack shows only ``backward``).
_COLLECTIVE_DIRS = ("torch/distributed/", "torch/nn/parallel/")
_BACKWARD = frozenset({"backward", "_engine_run_backward", "run_backward"})


def waits_for_peers(frames: Sequence[Frame]) -> bool:
    """The stack is inside a collective (or a DDP backward): a rank there waits for the
    others, so when groups are as large as each other this one is not the odd one."""
    for f in frames:
        path = f.file.replace("\\", "/")
        if any(d in path for d in _COLLECTIVE_DIRS):
            return True
        if f.function in _BACKWARD and "torch/" in path:
            return True
    return False


#: Where profd's client ends an nsys capture range (``NsysRange.finish``/``abandon``), and the
#: call nsys holds until it has flushed its collection.
_NSYS_RANGE_FILE = "profd_client/nsysrange.py"
_PROFILER_STOP_FILE = "torch/cuda/profiler.py"


def _leaf(function: str) -> str:
    # py-spy and the agent name a method by its qualified name ("NsysRange.finish").
    return function.rsplit(".", 1)[-1]


def in_nsys_stop(frames: Sequence[Frame]) -> bool:
    """The stack is inside the ``cudaProfilerStop`` that ends profd's nsys capture range:
    nsys returns from it only once it has flushed what it collected."""
    for i, f in enumerate(frames):
        path = f.file.replace("\\", "/")
        if path.endswith(_NSYS_RANGE_FILE) and _leaf(f.function) in ("finish", "abandon"):
            for inner in frames[:i]:
                name = inner.function
                if "cudaProfilerStop" in name:  # a native frame (py-spy --native)
                    return True
                where = inner.file.replace("\\", "/")
                if where.endswith(_PROFILER_STOP_FILE) and _leaf(name) == "stop":
                    return True
            return False
    return False


def group(ranks: Iterable[StackRank]) -> list[Group]:
    """Ranks with stacks grouped by their training thread's whole Python stack (function,
    file and line of every frame but native ones), the largest group first and marked
    majority. Between equal sizes a group waiting for its peers (:func:`waits_for_peers`)
    comes first: at 2 ranks, or 2 nodes of 8, the rank everyone waits for is the one
    elsewhere. Then by their lowest (host, role, rank), so the same stacks always give the
    same answer."""
    by_key: dict[tuple[Frame, ...], list[Member]] = {}
    frames_of: dict[tuple[Frame, ...], tuple[Frame, ...]] = {}
    for r in ranks:
        frames = training_frames(r)
        if frames is None:
            continue
        k = _key(frames)
        by_key.setdefault(k, []).append(r.member)
        frames_of.setdefault(k, frames)
    for members in by_key.values():
        members.sort()
    ordered = sorted(
        by_key.items(),
        key=lambda kv: (-len(kv[1]), not waits_for_peers(frames_of[kv[0]]), kv[1][0]),
    )
    return [
        Group(ranks=tuple(members), majority=i == 0, frames=frames_of[k])
        for i, (k, members) in enumerate(ordered)
    ]


def tree(ranks: Iterable[StackRank]) -> list[TreeNode]:
    """The training threads' Python stacks merged into one call tree, outermost frame at
    the root, as STAT draws it; where the ranks' stacks part, the tree branches, and each
    branch says which ranks took it. Children in the order of their lowest rank."""
    roots: list[TreeNode] = []
    for r in sorted(ranks, key=lambda r: r.member):
        frames = training_frames(r)
        if frames is None:
            continue
        level = roots
        for f in reversed(_key(frames)):
            node = next((n for n in level if n.frame == f), None)
            if node is None:
                node = TreeNode(frame=f, ranks=[], children=[])
                level.append(node)
            node.ranks.append(r.member)
            level = node.children
    return roots


#: Runs of library frames longer than this are folded in a tree: the first, the count, the
#: last (what the library was doing).
FOLD_FRAMES = 4


def _at(f: Frame) -> str:
    where = "" if f.native else f":{f.line}"
    return f"{f.function} ({os.path.basename(f.file)}{where})"


def render_tree(roots: Sequence[TreeNode], hosts: bool = False) -> list[str]:
    """The call tree as indented lines, a branch's ranks beside its first frame; a run of
    library frames that every rank of a branch shares is folded into one line."""
    lines: list[str] = []

    def walk(nodes: Sequence[TreeNode], depth: int, shown: str) -> None:
        for n in nodes:
            who = label(n.ranks, hosts)
            chain = [n]
            while (
                len(chain[-1].children) == 1
                and not is_user_frame(chain[-1].frame)
                and not is_user_frame(chain[-1].children[0].frame)
            ):
                chain.append(chain[-1].children[0])
            pad = "  " * depth
            tag = f"  [{who}]" if who != shown else ""
            lines.append(f"{pad}{_at(n.frame)}{tag}")
            last = n
            if len(chain) > FOLD_FRAMES:
                lines.append(f"{pad}  ... {len(chain) - 2} library frames")
                lines.append(f"{pad}  {_at(chain[-1].frame)}")
                last = chain[-1]
            walk(last.children, depth + 1, who)

    walk(roots, 0, "")
    return lines


def not_answering(ranks: Iterable[StackRank]) -> list[StackRank]:
    """The ranks that gave no stacks (neither source could read them)."""
    return [r for r in ranks if training_frames(r) is None]


# --- naming ---------------------------------------------------------------------------------------
def is_user_frame(f: Frame) -> bool:
    """A frame in the job's own code: not the standard library, an installed package, torch,
    profd or a native frame."""
    path = f.file
    if not path.endswith(".py"):
        return False  # native frames (py-spy --native), <frozen ...>, <string>
    if path.startswith(_LIBRARY_DIRS) or any(p in path for p in _LIBRARY_PARTS):
        return False
    parts = path.replace("\\", "/").split("/")
    return not any(p in _LIBRARY_PACKAGES for p in parts[:-1])


def where(frames: Sequence[Frame]) -> str:
    """Where a stack is, for a human: the innermost frame in user code, and the library
    function it called when there is one ("in train_step (train.py:41) -> backward"; "in
    load_batch (data.py:88)" when it is the innermost frame)."""
    if not frames:
        return "no Python frames"
    i = next((j for j, f in enumerate(frames) if is_user_frame(f)), None)
    if i is None:
        f = frames[0]
        return f"in {f.function} ({os.path.basename(f.file)}:{f.line})"
    user = frames[i]
    text = f"in {user.function} ({os.path.basename(user.file)}:{user.line})"
    callees = [f for f in reversed(frames[:i]) if f.file.endswith(".py")]
    called = next((f for f in callees if f.function not in _WRAPPERS), None)
    return text if called is None else f"{text} -> {called.function}"


def _spans(numbers: list[int]) -> str:
    out: list[str] = []
    start = prev = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(out)


def label(members: Iterable[Member], hosts: bool = False, roles: bool = False) -> str:
    """ "rank 1", "ranks 0, 2-5"; per role ("trainer ranks 0-3; ref rank 0") and per host
    ("ranks 0-1 on a; rank 2 on b") when asked."""
    parts: dict[tuple[str, str], list[int]] = {}
    for m in members:
        parts.setdefault((m.host if hosts else "", m.role if roles else ""), []).append(m.rank)
    out = []
    for (host, role), numbers in sorted(parts.items()):
        numbers = sorted(set(numbers))
        text = f"{'rank' if len(numbers) == 1 else 'ranks'} {_spans(numbers)}"
        if role:
            text = f"{role} {text}"
        if host:
            text += f" on {host}"
        out.append(text)
    return "; ".join(out)


def summary(ranks: Sequence[StackRank], groups: Sequence[Group]) -> list[str]:
    """The compact view of one job's grouped stacks, suspects first: one line per group,
    then the ranks that did not answer."""
    hosts = len({r.host for r in ranks}) > 1
    roles = len({r.role for r in ranks}) > 1
    lines = []
    for g in [*(g for g in groups if not g.majority), *(g for g in groups if g.majority)]:
        tag = (
            "majority" if g.majority and len(groups) > 1 else "suspect" if not g.majority else "all"
        )
        lines.append(f"{tag:8}  {label(g.ranks, hosts, roles)}: {where(g.frames)}")
    for r in not_answering(ranks):
        who = label([r.member], hosts, roles)
        lines.append(f"{'no stack':8}  {who}: {r.error or 'no answer'}")
    return lines
