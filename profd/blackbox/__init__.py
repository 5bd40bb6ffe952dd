"""Black boxes as the daemon collects them from its ranks (:mod:`.box`), and what profctl and
incidents make of them: one Perfetto trace (:mod:`.perfetto`) and a summary
(:mod:`.summary`). Pure: boxes in, documents out."""
