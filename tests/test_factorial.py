"""results/factorial.py against hand computations: arms whose losses are known per seed, so each contrast's
per-seed values, mean, std and 95% interval are known in advance; an arm enters only once its seeds 1-2 ran
at its seed-0 best lr."""
import importlib.util
import math
import os

import pytest

from fileio import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("factorial", os.path.join(ROOT, "results", "factorial.py"))
factorial = importlib.util.module_from_spec(spec)
spec.loader.exec_module(factorial)

BASE = {"A": 1.70, "B": 1.80, "C": 1.72, "D": 1.71, "F": 1.74, "G": 1.75}  # each arm's loss at seed 0 ...
SEED_SHIFT = {"A": (0.0, 0.01, 0.02), "B": (0.0, 0.02, 0.01), "C": (0.0, 0.01, 0.03), "D": (0.0, 0.0, 0.0),
              "F": (0.0, 0.03, 0.02), "G": (0.0, 0.01, 0.02)}  # ... plus these at seeds 0, 1, 2


def row(arm, seed, loss, lr, d=128, cpu=factorial.PREREGISTERED_CPU):
    return {"point": f"{arm}-{seed}-{lr}", "arm": arm, "seed": seed, "config": {"model": {"d_model": d}, "lr": lr},
            "eval": {"loss": {"summary": {"loss": loss}, "rows": []}}, "machine": {"cpu": cpu}}


@pytest.fixture
def study(tmp_path, monkeypatch):
    monkeypatch.setattr(factorial, "HERE", str(tmp_path))
    files = {}
    for arm, (_, (grid, grid_arm), (rest, rest_arm), _) in factorial.ARMS.items():
        loss = BASE[arm]
        # the seed-0 grid: the best at 5e-3, a worse one either side (and, in A's and B's files, width 96's rows)
        files.setdefault(grid, []).extend([row(grid_arm, 0, loss, 5e-3), row(grid_arm, 0, loss + 0.05, 3e-3),
                                           row(grid_arm, 0, loss + 0.04, 1e-2)]
                                          + [row(grid_arm, 0, loss - 1, 5e-3, 96)] * (arm in "AB"))
        files.setdefault(rest, []).extend(row(rest_arm, s, loss + SEED_SHIFT[arm][s], 5e-3) for s in (1, 2))
    for name, rows in files.items():
        write_json(str(tmp_path / name), {"rows": rows})
    return tmp_path


T_975 = {1: 12.706, 2: 4.303}  # t(0.975) by degrees of freedom, from tables


