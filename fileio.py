"""
Files that readers rely on: written whole or not at all, JSON without NaN, sha256 of a file.
Every tool writes through here (prepare_data.py's shards and meta.json, train.py's checkpoints
and metrics, eval.py's and sweep.py's results), so it imports nothing of the project.
"""

import hashlib
import json
import math
import os
import tempfile
from contextlib import contextmanager


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextmanager
def atomic_open(path):
    """A binary file for path that appears there whole or not at all: written under a temporary
    name of its own in the same folder (two writers of one file never share it: a fixed name.tmp
    let one rename the other's half-written file away), fsynced (so a crash right after the
    rename can't leave an empty file), then renamed over path; a reader sees the old file or the
    new one. Made with the mode a plain open() would give, not mkstemp's 0600."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=os.path.basename(path) + ".",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)  # a rename replaces a symlink at path; it never writes through one
    except BaseException:  # a full disk, a kill signal turned exception, path a folder: no temporary file left behind
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise


def open_nofollow(path, flags=os.O_RDWR | os.O_CREAT):
    """os.open that refuses a symlink at path (OSError ELOOP) instead of following it: a run folder
    may come from someone else (tar, rsync, a shared disk), and a lock or log file planted there as a
    link would otherwise let opening it truncate or append to any file the user can write."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


def atomic_write_bytes(path, chunks):
    with atomic_open(path) as f:
        for chunk in chunks:
            f.write(chunk)


def json_safe(obj):
    """obj with every non-finite float as None: standard JSON has no NaN/Infinity, and an
    undefined quantity (an error bar without residual degrees of freedom) is null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path, obj):
    # Atomic: a reader (a resumed run, `eval.py report` over a results folder) never sees half a file.
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_bytes(path, [json.dumps(json_safe(obj), indent=1, allow_nan=False).encode()])


def read_json(path):
    with open(path) as f:
        return json.load(f)
