"""Decode + validate cost of one agent message: hand-written schemas against typed msgspec
definitions, paired.

A heartbeat with a step ledger (every rank, every second, on the daemon), an ``arm`` (every
armed rank, on the client), a ``hello`` (every attach) and an ``armed`` (every armed rank, on
the daemon). For each, the old path (``msgpack.unpackb`` with limits, then the hand-written
``Struct`` checks these messages had, kept here) and the typed path they have now
(``profd_client.protocol.decode``: one msgspec decoder over the tagged union of every type
the receiver takes, with the same bounds, decoded and validated from msgpack in one pass) run
in alternating short batches, so both see the same machine load; each batch's time per
message is kept, and the result is the median of each side and of the per-pair ratio
(new / old), with p10..p90. The last row weighs the one union decoder against a decoder per
type picked from the frame's first bytes (``v`` then ``t`` as every sender here lays them out).

Both sides must accept the frames measured and refuse the same bad ones (checked first), or
the comparison is void. ``--quick``: a few rounds. Prints one line per message.

    PYTHONPATH=.:client python bench/bench_protocol.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgpack
import msgspec

from profd_client import protocol as P

# --- the hand-written schemas these messages had before they were typed ----------------------
_R, _O = True, False


class RegionTimes(P.Field):
    """A ledger's ``r`` as it was checked by hand: ``[[name, seconds, entries], ...]``."""

    def check(self, value: object, where: str) -> Any:
        if type(value) is not list or len(value) > P.MAX_LEDGER_REGIONS:
            raise P.bad(where, f"must be a list of at most {P.MAX_LEDGER_REGIONS} regions")
        for i, item in enumerate(value):
            if (
                type(item) is not list
                or len(item) != 3
                or type(item[0]) is not str
                or not 1 <= len(item[0]) <= P.MAX_NAME
                or type(item[1]) not in (int, float)
                or not 0.0 <= item[1] <= P.MAX_SECONDS  # also refuses NaN
                or type(item[2]) is not int
                or not 0 <= item[2] <= P.MAX_STEP
            ):
                raise P.bad(f"{where}[{i}]", "must be [name, seconds, entries]")
        return value

    def describe(self) -> str:
        return "list of [name, seconds, entries]"


OLD_LEDGER = P.Struct(
    {
        "at": (P.Int(0, P.MAX_STEP), _R),
        "n": (P.Int(0, P.MAX_STEP), _R),
        "sum": (P.Num(0.0, P.MAX_SECONDS), _R),
        "q": (P.ListOf(P.Num(0.0, P.MAX_SECONDS), 4, 4), _R),
        "b": (P.ListOf(P.Int(0, P.MAX_STEP), len(P.STEP_BUCKETS) + 1, len(P.STEP_BUCKETS) + 1), _R),
        "r": (RegionTimes(), _O),
        "epoch": (P.Int(0, 1 << 31), _O),
    },
    open=True,
)
OLD = {
    P.HEARTBEAT: P.Struct(
        {
            "step": (P.STEP, _O),
            "sps": (P.Num(0.0, P.MAX_RATE), _O),
            "state": (P.SHORT, _O),
            "ledger": (OLD_LEDGER, _O),
            "training_tid": (P.Nullable(P.TID), _O),
        },
        open=True,
    ),
    P.ARM: P.Struct(
        {
            "session": (P.SESSION_ID, _R),
            "job": (P.NAME, _R),
            "backend": (P.Str(16, choices=P.BACKENDS), _R),
            "cycles": (P.Cycles(), _R),
            "options": (P.OPTIONS, _R),
            "region": (P.Nullable(P.Str(P.MAX_NAME, 1)), _O),
            "incoming": (P.PATH, _R),
            "plan": (P.REVISION, _O),
        },
        open=True,
    ),
    P.HELLO: P.Struct(
        {
            "pid": (P.PID, _R),
            "host": (P.HOST, _R),
            "job": (P.NAME, _R),
            "role": (P.NAME, _R),
            "rank": (P.RANK, _R),
            "local_rank": (P.RANK, _R),
            "world_size": (P.Int(1, P.MAX_RANK + 1), _R),
            "step": (P.STEP, _R),
            "step_mode": (P.Str(16), _R),
            "allowed": (P.Bool(), _R),
            "client_version": (P.SHORT, _R),
            "torch": (P.Nullable(P.SHORT), _O),
            "device": (P.Nullable(P.SHORT), _O),
            "sessions": (P.ListOf(P.Str(P.MAX_NAME), P.MAX_CYCLES), _O),
            "nsys_session": (P.Nullable(P.NAME), _O),
            "waiting": (P.Bool(), _O),
            "identity_source": (P.IDENTITY_SOURCE, _O),
            "training_tid": (P.Nullable(P.TID), _O),
            "flight": (P.Bool(), _O),
        },
        open=True,
    ),
    P.ARMED: P.Struct(
        {"session": (P.SESSION_ID, _R), "cycles": (P.Cycles(), _R), "plan": (P.REVISION, _O)},
        open=True,
    ),
}


