"""
Data for smallinit: text corpora -> verified token shards, the loader that reads them, and the
anchor-function task (the synthetic default dataset of the quickstart).

    python prepare_data.py anchor --out data/anchor
    python prepare_data.py text --out data/en --source en=corpus/en --tokenizer bytes
    python prepare_data.py text --out data/bi --tokenizer gpt2 --tokenizer-dir tokenizers \\
        --source en=corpus/en,weight=0.5 --source 'zh=corpus/zh/*/*.txt,weight=0.5'
    python prepare_data.py text --out data/fw --tokenizer gpt2 --max-tokens 1B \\
        --source fw=hf:HuggingFaceFW/fineweb-edu,config=sample-10BT
    python prepare_data.py bench --source en=corpus/en --tokenizer gpt2 --tokenizer-dir tokenizers

A prepared folder holds meta.json and shards named {split}_{index:06d}.bin. meta.json is written
last, so a folder without it is incomplete and the loader refuses it. A shard is

    header (64 bytes): magic b"SITOKENS", format version (u32), token itemsize 2|4 (u32),
                       n_tokens (u64), n_docs (u64), has_mask (u32), zero padding
    doc table:         int64 (n_docs, 2): start offset in this shard, source id
    tokens:            uint16 | uint32 (n_tokens)
    mask:              uint8 (n_tokens), only when has_mask: 1 where the token is a loss target

Every document ends with eot_id. A document that does not fit in a shard continues in the next
one with a new doc-table row. Record datasets (the anchor task) store one fixed-length record
per document, without eot, and a mask; meta["record_len"] gives their length.

What train.py / eval.py use: load_meta, TokenLoader, check_model_vocab, get_tokenizer,
read_records and the anchor helpers anchor_fields, anchor_answer_kinds, anchor_accuracy.
"""
import argparse
import bz2
import codecs
import errno
import glob
import gzip
import hashlib
import io
import json
import lzma
import math
import multiprocessing
import os
import platform
import re
import shlex
import shutil
import signal
import struct
import sys
import tempfile
import time
from collections import deque
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from itertools import chain

import numpy as np
import tiktoken
import torch
from tqdm import tqdm

from fileio import atomic_open, atomic_write_bytes, sha256_file

FORMAT_VERSION = 1
MAGIC = b"SITOKENS"
HEADER = struct.Struct("<8sIIQQI")
HEADER_BYTES = 64  # room to grow the header without moving the data
EOT = "<|endoftext|>"

# -----------------------------------------------------------------------------
# Tokenizers


def byte_encoding():
    # Every byte is its own token and nothing merges, so the pattern only has to cut text into
    # pieces; short pieces keep tiktoken's per-piece merge loop linear.
    return tiktoken.Encoding(
        name="bytes",
        pat_str=r"[\s\S]{1,64}",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={EOT: 256},
    )


OPENAI = "https://openaipublic.blob.core.windows.net/"
# file name -> (URL tiktoken downloads it from, sha256 tiktoken_ext/openai_public.py expects)
PUBLISHED = {
    "vocab.bpe": (OPENAI + "gpt-2/encodings/main/vocab.bpe",
                  "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "encoder.json": (OPENAI + "gpt-2/encodings/main/encoder.json",
                     "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    "r50k_base.tiktoken": (OPENAI + "encodings/r50k_base.tiktoken",
                           "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"),
    "cl100k_base.tiktoken": (OPENAI + "encodings/cl100k_base.tiktoken",
                             "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"),
    "o200k_base.tiktoken": (OPENAI + "encodings/o200k_base.tiktoken",
                            "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
}
# encoding name -> file sets that provide it, as (encoding tiktoken builds from them, files).
# r50k_base has exactly gpt2's ranks and special token, so either set gives gpt2.
OFFLINE_SETS = {
    "gpt2": [("gpt2", ["vocab.bpe", "encoder.json"]), ("r50k_base", ["r50k_base.tiktoken"])],
    "r50k_base": [("r50k_base", ["r50k_base.tiktoken"])],
    "cl100k_base": [("cl100k_base", ["cl100k_base.tiktoken"])],
    "o200k_base": [("o200k_base", ["o200k_base.tiktoken"])],
}


def find_tokenizer_file(folder, name):
    # the published layout puts gpt2's two files in a gpt2/ subfolder; accept both layouts
    for path in [os.path.join(folder, name), *sorted(glob.glob(os.path.join(folder, "*", name)))]:
        if os.path.isfile(path):
            return path
    return None


def load_offline_tokenizer(name, folder):
    """Build a tiktoken encoding from published files in `folder`, after checking their sha256."""
    if name not in OFFLINE_SETS:
        raise ValueError(f"no offline file set for tokenizer {name!r}; known: {sorted(OFFLINE_SETS)} or 'bytes'")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"tokenizer folder {folder} does not exist")
    wanted = []
    for load_name, files in OFFLINE_SETS[name]:
        paths = {f: find_tokenizer_file(folder, f) for f in files}
        missing = [f for f, p in paths.items() if p is None]
        if missing:
            wanted.append(f"{' + '.join(files)} (missing: {', '.join(missing)})")
            continue
        for f, path in paths.items():
            digest = sha256_file(path)
            if digest != PUBLISHED[f][1]:
                raise ValueError(f"{path}: sha256 {digest} is not the published {PUBLISHED[f][1]} "
                                 f"of {f}; the file is corrupt or another version, replace it")
        # tiktoken reads downloads from TIKTOKEN_CACHE_DIR/<sha1 of URL> and deletes cache files
        # it dislikes, so hand it copies in a private folder rather than the user's files.
        with tempfile.TemporaryDirectory() as cache:
            for f, path in paths.items():
                shutil.copyfile(path, os.path.join(cache, hashlib.sha1(PUBLISHED[f][0].encode()).hexdigest()))
            saved = os.environ.get("TIKTOKEN_CACHE_DIR")
            os.environ["TIKTOKEN_CACHE_DIR"] = cache
            try:
                return tiktoken.get_encoding(load_name)
            finally:
                if saved is None:
                    del os.environ["TIKTOKEN_CACHE_DIR"]
                else:
                    os.environ["TIKTOKEN_CACHE_DIR"] = saved
    raise FileNotFoundError(f"tokenizer {name!r}: no complete file set in {folder}; need one of: "
                            + "; ".join(wanted))


