"""A job whose training thread holds the GIL, so profd's agent thread gets it only rarely.

``sys.setswitchinterval(SWITCH)`` makes a thread waiting for the GIL (the client's agent) wait
that long while this thread computes in pure Python, as a Python-heavy step (an RL rollout, a
tokenizer, a data loader in the main thread) does. An ``arm`` then reaches the training thread
seconds after the daemon sent it, later than ``--next`` planned for.

Env: SWITCH seconds (default 2.0), RUN_S seconds to run (default 120). Prints ``RESULT {json}``.
"""

import json
import os
import sys
import time

import profd_client

profd_client.attach(step="manual")
give_up = time.monotonic() + 30
while not profd_client.is_attached() and time.monotonic() < give_up:
    time.sleep(0.05)  # registered while the GIL is still easy to get

sys.setswitchinterval(float(os.environ.get("SWITCH", "2.0")))
deadline = time.monotonic() + float(os.environ.get("RUN_S", "120"))
# No sleeps, files or prints in the loop: each would release the GIL to the agent.
while time.monotonic() < deadline:
    x = 0
    for i in range(2000):
        x += i * i
    profd_client.step()

print("RESULT " + json.dumps({"steps": profd_client.current_step()}), flush=True)
