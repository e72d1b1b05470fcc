"""Which change carries width 128's gain? (issue 45). The recipe (A: γ=1, ε=1e-12, gate) and the baseline
(B: γ=0.5, ε=1e-5, no gate) of scale_wide, and four arms each one setting away from A (`bash
results/cpu_lm.sh factorial`): C γ=0.5, D γ=0.75, F no gate, G ε=41.94/128². Width 128, 2 layers, 1,200
steps; each arm at its seed-0 best lr. And depth at equal size: the recipe and the baseline at 4 layers
x width 96 (`cpu_lm.sh depth`).

Each contrast is a loss difference paired by seed, signed so that positive favours the recipe's side:
    C − A, D − A   what γ=1 gains over γ=0.5 / 0.75 with both fixes in
    F − A          what the gate gains at γ=1
    B − C          what the gate gains at γ=0.5 (B differs from C in the gate and in ε too, but at γ=0.5
                   ε=1e-5 is r = ε·d^(2γ) ≈ 1e-3 of the residual's mean square: the gate alone, in effect)
    G − A          what the tiny ε gains at γ=1 over the paper's standard ε emulated (r ≈ 42)
    (F − A) − (B − C)  whether the gate helps γ=1 more than γ=0.5
as mean ± std [95% t-interval] over the seeds both sides ran. Exploration: seeds 0-2 (seed 0 from each
arm's lr grid at its best, seeds 1-2 at that lr). Confirmation: seeds 100-105 (confirm_wide.json for A
and B, confirm_factorial.json for the others), by results/confirm_factorial.md's rule once it exists.

    python results/factorial.py   # writes results/report_factorial.md and results/factorial.png
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fileio import atomic_write_bytes, read_json  # noqa: E402
from report import format_delta, pyplot, save_figure  # noqa: E402

# arm: (what it is, its seed-0 lr grid file and arm name, the file and arm name of its other seeds and of its
# confirmation seeds)
ARMS = {
    "A": ("recipe: γ=1, ε=1e-12, gate", ("scale_wide_lr_recipe.json", "recipe"), ("scale_wide.json", "recipe_d128"),
          ("confirm_wide.json", "recipe_d128")),
    "B": ("baseline: γ=0.5, ε=1e-5, no gate", ("scale_wide_lr_baseline.json", "baseline"),
          ("scale_wide.json", "baseline_d128"), ("confirm_wide.json", "baseline_d128")),
    "C": ("γ=0.5, ε=1e-12, gate", ("factorial_lr_C_gamma05.json", "C_gamma05"), ("factorial.json", "C_gamma05"),
          ("confirm_factorial.json", "C_gamma05")),
    "D": ("γ=0.75, ε=1e-12, gate", ("factorial_lr_D_gamma075.json", "D_gamma075"), ("factorial.json", "D_gamma075"),
          ("confirm_factorial.json", "D_gamma075")),
    "F": ("γ=1, ε=1e-12, no gate", ("factorial_lr_F_nogate.json", "F_nogate"), ("factorial.json", "F_nogate"),
          ("confirm_factorial.json", "F_nogate")),
    "G": ("γ=1, ε=41.94/128², gate", ("factorial_lr_G_stdeps.json", "G_stdeps"), ("factorial.json", "G_stdeps"),
          ("confirm_factorial.json", "G_stdeps")),
}
# (name, what a positive value means, [(sign, arm)...]): a sum of signed per-seed losses
CONTRASTS = [
    ("C − A", "γ=1 ahead of γ=0.5, both fixes in", [(1, "C"), (-1, "A")]),
    ("D − A", "γ=1 ahead of γ=0.75, both fixes in", [(1, "D"), (-1, "A")]),
    ("F − A", "the gate helps at γ=1", [(1, "F"), (-1, "A")]),
    ("B − C", "the gate helps at γ=0.5", [(1, "B"), (-1, "C")]),
    ("G − A", "ε=1e-12 ahead of the standard ε emulated, at γ=1", [(1, "G"), (-1, "A")]),
    ("(F − A) − (B − C)", "the gate helps γ=1 more than γ=0.5", [(1, "F"), (-1, "A"), (-1, "B"), (1, "C")]),
    ("B − A", "the recipe's whole gain", [(1, "B"), (-1, "A")]),
]
# results/confirm_factorial.md fixed the confirmation's machine
PREREGISTERED_CPU = "Intel(R) Xeon(R) Processor"
# The same point rerun on another CPU (`cpu_lm.sh machine_factorial`): (file, arm) of the rerun and of the original
MACHINE = [(("machine_recipe.json", "recipe_d128"), ("confirm_wide.json", "recipe_d128")),
           (("machine_F.json", "F_nogate"), ("confirm_factorial.json", "F_nogate"))]
DEPTH = {"recipe": ("depth_lr_recipe_L4.json", "recipe_L4"), "baseline": ("depth_lr_baseline_L4.json", "baseline_L4")}


def load(name):
    path = os.path.join(HERE, name)
    return read_json(path)["rows"] if os.path.exists(path) else []


def loss(row):
    return row["eval"]["loss"]["summary"]["loss"]


def explored(grid, rest, d_model=None):
    """Seed 0 at the best lr of its grid, then seeds 1-2 (rest), which must have run at that lr; [] until they
    have (a grid may still be widening)."""
    grid_file, grid_arm = grid
    rows = [r for r in load(grid_file) if r["arm"] == grid_arm
            and (d_model is None or r["config"]["model"].get("d_model") == d_model)]
    others = [r for r in load(rest[0]) if r["arm"] == rest[1]]
    if not rows or not others:
        return []
    best = min(rows, key=loss)
    for r in others:
        assert r["config"]["lr"] == best["config"]["lr"], f"{r['point']} ran at lr {r['config']['lr']}, its " \
            f"seed-0 best is {best['config']['lr']}: rerun results/cpu_lm.sh for it"
    return [best] + others


def arm_rows(arm, phase):
    """The arm's rows of a phase ("explore": seeds 0-2, "confirm": seeds 100-105)."""
    _, grid, rest, confirm = ARMS[arm]
    if phase == "confirm":
        return [r for r in load(confirm[0]) if r["arm"] == confirm[1]]
    return explored(grid, rest, 128 if arm in "AB" else None)


