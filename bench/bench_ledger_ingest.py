"""The daemon's step-ledger ingest (``Ledgers.heartbeat``): the module as it was when it took
a map (``fields_of`` of the typed ``Ledger``, then key reads; read from git at ``--before``)
against the module now (the ``Ledger`` read in place), paired.

Both get the same decoded heartbeats: ``--ranks`` ranks, one heartbeat per rank per second
(none coalesced), a 10-step ledger with 3 regions each, ``--per-run`` heartbeats a run; runs
alternate which goes first. Prints the median and p10..p90 of each side and of the per-pair
ratio (now / before), in µs per heartbeat.

    PYTHONPATH=.:client python bench/bench_ledger_ingest.py [--pairs 40]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from profd.daemon.clients import ledger as now_module
from profd.daemon.clients.registry import Client
from profd_client import protocol as P

ROOT = Path(__file__).resolve().parents[1]


def _before(commit: str, where: Path) -> ModuleType:
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:profd/daemon/clients/ledger.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = where / "ledger_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("ledger_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ledger_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def _heartbeats(n: int) -> list[Any]:
    out = []
    for i in range(n):
        at = 10 * (i + 1)
        led = {
            "at": at,
            "n": 10,
            "sum": 1.01,
            "q": [0.1, 0.102, 0.11, 0.13],
            "b": [0] * 6 + [10] + [0] * 12,
            "r": [["forward", 0.41, 10], ["backward", 0.52, 10], ["optimizer", 0.08, 10]],
            "epoch": 0,
        }
        frame = P.encode(P.HEARTBEAT, step=at, sps=9.9, state="idle", ledger=led)
        out.append(P.decode(frame, P.AGENT_INBOUND))
    return out


def _run(module: ModuleType, typed: bool, clients: list[Client], hbs: list[Any]) -> float:
    clock = _Clock()
    heartbeat = module.Ledgers(clock).heartbeat
    fields_of = P.fields_of
    k = 0
    t0 = time.perf_counter()
    for i, m in enumerate(hbs):
        clock.t += 1.0
        now = 1000.0 + i
        for c in clients:
            heartbeat(c, m.step, m.ledger if typed else fields_of(m.ledger), now)
            k += 1
    return (time.perf_counter() - t0) / k * 1e6


def _spread(xs: list[float]) -> str:
    d = statistics.quantiles(xs, n=10)
    return f"{statistics.median(xs):.3f} (p10..p90 {d[0]:.3f}..{d[-1]:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--before", default="9bb6494", help="the commit of the map-taking module")
    ap.add_argument(
        "--before-typed",
        action="store_true",
        help="the module at --before takes the typed Ledger too (a commit since typed messages)",
    )
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--per-run", type=int, default=4000)
    args = ap.parse_args()
    clients = [
        Client(b"r%d" % r, "n1", 1000 + r, "j", "trainer", r, r, args.ranks, "optimizer", True,
               None, None)
        for r in range(args.ranks)
    ]  # fmt: skip
    hbs = _heartbeats(max(1, args.per_run // args.ranks))
    with tempfile.TemporaryDirectory() as tmp:
        before = _before(args.before, Path(tmp))
        for _ in range(3):  # warm
            _run(before, args.before_typed, clients, hbs)
            _run(now_module, True, clients, hbs)
        olds: list[float] = []
        news: list[float] = []
        for i in range(args.pairs):
            if i % 2:
                b = _run(now_module, True, clients, hbs)
                a = _run(before, args.before_typed, clients, hbs)
            else:
                a = _run(before, args.before_typed, clients, hbs)
                b = _run(now_module, True, clients, hbs)
            olds.append(a)
            news.append(b)
    ratios = [b / a for a, b in zip(olds, news, strict=True)]
    print(
        f"Ledgers.heartbeat, {len(hbs) * len(clients)} heartbeats a run, {args.pairs} pairs:"
        f" before ({args.before}) {_spread(olds)} µs, now {_spread(news)} µs,"
        f" now/before {_spread(ratios)}"
    )


if __name__ == "__main__":
    main()
