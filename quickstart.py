"""The γ experiment end to end on CPU: anchor-task data, two trainings, the anchor benchmark.

    python quickstart.py             # full size: a few minutes on 2 CPU cores
    python quickstart.py --smoke     # reduced size in well under a minute (tests/test_quickstart.py)

Steps: prepare_data.py anchor -> train.py on config/anchor_gamma05.py (standard init: γ=0.5,
RMSNorm eps 1e-5, no attention gate) and config/anchor_gamma1.py (the paper's recipe: γ=1,
eps 1e-12, gated) -> eval.py bench --task anchor on both. Prints a comparison table and writes
<out>/quickstart.json and, when matplotlib is installed, <out>/quickstart.png.

The held-out anchor pair (4,3) never appears in training; its mirror (3,4) is trained with x-6
instead of the composite x-10. A model that composed the single-anchor rules answers x-10
("inferential"); one that copied the mirror pair's answer says x-6 ("symmetric").
"""

import interrupt

if __name__ == "__main__":  # first: the imports below take seconds
    interrupt.while_starting("quickstart: interrupted while starting, before anything ran; rerun the same command")

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

from anchor import AnchorTask
from checkpoint import metrics_rows
from fileio import RunDirError, atomic_write_bytes, check_outputs, read_object, write_json
from launch import child_pool, end_child, start_child, stoppable
from prepare_data import usable_cores
from report import cpu_name, pyplot, save_figure
from train import load_config

ROOT = os.path.dirname(os.path.abspath(__file__))

RUNS = [  # (name, config file, label)
    ("gamma05", "config/anchor_gamma05.py", "γ=0.5 standard"),
    ("gamma1", "config/anchor_gamma1.py", "γ=1 paper recipe"),
]

# Settings from the anchor search (README results section): where γ=1 answered the held-out
# pair mostly inferentially and γ=0.5 mostly symmetrically on every seed tried, in ~4 minutes
# per run on one free core. Applied as --key=value only where the config files resolve
# differently, and announced when they do.
SETTINGS = {
    "model.n_layer": 2, "model.n_head": 1, "model.d_model": 64, "model.mlp": "swiglu",
    "global_batch": 128, "batch_size": 128, "max_steps": 4680, "lr": 1e-3, "warmup_steps": 100,
    "weight_decay.matrix": 0.1, "eval_batches": 15,  # 15 x 128 of the 2,000 validation records
}
DATA = {"--n-train": AnchorTask.n_train, "--n-eval": AnchorTask.n_eval}  # prepare_data.py anchor's defaults

# --smoke: every stage runs, on a tenth of the data and a few dozen steps (checks plumbing,
# not the science). Validation must hold eval_batches full batches of the 256 records.
SMOKE_SETTINGS = {"global_batch": 64, "batch_size": 64, "max_steps": 60, "warmup_steps": 10,
                  "log_interval": 10, "eval_interval": 30, "eval_batches": 2, "ckpt_interval": 60}
SMOKE_DATA = {"--n-train": 2000, "--n-eval": 256}

# One intra-op thread per child process (see --jobs); unbuffered so progress shows as it happens.
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
PROGRESS = re.compile(r"^step \d+")  # train.py's per-step and validation lines


def config_overrides(config, wanted):
    """--key=value arguments for each wanted setting the config file resolves differently."""
    cfg = load_config([os.path.join(ROOT, config)])
    args, notes = [], []
    for key, value in wanted.items():
        head, _, item = key.partition(".")
        current = cfg[head].get(item) if item else cfg[head]
        if current != value:
            args.append(f"--{key}={value!r}")
            notes.append(f"{key} {current!r} -> {value!r}")
    return args, notes


def run_logged(cmd, log_path, prefix, show):
    """Run cmd (in its own session: launch.start_child) with its output in log_path; print the lines
    `show` accepts, prefixed. Returns (exit code, wall seconds)."""
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = start_child(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=CHILD_ENV)
        for line in proc.stdout:
            log.write(line)
            if show(line):
                print(f"{prefix}{line.rstrip()}", flush=True)
        code = end_child(proc)
    return code, time.time() - t0


def check(code, what, log_path):
    if code:
        with open(log_path) as f:
            tail = f.readlines()[-15:]
        sys.stdout.write("".join(tail))
        raise SystemExit(f"quickstart: {what} failed (exit {code}); full log: {log_path}")


