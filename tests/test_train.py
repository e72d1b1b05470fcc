"""train.py: config system, schedules, shipped configs (dry run), and real CPU training runs:
loss falls, grad accumulation and 2-rank FSDP2 match one process, exact resume after SIGKILL,
resume on another world size, NaN guard, export (compile against eager: tests/test_compiled_tail.py)."""
import contextlib
import copy
import glob
import importlib.util
import io
import json
import math
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import checkpoint
import train
from plan import print_plan
from conftest import failure_text, launch_env
from init import init_model_
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A tiny model and batch: each run is dominated by process start-up (~3 s).
TINY = ["--model_size=tiny", "--seq_len=32", "--global_batch=4", "--batch_size=4", "--warmup_steps=2", "--lr=3e-3",
        "--log_interval=1", "--eval_interval=5", "--eval_batches=1"]
# The MoE runs that 1 process and 2 ranks must agree on (bias-balanced routing: counts summed over ranks).
MOE = [*TINY, "--max_steps=10", "--ckpt_interval=5", "--model={'n_experts': 4, 'top_k': 2, 'moe_bias_rate': 0.05}"]


# ----------------------------------------------------------------------------- helpers
def byte_dataset(root):
    """A byte-level dataset made by prepare_data.py from generated text (word salad with
    structure, so a tiny model's loss falls fast), in root/bytes (root: a pathlib.Path)."""
    rng = random.Random(0)
    words = "the cat sat on a mat and dog ran to big red house with small green tree".split()
    text = "\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) + "."
                       for _ in range(600))
    os.makedirs(root / "txt")
    (root / "txt" / "corpus.txt").write_text(text)
    out = root / "bytes"
    subprocess.run([sys.executable, "prepare_data.py", "text", "--out", str(out), "--source",
                    f"en={root / 'txt'}", "--tokenizer", "bytes"], cwd=ROOT, check=True,
                   capture_output=True, env=launch_env())
    return str(out)


def command(args, nproc):
    if nproc == 1:
        return [sys.executable, "train.py", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "train.py", *args]


def run_train(args, nproc=1, ok=True, env=None):
    p = subprocess.run(command(args, nproc), cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=launch_env(env))
    if ok:
        assert p.returncode == 0, failure_text(p)
    return p


def run_here(args, ok=True):
    """train.py's run in this process, through the main the process runs: for a check of what a run computes,
    writes and prints, not of the process itself (its status on a signal, a second process, torchrun). The same
    code without the ~4 s a process spends importing torch, DCP and dynamo. Returns what run_train does: status 0,
    or 1 with the one line the process would print (interrupt.run's) as stderr."""
    out, err = io.StringIO(), io.StringIO()
    status = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            train.main(args)
        except train.ERRORS as e:
            print(train.error_line(e), file=sys.stderr)
            status = 1
    p = subprocess.CompletedProcess(args, status, out.getvalue(), err.getvalue())
    if ok:
        assert p.returncode == 0, failure_text(p)
    return p


def train_error(args):
    """train.py's one line for a run it refuses, from main in-process: the line interrupt.run prints, exiting 1
    (that the process prints just that: test_broken_config_files_are_one_line)."""
    with pytest.raises(train.ERRORS) as e:
        train.main(args)
    line = train.error_line(e.value)
    assert line and "\n" not in line and "Traceback" not in line, line
    return line


def rows(out_dir, field):
    """{step: value} of one metrics.jsonl field; a step may appear only once."""
    found = {}
    for line in open(os.path.join(out_dir, "metrics.jsonl")):
        row = json.loads(line)
        if field in row:
            assert row["step"] not in found, f"step {row['step']} logged twice"
            found[row["step"]] = row[field]
    return found


def load_export(path):
    blob = torch.load(path, weights_only=False)
    net = GPT(GPTConfig(**blob["model_config"]))
    net.load_state_dict(blob["model"])  # strict: clean names, nothing missing
    return blob, net


# ----------------------------------------------------------------------------- config system
def test_config_defaults_files_and_overrides(tmp_path):
    defaults = copy.deepcopy(train.DEFAULTS)
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("import math\n_half = 0.5\nlr = 3e-3 * _half\nmodel = dict(norm_eps=1e-5)\n")
    cfg = train.load_config([str(cfg_file), "--max_steps=500", "--out_dir=out/x", "--model.attn_gate=none",
                             "--weight_decay.matrix=0.3", "--compile", "--betas=(0.9, 0.99)"])
    assert cfg["lr"] == 1.5e-3 and cfg["max_steps"] == 500 and cfg["out_dir"] == "out/x"
    assert cfg["model"] == {"norm_eps": 1e-5, "attn_gate": "none"}  # dotted key merges
    assert cfg["weight_decay"] == {"matrix": 0.3, "embed": 0.0, "norm": 0.0}
    assert cfg["compile"] is True and cfg["betas"] == (0.9, 0.99)
    assert train.load_config(["--lr=1"])["lr"] == 1.0  # an int where a float is expected is fine
    # A whole dict from the command line merges too: the file's other model settings survive.
    merged = train.load_config([str(cfg_file), "--model={'attn_gate': 'headwise'}"])
    assert merged["model"] == {"norm_eps": 1e-5, "attn_gate": "headwise"}
    assert train.DEFAULTS == defaults  # no load mutated the defaults (the dicts are where it could)


