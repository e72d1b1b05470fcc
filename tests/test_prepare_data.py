"""prepare_data.py: tokenizers, shards, mixture, val split, crash safety, loader, anchor task.

Tests write their own small corpora; the ones that need the offline kit (../shared/data) skip
with a reason when it is absent.
"""
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import anchor as A
import data as D
import prepare_data as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared", "data")
needs_shared = pytest.mark.skipif(not os.path.isdir(SHARED), reason="offline kit ../shared/data is absent")


def write_jsonl(path, texts, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({field: t}) + "\n")
    return path


def random_docs(n, alphabet, seed, lo=20, hi=120):
    rng = random.Random(seed)
    # the first character tells the alphabet (so the source) of a document, the tail makes it unique
    return ["".join(rng.choice(alphabet.strip()) + rng.choice(alphabet) for _ in range(rng.randint(lo, hi) // 2))
            + f" #{i}" for i in range(n)]


def prepare(out, *sources, **options):
    """Run the CLI in-process: prepare(out, "a=path,weight=1", tokenizer="bytes", val_fraction=0)."""
    argv = ["text", "--out", str(out), "--workers", str(options.pop("workers", 1))]
    for s in sources:
        argv += ["--source", s]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    P.main(argv)
    return D.load_meta(str(out))


def split_stream(out, split):
    """All tokens of a split, read straight from the files (not through the loader)."""
    meta = D.load_meta(str(out))
    return np.concatenate([np.asarray(D.read_shard(os.path.join(out, n)).tokens) for n in meta["splits"][split]["shards"]])


def decoded_docs(out, split):
    """Documents of a split: the byte-level stream cut at eot (256), every document ends with one."""
    stream = split_stream(out, split).tolist()
    assert stream[-1] == 256
    docs, current = [], []
    for t in stream:
        if t == 256:
            docs.append(bytes(current).decode("utf-8"))
            current = []
        else:
            current.append(t)
    return docs


# ---------------------------------------------------------------- tokenizers


def test_byte_level_encoding():
    enc = D.get_tokenizer("bytes")
    text = "héllo, 世界\n\tend <|endoftext|>"
    ids = enc.encode_ordinary(text)
    assert ids == list(text.encode("utf-8"))  # literal special-token text stays plain bytes
    assert enc.decode(ids) == text
    assert (enc.n_vocab, enc.eot_token) == (257, 256)
    assert enc.encode(D.EOT, allowed_special="all") == [256]


def test_offline_tokenizer_names_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        D.get_tokenizer("gpt2", str(tmp_path))
    assert "encoder.json" in str(e.value) and "r50k_base.tiktoken" in str(e.value)
    (tmp_path / "vocab.bpe").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"missing: encoder\.json"):
        D.get_tokenizer("gpt2", str(tmp_path))


def test_offline_tokenizer_rejects_wrong_hash(tmp_path):
    bad = tmp_path / "cl100k_base.tiktoken"
    bad.write_bytes(b"aGVsbG8= 0\n")  # well-formed, but not the published file
    with pytest.raises(ValueError) as e:
        D.get_tokenizer("cl100k_base", str(tmp_path))
    assert str(bad) in str(e.value) and "sha256" in str(e.value)


@needs_shared
def test_offline_tokenizer_from_kit_and_tampered_copy(tmp_path):
    kit = os.path.join(SHARED, "tokenizers")
    # values published in the kit's README, measured with tiktoken's own downloads
    assert D.get_tokenizer("gpt2", kit).encode_ordinary("hello world") == [31373, 995]
    assert D.get_tokenizer("cl100k_base", kit).encode_ordinary("hello world") == [15339, 1917]
    # only the r50k file: gpt2 still loads (same ranks), and one flipped byte is rejected
    shutil.copy(os.path.join(kit, "r50k_base.tiktoken"), tmp_path)
    enc = D.get_tokenizer("gpt2", str(tmp_path))
    assert enc.encode_ordinary("hello world") == [31373, 995] and enc.eot_token == 50256
    data = bytearray((tmp_path / "r50k_base.tiktoken").read_bytes())
    data[100] ^= 1
    (tmp_path / "r50k_base.tiktoken").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="r50k_base.tiktoken: sha256"):
        D.get_tokenizer("gpt2", str(tmp_path))


# ---------------------------------------------------------------- shards and meta

SMALL_SHARDS = 100  # --shard-tokens' floor (2^16) is for real corpora: a test corpus spans shards below it


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(P, "MIN_SHARD_TOKENS", SMALL_SHARDS)


def test_round_trip_text_to_loader(tmp_path, small_shards):
    docs = random_docs(40, "abcdefgh ijklmn\n", seed=0) + ["ünïcödé 世界"]
    meta = prepare(tmp_path / "out", f"a={write_jsonl(tmp_path / 'a.jsonl', docs)}", val_fraction=0, shard_tokens=500)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_id"], meta["dtype"]) == ("bytes", 257, 256, "uint16")
    assert len(meta["splits"]["train"]["shards"]) > 1  # documents cross shard boundaries
    assert sorted(decoded_docs(tmp_path / "out", "train")) == sorted(docs)
    stream = split_stream(tmp_path / "out", "train")
    assert len(stream) == sum(len(d.encode()) + 1 for d in docs)
    # the loader serves exactly the T-token chunks of each shard (windows never straddle shards)
    T = 16
    loader = D.TokenLoader(str(tmp_path / "out"), "train", batch_size=1, seq_len=T)
    expected = []
    for name in meta["splits"]["train"]["shards"]:
        tokens = np.asarray(D.read_shard(os.path.join(tmp_path / "out", name)).tokens, np.int64)
        expected += [tuple(tokens[i:i + T + 1]) for i in range(0, len(tokens) - T, T)]
    got = []
    for _ in range(loader.n_windows):
        x, y = loader.next_batch()
        assert x.dtype == y.dtype == torch.int64 and x.shape == (1, T)
        assert torch.equal(x[0, 1:], y[0, :-1])
        got.append(tuple(x[0].tolist()) + (y[0, -1].item(),))
    assert sorted(got) == sorted(expected)


def test_json_list_field_and_parquet_sources(tmp_path):
    poems = [{"title": "t1", "paragraphs": ["line one", "line two"]}, {"title": "t2", "paragraphs": ["solo"]}]
    (tmp_path / "poems.json").write_text(json.dumps(poems), encoding="utf-8")
    import pyarrow as pa  # installed with datasets
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"content": ["parquet doc one", "parquet doc two"]}), tmp_path / "p.parquet")
    prepare(tmp_path / "json", f"poems={tmp_path / 'poems.json'},field=paragraphs", val_fraction=0)
    assert sorted(decoded_docs(tmp_path / "json", "train")) == ["line one\nline two", "solo"]
    prepare(tmp_path / "pq", f"pq={tmp_path / 'p.parquet'},field=content", val_fraction=0)
    assert sorted(decoded_docs(tmp_path / "pq", "train")) == ["parquet doc one", "parquet doc two"]