def contrast(terms, rows):
    """{seed: the signed sum of the terms' losses} over the seeds every term ran."""
    by_arm = {arm: {r["seed"]: loss(r) for r in rows[arm]} for _, arm in terms}
    seeds = set.intersection(*(set(v) for v in by_arm.values())) if by_arm else set()
    return {s: sum(sign * by_arm[arm][s] for sign, arm in terms) for s in sorted(seeds)}


def seeds_and_mean(found):
    """'seed: loss, ... | mean' of an arm's rows, by seed."""
    per_seed = ", ".join(f"{r['seed']}: {loss(r):.4f}" for r in sorted(found, key=lambda r: r["seed"]))
    return f"{per_seed} | {sum(map(loss, found)) / len(found):.4f}"


def contrast_table(rows):
    lines = ["| contrast | positive means | seeds | mean ± std [95%] |", "|---|---|---|---|"]
    for name, meaning, terms in CONTRASTS:
        values = contrast(terms, rows)
        if len(values) > 1:
            lines.append(f"| {name} | {meaning} | {len(values)} | {format_delta(list(values.values()))} |")
    return lines


def report():
    lines = ["# Which change carries width 128's gain (issue 45)", "",
             "Written by `python results/factorial.py` from the result files beside it (module docstring: "
             "the arms, the signs). Width 128, 2 layers, 1,200 steps of 8,192 tokens; eval.py loss on "
             "262,144 validation tokens.", ""]
    figure = {}
    for phase, title in (("explore", "Exploration, seeds 0-2"), ("confirm", "Confirmation, seeds 100-105")):
        rows = {arm: arm_rows(arm, phase) for arm in ARMS}
        if not any(rows.values()):
            continue
        lines += [f"## {title}", "", "| arm | settings | lr | loss per seed | mean |", "|---|---|---|---|---|"]
        for arm, found in rows.items():
            if found:
                lines.append(f"| {arm} | {ARMS[arm][0]} | {found[0]['config']['lr']:g} | {seeds_and_mean(found)} |")
        lines += [""] + contrast_table(rows) + [""]
        cpus = sorted({r["machine"]["cpu"] for found in rows.values() for r in found})
        if len(cpus) > 1:  # numbers are bitwise only within one machine (results/README.md)
            lines += [f"Rows ran on {len(cpus)} CPUs: " + "; ".join(
                f"{cpu}: " + ", ".join(f"{arm} {r['seed']}" for arm, found in rows.items() for r in found
                                        if r["machine"]["cpu"] == cpu) for cpu in cpus) + ".", ""]
            if phase == "confirm":
                lines += [f"The same contrasts on the seeds whose every row ran on the pre-registered CPU "
                          f"({PREREGISTERED_CPU}) only (fewer seeds: not a verdict):", ""]
                lines += contrast_table({arm: [r for r in found if r["machine"]["cpu"] == PREREGISTERED_CPU]
                                         for arm, found in rows.items()}) + [""]
        if phase == "explore":
            figure = rows
    checks = [(rerun, original) for (rerun_file, arm), (original_file, _) in MACHINE
              for rerun in load(rerun_file) if rerun["arm"] == arm
              for original in load(original_file) if original["arm"] == arm and original["seed"] == rerun["seed"]]
    if checks:
        lines += ["## The same command on two CPUs", "", "| arm | seed | CPU | loss | CPU | loss | difference |",
                  "|---|---|---|---|---|---|---|"]
        for rerun, original in checks:
            lines.append(f"| {rerun['arm']} | {rerun['seed']} | {original['machine']['cpu']} | {loss(original):.4f} | "
                         f"{rerun['machine']['cpu']} | {loss(rerun):.4f} | {loss(rerun) - loss(original):+.4f} |")
        lines.append("")
    recipe, baseline = (explored(DEPTH[arm], ("depth.json", DEPTH[arm][1]), 96) for arm in ("recipe", "baseline"))
    if recipe and baseline:
        lines += ["## Depth at equal size: 4 layers x width 96, seeds 0-2", "",
                  "| arm | seed 0 by lr | lr | loss per seed | mean |", "|---|---|---|---|---|"]
        cpus = set()
        for arm, found in (("recipe", recipe), ("baseline", baseline)):
            grid = sorted((r for r in load(DEPTH[arm][0]) if r["arm"] == DEPTH[arm][1]),
                          key=lambda r: r["config"]["lr"])
            cpus |= {r["machine"]["cpu"] for r in grid + found}
            lines.append(f"| {arm} | " + ", ".join(f"{r['config']['lr']:g}: {loss(r):.4f}" for r in grid) +
                         f" | {found[0]['config']['lr']:g} | {seeds_and_mean(found)} |")
        gains = contrast([(1, "baseline"), (-1, "recipe")], {"recipe": recipe, "baseline": baseline})
        lines += ["", f"Gain (baseline − recipe, paired by seed): {format_delta(list(gains.values()))}. "
                  f"CPUs: {', '.join(sorted(cpus))}.", ""]
    atomic_write_bytes(os.path.join(HERE, "report_factorial.md"), ["\n".join(lines).encode()])
    if any(figure.values()):
        plot(figure, os.path.join(HERE, "factorial.png"))
    return lines


def plot(rows, path):
    """A bar per arm (its mean over seeds 0-2) with each seed's loss as a point."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    arms = [arm for arm in ARMS if rows[arm]]
    for x, arm in enumerate(arms):
        values = [loss(r) for r in rows[arm]]
        ax.bar(x, sum(values) / len(values), color="tab:blue" if arm == "A" else "tab:gray", alpha=0.6)
        ax.scatter([x] * len(values), values, color="black", s=12, zorder=3)
    ax.set_xticks(range(len(arms)), [f"{arm}\n{ARMS[arm][0].replace(', ', chr(10))}" for arm in arms], fontsize=7)
    low = min(loss(r) for arm in arms for r in rows[arm])
    high = max(loss(r) for arm in arms for r in rows[arm])
    ax.set_ylim(low - 0.02, high + 0.02)
    ax.set_ylabel("validation loss (eval.py, 262k tokens)")
    ax.set_title("Width 128: the recipe (A), the baseline (B), one setting changed (C-G)", fontsize=9)
    save_figure(fig, path)


if __name__ == "__main__":
    print("\n".join(report()))
