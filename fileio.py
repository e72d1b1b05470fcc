"""
Files that readers rely on: written whole or not at all, JSON without NaN, sha256 of a file; files
of a folder from someone else opened only when they are plain files of its own (open_regular, and
open_in_run_dir for a run folder's); the lock files that keep a run, a data folder or a sweep point
to one process (lock_holder); a JSON object another tool wrote, its fields checked (read_object);
output paths checked before a run writes them (check_outputs).
Every tool writes through here (prepare_data.py's shards and meta.json, train.py's checkpoints
and metrics, eval.py's and sweep.py's results), so it imports nothing of the project.
"""

import errno
import fcntl
import hashlib
import json
import math
import os
import re
import socket
import stat
import tempfile
import time
from contextlib import contextmanager


def sha256_of(f):
    """The sha256 of an open binary file from where it stands, read in blocks (hashlib.file_digest is
    Python 3.11+; the project runs on 3.10)."""
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def sha256_file(path):
    with os.fdopen(open_regular(path), "rb") as f:  # a FIFO is refused (NotOwnFile), not read forever
        return sha256_of(f)


@contextmanager
def atomic_open(path):
    """A binary file for path that appears there whole or not at all: written under a temporary
    name of its own in the same folder (two writers of one file never share it: with a fixed name.tmp
    one could rename the other's half-written file away), fsynced (so a crash right after the
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


class NotOwnFile(OSError):
    """A name in a folder that is not a plain file of that folder's own (open_regular): a symlink, a
    FIFO, socket or device, a folder, or for a writer a file with other hard links. strerror says which."""


def file_kind(mode):
    """What st_mode (of a stat, or an lstat: "a symlink") says a file is, as a message names it."""
    kinds = {stat.S_ISREG: "a file", stat.S_ISLNK: "a symlink", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket",
             stat.S_ISDIR: "a folder", stat.S_ISCHR: "a device", stat.S_ISBLK: "a device"}
    return next((kind for test, kind in kinds.items() if test(mode)), "a special file")


def path_kind(path):
    """What path leads to (symlinks followed) as a message names it (file_kind: "a file", "a FIFO",
    "a folder", ...), or None where nothing is: told apart, a FIFO is not reported as missing."""
    try:
        return file_kind(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # links that lead to each other
            return "a symlink loop"
        raise


def open_regular(path, flags=os.O_RDONLY, follow=True):
    """os.open of a regular file, anything else refused (NotOwnFile) without waiting: a FIFO planted
    under the name would block the open forever. A writer (O_WRONLY, O_RDWR) is also refused a file
    with other hard links: truncating or appending to it would change the file under its other name,
    which may be anywhere the user can write. follow=False refuses a symlink instead of following it
    (errno ELOOP). O_TRUNC is applied only once the file passed."""
    try:
        fd = os.open(path, flags & ~os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW),
                     0o666)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise NotOwnFile(e.errno, "a symlink: not followed", path) from None
        if e.errno == errno.ENXIO:  # a FIFO opened to write with no reader: refused by O_NONBLOCK
            raise NotOwnFile(e.errno, "a FIFO: not opened", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotOwnFile(errno.EINVAL, f"{file_kind(st.st_mode)}: not opened", path)
        if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:
            raise NotOwnFile(errno.EMLINK, f"a hard link ({st.st_nlink} names): not written through", path)
        os.set_blocking(fd, True)
        if flags & os.O_TRUNC:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_nofollow(path, flags=os.O_RDWR | os.O_CREAT):
    """open_regular that refuses a symlink at path instead of following it: a run folder may come from
    someone else (tar, rsync, a shared disk), and a lock or log file planted there as a link would
    otherwise let opening it truncate or append to any file the user can write."""
    return open_regular(path, flags, follow=False)


class RunDirError(Exception):
    """The run folder can't be used as asked: locked by another run, a file in it that is not its own, or a
    resume that would change the experiment. One line naming the problem and the fix."""


def open_in_run_dir(path, flags):
    """open_nofollow for a file of a run folder, refused in one line when it is not a plain file
    of its own: the folder may come from someone else, and opening a symlink or a hard link there to
    write (the lock truncates its file) would change a file anywhere the user can write, a FIFO would
    never open. A folder under the name is refused too: opened to write, it fails with a bare EISDIR."""
    try:
        return open_nofollow(path, flags)
    except (NotOwnFile, IsADirectoryError) as e:
        raise not_own_file(path, "a folder" if isinstance(e, IsADirectoryError) else e.strerror) from None


def not_own_file(path, what):
    """The one line for a run folder's file that is not a plain file of its own (what: what it is)."""
    return RunDirError(f"{path} is {what} (a run folder's files are its own); replace it with a regular file or "
                       f"remove it, then rerun")


