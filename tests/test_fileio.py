"""fileio.py: a results file written by two processes at once (two sweeps, two evals) is always
one writer's whole file to a reader, and neither writer fails."""
import errno
import json
import multiprocessing
import os

from fileio import atomic_open, open_nofollow, write_json

WRITES = 150


def writer(path, who, errors):
    payload = [who] * 20000  # ~100 kB: each write takes long enough for the others to overlap it
    try:
        for i in range(WRITES):
            write_json(path, {"who": who, "i": i, "payload": payload})
    except Exception as e:  # noqa: BLE001 (reported to the test, which names it)
        errors.put(f"writer {who}: {type(e).__name__}: {e}")


def test_two_concurrent_writers_and_a_reader(tmp_path):
    path = str(tmp_path / "results.json")
    write_json(path, {"who": -1, "i": -1, "payload": []})
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    procs = [ctx.Process(target=writer, args=(path, who, errors)) for who in (0, 1)]
    for p in procs:
        p.start()
    reads, bad = 0, []
    while any(p.is_alive() for p in procs):
        try:
            with open(path) as f:
                row = json.load(f)
            assert row["payload"] == [row["who"]] * len(row["payload"])  # one writer's file, whole
            reads += 1
        except (ValueError, FileNotFoundError) as e:
            bad.append(f"{type(e).__name__}: {e}")
    for p in procs:
        p.join()
    failed = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not failed and not bad and reads > 0, (failed, bad[:3], len(bad), reads)
    assert json.load(open(path))["i"] == WRITES - 1
    assert os.listdir(tmp_path) == ["results.json"]  # no temporary file left


def test_atomic_files_get_a_plain_files_mode(tmp_path):
    with atomic_open(tmp_path / "a.bin") as f:
        f.write(b"x")
    open(tmp_path / "b.bin", "wb").close()
    assert os.stat(tmp_path / "a.bin").st_mode == os.stat(tmp_path / "b.bin").st_mode  # not mkstemp's 0600


def test_failed_rename_leaves_no_temporary_file(tmp_path):
    # The target is a folder: the rename fails after the temporary file was written whole.
    (tmp_path / "out.json").mkdir()
    try:
        write_json(tmp_path / "out.json", {"a": 1})
    except OSError:
        pass
    else:
        raise AssertionError("writing over a folder should fail")
    assert sorted(os.listdir(tmp_path)) == ["out.json"]


def test_open_nofollow_refuses_a_link_and_leaves_its_target(tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    (tmp_path / "train.lock").symlink_to(target)
    try:
        open_nofollow(tmp_path / "train.lock")
    except OSError as e:
        assert e.errno == errno.ELOOP
    else:
        raise AssertionError("open_nofollow followed a symlink")
    assert target.read_bytes() == b"keep me"
    os.close(open_nofollow(tmp_path / "plain.lock"))  # a plain name is created as before
    assert (tmp_path / "plain.lock").is_file()


def test_json_nested_past_the_parser_is_a_value_error(tmp_path):
    """Every reader catches ValueError for a bad JSON file; a crafted 100k-deep one raised RecursionError."""
    from fileio import parse_json, read_json
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "deep.json").write_text(deep)
    for read in (lambda: parse_json(deep), lambda: read_json(tmp_path / "deep.json")):
        try:
            read()
        except ValueError as e:
            assert "nested deeper" in str(e)
        else:
            raise AssertionError("a 100k-deep JSON text was parsed")
    assert parse_json(b'{"a": [1, 2.5]}') == {"a": [1, 2.5]}


def test_the_lock_holder_named_is_the_live_one(tmp_path, monkeypatch):
    # train.lock as an exited run left it, now held by another process through a read-only descriptor: the
    # kernel's holder is named, not the dead pid the file still names.
    import socket
    import subprocess
    import sys

    import fileio
    path = tmp_path / "train.lock"
    path.write_text(f"train.py pid 999999 on host {socket.gethostname()} (since 2026-01-01 00:00:00)\n")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        said = fileio.lock_holder(os.open(path, os.O_RDWR), str(path), "train.py")
        assert said.startswith(f"pid {holder.pid} (") and "fcntl" in said and "999999" not in said
        # The kernel shows the pid the file names: the file's line, which says more (host, since).
        path.write_text(f"train.py pid {holder.pid} on host {socket.gethostname()} (since now)\n")
        assert fileio.lock_holder(os.open(path, os.O_RDWR), str(path), "train.py") == path.read_text().strip()
        # No word from the kernel (another host's holder on a network filesystem): never the file's pid as
        # this host's, unless the file names another host, which is said.
        monkeypatch.setattr(fileio, "lock_pids", lambda fd: None)
        assert fileio.lock_holder(os.open(path, os.O_RDWR), str(path), "train.py") == "another process"
        path.write_text("train.py pid 12 on host elsewhere (since now)\n")
        assert fileio.lock_holder(os.open(path, os.O_RDWR), str(path), "train.py") == (
            "train.py pid 12 on host elsewhere (since now) (as its lock file says: a process on another host, not "
            "checked from here)")
    finally:
        holder.communicate("")