def get_tokenizer(name, tokenizer_dir=None):
    """'bytes' (built here), or a tiktoken name: from `tokenizer_dir` when given, else downloaded."""
    if name == "bytes":
        return byte_encoding()
    if tokenizer_dir is not None:
        return load_offline_tokenizer(name, tokenizer_dir)
    if name not in tiktoken.list_encoding_names():
        raise ValueError(f"unknown tokenizer {name!r}; use 'bytes' or one of {tiktoken.list_encoding_names()}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # any network failure: the fix is the same
        sets = " or ".join(" + ".join(files) for _, files in OFFLINE_SETS.get(name, []))
        raise SystemExit(f"could not download tokenizer {name!r} ({type(e).__name__}); offline, pass "
                         f"--tokenizer-dir DIR holding {sets or 'its published files'}") from None


def cpu_name():
    """The CPU model ("Intel(R) Xeon(R) ..."), for result rows and the cached matmul peak."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores():
    # The cores this process may run on (a container's or taskset's share); macOS has no
    # sched_getaffinity, so there it is every core.
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count()


def token_dtype(vocab_size):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


# -----------------------------------------------------------------------------
# Shards: write (atomically) and read (validated, memory-mapped)


def npy_bytes(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def write_file(path, chunks):
    """fileio.atomic_write_bytes, whose errors name `path`: a failed write (a full disk, ulimit -f)
    names no file, a failed mkstemp its temporary name."""
    try:
        atomic_write_bytes(path, chunks)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), path) from None


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


@dataclass
class Shard:
    path: str
    tokens: np.ndarray  # memmap
    docs: np.ndarray    # (n_docs, 2) int64: start, source
    mask: np.ndarray | None


def read_shard(path):
    fix = "re-run prepare_data.py for this folder"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing shard {path}; {fix}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        raise ValueError(f"{path} is not a smallinit token shard (bad magic); {fix}")
    _, version, itemsize, n_tokens, n_docs, has_mask = HEADER.unpack(raw[:HEADER.size])
    if version != FORMAT_VERSION:
        raise ValueError(f"{path} has shard format version {version}, this code reads {FORMAT_VERSION}; {fix}")
    if itemsize not in (2, 4):
        raise ValueError(f"{path}: token itemsize {itemsize} is neither 2 nor 4; {fix}")
    expected = HEADER_BYTES + 16 * n_docs + itemsize * n_tokens + (n_tokens if has_mask else 0)
    if size != expected:
        raise ValueError(f"{path} is {size} bytes but its header describes {expected} "
                         f"({n_tokens} tokens, {n_docs} docs): truncated or corrupt; {fix}")
    docs = np.memmap(path, np.int64, "r", offset=HEADER_BYTES, shape=(n_docs, 2))
    offset = HEADER_BYTES + 16 * n_docs
    tokens = np.memmap(path, np.uint16 if itemsize == 2 else np.uint32, "r", offset=offset, shape=(n_tokens,))
    mask = np.memmap(path, np.uint8, "r", offset=offset + itemsize * n_tokens, shape=(n_tokens,)) if has_mask else None
    return Shard(path, tokens, docs, mask)


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


def clear_outputs(out_dir):
    """Start a (re)build: drop meta.json first, so no old meta ever vouches for new shards."""
    meta = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta):
        os.remove(meta)
    shard_names = "*_" + "[0-9]" * 6 + ".bin"  # only what ShardWriter writes: the folder may hold other files
    for pattern in (shard_names, shard_names + "*.tmp", "meta.json*.tmp"):  # fileio.atomic_open's leftovers
        for path in glob.glob(os.path.join(out_dir, pattern)):
            os.remove(path)


def write_meta(out_dir, meta, invocation):
    meta = {"format_version": FORMAT_VERSION, **meta, "command": invocation,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_file(os.path.join(out_dir, "meta.json"), [json.dumps(meta, indent=1).encode()])
    return meta


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def int_list(value):
    return isinstance(value, list) and all(is_int(v) and v >= 0 for v in value)


# What the readers (TokenLoader, train.py, eval.py) take from a data folder's meta.json, checked
# before use: the file may come from anywhere, and a wrong type would surface as a traceback deep
# in the loader. Shard names must be plain names of files in the folder, never a path out of it.
META_FIELDS = {
    "tokenizer": (lambda v: isinstance(v, str), "a tokenizer name"),
    "vocab_size": (lambda v: is_int(v) and v > 0, "a positive integer"),
    "eot_id": (lambda v: is_int(v) and v >= 0, "a token id"),
    "dtype": (lambda v: v in ("uint16", "uint32"), '"uint16" or "uint32"'),
    "sources": (lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v), "a list of source names"),
    "splits": (lambda v: isinstance(v, dict) and all(isinstance(i, dict) for i in v.values()),
               "an object of split name -> split"),
}
SPLIT_FIELDS = {  # name -> (required, check, what it must be); every list has one entry per shard
    "shards": (True, lambda v: isinstance(v, list) and all(isinstance(n, str) and SHARD_NAME.fullmatch(n) for n in v),
               "a list of shard file names (NAME_000000.bin)"),
    "shard_tokens": (True, int_list, "a list of token counts"),
    "shard_max_id": (False, int_list, "a list of token ids"),  # folders before it was recorded lack it
    "shard_sha256": (False, lambda v: isinstance(v, list) and all(isinstance(h, str) and len(h) == 64 for h in v),
                     "a list of sha256 hex digests"),
}
SHARD_NAME = re.compile(r"[\w.-]+_[0-9]{6}\.bin")


def meta_problem(meta):
    """What is wrong with a parsed data meta.json, or None."""
    if not isinstance(meta, dict):
        return f"it holds a JSON {type(meta).__name__}, not an object"
    if meta.get("format_version") != FORMAT_VERSION:
        return f"format version {meta.get('format_version')}, this code reads {FORMAT_VERSION}"
    for key, (check, what) in META_FIELDS.items():
        if key not in meta:
            return f"no {key!r}"
        if not check(meta[key]):
            return f"{key!r} is {json.dumps(meta[key])[:40]}, not {what}"
    if "record_len" in meta and not (is_int(meta["record_len"]) and meta["record_len"] >= 2):
        return f"'record_len' is {json.dumps(meta['record_len'])[:40]}, not a record length (>= 2)"
    for split, info in meta["splits"].items():
        for key, (required, check, what) in SPLIT_FIELDS.items():
            if key not in info and not required:
                continue
            if key not in info:
                return f"split {split!r} has no {key!r}"
            if not check(info[key]):
                return f"{key!r} of split {split!r} is {json.dumps(info[key])[:40]}, not {what}"
            if len(info[key]) != len(info["shards"]):
                return f"split {split!r} has {len(info['shards'])} shards but {len(info[key])} {key!r}"
    return None


def read_meta(path):
    """(meta, None), or (None, what is wrong with the file)."""
    try:
        with open(path, "rb") as f:
            meta = json.load(f)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested past the parser's depth
        return None, f"not JSON ({type(e).__name__}: {str(e)[:60]})"
    problem = meta_problem(meta)
    return (None, problem) if problem else (meta, None)


def load_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: {data_dir} is not a prepared data folder or its "
                                f"preparation did not finish; run prepare_data.py")
    meta, problem = read_meta(path)
    if problem:
        raise ValueError(f"{path} is not a data folder's meta.json: {problem}; re-run prepare_data.py "
                         f"for {data_dir} (or pass another data folder)")
    return meta


def check_model_vocab(meta, vocab_size, tokenizer=None):
    """A model must have an output for every token id in the data (a larger, padded vocab is fine)."""
    if tokenizer is not None and tokenizer != meta["tokenizer"]:
        raise ValueError(f"data was tokenized with {meta['tokenizer']!r} but the config expects "
                         f"{tokenizer!r}; prepare the data with --tokenizer {tokenizer} or change the config")
    if vocab_size < meta["vocab_size"]:
        raise ValueError(f"model vocab_size={vocab_size} is smaller than the data's vocab "
                         f"({meta['tokenizer']}, {meta['vocab_size']} ids); set vocab_size >= {meta['vocab_size']}")


def split_shards(data_dir, meta):
    """(split, shard path, index in the split) of every shard, in meta order."""
    return [(split, os.path.join(data_dir, name), i) for split, info in meta["splits"].items()
            for i, name in enumerate(info["shards"])]


def check_token_ids(data_dir, meta, vocab_size):
    """Every token id in every shard is < vocab_size: from the max ids meta.json stores, or read
    from the shards of folders written before it stored them."""
    for split, path, i in split_shards(data_dir, meta):
        stored = meta["splits"][split].get("shard_max_id")
        top = stored[i] if stored else int(np.max(read_shard(path).tokens, initial=0))
        if top >= vocab_size:
            raise ValueError(f"{path} holds token id {top} >= the model's vocab_size {vocab_size}: the shard is "
                             f"corrupt or was made with another tokenizer; re-run prepare_data.py")


def check_shard_ids(shard, meta, stored=None):
    """Read the shard's largest token id from its bytes: it must be the one prepare_data.py
    recorded (`stored`), or, for folders that predate the record, inside the data's vocab."""
    top = int(np.max(shard.tokens, initial=0))
    fix = "the shard changed after prepare_data.py wrote it; re-run prepare_data.py for this folder"
    if stored is not None and top != stored:
        raise ValueError(f"{shard.path} holds token ids up to {top}, meta.json recorded {stored}: {fix}")
    if top >= meta["vocab_size"]:
        raise ValueError(f"{shard.path} holds token id {top}, past the data's vocab ({meta['tokenizer']}, "
                         f"{meta['vocab_size']} ids): {fix}")


def data_fingerprint(data_dir, meta):
    """sha256 over every shard's sha256 (stored by prepare_data.py; hashed from the files for
    folders written before it stored them): equal iff the token data is the same."""
    digest = hashlib.sha256()
    for split, path, i in split_shards(data_dir, meta):
        stored = meta["splits"][split].get("shard_sha256")
        if stored:
            sha = stored[i]
        else:
            with open(path, "rb") as f:
                sha = hashlib.file_digest(f, "sha256").hexdigest()
        digest.update(f"{split}/{os.path.basename(path)}:{sha}\n".encode())
    return digest.hexdigest()


# -----------------------------------------------------------------------------
# Loader


class TokenLoader:
    """Batches of (T+1)-token windows, shuffled per epoch from `seed`, split across ranks.

    Text: windows start every T tokens of each shard (x positions never overlap). Records: one
    window per record and T = record_len - 1. A global step takes batch_size * world_size windows
    of the epoch's permutation, rank r the r-th slice, so ranks are disjoint and the position
    (epoch, pos) is all the state there is; pos counts windows, so it survives a change of world
    size. y == -1 where the shard's mask says the token is not a target.
    """

    def __init__(self, data_dir, split, batch_size, seq_len=None, rank=0, world_size=1, seed=0):
        self.meta = load_meta(data_dir)
        splits = self.meta["splits"]
        if split not in splits:
            raise ValueError(f"{data_dir} has no split {split!r}; it has {sorted(splits)}")
        record_len = self.meta.get("record_len")
        if record_len is not None:
            if seq_len not in (None, record_len - 1):
                raise ValueError(f"{data_dir} holds records of {record_len} tokens: use seq_len={record_len - 1}")
            seq_len, stride = record_len - 1, record_len
        elif seq_len is None:
            raise ValueError("seq_len is required for text data")
        else:
            stride = seq_len
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.batch_size, self.seq_len, self.stride = batch_size, seq_len, stride
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shards = []
        for name, n in zip(splits[split]["shards"], splits[split]["shard_tokens"]):
            shard = read_shard(os.path.join(data_dir, name))
            if len(shard.tokens) != n:
                raise ValueError(f"{shard.path} has {len(shard.tokens)} tokens, meta.json says {n}; re-run prepare_data.py")
            self.shards.append(shard)
        # The ids are checked in the bytes, not taken from meta.json: an id past the model's vocab
        # crashes a step (a device assert on CUDA). Scanning 16M uint16 tokens takes ~1.5 ms from
        # the page cache, ~17 ms from disk (hashing them, ~45 ms).
        recorded = splits[split].get("shard_max_id")
        if recorded:
            for shard, stored in zip(self.shards, recorded):
                check_shard_ids(shard, self.meta, stored)
        # Folders from before meta.json recorded max ids: each shard when a batch first reads it
        # (train.py's check_token_ids scans those at start, naming the model's vocab).
        self.unchecked = set() if recorded else set(range(len(self.shards)))
        windows = [max(0, (len(s.tokens) - seq_len - 1) // stride + 1) for s in self.shards]
        self.first_window = np.cumsum([0] + windows)
        self.n_windows = int(self.first_window[-1])
        if self.n_windows < batch_size * world_size:
            raise ValueError(f"split {split!r} of {data_dir} has {self.n_windows} windows of {seq_len + 1} "
                             f"tokens, fewer than one global batch ({batch_size} x {world_size} ranks); "
                             f"lower batch_size/seq_len or prepare more data")
        self.epoch, self.pos, self._order = 0, 0, None

    def order(self):
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, np.random.default_rng([self.seed, self.epoch]).permutation(self.n_windows))
        return self._order[1]

    def next_batch(self, with_sources=False):
        global_batch = self.batch_size * self.world_size
        if self.pos + global_batch > self.n_windows:  # drop the epoch's remainder: every step is full
            self.epoch, self.pos = self.epoch + 1, 0
        start = self.pos + self.rank * self.batch_size
        windows = self.order()[start:start + self.batch_size]
        self.pos += global_batch
        x, y, src = (np.empty((len(windows), self.seq_len), np.int64) for _ in range(3))
        shard_of = np.searchsorted(self.first_window, windows, side="right") - 1
        for s in np.unique(shard_of):  # one gather per shard: a batch of tiny records costs one call
            rows, shard = shard_of == s, self.shards[s]
            if s in self.unchecked:
                check_shard_ids(shard, self.meta)
                self.unchecked.discard(s)
            positions = (windows[rows] - self.first_window[s])[:, None] * self.stride + np.arange(self.seq_len + 1)
            chunk = shard.tokens[positions].astype(np.int64)
            targets = positions[:, 1:]
            x[rows] = chunk[:, :-1]
            y[rows] = chunk[:, 1:] if shard.mask is None else np.where(shard.mask[targets] == 1, chunk[:, 1:], -1)
            # the source of each target token: the document it lies in (a doc's eot belongs to it)
            src[rows] = shard.docs[np.searchsorted(shard.docs[:, 0], targets, side="right") - 1, 1]
        if with_sources:
            return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(src)
        return torch.from_numpy(x), torch.from_numpy(y)

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos, "n_windows": self.n_windows}

    def load_state_dict(self, state):
        if state["n_windows"] != self.n_windows:
            raise ValueError(f"loader state is for {state['n_windows']} windows, this split has "
                             f"{self.n_windows}: different data or seq_len than the checkpoint")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


def read_records(data_dir, split):
    """All records of a record split, in stored order: int64 (n_records, record_len)."""
    meta = load_meta(data_dir)
    if "record_len" not in meta:
        raise ValueError(f"{data_dir} holds text, not records")
    if split not in meta["splits"]:
        raise ValueError(f"{data_dir} has no split {split!r}; it has {sorted(meta['splits'])}")
    tokens = [np.asarray(read_shard(os.path.join(data_dir, n)).tokens) for n in meta["splits"][split]["shards"]]
    return np.concatenate(tokens).astype(np.int64).reshape(-1, meta["record_len"])


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
    split: str = "train"        # hub or folder split; a file or glob is read whole
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
        raise FileNotFoundError(f"source {source.name}: nothing matches {source.path} (expected "
                                f"{', '.join(TEXT_EXTENSIONS)} files (optionally .gz/.bz2/.xz), a folder or a glob)")
    builders = {file_builder(f) for f in files}
    if None in builders or len(builders) > 1:
        raise ValueError(f"source {source.name}: files must all be .txt, all .json/.jsonl or all "
                         f".parquet; split them into separate sources")
    return files, builders.pop()


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
    tail = suffixes.pop() if len(suffixes) == 1 else {"text": ".txt*", "json": ".json*"}.get(file_builder(files[0]), ".parquet")
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
    # datasets resolves the folder's symlinks (a macOS temp dir, a linked corpus), our listing
    # keeps the path as given: compare real paths, or every file reads as not read
    splits = builder.config.data_files or {}
    if readme_configs(folder) is not None:  # the card declares the splits: only files in none of them are news
        used = {os.path.realpath(f) for c in builder.builder_configs.values() for f in config_files(c, folder)}
        unread = [f for f in data if os.path.realpath(f) not in used]
        if unread and split in splits:
            print(f"warning: source {source.name}: {len(unread)} data files in {folder} are in no config of its "
                  f"README.md and are not read: {', '.join(unread)}; to read them, give them a --source of their "
                  f"own", file=sys.stderr)
        return
    where = {os.path.realpath(f): str(s) for s, fs in splits.items() for f in fs}
    unread = [f for f in data if where.get(os.path.realpath(f)) != split]
    if not unread or split not in splits and split != "train":  # a split asked for by name: the plain error
        return
    named = ", ".join(f + (f" (split {where[real]!r})" if real in where else " (no split)")
                      for f in unread for real in [os.path.realpath(f)])
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
    elif source.path.startswith("hf:"):
        return []
    else:
        files = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f)]
    return [[f, st.st_size, st.st_mtime_ns] for f in sorted(files) for st in [os.stat(f)]]


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
            changes.append(f"{f} changed size ({old[name, f][0]:,} -> {new[name, f][0]:,} bytes)")
        elif old[name, f] != new[name, f]:
            changes.append(f"{f} was modified (same size, new mtime)")
    return changes


