"""
Data for smallinit, written: text corpora -> verified token shards, and the anchor-function task
(the synthetic default dataset of the quickstart) as records.

    python prepare_data.py anchor --out data/anchor
    python prepare_data.py text --out data/en --source en=corpus/en --tokenizer bytes
    python prepare_data.py text --out data/bi --tokenizer gpt2 --tokenizer-dir tokenizers \\
        --source en=corpus/en,weight=0.5 --source 'zh=corpus/zh/*/*.txt,weight=0.5'
    python prepare_data.py text --out data/fw --tokenizer gpt2 --max-tokens 1B \\
        --source fw=hf:HuggingFaceFW/fineweb-edu,config=sample-10BT
    python prepare_data.py bench --source en=corpus/en --tokenizer gpt2 --tokenizer-dir tokenizers

The folder's format (shards, meta.json), its reader and the tokenizers are in data.py; the
anchor task's rules in anchor.py.
"""
import interrupt

if __name__ == "__main__":  # first: the imports below take seconds
    interrupt.while_starting("prepare_data.py: interrupted while starting, before anything was written; rerun the "
                             "same command")

import argparse
import bz2
import codecs
import errno
import fnmatch
import glob
import gzip
import hashlib
import io
import json
import lzma
import math
import multiprocessing
import os
import shlex
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections import deque
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from itertools import chain

import numpy as np

from anchor import ANCHOR_SHIFTS, PAIRS, AnchorTask, anchor_records, anchor_vocab, check_anchor_task
from configurator import at_least
from data import FORMAT_VERSION, HEADER, HEADER_BYTES, MAGIC, get_tokenizer, is_int, progress_bar, read_meta
from fileio import (NotOwnFile, atomic_open, atomic_write_bytes, file_kind, lock_holder, naming, open_nofollow,
                    parse_json, path_kind, sha256_of)
from launch import die_with_parent


def usable_cores():
    # The cores this process may run on (a container's or taskset's share); macOS has no
    # sched_getaffinity, so there it is every core.
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count()


def token_dtype(vocab_size):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


# -----------------------------------------------------------------------------
# Shards, written atomically (data.py reads them)


