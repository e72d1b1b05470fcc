"""Does the recipe's gain survive width? (issue 38). The scale section's recipe-vs-baseline pair at
widths 24-64 (results/scale.json, settings.json) joined by widths 96 and 128 (`bash results/cpu_lm.sh
scale_wide`: each arm's lr tuned on seed 0, results/scale_wide_lr_<arm>.json; seeds 1 and 2 at each
best, results/scale_wide.json), all 2 layers at about 20 tokens per non-embedding parameter.

Per width: the gain g = baseline − recipe, paired by seed, with its 95% t-interval. The trend: per
seed, the least-squares slope of g against log2(width) over widths 32-128 (the gain per doubling of
width); those slopes' mean and 95% t-interval are the seed-paired slope (a seed's runs share nothing
across widths but the seed number, so this is the honest unit of replication). The pooled fit over
every (width, seed) point is printed beside it. The effective-size fit (report.py's power law with
offset through the baseline's seed means, the recipe's widths read as baseline sizes) over all
widths. Width 128's confirmation (results/confirm_wide.md, seeds 100-105, results/confirm_wide.json)
is reported on its own, by the pre-registered rule.

    python results/scale_wide.py   # writes results/report_scale_wide.md and results/scale_wide.png
"""
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import numpy as np  # noqa: E402

from fileio import atomic_write_bytes, read_json  # noqa: E402
from report import (effective_size, fit_power_law, format_delta, mean_interval, pyplot, save_figure,  # noqa: E402
                    seed_deltas)

# Width -> (file, recipe arm, baseline arm) for the widths with one file of 3 seeds each.
SEEDED = {24: ("scale.json", "recipe_d24", "baseline_d24"), 32: ("scale.json", "recipe_d32", "baseline_d32"),
          48: ("scale.json", "recipe_d48", "baseline_d48"), 64: ("settings.json", "recipe", "baseline")}
WIDE = (96, 128)  # seed 0 at its best in scale_wide_lr_<arm>.json, seeds 1-2 in scale_wide.json
SLOPE_WIDTHS = (32, 48, 64, 96, 128)  # issue 38: the slope over 32-128 (d24's baselines sat on the lr grid's edge)
ARMS = ("recipe", "baseline")


def load(name):
    path = os.path.join(HERE, name)
    return read_json(path)["rows"] if os.path.exists(path) else []


def width_of(row):
    return row["config"]["model"].get("d_model", 64)


def wide_rows(arm, d):
    """Seed 0 at the arm's best lr of its grid, then seeds 1-2 from scale_wide.json, which must have
    run at that lr (a best that moved after they ran would mix two settings: refused)."""
    grid = [r for r in load(f"scale_wide_lr_{arm}.json") if width_of(r) == d]
    if not grid:
        return []
    rest = [r for r in load("scale_wide.json") if r["arm"] == f"{arm}_d{d}"]
    if not rest:  # the grid may still be widening: a width enters once its seeds 1-2 ran at its best
        return []
    best = min(grid, key=lambda r: r["eval"]["loss"]["summary"]["loss"])
    for r in rest:
        assert r["config"]["lr"] == best["config"]["lr"], f"{r['point']} ran at lr {r['config']['lr']}, " \
            f"the seed-0 best is {best['config']['lr']}: rerun `bash results/cpu_lm.sh scale_wide`"
    return [best] + rest


def runs():
    """{width: {arm: [rows]}} for every width with rows."""
    out = {}
    for d, (name, *arm_names) in SEEDED.items():
        rows = load(name)
        out[d] = {arm: [r for r in rows if r["arm"] == arm_name] for arm, arm_name in zip(ARMS, arm_names)}
    for d in WIDE:
        out[d] = {arm: wide_rows(arm, d) for arm in ARMS}
    return {d: by_arm for d, by_arm in out.items() if all(by_arm.values())}


def loss(row):
    return row["eval"]["loss"]["summary"]["loss"]


def params(row):
    return row["eval"]["loss"]["summary"]["params_nonembedding"]


