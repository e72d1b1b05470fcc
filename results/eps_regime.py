"""The ε regime law (issue 26, item 1). RMSNorm divides by sqrt(mean(x²) + ε); at init under γ the
residual stream's mean square is about d^-2γ, so ε should act through one ratio, r = ε·d^(2γ). From
`bash results/cpu_lm.sh eps_regime` (results/eps_regime.json): γ=1 with the gate at widths 32, 48
and 64, ε = r/d² for r = 1e-3 .. 1e2, and γ=0.5 at d 64 with d 64's ε values (so r = ε·d, 64x
smaller). Per width and arm, Δloss = loss(ε) − loss(ε=1e-12), paired by seed, against r: do the
widths collapse onto one curve in r, and at the paper's r ≈ 42 (d 2048, γ=1, ε=1e-5) how much of
the recipe's gain over the baseline does that ε remove?

r during training: the stream grows as the model trains, so the ratio the norms see at the end,
r_final = ε / (mean square of the norm's input), is measured on each finished run's final
checkpoint at every norm (each block's attention and MLP norms and the final one; eval.py's
`residual` analysis sees only the attention norm's input), and at init with the run's own seed.
The measurements go to results/eps_regime_r.json, so the report regenerates without the run folders.
Points not yet finished are listed as missing.

    python results/eps_regime.py [--runs out/sweeps/eps_regime] [--data DIR] [--batches 4]
    # reads results/eps_regime.json (+ scale.json, settings.json, confirm_lm.json for the gain);
    # writes results/eps_regime_r.json, results/report_eps_regime.md, results/eps_regime.png
"""
import argparse
import math
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from checkpoint import load_model  # noqa: E402
from data import data_fingerprint, load_meta  # noqa: E402
from downstream import check_data_fits  # noqa: E402
from eval import val_batches  # noqa: E402
from fileio import atomic_write_bytes, read_json, write_json  # noqa: E402
from init import init_model_  # noqa: E402
from model import LayerNorm, RMSNorm  # noqa: E402
from report import T_975, config_value, format_delta, mean_interval, pyplot, save_figure, seed_deltas  # noqa: E402

R_PAPER = 1e-5 * 2048 ** 2  # the paper's d 2048, γ=1, ε=1e-5: r = 41.9
REFERENCE_EPS = 1e-9  # ε below this is the sweep's ε=1e-12 reference (r ≤ 4e-9 at every width here)
# The recipe's gain over the baseline (baseline − recipe, paired by seed) at each width, from the
# sweep whose recipe arm ran at the lr this sweep's γ=1 arm runs at: scale.json at d 32 and 48
# (lr 1e-2, the same runs as this sweep's ε=1e-12 rows), settings.json at d 64 (lr 3e-3, seeds 0-2).
GAIN_FILES = {32: ("scale.json", "recipe_d32", "baseline_d32"), 48: ("scale.json", "recipe_d48", "baseline_d48"),
              64: ("settings.json", "recipe", "baseline")}
# d 64's fresh-seed estimate (results/confirm.md claim 1, seeds 100-105, each arm at its finer-grid lr):
# a second yardstick, not paired with this sweep's runs.
CONFIRM_GAIN = ("confirm_lm.json", "recipe", "baseline")


# ----------------------------------------------------------------------------- the sweep's rows

def load_runs(path):
    """(finished runs, every point the sweep defines). A run: its row plus d, γ, ε, r_init."""
    result = read_json(path)
    runs = []
    for row in result["rows"]:
        d, gamma = config_value(row["config"], "model.d_model"), row["config"]["gamma"]
        eps = config_value(row["config"], "model.norm_eps")
        runs.append({"row": row, "point": row["point"], "arm": row["arm"], "seed": row["seed"], "d": d,
                     "gamma": gamma, "eps": eps, "r_init": eps * d ** (2 * gamma),
                     "loss": row["eval"]["loss"]["summary"]["loss"]})
    # The sweep's own point names (ARM-seedN), so a point that never started is listed too.
    expected = [f"{arm}-seed{seed}" for arm in result["arms"] for seed in result["seeds"]]
    return runs, expected