def one_change(changes):
    return changes[0] + (f" (and {len(changes) - 1} more)" if len(changes) > 1 else "")


def source_layout(source):
    """'hub' (hf:ID), 'saved' / 'saved_dict' (a save_to_disk Dataset / DatasetDict), 'folder'
    (the hub layout: splits from README.md configs or from file names) or 'files' (file, glob)."""
    path = os.path.expanduser(source.path)
    if source.path.startswith("hf:"):
        return "hub"
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        return "saved_dict"
    if os.path.isfile(os.path.join(path, "state.json")):
        return "saved"
    return "folder" if os.path.isdir(path) else "files"


def split_read(source):
    """The split of the source that is read; None when it is read whole (files, a saved Dataset)."""
    if source_layout(source) in ("hub", "folder", "saved_dict"):
        return source.split
    if source.split != "train":
        raise ValueError(f"source {source.name}: {source.path} has no splits, it is read whole; "
                         f"split= picks a split of a folder, a DatasetDict or a hub dataset: drop it")
    return None


def builder_options(source, builder):
    """The Source options that datasets' `builder` (text, json, parquet...) takes."""
    options = {"sample_by": source.sample_by} if builder == "text" else {}
    if source.encoding is not None:
        if builder not in ("text", "json"):
            raise ValueError(f"source {source.name}: encoding= applies to .txt/.json files, this is "
                             f"{builder} data (stored as UTF-8): drop it")
        options["encoding"] = source.encoding
    return options