def npy_bytes(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def write_file(path, chunks):
    # naming: a failed write (a full disk, ulimit -f) names no file, a failed mkstemp its temporary one
    with naming(path):
        atomic_write_bytes(path, chunks)


def write_shard(path, tokens, docs, mask=None):
    """tokens: uint16|uint32 array; docs: int64 (n_docs, 2) of (start, source); mask: uint8 or None.
    Returns the file's sha256 (meta.json keeps it: the data's fingerprint for resumed runs)."""
    header = HEADER.pack(MAGIC, FORMAT_VERSION, tokens.dtype.itemsize, len(tokens), len(docs), mask is not None)
    chunks = [header.ljust(HEADER_BYTES, b"\0"), np.ascontiguousarray(docs, np.int64).tobytes(), tokens.tobytes()]
    if mask is not None:
        chunks.append(np.ascontiguousarray(mask, np.uint8).tobytes())
    write_file(path, chunks)
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()



class ShardWriter:
    """Cuts a stream of documents into shards of `shard_tokens` tokens."""

    def __init__(self, out_dir, split, dtype, shard_tokens, with_mask=False):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.with_mask = with_mask
        self.tokens, self.masks, self.docs, self.filled = [], [], [], 0
        self.shards = []  # (file name, n_tokens, max token id, sha256)

    def add(self, tokens, source, mask=None):
        while len(tokens):
            take = min(len(tokens), self.shard_tokens - self.filled)
            self.docs.append((self.filled, source))
            self.tokens.append(tokens[:take])
            if self.with_mask:
                self.masks.append(mask[:take])
                mask = mask[take:]
            tokens = tokens[take:]
            self.filled += take
            if self.filled == self.shard_tokens:
                self.flush()

    def flush(self):
        if self.filled == 0:
            return
        name = f"{self.split}_{len(self.shards):06d}.bin"
        tokens = np.concatenate(self.tokens).astype(self.dtype, copy=False)
        mask = np.concatenate(self.masks) if self.with_mask else None
        sha = write_shard(os.path.join(self.out_dir, name), tokens, np.array(self.docs, np.int64).reshape(-1, 2), mask)
        self.shards.append((name, self.filled, int(tokens.max()), sha))
        self.tokens, self.masks, self.docs, self.filled = [], [], [], 0

    def close(self):
        self.flush()
        names, counts, max_ids, shas = (list(c) for c in zip(*self.shards)) if self.shards else ([], [], [], [])
        # The largest id per shard is checked against the model's vocab when training starts (an
        # id past it would crash only when sampled); the sha256s fingerprint the data.
        return {"shards": names, "shard_tokens": counts, "tokens": sum(counts), "shard_max_id": max_ids,
                "shard_sha256": shas}


SHARD_FILES = "*_" + "[0-9]" * 6 + ".bin"  # only what ShardWriter writes: the folder may hold other files
# What a build writes in --out, meta.json first, with fileio.atomic_open's leftovers; beside them the
# token cache of an unfinished build and the lock of a running one
OUTPUT_FILES = ("meta.json", "meta.json*.tmp", SHARD_FILES, SHARD_FILES + "*.tmp")
CACHE_NAME, LOCK_NAME = "tokenize_cache", "prepare_data.lock"


def clear_outputs(out_dir):
    """Start a (re)build: drop meta.json first, so no old meta ever vouches for new shards."""
    for pattern in OUTPUT_FILES:
        for path in glob.glob(os.path.join(glob.escape(out_dir), pattern)):
            os.remove(path)


def write_meta(out_dir, meta, invocation):
    meta = {"format_version": FORMAT_VERSION, **meta, "command": invocation,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_file(os.path.join(out_dir, "meta.json"), [json.dumps(meta, indent=1).encode()])
    return meta


# -----------------------------------------------------------------------------
# Text sources (all read through `datasets`, the way its users store data)

TEXT_EXTENSIONS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# datasets decompresses text and json files by their suffix (.jsonl.gz); the checks below
# open them the same way
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


@dataclass
class Source:
    name: str
    path: str                   # file, folder, glob, or "hf:owner/dataset" for the hub
    weight: float = 1.0         # share of the mixture's tokens (normalised over sources)
    field: str = "text"         # json/parquet/hub column holding the text (a list of str is joined by \n)
    config: str | None = None   # hub or folder dataset config (README.md `configs:`)
    split: str = "train"        # hub split, or a split layout's; a file, glob or other folder is read whole
    sample_by: str = "paragraph"  # .txt documents: blank-line paragraphs, so books split into val/train
    sep: str | None = None      # also cut each text at this string (TinyStories: "<|endoftext|>")
    # Stop reading this source after this many tokens. Files are read in sorted path order, so a
    # capped folder of several corpora is cut from the front: give them separate sources to
    # control their shares.
    max_tokens: int | None = None
    encoding: str | None = None  # .txt/.json files that are not UTF-8, e.g. latin-1, gb18030


def parse_count(text):
    """'2_000', '5M', '1.5B' -> int."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9}.get(text[-1:].upper(), 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except (ValueError, OverflowError):  # 'inf' overflows int()
        raise ValueError(f"bad token count {text!r}: use a number with an optional K/M/B suffix, e.g. 500M") from None


def parse_source(spec):
    """NAME=PATH[,key=value...] with keys from Source, e.g. zh=hf:org/data,config=zh,weight=0.5."""
    name, _, rest = spec.partition("=")
    path, *options = rest.split(",")
    if not name or not path:
        raise ValueError(f"bad --source {spec!r}: expected NAME=PATH[,key=value...]")
    kwargs = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in Source.__dataclass_fields__ or key in ("name", "path"):
            raise ValueError(f"bad --source {spec!r}: unknown option {key!r}; options: weight, field, "
                             f"config, split, sample_by, sep, max_tokens, encoding")
        try:
            kwargs[key] = float(value) if key == "weight" else parse_count(value) if key == "max_tokens" else value
        except ValueError:
            raise ValueError(f"bad --source {spec!r}: {key}={value!r} is not a number") from None
    # max_tokens=0 would read as "no cap", a weight of 0 or nan as a share of nothing
    if kwargs.get("max_tokens", MIN_BUDGET) < MIN_BUDGET:
        raise ValueError(f"bad --source {spec!r}: max_tokens must be >= {MIN_BUDGET} (leave it out for no cap)")
    if not 0 < kwargs.get("weight", 1) < math.inf:
        raise ValueError(f"bad --source {spec!r}: weight must be a positive number (a share of the mixture)")
    if kwargs.get("sample_by", "paragraph") not in ("paragraph", "document", "line"):
        raise ValueError(f"bad --source {spec!r}: sample_by is paragraph, document or line")
    if "encoding" in kwargs:
        try:
            codecs.lookup(kwargs["encoding"])
        except LookupError:
            raise ValueError(f"bad --source {spec!r}: unknown encoding {kwargs['encoding']!r}") from None
    return Source(name, path, **kwargs)


def file_builder(path):
    """datasets' builder for a data file by its suffix, through a compression suffix; None: not data."""
    stem, ext = os.path.splitext(path)
    if ext in COMPRESSED:
        builder = TEXT_EXTENSIONS.get(os.path.splitext(stem)[1])
        return builder if builder in ("text", "json") else None  # parquet compresses itself
    return TEXT_EXTENSIONS.get(ext)


def source_files(source):
    files = sorted(glob.glob(os.path.expanduser(source.path), recursive=True))
    if not files:
        raise FileNotFoundError(f"source {source.name}: nothing matches {source.path}" + deeper_glob(source))
    builders = {file_builder(f) for f in files}
    if None in builders or len(builders) > 1:
        raise ValueError(f"source {source.name}: files must all be .txt, all .json/.jsonl or all "
                         f".parquet; split them into separate sources")
    return files, builders.pop()


def deeper_glob(source):
    """What to say when a glob matched nothing: a glob's * stops at a folder as the shell's does
    (zh/*.txt leaves out zh/classics/*.txt; reading them unasked would be worse), so name the **
    glob when it finds files in subfolders, else what a source may be."""
    folder, pattern = os.path.split(source.path)
    deeper = os.path.join(folder, "**", pattern)
    if "**" not in source.path and any(c in pattern for c in "*?["):
        found = [f for f in glob.glob(os.path.expanduser(deeper), recursive=True) if os.path.isfile(f)]
        if found:
            again = shlex.quote(",".join([f"{source.name}={deeper}", *source_options(source)]))
            return (f": its * stops at a folder, and {len(found)} files match {deeper}; to read them, pass "
                    f"--source {again}")
    return f" (expected {', '.join(TEXT_EXTENSIONS)} files (optionally .gz/.bz2/.xz), a folder or a glob)"


def folder_files(path):
    """Every file under a folder that datasets may read, sorted: it skips hidden files and
    folders (.cache/ of an `hf download --local-dir`, .git/) and folders named __*."""
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        files += [os.path.join(root, n) for n in names if not n.startswith(".")]
    return sorted(files)


def data_suffix(path):
    """'.txt', '.jsonl.gz'...: the end of the name that makes it a data file (file_builder)."""
    stem, ext = os.path.splitext(path)
    return os.path.splitext(stem)[1] + ext if ext in COMPRESSED else ext


def glob_source(source, folder, files):
    """The --source that reads `files` (one format, all under `folder`) whole as a glob, with
    the source's other options: the fix for a folder whose split inference drops files."""
    suffixes = {data_suffix(f) for f in files}
    tail = (suffixes.pop() if len(suffixes) == 1
            else {"text": ".txt*", "json": ".json*"}.get(file_builder(files[0]), ".parquet"))
    options = source_options(source, skip=("config", "split"))
    return "--source " + shlex.quote(",".join([f"{source.name}={os.path.join(folder, '**', '*' + tail)}", *options]))


def source_options(source, skip=()):
    """The key=value options of a --source that differ from their defaults."""
    defaults = Source(source.name, source.path)
    return [f"{k}={v}" for k, v in asdict(source).items()
            if k not in ("name", "path", *skip) and v != getattr(defaults, k)]


def readme_configs(folder):
    """The configs a folder's README.md declares (the hub layout), or None: then datasets
    infers splits from file names."""
    from huggingface_hub.repocard import metadata_load
    readme = os.path.join(folder, "README.md")
    return (metadata_load(readme) or {}).get("configs") if os.path.isfile(readme) else None


def check_folder(source, folder):
    """Refuse, in one line, a folder datasets would misread: no data file at all (datasets'
    message names no fix), or, without README configs, several formats (datasets reads only the
    most common one and drops the rest silently)."""
    data = [f for f in folder_files(folder) if file_builder(f)]
    if not data:
        raise ValueError(f"source {source.name}: {folder} holds no data files ({', '.join(TEXT_EXTENSIONS)}, "
                         f"optionally .gz/.bz2/.xz): put the corpus there or pass the files or a glob")
    kinds = {}
    for f in data:
        kinds.setdefault(file_builder(f), []).append(f)
    if len(kinds) > 1 and readme_configs(folder) is None:
        found = " and ".join(f"{len(fs)} {'/'.join(sorted({data_suffix(f) for f in fs}))}" for fs in kinds.values())
        fixes = " ".join(glob_source(Source(**{**asdict(source), "name": f"{source.name}_{kind}"}), folder, fs)
                         for kind, fs in kinds.items())
        raise ValueError(f"source {source.name}: {folder} mixes formats ({found} files) and datasets reads one "
                         f"format per folder, dropping the others: make a source of each, e.g. {fixes}")
    return data


def config_files(config, folder):
    """The files of every split of a README config. datasets resolves the files of the config it
    builds only; the others' are still patterns (data/validation-*)."""
    files = config.data_files or {}
    if hasattr(files, "resolve"):
        files = files.resolve(folder)
    return [f for fs in files.values() for f in fs]


def check_folder_split(source, folder, builder, split, data):
    """Name every data file of the folder that is not read, and how to read it: in a warning, or
    in the error when datasets' split inference left no `split` at all."""
    splits = builder.config.data_files or {}
    if readme_configs(folder) is not None:  # the card declares the splits: only files in none of them are news
        # real paths, as in named_splits: datasets resolves symlinks, our listing does not
        used = {os.path.realpath(f) for c in builder.builder_configs.values() for f in config_files(c, folder)}
        unread = [f for f in data if os.path.realpath(f) not in used]
        if unread and split in splits:
            print(f"warning: source {source.name}: {len(unread)} data files in {folder} are in no config of its "
                  f"README.md and are not read: {', '.join(unread)}; to read them, give them a --source of their "
                  f"own", file=sys.stderr)
        return
    where = {f: s for s, fs in named_splits(folder, data).items() for f in fs}
    unread = [f for f in data if where.get(f) != split]
    if not unread or split not in splits and split != "train":  # a split asked for by name: the plain error
        return
    named = ", ".join(f + (f" (split {where[f]!r})" if f in where else " (no split)") for f in unread)
    message = (f"source {source.name}: datasets splits {folder} by file names ({', '.join(map(str, splits))}) and "
               f"{'reads split' if split in splits else 'finds no split'} {split!r}, so {len(unread)} of its "
               f"{len(data)} data files are not read: {named}; to read every file, pass a glob: "
               f"{glob_source(source, folder, data)}")
    if split not in splits:
        raise ValueError(message + " (or pick a split with split=NAME)")
    print(f"warning: {message}", file=sys.stderr)


def source_file_stats(source):
    """[path, size, mtime_ns] of every local file the source's read depends on, by path: a
    glob's files, or everything under a folder (its file names and README.md decide what
    datasets reads, so an added file can change the split). Cheap (a stat per file, no
    hashing), and what a cached or finished read is compared with. [] for a hub id: the hub's
    files are not ours to stat."""
    path = os.path.expanduser(source.path[3:] if source.path.startswith("hf:") else source.path)
    if os.path.isdir(path):
        files = folder_files(path)
        for f in files:  # a dangling link would end the stat below in a bare FileNotFoundError
            check_plain(source, f)
    elif source.path.startswith("hf:"):
        return []
    else:
        files = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f)]
    return [[f, st.st_size, st.st_mtime_ns] for f in sorted(files) for st in [os.stat(f)]]


def size_text(size):
    """A file size as a message shows it. One recorded in a cache marker or meta.json may be any int:
    a 500-digit one, printed whole, would bury the line's file and fix."""
    digits = str(abs(size))
    return f"{size:,}" if len(digits) <= 20 else f"{str(size)[:20]}... ({len(digits)} digits)"


def file_changes(was, now):
    """Phrases naming each file that differs between two {source: source_file_stats} records."""
    old = {(name, f): (size, mtime) for name, rows in was.items() for f, size, mtime in rows}
    new = {(name, f): (size, mtime) for name, rows in now.items() for f, size, mtime in rows}
    changes = []
    for name, f in sorted(old.keys() | new.keys()):
        if (name, f) not in new:
            changes.append(f"{f} was removed")
        elif (name, f) not in old:
            changes.append(f"{f} was added")
        elif old[name, f][0] != new[name, f][0]:
            changes.append(f"{f} changed size ({size_text(old[name, f][0])} -> {size_text(new[name, f][0])} bytes)")
        elif old[name, f] != new[name, f]:
            changes.append(f"{f} was modified (same size, new mtime)")
    return changes