def groups(runs):
    """{(γ, d): {ε: [runs]}}: one curve per width and arm, γ=1's widths first, the control last."""
    out = {}
    for run in sorted(runs, key=lambda run: (run["gamma"] != 1, run["d"], run["eps"])):
        out.setdefault((run["gamma"], run["d"]), {}).setdefault(run["eps"], []).append(run)
    return out


def nominal_r(r):
    # The sweep's ε values are printed to 6 digits (9.76563e-07 for 1e-3/32²): r = 1.0000005e-3.
    return 10.0 ** round(math.log10(r))


def curves(runs):
    """[(γ, d, ε, r_init, {seed: Δloss}, [runs])] for every ε above the reference; Δ paired by seed
    with eval.py report --pair's seed_deltas, {} while the width's reference has not run."""
    out = []
    for (gamma, d), by_eps in groups(runs).items():
        ref = [run["row"] for eps, rs in by_eps.items() if eps < REFERENCE_EPS for run in rs]
        for eps, rs in by_eps.items():
            if eps >= REFERENCE_EPS:
                deltas = seed_deltas(ref, [run["row"] for run in rs]) if ref else {}
                out.append((gamma, d, eps, rs[0]["r_init"], deltas, rs))
    return out


def label(gamma, d):
    return f"γ={gamma:g}, d={d}" + (" (control)" if gamma != 1 else "")


# ----------------------------------------------------------------------------- collapse in r

def collapse_rows(curve_list):
    """Per nominal r, γ=1 only: each width's Δ mean and 95% interval, the spread of the width
    means, and the seed noise it is compared with: the 95% half-width of a difference of two width
    means with the within-width std pooled over every width at that r."""
    by_r = {}
    for gamma, d, eps, r, deltas, _ in curve_list:
        if gamma == 1 and len(deltas) >= 2:
            by_r.setdefault(nominal_r(r), {})[d] = list(deltas.values())
    rows = []
    for r, by_d in sorted(by_r.items()):
        stats = {d: mean_interval(v) for d, v in sorted(by_d.items())}
        row = {"r": r, "stats": stats, "n": {d: len(v) for d, v in by_d.items()}}
        if len(stats) >= 2:
            df = sum(len(v) - 1 for v in by_d.values())
            pooled = math.sqrt(sum((len(v) - 1) * s[1] ** 2 for v, s in zip(by_d.values(), stats.values())) / df)
            lo_d = min(stats, key=lambda k: stats[k][0])
            hi_d = max(stats, key=lambda k: stats[k][0])
            # The extreme pair is the one a pairwise test would flag first.
            half = T_975[df - 1] * pooled * math.sqrt(1 / row["n"][lo_d] + 1 / row["n"][hi_d])
            row.update(spread=stats[hi_d][0] - stats[lo_d][0], pooled_std=pooled, df=df, half=half,
                       overlap=max(m - h for m, _, h in stats.values()) <= min(m + h for m, _, h in stats.values()))
        rows.append(row)
    return rows


def control_rows(curve_list):
    """The γ=0.5 control against γ=1 at the same width. At one width and γ, r is ε times a constant,
    so only the two γ tell "ε acts through r" from "ε acts alone": per γ=0.5 point, its Δ and γ=1's
    mean-Δ curve (linear in log ε between its points) read at the same ε (the prediction if ε alone
    mattered) and at the same r (the law's prediction); None outside γ=1's range."""
    out = []
    for gamma, d, eps, r, deltas, _ in curve_list:
        if gamma == 1 or not deltas:
            continue
        ref = sorted((c[2], c[3], float(np.mean(list(c[4].values()))))
                     for c in curve_list if c[0] == 1 and c[1] == d and c[4])

        def read(x, column):
            xs = np.log10([point[column] for point in ref])
            # 1e-6: the sweep's 6-digit ε puts equal ε a hair apart.
            inside = len(ref) >= 2 and xs[0] - 1e-6 <= math.log10(x) <= xs[-1] + 1e-6
            return float(np.interp(math.log10(x), xs, [point[2] for point in ref])) if inside else None
        out.append({"gamma": gamma, "d": d, "eps": eps, "r": r, "deltas": deltas,
                    "at_eps": read(eps, 0), "at_r": read(r, 1)})
    return out


