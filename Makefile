# Two entry points a newcomer copies from the README. Both install what they need.
PYTHON ?= python3

.PHONY: install plots test-extras test test-fast quickstart gpu-check

install:
	$(PYTHON) -m pip install -q -r requirements.txt

# matplotlib only draws plots (eval.py --plot, the quickstart's figure): a failed install
# costs the plots, not the run, and the plot tests then skip saying why.
plots:
	$(PYTHON) -m pip install -q matplotlib || echo "matplotlib could not be installed: plots will be skipped"

# Packages only some tests use; a test whose package is missing skips, saying which.
# transformers: init.py on Hugging Face models (tests/test_init_hf.py) and the HF export.
# safetensors: the HF export's weights. lm-eval (+ accelerate, which its hf model needs): the
# HellaSwag parity test. math-verify: MATH-500's math_verify metric.
# tensorboard, wandb: train.py's optional live curves (tests/test_train.py's logger tests).
TEST_EXTRAS += transformers safetensors lm-eval accelerate math-verify
TEST_EXTRAS += tensorboard wandb

test-extras:
	$(PYTHON) -m pip install -q $(TEST_EXTRAS) || echo "could not install $(TEST_EXTRAS): the tests that need them will skip"

# The whole suite, slow tests included (CI runs exactly this).
test: install plots test-extras
	$(PYTHON) -m pytest -q tests

# Everything but the tests marked slow (torchrun, compile, training runs).
test-fast: install
	$(PYTHON) -m pytest -q -m "not slow" tests

# The γ experiment end to end on CPU (anchor task): data, two trainings, comparison table, plot.
quickstart: install plots
	$(PYTHON) quickstart.py

# On one H100/H200, ~8 minutes: the CUDA tests, a short bench, a 50-step flex+bf16+compile run,
# its HF export compared, peak memory vs the estimate; one table and results/gpu_check.json.
# Without CUDA it exits 1 in one line; `python gpu_check.py --dry-run` shows the plan anywhere.
gpu-check: install test-extras
	$(PYTHON) gpu_check.py
