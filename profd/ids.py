"""Session ids: made by a daemon for its own sessions, or by profctl for a cluster session."""

from __future__ import annotations

import secrets
import time


def new_session_id() -> str:
    # Sortable by creation time, short enough to type.
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)