# ----------------------------------------------------------------------------- r ≈ 42 and the gain

def interpolate_at(deltas_lo, r_lo, deltas_hi, r_hi, r=R_PAPER):
    """{seed: Δ at r}, linear in log r between two points of one curve, seed by seed (the pairing
    carries through), for the seeds both points have."""
    t = (math.log(r) - math.log(r_lo)) / (math.log(r_hi) - math.log(r_lo))
    return {s: deltas_lo[s] + t * (deltas_hi[s] - deltas_lo[s]) for s in deltas_lo if s in deltas_hi}


def gain(spec):
    """{seed: baseline − recipe} from a committed sweep, or {} when the file is absent."""
    path, recipe, baseline = spec
    path = os.path.join(HERE, path)
    if not os.path.exists(path):
        return {}
    rows = read_json(path)["rows"]
    return seed_deltas([r for r in rows if r["arm"] == recipe], [r for r in rows if r["arm"] == baseline])


def paper_rows(curve_list, gains):
    """Per γ=1 width: Δ at r=10, r=100 and interpolated at r ≈ 42, each as {seed: Δ}, beside the
    width's gain {seed: baseline − recipe}."""
    out = []
    for d in sorted({c[1] for c in curve_list if c[0] == 1}):
        at = {nominal_r(r): (r, deltas) for gamma, dd, eps, r, deltas, _ in curve_list if gamma == 1 and dd == d}
        lo, hi = at.get(10.0), at.get(100.0)
        mid = interpolate_at(lo[1], lo[0], hi[1], hi[0]) if lo and hi else {}
        out.append({"d": d, "r10": lo[1] if lo else {}, "r100": hi[1] if hi else {}, "r42": mid,
                    "gain": gains.get(d, {})})
    return out


def share(deltas, gain_by_seed):
    """'mean share [from the Δ interval's ends]' of the mean gain, or '—'."""
    if not deltas or not gain_by_seed:
        return "—"
    g = float(np.mean(list(gain_by_seed.values())))
    mean, std, half = mean_interval(list(deltas.values()))
    return f"{mean / g:.0%}" + ("" if half is None else f" [{(mean - half) / g:.0%}, {(mean + half) / g:.0%}]")


# ----------------------------------------------------------------------------- r during training

def norm_modules(model):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (RMSNorm, LayerNorm))]


@torch.no_grad()
def norm_input_squares(model, inputs):
    """{norm name: (mean square of its input over every token and channel, median over tokens of
    each token's mean square)}. The norm divides each token by its own mean square, so the median
    token shows whether a few large tokens carry the mean."""
    seen = {name: [] for name, _ in norm_modules(model)}
    hooks = [m.register_forward_hook(
                 lambda m, args, out, name=name: seen[name].append(args[0].float().pow(2).mean(-1).flatten()))
             for name, m in norm_modules(model)]
    try:
        for x in inputs:
            model(x)
    finally:
        for h in hooks:
            h.remove()
    # Every token has the same number of channels, so the mean of per-token mean squares is the
    # mean square over everything.
    return {name: (float(torch.cat(v).mean()), float(torch.cat(v).median())) for name, v in seen.items()}


def measure_run(run_dir, data, inputs_for):
    """Mean squares at every norm of the run's newest checkpoint and of the same model at init (the
    run's γ, seed and init overrides). inputs_for(data, seq_len) gives the validation batches."""
    model, info = load_model(run_dir)
    check_data_fits(data, model, info)
    inputs = inputs_for(data, info["config"]["seq_len"])
    final = norm_input_squares(model, inputs)
    cfg = info["config"]
    with warnings.catch_warnings():
        # init.py's ε audit warns on exactly the large-ε runs this sweep is about.
        warnings.simplefilter("ignore")
        init_model_(model, gamma=cfg["gamma"], seed=cfg["seed"], overrides=cfg["init_overrides"] or None)
    init = norm_input_squares(model, inputs)
    return {"step": info["step"], "norms": {name: {"mean_square": final[name][0], "median_token_square": final[name][1],
                                                    "mean_square_init": init[name][0]} for name in final}}


