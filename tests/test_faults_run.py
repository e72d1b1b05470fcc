"""Nothing a user does destroys a run, a read never changes the process, and every file the repo reads is checked
like its checkpoints (issue 37, train.py, checkpoint.py, hf_export.py): `train.py export` replaces only an earlier
export, a write limit or a file where a folder belongs (or the reverse) is one line, Ctrl-C at the very end of a
run is the interrupted line, a resealed meta.json with values no run wrote is damage, a model too big for memory
is one line, and JSON nested past the decoder's recursion is damage. The references are the files' bytes before
and after, and the messages written out by hand."""
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest
import torch

import checkpoint
import fileio
from conftest import launch_env
from test_faults_checkpoint import NEWEST, PREVIOUS, write_meta
from test_run_folder import ARGS, copy_run, limit_file_size, one_line, run6  # noqa: F401  (run6: the reference run)
from test_train import ROOT, TINY, rows, run_here, train_error


def run_cli(*args, **kwargs):
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          env=launch_env(), timeout=300, **kwargs)


def listing(folder):
    """{name: (kind, bytes or link target)} of a flat folder, without following anything in it."""
    out = {}
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            out[name] = ("link", os.readlink(path))
        elif stat.S_ISREG(mode):
            with open(path, "rb") as f:
                out[name] = ("file", f.read())
        else:
            out[name] = ("other", stat.S_IFMT(mode))
    return out


# ----------------------------------------------------------------------------- export: only its own file
def plant(kind, folder, run, data):
    """What a user has at OUT (in folder): (OUT, the message's name for it)."""
    out = os.path.join(folder, "out")
    if kind == "a data folder's meta.json":
        shutil.copy(os.path.join(data, "meta.json"), out)
        return out, "a file that is not a .pt export"
    if kind == "an empty file":
        open(out, "wb").close()
        return out, "a file that is not a .pt export"
    if kind == "a FIFO":
        os.mkfifo(out)
        return out, "a FIFO"
    if kind == "a folder":
        os.mkdir(out)
        return out, "a folder"
    checkpoint.export(os.path.join(run, PREVIOUS), os.path.join(folder, "earlier.pt"))
    os.symlink("earlier.pt", out)  # an export behind the link: replacing the name would still destroy the link
    return out, "a symlink"


@pytest.mark.parametrize("kind", ["a data folder's meta.json", "an empty file", "a FIFO", "a folder",
                                  "a symlink to an earlier export"])
def test_export_refuses_what_it_did_not_write_and_leaves_it_as_it_was(run6, data_dir, tmp_path, kind):  # noqa: F811
    folder = str(tmp_path / "user")
    os.mkdir(folder)
    out, what = plant(kind, folder, run6, data_dir)
    before = listing(folder)
    with pytest.raises(ValueError) as e:
        checkpoint.export(os.path.join(run6, NEWEST), out)
    assert str(e.value) == (f"{out} exists and is not an earlier export ({what}): choose another path or remove it "
                            f"yourself")
    assert listing(folder) == before  # byte for byte, and no temporary file beside it


def test_export_cli_over_a_checkpoints_meta_json_is_one_line_and_changes_nothing(run6, tmp_path):
    run = copy_run(run6, tmp_path)
    target = os.path.join(run, PREVIOUS, "meta.json")
    before = listing(os.path.join(run, PREVIOUS))
    assert train_error(["export", os.path.join(run, NEWEST), target]) == (
        f"{target} exists and is not an earlier export (a file that is not a .pt export): choose another path or "
        "remove it yourself")
    assert listing(os.path.join(run, PREVIOUS)) == before
    assert checkpoint.checkpoint_problem(os.path.join(run, PREVIOUS)) is None


def test_reexport_replaces_an_earlier_export(run6, tmp_path):
    out = str(tmp_path / "model.pt")
    checkpoint.export(os.path.join(run6, PREVIOUS), out)
    checkpoint.export(os.path.join(run6, NEWEST), out)
    assert torch.load(out, weights_only=True)["step"] == 6
    # an export of the same format written by other code (tests/test_bench_during_training.py writes one)
    torch.save({"model": {}, "model_config": {}}, out)
    checkpoint.export(os.path.join(run6, PREVIOUS), out)
    assert torch.load(out, weights_only=True)["step"] == 5 and os.listdir(tmp_path) == ["model.pt"]


