"""results/eps_regime.py against hand computations: a tiny sweep file whose Δloss, intervals,
collapse numbers, r ≈ 42 interpolation and γ=0.5 control readings are worked out here by hand,
and the norm-input measurement against the embedding itself and eval.py's trace_residual."""
import importlib.util
import json
import math
import os

import pytest
import torch

from analysis import trace_residual
from init import init_model_
from model import config_for, GPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("eps_regime", os.path.join(ROOT, "results", "eps_regime.py"))
eps_regime = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eps_regime)

T2, T4 = 4.303, 2.776  # two-sided 95% Student-t quantiles, df 2 and 4 (tables)

# (γ, d, r) -> Δloss by seed 0, 1, 2; the reference (ε=1e-12) loses 2.0 + 0.01·seed.
DELTAS = {(1.0, 32, 10): (0.1, 0.2, 0.3), (1.0, 32, 100): (0.4, 0.5, 0.6),
          (1.0, 64, 1): (0.0, 0.0, 0.0), (1.0, 64, 10): (0.25, 0.35, 0.45), (1.0, 64, 100): (0.5, 0.6, 0.7)}
CONTROL = (0.01, 0.02, 0.03)  # γ=0.5, d 64, at γ=1 d 64's r=100 ε (100/64²)


def row(arm, gamma, d, eps, seed, loss):
    return {"point": f"{arm}-seed{seed}", "arm": arm, "seed": seed, "setting": {}, "best_val_loss": loss,
            "config": {"model_size": "tiny", "model": {"d_model": d, "norm_eps": eps}, "gamma": gamma,
                       "lr": 0.003 if gamma == 1 else 0.03},
            "eval": {"loss": {"summary": {"loss": loss}, "rows": []}}}


def sweep_file(tmp_path):
    rows, arms = [], {}
    cells = {(g, d, 0): (0.0, 0.0, 0.0) for g, d in ((1.0, 32), (1.0, 64), (0.5, 64))}
    cells.update((k, v) for k, v in DELTAS.items())
    cells[(0.5, 64, 100)] = CONTROL
    for (gamma, d, r), deltas in cells.items():
        eps = 1e-12 if r == 0 else r / d ** 2  # the γ=0.5 control uses γ=1's ε at its width
        arm = f"g{gamma:g}_d{d}_r{r}"
        arms[arm] = {}
        rows += [row(arm, gamma, d, eps, s, 2.0 + 0.01 * s + delta) for s, delta in enumerate(deltas)]
    arms["g1_d48_r0"] = {}  # a point that never finished
    path = tmp_path / "eps_regime.json"
    path.write_text(json.dumps({"arms": arms, "seeds": [0, 1, 2], "rows": rows}))
    return path


