"""Post-processing of raw profiler output (runs in the daemon's worker processes)."""
