"""
The run folder and the checkpoint format: written by train.py, read by train.py (resume), eval.py,
hf_export.py and downstream.py (load_model). Nothing here imports train.py.

A run folder holds config.json, metrics.jsonl, train.lock and checkpoints ckpt_{step:08d}. A
checkpoint is a folder of DCP's shards (*.distcp) and .metadata index (model + optimizer), one
rng_rank{r}.pt per rank, and meta.json (config, model_config, data_meta, data_fingerprint, step,
world_size, the loader's data_state, code_version, and the sha256 of every other file in the folder) with its
own sha256 beside it in meta.json.sha256. It is written as tmp_ckpt_... and renamed only when
every part is on disk.

Run folders are untrusted input (tar, rsync, a shared disk). Reading never runs code from them
and never changes the process: .metadata is unpickled with an allow-list of the classes DCP
writes there, which may set the state of DCP's records only, byte entries and rng files load as
plain data (weights_only), a checkpoint reads only files inside its folder that meta.json has
sha256s of, and their bytes are checked before they are used. No symlink in a run folder is
followed, to read or to write, no FIFO there is opened (it would block), and no file with other
hard links is written to.
"""

import errno
import fcntl
import glob
import hashlib
import itertools
import json
import os
import pickle
import re
import resource
import shutil
import stat
import subprocess
import sys
import warnings
import zipfile
import contextlib
from contextlib import contextmanager
from dataclasses import asdict, fields

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from model import GPT, GPTConfig
from fileio import (WRITE_LIMITS, NotOwnFile, RunDirError, atomic_open, atomic_write_bytes, check_outputs, file_kind,
                    lock_holder, naming, open_in_run_dir, open_nofollow, open_regular, parse_json, path_kind, read_json,
                    sha256_file, sha256_of, write_json)

# ----------------------------------------------------------------------------- reading without running code
# DCP unpickles .metadata with plain pickle.load and torch.loads its byte entries (the optimizer's
# param_groups) with weights_only=False: a crafted folder would run its code on resume, eval or
# export, before any check of ours could look at it. .metadata may name only what DCP writes there.
# DCP's records, the dataclasses .metadata is made of: the only objects whose state it may set.
DCP_RECORDS = (Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata, BytesStorageMetadata,
               ChunkStorageMetadata, _StorageInfo)
METADATA_CLASSES = {(c.__module__, c.__name__) for c in DCP_RECORDS} | {
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint whose .metadata or byte entries would do more than hold DCP's plain records (name a
    class outside the allow-list, set a class's attributes, point at files outside its folder): never loaded."""


# The Python unpickler, not the C one: only its opcodes can be overridden (BUILD, below).
class MetadataUnpickler(pickle._Unpickler):
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module, name):
        # vars, not getattr: torch's module __getattr__ would import whatever submodule the name says
        dtype = module == "torch" and isinstance(vars(torch).get(name), torch.dtype)
        if (module, name) in METADATA_CLASSES or dtype:
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"its .metadata names {module}.{name}, which DCP never writes there (a crafted "
                               f"file?): not loaded")

    def load_build(self):
        # BUILD sets the attributes of whatever lies under its state on the stack, and that may be a
        # class the allow-list admits: `GLOBAL pathlib.PosixPath` then BUILD {"__truediv__": ...} would
        # rebind Path's `/` for the whole process. DCP only ever builds instances of its records.
        target = self.stack[-2]
        if type(target) not in DCP_RECORDS:
            raise UnsafeCheckpoint(f"its .metadata sets attributes of {repr(target)[:80]}, which is not one of "
                                   f"DCP's records (a crafted file?): not loaded")
        super().load_build()
    dispatch[pickle.BUILD[0]] = load_build


def plain_name(name):
    """A file name inside its folder: DCP joins an index's relative_path to the folder, so an absolute
    or ../ one (or a name with a separator) would read a file outside it."""
    return type(name) is str and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def index_problem(index):
    """What is wrong with an unpickled .metadata as DCP's index, else None. DCP's reader sets an
    attribute of its storage_meta and reads the files and byte ranges its storage entries name."""
    if type(index) is not Metadata:
        return f"holds {repr(index)[:80]}, not DCP's index"
    if type(index.storage_meta) not in (StorageMeta, type(None)):
        return f"has {repr(index.storage_meta)[:80]} as its storage_meta"
    if type(index.storage_data) is not dict:
        return "has no table of storage entries"
    for item in index.storage_data.values():
        if type(item) is not _StorageInfo:
            return f"has {repr(item)[:80]} as a storage entry"
        if not plain_name(item.relative_path):
            return f"points a storage entry at {item.relative_path!r}, not a file inside the checkpoint folder"
        if not all(type(n) is int and n >= 0 for n in (item.offset, item.length)):
            return f"gives {item.relative_path} a byte range of {item.offset!r}+{item.length!r}"
    return None


class CheckpointFiles(FileSystem):
    """DCP's file access for reading, every file opened by open_in_checkpoint."""

    @contextmanager
    def create_stream(self, path, mode):
        with os.fdopen(open_in_checkpoint(os.fspath(path)), mode) as stream:
            yield stream


class CheckpointReader(dcp.FileSystemReader):
    """DCP's reader with .metadata unpickled through the allow-list and checked before use, and its
    files opened as plain files of the folder (CheckpointFiles)."""

    def __init__(self, path):
        super().__init__(path)
        self.fs = CheckpointFiles()

    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = MetadataUnpickler(f).load()
        problem = index_problem(metadata)
        if problem:
            raise UnsafeCheckpoint(f"its .metadata {problem} (a crafted file?): not loaded")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class CheckpointLoadPlanner(DefaultLoadPlanner):
    """DCP's planner with byte entries loaded as plain data (numbers, strings, lists, tensors)."""

    def load_bytes(self, read_item, value):
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:  # torch's message advises weights_only=False: never that here
            raise UnsafeCheckpoint(f"its entry {read_item.dest_index.fqn} is a pickle of more than plain data "
                                   f"(a crafted file?): not loaded") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def dcp_load(state, path):
    dcp.load(state, storage_reader=CheckpointReader(path), planner=CheckpointLoadPlanner())