def test_deltas_collapse_and_paper_regime(tmp_path):
    runs, expected = eps_regime.load_runs(sweep_file(tmp_path))
    assert {"g1_d48_r0-seed0", "g1_d48_r0-seed2"} <= set(expected) - {r["point"] for r in runs}
    curves = {(c[0], c[1], round(c[3], 6)): c[4] for c in eps_regime.curves(runs)}
    for (gamma, d, r), deltas in DELTAS.items():
        assert curves[(gamma, d, r)] == pytest.approx(dict(enumerate(deltas)))
    assert curves[(0.5, 64, round(100 / 64, 6))] == pytest.approx(dict(enumerate(CONTROL)))

    collapse = {row["r"]: row for row in eps_regime.collapse_rows(eps_regime.curves(runs))}
    at10 = collapse[10.0]
    assert at10["stats"][32] == pytest.approx((0.2, 0.1, T2 * 0.1 / math.sqrt(3)), abs=1e-3)
    assert at10["spread"] == pytest.approx(0.15)
    assert at10["pooled_std"] == pytest.approx(0.1)
    assert at10["half"] == pytest.approx(T4 * 0.1 * math.sqrt(2 / 3), abs=1e-3)
    assert at10["overlap"]  # 0.2 ± 0.248 and 0.35 ± 0.248 share [0.102, 0.448]
    assert "spread" not in collapse[1.0]  # one width ran there

    # r ≈ 42 between r=10 and r=100, linear in log r: Δ10 + (Δ100 − Δ10)·log10(41.94/10).
    t = math.log10(1e-5 * 2048 ** 2 / 10)
    rows = {r["d"]: r for r in eps_regime.paper_rows(eps_regime.curves(runs), {32: {0: 0.1, 1: 0.1, 2: 0.1}})}
    assert rows[32]["r42"] == pytest.approx({s: a + (b - a) * t for s, (a, b) in
                                             enumerate(zip(DELTAS[(1.0, 32, 10)], DELTAS[(1.0, 32, 100)]))})
    # share of a gain of 0.1: 0.2/0.1, and the interval's ends 0.2 ∓ 0.2484 over 0.1
    assert eps_regime.share(rows[32]["r10"], rows[32]["gain"]) == "200% [-48%, 448%]"

    (control,) = eps_regime.control_rows(eps_regime.curves(runs))
    assert control["at_eps"] == pytest.approx(0.6)  # γ=1 at the same ε: its r=100 point
    # γ=1 at the same r = 100/64: between its r=1 (Δ 0) and r=10 (Δ 0.35) points, linear in log r
    assert control["at_r"] == pytest.approx(0.35 * math.log10(100 / 64))


def test_report_lists_missing_points_without_run_folders(tmp_path, capsys):
    eps_regime.main(["--results", str(sweep_file(tmp_path)), "--runs", str(tmp_path / "none"), "--out-dir", str(tmp_path)])
    text = (tmp_path / "report_eps_regime.md").read_text()
    assert "g1_d48_r0-seed1" in text and "no run folders here" in capsys.readouterr().err
    assert "+0.2000 ± 0.1000 [-0.0484, +0.4484]" in text  # d 32 at r=10, as eval.py report --pair writes it
    assert "(0.03, against γ=1's 0.003)" in text  # the control's lr, read from its rows


def test_spearman_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    x, y = [1, 1, 2, 3, 3, 3, 5, 8], [0.1, 0.4, 0.2, 0.3, 0.9, 0.5, 0.7, 0.6]
    assert eps_regime.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).correlation)


def test_norm_input_squares_match_the_embedding_and_trace_residual():
    torch.manual_seed(0)
    model = GPT(config_for("tiny", d_model=32, vocab_size=257, max_seq_len=64)).eval()
    init_model_(model, gamma=1.0, seed=0)
    xs = [torch.randint(257, (4, 64)) for _ in range(2)]
    got = eps_regime.norm_input_squares(model, xs)
    # The first norm sees the embedding alone.
    emb = torch.cat([model.tok_emb.weight[x].detach().pow(2).mean(-1).flatten() for x in xs])
    assert got["layers.0.attn_norm"][0] == pytest.approx(emb.mean().item(), rel=1e-5)
    assert got["layers.0.attn_norm"][1] == pytest.approx(emb.median().item(), rel=1e-5)
    # At init under γ=1 the embedding's mean square is about d^-2 (r_init's premise).
    assert got["layers.0.attn_norm"][0] == pytest.approx(32 ** -2, rel=0.15)
    # Every block's attention norm input is the stream eval.py's residual analysis measures
    # (its RMS per forward; each batch has the same number of tokens).
    with trace_residual(model) as trace, torch.no_grad():
        for x in xs:
            model(x)
    for i, rec in enumerate(trace):
        want = sum(v ** 2 for v in rec["resid_rms"]) / len(xs)
        assert got[f"layers.{i}.attn_norm"][0] == pytest.approx(want, rel=1e-5)
    assert set(got) == {"layers.0.attn_norm", "layers.0.mlp_norm", "layers.1.attn_norm", "layers.1.mlp_norm", "norm"}