@pytest.mark.parametrize("args, message", [
    (["--lrr=1e-3"], "unknown key 'lrr' in the command line; did you mean 'lr'?"),
    (["--lr=fast"], "lr='fast' is a str, expected a float"),
    (["--max_steps=1.5"], "max_steps=1.5 is a float, expected a int"),
    (["--compile=1"], "compile=1 is a int, expected a bool"),
    (["--weight_decay.matrx=0.3"], "did you mean 'weight_decay.matrix'"),
    (["--lr.x=1"], "lr is not a dict setting"),
    (["--schedule=linear"], "schedule='linear'"),
    (["--model.n_heads=3"], "n_heads"),
    (["--model_size=2b"], "unknown model size '2b'"),
    (["--model.d_model=100", "--model.n_head=3"], "divisible"),
    (["--warmup_steps=10", "--max_steps=10"], "warmup_steps=10 must be < max_steps=10"),
    (["--seq_len=2048"], "seq_len=2048 > the model's max_seq_len=1024"),
    (["--eval_batches=0"], "eval_batches=0 must be >= 1"),
    (["--decay_frac=1.5"], "decay_frac=1.5 must be between 0 and 1"),
    (["--schedule=wsd", "--max_steps=100", "--warmup_steps=30", "--decay_frac=0.75"],
     "schedule='wsd' decays from step 25 (decay_frac=0.75 of max_steps=100), before warmup_steps=30 end: "
     "lower decay_frac to <= 0.7 or warmup_steps to <= 25"),
    (["--lr=0.0"], "lr=0.0 must be > 0"),
    (["--betas=(0.9,)"], "betas=(0.9,) must be two numbers"),
    (["--betas=(0.9, 'x')"], "betas=(0.9, 'x') must be two numbers"),
    (["--weight_decay.matrix=-0.1"], "must be >= 0 in every group"),
    (["--grad_clip=-1.0"], "grad_clip=-1.0 must be >= 0"),
    (["--keep_steps=[0, 5000]"], "keep_steps=[0, 5000] must be whole steps between 0 and max_steps"),
    (["no_such_config.py"], "no such config file"),
    (["--lr=1e999"], "lr=inf is not a finite number"),
    (["--lr=1e39"], "lr=1e+39 is too large: AdamW's first step size lr/(1 - betas[0]) = 1e+40 is past float32's max"),
    (["--lr=1.0", "--weight_decay.matrix=1e39"], "weight_decay.matrix=1e+39 times lr=1 is past float32's max"),
    (["--peak_flops=1e999"], "peak_flops=inf is not a finite number"),
    (["--ATTN_BACKENDS=['eager']"], "unknown key 'ATTN_BACKENDS'"),  # a module constant, not a setting
    (["--gamma=-1"], "gamma=-1.0 is outside 0 < γ <= 3"),
    (["--gamma=0"], "gamma=0.0 is outside 0 < γ <= 3"),
    (["--gamma=50"], "gamma=50.0 is outside 0 < γ <= 3"),  # every weight exactly 0 in fp32
    (["--init_overrides={'^tok_emb': -21.3}"], "init_overrides['^tok_emb']=-21.3 is outside 0 < γ <= 3"),
    (["--init_overrides={'^lm_head': 3.5}"], "init_overrides['^lm_head']=3.5 is outside 0 < γ <= 3"),
    (["--init_overrides={'^lm_head': 'big'}"], "overrides pattern '^lm_head' maps to 'big': the value must be a number"),
    (["--init_overrides={'(': 0.5}"], "overrides pattern '(' is not a valid regex (missing ), unterminated subpattern"),
    (["--init_overrides={'^head': 0.5}"], "overrides pattern '^head' matches no parameter (names are like "),
    (["--out_dir="], "out_dir is empty: name the run folder"),
    (["--lr", "3e-4"], "config: --lr 3e-4: settings take one argument, write --lr=3e-4"),  # argparse's habit
    (["--compile", "False"], "write --compile=False"),
])
def test_config_errors(args, message):
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        train.load_config(args)
    assert message in str(e.value)


