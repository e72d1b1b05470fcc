# Two entry points a newcomer copies from the README. Both install what they need.
PYTHON ?= python3

.PHONY: install pytest plots test-extras test test-fast quickstart gpu-check

# pyproject.toml lists the packages; installing it adds no module to the path (see its header).
install:
	$(PYTHON) -m pip install -q .

# matplotlib only draws plots (eval.py --plot, the quickstart's figure): a failed install
# costs the plots, not the run, and the plot tests then skip saying why.
plots:
	$(PYTHON) -m pip install -q ".[plots]" || echo "matplotlib could not be installed: plots will be skipped"

# Packages only some tests use (pyproject.toml's extras; a test whose package is missing skips, saying
# which). hf: init.py on Hugging Face models and the HF export. eval: the HellaSwag parity test against
# lm-eval, MATH-500's math_verify metric. logging: train.py's optional live curves. dev: all, and pytest.
test-extras:
	$(PYTHON) -m pip install -q ".[dev]" || echo "could not install the dev extras: the tests that need them will skip"

# The runner alone, apart from the extras: a failed extra then skips its tests instead of every test.
pytest:
	$(PYTHON) -m pip install -q pytest
	$(PYTHON) -m pip install -q pytest-xdist || echo "pytest-xdist could not be installed: the suite runs in one process"

# Most tests run one thread (tests/conftest.py), so two pytest-xdist workers, each given whole test files
# (a module's fixtures are built once), keep both cores busy; without xdist the suite runs in one process.
WORKERS = $$($(PYTHON) -c "import xdist" 2>/dev/null && echo "-n 2 --dist loadfile")

# The whole suite, slow tests included (CI runs exactly this), then its 15 slowest tests.
test: install pytest plots test-extras
	$(PYTHON) -m pytest -q $(WORKERS) --durations=15 tests

# Everything but the tests marked slow (torchrun, compile, training runs).
test-fast: install pytest
	$(PYTHON) -m pytest -q $(WORKERS) -m "not slow" tests

# The γ experiment end to end on CPU (anchor task): data, two trainings, comparison table, plot.
quickstart: install plots
	$(PYTHON) quickstart.py

# On one H100/H200, under 9 minutes: bench's pairs and variants, train.py at 1.5B (MFU, peak memory vs
# the estimate), the CUDA tests; everything in out/gpu_check/. gpu_check.py itself installs nothing: on
# an image without a package index run `python3 gpu_check.py --out DIR` (README). Without CUDA it exits 1
# in one line; `python gpu_check.py --dry-run` shows the plan anywhere.
gpu-check: install test-extras
	$(PYTHON) gpu_check.py
