"""What one hostile local process can make a daemon keep, with its default limits.

Flood: one attached peer sends 20 heartbeats a second, each with a step ledger naming 32 new
200-character regions, for ``--seconds`` (30; 1 with ``--quick``). Measured: the daemon's
RSS as it goes and after the peer left, the region names it keeps for the rank, ``/metrics``
(bytes, samples, one scrape's time) and what ``index.db`` grew by once the peer's minutes
were written.

Peers: one process registers ``--peers`` peers (500; 20 with ``--quick``), each on its own
socket with its own host, job and role, and heartbeats each of them once a second with a
ledger of 4 regions for ``--peer-seconds`` (20; 1 with ``--quick``). Measured: peers
accepted, the daemon's RSS, ``/metrics`` (bytes, job labels), the size of one ``top`` reply
and ``index.db``'s growth.

Run it against another tree for a before/after: ``PYTHONPATH=/other:/other/client``.
Target: bounded by ``[daemon] max_regions_per_rank``, ``max_heartbeat_rate``,
``max_peers_per_process`` and ``max_peers_per_user`` (the defaults here).
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B

from profd import control_schema as C
from profd_client import protocol as P

HB_RATE = 20.0
NAMES_PER_HB = P.MAX_LEDGER_REGIONS
_BUCKETS = [0] * (len(P.STEP_BUCKETS) + 1)
_BUCKETS[P.STEP_BUCKETS.index(0.05)] = 10


def hello(name: str) -> dict[str, Any]:
    return {
        "v": P.VERSION, "t": P.HELLO, "pid": os.getpid(), "host": name, "job": name,
        "role": name, "rank": 0, "local_rank": 0, "world_size": 1, "step": 0,
        "step_mode": "manual", "allowed": True, "client_version": "bench",
    }  # fmt: skip


def heartbeat(step: int, regions: list[list[Any]]) -> bytes:
    led = {"at": step, "n": 10, "sum": 0.45, "q": [0.045, 0.048, 0.049, 0.049],
           "b": _BUCKETS, "r": regions, "epoch": 0}  # fmt: skip
    return msgpack.packb({"v": P.VERSION, "t": P.HEARTBEAT, "step": step, "ledger": led})


def dealer(ctx: zmq.Context[Any], d: B.Daemon) -> zmq.Socket[Any]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(f"ipc://{d.runtime_dir / 'agent.sock'}")
    return s


def answer(s: zmq.Socket[Any], timeout_ms: int = 10_000) -> dict[str, Any]:
    assert s.poll(timeout_ms), "no answer from the daemon"
    m: dict[str, Any] = msgpack.unpackb(s.recv(), raw=False)
    return m


def drain(s: zmq.Socket[Any]) -> None:
    while True:
        try:
            s.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


def rss_mb(d: B.Daemon) -> float:
    return float(psutil.Process(d.pid).memory_info().rss) / 2**20


def index_bytes(d: B.Daemon) -> int:
    """``index.db`` and its write-ahead log: what the rows take before a checkpoint."""
    return sum(
        p.stat().st_size
        for p in (d.state_dir / "index.db", d.state_dir / "index.db-wal")
        if p.exists()
    )


def scrape(d: B.Daemon) -> dict[str, Any]:
    addr = d.request("status")["metrics"]["listen"]
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=60) as r:
        page = r.read()
    took = time.perf_counter() - t0
    samples = [s for f in text_string_to_metric_families(page.decode()) for s in f.samples]
    return {
        "bytes": len(page),
        "samples": len(samples),
        "scrape_s": took,
        "regions": sum(s.name == "profd_region_seconds_total" for s in samples),
        "jobs": len({s.labels["job"] for s in samples if "job" in s.labels}),
    }


def top_bytes(ctx: zmq.Context[Any], d: B.Daemon) -> int:
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{d.runtime_dir / 'control.sock'}")
    s.send(msgpack.packb({"v": P.VERSION, "t": C.C_TOP}))
    assert s.poll(60_000), "no top reply"
    n = len(s.recv())
    s.close()
    return n


def wait_gone(d: B.Daemon) -> None:
    """Until no peer is attached and the loop's next ticks wrote their last minutes."""
    B.wait_for(lambda: d.request("status")["clients"] == 0, 60, "the peers to leave", every=0.2)
    time.sleep(3 * d.heartbeat)


def limits(d: B.Daemon) -> dict[str, Any]:
    return dict(d.request("status").get("limits") or {})


