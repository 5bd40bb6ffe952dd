"""STAT-style grouping of ranks by their training thread's stack (profd.watch.stackgroups),
on synthetic stacks from 2 to 8,192 ranks."""

from __future__ import annotations

import sysconfig

import pytest

from profd.watch import stackgroups as sg
from profd.watch.stackrows import Frame, Group, Source, StackRank, Thread, TreeNode

STDLIB = sysconfig.get_paths()["stdlib"]
TORCH = "/opt/venv/lib/python3.11/site-packages/torch/autograd/graph.py"


def fr(function: str, file: str, line: int) -> Frame:
    return Frame(function, file, line)


#: Innermost first: the all-reduce wait inside torch, called from train.py line 41.
IN_ALLREDUCE = [
    fr("_engine_run_backward", TORCH, 768),
    fr("backward", "/opt/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", 347),
    fr("backward", "/opt/venv/lib/python3.11/site-packages/torch/_tensor.py", 581),
    fr("train_step", "/home/u/job/train.py", 41),
    fr("<module>", "/home/u/job/train.py", 90),
]
IN_LOAD = [
    fr("read", f"{STDLIB}/socket.py", 700),
    fr("load_batch", "/home/u/job/data.py", 88),
    fr("train_step", "/home/u/job/train.py", 35),
    fr("<module>", "/home/u/job/train.py", 90),
]
IN_CHECKPOINT = [
    fr("save", "/opt/venv/lib/python3.11/site-packages/torch/serialization.py", 650),
    fr("checkpoint", "/home/u/job/train.py", 60),
    fr("<module>", "/home/u/job/train.py", 92),
]


def rank(n: int, frames: list[Frame] | None, host: str = "a", role: str = "trainer") -> StackRank:
    threads = []
    if frames is not None:
        # A helper thread listed before the training thread: grouping must not care.
        threads.append(Thread(name="pin_memory", tid=9000 + n, frames=tuple(IN_LOAD)))
        threads.append(Thread(name="MainThread", tid=100 + n, training=True, frames=tuple(frames)))
    return StackRank(
        host=host,
        role=role,
        rank=n,
        pid=1000 + n,
        source=Source.PYSPY if frames is not None else None,
        threads=tuple(threads),
        error=None if frames is not None else "py-spy: Permission denied (os error 13)",
    )


def members(g: Group | TreeNode) -> list[int]:
    return [m.rank for m in g.ranks]


def test_the_odd_rank_is_the_suspect_and_named_in_user_code() -> None:
    ranks = [rank(0, IN_ALLREDUCE), rank(1, IN_LOAD), rank(2, IN_ALLREDUCE)]
    groups = sg.group(ranks)
    assert [members(g) for g in groups] == [[0, 2], [1]]
    assert [g.majority for g in groups] == [True, False]
    assert groups[1].frames == tuple(IN_LOAD)  # the full stack, library frames kept
    # Named after the innermost user frame, and the library function it called.
    assert sg.where(IN_LOAD) == "in load_batch (data.py:88) -> read"
    assert sg.where(IN_ALLREDUCE) == "in train_step (train.py:41) -> backward"
    assert sg.summary(ranks, groups) == [
        "suspect   rank 1: in load_batch (data.py:88) -> read",
        "majority  ranks 0, 2: in train_step (train.py:41) -> backward",
    ]


def test_a_user_frame_innermost_names_itself() -> None:
    stuck = [fr("stuck_in_data_loading", "/w/tests/jobs/stuck.py", 33), *IN_LOAD[1:]]
    assert sg.where(stuck) == "in stuck_in_data_loading (stuck.py:33)"


def test_profd_and_stdlib_frames_are_not_user_code() -> None:
    assert not sg.is_user_frame(fr("tick", "/src/profd/client/profd_client/steps.py", 1))
    assert not sg.is_user_frame(fr("wait", f"{STDLIB}/threading.py", 1))
    assert not sg.is_user_frame(fr("futex_wait", "libc.so.6", 0))
    assert sg.is_user_frame(fr("main", "/home/u/job/train.py", 1))


@pytest.mark.parametrize("n", [2, 3, 64, 1024, 8192])
def test_one_rank_elsewhere_among_n(n: int) -> None:
    odd = n // 3
    ranks = [rank(i, IN_LOAD if i == odd else IN_ALLREDUCE) for i in range(n)]
    groups = sg.group(ranks)
    if n == 2:
        # One against one: the rank that waits in the all-reduce is the majority, the one
        # it waits for the suspect.
        assert [members(g) for g in groups] == [[1], [0]]
    else:
        assert members(groups[1]) == [odd]
        assert members(groups[0]) == [i for i in range(n) if i != odd]
    assert [g.majority for g in groups] == [True, False]


def test_equal_groups_waiting_first_then_by_their_lowest_rank_whatever_the_input_order() -> None:
    ranks = [rank(i, [IN_LOAD, IN_ALLREDUCE, IN_CHECKPOINT][i % 3]) for i in range(9)]
    a = sg.group(ranks)
    b = sg.group(list(reversed(ranks)))
    assert a == b
    assert [members(g) for g in a] == [[1, 4, 7], [0, 3, 6], [2, 5, 8]]
    assert sg.waits_for_peers(IN_ALLREDUCE)
    assert not sg.waits_for_peers(IN_LOAD) and not sg.waits_for_peers(IN_CHECKPOINT)
    in_collective = [
        fr("all_reduce", "/x/site-packages/torch/distributed/distributed_c10d.py", 2500),
        *IN_LOAD[1:],
    ]
    assert sg.waits_for_peers(in_collective)