def one_change(changes):
    return changes[0] + (f" (and {len(changes) - 1} more)" if len(changes) > 1 else "")


def named_splits(folder, data):
    """{split: data files} as datasets' split inference (no README.md configs) assigns them by
    file or folder names (train/, *_test_*.txt, data/validation-*); all in 'train' when no name
    gives a split, and a file no name assigns in none."""
    from datasets.data_files import DataFilesDict, get_data_patterns
    patterns = get_data_patterns(folder)
    # datasets resolves the folder's symlinks (a macOS temp dir, a linked corpus), our listing
    # keeps the path as given: match on real paths, or every file reads as in no split
    ours = {os.path.realpath(f): f for f in data}
    found = {str(s): [ours[r] for r in map(os.path.realpath, fs) if r in ours]
             for s, fs in DataFilesDict.from_patterns(patterns, folder).items()}
    return {s: fs for s, fs in found.items() if fs}


def split_root(splits):
    """The folder that split names lay out: the deepest one holding every file they name."""
    return os.path.commonpath([os.path.dirname(f) for fs in splits.values() for f in fs])


def has_split_layout(source, folder):
    """Whether datasets' splits apply to the folder: README.md configs declare them, or file or
    folder names give two or more splits that lay out the folder itself (every data file under
    split_root). One *_train_* file among books, or a corpus's train and validation files in a
    subfolder beside other corpora (the offline kit's corpus/en/tinystories/), lay out no split of
    the folder: it is read whole."""
    if readme_configs(folder) is not None:
        return True
    data = check_folder(source, folder)
    splits = named_splits(folder, data)
    if len(splits) < 2:
        return False
    root = split_root(splits)
    return all(os.path.commonpath([root, f]) == root for f in data)


def source_layout(source):
    """'hub' (hf:ID), 'saved' / 'saved_dict' (a save_to_disk Dataset / DatasetDict), 'folder'
    (the hub layout: splits from README.md configs or from file and folder names), 'tree' (a
    folder without a split layout, every data file under it read) or 'files' (file, glob)."""
    path = os.path.expanduser(source.path)
    if source.path.startswith("hf:"):
        return "hub"
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        return "saved_dict"
    if os.path.isfile(os.path.join(path, "state.json")):
        return "saved"
    if not os.path.isdir(path):
        return "files"
    return "folder" if has_split_layout(source, path) else "tree"


def split_read(source):
    """The split of the source that is read; None when it is read whole (files, a folder without
    a split layout, a saved Dataset)."""
    if source_layout(source) in ("hub", "folder", "saved_dict"):
        return source.split
    if source.split != "train":
        raise ValueError(f"source {source.name}: {source.path} has no splits, it is read whole; split= picks a "
                         f"split of a folder laid out in splits (train/, test/...), a DatasetDict or a hub dataset: "
                         f"drop it")
    return None


def tree_files(source, folder):
    """Every data file of a folder without a split layout (sorted, one format) and their builder.
    Files whose names give splits are read like the others: say so, so that a test split read
    for training is seen (and how to read one split instead)."""
    if source.config is not None:
        raise ValueError(f"source {source.name}: config= picks a config that a README.md declares; {folder} has "
                         f"none: drop it")
    data = check_folder(source, folder)
    splits = named_splits(folder, data)
    if len(splits) > 1:
        root = split_root(splits)
        named = ", ".join(f"{os.path.relpath(f, folder)} ({s})" for s, fs in splits.items() for f in fs)
        one_split = ",".join([f"{source.name}={root}", "split=NAME", *source_options(source, skip=("split",))])
        print(f"note: source {source.name}: all {len(data)} data files of {folder} are read, {named} too: their "
              f"split names lay out {root} only; to read one split of it, pass --source {shlex.quote(one_split)}",
              file=sys.stderr)
    return data, file_builder(data[0])


def builder_options(source, builder):
    """The Source options that datasets' `builder` (text, json, parquet...) takes."""
    options = {"sample_by": source.sample_by} if builder == "text" else {}
    if source.encoding is not None:
        if builder not in ("text", "json"):
            raise ValueError(f"source {source.name}: encoding= applies to .txt/.json files, this is "
                             f"{builder} data (stored as UTF-8): drop it")
        options["encoding"] = source.encoding
    return options


def open_source(source, batch_size=1000):
    """(batches of records as {column: values}, text column, local data files) of one source. A file
    or glob of .txt files is read here; every other source through datasets."""
    layout, split, path = source_layout(source), split_read(source), os.path.expanduser(source.path)
    if layout == "files":
        files, builder = source_files(source)
        if builder == "text":
            check_not_empty(source, files)
            return plain_text_batches(source, files, batch_size), "text", files
    try:  # ~3 s to import: only reading a source other than .txt files needs it
        import datasets
    except ImportError:
        raise ValueError(f"source {source.name}: reading {source.path} needs the datasets package (pip install "
                         f"datasets); a .txt file or a glob of them is read without it") from None
    ds, field, files = open_dataset(datasets, source, layout, split, path)
    return ds.iter(batch_size=batch_size), field, files


def open_dataset(datasets, source, layout, split, path):
    """(dataset, text column, local data files) of a source that datasets reads."""
    if layout in ("saved", "saved_dict"):  # load_dataset refuses these: load_from_disk reads them
        ds = datasets.load_from_disk(path)
        if layout == "saved_dict":
            if split not in ds:
                raise ValueError(f"source {source.name}: {path} has no split {split!r}; it has "
                                 f"{sorted(ds)}: pass split=NAME in --source")
            ds = ds[split]
        return ds, source.field, []
    if layout in ("files", "tree"):
        files, builder = source_files(source) if layout == "files" else tree_files(source, path)
        check_not_empty(source, files)
        ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True,
                                   **builder_options(source, builder))
        return ds, "text" if builder == "text" else source.field, files
    repo = source.path[3:] if layout == "hub" else path
    data = check_folder(source, path) if layout == "folder" else []
    try:
        builder = datasets.load_dataset_builder(repo, source.config)
        options = builder_options(source, builder.name)
        if options:  # which options apply depends on the builder that datasets picked
            builder = datasets.load_dataset_builder(repo, source.config, **options)
    except ConnectionError as e:
        raise ValueError(f"source {source.name}: cannot reach the Hugging Face Hub for {repo!r} ({e}); "
                         f"download it on a machine with network (hf download {repo} --repo-type dataset "
                         f"--local-dir DIR) and pass --source {source.name}=DIR; offline, set "
                         f"HF_HUB_OFFLINE=1 to fail at once instead of retrying") from None
    splits = builder.config.data_files or {}
    if layout == "folder":  # datasets passes over some files silently: say which, and how to read them
        check_folder_split(source, path, builder, split, data)
    if split not in splits:
        raise ValueError(f"source {source.name}: {repo} has no split {split!r}; datasets finds "
                         f"{[str(s) for s in splits]} (from README.md configs or file names): "
                         f"pass split=NAME in --source")
    files = [f for f in splits[split] if os.path.lexists(f)]  # local ones: hub files are URLs
    check_not_empty(source, files)
    field = "text" if builder.name == "text" else source.field
    return builder.as_streaming_dataset(split), field, files


def open_file(path):
    return COMPRESSED.get(os.path.splitext(path)[1], open)(path, "rb")


TEXT_BLOCK_CHARS = 1 << 22  # .txt files are read this many characters at a time


def plain_text_batches(source, files, batch_size):
    """{"text": [document, ...]} batches of .txt files, cut as datasets' text builder cuts them
    (the study's data was made through it: the same documents keep its fingerprint) but without
    datasets, which a bare GPU image lacks. Universal newlines (\r\n and \r read as \n), then per
    sample_by: paragraphs between blank lines ("\n\n"), lines, or the whole file. Empty pieces are
    dropped (datasets keeps empty lines; every document is filtered for blanks after this anyway)."""
    cut = {"paragraph": "\n\n", "line": "\n", "document": None}[source.sample_by]
    batch = []
    for path in files:
        with io.TextIOWrapper(open_file(path), encoding=source.encoding or "utf-8") as f:
            rest = ""
            for block in iter(lambda: f.read(TEXT_BLOCK_CHARS), ""):
                if cut is None:
                    rest += block
                    continue
                # A cut may straddle two blocks: the last piece waits for the next block.
                *pieces, rest = (rest + block).split(cut)
                batch += filter(None, pieces)
            batch += filter(None, [rest])
        while len(batch) >= batch_size:
            yield {"text": batch[:batch_size]}
            batch = batch[batch_size:]
    if batch:
        yield {"text": batch}


def check_plain(source, path):
    kind = path_kind(path)
    if kind != "a file":
        raise ValueError(f"source {source.name}: {path} is {kind or 'a link to nothing'}, not a data file: "
                         f"remove it or move it out of the source")