def load_error(error):
    """One line for an exception from dcp_load: DCP wraps each rank's own exception, with its
    traceback, in a CheckpointException whose text is the whole traceback."""
    for failure in getattr(error, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            error = inner
            break
    text = str(error).splitlines()[0] if str(error) else ""
    return text if isinstance(error, UnsafeCheckpoint) else f"{type(error).__name__}: {text[:160]}"


# ----------------------------------------------------------------------------- code version
# config.json and every checkpoint record the code that wrote them. The files hashed are the code a
# run is made of, the top-level modules and the config files, read from beside this file: never from
# the run folder (out/run by default sits inside the repo, and holds no code).
HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_PATHSPECS = (":(glob)*.py", ":(glob)config/**/*.py")  # the same files, as git names them


def source_files(root):
    top = [name for name in os.listdir(root) if name.endswith(".py")]
    configs = [os.path.relpath(os.path.join(folder, name), root)
               for folder, _, names in os.walk(os.path.join(root, "config")) for name in names if name.endswith(".py")]
    return sorted(name for name in top + configs if os.path.isfile(os.path.join(root, name)))


def source_sha256(root):
    """The sha256 of sha256sum's lines for the source files in sorted order; by hand, in root:
    (ls *.py; find config -name '*.py') | LC_ALL=C sort | xargs sha256sum | sha256sum"""
    lines = "".join(f"{sha256_file(os.path.join(root, name))}  {name}\n" for name in source_files(root))
    return hashlib.sha256(lines.encode()).hexdigest()


def git_state(root):
    """(commit, dirty) when root is the top of a git checkout, else (None, None). Dirty: a source file
    differs from the commit, untracked ones included (a new module the code imports is a change too).
    A copy of the files inside another project's checkout is not that project's commit."""
    # GIT_DIR and its kind, set when this runs under a git hook, would point git at another repository
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        top, commit = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                                     text=True, check=True, env=env, timeout=30).stdout.splitlines()
        if os.path.realpath(top) != os.path.realpath(root):
            return None, None
        # --no-optional-locks: every rank of a job runs this, and status would otherwise take the index's lock
        changed = subprocess.run(["git", "--no-optional-locks", "-C", root, "status", "--porcelain", "--",
                                  *SOURCE_PATHSPECS], capture_output=True, text=True, check=True, env=env,
                                 timeout=30).stdout
    except (OSError, ValueError, subprocess.SubprocessError):  # no git, not a checkout (or no commit yet)
        return None, None
    return commit, bool(changed.strip())


def code_version(root=HERE):
    """{git_commit, git_dirty, source_sha256}: the git ones None outside a git checkout (a copied
    folder, a tarball). The hash is always there: it tells two dirty runs of one commit apart."""
    commit, dirty = git_state(root)
    return {"git_commit": commit, "git_dirty": dirty, "source_sha256": source_sha256(root)}


# ----------------------------------------------------------------------------- checksums
# DCP keeps no checksums, so a flipped byte in a shard would load as a plausible model. Every file
# a checkpoint writes is hashed from the bytes on their way to disk (no second read at save) and
# its sha256 goes into meta.json; readers compare before loading.
class HashingStream:
    def __init__(self, stream, errors):
        self.stream, self.digest, self.errors = stream, hashlib.sha256(), errors

    def write(self, data):
        self.digest.update(data)
        try:
            return self.stream.write(data)
        except OSError as e:
            # torch.save reports a failed write as "unexpected pos 704 vs 598", without the errno:
            # kept here, so a save can tell a full disk, a quota or a file-size limit apart.
            self.errors.append(e)
            raise

    def __getattr__(self, name):  # tell, flush, fileno: the file's own
        return getattr(self.stream, name)


class HashingFileSystem(FileSystem):
    """DCP's file access, keeping {file name: sha256} of what it writes (.metadata under its final
    name: DCP writes it as .metadata.tmp and renames it)."""

    def __init__(self):
        super().__init__()
        self.sha256, self.errors = {}, []

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = HashingStream(stream, self.errors)
            yield hashing
        self.sha256[os.path.basename(path)] = hashing.digest.hexdigest()

    def rename(self, path, new_path):
        super().rename(path, new_path)
        if os.path.basename(path) in self.sha256:
            self.sha256[os.path.basename(new_path)] = self.sha256.pop(os.path.basename(path))


class DamagedCheckpoint(Exception):
    """A complete-looking checkpoint whose bytes are not the ones written: resume falls back."""


# meta.json can't hold its own sha256, so it sits beside it, in sha256sum's format (`sha256sum -c`
# checks it by hand): a flipped digit of the data position or the step would otherwise resume the
# wrong batches, silently. Checkpoints written before it have none, and are read as before.
META_SUM = "meta.json.sha256"


def meta_sum(raw):
    return f"{hashlib.sha256(raw).hexdigest()}  meta.json\n".encode()


# meta.json's keys as the readers use them (resume, load_model, export), each of one JSON type: any
# other meta.json is damage, not a traceback deep in a resume. The optional ones are absent from
# checkpoints written before they existed; only resume reads data_state (a folder made for analysis
# may lack it).
META_TYPES = {"step": int, "world_size": int, "config": dict, "model_config": dict, "data_meta": dict,
              "data_state": dict, "sha256": dict, "data_fingerprint": str, "resume_changes": list,
              "code_version": dict}
OPTIONAL_META = {"data_state", "sha256", "data_fingerprint", "resume_changes", "code_version"}
DATA_STATE = ("epoch", "pos", "n_windows")  # the loader's position (data.TokenLoader.state_dict)


def data_state_problem(state):
    """What makes a loader position (None: absent) one no run wrote, else None: a negative or fractional pos would
    read a short batch (an assertion deep in the step), one past the split would skip data."""
    if state is None:
        return None
    if not all(type(state.get(key)) is int for key in DATA_STATE):
        return f"has data_state {str(state)[:120]}, not whole numbers {', '.join(DATA_STATE)}"
    if not (state["epoch"] >= 0 and 0 <= state["pos"] <= state["n_windows"]):
        return f"has data_state {str(state)[:120]}, not a position in the split (0 <= pos <= n_windows, epoch >= 0)"
    return None


def changes_problem(history):
    """What makes resume_changes other than the [{step, changes: {setting: {was, now}}}] a resume reads, else None."""
    for entry in history:
        if not (type(entry) is dict and type(entry.get("changes")) is dict
                and all(type(c) is dict and "now" in c for c in entry["changes"].values())):
            return f"has resume_changes entry {str(entry)[:80]}, not {{step, changes: {{setting: {{was, now}}}}}}"
    return None


def meta_problem(meta):
    if type(meta) is not dict:
        return f"holds a JSON {type(meta).__name__}, not an object"
    for key, kind in META_TYPES.items():
        if key not in meta and key not in OPTIONAL_META:
            return f"has no {key!r}"
        if key in meta and type(meta[key]) is not kind:
            return f"has {key!r} of type {type(meta[key]).__name__}, not {kind.__name__}"
    if meta["step"] < 0 or meta["world_size"] < 1:
        return f"has step {meta['step']} and world_size {meta['world_size']}"
    outside = [name for name in meta.get("sha256", {}) if not plain_name(name)]
    if outside:
        return f"lists {outside[0]!r} among its files, not a file inside the checkpoint folder"
    return (model_config_problem(meta["model_config"]) or data_state_problem(meta.get("data_state"))
            or changes_problem(meta.get("resume_changes", [])))


def model_config_problem(model_config):
    """Why GPTConfig refuses a recorded model_config (an unknown or missing field, a wrong type or value), or None:
    every reader builds the model from it, and a TypeError there would be a traceback, not damage."""
    if not isinstance(model_config, dict):
        return f"has model_config of type {type(model_config).__name__}, not dict"
    try:
        GPTConfig(**model_config)
    except (TypeError, ValueError) as e:
        return f"has a model_config GPTConfig refuses ({e})"
    return None


