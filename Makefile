# Two entry points a newcomer copies from the README. Both install what they need.
PYTHON ?= python3

.PHONY: install plots hf-eval test test-fast quickstart

install:
	$(PYTHON) -m pip install -q -r requirements.txt

# matplotlib only draws plots (eval.py --plot, the quickstart's figure): a failed install
# costs the plots, not the run, and the plot tests then skip saying why.
plots:
	$(PYTHON) -m pip install -q matplotlib || echo "matplotlib could not be installed: plots will be skipped"

# The HF export (transformers, safetensors), lm-evaluation-harness (lm-eval + accelerate, which its
# hf model needs) and MATH-500's math_verify metric: optional at run time, installed here so
# their tests run; a failed install makes those tests skip, saying why.
hf-eval:
	$(PYTHON) -m pip install -q transformers safetensors lm-eval accelerate math-verify || echo "an optional package could not be installed: its tests will be skipped"

# The whole suite, slow tests included (CI runs exactly this).
test: install plots hf-eval
	$(PYTHON) -m pytest -q tests

# Everything but the tests marked slow (torchrun, compile, training runs).
test-fast: install
	$(PYTHON) -m pytest -q -m "not slow" tests

# The γ experiment end to end on CPU (anchor task): data, two trainings, comparison table, plot.
quickstart: install plots
	$(PYTHON) quickstart.py