def check_not_empty(source, files):
    """Refuse a file that is not a plain file (a FIFO would block the read forever, a dangling link
    fail in datasets) or is empty: datasets skips an empty file among others, and fails with a bare
    StopIteration when all are."""
    for path in files:
        check_plain(source, path)
        with open_file(path) as f:
            if not f.read(1):
                raise ValueError(f"source {source.name}: {path} is empty (no records); remove it "
                                 f"or replace it with the complete file")


def undecodable(source, files, error):
    """The one-line error for a file that is not in the source's encoding, naming the file."""
    encoding = source.encoding or "utf-8"
    for path in files:  # datasets' error names no file: find it (only on this failure path)
        decoder = codecs.getincrementaldecoder(encoding)()
        with open_file(path) as f:
            try:
                for block in iter(lambda: f.read(1 << 20), b""):
                    decoder.decode(block)
                decoder.decode(b"", final=True)
            except UnicodeDecodeError as e:
                error, culprit = e, path
                break
    else:
        culprit = source.path
    return (f"source {source.name}: {culprit} is not {encoding} text (byte 0x{error.object[error.start]:02x}: "
            f"{error.reason}); add encoding=<its encoding> to its --source, e.g. encoding=latin-1, "
            f"cp1252 or gb18030")


def document_text(value, source, field, index, columns):
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    if not isinstance(value, str):
        raise ValueError(f"source {source.name} ({source.path}): record {index} has {field}="
                         f"{value!r:.40} ({type(value).__name__}), not text; pass field=<a text column> "
                         f"in --source (columns: {', '.join(sorted(columns))})")
    return value


def iter_texts(source, batch_size=1000):
    """Lists of document texts of one source, streamed (nothing is cached or loaded whole).
    The source is opened now, so a bad one fails before any progress output."""
    return document_batches(source, *open_source(source, batch_size))


def document_batches(source, batches, field, files):
    read = 0
    try:
        for batch in batches:
            if field not in batch:
                raise ValueError(f"source {source.name}: no field {field!r}; columns are {sorted(batch)}; "
                                 f"pass field=<column> in --source")
            texts = [document_text(t, source, field, read + i, batch) for i, t in enumerate(batch[field])]
            read += len(texts)
            if source.sep is not None:
                texts = [piece.strip() for t in texts for piece in t.split(source.sep)]
            yield [t for t in texts if t and not t.isspace()]
    except UnicodeDecodeError as e:
        raise ValueError(undecodable(source, files, e)) from None


def chunk_texts(batches, chars):
    """Regroup document lists into tasks of about `chars` characters: big enough to amortise
    the inter-process hop, small enough to keep all workers busy."""
    group, size = [], 0
    for texts in batches:
        for t in texts:
            group.append(t)
            size += len(t)
            if size >= chars:
                yield group
                group, size = [], 0
    if group:
        yield group


# -----------------------------------------------------------------------------
# Multiprocess tokenization

_worker_enc = None


def init_worker(tokenizer, tokenizer_dir, tie_to_parent):
    """First in each pool worker. tie_to_parent (launch.die_with_parent's request, None off Linux) has it
    SIGTERMed when the thread that forked it ends: a SIGKILLed run's worker would otherwise finish the task
    it holds (a long document: minutes) before its pipe's end stops it, keeping the memory and the lock on
    --out it inherited, so the rerun is refused. Pool forks its workers in the thread that makes it, and a
    replacement in its worker-handler thread, which lives as long as the pool."""
    global _worker_enc
    # Ctrl-C reaches the whole process group: the main process stops the pool and says one line;
    # workers that took it too would each print a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal's: likewise the main process's to handle
    # SIGTERM (the parent's death, Pool.terminate) must end the worker, not run a handler inherited from a
    # program that imported this module; set before the request, which may send it at once
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if tie_to_parent is not None:
        tie_to_parent()
    sys.stderr = QuietOrphan(sys.stderr, os.getppid())
    _worker_enc = get_tokenizer(tokenizer, tokenizer_dir)


class QuietOrphan:
    """A pool worker's stderr, silent once its parent is gone: a SIGKILLed run's busy workers would each
    print multiprocessing's traceback for the result they can no longer send (a BrokenPipeError: the pipe
    is the parent's), after the run itself ended without a word. Such a pipe breaks before the parent's
    death reparents the worker, so the error at hand counts as much as the parent's pid."""

    def __init__(self, stream, parent):
        self.stream, self.parent = stream, parent

    def orphaned(self):
        return os.getppid() != self.parent or isinstance(sys.exc_info()[1], BrokenPipeError)

    def write(self, text):
        return len(text) if self.orphaned() else self.stream.write(text)

    def flush(self):
        if not self.orphaned():
            self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def encode_documents(texts):
    """Tokens of the documents, each followed by eot, and the per-document lengths (eot included)."""
    ids = [_worker_enc.encode_ordinary(t) for t in texts]  # the batch API would spin up a thread pool per call
    lengths = np.fromiter((len(d) + 1 for d in ids), np.int64, len(ids))
    eot = [_worker_enc.eot_token]
    tokens = np.fromiter(chain.from_iterable(d + eot for d in ids), token_dtype(_worker_enc.n_vocab),
                         int(lengths.sum()))
    return tokens, lengths


def parallel_map(pool, fn, tasks, workers):
    """pool.imap with bounded read-ahead: imap would drain a streamed hub dataset into memory."""
    pending = deque()
    for task in tasks:
        pending.append(pool.apply_async(fn, (task,)))
        if len(pending) >= 2 * workers:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()



def stat_rows(value):
    """Whether a recorded source_file_stats is [path, size, mtime_ns] rows, as file_changes reads them."""
    return isinstance(value, list) and all(isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)
                                           and is_int(row[1]) and is_int(row[2]) for row in value)


def open_cached(path):
    """A cache file for reading: a symlink is not followed out of the folder, a FIFO not waited on
    (fileio.NotOwnFile)."""
    return os.fdopen(open_nofollow(path, os.O_RDONLY), "rb")


def cache_paths(cache_dir, source):
    """A source's token cache: the done marker, the tokens, the document lengths."""
    return [os.path.join(cache_dir, f"{source.name}.{kind}") for kind in ("done.json", "tokens.bin", "lengths.npy")]


def read_cache(source, cache_dir, dtype, fingerprint):
    """((tokens memmap, document lengths), None) of a complete cache that an interrupted run left for
    the source, or (None, why not). Its files may hold anything: <name>.done.json must be the marker this
    run would write (fingerprint["files"], source_file_stats, ties it to the files it was read from)
    with the sha256 of each file, and the files must have those bytes."""
    done, tokens_path, lengths_path = cache_paths(cache_dir, source)
    try:
        with open_cached(done) as f:
            cached = parse_json(f.read())
    except ValueError as e:
        return None, f"{done} is not JSON ({e})"
    if not isinstance(cached, dict):
        return None, f"{done} holds a JSON {type(cached).__name__}, not a cache marker"
    recorded = {k: v for k, v in cached.items() if k != "sha256"}
    if recorded != fingerprint:
        if {**recorded, "files": None} == {**fingerprint, "files": None} and stat_rows(recorded.get("files")):
            changes = file_changes({source.name: recorded["files"]}, {source.name: fingerprint["files"]})
            return None, f"{one_change(changes)} since the interrupted run"
        return None, f"{done} was written for other settings or source files"
    sums = cached.get("sha256")
    if not (isinstance(sums, dict) and all(isinstance(sums.get(k), str) for k in ("tokens", "lengths"))):
        return None, f"{done} records no sha256 of the cached files"
    with open_cached(lengths_path) as f:
        raw = f.read()
    if hashlib.sha256(raw).hexdigest() != sums["lengths"]:
        return None, f"{lengths_path} does not match the sha256 that {done} records"
    try:  # the sha256 is no secret: a marker written by hand can vouch for any bytes
        lengths = np.load(io.BytesIO(raw))
    except (ValueError, EOFError):
        lengths = None
    if not (isinstance(lengths, np.ndarray) and lengths.dtype == np.int64 and lengths.ndim == 1 and len(lengths)
            and (lengths > 0).all()):
        return None, f"{lengths_path} holds no document lengths"
    with open_cached(tokens_path) as f:
        # The sizes first: a cache cut short (a full disk) is the common damage, and says so
        # summed as Python ints: a crafted lengths file's int64 sum can wrap around to the file's size
        if os.fstat(f.fileno()).st_size != sum(lengths.tolist()) * np.dtype(dtype).itemsize:
            return None, "cached tokens are incomplete"
        if sha256_of(f) != sums["tokens"]:
            return None, f"{tokens_path} does not match the sha256 that {done} records"
        return (np.memmap(f, dtype, "r"), lengths), None  # the file checked, not whatever its name holds now


