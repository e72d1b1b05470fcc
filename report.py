"""Reports over smallinit's result files: the tables, plots and scaling fit that sweeps and the study
are read through, and the output helpers every tool that prints a table or draws a plot shares.

    python eval.py scaling  --baseline A.json ... --compare B.json ...   L(N) = a N^-α + c
    python eval.py report   out/*.json --out out/report.md

The commands' flags live in eval.py's one parser (run_scaling and run_report take its args). This
file reads result JSONs (eval.py --json-out, sweep.py's results/<name>.json), never a checkpoint,
and imports no tool: eval.py, sweep.py and results/*.py import it.
"""
import io
import json
import math
import os
import platform
import re
import sys

import numpy as np

from configurator import parse_value
from fileio import atomic_write_bytes, open_regular, parse_json
from model import config_for


# ----------------------------------------------------------------------------- the machine

def cpu_name():
    """The CPU model ("Intel(R) Xeon(R) ..."), for result rows and the cached matmul peak."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------- output helpers

def fmt(value):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    # One cell, one line: a raw newline (a bench completion's) would start a new table row.
    return str(value).replace("\r", "\\r").replace("\n", "\\n")


def format_table(rows, markdown=False):
    """Rows of dicts as an aligned console table, or as a markdown table for the README.
    Columns: every key that any row has, in order of first appearance."""
    if not rows:
        return "(no rows)"
    columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[fmt(row.get(c)) for c in columns] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    return "\n".join(lines + ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells])


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib, an optional dependency: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_file(path, data):
    # Like write_json: a missing folder is made, so every output flag takes the same paths.
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_bytes(os.fspath(path), [data])


def save_figure(fig, path):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    write_file(path, buf.getvalue())
    print(f"wrote {path}", file=sys.stderr)



# ----------------------------------------------------------------------------- scaling law

def fit_power_law(n, loss, alphas=np.linspace(0.01, 3.0, 600)):
    """Least-squares fit of L(N) = a·N^(−α) + c with the Jacobian standard errors.

    For a fixed α the model is linear in (a, c), so each α gets its exact best (a, c) and only
    α is searched (grid, then golden section): no start values, no local minima in (a, c).
    N is scaled by its geometric mean n0 so N^(−α) stays O(1) for every α."""
    n, loss = np.asarray(n, np.float64), np.asarray(loss, np.float64)
    if len(n) < 3:
        raise ValueError(f"a power law with offset has 3 parameters; got {len(n)} baseline points: "
                         "pass at least 3 --baseline runs (4+ for error bars)")
    n0 = float(np.exp(np.log(n).mean()))
    logx = np.log(n / n0)

    def solve(alpha):
        design = np.stack([np.exp(-alpha * logx), np.ones_like(logx)], 1)
        coef = np.linalg.lstsq(design, loss, rcond=None)[0]
        return coef, float(((design @ coef - loss) ** 2).sum())

    sse = [solve(a)[1] for a in alphas]
    i = int(np.argmin(sse))
    if solve(alphas[i])[0][0] <= 0:
        raise ValueError("the best fit has a <= 0: the baseline loss does not decrease with N, so no power law "
                         "describes it; check the baseline runs (same data, tokens, --count) or add sizes")
    if i in (0, len(alphas) - 1):
        raise ValueError("the best exponent is at the edge of the searched range "
                         f"α in [{alphas[0]:g}, {alphas[-1]:g}]: "
                         "the baselines do not pin down a power law with offset; add sizes or check their losses")
    lo, hi = alphas[max(i - 1, 0)], alphas[min(i + 1, len(alphas) - 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(100):
        m1, m2 = hi - golden * (hi - lo), lo + golden * (hi - lo)
        lo, hi = (lo, m2) if solve(m1)[1] < solve(m2)[1] else (m1, hi)
    alpha = (lo + hi) / 2
    (a_ref, c), residual = solve(alpha)
    # Covariance s²(JᵀJ)⁻¹ of (a_ref, α, c); needs a residual degree of freedom to estimate s².
    u = np.exp(-alpha * logx)
    jac = np.stack([u, -a_ref * logx * u, np.ones_like(u)], 1)
    # 3 points fit exactly: no error estimate (None, JSON null) rather than NaN.
    dof = len(n) - 3
    cov = (residual / dof * np.linalg.inv(jac.T @ jac)).tolist() if dof > 0 else None
    return {"a": a_ref * n0 ** alpha, "alpha": alpha, "c": c, "a_ref": a_ref, "n0": n0, "cov": cov,
            "alpha_err": math.sqrt(cov[1][1]) if cov else None, "c_err": math.sqrt(cov[2][2]) if cov else None,
            "rmse": math.sqrt(residual / len(n))}


def effective_size(loss, fit):
    """N_eff with L(N_eff) = loss, i.e. N_eff = n0·(a_ref/(loss − c))^(1/α), and its standard
    error by the delta method on log N_eff with the fit covariance (None without one)."""
    a_ref, alpha, c = fit["a_ref"], fit["alpha"], fit["c"]
    if loss <= c:
        raise ValueError(f"loss {loss:.4f} is below the fitted irreducible loss c={c:.4f}: "
                         "no finite size reaches it; fit with more/larger baselines")
    log_ratio = (math.log(a_ref) - math.log(loss - c)) / alpha
    grad = np.array([1 / (alpha * a_ref), -log_ratio / alpha, 1 / (alpha * (loss - c))])
    n_eff = fit["n0"] * math.exp(log_ratio)
    if fit["cov"] is None:
        return n_eff, None
    return n_eff, n_eff * math.sqrt(grad @ np.asarray(fit["cov"]) @ grad)


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def params_of(summary, count, name):
    """N of a loss result: total, active (MoE experts at top_k/E) or nonembedding = total minus
    the input embedding (Kaplan et al.), which keeps a 50k-100k-row table from dominating small
    models' N and bending α."""
    needed = ("params_total", "params_embedding") if count == "nonembedding" else (f"params_{count}",)
    if not all(is_number(summary.get(key)) for key in needed):
        raise ValueError(f"{name}: no {' and '.join(needed)} in its summary; pass loss JSONs from "
                         "`eval.py loss --json-out`")
    if count == "nonembedding":
        return summary["params_total"] - summary["params_embedding"]
    return summary[f"params_{count}"]


