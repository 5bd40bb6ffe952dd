"""This process's flight recorder (torch.distributed's ring of its last collectives), for a
daemon diagnosing a hang: where ``TORCH_FR_BUFFER_SIZE`` (or ``TORCH_NCCL_TRACE_BUFFER_SIZE``)
is set, the agent thread dumps it on request through torch's documented entry point
(``torch._C._distributed_c10d._dump_fr_trace_json``; ``_dump_nccl_trace_json`` in older
releases) and sends a bounded summary: per process group the last collective enqueued,
started and completed, and its most recent entries. The daemon compares ranks (which one
never reached the collective the others wait in). Never raises into the agent thread: any
failure is one line of text.

The summary's shape (``protocol.FLIGHT``): ``{"version", "pgs": [{"pg", "desc",
"enqueued", "started", "completed"}], "entries": [{"pg", "seq", "p2p", "op", "state",
"sizes"}]}``, process groups by name (what ``pg_status`` is keyed by), entries oldest
first, ``seq`` the collective sequence number (the p2p one for point-to-point ops).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from typing import Any, Final

from . import protocol as P

#: The environment variables that turn torch's flight recorder on (> 0 entries).
ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: NCCL keeps its own recorder (of CUDA events) in CUDA builds; every other backend (gloo
#: included) records into the generic one, dumped by ``_dump_fr_trace`` (torch 2.7+), each
#: as JSON (``_json``) or as a pickle that may leave out stack traces.
_NCCL_DUMP = "_dump_nccl_trace"
_GENERIC_DUMP = "_dump_fr_trace"


def enabled() -> bool:
    """Whether this process's flight recorder is on (its environment says so)."""
    for name in ENV:
        try:
            if int(os.environ.get(name, "0") or "0") > 0:
                return True
        except ValueError:
            continue
    return False


def summary() -> dict[str, Any]:
    """The flight recorder's bounded summary; raises ``RuntimeError`` with one line when
    there is none (not on, no process group yet, an entry point this torch lacks)."""
    return condense(_dump())


#: Collectives a black box carries at most (the newest).
TIMED_MAX: Final = 2048


def timed() -> list[dict[str, Any]]:
    """The recorder's collectives with their timings, oldest first, for the black box:
    ``{"pg", "seq", "op", "state", "created", "started", "completed", "ms"}``, times in
    wall-clock seconds (None where torch did not see that moment: ``started`` and
    ``completed`` are observed by its watchdog, ``ms`` is measured on CUDA only). Raises
    ``RuntimeError`` as :func:`summary` does."""
    return timed_entries(_dump())


def timed_entries(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A dump's entries as :func:`timed` gives them."""
    out = []
    for e in (doc.get("entries") or [])[-TIMED_MAX:]:
        if not isinstance(e, dict):
            continue
        pg = e.get("process_group") or ("", "")
        p2p = bool(e.get("is_p2p"))
        ms = e.get("duration_ms")
        out.append(
            {
                "pg": (str(pg[0]) if isinstance(pg, list | tuple) and pg else str(pg))[
                    : P.MAX_NAME
                ],
                "seq": _int(e.get("p2p_seq_id" if p2p else "collective_seq_id")),
                "op": str(e.get("profiling_name") or "?")[: P.MAX_NAME],
                "state": str(e.get("state") or "?")[:16],
                "created": _wall(e.get("time_created_ns")),
                "started": _wall(e.get("time_discovered_started_ns")),
                "completed": _wall(e.get("time_discovered_completed_ns")),
                "ms": float(ms) if isinstance(ms, int | float) and ms >= 0 else None,
            }
        )
    return out


def _wall(ns: Any) -> float | None:
    return ns / 1e9 if isinstance(ns, int) and ns > 0 else None


def _dump() -> dict[str, Any]:
    raw = _entry_point(json_names=True)(True, False)  # includeCollectives, onlyActive
    doc: dict[str, Any] = json.loads(
        raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    )
    return doc


def timing_dump() -> dict[str, Any]:
    """The recorder's entries without their stack traces (torch's pickle document): about
    half the cost of the JSON one, for a read every heartbeat (``waits``). Raises
    ``RuntimeError`` as :func:`summary` does."""
    # includeCollectives, includeStackTraces, onlyActive; the pickle is torch's own, made
    # in this process a moment ago.
    raw = _entry_point(json_names=False)(True, False, False)
    doc = pickle.loads(raw)
    if not isinstance(doc, dict):
        raise RuntimeError("the flight recorder's dump is not a map")
    return doc


def _entry_point(json_names: bool) -> Any:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("no torch.distributed process group in this process")
    c10d = sys.modules.get("torch._C._distributed_c10d")
    nccl = "nccl" in str(dist.get_backend()).lower()
    suffix = "_json" if json_names else ""
    names = (_NCCL_DUMP + suffix, _GENERIC_DUMP + suffix)
    order = names if nccl else names[::-1]
    dump = next((getattr(c10d, n) for n in order if hasattr(c10d, n)), None)
    if dump is None:
        raise RuntimeError("this torch has no flight-recorder dump entry point")
    return dump


def condense(doc: dict[str, Any]) -> dict[str, Any]:
    """A dump (torch's JSON or pickle document, as a map) as the summary the daemon reads."""
    pgs: dict[str, dict[str, Any]] = {}
    status = doc.get("pg_status") or {}
    config = doc.get("pg_config") or {}
    for pg_id, st in list(status.items())[: P.FLIGHT_MAX_PGS]:
        if not isinstance(st, dict):
            continue
        pgs[str(pg_id)[: P.MAX_NAME]] = {
            "enqueued": _int(st.get("last_enqueued_collective")),
            "started": _int(st.get("last_started_collective")),
            "completed": _int(st.get("last_completed_collective")),
        }
    names: dict[str, str] = {}
    entries = []
    for e in (doc.get("entries") or [])[-P.FLIGHT_MAX_ENTRIES :]:
        if not isinstance(e, dict):
            continue
        pg = e.get("process_group") or ("", "")
        pg_name, pg_desc = (str(pg[0]), str(pg[1])) if len(pg) == 2 else (str(pg), "")
        pg_id = pg_name[: P.MAX_NAME]  # pg_status is keyed by the group's name too
        names[pg_id] = pg_desc
        p2p = bool(e.get("is_p2p"))
        entries.append(
            {
                "pg": pg_id,
                "seq": _int(e.get("p2p_seq_id" if p2p else "collective_seq_id")),
                "p2p": p2p,
                "op": str(e.get("profiling_name") or "?")[: P.MAX_NAME],
                "state": str(e.get("state") or "?")[:16],
                "sizes": [
                    [_int(d) for d in s[:8]]
                    for s in (e.get("input_sizes") or [])[:4]
                    if isinstance(s, list)
                ],
            }
        )
    for pg_id, desc in names.items():
        pgs.setdefault(pg_id, {"enqueued": -1, "started": -1, "completed": -1})
        pgs[pg_id]["desc"] = desc[: P.MAX_NAME]
    for pg_id, pg in pgs.items():
        cfg = config.get(pg_id) if isinstance(config, dict) else None
        pg["pg"] = pg_id
        pg.pop("name", None)
        if not pg.get("desc"):
            pg["desc"] = str((cfg or {}).get("desc", ""))[: P.MAX_NAME]
    return {
        "version": str(doc.get("version", ""))[:32],
        "pgs": list(pgs.values()),
        "entries": entries,
    }


def _int(v: Any) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        return -1
    return max(-1, min(n, P.MAX_STEP))
