"""Watch: what profd notices by itself from every rank's step clock (docs/design.md "Watch").

Pure code only: statistics over step times and the snapshot the daemon publishes for
``/metrics``. The daemon owns the live state (``profd.daemon.clients.ledger``); profctl uses
the same rules to merge nodes (``profctl --cluster top``).
"""