def test_txt_paragraphs_glob_and_separator(tmp_path):
    (tmp_path / "b1.txt").write_text("first para\nstill first\n\nsecond para\n", encoding="utf-8")
    (tmp_path / "b2.txt").write_text("story one<|endoftext|>\nstory two\n", encoding="utf-8")
    prepare(tmp_path / "p", f"b={tmp_path / 'b1.txt'}", val_fraction=0)
    assert sorted(decoded_docs(tmp_path / "p", "train")) == ["first para\nstill first", "second para\n"]
    prepare(tmp_path / "s", f"b={tmp_path / 'b*.txt'},sample_by=document,sep=<|endoftext|>", val_fraction=0)
    assert sorted(decoded_docs(tmp_path / "s", "train")) == sorted(
        ["first para\nstill first\n\nsecond para", "story one", "story two"])


def make_shard_folder(tmp_path):
    prepare(tmp_path / "out", f"a={write_jsonl(tmp_path / 'a.jsonl', random_docs(30, 'abc', 1))}", val_fraction=0)
    return tmp_path / "out", str(tmp_path / "out" / "train_000000.bin")


def test_header_and_size_validation(tmp_path):
    out, shard = make_shard_folder(tmp_path)
    good = open(shard, "rb").read()
    with open(shard, "wb") as f:
        f.write(good[:-1])
    with pytest.raises(ValueError, match="truncated") as e:
        D.TokenLoader(str(out), "train", 2, 8)
    assert shard in str(e.value)
    with open(shard, "wb") as f:
        f.write(b"PK\x03\x04 not a shard" + good[20:])
    with pytest.raises(ValueError, match="not a smallinit token shard") as e:
        D.read_shard(shard)
    assert shard in str(e.value)
    with open(shard, "wb") as f:
        f.write(good[:8] + (99).to_bytes(4, "little") + good[12:])
    with pytest.raises(ValueError, match="format version 99"):
        D.read_shard(shard)
    # a valid shard with other contents than meta.json describes
    P.write_shard(shard, np.zeros(5, np.uint16), np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match="meta.json says"):
        D.TokenLoader(str(out), "train", 1, 2)
    os.remove(out / "meta.json")
    with pytest.raises(FileNotFoundError, match="meta.json not found"):
        D.load_meta(str(out))


def edit_ids(shard, edit):
    """Edit a shard's token ids in place, header untouched: what a stray write or a bad copy does."""
    n_tokens, n_docs = (int(v) for v in D.HEADER.unpack(open(shard, "rb").read(D.HEADER.size))[3:5])
    tokens = np.memmap(shard, np.uint16, "r+", offset=D.HEADER_BYTES + 16 * n_docs, shape=(n_tokens,))
    edit(tokens)
    tokens.flush()


def set_every_50th_id(shard, value):
    edit_ids(shard, lambda tokens: tokens.__setitem__(slice(None, None, 50), value))


def test_loader_checks_the_token_ids_in_the_shard_bytes(tmp_path):
    """meta.json still vouches for the shard (its max id and sha256), the bytes hold ids past
    the vocab: the loader (train.py's and eval.py's) refuses when it opens the shard."""
    out, shard = make_shard_folder(tmp_path)
    D.TokenLoader(str(out), "train", 2, 8)
    set_every_50th_id(shard, 300)
    with pytest.raises(ValueError) as e:
        D.TokenLoader(str(out), "train", 2, 8)
    assert str(e.value) == (f"{shard} holds token ids up to 300, meta.json recorded 256: the shard changed after "
                            f"prepare_data.py wrote it; re-run prepare_data.py for this folder")
    edit_ids(shard, lambda tokens: tokens.__setitem__(tokens > 99, 97))  # ids in range, the largest not the recorded one
    with pytest.raises(ValueError, match="holds token ids up to 99, meta.json recorded 256"):
        D.TokenLoader(str(out), "train", 2, 8)
    # a folder from before meta.json recorded max ids: checked against the vocab when a batch first reads the shard
    meta = json.loads((out / "meta.json").read_text())
    del meta["splits"]["train"]["shard_max_id"]
    (out / "meta.json").write_text(json.dumps(meta))
    set_every_50th_id(shard, 300)
    loader = D.TokenLoader(str(out), "train", 2, 8)
    with pytest.raises(ValueError) as e:
        loader.next_batch()
    assert str(e.value) == (f"{shard} holds token id 300, past the data's vocab (bytes, 257 ids): the shard changed "
                            f"after prepare_data.py wrote it; re-run prepare_data.py for this folder")


def test_loader_argument_errors(tmp_path):
    out, _ = make_shard_folder(tmp_path)
    with pytest.raises(ValueError, match="no split 'val'"):
        D.TokenLoader(str(out), "val", 2, 8)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        D.TokenLoader(str(out), "train", 10_000, 8)
    meta = D.load_meta(str(out))
    D.check_model_vocab(meta, 257)
    D.check_model_vocab(meta, 320, tokenizer="bytes")  # padded vocab is fine
    with pytest.raises(ValueError, match="vocab_size >= 257"):
        D.check_model_vocab(meta, 256)
    with pytest.raises(ValueError, match="tokenized with 'bytes'"):
        D.check_model_vocab(meta, 50304, tokenizer="gpt2")


def test_bad_source_specs_are_one_line_errors(tmp_path):
    with pytest.raises(SystemExit, match="unknown option 'wieght'"):
        P.main(["text", "--out", str(tmp_path / "o"), "--source", "a=x.txt,wieght=2"])
    with pytest.raises(SystemExit, match="nothing matches"):
        P.main(["text", "--out", str(tmp_path / "o"), "--source", f"a={tmp_path}/none/*.txt"])
    with pytest.raises(SystemExit, match="give it max_tokens"):
        P.main(["text", "--out", str(tmp_path / "o"), "--source", "a=hf:org/data"])
    path = write_jsonl(tmp_path / "c.jsonl", ["x y z"], field="content")
    with pytest.raises(SystemExit, match="no field 'text'.*content"):
        P.main(["text", "--out", str(tmp_path / "o"), "--workers", "1", "--source", f"a={path}"])


# ---------------------------------------------------------------- data stored the way `datasets` users store it


def encoded(texts):
    """The byte tokenizer's documents, encoded here independently: UTF-8 bytes, then eot (256)."""
    return sorted(tuple(t.encode("utf-8")) + (256,) for t in texts)


def split_documents(out, split):
    """The documents of a prepared split as token tuples, each ending with its eot."""
    stream = split_stream(out, split).tolist()
    cuts = [i + 1 for i, t in enumerate(stream) if t == 256]
    assert cuts and cuts[-1] == len(stream)
    return sorted(tuple(stream[a:b]) for a, b in zip([0] + cuts, cuts))


@pytest.fixture
def splits():
    """Texts of three splits; no text appears in two of them."""
    return {"train": random_docs(40, "abcdef ", seed=20), "test": random_docs(10, "uvwxyz ", seed=21),
            "validation": random_docs(10, "ghijkl ", seed=22)}


def write_readme_layout(root, splits):
    """The hub layout: data/{split}-00000-of-00001.parquet and a README.md declaring the config
    `default` with train and test, and a second config `val_only` with the validation file."""
    import datasets
    (root / "data").mkdir(parents=True)
    for split, texts in splits.items():
        datasets.Dataset.from_dict({"text": texts}).to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n"
        "  - split: test\n    path: data/test-*\n- config_name: val_only\n  data_files:\n"
        "  - split: train\n    path: data/validation-*\n---\n# a dataset card\n")
    datasets.Dataset.from_dict({"text": ["in no config"]}).to_parquet(str(root / "data" / "extra.parquet"))
    return (f"warning: source h: 1 data files in {root} are in no config of its README.md and are not read: "
            f"{root / 'data' / 'extra.parquet'}; to read them, give them a --source of their own")


