"""The protocol contract: every schema, both directions, as pure functions (no sockets)."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from profd import control_schema as C
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
#: Every message type, agent and control, with its schema.
ALL_SCHEMAS = P.Inbound({**P.SCHEMAS, **C.SCHEMAS})
ALL_TYPES = sorted(ALL_SCHEMAS)


def _fields(t: str) -> list[str]:
    return list(ALL_SCHEMAS[t].fields)


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
    try:
        out = P.decode(frame, ALL_SCHEMAS)
    except P.ProtocolError as exc:
        assert exc.code in ("bad_request", "malformed", "type", "version"), exc.code
        return
    if isinstance(out, P.Message):  # a typed message: its fields as a map
        out = msgspec.to_builtins(out)
    # Whatever passed is inside the declared bounds (a reply's payload is the request's
    # business) and re-encodes (outbound validation).
    if out["t"] != C.OK:
        _assert_bounded(out)
    # A name both sockets use (``blackbox``: the control request, and the daemon's request to
    # a client) was decoded by the control schema, which ALL_SCHEMAS lists last.
    encode = C.encode if out["t"] in C.SCHEMAS else P.encode
    encode(**{k: v for k, v in out.items() if k != "v"}, v=out["v"])


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
@given(st.dictionaries(st.sampled_from(sorted(C.START_KEYS)), anything, max_size=8))
def test_start_specs_validate_or_name_the_field(spec: dict[str, Any]) -> None:
    try:
        C.start_spec(spec)
    except P.ProtocolError as exc:
        assert str(exc).startswith("spec"), str(exc)


@pytest.mark.parametrize(
    ("roles", "why"),
    [
        # The value is a list: what is wrong inside it, not that it is no string.
        (["ok", 5], "spec.roles[1]: must be a string, got int"),
        (["ok", ""], "spec.roles[1]: length 0 is not 1..200"),
        (["r"] * 65, "spec.roles: 65 items, not 0..64"),
        # Neither kind at all.
        (5, "spec.roles: must be string of 1..200 or list of string of 1..200, got int"),
    ],
)
def test_a_field_of_several_kinds_names_what_is_wrong_inside_the_kind_given(
    roles: object, why: str
) -> None:
    with pytest.raises(P.ProtocolError) as exc:
        C.start_spec({"job": "j", "roles": roles, "steps": "next:1"})
    assert str(exc.value) == why


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
        C.start_spec(spec)
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
    big = C.encode(C.OK, data=["x"] * ((1 << 17) + 1))
    with pytest.raises(P.ProtocolError):
        P.decode(big, C.REPLY_INBOUND)
    assert len(P.decode(big, C.REPLY_INBOUND, reply=True)["data"]) == (1 << 17) + 1


# --- the envelope: what every receiver does with a frame (both daemon sockets, the client) -----
def test_a_refused_frame_carries_its_answer_in_the_peers_version() -> None:
    # Not msgpack: nothing to read a version from, so the answer is in ours.
    with pytest.raises(P.ProtocolError) as exc:
        P.decode(b"\xc1", P.AGENT_INBOUND)
    assert exc.value.code == "malformed" and exc.value.raw is None
    assert exc.value.reply_v == P.VERSION
    # Another version: refused, answered in that version so the peer can read why.
    raw = {"v": 99, "t": P.HELLO, "pid": 5}
    with pytest.raises(P.ProtocolError) as exc:
        P.decode(msgpack.packb(raw), P.AGENT_INBOUND)
    assert exc.value.code == "version" and exc.value.raw == raw and exc.value.reply_v == 99
    answer = msgpack.unpackb(exc.value.reply())
    assert answer["v"] == 99 and answer["t"] == P.ERROR and answer["code"] == "version"
    assert f"{P.MIN_VERSION}..{P.VERSION}" in answer["msg"]
    # A version-1 peer's bad field is answered in version 1, naming the field.
    with pytest.raises(P.ProtocolError) as exc:
        P.decode(_hello(v=1, rank=-1), P.AGENT_INBOUND)
    answer = P.decode(exc.value.reply(), P.CLIENT_INBOUND)
    assert answer["v"] == 1 and answer["code"] == "bad_request" and "hello.rank" in answer["msg"]
    # A type this socket does not take.
    with pytest.raises(P.ProtocolError) as exc:
        P.decode(C.encode(C.C_STATUS), P.AGENT_INBOUND)
    assert exc.value.code == "type"


@pytest.mark.parametrize(
    ("v", "answer_in"),
    [(1, 1), (2, 2), (7, 7), (0, 0), (-1, P.VERSION), (1 << 16, P.VERSION), ("2", P.VERSION)],
)
def test_the_reply_version_is_the_peers_when_it_fits(v: object, answer_in: int) -> None:
    assert P.reply_version({"v": v}) == answer_in
    assert P.reply_version(None) == P.VERSION


# --- ok replies: the data of each control request has a schema -----------------------------------
def _client() -> Any:
    from profd.daemon.clients.registry import Client

    # ident, host, pid, job, role, rank, local_rank, world_size, step_mode, allowed, torch, device
    c = Client(b"x", "node1", 42, "j", "trainer", 3, 3, 8, "optimizer", True, "2.13", "cuda:0")
    c.uid, c.cpu, c.rss, c.identity_source = 1000, 150.5, 1 << 30, {"rank": "env:RANK"}
    return c


def _ps_row(**over: Any) -> Any:
    from msgspec.structs import replace

    return replace(_client().ps_row("n1", 7, True, 0.25, ()), **over)


@pytest.mark.parametrize("table", [True, False], ids=["table", "maps"])
def test_ps_rows_of_served_and_incompatible_peers_read_back_as_maps(table: bool) -> None:
    """Either form reads back as the same maps: the table (columns, an array a row, then the
    rows of another shape as maps) and the list of maps a profctl from before asks for."""
    from profd.control_rows import pack
    from profd.daemon.clients.registry import Incompatible

    odd = Incompatible(b"y", 99, {"pid": 1 << 40, "host": 5, "rank": -3}).ps_row("n1")
    frame = C.reply({"v": 1, "t": C.C_PS}, pack(C.C_PS, [_ps_row()], [odd], table=table))
    msg = P.decode(frame, C.REPLY_INBOUND, reply=True)
    assert msg["v"] == 1 and msg["t"] == C.OK
    assert isinstance(msg["data"], dict) == table
    served, listed = C.listing_rows(msg["data"])
    assert served["pid"] == 42 and served["step"] == 7 and served["step_extrapolated"] is True
    assert served["claimed_by"] == [42] and served["duplicate"] is False
    assert served["identity_source"] == {"rank": "env:RANK"} and served["node"] == "n1"
    assert served["cpu_percent"] == 150.5 and served["gpu_util"] is None  # None is sent
    # An incompatible peer's row has only what it claimed: the rest is left out, not None.
    assert listed == {
        "host": "?",
        "pid": 1 << 40,
        "job": "?",
        "role": "?",
        "rank": -3,
        "state": "incompatible",
        "protocol": 99,
        "client_version": None,
        "error": "speaks protocol version 99",
        "node": "n1",
    }


#: A field of a ``ps`` row beyond its definition, and the name a refusal gives it.
PS_FAULTS: list[tuple[dict[str, Any], str]] = [
    ({"pid": "42"}, "pid"),
    ({"rank": 1.5}, "rank"),
    ({"steps_per_s": math.nan}, "steps_per_s"),
    ({"steps_per_s": math.inf}, "steps_per_s"),
    ({"allowed": 1}, "allowed"),
    ({"node": ""}, "node"),
    ({"job": "j" * 201}, "job"),
    ({"claimed_by": (42, 0)}, "claimed_by[1]"),
    ({"age_s": math.nan}, "age_s"),
]


@pytest.mark.parametrize(("over", "field"), PS_FAULTS)
def test_a_ps_row_beyond_its_definition_does_not_leave(over: dict[str, Any], field: str) -> None:
    from profd.control_rows import pack

    rows = [_ps_row() for _ in range(6)]
    rows[5] = _ps_row(**over)
    for table in (True, False):  # checked the same way, and named as in the listing
        with pytest.raises(P.ProtocolError) as exc:
            pack(C.C_PS, rows, table=table)
        assert exc.value.code == "bad_request"
        assert str(exc.value).startswith(f"ps.data[5].{field}:"), str(exc.value)


def _parts(row: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    from msgspec.structs import astuple

    from profd.control_rows import PS_HELLO

    values = astuple(row)
    return values[: len(PS_HELLO)], values[len(PS_HELLO) :]


@pytest.mark.parametrize("table", [True, False], ids=["table", "maps"])
def test_ps_packed_from_its_two_parts_is_the_same_as_from_whole_rows(table: bool) -> None:
    """What the ``ps`` handler sends (each row's hello part made once, its live part now)
    is byte for byte what the whole rows pack to."""
    from profd.control_rows import pack, pack_ps
    from profd.daemon.clients.registry import Incompatible

    c = _client()
    rows = [
        c.ps_row("n1", 7 + i, i % 2 == 0, 0.25 * i, (42, 43) if i == 2 else ()) for i in range(4)
    ]
    odd = Incompatible(b"y", 99, {"pid": 1 << 40}).ps_row("n1")
    hellos = [c.ps_hello("n1")] * 4
    lives = [c.ps_live(7 + i, i % 2 == 0, 0.25 * i, (42, 43) if i == 2 else ()) for i in range(4)]
    assert [_parts(r) for r in rows] == list(zip(hellos, lives, strict=True))
    assert pack_ps(hellos, lives, [odd], table=table) == pack(C.C_PS, rows, [odd], table=table)
    assert rows[2].duplicate and rows[2].claimed_by == (42, 43) and rows[1].claimed_by == (42,)


@pytest.mark.parametrize(("over", "field"), PS_FAULTS)
def test_a_ps_part_beyond_its_definition_does_not_leave(over: dict[str, Any], field: str) -> None:
    """A live part is checked with the listing and named by its row; a hello part when it
    is made (once per client), and the listing names the row it would have been."""
    from msgspec.structs import astuple

    from profd.control_rows import PS_HELLO, PsHello, RowFault, hello_part, pack_ps

    bad_row = _ps_row(**over)
    hello, live = _parts(bad_row)
    if field.partition("[")[0] in PS_HELLO:
        with pytest.raises(RowFault) as fault:
            hello_part(PsHello(**dict(zip(PS_HELLO, hello, strict=True))))
        assert fault.value.field == field, fault.value
        return
    good_hello, good_live = _parts(_ps_row())
    lives = [good_live] * 5 + [live]
    for table in (True, False):
        with pytest.raises(P.ProtocolError) as exc:
            pack_ps([good_hello] * 6, lives, table=table)
        assert exc.value.code == "bad_request"
        assert str(exc.value).startswith(f"ps.data[5].{field}:"), str(exc.value)
    assert astuple(bad_row)  # (the row itself was made: only its packing refuses it)


def test_a_peers_row_beyond_its_definition_is_named_after_the_served_parts() -> None:
    from profd.control_rows import pack_ps
    from profd.daemon.clients.registry import Incompatible

    odd = msgspec.structs.replace(Incompatible(b"y", 99, {}).ps_row("n1"), node="")
    hello, live = _parts(_ps_row())
    with pytest.raises(P.ProtocolError) as exc:
        pack_ps([hello, hello], [live, live], [odd])
    assert str(exc.value).startswith("ps.data[2].node:"), str(exc.value)


def test_an_incompatible_peers_row_beyond_its_definition_is_named_after_the_served_rows() -> None:
    from profd.control_rows import pack
    from profd.daemon.clients.registry import Incompatible

    odd = msgspec.structs.replace(Incompatible(b"y", 99, {}).ps_row("n1"), node="")
    with pytest.raises(P.ProtocolError) as exc:
        pack(C.C_PS, [_ps_row(), _ps_row()], [odd])
    assert str(exc.value).startswith("ps.data[2].node:"), str(exc.value)


@pytest.mark.parametrize(
    "data",
    [
        {"columns": ["a", "b"], "rows": [[1]], "others": []},  # a row short of a column
        {"columns": ["a", 2], "rows": [], "others": []},
        {"columns": ["a"], "rows": [{"a": 1}], "others": []},
        {"columns": ["a"], "rows": [[1]], "others": [[1]]},
        {"rows": [[1]]},
        [{"a": 1}, 5],
        "rows",
    ],
)
def test_a_listing_that_is_neither_a_table_nor_maps_is_refused(data: Any) -> None:
    with pytest.raises(P.ProtocolError) as exc:
        C.listing_rows(data)
    assert exc.value.code == "bad_request"


def test_a_table_reads_as_the_maps_its_columns_name() -> None:
    data = {"columns": ["a", "b"], "rows": [[1, None], [2, [3]]], "others": [{"a": 9}]}
    assert C.listing_rows(data) == [{"a": 1, "b": None}, {"a": 2, "b": [3]}, {"a": 9}]
    assert C.listing_rows({"columns": ["a"], "rows": []}) == []  # ``others`` may be left out
    assert C.listing_rows([{"a": 1}]) == [{"a": 1}]


def _session_row(**over: Any) -> dict[str, Any]:
    row = {
        "id": "s1",
        "job": "j",
        "state": "done",
        "backend": "torch",
        "label": None,
        "region": None,
        "request": {"steps": "2:5"},
        "cycles": [[1, 2, 5]],
        "plan": 0,
        "owner": 1000,
        "error": None,
        "created_at": 1.7e9,
        "updated_at": 1.7e9,
        "node": "n1",
    }
    return {**row, **over}


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"id": ""}, "id"),
        ({"plan": 1.5}, "plan"),
        ({"created_at": math.nan}, "created_at"),
        ({"owner": "1000"}, "owner"),
        ({"node": ""}, "node"),
        ({"cycles": [[1, 2, "5"]]}, "cycles[0][2]"),
    ],
)
def test_a_reply_that_breaks_its_schema_does_not_leave(over: dict[str, Any], field: str) -> None:
    for n in (1, 40):  # one by one, and column by column
        rows = [_session_row() for _ in range(n)]
        rows[n - 1] = _session_row(**over)
        with pytest.raises(P.ProtocolError) as exc:
            C.reply({"v": P.VERSION, "t": C.C_SESSIONS}, rows)
        assert str(exc.value).startswith(f"sessions.data[{n - 1}].{field}:"), str(exc.value)
    row = _session_row()
    del row["job"]
    with pytest.raises(P.ProtocolError, match="missing field 'job'"):
        C.reply({"v": P.VERSION, "t": C.C_SESSIONS}, [row])


def test_replies_without_a_schema_are_any_map() -> None:
    assert set(C.REPLIES) == {
        C.C_STATUS,
        C.C_TRACES,
        C.C_SHOW,
        C.C_SESSIONS,
        C.C_HISTORY,
        C.C_INCIDENTS,
        C.C_INCIDENT,
        C.C_STACKS,
        C.C_BLACKBOX,
        C.C_WAREHOUSE,
    }
    frame = C.reply({"v": P.VERSION, "t": C.C_RETRY}, {"requeued": 3})
    assert P.decode(frame, C.REPLY_INBOUND)["data"] == {"requeued": 3}


def test_session_and_trace_documents_from_memory_and_from_the_index(tmp_path: Any) -> None:
    """What ``show``, ``sessions`` and ``traces`` answer with, built by the code that builds
    them (a live session's summary; the index's rows), passes the reply schemas."""
    from profd.daemon.sessions.state import Session, Target
    from profd.store.index import Database, SessionRepo, TraceFilter, TraceRepo

    s = Session("s1", "j", {"steps": "3:5"}, [(1, 3, 5)], "torch", {}, None, "lbl")
    for rank in range(20):
        t = Target("node1", 100 + rank, "j", "trainer", rank, 20)
        t.results.append({"cycle": 0, "state": "done"})
        s.targets[t.key] = t
    live = s.summary()
    for r in [live, *live["targets"]]:
        r["node"] = "n1"
    C.reply({"v": P.VERSION, "t": C.C_SHOW}, live)

    db = Database(tmp_path / "index.db")
    idx, trace_repo = SessionRepo(db), TraceRepo(db)
    try:
        idx.save_session(s.row())
        for t in s.targets.values():
            idx.save_target(t.stored(s.id))
        for rank in range(20):
            trace_repo.add_trace(
                {
                    "session": "s1",
                    "job": "j",
                    "host": "node1",
                    "pid": 100 + rank,
                    "role": "trainer",
                    "rank": rank,
                    "cycle": 0,
                    "region": None,
                    "steps": [3, 4],
                    "path": f"/spool/j/s1/c0/trainer-r{rank}.pt.trace.json.gz",
                    "bytes": 1000,
                    "state": "done",
                    "stall_ms": 1.5,
                    "step_ms_p50": 10.0,
                    "step_ms_max": None,
                    "torch": "2.13",
                    "device": None,
                    "created_at": 1000.0 + rank,
                    "stats": {"comm_ms": [1.0]},
                },
                [
                    {
                        "session": "s1",
                        "job": "j",
                        "kind": kind,
                        "path": f"/spool/j/s1/c0/trainer-r{rank}.{kind}",
                        "rel": f"j/s1/c0/trainer-r{rank}.{kind}",
                        "bytes": 10,
                        "upload_state": "pending",
                    }
                    for kind in ("trace", "summary")
                ],
            )
        stored = idx.session("s1")
        assert stored is not None
        stored["steps"] = [3, 4]
        sessions = idx.sessions()
        traces = trace_repo.traces(TraceFilter())
    finally:
        db.close()
    for r in [stored, *stored["targets"], *sessions, *traces]:
        r["node"] = "n1"
    C.reply({"v": P.VERSION, "t": C.C_SHOW}, stored)
    C.reply({"v": P.VERSION, "t": C.C_SESSIONS}, sessions)
    C.reply({"v": P.VERSION, "t": C.C_TRACES}, traces)
    traces[7]["files"][1]["deleted"] = 2
    with pytest.raises(P.ProtocolError, match=r"traces\.data\[7\]\.files\[1\]\.deleted"):
        C.reply({"v": P.VERSION, "t": C.C_TRACES}, traces)


# The column check must accept exactly what the value-by-value check accepts.
COLUMN_FIELDS = [
    P.Int(0, 10),
    P.Num(0.0, 10.0),
    C.FINITE,
    P.Str(3),
    P.Str(3, min_len=1),
    P.Str(8, choices=frozenset({"a", "bb"})),
    P.NAME,
    P.Bool(),
    P.Nullable(P.Int(0, 10)),
    P.ListOf(P.Int(0, 10), 3, 1),
    P.Struct({"a": (P.Int(0, 10), True), "b": (P.Str(3), False)}),
    P.Struct({"a": (P.Int(0, 10), True)}, open=True),
    C.FILE_ROW,
]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(range(len(COLUMN_FIELDS))), st.lists(anything, min_size=1, max_size=40))
def test_column_checks_accept_exactly_what_value_checks_accept(i: int, values: list[Any]) -> None:
    f = COLUMN_FIELDS[i]
    one_by_one = not any(_refused(f, v) for v in values)
    if f.all_valid(values):
        assert one_by_one  # "all valid" is never wrong
    # and the list check, whichever path it takes, agrees with the values'
    assert _refused(P.ListOf(f, 100), values) != one_by_one


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(sorted(C.SESSION_ROW.fields)), max_size=3), anything)
def test_session_rows_with_any_value_in_any_field(fields: list[str], value: Any) -> None:
    rows = [_session_row() for _ in range(20)]
    for name in fields:
        rows[5][name] = value
    ok = not _refused(C.SESSION_ROW, rows[5])
    assert ok == (not _refused(C.REPLIES[C.C_SESSIONS], rows))
    assert C.SESSION_ROW.all_valid(rows) in (ok, False)


def _refused(f: P.Field, value: Any) -> bool:
    try:
        f.check(value, "x")
    except P.ProtocolError:
        return True
    return False


def test_every_accepted_type_has_its_handler() -> None:
    from profd.daemon.agent import handler as agent
    from profd.daemon.control import handler as control

    assert set(control.HANDLERS) == set(C.CONTROL_INBOUND)
    # ``hello`` comes from a process not registered yet, and is handled before the table.
    assert set(agent.HANDLERS) == set(P.AGENT_INBOUND) - {P.HELLO}


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
            {"v": P.VERSION, "t": C.C_SHOW, "session": sid},
            {"v": P.VERSION, "t": C.C_TRACES, "filters": {"session": sid}},
            {**hello, "sessions": [sid]},
            {"v": P.VERSION, "t": C.C_START, "spec": {"session": sid}},
        ]
        for m in msgs:
            if passes:
                P.validate(m, {**C.CONTROL_INBOUND, **P.AGENT_INBOUND})
            else:
                with pytest.raises(P.ProtocolError, match=str(P.MAX_NAME)):
                    P.validate(m, {**C.CONTROL_INBOUND, **P.AGENT_INBOUND})
    # A name field's own bound holds too, below the name rule's.
    with pytest.raises(P.ProtocolError, match=r"1\.\.8"):
        P.Str(8, min_len=1, name=True).check("s" * 9, "f")


def _top_row(**over: Any) -> Any:
    from profd.control_rows import TopRow

    row = TopRow(
        host="node1",
        pid=42,
        job="j",
        role="trainer",
        rank=3,
        world_size=8,
        step=7,
        step_extrapolated=False,
        age_s=0.25,
        sps=4.0,
        step_ms_p50=250.0,
        step_ms_p99=300.0,
        window_s=60.0,
        source="ledger",
        regions={"forward": 0.5},
        wait_ms=None,
        cpu_percent=150.5,
        rss_bytes=1 << 30,
        gpu_util=None,
        gpu_mem_bytes=None,
        vs_role=1.0,
        marked=False,
        node="n1",
    )
    return msgspec.structs.replace(row, **over)


@pytest.mark.parametrize("table", [True, False], ids=["table", "maps"])
def test_top_rows_read_back_as_maps_with_every_field(table: bool) -> None:
    from profd.control_rows import pack

    rows = [_top_row(), _top_row(rank=4)]
    frame = C.reply({"v": 2, "t": C.C_TOP}, pack(C.C_TOP, rows, table=table))
    msg = P.decode(frame, C.REPLY_INBOUND, reply=True)
    data = C.listing_rows(msg["data"])
    assert msg["v"] == 2 and [r["rank"] for r in data] == [3, 4]
    first = data[0]
    assert first["regions"] == {"forward": 0.5} and first["wait_ms"] is None
    assert list(first) == list(msgspec.structs.asdict(_top_row()))  # None is sent, not left out


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"pid": 0}, "pid"),
        ({"sps": math.inf}, "sps"),
        ({"step_ms_p50": math.nan}, "step_ms_p50"),
        ({"regions": {"forward": math.inf}}, "regions[...]"),
        ({"node": ""}, "node"),
    ],
)
def test_a_top_row_beyond_its_definition_does_not_leave(over: dict[str, Any], field: str) -> None:
    from profd.control_rows import pack

    for table in (True, False):
        with pytest.raises(P.ProtocolError) as exc:
            pack(C.C_TOP, [_top_row(), _top_row(**over)], table=table)
        assert str(exc.value).startswith(f"top.data[1].{field}:"), str(exc.value)
