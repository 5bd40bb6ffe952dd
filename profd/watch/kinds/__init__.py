"""Incident kinds: one module per kind, each a :class:`~profd.watch.kinds.kind.Kind`, listed
by :mod:`profd.watch.kinds.registry`. A new kind is a new module here and one line there."""
