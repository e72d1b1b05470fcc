"""Run folders and data folders are untrusted input: a hard link planted there is never written
through (the lock truncates its file, the logs append), a FIFO planted under a name a writer or
reader opens is refused instead of blocking forever, and the anchor command, like `text`, never
rebuilds a folder prepared with other settings unasked. Each refusal is one line naming the file."""
import hashlib
import json
import os
import pickle
import signal
from contextlib import contextmanager

import pytest
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.filesystem import _StorageInfo

import checkpoint
import fileio
import prepare_data as P
from test_faults_data import snapshot
from test_run_folder import one_line
from test_train import TINY, run_here, run_train

OUTSIDE = b"a file of the user's, anywhere\n"
TAIL = "(a run folder's files are its own); replace it with a regular file or remove it, then rerun"


@contextmanager
def within(seconds):
    """Fails the test, instead of hanging it, when what runs inside blocks (an open of a FIFO waits
    for the other end forever): SIGALRM's handler raises out of the blocked system call."""
    def stop(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def plant_hard_link(folder, name, outside):
    """name in folder as a second name of the outside file (what tar or rsync -H of someone's folder gives)."""
    outside.write_bytes(OUTSIDE)
    os.makedirs(folder, exist_ok=True)
    os.link(outside, os.path.join(folder, name))


def plant_fifo(folder, name):
    os.makedirs(folder, exist_ok=True)
    os.mkfifo(os.path.join(folder, name))
    return os.path.join(folder, name)


# ----------------------------------------------------------------------------- hard links in a run folder
def test_a_hard_linked_train_lock_is_refused_and_the_other_file_kept(data_dir, tmp_path):
    out, outside = tmp_path / "run", tmp_path / "precious.txt"
    plant_hard_link(out, "train.lock", outside)
    p = run_here([*TINY, "--max_steps=4", f"--data_dir={data_dir}", f"--out_dir={out}"], ok=False)
    assert p.returncode == 1
    assert one_line(p) == f"{out / 'train.lock'} is a hard link (2 names): not written through {TAIL}"
    assert outside.read_bytes() == OUTSIDE and os.path.samefile(outside, out / "train.lock")
    assert not (out / "config.json").exists()


# the run folder's writers that change a file in place: train.lock and sweep.lock (rewritten), metrics.jsonl
# and sweep.log (appended to)
WRITERS = {"lock": os.O_RDWR | os.O_CREAT, "log": os.O_WRONLY | os.O_APPEND | os.O_CREAT}


@pytest.mark.parametrize("flags", WRITERS.values(), ids=WRITERS.keys())
def test_no_writer_of_a_run_folder_writes_through_a_hard_link(tmp_path, flags):
    run, outside = tmp_path / "run", tmp_path / "precious.txt"
    plant_hard_link(run, "metrics.jsonl", outside)
    with pytest.raises(fileio.RunDirError) as e:
        os.close(fileio.open_in_run_dir(str(run / "metrics.jsonl"), flags))
    assert str(e.value) == f"{run / 'metrics.jsonl'} is a hard link (2 names): not written through {TAIL}"
    assert outside.read_bytes() == OUTSIDE
    os.remove(run / "metrics.jsonl")  # the fix the line names
    os.close(fileio.open_in_run_dir(str(run / "metrics.jsonl"), flags))
    assert (run / "metrics.jsonl").is_file() and outside.read_bytes() == OUTSIDE


def test_reading_a_hard_linked_file_is_allowed(tmp_path):
    """Reading changes nothing: a run folder copied with `cp -al` still reads."""
    run, outside = tmp_path / "run", tmp_path / "rows.jsonl"
    plant_hard_link(run, "metrics.jsonl", outside)
    outside.write_bytes(b'{"step": 1}\n')
    assert checkpoint.metrics_rows(str(run / "metrics.jsonl")) == [(b'{"step": 1}\n', {"step": 1})]


# ----------------------------------------------------------------------------- FIFOs in a run folder
@pytest.mark.parametrize("flags", [*WRITERS.values(), os.O_RDONLY], ids=[*WRITERS.keys(), "read"])
def test_a_fifo_in_a_run_folder_is_refused_without_blocking(tmp_path, flags):
    fifo = plant_fifo(tmp_path / "run", "metrics.jsonl")
    with within(10), pytest.raises(fileio.RunDirError) as e:
        os.close(fileio.open_in_run_dir(fifo, flags))
    assert str(e.value) == f"{fifo} is a FIFO: not opened {TAIL}"


def test_resume_into_a_run_folder_with_a_fifo_metrics_jsonl_is_one_line(data_dir, tmp_path):
    out = tmp_path / "run"
    fifo = plant_fifo(out, "metrics.jsonl")
    p = run_train([*TINY, "--max_steps=4", f"--data_dir={data_dir}", f"--out_dir={out}"], ok=False)  # hung before
    assert p.returncode == 1 and one_line(p) == f"{fifo} is a FIFO: not opened {TAIL}"


# ----------------------------------------------------------------------------- FIFOs in a checkpoint
def fake_checkpoint(folder):
    """A checkpoint folder complete by checkpoint_problem's rules: one 4-byte shard that .metadata
    names, an rng file, meta.json listing the three with their sha256s, meta.json's own beside it."""
    os.makedirs(folder)
    index = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): _StorageInfo("__0_0.distcp", 0, 4)})
    files = {".metadata": pickle.dumps(index), "__0_0.distcp": b"\0" * 4, "rng_rank0.pt": b"rng"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    meta = {"step": 1, "world_size": 1, "config": {}, "model_config": {}, "data_meta": {},
            "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}}
    raw = json.dumps(meta).encode()
    (folder / "meta.json").write_bytes(raw)
    (folder / checkpoint.META_SUM).write_bytes(checkpoint.meta_sum(raw))
    return str(folder), meta


def test_the_fake_checkpoint_is_complete(tmp_path):
    path, meta = fake_checkpoint(tmp_path / "ckpt_00000001")
    assert checkpoint.checkpoint_problem(path) is None and checkpoint.checksum_problem(path, meta) is None


@pytest.mark.parametrize("name", ["meta.json", checkpoint.META_SUM, ".metadata", "__0_0.distcp", "rng_rank0.pt"])
def test_a_fifo_in_a_checkpoint_is_damage_not_a_hang(tmp_path, name):
    """meta.json, its sha256 and .metadata are read by open(), which blocked forever; the shard and
    the rng file were called missing."""
    path, meta = fake_checkpoint(tmp_path / "ckpt_00000001")
    os.remove(os.path.join(path, name))
    plant_fifo(path, name)
    expected = f"{name} is a FIFO: not opened (a checkpoint's files are plain files in its folder)"
    with within(10):
        assert checkpoint.checkpoint_problem(path) == expected
        # the readers' check hashes the files meta.json lists: not meta.json and its sha256
        assert checkpoint.checksum_problem(path, meta) == (expected if name in meta["sha256"] else None)
        found, damaged = checkpoint.scan_checkpoints(str(tmp_path))
    assert found == [] and damaged == [(path, expected)]


# ----------------------------------------------------------------------------- data folders
def test_a_fifo_as_a_data_folders_meta_json_is_one_line(tmp_path):
    out = tmp_path / "data"
    fifo = plant_fifo(out, "meta.json")
    with within(20), pytest.raises(SystemExit) as e:
        P.main(["anchor", "--out", str(out), "--n-train", "50", "--n-eval", "10"])
    assert str(e.value.code) == (f"error: {fifo} is not a data folder's meta.json: a FIFO: not opened; --force "
                                 f"rebuilds {out} (dropping that file), or pass another --out")
    assert os.listdir(out) == ["meta.json"]


# ----------------------------------------------------------------------------- the anchor command's folder
ANCHOR = ["anchor", "--n-train", "200", "--n-eval", "40"]


def test_the_anchor_command_refuses_a_folder_prepared_with_other_settings(tmp_path, capsys):
    out = str(tmp_path / "anchor")
    P.main([*ANCHOR, "--out", out])
    before = snapshot(out)
    with pytest.raises(SystemExit) as e:  # rebuilt silently before: runs trained on it lost their data
        P.main([*ANCHOR, "--out", out, "--seed", "3", "--keys", "20-60"])
    assert str(e.value.code) == (f"error: {out} was prepared with other settings: --keys [20, 99] -> [20, 60]; "
                                 f"--seed 0 -> 3; --force replaces its data with these, or pass another --out")
    assert snapshot(out) == before
    capsys.readouterr()
    P.main([*ANCHOR, "--out", out])  # the same settings: left as it is
    assert "already prepared with these settings" in capsys.readouterr().out and snapshot(out) == before
    P.main([*ANCHOR, "--out", out, "--seed", "3", "--keys", "20-60", "--force"])  # the fix the line names
    with open(os.path.join(out, "meta.json")) as f:
        recorded = json.load(f)["anchor"]
    assert (recorded["seed"], recorded["keys"]) == (3, [20, 60])


def test_the_anchor_command_does_not_overwrite_a_text_folder(tmp_path):
    out = tmp_path / "text"
    (tmp_path / "a.txt").write_text("some text\n\nand more\n")
    P.main(["text", "--out", str(out), "--workers", "1", "--source", f"a={tmp_path / 'a.txt'}"])
    before = snapshot(out)
    with pytest.raises(SystemExit) as e:
        P.main([*ANCHOR, "--out", str(out)])
    message = str(e.value.code)
    assert message.startswith(f"error: {out} was prepared with other settings: --seq-len (not recorded) -> 9;")
    assert snapshot(out) == before