def tokenize_source(source, pool, workers, cache_dir, dtype, fingerprint):
    """Tokenize one source into cache_dir/<name>.tokens.bin (raw `dtype`) and <name>.lengths.npy.

    Returns (tokens memmap, document lengths, (tokens, seconds) since the first result, or
    None when reused).
    fingerprint["cap"] (None: no cap) stops the read once that many tokens are in.
    A cache whose <name>.done.json vouches for it is reused (resume after a crash, read_cache);
    any other is tokenized again, saying why in one line.
    """
    done, tokens_path, lengths_path = cache_paths(cache_dir, source)
    if os.path.lexists(done):
        try:
            cache, why = read_cache(source, cache_dir, dtype, fingerprint)
        except FileNotFoundError:
            cache, why = None, "cached tokens are incomplete"
        except NotOwnFile as e:
            cache, why = None, f"{e.filename} is {e.strerror}"
        if cache is not None:
            print(f"{source.name}: reusing tokens from an interrupted run", file=sys.stderr)
            return *cache, None
        print(f"{source.name}: {why}, tokenizing again", file=sys.stderr)
        os.remove(done)  # a link or a FIFO goes, not what it names; the files under it are replaced by renames
    cap = fingerprint["cap"]
    lengths, count, first = [], 0, None  # first: (time, tokens) at the first result
    digest = hashlib.sha256()
    texts = iter_texts(source)
    # a bar when the token budget is known (a stream has no length), else a counter; atomic_open
    # fsyncs before the rename, so the file is on disk before the done marker can vouch for it
    with atomic_open(tokens_path) as raw, progress_bar(total=cap, desc=f"tokenizing {source.name}", unit="tok",
                                                       unit_scale=True) as bar:
        for tokens, lens in parallel_map(pool, encode_documents, chunk_texts(texts, 1 << 18), workers):
            data = tokens.tobytes()
            with naming(tokens_path):  # names no file: name the one the user knows
                raw.write(data)
            digest.update(data)
            lengths.append(lens)
            count += len(tokens)
            bar.update(len(tokens) if cap is None else min(len(tokens), cap - bar.n))  # the last read overshoots
            first = first or (time.time(), count)
            if cap is not None and count >= cap:
                break
        if not lengths:  # raised inside: atomic_open then leaves no file
            raise ValueError(f"source {source.name} ({source.path}) has no non-empty documents")
    lengths = np.concatenate(lengths)
    lengths_bytes = npy_bytes(lengths)
    write_file(lengths_path, [lengths_bytes])
    sums = {"tokens": digest.hexdigest(), "lengths": hashlib.sha256(lengths_bytes).hexdigest()}
    write_file(done, [json.dumps({**fingerprint, "sha256": sums}).encode()])
    # The steady rate counts from the first result on: start-up (imports, worker start, opening
    # the dataset) is a fixed cost that the pipeline's throughput at scale does not pay per token.
    with open_cached(tokens_path) as f:
        tokens = np.memmap(f, dtype, "r")
    return tokens, lengths, (count - first[1], time.time() - first[0])


# -----------------------------------------------------------------------------
# Mixture, validation split, shards


def normalized_weights(sources):
    weights = np.array([s.weight for s in sources], np.float64)
    assert (weights > 0).all(), "parse_source refuses a weight <= 0"
    return weights / weights.sum()


def mixture_quotas(sources, available, max_tokens):
    """Tokens to take from each source so the mixture matches the weights exactly: all of
    `max_tokens` when given, else as many as the scarcest source (relative to its weight) allows."""
    weights = normalized_weights(sources)
    total = max_tokens if max_tokens is not None else min(a / w for a, w in zip(available, weights))
    quotas = [int(round(w * total)) for w in weights]
    for s, q, a in zip(sources, quotas, available):
        if q > a:
            raise ValueError(f"source {s.name} has {a:,} tokens, the mixture needs {q:,} from it; lower "
                             f"--max-tokens, lower its weight, or add data")
    return quotas


def select_documents(lengths, quota, val_fraction, rng):
    """(doc index, tokens to keep) rows for train and val, in a seeded random order of documents.

    Documents are taken until the quota is met, the last one cut to fit (its eot kept). The first
    of them go to val until it holds val_fraction of the source, always leaving train one.
    """
    order = rng.permutation(len(lengths))
    ends = np.cumsum(lengths[order])
    n = min(int(np.searchsorted(ends, quota)) + 1, len(order))
    docs = np.stack([order[:n], lengths[order[:n]]], 1)
    docs[-1, 1] -= max(0, int(ends[n - 1]) - quota)
    docs = docs[docs[:, 1] > 0]
    n_val = int(np.searchsorted(np.cumsum(docs[:, 1]), val_fraction * docs[:, 1].sum())) + 1 if val_fraction > 0 else 0
    n_val = min(n_val, len(docs) - 1)
    return docs[n_val:], docs[:n_val]


def no_val_reason(source, lengths, quota):
    """Why select_documents took a single document (train keeps it, val gets none) and what helps."""
    finer = {"document": "sample_by=paragraph or sample_by=line (.txt files)",
             "paragraph": "sample_by=line (.txt files)",
             "line": None}[source.sample_by]
    cut = " or ".join(c for c in (finer, "sep=STRING (cuts documents at that string)") if c)
    if len(lengths) == 1:
        return f"it is one document ({int(lengths[0]):,} tokens); cut it into more with {cut}"
    return (f"its share of the mixture ({quota:,} tokens) is filled by the first of its {len(lengths):,} documents "
            f"drawn; raise the share (weight=, max_tokens=, --max-tokens) or cut documents smaller with {cut}")


def write_text_split(out_dir, split, docs, caches, eot, dtype, shard_tokens, rng):
    """docs: int64 rows (source id, doc index, tokens to keep), written in a seeded order that mixes sources."""
    starts = [np.concatenate([[0], np.cumsum(lengths)]) for _, lengths in caches]
    writer = ShardWriter(out_dir, split, dtype, shard_tokens)
    for src, d, keep in docs[rng.permutation(len(docs))].tolist():
        tokens = caches[src][0][starts[src][d]:starts[src][d] + keep]
        if tokens[-1] != eot:  # a document cut to fit the quota still ends its document
            tokens = np.append(tokens[:-1], eot).astype(dtype)
        writer.add(tokens, src)
    return writer.close()


# The command-line flag of each recorded setting, for naming what differs: the text command's
# (recorded under meta.json's "settings") and the anchor command's (under "anchor", with the task).
TEXT_FLAGS = {"sources": "--source", "tokenizer": "--tokenizer", "max_tokens": "--max-tokens",
              "val_fraction": "--val-fraction", "seed": "--seed", "shard_tokens": "--shard-tokens"}
ANCHOR_FLAGS = {name: "--" + name.replace("_", "-") for name in AnchorTask.__dataclass_fields__}


def recorded_sources(value):
    """A folder's recorded sources as asdict(Source) rows, options added since then at their
    defaults (which read as before), so an older folder of the same sources compares equal;
    None when they are not rows with a name and a path."""
    try:
        return [asdict(Source(**{k: v for k, v in row.items() if k in Source.__dataclass_fields__})) for row in value]
    except (TypeError, AttributeError):
        return None


def setting_text(key, value):
    if key == "sources" and recorded_sources(value) is not None:
        return " ".join(",".join([f"{v['name']}={v['path']}", *source_options(Source(**v))])
                        for v in recorded_sources(value))
    return "none" if value is None else str(value)


def setting_changes(was, now, flags):
    """'FLAG OLD -> NEW' for each setting of flags that a folder's recorded `was` (from its meta.json,
    so anything) has otherwise than `now`."""
    was = dict(was) if isinstance(was, dict) else {}
    if recorded_sources(was.get("sources")) is not None:
        was["sources"] = recorded_sources(was["sources"])
    changes = []
    for key, flag in flags.items():
        if key not in was or was[key] != now[key]:
            old = setting_text(key, was[key]) if key in was else "(not recorded)"
            changes.append(f"{flag} {old} -> {setting_text(key, now[key])}")
    return changes