def slope(widths, gains):
    """Least-squares slope of gains against log2(widths) and its standard error."""
    x, y = np.log2(widths), np.asarray(gains, np.float64)
    xc = x - x.mean()
    b = float((xc * (y - y.mean())).sum() / (xc ** 2).sum())
    resid = y - y.mean() - b * xc
    se = math.sqrt((resid ** 2).sum() / (len(x) - 2) / (xc ** 2).sum()) if len(x) > 2 else None
    return b, se


def trend(gains):
    """The seed-paired slope over SLOPE_WIDTHS: ({seed: slope} for seeds present at every width,
    (mean, std, half-width)), and the pooled least-squares fit over every point (slope, se, n)."""
    widths = [d for d in SLOPE_WIDTHS if d in gains]
    seeds = sorted(set.intersection(*(set(gains[d]) for d in widths))) if len(widths) >= 3 else []
    per_seed = {s: slope(widths, [gains[d][s] for d in widths])[0] for s in seeds}
    points = [(d, g) for d in widths for g in gains[d].values()]
    pooled = slope([d for d, _ in points], [g for _, g in points]) if len(widths) >= 3 else (None, None)
    return widths, per_seed, mean_interval(list(per_seed.values())) if per_seed else None, (*pooled, len(points))


def fit_sizes(by_width):
    """report.py's effective-size fit on seed means: the baseline's widths fix L(N) = a·N^-α + c, each
    recipe width becomes the baseline size reaching its loss."""
    base = [(np.mean([params(r) for r in rows["baseline"]]), np.mean([loss(r) for r in rows["baseline"]]))
            for rows in by_width.values()]
    fit = fit_power_law([n for n, _ in base], [l for _, l in base])
    out = {}
    for d, rows in by_width.items():
        n = params(rows["recipe"][0])
        try:
            n_eff, err = effective_size(float(np.mean([loss(r) for r in rows["recipe"]])), fit)
            out[d] = (n_eff / n, None if err is None else err / n)
        except ValueError:  # below the fitted floor: no finite baseline size reaches it
            out[d] = (math.inf, None)
    return fit, out


def confirmation():
    """Width 128's pre-registered pair on seeds 100-105 (results/confirm_wide.json), {} until it ran."""
    rows = load("confirm_wide.json")
    recipe = [r for r in rows if r["arm"] == "recipe_d128"]
    baseline = [r for r in rows if r["arm"] == "baseline_d128"]
    return seed_deltas(recipe, baseline), recipe, baseline


def verdict(deltas):
    """results/confirm_wide.md's rule, on all six seeds or none."""
    if len(deltas) < 6:
        return f"no verdict yet ({len(deltas)} of 6 seeds)"
    mean, std, half = mean_interval(list(deltas.values()))
    return "reproduced" if mean - half > 0 else "opposite" if mean + half < 0 else "not resolved"


def plot(gains, per_seed, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    widths = sorted(gains)
    for s in sorted({s for g in gains.values() for s in g}):
        ax.scatter([d for d in widths if s in gains[d]], [gains[d][s] for d in widths if s in gains[d]], s=12,
                   color="gray", alpha=0.6, label="a seed" if s == 0 else None)
    stats = [mean_interval(list(gains[d].values())) for d in widths]
    ax.errorbar(widths, [m for m, _, _ in stats], yerr=[h or 0 for _, _, h in stats], color="tab:red", fmt="o-",
                capsize=3, label="mean, 95% interval")
    if per_seed:
        fit_widths = [d for d in SLOPE_WIDTHS if d in gains]
        b = float(np.mean(list(per_seed.values())))
        x = np.log2(fit_widths)
        a = np.mean([np.mean([gains[d][s] for s in per_seed]) for d in fit_widths]) - b * x.mean()
        ax.plot(fit_widths, a + b * x, "--", color="tab:blue", label=f"slope {b:+.4f} per doubling")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(d) for d in widths])
    ax.set_xlabel("d_model (2 layers, ~20 tokens per parameter)")
    ax.set_ylabel("baseline − recipe (val loss)")
    ax.legend(fontsize=8)
    save_figure(fig, path)
    plt.close(fig)


