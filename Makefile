PYTHON ?= .venv/bin/python

.PHONY: bench bench-smoke

# Every target in docs/design.md, full sizes, side by side with its baseline (see docs/benchmarks.md).
bench:
	$(PYTHON) bench/run.py

# Tiny sizes, every code path of every benchmark (the torchrun job included), about a minute;
# results go to $$TMPDIR/profd-bench-smoke, not bench/results.
bench-smoke:
	$(PYTHON) bench/run.py --quick --out $(or $(TMPDIR),/tmp)/profd-bench-smoke
