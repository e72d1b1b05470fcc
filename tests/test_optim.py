"""optim.py: optimizer="muon" against a hand-written Newton-Schulz step in float64, the parameter split,
its training and bitwise resume through train.py, 2 ranks against one process, and bench timing the
optimizer train.py builds."""
import math
import shutil
from dataclasses import replace

import pytest
import torch

import bench
import train
from conftest import tiny
from init import init_model_
from model import GPT
from optim import build_optimizer
from test_train import TINY, byte_dataset, rows, run_here, run_train


def newton_schulz(g, steps=5):
    """Keller Jordan's quintic iteration (Muon's coefficients), in float64: X <- aX + (bA + cA²)X with
    A = XXᵀ, on the wide orientation of g scaled to Frobenius norm 1."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = (x.T if tall else x) / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon_settings(**over):
    return {**train.DEFAULTS, "optimizer": "muon", "lr": 0.02, "weight_decay": {"matrix": 0.1, "embed": 0.0,
                                                                                 "norm": 0.0}, **over}


def test_muon_takes_the_block_matrices_and_adamw_the_rest():
    net = GPT(tiny(n_experts=4, top_k=2))
    opt = build_optimizer(net, muon_settings(), torch.device("cpu"))
    muon, adamw = opt
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    names = {id(p): n for n, p in net.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert in_muon | in_adamw == set(names.values()) and not in_muon & in_adamw
    for n, p in net.named_parameters():
        block_matrix = n.startswith("layers.") and p.dim() == 2
        assert (n in in_muon) == block_matrix, n
    assert any("router" in n for n in in_muon) and any(".attn.wq." in n for n in in_muon)
    assert any(p.dim() == 3 for n, p in net.named_parameters() if n in in_adamw)  # MoE experts
    # The groups keep their kinds' decay, which a resume re-applies by name.
    assert [(g["name"], g["weight_decay"]) for g in opt.param_groups] == [
        ("matrix", 0.1), ("matrix", 0.1), ("embed", 0.0), ("norm", 0.0)]


def test_muon_step_is_newton_schulz_of_the_nesterov_momentum():
    torch.manual_seed(0)
    net = GPT(tiny(d_model=64, n_head=4))
    init_model_(net, gamma=0.5)
    cfg = muon_settings()
    opt = build_optimizer(net, cfg, torch.device("cpu"))
    matrices = [p for g in opt[0].param_groups for p in g["params"]]
    shapes = {tuple(p.shape) for p in matrices}
    assert (64, 64) in shapes and any(a > b for a, b in shapes) and any(a < b for a, b in shapes)  # square, tall, wide
    weights = [p.detach().double().clone() for p in matrices]
    bufs = [torch.zeros_like(w) for w in weights]
    m, lr, wd = cfg["muon_momentum"], cfg["lr"], cfg["weight_decay"]["matrix"]
    for step in range(3):
        for p in net.parameters():
            p.grad = torch.randn_like(p)
        grads = [p.grad.double() for p in matrices]
        opt.step()
        for i, (p, g) in enumerate(zip(matrices, grads)):
            bufs[i] = m * bufs[i] + (1 - m) * g
            nesterov = (1 - m) * g + m * bufs[i]
            step_size = lr * 0.2 * math.sqrt(max(p.shape))  # scaled to AdamW's update RMS
            weights[i] = weights[i] * (1 - lr * wd) - step_size * newton_schulz(nesterov)
            # Newton-Schulz runs in bf16 (8 bits of mantissa over 5 iterations); the update's
            # entries are ~0.3, each one step_size (~0.03-0.06) times that.
            torch.testing.assert_close(p.detach().double(), weights[i], atol=step_size * 0.03, rtol=0,
                                       msg=f"step {step + 1}, matrix {tuple(p.shape)}")


def test_bench_times_the_optimizer_train_builds():
    v = {x.name: x for x in bench.cpu_variants()}
    for name, kinds in (("default", [torch.optim.AdamW]), ("muon", [torch.optim.Muon, torch.optim.AdamW])):
        small = replace(v[name], group=replace(v[name].group, config=dict(
            vocab_size=50, n_layer=1, n_head=2, d_model=32), batch=2, seq_len=8))
        runner = bench.Runner(small, torch.device("cpu"))
        built = build_optimizer(runner.model, {**train.DEFAULTS, "optimizer": small.optimizer}, torch.device("cpu"))
        assert [type(o) for o in runner.opt] == [type(o) for o in built] == kinds
        assert [len(g["params"]) for g in runner.opt.param_groups] == [len(g["params"]) for g in built.param_groups]


@pytest.fixture(scope="module")
def muon_runs(tmp_path_factory):
    """One tiny muon run of 6 steps (checkpoints at 3 and 6); its resume from step 3; the same 6 steps on
    2 ranks."""
    root = tmp_path_factory.mktemp("muon")
    data = byte_dataset(root / "data")
    args = [*TINY, f"--data_dir={data}", "--optimizer=muon", "--max_steps=6", "--ckpt_interval=3",
            "--eval_interval=3", "--keep_last=4"]
    run_here([*args, f"--out_dir={root / 'ref'}"])
    (root / "resumed").mkdir()
    shutil.copytree(root / "ref" / "ckpt_00000003", root / "resumed" / "ckpt_00000003")
    resumed = run_here([*args, f"--out_dir={root / 'resumed'}"])
    run_train([*args, f"--out_dir={root / 'ranks2'}", "--batch_size=2"], nproc=2)
    return root, resumed.stdout


@pytest.mark.slow
def test_muon_trains_and_resumes_bitwise(muon_runs):
    root, resumed_log = muon_runs
    assert "resumed from" in resumed_log and "ckpt_00000003" in resumed_log
    loss = rows(root / "ref", "loss")
    assert loss[6] < loss[1] - 0.3  # it trains: random bytes start at ln(257) = 5.5
    for field in ("loss", "grad_norm", "val_loss"):
        ref = {s: v for s, v in rows(root / "ref", field).items() if s > 3}
        assert rows(root / "resumed", field) == ref, field  # bitwise, momentum buffers included


@pytest.mark.slow
def test_muon_on_two_ranks_matches_one_process(muon_runs):
    # DTensor runs Newton-Schulz on the row shards: the whole matrix's update, the partial sums added
    # in another order, in bf16 (optim.py).
    root, _ = muon_runs
    one, two = rows(root / "ref", "loss"), rows(root / "ranks2", "loss")
    assert sorted(one) == sorted(two) == list(range(1, 7))
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=2e-3), step