def open_source(source):
    """(dataset with .iter(batch_size), text column, local data files) of one source."""
    import datasets  # only preparation needs it; train/eval import this module for the loader

    layout, split, path = source_layout(source), split_read(source), os.path.expanduser(source.path)
    if layout in ("saved", "saved_dict"):  # load_dataset refuses these: load_from_disk reads them
        ds = datasets.load_from_disk(path)
        if layout == "saved_dict":
            if split not in ds:
                raise ValueError(f"source {source.name}: {path} has no split {split!r}; it has "
                                 f"{sorted(ds)}: pass split=NAME in --source")
            ds = ds[split]
        return ds, source.field, []
    if layout == "files":
        files, builder = source_files(source)
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
    files = [f for f in splits[split] if os.path.isfile(f)]  # local ones: hub files are URLs
    check_not_empty(source, files)
    field = "text" if builder.name == "text" else source.field
    return builder.as_streaming_dataset(split), field, files


def open_file(path):
    return COMPRESSED.get(os.path.splitext(path)[1], open)(path, "rb")


def check_not_empty(source, files):
    # datasets skips an empty file among others, and fails with a bare StopIteration when all are
    for path in files:
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
    return document_batches(source, *open_source(source), batch_size)


def document_batches(source, ds, field, files, batch_size):
    read = 0
    try:
        for batch in ds.iter(batch_size=batch_size):
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