def literal_point(spec, flag):
    """{params, loss} of a literal N=loss: N a positive parameter count, loss finite (log N is fitted)."""
    try:
        n, loss = map(float, spec.split("="))
    except ValueError:
        n = loss = math.nan
    if not (n > 0 and math.isfinite(n) and math.isfinite(loss)):
        raise ValueError(f"{flag} {spec}: not N=loss (a positive parameter count and a finite loss, e.g. 1.5e9=2.41)")
    return {"params": n, "loss": loss}


def run_scaling(args):
    def points(specs, flag):
        out = []
        for spec in specs:
            if "=" in spec:  # literal N=loss, e.g. 1.5e9=2.41
                out.append({"name": spec, **literal_point(spec, flag)})
            else:
                fix = "pass loss JSONs from `eval.py loss --json-out` (or N=loss)"
                summary = result_of(spec, flag, "loss", fix)["summary"]
                if not is_number(summary.get("loss")):  # a diverged run's is null
                    raise ValueError(f"{flag} {spec}: no finite loss in its summary; {fix}")
                out.append({"name": spec, "params": float(params_of(summary, args.count, spec)),
                            "loss": summary["loss"]})
        return out

    base, compare = points(args.baseline, "--baseline"), points(args.compare, "--compare")
    fit = fit_power_law([p["params"] for p in base], [p["loss"] for p in base])
    rows = [{**p, "role": "baseline", "fit_loss": fit["a"] * p["params"] ** -fit["alpha"] + fit["c"]} for p in base]
    for p in compare:
        n_eff, err = effective_size(p["loss"], fit)
        rows.append({**p, "role": "compare", "effective_params": n_eff, "size_ratio": n_eff / p["params"],
                     "size_ratio_err": None if err is None else err / p["params"]})
    # N=loss literals are taken as given; --count says how loss JSONs were read.
    count = args.count if any("=" not in spec for spec in args.baseline + args.compare) else "as given"
    summary = {"count": count, **{k: fit[k] for k in ("a", "alpha", "alpha_err", "c", "c_err", "rmse")}}
    ratios = [r["size_ratio"] for r in rows if r["role"] == "compare"]
    if ratios:
        summary["mean_size_ratio"] = float(np.mean(ratios))
    result = {"analysis": "scaling", "summary": summary, "rows": rows, "fit": fit}
    if args.plot:
        plot_scaling(rows, fit, args.plot)
        result["plots"] = [args.plot]
    return result