def train_all(runs, out, data_dir, extra, jobs):
    """Both trainings, `jobs` at a time (one per core: they are independent; the threads only wait on
    them). Returns wall seconds per run."""
    def train_one(name, config, overrides):
        cmd = [sys.executable, "train.py", config, f"--out_dir={os.path.join(out, name)}",
               f"--data_dir={data_dir}", "--resume=False", *overrides, *extra]
        return run_logged(cmd, os.path.join(out, f"{name}.log"), f"[{name}] ", PROGRESS.match)

    with child_pool(jobs) as pool:
        futures = {name: pool.submit(train_one, name, config, overrides) for name, config, overrides in runs}
        done = {name: future.result() for name, future in futures.items()}  # name -> (exit code, wall seconds)
    for name, (code, _) in done.items():
        check(code, f"training {name}", os.path.join(out, f"{name}.log"))
    return {name: wall for name, (_, wall) in done.items()}


# The summary numbers of eval.py bench --task anchor that the table shows.
SCORES = ("heldout_inferential", "heldout_symmetric", "heldout_other", "seen_pair_acc", "test_key_acc")


def read_scores(path):
    """The summary in eval.py bench's --json-out, refused in one line unless it holds every score as a number."""
    try:
        summary = read_object(path, {"summary": dict})["summary"]
        wrong = [key for key in SCORES if type(summary.get(key)) not in (int, float)]
        if wrong:
            raise ValueError(f"summary's {', '.join(wrong)} missing or not a number")
    except ValueError as e:
        raise ValueError(f"{path} is not eval.py bench's result ({e}): rerun the same command") from None
    return summary


def read_metrics(run_dir):
    rows = [row for _, row in metrics_rows(os.path.join(run_dir, "metrics.jsonl"))]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    return train, val


def table(results, cpu, jobs):
    """The comparison table; its last line names the CPU and how many trainings shared it, which
    the wall-time column depends on."""
    head = (f"{'run':<18} {'inferential':>11} {'symmetric':>9} {'other':>6} {'seen acc':>8} {'new keys':>8} "
            f"{'val loss':>9} {'wall s':>6}")
    lines = ["held-out pair (4,3): inferential = x-10 (composed), symmetric = x-6 (copied from (3,4));",
             "seen acc: trained pairs on training keys (val split); new keys: trained pairs on keys never trained",
             head, "-" * len(head)]
    for r in results:
        lines.append(f"{r['label']:<18} {r['inferential']:>11.1%} {r['symmetric']:>9.1%} {r['other']:>6.1%} "
                     f"{r['seen_pair_acc']:>8.1%} {r['test_key_acc']:>8.1%} {r['val_loss']:>9.3g} {r['wall_s']:>6.0f}")
    lines.append(f"ran on {cpu}, {jobs} training{'s' if jobs > 1 else ''} at a time")
    return "\n".join(lines)


def plot(results, curves, path):
    """Training curves and held-out answer shares; False when matplotlib is missing."""
    try:
        plt = pyplot()
    except ImportError:  # matplotlib is optional: the quickstart says so and goes on
        return False
    fig, (ax_loss, ax_share) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        train, val = curves[r["name"]]
        line, = ax_loss.plot(*zip(*train), label=f"{r['label']} train")
        ax_loss.plot(*zip(*val), "o--", color=line.get_color(), label=f"{r['label']} val")
    ax_loss.set(xlabel="step", ylabel="loss (answer token)", yscale="log", title="training curves")
    ax_loss.legend()
    kinds = ["inferential", "symmetric", "other"]
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        ax_share.bar([k + i * width for k in range(len(kinds))], [r[k] for k in kinds], width, label=r["label"])
    ax_share.set_xticks([k + width * (len(results) - 1) / 2 for k in range(len(kinds))],
                        ["inferential\n(x-10)", "symmetric\n(x-6)", "other"])
    ax_share.set(ylabel="share of held-out answers", ylim=(0, 1), title="held-out pair (4,3)")
    ax_share.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return True


def outputs(out):
    """[(path, "file" or "folder")] of everything the quickstart writes in out, for fileio.check_outputs."""
    folders = [out, os.path.join(out, "data"), *[os.path.join(out, name) for name, _, _ in RUNS]]
    files = ["data.log", "quickstart.json", "quickstart.png",
             *[f"{name}{end}" for name, _, _ in RUNS for end in (".log", "_eval.log", "_anchor.json")]]
    return [(folder, "folder") for folder in folders] + [(os.path.join(out, file), "file") for file in files]


# The file that makes a folder the quickstart's own: each run deletes and remakes its runs, data and logs there.
MARKER = ".quickstart"