def init_worker(tokenizer, tokenizer_dir):
    global _worker_enc
    # Ctrl-C reaches the whole process group: the main process stops the pool and says one line;
    # workers that took it too would each print a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_enc = get_tokenizer(tokenizer, tokenizer_dir)


def encode_documents(texts):
    """Tokens of the documents, each followed by eot, and the per-document lengths (eot included)."""
    ids = [_worker_enc.encode_ordinary(t) for t in texts]  # the batch API would spin up a thread pool per call
    lengths = np.fromiter((len(d) + 1 for d in ids), np.int64, len(ids))
    eot = [_worker_enc.eot_token]
    tokens = np.fromiter(chain.from_iterable(d + eot for d in ids), token_dtype(_worker_enc.n_vocab), int(lengths.sum()))
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


class LogLines:
    """A file for tqdm that is not a terminal: each refresh on a line of its own instead of a
    \r redraw, so a log file does not glue its lines together."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        text = text.replace("\r", "").rstrip()
        if text:
            self.stream.write(text + "\n")

    def flush(self):
        self.stream.flush()


def progress_bar(iterable=None, **kwargs):
    """tqdm on stderr: a live bar on a terminal, else a plain line every 30 s."""
    tty = sys.stderr.isatty()
    return tqdm(iterable, file=sys.stderr if tty else LogLines(sys.stderr), mininterval=0.5 if tty else 30,
                dynamic_ncols=tty, **kwargs)


def tokenize_source(source, pool, workers, cache_dir, dtype, fingerprint):
    """Tokenize one source into cache_dir/<name>.tokens.bin (raw `dtype`) and <name>.lengths.npy.

    Returns (tokens memmap, document lengths, (tokens, seconds) since the first result, or
    None when reused).
    fingerprint["cap"] (None: no cap) stops the read once that many tokens are in.
    A cache with a matching <name>.done.json is complete and reused (resume after a crash):
    fingerprint["files"] (source_file_stats) ties it to the files it was read from.
    """
    done = os.path.join(cache_dir, f"{source.name}.done.json")
    tokens_path = os.path.join(cache_dir, f"{source.name}.tokens.bin")
    lengths_path = os.path.join(cache_dir, f"{source.name}.lengths.npy")
    if os.path.exists(done):
        with open(done) as f:
            cached = json.load(f)
        same = cached == fingerprint
        # a marker without "files" predates them: it is not reused, and there is nothing to name
        changes = file_changes({source.name: cached["files"]}, {source.name: fingerprint["files"]}) if "files" in cached else []
        if changes and {**cached, "files": None} == {**fingerprint, "files": None}:
            print(f"{source.name}: {one_change(changes)} since the interrupted run, tokenizing again", file=sys.stderr)
        if same and os.path.exists(tokens_path) and os.path.exists(lengths_path):
            tokens, lengths = np.memmap(tokens_path, dtype, "r"), np.load(lengths_path)
            # The marker vouches for the settings; the sizes vouch for the bytes (a cache
            # truncated or edited after the marker was written is tokenized again).
            if len(tokens) == lengths.sum():
                print(f"{source.name}: reusing tokens from an interrupted run", file=sys.stderr)
                return tokens, lengths, None
            print(f"{source.name}: cached tokens are incomplete, tokenizing again", file=sys.stderr)
        os.remove(done)
    cap = fingerprint["cap"]
    lengths, count, first = [], 0, None  # first: (time, tokens) at the first result
    texts = iter_texts(source)
    # a bar when the token budget is known (a stream has no length), else a counter; atomic_open
    # fsyncs before the rename, so the file is on disk before the done marker can vouch for it
    with atomic_open(tokens_path) as raw, progress_bar(total=cap, desc=f"tokenizing {source.name}", unit="tok",
                                                       unit_scale=True) as bar:
        for tokens, lens in parallel_map(pool, encode_documents, chunk_texts(texts, 1 << 18), workers):
            try:
                raw.write(tokens.tobytes())
            except OSError as e:  # names no file: name the one the user knows
                raise OSError(e.errno, e.strerror, tokens_path) from None
            lengths.append(lens)
            count += len(tokens)
            bar.update(len(tokens) if cap is None else min(len(tokens), cap - bar.n))  # the last read overshoots
            first = first or (time.time(), count)
            if cap is not None and count >= cap:
                break
        if not lengths:  # raised inside: atomic_open then leaves no file
            raise ValueError(f"source {source.name} ({source.path}) has no non-empty documents")
    lengths = np.concatenate(lengths)
    write_file(lengths_path, [npy_bytes(lengths)])
    write_file(done, [json.dumps(fingerprint).encode()])
    # The steady rate counts from the first result on: start-up (imports, worker start, opening
    # the dataset) is a fixed cost that the pipeline's throughput at scale does not pay per token.
    return np.memmap(tokens_path, dtype, "r"), lengths, (count - first[1], time.time() - first[0])


# -----------------------------------------------------------------------------
# Mixture, validation split, shards


def normalized_weights(sources):
    weights = np.array([s.weight for s in sources], np.float64)
    if (weights <= 0).any():
        raise ValueError("source weights must be positive")
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
    finer = {"document": "sample_by=paragraph or sample_by=line (.txt files)", "paragraph": "sample_by=line (.txt files)",
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


# the command-line flag of each recorded setting, for naming what differs
SETTING_FLAGS = {"sources": "--source", "tokenizer": "--tokenizer", "max_tokens": "--max-tokens",
                 "val_fraction": "--val-fraction", "seed": "--seed", "shard_tokens": "--shard-tokens"}


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


def setting_changes(was, now):
    """'FLAG OLD -> NEW' for each setting that a folder's recorded `was` (from its meta.json, so
    anything) has otherwise than `now`."""
    was = dict(was) if isinstance(was, dict) else {}
    if recorded_sources(was.get("sources")) is not None:
        was["sources"] = recorded_sources(was["sources"])
    changes = []
    for key, flag in SETTING_FLAGS.items():
        if key not in was or was[key] != now[key]:
            old = setting_text(key, was[key]) if key in was else "(not recorded)"
            changes.append(f"{flag} {old} -> {setting_text(key, now[key])}")
    return changes


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with the one line that says what it left: prepare_data.py prints it and exits 130."""


