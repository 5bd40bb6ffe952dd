"""Listing rows that can be sent: one row's bad value costs that row's field, never the listing.

The pipeline holds what it stores to the protocol's bounds, but an index written by an older
daemon may hold a value msgpack cannot carry (a 30-digit step from a client's trace): one such
row must not turn ``profctl traces`` into an error for every user, for good. The row is served
with the fields that cannot be sent emptied, and a ``skipped`` note that names them.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack

log = logging.getLogger("profd.control")


def fits(value: object) -> bool:
    """Whether ``value`` can go into a reply (the encoding profd_client.protocol uses)."""
    try:
        msgpack.packb(value, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return False
    return True


def rows(listing: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``listing`` itself when it can be sent (one pass in C); else each row that cannot,
    replaced by :func:`row`."""
    if fits(listing):
        return listing
    return [r if fits(r) else row(r) for r in listing]


def row(r: dict[str, Any]) -> dict[str, Any]:
    """``r`` with each field that cannot be sent emptied (a list to ``[]``, anything else to
    None: what readers already handle for a row without it) and named in ``skipped``."""
    bad = [k for k, v in r.items() if not fits(v)]
    if not bad:
        return r
    out = {**r, **{k: [] if isinstance(r[k], list) else None for k in bad}}
    out["skipped"] = f"not sent: {', '.join(bad)} (a value beyond what the protocol carries)"
    name = r.get("id") or r.get("session")
    log.warning("row %s of the index cannot be sent: %s", name, out["skipped"])
    return out