def plot_scaling(rows, fit, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    n = np.geomspace(min(r["params"] for r in rows) / 2, max(r["params"] for r in rows) * 2, 100)
    ax.plot(n, fit["a"] * n ** -fit["alpha"] + fit["c"], color="gray",
            label=f"fit α={fit['alpha']:.3f}±{fmt(fit['alpha_err'])}, c={fit['c']:.3f}")
    for role, color in (("baseline", "tab:blue"), ("compare", "tab:red")):
        sel = [r for r in rows if r["role"] == role]
        ax.scatter([r["params"] for r in sel], [r["loss"] for r in sel], color=color, label=role)
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=8)
    save_figure(fig, path)
    plt.close(fig)



# ----------------------------------------------------------------------------- report

# Two-sided 95% Student-t quantiles t_{0.975, df}; past 30 degrees of freedom the normal 1.96
# is within 2%. A 3-seed mean has df=2: its interval is 4.3 standard errors wide each side.
T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]


def mean_interval(values):
    """(mean, sample std, half-width of the 95% t-interval of the mean); std and interval are
    None for one value (no spread can be estimated from one seed)."""
    n, mean = len(values), float(np.mean(values))
    if n < 2:
        return mean, None, None
    std = float(np.std(values, ddof=1))
    return mean, std, (T_975[n - 2] if n <= 31 else 1.96) * std / math.sqrt(n)


def config_value(config, key):
    """A resolved train.py setting by its sweep name: 'lr', 'model.norm_eps', 'weight_decay.matrix'.
    A model field the run left at its default is read from GPTConfig (the run's model dict
    holds only what was set)."""
    head, _, item = key.partition(".")
    value = config[head]
    if not item:
        return value
    if item in value:
        return value[item]
    if head == "model":
        return getattr(config_for(config["model_size"], **config["model"]), item)
    raise KeyError(key)


ANCHOR_METRICS = ("seen_pair_acc", "test_key_acc", "heldout_inferential", "heldout_symmetric", "heldout_other")


def sweep_metrics(row):
    """The numbers a sweep row is compared by: eval.py loss (overall and per source), the
    first-token attention share and the share of sink heads when `sink` was evaluated, the
    anchor task's accuracies and held-out answer shares when `anchor` was, and train.py's best
    val loss."""
    out, evals = {}, row["eval"]
    if "loss" in evals:
        out["loss"] = evals["loss"]["summary"]["loss"]
        out.update((f"loss_{r['source']}", r["loss"]) for r in evals["loss"]["rows"])
    if "sink" in evals:
        sink = evals["sink"]["summary"]
        out["sink_first"] = sink["mean_share_first"]
        # The head-level metric (eval.py sink's sink_heads_*) and the document-start shares exist
        # in rows evaluated since they were added, and doc_first only under document masking.
        for name, key in (("sink_heads", "sink_heads_first"), ("sink_doc_first", "mean_share_doc_first"),
                          ("sink_doc_heads", "sink_heads_doc_first")):
            if key in sink:
                out[name] = sink[key]
    if "anchor" in evals:
        out.update((k, evals["anchor"]["summary"][k]) for k in ANCHOR_METRICS)
        # composing minus copying: one number per run, > 0 when the held-out pair is mostly composed
        out["heldout_margin"] = out["heldout_inferential"] - out["heldout_symmetric"]
    out["best_val_loss"] = row["best_val_loss"]
    return out


