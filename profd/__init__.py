"""profd: a per-node, out-of-process profiling daemon for distributed PyTorch training."""

from profd_client.protocol import RELEASE as __version__

__all__ = ["__version__"]
