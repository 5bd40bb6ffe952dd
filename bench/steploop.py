"""A real training process for ``bench_stacks.py``: attached with profd_client, its steps
(one sleep of ``STEP_MS`` each, then ``profd_client.step()``) on a thread named ``trainer``.

Arguments: STEP_MS RANK WORLD. Prints ``{"ready": true}``, then answers one JSON line per
command on stdin: ``{"op": "reset"}`` starts a window, ``{"op": "gap"}`` says the longest
time between two steps in it (``max_gap_ms``): a read that pauses the process shows there.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import profd_client

step_s = float(sys.argv[1]) / 1000.0
profd_client.attach(job="bench", rank=int(sys.argv[2]), world_size=int(sys.argv[3]), step="manual")
longest = [0.0]
last = [time.monotonic()]


def one_step() -> None:
    time.sleep(step_s)


def train() -> None:
    while True:
        one_step()
        profd_client.step()
        now = time.monotonic()
        longest[0] = max(longest[0], now - last[0])
        last[0] = now


threading.Thread(target=train, name="trainer", daemon=True).start()
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    if json.loads(line)["op"] == "reset":
        longest[0] = 0.0
        out: dict[str, object] = {"ok": True}
    else:
        out = {"max_gap_ms": round(longest[0] * 1000, 2)}
    print(json.dumps(out), flush=True)