def test_two_nodes_each_uniform_the_node_elsewhere_is_the_suspect() -> None:
    ranks = [rank(i, IN_LOAD, host="a") for i in range(8)]
    ranks += [rank(8 + i, IN_ALLREDUCE, host="b") for i in range(8)]
    majority, suspect = sg.group(ranks)
    assert members(majority) == list(range(8, 16)) and members(suspect) == list(range(8))


def test_a_whole_node_elsewhere_stands_out_across_nodes() -> None:
    ranks = [rank(i, IN_ALLREDUCE, host=f"n{i // 8}") for i in range(8 * 64)]
    ranks += [rank(8 * 64 + i, IN_LOAD, host="n64") for i in range(8)]
    groups = sg.group(ranks)
    assert len(groups) == 2
    assert (
        sg.summary(ranks, groups)[0]
        == "suspect   ranks 512-519 on n64: in load_batch (data.py:88) -> read"
    )


def test_ranks_without_stacks_are_in_no_group_and_listed_with_the_reason() -> None:
    ranks = [rank(0, IN_ALLREDUCE), rank(1, None), rank(2, IN_ALLREDUCE)]
    groups = sg.group(ranks)
    assert [members(g) for g in groups] == [[0, 2]]
    assert sg.summary(ranks, groups) == [
        "all       ranks 0, 2: in train_step (train.py:41) -> backward",
        "no stack  rank 1: py-spy: Permission denied (os error 13)",
    ]


def test_the_same_function_at_another_line_is_another_group() -> None:
    other = [*IN_ALLREDUCE[:3], fr("train_step", "/home/u/job/train.py", 42), IN_ALLREDUCE[4]]
    ranks = [rank(0, IN_ALLREDUCE), rank(1, IN_ALLREDUCE), rank(2, other)]
    assert [members(g) for g in sg.group(ranks)] == [[0, 1], [2]]


def test_roles_are_named_when_a_job_has_several() -> None:
    ranks = [rank(0, IN_ALLREDUCE), rank(0, IN_LOAD, role="ref"), rank(1, IN_ALLREDUCE)]
    summary = sg.summary(ranks, sg.group(ranks))
    assert summary[0] == "suspect   ref rank 0: in load_batch (data.py:88) -> read"


def test_mark_training_prefers_the_told_thread_then_the_main_thread() -> None:
    threads = [Thread(name="trainer", tid=7), Thread(name="MainThread", tid=5)]
    assert [t.training for t in sg.mark_training(threads, 7)] == [True, False]
    assert [t.training for t in sg.mark_training(threads, None)] == [False, True]
    # A tid no thread has: the main thread; marked again, one thread stays marked.
    assert [t.training for t in sg.mark_training(threads, 12345)] == [False, True]
    again = sg.mark_training(sg.mark_training(threads, 7), None)
    assert [t.training for t in again] == [False, True]


def test_parse_rejects_what_is_not_a_thread_list() -> None:
    with pytest.raises(ValueError):
        sg.parse_pyspy({"threads": []})


@pytest.mark.parametrize("n", [2, 64, 8192])
def test_the_call_tree_branches_where_the_stacks_part(n: int) -> None:
    odd = n - 1
    roots = sg.tree([rank(i, IN_LOAD if i == odd else IN_ALLREDUCE) for i in range(n)])
    (root,) = roots
    assert root.frame.function == "<module>" and len(root.ranks) == n
    waiting, loading = root.children  # two train_step lines: the stacks part there
    assert members(waiting) == [i for i in range(n) if i != odd]
    assert members(loading) == [odd]
    assert loading.children[0].frame.function == "load_batch"
    lines = sg.render_tree(roots)
    assert lines[0] == f"<module> (train.py:90)  [ranks 0-{n - 1}]"
    assert f"  train_step (train.py:35)  [rank {odd}]" in lines
    assert "    load_batch (data.py:88)" in lines  # same ranks as its parent: no label


def test_the_call_tree_folds_long_runs_of_library_frames() -> None:
    deep = [fr(f"lib{i}", TORCH, i) for i in range(6)] + IN_ALLREDUCE
    lines = sg.render_tree(sg.tree([rank(0, deep)]))
    assert "      ... 7 library frames" in lines and "      lib0 (graph.py:0)" in lines


def test_profctl_leaves_out_and_says_the_rank_rows_it_cannot_read() -> None:
    from profd.ctl.commands import stacks
    from profd.watch.stackrows import ranks_of, to_maps

    good = [to_maps(rank(i, IN_ALLREDUCE)) for i in range(2)]
    # Past the reply's schema, which leaves a row's other fields open: a peer's lie.
    lying = {**to_maps(rank(2, IN_LOAD)), "client_host": 7}
    decoded = ranks_of([*good, lying])
    assert decoded[2] is None and all(r is not None for r in decoded[:2])
    rows = [(m, r) for m, r in zip(good, decoded, strict=False) if r is not None]
    doc = stacks.Stacks("j", rows, ["10.0.0.2"])
    assert [g.majority for g in doc.groups] == [True]  # the lying row is in no group
    assert doc.doc()["ranks_unread"] == 1 and len(doc.doc()["ranks"]) == 2
    head = stacks.render(doc, full=False).split("\n")[0]
    assert head == "job j: 2 ranks, 1 group, 1 unreadable rank row (10.0.0.2)"
    assert "ranks_unread" not in stacks.Stacks("j", rows, []).doc()
