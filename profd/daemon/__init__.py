"""The daemon: one event loop owns the registry of clients and the sessions."""
