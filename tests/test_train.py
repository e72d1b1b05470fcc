"""train.py: config system, schedules, shipped configs (dry run), and real CPU training runs:
loss falls, grad accumulation and 2-rank FSDP2 match one process, exact resume after SIGKILL,
resume on another world size, compile matches eager, NaN guard, export."""
import copy
import glob
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import train
from model import GPT, GPTConfig, init_model_

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A tiny model and batch: each run is dominated by process start-up (~3 s).
TINY = ["--model_size=tiny", "--seq_len=32", "--global_batch=4", "--batch_size=4", "--warmup_steps=2", "--lr=3e-3",
        "--log_interval=1", "--eval_interval=5", "--eval_batches=1"]


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A byte-level dataset made by prepare_data.py from generated text (word salad with
    structure, so a tiny model's loss falls fast)."""
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    words = "the cat sat on a mat and dog ran to big red house with small green tree".split()
    text = "\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) + "."
                       for _ in range(600))
    os.makedirs(root / "txt")
    (root / "txt" / "corpus.txt").write_text(text)
    out = root / "bytes"
    subprocess.run([sys.executable, "prepare_data.py", "text", "--out", str(out), "--source",
                    f"en={root / 'txt'}", "--tokenizer", "bytes"], cwd=ROOT, check=True,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return str(out)


def command(args, nproc):
    if nproc == 1:
        return [sys.executable, "train.py", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "train.py", *args]


def run_train(args, nproc=1, ok=True):
    p = subprocess.run(command(args, nproc), cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if ok:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


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
    (["--lr=0.0"], "lr=0.0 must be > 0"),
    (["--betas=(0.9,)"], "betas=(0.9,) must be two numbers"),
    (["--weight_decay.matrix=-0.1"], "must be >= 0 in every group"),
    (["--grad_clip=-1.0"], "grad_clip=-1.0 must be >= 0"),
    (["--keep_steps=[0, 5000]"], "keep_steps=[0, 5000] must be whole steps between 0 and max_steps"),
    (["no_such_config.py"], "no such config file"),
])
def test_config_errors(args, message):
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        train.load_config(args)
    assert message in str(e.value)


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
    cpu_config = os.path.basename(path).startswith(("anchor_", "tiny_"))
    plan = train.print_plan(cfg, 1 if cpu_config else 8)
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
def test_loss_falls(data_dir, tmp_path):
    out = str(tmp_path / "run")
    run_train([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=60", "--seq_len=64",
               "--global_batch=16", "--batch_size=16", "--eval_interval=60", "--eval_batches=2",
               "--ckpt_interval=20", "--keep_last=1", "--keep_steps=[0, 7]"])
    # keep_last=1 removed steps 20 and 40; keep_steps kept the init and step 7.
    assert sorted(os.listdir(out)) == ["ckpt_00000000", "ckpt_00000007", "ckpt_00000060", "config.json", "metrics.jsonl"]
    init_path = str(tmp_path / "init.pt")
    train.export(os.path.join(out, "ckpt_00000000"), init_path)
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
    train.export(os.path.join(out, "ckpt_00000060"), path)
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
    from prepare_data import read_shard, write_shard
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
    base = [*TINY, f"--data_dir={masked}", "--max_steps=10", "--ckpt_interval=5",
            "--model={'n_experts': 4, 'top_k': 2, 'moe_bias_rate': 0.05}"]
    runs = {"1x4": (1, 4, []), "4x1": (1, 1, []), "fsdp2": (2, 2, []),
            "fsdp2_accum_ac": (2, 1, ["--model.activation_checkpointing=True"])}
    for name, (nproc, batch, extra) in runs.items():
        run_train([*base, f"--out_dir={root / name}", f"--batch_size={batch}", *extra], nproc=nproc)
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
        train.export(str(root / name / "ckpt_00000010"), path)  # in this process: no process group
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
    args = [*TINY, f"--data_dir={data_dir}", "--max_steps=150", "--ckpt_interval=10", "--eval_interval=25"]
    ref = str(tmp_path / "ref")
    run_train([*args, f"--out_dir={ref}"])
    out = str(tmp_path / "killed")
    proc = subprocess.Popen(command([*args, f"--out_dir={out}"], 1), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(out, "ckpt_00000020")) and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    done = train.complete_checkpoints(out)
    assert done and not done[-1].endswith("ckpt_00000150"), "the run finished before it was killed"
    os.makedirs(os.path.join(out, "ckpt_99999999"))    # incomplete (no meta.json): ignored
    os.makedirs(os.path.join(out, "tmp_ckpt_00000999"))  # a save cut short: removed
    p = run_train([*args, f"--out_dir={out}"])
    assert f"resumed from {done[-1]}" in p.stdout
    assert not os.path.exists(os.path.join(out, "tmp_ckpt_00000999"))
    assert [os.path.basename(c) for c in train.complete_checkpoints(ref)] == ["ckpt_00000140", "ckpt_00000150"]  # keep_last=2
    for field in ("loss", "grad_norm", "val_loss"):
        assert rows(out, field) == rows(ref, field), field  # every step, bitwise


