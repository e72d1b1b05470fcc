"""sweep.py: grid expansion, one-line errors, real 2-step sweeps (results rows against the run
folders, a second call runs nothing, a killed point resumes to the uninterrupted result), and
`eval.py report`'s aggregation against hand-computed means, stds and t-intervals."""
import argparse
import glob
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import checkpoint
import eval as ev
import interrupt
import report
import sweep
from conftest import launch_env
from test_train import rows, train_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--set", "model_size=tiny", "--set", "model={'max_seq_len': 32}", "--set", "seq_len=32",
        "--set", "global_batch=4", "--set", "batch_size=4", "--set", "warmup_steps=1", "--set", "log_interval=1",
        "--set", "eval_interval=1", "--set", "eval_batches=1", "--set", "ckpt_interval=1"]


def test_points_expand_arms_grid_and_seeds_in_order(tmp_path):
    extra = tmp_path / "b.py"
    extra.write_text("gamma = 0.5\n")
    arms = sweep.parse_arms(["r=", f"b={extra},lr=0.5,model.norm_eps=1e-5"])
    assert arms == {"r": {"configs": [], "set": {}}, "b": {"configs": [str(extra)], "set": {"lr": 0.5, "model.norm_eps": 1e-5}}}
    grid = sweep.parse_grid(["gamma=0.5,1.0", "model.attn_gate=none,headwise"])
    assert grid == {"gamma": [0.5, 1.0], "model.attn_gate": ["none", "headwise"]}
    pts = sweep.points(arms, grid, [0, 1])
    want = [(arm, g, gate, s) for arm in ("r", "b") for g in (0.5, 1.0) for gate in ("none", "headwise") for s in (0, 1)]
    assert [(p["arm"], p["setting"]["gamma"], p["setting"]["model.attn_gate"], p["seed"]) for p in pts] == want
    assert pts[0]["name"] == "r-gamma=0.5-model.attn_gate=none-seed0"
    assert len({p["name"] for p in pts}) == 16

    class Args:
        base, set = "config/cpu_lm.py", ["max_steps=2"]
    b = pts[8]  # arm b, gamma 0.5, gate none, seed 0: base, arm file, --set, arm settings, grid, seed, out_dir
    assert sweep.train_args(Args, b, "out/x") == [
        "config/cpu_lm.py", str(extra), "--max_steps=2", "--lr=0.5", "--model.norm_eps=1e-05", "--gamma=0.5",
        "--model.attn_gate=none", "--seed=0", "--out_dir=out/x"]


def test_zipped_grid_keys_move_together():
    grid = sweep.parse_grid(["max_steps:warmup_steps=32:3,320:32", "lr=0.1,0.2"])
    assert grid == {"max_steps:warmup_steps": [[32, 3], [320, 32]], "lr": [0.1, 0.2]}
    pts = sweep.points({"r": {"configs": [], "set": {}}}, grid, [0])
    # 2 zipped pairs x 2 lrs, not the 2x2x2 a crossed grid of the three keys would give
    assert [p["setting"] for p in pts] == [
        {"max_steps": 32, "warmup_steps": 3, "lr": 0.1}, {"max_steps": 32, "warmup_steps": 3, "lr": 0.2},
        {"max_steps": 320, "warmup_steps": 32, "lr": 0.1}, {"max_steps": 320, "warmup_steps": 32, "lr": 0.2}]
    assert pts[0]["name"] == "r-max_steps=32-warmup_steps=3-lr=0.1-seed0"


def test_a_finished_point_is_stale_when_its_command_or_evaluations_change(tmp_path):
    class Args:
        base, set, eval = "config/cpu_lm.py", ["max_steps=2"], ["loss"]
    point = sweep.points({"r": {"configs": [], "set": {"lr": 0.01}}}, {}, [0])[0]
    run = str(tmp_path / point["name"])
    assert sweep.stale_reason(Args, point, run) is None  # not run yet: nothing to compare
    os.makedirs(run)
    command = ["python", "train.py", *sweep.train_args(Args, point, run)]
    row = {"point": point["name"], "arm": "r", "arm_configs": [], "arm_set": {"lr": 0.01}, "setting": {}, "seed": 0,
           "config": {}, "command": command, "eval": {"loss": {}}}  # every field sweep.finished requires
    (tmp_path / point["name"] / "sweep_point.json").write_text(json.dumps(row))
    assert sweep.stale_reason(Args, point, run) is None
    Args.eval = ["loss", "sink"]
    assert sweep.stale_reason(Args, point, run) == "was evaluated without sink"
    Args.eval, point["arm_set"] = ["loss"], {"lr": 0.03}
    assert sweep.stale_reason(Args, point, run) == f"was run as `{' '.join(command)}`"