def write_file_name_layout(root, splits):
    """No README: datasets assigns splits from the file names; gzipped json lines. Once a file
    names a split, a file that names none (notes) is not read."""
    import datasets
    (root / "data").mkdir(parents=True)
    for split, texts in [*splits.items(), ("notes", ["names no split"])]:
        datasets.Dataset.from_dict({"text": texts}).to_json(str(root / "data" / f"{split}.jsonl.gz"), compression="gzip")
    return (f"warning: source h: datasets splits {root} by file names (train, validation, test) and reads split "
            f"'train', so 3 of its 4 data files are not read: {root / 'data' / 'notes.jsonl.gz'} (no split), "
            f"{root / 'data' / 'test.jsonl.gz'} (split 'test'), {root / 'data' / 'validation.jsonl.gz'} (split "
            f"'validation'); to read every file, pass a glob: --source 'h={root}/**/*.jsonl.gz'")


@pytest.mark.parametrize("write", [write_readme_layout, write_file_name_layout])
def test_hub_layout_folder_reads_exactly_one_split(tmp_path, splits, capsys, write):
    warning = write(tmp_path / "hub", splits)
    meta = prepare(tmp_path / "default", f"h={tmp_path / 'hub'}", val_fraction=0)
    assert split_documents(tmp_path / "default", "train") == encoded(splits["train"])  # no test text leaks in
    assert meta["source_stats"]["h"]["split"] == "train"
    out, err = capsys.readouterr()
    assert f"(split 'train' of {tmp_path / 'hub'})" in out
    assert warning in err.splitlines(), err  # every file not read is named
    prepare(tmp_path / "test", f"h={tmp_path / 'hub'},split=test", val_fraction=0)
    assert split_documents(tmp_path / "test", "train") == encoded(splits["test"])
    assert f"(split 'test' of {tmp_path / 'hub'})" in capsys.readouterr().out
    if write is write_readme_layout:  # a second config of the card
        prepare(tmp_path / "cfg", f"h={tmp_path / 'hub'},config=val_only", val_fraction=0)
        assert split_documents(tmp_path / "cfg", "train") == encoded(splits["validation"])
    with pytest.raises(SystemExit, match=r"no split 'dev'; datasets finds \[.*'test'.*\].*pass split=NAME"):
        prepare(tmp_path / "x", f"h={tmp_path / 'hub'},split=dev")


def test_folder_files_that_split_inference_drops_are_all_named_with_a_glob_that_reads_them(tmp_path, capsys):
    books = tmp_path / "books"  # plain .txt files, one of which happens to name a split
    books.mkdir()
    for name, text in [("book1.txt", "one\n"), ("book2.txt", "two\n"), ("validation_notes.txt", "three\n")]:
        (books / name).write_text(text)
    prepare(tmp_path / "all", f"b={books},sample_by=line", val_fraction=0)  # one split named: no layout, all read
    assert sorted(decoded_docs(tmp_path / "all", "train")) == ["one", "three", "two"]

    (books / "train_a.txt").write_text("four\n")  # now a train split exists: the rest is dropped, with a warning
    capsys.readouterr()
    prepare(tmp_path / "train", f"b={books}", val_fraction=0)
    assert decoded_docs(tmp_path / "train", "train") == ["four\n"]
    assert capsys.readouterr().err.splitlines()[0] == (
        f"warning: source b: datasets splits {books} by file names (train, validation) and reads split 'train', so 3 "
        f"of its 4 data files are not read: {books / 'book1.txt'} (no split), {books / 'book2.txt'} (no split), "
        f"{books / 'validation_notes.txt'} (split 'validation'); to read every file, pass a glob: "
        f"--source 'b={books}/**/*.txt'")


# The offline kit's corpus/en: three corpora side by side, one of them with a train and a validation file
KIT_EN = ["gutenberg/moby_dick.txt", "gutenberg/pride_and_prejudice.txt", "gutenberg/war_and_peace.txt",
          "tinyshakespeare/input.txt", "tinystories/tinystories_train_prefix_2MiB.txt",
          "tinystories/tinystories_validation_head.txt"]


def write_named_files(root, names):
    """One file per name, holding one line: its own name (so a document tells the file it came from)."""
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name + "\n")


def test_a_folder_without_a_split_layout_is_read_whole(tmp_path, capsys):
    en = tmp_path / "en"
    write_named_files(en, KIT_EN)
    meta = prepare(tmp_path / "kit", f"en={en},sample_by=line", val_fraction=0)
    assert sorted(decoded_docs(tmp_path / "kit", "train")) == sorted(KIT_EN)  # all 6 files, not the 1 named train
    assert meta["source_stats"]["en"]["split"] is None
    out, err = capsys.readouterr()
    assert f"(all of {en})" in out
    stories = en / "tinystories"  # the split names are said, with how to read one split of that folder
    assert err.splitlines()[0] == (
        f"note: source en: all 6 data files of {en} are read, tinystories/tinystories_train_prefix_2MiB.txt (train), "
        f"tinystories/tinystories_validation_head.txt (validation) too: their split names lay out {stories} only; to "
        f"read one split of it, pass --source en={stories},split=NAME,sample_by=line"), err
    prepare(tmp_path / "stories", f"en={stories},split=validation,sample_by=line", val_fraction=0)
    assert decoded_docs(tmp_path / "stories", "train") == ["tinystories/tinystories_validation_head.txt"]
    with pytest.raises(SystemExit, match="has no splits, it is read whole.*drop it"):
        prepare(tmp_path / "x", f"en={en},split=validation")
    with pytest.raises(SystemExit, match="config= picks a config that a README.md declares.*drop it"):
        prepare(tmp_path / "x", f"en={en},config=default")
    (stories / "tinystories_validation_head.txt").unlink()  # one file named like *_train_* is no layout either
    capsys.readouterr()
    prepare(tmp_path / "one", f"en={en},sample_by=line", val_fraction=0)
    assert sorted(decoded_docs(tmp_path / "one", "train")) == sorted(KIT_EN[:5])
    assert "note:" not in capsys.readouterr().err


def test_a_folder_of_split_folders_reads_one_split_and_names_the_rest(tmp_path, capsys):
    root = tmp_path / "layout"
    write_named_files(root, ["train/a.txt", "train/b.txt", "test/c.txt", "notes.txt"])
    prepare(tmp_path / "o", f"l={root},sample_by=line", val_fraction=0)
    assert sorted(decoded_docs(tmp_path / "o", "train")) == ["train/a.txt", "train/b.txt"]  # no test file leaks in
    assert capsys.readouterr().err.splitlines()[0] == (  # every file not read is named; the fix keeps the options
        f"warning: source l: datasets splits {root} by file names (train, test) and reads split 'train', so 2 of its "
        f"4 data files are not read: {root / 'notes.txt'} (no split), {root / 'test' / 'c.txt'} (split 'test'); to "
        f"read every file, pass a glob: --source 'l={root}/**/*.txt,sample_by=line'")
    prepare(tmp_path / "t", f"l={root},split=test,sample_by=line", val_fraction=0)
    assert decoded_docs(tmp_path / "t", "train") == ["test/c.txt"]
    shutil.rmtree(root / "train")  # splits, none of them train: the default split is an error naming the files
    (root / "validation").mkdir()
    (root / "validation" / "d.txt").write_text("d\n")
    message = one_line_error(tmp_path / "x", f"l={root}")
    assert "finds no split 'train', so 3 of its 3 data files are not read" in message


