"""
Run a grid of train.py runs (arms x grid x seeds), evaluate each with eval.py, and gather one
results/<name>.json that `eval.py report` turns into tables (mean ± std and a 95% interval).

    python sweep.py config/cpu_lm.py --grid lr=1e-3,3e-3,1e-2 --seeds 0 --name lr_tune \
        --arm recipe= --arm baseline=config/_baseline.py
    python sweep.py config/cpu_lm.py --grid gamma=0.5,0.75,1.0 --seeds 0,1,2 --name gamma --jobs 2
    python sweep.py ... --dry-run            # the points and their commands, nothing runs
    python sweep.py ... --print-commands     # one torchrun line per point, for a cluster scheduler
    python eval.py report results/gamma.json

Every point is a run folder out/sweeps/<name>/<point>. A point is finished when its folder
holds sweep_point.json (written last, atomically, after the evaluations): a second call skips
it. A killed point is simply run again: train.py resumes from its newest complete checkpoint
and the evaluations are redone. Each point is one subprocess with one thread (--jobs N side by
side) that runs train.py's main and then eval.py's, the code `python train.py ... && python eval.py
...` runs, with torch imported once.

A sweep holds a lock on each point it works on (run folder's sweep.lock): a second sweep of the
same name skips the points the first one is running (reported as skipped, busy) instead of
failing on them. SIGTERM, SIGINT or SIGHUP stops the running points' processes before the sweep exits;
on Linux they are also stopped when the sweep is SIGKILLed.
"""

import sys

import interrupt

if __name__ == "__main__" and sys.argv[1:2] != ["--point"]:  # first, before any import below
    interrupt.while_starting("sweep: interrupted while starting, before any point ran; the same command runs the sweep")

import argparse
import glob
import itertools
import json
import os
import platform
import subprocess
import time
from concurrent.futures import as_completed

from configurator import at_least, parse_value  # a grid value is read as train.py reads --key=value
from fileio import RunDirError, check_outputs, lock_holder, open_in_run_dir, read_object, write_json
from launch import STOPPING, child_pool, end_child, start_child, stoppable
# The sweep itself never imports torch (~1.6 s of CPU): checkpoint, report, train and eval are imported by the
# functions that a point's own process runs (point_main and the row it writes).

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_grid(specs):
    """['lr=1e-3,3e-3', 'gamma=0.5'] -> {'lr': [0.001, 0.003], 'gamma': [0.5]} (order kept).
    KEY:KEY=V:V,... is one axis whose keys move together (zipped, not crossed), e.g.
    max_steps:warmup_steps=32:3,320:32 keeps warmup a tenth of each token budget; its values are
    lists, one entry per key."""
    grid = {}
    for spec in specs:
        axis, eq, values = spec.partition("=")
        if not eq or not axis or not values:
            raise ValueError(f"--grid {spec!r}: write KEY=V1,V2,... e.g. --grid lr=1e-3,3e-3")
        keys = axis.split(":")
        for key in keys:
            if not key:
                raise ValueError(f"--grid {spec!r}: an empty key; zipped keys are KEY:KEY=V:V,...")
            if key in grid_keys(grid):
                raise ValueError(f"--grid {key} given twice: put all its values in one --grid")
            check_key(key, "--grid")
        grid[axis] = []
        for value in values.split(","):
            parts = value.split(":") if len(keys) > 1 else [value]
            if len(parts) != len(keys):
                raise ValueError(f"--grid {axis}: value {value!r} has {len(parts)} parts for {len(keys)} keys")
            parsed = [parse_value(v) for v in parts]
            grid[axis].append(parsed if len(keys) > 1 else parsed[0])
    return grid


def grid_keys(grid):
    return [key for axis in grid for key in axis.split(":")]


def grid_setting(grid, values):
    """One product entry of the grid as {key: value}, zipped axes spread over their keys."""
    setting = {}
    for axis, value in zip(grid, values):
        keys = axis.split(":")
        setting.update(zip(keys, value) if len(keys) > 1 else [(axis, value)])
    return setting


