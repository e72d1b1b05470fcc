"""
A prepared data folder, read: the token-shard format, meta.json and its checks, the loader, the
tokenizers, and the data's fingerprint. prepare_data.py writes such folders; train.py, eval.py,
downstream.py and the checkpoint readers read them through this file alone, which imports no
`datasets` and nothing of the project but fileio.py.

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
"""
import glob
import hashlib
import json
import os
import re
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
import tiktoken
from tqdm import tqdm

from fileio import NotOwnFile, open_regular, parse_json, path_kind, sha256_file

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
    kind = path_kind(folder)
    if kind != "a folder":
        error = FileNotFoundError if kind is None else ValueError
        raise error(f"tokenizer folder {folder} {'does not exist' if kind is None else 'is ' + kind}: pass the "
                    f"folder holding the published tokenizer files (e.g. the offline data kit's tokenizers/)")
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


# -----------------------------------------------------------------------------
# Shards and meta.json: read and checked


@dataclass
class Shard:
    path: str
    tokens: np.ndarray  # memmap
    docs: np.ndarray    # (n_docs, 2) int64: start, source
    mask: np.ndarray | None


def read_shard(path):
    fix = "re-run prepare_data.py for this folder"
    kind = path_kind(path)
    if kind is None:
        raise FileNotFoundError(f"missing shard {path}; {fix}")
    if kind != "a file":  # a FIFO would block the read, a device (a link to /dev/zero) read forever
        raise ValueError(f"shard {path} is {kind}, not a token shard file; {fix}")
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
        with os.fdopen(open_regular(path), "rb") as f:  # a FIFO planted as meta.json would block open()
            meta = parse_json(f.read())
    except NotOwnFile as e:
        return None, e.strerror
    except ValueError as e:  # not JSON, not UTF-8, or nested past the decoder's depth (parse_json)
        return None, f"not JSON ({type(e).__name__}: {str(e)[:60]})"
    problem = meta_problem(meta)
    return (None, problem) if problem else (meta, None)


def load_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    kind = path_kind(path)
    if kind is None:
        raise FileNotFoundError(f"{path} not found: {data_dir} is not a prepared data folder or its "
                                f"preparation did not finish; run prepare_data.py")
    if kind != "a file":
        raise ValueError(f"{path} is {kind}, not a data folder's meta.json; re-run prepare_data.py for {data_dir} "
                         f"(or pass another data folder)")
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
            sha = sha256_file(path)
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
        assert 0 <= rank < world_size, f"rank {rank} of world_size {world_size}"
        self.batch_size, self.seq_len, self.stride = batch_size, seq_len, stride
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shards = []
        for name, n in zip(splits[split]["shards"], splits[split]["shard_tokens"]):
            shard = read_shard(os.path.join(data_dir, name))
            if len(shard.tokens) != n:
                raise ValueError(f"{shard.path} has {len(shard.tokens)} tokens, meta.json says {n}; "
                                 "re-run prepare_data.py")
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
        import torch  # here, not at the top: prepare_data.py reads this module and needs no torch (~1.7 s a start)
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
# Progress over what is read: eval.py's batches and benchmark items, prepare_data.py's tokenizing


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
