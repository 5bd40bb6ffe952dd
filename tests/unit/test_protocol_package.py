"""The protocol package's seams: what a training job loads, the error codes as documented,
and version adaptation (an older peer's shape of a message, made from the current one)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from profd import control_schema as C
from profd_client import protocol as P

ROOT = Path(__file__).resolve().parents[2]

# What a training job imports: the package, then what attach() loads.
_PROBE = """
import json, sys
import profd_client, profd_client.api, profd_client.agent
from profd_client import protocol
top = {m.split(".")[0] for m in sys.modules}
print(json.dumps({
    "profd": sorted(m for m in sys.modules if m == "profd" or m.startswith("profd.")),
    "third_party": sorted(t for t in top - set(sys.stdlib_module_names) if not t.startswith("_")),
    "control_names": [n for n in ("STATUS_DOC", "SESSION_ROW", "REPLIES", "C_STATUS", "START_SPEC")
                      if hasattr(protocol, n)],
}))
"""


def test_a_training_job_loads_no_control_schemas() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, cwd=ROOT
    )
    seen = json.loads(out.stdout)
    assert seen["profd"] == [], seen  # profd.control_schema above all
    assert seen["control_names"] == [], seen
    # The client's own dependencies only (torch is imported lazily, zmq when it connects).
    assert set(seen["third_party"]) <= {
        "profd_client",
        "msgpack",
        "msgspec",
        "typing_extensions",
        "zmq",
        "torch",
        "cython_runtime",
    }


# What `profctl ps` and `profctl top` load before they connect: the commands, the control
# schemas and the envelope, and none of what only the daemon or a training job needs.
_CTL_PROBE = """
import json, sys
import profd.ctl.main
from profd.ctl.commands import ps, top
print(json.dumps(sorted(sys.modules)))
"""

#: Modules `profctl ps` must not load: a third of its start-up when it did.
_NOT_FOR_PS = (
    "msgspec",  # the typed agent messages' decoder
    "profd_client.protocol.agent",
    "profd_client.protocol.typed",
    "profd_client.protocol.adapter",
    "profd.config",  # read only when no runtime dir is given
    "profd.ctl.cluster",  # --cluster only
    "profd.ctl.commands.start",
    "zmq",  # imported when the request is sent
)


def test_profctl_ps_and_top_load_only_what_they_use() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CTL_PROBE], capture_output=True, text=True, check=True, cwd=ROOT
    )
    loaded = set(json.loads(out.stdout))
    assert "profd.control_schema" in loaded  # the probe did import the commands
    assert not {m for m in loaded if m.split(".")[0] in _NOT_FOR_PS or m in _NOT_FOR_PS}, loaded


_CTL_RUN = """
import json, sys
from profd.ctl.main import cli
try:
    cli.main(["--json", "ps"], prog_name="profctl", standalone_mode=False)
except BaseException as exc:  # no daemon there: what matters is where it looked
    print(json.dumps([type(exc).__name__, str(exc), sorted(sys.modules)]))