def parse_arms(specs):
    """['baseline=config/_baseline.py', 'g0.5=,gamma=0.5,lr=0.01', 'recipe='] ->
    {name: {"configs": [...], "set": {...}}}. An arm is extra config files applied after the
    base (joined by +; empty: the base as it is) and its own fixed settings (e.g. each arm's
    tuned lr)."""
    if not specs:
        return {"base": {"configs": [], "set": {}}}
    arms = {}
    for spec in specs:
        name, eq, rest = spec.partition("=")
        if not eq or not name or "/" in name:
            raise ValueError(f"--arm {spec!r}: write NAME=CONFIG[+CONFIG][,KEY=VALUE...] (NAME= for the base config)")
        files, *pairs = rest.split(",")
        files = [f for f in files.split("+") if f]
        for f in files:
            if not os.path.isfile(f):
                raise ValueError(f"--arm {name}: no such config file {f!r}")
        if name in arms:
            raise ValueError(f"--arm {name} given twice")
        arms[name] = {"configs": files, "set": dict(parse_value_pair(p, f"--arm {name}") for p in pairs)}
    return arms


def value_text(value):
    return value if isinstance(value, str) else repr(value)


def points(arms, grid, seeds):
    """Every (arm, grid values, seed), in a fixed order: arms, then the grid (last key fastest),
    then seeds. Names are unique, readable and safe as folder names."""
    out = []
    for arm, spec in arms.items():
        clash = sorted(set(spec["set"]) & set(grid_keys(grid)))
        if clash:
            raise ValueError(f"--arm {arm} sets {', '.join(clash)}, which the grid sweeps")
        for values in itertools.product(*grid.values()):
            setting = grid_setting(grid, values)
            for seed in seeds:
                parts = [arm] + [f"{k}={value_text(v)}" for k, v in setting.items()] + [f"seed{seed}"]
                name = "-".join(parts).replace("/", "_").replace(" ", "")
                out.append({"name": name, "arm": arm, "configs": spec["configs"], "arm_set": spec["set"],
                            "setting": setting, "seed": seed})
    return out


def train_args(args, point, run_dir):
    overrides = dict(parse_value_pair(s, "--set") for s in args.set)
    overrides.update(point["arm_set"])
    overrides.update(point["setting"])
    return [args.base, *point["configs"], *[f"--{k}={value_text(v)}" for k, v in overrides.items()],
            f"--seed={point['seed']}", f"--out_dir={run_dir}"]


def parse_value_pair(spec, where):
    key, eq, value = spec.partition("=")
    if not eq or not key:
        raise ValueError(f"{where} {spec!r}: write KEY=VALUE, e.g. max_steps=300")
    check_key(key, where)
    return key, parse_value(value)


def check_key(key, where):
    if key in ("seed", "out_dir"):
        raise ValueError(f"{where} {key}: the sweep sets {key} itself (use --seeds for seeds)")


EVALS = ("loss", "sink", "anchor")


def eval_commands(args, run_dir):
    """One eval.py call per analysis in --eval; each writes eval_<analysis>.json in the run.
    anchor is `eval.py bench --task anchor` on the run's own data (the held-out pair's answers)."""
    return {name: ["eval.py", *(["bench", run_dir, "--task", "anchor"] if name == "anchor"
                                else [name, run_dir, "--tokens", str(args.eval_tokens)]),
                   "--json-out", eval_json(run_dir, name)] for name in args.eval}


def eval_json(run_dir, name):
    return os.path.join(run_dir, f"eval_{name}.json")


def git_commit():
    """The sweep's code as `git describe --dirty` spells a commit (checkpoint.code_version), or None
    outside a git checkout."""
    from checkpoint import code_version
    version = code_version()
    return version["git_commit"] and version["git_commit"] + ("-dirty" if version["git_dirty"] else "")


def machine():
    from report import cpu_name
    return {"cpu": cpu_name(), "threads_per_point": 1, "host": platform.node(), "python": platform.python_version()}


def trained_data_fingerprint(run_dir):
    """The data fingerprint (data.data_fingerprint) that the run's newest intact checkpoint trained
    on, read as eval.py reads the checkpoint: a result row names its data, so a rebuilt data set can
    be checked against it. Not sha256-checked again: eval.py has just read every byte."""
    from checkpoint import newest_in_run
    if not glob.glob(os.path.join(run_dir, "ckpt_*")):
        return None
    return newest_in_run(run_dir, verify=False)[1].get("data_fingerprint")


def run_output(path, fields):
    """read_object of a file train.py or eval.py wrote in a run folder, a damaged one refused in one line."""
    try:
        return read_object(path, fields)
    except ValueError as e:
        raise ValueError(f"{path} is not the file train.py or eval.py writes ({e}): remove it and rerun this "
                         "command to redo the point") from None


