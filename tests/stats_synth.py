"""Synthetic per-rank statistics (what profd/pipeline/rankstats.py stores) for any rank count.

A synchronous job: each step every rank computes for about ``compute_ms`` (plus ``extra_ms``
on the ``straggler``), then waits in the collective until the slowest has arrived. Used by the
report's unit tests and by ``bench/bench_report.py`` (1,024 ranks). Same seed, same numbers.
"""

from __future__ import annotations

import random
from typing import Any

from profd.store.index import SessionRepo

OPS = [f"aten::op{i:02d}" for i in range(30)]


def synthetic_session(
    ranks: int,
    steps: int = 10,
    *,
    straggler: int | None = None,
    extra_ms: float = 30.0,
    compute_ms: float = 100.0,
    noise_ms: float = 2.0,
    seed: int = 0,
    session: str = "20260101-000000-abcdef",
    hosts_per: int = 8,
) -> dict[str, Any]:
    """A session as ``profctl show --json`` gives it, every target with ``stats``."""
    rng = random.Random(seed)
    compute = [
        [
            compute_ms + rng.gauss(0, noise_ms) + (extra_ms if r == straggler else 0.0)
            for _ in range(steps)
        ]
        for r in range(ranks)
    ]
    targets = []
    for r in range(ranks):
        cols: dict[str, list[float]] = {
            k: [] for k in ("step", "start_us", "ms", "compute_ms", "collective_ms", "idle_ms")
        }
        cols["gap_ms"] = []
        t = 1e9 + rng.uniform(0, 1e6)  # every host's clock its own
        for k in range(steps):
            slowest = max(compute[o][k] for o in range(ranks)) if ranks < 64 else None
            if slowest is None:  # large synthetic jobs: the slowest is known without a scan
                slowest = compute_ms + 3.5 * noise_ms + (extra_ms if straggler is not None else 0)
                slowest = max(slowest, compute[r][k])
            coll = slowest - compute[r][k] + 1.0
            ms = compute[r][k] + coll + 2.0
            cols["step"].append(100 + k)
            cols["start_us"].append(round(t, 3))
            cols["ms"].append(round(ms, 3))
            cols["compute_ms"].append(round(compute[r][k], 3))
            cols["collective_ms"].append(round(coll, 3))
            cols["idle_ms"].append(2.0)
            cols["gap_ms"].append(1.0)
            t += ms * 1000
        per_op = [compute_ms / (2 + i) for i in range(len(OPS))]
        if r == straggler:
            per_op[3] += extra_ms
        ops = sorted(
            (
                [n, steps * 10, round(v * steps * rng.uniform(0.97, 1.03), 3), 0.0]
                for n, v in zip(OPS, per_op, strict=True)
            ),
            key=lambda o: -o[2],
        )[:20]
        stats = {
            "v": 1,
            "mode": "cpu",
            "steps": cols,
            "steps_total": steps,
            "ops": ops,
            "gpu_ops": [],
            "collectives": [["gloo:all_reduce", steps, round(sum(cols["collective_ms"]), 3)]],
            "memory": {"cpu": {"peak_allocated": 2**30 + r * 2**20, "peak_reserved": 2**31}},
        }
        targets.append(
            {
                "host": f"node{r // hosts_per:04d}",
                "pid": 1000 + r,
                "role": "trainer",
                "rank": r,
                "world_size": ranks,
                "state": "done",
                "results": [
                    {
                        "cycle": 0,
                        "path": f"j/{session}/c0/trainer-r{r}.pt.trace.json.gz",
                        "steps": cols["step"],
                        "stats": stats,
                    }
                ],
            }
        )
    return {"id": session, "job": "synthetic", "state": "done", "targets": targets}


def sync_steps(
    ranks: int,
    steps: int = 10,
    *,
    seed: int = 0,
    jitter: float = 0.10,
    slow: int | None = None,
    slower: float = 0.25,
    work_ms: float = 20.0,
    comm_ms: float = 1.0,
) -> tuple[list[tuple[list[float], list[float]]], float]:
    """Per-rank (collective, work) times of a synchronous job, and its median step, in ms.

    Each step every rank works ``work_ms`` times 1 ± ``jitter`` (uniform), ``slow`` works
    ``slower`` of ``work_ms`` more (25 %: a rank 25 % slower than its peers), then all
    wait in the collective until the last has arrived, plus ``comm_ms``. What
    :func:`profd.report.straggler.find_stragglers` takes, without a report around it.
    """
    rng = random.Random(seed)
    work = [
        [
            work_ms * (1 + rng.uniform(-jitter, jitter)) + (slower * work_ms if r == slow else 0)
            for _ in range(steps)
        ]
        for r in range(ranks)
    ]
    last = [max(w[k] for w in work) for k in range(steps)]
    out = [([last[k] - w[k] + comm_ms for k in range(steps)], w) for w in work]
    step = sorted(last)[steps // 2] + comm_ms
    return out, step


def store_session(
    idx: SessionRepo, s: dict[str, Any], label: str | None, created_at: float, state: str = "done"
) -> None:
    """Keep a synthetic session (with its targets' statistics) in a real index, as the
    daemon does once a session is processed."""
    with idx.transaction():
        idx.save_session(
            {
                "id": s["id"],
                "job": s["job"],
                "state": state,
                "backend": "torch",
                "label": label,
                "region": None,
                "request": {"job": s["job"], "label": label},
                "cycles": [[99, 100, 100 + len(s["targets"][0]["results"][0]["steps"])]],
                "plan": 0,
                "error": None,
                "created_at": created_at,
                "updated_at": created_at,
            }
        )
        for t in s["targets"]:
            idx.save_target(
                {
                    **t,
                    "session": s["id"],
                    "job": s["job"],
                    "error": None,
                    "traces": 1,
                    "final": "done",
                    "updated_at": created_at,
                }
            )
