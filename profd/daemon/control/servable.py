"""Listing rows that can be sent: one row's bad value costs that row's field, never the listing.

The pipeline holds what it stores to the protocol's bounds, but an index written by an older
daemon may hold a value msgpack cannot carry (a 30-digit step from a client's trace) or one
beyond the reply schema (:data:`profd_client.protocol.REPLIES`). Such a row must not turn
``profctl traces`` into an error for every user, for good: it is served with the fields that
cannot be sent emptied and a ``skipped`` note naming them. A row that still breaks its schema
then (a bad value in a field that cannot be empty) is left out of the listing, with a warning.

Only a reply that failed goes through here (:func:`repair`): the normal reply is checked once,
by ``protocol.reply``.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack

from profd import control_schema as C
from profd.scheduling.refusal import Refused
from profd_client import protocol as P

log = logging.getLogger("profd.control")


def fits(value: object) -> bool:
    """Whether ``value`` can go into a reply (the encoding profd_client.protocol uses)."""
    try:
        msgpack.packb(value, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return False
    return True


def _valid(f: P.Field, value: object) -> bool:
    try:
        f.check(value, "")
    except P.ProtocolError:
        return False
    return fits(value)


#: What a reply that cannot be sent is: a value outside its schema, or one msgpack cannot pack
#: (a 30-digit integer inside a map the schema does not look into).
UNSENDABLE = (P.ProtocolError, OverflowError, TypeError, ValueError)


def repair(t: str, data: Any) -> Any:
    """``data`` of a ``t`` reply that could not be sent, made sendable; the same ``data``
    back for a reply type whose rows are not read from the index (nothing to repair)."""
    if t == C.C_SESSIONS:
        return rows(data, C.SESSION_ROW)
    if t == C.C_TRACES:
        return rows(data, C.TRACE_ROW)
    if t == C.C_SHOW:
        doc = row({**data, "targets": rows(data["targets"], C.TARGET_ROW)}, C.SESSION_DOC)
        if doc is None:
            why = f"session {data['id']!r} holds values beyond the protocol's"
            raise Refused(P.ErrorCode.UNSERVABLE, why)
        return doc
    return data


def rows(listing: list[dict[str, Any]], schema: P.Struct) -> list[dict[str, Any]]:
    """Each row of ``listing`` that cannot be sent replaced by :func:`row`, and left out if
    even that cannot."""
    out = []
    for r in listing:
        fixed = r if _valid(schema, r) else row(r, schema)
        if fixed is not None:
            out.append(fixed)
    return out


def row(r: dict[str, Any], schema: P.Struct) -> dict[str, Any] | None:
    """``r`` with each field that cannot be sent emptied (a list to ``[]``, anything else to
    None: what readers already handle for a row without it) and named in ``skipped``; None
    when the row breaks its schema even so."""
    name = r.get("id") or r.get("session")
    fields = schema.fields
    bad = [k for k, v in r.items() if not (_valid(fields[k][0], v) if k in fields else fits(v))]
    out = {**r, **{k: [] if isinstance(r[k], list) else None for k in bad}}
    if bad:
        out["skipped"] = f"not sent: {', '.join(bad)} (a value beyond what the protocol carries)"
    if not _valid(schema, out):
        log.warning("row %s of the index cannot be sent: left out (bad: %s)", name, bad)
        return None
    if bad:
        log.warning("row %s of the index cannot be sent whole: %s", name, out["skipped"])
    return out