def lock_pids(fd):
    """The pids the kernel's lock table (Linux's /proc/locks) shows holding a lock on fd's file, or None
    when it cannot tell (no /proc/locks; a holder on another host of a network filesystem is not listed)."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            table = f.read().splitlines()
    except OSError:
        return None
    # "1: FLOCK  ADVISORY  WRITE 6496 fe:00:2146371 0 EOF"; a waiter's line has "->" after the number
    rows = [line.split() for line in table if "->" not in line.split()[:2]]
    pids = {int(row[4]) for row in rows if len(row) > 5 and row[5] == key and row[4].lstrip("-").isdigit()}
    return {pid for pid in pids if pid > 0} or None  # 0 or -1: a pid outside this pid namespace


def live_holder(written, pids):
    """Who holds a lock, for the error line: the line its file holds (who, pid, host, since) when the kernel
    shows that pid holding it, else the pid the kernel shows with its command line; never a pid that the
    file names but the kernel does not (a run that has exited, and whoever holds the lock now left the
    file as it was). Without the kernel's word: the file's line when it names another host (its process
    cannot be looked up from here), else "another process"."""
    named = re.search(r"\bpid (\d+) on host (\S+)", written)
    here = socket.gethostname()
    if pids:
        if named and int(named.group(1)) in pids and named.group(2) == here:
            return written
        pid = min(pids)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmdline = ""
        return f"pid {pid}" + (f" ({cmdline[:100]})" if cmdline else "")
    if named and named.group(2) != here:
        return f"{written} (as its lock file says: a process on another host, not checked from here)"
    return "another process"


def lock_holder(fd, path, who):
    """An exclusive OS lock on the open file fd (path: its name), taken without waiting and released by
    the kernel when the process dies (no stale lock after a crash or SIGKILL). Returns None once taken,
    the file then saying `who` holds it (e.g. "train.py pid 12 on host h (since ...)"); else the line
    the holder wrote, for the error the second process gives (fd is then closed, as when writing fails)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        written = os.read(fd, 512).decode(errors="replace").strip()
        holders = lock_pids(fd)
        os.close(fd)
        return live_holder(written, holders)
    try:
        with naming(path):
            os.ftruncate(fd, 0)  # the holder before was killed: its line stayed
            os.write(fd, f"{who} pid {os.getpid()} on host {socket.gethostname()} "
                         f"(since {time.strftime('%Y-%m-%d %H:%M:%S')})\n".encode())
    except OSError:  # a full disk: the error, and the fd closed (a process that goes on keeps no file open)
        os.close(fd)
        raise
    return None


@contextmanager
def naming(path):
    """An OSError raised while writing path names it: a write or flush that fails (a full disk)
    raises one without a file name, or with that of the temporary file atomic_open writes."""
    try:
        yield
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), path) from None


# The limits a write can run into, each with what was hit and what to do about it: a write that
# hits one is a one-line error naming it (train.py, checkpoint.py), not a traceback.
WRITE_LIMITS = {
    errno.ENOSPC: ("no space left on device", "Free space"),
    errno.EDQUOT: ("disk quota exceeded", "Free space within the quota (or raise it)"),
    errno.EFBIG: ("file too large for the file-size limit (ulimit -f)", "Raise the limit (ulimit -f unlimited)"),
}


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


def parse_json(text):
    """json.loads whose every failure on bad text is a ValueError, as a reader's one-line error
    catches it: the decoder recurses once per nesting level, so a crafted line of 100k '[' would
    otherwise raise RecursionError past every `except ValueError`."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested deeper than a JSON reader follows") from None


def read_json(path):
    with open(path, "rb") as f:
        return parse_json(f.read())


# What a JSON value is, as a message names it.
JSON_KINDS = {list: "an array", str: "a string", bool: "true or false", int: "a number", float: "a number",
              type(None): "null"}


def read_object(path, fields, follow=True):
    """The JSON object in path, a file a run wrote, with `fields` ({key: type}) of those types. Anything
    else is a ValueError saying what the file is instead: not a plain file (a FIFO would block the read
    forever; follow=False refuses a symlink), not JSON (also JSON nested past what the decoder follows), or
    another JSON value: read as it is, it would end the launcher in a traceback or go wrong into its results."""
    try:
        with os.fdopen(open_regular(path, follow=follow), "rb") as f:
            obj = parse_json(f.read())
    except OSError as e:  # missing, a folder, a FIFO, a link not followed
        raise ValueError(e.strerror) from None
    except ValueError as e:  # not JSON, not UTF-8
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{JSON_KINDS[type(obj)]}, not an object")
    wrong = [k for k, kind in fields.items() if not isinstance(obj.get(k), kind)]
    if wrong:
        raise ValueError(f"{', '.join(wrong)} missing or of the wrong type")
    return obj


def folders_above(path):
    """The folders path lies in, outermost first: /a/b/c -> /, /a, /a/b."""
    up = os.path.dirname(path)
    return [] if up == path else [*folders_above(up), up]


def check_outputs(outputs, fix):
    """Refuse, before anything runs, an output path (outputs: [(path, "file" or "folder")]) that holds the
    wrong kind of thing: a file where a folder goes (the path or a folder above it), a folder, FIFO or device
    where a file is written. Met only when written, it would end the run after its work (a launcher's trainings, an
    export's model read), its results unsaved. One line naming the path and `fix`."""
    for path, kind in outputs:
        path = os.fspath(path)
        parts = path.split(os.sep)
        for i, part in enumerate(parts):
            # abspath drops "a/.." without looking, the kernel walks into a: a missing one fails the write
            # after the checks passed and the folders after ".." were made.
            if part == ".." and i and not os.path.isdir(os.sep.join(parts[:i]) or os.sep):
                raise ValueError(f"{path} goes through {os.sep.join(parts[:i])}, which is not a folder, before "
                                 f"'..': {fix}")
        path = os.path.abspath(path)
        for at, want in [(folder, "folder") for folder in folders_above(path)] + [(path, kind)]:
            try:
                mode = os.stat(at).st_mode
            except FileNotFoundError:
                if want == "folder" and os.path.lexists(at):  # a link to nothing: making the folder fails
                    raise ValueError(f"{at} is a link to nothing where a folder is made: {fix}") from None
                break  # made when written, with what lies below it (a file's rename replaces a link)
            except OSError as e:  # a symlink loop
                raise ValueError(f"{at}: {e.strerror}, where a {want} is written: {fix}") from None
            if not (stat.S_ISDIR(mode) if want == "folder" else stat.S_ISREG(mode)):
                raise ValueError(f"{at} is {file_kind(mode)} where a {want} is written: {fix}")
