"""profd_client: let the node's profd daemon profile this training process.

Two lines in a training script::

    import profd_client
    profd_client.attach()

From then on ``profctl start ...`` on the node can capture exactly the requested steps on
exactly the requested ranks. While nothing is being captured the cost per step is one clock
read into a preallocated ring (the step ledger), an integer increment and a compare. Nothing
in this package raises into training code because the daemon is absent, slow, restarted or
misbehaving.

This package imports only the standard library, pyzmq, msgpack, msgspec and (lazily) torch. It looks
at ``ray`` only when the process has already imported it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["attach", "current_step", "detach", "identity", "is_attached", "region", "step"]

if TYPE_CHECKING:
    from .api import attach, current_step, detach, identity, is_attached, region, step
    from .protocol.envelope import RELEASE as __version__  # noqa: F401 - read by __getattr__
else:

    def __getattr__(name: str) -> Any:
        if name == "__version__":
            # The one version string lives with the protocol; read on demand, so that
            # `import profd_client` alone loads nothing but this file.
            return importlib.import_module(".protocol.envelope", __name__).RELEASE
        # The API (and the agent, stepper and identity code behind it) loads on first use:
        # profctl and the daemon import profd_client.protocol and need none of it.
        if name not in __all__ and not (name.startswith("_") and not name.startswith("__")):
            # A submodule (``from . import protocol`` asks here first): the import system
            # loads it when this says there is no such attribute. Answering with the API
            # instead would import agent.py from inside agent.py's own imports.
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        api = importlib.import_module(".api", __name__)
        # Every public name at once, and after the import: importing api imports the
        # submodule identity.py, which binds profd_client.identity to that module, over
        # the identity() function, and __getattr__ is never asked for it again.
        for public in __all__:
            globals()[public] = getattr(api, public)  # later uses are plain attribute reads
        return getattr(api, name)