def measure(runs, args, path):
    """Measure every finished run whose run folder exists and that path does not hold yet (same
    batches); rewrite path after each, so a killed measurement keeps what it did."""
    settings = {"split": "val", "batches": args.batches, "batch_size": args.batch_size, "seed": 0}
    stored = read_json(path) if os.path.exists(path) else {}
    if stored.get("settings") != settings:
        stored = {"analysis": "eps_regime_r", "settings": settings, "points": {}}
    if not os.path.isdir(args.runs):
        print(f"{args.runs}: no run folders here; r_final from {os.path.relpath(path, ROOT)} only "
              f"({len(stored['points'])} runs measured)", file=sys.stderr)
        return stored
    cache, fingerprints = {}, {}

    def fingerprint(data):
        if data not in fingerprints:
            fingerprints[data] = data_fingerprint(data, load_meta(data))
        return fingerprints[data]

    def inputs_for(data, seq_len):
        # One fixed set of batches for every run: the runs differ, not what they are shown.
        if (data, seq_len) not in cache:
            _, _, batches = val_batches(data, "val", args.batch_size, seq_len, args.batches * args.batch_size * seq_len,
                                        0, "batches")
            cache[data, seq_len] = [x for x, _, _ in batches]
        return cache[data, seq_len]

    todo = [run for run in runs if run["point"] not in stored["points"]
            and os.path.isdir(os.path.join(args.runs, run["point"]))]
    for i, run in enumerate(todo):
        # --data as given; a run's own data_dir is relative to the repository, where it trained.
        data = args.data or os.path.join(ROOT, run["row"]["config"]["data_dir"])
        entry = measure_run(os.path.join(args.runs, run["point"]), data, inputs_for)
        # The batches' data, by the same fingerprint the sweep rows record for the training data.
        entry.update(eps=run["eps"], d_model=run["d"], gamma=run["gamma"], seed=run["seed"],
                     data_fingerprint=fingerprint(data))
        stored["points"][run["point"]] = entry
        write_json(path, stored)
        print(f"measured {run['point']} ({i + 1} of {len(todo)})", file=sys.stderr)
    absent = [run["point"] for run in runs if run["point"] not in stored["points"]]
    if absent:
        print(f"no checkpoint under {args.runs} for {len(absent)} finished runs: {', '.join(absent)}", file=sys.stderr)
    return stored


def run_r(entry, which="final"):
    """ε / mean square at each norm of one measured run: {norm: r}. which: "final" (the final
    checkpoint), "token" (the final checkpoint, the median token's mean square), "init"."""
    key = {"final": "mean_square", "token": "median_token_square", "init": "mean_square_init"}[which]
    return {name: entry["eps"] / v[key] for name, v in entry["norms"].items()}


def ranks(values):
    """Ranks 1..n, tied values sharing their average rank (Spearman's rule for ties)."""
    values = np.asarray(values, dtype=float)
    order = np.argsort(values, kind="stable")
    out = np.empty(len(values))
    out[order] = np.arange(1, len(values) + 1)
    for v in np.unique(values):
        tied = values == v
        out[tied] = out[tied].mean()
    return out


def spearman(x, y):
    return float(np.corrcoef(ranks(x), ranks(y))[0, 1]) if len(x) >= 3 else float("nan")


def ordering(curve_list, measured):
    """Per run above the reference with a measurement: (Δ, γ, {summary name: r}). The summaries: the
    theory's r_init, the measured r at init and r_final (median over norms), r_final's largest over
    norms, and r_final at each norm."""
    out = []
    for gamma, d, eps, r, deltas, rs in curve_list:
        for run in rs:
            entry = measured.get(run["point"])
            if entry is None or run["seed"] not in deltas:
                continue
            final = run_r(entry)
            summaries = {"r_init = ε·d^(2γ)": r,
                         "r at init, measured (median over norms)":
                             float(np.median(list(run_r(entry, "init").values()))),
                         "r_final (median over norms)": float(np.median(list(final.values()))),
                         "r_final (largest over norms)": max(final.values()),
                         **{f"r_final at {name}": v for name, v in final.items()}}
            out.append((deltas[run["seed"]], gamma, summaries))
    return out


# ----------------------------------------------------------------------------- report and plot

def fnum(x):
    return f"{x:.3g}"


