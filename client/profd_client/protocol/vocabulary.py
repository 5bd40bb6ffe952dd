"""The vocabulary both sides share: message type names, option and state names, and the
field types messages are built from."""

from __future__ import annotations

from typing import Final, Literal, get_args

from .envelope import ERROR as ERROR  # both directions, both sockets
from .envelope import MAX_ERROR_TEXT
from .schema import (
    MAX_HOST,
    MAX_ID,
    MAX_NAME,
    MAX_PATH,
    MAX_PID,
    MAX_RANK,
    MAX_REVISION,
    MAX_SECONDS,
    MAX_STEP,
    MAX_TEXT,
    Bool,
    Field,
    Int,
    ListOf,
    Num,
    Str,
    Struct,
)

# --- message types ------------------------------------------------------------------------------
# Client -> daemon, on agent.sock.
HELLO: Final = "hello"
HEARTBEAT: Final = "hb"
ARMED: Final = "armed"
PROGRESS: Final = "progress"
CAPTURED: Final = "captured"
BYE: Final = "bye"
STACKS_RESULT: Final = "stacks_result"  # the answer to ``stacks``: this process's threads
BLACKBOX_RESULT: Final = "blackbox_result"  # the answer to ``blackbox``: its black box
# Daemon -> client, on agent.sock.
WELCOME: Final = "welcome"
ARM: Final = "arm"
DISARM: Final = "disarm"
ACK: Final = "ack"
#: Daemon -> client: send every thread's stack (when the daemon may not trace the process);
#: not named ``stacks``, which is the control request.
STACKS_REQUEST: Final = "dump_stacks"
#: Daemon -> client: send your black box (only to a client whose hello said ``blackbox``).
BLACKBOX_REQUEST: Final = "blackbox"

# --- names -------------------------------------------------------------------------------------
ACTIVITIES: Final = frozenset({"cpu", "cuda"})
BOOL_OPTIONS: Final = frozenset(
    {
        "record_shapes",
        "profile_memory",
        "with_stack",
        "with_flops",
        "with_modules",
        "memory_snapshot",
    }
)
BACKENDS: Final = frozenset({"torch", "nsys"})
DEFAULT_BACKEND: Final = "torch"
#: Set by ``profctl run --nsys`` for the launched job: the nsys session to drive.
NSYS_SESSION_ENV: Final = "PROFD_NSYS_SESSION"

#: What a client reports in ``progress``; the terminal ones end its part of a session.
ReportState = Literal["capturing", "done", "failed", "stopped", "cancelled", "missed", "late"]
REPORT_STATES: Final = frozenset(get_args(ReportState))
REPORT_TERMINAL: Final = frozenset({"done", "failed", "stopped", "cancelled"})

# Reusable field types.
STEP: Final = Int(0, MAX_STEP)
RANK: Final = Int(0, MAX_RANK)
PID: Final = Int(1, MAX_PID)
#: A native thread id (Linux: at most pid_max, like a pid).
TID: Final = Int(0, MAX_PID)
MSG_ID: Final = Int(0, MAX_ID)
REVISION: Final = Int(0, MAX_REVISION)
NAME: Final = Str(MAX_NAME, name=True)
#: One bound for session ids wherever they appear: the name rule's (docs/protocol.md).
SESSION_ID: Final = Str(MAX_NAME, min_len=1, name=True)
HOST: Final = Str(MAX_HOST, min_len=1)
PATH: Final = Str(MAX_PATH, min_len=1)
TEXT: Final = Str(MAX_TEXT)
SHORT: Final = Str(64)
SECONDS: Final = Num(0.0, MAX_SECONDS)

OPTIONS: Final = Struct(
    {
        "activities": (ListOf(Str(8, choices=ACTIVITIES), len(ACTIVITIES), 1), False),
        **{k: (Bool(), False) for k in sorted(BOOL_OPTIONS)},
    }
)


#: Where each identity field of a ``hello`` came from (``env:RANK``, ``torch.distributed``,
#: ``ray``, ...); open, so a newer client may name more fields.
IDENTITY_FIELDS: Final = ("job", "role", "rank", "local_rank", "world_size")
IDENTITY_SOURCE: Final = Struct({k: (Str(64), False) for k in IDENTITY_FIELDS}, open=True)


# --- shapes the control replies share with the agent messages ---------------------------------
def _open(**fields: tuple[Field, bool]) -> Struct:
    # Open like every top-level message: a newer peer may add fields an older one ignores.
    return Struct(fields, open=True)


_R, _O = True, False  # required, optional

# The stack schemas ``stacks_result`` is made of, shared with the control replies that carry
# them on (``profd.control_schema``, which profctl loads without the typed agent messages):
# one hand-written definition, which ``StacksResult`` checks its nested maps with. A process
# sends its own stacks innermost frames first, so what is cut is the outermost (an agent
# frame is at most ``MAX_FRAME_BYTES``).
AGENT_MAX_FRAMES: Final = 128
AGENT_MAX_THREADS: Final = 64
STACK_FRAME: Final = _open(
    function=(Str(MAX_TEXT), _R),
    file=(Str(MAX_PATH), _R),
    line=(Int(0, 1 << 31), _R),
    native=(Bool(), _O),  # a C/C++ frame (py-spy --native): not part of a group's key
)
#: A flight recorder's summary (``profd_client.flight``): what a rank's last collectives were.
FLIGHT_MAX_PGS: Final = 64
FLIGHT_MAX_ENTRIES: Final = 256
FLIGHT_SEQ: Final = Int(-1, MAX_STEP)  # -1: none yet
FLIGHT_PG: Final = _open(
    pg=(Str(MAX_NAME), _R),
    desc=(Str(MAX_NAME), _R),
    enqueued=(FLIGHT_SEQ, _R),
    started=(FLIGHT_SEQ, _R),
    completed=(FLIGHT_SEQ, _R),
)
FLIGHT_ENTRY: Final = _open(
    pg=(Str(MAX_NAME), _R),
    seq=(FLIGHT_SEQ, _R),
    p2p=(Bool(), _R),
    op=(Str(MAX_NAME), _R),
    state=(Str(16), _R),
    sizes=(ListOf(ListOf(FLIGHT_SEQ, 8), 4), _R),
)
FLIGHT: Final = _open(
    version=(Str(32), _R),
    pgs=(ListOf(FLIGHT_PG, FLIGHT_MAX_PGS), _R),
    entries=(ListOf(FLIGHT_ENTRY, FLIGHT_MAX_ENTRIES), _R),
)
#: A process's own threads (``stacks_result``), bounded to fit one agent frame.
AGENT_STACK_THREAD: Final = _open(
    name=(Str(MAX_NAME), _R),
    tid=(TID, _R),
    frames=(ListOf(STACK_FRAME, AGENT_MAX_FRAMES), _R),
)

#: ``error`` on control.sock (``profd.control_schema``); on agent.sock it is :class:`Error`.
ERROR_SCHEMA: Final = _open(code=(SHORT, _R), msg=(Str(MAX_ERROR_TEXT), _R))