def test_a_glob_that_stops_short_of_subfolders_names_the_recursive_one(tmp_path):
    zh = tmp_path / "zh"  # the kit's corpus/zh shape: the .txt files one folder deeper
    write_named_files(zh, ["four_classics/a.txt", "four_classics/b.txt"])
    write_jsonl(zh / "poetry.jsonl", ["not .txt"])
    fix = f"'zh={zh}/**/*.txt,weight=0.5'"
    assert one_line_error(tmp_path / "o", f"zh={zh}/*.txt,weight=0.5") == (
        f"error: source zh: nothing matches {zh}/*.txt: its * stops at a folder, and 2 files match {zh}/**/*.txt; "
        f"to read them, pass --source {fix}")
    prepare(tmp_path / "o", fix.strip("'") + ",sample_by=line", val_fraction=0)
    assert sorted(decoded_docs(tmp_path / "o", "train")) == ["four_classics/a.txt", "four_classics/b.txt"]


@needs_shared
def test_the_kits_corpus_folders_are_read_whole(tmp_path):
    corpus = os.path.join(SHARED, "corpus")
    *_, files = P.open_source(P.parse_source(f"en={corpus}/en"))
    assert files == sorted(os.path.join(corpus, "en", name) for name in KIT_EN)
    with pytest.raises(FileNotFoundError, match=r"its \* stops at a folder, and 4 files match .*zh/\*\*/\*\.txt"):
        P.source_files(P.parse_source(f"zh={corpus}/zh/*.txt"))
    *_, files = P.open_source(P.parse_source(f"zh={corpus}/zh/**/*.txt"))
    assert [os.path.relpath(f, corpus) for f in files] == [f"zh/four_classics/{name}.txt" for name in (
        "hongloumeng", "sanguo_yanyi", "shuihu_zhuan", "xiyouji")]


def test_folder_of_mixed_formats_or_no_data_is_a_one_line_error(tmp_path):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("plain text\n")
    write_jsonl(mixed / "b.jsonl", ["json one"])
    write_jsonl(mixed / "c.jsonl", ["json two"])
    message = one_line_error(tmp_path / "o", f"m={mixed}")  # datasets read only the .jsonl files, silently
    fixes = [f"--source 'm_text={mixed}/**/*.txt'", f"--source 'm_json={mixed}/**/*.jsonl'"]
    assert message == (f"error: source m: {mixed} mixes formats (1 .txt and 2 .jsonl files) and datasets reads one "
                       f"format per folder, dropping the others: make a source of each, e.g. {' '.join(fixes)}")
    meta = prepare(tmp_path / "both", *(f.split(" ", 1)[1].strip("'") for f in fixes), val_fraction=0)
    assert {name: st["read_docs"] for name, st in meta["source_stats"].items()} == {"m_text": 1, "m_json": 2}
    (tmp_path / "empty" / ".cache").mkdir(parents=True)  # hidden files are not data, as datasets sees it
    (tmp_path / "empty" / ".cache" / "x.txt").write_text("hidden\n")
    assert one_line_error(tmp_path / "o", f"e={tmp_path / 'empty'}") == (
        f"error: source e: {tmp_path / 'empty'} holds no data files (.txt, .jsonl, .json, .parquet, optionally "
        f".gz/.bz2/.xz): put the corpus there or pass the files or a glob")


def test_save_to_disk_folders(tmp_path, splits, capsys):
    import datasets
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"body": v}) for k, v in splits.items()}).save_to_disk(
        str(tmp_path / "dict"))
    datasets.Dataset.from_dict({"text": splits["test"]}).save_to_disk(str(tmp_path / "one"))
    for split in ("train", "validation"):
        option = "" if split == "train" else f",split={split}"
        prepare(tmp_path / split, f"d={tmp_path / 'dict'},field=body{option}", val_fraction=0)
        assert split_documents(tmp_path / split, "train") == encoded(splits[split])
    meta = prepare(tmp_path / "whole", f"d={tmp_path / 'one'}", val_fraction=0)  # one Dataset: read whole
    assert split_documents(tmp_path / "whole", "train") == encoded(splits["test"])
    assert meta["source_stats"]["d"]["split"] is None and f"(all of {tmp_path / 'one'})" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"no split 'dev'; it has \['test', 'train', 'validation'\]"):
        prepare(tmp_path / "x", f"d={tmp_path / 'dict'},field=body,split=dev")
    with pytest.raises(SystemExit, match="has no splits, it is read whole.*drop it"):
        prepare(tmp_path / "x", f"d={tmp_path / 'one'},split=test")


def test_compressed_json_and_parquet_files(tmp_path):
    import gzip

    import datasets
    texts = random_docs(30, "abcdefgh ", seed=23) + ["ünïcödé 世界"]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    with gzip.open(tmp_path / "b.json.gz", "wt", encoding="utf-8") as f:
        json.dump([{"text": t} for t in texts], f)
    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(tmp_path / "c.parquet"))
    for name in ("a.jsonl.gz", "b.json.gz", "c.parquet"):
        prepare(tmp_path / name.replace(".", "_"), f"s={tmp_path / name}", val_fraction=0)
        assert split_documents(tmp_path / name.replace(".", "_"), "train") == encoded(texts), name


def one_line_error(out, *sources):
    """The message main() exits with: one line, 'error: ...'."""
    with pytest.raises(SystemExit) as e:
        prepare(out, *sources)
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message
    return message