def r_summary(rs, measured, which):
    """'median [min, max]' of ε/mean square over every norm of the point's measured seeds."""
    values = [v for run in rs if run["point"] in measured for v in run_r(measured[run["point"]], which).values()]
    return f"{fnum(float(np.median(values)))} [{fnum(min(values))}, {fnum(max(values))}]" if values else "—"


def geometric_mean(values):
    return float(np.exp(np.mean(np.log(values))))


def header(runs, expected):
    finished = {run["point"] for run in runs}
    missing = [p for p in expected if p not in finished]
    commits = sorted({run["row"].get("git_commit", "")[:7] for run in runs})
    cpus = sorted({run["row"].get("machine", {}).get("cpu", "?") for run in runs})
    lines = ["# The ε regime law (issue 26, item 1)", "",
             "`python results/eps_regime.py` on results/eps_regime.json (`bash results/cpu_lm.sh eps_regime`): "
             f"{len(finished)} of {len(expected)} points finished (commit {', '.join(commits)}; {', '.join(cpus)}). "
             "Δloss = loss(ε) − loss(ε=1e-12) of the same width, γ and seed (eval.py loss on 262k validation "
             "tokens), mean ± std over seeds [95% t-interval], as `eval.py report --pair` computes it. "
             "r_init = ε·d^(2γ), the ratio of ε to the stream's mean square at init by the theory; r_final = "
             "ε / (mean square of the norm's input) at the final checkpoint, measured at every norm "
             "(results/eps_regime_r.json); 'r at init, measured': the same on the run's own init.", ""]
    if missing:
        lines += [f"**Missing ({len(missing)} points, not yet finished):** " + ", ".join(missing), ""]
    return lines


def delta_table(runs, curve_list, measured):
    lines = ["## Δloss against r", "",
             "| arm | ε | r_init | seeds | loss | Δloss | Δ by seed | r at init, measured: median [min, max] "
             "over norms | r_final: median [min, max] over norms |", "|---|---|---|---|---|---|---|---|---|"]
    for (gamma, d), by_eps in groups(runs).items():
        deltas_of = {c[2]: c[4] for c in curve_list if (c[0], c[1]) == (gamma, d)}
        for eps, rs in by_eps.items():
            loss, std, _ = mean_interval([run["loss"] for run in rs])
            deltas = deltas_of.get(eps) or {}
            delta = "reference" if eps < REFERENCE_EPS else (format_delta(list(deltas.values())) or "no reference seed")
            by_seed = ", ".join(f"{s}: {v:+.4f}" for s, v in sorted(deltas.items()))
            lines.append(f"| {label(gamma, d)} | {eps:g} | {fnum(rs[0]['r_init'])} | {len(rs)} | {loss:.4f}"
                         + ("" if std is None else f" ± {std:.4f}") + f" | {delta} | {by_seed} | "
                         f"{r_summary(rs, measured, 'init')} | {r_summary(rs, measured, 'final')} |")
    return lines


def collapse_section(curve_list):
    rows = collapse_rows(curve_list)
    widths = sorted({d for row in rows for d in row["stats"]})
    lines = ["", "## Collapse: do the widths agree at each r? (γ=1)", "",
             "Spread: the largest minus the smallest width mean. Noise: the 95% half-width of a difference of two "
             "width means, the within-width std pooled over the widths at that r (df = seeds − 1 summed). "
             "Intervals overlap: some Δ lies inside every width's 95% interval (lenient with 3 seeds: each interval "
             "is 4.3 standard errors wide each side).", "",
             "| r | " + " | ".join(f"d={d}: Δ [95%]" for d in widths)
             + " | spread | noise (95% half-width) | spread / noise | intervals overlap |",
             "|---|" + "---|" * (len(widths) + 4)]
    for row in rows:
        cells = []
        for d in widths:
            m, _, h = row["stats"].get(d, (None, None, None))
            cells.append("—" if m is None else f"{m:+.4f}" + ("" if h is None else f" [{m - h:+.4f}, {m + h:+.4f}]"))
        tail = (f"{row['spread']:.4f} | {row['half']:.4f} | {row['spread'] / row['half']:.2f} | "
                f"{'yes' if row['overlap'] else 'no'}") if "spread" in row else "— | — | — | one width"
        lines.append(f"| {row['r']:g} | " + " | ".join(cells) + f" | {tail} |")
    compared = [row for row in rows if "spread" in row]
    if compared:
        agree = [f"{row['r']:g}" for row in compared if row["overlap"]]
        apart = [f"{row['r']:g}" for row in compared if not row["overlap"]]
        beyond = [f"{row['r']:g}" for row in compared if row["spread"] > row["half"]]
        lines += ["", f"**In short** (widths {', '.join(str(d) for d in widths)}, at the r values where at least two "
                  f"ran): the widths' curves agree within their intervals at r = {', '.join(agree) or 'none'}"
                  + (f", and not at r = {', '.join(apart)}" if apart else "") + ". "
                  + ("The spread of the width means exceeds the noise of a difference of two means at r = "
                     f"{', '.join(beyond)}." if beyond else
                     "Nowhere does the spread of the width means exceed the noise of a difference of two means.")]
    return lines