def metric(row, name):
    """One column of a sweep row (sweep_metrics), or a one-line error naming those it has."""
    metrics = sweep_metrics(row)
    if name not in metrics:
        raise ValueError(f"{row['point']} has no {name!r} (evaluated: {', '.join(row['eval'])}); "
                         f"choose from {', '.join(metrics)}")
    return metrics[name]


def seed_deltas(reference, rows, name="loss"):
    """{seed: the metric - the reference's on that seed}. Paired by seed: a seed fixes the init
    draw and the data order in every arm, so the per-seed difference removes the variance the
    arms share."""
    ref = {r["seed"]: metric(r, name) for r in reference}
    return {r["seed"]: metric(r, name) - ref[r["seed"]] for r in rows if r["seed"] in ref}


def format_delta(deltas):
    """Paired differences as 'mean ± std [95% interval]', or None for none."""
    if not deltas:
        return None
    mean, std, half = mean_interval(deltas)
    return f"{mean:+.4f}" + ("" if std is None else f" ± {std:.4f} [{mean - half:+.4f}, {mean + half:+.4f}]")


def paired(reference, rows):
    return format_delta(list(seed_deltas(reference, rows).values()))


def sweep_rows(selector):
    """FILE.json:ARM[:KEY=VALUE...] -> the rows of that arm (at those grid settings) in that sweep,
    one per seed."""
    path, arm, *settings = selector.split(":")
    sweep = result_of(path, "--pair", "sweep", "write FILE.json:ARM[:KEY=VALUE...] with a sweep.py results file")
    rows = [r for r in sweep["rows"] if r["arm"] == arm]
    for setting in settings:
        key, _, value = setting.partition("=")
        rows = [r for r in rows if key in r["setting"] and r["setting"][key] == parse_value(value)]  # 1e-2 == 0.01
    if not rows:
        raise ValueError(f"--pair {selector}: no finished rows of arm {arm!r}" + "".join(f" at {s}" for s in settings)
                         + f" in {path}; write FILE.json:ARM[:KEY=VALUE...]")
    seeds = [r["seed"] for r in rows]
    if len(set(seeds)) < len(seeds):
        found = ", ".join(sorted({json.dumps(r["setting"]) for r in rows}))
        raise ValueError(f"--pair {selector}: several settings per seed ({found}); "
                         "add :KEY=VALUE to pick one")
    return rows


def pair_table(pairs, name="loss"):
    """--pair A B: B - A of the metric by seed across result files (e.g. one sweep's arm against
    another's), every seed's difference shown, with how many seeds B is lower on."""
    lines = []
    for a, b in pairs:
        deltas = seed_deltas(sweep_rows(a), sweep_rows(b), name)
        if not deltas:
            raise ValueError(f"--pair {a} {b}: no seed in common")
        lines.append({"a": a, "b": b, "b - a by seed": ", ".join(f"{s}: {d:+.4f}" for s, d in sorted(deltas.items())),
                      "b - a": format_delta(list(deltas.values())),
                      "b lower": f"{sum(d < 0 for d in deltas.values())} of {len(deltas)}"})
    return lines


