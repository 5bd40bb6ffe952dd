"""One module per profctl command; ``ALL`` is what ``profctl`` registers."""

from __future__ import annotations

from .ps import ps
from .pull import pull
from .retry import retry
from .sessions import sessions, show
from .start import start
from .status import status
from .stop import cancel, stop
from .traces import traces

ALL = [status, ps, start, stop, cancel, sessions, show, traces, pull, retry]
