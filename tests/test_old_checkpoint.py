"""A run folder written by the code before issue 40's reshaping (commit OLD) still resumes and exports:
the old tree (from git) prepares the data and trains, today's train.py resumes its checkpoint and
exports it. References: today's code trained from scratch on the same settings, the old run's own
continuation, and the old code's own model loaded from the same checkpoint."""
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch

import checkpoint
import train
from conftest import failure_text, launch_env
from fileio import read_json
from model import GPT, GPTConfig
from test_train import ROOT, TINY, command, rows, run_here

OLD = "09a9812"  # the last commit before issue 40 moved data, analysis and the HF model out of place
ARGS = [*TINY, "--max_steps=6", "--ckpt_interval=2"]
FIELDS = ("loss", "grad_norm", "val_loss")
# Run with cwd = the old tree, so `import checkpoint` is the old module: its model and loader.
OLD_LOGITS = """import sys, numpy as np, torch, checkpoint
net, _ = checkpoint.load_model(sys.argv[1])
with torch.no_grad():
    np.save(sys.argv[3], net(torch.from_numpy(np.load(sys.argv[2])))[0].numpy())
torch.save(net.state_dict(), sys.argv[4])
print(checkpoint.__file__)
"""


def old_tree(dst):
    """The repository at OLD, as `git archive` gives it; skips where history is missing (a shallow
    clone or a tarball), which CI's full clone is not."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the old code comes from the repository's history")
    found = subprocess.run(["git", "-C", ROOT, "cat-file", "-e", f"{OLD}^{{commit}}"], capture_output=True)
    if found.returncode:  # git's own words too: "not a git repository", "dubious ownership"...
        pytest.skip(f"commit {OLD} is not in this checkout (not a git clone, or a shallow one): clone the repo fully "
                    f"({found.stderr.decode().strip()[:200]})")
    tar = subprocess.run(["git", "-C", ROOT, "archive", OLD], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(dst, filter="data")
    return str(dst)


def run_in(cwd, args, env=None):
    p = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300, env=launch_env(env))
    assert p.returncode == 0, failure_text(p)
    return p


def export_today(*args):
    """Today's `train.py export`, through main in this process (the command as a process: the README's)."""
    train.main(["export", *args])


def file_sums(folder):
    sums = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            sums[name] = hashlib.sha256(f.read()).hexdigest()
    return sums


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    """The old code's run folder, stopped after its step-4 checkpoint as a killed run would be (its
    step-6 checkpoint removed, so steps 5-6 are redone on resume), with what the old code itself
    says: its metrics rows of steps 1-6, and logits and weights of its own model from ckpt_4."""
    root = tmp_path_factory.mktemp("old")
    old = old_tree(root / "tree")
    # The old train.py caches a measured CPU peak under SMALLINIT_CACHE (default ~/.cache): kept in tmp.
    env = {"SMALLINIT_CACHE": str(root / "cache")}
    # Word salad in paragraphs: enough tokens for 6 steps and a validation batch.
    words = "a small init keeps the residual stream quiet while the norm gain grows".split()
    rng = np.random.default_rng(0)
    os.makedirs(root / "txt")
    (root / "txt" / "corpus.txt").write_text(
        "\n\n".join(" ".join(rng.choice(words, rng.integers(20, 60))) + "." for _ in range(400)))
    data = str(root / "bytes")  # written by the old prepare_data.py: today's data.py must read its meta.json
    run_in(old, [sys.executable, "prepare_data.py", "text", "--out", data, "--source", f"en={root / 'txt'}",
                 "--tokenizer", "bytes"], env)
    run = str(root / "run")
    run_in(old, command([*ARGS, f"--data_dir={data}", f"--out_dir={run}"], 1), env)
    old_rows = {field: rows(run, field) for field in FIELDS}
    shutil.rmtree(os.path.join(run, "ckpt_00000006"))
    ckpt = os.path.join(run, "ckpt_00000004")
    tokens = np.random.default_rng(1).integers(0, 257, (2, 32))  # 256: the byte tokenizer's end-of-text
    np.save(root / "tokens.npy", tokens)
    said = run_in(old, [sys.executable, "-c", OLD_LOGITS, ckpt, str(root / "tokens.npy"), str(root / "logits.npy"),
                        str(root / "weights.pt")], env).stdout
    assert os.path.dirname(said.strip()) == old  # the old module answered, not today's
    return dict(data=data, run=run, ckpt=ckpt, rows=old_rows, tokens=torch.from_numpy(tokens),
                logits=torch.from_numpy(np.load(root / "logits.npy")),
                weights=torch.load(root / "weights.pt", weights_only=True))


@pytest.mark.slow
def test_old_run_resumes_as_the_same_experiment(old_run, tmp_path):
    run, ckpt = old_run["run"], old_run["ckpt"]
    # Preconditions: this really is the old format (no code version anywhere, no meta.json sidecar).
    assert "code_version" not in read_json(os.path.join(run, "config.json"))
    assert "code_version" not in read_json(os.path.join(ckpt, "meta.json"))
    assert not os.path.exists(os.path.join(ckpt, "meta.json.sha256"))
    before = file_sums(ckpt)

    p = run_here([*ARGS, f"--data_dir={old_run['data']}", f"--out_dir={run}"])
    said = p.stdout + p.stderr
    assert f"resumed from {ckpt} at step 4" in p.stdout
    # The same experiment: no setting, data fingerprint or model counted as changed, nothing damaged.
    for warning in ("changed settings", "other settings", "could not be resumed", "damaged", "different model"):
        assert warning not in said, said
    assert file_sums(ckpt) == before  # resuming reads the old checkpoint, never rewrites it
    config = read_json(os.path.join(run, "config.json"))
    assert config["resume_changes"] == []
    version = checkpoint.code_version()  # the resumed run records today's code, in config.json and its checkpoint
    assert config["code_version"] == version
    assert checkpoint.read_meta(os.path.join(run, "ckpt_00000006"))["code_version"] == version

    ref = str(tmp_path / "ref")
    run_here([*ARGS, f"--data_dir={old_run['data']}", f"--out_dir={ref}"])
    for field in FIELDS:
        old, resumed, scratch = old_run["rows"][field], rows(run, field), rows(ref, field)
        assert sorted(resumed) == sorted(scratch), field  # every step once: the old steps 5-6 were redone
        steps = sorted(scratch)
        # The loss's chunked cross-entropy and the fused q/k/v GEMM came after OLD: the same sums in
        # another order, so old and new arithmetic agree to float32 rounding (~1e-7 relative), not bitwise.
        # A resume that lost the optimizer state, the schedule or the data position is off by far more.
        assert [resumed[s] for s in steps] == pytest.approx([scratch[s] for s in steps], rel=1e-5), field
        assert [resumed[s] for s in steps] == pytest.approx([old[s] for s in steps], rel=1e-5), field


@pytest.mark.slow
def test_old_checkpoint_exports_pt(old_run, tmp_path):
    out = str(tmp_path / "old.pt")
    export_today(old_run["ckpt"], out)
    blob = torch.load(out, weights_only=True)
    assert blob["step"] == 4 and blob.get("code_version") is None  # the old checkpoint names no code version
    assert blob["model"].keys() == old_run["weights"].keys()
    for name, weight in old_run["weights"].items():
        assert torch.equal(blob["model"][name], weight), name  # a read, bit for bit
    net = GPT(GPTConfig(**blob["model_config"]))
    net.load_state_dict(blob["model"])
    with torch.no_grad():
        logits = net.eval()(old_run["tokens"])[0]
    assert (logits - old_run["logits"]).abs().max() < 1e-5


@pytest.mark.slow
def test_old_checkpoint_exports_hf(old_run, tmp_path):
    need = "the HF export needs transformers and safetensors (Makefile test install)"
    transformers = pytest.importorskip("transformers", reason=need)
    pytest.importorskip("safetensors", reason=need)
    out = str(tmp_path / "hf")
    export_today(old_run["ckpt"], out, "--format", "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(old_run["tokens"]).logits
    assert (logits - old_run["logits"]).abs().max() < 1e-5