def point_result(eval_names, point, run_dir, wall_s, command):
    """The result row of a finished point, from its run folder and its evaluations' results."""
    from checkpoint import metrics_rows
    config = run_output(os.path.join(run_dir, "config.json"), {})
    metrics = [row for _, row in metrics_rows(os.path.join(run_dir, "metrics.jsonl"))]
    train_rows = [r for r in metrics if "loss" in r]
    val_rows = [r for r in metrics if "val_loss" in r]
    evals = {}
    for name in eval_names:
        fields = {"summary": dict, "rows": list} if name == "loss" else {"summary": dict}
        result = run_output(eval_json(run_dir, name), fields)
        evals[name] = {"summary": result["summary"], "rows": result["rows"] if name == "loss" else None}
    return {"point": point["name"], "arm": point["arm"], "arm_configs": point["configs"], "arm_set": point["arm_set"],
            "setting": point["setting"],
            "seed": point["seed"], "run_dir": run_dir, "command": command, "config": config,
            "git_commit": git_commit(), "tokens": train_rows[-1]["tokens"] if train_rows else 0,
            "final_train_loss": train_rows[-1]["loss"] if train_rows else None,
            "final_val_loss": val_rows[-1]["val_loss"] if val_rows else None,
            "best_val_loss": min(r["val_loss"] for r in val_rows) if val_rows else None,
            "eval": evals, "data_fingerprint": trained_data_fingerprint(run_dir), "wall_s": wall_s,
            "machine": machine()}


class PointBusy(Exception):
    """Another live sweep (the same --name, started twice) is running this point."""


def lock_point(run_dir):
    """An exclusive OS lock on run_dir/sweep.lock for as long as this sweep works on the point,
    released by the kernel when the sweep dies (no stale lock after a kill). It covers training
    and the evaluations, where train.py's own lock covers only training. The file says who
    holds it, for the sibling's message."""
    path = os.path.join(run_dir, "sweep.lock")
    fd = open_in_run_dir(path, os.O_RDWR | os.O_CREAT)
    holder = lock_holder(fd, path, "sweep.py")
    if holder:
        raise PointBusy(f"{run_dir} is being run by {holder}")
    return fd


