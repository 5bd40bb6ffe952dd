"""``straggler``: a rank its peers wait for, found when a sample's traces are processed
(``SampleStragglers``)."""

from __future__ import annotations

from profd.watch.kinds.kind import Kind, plain_text, rule_grace

KIND = Kind(
    name="straggler",
    label="straggler",
    job_wide=False,
    captures=True,
    grace=rule_grace,
    text=plain_text,
)
