"""Modules pyarrow and DuckDB import without a use in the processes that read or write the
warehouse: pandas, on the first Arrow array made of Python objects or the first table handed
to DuckDB, only to ask whether it is a pandas object (~0.4 s of a ~0.9 s ``profctl query``,
~0.3 s and ~50 MB of each flush); numpy, at ``import pyarrow`` (0.06-0.17 s). Both work without
either, taking Python objects as plain sequences. A process that never needs them refuses
them, as if they were not installed; nothing here is imported by the daemon itself.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any


class Refuse(importlib.abc.MetaPathFinder):
    """``import`` of ``names`` (and their submodules) fails, naming ``who`` refused it."""

    def __init__(self, names: tuple[str, ...], who: str) -> None:
        self.names = names
        self.who = who

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"{fullname}: not used by {self.who}")


def refuse(names: tuple[str, ...], who: str) -> None:
    """From now on this process cannot import ``names``; those already imported stay."""
    wanted = tuple(n for n in names if n not in sys.modules)
    if wanted and not any(isinstance(f, Refuse) for f in sys.meta_path):
        sys.meta_path.insert(0, Refuse(wanted, who))
