"""gpu_check.py on a machine without a GPU. The rehearsal: its dry run under the lent GPU machine's
conditions (no `datasets`, no pip or make, no network), on a copy of the repository, checks every
step's command for real (pytest collects, bench and train.py plan, the data is made), fits its plan in
the budget and writes nothing outside --out. The real run exits 1 in one line."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import launch_env
from test_train import ROOT

# Loaded by every Python process started with it on PYTHONPATH (gpu_check's steps too): what the lent
# machine lacks is unavailable, and reaching for it fails loudly.
LENT_MACHINE = '''
import importlib.abc, os, socket, subprocess, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("datasets", "pip"):
            raise ImportError(f"{name}: not on the lent GPU machine")

sys.meta_path.insert(0, Absent())
connect = socket.socket.connect

def no_network(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        raise OSError(f"no network on the lent GPU machine ({address})")
    return connect(self, address)

socket.socket.connect = no_network
popen = subprocess.Popen.__init__

def no_installs(self, args, *rest, **options):
    words = [os.path.basename(str(w)) for w in (args if isinstance(args, (list, tuple)) else str(args).split())]
    if {"pip", "pip3", "make", "install"} & set(words):
        raise OSError(f"no package index on the lent GPU machine: {args}")
    popen(self, args, *rest, **options)

subprocess.Popen.__init__ = no_installs
'''


def tree(root):
    """{path: (size, mtime)} of every file under root but bytecode caches."""
    return {os.path.join(d, n): (os.stat(os.path.join(d, n)).st_size, os.stat(os.path.join(d, n)).st_mtime_ns)
            for d, dirs, names in os.walk(root) if "__pycache__" not in d for n in names}


@pytest.mark.slow
def test_dry_run_under_the_lent_machines_conditions(tmp_path):
    repo, out, block = tmp_path / "repo", tmp_path / "OUT", tmp_path / "block"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".git", "out", "data", "results", "__pycache__",
                                                               ".pytest_cache"))
    block.mkdir()
    (block / "sitecustomize.py").write_text(LENT_MACHINE)
    env = {**launch_env(), "PYTHONPATH": str(block), "OUT": str(out)}
    for blocked in ("import datasets", "import subprocess; subprocess.run(['pip', 'list'])",
                    "import socket; socket.create_connection(('127.0.0.1', 9))"):
        p = subprocess.run([sys.executable, "-c", blocked], env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode != 0 and "lent GPU machine" in p.stderr, blocked
    before = tree(repo)
    p = subprocess.run([sys.executable, "gpu_check.py", "--dry-run"], cwd=repo, capture_output=True, text=True,
                       timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    steps = [line.split()[0] for line in p.stdout.splitlines() if line[:1].isalpha() and not line.startswith(
        ("api", "expected"))]
    assert steps == ["pair", "data", "train", "compiled", "fsdp", "eager", "tests"]
    assert p.stdout.count("check: ok") == 7 and "FAILED" not in p.stdout and "missing" not in p.stdout
    summary = json.loads((out / "gpu_check.json").read_text())
    assert sum(summary["expected_s"].values()) <= 540 and set(summary["expected_s"]) == set(steps)
    assert (out / "scratch" / "data" / "meta.json").exists()  # the data step really ran, without datasets
    assert tree(repo) == before  # $OUT is outside the copy: nothing was written in the repository


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_cuda_it_exits_1_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "gpu_check.py", "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=launch_env())
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "no CUDA device" in p.stderr
    assert not (tmp_path / "o" / "gpu_check.json").exists()