def inside(x, deltas):
    """Whether x lies in the 95% interval of the Δ by seed: 'yes', 'no', or '—' without one."""
    m, _, h = mean_interval(list(deltas.values()))
    return "—" if x is None or h is None else ("yes" if m - h <= x <= m + h else "no")


def control_section(runs, curve_list):
    lrs = {gamma: sorted({run["row"]["config"]["lr"] for run in runs if run["gamma"] == gamma and run["d"] == 64})
           for gamma in (0.5, 1.0)}
    lines = ["", "## The γ=0.5 control: ε alone, or r?", "",
             "At d=64, γ=0.5 ran at γ=1's ε values, so its r = ε·d is 64x smaller. If ε acted alone, γ=0.5's Δ would "
             "match γ=1's at the same ε; by the law, γ=1's at the same r (γ=1's mean curve, linear in log between "
             "its points; '—' outside γ=1's range). 'inside?': in γ=0.5's 95% interval. γ=0.5 runs at its own lr "
             f"({', '.join(f'{v:g}' for v in lrs[0.5]) or '—'}, "
             f"against γ=1's {', '.join(f'{v:g}' for v in lrs[1.0]) or '—'}), "
             "so the control differs in more than γ.", "",
             "| arm | ε | r = ε·d | Δ measured [95%] | γ=1 at the same ε | inside? | γ=1 at the same r | inside? |",
             "|---|---|---|---|---|---|---|---|"]
    control = control_rows(curve_list)
    for row in control:
        read = " | ".join(("—" if x is None else f"{x:+.4f}") + f" | {inside(x, row['deltas'])}"
                          for x in (row["at_eps"], row["at_r"]))
        lines.append(f"| {label(row['gamma'], row['d'])} | {row['eps']:g} | {fnum(row['r'])} | "
                     f"{format_delta(list(row['deltas'].values()))} | {read} |")
    if not control:
        lines.append("| (no γ=0.5 point has finished with its reference yet) | | | | | | | |")
    return lines


