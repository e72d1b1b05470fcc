# Two entry points a newcomer copies from the README. Both install what they need.
PYTHON ?= python3

.PHONY: install test test-fast

install:
	$(PYTHON) -m pip install -q -r requirements.txt

# The whole suite, slow tests included (CI runs exactly this).
test: install
	$(PYTHON) -m pytest -q tests

# Everything but the tests marked slow (torchrun, compile, training runs).
test-fast: install
	$(PYTHON) -m pytest -q -m "not slow" tests
