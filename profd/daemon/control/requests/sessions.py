"""Requests about sessions: ``start``, ``stop`` and ``cancel``, ``sessions``, ``show``,
``retry``. Requests that read the index flush first, so the answer has every change so far."""

from __future__ import annotations

from typing import Any

from profd import claims
from profd import control_schema as C
from profd.daemon.control.requests.context import Context, Handler
from profd.daemon.runtime.peers import Requester
from profd.daemon.sessions.starts import StartRequest, started
from profd.scheduling import schedule as sch
from profd.scheduling.refusal import Refused
from profd_client.protocol import ErrorCode

#: Ids an ambiguous session name lists.
SHOWN_AMBIGUOUS = 5


def start(ctx: Context, m: dict[str, Any], by: Requester) -> dict[str, Any]:
    req = StartRequest.parse(m["spec"], validated=True)
    if req.probe:
        out = {"candidates": ctx.starter.candidates(req, by)}
    else:
        out = started(ctx.starter.start(req, by=by))
    ctx.stamp(out.get("targets") or out.get("candidates") or [])
    return out


def stop(ctx: Context, m: dict[str, Any], by: Requester) -> dict[str, Any]:
    """``stop`` keeps what was captured; ``cancel`` does not."""
    sid = session_id(ctx, m["session"])
    s = ctx.starter.stop(sid, m["t"] == C.C_STOP, by)
    if s is None:
        row = ctx.session_rows.session(sid)
        if row is None:
            raise Refused(ErrorCode.UNKNOWN_SESSION, f"no session {m['session']!r}")
        raise Refused(ErrorCode.FINISHED, f"session {row['id']} already ended: {row['state']}")
    return {"session": s.id, "state": s.state}


def sessions(ctx: Context, m: dict[str, Any], by: Requester) -> list[dict[str, Any]]:
    ctx.flush()
    rows = ctx.session_rows.sessions(m.get("state"), m.get("job"), m.get("limit") or 50)
    ctx.stamp(rows)
    return rows


def show(ctx: Context, m: dict[str, Any], by: Requester) -> dict[str, Any]:
    ctx.flush()
    sid = session_id(ctx, m["session"])
    live = ctx.sessions.exact(sid)
    if live is not None:
        # From memory: right even while the index cannot be written (a full disk).
        s = live.summary()
    else:
        row = ctx.session_rows.session(sid)
        if row is None:
            raise Refused(ErrorCode.UNKNOWN_SESSION, f"no session {m['session']!r}")
        s = row
        s["steps"] = sch.steps_of([tuple(c) for c in s["cycles"]])
        for t in s["targets"]:
            t["stem"] = t.get("stem") or claims.stem(t["role"], t["rank"])
        s["notes"] = claims.notes((t["role"], t["rank"], t["pid"], t["stem"]) for t in s["targets"])
    ctx.stamp([s, *s["targets"]])
    return s


def retry(ctx: Context, m: dict[str, Any], by: Requester) -> dict[str, Any]:
    if not by.privileged:
        _check_owner(ctx, m.get("session"), by)
    return {"requeued": ctx.retry(m.get("session"))}


def _check_owner(ctx: Context, sid: str | None, by: Requester) -> None:
    if sid is None:
        raise Refused(
            ErrorCode.PERMISSION,
            f"profctl as uid {by.uid} may retry only its own sessions: name one",
        )
    row = ctx.session_rows.session(sid)
    if row is not None and not by.may_act_on(row.get("owner")):
        raise Refused(
            ErrorCode.PERMISSION, f"session {row['id']} is not uid {by.uid}'s; ask root to retry it"
        )


def session_id(ctx: Context, text: str) -> str:
    """The session ``text`` names: the one with that id, else the one whose id contains
    it (Refused when none does, or several do: a guess could stop the wrong one)."""
    if ctx.sessions.exact(text) is not None or ctx.session_rows.has_session(text):
        return text
    # Live sessions may not be in the index yet (its writes are behind).
    hits = set(ctx.sessions.containing(text))
    hits.update(ctx.session_rows.session_ids(text, SHOWN_AMBIGUOUS + 1))
    if len(hits) == 1:
        return hits.pop()
    if not hits:
        raise Refused(ErrorCode.UNKNOWN_SESSION, f"no session {text!r}")
    ids = sorted(hits, reverse=True)
    more = ", ..." if len(ids) > SHOWN_AMBIGUOUS else ""
    raise Refused(
        ErrorCode.AMBIGUOUS,
        f"session {text!r} is ambiguous: it is part of {', '.join(ids[:SHOWN_AMBIGUOUS])}"
        f"{more}; give more of the id",
    )


HANDLERS: dict[str, Handler] = {
    C.C_START: start,
    C.C_STOP: stop,
    C.C_CANCEL: stop,
    C.C_SESSIONS: sessions,
    C.C_SHOW: show,
    C.C_RETRY: retry,
}
