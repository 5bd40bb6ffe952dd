"""profd: a per-node, out-of-process profiling daemon for distributed PyTorch training."""

__version__ = "0.1.0"