@pytest.mark.parametrize("out, message", [
    ("", "export: OUT is empty: name the .pt file to write, e.g. model.pt"),
    ("notes.txt/sub/model.pt", "export: {tmp}/notes.txt is a file where a folder is written: choose another path"),
])
def test_export_to_nothing_or_into_a_file_is_one_line(run6, tmp_path, monkeypatch, out, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("the user's own file\n")
    before = listing(tmp_path.parent)
    with pytest.raises(ValueError) as e:
        checkpoint.export(os.path.join(run6, NEWEST), out)
    assert str(e.value) == message.format(tmp=tmp_path)
    assert os.listdir(tmp_path) == ["notes.txt"] and listing(tmp_path.parent) == before  # '' named the cwd's parent
    assert (tmp_path / "notes.txt").read_text() == "the user's own file\n"


def test_export_makes_its_missing_folder_once_it_writes(run6, tmp_path):
    # As the hf export does (tests/test_faults_messages.py), and transformers' save_pretrained; an export
    # refused for its input leaves no new folder.
    out = tmp_path / "exports" / "sub" / "model.pt"
    with pytest.raises(ValueError, match="is not a complete checkpoint folder"):
        checkpoint.export(str(tmp_path / "no_such_run"), str(out))
    assert os.listdir(tmp_path) == []
    checkpoint.export(os.path.join(run6, NEWEST), str(out))
    assert torch.load(out, weights_only=True)["step"] == 6 and os.listdir(out.parent) == ["model.pt"]


def test_hf_export_to_nothing_is_one_line_that_does_not_name_the_current_folder(run6, tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="the HF export needs transformers (Makefile test install)")
    import hf_export
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("the user's own file\n")
    with pytest.raises(ValueError) as e:
        hf_export.export_hf(run6, "")
    assert str(e.value) == "export: OUT_DIR is empty: name the folder to write, e.g. out/hf/model"
    assert listing(tmp_path) == {"notes.txt": ("file", b"the user's own file\n")}


def test_file_size_limit_during_an_export_is_one_line_and_keeps_the_earlier_one(run6, tmp_path):
    out = str(tmp_path / "model.pt")
    checkpoint.export(os.path.join(run6, PREVIOUS), out)
    before = listing(tmp_path)
    limit = os.path.getsize(out) // 2
    p = run_cli("train.py", "export", os.path.join(run6, NEWEST), out, preexec_fn=limit_file_size(limit))
    assert p.returncode == 1 and one_line(p) == (f"file too large for the file-size limit (ulimit -f) writing {out}: "
                                                 f"raise the limit (ulimit -f unlimited) and rerun (files written "
                                                 f"before are intact)")
    assert listing(tmp_path) == before  # the earlier export whole, no temporary file


def test_file_size_limit_during_an_hf_export_is_one_line_and_leaves_nothing(run6, tmp_path):
    pytest.importorskip("transformers", reason="the HF export needs transformers (Makefile test install)")
    pytest.importorskip("safetensors", reason="the HF export needs safetensors (Makefile test install)")
    out = str(tmp_path / "hf")
    # above config.json and the tokenizer (~20 kB), below model.safetensors (~1 MB): safetensors' own error type
    p = run_cli("train.py", "export", run6, out, "--format", "hf", preexec_fn=limit_file_size(100_000))
    assert p.returncode == 1 and one_line(p) == (f"file too large for the file-size limit (ulimit -f) writing {out}: "
                                                 f"raise the limit (ulimit -f unlimited) and rerun (files written "
                                                 f"before are intact)")
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- a file where a folder belongs
@pytest.mark.parametrize("where", ["train.lock is a folder", "config.json is a folder", "out_dir is a file",
                                   "out_dir is under a file"])
def test_a_file_or_folder_in_the_wrong_place_is_one_line_and_kept(data_dir, tmp_path, where):
    run = str(tmp_path / "run")
    name = where.split()[0]
    if where.endswith("a folder"):
        os.makedirs(os.path.join(run, name))
        out, expected = run, (f"{run}/{name} is a folder (a run folder's files are its own); replace it with a "
                              f"regular file or remove it, then rerun")
    else:
        with open(run, "w") as f:
            f.write("the user's own file\n")
        out = run if where.endswith("a file") else os.path.join(run, "sub")
        expected = (f"out_dir={out} is a file, or lies under one, not a folder: choose another out_dir (nothing was "
                    f"changed)")
    before = listing(tmp_path)
    p = run_here([*TINY, "--max_steps=3", f"--data_dir={data_dir}", f"--out_dir={out}"], ok=False)
    assert p.returncode == 1 and one_line(p) == expected
    if where.startswith("out_dir"):
        assert listing(tmp_path) == before
    else:
        assert os.path.isdir(os.path.join(run, name)) and os.listdir(os.path.join(run, name)) == []


# ----------------------------------------------------------------------------- Ctrl-C at the very end of a run
# train.py run as `python train.py`, with a real SIGINT sent to itself right after one of the calls that end a
# finished run: closing metrics.jsonl (and TensorBoard, wandb) or tearing down the process group.
CTRL_C_AFTER = """
import os, runpy, signal, sys
import checkpoint, interrupt
import torch.distributed as dist
# "hold": between train()'s return and close_process_group's hold on Ctrl-C (its context made, not yet entered)
owner, name = {"close": (checkpoint.Metrics, "close"), "destroy": (dist, "destroy_process_group"),
               "hold": (interrupt, "sigint_held")}[sys.argv.pop(1)]
original = getattr(owner, name)
sent = []
def then_ctrl_c(*args, **kwargs):
    result = original(*args, **kwargs)
    if not sent:  # one Ctrl-C, after the first call
        sent.append(True)
        os.kill(os.getpid(), signal.SIGINT)
    return result
setattr(owner, name, then_ctrl_c)
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


CTRL_C_AT_EXIT = """
import atexit, os, runpy, signal, sys, time
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))  # while the interpreter ends
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.slow
def test_ctrl_c_while_a_finished_run_exits_changes_nothing(data_dir, tmp_path):
    out = str(tmp_path / "run")
    p = run_cli("-c", CTRL_C_AT_EXIT, *TINY, "--max_steps=3", f"--data_dir={data_dir}", f"--out_dir={out}")
    assert p.returncode == 0 and "KeyboardInterrupt" not in p.stderr, p.stderr[-3000:]
    assert f"saved {out}/ckpt_00000003" in p.stdout


