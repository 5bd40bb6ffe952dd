"""The profd wire protocol, as the client and both sides of ``agent.sock`` speak it.

- :mod:`.envelope`: versions, framing, ``encode_with``/``decode``, :class:`ErrorCode` and
  :class:`ProtocolError`;
- :mod:`.schema`: the field types messages are checked with, and the limits;
- :mod:`.vocabulary`: message type names, option and state names, shared field types;
- :mod:`.agent`: the agent messages, one definition each (:data:`SCHEMAS`), and ``encode``;
- :mod:`.typed`: typed messages (msgspec), decoded and validated in one pass;
- :mod:`.adapter`: an older peer's version of a message, and back.

profctl's requests and the daemon's replies are not here: ``profd.control_schema`` has
them, so a training job that imports this package never loads them.

The names of every submodule are this package's too, loaded on the first one asked for
(``P.decode``): a submodule imported by its own name (``profd_client.protocol.envelope``)
loads only what it imports. profctl reads control replies that way, without msgspec and the
typed agent messages, which would be a third of ``profctl ps``'s start-up.
``docs/protocol.md`` describes every message and the version history.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from msgspec import UNSET as UNSET

    from . import adapter as adapter
    from .adapter import Peer as Peer
    from .agent import *  # noqa: F403
    from .envelope import *  # noqa: F403
    from .schema import *  # noqa: F403
    from .schema import cycles as cycles
    from .typed import Message as Message
    from .typed import Typed as Typed
    from .typed import fields_of as fields_of
    from .vocabulary import *  # noqa: F403
else:
    _SUBMODULES = frozenset({"adapter", "agent", "envelope", "schema", "typed", "vocabulary"})

    def __getattr__(name: str) -> Any:
        if name in _SUBMODULES:
            # ``from profd_client.protocol import envelope`` asks here first: that one module.
            return importlib.import_module(f".{name}", __name__)
        if name.startswith("__"):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        _load_all()
        try:
            return globals()[name]
        except KeyError:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None

    def _load_all() -> None:
        """Every name of the package, as the star imports above bind them, once: later
        reads are plain attribute reads."""
        g = globals()
        # The order of the star imports above: a later module's name wins.
        for sub in ("agent", "envelope", "schema", "vocabulary"):
            m = importlib.import_module(f".{sub}", __name__)
            g.update({k: v for k, v in vars(m).items() if not k.startswith("_")})
        g["UNSET"] = importlib.import_module("msgspec").UNSET
        g["adapter"] = adapter = importlib.import_module(".adapter", __name__)
        g["Peer"] = adapter.Peer
        g["cycles"] = importlib.import_module(".schema", __name__).cycles
        typed = importlib.import_module(".typed", __name__)
        g.update(Message=typed.Message, Typed=typed.Typed, fields_of=typed.fields_of)