def sweep_table(result, per_seed=()):
    """One line per arm x grid setting: every metric as mean ± std over its seeds, and the loss's
    95% interval; each metric in per_seed also seed by seed. Groups keep the order of the
    sweep's points."""
    groups = {}
    for row in result["rows"]:
        groups.setdefault((row["arm"], json.dumps(row["setting"], sort_keys=True)), []).append(row)

    # Arms crossed with a grid (an lr grid, token budgets): each line also against the first
    # arm at the same setting, the comparison such a sweep is run for.
    first_arm = next(iter(groups))[0]
    crossed = len({arm for arm, _ in groups}) > 1 and any(setting != "{}" for _, setting in groups)
    lines = []
    for (arm, setting), rows in groups.items():
        metrics = [sweep_metrics(r) for r in rows]
        line = {"arm": arm, **rows[0]["setting"], "seeds": ",".join(str(r["seed"]) for r in rows)}
        for key in metrics[0]:
            mean, std, _ = mean_interval([m[key] for m in metrics])
            line[key] = f"{mean:.4f}" + ("" if std is None else f" ± {std:.4f}")
        if "loss" in metrics[0]:  # a sweep without eval.py loss (the anchor task's) has no loss columns
            mean, _, half = mean_interval([m["loss"] for m in metrics])
            line["loss_95ci"] = "-" if half is None else f"[{mean - half:.4f}, {mean + half:.4f}]"
            delta = paired(next(iter(groups.values())), rows)
            if lines and delta:
                line["dloss_vs_first"] = delta
            if crossed and arm != first_arm and (first_arm, setting) in groups:
                line[f"dloss_vs_{first_arm}"] = paired(groups[(first_arm, setting)], rows) or "-"
        for name in per_seed:
            line[f"{name} by seed"] = ", ".join(f"{r['seed']}: {metric(r, name):.4f}" for r in rows)
        line["tokens"] = rows[0]["tokens"]
        lines.append(line)
    return lines


