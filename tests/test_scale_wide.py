"""results/scale_wide.py against hand computations: sweep files whose gains lie exactly on one line in
log2(width) per seed, so each seed's slope, their mean and 95% interval, the pooled fit, the seed-0 best
of a tuning grid and the confirmation verdict are known in advance."""
import importlib.util
import math
import os

import numpy as np
import pytest

from fileio import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("scale_wide", os.path.join(ROOT, "results", "scale_wide.py"))
scale_wide = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scale_wide)

T2, T5 = 4.303, 2.571  # two-sided 95% Student-t quantiles, df 2 and 5 (tables)
SLOPES = {0: -0.03, 1: -0.01, 2: -0.02}  # each seed's gain per doubling of width


def gain(d, seed):
    return 0.2 + 0.01 * seed + SLOPES[seed] * math.log2(d / 32)


def row(arm, d, seed, loss, lr):
    return {"point": f"{arm}-seed{seed}-lr{lr}", "arm": arm, "seed": seed, "setting": {}, "best_val_loss": loss,
            "config": {"model": {"d_model": d}, "lr": lr},
            "eval": {"loss": {"summary": {"loss": loss, "params_nonembedding": 32 * d * d}, "rows": []}}}


@pytest.fixture
def study(tmp_path, monkeypatch):
    """Recipe loss 2 + 1/d at every width and seed; the baseline that plus the seed's gain."""
    monkeypatch.setattr(scale_wide, "HERE", str(tmp_path))
    files = {"scale.json": [], "settings.json": [], "scale_wide_lr_recipe.json": [],
             "scale_wide_lr_baseline.json": [], "scale_wide.json": []}
    for d in (24, 32, 48, 64, 96, 128):
        for s in (0, 1, 2):
            recipe = 2 + 1 / d
            if d <= 48:
                files["scale.json"] += [row(f"recipe_d{d}", d, s, recipe, 0.01), row(f"baseline_d{d}", d, s, recipe + gain(d, s), 0.03)]
            elif d == 64:
                files["settings.json"] += [row("recipe", d, s, recipe, 0.003), row("baseline", d, s, recipe + gain(d, s), 0.03)]
            elif s == 0:  # a tuning grid: the best lr is the middle one, the others 0.5 worse
                for lr, extra in ((0.003, 0.5), (0.0055, 0.0), (0.01, 0.5)):
                    files["scale_wide_lr_recipe.json"].append(row("recipe", d, s, recipe + extra, lr))
                    files["scale_wide_lr_baseline.json"].append(row("baseline", d, s, recipe + gain(d, s) + extra, lr * 3))
            else:
                files["scale_wide.json"] += [row(f"recipe_d{d}", d, s, recipe, 0.0055),
                                             row(f"baseline_d{d}", d, s, recipe + gain(d, s), 0.0165)]
    for name, rows in files.items():
        write_json(tmp_path / name, {"rows": rows})
    return tmp_path, files


def test_gains_and_seed_paired_slope(study):
    by_width = scale_wide.runs()
    assert sorted(by_width) == [24, 32, 48, 64, 96, 128]
    assert [r["config"]["lr"] for r in by_width[96]["recipe"]] == [0.0055] * 3  # seed 0's best of its grid
    gains = {d: scale_wide.seed_deltas(rows["recipe"], rows["baseline"]) for d, rows in by_width.items()}
    for d in gains:
        for s in (0, 1, 2):
            assert gains[d][s] == pytest.approx(gain(d, s), abs=1e-12)
    widths, per_seed, (mean, std, half), (b, se, n) = scale_wide.trend(gains)
    assert widths == [32, 48, 64, 96, 128] and n == 15
    for s, want in SLOPES.items():
        assert per_seed[s] == pytest.approx(want, abs=1e-12)
    assert mean == pytest.approx(-0.02) and std == pytest.approx(0.01)
    assert half == pytest.approx(T2 * 0.01 / math.sqrt(3), rel=1e-3)
    # The pooled fit against numpy's polyfit on the same 15 points.
    x = [math.log2(d) for d in widths for _ in (0, 1, 2)]
    y = [gain(d, s) for d in widths for s in (0, 1, 2)]
    assert b == pytest.approx(np.polyfit(x, y, 1)[0], abs=1e-12)


def test_seeds_at_another_lr_than_the_seed0_best_are_refused(study):
    tmp_path, files = study
    files["scale_wide.json"][0]["config"]["lr"] = 0.01
    write_json(tmp_path / "scale_wide.json", {"rows": files["scale_wide.json"]})
    with pytest.raises(AssertionError, match="the seed-0 best is 0.0055"):
        scale_wide.runs()


@pytest.mark.parametrize("gains, want", [
    ((0.02, 0.03, 0.01, 0.02, 0.04, 0.0), "reproduced"),
    ((0.02, -0.03, 0.01, 0.02, 0.04, 0.0), "not resolved"),
    ((-0.02, -0.03, -0.01, -0.02, -0.04, -0.01), "opposite"),
    ((0.02, 0.03, 0.01), "no verdict yet (3 of 6 seeds)"),
])
def test_confirmation_verdict(gains, want):
    deltas = dict(enumerate(gains))
    assert scale_wide.verdict(deltas) == want
    if len(gains) == 6:  # the rule by hand: the 95% t-interval against 0
        m, sd = np.mean(gains), np.std(gains, ddof=1)
        lo, hi = m - T5 * sd / math.sqrt(6), m + T5 * sd / math.sqrt(6)
        assert want == ("reproduced" if lo > 0 else "opposite" if hi < 0 else "not resolved")


def test_a_width_whose_seeds_have_not_run_is_left_out(study):
    tmp_path, files = study
    kept = [r for r in files["scale_wide.json"] if not r["arm"].endswith("_d128")]
    write_json(tmp_path / "scale_wide.json", {"rows": kept})
    assert sorted(scale_wide.runs()) == [24, 32, 48, 64, 96]  # 128's grid alone does not enter the trend