@pytest.mark.parametrize("argv, message", [
    (["--grid", "seed=1,2"], "--grid seed: the sweep sets seed itself"),
    (["--grid", "lr"], "--grid 'lr': write KEY=V1,V2"),
    (["--grid", "lr=1", "--grid", "lr=2"], "--grid lr given twice"),
    (["--grid", "lr=1", "--grid", "max_steps:lr=2:1"], "--grid lr given twice"),
    (["--grid", "max_steps:warmup_steps=32:3,64"], "--grid max_steps:warmup_steps: value '64' has 1 parts for 2 keys"),
    (["--arm", "a=,warmup_steps=1", "--grid", "max_steps:warmup_steps=2:1"], "--arm a sets warmup_steps, which the grid sweeps"),
    (["--arm", "a=,lr=1", "--grid", "lr=2"], "--arm a sets lr, which the grid sweeps"),
    (["--arm", "a=missing.py"], "--arm a: no such config file 'missing.py'"),
    (["--set", "out_dir=x"], "--set out_dir: the sweep sets out_dir itself"),
    (["--eval", "tokens"], "--eval tokens: choose from loss, sink, anchor"),
])
def test_bad_input_is_one_line(argv, message):
    with pytest.raises(SystemExit) as e:
        sweep.main(["config/cpu_lm.py", "--name", "x", *argv])
    assert str(e.value).startswith("error: ") and message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flag", ["--jobs", "--eval-tokens", "--nproc"])
def test_count_flags_are_refused_below_one_when_parsed(flag, capsys):
    assert getattr(sweep.build_parser().parse_args(["config/cpu_lm.py", "--name", "x", flag, "1"]), flag[2:].replace("-", "_")) == 1
    with pytest.raises(SystemExit) as e:  # --dry-run: nothing would run even if the flag were let through
        sweep.main(["config/cpu_lm.py", "--name", "x", "--dry-run", flag, "0"])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(f"error: argument {flag}: must be >= 1 (got 0)")


