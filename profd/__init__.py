"""profd: a per-node, out-of-process profiling daemon for distributed PyTorch training."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["__version__"]

if TYPE_CHECKING:
    from profd_client.protocol.envelope import RELEASE as __version__
else:

    def __getattr__(name: str) -> Any:
        if name == "__version__":
            # Read on demand: importing a submodule (``profd.ctl.main``) loads no protocol.
            return importlib.import_module("profd_client.protocol.envelope").RELEASE
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