def plot_sweep(result, x_key, path, name="loss"):
    """A metric (mean ± std over seeds, every seed a gray dot) against one setting: a line per arm,
    or one line across the arms when each arm is a value of that setting (a γ sweep whose arms
    carry their own tuned lr; one line per arm config file, e.g. recipe and baseline sizes).
    x_key "arm": the arms as categories (ablations)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    series, arms = {}, list(dict.fromkeys(row["arm"] for row in result["rows"]))
    for row in result["rows"]:
        if x_key == "arm":
            label, x = "arms", arms.index(row["arm"])
        else:
            # arms that carry the plotted setting themselves are one line per set of config
            # files (the recipe's sizes; the baseline's sizes), else each arm is its own line
            files = "+".join(os.path.basename(f) for f in row["arm_configs"])
            label = (result["name"] + (f" + {files}" if files else "")) if x_key in row["arm_set"] else row["arm"]
            x = config_value(row["config"], x_key)
        series.setdefault(label, {}).setdefault(x, []).append(metric(row, name))
    for label, points in series.items():
        xs = sorted(points)
        stats = [mean_interval(points[x]) for x in xs]
        ax.errorbar(xs, [s[0] for s in stats], yerr=[s[1] or 0 for s in stats], marker="o", capsize=3, label=label,
                    linestyle="none" if x_key == "arm" else "-")
        for x in xs:
            ax.scatter([x] * len(points[x]), points[x], s=8, color="gray", zorder=3)
    if x_key == "arm":
        ax.set_xticks(range(len(arms)), arms, rotation=20)
    elif x_key in ("lr", "model.norm_eps", "max_steps", "model.d_model"):
        ax.set_xscale("log")
        xs = sorted({x for points in series.values() for x in points})
        ax.set_xticks(xs, [f"{x:g}" for x in xs])  # the swept values, not log decades
        ax.minorticks_off()
    ax.set_xlabel(x_key)
    ax.set_ylabel("validation loss (eval.py loss)" if name == "loss" else name)
    ax.set_title(result["name"])
    if x_key != "arm":
        ax.legend(fontsize=8)
    save_figure(fig, path)
    plt.close(fig)


def sweep_cells(result, x_key, y_key, name):
    """{(x, y): [the metric of every seed]} over a grid of two settings."""
    cells = {}
    for row in result["rows"]:
        xy = (config_value(row["config"], x_key), config_value(row["config"], y_key))
        cells.setdefault(xy, []).append(metric(row, name))
    return cells


def plot_sweep_heatmap(result, x_key, y_key, path, name):
    """A metric's seed mean over a grid of two settings (the anchor task's depth x γ phase
    diagram), every cell labelled with its mean ± std and its number of seeds."""
    plt = pyplot()
    cells = sweep_cells(result, x_key, y_key, name)
    xs, ys = sorted({x for x, _ in cells}), sorted({y for _, y in cells})
    means = np.full((len(ys), len(xs)), np.nan)  # a cell with no finished run stays blank
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(xs), 1.2 + 0.8 * len(ys)))
    for (x, y), values in cells.items():
        mean, std, _ = mean_interval(values)
        means[ys.index(y), xs.index(x)] = mean
        label = f"{mean:.2f}" + ("" if std is None else f"±{std:.2f}") + f"\n({len(values)})"
        ax.text(xs.index(x), ys.index(y), label, ha="center", va="center", fontsize=8,
                color="white" if mean < 0.5 else "black")
    shares = name in ANCHOR_METRICS  # shares and accuracies: one scale, 0 to 1, for every plot
    image = ax.imshow(means, origin="lower", aspect="auto", cmap="viridis",
                      vmin=0 if shares else None, vmax=1 if shares else None)
    ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs])
    ax.set_yticks(range(len(ys)), [f"{y:g}" for y in ys])
    ax.set_xlabel(x_key)
    ax.set_ylabel(y_key)
    ax.set_title(f"{result['name']}: {name}, seed mean (seeds)")
    fig.colorbar(image, ax=ax)
    save_figure(fig, path)
    plt.close(fig)


# Per-row tables that `report` averages over seeds: (rows of a result, key column, columns).
SEED_TABLES = {
    "tokens": (lambda r: r["rows"], "bucket", ("mean_delta_sym", "win_rate_a", "loss_a", "loss_b")),
    "weights": (lambda r: r["trajectory"], "step",
                ("wq:mean_abs_cos", "wq:stable_rank", "w_up:mean_abs_cos", "w_up:stable_rank")),
}


def seed_groups(items):
    """Result files whose names differ only in a seedN part are seeds of one comparison:
    {name without it: [(path, result), ...]}."""
    groups = {}
    for path, result in items:
        name = re.sub(r"[-_]?seed\d+", "", os.path.splitext(os.path.basename(path))[0])
        name = name or os.path.basename(os.path.dirname(os.path.abspath(path)))  # seedN.json: its folder names it
        groups.setdefault(name, []).append((path, result))
    return groups


def rows_over_seeds(results, rows_of, key, columns):
    """One line per key (bucket, step) with each column as mean ± std over the results that
    have that key."""
    by_key = {}
    for result in results:
        for row in rows_of(result):
            by_key.setdefault(row[key], []).append(row)
    out = []
    for k, rows in by_key.items():
        line = {key: k, "seeds": len(rows)}
        for c in columns:
            mean, std, half = mean_interval([r[c] for r in rows if c in r])
            line[c] = f"{mean:.4f}" + ("" if std is None else f" ± {std:.4f}")
            if c == columns[0] and half is not None:  # the comparison's own number: its 95% interval too
                line[f"{c}_95ci"] = f"[{mean - half:+.4f}, {mean + half:+.4f}]"
        out.append(line)
    return out


def sweep_plots(result, stem, args):
    """The --plot-x plots of one sweep result at stem.png (stem_METRIC.png for a metric other than
    the loss); returns the report's markdown lines for them."""
    lines = []
    for name in args.plot_metric.split(",") if args.plot_x else []:
        plot = stem + ("" if name == "loss" else f"_{name}") + ".png"
        if args.plot_y:
            plot_sweep_heatmap(result, args.plot_x, args.plot_y, plot, name)
        else:
            plot_sweep(result, args.plot_x, plot, name)
        lines += [f"![{result['name']}]({os.path.relpath(plot, os.path.dirname(os.path.abspath(args.out)))})", ""]
    return lines