def claim(out):
    """out, made when missing, for the quickstart alone: a new or empty folder, or one it marked before. A
    folder of anything else (a training run, a data folder, the user's files) is refused, not emptied."""
    marker = os.path.join(out, MARKER)
    if os.path.isdir(out) and not os.path.isfile(marker):
        theirs = sorted(os.listdir(out))
        if theirs:
            more = f" and {len(theirs) - 1} more" if len(theirs) > 1 else ""
            raise ValueError(f"{out} holds {theirs[0]}{more} and no {MARKER}: it is not a folder the quickstart made, "
                             f"and the quickstart deletes and remakes its runs and data there; choose another --out "
                             f"(a new or empty folder)")
    os.makedirs(out, exist_ok=True)
    atomic_write_bytes(marker, [b"made by quickstart.py, which deletes and remakes the runs, data and logs here\n"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/quickstart", help="folder for data, runs, logs, table and plot")
    p.add_argument("--smoke", action="store_true", help="reduced size: checks every stage in well under a minute")
    p.add_argument("--seed", type=int, default=0, help="init and data-order seed of both runs")
    # Two independent single-threaded trainings use two cores fully; one process with two
    # threads would not (the matrices are too small to split).
    p.add_argument("--jobs", type=int, default=min(2, usable_cores()),
                   help="trainings run at once (default: one per core, at most 2)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        raise SystemExit(f"quickstart: --jobs={args.jobs} must be >= 1")
    out = os.path.abspath(args.out)
    data_dir = os.path.join(out, "data")
    settings = {**SETTINGS, **(SMOKE_SETTINGS if args.smoke else {})}
    data = {**DATA, **(SMOKE_DATA if args.smoke else {})}
    t_start = time.time()
    check_outputs(outputs(out), "move it away or choose another --out")
    claim(out)
    for name, _, _ in RUNS:  # train.py resumes from checkpoints; the quickstart always starts fresh
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)

    print(f"[1/3] anchor-task data -> {data_dir}", flush=True)
    log = os.path.join(out, "data.log")
    # --force: out/data is the quickstart's own, rebuilt like its runs (a --smoke run leaves other settings).
    cmd = [sys.executable, "prepare_data.py", "anchor", "--out", data_dir, "--force",
           *[str(x) for kv in data.items() for x in kv]]
    check(run_logged(cmd, log, "  ", lambda line: True)[0], "prepare_data.py anchor", log)

    runs = []
    for name, config, label in RUNS:
        overrides, notes = config_overrides(config, settings)
        if notes:
            print(f"  {config}: quickstart settings override {', '.join(notes)}")
        runs.append((name, config, overrides))
    print(f"[2/3] training {len(runs)} models, {args.jobs} at a time (progress every log_interval steps)", flush=True)
    walls = train_all(runs, out, data_dir, [f"--seed={args.seed}"], args.jobs)

    print("[3/3] anchor benchmark (eval.py bench --task anchor)", flush=True)
    results, curves = [], {}
    for name, _, label in RUNS:
        run_dir, scores = os.path.join(out, name), os.path.join(out, f"{name}_anchor.json")
        log = os.path.join(out, f"{name}_eval.log")
        cmd = [sys.executable, "eval.py", "bench", run_dir, "--task", "anchor", "--data", data_dir,
               "--device", "cpu", "--json-out", scores]
        check(run_logged(cmd, log, "", lambda line: False)[0], f"eval.py bench on {name}", log)
        summary = read_scores(scores)
        curves[name] = read_metrics(run_dir)
        results.append({"name": name, "label": label, "inferential": summary["heldout_inferential"],
                        "symmetric": summary["heldout_symmetric"], "other": summary["heldout_other"],
                        "seen_pair_acc": summary["seen_pair_acc"], "test_key_acc": summary["test_key_acc"],
                        "val_loss": curves[name][1][-1][1], "wall_s": walls[name]})

    print()
    cpu = cpu_name()
    print(table(results, cpu, args.jobs))
    write_json(os.path.join(out, "quickstart.json"),
               {"smoke": args.smoke, "seed": args.seed, "cpu": cpu, "jobs": args.jobs, "settings": settings,
                "data": data, "results": results})
    png = os.path.join(out, "quickstart.png")
    if plot(results, curves, png):
        print(f"plot: {png}")
    else:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
    print(f"results: {os.path.join(out, 'quickstart.json')}; logs in {out}; total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    STOPPED = "quickstart: stopped by {signal}, and the runs it had started with it; the same command starts it over"
    # train.py's config check (config_overrides), an output path in the way, a damaged result: one line
    interrupt.run(lambda: stoppable(main, STOPPED), STOPPED.format(signal="SIGINT"), errors=(ValueError, RunDirError),
                  line=lambda e: f"quickstart: {e}")
