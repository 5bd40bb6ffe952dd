"""Simulated profd nodes for ``bench_cluster.py``: many per process, the real control protocol.

Each node is a ZeroMQ ROUTER on its own TCP port on 127.0.0.1 with the daemon's CURVE server
key (every client key is let in: no ZAP handler, so the handshake's cryptography runs but
the authorization lookup of a real daemon does not), answering ``status``, ``ps`` and
``start`` (a ``probe``, then a start with the coordinator's session id and cycles) and
``stacks`` (a DDP job's stacks as py-spy reads them, grouped by the daemon's own code; on
node ``--stuck-node`` its rank 1 is stuck loading data) for ``--ranks`` simulated ranks.
The time a node gets its start is when its ranks would be armed (a real daemon sends the
arms inside that handler). Rows come from the daemon's own ``Client.ps_row()``, packed as
the daemon packs them.

Commands on stdin, one JSON line each, one JSON reply line on stdout:
``{"cmd": "ready"}`` -> ``{"ports": [...]}``; ``{"cmd": "arms"}`` -> ``{"arms": [[session,
node, wall time], ...]}`` (and forgets them); ``{"cmd": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import zmq
import zmq.auth

from profd import control_schema as C
from profd.control_rows import pack
from profd.daemon.clients.pyspy_reader import job_doc
from profd.daemon.clients.registry import Client
from profd.daemon.clients.stack_sources import target
from profd.watch import stackgroups
from profd.watch.rankrow import ReadStatus
from profd.watch.stackrows import Source, threads_of
from profd_client import protocol as P


def make_clients(node: int, ranks: int, world: int) -> list[Client]:
    now = time.monotonic()
    return [
        Client(
            ident=b"sim",
            host=f"sim{node:04d}",
            pid=100_000 + k,
            job="simjob",
            role="trainer",
            rank=node * ranks + k,
            local_rank=k,
            world_size=world,
            step_mode="optimizer",
            allowed=True,
            torch="2.13.0",
            device="cuda:0",
            step=1000,
            step_at=now,
            sps=10.0,
            version=P.VERSION,
        )
        for k in range(ranks)
    ]


def _frames(*where: tuple[str, str, int]) -> list[dict[str, Any]]:
    return [{"function": f, "file": file, "line": line} for f, file, line in where]


TORCH = "/opt/conda/lib/python3.11/site-packages/torch"
#: The training thread's frames, innermost first: most ranks wait in backward's all-reduce,
#: a stuck one reads its next batch.
WAITING = _frames(
    ("wait", f"{TORCH}/distributed/distributed_c10d.py", 2510),
    ("all_reduce", f"{TORCH}/distributed/distributed_c10d.py", 2501),
    ("wrapper", f"{TORCH}/distributed/c10d_logger.py", 83),
    ("_run_backward", f"{TORCH}/autograd/graph.py", 768),
    ("backward", f"{TORCH}/autograd/__init__.py", 289),
    ("backward", f"{TORCH}/_tensor.py", 626),
    ("train_step", "/home/user/job/train.py", 88),
    ("train", "/home/user/job/train.py", 120),
    ("main", "/home/user/job/train.py", 141),
    ("<module>", "/home/user/job/train.py", 150),
)
STUCK = _frames(
    ("readinto", "/opt/conda/lib/python3.11/socket.py", 706),
    ("read_shard", "/home/user/job/data.py", 61),
    ("load_batch", "/home/user/job/data.py", 88),
    ("train_step", "/home/user/job/train.py", 80),
    ("train", "/home/user/job/train.py", 120),
    ("main", "/home/user/job/train.py", 141),
    ("<module>", "/home/user/job/train.py", 150),
)
OTHER_THREADS = [
    ("pin_memory", _frames(
        ("get", "/opt/conda/lib/python3.11/queue.py", 180),
        ("_pin_memory_loop", f"{TORCH}/utils/data/_utils/pin_memory.py", 54),
        ("run", "/opt/conda/lib/python3.11/threading.py", 982),
        ("_bootstrap", "/opt/conda/lib/python3.11/threading.py", 1002),
    )),
    ("profd-agent", _frames(
        ("poll", "/opt/conda/lib/python3.11/site-packages/zmq/sugar/poll.py", 106),
        ("_run", "/opt/conda/lib/python3.11/site-packages/profd_client/agent.py", 180),
        ("run", "/opt/conda/lib/python3.11/threading.py", 982),
        ("_bootstrap", "/opt/conda/lib/python3.11/threading.py", 1002),
    )),
]  # fmt: skip


def stacks_doc(node: str, clients: list[Client], stuck: bool) -> dict[str, Any]:
    """What a daemon answers ``stacks`` with for these ranks: every one read by py-spy,
    three threads each; rank 1 of a ``stuck`` node in ``load_batch``."""
    rows = []
    for k, c in enumerate(clients):
        main = STUCK if stuck and k == 1 else WAITING
        threads = [{"name": "MainThread", "tid": c.pid, "training": True, "frames": main}]
        threads += [
            {"name": name, "tid": c.pid + 1 + i, "training": False, "frames": frames}
            for i, (name, frames) in enumerate(OTHER_THREADS)
        ]
        marked = stackgroups.mark_training(threads_of(threads), c.pid)
        read = target(c).row(ReadStatus.READ, Source.PYSPY, marked, read_ms=6.0)
        rows.append(read)
    doc = job_doc(clients[0].job, rows)
    doc["node"] = node
    return doc


class Nodes:
    def __init__(
        self, first: int, count: int, ranks: int, world: int, secret: str, stuck_node: int = -1
    ) -> None:
        public, secret_key = zmq.auth.load_certificate(secret)
        self.ctx = zmq.Context()
        self.socks: dict[Any, int] = {}
        self.ports: list[int] = []
        self.clients: dict[int, list[Client]] = {}
        for node in range(first, first + count):
            s = self.ctx.socket(zmq.ROUTER)
            s.setsockopt(zmq.LINGER, 0)
            s.curve_server = True
            s.curve_publickey = public
            s.curve_secretkey = secret_key
            port = s.bind_to_random_port("tcp://127.0.0.1")
            self.socks[s] = node
            self.ports.append(port)
            self.clients[node] = make_clients(node, ranks, world)
        self.stuck_node = stuck_node
        self.arms: list[tuple[str, int, float]] = []
        self.lock = threading.Lock()
        self.stopping = False

    def serve(self) -> None:
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        while not self.stopping:
            for s, _ in poller.poll(200):
                frames = s.recv_multipart()
                envelope, frame = P.split_envelope(frames)
                msg = P.unpack(frame)
                node = self.socks[s]
                try:
                    data = self.answer(node, msg)
                    if isinstance(data, C.Packed):  # typed rows, packed as the daemon does
                        reply = C.reply(msg, data)
                    else:
                        reply = C.encode(C.OK, data=data)
                except Exception as exc:  # a bench bug: say so to the coordinator
                    reply = P.error("internal", repr(exc))
                s.send_multipart(P.join_envelope(envelope, reply))

    def answer(self, node: int, m: dict[str, Any]) -> Any:
        t = m["t"]
        clients = self.clients[node]
        name = f"sim{node:04d}"
        if t == C.C_PS:
            rows = [c.ps_row(name, c.step, False, 0.0, ()) for c in clients]
            return pack(C.C_PS, rows, table=m.get("form") == C.FORM_TABLE)
        if t == C.C_STATUS:
            return {"host": name, "version": "sim", "clients": len(clients)}
        if t == C.C_START:
            spec = m["spec"]
            now = time.monotonic()
            if spec.get("probe"):
                return {
                    "candidates": [
                        {
                            "host": c.host,
                            "pid": c.pid,
                            "job": c.job,
                            "role": c.role,
                            "rank": c.rank,
                            "uid": 0,
                            "step": c.step + int(c.sps * (now - c.step_at)),
                            "sps": c.sps,
                            "age_s": 0.0,
                            "busy_until": 0,
                            "attaching": False,
                            "node": name,
                        }
                        for c in clients
                    ]
                }
            with self.lock:
                self.arms.append((spec["session"], node, time.time()))
            return {
                "session": spec["session"],
                "job": "simjob",
                "steps": [],
                "cycles": spec["cycles"],
                "state": "armed",
                "targets": [
                    {"host": c.host, "pid": c.pid, "role": c.role, "rank": c.rank, "node": name}
                    for c in clients
                ],
            }
        if t == C.C_STACKS:
            return [stacks_doc(name, clients, node == self.stuck_node)]
        raise ValueError(f"simulated node does not answer {t!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--first", type=int, required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--world", type=int, required=True, help="ranks on every node of the fleet")
    ap.add_argument("--secret", required=True)
    ap.add_argument("--stuck-node", type=int, default=-1)
    a = ap.parse_args()
    nodes = Nodes(a.first, a.count, a.ranks, a.world, a.secret, a.stuck_node)
    t = threading.Thread(target=nodes.serve, daemon=True)
    t.start()
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        if cmd == "ready":
            out: dict[str, Any] = {"ports": nodes.ports, "pid": os.getpid()}
        elif cmd == "arms":
            with nodes.lock:
                out = {"arms": nodes.arms}
                nodes.arms = []
        else:
            break
        print(json.dumps(out), flush=True)
    nodes.stopping = True
    t.join(2)


if __name__ == "__main__":
    main()