def adamw_limit(ok, hi=1e60):
    """The largest value x (to 1e-9 relative) for which ok(x) holds, by bisection in log space."""
    lo = 1e-3
    assert ok(lo) and not ok(hi)
    while hi / lo > 1 + 1e-9:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.0, 0.95), (0.99, 0.999)])
def test_lr_and_decay_bounds_are_where_torch_adamw_breaks(betas):
    """torch's own AdamW is the reference: the largest lr whose first step it takes, and the
    largest lr * weight_decay that leaves a weight of 1 finite. The config accepts just below each
    and refuses just above (lr=1e39 used to pass and die in AdamW with a traceback)."""
    def first_step(lr, wd, grad):
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.full((4,), grad)
        try:
            torch.optim.AdamW([p], lr=lr, betas=betas, weight_decay=wd).step()
        except RuntimeError as e:
            assert "without overflow" in str(e)
            return False
        return bool(p.isfinite().all())

    lr_max = adamw_limit(lambda lr: first_step(lr, 0.0, 1.0))
    beta_args = [f"--betas={betas}", "--weight_decay={'matrix': 0.0, 'embed': 0.0, 'norm': 0.0}"]
    assert train.load_config([f"--lr={lr_max * 0.999!r}", *beta_args])
    with pytest.raises(ValueError, match=r"lr=.* is too large: AdamW's first step size"):
        train.load_config([f"--lr={lr_max * 1.001!r}", *beta_args])
    decay_max = adamw_limit(lambda wd: first_step(1.0, wd, 0.0))  # no gradient: the decay alone
    assert train.load_config(["--lr=1.0", f"--weight_decay.norm={decay_max * 0.999!r}", f"--betas={betas}"])
    with pytest.raises(ValueError, match=r"weight_decay.norm=.* times lr=1 is past float32's max"):
        train.load_config(["--lr=1.0", f"--weight_decay.norm={decay_max * 1.001!r}", f"--betas={betas}"])


@pytest.mark.parametrize("seed", [-1, 0, 2**64 - 1, 2**64])
def test_seed_range_is_what_the_generators_take(seed):
    """A seed passes the config exactly when torch's generator and numpy's (the data order) take it;
    -1 and 2**64 used to pass and stop the run once training began."""
    try:
        torch.Generator().manual_seed(seed)
        np.random.default_rng([seed, 0])
        taken = True
    except (ValueError, RuntimeError):
        taken = False
    if taken:
        assert train.load_config([f"--seed={seed}"])["seed"] == seed
    else:
        with pytest.raises(ValueError, match=rf"seed={seed} must be in 0 <= seed < 2\*\*64"):
            train.load_config([f"--seed={seed}"])


def test_help_lists_every_setting_with_its_default():
    for flag in ("--help", "-h"):
        p = subprocess.run([sys.executable, "train.py", flag], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, env=launch_env())
        assert p.returncode == 0, failure_text(p)
        lines = p.stdout.splitlines()
        assert "usage: python train.py [CONFIG.py ...] [--key=value ...]" in lines and "export" in p.stdout
        settings = [line.split("=")[0].strip() for line in lines if re.match(r"  \w+=", line)]
        assert settings == list(train.DEFAULTS) and "ATTN_BACKENDS" not in settings
        assert f"  max_steps={train.DEFAULTS['max_steps']!r}  optimizer steps" in lines
        assert any(line.startswith(f"  gamma={train.DEFAULTS['gamma']!r}  every weight") for line in lines)
        assert not p.stderr


