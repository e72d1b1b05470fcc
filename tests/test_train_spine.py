"""train.py's settings rules (rules.check_settings): each refuses its bad value with its one
line; varlen passes the settings check and is refused by the device at start, before any run folder;
Ctrl-C during `train.py export` is one line, exit 130, and leaves the output folder as it was."""
import hashlib
import os
import signal
import subprocess
import sys

import pytest
import torch

import checkpoint
import train
from conftest import launch_env
from test_train import ROOT, TINY, run_here, train_error

GAMMA = ("is outside 0 < γ <= 3: at γ <= 0 weights do not shrink with width, above 3 they start near 0; use e.g. "
         "0.5 (standard) or 1.0")
# (arguments, the whole error), the lines as the settings check printed them before it became a table.
BAD = [
    (["--schedule=linear"], "schedule='linear': choose one of ('cosine', 'wsd')"),
    (["--optimizer=sgd"], "optimizer='sgd': choose one of adamw, muon"),
    (["--muon_momentum=1.0"], "muon_momentum=1.0 must be in [0, 1), e.g. 0.95"),
    (["--attn_backend=flash"], "attn_backend='flash': choose one of auto, flex, sdpa, eager, varlen"),
    *[([f"--{k}=0"], f"{k}=0 must be >= 1") for k in ("seq_len", "global_batch", "batch_size", "max_steps",
                                                       "log_interval", "eval_interval", "eval_batches",
                                                       "ckpt_interval", "keep_last")],
    *[([f"--{k}=-1"], f"{k}=-1 must be >= 0") for k in ("warmup_steps", "keep_every", "dry_run", "bench_interval")],
    *[([f"--{k}=-1"], f"{k}=-1.0 must be >= 0") for k in ("peak_flops", "grad_clip")],
    (["--adam_eps=1e-50"], "adam_eps=1e-50 must be >= float32's smallest normal 1.18e-38 (AdamW's state is fp32: "
                           "smaller is 0 or subnormal there, and a zero gradient's update 0/0 = NaN); use e.g. 1e-8"),
    (["--keep_steps=[1.5]"], "keep_steps=[1.5] must be whole steps between 0 and max_steps"),
    (["--seed=-1"], "seed=-1 must be in 0 <= seed < 2**64"),
    (["--warmup_steps=10", "--max_steps=10"], "warmup_steps=10 must be < max_steps=10"),
    (["--min_lr_ratio=-0.1"], "min_lr_ratio=-0.1 must be between 0 and 1"),
    (["--decay_frac=1.5"], "decay_frac=1.5 must be between 0 and 1"),
    (["--schedule=wsd", "--max_steps=110", "--warmup_steps=10", "--decay_frac=0.95"],
     "schedule='wsd' decays from step 6 (decay_frac=0.95 of max_steps=110), before warmup_steps=10 end: lower "
     "decay_frac to <= 0.909091 or warmup_steps to <= 6"),
    (["--betas=(1.0, 0.9)"], "betas=(1.0, 0.9) must be two numbers in [0, 1), e.g. (0.9, 0.95)"),
    (["--weight_decay.embed=-0.1"], "weight_decay={'matrix': 0.1, 'embed': -0.1, 'norm': 0.0} must be >= 0 in every "
                                    "group"),
    (["--lr=-1.0"], "lr=-1.0 must be > 0"),
    (["--lr=1e39", "--betas=(0.0, 0.9)"], "lr=1e+39 is too large: AdamW's first step size lr/(1 - betas[0]) = 1e+39 "
                                          "is past float32's max 3.4e+38; use e.g. lr=1e-3"),
    (["--lr=1e20", "--weight_decay.embed=1e20"], "weight_decay.embed=1e+20 times lr=1e+20 is past float32's max "
                                                 "3.4e+38: AdamW would scale the weights by 1 - lr*weight_decay = "
                                                 "-inf; use e.g. 0.1"),
    (["--tensorboard_dir=tb"], "tensorboard_dir='tb' needs the tensorboard package: pip install tensorboard"),
    (["--wandb_log=True"], "wandb_log=True needs the wandb package: pip install wandb"),
    (["--out_dir=  "], "out_dir is empty: name the run folder, e.g. --out_dir=out/run"),
    (["--gamma=0"], f"gamma=0.0 {GAMMA}"),
    (["--model.norm_eps=0.0"], "model_size='tiny', model={'norm_eps': 0.0}: norm_eps=0.0: must be > 0 (use 1e-12 for "
                               "small init)"),
    (["--model.tie_embeddings=True", "--init_overrides={'^lm_head': 0.5}"],
     "init_overrides: overrides pattern '^lm_head' matches only lm_head.weight, which is tied to tok_emb.weight and "
     "drawn under that name: write the pattern for tok_emb.weight"),
    (["--init_overrides={'^lm_head': 0.5, '^tok': 9.0}"], f"init_overrides['^tok']=9.0 {GAMMA}"),
    (["--seq_len=2048"], "seq_len=2048 > the model's max_seq_len=1024: lower seq_len or set --model.max_seq_len=2048"),
]


