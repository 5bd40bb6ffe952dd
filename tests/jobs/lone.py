"""A single-process job with no launcher: ``python lone.py``, the two profd lines, manual steps.

Steps every 0.05 s until killed.
"""

import time

import profd_client

profd_client.attach(step="manual")
while True:
    time.sleep(0.05)
    profd_client.step()