def old_decode(frame: bytes) -> object:
    """The path before: unpack with the limits, then the hand-written checks."""
    return P.validate(P.unpack(frame), OLD)


# --- the frames ------------------------------------------------------------------------------
LEDGER = {
    "at": 120_000,
    "n": 12,
    "sum": 1.21,
    "q": [0.1, 0.102, 0.11, 0.13],
    "b": [0] * 6 + [12] + [0] * 12,
    "r": [["forward", 0.41, 12], ["backward", 0.62, 12], ["optimizer", 0.08, 12]],
    "epoch": 0,
}
HB = P.encode(P.HEARTBEAT, step=120_000, sps=9.9, state="idle", ledger=LEDGER)
ARM = P.encode(
    P.ARM,
    session="s-20270101-120000-ab12",
    job="llama-70b-pretrain",
    backend="torch",
    cycles=[[120_010, 120_012, 120_014]],
    options={"activities": ["cpu", "cuda"], "record_shapes": True, "with_stack": False},
    region=None,
    incoming="/var/lib/profd/spool/incoming/llama-70b-pretrain/s-20270101-120000-ab12",
    plan=0,
)
ARMED = P.encode(
    P.ARMED, session="s-20270101-120000-ab12", cycles=[[120_010, 120_012, 120_014]], plan=0
)
HELLO = P.encode(
    P.HELLO,
    pid=48213,
    host="gpu-node-0417.cluster.example.com",
    job="llama-70b-pretrain",
    role="trainer",
    rank=1234,
    local_rank=2,
    world_size=2048,
    step=0,
    step_mode="optimizer",
    allowed=True,
    client_version=P.RELEASE,
    torch="2.13.0+cu128",
    device="cuda:2",
    sessions=[],
    nsys_session=None,
    waiting=True,
    identity_source={
        "job": "env:TORCHELASTIC_RUN_ID",
        "role": "default",
        "rank": "env:RANK",
        "local_rank": "env:LOCAL_RANK",
        "world_size": "env:WORLD_SIZE",
    },
    training_tid=48213,
    flight=True,
)


class PerType:
    """The alternative to one union decoder: a decoder per type, picked by the frame's first
    bytes (``{v: <fixint>, t: <fixstr>`` as every sender here writes them), the union for any
    frame laid out otherwise."""

    def __init__(self, inbound: P.Inbound) -> None:
        self.union = inbound.fast
        self.by_prefix = {
            b"\xa1t" + bytes([0xA0 | len(t)]) + t.encode(): msgspec.msgpack.Decoder(s.type)
            for t, s in inbound.items()
        }

    def decode(self, frame: bytes) -> object:
        if frame.startswith(b"\xa1v", 1) and frame.startswith(b"\xa1t", 4):
            dec = self.by_prefix.get(frame[4 : 7 + (frame[6] & 0x1F)])
            if dec is not None:
                return dec.decode(frame)
        return self.union.decode(frame)


