"""prepare_data.py killed (SIGKILL: kill -9, the OOM killer) while its pool tokenizes: no worker outlives it.
An idle worker sees the task pipe close and ends; a busy one ran its task to the end first (a long document:
seconds, with a slow tokenizer minutes), holding its memory and --out's lock (inherited), so the same command
run again was refused as "in use" by the dead process. The rerun must then build the folder whole.
And what the interrupted run recorded (a cache marker, meta.json) is quoted shortened: a 500-digit file size
was printed whole."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import prepare_data as P
from test_prepare_data import ROOT, prepare, random_docs, write_jsonl

# prepare_data.py whose workers, once they hold a task, say so (a file named by their pid in argv[1]) and stay
# busy with it: a document that takes long to tokenize, without the minutes and the memory of a real one
BUSY = """
import os, sys, time
import prepare_data as P

def busy(texts):
    open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
    time.sleep(600)

P.encode_documents = busy
P.cli(sys.argv[2:])
"""


def start_time(pid):
    """The process's start time (field 22 of /proc/PID/stat), None once it has ended (or is a zombie): with
    the pid it names one process, not a later one given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    except FileNotFoundError:
        return None
    return None if fields[0] == "Z" else fields[19]


def wait_for(condition, seconds):
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal and /proc are Linux's")
def test_a_killed_run_leaves_no_worker_and_the_rerun_builds_the_folder(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", random_docs(200, "abcdefgh ", seed=30, lo=2000, hi=3000))
    text = ["text", "--workers", "2", "--source", f"a={src}", "--val-fraction", "0.1"]
    busy_dir = tmp_path / "busy"
    busy_dir.mkdir()
    main = subprocess.Popen([sys.executable, "-c", BUSY, str(busy_dir), *text, "--out", str(tmp_path / "out")],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    workers = {}
    try:
        # 200 documents of ~2.5k characters are two tasks (chunk_texts' 256k): one for each worker
        assert wait_for(lambda: len(os.listdir(busy_dir)) == 2 or main.poll() is not None, 60), "no busy workers"
        assert main.poll() is None, main.stderr.read()
        workers = {pid: start_time(pid) for pid in map(int, os.listdir(busy_dir))}
        assert None not in workers.values()
        main.kill()
        main.wait()
        assert wait_for(lambda: all(start_time(pid) != t for pid, t in workers.items()), 5), \
            f"workers {sorted(workers)} still run 5 s after their prepare_data.py was killed"
    finally:
        main.kill()
        main.wait()
        for pid, t in workers.items():
            if start_time(pid) == t:
                os.kill(pid, signal.SIGKILL)
    # what the kill left (a lock file, a half-written token file without its done marker) is not trusted: the
    # same command writes what a clean build writes, byte for byte, and nothing else
    cmd = [sys.executable, "prepare_data.py", *text]
    for out in ("out", "clean"):
        run = subprocess.run([*cmd, "--out", str(tmp_path / out)], cwd=ROOT, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert "reusing" not in run.stderr
    built = {name: (tmp_path / "out" / name).read_bytes() for name in os.listdir(tmp_path / "out")}
    clean = {name: (tmp_path / "clean" / name).read_bytes() for name in os.listdir(tmp_path / "clean")}
    assert sorted(built) == sorted(clean) == ["meta.json", "train_000000.bin", "val_000000.bin"]
    assert {k: v for k, v in built.items() if k != "meta.json"} == {k: v for k, v in clean.items() if k != "meta.json"}


# Workers that outlive their parent's death long enough to send their result: SIGTERM (the parent-death
# signal) ignored, the task returning once the parent is gone.
ORPHANS = """
import os, signal, sys, time
import prepare_data as P

init = P.init_worker

def stubborn(*args):
    init(*args)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

def busy(texts):
    parent = os.getppid()
    open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
    while os.getppid() == parent:
        time.sleep(0.01)
    return [[1, 2, 3]] * len(texts)

P.init_worker, P.encode_documents = stubborn, busy
P.cli(sys.argv[2:])
"""


def busy_run(script, tmp_path):
    """prepare_data.py (script: BUSY or ORPHANS) with two workers, each holding a task: (process, busy folder)."""
    src = write_jsonl(tmp_path / "a.jsonl", random_docs(200, "abcdefgh ", seed=30, lo=2000, hi=3000))
    busy_dir = tmp_path / "busy"
    busy_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", script, str(busy_dir), "text", "--workers", "2", "--source",
                             f"a={src}", "--out", str(tmp_path / "out")], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: len(os.listdir(busy_dir)) == 2 or proc.poll() is not None, 60), "no busy workers"
    assert proc.poll() is None, proc.stderr.read()
    return proc, busy_dir


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal and /proc are Linux's")
def test_workers_dying_after_their_run_was_killed_print_nothing(tmp_path):
    proc, busy_dir = busy_run(ORPHANS, tmp_path)
    workers = {pid: start_time(pid) for pid in map(int, os.listdir(busy_dir))}
    proc.kill()
    # stderr ends once the workers, which share it, have exited: after sending into the dead run's pipe
    said = proc.stderr.read()
    assert "Traceback" not in said and "Error" not in said, said
    assert wait_for(lambda: all(start_time(p) != t for p, t in workers.items()), 10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_stops_a_build_in_one_line(tmp_path, sig):
    proc, _ = busy_run(BUSY, tmp_path)
    proc.send_signal(sig)
    err = proc.communicate(timeout=60)[1]
    said = [line for line in err.splitlines() if not line.startswith("tokenizing a:")]  # the progress lines
    assert proc.returncode == 128 + sig and len(said) == 1 and said[0].startswith(f"{sig.name}: interrupted"), err
    assert not os.path.exists(tmp_path / "out" / "meta.json")


def test_a_huge_recorded_file_size_is_quoted_shortened(tmp_path, monkeypatch, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", random_docs(50, "abcdefgh ", seed=31))
    size = os.path.getsize(src)
    huge = 10 ** 500  # json.dumps writes it whole; parse_json reads it back as an int
    changed = f"{src} changed size (1{'0' * 19}... (501 digits) -> {size:,} bytes)"
    out = tmp_path / "out"
    # an interrupted run's cache whose marker records the huge size: tokenized again, said in one short line
    with monkeypatch.context() as m:
        m.setattr(P, "write_shard", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            prepare(out, f"a={src}")
    done = out / "tokenize_cache" / "a.done.json"
    marker = json.loads(done.read_text())
    done.write_text(json.dumps({**marker, "files": [[str(src), huge, marker["files"][0][2]]]}))
    capsys.readouterr()
    prepare(out, f"a={src}")
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("a: ")]
    assert said == [f"a: {changed} since the interrupted run, tokenizing again"]
    # a prepared folder whose meta.json records it: refused in one line naming the file and the fix
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "source_files": {"a": [[str(src), huge, 0]]}}))
    with pytest.raises(SystemExit) as e:
        prepare(out, f"a={src}")
    assert str(e.value) == (f"error: {out} was prepared from other source files: {changed}; --force rebuilds it "
                            f"from the files there now, --keep-stale keeps the old data")