def paper_section(runs, curve_list, gains, confirm_gain):
    def fd(deltas):
        return format_delta(list(deltas.values())) or "—"

    lines = ["", f"## The paper's regime, r ≈ {R_PAPER:.1f}", "",
             "Δ at r ≈ 42: linear in log r between the r=10 and r=100 points, seed by seed. The gain: baseline − "
             "recipe at that width, paired by seed, from the sweep whose recipe ran at this sweep's γ=1 lr: "
             + "; ".join(f"d={d}: results/{f} ({a} vs {b})" for d, (f, a, b) in GAIN_FILES.items())
             + ". Share: Δ's mean over the gain's mean [Δ's interval ends over the gain's mean; the gain's own "
             "uncertainty is not in it].", "",
             "| d | gain (baseline − recipe) | Δ at r=10 | Δ at r=100 | Δ at r≈42 | share of the gain at r=10 | "
             "at r≈42 | at r=100 |", "|---|---|---|---|---|---|---|---|"]
    for row in paper_rows(curve_list, gains):
        shares = " | ".join(share(row[k], row["gain"]) for k in ("r10", "r42", "r100"))
        lines.append(f"| {row['d']} | {fd(row['gain'])} | {fd(row['r10'])} | {fd(row['r100'])} | {fd(row['r42'])} | "
                     f"{shares} |")
        if row["d"] == 64 and confirm_gain:
            shares = " | ".join(share(row[k], confirm_gain) for k in ("r10", "r42", "r100"))
            lines.append(f"| 64, against results/{CONFIRM_GAIN[0]} (seeds 100–105, recipe lr 5.5e-3, baseline "
                         f"1.7e-2) | {fd(confirm_gain)} | | | | {shares} |")
    # The gain comes from another sweep: its recipe runs should be this sweep's ε=1e-12 runs again.
    checks = []
    for d, (name, recipe, _) in GAIN_FILES.items():
        ours = {run["seed"]: run["loss"] for run in runs
                if run["gamma"] == 1 and run["d"] == d and run["eps"] < REFERENCE_EPS}
        path = os.path.join(HERE, name)
        if ours and os.path.exists(path):
            theirs = {r["seed"]: r["eval"]["loss"]["summary"]["loss"]
                      for r in read_json(path)["rows"] if r["arm"] == recipe}
            diffs = [abs(ours[s] - theirs[s]) for s in ours if s in theirs]
            if diffs:
                checks.append(f"d={d}: largest |difference| {max(diffs):.2g} over {len(diffs)} seeds")
    if checks:
        lines += ["", "This sweep's ε=1e-12 runs against the gain file's recipe runs (the same settings): "
                  + "; ".join(checks) + "."]
    return lines


def norm_section(runs, measured, settings):
    lines = ["", "## r at each norm at the final checkpoint", "",
             f"Measured on {settings['batches']} batches of {settings['batch_size']} validation sequences (the same "
             "for every run; eps_regime_r.json's settings). "
             "ε / mean square of each norm's input at the final checkpoint, geometric mean over the measured seeds; "
             "the last column is the final norm's r with the median token's mean square instead of the mean over "
             "tokens (a large gap: a few tokens carry the mean square).", ""]
    names = list(dict.fromkeys(n for e in measured.values() for n in e["norms"]))
    if not names:
        return lines + ["No run measured yet."]
    lines += ["| arm | ε | r_init | seeds measured | " + " | ".join(names) + " | final norm, median token |",
              "|---|---|---|---|" + "---|" * (len(names) + 1)]
    for (gamma, d), by_eps in groups(runs).items():
        for eps, rs in by_eps.items():
            entries = [measured[run["point"]] for run in rs if run["point"] in measured]
            if entries:
                cells = [fnum(geometric_mean([run_r(e)[n] for e in entries])) for n in names]
                token = fnum(geometric_mean([run_r(e, "token")[names[-1]] for e in entries]))
                lines.append(f"| {label(gamma, d)} | {eps:g} | {fnum(rs[0]['r_init'])} | {len(entries)} | "
                             + " | ".join(cells) + f" | {token} |")
    return lines


def ordering_section(curve_list, measured):
    points = ordering(curve_list, measured)
    lines = ["", "## Which r orders the cost: init or final", ""]
    if not points:
        return lines + ["No run measured yet (results/eps_regime_r.json holds none of the finished points)."]
    g1 = [p for p in points if p[1] == 1]
    lines += ["Spearman rank correlation of Δloss with each r, over runs (every ε above the reference, each seed "
              "its own Δ; a point's seeds share its r_init, as tied ranks):", "",
              "| r | all runs | γ=1 runs only |", "|---|---|---|"]
    rho = {}
    for name in points[0][2]:
        rho[name] = spearman([p[2][name] for p in points], [p[0] for p in points])
        lines.append(f"| {name} | {rho[name]:+.3f} ({len(points)} runs) | "
                     f"{spearman([p[2][name] for p in g1], [p[0] for p in g1]):+.3f} ({len(g1)} runs) |")
    init, final = rho["r_init = ε·d^(2γ)"], rho["r_final (median over norms)"]
    best = max((n for n in rho if n.startswith("r_final")), key=lambda n: rho[n])
    return lines + ["", "Over all runs " + ("r_final" if final > init else "r_init") + " orders Δloss better: "
                    f"ρ = {init:+.3f} for r_init, {final:+.3f} for r_final (median over norms); the best of r_final's "
                    f"summaries is {best}, ρ = {rho[best]:+.3f}."
                    + ("" if any(p[1] != 1 for p in points) else " No γ=0.5 run is measured yet: it is the control "
                       "that separates r_init from ε itself (at one width and γ, r_init is ε times a constant).")]