@contextmanager
def building(out_dir):
    """A (re)build of out_dir: the old meta.json and shards go first. On a failure or Ctrl-C the
    shards written so far go too (a folder without meta.json is never read, and the rerun writes
    them again), and the folder when this build made it and nothing is left in it; complete token
    caches stay for the rerun to reuse. Ctrl-C becomes Interrupted, saying that."""
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    try:
        clear_outputs(out_dir)
        yield
    except BaseException as e:
        cache = os.path.join(out_dir, "tokenize_cache")
        with suppress(OSError):  # the failure may be the disk's: clean what can be, report the first error
            clear_outputs(out_dir)
            for folder in (cache, out_dir) if created else (cache,):
                with suppress(OSError):
                    os.rmdir(folder)  # only when empty
        if isinstance(e, KeyboardInterrupt) and not isinstance(e, Interrupted):
            kept = sorted(f[:-len(".done.json")] for f in os.listdir(cache) if f.endswith(".done.json")) \
                if os.path.isdir(cache) else []
            line = f"interrupted; {out_dir} is not prepared: the same command " + (
                f"resumes, reusing the tokens of {', '.join(kept)}" if kept else "starts over")
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
    files = {s.name: source_file_stats(s) for s in sources}  # before any read: a file changed during it is caught next time
    if os.path.exists(os.path.join(args.out, "meta.json")) and not args.force:
        meta, problem = read_meta(os.path.join(args.out, "meta.json"))
        if problem:
            raise ValueError(f"{os.path.join(args.out, 'meta.json')} is not a data folder's meta.json: {problem}; "
                             f"--force rebuilds {args.out} (dropping that file), or pass another --out")
        # Other settings would replace the data that runs trained on it are fingerprinted with
        # (their resume then fails, and eval.py scores them on other data): refuse, naming them.
        changed = setting_changes(meta.get("settings"), settings)
        if changed:
            raise ValueError(f"{args.out} was prepared with other settings: {'; '.join(changed)}; --force "
                             f"replaces its data with these, or pass another --out")
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
    with building(args.out):
        return build_text(args, sources, names, enc, settings, files)


