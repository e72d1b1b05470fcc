# Two entry points a newcomer copies from the README. Both install what they need.
PYTHON ?= python3

.PHONY: install plots test test-fast quickstart

install:
	$(PYTHON) -m pip install -q -r requirements.txt

# matplotlib only draws plots (eval.py --plot, the quickstart's figure): a failed install
# costs the plots, not the run, and the plot tests then skip saying why.
plots:
	$(PYTHON) -m pip install -q matplotlib || echo "matplotlib could not be installed: plots will be skipped"

# The whole suite, slow tests included (CI runs exactly this). tensorboard and wandb only
# receive train.py's optional live curves: a failed install skips their tests, saying why.
test: install plots
	$(PYTHON) -m pip install -q tensorboard wandb || echo "tensorboard/wandb could not be installed: their logger tests will be skipped"
	$(PYTHON) -m pytest -q tests

# Everything but the tests marked slow (torchrun, compile, training runs).
test-fast: install
	$(PYTHON) -m pytest -q -m "not slow" tests

# The γ experiment end to end on CPU (anchor task): data, two trainings, comparison table, plot.
quickstart: install plots
	$(PYTHON) quickstart.py