@pytest.mark.slow
@pytest.mark.parametrize("after", ["close", "destroy", "hold"])
def test_ctrl_c_after_the_final_checkpoint_is_the_interrupted_line(data_dir, tmp_path, after):
    out = str(tmp_path / "run")
    p = run_cli("-c", CTRL_C_AFTER, after, *TINY, "--max_steps=3", f"--data_dir={data_dir}", f"--out_dir={out}")
    assert f"saved {out}/ckpt_00000003" in p.stdout
    assert p.returncode == 130 and one_line(p) == (f"interrupted at step 3/3; the same command resumes from "
                                                   f"{out}/ckpt_00000003"), p.stderr[-3000:]


# ----------------------------------------------------------------------------- meta.json values no run wrote
def reseal(ckpt, change):
    """meta.json changed and its sha256 recomputed: it verifies, so only a check of its values can refuse it."""
    with open(os.path.join(ckpt, "meta.json")) as f:
        meta = json.load(f)
    change(meta)
    write_meta(ckpt, json.dumps(meta).encode())
    return meta


def set_state(key, value):
    return lambda meta: meta["data_state"].update({key: value})


NOT_A_POSITION = ("meta.json has data_state {data_state}, not a position in the split (0 <= pos <= n_windows, "
                  "epoch >= 0)")
