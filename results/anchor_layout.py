"""The anchor task's layout map (issue 24, item 4): for each sequence length x key window, both
arms' margin s = inferential - symmetric share of the held-out answers (s > 0: the run composes
the pair's rules; s < 0: it copies the mirror pair), seed by seed, from `bash results/anchor.sh
layout` (results/anchor_layout.json). Shares on trained keys sit beside those on all keys where
the rows have them (about 20% of held-out records have a key never trained, so a share on all
keys tops out near 0.8). The two cells that ran before under other names are read from their
files (len 9 anywhere: anchor_ablate.json; len 15 anywhere: anchor_len15.json) when the map
lacks them, and marked. Where `bash results/anchor.sh layout_bench` scored a run again
(results/anchor_bench/<sweep>/<point>.json), that score is used, with the answer position's
attention to the key and to the pair by layer: the mechanism table, next to claim 7's runs (the
tuned layout, seeds 100-105).

    python results/anchor_layout.py   # writes results/report_anchor_layout.md and anchor_layout.png
"""
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from fileio import atomic_write_bytes  # noqa: E402
from report import pyplot, save_figure  # noqa: E402

LENGTHS, WINDOWS, ARMS = (9, 12, 15), ("first", "any", "last"), ("recipe", "baseline")
WINDOW_NAMES = {"first": "key in the first 5 positions", "any": "key anywhere", "last": "key in the last 5 positions"}
EARLIER = {(9, "any"): "anchor_ablate.json", (15, "any"): "anchor_len15.json"}


def bench_summary(sweep, row):
    """The row's summary, or its later score by today's bench where there is one."""
    path = os.path.join(HERE, "anchor_bench", sweep, f"{row['arm']}-seed{row['seed']}.json")
    return json.load(open(path))["summary"] if os.path.exists(path) else row["eval"]["anchor"]["summary"]


def margins(summary, suffix=""):
    inf, sym = summary.get("heldout_inferential" + suffix), summary.get("heldout_symmetric" + suffix)
    return None if inf is None or sym is None else inf - sym


def cells():
    """{(length, window, arm): {seed: summary}} and {(length, window): source file}."""
    out, source = {}, {}
    files = [("anchor_layout.json", None)] + [(f, cell) for cell, f in EARLIER.items()]
    for name, cell in files:
        path = os.path.join(HERE, name)
        if not os.path.exists(path):
            continue
        for row in json.load(open(path))["rows"]:
            if cell is None:
                m = re.fullmatch(r"(recipe|baseline)_len(\d+)_(first|any|last)", row["arm"])
                if not m:
                    continue
                key = (int(m.group(2)), m.group(3), m.group(1))
            elif row["arm"] in ARMS and source.get(cell, name) == name:  # unless the map ran the cell itself
                key = (*cell, row["arm"])
            else:
                continue
            out.setdefault(key, {})[row["seed"]] = bench_summary(os.path.splitext(name)[0], row)
            source[key[:2]] = name
    return out, source


def fmt(values):
    return ", ".join(f"{v:+.2f}" for v in values)


