"""What the daemon's heartbeat answers cost, by how many are sent and how they are grouped.

The daemon answers a ``quiet`` client's heartbeat once every ``QUIET_ACKS`` intervals, and it
reads agent messages in batches (one wake-up every ``AGENT_LINGER_S``), so its answers leave
in bursts: at 1,024 clients, 1 Hz heartbeats and answers every third interval, ~7 sends every
20 ms. This times that pattern alone: a ROUTER bound on ipc sends a heartbeat answer (the
routing id with SNDMORE, then the frame, as ``Daemon._send_agent`` does) to peers of another
process, at a given rate, in bursts every given interval, and measures the CPU of the whole
sending process (ZeroMQ's I/O thread included) per send, less the same pacing loop without
sends. Rates alternate, so a drift of the machine shows as spread, not as a difference.

    PYTHONPATH=.:client python bench/bench_answers.py [--rates 340,170] [--burst-ms 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import zmq

#: The peers: DEALERs that say hello once, then read whatever comes.
PEERS = """
import sys, time, zmq
endpoint, n = sys.argv[1], int(sys.argv[2])
ctx = zmq.Context()
poller = zmq.Poller()
for i in range(n):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, b"p%d" % i)
    s.connect(endpoint)
    s.send(b"hello")
    poller.register(s, zmq.POLLIN)
while True:
    for s, _ in poller.poll(1000):
        while True:
            try:
                s.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
"""
#: A heartbeat answer as the daemon encodes it (``{"v": 3, "t": "hb"}``).
FRAME = b"\x82\xa1v\x03\xa1t\xa2hb"
_MORE = zmq.SNDMORE | zmq.NOBLOCK


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def paced(seconds: float, burst_s: float, per_burst: float, send: Callable[[], None]) -> int:
    """Call ``send`` ``per_burst`` times (on average) every ``burst_s`` for ``seconds``;
    how many times it was called."""
    n, owed = 0, 0.0
    start = time.perf_counter()
    due = start
    while due - start < seconds:
        due += burst_s
        owed += per_burst
        while owed >= 1.0:
            send()
            n += 1
            owed -= 1.0
        left = due - time.perf_counter()
        if left > 0:
            time.sleep(left)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rates", default="340,170", help="answers a second, alternated")
    ap.add_argument("--burst-ms", type=float, default=20.0, help="one burst every this long")
    ap.add_argument("--peers", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    burst_s = args.burst_ms / 1000.0
    tmp = tempfile.mkdtemp()
    endpoint = f"ipc://{tmp}/answers"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    peers = subprocess.Popen([sys.executable, "-c", PEERS, endpoint, str(args.peers)])
    try:
        ids: list[bytes] = []
        while len(ids) < args.peers:
            ids.append(router.recv_multipart()[0])
        turn = 0

        def send() -> None:
            nonlocal turn
            router.send(ids[turn % len(ids)], _MORE)
            router.send(FRAME, zmq.NOBLOCK)
            turn += 1

        per_send: dict[float, list[float]] = {r: [] for r in rates}
        for k in range(args.rounds):
            for rate in rates if k % 2 == 0 else rates[::-1]:
                c0 = cpu_s()
                n = paced(args.seconds, burst_s, rate * burst_s, send)
                c1 = cpu_s()
                paced(args.seconds, burst_s, 0.0, send)  # the pacing alone
                c2 = cpu_s()
                per_send[rate].append(((c1 - c0) - (c2 - c1)) / n * 1e6)
        for rate, us in per_send.items():
            mid = statistics.median(us)
            print(
                f"{rate:g} answers/s in bursts every {args.burst_ms:g} ms: "
                f"{mid:.1f} µs of CPU per send ({', '.join(f'{u:.1f}' for u in us)}), "
                f"{mid * rate / 1e4:.2f} % of a core"
            )
    finally:
        peers.kill()
        peers.wait()
        router.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    main()