def _bad_frames() -> list[tuple[str, bytes]]:
    hb = msgpack.unpackb(HB)
    arm = msgpack.unpackb(ARM)
    hello = msgpack.unpackb(HELLO)
    armed = msgpack.unpackb(ARMED)
    bad: list[tuple[str, dict[str, Any]]] = [
        ("hb", {**hb, "step": -1}),
        ("hb", {**hb, "sps": float("nan")}),
        ("hb", {**hb, "step": True}),
        ("hb", {**hb, "ledger": {**LEDGER, "n": "3"}}),
        ("hb", {**hb, "ledger": {**LEDGER, "q": [0.1] * 3}}),
        ("hb", {**hb, "ledger": {**LEDGER, "r": [["", 0.1, 1]]}}),
        ("hb", {**hb, "v": 9}),
        ("arm", {**arm, "backend": "perf"}),
        ("arm", {**arm, "job": "../etc"}),
        ("arm", {**arm, "cycles": [[1, 2, 3], [2, 3, 4]]}),
        ("arm", {**arm, "options": {"record_shapes": 1}}),
        ("arm", {**arm, "options": {"recordshapes": True}}),
        ("hello", {**hello, "rank": -1}),
        ("hello", {**hello, "pid": 0}),
        ("hello", {**hello, "job": "../etc"}),
        ("hello", {**hello, "host": ""}),
        ("hello", {**hello, "allowed": 1}),
        ("hello", {**hello, "identity_source": {"rank": 5}}),
        ("armed", {**armed, "cycles": [[3, 2, 1]]}),
        ("armed", {**armed, "plan": 1001}),
        ("armed", {**armed, "session": ""}),
    ]
    return [(t, msgpack.packb(m)) for t, m in bad]


def _refuses(f: Callable[[bytes], object], frame: bytes) -> bool:
    try:
        f(frame)
    except (P.ProtocolError, msgspec.ValidationError):
        return True
    return False


def _per_message(f: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e6


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(xs, n=10)
    return statistics.median(xs), qs[0], qs[-1]


def compare(
    name: str, old: Callable[[], object], new: Callable[[], object], rounds: int
) -> dict[str, Any]:
    n = 2000
    for f in (old, new):  # warm
        _per_message(f, n)
    olds: list[float] = []
    news: list[float] = []
    for i in range(rounds):
        # Alternate which goes first, so neither always follows the other's cache state.
        if i % 2:
            b = _per_message(new, n)
            a = _per_message(old, n)
        else:
            a = _per_message(old, n)
            b = _per_message(new, n)
        olds.append(a)
        news.append(b)
    ratios = [b / a for a, b in zip(olds, news, strict=True)]
    (om, o10, o90), (nm, n10, n90), (rm, r10, r90) = map(_quantiles, (olds, news, ratios))
    return {
        "message": name,
        "old_us": {"median": om, "p10": o10, "p90": o90, "min": min(olds)},
        "new_us": {"median": nm, "p10": n10, "p90": n90, "min": min(news)},
        "ratio": {"median": rm, "p10": r10, "p90": r90},
        "rounds": rounds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds = 10 if args.quick else args.rounds

    def daemon(frame: bytes) -> object:
        return P.decode(frame, P.AGENT_INBOUND)

    def client(frame: bytes) -> object:
        return P.decode(frame, P.CLIENT_INBOUND)

    for new, frame in ((daemon, HB), (client, ARM), (daemon, HELLO), (daemon, ARMED)):
        assert not _refuses(old_decode, frame) and not _refuses(new, frame)
    for t, frame in _bad_frames():
        new = client if t == "arm" else daemon
        assert _refuses(old_decode, frame) and _refuses(new, frame), (t, msgpack.unpackb(frame))
    per_type = PerType(P.AGENT_INBOUND)
    frames = (HB, HELLO, ARMED)
    for frame in frames:
        assert per_type.decode(frame) == daemon(frame)

    rows = [
        compare("hb with ledger (daemon)", lambda: old_decode(HB), lambda: daemon(HB), rounds),
        compare("arm (client)", lambda: old_decode(ARM), lambda: client(ARM), rounds),
        compare("hello (daemon)", lambda: old_decode(HELLO), lambda: daemon(HELLO), rounds),
        compare("armed (daemon)", lambda: old_decode(ARMED), lambda: daemon(ARMED), rounds),
        compare(
            "per-type vs union, hb+hello+armed",
            lambda: [per_type.decode(f) for f in frames],
            lambda: [daemon(f) for f in frames],
            rounds,
        ),
    ]

    def spread(x: dict[str, float], fmt: str) -> str:
        return f"{x['median']:{fmt}} (p10..p90 {x['p10']:{fmt}}..{x['p90']:{fmt}})"

    for r in rows:
        print(
            f"{r['message']:34} old {spread(r['old_us'], '.2f')} µs,"
            f" new {spread(r['new_us'], '.2f')} µs, new/old {spread(r['ratio'], '.3f')}"
        )


if __name__ == "__main__":
    main()
