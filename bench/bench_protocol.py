"""Decode + validate cost of one agent message: the hand-written schemas against typed msgspec
definitions, paired.

Two messages the daemon and the client decode most: a heartbeat with a step ledger (every
rank, every second, on the daemon) and an ``arm`` (every armed rank, on the client). For
each, the current path (``profd_client.protocol.decode``: ``msgpack.unpackb``, then the
hand-written ``Struct`` checks) and a candidate (msgspec ``Struct`` definitions with the same
bounds, decoded and validated from msgpack in one pass) run in alternating short batches, so
both see the same machine load; each batch's time per message is kept, and the result is
the median of each side and of the per-pair ratio (new / old), with p10..p90.

Both sides must accept the frames measured and refuse the same bad ones (checked first), or
the comparison is void. ``--quick``: a few rounds. Prints one line per message.

    PYTHONPATH=.:client python bench/bench_protocol.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgpack
import msgspec
from msgspec import UNSET, Meta, UnsetType

from profd_client import protocol as P

# --- the candidate: typed definitions with the hand-written schemas' bounds ------------------
Step = Annotated[int, Meta(ge=0, le=P.MAX_STEP)]
Seconds = Annotated[float, Meta(ge=0.0, le=P.MAX_SECONDS)]
RegionName = Annotated[str, Meta(min_length=1, max_length=P.MAX_NAME)]
# The name rule (``schema._SAFE_NAME``), anchored: msgspec searches.
_NAME = r"^[A-Za-z0-9_+=@:-][A-Za-z0-9._+=@:-]*$"
Name = Annotated[str, Meta(pattern=_NAME, max_length=P.MAX_NAME)]
SessionId = Annotated[str, Meta(pattern=_NAME, min_length=1, max_length=P.MAX_NAME)]
Version = Annotated[int, Meta(ge=P.MIN_VERSION, le=P.VERSION)]
_BUCKETS = len(P.STEP_BUCKETS) + 1


class Ledger(msgspec.Struct):
    at: Step
    n: Step
    sum: Seconds
    q: Annotated[list[Seconds], Meta(min_length=4, max_length=4)]
    b: Annotated[list[Step], Meta(min_length=_BUCKETS, max_length=_BUCKETS)]
    r: Annotated[list[tuple[RegionName, Seconds, Step]], Meta(max_length=32)] | UnsetType = UNSET
    epoch: Annotated[int, Meta(ge=0, le=1 << 31)] | UnsetType = UNSET


class Heartbeat(msgspec.Struct, tag_field="t", tag="hb"):
    v: Version
    step: Step | UnsetType = UNSET
    sps: Annotated[float, Meta(ge=0.0, le=P.MAX_RATE)] | UnsetType = UNSET
    state: Annotated[str, Meta(max_length=64)] | UnsetType = UNSET
    ledger: Ledger | UnsetType = UNSET
    training_tid: Annotated[int, Meta(ge=0, le=P.MAX_PID)] | UnsetType | None = UNSET


class Options(msgspec.Struct, forbid_unknown_fields=True):
    activities: (
        Annotated[list[Literal["cpu", "cuda"]], Meta(min_length=1, max_length=2)] | UnsetType
    ) = UNSET
    record_shapes: bool | UnsetType = UNSET
    profile_memory: bool | UnsetType = UNSET
    with_stack: bool | UnsetType = UNSET
    with_flops: bool | UnsetType = UNSET
    with_modules: bool | UnsetType = UNSET
    memory_snapshot: bool | UnsetType = UNSET


_CYCLES = P.Cycles()
Cycle = Annotated[list[Step], Meta(min_length=3, max_length=3)]


class Arm(msgspec.Struct, tag_field="t", tag="arm"):
    v: Version
    session: SessionId
    job: Name
    backend: Literal["torch", "nsys"]
    cycles: Annotated[list[Cycle], Meta(min_length=1, max_length=P.MAX_CYCLES)]
    options: Options
    incoming: Annotated[str, Meta(min_length=1, max_length=P.MAX_PATH)]
    region: Annotated[str, Meta(min_length=1, max_length=P.MAX_NAME)] | UnsetType | None = UNSET
    plan: Annotated[int, Meta(ge=0, le=P.MAX_REVISION)] | UnsetType = UNSET

    def __post_init__(self) -> None:
        _CYCLES.check(self.cycles, "cycles")  # the cross-field rule: ordered, bounded spans


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


def _bad_frames() -> list[tuple[str, bytes]]:
    hb = msgpack.unpackb(HB)
    arm = msgpack.unpackb(ARM)
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

    hb_new = msgspec.msgpack.Decoder(Heartbeat).decode
    arm_new = msgspec.msgpack.Decoder(Arm).decode

    def hb_old(frame: bytes) -> object:
        return P.decode(frame, P.AGENT_INBOUND)

    def arm_old(frame: bytes) -> object:
        return P.decode(frame, P.CLIENT_INBOUND)

    checkers = {"hb": (hb_old, hb_new), "arm": (arm_old, arm_new)}
    for t, frame in (("hb", HB), ("arm", ARM)):
        old, new = checkers[t]
        assert not _refuses(old, frame) and not _refuses(new, frame), t
    for t, frame in _bad_frames():
        old, new = checkers[t]
        assert _refuses(old, frame) and _refuses(new, frame), (t, msgpack.unpackb(frame))

    rows = [
        compare("hb with ledger (daemon)", lambda: hb_old(HB), lambda: hb_new(HB), rounds),
        compare("arm (client)", lambda: arm_old(ARM), lambda: arm_new(ARM), rounds),
    ]

    def spread(x: dict[str, float], fmt: str) -> str:
        return f"{x['median']:{fmt}} (p10..p90 {x['p10']:{fmt}}..{x['p90']:{fmt}})"

    for r in rows:
        print(
            f"{r['message']:24} old {spread(r['old_us'], '.2f')} µs,"
            f" new {spread(r['new_us'], '.2f')} µs, new/old {spread(r['ratio'], '.3f')}"
        )


if __name__ == "__main__":
    main()
