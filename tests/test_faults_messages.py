"""Inputs and outputs of the wrong kind from a fault-injection run: a FIFO (or a folder, or nothing) where
eval.py reads a result file, a checkpoint, a benchmark file or a data folder, or where `train.py export`
writes, is named for what it is with the fix, in one line (eval.py's bad-input status is 2, train.py's 1),
never reported missing and never opened (a read of a FIFO waits for a writer forever); an hf export and a pt
one alike make a missing folder and refuse a file in its way. Nothing is written."""
import os
import signal
import stat

import pytest

import downstream as ds
import train
from conftest import ctrl_c_after, tiny_model
from test_eval import export
from test_faults_eval import error_line
from test_train import train_error

CKPT_FIX = "pass a .pt export, a complete checkpoint folder or a run folder written by train.py"
KIT = {"hellaswag": "hellaswag/hellaswag_val_full.txt.bz2", "gsm8k": "gsm8k/test.jsonl",
       "math500": "math500/test.jsonl"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return export(tiny_model(seed=1), tmp_path_factory.mktemp("ckpt") / "m.pt")


@pytest.fixture
def fifo(tmp_path):
    path = str(tmp_path / "in.json")
    os.mkfifo(path)
    return path


def source_line(flag, path, problem, task):
    return (f"error: {flag} {path}: {problem}; pass a local {task} file in its published format (e.g. {KIT[task]} "
            "of the offline data kit) or 'hub'")


# ----------------------------------------------------------------------------- eval.py report

@pytest.mark.parametrize("make,what", [(os.mkfifo, "a FIFO: not opened"), (os.mkdir, "a folder: not opened"),
                                       (lambda path: None, "No such file or directory")])
def test_report_names_an_input_that_is_no_result_file_and_the_fix(make, what, tmp_path, capsys):
    # It printed "[Errno 22] a FIFO: not opened: '...'": what the path is, but not what to pass instead.
    path = str(tmp_path / "r.json")
    make(path)
    before = sorted(os.listdir(tmp_path))
    assert error_line(["report", path, "--out", str(tmp_path / "report.md")], capsys) == (
        f"error: {path} is not a result file ({what}): pass eval.py --json-out or sweep.py result JSONs "
        "(e.g. out/*.json)")
    assert sorted(os.listdir(tmp_path)) == before


# ----------------------------------------------------------------------------- checkpoints and data

@pytest.mark.parametrize("argv", [["loss", "{}"], ["sample", "{}"], ["weights", "{}"], ["tokens", "{}", "{}"],
                                  ["bench", "{}", "--task", "gsm8k"]])
def test_a_fifo_as_a_checkpoint_is_named_not_reported_missing(argv, fifo, tmp_path, capsys):
    # "no such checkpoint file or folder" for a FIFO that is there, and no fix for either case.
    assert error_line([a.format(fifo) for a in argv], capsys) == (
        f"error: {fifo} is a FIFO, not a checkpoint: {CKPT_FIX}")
    missing = str(tmp_path / "nope")
    assert error_line([a.format(missing) for a in argv], capsys) == (
        f"error: {missing}: no such checkpoint file or folder; {CKPT_FIX}")
    assert os.listdir(tmp_path) == ["in.json"]


def test_a_fifo_as_data_is_named_not_its_missing_meta_json(ckpt, fifo, capsys):
    assert error_line(["loss", ckpt, "--data", fifo], capsys) == (
        f"error: {fifo} is a FIFO, not a data folder: pass --data <folder written by prepare_data.py>")


# ----------------------------------------------------------------------------- benchmark files

@pytest.mark.parametrize("task", KIT)
def test_bench_names_a_fifo_source_and_the_fix(task, ckpt, fifo, tmp_path, capsys):
    # It said "no such file" of a FIFO that is there.
    assert error_line(["bench", ckpt, "--task", task, "--source", fifo], capsys) == (
        source_line("--source", fifo, f"a FIFO, not a {task} file", task))
    assert error_line(["bench", ckpt, "--task", task, "--source", str(tmp_path)], capsys) == (
        source_line("--source", tmp_path, f"a folder, not a {task} file", task))
    assert os.listdir(tmp_path) == ["in.json"]


def test_bench_names_a_bad_fewshot_source_by_its_own_flag(ckpt, fifo, capsys):
    # A FIFO was "--source FIFO: no such file" (another flag, a wrong problem); 'hub', which is a value of
    # --source only, ended in "[Errno 2] No such file or directory: 'hub'".
    fix = "pass gsm8k's train.jsonl in its published format (its first --shots records are the exemplars)"
    for source, problem in ((fifo, "a FIFO, not a gsm8k file"), ("hub", "no such file")):
        assert error_line(["bench", ckpt, "--task", "gsm8k", "--fewshot-source", source], capsys) == (
            f"error: --fewshot-source {source}: {problem}; {fix}")


@pytest.mark.parametrize("task", ["hellaswag", "gsm8k"])
def test_lm_eval_task_names_a_fifo_source(task, fifo, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    assert error_line(["lm-eval-task", "--task", task, "--source", fifo, "--out-dir", str(tmp_path / "tasks")],
                      capsys) == source_line("--source", fifo, f"a FIFO, not a {task} file", task)
    assert os.listdir(tmp_path) == ["in.json"]


def test_a_fifo_as_the_training_bench_source_is_named(fifo):
    with pytest.raises(ValueError) as e:
        ds.hellaswag_bench(fifo, 10, "data", {"tokenizer": "bytes"}, None, "", "")
    assert str(e.value).startswith(f"config: bench_source={fifo!r}: a FIFO, not a HellaSwag file; pass a HellaSwag "
                                   "file (the published jsonl")


# ----------------------------------------------------------------------------- train.py export

def export_line(*args):
    """train.py export's one line for bad input (exit status 1), from train.main in-process."""
    return train_error(["export", *map(str, args)])


def test_an_hf_export_onto_a_fifo_calls_it_a_fifo(ckpt, fifo, tmp_path):
    # It said "(a file)".
    assert export_line(ckpt, fifo, "--format", "hf") == (
        f"{fifo} exists and is not an earlier export (a FIFO): choose another OUT_DIR or remove it yourself")
    assert os.listdir(tmp_path) == ["in.json"] and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_hf_and_pt_exports_make_a_missing_folder_alike_and_refuse_a_file_in_its_way(ckpt, tmp_path):
    # The hf export made missing folders and the pt export refused them; both make them now, as
    # transformers' save_pretrained does, and neither writes past a file standing where a folder goes.
    pytest.importorskip("transformers", reason="the HF export needs transformers (Makefile test install)")
    # (the pt export of a checkpoint into a missing folder: tests/test_faults_run.py)
    out = tmp_path / "hf" / "sub" / "hf"
    assert export_line(tmp_path / "no_such_run", out, "--format", "hf").endswith(f"no_such_run: no such checkpoint "
                                                                               f"file or folder; {CKPT_FIX}")
    assert os.listdir(tmp_path) == []  # refused for its input: no folder made
    train.main(["export", str(ckpt), str(out), "--format", "hf"])
    assert (out / "config.json").is_file()
    (tmp_path / "notes.txt").write_text("the user's own file\n")
    for fmt, name in (("hf", "hf"), ("pt", "m.pt")):
        out = tmp_path / "notes.txt" / "sub" / name
        assert export_line(ckpt, out, "--format", fmt) == (
            f"export: {tmp_path / 'notes.txt'} is a file where a folder is written: choose another path")
    assert sorted(os.listdir(tmp_path)) == ["hf", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "the user's own file\n"

# ----------------------------------------------------------------------------- tokenizer files

def test_a_fifo_is_named_as_the_tokenizer_folder_and_never_hashed(fifo):
    import data
    import fileio
    with pytest.raises(ValueError, match=f"^tokenizer folder {fifo} is a FIFO: pass the folder holding"):
        data.load_offline_tokenizer("cl100k_base", fifo)
    # sha256_file read the FIFO, waiting for a writer forever: the alarm turns that wait into a failure

    def waited(signum, frame):
        raise TimeoutError("sha256_file waited on the FIFO")
    previous = signal.signal(signal.SIGALRM, waited)
    signal.alarm(10)
    try:
        with pytest.raises(fileio.NotOwnFile):
            fileio.sha256_file(fifo)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ----------------------------------------------------------------------------- prepare_data.py sources

@pytest.mark.parametrize("plant", ["fifo", "dangling link"])
@pytest.mark.parametrize("spec", ["{src}", "{src}/*.txt", "{src}/b.txt"])
def test_a_source_file_that_is_no_plain_file_is_one_line_not_a_hang(tmp_path, plant, spec):
    # A FIFO among a source's files: datasets (and the emptiness check before it) opened it and waited for a
    # writer forever; a dangling link was "[Errno 2] No such file" with no fix.
    from test_faults_data import one_line_error
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("some words for a document\n" * 20)
    b = src / "b.txt"
    os.mkfifo(b) if plant == "fifo" else os.symlink(tmp_path / "nowhere.txt", b)
    message = one_line_error(tmp_path / "out", "en=" + spec.format(src=src), tokenizer="bytes")
    what = "a FIFO" if plant == "fifo" else "a link to nothing"
    assert message == f"error: source en: {b} is {what}, not a data file: remove it or move it out of the source"
    assert not (tmp_path / "out" / "meta.json").exists()


# ----------------------------------------------------------------------------- bench.py, launchers' outputs

@pytest.mark.parametrize("kind", ["folder", "fifo", "under a file"])
def test_a_bench_json_out_that_cannot_be_written_is_refused_before_measuring(tmp_path, kind):
    # It was a traceback after the whole measurement (its results lost), and a FIFO was replaced.
    import bench
    path = tmp_path / "b.json"
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        (tmp_path / "notes.txt").write_text("x")
        path = tmp_path / "notes.txt" / "b.json"
    what = {"folder": f"{path} is a folder where a file", "fifo": f"{path} is a FIFO where a file",
            "under a file": f"{tmp_path / 'notes.txt'} is a file where a folder"}[kind]
    with pytest.raises(ValueError) as e:
        bench.main(["--variants", "reference", "--batch", "2", "--seq-len", "16", "--json-out", str(path)])
    assert str(e.value) == f"{what} is written: choose another --json-out"


def test_ctrl_c_during_a_bench_run_is_one_line_and_130():
    # the plan is printed once the imports are done and the peak is measured
    code, err = ctrl_c_after(["bench.py", "--variants", "reference", "--batch", "2", "--seq-len", "16", "--steps",
                              "100000", "--repeats", "1", "--warmup", "1"], "estimated time", timeout=60)
    assert code == 130 and err.strip().splitlines() == [
        "bench.py: interrupted; --json-out holds only the groups finished before it, run the same command again"], err


def test_launcher_outputs_under_a_link_to_nothing_or_a_loop_are_refused(tmp_path):
    # makedirs failed on them after the runs (a sweep's --results-dir) or at once with a traceback.
    import fileio
    os.symlink(tmp_path / "nowhere", tmp_path / "dangle")
    os.symlink("la", tmp_path / "lb")
    os.symlink("lb", tmp_path / "la")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'dangle'} is a link to nothing where a folder is made: fix$"):
        fileio.check_outputs([(tmp_path / "dangle" / "r.json", "file")], "fix")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'la'}: Too many levels of symbolic links, where a folder is "):
        fileio.check_outputs([(tmp_path / "la" / "r.json", "file")], "fix")
    fileio.check_outputs([(tmp_path / "dangle", "file")], "fix")  # a file's rename replaces the link itself
