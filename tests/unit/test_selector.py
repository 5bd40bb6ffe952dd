"""Selectors (``profd/daemon/sessions/selector.py``): which attached clients a session targets.

Clients are the registry's own :class:`~profd.daemon.clients.registry.Client` records,
built directly.
"""

from __future__ import annotations

from typing import Any

import pytest

from profd.daemon.clients.registry import Client
from profd.daemon.sessions.selector import Selector, SelectorError, describe_attached


def client(
    rank: int,
    role: str = "main",
    job: str = "job1",
    host: str = "node0",
    pid: int | None = None,
    allowed: bool = True,
) -> Client:
    return Client(
        ident=f"{host}/{pid or 1000 + rank}".encode(),
        host=host,
        pid=pid if pid is not None else 1000 + rank,
        job=job,
        role=role,
        rank=rank,
        local_rank=rank % 8,
        world_size=16,
        step_mode="optimizer",
        allowed=allowed,
        torch=None,
        device=None,
    )


def keys(cs: list[Client]) -> list[tuple[str, str, int]]:
    return [(c.job, c.role, c.rank) for c in cs]


# An RL job (actor/rollout/critic workers) beside an unrelated pre-training job.
CLIENTS = [
    *(client(r, "actor", "rl") for r in range(4)),
    *(client(r, "rollout_vllm", "rl", host="node1") for r in range(2)),
    client(0, "Critic", "rl", host="node1"),
    *(client(r, "main", "pretrain", pid=2000 + r) for r in range(3)),
]


def select(**spec: Any) -> list[tuple[str, str, int]]:
    return keys(Selector.from_spec(spec).select(CLIENTS))


def test_empty_selector_takes_everything_sorted() -> None:
    sel = Selector.from_spec({})
    assert sel == Selector()
    assert sel.describe() == "all"
    got = sel.select(reversed(CLIENTS))
    assert keys(got) == sorted(keys(CLIENTS))
    assert sorted(got, key=lambda c: (c.job, c.role, c.rank, c.pid)) == got


def test_job_is_exact() -> None:
    assert {k[0] for k in select(job="rl")} == {"rl"}
    assert select(job="r*") == []  # a job id is not a glob
    assert select(job="RL") == []


def test_empty_strings_mean_not_given() -> None:
    assert Selector.from_spec({"job": "", "host": "", "roles": []}) == Selector()


def test_role_glob_is_case_sensitive() -> None:
    assert select(roles=["actor"]) == [("rl", "actor", r) for r in range(4)]
    assert select(roles=["*vllm*"]) == [("rl", "rollout_vllm", 0), ("rl", "rollout_vllm", 1)]
    assert select(roles=["critic"]) == []  # the role is "Critic"
    assert select(roles=["[Cc]ritic"]) == [("rl", "Critic", 0)]
    assert select(roles=["act?r"]) == select(roles=["actor"])


def test_role_is_a_glob_on_the_whole_name() -> None:
    assert select(roles=["act"]) == []
    assert select(roles=["roll"]) == []


def test_roles_repeat_as_alternatives() -> None:
    got = select(roles=["actor", "Critic"])
    assert got == [("rl", "Critic", 0), *(("rl", "actor", r) for r in range(4))]


def test_a_single_role_string_is_one_pattern() -> None:
    assert Selector.from_spec({"roles": "act*"}).roles == ("act*",)
    assert select(roles="act*") == select(roles=["act*"])


def test_ranks() -> None:
    sel = Selector.from_spec({"ranks": "0,2-3"})
    assert sel.ranks == frozenset({0, 2, 3})
    assert sel.describe() == "ranks=0,2,3"
    assert select(job="rl", roles=["actor"], ranks="0,2-3") == [
        ("rl", "actor", 0),
        ("rl", "actor", 2),
        ("rl", "actor", 3),
    ]
    # The rank is matched in every role and job that the rest of the selector leaves in.
    assert select(ranks="1") == [
        ("pretrain", "main", 1),
        ("rl", "actor", 1),
        ("rl", "rollout_vllm", 1),
    ]


@pytest.mark.parametrize("spec", ["all", "ALL", " * "])
def test_ranks_all_is_no_rank_filter(spec: str) -> None:
    sel = Selector.from_spec({"ranks": spec})
    assert sel.ranks is None
    assert len(sel.select(CLIENTS)) == len(CLIENTS)