def test_config_file_errors_name_the_file_and_key(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("max_step = 10\n")
    with pytest.raises(ValueError, match=r"unknown key 'max_step' in .*bad.py; did you mean 'max_steps'"):
        train.load_config([str(bad)])
    with pytest.raises(ValueError, match="global_batch=32 is not a multiple of batch_size\\*world_size=32\\*3"):
        train.grad_accum(train.load_config([]), 3)


def test_schedules_by_hand():
    cfg = train.load_config(["--lr=1.0", "--min_lr_ratio=0.1", "--warmup_steps=10", "--max_steps=110"])
    lr = [train.lr_at(cfg, s) for s in range(110)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)      # linear warmup to the peak
    assert lr[10] == pytest.approx(1.0) and lr[-1] == pytest.approx(0.1)    # cosine from peak to the floor
    assert lr[10 + 99 // 2] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 49 / 99)))
    cfg = train.load_config(["--lr=1.0", "--min_lr_ratio=0.0", "--warmup_steps=10", "--max_steps=110",
                             "--schedule=wsd", "--decay_frac=0.2"])
    lr = [train.lr_at(cfg, s) for s in range(110)]
    assert lr[10:88] == [1.0] * 78                              # stable until the last 22 steps
    assert lr[88] == pytest.approx(1 - 1 / 22) and lr[-1] == pytest.approx(0.0)
    # The decay may start right where warmup ends (the largest decay_frac the config check allows).
    cfg = train.load_config(["--lr=1.0", "--min_lr_ratio=0.0", "--warmup_steps=10", "--max_steps=110",
                             "--schedule=wsd", f"--decay_frac={100 / 110}"])
    lr = [train.lr_at(cfg, s) for s in range(110)]
    assert lr[9] == pytest.approx(1.0) and lr[10] == pytest.approx(1 - 1 / 100) and lr[-1] == pytest.approx(0.0)


# ----------------------------------------------------------------------------- shipped configs
def expected_params(c):
    """Parameter count from the architecture by hand, independent of model.num_params()."""
    d, hd = c.d_model, c.head_dim
    attn = d * c.n_head * hd * 2 + 2 * d * c.n_kv_head * hd + {"elementwise": d * c.n_head * hd,
                                                               "headwise": d * c.n_head, "none": 0}[c.attn_gate]
    mats = 3 if c.mlp == "swiglu" else 2
    mlp = c.n_experts * (mats * d * c.d_expert + d) if c.n_experts else mats * d * c.d_ff
    return c.vocab_size * d * (1 if c.tie_embeddings else 2) + c.n_layer * (attn + mlp + 2 * d) + d


CONFIGS = sorted(glob.glob(os.path.join(ROOT, "config", "[!_]*.py")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_dry_run(path, capsys):
    cfg = train.load_config([path])
    cpu_config = os.path.basename(path).startswith(("anchor_", "tiny_", "cpu_"))
    plan = print_plan(cfg, 1 if cpu_config else 8)
    mcfg = train.model_config(cfg, "cuda")
    assert plan["params"]["total"] == expected_params(mcfg)
    assert plan["tokens_per_step"] == cfg["global_batch"] * cfg["seq_len"]
    assert "FLOPs/token" in capsys.readouterr().out
    if not cpu_config:  # sized for one node of 80 GB GPUs, and as large as its name says
        assert plan["memory_bytes"] < 70 * 2**30
        name = re.search(r"gamma[0-9]+_(moe)?([0-9p]+)b", os.path.basename(path))
        billions = float(name.group(2).replace("p", "."))
        assert abs(plan["params"]["total"] / (billions * 1e9) - 1) < 0.10, plan["params"]
        assert mcfg.max_seq_len >= cfg["seq_len"] and mcfg.attn_backend == "flex"


def test_config_pairs_differ_only_in_the_recipe():
    for path in glob.glob(os.path.join(ROOT, "config", "*gamma1*.py")):
        a = train.load_config([path])
        b = train.load_config([path.replace("gamma1", "gamma05")])
        assert (a["gamma"], a["model"]["norm_eps"], a["model"]["attn_gate"]) == (1.0, 1e-12, "elementwise")
        assert (b["gamma"], b["model"]["norm_eps"], b["model"]["attn_gate"]) == (0.5, 1e-5, "none")
        for cfg in (a, b):
            del cfg["gamma"], cfg["model"]["norm_eps"], cfg["model"]["attn_gate"], cfg["out_dir"]
        assert a == b, path


# ----------------------------------------------------------------------------- training runs
@pytest.mark.slow
def test_first_log_line_comes_after_step_one(data_dir, tmp_path):
    out = tmp_path / "run"
    p = run_here([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=3", "--log_interval=10",
                  "--eval_interval=3", "--ckpt_interval=3"])
    logged = [line.split()[1] for line in p.stdout.splitlines() if re.match(r"step \d+/", line)]
    assert logged == ["1/3", "3/3"] and "(first step: compile and warm-up included)" in p.stdout
    assert sorted(rows(out, "loss")) == [3]  # metrics.jsonl keeps log_interval's rows (and the last step)


def test_loss_falls(data_dir, tmp_path):
    out = str(tmp_path / "run")
    run_here([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=60", "--seq_len=64",
              "--global_batch=16", "--batch_size=16", "--eval_interval=60", "--eval_batches=2",
              "--ckpt_interval=20", "--keep_last=1", "--keep_steps=[0, 7]"])
    # keep_last=1 removed steps 20 and 40; keep_steps kept the init and step 7.
    assert sorted(os.listdir(out)) == ["ckpt_00000000", "ckpt_00000007", "ckpt_00000060", "config.json", "metrics.jsonl",
                                       "train.lock"]
    init_path = str(tmp_path / "init.pt")
    checkpoint.export(os.path.join(out, "ckpt_00000000"), init_path)
    blob, at_init = load_export(init_path)
    fresh = GPT(GPTConfig(**blob["model_config"]))
    init_model_(fresh, gamma=blob["config"]["gamma"], seed=blob["config"]["seed"])
    for k, v in fresh.state_dict().items():
        assert torch.equal(at_init.state_dict()[k], v), k
    loss, val = rows(out, "loss"), rows(out, "val_loss")
    saved = json.load(open(os.path.join(out, "config.json")))
    meta = json.load(open(os.path.join(out, "ckpt_00000060", "meta.json")))
    assert saved["max_steps"] == meta["config"]["max_steps"] == 60 and meta["step"] == 60
    assert meta["model_config"]["d_model"] == 64 and meta["data_meta"]["tokenizer"] == "bytes"
    assert sorted(loss) == list(range(1, 61))
    assert sum(loss[s] for s in range(56, 61)) / 5 < loss[1] - 1.5   # bytes: ~5.5 -> well under 4
    assert val[60] < val[0] - 1.5
    # The logged condensation metrics are those of the checkpointed weights (numpy reference).
    path = str(tmp_path / "final.pt")
    checkpoint.export(os.path.join(out, "ckpt_00000060"), path)
    _, net = load_export(path)
    logged = rows(out, "weights")[60]
    for name in ("layers.0.attn.wq.weight", "layers.1.mlp.w_up.weight"):
        w = net.get_parameter(name).detach().double().numpy()
        s = np.linalg.svd(w, compute_uv=False)
        unit = w / np.linalg.norm(w, axis=1, keepdims=True)
        cos = np.abs(unit @ unit.T)[~np.eye(len(w), dtype=bool)]
        assert logged[name]["stable_rank"] == pytest.approx((s ** 2).sum() / s[0] ** 2, rel=1e-6)
        assert logged[name]["mean_abs_cos"] == pytest.approx(cos.mean(), rel=1e-6)


def masked_copy(data_dir, out_dir, seed=0):
    """The same data with a random loss mask over ~a third of the targets, in runs, so
    micro-batches carry very different numbers of loss tokens (some none at all)."""
    from data import read_shard
    from prepare_data import write_shard
    shutil.copytree(data_dir, out_dir)
    rng = np.random.default_rng(seed)
    for path in glob.glob(os.path.join(out_dir, "*.bin")):
        shard = read_shard(path)
        runs = rng.random(len(shard.tokens) // 64 + 1) < 0.35
        mask = np.repeat(runs, 64)[:len(shard.tokens)].astype(np.uint8)
        write_shard(path, np.array(shard.tokens), np.array(shard.docs), mask)
    return out_dir


@pytest.fixture(scope="module")
def moe_runs(data_dir, tmp_path_factory):
    """The same MoE training (bias-balanced routing, so counts must be summed over ranks) on
    unevenly loss-masked data, as 1 process x 1 micro-batch of 4, 1 process x 4 micro-batches
    of 1, 2 ranks x 1 x 2, and 2 ranks x 2 micro-batches of 1 with activation checkpointing."""
    root = tmp_path_factory.mktemp("moe")
    masked = masked_copy(data_dir, str(root / "masked"))
    base = [*MOE, f"--data_dir={masked}"]
    runs = {"1x4": (1, 4, []), "4x1": (1, 1, []), "fsdp2": (2, 2, []),
            "fsdp2_accum_ac": (2, 1, ["--model.activation_checkpointing=True"])}
    for name, (nproc, batch, extra) in runs.items():
        args = [*base, f"--out_dir={root / name}", f"--batch_size={batch}", *extra]
        if nproc == 1:
            run_here(args)
        else:
            run_train(args, nproc=nproc)
    return root, base


@pytest.mark.slow
@pytest.mark.parametrize("name", ["4x1", "fsdp2", "fsdp2_accum_ac"])
def test_accumulation_and_fsdp_match_one_process(moe_runs, name):
    root, _ = moe_runs
    ref, got = rows(root / "1x4", "loss"), rows(root / name, "loss")
    assert sorted(ref) == sorted(got) == list(range(1, 11))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), step
    # Adam hides a wrong gradient scale from the losses; the global grad norm does not.
    ref, got = rows(root / "1x4", "grad_norm"), rows(root / name, "grad_norm")
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    assert rows(root / name, "val_loss")[10] == pytest.approx(rows(root / "1x4", "val_loss")[10], abs=1e-5)
    # Expert loads are counted over the whole global batch (summed over ranks), so every
    # split logs the single process's loads.
    loads, ref_loads = rows(root / name, "expert_load"), rows(root / "1x4", "expert_load")
    assert len(loads[10]) == 2
    for layer, ref_layer in zip(loads[10], ref_loads[10]):
        assert layer == pytest.approx(ref_layer, abs=1e-6)


@pytest.mark.slow
def test_export_of_sharded_checkpoint_matches_single_process(moe_runs, tmp_path):
    root, _ = moe_runs
    exported = {}
    for name in ("1x4", "fsdp2"):
        path = str(tmp_path / f"{name}.pt")
        checkpoint.export(str(root / name / "ckpt_00000010"), path)  # in this process: no process group
        exported[name] = load_export(path)
    (blob1, net1), (blob2, net2) = exported["1x4"], exported["fsdp2"]
    assert blob1["step"] == blob2["step"] == 10 and blob2["config"]["batch_size"] == 2
    assert blob1["data_meta"]["tokenizer"] == "bytes"
    sd1, sd2 = net1.state_dict(), net2.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        torch.testing.assert_close(sd1[k], sd2[k], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_resume_on_another_world_size(moe_runs, tmp_path):
    root, base = moe_runs
    out = tmp_path / "resume2"
    os.makedirs(out)
    shutil.copytree(root / "1x4" / "ckpt_00000005", out / "ckpt_00000005")
    p = run_train([*base, f"--out_dir={out}", "--batch_size=2"], nproc=2)
    assert "world size 1 -> 2" in p.stdout and "data order is unchanged" in p.stdout
    ref, got = rows(root / "1x4", "loss"), rows(out, "loss")
    assert sorted(got) == list(range(6, 11))
    for step in got:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), step


@pytest.mark.slow
def test_sigkill_and_resume_is_bitwise_exact(data_dir, tmp_path):
    # The killed run is a process; the reference and the resume are runs in this process (run_here), which compute
    # what a process does (one machine, one thread: bitwise).
    args = [*TINY, f"--data_dir={data_dir}", "--max_steps=60", "--ckpt_interval=10", "--eval_interval=25"]
    ref = str(tmp_path / "ref")
    run_here([*args, f"--out_dir={ref}"])
    out = str(tmp_path / "killed")
    proc = subprocess.Popen(command([*args, f"--out_dir={out}"], 1), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=launch_env())
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(out, "ckpt_00000020")) and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    done = checkpoint.complete_checkpoints(out)
    assert done and not done[-1].endswith("ckpt_00000060"), "the run finished before it was killed"
    os.makedirs(os.path.join(out, "ckpt_99999999"))    # incomplete (no meta.json): ignored
    os.makedirs(os.path.join(out, "tmp_ckpt_00000999"))  # a save cut short: removed
    p = run_here([*args, f"--out_dir={out}"])
    assert f"resumed from {done[-1]}" in p.stdout
    assert not os.path.exists(os.path.join(out, "tmp_ckpt_00000999"))
    assert [os.path.basename(c) for c in checkpoint.complete_checkpoints(ref)] == ["ckpt_00000050", "ckpt_00000060"]  # keep_last=2
    for field in ("loss", "grad_norm", "val_loss"):
        assert rows(out, field) == rows(ref, field), field  # every step, bitwise


@pytest.mark.slow
def test_nan_guard_stops_and_keeps_last_checkpoint(data_dir, tmp_path):
    out = str(tmp_path / "nan")
    p = run_here([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=12",
                  "--ckpt_interval=5", "--debug_nan_step=3"], ok=False)
    assert p.returncode != 0 and "at step 3" in p.stderr and "No checkpoint of this run was saved yet" in p.stderr
    # no checkpoint yet: the next run starts over, and its metrics replace the failed run's
    p = run_here([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=12",
                  "--ckpt_interval=5", "--debug_nan_step=8"], ok=False)
    assert p.returncode != 0
    last = os.path.join(out, "ckpt_00000005")
    assert "non-finite loss nan" in p.stderr and "at step 8" in p.stderr and last in p.stderr
    assert "adding --allow_resume_changes=True" in p.stderr  # a resume with a lower lr is another experiment
    assert checkpoint.complete_checkpoints(out) == [last]
    assert sorted(rows(out, "loss")) == list(range(1, 8))  # once each; nothing for the poisoned step
    assert sorted(rows(out, "val_loss")) == [0, 5]
    path = str(tmp_path / "last.pt")
    checkpoint.export(last, path)
    blob, net = load_export(path)
    assert blob["step"] == 5 and all(torch.isfinite(v).all() for v in blob["model"].values())
    # the run continues from the intact checkpoint once the cause is gone
    run_here([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=12", "--ckpt_interval=5"])
    assert max(rows(out, "loss")) == 12
    assert "already holds checkpoints (ckpt_00000012)" in train_error([*TINY, f"--data_dir={data_dir}",
                                                                      f"--out_dir={out}", "--resume=False"])


@pytest.mark.slow
def test_resuming_a_different_model_is_a_one_line_error(moe_runs, tmp_path):
    root, base = moe_runs
    out = tmp_path / "other_model"
    os.makedirs(out)
    shutil.copytree(root / "1x4" / "ckpt_00000005", out / "ckpt_00000005")
    assert "holds a different model (n_experts 4 there, 8 now)" in train_error([*base, f"--out_dir={out}",
                                                                               "--model.n_experts=8"])


def test_half_written_metrics_row_and_missing_export_folder(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')
    checkpoint.truncate_metrics(str(path), 2)
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n'
    with pytest.raises(ValueError, match="not a complete checkpoint folder"):
        checkpoint.export(str(tmp_path / "ckpt_00000099"), str(tmp_path / "x.pt"))


# ----------------------------------------------------------------------------- ETA and live curves
def test_throughput_after_the_first_line_leaves_out_the_first_step(monkeypatch):
    """The first step (compile, warm-up) has a line of its own; the next line's tok/s covers only
    the steps after it. By hand: 128 tokens a step, step 1 done at 7 s, step 4 at 10 s: 128/7 then
    3 * 128/3."""
    printed, recorded = [], []
    monkeypatch.setattr(train, "log0", printed.append)
    metrics = type("Rows", (), {"spent": {"eval_s": [], "bench_s": [], "ckpt_s": []},
                                "record": staticmethod(recorded.append)})()
    cfg = train.load_config([*TINY, "--log_interval=4", "--max_steps=100"])
    log_step = train.StepLog(cfg, metrics, torch.device("cpu"), 1.0, 0.0, 0)
    for step, seconds in ((1, 7.0), (2, 8.0), (3, 9.0), (4, 10.0)):
        log_step({"step": step, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0}, seconds)
    assert [line.split()[1] for line in printed] == ["1/100", "4/100"]
    assert f"{128 / 7:,.0f} tok/s" in printed[0] and f"{128:,.0f} tok/s" in printed[1]
    assert [row["step"] for row in recorded] == [4] and recorded[0]["tokens_per_s"] == pytest.approx(128.0)


def test_eta_counts_the_evaluations_and_checkpoints_still_due():
    cfg = {"max_steps": 100, "eval_interval": 30, "ckpt_interval": 40, "keep_steps": [0, 45, 80, 100],
           "bench_interval": 0}
    spent = {"eval_s": [2.0, 4.0], "bench_s": [], "ckpt_s": [10.0]}
    # after step 41: 59 steps; evaluations at 60, 90, 100; checkpoints at 45 (kept), 80, 100
    assert train.eta_seconds(cfg, 41, 0.5, spent) == 59 * 0.5 + 3 * 3.0 + 3 * 10.0
    # at step 90 its own evaluation is still due (it runs after the log line), then 100's
    assert train.eta_seconds(cfg, 90, 0.5, spent) == 10 * 0.5 + 2 * 3.0 + 1 * 10.0
    assert train.eta_seconds(cfg, 41, 0.5, {"eval_s": [], "bench_s": [], "ckpt_s": []}) == 59 * 0.5  # nothing timed
    # benchmarks every 25 steps, 7 s each: after step 41 at 50, 75, 100
    with_bench = {**cfg, "bench_interval": 25}
    want = 59 * 0.5 + 3 * 3.0 + 3 * 7.0 + 3 * 10.0
    assert train.eta_seconds(with_bench, 41, 0.5, {**spent, "bench_s": [7.0]}) == want
    rng = random.Random(0)
    for _ in range(500):  # the closed form against counting step by step
        last, interval = rng.randint(1, 60), rng.randint(1, 25)
        first, extra = rng.randint(1, last), rng.sample(range(last + 1), min(last + 1, rng.randint(0, 5)))
        want = sum(s % interval == 0 or s == last or s in extra for s in range(first, last + 1))
        assert train.steps_due(first, last, interval, extra) == want


HAS_WANDB = importlib.util.find_spec("wandb") is not None
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.fixture(scope="module")
def curves_run(data_dir, tmp_path_factory):
    """6 steps whose time goes mostly to evaluation (30 validation batches every 2 steps against
    one training batch a step), logged to TensorBoard and, when installed, to wandb offline; then
    resumed from its step-3 checkpoint, which redoes steps 4-6. Returns the run folder and the
    first run's metrics rows."""
    out = tmp_path_factory.mktemp("curves") / "run"
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=6", "--eval_interval=2",
            "--eval_batches=30", "--ckpt_interval=3", "--keep_steps=[0]", "--keep_last=5"]
    args += [f"--tensorboard_dir={out / 'tb'}"] if HAS_TENSORBOARD else []
    wandb = ["--wandb_log=True", "--wandb_project=smallinit-test", "--wandb_run_name=curves-probe"] if HAS_WANDB else []
    run_train([*args, *wandb], env={"WANDB_MODE": "offline"})
    first = [json.loads(line) for line in open(out / "metrics.jsonl")]
    shutil.rmtree(out / "ckpt_00000006")
    assert "resumed from" in run_train(args).stdout
    return out, first


@pytest.mark.slow
def test_eta_includes_evaluation_time(curves_run):
    _, metrics = curves_run
    tokens_step = 4 * 32
    # hand count, steps 1..6: evaluations at 2, 4, 6 and checkpoints at 3, 6 still due at each log
    evals_due = {1: 3, 2: 3, 3: 2, 4: 2, 5: 1, 6: 1}
    ckpts_due = {1: 2, 2: 2, 3: 2, 4: 1, 5: 1, 6: 1}
    train_rows = [r for r in metrics if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 7))
    for r in train_rows:
        k = r["step"]
        evals = [e["eval_s"] for e in metrics if "eval_s" in e and e["step"] < k]  # timed before this log
        ckpts = [c["ckpt_s"] for c in metrics if "ckpt_s" in c and c["step"] < k]
        hand = ((6 - k) * tokens_step / r["tokens_per_s"] + evals_due[k] * sum(evals) / len(evals)
                + ckpts_due[k] * sum(ckpts) / len(ckpts))
        assert r["eta_s"] == pytest.approx(hand, rel=1e-9), k
        # the identity above tells an ETA with these terms from one of training steps alone only
        # if they are far above rel=1e-9 of it; how far depends on the machine, so no more is said
        assert min(evals + ckpts) > 1e-6 * r["eta_s"], k


def logged_scalars(rows_):
    """{curve name: {step: value}} that the loggers must show for metrics rows, flattened here."""
    want = {}
    for row in rows_:
        for key, value in row.items():
            if key == "weights":
                for matrix, stats in value.items():
                    for stat, v in stats.items():
                        want.setdefault(f"weights/{matrix}/{stat}", {})[row["step"]] = v
            elif key != "step" and value is not None:
                want.setdefault(key, {})[row["step"]] = value
    return want


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed (optional: pip install tensorboard)")
def test_tensorboard_scalars_equal_metrics_rows(curves_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, _ = curves_run
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    want = logged_scalars(rows)
    assert all(row.get("mfu") is None for row in rows)  # CPU: no nominal peak, no MFU
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "eta_s",
            "weights/layers.1.attn.wq.weight/stable_rank", "weights/layers.0.mlp.w_up.weight/mean_abs_cos"} <= set(want)
    assert set(acc.Tags()["scalars"]) == set(want)
    for name, by_step in want.items():
        events = acc.Scalars(name)
        # each step once: the resumed run's purge_step hid the first run's steps 4-6
        assert sorted(e.step for e in events) == sorted(by_step), name
        for e in events:
            assert e.value == pytest.approx(by_step[e.step], rel=1e-6), (name, e.step)  # stored as float32


def wandb_records(path):
    """The protobuf records of a .wandb file: W&B's LevelDB-style log (a 7-byte header, then 32 KiB
    blocks of records with a 7-byte head: crc32, length, type full=1/first=2/middle=3/last=4)."""
    from wandb.proto import wandb_internal_pb2
    data, pos, pending = open(path, "rb").read(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if room < 7 or kind == 0:  # the block's zero padding
            pos += room
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


@pytest.mark.slow
@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (optional: pip install wandb)")
def test_wandb_offline_run_holds_metrics_rows(curves_run):
    out, metrics = curves_run
    (path,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, names = {}, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            names.append((record.run.project, record.run.display_name))
        elif kind == "history":
            # the name is in `key`, or (as wandb 0.31 writes it) as a path in `nested_key`
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[items["_step"]] = items
    assert names == [("smallinit-test", "curves-probe")]
    want = logged_scalars(metrics)
    assert sorted(history) == sorted({step for by_step in want.values() for step in by_step})
    for name, by_step in want.items():
        for step, value in by_step.items():
            assert history[step][name] == pytest.approx(value, rel=1e-12), (name, step)
    # nothing else was logged but wandb's own bookkeeping
    assert {k for h in history.values() for k in h if not k.startswith("_")} == set(want)


@pytest.mark.parametrize("key, package", [("--tensorboard_dir=tb", "tensorboard"), ("--wandb_log=True", "wandb")])
def test_missing_logger_package_fails_at_start_up(monkeypatch, key, package):
    monkeypatch.setitem(sys.modules, package, None)  # import (and find_spec) now see no such package
    with pytest.raises(ValueError, match=f"needs the {package} package: pip install {package}"):
        train.load_config([key])  # the config check, before any data, model or training step