def read_result(path):
    """(result, None) for an eval.py --json-out or sweep.py result file, else (None, why not). A file
    that cannot be opened is an OSError: a missing one (a typo) is not a skip, and a FIFO is refused
    (fileio.NotOwnFile), not waited on forever."""
    with os.fdopen(open_regular(path), "rb") as f:
        text = f.read()
    try:
        result = parse_json(text)
    except ValueError as e:  # not UTF-8, not JSON, nested past the decoder
        return None, f"not JSON ({e})"
    if not (isinstance(result, dict) and isinstance(result.get("analysis"), str)
            and isinstance(result.get("summary"), dict)):
        return None, "not an eval.py --json-out or sweep.py result (no 'analysis' and 'summary')"
    if result["analysis"] == "sweep" and not isinstance(result.get("rows"), list):
        return None, "a sweep result without its 'rows'"
    return result, None


def result_of(path, flag, analysis, fix):
    """The `analysis` result in path (scaling's loss JSONs, --pair's sweeps), else a ValueError naming
    flag, path, what it is instead and fix."""
    try:
        result, why = read_result(path)
    except OSError as e:  # missing, a FIFO (not opened), unreadable
        result, why = None, e.strerror or str(e)
    if result and result["analysis"] != analysis:
        why = f"a {result['analysis']} result, not a {analysis} result"
    if why:
        raise ValueError(f"{flag} {path}: {why}; {fix}")
    return result


def run_report(args):
    if args.plot_y and args.plot_x in (None, "arm"):
        raise ValueError("--plot-y draws a heatmap over two settings: give --plot-x a setting too (e.g. gamma)")
    if args.plot_together and not args.plot_x:
        raise ValueError("--plot-together draws the sweeps' rows in one plot: give --plot-x too (e.g. lr)")
    groups = {}
    for path in args.results:
        try:
            result, why = read_result(path)
        except OSError as e:  # missing (a typo: not skipped), a folder, a FIFO (not opened)
            raise ValueError(f"{path} is not a result file ({e.strerror or e}): pass eval.py --json-out or sweep.py "
                             "result JSONs (e.g. out/*.json)") from None
        if why:
            # `report results/*.json` meets the study's other JSON files (bench timings, data
            # fingerprints): named and passed over, not a KeyError on the first of them.
            print(f"skipped {path}: {why}", file=sys.stderr)
            continue
        groups.setdefault(result["analysis"], []).append((path, result))
    if not groups:
        raise ValueError(f"none of the {len(args.results)} file(s) is an eval.py --json-out or sweep.py result: "
                         "pass those (e.g. out/*.json)")
    lines, sweeps = [], groups.pop("sweep", [])
    for path, result in sweeps:
        lines += [f"### sweep {result['name']} ({os.path.basename(path)}; {result['summary']['finished']} of "
                  f"{result['summary']['points']} points)", "",
                  format_table(sweep_table(result, args.per_seed), markdown=True), ""]
        if not args.plot_together:  # beside the results JSON
            lines += sweep_plots(result, os.path.splitext(path)[0], args)
    if args.plot_together:
        # one plot over every sweep's rows: a grid and its later refinement, or arms from several sweeps
        merged = {"name": " + ".join(r["name"] for _, r in sweeps),
                  "rows": [row for _, r in sweeps for row in r["rows"]]}
        lines += sweep_plots(merged, os.path.splitext(args.plot_together)[0], args)
    if args.pair:
        lines += [f"### paired by seed ({args.pair_metric})", "",
                  format_table(pair_table(args.pair, args.pair_metric), markdown=True), ""]
    for analysis, items in groups.items():
        lines += [f"### {analysis}", "", format_table([{"file": os.path.basename(p), **r["summary"]} for p, r in items],
                                                      markdown=True), ""]
        if analysis in SEED_TABLES:
            for name, seeds in seed_groups(items).items():
                lines += [f"{analysis} of {name} over {len(seeds)} seed file(s), mean ± std:", "",
                          format_table(rows_over_seeds([r for _, r in seeds], *SEED_TABLES[analysis]),
                                       markdown=True), ""]
        lines += [f"![{analysis}]({os.path.relpath(plot, os.path.dirname(os.path.abspath(args.out)))})"
                  for _, r in items for plot in r.get("plots", [])]
    text = "\n".join(lines) + "\n"
    write_file(args.out, text.encode())
    print(text)
    return None