NOT_WHOLE = "meta.json has data_state {data_state}, not whole numbers epoch, pos, n_windows"
NOT_CHANGES = "meta.json has resume_changes entry {entry}, not {{step, changes: {{setting: {{was, now}}}}}}"
RESEALED = {
    "negative-pos": (set_state("pos", -8), NOT_A_POSITION),
    "pos-past-the-split": (lambda meta: set_state("pos", meta["data_state"]["n_windows"] + 1)(meta), NOT_A_POSITION),
    "negative-epoch": (set_state("epoch", -1), NOT_A_POSITION),
    "fractional-pos": (set_state("pos", 7.5), NOT_WHOLE),
    "pos-as-text": (set_state("pos", "8"), NOT_WHOLE),
    "pos-a-bool": (set_state("pos", True), NOT_WHOLE),
    "no-n-windows": (lambda meta: meta["data_state"].pop("n_windows"), NOT_WHOLE),
    "a-change-of-a-number": (lambda meta: meta.update(resume_changes=[5]), NOT_CHANGES),
    "a-change-without-now": (lambda meta: meta.update(resume_changes=[{"step": 3, "changes": {"lr": {"was": 1}}}]),
                             NOT_CHANGES),
    "an-unknown-model-field": (lambda meta: meta["model_config"].update(wings=2),
                               "meta.json has a model_config GPTConfig refuses (GPTConfig.__init__() got an "
                               "unexpected keyword argument 'wings')"),
    "a-model-field-of-text": (lambda meta: meta["model_config"].update(n_layer="2"),
                              "meta.json has a model_config GPTConfig refuses (GPTConfig.n_layer='2': expected int)"),
}


@pytest.mark.parametrize("change, expected", RESEALED.values(), ids=RESEALED.keys())
def test_a_resealed_meta_json_with_values_no_run_wrote_is_damage(run6, tmp_path, change, expected):
    run = copy_run(run6, tmp_path)
    newest = os.path.join(run, NEWEST)
    meta = reseal(newest, change)
    entry = (meta.get("resume_changes") or [None])[-1]
    assert checkpoint.checkpoint_problem(newest) == expected.format(data_state=meta["data_state"], entry=entry)
    assert checkpoint.load_model(run)[1]["path"] == os.path.join(run, PREVIOUS)


def test_an_export_whose_model_config_gpt_refuses_is_one_line(run6, tmp_path):
    out = str(tmp_path / "m.pt")
    checkpoint.export(os.path.join(run6, NEWEST), out)
    blob = torch.load(out, weights_only=True)
    torch.save({**blob, "model_config": {**blob["model_config"], "wings": 2}}, out)
    with pytest.raises(ValueError) as e:
        checkpoint.load_model(out)
    assert str(e.value) == (f"{out}: has a model_config GPTConfig refuses (GPTConfig.__init__() got an unexpected "
                            "keyword argument 'wings'); pass a .pt made by `python train.py export`, or a checkpoint "
                            "folder")