def report():
    by_width = runs()
    gains = {d: seed_deltas(rows["recipe"], rows["baseline"]) for d, rows in by_width.items()}
    lines = ["# The recipe's gain across width (issue 38)", "",
             "Generated by `python results/scale_wide.py` from results/scale.json (d 24-48), settings.json (d 64),",
             "scale_wide_lr_recipe.json / scale_wide_lr_baseline.json (d 96, 128: seed 0 at each arm's best) and",
             "scale_wide.json (seeds 1, 2). Gain = baseline − recipe, paired by seed; mean ± std [95% t-interval].", "",
             "| d_model | N recipe | N baseline | lr recipe | lr baseline | recipe | baseline | gain per seed | gain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d, rows in by_width.items():
        cells = [f"{mean_interval([loss(r) for r in rows[a]])[0]:.4f} ± "
                 f"{mean_interval([loss(r) for r in rows[a]])[1] or 0:.4f}"
                 for a in ARMS]
        lrs = ["/".join(sorted({f"{r['config']['lr']:g}" for r in rows[a]})) for a in ARMS]
        lines.append(f"| {d} | {params(rows['recipe'][0]):,} | {params(rows['baseline'][0]):,} | {lrs[0]} | {lrs[1]} | "
                     f"{cells[0]} | {cells[1]} | {', '.join(f'{g:+.4f}' for _, g in sorted(gains[d].items()))} | "
                     f"{format_delta(list(gains[d].values()))} |")
    widths, per_seed, seeded, (b, se, n) = trend(gains)
    lines += ["", f"## The trend over widths {', '.join(map(str, widths))}", ""]
    if seeded:
        mean, std, half = seeded
        lines.append(f"Slope of the gain per doubling of width, seed-paired (one least-squares slope per seed, "
                     f"then their mean): {mean:+.4f}" + (f" ± {std:.4f} [{mean - half:+.4f}, {mean + half:+.4f}]"
                                                       if half is not None else "") +
                     f"; per seed {', '.join(f'{s}: {v:+.4f}' for s, v in per_seed.items())}.")
        lines.append(f"Pooled least squares over all {n} (width, seed) points: {b:+.4f} ± {se:.4f} (standard error).")
    else:
        lines.append("Not enough widths with every seed yet.")
    fit, ratios = fit_sizes(by_width) if len(by_width) >= 4 else (None, {})
    if fit:
        lines += ["", f"## Effective size over widths {', '.join(map(str, by_width))}", "",
                  f"L(N) = a·N^-α + c through the baseline's seed means: α = {fit['alpha']:.3f}"
                  + (f" ± {fit['alpha_err']:.3f}, c = {fit['c']:.3f} ± {fit['c_err']:.3f}" if fit["cov"] else
                     f", c = {fit['c']:.3f}") + "; the recipe's effective size / its size:", "",
                  "| d_model | multiple |", "|---|---|"]
        lines += [f"| {d} | {r:.3f}" + (f" ± {e:.3f}" if e is not None else "") + " |" for d, (r, e) in ratios.items()]
    deltas, recipe, baseline = confirmation()
    lines += ["", "## Width 128, confirmation seeds 100-105 (results/confirm_wide.md)", ""]
    if deltas:
        lines += [f"Recipe lr {recipe[0]['config']['lr']:g}, baseline lr {baseline[0]['config']['lr']:g}; "
                  f"{len(deltas)} seeds: gain per seed "
                  f"{', '.join(f'{s}: {g:+.4f}' for s, g in sorted(deltas.items()))}; "
                  f"{format_delta(list(deltas.values()))}; {sum(g > 0 for g in deltas.values())} of {len(deltas)} "
                  f"positive. By the pre-registered rule: **{verdict(deltas)}**."]
    else:
        lines.append("Not run yet.")
    atomic_write_bytes(os.path.join(HERE, "report_scale_wide.md"), ["\n".join(lines).encode() + b"\n"])
    plot(gains, per_seed, os.path.join(HERE, "scale_wide.png"))
    print("\n".join(lines))


if __name__ == "__main__":
    report()
