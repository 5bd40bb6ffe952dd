PYTHON ?= .venv/bin/python

.PHONY: bench bench-smoke

# Every target in DESIGN.md, full sizes, side by side with its baseline (see docs/benchmarks.md).
bench:
	$(PYTHON) bench/run.py

# Tiny sizes: checks that every benchmark runs end to end (results go to $$TMPDIR/profd-bench-smoke, not bench/results).
bench-smoke:
	$(PYTHON) bench/run.py --quick --out $(or $(TMPDIR),/tmp)/profd-bench-smoke