@pytest.mark.slow
def test_resume_falls_back_from_a_resealed_bad_position_or_refuses_in_one_line(run6, data_dir, tmp_path):  # noqa: F811
    run = copy_run(run6, tmp_path)
    reseal(os.path.join(run, NEWEST), set_state("pos", -8))
    p = run_here([*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}"])
    assert f"{os.path.join(run, NEWEST)} is damaged (meta.json has data_state " in p.stdout
    assert "resumed from " + os.path.join(run, PREVIOUS) in p.stdout
    assert rows(run, "loss") == rows(run6, "loss")  # step 6 redone from 5, at the data position saved there
    every = copy_run(run6, tmp_path, "every")
    for ckpt in checkpoint.complete_checkpoints(every):
        reseal(ckpt, set_state("pos", -8))
    before = listing(os.path.join(every, NEWEST))
    p = run_here([*ARGS, f"--data_dir={data_dir}", f"--out_dir={every}"], ok=False)
    assert p.returncode == 1 and one_line(p).startswith(f"every checkpoint in {every} is damaged ({NEWEST}: meta.json "
                                                        f"has data_state ")
    assert listing(os.path.join(every, NEWEST)) == before


# ----------------------------------------------------------------------------- a model too big for memory
D_MODEL = 10**7  # a 1e14-element attention matrix: no allocator hands out 400 TB


def test_a_model_too_big_for_memory_is_one_line(data_dir, tmp_path):
    out = str(tmp_path / "run")
    p = run_here([*TINY, "--max_steps=3", f"--data_dir={data_dir}", f"--out_dir={out}",
                  f"--model.d_model={D_MODEL}"], ok=False)
    assert p.returncode == 1
    assert re.fullmatch(rf"config: model_size='tiny', model={{'d_model': {D_MODEL}}}: the model \([\d,]+ parameters, "
                        rf"[\d.e+]+ GiB in fp32\) asks for more memory than there is \(the allocator could not get "
                        rf"\d+ bytes\): choose a smaller model \(--dry_run=N prints the memory a size needs on N "
                        rf"GPUs\)", one_line(p)), one_line(p)


def test_a_checkpoint_whose_model_is_too_big_for_memory_is_one_line(run6, tmp_path):
    run = copy_run(run6, tmp_path)
    newest = os.path.join(run, NEWEST)
    reseal(newest, lambda meta: meta["model_config"].update(d_model=D_MODEL))
    with pytest.raises(ValueError) as e:
        checkpoint.load_model(newest)
    assert re.fullmatch(rf"{re.escape(newest)}: its model_config asks for more memory than there is \(the allocator "
                        rf"could not get \d+ bytes\): pass another checkpoint, or load it where that memory is",
                        str(e.value)), str(e.value)


# ----------------------------------------------------------------------------- JSON nested past the recursion limit
DEEP = b"[" * 100_000 + b"]" * 100_000


def test_a_deeply_nested_meta_json_is_damage(run6, tmp_path):
    run = copy_run(run6, tmp_path)
    newest = os.path.join(run, NEWEST)
    write_meta(newest, DEEP)
    assert checkpoint.checkpoint_problem(newest) == ("meta.json is not valid JSON (nested deeper than a JSON reader "
                                                     "follows)")
    assert checkpoint.load_model(run)[1]["path"] == os.path.join(run, PREVIOUS)


def test_a_deeply_nested_metrics_line_is_one_line_and_changes_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    data = b'{"step": 1, "loss": 3.0}\n' + DEEP + b'\n{"step": 2, "loss": 2.0}\n'
    path.write_bytes(data)
    with pytest.raises(ValueError) as e:
        checkpoint.truncate_metrics(str(path), 2)
    assert str(e.value) == (f"{path} line 2 is not a metrics row ({'[' * 60!r}: a row is a JSON object with an "
                            f"integer step): repair or delete that line and rerun (nothing was changed)")
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(data).digest()


def test_export_write_failures_are_one_line_naming_the_folder(run6, tmp_path, monkeypatch):
    # A folder it may not make or write in (as root, hand-made faults): "[Errno 2]" from the write-limit probe
    # of the folder never made, or "[Errno 1]" naming the temporary file, with no fix.
    ckpt = os.path.join(run6, NEWEST)
    out = str(tmp_path / "trail") + os.sep
    with pytest.raises(ValueError) as e:
        checkpoint.export(ckpt, out)
    assert str(e.value) == f"export: OUT ends in '/': name the .pt file to write, e.g. {out}model.pt"
    monkeypatch.setattr(checkpoint.os, "makedirs", lambda *a, **k: (_ for _ in ()).throw(
        PermissionError(errno.EACCES, "Permission denied")))
    with pytest.raises(ValueError) as e:
        checkpoint.export(ckpt, str(tmp_path / "new" / "m.pt"))
    assert str(e.value) == f"export: cannot make the folder {tmp_path / 'new'} (Permission denied): choose another path"
    monkeypatch.undo()
    monkeypatch.setattr(fileio.tempfile, "mkstemp", lambda *a, **k: (_ for _ in ()).throw(
        PermissionError(errno.EPERM, "Operation not permitted", "x.tmp")))
    with pytest.raises(ValueError) as e:
        checkpoint.export(ckpt, str(tmp_path / "m.pt"))
    assert str(e.value) == f"export: cannot write {tmp_path / 'm.pt'} (Operation not permitted): choose a folder you " \
                           "may write in"
    assert os.listdir(tmp_path) == []
