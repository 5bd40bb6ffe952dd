"""How the agent side answers a client: its routing id and one encoded frame."""

from collections.abc import Callable

Send = Callable[[bytes, bytes], None]