def report(found, source):
    lines = ["# Anchor layout map", "",
             "s = inferential − symmetric share of the held-out answers, by seed (s > 0 composes, s < 0 copies "
             "the mirror); on all held-out keys, then on trained keys where measured. Source: " +
             ", ".join(sorted(set(source.values()))) + ".", "",
             "| length | key window | recipe s by seed | baseline s by seed | recipe s, trained keys | "
             "baseline s, trained keys | recipe composes | baseline copies | source |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in LENGTHS:
        for w in WINDOWS:
            runs = {arm: found.get((n, w, arm), {}) for arm in ARMS}
            if not any(runs.values()):
                lines.append(f"| {n} | {WINDOW_NAMES[w]} | not run | not run | | | | | |")
                continue
            s = {arm: [margins(runs[arm][k]) for k in sorted(runs[arm])] for arm in ARMS}
            t = {arm: [margins(runs[arm][k], "_trained_keys") for k in sorted(runs[arm])] for arm in ARMS}
            trained = {arm: fmt(t[arm]) if t[arm] and None not in t[arm] else "—" for arm in ARMS}
            lines.append(f"| {n} | {WINDOW_NAMES[w]} | {fmt(s['recipe'])} | {fmt(s['baseline'])} | "
                         f"{trained['recipe']} | "
                         f"{trained['baseline']} | {sum(v > 0 for v in s['recipe'])} of {len(s['recipe'])} | "
                         f"{sum(v < 0 for v in s['baseline'])} of {len(s['baseline'])} | {source[(n, w)]} |")
    return "\n".join(lines) + "\n"


ATTENTION = ("attn_to_key_L0", "attn_to_pair_L0", "attn_to_key_L1", "attn_to_pair_L1")


def mechanism(found):
    """The answer position's mean attention to the key and to the pair (two positions summed), per
    layer, averaged over heads, held-out records and seeds; for every cell scored again."""
    runs = dict(found)
    path = os.path.join(HERE, "confirm_anchor.json")
    if os.path.exists(path):
        for row in json.load(open(path))["rows"]:
            runs.setdefault(("claim 7", "tuned", row["arm"]), {})[row["seed"]] = bench_summary("confirm_anchor", row)
    lines = ["", "## The answer position's attention (mechanism)", "",
             "Mean over seeds of the attention from the last input position (whose output is the answer) to "
             "the key and to the two pair positions, layer 0 and layer 1, averaged over heads and held-out "
             "records; s as above. Claim 7's runs are the tuned layout (length 9, key anywhere), seeds 100–105.", "",
             "| cells | arm | runs | mean s | key L0 | pair L0 | key L1 | pair L1 |",
             "|---|---|---|---|---|---|---|---|"]
    for (n, w, arm), seeds in sorted(runs.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]), kv[0][2])):
        scored = [v for v in seeds.values() if ATTENTION[0] in v]
        if not scored:
            continue
        where = "claim 7 (length 9, key anywhere)" if n == "claim 7" else f"length {n}, {WINDOW_NAMES[w]}"
        att = " | ".join(f"{statistics.mean(v[k] for v in scored):.3f}" for k in ATTENTION)
        lines.append(f"| {where} | {arm} | {len(scored)} | "
                     f"{statistics.mean(margins(v) for v in scored):+.2f} | {att} |")
    return "\n".join(lines) + "\n" if len(lines) > 7 else ""


def plot(found, path):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    fig.suptitle("s = inferential − symmetric share of the held-out answers (> 0 composes, < 0 copies)")
    for ax, arm in zip(axes, ARMS):
        grid = [[statistics.mean(margins(v) for v in found[(n, w, arm)].values()) if found.get((n, w, arm))
                 else float("nan") for w in WINDOWS] for n in LENGTHS]
        im = ax.imshow(grid, cmap="RdBu", vmin=-1, vmax=1, origin="lower")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, "not run" if v != v else f"{v:+.2f}", ha="center", va="center", fontsize=9)
        ax.set_xticks(range(len(WINDOWS)), [w if w != "any" else "anywhere" for w in WINDOWS])
        ax.set_yticks(range(len(LENGTHS)), LENGTHS)
        ax.set_xlabel("key window")
        ax.set_title(f"{arm}: mean s")
    axes[0].set_ylabel("sequence length")
    fig.colorbar(im, ax=axes, shrink=0.8)
    save_figure(fig, path)


def main():
    found, source = cells()
    text = report(found, source) + mechanism(found)
    atomic_write_bytes(os.path.join(HERE, "report_anchor_layout.md"), [text.encode()])
    print(text)
    plot(found, os.path.join(HERE, "anchor_layout.png"))


if __name__ == "__main__":
    main()
