# Two entry points a newcomer copies from the README. Both install what they need.
PYTHON ?= python3

.PHONY: install test test-fast quickstart

install:
	$(PYTHON) -m pip install -q -r requirements.txt

# The whole suite, slow tests included (CI runs exactly this).
test: install
	$(PYTHON) -m pytest -q tests

# Everything but the tests marked slow (torchrun, compile, training runs).
test-fast: install
	$(PYTHON) -m pytest -q -m "not slow" tests

# The γ experiment end to end on CPU (anchor task): data, two trainings, comparison table, plot.
# matplotlib only draws the plot, so a failed install costs the plot, not the run.
quickstart: install
	$(PYTHON) -m pip install -q matplotlib || echo "matplotlib could not be installed: the quickstart will skip its plot"
	$(PYTHON) quickstart.py