def build_text(args, sources, names, enc, settings, files):
    start = time.time()

    # 1) tokenize each source into a cache (complete caches of an interrupted run are reused)
    cache_dir = os.path.join(args.out, "tokenize_cache")
    os.makedirs(cache_dir, exist_ok=True)
    dtype = token_dtype(enc.n_vocab)
    caches, timings = [], []
    with multiprocessing.Pool(args.workers, init_worker, (args.tokenizer, args.tokenizer_dir)) as pool:
        for s, weight in zip(sources, normalized_weights(sources)):
            caps = [c for c in (s.max_tokens, args.max_tokens and int(round(weight * args.max_tokens))) if c]
            fingerprint = {"source": asdict(s), "tokenizer": args.tokenizer, "cap": min(caps, default=None),
                           "files": files[s.name]}
            *cache, steady = tokenize_source(s, pool, args.workers, cache_dir, dtype, fingerprint)
            caches.append(cache)
            timings.append(steady or (0, 0.0))
    tokenize_seconds = time.time() - start

    # 2) mix by token weights, split by documents, write shards
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
            splits[split] = write_text_split(args.out, split, docs, caches, enc.eot_token, dtype, args.shard_tokens, rng)
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
# The anchor-function task (Zhang, Xu et al., NeurIPS 2024: "Initialization is critical to whether
# transformers fit composite functions by reasoning or memorizing")

ANCHOR_SHIFTS = {1: 5, 2: 1, 3: -2, 4: -8}  # anchor token -> its single function x + shift
SHIFT = np.zeros(max(ANCHOR_SHIFTS) + 1, np.int64)
SHIFT[list(ANCHOR_SHIFTS)] = list(ANCHOR_SHIFTS.values())
PAIRS = np.array([(a, b) for a in ANCHOR_SHIFTS for b in ANCHOR_SHIFTS], np.int64)  # source id = row


@dataclass
class AnchorTask:
    seq_len: int = 9                 # input tokens per sequence: the paper's length
    keys: tuple = (20, 99)           # key range (inclusive): the paper's
    fillers: tuple = (20, 99)        # filler range: the keys' range, so only the anchors mark the key
    test_key_fraction: float = 0.2   # keys never trained with any pair: seen pairs are tested on them
    heldout: tuple = (4, 3)          # the pair that never appears in training
    mirror_shift: int = -6           # its mirror (3,4) is trained with x-6 instead of the composite x-10
    key_positions: tuple = None      # (LO, HI) positions the key may take; None: anywhere it fits, 0..seq_len-3
    n_train: int = 20000             # issue 6's probe: 20k samples show the effect in minutes on 2 cores
    n_eval: int = 2000               # per evaluation split: answer shares to about +-1%
    seed: int = 0                    # fixes keys split, positions and fillers: same seed, same bytes

    @property
    def mirror(self):
        return (self.heldout[1], self.heldout[0])

    @property
    def positions(self):
        return tuple(self.key_positions) if self.key_positions is not None else (0, self.seq_len - 3)


