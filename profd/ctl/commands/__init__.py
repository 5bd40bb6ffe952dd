"""One module per profctl command; ``ALL`` is what ``profctl`` registers."""

from __future__ import annotations

from .ps import ps
from .status import status

ALL = [status, ps]