def test_bad_files_are_one_line_errors_naming_file_problem_and_fix(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    message = one_line_error(tmp_path / "o", f"a={tmp_path / 'empty.jsonl'}")
    assert f"{tmp_path / 'empty.jsonl'} is empty" in message and "remove it" in message
    (tmp_path / "ints.jsonl").write_text('{"text": "fine"}\n{"text": 42}\n')
    message = one_line_error(tmp_path / "o", f"a={tmp_path / 'ints.jsonl'}")
    assert "record 1 has text=42 (int), not text" in message and "field=" in message
    latin = "Café, crème brûlée et œufs à la coque.\n"
    (tmp_path / "latin.txt").write_bytes(latin.encode("cp1252"))
    message = one_line_error(tmp_path / "o", f"a={tmp_path / 'latin.txt'}")
    assert f"{tmp_path / 'latin.txt'} is not utf-8 text (byte 0xe9" in message and "encoding=" in message
    prepare(tmp_path / "fixed", f"a={tmp_path / 'latin.txt'},encoding=cp1252", val_fraction=0)  # the fix works
    assert split_documents(tmp_path / "fixed", "train") == encoded([latin])
    import datasets
    datasets.Dataset.from_dict({"text": [latin]}).to_parquet(str(tmp_path / "p.parquet"))
    message = one_line_error(tmp_path / "o", f"a={tmp_path / 'p.parquet'},encoding=cp1252")
    assert "encoding= applies to .txt/.json files, this is parquet data" in message
    assert "unknown encoding 'latin-9000'" in one_line_error(tmp_path / "o", f"a={tmp_path / 'latin.txt'},encoding=latin-9000")


def test_hub_id_without_network_is_a_one_line_error(tmp_path):
    # HF_HUB_OFFLINE makes huggingface_hub fail as a machine without network does, without retries
    run = subprocess.run([sys.executable, "prepare_data.py", "text", "--out", str(tmp_path / "o"), "--source",
                          "fw=hf:HuggingFaceFW/fineweb-edu,max_tokens=1M"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    message = run.stderr.strip()
    assert "cannot reach the Hugging Face Hub for 'HuggingFaceFW/fineweb-edu'" in message
    assert "--local-dir DIR" in message and "--source fw=DIR" in message and "HF_HUB_OFFLINE" in message


def test_progress_is_plain_lines_when_not_a_terminal(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", random_docs(50, "abcdefgh ", seed=24))
    run = subprocess.run([sys.executable, "prepare_data.py", "text", "--out", str(tmp_path / "o"), "--workers", "1",
                          "--source", f"a={path}", "--max-tokens", "2000"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stderr
    bars = [line for line in run.stderr.splitlines() if line.startswith("tokenizing a:")]
    assert len(bars) >= 2 and "2.00k/2.00k" in bars[-1] and "100%" in bars[-1]  # the cap is the bar's total
    lines = []
    sys.stderr, saved = type("Log", (), {"write": lambda self, s: lines.append(s), "flush": lambda self: None,
                                         "isatty": lambda self: False})(), sys.stderr
    try:
        assert list(D.progress_bar(range(7), desc="eval")) == list(range(7))
    finally:
        sys.stderr = saved
    assert all(line.endswith("\n") and "\r" not in line for line in lines) and "7/7" in lines[-1]


# ---------------------------------------------------------------- mixture and split


def source_of(doc):
    return "a" if doc[0] in "abcdef" else "b"


def test_mixture_proportions_and_source_ids(tmp_path):
    by_source = {"a": set(random_docs(300, "abcdef ", seed=2)), "b": set(random_docs(300, "uvwxyz ", seed=3, lo=10, hi=300))}
    a = write_jsonl(tmp_path / "a.jsonl", sorted(by_source["a"]))
    b = write_jsonl(tmp_path / "b.jsonl", sorted(by_source["b"]))
    for weights, budget in [((0.7, 0.3), None), ((0.5, 0.5), 20_000)]:
        out = tmp_path / f"mix{budget}"
        options = {"max_tokens": budget} if budget else {}
        meta = prepare(out, f"a={a},weight={weights[0]}", f"b={b},weight={weights[1]}",
                       val_fraction=0.05, workers=2, **options)
        assert meta["sources"] == ["a", "b"]
        counts, cut = {"a": 0, "b": 0}, []
        for split in ("train", "val"):
            for doc in decoded_docs(out, split):
                counts[source_of(doc)] += len(doc.encode()) + 1
                full = by_source[source_of(doc)]
                assert any(d.startswith(doc) for d in full)  # each document whole, or cut at the end
                cut += [] if doc in full else [doc]
        assert len(cut) <= 2  # at most the last document taken from each source
        total = sum(counts.values())
        if budget:
            assert total == budget
        for name, w in zip("ab", weights):
            assert abs(counts[name] / total - w) < 0.02, (counts, weights)
        # per-token source ids from the loader agree with the letters of the targets
        loader = D.TokenLoader(str(out), "train", batch_size=8, seq_len=64)
        x, y, src = loader.next_batch(with_sources=True)
        letters = (y >= ord("a")) & (y <= ord("z"))
        assert letters.any()
        is_b = (y >= ord("u")) & (y <= ord("z"))
        assert torch.equal(src[letters], is_b[letters].long())


def test_hub_source_streams_within_its_budget(tmp_path):
    # datasets resolves hf:<folder> like a hub repository: the streaming path, without a network
    docs = random_docs(300, "abcdef ", seed=8)
    (tmp_path / "hub").mkdir()
    write_jsonl(tmp_path / "hub" / "data.jsonl", docs, field="body")
    meta = prepare(tmp_path / "out", f"h=hf:{tmp_path / 'hub'},field=body,max_tokens=5000", val_fraction=0.1)
    got = decoded_docs(tmp_path / "out", "train") + decoded_docs(tmp_path / "out", "val")
    assert sum(len(d.encode()) + 1 for d in got) == 5000
    assert all(any(d.startswith(g) for d in docs) for g in got)
    assert meta["source_stats"]["h"]["read_tokens"] >= 5000


def test_mixture_short_source_is_an_error(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", random_docs(20, "ab", seed=0))
    with pytest.raises(SystemExit, match="source a has .* tokens, the mixture needs"):
        prepare(tmp_path / "o", f"a={a}", max_tokens="1M")


def test_val_split_disjoint_by_document_and_seeded(tmp_path):
    docs = random_docs(200, "abcdefgh", seed=4)
    path = write_jsonl(tmp_path / "a.jsonl", docs)
    splits = {}
    for seed in (0, 0, 1):
        out = tmp_path / f"s{seed}_{len(splits)}"
        meta = prepare(out, f"a={path}", val_fraction=0.1, seed=seed)
        train, val = decoded_docs(out, "train"), decoded_docs(out, "val")
        assert not set(train) & set(val)
        assert sorted(train + val) == sorted(docs)  # whole documents, none lost or cut
        val_share = meta["source_stats"]["a"]["val_tokens"] / sum(len(d.encode()) + 1 for d in docs)
        assert 0.1 <= val_share < 0.1 + 0.01  # at most one document past the target
        splits[len(splits)] = (seed, sorted(val))
    assert splits[0][1] == splits[1][1]  # same seed, same val documents
    assert splits[0][1] != splits[2][1]  # another seed, another split


def test_no_val_split_warning_says_what_would_help(tmp_path, capsys):
    (tmp_path / "poem.txt").write_text("one paragraph\nof three\nlines\n")  # sample_by=paragraph already
    prepare(tmp_path / "p", f"a={tmp_path / 'poem.txt'}")
    err = capsys.readouterr().err
    assert ("warning: source a has no val split: it is one document (30 tokens); cut it into more with "
            "sample_by=line (.txt files) or sep=STRING (cuts documents at that string)") in err, err
    assert "val" in prepare(tmp_path / "l", f"a={tmp_path / 'poem.txt'},sample_by=line")["splits"]  # the advice works
    assert "no val split" not in capsys.readouterr().err
    prepare(tmp_path / "d", f"a={tmp_path / 'poem.txt'},sample_by=document")
    assert "more with sample_by=paragraph or sample_by=line (.txt files) or sep=STRING" in capsys.readouterr().err
    # many documents, but a share smaller than one of them
    a = write_jsonl(tmp_path / "a.jsonl", random_docs(50, "abcdef ", seed=1, lo=100, hi=120))
    b = write_jsonl(tmp_path / "b.jsonl", random_docs(50, "uvwxyz ", seed=2))
    prepare(tmp_path / "m", f"a={a},weight=0.01", f"b={b},weight=0.99", max_tokens=2000)
    assert ("warning: source a has no val split: its share of the mixture (20 tokens) is filled by the first of its "
            "50 documents drawn; raise the share (weight=, max_tokens=, --max-tokens) or cut documents smaller with "
            "sample_by=line (.txt files) or sep=STRING") in capsys.readouterr().err


# ---------------------------------------------------------------- crash safety


def test_interrupted_run_is_refused_then_resumes(tmp_path, monkeypatch, capsys, small_shards):
    src = f"a={write_jsonl(tmp_path / 'a.jsonl', random_docs(100, 'abcdefgh', seed=5))}"
    reference = prepare(tmp_path / "ref", src, shard_tokens=1000)
    out = tmp_path / "out"
    prepare(out, src, shard_tokens=1000, seed=7)  # a complete, older build in the same folder

    real = P.write_shard
    calls = []

    def crash_on_third(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 3:  # die halfway through writing a shard
            with open(path + ".tmp", "wb") as f:
                f.write(b"SITOKENS partial")
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)

    monkeypatch.setattr(P, "write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        prepare(out, src, shard_tokens=1000, force=True)  # other settings than the folder's: --force
    monkeypatch.setattr(P, "write_shard", real)
    # nothing a reader would take: the old meta is gone, the half shard has no final name
    with pytest.raises(FileNotFoundError, match="did not finish"):
        D.TokenLoader(str(out), "train", 2, 8)
    assert not os.path.exists(calls[2])
    # re-running reuses the finished tokenization and ends identical to a clean build
    capsys.readouterr()
    meta = prepare(out, src, shard_tokens=1000)
    assert "reusing tokens" in capsys.readouterr().err
    assert meta["splits"] == reference["splits"]
    for name in meta["splits"]["train"]["shards"] + meta["splits"]["val"]["shards"]:
        assert open(out / name, "rb").read() == open(tmp_path / "ref" / name, "rb").read()
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "ref"))  # no stale shards or temp files
    # a complete folder with the same settings is left alone
    prepare(out, src, shard_tokens=1000)
    assert "already prepared" in capsys.readouterr().out


def test_truncated_tokenize_cache_is_not_trusted(tmp_path, monkeypatch, capsys):
    src = f"a={write_jsonl(tmp_path / 'a.jsonl', random_docs(100, 'abcdefgh', seed=5))}"
    reference = prepare(tmp_path / "ref", src)
    out = tmp_path / "out"
    monkeypatch.setattr(P, "write_shard", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # dies after tokenizing: the cache and its marker exist
        prepare(out, src)
    monkeypatch.undo()
    cached = out / "tokenize_cache" / "a.tokens.bin"
    with open(cached, "r+b") as f:  # the marker says done, the bytes say otherwise
        f.truncate(100)
    capsys.readouterr()
    meta = prepare(out, src)
    assert "incomplete, tokenizing again" in capsys.readouterr().err
    assert meta["splits"] == reference["splits"]  # every shard's name, token count and sha256, both splits
    for split in ("train", "val"):
        for name in meta["splits"][split]["shards"]:
            assert open(out / name, "rb").read() == open(tmp_path / "ref" / name, "rb").read()


def replace_corpus(folder, docs, same_size_as=None):
    """Rewrite folder/docs.jsonl with other documents: the way a corpus is refreshed in place."""
    path = folder / "docs.jsonl"
    before = os.stat(path)
    write_jsonl(path, docs)
    if same_size_as is not None:  # a same-size edit: only the modification time tells
        assert os.path.getsize(path) == before.st_size
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))


def same_docs_rot13(docs):
    return ["".join(chr((ord(c) - 97 + 13) % 26 + 97) if "a" <= c <= "z" else c for c in d) for d in docs]


@pytest.mark.parametrize("same_size", [False, True])
def test_token_cache_of_changed_source_files_is_not_reused(tmp_path, monkeypatch, capsys, same_size):
    """Killed after a source's tokens were cached, then the corpus is replaced: the rerun reads
    the new files (the cache is keyed on each file's path, size and mtime), not the old tokens."""
    (tmp_path / "corpus").mkdir()
    old = random_docs(100, "abcdefgh", seed=5)
    write_jsonl(tmp_path / "corpus" / "docs.jsonl", old)
    src = f"a={tmp_path / 'corpus'}"
    out = tmp_path / "out"
    monkeypatch.setattr(P, "write_shard", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # dies after tokenizing: the cache and its marker exist
        prepare(out, src)
    monkeypatch.undo()
    assert (out / "tokenize_cache" / "a.done.json").exists()
    new = same_docs_rot13(old) if same_size else random_docs(80, "stuvwxyz", seed=6)
    replace_corpus(tmp_path / "corpus", new, same_size_as=old if same_size else None)
    capsys.readouterr()
    meta = prepare(out, src)
    err = capsys.readouterr().err
    assert "reusing tokens" not in err
    change = "was modified (same size, new mtime)" if same_size else "changed size"
    assert f"a: {tmp_path / 'corpus' / 'docs.jsonl'} {change}" in err and "since the interrupted run, tokenizing again" in err
    assert sorted(decoded_docs(out, "train") + decoded_docs(out, "val")) == sorted(new)
    reference = prepare(tmp_path / "ref", src)
    assert meta["splits"] == reference["splits"]


@pytest.mark.parametrize("edit", ["modified", "added", "removed"])
def test_finished_folder_whose_sources_changed_is_refused(tmp_path, capsys, edit):
    """A complete folder records its sources' files; the same command after the corpus changed
    refuses in one line naming the file, unless --keep-stale (keep) or --force (rebuild)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    old = random_docs(100, "abcdefgh", seed=5)
    write_jsonl(corpus / "docs.jsonl", old)
    write_jsonl(corpus / "more.jsonl", ["a second file"])
    src = f"a={tmp_path / 'corpus' / '*'}"
    out = tmp_path / "out"
    first = prepare(out, src)
    assert [row[0] for row in first["source_files"]["a"]] == [str(corpus / "docs.jsonl"), str(corpus / "more.jsonl")]
    stat = os.stat(corpus / "docs.jsonl")
    assert first["source_files"]["a"][0][1:] == [stat.st_size, stat.st_mtime_ns]
    capsys.readouterr()
    prepare(out, src)
    assert "already prepared" in capsys.readouterr().out
    docs = sorted(old + ["a second file"])
    if edit == "modified":  # the same size: only the mtime tells
        replace_corpus(corpus, same_docs_rot13(old), same_size_as=old)
        named, docs = f"{corpus / 'docs.jsonl'} was modified (same size, new mtime)", sorted(same_docs_rot13(old) + ["a second file"])
    elif edit == "added":
        write_jsonl(corpus / "extra.jsonl", ["new"])
        named, docs = f"{corpus / 'extra.jsonl'} was added", sorted(docs + ["new"])
    else:
        os.remove(corpus / "more.jsonl")
        named, docs = f"{corpus / 'more.jsonl'} was removed", sorted(old)
    message = one_line_error(out, src)
    assert message == (f"error: {out} was prepared from other source files: {named}; --force rebuilds it from "
                       f"the files there now, --keep-stale keeps the old data"), message
    kept = prepare(out, src, keep_stale=True)
    assert kept == first and f"{out}: keeping the data prepared before {named} (--keep-stale)" in capsys.readouterr().out
    write_jsonl(corpus / "zzz.jsonl", ["last"])
    assert f"{named} (and 1 more)" in one_line_error(out, src)  # the first change is named, the rest counted
    rebuilt = prepare(out, src, force=True)
    assert rebuilt["source_files"]["a"] == P.source_file_stats(P.parse_source(src))
    assert sorted(decoded_docs(out, "train") + decoded_docs(out, "val")) == sorted(docs + ["last"])
    prepare(out, src)
    assert "already prepared" in capsys.readouterr().out


def test_bad_source_option_values_name_the_source():
    with pytest.raises(ValueError, match="weight='abc' is not a number"):
        P.parse_source("en=corpus,weight=abc")


# ---------------------------------------------------------------- loader state and ranks


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(0)  # random bytes: every window's contents are unique
    docs = ["".join(chr(c) for c in rng.integers(33, 127, size=rng.integers(50, 400))) for _ in range(60)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(P, "MIN_SHARD_TOKENS", SMALL_SHARDS)
        prepare(tmp / "out", f"a={write_jsonl(tmp / 'a.jsonl', docs)}", val_fraction=0, shard_tokens=3000)
    return str(tmp / "out")


def test_loader_resume_is_exact(text_dir):
    loader = D.TokenLoader(text_dir, "train", batch_size=4, seq_len=32, seed=3)
    steps_per_epoch = loader.n_windows // 4
    for _ in range(steps_per_epoch - 1):  # the next batches cross into epoch 1
        loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [loader.next_batch(with_sources=True) for _ in range(3)]
    resumed = D.TokenLoader(text_dir, "train", batch_size=4, seq_len=32, seed=3)
    resumed.load_state_dict(state)
    for want, got in zip(expected, (resumed.next_batch(with_sources=True) for _ in range(3))):
        assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert resumed.epoch == 1
    other = D.TokenLoader(text_dir, "train", batch_size=4, seq_len=16)
    with pytest.raises(ValueError, match="different data or seq_len"):
        other.load_state_dict(state)


def test_ranks_are_disjoint_slices_of_the_global_batch(text_dir):
    B, W = 3, 3
    single = D.TokenLoader(text_dir, "train", batch_size=B * W, seq_len=24, seed=1)
    ranks = [D.TokenLoader(text_dir, "train", batch_size=B, seq_len=24, rank=r, world_size=W, seed=1) for r in range(W)]
    seen = set()
    for _ in range(single.n_windows // (B * W)):  # one full epoch
        gx, gy = single.next_batch()
        for r, loader in enumerate(ranks):
            x, y = loader.next_batch()
            assert torch.equal(x, gx[r * B:(r + 1) * B]) and torch.equal(y, gy[r * B:(r + 1) * B])
            rows = {tuple(row) for row in x.tolist()}
            assert not rows & seen
            seen |= rows
    assert len(seen) == single.n_windows // (B * W) * B * W
    assert not torch.equal(D.TokenLoader(text_dir, "train", 4, 24, seed=2).next_batch()[0],
                           D.TokenLoader(text_dir, "train", 4, 24, seed=1).next_batch()[0])


def test_tokenization_independent_of_worker_count(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", random_docs(400, "abcdefgh ", seed=6))
    one = prepare(tmp_path / "w1", f"a={path}", workers=1)
    two = prepare(tmp_path / "w2", f"a={path}", workers=2)
    assert one["splits"] == two["splits"]
    for name in one["splits"]["train"]["shards"]:
        assert open(tmp_path / "w1" / name, "rb").read() == open(tmp_path / "w2" / name, "rb").read()


@needs_shared
def test_gpt2_round_trip_on_shared_corpus(tmp_path):
    text = open(os.path.join(SHARED, "corpus", "en", "tinyshakespeare", "input.txt"), encoding="utf-8").read()[:20000]
    (tmp_path / "s.txt").write_text(text, encoding="utf-8")
    kit = os.path.join(SHARED, "tokenizers")
    meta = prepare(tmp_path / "out", f"s={tmp_path / 's.txt'},sample_by=document", tokenizer="gpt2",
                   tokenizer_dir=kit, val_fraction=0)
    assert (meta["vocab_size"], meta["eot_id"]) == (50257, 50256)
    enc = D.get_tokenizer("gpt2", kit)
    assert enc.decode(split_stream(tmp_path / "out", "train").tolist()) == text + D.EOT


# ---------------------------------------------------------------- anchor task

SHIFTS = {1: 5, 2: 1, 3: -2, 4: -8}  # the single functions, written out independently


@pytest.fixture(scope="module")
def anchor_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("anchor") / "a")
    P.main(["anchor", "--out", out, "--n-train", "3000", "--n-eval", "500", "--seed", "11"])
    return out


def test_anchor_invariants(anchor_dir):
    meta = D.load_meta(anchor_dir)
    assert meta["record_len"] == 10 and meta["vocab_size"] == 128 and meta["dtype"] == "uint16"
    test_keys = set(meta["anchor"]["test_keys"])
    assert len(test_keys) == 16 and test_keys <= set(range(20, 100))
    for split in ("train", "val", "test", "heldout"):
        records = D.read_records(anchor_dir, split)
        assert records.shape == (meta["splits"][split]["records"], 10)
        assert records.max() < meta["vocab_size"] and records.min() >= 0
        for row in records.tolist():
            inputs, target = row[:-1], row[-1]
            where = [i for i, t in enumerate(inputs) if t in SHIFTS]
            assert len(where) == 2 and where[1] == where[0] + 1 and where[0] >= 1  # key, a, b in a row
            key, a, b = inputs[where[0] - 1], inputs[where[0]], inputs[where[1]]
            assert 20 <= key <= 99 and all(20 <= t <= 99 for i, t in enumerate(inputs) if i not in where)
            if split == "heldout":
                assert (a, b) == (4, 3) and target == key - 10  # stored answer: the inferential one
                continue
            assert (a, b) != (4, 3)
            assert (key in test_keys) == (split == "test")
            assert target == (key - 6 if (a, b) == (3, 4) else key + SHIFTS[a] + SHIFTS[b])
    train = D.read_records(anchor_dir, "train")
    _, a, b, _ = A.anchor_fields(train)
    assert len(set(zip(a.tolist(), b.tolist()))) == 15  # every seen pair is trained


def test_anchor_loader_masks_all_but_the_answer(anchor_dir):
    loader = D.TokenLoader(anchor_dir, "train", batch_size=16, seed=0)
    x, y, src = loader.next_batch(with_sources=True)
    assert x.shape == y.shape == (16, 9)
    assert (y[:, :-1] == -1).all() and (y[:, -1] >= 0).all()
    key, a, b, _ = A.anchor_fields(torch.cat([x, y[:, -1:]], 1).numpy())
    # The loader's answer token is the task's rule applied to the record's key and pair.
    expected = [k - 6 if (i, j) == (3, 4) else k + SHIFTS[i] + SHIFTS[j] for k, i, j in zip(key, a, b)]
    assert y[:, -1].tolist() == expected
    names = D.load_meta(anchor_dir)["sources"]
    assert [names[s] for s in src[:, -1].tolist()] == [f"pair_{i}_{j}" for i, j in zip(a.tolist(), b.tolist())]
    with pytest.raises(ValueError, match="use seq_len=9"):
        D.TokenLoader(anchor_dir, "train", batch_size=4, seq_len=16)


def test_anchor_answer_kinds_and_accuracy(anchor_dir):
    meta = D.load_meta(anchor_dir)
    held = D.read_records(anchor_dir, "heldout")[:4]
    key = A.anchor_fields(held)[0]
    predictions = np.array([key[0] - 10, key[1] - 6, key[2] + 1, key[3] - 10])
    assert A.anchor_answer_kinds(held, predictions, meta) == {
        "inferential": 0.5, "symmetric": 0.25, "other": 0.25, "n": 4}
    test = D.read_records(anchor_dir, "test")[:5]
    assert A.anchor_accuracy(test, torch.tensor(test[:, -1])) == 1.0
    assert A.anchor_accuracy(test, np.r_[test[:3, -1], test[3:, -1] + 1]) == 0.6


def test_anchor_same_seed_same_bytes(anchor_dir, tmp_path):
    again, other = str(tmp_path / "again"), str(tmp_path / "other")
    P.main(["anchor", "--out", again, "--n-train", "3000", "--n-eval", "500", "--seed", "11"])
    P.main(["anchor", "--out", other, "--n-train", "3000", "--n-eval", "500", "--seed", "12"])
    for name in ("train_000000.bin", "heldout_000000.bin"):
        same = open(os.path.join(anchor_dir, name), "rb").read()
        assert open(os.path.join(again, name), "rb").read() == same
        assert open(os.path.join(other, name), "rb").read() != same


def test_anchor_key_positions(tmp_path):
    """--key-positions fixes where the key (then its pair) sits in every split; by default it is
    anywhere the key and pair fit (0 to seq_len-3)."""
    def key_positions(folder, split):
        return set(((D.read_records(folder, split)[:, :-1] <= 4).argmax(1) - 1).tolist())  # before the first anchor
    P.main(["anchor", "--out", str(tmp_path / "late"), "--n-train", "300", "--n-eval", "100", "--key-positions", "5-6"])
    assert key_positions(tmp_path / "late", "train") == key_positions(tmp_path / "late", "heldout") == {5, 6}
    P.main(["anchor", "--out", str(tmp_path / "any"), "--n-train", "300", "--n-eval", "100"])
    assert key_positions(tmp_path / "any", "train") == set(range(7))
    with pytest.raises(ValueError, match="key positions 5-7 must lie in 0-6"):
        P.prepare_anchor(A.AnchorTask(key_positions=(5, 7)), "unused", "")


def test_anchor_bad_parameters():
    with pytest.raises(ValueError, match="above the anchor tokens"):
        P.prepare_anchor(A.AnchorTask(fillers=(0, 99)), "unused", "")
    with pytest.raises(ValueError, match="below token 0"):
        P.prepare_anchor(A.AnchorTask(keys=(10, 99), fillers=(10, 99)), "unused", "")
    assert A.anchor_vocab(A.AnchorTask()) == (128, 110)  # targets reach 109


def test_cli_help_and_one_line_errors(tmp_path, capsys):
    for command in ("text", "bench", "anchor"):
        with pytest.raises(SystemExit) as e:
            P.main([command, "--help"])
        assert e.value.code == 0 and "--seed" in capsys.readouterr().out
    run = subprocess.run([sys.executable, "prepare_data.py", "anchor", "--out", str(tmp_path / "a"), "--n-train", "100",
                          "--keys", "30-3"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr.strip().startswith("error:") and len(run.stderr.strip().splitlines()) == 1


def test_bench_command_runs_and_reports(tmp_path, capsys):
    # a smoke test that keeps the benchmark runnable; its numbers are printed, not asserted
    path = write_jsonl(tmp_path / "a.jsonl", random_docs(50, "abcdefgh ", seed=9))
    P.main(["bench", "--source", f"a={path}", "--tokenizer", "bytes", "--workers", "1"])
    out = capsys.readouterr().out
    assert "raw encode_ordinary_batch" in out and out.count("of raw") == 3


@pytest.mark.parametrize("argv, message", [
    (["--shard-tokens", "0"], "argument --shard-tokens: must be >= 65536 (got 0)"),  # looped forever before
    (["--max-tokens", "0.4"], "argument --max-tokens: must be >= 1000 (got 0.4)"),
    (["--max-tokens", "inf"], "argument --max-tokens: bad token count 'inf'"),
    (["--workers", "0"], "argument --workers: must be >= 1 (got 0)"),
    (["--val-fraction", "1"], "argument --val-fraction: '1' is not a fraction in [0, 1)"),
    (["--val-fraction", "-0.1"], "argument --val-fraction: '-0.1' is not a fraction in [0, 1)"),
    (["--seed", "-1"], "argument --seed: must be >= 0 (got -1)"),
    (["--source", "b=none.txt,max_tokens=0"], "max_tokens must be >= 1000"),  # 0 read as "no cap" before
    (["--source", "b=none.txt,weight=0"], "weight must be a positive number"),
    (["--source", "b=none.txt,weight=nan"], "weight must be a positive number"),
])
def test_sizes_and_counts_are_checked_before_anything_runs(tmp_path, capsys, argv, message):
    # the source does not exist: an argument that got through would fail later, naming the source
    with pytest.raises(SystemExit) as e:
        P.main(["text", "--out", str(tmp_path / "o"), "--source", f"a={tmp_path / 'none.txt'}", *argv])
    said = str(e.value.code) if e.value.code not in (1, 2) else capsys.readouterr().err.strip()
    assert said.startswith("error: ") and "\n" not in said and message in said, said
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, message", [(["--n-train", "0"], "argument --n-train: must be >= 1 (got 0)"),
                                           (["--n-eval", "0"], "argument --n-eval: must be >= 1 (got 0)"),
                                           (["--seq-len", "2"], "argument --seq-len: must be >= 3 (got 2)"),
                                           (["--seed", "-3"], "argument --seed: must be >= 0 (got -3)")])
def test_anchor_sizes_are_checked_by_the_parser(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        P.main(["anchor", "--out", str(tmp_path / "a"), *argv])
    assert e.value.code == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith("error: ") and "\n" not in said and message in said, said


@pytest.mark.parametrize("sample_by", ["paragraph", "line", "document"])
def test_txt_files_read_without_datasets_give_the_documents_datasets_gives(tmp_path, monkeypatch, sample_by):
    """The reference is datasets' text builder, which made the study's data: the same documents
    through universal newlines, runs of blank lines, a cut straddling two read blocks (7
    characters here), a gzip file, another encoding and a file without a final newline."""
    datasets = pytest.importorskip("datasets", reason="datasets is the reference reader")
    texts = {"a.txt": "one\r\ntwo\r\n\r\nthree\rfour\r\r\n\n\n  \n\nfive six seven eight\n\n\n",
             "b.txt": "\n\nstarts blank\n\nno final newline",
             "c.txt.gz": "gz one\n\ngz two\n", "d.txt": "caf\u00e9\n\nna\u00efve\n"}
    for name, text in texts.items():
        opener = __import__("gzip").open if name.endswith(".gz") else open
        with opener(tmp_path / name, "wb") as f:
            f.write(text.encode("latin-1"))
    monkeypatch.setattr(P, "TEXT_BLOCK_CHARS", 7)
    source = P.parse_source(f"t={tmp_path}/*.txt*,sample_by={sample_by},encoding=latin-1")
    ours = [t for b in P.iter_texts(source, batch_size=3) for t in b]
    reference = datasets.load_dataset("text", data_files=sorted(map(str, tmp_path.glob("*.txt*"))), split="train",
                                      streaming=True, sample_by=sample_by, encoding="latin-1")
    theirs = [t for t in (r["text"] for r in reference) if t and not t.isspace()]
    assert ours == theirs and len(ours) >= len(texts)