def report(runs, expected, curve_list, stored, gains, confirm_gain):
    measured = stored["points"]
    lines = (header(runs, expected) + delta_table(runs, curve_list, measured) + collapse_section(curve_list)
             + control_section(runs, curve_list) + paper_section(runs, curve_list, gains, confirm_gain)
             + norm_section(runs, measured, stored["settings"]) + ordering_section(curve_list, measured))
    return "\n".join(lines) + "\n"


def plot(curve_list, measured, gains, path):
    plt = pyplot()
    panels = 2 if measured else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 4.2), sharey=True, squeeze=False)
    colours = {}
    for ax, which in zip(axes[0], ("init", "final")[:panels]):
        for gamma, d in dict.fromkeys((c[0], c[1]) for c in curve_list):
            xs, ys, errs = [], [], []
            for g, dd, eps, r, deltas, rs in curve_list:
                if (g, dd) != (gamma, d) or not deltas:
                    continue
                if which == "final":
                    values = [v for run in rs if run["point"] in measured
                              for v in run_r(measured[run["point"]]).values()]
                    if not values:
                        continue
                    r = float(np.median(values))
                m, _, h = mean_interval(list(deltas.values()))
                xs.append(r)
                ys.append(m)
                errs.append(h or 0.0)
            if not xs:
                continue
            # In ε order (curves() sorts by ε): r_final need not rise with ε, and the path shows where it folds back.
            line = ax.errorbar(xs, ys, yerr=errs, marker="o",
                               capsize=3, ls="--" if gamma != 1 else "-", label=label(gamma, d),
                               color=colours.get((gamma, d)))
            colours[(gamma, d)] = line[0].get_color()
        ax.set_xscale("log")
        ax.axhline(0, color="grey", lw=0.8)
        ax.axvline(R_PAPER, color="grey", ls=":", lw=1)
        ax.text(R_PAPER, ax.get_ylim()[1], " paper: r≈42", va="top", fontsize=8, color="grey")
        for d, g in gains.items():
            if g and (1.0, d) in colours:
                ax.axhline(float(np.mean(list(g.values()))), color=colours[(1.0, d)], ls=":", lw=1)
        ax.set_xlabel("r_init = ε·d^(2γ)" if which == "init"
                      else "r_final = ε / mean square at the norm (median over norms and seeds)")
    axes[0][0].set_ylabel("Δloss = loss(ε) − loss(ε=1e-12)  (mean, 95% interval)")
    axes[0][0].legend(fontsize=8, title="dotted: the recipe's gain over the baseline", title_fontsize=7)
    fig.suptitle("RMSNorm ε against the residual stream's scale")
    save_figure(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=os.path.join(HERE, "eps_regime.json"), help="the sweep's results file")
    p.add_argument("--runs", default=os.path.join(ROOT, "out", "sweeps", "eps_regime"),
                   help="the sweep's run folders (their final checkpoints are measured); skipped when absent")
    p.add_argument("--data", default=None, help="validation data folder (default: each run's own data_dir)")
    p.add_argument("--batches", type=int, default=4, help="validation batches per checkpoint")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    p.add_argument("--out-dir", default=HERE, help="where the report, plot and eps_regime_r.json go")
    args = p.parse_args(argv)
    runs, expected = load_runs(args.results)
    stored = measure(runs, args, os.path.join(args.out_dir, "eps_regime_r.json"))
    measured = stored["points"]
    curve_list = curves(runs)
    gains = {d: gain(spec) for d, spec in GAIN_FILES.items()}
    confirm_gain = gain(CONFIRM_GAIN)
    text = report(runs, expected, curve_list, stored, gains, confirm_gain)
    atomic_write_bytes(os.path.join(args.out_dir, "report_eps_regime.md"), [text.encode()])
    print(text)
    try:
        plot(curve_list, measured, gains, os.path.join(args.out_dir, "eps_regime.png"))
    except ImportError as e:
        print(f"no plot: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