def anchor_vocab(task):
    """(vocab_size, eot_id). Targets reach max key + 10 = 109 with the defaults, so ids 0..99 do not
    suffice: the vocab is the largest id + eot, rounded up to a multiple of 64 (128 by default)."""
    top = max(task.keys[1], task.fillers[1], task.keys[1] + max(int(SHIFT[PAIRS].sum(1).max()), task.mirror_shift))
    return -(-(top + 2) // 64) * 64, top + 1


def anchor_targets(task, key, a, b):
    target = key + SHIFT[a] + SHIFT[b]
    mirror = (a == task.mirror[0]) & (b == task.mirror[1])
    return np.where(mirror, key + task.mirror_shift, target)


def anchor_records(task, n, keys, pairs, rng):
    """n records: seq_len inputs (fillers; the key then the pair at a random position) + the target."""
    key = rng.choice(keys, n)
    pair = pairs[rng.integers(len(pairs), size=n)]
    pos = rng.integers(task.positions[0], task.positions[1] + 1, size=n)
    records = rng.integers(task.fillers[0], task.fillers[1] + 1, size=(n, task.seq_len + 1))
    rows = np.arange(n)
    records[rows, pos], records[rows, pos + 1], records[rows, pos + 2] = key, pair[:, 0], pair[:, 1]
    records[:, -1] = anchor_targets(task, key, pair[:, 0], pair[:, 1])
    return records, (pair[:, 0] - 1) * len(ANCHOR_SHIFTS) + pair[:, 1] - 1


def check_anchor_task(task):
    if task.keys[0] > task.keys[1] or task.fillers[0] > task.fillers[1]:
        raise ValueError(f"ranges go LO-HI: keys {task.keys}, fillers {task.fillers}")
    lowest = min(task.keys[0], task.fillers[0])
    if lowest <= max(ANCHOR_SHIFTS):
        raise ValueError(f"keys and fillers must be above the anchor tokens 1..{max(ANCHOR_SHIFTS)}")
    if task.keys[0] + min(int(SHIFT[PAIRS].sum(1).min()), task.mirror_shift) < 0:
        raise ValueError(f"key {task.keys[0]} composed with the anchors goes below token 0; raise the key range")
    if task.seq_len < 3:
        raise ValueError("seq_len must hold the key and the anchor pair (>= 3)")
    if not 0 <= task.positions[0] <= task.positions[1] <= task.seq_len - 3:
        raise ValueError(f"key positions {task.positions[0]}-{task.positions[1]} must lie in 0-{task.seq_len - 3}: "
                         f"the key and its pair must fit in the {task.seq_len} inputs")
    if tuple(task.heldout) not in {tuple(p) for p in PAIRS.tolist()} or task.heldout == task.mirror:
        raise ValueError(f"held-out pair {task.heldout} must be two different anchors from {list(ANCHOR_SHIFTS)}")
    if not 0 < round(task.test_key_fraction * (task.keys[1] - task.keys[0] + 1)) < task.keys[1] - task.keys[0] + 1:
        raise ValueError("test_key_fraction must leave at least one train key and one test key")


def prepare_anchor(task, out_dir, invocation):
    """Splits: train (train keys, seen pairs), val (fresh samples of the same), test (test keys,
    seen pairs), heldout (the held-out pair on all keys; its stored target is the composite,
    i.e. the inferential answer). Loss only on the last token of each record."""
    check_anchor_task(task)
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
    with building(out_dir):
        splits = {}
        for split, n, split_keys, pairs in [("train", task.n_train, train_keys, seen),
                                            ("val", task.n_eval, train_keys, seen),
                                            ("test", task.n_eval, test_keys, seen), ("heldout", task.n_eval, keys, held)]:
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


def anchor_fields(records):
    """(key, a, b, target) of each record (n, record_len): the pair is the first anchor token and
    the one after it (fillers are never anchors), the key the token before."""
    records = np.asarray(records, np.int64)
    inputs = records[:, :-1]
    first = ((inputs >= 1) & (inputs <= max(ANCHOR_SHIFTS))).argmax(1)
    rows = np.arange(len(records))
    return inputs[rows, first - 1], inputs[rows, first], inputs[rows, first + 1], records[:, -1]


def anchor_answer_kinds(records, predictions, meta):
    """Shares of answers that are inferential (the composite f_b(f_a(x))), symmetric (the rule
    trained on the mirror pair, x + mirror_shift) or other. Meant for the heldout split, with
    `predictions` the model's argmax at the last input position (n,)."""
    key, a, b, _ = anchor_fields(records)
    pred = np.asarray(predictions, np.int64)
    inferential = pred == key + SHIFT[a] + SHIFT[b]
    symmetric = (pred == key + meta["anchor"]["mirror_shift"]) & ~inferential
    return {"inferential": float(inferential.mean()), "symmetric": float(symmetric.mean()),
            "other": float(1 - inferential.mean() - symmetric.mean()), "n": len(pred)}


def anchor_accuracy(records, predictions):
    """Share of answers equal to the stored target (for the train/val/test splits: the trained rule)."""
    return float((np.asarray(predictions, np.int64) == np.asarray(records, np.int64)[:, -1]).mean())


# -----------------------------------------------------------------------------
# Command line


def parse_range(text):
    lo, _, hi = text.partition("-")
    return int(lo), int(hi)


def parse_pair(text):
    a, _, b = text.partition(",")
    return int(a), int(b)


def at_least(low, parse=int):
    """An argparse type: parse(text), refused below `low` before anything runs (--shard-tokens 0
    would loop forever filling a shard of no tokens)."""
    def check(text):
        try:
            value = parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer" if parse is int else str(e)) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"got {text}, need {low} or more")
        return value
    return check


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
# small (a 2048-token window wastes at most 3%), where --shard-tokens 1 wrote a file per token.
# A token budget under 1K is a dropped suffix (--max-tokens 2 for 2B wrote an empty folder: every
# share rounded to 0 tokens); quick checks use 2K and up.
MIN_SHARD_TOKENS = 1 << 16
MIN_BUDGET = 1000


def add_text_arguments(p):
    p.add_argument("--source", action="append", required=True, metavar="NAME=PATH[,key=value...]",
                   help="a text source, repeatable. PATH: file, folder (hub layout or save_to_disk), glob or "
                        "hf:owner/dataset. keys: weight (token share), field (json/parquet/hub column), config "
                        "and split (folder or hub; split defaults to train), sample_by (.txt docs: "
                        "paragraph|document|line), sep (cut docs at it), max_tokens, encoding (.txt/.json files "
                        "that are not UTF-8)")
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
    p.add_argument("--workers", type=at_least(1), default=usable_cores(), help="tokenizer processes")
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
}


def os_error_line(e, out):
    """One line for an OSError: writing in the output folder names the file and the fix, others
    the file and what the system said."""
    inside = out is not None and (e.filename is None or os.path.commonpath(
        [os.path.realpath(e.filename), os.path.realpath(out)]) == os.path.realpath(out))
    if inside and e.errno in WRITE_FIXES:
        return f"cannot write {e.filename or out} ({e.strerror}): {WRITE_FIXES[e.errno]}"
    return f"{e.filename}: {e.strerror}" if e.filename else str(e)


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
    p.set_defaults(tokenizer="gpt2")  # the reference measurement

    p = commands.add_parser("anchor", help="generate the anchor-function task")
    d = AnchorTask()  # the defaults and their reasons live in the dataclass
    p.add_argument("--out", default="data/anchor", help="output folder (data/ is git-ignored)")
    p.add_argument("--seq-len", type=at_least(3), default=d.seq_len, help="input tokens per sequence (>= 3: key and pair)")
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

    args = parser.parse_args(argv)
    args.invocation = shlex.join(["python", "prepare_data.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        if args.command == "text":
            prepare_text(args)
        elif args.command == "bench":
            benchmark(args)
        else:
            fields = {k: getattr(args, k) for k in AnchorTask.__dataclass_fields__}
            prepare_anchor(AnchorTask(**fields), args.out, args.invocation)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:
        raise SystemExit(f"error: {os_error_line(e, getattr(args, 'out', None))}") from None
    except KeyboardInterrupt as e:
        if isinstance(e, Interrupted):
            raise
        raise Interrupted("interrupted before anything was written") from None  # loading the tokenizer, ...


if __name__ == "__main__":
    try:
        main()
    except Interrupted as e:  # Ctrl-C: one line (no traceback), and the shell's code for SIGINT
        print(e, file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