def data_position_problem(meta):
    """For a checkpoint without META_SUM: what its data position says against its step, else None. From the
    run's start, `step` full batches of global_batch windows leave the loader (data.TokenLoader) at one
    epoch and window, so an edited position (the batches a resume would read) shows. Unknowable, so
    unchecked, once a resume changed the batch, the sequence length or the data."""
    state, step, batch = meta.get("data_state"), meta["step"], meta["config"].get("global_batch")
    changed = {k for entry in meta.get("resume_changes", []) for k in entry["changes"]}
    if not state or type(batch) is not int or batch < 1 or changed & {"global_batch", "seq_len", "data"}:
        return None
    per_epoch = state["n_windows"] // batch
    if per_epoch < 1:
        return None
    epoch, pos = ((step - 1) // per_epoch, ((step - 1) % per_epoch + 1) * batch) if step else (0, 0)
    if (state["epoch"], state["pos"]) == (epoch, pos):
        return None
    return (f"meta.json puts the data at epoch {state['epoch']}, window {state['pos']}, where {step} steps of "
            f"{batch} windows end at epoch {epoch}, window {pos}: edited after it was written")


def read_meta(path):
    """A checkpoint folder's meta.json, read once and checked (against META_SUM where it has one, then
    its keys); DamagedCheckpoint says what is wrong."""
    try:
        with os.fdopen(open_in_checkpoint(os.path.join(path, "meta.json")), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DamagedCheckpoint("no meta.json") from None
    try:
        meta = parse_json(raw)
    except ValueError as e:  # not JSON, not UTF-8, or nested past the decoder's recursion
        raise DamagedCheckpoint(f"meta.json is not valid JSON ({e})") from None
    try:
        with os.fdopen(open_in_checkpoint(os.path.join(path, META_SUM)), "rb") as f:
            recorded = f.read()
    except FileNotFoundError:
        recorded = None  # written before meta.json had a sha256
    if recorded is not None and recorded != meta_sum(raw):
        raise DamagedCheckpoint(f"meta.json does not match its sha256 in {META_SUM} (its bytes changed after it "
                                f"was written)")
    problem = meta_problem(meta)
    if problem:
        raise DamagedCheckpoint(f"meta.json {problem}")
    return meta


def checksum_problem(path, meta, rank=0, world=1):
    """None if this rank's share of the folder's files (every world-th, from rank) match the sha256s
    in meta.json, else the first that does not. Checkpoints from before checksums pass unchecked."""
    names = sorted(meta.get("sha256", {}))
    for name in names[rank::world]:
        try:
            with os.fdopen(open_in_checkpoint(os.path.join(path, name)), "rb") as f:
                digest = sha256_of(f)
        except FileNotFoundError:
            return f"{name} is missing"
        except DamagedCheckpoint as e:
            return str(e)
        if digest != meta["sha256"][name]:
            return f"{name} does not match its sha256 in meta.json (its bytes changed after it was written)"
    return None


# ----------------------------------------------------------------------------- the run folder
# Settings that may change between a checkpoint and its resumption: how the same model is run.
RUNTIME_MODEL_FIELDS = {"attn_backend", "activation_checkpointing", "moe_impl"}


def open_in_checkpoint(file):
    """fileio.open_nofollow of a checkpoint's file, to read: a symlink (it would be read from outside),
    a FIFO (it would block the read forever) or anything else but a plain file is damage, in one line."""
    try:
        return open_nofollow(file, os.O_RDONLY)
    except NotOwnFile as e:
        raise DamagedCheckpoint(f"{os.path.basename(file)} is {e.strerror} (a checkpoint's files are plain files "
                                f"in its folder)") from None


def file_problem(path, name, listed, size=0):
    """What keeps a checkpoint from reading its file name (at least size bytes long), else None. listed:
    the names meta.json has sha256s of (None before checksums): any other file would be read unchecked."""
    if listed is not None and name not in listed:
        return f"{name} is not among the files meta.json has sha256s of (a crafted .metadata?)"
    try:
        fd = open_in_checkpoint(os.path.join(path, name))
    except FileNotFoundError:
        return f"{name} is missing"
    except DamagedCheckpoint as e:
        return str(e)
    except OSError as e:
        return f"{name} is unreadable ({e.strerror})"
    found = os.fstat(fd).st_size
    os.close(fd)
    if found < size:
        return f"{name} is truncated ({found} of {size} bytes)"
    return None


def checkpoint_problem(path):
    """None if the checkpoint folder is complete, else what is wrong with it. Complete means
    meta.json matches its sha256 and has the keys readers use, DCP's .metadata parses and names
    only files inside the folder that meta.json has sha256s of, every byte range it names is on
    disk, and each rank that saved left its rng file: a folder pruned or copied halfway fails one
    of these. A file of it that is a symlink (read from outside) or a FIFO is refused unread."""
    try:
        meta = read_meta(path)
        index = CheckpointReader(path).read_metadata()
    except DamagedCheckpoint as e:
        return str(e)
    except FileNotFoundError:
        return "no .metadata (DCP's index)"
    except UnsafeCheckpoint as e:
        return str(e)
    except Exception as e:  # a truncated or foreign pickle: any unpickling error
        return f".metadata is unreadable ({type(e).__name__})"
    needed = {".metadata": 0}
    for item in index.storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    listed = meta.get("sha256")
    # lazily: a crafted world_size of 10**12 ends at the first rng file missing
    files = itertools.chain(sorted(needed.items()), ((f"rng_rank{r}.pt", 0) for r in range(meta["world_size"])),
                            ((name, 0) for name in sorted(listed or ())))
    for name, size in files:
        problem = file_problem(path, name, listed, size)
        if problem:
            return problem
    return None


def scan_checkpoints(run_dir):
    """(complete, damaged): a run's complete ckpt_* folders oldest first, and [(path, problem)]
    for the others. A run killed while saving leaves a tmp_ folder and one killed while pruning
    a deleting_ folder, never a ckpt_ one; damage after that (a disk error, a partial copy) is
    caught by checkpoint_problem. A ckpt_ symlink is never read: a run folder may come from
    someone else (tar, rsync), and its link could point anywhere."""
    complete, damaged = [], []
    for path in sorted(glob.glob(os.path.join(run_dir, "ckpt_*"))):
        problem = "a symlink: not followed (a run's checkpoints are in its folder)" if os.path.islink(path) else \
            checkpoint_problem(path)
        if problem:
            damaged.append((path, problem))
        else:
            complete.append(path)
    return complete, damaged


def complete_checkpoints(run_dir):
    return scan_checkpoints(run_dir)[0]


def remove_tree(path):
    """rmtree, except that a symlink is removed itself: its target is not the run's to delete."""
    if os.path.islink(path):
        os.unlink(path)
    else:
        shutil.rmtree(path)


# Readers and the pruner. eval, export and the HF export read checkpoints of a run that may still be
# training, and with keep_last the training deletes old ones, maybe one being read (a model loads
# for seconds; a run may save every step). A reader holds a shared flock on the checkpoint's
# meta.json while it reads; the pruner takes it exclusively without waiting and, when a reader
# holds it, keeps the checkpoint for a later save's prune (keep_last is exceeded meanwhile, never
# the training slowed). The alternatives were worse: a pruner that waits stalls training on a
# reader, and a reader that retries on failure cannot tell a pruned file from a damaged one.
# A reader that comes too late (the pruner holds the lock, or has already renamed the folder to
# deleting_) sees the checkpoint gone, never half-deleted: see held_whole.

def meta_fd(path):
    """A read-only descriptor of path/meta.json (the lock's file), or None: no meta.json (damage the
    checks name), a symlink. O_NONBLOCK: a FIFO in its place must not hang the open."""
    try:
        return os.open(os.path.join(path, "meta.json"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None


@contextmanager
def held_whole(path):
    """Hold checkpoint folder `path` whole for the block (its reader's lock, above). Yields False when it
    was pruned before the lock was taken: the folder is gone (renamed by the pruner), or its meta.json
    is locked for deletion or no longer the file opened. A damaged folder still yields True: its
    checks then say what is wrong with it."""
    fd = meta_fd(path)
    if fd is None:
        yield os.path.lexists(path)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # the pruner holds it: being deleted now
            yield False
            return
        try:
            now = os.stat(os.path.join(path, "meta.json"), follow_symlinks=False)
        except OSError:
            now = None
        yield now is not None and (now.st_dev, now.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
    finally:
        os.close(fd)


def pruned_error(path):
    """The one line for a checkpoint named by its path that its training pruned before it could be read."""
    run = os.path.dirname(os.path.abspath(path))
    newest = complete_checkpoints(run)
    return ValueError(f"{path} was pruned by its training (keep_last) before it could be read, not damaged: pass "
                      f"{'a newer one (the newest is ' + os.path.basename(newest[-1]) + ')' if newest else 'another'}"
                      f", or the run folder {run} to read its newest")


def prune_checkpoint(path, unless_read=True):
    """Delete a checkpoint so that a kill at any moment leaves no half-deleted ckpt_ folder: renamed
    out of the ckpt_* namespace first (atomic), then removed; train.py clears leftover deleting_
    folders at start. unless_read: kept (False returned) while a reader holds it (held_whole)."""
    fd = meta_fd(path) if unless_read else None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
        trash = os.path.join(os.path.dirname(path), "deleting_" + os.path.basename(path))
        os.rename(path, trash)
        remove_tree(trash)
        return True
    finally:
        if fd is not None:
            os.close(fd)


def clear_leftovers(run_dir):
    """tmp_ckpt_* (killed while saving) and deleting_ckpt_* (killed while pruning). Only ever
    called under the run folder's lock: another run's tmp_ folder is its checkpoint in progress."""
    for stale in glob.glob(os.path.join(run_dir, "tmp_ckpt_*")) + glob.glob(os.path.join(run_dir, "deleting_ckpt_*")):
        remove_tree(stale)


def lock_run_dir(run_dir):
    """An exclusive OS lock on run_dir/train.lock, held until the returned fd is closed, and released
    by the kernel when the process dies (no stale lock after a crash or SIGKILL). The file says who
    holds it, for the error a second launch gets."""
    path = os.path.join(run_dir, "train.lock")
    fd = open_in_run_dir(path, os.O_RDWR | os.O_CREAT)
    holder = lock_holder(fd, path, "train.py")
    if holder:
        raise RunDirError(f"{run_dir} is in use by {holder}: wait for that run to end (or stop it), "
                          f"or choose another out_dir")
    return fd


def all_finite(net, opt):
    """True on every rank iff every parameter and optimizer-state tensor is finite: one fused
    max-abs per tensor list (local shards), one all-reduce. A NaN written by an update whose loss
    and gradient were finite (e.g. 0/0 in Adam) would otherwise be checkpointed as good."""
    local = [t.to_local() if isinstance(t, DTensor) else t
             for t in [*net.parameters(), *(v for st in opt.state.values() for v in st.values())]
             if torch.is_tensor(t) and t.is_floating_point()]
    local = [t.detach() for t in local if t.numel()]
    bad = torch.zeros((), device=next(net.parameters()).device)
    if local:
        bad = (~torch.stack(torch._foreach_norm(local, ord=float("inf"))).isfinite()).any().float()
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bad.item()


def check_resumable(path, mcfg):
    saved = read_json(os.path.join(path, "meta.json"))["model_config"]
    # A field added to GPTConfig after the checkpoint was written (e.g. norm) counts as its
    # default there: the code that wrote it had no other behaviour.
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    saved = {**{k: v for k, v in defaults.items() if k not in saved}, **saved}
    changed = [f"{k} {saved.get(k)!r} there, {v!r} now" for k, v in asdict(mcfg).items()
               if k not in RUNTIME_MODEL_FIELDS and saved.get(k) != v]
    if changed:
        raise ValueError(f"{path} holds a different model ({'; '.join(changed)}): resume with its settings "
                         f"or choose another out_dir")


def recorded_settings(saved_meta):
    """The experiment's settings as they stand at a checkpoint: the first run's, then each change
    allowed at a resume (allow_resume_changes), in order."""
    now = dict(saved_meta["config"])
    for resume in saved_meta.get("resume_changes", []):
        now.update({k: v["now"] for k, v in resume["changes"].items() if k != "data"})
    return now


def experiment_changes(saved_meta, cfg, data_fp, experiment):
    """{setting: {"was", "now"}} of the settings in experiment ({name: default}, train.EXPERIMENT's) and the
    data, between a checkpoint and this run. A setting the checkpoint's run predates counts as its default:
    the code before the setting existed did what its default does. Data is compared by content
    (data.data_fingerprint), so a refilled folder of the same size is caught; checkpoints
    written before fingerprints existed are compared on settings only."""
    was, now = recorded_settings(saved_meta), json.loads(json.dumps(cfg))  # as saved: tuples are lists
    was = {k: was.get(k, v) for k, v in json.loads(json.dumps(experiment)).items()}
    changes = {k: {"was": was[k], "now": now[k]} for k in experiment if was[k] != now[k]}
    if saved_meta.get("data_fingerprint") not in (None, data_fp):
        changes["data"] = {"was": saved_meta["data_fingerprint"][:12], "now": data_fp[:12]}
    return changes


def settings_to_record(saved_meta, cfg, step, changes, experiment):
    """(config, resume_changes) for the checkpoints and config.json of a run resumed from a
    checkpoint with meta saved_meta (None: a fresh run). The experiment's settings stay the first
    run's and every change allowed at a resume is listed with its step: a checkpoint never says
    γ=0.5 for a model initialised at γ=1. The other settings (paths, intervals) are this run's."""
    if saved_meta is None:
        return cfg, []
    first = {k: saved_meta["config"][k] for k in experiment if k in saved_meta["config"]}
    history = saved_meta.get("resume_changes", []) + ([{"step": step, "changes": changes}] if changes else [])
    return {**cfg, **first}, history


def describe_changes(changes):
    return "; ".join(f"{k} {v['was']!r} there, {v['now']!r} now" for k, v in changes.items())


def make_run_dir(out):
    """os.makedirs of the run folder, a file in its place (or in its path) refused in one line: makedirs says only
    "File exists"."""
    try:
        os.makedirs(out, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise RunDirError(f"out_dir={out} is a file, or lies under one, not a folder: choose another out_dir "
                          f"(nothing was changed)") from None


def open_run_dir(out, resume, rank, log, held):
    """The run folder's complete checkpoints, oldest first, with its lock held until the ExitStack `held` closes
    (the run's end: a notebook may call train.main again on the folder) or the process dies. Rank 0 takes the
    lock, clears what killed runs left and lists the checkpoints, then tells the others: on a
    shared filesystem another node's stale directory cache could otherwise pick a different
    checkpoint (or none) and hang the job. Multi-node: out must be on a filesystem every node sees."""
    found = [None, [], []]
    if rank == 0:
        try:
            make_run_dir(out)
            held.callback(os.close, lock_run_dir(out))
            clear_leftovers(out)
            found = [None, *scan_checkpoints(out)]
        except RunDirError as e:
            found = [str(e), [], []]
    dist.broadcast_object_list(found, src=0)
    problem, done, damaged = found
    if problem:
        raise RunDirError(problem)
    if (done or damaged) and not resume:
        newest = os.path.basename((done or [p for p, _ in damaged])[-1])
        raise RunDirError(f"{out} already holds checkpoints ({newest}); pass --resume=True or choose another out_dir")
    if damaged and not done:  # starting over would truncate metrics.jsonl and bury the run's history
        raise RunDirError(f"every checkpoint in {out} is damaged ({os.path.basename(damaged[-1][0])}: "
                          f"{damaged[-1][1]}); nothing was changed: move them away to start over, or choose "
                          f"another out_dir")
    for path, why in damaged:
        log(f"{path} is damaged ({why}): not used")
    return done


def resume_run(cfg, experiment, done, net, opt, loader, mcfg, data_fp, log):
    """(step, resumed checkpoint or None, changes, meta): the newest of `done` that loads on every
    rank (newest_intact), falling back to the one before; the changes of experiment's settings
    (train.EXPERIMENT) allowed at this resume; and the meta every checkpoint of this run records
    (settings_to_record, code_version)."""

    def agreed(why):  # every rank's verdict, so that all load, fall back or stop together
        ok = torch.tensor(why is None, device=next(net.parameters()).device, dtype=torch.float32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return ok.item()

    def try_resume(path, meta, why):
        if why is None and not os.path.lexists(os.path.join(path, META_SUM)):
            log(f"{path} has no {META_SUM} (deleted, or written before checkpoints had one): its meta.json is "
                f"checked only against its step")
            why = data_position_problem(meta)
        if not agreed(why):
            why = why or "another rank could not read its meta.json"
        else:
            check_resumable(path, mcfg)
            changes = experiment_changes(meta, cfg, data_fp, experiment)
            if changes and not cfg["allow_resume_changes"]:
                raise RunDirError(f"{cfg['out_dir']} was trained with other settings ({describe_changes(changes)}): "
                                  f"resume with the run's settings, choose another out_dir, or pass "
                                  f"--allow_resume_changes=True (the changes are recorded in metrics.jsonl)")
            try:
                load_checkpoint(path, meta, net, opt, loader, cfg["weight_decay"], cfg["verify_checkpoints"])
            except ValueError:
                raise  # the data no longer fits the checkpoint: the user's to fix, not damage
            except (Exception, CheckpointException) as e:  # unreadable bytes: DCP raises a BaseException
                why = load_error(e)
            if not agreed(why):
                why = why or "another rank could not load it"
            elif not all_finite(net, opt):
                why = "its parameters or optimizer state are not finite"
        if why is not None:
            log(f"{path} could not be resumed ({why}): falling back to the previous checkpoint")
        return why

    resumed, meta, _ = newest_intact(done, try_resume)
    if done and resumed is None:
        raise RunDirError(f"no checkpoint in {cfg['out_dir']} could be resumed (see above): move them away to start "
                          f"over, or choose another out_dir")
    step, changes = (meta["step"], experiment_changes(meta, cfg, data_fp, experiment)) if resumed else (0, {})
    if resumed:
        log(f"resumed from {resumed} at step {step}")
        if meta["world_size"] != dist.get_world_size():
            log(f"world size {meta['world_size']} -> {dist.get_world_size()}: DCP resharded model and optimizer; "
                f"the data order is unchanged (global batches), per-rank RNG streams restart from seed, and "
                f"float reductions run in a different order")
        if changes:
            log(f"resuming with changed settings (allow_resume_changes): {describe_changes(changes)}")
    recorded, history = settings_to_record(meta, cfg, step, changes, experiment)
    return step, resumed, changes, {"config": recorded, "resume_changes": history, "model_config": asdict(mcfg),
                                    "data_meta": loader.meta, "data_fingerprint": data_fp,
                                    "code_version": code_version()}


def diverged_hint(last_good):
    """What to do after a non-finite loss or state: resume from the last good checkpoint with
    settings that a resume counts as a change of experiment."""
    if not last_good:
        return ("No checkpoint of this run was saved yet: rerun with a lower lr, longer warmup or tighter "
                "grad_clip (and a new out_dir or --resume=False)")
    return (f"Last good checkpoint: {last_good} (intact). Resume from it with a lower lr, longer warmup or tighter "
            f"grad_clip, adding --allow_resume_changes=True (they are settings of the experiment)")


def resume_command(cfg):
    return "the same command" if cfg["resume"] else "the same command with --resume=True"


def interrupted_line(cfg, step):
    """Ctrl-C's one line: the step the run reached and where a rerun of the same command resumes."""
    where = "before the first step" if step is None else f"at step {step}/{cfg['max_steps']}"
    done = complete_checkpoints(cfg["out_dir"]) if os.path.isdir(cfg["out_dir"]) else []
    if not done:
        return f"interrupted {where}; no checkpoint was saved yet: the same command starts over"
    return f"interrupted {where}; {resume_command(cfg)} resumes from {done[-1]}"


def save_checkpoint(cfg, step, net, opt, loader, meta, last_good):
    """Write ckpt_{step} (as tmp_, renamed when whole) and prune old ones. Refuses to save
    non-finite weights or optimizer state; a full disk is one line, the partial folder removed."""
    if not all_finite(net, opt):
        raise FloatingPointError(f"step {step}: parameters or optimizer state are not finite (NaN/Inf); not saved. "
                                 f"{diverged_hint(last_good)}")
    rank = dist.get_rank()
    name = f"ckpt_{step:08d}"
    tmp, final = os.path.join(cfg["out_dir"], "tmp_" + name), os.path.join(cfg["out_dir"], name)
    fresh_optimizer = not opt.state  # the init checkpoint: no update has run yet
    writer = dcp.FileSystemWriter(tmp)
    writer.fs = HashingFileSystem()
    try:
        model_sd, optim_sd = get_state_dict(net, opt)
        if fresh_optimizer:
            # get_state_dict materialises the optimizer's state by a zero-gradient step, which counts as
            # step 1: left in place, saving the init would shift every later bias correction.
            opt.clear_state()
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)
        # RNG streams differ per rank, so they can't be DCP entries (which are deduplicated).
        rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
        rng_file = os.path.join(tmp, f"rng_rank{rank}.pt")
        with atomic_open(rng_file) as f:
            torch.save(rng, f)
        sha256 = {**writer.fs.sha256, os.path.basename(rng_file): sha256_file(rng_file)}  # a few kB: read back
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, sha256)  # also the barrier: every rank's files are on disk
        if rank == 0:
            meta_file = os.path.join(tmp, "meta.json")
            write_json(meta_file, {
                **meta, "step": step, "world_size": dist.get_world_size(), "data_state": loader.state_dict(),
                "sha256": dict(sorted(kv for files in every_rank for kv in files.items()))})
            with open(meta_file, "rb") as f:
                atomic_write_bytes(os.path.join(tmp, META_SUM), [meta_sum(f.read())])
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        hit = write_limit([e, *writer.fs.errors], cfg["out_dir"], local_state_bytes(net, opt))
        if hit is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        what, fix = WRITE_LIMITS[hit]
        raise OSError(hit, f"{what} while saving {tmp} ({limit_detail(hit, cfg['out_dir'])}): not saved, its partial "
                      f"folder removed; {last_good or 'no earlier checkpoint'} is intact. {fix} and resume") from None
    except KeyboardInterrupt:  # Ctrl-C mid-save: no half-written folder left for the next start to clear
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        if os.path.lexists(final):  # a damaged one that resume fell back from (or a link): replaced
            prune_checkpoint(final, unless_read=False)
        os.rename(tmp, final)
        # keep_last counts complete checkpoints (each .metadata read, ms apiece), so a damaged
        # newer folder never displaces a good older one
        done = complete_checkpoints(cfg["out_dir"])
        for old in done[:-cfg["keep_last"]]:
            old_step = int(os.path.basename(old)[5:])
            if not (cfg["keep_every"] and old_step % cfg["keep_every"] == 0) and old_step not in cfg["keep_steps"]:
                prune_checkpoint(old)
    dist.barrier()
    return final


def local_state_bytes(net, opt):
    """Bytes of this rank's parameters and optimizer state: about what its checkpoint shard needs."""
    tensors = [*net.parameters(), *(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))]
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def write_limit(errors, folder, need_bytes):
    """The WRITE_LIMITS errno a failed save ran into, else None. An OSError with one of them
    anywhere in the errors given, their chains or DCP's per-rank failures decides (or the errno in the
    text of a Rust library's error: safetensors, tokenizers); torch.save's writer can lose the errno
    ("unexpected pos 704 vs 598"), so a file-size limit or free space below what one checkpoint
    needs counts too."""
    seen, todo = set(), list(errors)
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError):
            code = error.errno
        else:  # a Rust library's io::Error keeps the errno in its text only
            found = re.search(r"\(os error (\d+)\)", str(error))
            code = found and int(found.group(1))
        if code in WRITE_LIMITS:
            return code
        todo += [error.__cause__, error.__context__]
        for failure in getattr(error, "failures", {}).values():  # DCP's CheckpointException
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY and soft < need_bytes:
        return errno.EFBIG
    if shutil.disk_usage(folder).free < need_bytes:
        return errno.ENOSPC
    return None


def export_write_error(error, out, need_bytes):
    """The one-line error for an export's failed write of out (a file or folder): a write limit
    (write_limit_error) or a folder it may not write in, else None."""
    limit = write_limit_error(error, out, need_bytes)
    if limit is None and getattr(error, "errno", None) in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ValueError(f"export: cannot write {out} ({error.strerror}): choose a folder you may write in")
    return limit


def write_limit_error(error, path, need_bytes):
    """The one-line OSError for a write of path (a file or folder) that failed on a write limit (write_limit, need_bytes
    about what it writes), else None: write_error_line says what was hit and what to do."""
    hit = write_limit([error], os.path.dirname(os.path.abspath(path)), need_bytes)
    return None if hit is None else OSError(hit, WRITE_LIMITS[hit][0], path)


def write_error_line(e):
    """The one line an OSError gets: a write limit names what was hit and the file, the rest as the OS says it."""
    if e.errno in WRITE_LIMITS and e.filename:
        what, fix = WRITE_LIMITS[e.errno]
        return f"{what} writing {e.filename}: {fix[0].lower() + fix[1:]} and rerun (files written before are intact)"
    return e.strerror if e.strerror and not e.filename else str(e)


def limit_detail(hit, folder):
    if hit == errno.EFBIG:
        return f"the limit is {resource.getrlimit(resource.RLIMIT_FSIZE)[0]:,} bytes"
    return f"{shutil.disk_usage(folder).free:,} bytes free"


def load_checkpoint(path, meta, net, opt, loader, cfg_weight_decay, verify=True):
    """Load ckpt folder `path` (its meta.json already read as `meta`) into net, opt and loader.
    Each rank first checks its share of the files' sha256s; the verdict is agreed before DCP's
    collective load, which a rank that stopped alone would leave the others waiting in."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problem = checksum_problem(path, meta, rank, world) if verify else None
    ok = torch.tensor(problem is None, dtype=torch.float32, device=next(net.parameters()).device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        raise DamagedCheckpoint(problem or "a file checked by another rank does not match its sha256")
    model_sd, optim_sd = get_state_dict(net, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp_load(state, path)  # DCP reshards when the world size changed
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if meta["step"] == 0:
        opt.clear_state()  # the init checkpoint's optimizer is fresh (see save_checkpoint)
    for group in opt.param_groups:  # the config's weight decay wins over the checkpoint's (sweeps)
        group["weight_decay"] = cfg_weight_decay[group["name"]]
    try:
        loader.load_state_dict(meta["data_state"])
    except ValueError as e:
        raise ValueError(f"resume from {path}: {e}") from None
    rng_file = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    if meta["world_size"] == dist.get_world_size():
        with os.fdopen(open_in_checkpoint(rng_file), "rb") as f:
            rng = torch.load(f, weights_only=True)  # tensors only: a crafted pickle can't run code
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


CKPT_FIX = "pass a .pt export, a complete checkpoint folder or a run folder written by train.py"


def find_checkpoints(path):
    """Checkpoint paths in a run folder (complete ckpt_* folders, step order), or [path] for a
    complete checkpoint folder or a file. Anything else is a one-line error saying what it is."""
    kind = path_kind(path)
    if kind is None:
        raise FileNotFoundError(f"{path}: no such checkpoint file or folder; {CKPT_FIX}")
    if kind == "a file":
        return [path]
    if kind != "a folder":
        raise ValueError(f"{path} is {kind}, not a checkpoint: {CKPT_FIX}")
    if glob.glob(os.path.join(path, "*_000000.bin")):  # prepare_data.py's first shard of a split
        raise ValueError(f"{path} is a data folder (prepare_data.py output), not a checkpoint: {CKPT_FIX}")
    if os.path.exists(os.path.join(path, "meta.json")) or os.path.exists(os.path.join(path, ".metadata")):
        problem = checkpoint_problem(path)
        if problem and not os.path.lexists(path):  # renamed away while checked: the pruner's, not damage
            raise pruned_error(path)
        if problem:
            others = complete_checkpoints(os.path.dirname(os.path.abspath(path)))
            hint = f"complete ones beside it: {', '.join(os.path.basename(o) for o in others)}" if others else \
                "pass another checkpoint"
            raise ValueError(f"{path}: damaged or half-written checkpoint ({problem}); {hint}")
        return [path]
    found, damaged = scan_checkpoints(path)
    if not found:
        what = f"only damaged checkpoints ({damaged[-1][0]}: {damaged[-1][1]})" if damaged else "no ckpt_* folders"
        raise ValueError(f"{path}: {what}; {CKPT_FIX}")
    return found


def newest_intact(paths, check):
    """The one chooser of the checkpoint to use (resume, load_model, export): (path, its meta.json,
    passed) for the newest of paths (oldest first) whose meta.json reads whole (read_meta) and that
    check passes, with passed the [(path, why)] of the newer ones passed over; path and meta are None
    when none does. check(path, meta, why) gets meta None and why when meta.json did not read; it
    returns why not to use the checkpoint, or None. It is called on each candidate in turn (on every
    rank at a resume, where it loads the checkpoint: collectives stay in step)."""
    passed = []
    for path in reversed(paths):
        try:
            meta, why = read_meta(path), None
        except DamagedCheckpoint as e:
            meta, why = None, str(e)
        why = check(path, meta, why)
        if why is None:
            return path, meta, passed
        passed.append((path, why))
    return None, None, passed


def sums_check(verify):
    """newest_intact's check for the readers: every file matches its sha256 (not checked when verify
    is False: that is a full read of the checkpoint)."""
    return lambda path, meta, why: why or (checksum_problem(path, meta) if verify else None)


class Pruned(Exception):
    """The checkpoint being opened was pruned by its training (newest_in_run)."""


def newest_in_run(run_dir, verify, held=None):
    """(path, its meta.json) of a run folder's newest intact checkpoint (newest_intact, sums_check);
    says on stderr which newer ones were passed over and why. held (an ExitStack): each candidate is
    held whole in it (held_whole) before it is checked, and (None, None) means that one was pruned
    meanwhile (the training saved newer ones): ask again, for the newest now."""
    found, damaged = scan_checkpoints(run_dir)

    def check(path, meta, why):
        if held is not None and not held.enter_context(held_whole(path)):
            raise Pruned
        return sums_check(verify)(path, meta, why)

    try:
        path, meta, passed = newest_intact(found, check)
    except Pruned:
        return None, None
    problems = dict(damaged + passed)
    if path is None:
        if not problems:
            raise ValueError(f"{run_dir}: no ckpt_* folders; pass a .pt export or another run folder")
        newest = max(problems, key=os.path.basename)
        raise ValueError(f"{run_dir}: every checkpoint is damaged (the newest, {os.path.basename(newest)}: "
                         f"{problems[newest]}); pass a .pt export or another run folder")
    skipped = sorted(p for p in problems if os.path.basename(p) > os.path.basename(path))
    if skipped:
        print(f"{run_dir}: using {os.path.basename(path)}; newer but damaged: "
              + "; ".join(f"{os.path.basename(p)} ({problems[p]})" for p in skipped), file=sys.stderr)
    return path, meta


# What an allocator's failure says it asked for: torch's CPU allocator "can't allocate memory: you tried to allocate
# 400000000000000 bytes", CUDA's OutOfMemoryError "Tried to allocate 20.00 GiB".
ALLOCATION_FAILURE = re.compile(r"tried to allocate ([\d.]+ ?\w+)", re.IGNORECASE)


@contextmanager
def allocating(what, fix):
    """A model's memory allocated in the block: the allocator's failure (a RuntimeError, a traceback deep in
    to_empty) becomes one line saying that what asked for more memory than there is, how much, and the fix."""
    try:
        yield
    except RuntimeError as e:
        asked = ALLOCATION_FAILURE.search(str(e))
        if asked is None:
            raise
        raise ValueError(f"{what} asks for more memory than there is (the allocator could not get "
                         f"{asked.group(1)}): {fix}") from None


def load_model(path, device="cpu", attn_backend=None, verify=True):
    """The one model-loading path (export and every analysis): (GPT in eval mode, info) where info holds
    the checkpoint's model_config, config, step and data_meta. A run folder gives its newest intact
    checkpoint. verify=False skips the sha256 check of the checkpoint's files (a full read of them).
    A checkpoint folder is held whole while it is read (held_whole): a training beside it prunes it
    only after. A run folder's newest pruned before it was held (the training saved twice meanwhile)
    is passed over for the newest then, said in one line; a checkpoint named so is a one-line error."""
    found = find_checkpoints(path)
    if os.path.isfile(path):
        return load_weights(path, None, device, attn_backend)
    run_dir = path if found != [path] else None
    while True:
        with contextlib.ExitStack() as held:
            if run_dir:
                path, info = newest_in_run(run_dir, verify, held)
            elif not held.enter_context(held_whole(path)):
                raise pruned_error(path)
            else:
                # meta.json read once: the settings returned are then those whose sha256s were checked,
                # even if the file is replaced meanwhile.
                _, info, passed = newest_intact([path], sums_check(verify))
                if info is None:
                    raise ValueError(f"{path}: damaged checkpoint ({passed[0][1]}); pass another checkpoint")
            if path is not None:
                return load_weights(path, info, device, attn_backend)
        print(f"{run_dir}: its newest checkpoint was pruned by its training as it was opened; reading the "
              f"newest again", file=sys.stderr)


def load_weights(path, info, device, attn_backend):
    """load_model's model from a checkpoint folder whose meta.json (info) has been read, or a .pt export."""
    if info is None:
        blob = read_export(path)
        info = {k: v for k, v in blob.items() if k != "model"}
    # Built on the meta device: the random init of GPT(cfg) would be overwritten anyway, and at
    # 1.5B it costs a minute and a full extra copy of the weights in host memory.
    with torch.device("meta"):
        net = GPT(GPTConfig(**info["model_config"]))
    with allocating(f"{path}: its model_config", "pass another checkpoint, or load it where that memory is"):
        net.to_empty(device=device)  # GPT.to_empty keeps tied embeddings tied
    net.reset_buffers()  # non-persistent buffers are not in the checkpoint
    if os.path.isfile(path):
        net.load_state_dict(blob["model"])
    else:
        # DCP fills the given tensors in place and reads only the keys asked for ("model.*",
        # not the optimizer); in a single process it needs no process group, and says so in a
        # warning that would only confuse here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            try:
                dcp_load({"model": net.state_dict()}, path)
            # bytes damaged in place: the sizes were right, the contents not
            except (Exception, CheckpointException) as e:
                raise ValueError(f"{path}: its weights could not be read ({load_error(e)}); the checkpoint is "
                                 f"damaged: pass another one") from None
    if attn_backend or net.cfg.attn_backend == "varlen" or \
            (net.cfg.attn_backend == "flex" and not str(device).startswith("cuda")):
        # Flex kernels are CUDA-only here, varlen's also bf16/fp16-only (the model loads in fp32);
        # sdpa shares their mask definition (model.py).
        net.set_attn_backend(attn_backend or "sdpa")
    info["path"] = path
    return net.eval(), info


def read_export(path, device="cpu", follow=True):
    """The dict a .pt export holds (export's payload), its tensors on device ("meta": the weights are not read);
    a ValueError says why path is not one. follow=False refuses a symlink (NotOwnFile), as open_regular."""
    with os.fdopen(open_regular(path, follow=follow), "rb") as f:
        if not zipfile.is_zipfile(f):  # torch.save writes a zip archive; its error would only say "weights only"
            raise ValueError(f"{path}: not a torch file (no zip archive in it: random bytes or a truncated copy); "
                             "pass a .pt made by `python train.py export`, or a checkpoint folder")
        f.seek(0)
        try:
            blob = torch.load(f, map_location=device, weights_only=True)
        except Exception as e:  # a damaged zip, a pickle with code in it
            raise ValueError(f"{path}: not a readable torch file ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                             "pass a .pt made by `python train.py export`, or a checkpoint folder") from None
    if not isinstance(blob, dict) or "model" not in blob or "model_config" not in blob:
        raise ValueError(f"{path}: not a smallinit export (needs 'model' and 'model_config'); "
                         "make one with `python train.py export <ckpt_dir> <file.pt>`")
    problem = model_config_problem(blob["model_config"])
    if problem:
        raise ValueError(f"{path}: {problem}; pass a .pt made by `python train.py export`, or a checkpoint folder")
    return blob


def check_export_parent(out, make=False):
    """Raise unless out's folder exists or can be made (fileio.check_outputs: no file, link to nothing or loop
    on the way). make=True makes the missing folders (as transformers' save_pretrained does), right before the
    export is written, so that a refused export leaves no new folders behind."""
    parent = os.path.dirname(out) or "."  # as given: check_outputs reads its ".." as the kernel will
    try:
        check_outputs([(parent, "folder")], "choose another path")
    except ValueError as e:
        raise ValueError(f"export: {e}") from None
    if make:
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:  # no permission, a read-only file system, no space
            raise ValueError(f"export: cannot make the folder {parent} ({e.strerror}): choose another "
                             f"path") from None


def check_export_target(out_file):
    """Raise unless export may write out_file: in a folder that exists or can be made (check_export_parent), and
    absent or an earlier export (read_export on the meta device: its weights are not read). A data folder's or a
    checkpoint's meta.json, a device, a folder or a link there is someone else's, and the rename that puts an
    export in place would destroy it."""
    if not out_file or out_file.endswith(os.sep):
        what = "is empty" if not out_file else f"ends in {os.sep!r}"
        raise ValueError(f"export: OUT {what}: name the .pt file to write, e.g. {out_file}model.pt")
    check_export_parent(out_file)
    try:
        mode = os.lstat(out_file).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        what = file_kind(mode)
    else:
        try:
            read_export(out_file, "meta", follow=False)
            return
        except (ValueError, OSError):  # not an export, or no longer a plain file since the lstat
            what = "a file that is not a .pt export"
    raise ValueError(f"{out_file} exists and is not an earlier export ({what}): choose another path or remove it "
                     f"yourself")


def export(ckpt_dir, out_file):
    """DCP folder -> one torch.save file with the full fp32 model; no process group needed. A run
    folder gives its newest intact checkpoint (load_model's chooser, as eval and the HF export).
    Only an earlier export at out_file is replaced (check_export_target); a write limit is one line."""
    check_export_target(out_file)  # before the work, not only before the rename
    if not os.path.isdir(ckpt_dir):
        raise ValueError(f"export: {ckpt_dir} is not a complete checkpoint folder nor a run folder; pass an "
                         f"out_dir/ckpt_XXXXXXXX folder or its run folder")
    net, info = load_model(ckpt_dir)  # the one loading path: one process reads every shard
    payload = {"model": net.state_dict(), **{k: info[k] for k in ("model_config", "config", "step", "data_meta",
                                                                 "code_version") if k in info}}
    need = sum(t.nbytes for t in payload["model"].values())
    check_export_parent(out_file, make=True)
    try:
        with atomic_open(out_file) as f:
            torch.save(payload, f)
            check_export_target(out_file)  # again: something may have appeared there while the model was read
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as "unexpected pos", the OSError before
        error = export_write_error(e, out_file, need)
        if error is None:
            raise
        raise error from None
    print(f"exported {ckpt_dir} (step {info['step']}) -> {out_file}")



def metrics_rows(path):
    """metrics.jsonl as [(line, row)] (train.py's resume, sweep.py's result rows), read without
    following a symlink. Only the last line can be half-written (the file is only appended to, and
    cut at every start): it is dropped. Any other line that is not a row is a one-line error: skipping
    it would rewrite or misreport the run's history unasked."""
    with os.fdopen(open_in_run_dir(path, os.O_RDONLY), "rb") as f:
        lines = f.readlines()
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            row = parse_json(line)
        except ValueError:  # not JSON, not UTF-8, or nested past the decoder's recursion
            row = None
        if type(row) is not dict or type(row.get("step")) is not int:
            if n == len(lines) and not line.endswith(b"\n"):
                break  # the half-written last row of a killed run
            text = line.rstrip(b"\n")[:60].decode(errors="replace")
            raise ValueError(f"{path} line {n} is not a metrics row ({text!r}: "
                             f"a row is a JSON object with an integer step): repair or delete that line and rerun "
                             f"(nothing was changed)")
        rows.append((line, row))
    return rows


def truncate_metrics(path, step):
    """On resume, drop rows the killed run wrote after its last checkpoint (they are redone) and a
    half-written last one (metrics_rows)."""
    try:
        rows = metrics_rows(path)
    except FileNotFoundError:
        return
    # a whole last row without its newline (a full disk) would have the next row appended to it
    atomic_write_bytes(path, [line if line.endswith(b"\n") else line + b"\n" for line, row in rows
                              if row["step"] <= step])


def scalars(row, prefix=""):
    """(name, number) pairs of a metrics.jsonl row, nested keys joined by "/" (weights/<matrix>/
    stable_rank, expert_load/<layer>/<expert>); the step is the x axis, not a curve."""
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list)):
            yield from scalars(value if isinstance(value, dict) else dict(enumerate(value)), name + "/")
        elif isinstance(value, (int, float)) and name != "step":  # None: not measured (MFU)
            yield name, value


class Metrics:
    """Rank 0's record of a run: metrics.jsonl (rows past the resumed step dropped: they are redone),
    mirrored as live curves in TensorBoard (tensorboard_dir) and/or wandb (wandb_log), and the
    durations of evaluations, benchmarks and checkpoints for the ETA. metrics.jsonl stays the
    record; on other ranks record() does nothing."""

    def __init__(self, cfg, rank, resumed_step):
        self.spent = {"eval_s": [], "bench_s": [], "ckpt_s": []}
        self.file = self.writer = self.run = None
        if rank != 0:
            return
        self.path = os.path.join(cfg["out_dir"], "metrics.jsonl")
        with naming(self.path):
            truncate_metrics(self.path, -1 if resumed_step is None else resumed_step)
            self.file = os.fdopen(open_in_run_dir(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")
        if cfg["tensorboard_dir"]:
            from torch.utils.tensorboard import SummaryWriter
            # A resumed run redoes the steps after its checkpoint: purge_step hides the killed
            # run's copies of them, as truncate_metrics drops them from metrics.jsonl.
            self.writer = SummaryWriter(cfg["tensorboard_dir"],
                                        purge_step=None if resumed_step is None else resumed_step + 1)
        if cfg["wandb_log"]:
            import wandb
            self.run = wandb.init(project=cfg["wandb_project"], dir=cfg["out_dir"], config=cfg,
                                  name=cfg["wandb_run_name"] or os.path.basename(os.path.abspath(cfg["out_dir"])))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def record(self, row):
        for key in self.spent:
            if key in row:
                self.spent[key].append(row[key])
        if self.file is None:
            return
        with naming(self.path):
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        values = dict(scalars(row))
        if self.writer:
            for name, value in values.items():
                self.writer.add_scalar(name, value, row["step"])
            self.writer.flush()  # like metrics.jsonl: on disk when the row is logged
        if self.run:
            self.run.log(values, step=row["step"])

    def close(self):
        if self.file:
            self.file.close()
        if self.writer:
            self.writer.close()
        if self.run:
            self.run.finish()