@pytest.fixture
def no_loggers(monkeypatch):
    for package in ("tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, package, None)  # find_spec now sees no such package


def error_of(args):
    """load_config's error for args, or None."""
    try:
        train.load_config(args)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("args, message", BAD)
def test_a_bad_value_is_its_one_line(args, message, no_loggers):
    assert error_of(args) == f"config: {message}"


def test_every_rule_is_met_by_a_case(no_loggers):
    """Each `refuse(...)` of rules.check_settings runs for at least one case of BAD: no rule is there that the
    cases never reach, and each case's line is its own (BAD has no two alike)."""
    import inspect

    import rules
    lines = inspect.getsource(rules).splitlines()
    refusals = {number for number, line in enumerate(lines, start=1) if line.strip().startswith("refuse(")}
    reached = set()

    def trace(frame, event, arg):
        if frame.f_code.co_filename == rules.__file__ and event == "line":
            reached.add(frame.f_lineno)
        return trace
    sys.settrace(trace)
    try:
        for args, _ in BAD:
            error_of(args)
    finally:
        sys.settrace(None)
    assert refusals and refusals <= reached, sorted(refusals - reached)
    assert len({message for _, message in BAD}) == len(BAD)


def test_varlen_passes_the_settings_and_the_device_refuses_it_before_the_run_folder(data_dir, tmp_path):
    """The settings check asked for varlen's CUDA device on every machine, so train.py refused
    attn_backend='varlen' on a GPU too."""
    assert train.load_config(["--attn_backend=varlen"])["attn_backend"] == "varlen"
    assert train.model_config(train.load_config(["--attn_backend=varlen"]), "cuda").attn_backend == "varlen"
    if torch.cuda.is_available():
        pytest.skip("a GPU here: the CPU refusal is not what runs")
    out = tmp_path / "run"
    assert train_error([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=3",
                        "--attn_backend=varlen"]) == ("attn_backend='varlen' runs flash-attention kernels, CUDA only, "
                                                      "not cpu: use attn_backend='sdpa' here")
    assert not out.exists()


# ----------------------------------------------------------------------------- Ctrl-C during an export
# train.py as `python train.py export ...` runs it, its writer of the export's bytes (torch.save, safetensors'
# save_file) held after writing them, so that SIGINT comes between the bytes and the rename into place.
HELD = """
import importlib, runpy, sys, time
module, name = sys.argv[1].rsplit(".", 1)
module = importlib.import_module(module)
write = getattr(module, name)
def held(*args, **kwargs):
    write(*args, **kwargs)
    print("written", file=sys.stderr, flush=True)
    time.sleep(120)
setattr(module, name, held)
sys.argv = ["train.py", *sys.argv[2:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.fixture(scope="module")
def ckpt(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    run_here([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=2", "--warmup_steps=1"])
    return checkpoint.complete_checkpoints(str(out))[-1]


def tree(path):
    """{relative path: sha256} of every file under path, and its folders."""
    out = {}
    for folder, dirs, files in os.walk(path):
        out.update({os.path.relpath(os.path.join(folder, d), path): "dir" for d in dirs})
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                out[os.path.relpath(os.path.join(folder, name), path)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.parametrize("fmt, writer", [("pt", "torch.save"), ("hf", "safetensors.torch.save_file")])
def test_ctrl_c_during_an_export_is_one_line_and_keeps_the_earlier_export(ckpt, tmp_path, fmt, writer):
    """It printed KeyboardInterrupt's traceback and died by the signal."""
    if fmt == "hf":
        pytest.importorskip("transformers")
        pytest.importorskip("safetensors")
        import hf_export
    exports = tmp_path / "exports"
    exports.mkdir()
    out = str(exports / ("model.pt" if fmt == "pt" else "hf"))
    if fmt == "pt":
        checkpoint.export(ckpt, out)
    else:
        hf_export.export_hf(ckpt, out)
    before = tree(exports)
    proc = subprocess.Popen([sys.executable, "-c", HELD, writer, "export", ckpt, out, "--format", fmt], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env(),
                            start_new_session=True)
    try:
        assert proc.stderr.readline() == "written\n"
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
        stdout, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.strip() == (f"interrupted: the export to {out} stopped before it finished; "
                                                      f"nothing is half-written, the same command exports again"), err
    assert "exported" not in stdout
    assert tree(exports) == before  # the earlier export byte for byte, and no temporary file or folder beside it


def test_pt_export_of_a_run_folder_is_its_newest_intact_checkpoint(ckpt, tmp_path):
    """README: export given a run folder takes its newest intact checkpoint (it was refused: "not a
    complete checkpoint folder"). Reference: the export of that checkpoint folder itself."""
    run = os.path.dirname(ckpt)
    checkpoint.export(ckpt, str(tmp_path / "ckpt.pt"))
    train.main(["export", run, str(tmp_path / "run.pt")])
    want, got = (torch.load(tmp_path / n, weights_only=True) for n in ("ckpt.pt", "run.pt"))
    assert got["step"] == want["step"] and got["model"].keys() == want["model"].keys()
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