def prepared_meta(out, recorded, settings, flags):
    """out's meta.json when out is a data folder prepared with these settings (recorded under its
    key `recorded`), None when it holds no meta.json. Other settings would replace the data that runs
    trained on it are fingerprinted with (their resume then fails, and eval.py scores them on other
    data): refused in one line naming each, as is a meta.json that is not a data folder's."""
    path = os.path.join(out, "meta.json")
    if not os.path.exists(path):
        return None
    meta, problem = read_meta(path)
    if problem:
        raise ValueError(f"{path} is not a data folder's meta.json: {problem}; --force rebuilds {out} (dropping "
                         f"that file), or pass another --out")
    changed = setting_changes(meta.get(recorded), settings, flags)
    if changed:
        raise ValueError(f"{out} was prepared with other settings: {'; '.join(changed)}; --force replaces its data "
                         f"with these, or pass another --out")
    return meta


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with the one line that says what it left: prepare_data.py prints it and exits 130."""


def glob_reaches(parts, names):
    """Whether glob.glob's pattern components (recursive: ** spans folders) match a path's names.
    As in glob, a wildcard passes over hidden names (.cache/) unless the pattern spells the dot."""
    if not parts:
        return not names
    if parts[0] == "**":
        return any(glob_reaches(parts[1:], names[i:]) for i in range(len(names) + 1)
                   if not any(n.startswith(".") for n in names[:i]))
    return (bool(names) and fnmatch.fnmatchcase(names[0], parts[0])
            and (parts[0].startswith(".") or not names[0].startswith(".")) and glob_reaches(parts[1:], names[1:]))


def check_out_of_sources(out, sources):
    """Refuse an --out that a source reads: under a folder source (every file there is read, and each
    build would change the files its data was prepared from), or where a glob source matches what a
    build writes (corpus/**/*.json matches meta.json and the cache markers)."""
    real_out = os.path.realpath(out)
    written = ["meta.json", "train_000000.bin", LOCK_NAME, *(p for s in sources for p in cache_paths(CACHE_NAME, s))]
    for s in sources:
        if s.path.startswith("hf:"):
            continue
        path = os.path.abspath(os.path.expanduser(s.path))
        if os.path.isdir(path):
            reads = os.path.commonpath([os.path.realpath(path), real_out]) == os.path.realpath(path)
        else:  # a file or a glob: from its first component with a wildcard on, compared name by name
            parts = path.split(os.sep)
            fixed = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
            root = os.path.realpath(os.sep.join(parts[:fixed]) or os.sep)
            inside = os.path.relpath(real_out, root)
            reads = not inside.startswith(os.pardir) and any(
                glob_reaches(parts[fixed:], os.path.normpath(os.path.join(inside, f)).split(os.sep)) for f in written)
        if reads:
            raise ValueError(f"--out {out} is where source {s.name} ({s.path}) reads: the files written there would "
                             f"become its documents; pass an --out outside it")


def check_out_folder(out_dir):
    """Refuse an --out that is not a data folder of ours: files that no build wrote and no data
    meta.json (`--out ~` or `--out /`, where --force, meant to rebuild a data folder, would then
    write), or a token cache that is not a folder of its own (a link to another folder would be read
    as the cache and written into)."""
    cache = os.path.join(out_dir, CACHE_NAME)
    mode = os.lstat(cache).st_mode if os.path.lexists(cache) else stat.S_IFDIR
    if not stat.S_ISDIR(mode):
        raise ValueError(f"{cache} is {file_kind(mode)}, not a folder of its own: the token cache is read and "
                         f"written only there; remove it, then rerun")
    theirs = sorted(n for n in os.listdir(out_dir)
                    if n not in (CACHE_NAME, LOCK_NAME) and not any(fnmatch.fnmatchcase(n, p) for p in OUTPUT_FILES))
    meta = os.path.join(out_dir, "meta.json")
    if theirs and not (os.path.lexists(meta) and read_meta(meta)[1] is None):
        more = f" (and {len(theirs) - 1} more)" if len(theirs) > 1 else ""
        raise ValueError(f"{out_dir} holds {theirs[0]}{more}, which prepare_data.py did not write, and no data "
                         f"meta.json: it is not a data folder; pass a new or empty folder as --out")


def lock_out(out_dir):
    """An exclusive OS lock on out_dir/prepare_data.lock, released by the kernel when the process
    dies (no stale lock after a crash). The file says who holds it, for the error a second run gets."""
    path = os.path.join(out_dir, LOCK_NAME)
    while True:
        try:
            fd = open_nofollow(path)
        except NotOwnFile as e:
            raise ValueError(f"{path} is {e.strerror} (a data folder's files are its own); remove it, "
                             f"then rerun") from None
        holder = lock_holder(fd, path, "prepare_data.py")
        if holder:
            raise ValueError(f"{out_dir} is in use by {holder}: wait for that run to end (or stop it), or pass "
                             f"another --out")
        # The run before removes the file as it ends: a lock taken on a file opened just before that
        # excludes no one who opens the name now, so it is taken again on the file there
        with suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                return fd
        os.close(fd)


@contextmanager
def claimed(out_dir):
    """out_dir for this run alone, made when missing: checked (check_out_folder) and locked (lock_out):
    a second run into it would clear the first one's shards and write its own, and the first one's
    meta.json would then vouch for them. The lock file goes when the run ends, and the folder too
    when this run made it and nothing is left in it."""
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    fd = None
    try:
        check_out_folder(out_dir)
        fd = lock_out(out_dir)
        yield
    finally:
        if fd is not None:
            with suppress(OSError):  # removed while still locked: no other run holds the name meanwhile
                os.remove(os.path.join(out_dir, LOCK_NAME))
            os.close(fd)
        if created:
            with suppress(OSError):
                os.rmdir(out_dir)  # only when empty


@contextmanager
def building(out_dir):
    """A (re)build of out_dir (claimed). It yields replace(), which the build calls once it holds what it
    writes (the tokens: the long part): only then do the old meta.json and shards go, so a rebuild
    stopped before leaves the earlier data as it was. On a failure or Ctrl-C after replace() the shards
    written so far go too (a folder without meta.json is never read, and the rerun writes them again);
    complete token caches stay for the rerun to reuse. Ctrl-C becomes Interrupted, saying that."""
    replaced = []

    def replace():
        replaced.append(True)
        clear_outputs(out_dir)
    try:
        yield replace
    except BaseException as e:
        cache = os.path.join(out_dir, CACHE_NAME)
        with suppress(OSError):  # the failure may be the disk's: clean what can be, report the first error
            if replaced:
                clear_outputs(out_dir)
            os.rmdir(cache)  # only when empty
        if isinstance(e, KeyboardInterrupt) and not isinstance(e, Interrupted):
            kept = sorted(f[:-len(".done.json")] for f in os.listdir(cache) if f.endswith(".done.json")) \
                if os.path.isdir(cache) else []
            earlier = not replaced and os.path.exists(os.path.join(out_dir, "meta.json"))
            line = f"interrupted; {out_dir} {'keeps its earlier data' if earlier else 'is not prepared'}: the same " \
                   f"command " + (f"resumes, reusing the tokens of {', '.join(kept)}" if kept else "starts over")
            raise Interrupted(line) from None
        raise


def prepare_text(args):
    sources = [parse_source(s) for s in args.source]
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"source names must be unique: {names}")
    for s in sources:
        if s.path.startswith("hf:") and s.max_tokens is None and args.max_tokens is None:
            raise ValueError(f"source {s.name} streams from the hub: give it max_tokens=N or set --max-tokens")
    enc = get_tokenizer(args.tokenizer, args.tokenizer_dir)
    settings = {"sources": [asdict(s) for s in sources], "tokenizer": args.tokenizer, "max_tokens": args.max_tokens,
                "val_fraction": args.val_fraction, "seed": args.seed, "shard_tokens": args.shard_tokens}
    # before any read: a file changed during it is caught next time
    files = {s.name: source_file_stats(s) for s in sources}
    check_out_of_sources(args.out, sources)
    with claimed(args.out):
        meta = None if args.force else prepared_meta(args.out, "settings", settings, TEXT_FLAGS)
        if meta is not None:
            changes = file_changes(meta["source_files"], files) if "source_files" in meta else []
            if not changes:
                unrecorded = "" if "source_files" in meta else "; its source files were not recorded, so not compared"
                print(f"{args.out} is already prepared with these settings (--force rebuilds it{unrecorded})")
                return meta
            if not args.keep_stale:
                raise ValueError(f"{args.out} was prepared from other source files: {one_change(changes)}; "
                                 f"--force rebuilds it from the files there now, --keep-stale keeps the old data")
            print(f"{args.out}: keeping the data prepared before {one_change(changes)} (--keep-stale)")
            return meta
        with building(args.out) as replace:
            return build_text(args, sources, names, enc, settings, files, replace)


def build_text(args, sources, names, enc, settings, files, replace):
    start = time.time()

    # 1) tokenize each source into a cache (complete caches of an interrupted run are reused)
    cache_dir = os.path.join(args.out, CACHE_NAME)
    os.makedirs(cache_dir, exist_ok=True)  # check_out_folder: a folder of its own if it is there
    dtype = token_dtype(enc.n_vocab)
    caches, timings = [], []
    # forked where the request is made (Linux): the request names this process as the parent, and
    # Python 3.14's forkserver would fork the workers from another (and pickle the request, which fails)
    tie_to_parent = die_with_parent()
    context = multiprocessing.get_context("fork" if tie_to_parent else None)
    with context.Pool(args.workers, init_worker, (args.tokenizer, args.tokenizer_dir, tie_to_parent)) as pool:
        for s, weight in zip(sources, normalized_weights(sources)):
            caps = [c for c in (s.max_tokens, args.max_tokens and int(round(weight * args.max_tokens))) if c]
            fingerprint = {"source": asdict(s), "tokenizer": args.tokenizer, "cap": min(caps, default=None),
                           "files": files[s.name]}
            *cache, steady = tokenize_source(s, pool, args.workers, cache_dir, dtype, fingerprint)
            caches.append(cache)
            timings.append(steady or (0, 0.0))
    tokenize_seconds = time.time() - start

    # 2) mix by token weights, split by documents, write shards (the earlier data goes now)
    replace()
    # the last batch read overshoots a source's own max_tokens: the budget, not the read, counts
    available = [min(len(t), s.max_tokens or len(t)) for s, (t, _) in zip(sources, caches)]
    quotas = mixture_quotas(sources, available, args.max_tokens)
    split_docs = {"train": [], "val": []}
    stats = {}
    for i, (s, (_, lengths), quota) in enumerate(zip(sources, caches, quotas)):
        train, val = select_documents(lengths, quota, args.val_fraction, np.random.default_rng([args.seed, i]))
        if not len(val) and args.val_fraction > 0:
            print(f"warning: source {s.name} has no val split: {no_val_reason(s, lengths, quota)}", file=sys.stderr)
        for split, docs in (("train", train), ("val", val)):
            split_docs[split].append(np.column_stack([np.full(len(docs), i), docs]))
        stats[s.name] = {"weight": s.weight, "split": split_read(s),
                         "read_docs": len(lengths), "read_tokens": int(lengths.sum()),
                         "train_docs": len(train), "train_tokens": int(train[:, 1].sum()),
                         "val_docs": len(val), "val_tokens": int(val[:, 1].sum())}
    splits = {}
    for j, (split, docs) in enumerate(split_docs.items()):
        docs = np.concatenate(docs)
        if len(docs):
            rng = np.random.default_rng([args.seed, len(sources) + j])
            splits[split] = write_text_split(args.out, split, docs, caches, enc.eot_token, dtype, args.shard_tokens,
                                             rng)
    total = sum(sp["tokens"] for sp in splits.values())
    seconds = time.time() - start
    meta = write_meta(args.out, {
        "tokenizer": args.tokenizer, "vocab_size": enc.n_vocab, "eot_id": enc.eot_token,
        "dtype": np.dtype(dtype).name, "sources": names,
        "weights": dict(zip(names, normalized_weights(sources).tolist())),
        "source_stats": stats, "splits": splits, "settings": settings, "source_files": files,
        "throughput": {"tokenize_tok_per_s": sum(len(t) for t, _ in caches) / tokenize_seconds,
                       "tokenize_steady_tok_per_s": sum(n for n, _ in timings) / max(sum(s for _, s in timings), 1e-9),
                       "total_tok_per_s": total / seconds, "seconds": seconds, "workers": args.workers},
    }, args.invocation)
    shutil.rmtree(cache_dir)
    sizes = ", ".join(f"{k} {v['tokens']:,}" for k, v in splits.items())
    print(f"wrote {total:,} tokens ({sizes}) to "
          f"{args.out} in {seconds:.1f}s: {total / seconds / 1e6:.2f}M tok/s overall with {args.workers} workers")
    for s, st in zip(sources, stats.values()):
        read = f"split {st['split']!r} of" if st["split"] else "all of"
        print(f"  {s.name}: {st['train_tokens']:,} train / {st['val_tokens']:,} val tokens from "
              f"{st['read_docs']:,} docs ({read} {s.path})")
    return meta


def benchmark(args):
    """Pipeline throughput against raw encode_ordinary_batch on the same documents and cores."""
    enc = get_tokenizer(args.tokenizer, args.tokenizer_dir)
    texts = [t for s in args.source for batch in iter_texts(parse_source(s)) for t in batch]
    raw = []
    for _ in range(3):  # best of three: the machine is shared
        t0 = time.time()
        n = sum(map(len, enc.encode_ordinary_batch(texts, num_threads=args.workers)))
        raw.append(n / (time.time() - t0))
    with tempfile.TemporaryDirectory() as out:
        args.out, args.force = out, True
        meta = prepare_text(args)
    th = meta["throughput"]
    print(f"\nbenchmark ({args.tokenizer}, {args.workers} workers, {len(texts):,} documents, {n:,} tokens)")
    print(f"  raw encode_ordinary_batch  {max(raw) / 1e6:6.2f}M tok/s")
    print(f"  pipeline tokenize, steady  {th['tokenize_steady_tok_per_s'] / 1e6:6.2f}M tok/s  "
          f"({th['tokenize_steady_tok_per_s'] / max(raw):.0%} of raw; from the first result to the last)")
    print(f"  pipeline tokenize stage    {th['tokenize_tok_per_s'] / 1e6:6.2f}M tok/s  "
          f"({th['tokenize_tok_per_s'] / max(raw):.0%} of raw; with imports and worker start-up)")
    print(f"  pipeline end to end        {th['total_tok_per_s'] / 1e6:6.2f}M tok/s  "
          f"({th['total_tok_per_s'] / max(raw):.0%} of raw; includes reading, mixing, shard writes)")


# -----------------------------------------------------------------------------
# The anchor-function task's records (anchor.py), written as shards


def prepare_anchor(task, out_dir, invocation, force=False):
    """Splits: train (train keys, seen pairs), val (fresh samples of the same), test (test keys,
    seen pairs), heldout (the held-out pair on all keys; its stored target is the composite,
    i.e. the inferential answer). Loss only on the last token of each record. A folder prepared
    with the same task is left as it is (same seed, same bytes); with another, refused without force."""
    check_anchor_task(task)
    settings = json.loads(json.dumps(asdict(task)))  # as meta.json records them: tuples are lists
    with claimed(out_dir):
        meta = None if force else prepared_meta(out_dir, "anchor", settings, ANCHOR_FLAGS)
        if meta is not None:
            print(f"{out_dir} is already prepared with these settings (--force rebuilds it)")
            return meta
        rng = np.random.default_rng(task.seed)
        keys = np.arange(task.keys[0], task.keys[1] + 1)
        test_keys = np.sort(rng.choice(keys, round(task.test_key_fraction * len(keys)), replace=False))
        train_keys = np.setdiff1d(keys, test_keys)
        heldout = (PAIRS[:, 0] == task.heldout[0]) & (PAIRS[:, 1] == task.heldout[1])
        seen, held = PAIRS[~heldout], PAIRS[heldout]
        vocab_size, eot_id = anchor_vocab(task)
        record_len = task.seq_len + 1
        mask = np.zeros(record_len, np.uint8)
        mask[-1] = 1
        with building(out_dir) as replace:
            replace()
            splits = {}
            for split, n, split_keys, pairs in [("train", task.n_train, train_keys, seen),
                                                ("val", task.n_eval, train_keys, seen),
                                                ("test", task.n_eval, test_keys, seen),
                                                ("heldout", task.n_eval, keys, held)]:
                records, sources = anchor_records(task, n, split_keys, pairs, rng)
                writer = ShardWriter(out_dir, split, np.uint16, record_len * 1_000_000, with_mask=True)
                for record, source in zip(records.astype(np.uint16), sources.tolist()):
                    writer.add(record, source, mask)
                splits[split] = {**writer.close(), "records": n,
                                 "pair_counts": np.bincount(sources, minlength=len(PAIRS)).tolist()}
            meta = write_meta(out_dir, {
                "tokenizer": "anchor", "vocab_size": vocab_size, "eot_id": eot_id, "dtype": "uint16",
                "sources": [f"pair_{a}_{b}" for a, b in PAIRS.tolist()], "record_len": record_len, "splits": splits,
                "anchor": {**asdict(task), "shifts": ANCHOR_SHIFTS, "train_keys": train_keys.tolist(),
                           "test_keys": test_keys.tolist()},
            }, invocation)
            print(f"anchor task in {out_dir}: " + ", ".join(f"{k} {v['records']:,}" for k, v in splits.items())
                  + f" records of {record_len} tokens, vocab {vocab_size}")
            return meta


# -----------------------------------------------------------------------------
# Command line


def parse_range(text):
    lo, _, hi = text.partition("-")
    return int(lo), int(hi)


def parse_pair(text):
    a, _, b = text.partition(",")
    return int(a), int(b)


def fraction(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1) (0: no val split)")
    return value


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (argparse puts its usage block first): the line names
    the argument, and --help has the rest."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


# Floors of the size flags: each one stops a value that only a typo gives. A shard costs a file,
# an fsync, a 64-byte header, and in the loader an open memory map (a file descriptor) with a
# tail shorter than a window that is never trained on; 2^16 tokens (128 KB) keeps those costs
# small (a 2048-token window wastes at most 3%), where --shard-tokens 1 would write a file per token.
# A token budget under 1K is a dropped suffix (--max-tokens 2 meant as 2B would write an empty folder:
# every share rounds to 0 tokens); quick checks use 2K and up.
MIN_SHARD_TOKENS = 1 << 16
MIN_BUDGET = 1000
# A worker is a process with a tokenizer of its own: more than a few per core only adds memory, and a
# typo's --workers 100000 forks until the OOM killer ends the run.
WORKERS_PER_CORE = 4


def worker_count(text):
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"invalid int value: {text!r}") from None  # argparse's own words for an int flag
    cores = os.cpu_count() or 1
    if value > WORKERS_PER_CORE * cores:
        raise ValueError(f"must be <= {WORKERS_PER_CORE * cores} (got {text}): at most {WORKERS_PER_CORE} tokenizer "
                         f"processes per core, of the {cores} here")
    return value


def add_text_arguments(p):
    p.add_argument("--source", action="append", required=True, metavar="NAME=PATH[,key=value...]",
                   help="a text source, repeatable. PATH: file, folder (every data file under it, or one split "
                        "of a split layout: README.md configs, train/ + test/...; or save_to_disk), glob (** for "
                        "subfolders) or hf:owner/dataset. keys: weight (token share), field (json/parquet/hub "
                        "column), config and split (split layout or hub; split defaults to train), sample_by (.txt "
                        "docs: paragraph|document|line), sep (cut docs at it), max_tokens, encoding (.txt/.json "
                        "files that are not UTF-8)")
    # bytes: no download, and its 257 ids are GPTConfig's default vocab, so tiny CPU runs just work
    p.add_argument("--tokenizer", default="bytes", help="bytes, gpt2, r50k_base, cl100k_base, o200k_base")
    # None: tiktoken downloads (or finds its cache); offline clusters point this at the published files
    p.add_argument("--tokenizer-dir", help="folder with the published tokenizer files (sha256 checked)")
    # None: take all local data the weights allow; hub sources need a budget
    p.add_argument("--max-tokens", type=at_least(MIN_BUDGET, parse_count),
                   help="total token budget of the mixture (e.g. 500M, 2B)")
    # 2%: a stable val loss on a few-MB corpus; lower it for large corpora
    p.add_argument("--val-fraction", type=fraction, default=0.02,
                   help="share of each source's tokens held out by document (0: no val split)")
    p.add_argument("--seed", type=at_least(0), default=0, help="fixes document selection, val split and order")
    # one tokenizer process per usable core: tokenization is CPU-bound
    p.add_argument("--workers", type=at_least(1, worker_count), default=usable_cores(),
                   help=f"tokenizer processes (at most {WORKERS_PER_CORE} per core)")
    # 100M tokens (200 MB as uint16): few files, each cheap to map, as in nanoGPT/llm.c FineWeb shards
    p.add_argument("--shard-tokens", type=at_least(MIN_SHARD_TOKENS, parse_count), default=100_000_000,
                   help="tokens per shard file")


# What to do when writing in the output folder fails, by errno (a write that fails names no file)
WRITE_FIXES = {
    errno.EACCES: "make it writable or pass another --out",
    errno.EPERM: "make it writable or pass another --out",
    errno.EROFS: "pass an --out on a writable file system",
    errno.ENOSPC: "free space or pass an --out on another disk",
    errno.EDQUOT: "free space within the quota or pass an --out on another disk",
    errno.EFBIG: "the file-size limit (ulimit -f) is below the file: raise it (ulimit -f unlimited)",
    errno.ENOTDIR: "a folder of the path is a file: pass another --out",
    errno.EEXIST: "it is a file: pass a folder as --out",
    errno.EISDIR: "a folder stands where a file of the data goes: remove it or pass another --out",
}


def os_error_line(e, out):
    """One line for an OSError: writing in the output folder names the file and the fix, others
    the file and what the system said. A failed rename names the file renamed to (fileio.atomic_open's
    temporary name is none the user knows)."""
    name = e.filename2 or e.filename
    inside = out is not None and (name is None or os.path.commonpath(
        [os.path.realpath(name), os.path.realpath(out)]) == os.path.realpath(out))
    if inside and e.errno in WRITE_FIXES:
        return f"cannot write {name or out} ({e.strerror}): {WRITE_FIXES[e.errno]}"
    return f"{name}: {e.strerror}" if name else str(e)


def main(argv=None):
    parser = OneLineParser(description="\n\n".join(__doc__.strip().split("\n\n")[:2]),  # title + examples
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("text", help="tokenize text sources into shards")
    add_text_arguments(p)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--force", action="store_true",
                   help="rebuild a complete folder: the same settings again, or replace data prepared with others")
    p.add_argument("--keep-stale", action="store_true",
                   help="keep a complete folder whose source files changed since it was prepared (default: refuse)")

    p = commands.add_parser("bench", help="pipeline throughput vs raw tiktoken (prints numbers)")
    add_text_arguments(p)
    p.set_defaults(tokenizer="gpt2")  # a real BPE: bytes merges nothing, so it would not time the encoder

    p = commands.add_parser("anchor", help="generate the anchor-function task")
    d = AnchorTask()  # the defaults and their reasons live in the dataclass
    p.add_argument("--out", default="data/anchor", help="output folder (data/ is git-ignored)")
    p.add_argument("--seq-len", type=at_least(3), default=d.seq_len,
                   help="input tokens per sequence (>= 3: key and pair)")
    p.add_argument("--keys", type=parse_range, default=d.keys, help="key range LO-HI, inclusive")
    p.add_argument("--fillers", type=parse_range, default=d.fillers, help="filler token range LO-HI")
    p.add_argument("--test-key-fraction", type=float, default=d.test_key_fraction, help="keys held out of training")
    p.add_argument("--heldout", type=parse_pair, default=d.heldout, help="anchor pair A,B never trained")
    p.add_argument("--mirror-shift", type=int, default=d.mirror_shift, help="rule trained on the mirror pair B,A")
    p.add_argument("--key-positions", type=parse_range, default=d.key_positions,
                   help="positions LO-HI (0-based) the key may take, in every split (default: anywhere it fits)")
    p.add_argument("--n-train", type=at_least(1), default=d.n_train, help="training records")
    p.add_argument("--n-eval", type=at_least(1), default=d.n_eval, help="records per evaluation split")
    p.add_argument("--seed", type=at_least(0), default=d.seed, help="same seed, same bytes")
    p.add_argument("--force", action="store_true", help="rebuild a complete folder, also one prepared with other "
                   "settings")

    args = parser.parse_args(argv)
    args.invocation = shlex.join(["python", "prepare_data.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        if args.command == "text":
            prepare_text(args)
        elif args.command == "bench":
            benchmark(args)
        else:
            fields = {k: getattr(args, k) for k in AnchorTask.__dataclass_fields__}
            prepare_anchor(AnchorTask(**fields), args.out, args.invocation, args.force)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:
        raise SystemExit(f"error: {os_error_line(e, getattr(args, 'out', None))}") from None
    except KeyboardInterrupt as e:
        if isinstance(e, Interrupted):
            raise
        raise Interrupted("interrupted before anything was written") from None  # loading the tokenizer, ...


def stopped_by(signum, frame):
    """SIGTERM (kill PID) and SIGHUP (a closed terminal) stop a build as Ctrl-C does: what is written stays
    whole, one line says so, and the shell's 128 + the signal's number."""
    STOPPED_BY.append(signum)
    for again in (signal.SIGTERM, signal.SIGHUP):  # a second one must not cut the clean-up short
        signal.signal(again, signal.SIG_IGN)
    raise KeyboardInterrupt


STOPPED_BY = []


def cli(argv=None):
    """main as the command line runs it, the whole process (interrupt.run): Ctrl-C, SIGTERM or SIGHUP is one line
    (no traceback) and the shell's 128 + the signal's number."""
    def main_saying_the_signal():
        try:
            main(argv)
        except Interrupted as e:
            signum = STOPPED_BY[0] if STOPPED_BY else signal.SIGINT
            raise interrupt.Interrupted(str(e) if signum == signal.SIGINT else f"{signal.Signals(signum).name}: {e}",
                                        signum) from None
    for stop_signal in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop_signal, stopped_by)
    interrupt.run(main_saying_the_signal, "interrupted before anything was written")


if __name__ == "__main__":
    cli()
