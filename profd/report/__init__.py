"""Reports across the ranks of a session, from the pipeline's per-rank statistics."""