@pytest.mark.slow
def test_compiled_run_matches_eager(data_dir, tmp_path):
    args = [*TINY, f"--data_dir={data_dir}", "--max_steps=6", "--ckpt_interval=6"]
    run_train([*args, f"--out_dir={tmp_path / 'eager'}"])
    run_train([*args, f"--out_dir={tmp_path / 'compiled'}", "--compile=True"])
    eager, compiled = rows(tmp_path / "eager", "loss"), rows(tmp_path / "compiled", "loss")
    assert sorted(compiled) == list(range(1, 7))
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-4), step


@pytest.mark.slow
def test_nan_guard_stops_and_keeps_last_checkpoint(data_dir, tmp_path):
    out = str(tmp_path / "nan")
    p = run_train([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=12",
                   "--ckpt_interval=5", "--debug_nan_step=3"], ok=False)
    assert p.returncode != 0 and "at step 3" in p.stderr and "Last good checkpoint: none" in p.stderr
    # no checkpoint yet: the next run starts over, and its metrics replace the failed run's
    p = run_train([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=12",
                   "--ckpt_interval=5", "--debug_nan_step=8"], ok=False)
    assert p.returncode != 0
    last = os.path.join(out, "ckpt_00000005")
    assert "non-finite loss nan" in p.stderr and "at step 8" in p.stderr and last in p.stderr
    assert train.complete_checkpoints(out) == [last]
    assert sorted(rows(out, "loss")) == list(range(1, 8))  # once each; nothing for the poisoned step
    assert sorted(rows(out, "val_loss")) == [0, 5]
    path = str(tmp_path / "last.pt")
    subprocess.run([sys.executable, "train.py", "export", last, path], cwd=ROOT, check=True, capture_output=True)
    blob, net = load_export(path)
    assert blob["step"] == 5 and all(torch.isfinite(v).all() for v in blob["model"].values())
    # the run continues from the intact checkpoint once the cause is gone
    run_train([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=12", "--ckpt_interval=5"])
    assert max(rows(out, "loss")) == 12
    p = run_train([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--resume=False"], ok=False)
    assert p.returncode == 1 and "already holds checkpoints (ckpt_00000012)" in p.stderr


@pytest.mark.slow
def test_resuming_a_different_model_is_a_one_line_error(moe_runs, tmp_path):
    root, base = moe_runs
    out = tmp_path / "other_model"
    os.makedirs(out)
    shutil.copytree(root / "1x4" / "ckpt_00000005", out / "ckpt_00000005")
    p = run_train([*base, f"--out_dir={out}", "--model.n_experts=8"], ok=False)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "holds a different model (n_experts 4 there, 8 now)" in p.stderr


def test_half_written_metrics_row_and_missing_export_folder(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')
    train.truncate_metrics(str(path), 2)
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n'
    with pytest.raises(ValueError, match="not a complete checkpoint folder"):
        train.export(str(tmp_path / "ckpt_00000099"), str(tmp_path / "x.pt"))
