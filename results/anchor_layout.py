"""The anchor task's layout map (issue 24, item 4): for each sequence length x key window, both
arms' margin s = inferential - symmetric share of the held-out answers (s > 0: the run composes
the pair's rules; s < 0: it copies the mirror pair), seed by seed, from `bash results/anchor.sh
layout` (results/anchor_layout.json). Shares on trained keys sit beside those on all keys where
the rows have them (about 20% of held-out records have a key never trained, so a share on all
keys tops out near 0.8). The two cells that ran before under other names are read from their
files (len 9 anywhere: anchor_ablate.json; len 15 anywhere: anchor_len15.json) when the map
lacks them, and marked.

    python results/anchor_layout.py   # writes results/report_anchor_layout.md and anchor_layout.png
"""
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from eval import pyplot, save_figure  # noqa: E402
from fileio import atomic_write_bytes  # noqa: E402

LENGTHS, WINDOWS, ARMS = (9, 12, 15), ("first", "any", "last"), ("recipe", "baseline")
WINDOW_NAMES = {"first": "key in the first 5 positions", "any": "key anywhere", "last": "key in the last 5 positions"}
EARLIER = {(9, "any"): "anchor_ablate.json", (15, "any"): "anchor_len15.json"}


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
            out.setdefault(key, {})[row["seed"]] = row["eval"]["anchor"]["summary"]
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
            lines.append(f"| {n} | {WINDOW_NAMES[w]} | {fmt(s['recipe'])} | {fmt(s['baseline'])} | {trained['recipe']} | "
                         f"{trained['baseline']} | {sum(v > 0 for v in s['recipe'])} of {len(s['recipe'])} | "
                         f"{sum(v < 0 for v in s['baseline'])} of {len(s['baseline'])} | {source[(n, w)]} |")
    return "\n".join(lines) + "\n"


def plot(found, path):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    fig.suptitle("s = inferential − symmetric share of the held-out answers (> 0 composes, < 0 copies)")
    for ax, arm in zip(axes, ARMS):
        grid = [[statistics.mean(margins(v) for v in found[(n, w, arm)].values()) if found.get((n, w, arm)) else float("nan")
                 for w in WINDOWS] for n in LENGTHS]
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
    text = report(found, source)
    atomic_write_bytes(os.path.join(HERE, "report_anchor_layout.md"), [text.encode()])
    print(text)
    plot(found, os.path.join(HERE, "anchor_layout.png"))


if __name__ == "__main__":
    main()