def run_sweep(args, cwd, **kw):
    return subprocess.run([sys.executable, os.path.join(ROOT, "sweep.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=launch_env(), **kw)


def sweep_args(data, name, max_steps):
    return [os.path.join(ROOT, "config", "cpu_lm.py"), "--name", name, *TINY, "--set", f"data_dir={data}",
            "--set", f"max_steps={max_steps}", "--eval-tokens", "256"]


@pytest.mark.slow
def shards_digest(data_dir):
    """The data fingerprint's definition, from the shard files' bytes (not meta.json's sha256s)."""
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    digest = hashlib.sha256()
    for split, info in meta["splits"].items():
        for name in info["shards"]:
            digest.update(f"{split}/{name}:{hashlib.sha256((Path(data_dir) / name).read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()


def test_sweep_rows_match_run_folders_and_second_call_runs_nothing(data_dir, tmp_path):
    args = sweep_args(data_dir, "lr", 2) + ["--grid", "lr=1e-3,1e-2", "--eval", "loss,sink", "--jobs", "2"]
    p = run_sweep(args, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads((tmp_path / "results" / "lr.json").read_text())
    assert result["summary"] == {"points": 2, "finished": 2}
    for row, lr in zip(result["rows"], (1e-3, 1e-2)):
        run = tmp_path / "out" / "sweeps" / "lr" / f"base-lr={lr!r}-seed0"
        assert row["run_dir"] == os.path.relpath(run, tmp_path)
        assert row["config"] == json.loads((run / "config.json").read_text()) and row["config"]["lr"] == lr
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        vals = [m["val_loss"] for m in metrics if "val_loss" in m]
        assert len(vals) == 3 and row["best_val_loss"] == min(vals) and row["final_val_loss"] == vals[-1]
        assert row["tokens"] == 2 * 4 * 32  # 2 steps x 4 sequences x 32 tokens
        assert row["eval"]["loss"]["summary"] == json.loads((run / "eval_loss.json").read_text())["summary"]
        # evaluated in the point's process after its training, as a fresh eval.py evaluates the run folder
        alone = ev.main(["loss", str(run), "--tokens", "256"])["summary"]
        assert (alone["loss"], alone["step"]) == (row["eval"]["loss"]["summary"]["loss"], 2)
        assert (run / "sweep.log").read_text().startswith(f"$ python train.py {' '.join(row['command'][2:])} && "
                                                          f"python eval.py loss {os.path.relpath(run, tmp_path)} ")
        assert row["eval"]["sink"]["summary"]["attn_gate"] == "elementwise"
        assert row["command"][:2] == ["python", "train.py"] and f"--lr={lr!r}" in row["command"]
        assert row["git_commit"] and row["machine"]["threads_per_point"] == 1
        assert row["data_fingerprint"] == shards_digest(data_dir)
    assert result["rows"][0]["eval"]["loss"]["summary"]["loss"] != result["rows"][1]["eval"]["loss"]["summary"]["loss"]
    logs = {d: (tmp_path / "out" / "sweeps" / "lr" / d / "sweep.log").read_text() for d in os.listdir(tmp_path / "out" / "sweeps" / "lr")}
    again = run_sweep(args, tmp_path)
    assert again.returncode == 0 and "2 finished, 0 to run" in again.stdout
    assert {d: (tmp_path / "out" / "sweeps" / "lr" / d / "sweep.log").read_text() for d in logs} == logs
    assert json.loads((tmp_path / "results" / "lr.json").read_text()) == result
    # a changed definition of a finished point (here every point's warmup) is refused, not reported
    changed = run_sweep(args + ["--set", "warmup_steps=2"], tmp_path)
    assert changed.returncode == 1 and "error: point base-lr=0.001-seed0 in" in changed.stderr
    assert "was run as `python train.py" in changed.stderr and changed.stderr.count("\n") == 1
    assert json.loads((tmp_path / "results" / "lr.json").read_text()) == result


def test_a_point_process_ends_on_its_trainings_own_line(tmp_path):
    # sweep.py --point: a training refused ends the point with train.py's own line (exit 1), its evaluations unrun
    run = str(tmp_path / "p")
    argv = [os.path.join(ROOT, "config", "cpu_lm.py"), "--max_steps=0", f"--out_dir={run}"]
    with pytest.raises(interrupt.Stop) as e:
        sweep.point_main({"train": argv, "evals": {"loss": ["loss", run, "--json-out", str(tmp_path / "e.json")]},
                          "point": sweep.points({"b": {"configs": [], "set": {}}}, {}, [0])[0], "run_dir": run,
                          "start": time.time()})
    assert (str(e.value), e.value.status) == (train_error(argv), 1) and os.listdir(tmp_path) == []


@pytest.mark.slow
def test_killed_point_resumes_to_the_uninterrupted_result(data_dir, tmp_path):
    def start(name, **kw):
        return subprocess.Popen([sys.executable, os.path.join(ROOT, "sweep.py"), *sweep_args(data_dir, name, 8)],
                                cwd=tmp_path, env=launch_env(), **kw)
    # The uninterrupted reference runs side by side with the one that is killed (a core each).
    full = start("full", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        proc = start("killed", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        run = tmp_path / "out" / "sweeps" / "killed" / "base-seed0"
        deadline = time.time() + 300
        while not (run / "ckpt_00000003").exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep, mid-run; its train.py (own session) dies with it
        proc.wait()
        assert not (run / "sweep_point.json").exists()
        assert full.wait(timeout=600) == 0, full.stdout.read()
    finally:
        full.kill()  # a no-op once it has finished
    again = run_sweep(sweep_args(data_dir, "killed", 8), tmp_path)
    assert again.returncode == 0 and "0 finished, 1 to run" in again.stdout
    assert "resumed from" in (run / "sweep.log").read_text()

    def losses(name):
        """Every step's train and val loss (each step once) and the point's eval.py loss. Timing rows
        (eval_s, ckpt_s) differ between a killed and an uninterrupted run and are not compared."""
        row = json.loads((tmp_path / "results" / f"{name}.json").read_text())["rows"][0]
        run_dir = tmp_path / "out" / "sweeps" / name / "base-seed0"
        return rows(run_dir, "loss"), rows(run_dir, "val_loss"), row["eval"]["loss"]["summary"]["loss"]
    assert losses("killed") == losses("full")


def point_children(pid):
    """(pid, command line) of every process whose parent is pid, from /proc."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            command = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:  # ended while listed
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append((int(entry), command))
    return found


def started_train(launcher_pid, timeout=300):
    """The pid of the training a launcher started, once it runs: quickstart.py's train.py, or a sweep's point
    process (sweep.py --point: its training, then its evaluations)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        pids = [pid for pid, command in point_children(launcher_pid)
                if any(part.endswith(b"train.py") or part == b"--point" for part in command)]
        if pids:
            return pids[0]
        time.sleep(0.1)
    pytest.fail(f"{launcher_pid} started no training in {timeout}s")


def alive(pid):
    """Running (a zombie, ended but not yet reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_the_study_runner_reruns_only_unfinished_points_where_their_run_folders_are_gone(data_dir, tmp_path):
    # results/cpu_lm.sh's sweep(), on another machine: the committed rows are there, the run folders are not.
    function = re.search(r"^sweep\(\) \{.*?^\}\n", open(os.path.join(ROOT, "results", "cpu_lm.sh")).read(),
                         re.S | re.M).group(0)
    repo = tmp_path / "repo"
    (repo / "results").mkdir(parents=True)
    shutil.copytree(os.path.join(ROOT, "config"), repo / "config")
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), repo)

    def study_sweep(seeds):
        args = ["--name", "s", *TINY, "--set", f"data_dir={data_dir}", "--set", "max_steps=2", "--eval-tokens", "256",
                "--seeds", seeds]
        p = subprocess.run(["bash", "-c", f"BASE=config/cpu_lm.py\nJOBS=1\n{function}sweep \"$@\"", "bash", *args],
                           cwd=repo, capture_output=True, text=True, timeout=600, env=launch_env())
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout, json.loads((repo / "results" / "s.json").read_text())["rows"]
    _, first = study_sweep("0")
    shutil.rmtree(repo / "out")  # a fresh clone: results/s.json committed, no run folder
    said, rows_now = study_sweep("0,1")
    assert "2 points, 1 finished, 1 to run" in said
    assert rows_now[0] == first[0] and [r["seed"] for r in rows_now] == [0, 1]


def long_sweep(data, name):
    """One point that trains far longer than a test waits: it is busy until stopped."""
    return sweep_args(data, name, 100000) + ["--set", "ckpt_interval=100000", "--set", "eval_interval=100000"]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes from /proc")
def test_a_point_busy_in_a_live_sibling_sweep_is_skipped_not_failed(data_dir, tmp_path):
    args = long_sweep(data_dir, "twin")
    first = subprocess.Popen([sys.executable, os.path.join(ROOT, "sweep.py"), *args], cwd=tmp_path, env=launch_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    train = None
    try:
        train = started_train(first.pid)
        # The same sweep again, while the first runs its only point
        second = run_sweep(args, tmp_path)
        assert second.returncode == 0, second.stdout + second.stderr
        assert f"skipped (busy) base-seed0: {os.path.join('out', 'sweeps', 'twin', 'base-seed0')} is being run by " \
               f"sweep.py pid {first.pid}" in second.stdout
        assert "failed" not in second.stdout and "error" not in second.stderr
        assert (tmp_path / "out" / "sweeps" / "twin" / "base-seed0" / "sweep.log").read_text().count("$ ") == 1
        assert alive(train)
    finally:
        first.kill()
        if train and alive(train):
            os.kill(train, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux",
                    reason="reads /proc; a SIGKILLed sweep's children get Linux's parent-death signal")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL])
def test_a_stopped_or_killed_sweep_leaves_no_training_behind(data_dir, tmp_path, sig):
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "sweep.py"), *long_sweep(data_dir, "stopped")],
                            cwd=tmp_path, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    train = None
    try:
        train = started_train(proc.pid)
        if sig == signal.SIGTERM:  # once it trains: the notice passed on saves the training's step
            while not glob.glob(str(tmp_path / "out" / "sweeps" / "stopped" / "*" / "metrics.jsonl")):
                assert proc.poll() is None
                time.sleep(0.1)
        proc.send_signal(sig)  # to the sweep alone, as `kill PID` sends it
        said, _ = proc.communicate(timeout=120)
        if sig != signal.SIGKILL:  # handled: the training is stopped and reaped before the sweep exits
            assert proc.returncode == 128 + sig and said.splitlines()[-1] == (
                f"sweep: stopped by {sig.name}, and its running points with it; the same command resumes the sweep"), said
            assert not alive(train)
        if sig == signal.SIGTERM:
            point = glob.glob(str(tmp_path / "out" / "sweeps" / "stopped" / "*"))[0]
            assert checkpoint.complete_checkpoints(point), "the training's step was not saved"
        deadline = time.time() + 60  # SIGKILL: no handler runs; the training gets its parent-death signal
        while alive(train) and time.time() < deadline:
            time.sleep(0.1)
        assert not alive(train)
    finally:
        proc.kill()
        if train and alive(train):
            os.kill(train, signal.SIGKILL)


def actions_without_help(parser, prefix=""):
    """Every argument (options and positionals, subcommands' too) that --help would list bare."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += actions_without_help(sub, f"{prefix}{name} ")
        elif not isinstance(action, argparse._HelpAction) and not action.help:
            missing.append(prefix + ("/".join(action.option_strings) or action.dest))
    return missing


def test_every_flag_has_help():
    assert actions_without_help(sweep.build_parser()) == []


def synthetic_result(losses_by_arm):
    rows = []
    for arm, losses in losses_by_arm.items():
        for seed, loss in enumerate(losses):
            rows.append({"arm": arm, "arm_set": {}, "arm_configs": [], "setting": {"lr": 0.01}, "seed": seed, "tokens": 100,
                         "best_val_loss": loss + 1, "config": {"lr": 0.01, "model": {}, "model_size": "tiny"},
                         "eval": {"loss": {"summary": {"loss": loss}, "rows": [{"source": "en", "loss": 2 * loss}]}}})
    return {"analysis": "sweep", "name": "syn", "summary": {"points": len(rows), "finished": len(rows)}, "rows": rows}


def test_report_aggregates_seeds_by_hand(tmp_path, capsys):
    table = report.sweep_table(synthetic_result({"a": [1.0, 2.0, 3.0], "b": [5.0]}))
    # a: mean 2, sample std 1; 95% t-interval 2 ± 4.303 / sqrt(3) = 2 ± 2.4843
    assert table[0]["loss"] == "2.0000 ± 1.0000" and table[0]["loss_en"] == "4.0000 ± 2.0000"
    assert table[0]["loss_95ci"] == "[-0.4843, 4.4843]" and table[0]["seeds"] == "0,1,2"
    assert table[0]["best_val_loss"] == "3.0000 ± 1.0000"
    assert table[1]["loss"] == "5.0000" and table[1]["loss_95ci"] == "-"  # one seed: no spread claimed
    assert "dloss_vs_first" not in table[0] and table[1]["dloss_vs_first"] == "+4.0000"  # 5 - a's seed 0
    paired = report.sweep_table(synthetic_result({"a": [1.0, 2.0, 3.0], "b": [1.5, 2.0, 3.5]}))[1]["dloss_vs_first"]
    # differences 0.5, 0, 0.5 by seed: mean 1/3, std sqrt(1/12), half-width 4.303 * sqrt(1/12) / sqrt(3)
    half = 4.303 * math.sqrt(1 / 12) / math.sqrt(3)
    assert paired == f"+0.3333 ± 0.2887 [{1 / 3 - half:+.4f}, {1 / 3 + half:+.4f}]"
    # arms crossed with a grid: each line also paired with the first arm at its own setting
    crossed = synthetic_result({"a": [1.0, 2.0], "b": [1.5, 3.0]})
    crossed["rows"] += [{**r, "setting": {"lr": 0.1}, "eval": {"loss": {"summary": {"loss": loss}, "rows": []}}}
                        for r, loss in zip(crossed["rows"], [4.0, 4.0, 3.0, 3.5])]
    table = report.sweep_table(crossed)  # lines: a@0.01, b@0.01, a@0.1, b@0.1
    # per-seed differences 0.5, 1.0 (and -1.0, -0.5): std sqrt(1/8), half-width 12.7062 * sqrt(1/8) / sqrt(2)
    half = 12.7062 * math.sqrt(1 / 8) / math.sqrt(2)
    assert [line.get("dloss_vs_a") for line in table] == [
        None, f"+0.7500 ± 0.3536 [{0.75 - half:+.4f}, {0.75 + half:+.4f}]",
        None, f"-0.7500 ± 0.3536 [{-0.75 - half:+.4f}, {-0.75 + half:+.4f}]"]
    assert table[3]["dloss_vs_first"] == f"+1.7500 ± 0.3536 [{1.75 - half:+.4f}, {1.75 + half:+.4f}]"  # vs a@0.01
    path = tmp_path / "syn.json"
    path.write_text(json.dumps(synthetic_result({"a": [1.0, 2.0, 3.0]})))
    ev.main(["report", str(path), "--out", str(tmp_path / "r.md")])
    text = (tmp_path / "r.md").read_text()
    assert "| a | 0.01 | 0,1,2 | 2.0000 ± 1.0000 |" in text and "[-0.4843, 4.4843]" in text


def test_report_pairs_arms_across_files_by_seed(tmp_path, capsys):
    first, second = synthetic_result({"a": [1.0, 2.0, 3.0]}), synthetic_result({"b": [1.5, 1.0, 3.5]})
    second["rows"] += [{**r, "setting": {"lr": 0.1}} for r in synthetic_result({"b": [9.0, 9.0, 9.0]})["rows"]]
    (tmp_path / "one.json").write_text(json.dumps(first))
    (tmp_path / "two.json").write_text(json.dumps(second))
    ev.main(["report", str(tmp_path / "one.json"), "--out", str(tmp_path / "r.md"),
             "--pair", f"{tmp_path / 'one.json'}:a", f"{tmp_path / 'two.json'}:b:lr=1e-2"])
    # b - a by seed: +0.5, -1.0, +0.5 -> mean 0, std sqrt(0.75), half-width 4.303 * sqrt(0.75) / sqrt(3)
    half = 4.303 * math.sqrt(0.75) / math.sqrt(3)
    text = (tmp_path / "r.md").read_text()
    assert f"| 0: +0.5000, 1: -1.0000, 2: +0.5000 | +0.0000 ± 0.8660 [{-half:+.4f}, {half:+.4f}] | 1 of 3 |" in text
    capsys.readouterr()
    for selector, message in ((f"{tmp_path / 'two.json'}:c", f"no finished rows of arm 'c' in {tmp_path / 'two.json'}; "
                                                              "write FILE.json:ARM[:KEY=VALUE...]"),
                              (f"{tmp_path / 'two.json'}:b", 'several settings per seed ({"lr": 0.01}, {"lr": 0.1}); '
                                                              "add :KEY=VALUE to pick one")):
        with pytest.raises(SystemExit):
            ev.main(["report", str(tmp_path / "one.json"), "--out", str(tmp_path / "bad.md"),
                     "--pair", f"{tmp_path / 'one.json'}:a", selector])
        assert capsys.readouterr().err == f"error: --pair {selector}: {message}\n"
    assert not (tmp_path / "bad.md").exists()


def test_report_plots_several_sweeps_together(tmp_path, monkeypatch, capsys):
    """--plot-together: one plot over the rows of every sweep given (an lr grid and its later
    refinement), drawn once at that path, and none beside each results JSON."""
    grid, finer = synthetic_result({"a": [1.0], "b": [2.0]}), synthetic_result({"a": [0.5]})
    finer["name"] = "finer"
    for row in finer["rows"]:
        row["setting"], row["config"]["lr"] = {"lr": 0.03}, 0.03
    (tmp_path / "grid.json").write_text(json.dumps(grid))
    (tmp_path / "finer.json").write_text(json.dumps(finer))
    files = [str(tmp_path / "grid.json"), str(tmp_path / "finer.json")]
    drawn = []
    monkeypatch.setattr(report, "plot_sweep",
                        lambda result, x_key, path, name: drawn.append((result, x_key, path, name)))
    ev.main(["report", *files, "--plot-x", "lr", "--plot-together", str(tmp_path / "both.png"), "--out", str(tmp_path / "r.md")])
    assert [(r["name"], r["rows"], x_key, path, name) for r, x_key, path, name in drawn] == [
        ("syn + finer", grid["rows"] + finer["rows"], "lr", str(tmp_path / "both.png"), "loss")]
    assert "![syn + finer](both.png)" in (tmp_path / "r.md").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        ev.main(["report", *files, "--plot-together", str(tmp_path / "both.png"), "--out", str(tmp_path / "r.md")])
    assert capsys.readouterr().err == "error: --plot-together draws the sweeps' rows in one plot: give --plot-x too (e.g. lr)\n"
    monkeypatch.undo()
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: the plot is not drawn")
    ev.main(["report", *files, "--plot-x", "lr", "--plot-together", str(tmp_path / "both.png"), "--out", str(tmp_path / "r.md")])
    assert (tmp_path / "both.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "grid.png").exists() and not (tmp_path / "finer.png").exists()


def test_report_of_an_anchor_sweep_by_hand(tmp_path, capsys):
    """A sweep evaluated with --eval anchor has no eval.py loss: its table holds the answer shares
    (mean ± std over seeds), and --plot-y draws the seed means over two settings."""
    rows = []
    for depth, gamma, seed, inferential in ((1, 0.5, 0, 0.1), (1, 0.5, 1, 0.3), (1, 1.0, 0, 0.8), (2, 1.0, 0, 0.6)):
        shares = {"seen_pair_acc": 1.0, "test_key_acc": 0.0, "heldout_inferential": inferential,
                  "heldout_symmetric": 1 - inferential, "heldout_other": 0.0}
        rows.append({"point": f"base-{depth}-{gamma}-seed{seed}", "arm": "base", "arm_set": {}, "arm_configs": [],
                     "setting": {"model.n_layer": depth, "gamma": gamma}, "seed": seed,
                     "tokens": 10, "best_val_loss": 0.5, "config": {"gamma": gamma, "model": {"n_layer": depth},
                                                                     "model_size": "tiny"},
                     "eval": {"anchor": {"summary": {"task": "anchor", **shares}, "rows": None}}})
    result = {"analysis": "sweep", "name": "phase", "summary": {"points": 4, "finished": 4}, "rows": rows}
    table = report.sweep_table(result)
    # (1, 0.5): 0.1 and 0.3 -> 0.2 ± 0.1414; no loss, so no loss interval or paired loss columns
    assert table[0]["heldout_inferential"] == "0.2000 ± 0.1414" and table[0]["heldout_symmetric"] == "0.8000 ± 0.1414"
    assert table[0]["seeds"] == "0,1" and table[1]["heldout_inferential"] == "0.8000"
    by_seed = report.sweep_table(result, ["heldout_inferential"])[0]["heldout_inferential by seed"]
    assert by_seed == "0: 0.1000, 1: 0.3000"
    assert not any(key.startswith(("loss", "dloss")) for line in table for key in line)
    assert report.sweep_cells(result, "gamma", "model.n_layer", "heldout_inferential") == {
        (0.5, 1): [0.1, 0.3], (1.0, 1): [0.8], (1.0, 2): [0.6]}
    path = tmp_path / "phase.json"
    path.write_text(json.dumps(result))
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: the heatmap is not drawn")
    with pytest.raises(SystemExit):  # the default metric, the loss, was not evaluated: one line naming what was
        ev.main(["report", str(path), "--plot-x", "gamma", "--out", str(tmp_path / "r.md")])
    assert capsys.readouterr().err.startswith("error: base-1-0.5-seed0 has no 'loss' (evaluated: anchor); choose from")
    ev.main(["report", str(path), "--plot-x", "gamma", "--plot-y", "model.n_layer", "--plot-metric",
             "heldout_inferential,heldout_symmetric", "--out", str(tmp_path / "r.md")])
    assert (tmp_path / "phase_heldout_inferential.png").stat().st_size > 0
    assert "phase_heldout_symmetric.png" in (tmp_path / "r.md").read_text()


def test_report_pairs_anchor_arms_by_their_margin(tmp_path, capsys):
    """--pair-metric heldout_margin: (inferential - symmetric) of B minus A's, seed by seed."""
    def row(arm, seed, inferential, symmetric):
        shares = {"seen_pair_acc": 1.0, "test_key_acc": 0.0, "heldout_inferential": inferential,
                  "heldout_symmetric": symmetric, "heldout_other": 1 - inferential - symmetric}
        return {"point": f"{arm}-seed{seed}", "arm": arm, "setting": {}, "seed": seed, "best_val_loss": 0.1,
                "tokens": 10, "eval": {"anchor": {"summary": shares, "rows": None}}}
    rows = [row("baseline", 0, 0.1, 0.6), row("baseline", 1, 0.0, 0.5), row("recipe", 0, 0.7, 0.0), row("recipe", 1, 0.4, 0.2)]
    path = tmp_path / "anchor.json"
    path.write_text(json.dumps({"analysis": "sweep", "name": "a", "summary": {"points": 4, "finished": 4}, "rows": rows}))
    ev.main(["report", str(path), "--pair", f"{path}:baseline", f"{path}:recipe", "--pair-metric", "heldout_margin",
             "--out", str(tmp_path / "r.md")])
    text = (tmp_path / "r.md").read_text()
    # seed 0: 0.7 - (0.1 - 0.6) = 1.2; seed 1: 0.2 - (-0.5) = 0.7; mean 0.95, std 0.3536, half 12.706 * 0.25
    assert "### paired by seed (heldout_margin)" in text and "0: +1.2000, 1: +0.7000" in text
    assert "+0.9500 ± 0.3536 [-2.2265, +4.1265]" in text


def test_report_of_a_sink_sweep_shows_the_head_metric(tmp_path, capsys):
    """eval.py sink's summary in a sweep row becomes the report's sink_first, sink_heads,
    sink_doc_first and sink_doc_heads columns, and --pair-metric pairs any of them; a row
    evaluated before the head metric existed keeps its sink_first alone."""
    def row(arm, seed, heads, doc_heads):
        sink = {"mean_share_first": 0.01, "mean_share_doc_first": 0.02, "sink_heads_first": heads,
                "sink_heads_doc_first": doc_heads, "threshold": 0.3}
        return {"point": f"{arm}-seed{seed}", "arm": arm, "setting": {}, "seed": seed, "best_val_loss": 2.0,
                "tokens": 10, "eval": {"sink": {"summary": sink, "rows": None}}}
    rows = [row("g05", 0, 0.25, 0.5), row("g05", 1, 0.0, 0.25), row("g1", 0, 0.5, 0.75), row("g1", 1, 0.25, 0.25)]
    table = report.sweep_table({"rows": rows})
    assert table[0]["sink_heads"] == "0.1250 ± 0.1768" and table[0]["sink_doc_heads"] == "0.3750 ± 0.1768"
    assert table[1]["sink_first"] == "0.0100 ± 0.0000" and table[1]["sink_doc_first"] == "0.0200 ± 0.0000"
    path = tmp_path / "sink.json"
    path.write_text(json.dumps({"analysis": "sweep", "name": "s", "summary": {"points": 4, "finished": 4}, "rows": rows}))
    ev.main(["report", str(path), "--pair", f"{path}:g05", f"{path}:g1", "--pair-metric", "sink_doc_heads",
             "--out", str(tmp_path / "r.md")])
    assert "### paired by seed (sink_doc_heads)" in (tmp_path / "r.md").read_text()
    assert "0: +0.2500, 1: +0.0000" in (tmp_path / "r.md").read_text()
    old = {**rows[0], "eval": {"sink": {"summary": {"mean_share_first": 0.01}, "rows": None}}}
    assert report.sweep_metrics(old) == {"sink_first": 0.01, "best_val_loss": 2.0}


def test_t_quantiles_against_numerical_integration():
    # P(T <= t) of Student's t with df degrees of freedom, by integrating its density (float64).
    for df, t in enumerate(report.T_975, start=1):
        x = np.linspace(0, t, 200001)
        pdf = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2)) * (1 + x**2 / df) ** (-(df + 1) / 2)
        assert 0.5 + np.trapezoid(pdf, x) == pytest.approx(0.975, abs=3e-5), df  # 3-decimal table: CDF within 2.5e-5


def test_report_averages_token_buckets_over_seed_files(tmp_path):
    def tokens(deltas):
        return {"analysis": "tokens", "summary": {"mean_delta_sym": sum(deltas) / 2},
                "rows": [{"bucket": b, "mean_delta_sym": d, "win_rate_a": 0.5, "loss_a": 1.0, "loss_b": 1.0 + d}
                         for b, d in enumerate(deltas)]}
    for name, deltas in (("a_vs_b_seed0", [0.1, 0.3]), ("a_vs_b_seed1", [0.3, 0.3]), ("c_vs_b_seed0", [9.0, 9.0])):
        (tmp_path / f"{name}.json").write_text(json.dumps(tokens(deltas)))
    ev.main(["report", *sorted(str(p) for p in tmp_path.glob("*.json")), "--out", str(tmp_path / "r.md")])
    text = (tmp_path / "r.md").read_text()
    # bucket 0 of a_vs_b: 0.1 and 0.3 -> 0.2 ± 0.1414; c_vs_b is its own group, never mixed in
    # its 95% interval: t(1 df) = 12.706, 12.706 * 0.1414 / sqrt(2) = 1.2706
    assert "tokens of a_vs_b over 2 seed file(s)" in text and "| 0 | 2 | 0.2000 ± 0.1414 | [-1.0706, +1.4706] |" in text
    assert "| 1 | 2 | 0.3000 ± 0.0000 |" in text and "tokens of c_vs_b over 1 seed file(s)" in text
    assert "| 0 | 1 | 9.0000 |" in text
