"""This process's own stacks, for a daemon that may not read them from outside (a daemon of
another user, Yama's ``ptrace_scope``): the agent thread answers the daemon's ``stacks``
request with every thread's frames from ``sys._current_frames()``. It can answer only while
the agent thread runs, which a wedged interpreter (a C call holding the GIL) does not let it
do: then the daemon lists the rank as not answering."""

from __future__ import annotations

import sys
import threading
from typing import Any

from . import protocol as P


def own_stacks() -> list[dict[str, Any]]:
    """Every thread's ``{"name", "tid", "frames"}``, frames innermost first, at most
    ``P.AGENT_MAX_FRAMES`` each (the innermost: where it is), at most
    ``P.AGENT_MAX_THREADS`` threads; ``tid`` the native id (what py-spy reports)."""
    known = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue  # the agent thread itself, answering: not where anything is
        t = known.get(ident)
        frames: list[dict[str, Any]] = []
        f: Any = frame
        while f is not None and len(frames) < P.AGENT_MAX_FRAMES:
            code = f.f_code
            frames.append(
                {
                    "function": code.co_name[: P.MAX_TEXT],
                    "file": code.co_filename[: P.MAX_PATH],
                    "line": max(0, f.f_lineno or 0),
                }
            )
            f = f.f_back
        native = t.native_id if t is not None else None
        out.append(
            {
                "name": (t.name if t is not None else f"thread {ident}")[: P.MAX_NAME],
                "tid": native if native is not None and 0 <= native <= P.MAX_PID else 0,
                "frames": frames,
            }
        )
        if len(out) >= P.AGENT_MAX_THREADS:
            break
    return out
