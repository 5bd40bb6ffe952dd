"""The protocol contract: every schema, both directions, as pure functions (no sockets)."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from profd_client import protocol as P

# Any value msgpack can carry, nested: what a hostile peer can put in a field.
leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=300),
    st.binary(max_size=50),
)
anything = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)
ALL_TYPES = sorted(P.SCHEMAS)


def _fields(t: str) -> list[str]:
    return list(P.SCHEMAS[t].fields)


@st.composite
def hostile_message(draw: st.DrawFn) -> dict[str, Any]:
    """A message of a real type, each declared field present or not, holding anything."""
    t = draw(st.sampled_from(ALL_TYPES))
    msg: dict[str, Any] = {"v": P.VERSION, "t": t}
    for name in _fields(t):
        if draw(st.booleans()):
            msg[name] = draw(anything)
    return msg


@settings(max_examples=1000, deadline=None)
@given(hostile_message())
def test_random_field_values_raise_only_protocol_errors(msg: dict[str, Any]) -> None:
    frame = msgpack.packb(msg, use_bin_type=True)
    accept = frozenset(P.SCHEMAS)
    try:
        out = P.decode(frame, accept)
    except P.ProtocolError as exc:
        assert exc.code in ("bad_request", "malformed", "type", "version"), exc.code
        return
    # Whatever passed is inside the declared bounds (a reply's payload is the request's
    # business) and re-encodes (outbound validation).
    if out["t"] != P.OK:
        _assert_bounded(out)
    P.encode(**{k: v for k, v in out.items() if k != "v"}, v=out["v"])


def _assert_bounded(value: Any) -> None:
    if isinstance(value, float):
        assert math.isfinite(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        assert -(1 << 63) <= value < (1 << 63)
    elif isinstance(value, list):
        for x in value:
            _assert_bounded(x)
    elif isinstance(value, dict):
        for x in value.values():
            _assert_bounded(x)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_protocol_errors(frame: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode(frame, P.AGENT_INBOUND)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(P.START_KEYS)), anything, max_size=8))
def test_start_specs_validate_or_name_the_field(spec: dict[str, Any]) -> None:
    try:
        P.start_spec(spec)
    except P.ProtocolError as exc:
        assert str(exc).startswith("spec"), str(exc)


HELLO = {
    "pid": 123,
    "host": "node1",
    "job": "j",
    "role": "trainer",
    "rank": 0,
    "local_rank": 0,
    "world_size": 2,
    "step": 0,
    "step_mode": "optimizer",
    "allowed": True,
    "client_version": "0.1.0",
}


def _hello(**over: Any) -> bytes:
    return msgpack.packb({"v": P.VERSION, "t": P.HELLO, **HELLO, **over})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rank", 1 << 63),  # once an OverflowError while indexing, inside a reactor callback
        ("rank", -1),
        ("pid", -1),  # once broke every sampling round
        ("pid", 0),
        ("world_size", 0),
        ("step", (1 << 64) - 1),
        ("job", "../etc"),
        ("job", {"a": 1}),
        ("host", ""),
        ("allowed", 1),
    ],
)
def test_hello_fields_out_of_bounds_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(P.ProtocolError) as exc:
        P.decode(_hello(**{field: value}), P.AGENT_INBOUND)
    assert exc.value.code == "bad_request"
    assert field in str(exc.value)


@pytest.mark.parametrize("sps", [math.inf, -math.inf, math.nan, -1.0, 1e300])
def test_heartbeat_rates_must_be_finite_and_sane(sps: float) -> None:
    frame = msgpack.packb({"v": P.VERSION, "t": P.HEARTBEAT, "sps": sps})
    with pytest.raises(P.ProtocolError, match=r"hb\.sps"):
        P.decode(frame, P.AGENT_INBOUND)


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        ({"label": {"a": 1}}, "spec.label"),
        ({"label": [1]}, "spec.label"),
        ({"region": 123}, "spec.region"),
        ({"region": ["x"]}, "spec.region"),
        ({"repeat": 2_000_000}, "spec.repeat"),
        ({"warmup": -1}, "spec.warmup"),
        ({"pids": [0]}, "spec.pids[0]"),
        ({"options": {"activities": ["gpu"]}}, "spec.options.activities[0]"),
        ({"options": {"record_shapes": "yes"}}, "spec.options.record_shapes"),
        ({"options": {"bogus": True}}, "spec.options"),
        ({"bogus": 1}, "spec: unknown field"),
        ({"backend": "perf"}, "spec.backend"),
    ],
)
def test_start_specs_name_the_bad_field(spec: dict[str, Any], where: str) -> None:
    with pytest.raises(P.ProtocolError) as exc:
        P.start_spec(spec)
    assert exc.value.code == "bad_request"
    assert where in str(exc.value)


def test_cycles_are_ordered_bounded_triples() -> None:
    assert P.cycles([[1, 2, 3], [3, 3, 5]]) == [(1, 2, 3), (3, 3, 5)]
    for bad in (
        [],
        [[2, 1, 3]],
        [[1, 3, 3]],
        [[0, 1, 2]],
        [[1, 2, 3], [2, 2, 4]],  # overlaps
        [[1, 1, 2 + P.MAX_CYCLE_STEPS]],
        [[1, 2, P.MAX_STEP + 1]],
        [[1, 2]],
        [[1, 2, 3]] * (P.MAX_CYCLES + 1),
    ):
        with pytest.raises(P.ProtocolError):
            P.cycles(bad)


def test_outbound_messages_are_validated() -> None:
    with pytest.raises(P.ProtocolError, match=r"arm\.region"):
        P.encode(
            P.ARM,
            session="s-1",
            job="j",
            backend="torch",
            cycles=[[1, 2, 3]],
            options={},
            region=123,
            incoming="/x",
        )
    with pytest.raises(P.ProtocolError, match="no message type"):
        P.encode("nonsense")


def test_versions_supported_and_refused() -> None:
    for v in P.SUPPORTED_VERSIONS:
        msg = P.decode(P.encode(P.HEARTBEAT, v=v, step=3), P.AGENT_INBOUND)
        assert msg["v"] == v
    for v in (P.MIN_VERSION - 1, P.VERSION + 1, "2", True, None):
        frame = msgpack.packb({"v": v, "t": P.HEARTBEAT})
        with pytest.raises(P.ProtocolError) as exc:
            P.decode(frame, P.AGENT_INBOUND)
        assert exc.value.code == "version"
        assert f"{P.MIN_VERSION}..{P.VERSION}" in str(exc.value)


def test_newer_peers_fields_are_ignored_but_start_specs_are_closed() -> None:
    frame = msgpack.packb({"v": P.VERSION, "t": P.HEARTBEAT, "step": 1, "future": [1]})
    assert P.decode(frame, P.AGENT_INBOUND)["step"] == 1


def test_envelopes() -> None:
    assert P.split_envelope([b"id", b"", b"payload"]) == ([b"id", b""], b"payload")
    assert P.split_envelope([b"id", b"payload"]) == ([b"id"], b"payload")
    for bad in ([], [b"id"], [b"id", b"x", b"y"], [b"a", b"", b"b", b"c"]):
        with pytest.raises(P.ProtocolError):
            P.split_envelope(bad)
    assert P.join_envelope([b"id", b""], b"r") == [b"id", b"", b"r"]


def test_reply_limits_are_larger_than_request_limits() -> None:
    big = P.encode(P.OK, data=["x"] * ((1 << 17) + 1))
    with pytest.raises(P.ProtocolError):
        P.decode(big, P.REPLY_INBOUND)
    assert len(P.decode(big, P.REPLY_INBOUND, reply=True)["data"]) == (1 << 17) + 1


def test_session_ids_have_one_bound_the_documented_one() -> None:
    # docs/protocol.md: session ids are path-safe names of 1-200. The code before declared 64
    # (SESSION_ID, the traces filter, a hello's held sessions) and accepted 200 where the
    # name rule ran: a coordinator's 200-character id was started, then refused in the
    # filter, and a client holding it could no longer say hello.
    ok, long = "s" * P.MAX_NAME, "s" * (P.MAX_NAME + 1)
    assert P.SESSION_ID.describe() == f"string of 1..{P.MAX_NAME}"
    hello = {"v": P.VERSION, "t": P.HELLO, **{k: v for k, v in HELLO.items()}}
    for sid, passes in ((ok, True), (long, False)):
        msgs = [
            {"v": P.VERSION, "t": P.C_SHOW, "session": sid},
            {"v": P.VERSION, "t": P.C_TRACES, "filters": {"session": sid}},
            {**hello, "sessions": [sid]},
            {"v": P.VERSION, "t": P.C_START, "spec": {"session": sid}},
        ]
        for m in msgs:
            if passes:
                P.validate(m, P.CONTROL_INBOUND | P.AGENT_INBOUND)
            else:
                with pytest.raises(P.ProtocolError, match=str(P.MAX_NAME)):
                    P.validate(m, P.CONTROL_INBOUND | P.AGENT_INBOUND)
    # A name field's own bound holds too, below the name rule's.
    with pytest.raises(P.ProtocolError, match=r"1\.\.8"):
        P.Str(8, min_len=1, name=True).check("s" * 9, "f")