def test_ranks_as_an_integer() -> None:
    assert Selector.from_spec({"ranks": 3}).ranks == frozenset({3})


@pytest.mark.parametrize("spec", ["", "x", "1,,2", "3-1", "-1", "1-x", "[0, 1]"])
def test_bad_ranks(spec: str) -> None:
    with pytest.raises(SelectorError, match="bad rank list") as exc:
        Selector.from_spec({"ranks": spec})
    assert "\n" not in str(exc.value)


def test_host() -> None:
    assert {k[1] for k in select(host="node1")} == {"rollout_vllm", "Critic"}
    assert select(host="node") == []


def test_pids() -> None:
    sel = Selector.from_spec({"pids": [2001, 1002]})
    assert sel.pids == frozenset({2001, 1002})
    assert keys(sel.select(CLIENTS)) == [("pretrain", "main", 1), ("rl", "actor", 2)]
    assert sel.describe() == "pid=1002,2001"


def test_every_criterion_must_hold() -> None:
    assert select(job="rl", roles=["actor"], host="node0", ranks="1-2", pids=[1002]) == [
        ("rl", "actor", 2)
    ]
    assert select(job="pretrain", roles=["actor"]) == []
    assert select(host="node1", roles=["actor"]) == []
    assert select(ranks="0", pids=[1001]) == []


def test_describe() -> None:
    sel = Selector.from_spec(
        {"job": "rl", "roles": ["a*", "b"], "ranks": "3,1", "host": "n0", "pids": [9]}
    )
    assert sel.describe() == "job=rl role=a*,b ranks=1,3 host=n0 pid=9"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"roles": [""]}, "--role takes glob patterns"),
        ({"roles": ["actor", 3]}, "--role takes glob patterns"),
        ({"pids": ["1000"]}, "--pid takes integers"),
        ({"pids": [1000, 1.5]}, "--pid takes integers"),
    ],
)
def test_from_spec_errors(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(SelectorError, match=message):
        Selector.from_spec(spec)


# --- PROFD_RANKS (the client-side allowlist) ----------------------------------------------------
ALLOW = [client(r, allowed=r in (0, 1)) for r in range(4)]  # PROFD_RANKS=0,1


def test_allowlist_filters_a_selector_without_ranks() -> None:
    # No ranks asked for: every matching rank the job allows.
    assert keys(Selector.from_spec({}).select(ALLOW)) == [("job1", "main", 0), ("job1", "main", 1)]
    assert keys(Selector.from_spec({"ranks": "all"}).select(ALLOW)) == [
        ("job1", "main", 0),
        ("job1", "main", 1),
    ]


def test_allowlist_leaves_nothing() -> None:
    assert Selector.from_spec({"roles": ["main"]}).select([ALLOW[2], ALLOW[3]]) == []


def test_explicit_ranks_inside_the_allowlist() -> None:
    assert keys(Selector.from_spec({"ranks": "1"}).select(ALLOW)) == [("job1", "main", 1)]


def test_explicit_ranks_outside_the_allowlist_are_refused() -> None:
    with pytest.raises(SelectorError) as exc:
        Selector.from_spec({"ranks": "1-3"}).select(ALLOW)
    msg = str(exc.value)
    assert "PROFD_RANKS" in msg
    assert "main rank 2" in msg and "main rank 3" in msg
    assert "rank 1" not in msg


def test_explicit_pids_outside_the_allowlist_are_refused() -> None:
    with pytest.raises(SelectorError, match="PROFD_RANKS: main rank 3"):
        Selector.from_spec({"pids": [1000, 1003]}).select(ALLOW)


def test_no_match_is_empty_not_an_error() -> None:
    assert Selector.from_spec({"ranks": "7"}).select(ALLOW) == []
    assert Selector.from_spec({"job": "other"}).select(ALLOW) == []
    assert Selector().select([]) == []


# --- listings for "matches nothing" ------------------------------------------------------------
def test_describe_attached() -> None:
    assert describe_attached([]) == "no processes are attached"
    assert describe_attached(CLIENTS) == (
        "attached: job=pretrain role=main ranks=0,1,2; job=rl role=Critic ranks=0;"
        " job=rl role=actor ranks=0,1,2,3; job=rl role=rollout_vllm ranks=0,1"
    )