def run_point(args, point, run_dir):
    """Train (or resume) and evaluate one point; returns its result row, or None when a sibling
    sweep finished it meanwhile. Output goes to run_dir/sweep.log so side-by-side points don't
    interleave on the console."""
    if STOPPING.is_set():  # a point queued behind the running ones when the sweep was stopped
        raise RuntimeError("the sweep is stopping")
    os.makedirs(run_dir, exist_ok=True)
    lock = lock_point(run_dir)
    try:
        if finished(run_dir):  # a sibling sweep finished it after this one listed its points
            return None
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "EVAL_THREADS": "1"}
        train, evals = train_args(args, point, run_dir), eval_commands(args, run_dir)
        # What the point's process runs: train.py's argv, each evaluation's eval.py argv, then the row it writes.
        spec = {"train": train, "evals": {name: c[1:] for name, c in evals.items()}, "point": point,
                "run_dir": run_dir, "start": time.time()}
        log_fd = open_in_run_dir(os.path.join(run_dir, "sweep.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        with os.fdopen(log_fd, "a") as log:
            log.write("$ " + " && ".join("python " + " ".join(c) for c in [["train.py", *train], *evals.values()])
                      + "\n")
            log.flush()
            point_process = [sys.executable, os.path.join(HERE, "sweep.py"), "--point", json.dumps(spec)]
            returncode = end_child(start_child(point_process, stdout=log, stderr=subprocess.STDOUT, env=env))
        if returncode != 0:
            raise RuntimeError(f"point {point['name']}: its process exited {returncode}; "
                               f"see {os.path.join(run_dir, 'sweep.log')}")
        row = finished(run_dir)
        assert row is not None, "a point's process exits 0 only after writing its sweep_point.json (point_main)"
        return row
    finally:
        os.close(lock)


def point_main(spec):
    """A point's own process (`sweep.py --point SPEC`, started by run_point): train.py's main, then eval.py's main
    for each evaluation, each with the lines and exit status its own process would give (torch imported once,
    not once per tool: ~2 s of CPU each), then the point's row, written last as its sweep_point.json."""
    import eval as ev
    import train
    try:
        train.main(spec["train"])
    except train.ERRORS as e:
        raise interrupt.Stop(train.error_line(e)) from None
    for argv in spec["evals"].values():
        ev.main(argv)
    run_dir, point = spec["run_dir"], spec["point"]
    try:  # the command as a user would type it from the repo root (no path of this machine)
        row = point_result(list(spec["evals"]), point, run_dir, time.time() - spec["start"],
                           ["python", "train.py", *spec["train"]])
    except (ValueError, RunDirError) as e:  # a damaged metrics.jsonl or checkpoint: this point fails
        raise interrupt.Stop(f"point {point['name']}: {e}") from None
    write_json(os.path.join(run_dir, "sweep_point.json"), row)


# The fields of a point's row that this sweep and `eval.py report` read, and their types.
ROW_FIELDS = {"point": str, "arm": str, "arm_configs": list, "arm_set": dict, "setting": dict, "seed": int,
              "command": list, "config": dict, "eval": dict}


def finished(run_dir):
    """A finished point's row (its sweep_point.json), or None. A record that is not a whole row (cut
    short on a disk that lost data, edited by hand, a link) is refused rather than guessed at: read
    as unfinished it would be silently redone, read as it is it would be a wrong row in results."""
    path = os.path.join(run_dir, "sweep_point.json")
    if not os.path.lexists(path):
        return None
    try:
        return read_object(path, ROW_FIELDS, follow=False)
    except ValueError as e:
        raise ValueError(f"{path} is not a finished point's record ({e}): delete it and rerun this command "
                         "to redo the point (train.py resumes from its checkpoints)") from None


def stale_reason(args, point, run_dir):
    """Why a finished point no longer matches its definition (an arm's lr or a --set changed
    since it ran), or None. The train.py command is the whole definition of the run."""
    row = finished(run_dir)
    if row is None:
        return None
    if row["command"] != ["python", "train.py", *train_args(args, point, run_dir)]:
        return f"was run as `{' '.join(row['command'])}`"
    missing = sorted(set(args.eval) - set(row["eval"]))
    return f"was evaluated without {', '.join(missing)}" if missing else None


def write_results(args, todo):
    """results/<name>.json from every finished point, rewritten after each one lands."""
    rows = [r for r in (finished(run_dir) for _, run_dir in todo) if r is not None]
    write_json(os.path.join(args.results_dir, f"{args.name}.json"), {
        "analysis": "sweep", "name": args.name, "base": args.base, "arms": parse_arms(args.arm),
        "grid": parse_grid(args.grid), "seeds": args.seeds, "set": args.set, "eval": args.eval,
        "summary": {"points": len(todo), "finished": len(rows)}, "rows": rows})


def check_name(name):
    """A sweep's name is a folder's (<out-root>/<name>/) and a file's (<results-dir>/<name>.json): one plain
    path component. '..' would put the points beside the sweep folder, '' or '.' in it, 'a/b' anywhere."""
    if name.strip() in ("", ".", "..") or "/" in name:
        raise ValueError(f"--name {name!r}: the name of the sweep's folder and results file must be one plain "
                         "name, without '/' and not '.' or '..', e.g. --name lr_tune")


def outputs(args, todo):
    """[(path, "file" or "folder")] of everything the sweep writes, for check_outputs."""
    files = [os.path.join(args.results_dir, f"{args.name}.json")]
    for _, run_dir in todo:
        files += [os.path.join(run_dir, "sweep.lock"), os.path.join(run_dir, "sweep.log"),
                  *[eval_json(run_dir, name) for name in args.eval]]
    return [(run_dir, "folder") for _, run_dir in todo] + [(path, "file") for path in files]


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="base config file")
    p.add_argument("--grid", action="append", default=[], help="KEY=V1,V2,... (repeatable; the product is swept); "
                   "KEY:KEY=V:V,... moves keys together")
    p.add_argument("--arm", action="append", default=[],
                   help="NAME=CONFIG[+CONFIG] extra config files after the base (repeatable; NAME= is the base)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (init and data order)")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE fixed for every point (repeatable)")
    p.add_argument("--name", required=True, help="sweep name: out/sweeps/<name>/, results/<name>.json")
    p.add_argument("--eval", default="loss", help="comma-separated eval.py analyses per point (loss, sink, anchor)")
    p.add_argument("--eval-tokens", type=at_least(1), default=262144, help="validation tokens per evaluation")
    p.add_argument("--jobs", type=at_least(1), default=1, help="points side by side, one thread each")
    p.add_argument("--out-root", default="out/sweeps", help="parent of the sweep's folder: <out-root>/<name>/<point>/")
    p.add_argument("--results-dir", default="results", help="where <name>.json, one row per finished point, is written")
    p.add_argument("--dry-run", action="store_true", help="list the points and their commands; run nothing")
    p.add_argument("--print-commands", action="store_true", help="one torchrun command per point (for a scheduler)")
    p.add_argument("--nproc", type=at_least(1), default=8, help="--print-commands: GPUs per point")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        check_name(args.name)
        args.seeds = [int(s) for s in args.seeds.split(",")]
        args.eval = [e for e in args.eval.split(",") if e]
        unknown = sorted(set(args.eval) - set(EVALS))
        if unknown:
            raise ValueError(f"--eval {','.join(unknown)}: choose from {', '.join(EVALS)}")
        if not os.path.isfile(args.base):
            raise ValueError(f"no such base config {args.base!r}")
        arms, grid = parse_arms(args.arm), parse_grid(args.grid)
        for s in args.set:
            parse_value_pair(s, "--set")
        todo = [(pt, os.path.join(args.out_root, args.name, pt["name"])) for pt in points(arms, grid, args.seeds)]
        if len({pt["name"] for pt, _ in todo}) != len(todo):
            raise ValueError("two points have the same name: give the arms distinct names")
        for pt, run_dir in todo:  # reads every finished point's record: a broken one stops the sweep here
            stale = stale_reason(args, pt, run_dir)
            if stale:
                raise ValueError(f"point {pt['name']} in {run_dir} {stale}: its row would be reported under "
                                 "today's settings; use a new --name, or delete that folder to rerun it")
        if not (args.dry_run or args.print_commands):  # a listing writes nothing
            check_outputs(outputs(args, todo), "move it away, or choose another --name, --out-root or --results-dir")
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    if args.dry_run or args.print_commands:
        for pt, run_dir in todo:
            state = "finished" if finished(run_dir) else "to run"
            if args.print_commands:
                evals = " && ".join(f"python {' '.join(c)}" for c in eval_commands(args, run_dir).values())
                print(f"torchrun --nproc_per_node={args.nproc} train.py {' '.join(train_args(args, pt, run_dir))}"
                      + (f" && {evals}" if evals else ""))
            else:
                print(f"{pt['name']} [{state}]: python train.py {' '.join(train_args(args, pt, run_dir))}")
        return
    pending = [(pt, d) for pt, d in todo if not finished(d)]
    print(f"sweep {args.name}: {len(todo)} points, {len(todo) - len(pending)} finished, {len(pending)} to run "
          f"({args.jobs} at a time)", flush=True)
    failures, busy = run_all(args, pending, todo)
    write_results(args, todo)
    print(f"wrote {os.path.join(args.results_dir, args.name + '.json')}", flush=True)
    if busy:
        print(f"{len(busy)} point(s) skipped as busy in another live sweep of this name: run this command again "
              "once it has ended to gather their rows", flush=True)
    if failures:
        raise SystemExit("error: " + "; ".join(failures))


def run_all(args, pending, todo):
    """Up to --jobs points at once (threads only wait on subprocesses); results/<name>.json is
    rewritten as each point lands, so a killed sweep keeps everything finished before it.
    Returns (failures, points skipped as busy)."""
    failures, busy = [], []
    with child_pool(args.jobs) as pool:
        futures = {pool.submit(run_point, args, pt, d): pt for pt, d in pending}
        for fut in as_completed(futures):
            pt = futures[fut]
            try:
                row = fut.result()
                if row is None:
                    print(f"skipped {pt['name']}: finished by another sweep meanwhile", flush=True)
                else:
                    loss = row["final_val_loss"]  # train.py's last evaluation (every --eval may lack a loss)
                    print(f"done {pt['name']}: final val loss {loss if loss is None else round(loss, 4)} "
                          f"in {row['wall_s']:.0f}s", flush=True)
            except PointBusy as e:
                busy.append(pt["name"])
                print(f"skipped (busy) {pt['name']}: {e}", flush=True)
            except (RuntimeError, RunDirError) as e:  # RunDirError: a symlink planted as sweep.lock or sweep.log
                failures.append(str(e))
                print(f"failed {e}", flush=True)
            write_results(args, todo)
    return failures, busy


if __name__ == "__main__" and sys.argv[1:2] == ["--point"]:
    interrupt.run(lambda: point_main(json.loads(sys.argv[2])), "interrupted: a sweep point stopped; the sweep "
                  "redoes it (train.py resumes from its checkpoints)")
elif __name__ == "__main__":
    STOPPED = "sweep: stopped by {signal}, and its running points with it; the same command resumes the sweep"
    interrupt.run(lambda: stoppable(main, STOPPED), STOPPED.format(signal="SIGINT"))
