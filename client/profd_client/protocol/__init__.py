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
``docs/protocol.md`` describes every message and the version history.
"""

from __future__ import annotations

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
