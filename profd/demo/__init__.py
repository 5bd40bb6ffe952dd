"""The 60-second demo: a daemon, a 2-rank CPU torchrun job, a capture, the indexed result."""