def flood(seconds: float) -> dict[str, Any]:
    ctx: zmq.Context[Any] = zmq.Context()
    d = B.Daemon(sim_peers=False, tables='[metrics]\nlisten = "127.0.0.1:0"\n').start()
    try:
        time.sleep(1.0)
        idx0, rss = index_bytes(d), [(0.0, rss_mb(d))]
        s = dealer(ctx, d)
        s.send(msgpack.packb(hello("flood")))
        assert answer(s)["t"] == P.WELCOME
        t0 = time.monotonic()
        beat, next_rss = 0, 10.0
        while (now := time.monotonic() - t0) < seconds:
            names = [
                [f"{beat:06d}-{j:02d}-".ljust(P.MAX_NAME, "x"), 0.001, 1]
                for j in range(NAMES_PER_HB)
            ]
            beat += 1
            s.send(heartbeat(10 * beat, names))
            drain(s)
            if now >= next_rss:
                rss.append((round(now), rss_mb(d)))
                next_rss += 10.0
            time.sleep(max(0.0, t0 + beat / HB_RATE - time.monotonic()))
        rss.append((round(time.monotonic() - t0), rss_mb(d)))
        time.sleep(2 * d.heartbeat)  # what was coalesced is applied at the next tick
        page = scrape(d)
        attached = [r["job"] for r in d.request("ps")] == ["flood"]
        s.send(msgpack.packb({"v": P.VERSION, "t": P.BYE}))
        wait_gone(d)
        after = rss_mb(d)
        s.close()
        return {
            "heartbeats": beat,
            "region_names_sent": beat * NAMES_PER_HB,
            "rss_mb": rss,
            "rss_after_leave_mb": after,
            "metrics": page,
            "index_growth_bytes": index_bytes(d) - idx0,
            "still_attached": attached,
            "limits": limits(d),
        }
    finally:
        d.stop()
        ctx.destroy(linger=0)


def peers(n: int, seconds: float) -> dict[str, Any]:
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * n + 64)
    d = B.Daemon(sim_peers=False, tables='[metrics]\nlisten = "127.0.0.1:0"\n').start()
    try:
        time.sleep(1.0)
        idx0, rss0 = index_bytes(d), rss_mb(d)
        socks, refused = [], ""
        for i in range(n):
            s = dealer(ctx, d)
            s.send(msgpack.packb(hello(f"peer-{i:04d}")))
            m = answer(s)
            if m["t"] == P.WELCOME:
                socks.append(s)
            else:
                refused = refused or str(m.get("msg"))
                s.close()
        regions = [[f"region-{k}", 0.01, 1] for k in range(4)]
        t0 = time.monotonic()
        beat = 0
        while time.monotonic() - t0 < seconds:
            beat += 1
            for s in socks:
                s.send(heartbeat(10 * beat, regions))
                drain(s)
            time.sleep(max(0.0, t0 + beat - time.monotonic()))
        page = scrape(d)
        top = top_bytes(ctx, d)
        rss = rss_mb(d)
        for s in socks:
            s.send(msgpack.packb({"v": P.VERSION, "t": P.BYE}))
        wait_gone(d)
        for s in socks:
            s.close()
        return {
            "asked": n,
            "accepted": len(socks),
            "refusal": refused,
            "rss_before_mb": rss0,
            "rss_mb": rss,
            "metrics": page,
            "top_reply_bytes": top,
            "index_growth_bytes": index_bytes(d) - idx0,
            "limits": limits(d),
        }
    finally:
        d.stop()
        ctx.destroy(linger=0)


def main() -> None:
    ap = B.parser(__doc__)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--peers", type=int, default=None)
    ap.add_argument("--peer-seconds", type=float, default=None)
    args = ap.parse_args()
    started = time.monotonic()
    quick = args.quick
    # --quick: a second of flood (20 heartbeats, 640 names: ten times the limit) and of peers
    # (each heartbeats once) exercises every path; the minutes measure.
    seconds = args.seconds or (1.0 if quick else 30.0)
    npeers = args.peers or (20 if quick else 500)
    peer_s = args.peer_seconds or (1.0 if quick else 20.0)
    f = flood(seconds)
    p = peers(npeers, peer_s)
    mb = 2**20
    rows = [
        B.row("flood: region series in /metrics", "<= 65 (64 + (other))",
              f["metrics"]["regions"], "series", met=f["metrics"]["regions"] <= 65),
        B.row("flood: daemon RSS at the end", "bounded", f["rss_mb"][-1][1], "MB",
              baseline=f["rss_mb"][0][1], baseline_what="before the peer"),
        B.row("flood: /metrics page", "", f["metrics"]["bytes"] / mb, "MB"),
        B.row("flood: one /metrics scrape", "", f["metrics"]["scrape_s"], "s"),
        B.row("flood: index.db growth", "", f["index_growth_bytes"] / mb, "MB"),
        B.row("flood: peer still attached", "yes", float(f["still_attached"]), "",
              met=f["still_attached"]),
        B.row("peers: accepted from one process", "<= 16", p["accepted"], "peers",
              baseline=p["asked"], baseline_what="asked", met=p["accepted"] <= 16),
        B.row("peers: /metrics page", "", p["metrics"]["bytes"] / mb, "MB"),
        B.row("peers: top reply", "", p["top_reply_bytes"] / mb, "MB"),
        B.row("peers: daemon RSS", "", p["rss_mb"], "MB", baseline=p["rss_before_mb"],
              baseline_what="before the peers"),
        B.row("peers: index.db growth", "", p["index_growth_bytes"] / mb, "MB"),
    ]  # fmt: skip
    params = {"seconds": seconds, "hb_rate": HB_RATE, "names_per_hb": NAMES_PER_HB,
              "peers": npeers, "peer_seconds": peer_s}  # fmt: skip
    B.write_result("hostile", args.out, quick, params, rows, {"flood": f, "peers": p}, started)


if __name__ == "__main__":
    main()
