"""Simulated training processes that speak the real protocol through the real client code.

One worker process holds ``--count`` pairs of :class:`profd_client.agent.Agent` (its own
ZeroMQ DEALER, heartbeats, arm handling) and :class:`profd_client.steps.Stepper` (the step
counter, plans and torch.profiler captures), and one "training" thread that calls
``stepper.tick()`` on all of them at ``--rate`` Hz. Each client has host ``sim-<proc>`` and a
fake pid, so the daemon's sampler (which only samples pids on its own host) leaves them
alone. The ARM arrival time of every client is recorded (``time.monotonic()``, the same
system-wide clock in every process) by wrapping ``Agent._arm``.

Commands, one JSON per line on stdin; one JSON reply per line on stdout:
``{"op": "status"}``, ``{"op": "arms", "session": S}``, ``{"op": "steps"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import defaultdict
from typing import Any

from profd_client.agent import Agent
from profd_client.identity import Identity
from profd_client.steps import Stepper

ARMS: dict[str, list[tuple[int, float]]] = defaultdict(list)
ARMS_LOCK = threading.Lock()


RECONNECTS: list[int] = []


class TimedAgent(Agent):
    def _connect(self, zmq: Any, ctx: Any, poller: Any) -> None:
        if self._sock is not None:
            RECONNECTS.append(self.who.rank)
        super()._connect(zmq, ctx, poller)

    def _arm(self, msg: dict[str, Any]) -> None:
        # Under the lock: an append racing the "arms" pop would land in a dropped list.
        with ARMS_LOCK:
            ARMS[msg["session"]].append((self.who.rank, time.monotonic()))
        super()._arm(msg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--proc", type=int, required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--rank-base", type=int, default=0)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--role", default="sim")
    ap.add_argument("--hb", type=float, default=1.0)
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--work", action="store_true", help="a small torch op per step")
    ap.add_argument("--runtime-dir")
    args = ap.parse_args()

    import zmq

    zmq.Context.instance().set(zmq.MAX_SOCKETS, 65536)
    work = None
    if args.work:
        import torch

        torch.set_num_threads(1)
        a = torch.randn(64, 64)

        def work() -> None:
            (a @ a).relu_().sum()

    host = f"sim-{args.proc}"
    pairs: list[tuple[Stepper, Agent]] = []
    for i in range(args.count):
        rank = args.rank_base + i
        ident = Identity(
            job=args.job,
            role=args.role,
            rank=rank,
            local_rank=i,
            world_size=args.world,
            # The daemon believes only the kernel's pid: every simulated client is this
            # process, told apart by its host name.
            host=f"{host}-sim{rank}",
            pid=os.getpid(),
        )
        st = Stepper(stem=f"{args.role}-r{rank}", notify=lambda: None)
        ag = TimedAgent(ident, st, "manual", True, args.runtime_dir, args.hb)
        st._notify = ag.notify
        pairs.append((st, ag))
    for _, ag in pairs:
        ag.start()

    stop = threading.Event()
    period = 1.0 / args.rate

    def train() -> None:
        nxt = time.monotonic()
        while not stop.is_set():
            if work is not None:
                work()
            for st, _ in pairs:
                st.tick()
            nxt += period
            delay = nxt - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                nxt = time.monotonic()

    t = threading.Thread(target=train, name="sim-train", daemon=True)
    t.start()
    print(json.dumps({"ready": args.proc}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "status":
            n = sum(ag.connected.is_set() for _, ag in pairs)
            print(json.dumps({"connected": n, "count": len(pairs)}), flush=True)
        elif op == "arms":
            with ARMS_LOCK:
                times = ARMS.pop(cmd["session"], [])
            print(json.dumps({"times": times}), flush=True)
        elif op == "reconnects":
            print(json.dumps({"n": RECONNECTS}), flush=True)
        elif op == "steps":
            print(json.dumps({"steps": [st.count for st, _ in pairs]}), flush=True)
    stop.set()
    t.join(2)
    for _, ag in pairs:
        ag.stopping.set()
        ag.notify()
    for _, ag in pairs:
        ag.join(2)


if __name__ == "__main__":
    main()