def interval(values):
    """(mean, std, half-width of the 95% t-interval) of per-seed values, by hand."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean, std, T_975[len(values) - 1] * std / math.sqrt(len(values))


def by_hand(terms):
    values = [sum(sign * (BASE[arm] + SEED_SHIFT[arm][s]) for sign, arm in terms) for s in (0, 1, 2)]
    return (values, *interval(values))


def test_every_contrast_is_the_hand_computed_one(study):
    rows = {arm: factorial.arm_rows(arm, "explore") for arm in factorial.ARMS}
    assert all(len(found) == 3 and found[0]["config"]["lr"] == 5e-3 for found in rows.values())
    for name, _, terms in factorial.CONTRASTS:
        values, mean, std, half = by_hand(terms)
        assert list(factorial.contrast(terms, rows).values()) == pytest.approx(values), name
    lines = factorial.report()
    # the interaction by hand: (F - A) - (B - C) = (1.74 - 1.70) - (1.80 - 1.72) = -0.04 at seed 0, then -0.03, -0.02
    values, mean, std, half = by_hand(factorial.CONTRASTS[5][2])
    assert values == pytest.approx([-0.04, -0.03, -0.02])
    assert f"| (F − A) − (B − C) | the gate helps γ=1 more than γ=0.5 | 3 | {mean:+.4f} ± {std:.4f} " \
        f"[{mean - half:+.4f}, {mean + half:+.4f}] |" in lines
    assert (study / "report_factorial.md").exists()


def test_an_arm_enters_once_its_seeds_ran_at_its_best_lr(study):
    write_json(str(study / "factorial.json"), {"rows": []})  # C, D, F, G: only their grids so far
    assert [arm for arm in factorial.ARMS if factorial.arm_rows(arm, "explore")] == ["A", "B"]
    write_json(str(study / "factorial.json"), {"rows": [row("C_gamma05", 1, 1.7, 1e-2)]})
    with pytest.raises(AssertionError, match="ran at lr 0.01, its seed-0 best is 0.005"):
        factorial.arm_rows("C", "explore")


def test_rows_from_another_cpu_are_named_and_the_same_point_on_two_cpus_is_compared(study):
    # A confirmation row that ran on another CPU is named under its table, and the contrasts are given again
    # on the pre-registered CPU's seeds alone; a point rerun there is set beside its original, all by hand.
    xeon = factorial.PREREGISTERED_CPU
    write_json(str(study / "confirm_wide.json"), {"rows": [row("recipe_d128", s, 1.70 + (s - 100) / 1000, 5e-3)
                                                           for s in (100, 101, 102)]})
    write_json(str(study / "confirm_factorial.json"), {"rows": [row("F_nogate", 100, 1.75, 5e-3),
                                                                row("F_nogate", 101, 1.87, 5e-3, cpu="EPYC"),
                                                                row("F_nogate", 102, 1.76, 5e-3)]})
    write_json(str(study / "machine_F.json"), {"rows": [row("F_nogate", 100, 1.7530, 5e-3, cpu="EPYC")]})
    lines = factorial.report()
    assert f"Rows ran on 2 CPUs: EPYC: F 101; {xeon}: A 100, A 101, A 102, F 100, F 102." in lines
    # F - A: 0.05, 0.169, 0.058 on every row; on the Xeon's seeds 100 and 102: 0.05 and 0.058
    def expected(values):
        mean, std, half = interval(values)
        return f"| F − A | the gate helps at γ=1 | {len(values)} | {mean:+.4f} ± {std:.4f} " \
            f"[{mean - half:+.4f}, {mean + half:+.4f}] |"
    confirm = lines[lines.index("## Confirmation, seeds 100-105"):]
    assert [line for line in confirm if line.startswith("| F − A |")] == [expected([0.05, 0.169, 0.058]),
                                                                         expected([0.05, 0.058])]
    assert f"| F_nogate | 100 | {xeon} | 1.7500 | EPYC | 1.7530 | +0.0030 |" in lines


def test_depth_gain_is_paired_by_seed(study):
    # The depth pair enters once both arms' seeds 1-2 ran at their seed-0 best; the gain is baseline - recipe by seed.
    recipe, baseline = {0: 1.67, 1: 1.68, 2: 1.66}, {0: 1.75, 1: 1.78, 2: 1.74}
    write_json(str(study / "depth_lr_recipe_L4.json"), {"rows": [row("recipe_L4", 0, 1.67, 5.5e-3, 96),
                                                                 row("recipe_L4", 0, 1.69, 1e-2, 96)]})
    write_json(str(study / "depth_lr_baseline_L4.json"), {"rows": [row("baseline_L4", 0, 1.75, 1e-2, 96)]})
    assert not any(line.startswith("## Depth") for line in factorial.report())  # seeds 1-2 not yet run
    write_json(str(study / "depth.json"), {"rows": [row("recipe_L4", s, recipe[s], 5.5e-3, 96) for s in (1, 2)] +
                                           [row("baseline_L4", s, baseline[s], 1e-2, 96) for s in (1, 2)]})
    lines = factorial.report()
    assert "| recipe | 0.0055: 1.6700, 0.01: 1.6900 | 0.0055 | 0: 1.6700, 1: 1.6800, 2: 1.6600 | 1.6700 |" in lines
    mean, std, half = interval([baseline[s] - recipe[s] for s in (0, 1, 2)])  # 0.08, 0.10, 0.08
    assert any(line.startswith(f"Gain (baseline − recipe, paired by seed): {mean:+.4f} ± {std:.4f} "
                               f"[{mean - half:+.4f}, {mean + half:+.4f}].") for line in lines)
