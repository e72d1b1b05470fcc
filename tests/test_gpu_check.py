"""gpu_check.py (make gpu-check) on a machine without a GPU: the dry run checks every step's
arguments for real (pytest collects, bench and train.py plan, the data is made), and the real run
exits 1 in one line."""
import subprocess
import sys

import pytest
import torch

from conftest import launch_env
from test_train import ROOT


@pytest.mark.slow
def test_dry_run_checks_every_command(tmp_path):
    p = subprocess.run([sys.executable, "gpu_check.py", "--dry-run", "--work", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=launch_env())
    assert p.returncode == 0, p.stdout + p.stderr
    steps = [line.split()[0] for line in p.stdout.splitlines() if not line.startswith((" ", "then"))]
    assert steps == ["tests", "data", "train", "export", "bench"]
    assert p.stdout.count("check: ok") == 4 and "FAILED" not in p.stdout
    assert (tmp_path / "data" / "meta.json").exists()  # the data step really ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_cuda_it_exits_1_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "gpu_check.py", "--work", str(tmp_path), "--json-out", str(tmp_path / "x.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=launch_env())
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "no CUDA device" in p.stderr
    assert not (tmp_path / "x.json").exists()
