"""Watch, the daemon's side (docs/design.md "Watch"): the detectors fed from the step ledger once a
tick, the incidents they open, and the automatic capture of each. The rules themselves are
pure (``profd.watch``); everything here is owned by the event loop."""
