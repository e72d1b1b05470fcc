"""quickstart.py and sweep.py under the outside fault run of issue 37: a signal at any time ends them
in one line with the shell's 128 + signal and leaves no child of theirs running (F23, F24); an output
path holding the wrong kind of thing, or a sweep name that is not one plain folder name, is refused
before anything runs and writes nothing (F25, F26); a damaged JSON file they read (nested past the
decoder, the wrong JSON value, a FIFO) is one line, not a traceback or a hang (F1). The references are
the processes alive after the launcher exits and the folder's bytes before and after."""
import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest

import quickstart
import sweep
from conftest import launch_env
from test_faults_links import within
from test_sweep import alive, started_train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEP = b"[" * 100_000  # a JSON text nested past the decoder's recursion limit
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads processes from /proc")


def tree(path):
    """{relative path: sha256 of a file, 'dir', or the kind of anything else} of everything under path."""
    out = {}
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(folder, name)
            if os.path.isdir(full):
                kind = "dir"
            elif os.path.isfile(full):
                with open(full, "rb") as f:
                    kind = hashlib.sha256(f.read()).hexdigest()
            else:
                kind = "other"
            out[os.path.relpath(full, path)] = kind
    return out


def launch(script, *args):
    """script in its own session (a terminal's foreground job: Ctrl-C reaches its whole group)."""
    return subprocess.Popen([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, env=launch_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def send(proc, sig):
    """Ctrl-C as a terminal sends it (to the foreground process group); SIGTERM and SIGHUP as `kill PID`."""
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)


# ----------------------------------------------------------------------------- F23, F24: signals
def loading(pid, library):
    """pid has mapped the library: it is inside the import that loads it (libtorch: `import torch`, which goes on
    for a second or more; numpy's _multiarray_umath: `import numpy`, tenths of a second, with more imports after)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return library in f.read()
    except OSError:  # ended
        return False


# script: (arguments that would run it, the line of a Ctrl-C while it starts, a shared library its imports load:
# prepare_data.py needs no torch, its imports are numpy's, tiktoken's and the repo's). Not sweep.py: it imports
# no torch (its points' processes do), and its ~30 ms of imports leave no window a signal can be aimed at.
LAUNCHES = {
    "quickstart.py": (lambda tmp: ["--smoke", "--out", str(tmp / "qs")],
                      "quickstart: interrupted while starting, before anything ran; rerun the same command",
                      "libtorch"),
    **{script: (args, f"{script}: interrupted while starting, before anything was written; rerun the same command",
                library)
       for script, args, library in (
           ("train.py", lambda tmp: ["config/tiny_bytes.py", f"--data_dir={tmp / 'data'}", f"--out_dir={tmp / 'run'}"],
            "libtorch"),
           ("eval.py", lambda tmp: ["loss", str(tmp / "run"), "--data", str(tmp / "data")], "libtorch"),
           ("prepare_data.py", lambda tmp: ["text", "--out", str(tmp / "data"), "--source", f"en={tmp / 'corpus'}",
                                            "--tokenizer", "bytes"], "_multiarray_umath"))},
}


@linux_only
@pytest.mark.parametrize("script", LAUNCHES)
def test_ctrl_c_while_importing_is_one_line(script, tmp_path):
    args, line, library = LAUNCHES[script]
    proc = launch(script, *args(tmp_path))
    try:
        while not loading(proc.pid, library) and proc.poll() is None:
            pass  # no sleep: the signal must land while the imports go on
        send(proc, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, err, out) == (130, line + "\n", "")
    assert os.listdir(tmp_path) == []  # nothing written


STOPPED = "quickstart: stopped by {}, and the runs it had started with it; the same command starts it over"


@pytest.mark.slow
@linux_only
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stopped_quickstart_stops_its_trainings_first(sig, tmp_path):
    proc = launch("quickstart.py", "--smoke", "--out", str(tmp_path))
    train = None
    try:
        train = started_train(proc.pid, timeout=120)
        send(proc, sig)
        out, err = proc.communicate(timeout=60)
        assert not alive(train)  # stopped and reaped before the quickstart exited
    finally:
        proc.kill()
        if train and alive(train):
            os.kill(train, signal.SIGKILL)
    assert (proc.returncode, err) == (128 + sig, STOPPED.format(sig.name) + "\n"), out[-2000:]
    assert "Traceback" not in out


# ----------------------------------------------------------------------------- F25, F26: outputs and names


def make(path, kind):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if kind == "a file":
        with open(path, "w") as f:
            f.write("the user's\n")
    elif kind == "a folder":
        os.mkdir(path)
    else:
        os.mkfifo(path)


QUICKSTART_OUTPUTS = [  # (path under --out, what is put there, what is written there)
    ("", "a file", "folder"),
    ("data", "a file", "folder"),
    ("gamma1", "a file", "folder"),
    ("data.log", "a FIFO", "file"),
    ("gamma05_anchor.json", "a folder", "file"),
    ("quickstart.json", "a folder", "file"),
    ("quickstart.png", "a folder", "file"),
]


@pytest.mark.parametrize("name, kind, written", QUICKSTART_OUTPUTS)
def test_a_quickstart_output_in_the_way_is_refused_before_anything_runs(name, kind, written, tmp_path):
    out = tmp_path / "qs"
    path = os.path.join(out, name) if name else str(out)
    make(path, kind)
    before = tree(tmp_path)
    with pytest.raises(ValueError) as e, within(60):  # a FIFO opened to write waits for a reader
        quickstart.main(["--smoke", "--out", str(out)])
    assert str(e.value) == f"{path} is {kind} where a {written} is written: move it away or choose another --out"
    assert tree(tmp_path) == before


def test_a_quickstart_output_in_the_way_is_one_line(tmp_path):
    (tmp_path / "qs").write_text("the user's\n")
    proc = subprocess.run([sys.executable, "quickstart.py", "--smoke", "--out", str(tmp_path / "qs" / "sub")],
                          cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        1, "", f"quickstart: {tmp_path / 'qs'} is a file where a folder is written: move it away or choose another "
               "--out\n")
    assert os.listdir(tmp_path) == ["qs"] and (tmp_path / "qs").read_text() == "the user's\n"


@pytest.mark.parametrize("theirs", ["notes.txt", "gamma1/ckpt_00000100/meta.json"])
def test_a_quickstart_out_it_did_not_make_is_refused_and_kept(theirs, tmp_path):
    # It deleted gamma1/ and gamma05/ (a training run copied there), and replaced the data and quickstart.json
    out = tmp_path / "qs"
    make(str(out / theirs), "a file")
    before = tree(tmp_path)
    with pytest.raises(ValueError) as e:
        quickstart.main(["--smoke", "--out", str(out)])
    first = theirs.split("/")[0]
    assert str(e.value) == (f"{out} holds {first} and no .quickstart: it is not a folder the quickstart made, and the "
                            "quickstart deletes and remakes its runs and data there; choose another --out (a new or "
                            "empty folder)")
    assert tree(tmp_path) == before


SWEEP_OUTPUTS = [  # (path under tmp_path, what is put there, what is written there)
    ("out", "a file", "folder"),
    ("out/s", "a file", "folder"),
    ("out/s/base-seed0", "a file", "folder"),
    ("out/s/base-seed0/eval_loss.json", "a folder", "file"),
    ("out/s/base-seed0/sweep.log", "a FIFO", "file"),
    ("results", "a file", "folder"),
    ("results/s.json", "a folder", "file"),
]


def sweep_argv(tmp_path, name="s"):
    return [os.path.join(ROOT, "config", "cpu_lm.py"), "--name", name, "--set", "max_steps=2",
            "--out-root", str(tmp_path / "out"), "--results-dir", str(tmp_path / "results")]


@pytest.mark.parametrize("name, kind, written", SWEEP_OUTPUTS)
def test_a_sweep_output_in_the_way_is_refused_before_anything_runs(name, kind, written, tmp_path):
    make(tmp_path / name, kind)
    before = tree(tmp_path)
    with pytest.raises(SystemExit) as e, within(60):
        sweep.main(sweep_argv(tmp_path))
    assert str(e.value) == (f"error: {tmp_path / name} is {kind} where a {written} is written: move it away, or "
                            "choose another --name, --out-root or --results-dir")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("name", ["", " ", ".", "..", "a/b", "../s", "/tmp"])
def test_a_sweep_name_that_is_not_one_folder_name_is_refused(name, tmp_path):
    with pytest.raises(SystemExit) as e:
        sweep.main([*sweep_argv(tmp_path, name), "--dry-run"])
    assert str(e.value) == (f"error: --name {name!r}: the name of the sweep's folder and results file must be one "
                            "plain name, without '/' and not '.' or '..', e.g. --name lr_tune")
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- F1: damaged JSON read
def put(path, damage):
    """A file's bytes, or a FIFO in its place (damage None)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if damage is None:
        os.mkfifo(path)
    else:
        with open(path, "wb") as f:
            f.write(damage)


DAMAGE = {  # name: (bytes, or None for a FIFO; what the one line says the file is)
    "nested too deep": (DEEP, "not JSON: nested deeper than a JSON reader follows"),
    "null": (b"null", "null, not an object"),
    "a list": (b"[1, 2]", "an array, not an object"),
    "a FIFO": (None, "a FIFO: not opened"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_finished_record_stops_a_rerun_in_one_line(damage, tmp_path):
    data, why = DAMAGE[damage]
    record = tmp_path / "out" / "s" / "base-seed0" / "sweep_point.json"
    put(record, data)
    before = tree(tmp_path)
    with pytest.raises(SystemExit) as e, within(10):
        sweep.main(sweep_argv(tmp_path))
    assert str(e.value) == (f"error: {record} is not a finished point's record ({why}): delete it and rerun this "
                            "command to redo the point (train.py resumes from its checkpoints)")
    assert tree(tmp_path) == before


class Args:
    base, set, eval = "config/cpu_lm.py", ["max_steps=2"], ["loss"]


RUN_FILES = {  # a run folder's files as point_result reads them, stand-ins with the fields it uses
    "config.json": b'{"lr": 0.01}', "metrics.jsonl": b'{"step": 2, "loss": 5.0, "tokens": 256}\n',
    "eval_loss.json": b'{"summary": {"loss": 5.1}, "rows": []}'}


RUN_DAMAGE = [(file, damage) for file in ("config.json", "eval_loss.json") for damage in DAMAGE]
NO_SUMMARY = (b'{"summary": null, "rows": []}', "summary missing or of the wrong type")


@pytest.mark.parametrize("file, damage", [*RUN_DAMAGE, ("eval_loss.json", "no summary")])
def test_a_damaged_run_file_fails_its_point_in_one_line(file, damage, tmp_path):
    point = sweep.points({"base": {"configs": [], "set": {}}}, {}, [0])[0]
    run = tmp_path / point["name"]
    for name, data in RUN_FILES.items():
        put(run / name, data)
    command = ["python", "train.py", *sweep.train_args(Args, point, str(run))]
    assert sweep.point_result(Args.eval, point, str(run), 1.0, command)["eval"]["loss"]["summary"] == {"loss": 5.1}
    os.remove(run / file)
    data, why = DAMAGE.get(damage, NO_SUMMARY)
    put(run / file, data)
    with pytest.raises(ValueError) as e, within(10):
        sweep.point_result(Args.eval, point, str(run), 1.0, command)
    assert str(e.value) == (f"{run / file} is not the file train.py or eval.py writes ({why}): remove it and rerun "
                            "this command to redo the point")


@pytest.mark.parametrize("damage", [*DAMAGE, "a score missing"])
def test_a_damaged_benchmark_result_is_one_line(damage, tmp_path):
    scores = {"heldout_inferential": 0.5, "heldout_symmetric": 0.25, "heldout_other": 0.25, "seen_pair_acc": 1.0,
              "test_key_acc": 0.75}
    path = tmp_path / "gamma1_anchor.json"
    put(path, json.dumps({"summary": scores, "rows": []}).encode())
    assert quickstart.read_scores(path) == scores
    os.remove(path)
    data, why = DAMAGE.get(damage, (json.dumps({"summary": {**scores, "test_key_acc": None}}).encode(),
                                    "summary's test_key_acc missing or not a number"))
    put(path, data)
    with pytest.raises(ValueError) as e, within(10):
        quickstart.read_scores(path)
    assert str(e.value) == f"{path} is not eval.py bench's result ({why}): rerun the same command"


@pytest.mark.parametrize("line", [DEEP, b"null", b"[1, 2]"], ids=["nested too deep", "null", "a list"])
def test_a_damaged_metrics_row_is_one_line(line, tmp_path):
    good = b'{"step": 0, "val_loss": 5.0}\n{"step": 1, "loss": 4.0, "tokens": 8}\n'
    (tmp_path / "metrics.jsonl").write_bytes(good)
    assert quickstart.read_metrics(str(tmp_path)) == ([(1, 4.0)], [(0, 5.0)])
    (tmp_path / "metrics.jsonl").write_bytes(line + b"\n" + good)  # a row before the last: not cut short
    with pytest.raises(ValueError) as e:
        quickstart.read_metrics(str(tmp_path))
    assert str(e.value).startswith(f"{tmp_path / 'metrics.jsonl'} line 1 is not a metrics row (")
    assert "\n" not in str(e.value)