"""


def test_profctl_ps_reads_the_runtime_dir_from_the_config_file_without_the_settings(
    tmp_path: Path,
) -> None:
    rdir = tmp_path / "from-the-file"
    conf = tmp_path / "profd.toml"
    conf.write_text(f'[daemon]\nruntime_dir = "{rdir}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROFD_")}
    env["PROFD_CONFIG"] = str(conf)
    out = subprocess.run(
        [sys.executable, "-c", _CTL_RUN], capture_output=True, text=True, cwd=ROOT, env=env
    )
    kind, message, loaded = json.loads(out.stdout.splitlines()[-1])
    assert kind == "SystemExit" and str(rdir) in out.stderr, (kind, message, out.stderr)
    assert "profd.config_file" in loaded and "profd.config" not in loaded


def test_the_protocol_package_names_every_submodules_names() -> None:
    from profd_client.protocol import agent, envelope, schema, typed, vocabulary

    # As the star imports bound them, in their order: a later module's name wins.
    expected: dict[str, object] = {}
    for module in (agent, envelope, schema, vocabulary):
        expected.update((k, v) for k, v in vars(module).items() if not k.startswith("_"))
    assert expected
    for name, value in expected.items():
        assert getattr(P, name) is value, name
    assert P.Message is typed.Message and P.cycles is schema.cycles and P.Peer is P.adapter.Peer


def _documented_codes() -> list[str]:
    text = (ROOT / "docs" / "protocol.md").read_text()
    section = text.split("## Error codes", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)


def test_the_error_code_table_is_the_enum() -> None:
    documented = _documented_codes()
    assert len(documented) == len(set(documented)), "a code listed twice"
    assert documented == [c.value for c in P.ErrorCode]


def test_an_error_code_is_its_string_on_the_wire() -> None:
    frame = P.error(P.ErrorCode.UNKNOWN_CLIENT, "say hello first", v=2)
    msg = P.decode(frame, P.CLIENT_INBOUND)
    assert msg == P.Error(v=2, code="unknown_client", msg="say hello first")
    assert type(msg.code) is str and msg.code == P.ErrorCode.UNKNOWN_CLIENT


def test_a_bad_field_is_named_in_one_line() -> None:
    ledger = {"at": 1, "n": "3", "sum": 0.1, "q": [0.1] * 4, "b": [0] * 19}
    bad = msgpack.packb({"v": P.VERSION, "t": "hb", "step": 1, "ledger": ledger})
    with pytest.raises(P.ProtocolError) as exc:
        P.decode(bad, P.AGENT_INBOUND)
    assert str(exc.value) == "hb.ledger.n: Expected `int`, got `str`"
    assert exc.value.code == P.ErrorCode.BAD_REQUEST


def _ledger() -> dict[str, object]:
    return {"at": 9, "n": 2, "sum": 0.2, "q": [0.1, 0.1, 0.1, 0.1], "b": [0] * 19}


def test_a_heartbeat_loses_its_ledger_below_version_3() -> None:
    for v in P.SUPPORTED_VERSIONS:
        msg = P.decode(P.encode(P.HEARTBEAT, v=v, step=9, ledger=_ledger()), P.AGENT_INBOUND)
        assert ("ledger" in msg) == (v >= 3), (v, msg)
        assert msg["v"] == v and msg["step"] == 9


def test_a_welcome_names_the_daemons_versions_from_version_2() -> None:
    fields = {"spool": "/s", "hb_interval": 1.0, "daemon": "x", "protocol": [1, P.VERSION]}
    for v in P.SUPPORTED_VERSIONS:
        msg = P.decode(P.encode(P.WELCOME, v=v, **fields), P.CLIENT_INBOUND)
        assert ("protocol" in msg) == (v >= 2), (v, msg)


def test_a_version_1_arm_names_the_process_own_dir_and_is_read_back_so() -> None:
    peer = P.Peer("node-a", 4242)
    fields = {
        "session": "s-1",
        "job": "j",
        "backend": "torch",
        "cycles": [[1, 2, 3]],
        "options": {},
        "incoming": "/spool/incoming/j/s-1",
    }
    own = f"/spool/incoming/j/s-1/{P.target_dir(peer.host, peer.pid)}"
    for v in P.SUPPORTED_VERSIONS:
        assert P.adapter.per_peer(P.ARM, v) == (v < 2)
        msg = P.decode(P.encode(P.ARM, v=v, peer=peer, **fields), P.CLIENT_INBOUND)
        assert msg["incoming"] == (own if v < 2 else fields["incoming"])
        # Either way the process writes into the same directory.
        assert P.adapter.home(msg["incoming"], msg["v"], peer) == own
    with pytest.raises(ValueError, match="peer"):
        P.encode(P.ARM, v=1, **fields)


def test_control_messages_are_framed_by_the_same_envelope() -> None:
    frame = C.encode(C.C_STATUS)
    assert P.decode(frame, C.CONTROL_INBOUND)["t"] == "status"
    with pytest.raises(P.ProtocolError) as exc:
        P.decode(frame, P.AGENT_INBOUND)
    assert exc.value.code == P.ErrorCode.TYPE


def test_typed_messages_are_read_by_attribute_however_the_frame_is_laid_out() -> None:
    ours = P.encode(P.HEARTBEAT, step=7, ledger=_ledger())
    theirs = msgpack.packb({"ledger": _ledger(), "step": 7, "t": "hb", "v": 3, "new": [1]})
    for frame in (ours, theirs):
        m = P.decode(frame, P.AGENT_INBOUND)
        assert isinstance(m, P.Heartbeat) and m.t == m["t"] == "hb" and m.v == 3
        assert m.step == 7 and m.ledger.at == 9 and m.sps is P.UNSET and "sps" not in m
    # What an older peer leaves out reads as that version meant it.
    armed = P.decode(P.encode(P.ARMED, v=1, session="s", cycles=[[1, 2, 3]]), P.AGENT_INBOUND)
    assert armed == P.Armed(v=1, session="s", cycles=[[1, 2, 3]], plan=0)


def test_every_agent_message_is_typed_and_read_by_one_decoder() -> None:
    for inbound in (P.AGENT_INBOUND, P.CLIENT_INBOUND):
        assert all(isinstance(s, P.Typed) for s in inbound.values())
    # Both ends' types are the definitions senders encode with: one per type.
    assert (
        {*P.AGENT_INBOUND, *P.CLIENT_INBOUND}
        == set(P.SCHEMAS)
        == {t.__struct_config__.tag for t in P.TYPES}
    )


@pytest.mark.parametrize(
    ("t", "fields", "why"),
    [
        (P.HELLO, {"rank": -1}, "hello.rank: Expected `int` >= 0"),
        (P.HELLO, {"job": "../x"}, "hello.job: Expected `str` matching regex"),
        (P.HELLO, {"identity_source": {"rank": 5}}, "hello.identity_source.rank: must be a string"),
        (P.ARMED, {"cycles": [[3, 2, 1]]}, "armed.cycles[0]: is not 1 <= warmup_start"),
        (P.PROGRESS, {"state": "gone"}, "progress.state: Invalid enum value 'gone'"),
        (P.CAPTURED, {"files": [{"kind": "", "path": "/x"}]}, "captured.files[0].kind:"),
        (P.STACKS_RESULT, {"threads": [{"name": "m", "tid": 1, "frames": [{}]}]},
         "stacks_result.threads[0].frames[0]: missing field 'function'"),
        (P.STACKS_RESULT, {"flight": {"version": "2.10"}}, "stacks_result.flight: missing field"),
        (P.STACKS_RESULT, {"flight_error": 5}, "stacks_result.flight_error: Expected `str`"),
    ],
)  # fmt: skip
def test_a_bad_field_of_any_agent_message_is_named_in_one_line(
    t: str, fields: dict[str, object], why: str
) -> None:
    good: dict[str, dict[str, object]] = {
        P.HELLO: {"pid": 5, "host": "h", "job": "j", "role": "r", "rank": 0, "local_rank": 0,
                  "world_size": 1, "step": 0, "step_mode": "optimizer", "allowed": True,
                  "client_version": "0.1.0"},
        P.ARMED: {"session": "s", "cycles": [[1, 2, 3]]},
        P.PROGRESS: {"id": 1, "session": "s", "state": "done", "step": 3},
        P.CAPTURED: {"id": 1, "session": "s", "job": "j", "cycle": 0, "steps": [2], "files": [],
                     "started_at": 1.0, "ended_at": 2.0, "stall_ms": 0.5},
        P.STACKS_RESULT: {"id": 1, "threads": []},
    }  # fmt: skip
    assert P.decode(P.encode(t, **good[t]), P.AGENT_INBOUND).t == t
    frame = msgpack.packb({"v": 3, "t": t, **good[t], **fields, "newer": {"x": 1}})
    with pytest.raises(P.ProtocolError) as exc:
        P.decode(frame, P.AGENT_INBOUND)
    assert str(exc.value).startswith(why) and "\n" not in str(exc.value)
    assert exc.value.code == P.ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"options": {"x": True}}, "arm.options: Object contains unknown field `x`"),
        ({"cycles": [[1, 2, 3], [2, 3, 4]]}, "arm.cycles[1]: overlaps the cycle before it"),
        ({"backend": "perf"}, "arm.backend: Invalid enum value 'perf'"),
        ({"plan": 1001}, "arm.plan: Expected `int` <= 1000"),
    ],
)
def test_a_bad_typed_field_is_named_in_one_line(fields: dict[str, object], why: str) -> None:
    arm = {
        "v": 3,
        "t": "arm",
        "session": "s",
        "job": "j",
        "backend": "torch",
        "cycles": [[1, 2, 3]],
        "options": {},
        "incoming": "/x",
    }
    with pytest.raises(P.ProtocolError) as exc:
        P.decode(msgpack.packb({**arm, **fields}), P.CLIENT_INBOUND)
    assert str(exc.value) == why and exc.value.code == P.ErrorCode.BAD_REQUEST
    assert exc.value.reply_v == 3


@pytest.mark.parametrize("field", ["newer", "threads"])
def test_a_frame_nested_too_deep_is_malformed_wherever_it_nests(field: str) -> None:
    head = msgpack.packb({"v": 3, "t": P.STACKS_RESULT, "id": 1})
    deep = b"\x91" * 200_000 + b"\xc0"  # [[[...]]], in a field read or one ignored
    frame = b"\x84" + head[1:] + msgpack.packb(field) + deep
    with pytest.raises(P.ProtocolError) as exc:
        P.decode(frame, P.AGENT_INBOUND)
    assert exc.value.code == P.ErrorCode.MALFORMED
