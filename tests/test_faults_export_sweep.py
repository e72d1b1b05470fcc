"""Nothing a user does destroys a run (issue 37), for `train.py export --format hf` and sweep.py: an
export never replaces what it did not write itself (a run folder, a user's HF folder, a file, OUT.old
and OUT.tmp beside it), two exports to one folder leave one whole export, and a sweep refuses a link
planted as its lock or log and a broken sweep_point.json in one line, leaving their bytes as they were.
The references are the files' bytes before and after."""
import hashlib
import json
import os
import subprocess
import sys
import threading

import pytest

pytest.importorskip("transformers", reason="the HF export needs transformers (Makefile test install)")
pytest.importorskip("safetensors", reason="the HF export needs safetensors (Makefile test install)")

import hf_export  # noqa: E402
import sweep  # noqa: E402
from conftest import launch_env  # noqa: E402
from test_export_hf import save_export, trained_looking_model  # noqa: E402
from test_train import train_error  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree(path):
    """{relative path: sha256 of a file, 'dir', or 'link -> target'} of everything under path."""
    out = {}
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(folder, name)
            rel = os.path.relpath(full, path)
            if os.path.islink(full):
                out[rel] = "link -> " + os.readlink(full)
            elif os.path.isdir(full):
                out[rel] = "dir"
            else:
                with open(full, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def fill(folder, files):
    os.makedirs(folder, exist_ok=True)
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "m.pt"
    save_export(trained_looking_model(attn_gate="none"), path)
    return str(path)


# A run folder's files (train.py's names; contents stand-ins): config.json made the old code take it for an export.
RUN_FOLDER = {"config.json": '{"lr": 0.01}', "metrics.jsonl": '{"step": 1, "loss": 5.5}\n', "train.lock": "",
              "ckpt_00000001/meta.json": '{"step": 1}', "ckpt_00000001/__0_0.distcp": "weights"}


def test_export_into_a_run_folder_is_refused_and_the_run_kept(ckpt, tmp_path):
    run = str(tmp_path / "run")
    fill(run, RUN_FOLDER)
    before = tree(tmp_path)
    err = train_error(["export", ckpt, run, "--format", "hf"])  # the line `train.py export` exits 1 on
    assert err.startswith(run) and "is not an earlier export" in err and "choose another OUT_DIR" in err
    assert tree(tmp_path) == before  # the run's bytes, and nothing left beside it


@pytest.mark.parametrize("kind", ["a user's HF folder", "a file", "a symlink to an export"])
def test_anything_but_an_earlier_export_is_refused_untouched(kind, ckpt, tmp_path):
    out = str(tmp_path / "hf")
    if kind == "a user's HF folder":  # config.json and weights, but not written by this exporter
        fill(out, {"config.json": '{"model_type": "llama"}', "model.safetensors": "my fine-tune"})
    elif kind == "a file":
        fill(str(tmp_path), {"hf": "notes"})
    else:
        hf_export.export_hf(ckpt, str(tmp_path / "export"))
        os.symlink(tmp_path / "export", out)
    before = tree(tmp_path)
    with pytest.raises(ValueError, match="is not an earlier export .*remove it yourself$"):
        hf_export.export_hf(ckpt, out)
    assert tree(tmp_path) == before


def test_reexport_replaces_an_earlier_export_and_spares_out_old_and_out_tmp(ckpt, tmp_path):
    out = str(tmp_path / "hf")
    hf_export.export_hf(ckpt, out)
    first = tree(out)
    assert "config.json" in first and "model.safetensors" in first
    # Folders of the user's that happen to have the names the old exporter used for its own.
    fill(out + ".old", {"keep.txt": "a backup of mine"})
    fill(out + ".tmp", {"sub/keep.txt": "scratch of mine"})
    mine = {name: tree(str(tmp_path / name)) for name in ("hf.old", "hf.tmp")}
    with open(os.path.join(out, "config.json"), "w") as f:  # so a replaced folder is told from a kept one
        f.write("{}")
    hf_export.export_hf(ckpt, out)
    assert tree(out) == first
    assert {name: tree(str(tmp_path / name)) for name in ("hf.old", "hf.tmp")} == mine
    assert sorted(os.listdir(tmp_path)) == ["hf", "hf.old", "hf.tmp"]  # no temporary or aside folder left
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask  # as a plain new folder, not mkdtemp's 0700


def test_an_export_that_fails_midway_leaves_the_earlier_one_whole(tmp_path):
    out = str(tmp_path / "hf")
    hf_export.write_folder(out, lambda folder: fill(folder, {"config.json": "first"}))
    before = tree(tmp_path)

    def interrupted(folder):
        fill(folder, {"config.json": "second"})
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        hf_export.write_folder(out, interrupted)
    assert tree(tmp_path) == before


def test_two_exports_to_one_folder_at_once_leave_one_whole_export(tmp_path):
    """Both writers reach the swap together (a barrier); repeated, since which syscall of one falls
    between two of the other varies. Each writer's files name it: a mix would show."""
    out = str(tmp_path / "hf")
    for attempt in range(200):
        barrier, errors = threading.Barrier(2), []

        def export(who):
            def write(folder):
                fill(folder, {"config.json": who, "model.safetensors": who * 100})
                barrier.wait()
            try:
                hf_export.write_folder(out, write)
            except Exception as e:  # any error fails the test below, with its text
                errors.append(repr(e))
        threads = [threading.Thread(target=export, args=(who,)) for who in (f"a{attempt}", f"b{attempt}")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sorted(os.listdir(out)) == sorted(["config.json", "model.safetensors", hf_export.MARKER])
        with open(os.path.join(out, "config.json")) as f, open(os.path.join(out, "model.safetensors")) as g:
            who, weights = f.read(), g.read()
        assert who in (f"a{attempt}", f"b{attempt}") and weights == who * 100
        assert os.listdir(tmp_path) == ["hf"]  # neither writer's temporary or aside folder is left


# ----------------------------------------------------------------------------- sweep.py
def sweep_cli(tmp_path):
    return [sys.executable, os.path.join(ROOT, "sweep.py"), os.path.join(ROOT, "config", "cpu_lm.py"), "--name", "s",
            "--set", "max_steps=2", "--out-root", str(tmp_path / "out"), "--results-dir", str(tmp_path / "results")]


@pytest.mark.parametrize("name", ["sweep.lock", "sweep.log"])
def test_a_link_planted_as_the_sweep_lock_or_log_is_refused(name, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("a file of the user's, anywhere\n")
    run = tmp_path / "out" / "s" / "base-seed0"
    run.mkdir(parents=True)
    os.symlink(victim, run / name)
    proc = subprocess.run(sweep_cli(tmp_path), capture_output=True, text=True, env=launch_env(), timeout=300)
    assert victim.read_text() == "a file of the user's, anywhere\n" and os.path.islink(run / name)
    err = proc.stderr.strip()
    assert proc.returncode == 1 and "\n" not in err and "Traceback" not in err, proc.stderr[-2000:]
    assert err == f"error: {run / name} is a symlink: not followed (a run folder's files are its own); replace it " \
                  "with a regular file or remove it, then rerun"
    assert not (run / "config.json").exists()  # train.py never started


class Args:
    base, set, eval = "config/cpu_lm.py", ["max_steps=2"], ["loss"]


def finished_point(tmp_path):
    """The base config's only point with a sweep_point.json as run_point writes it, from a run
    folder's files (stand-ins with the fields point_result reads)."""
    point = sweep.points({"base": {"configs": [], "set": {}}}, {}, [0])[0]
    run = str(tmp_path / "out" / "s" / point["name"])
    fill(run, {"config.json": '{"lr": 0.01}', "metrics.jsonl": '{"step": 2, "loss": 5.0, "tokens": 256}\n',
               "eval_loss.json": '{"summary": {"loss": 5.1}, "rows": []}'})
    row = sweep.point_result(Args.eval, point, run, 1.0, ["python", "train.py", *sweep.train_args(Args, point, run)])
    with open(os.path.join(run, "sweep_point.json"), "w") as f:
        json.dump(row, f)
    return run, row


def without(row, key):
    return {k: v for k, v in row.items() if k != key}


BROKEN = {  # name: the record's bytes from the good row
    "cut short": lambda row: json.dumps(row).encode()[:40],
    "an open brace": lambda row: b"{",
    "empty": lambda row: b"",
    "a list": lambda row: b"[]",
    "no seed": lambda row: json.dumps(without(row, "seed")).encode(),
    "command a string": lambda row: json.dumps({**row, "command": " ".join(row["command"])}).encode(),
    "not utf-8": lambda row: b"\xff\xfe{}",
}


@pytest.mark.parametrize("kind", [*BROKEN, "a link to a good record", "a folder"])
def test_a_broken_point_record_stops_a_rerun_in_one_line(kind, tmp_path):
    run, row = finished_point(tmp_path)
    record = os.path.join(run, "sweep_point.json")
    assert sweep.finished(run) == row  # the record as written is a row
    if kind in BROKEN:
        with open(record, "wb") as f:
            f.write(BROKEN[kind](row))
    else:
        os.replace(record, tmp_path / "good.json")
        if kind == "a folder":
            os.mkdir(record)
        else:
            os.symlink(tmp_path / "good.json", record)
    before = tree(tmp_path)
    with pytest.raises(SystemExit) as e:
        sweep.main([Args.base, "--name", "s", "--set", "max_steps=2", "--out-root", str(tmp_path / "out"),
                    "--results-dir", str(tmp_path / "results")])
    message = str(e.value)
    assert message.startswith(f"error: {record} is not a finished point's record (") and "\n" not in message
    assert message.endswith("delete it and rerun this command to redo the point "
                            "(train.py resumes from its checkpoints)")
    assert tree(tmp_path) == before  # nothing ran, nothing written


def test_an_export_path_through_a_missing_folder_and_dotdot_is_refused_first(tmp_path, monkeypatch, capsys):
    # abspath reads missing/../x as x and the check passed; the kernel walks into missing and the write failed
    # after the model was read, leaving the folder x made. Now: refused before anything, nothing made.
    import eval as ev
    from checkpoint import export
    monkeypatch.chdir(tmp_path)
    for out, fmt in (("missing/../x/m.pt", "pt"), ("missing/../x/", "hf")):
        with pytest.raises(ValueError, match=r"^export: missing/../x goes through missing, which is not a folder, "
                                             r"before '..': choose another path$"):
            export("no-such-checkpoint", out) if fmt == "pt" else hf_export.export_hf("no-such-checkpoint", out, None)
    assert sorted(os.listdir(tmp_path)) == []
    # eval's --seed is read with the command line, before any model loads (sample took -1)
    for command in ("loss", "sample"):
        with pytest.raises(SystemExit) as e:
            ev.main([command, "no-such-checkpoint", "--seed", "-1"])
        assert e.value.code == 2 and "argument --seed: must be >= 0 (got -1)" in capsys.readouterr().err
