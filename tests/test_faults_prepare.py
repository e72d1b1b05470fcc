"""prepare_data.py's own folder as untrusted input (issue 37): the token cache an interrupted run left
(done.json of any shape or depth, a FIFO, a symlink, a flipped byte), an --out inside a source or in a
folder that is not a data folder, a second run into the same --out, and a --workers past any machine.
A cache entry that does not vouch for its tokens is tokenized again, said in one line; everything else
is refused in one line, nothing outside the folder read or written, nothing left behind."""
import hashlib
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import data as D
import prepare_data as P
from conftest import launch_env
from test_faults_data import leftovers, one_line_error, snapshot
from test_faults_links import within
from test_prepare_data import ROOT, decoded_docs, prepare, random_docs, write_jsonl

DOCS = random_docs(100, "abcdefgh", seed=5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A clean build of DOCS: what every rebuild below must write, byte for byte."""
    tmp = tmp_path_factory.mktemp("reference")
    prepare(tmp / "ref", f"a={write_jsonl(tmp / 'a.jsonl', DOCS)}")
    return tmp / "ref"


@pytest.fixture
def cached(tmp_path, monkeypatch, reference):
    """(out, source, reference): out holds what a run killed after tokenizing leaves (the token cache
    of source a, complete, and its done.json), reference a clean build of the same source."""
    src = f"a={write_jsonl(tmp_path / 'a.jsonl', DOCS)}"
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(P, "write_shard", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            prepare(out, src)
    assert sorted(os.listdir(out / "tokenize_cache")) == ["a.done.json", "a.lengths.npy", "a.tokens.bin"]
    return out, src, reference


def cache_file(out, suffix):
    return out / "tokenize_cache" / f"a.{suffix}"


def rebuilt(out, src, ref, capsys):
    """Prepare out again; its shards must be the clean build's, byte for byte. Returns what it said
    about the cache: the stderr lines naming source a."""
    capsys.readouterr()
    meta = prepare(out, src)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("a: ")]
    assert meta["splits"] == D.load_meta(str(ref))["splits"]
    for name in meta["splits"]["train"]["shards"] + meta["splits"]["val"]["shards"]:
        assert (out / name).read_bytes() == (ref / name).read_bytes()
    assert not (out / "tokenize_cache").exists() and not leftovers(out) and "prepare_data.lock" not in os.listdir(out)
    return said


def plant_link(path, target):
    """path as a symlink to target, a file outside the folder with the bytes path had (so a reader
    that follows it finds a cache entry that looks right)."""
    target.write_bytes(path.read_bytes())
    os.remove(path)
    os.symlink(target, path)
    return target.read_bytes()


# ---------------------------------------------------------------- done.json of any shape (F1, F2)


@pytest.mark.parametrize("edit, reason", [
    (lambda m: [], "{done} holds a JSON list, not a cache marker"),
    (lambda m: "files", "{done} holds a JSON str, not a cache marker"),
    (lambda m: {**m, "files": "abc"}, "{done} was written for other settings or source files"),
    (lambda m: {**m, "files": [[m["files"][0][0], "big", 0]]}, "{done} was written for other settings or source files"),
    (lambda m: {k: v for k, v in m.items() if k != "cap"}, "{done} was written for other settings or source files"),
    (lambda m: {k: v for k, v in m.items() if k != "files"}, "{done} was written for other settings or source files"),
    (lambda m: {**m, "cap": "abc"}, "{done} was written for other settings or source files"),
    (lambda m: {**m, "sha256": "abc"}, "{done} records no sha256 of the cached files"),
    (lambda m: {**m, "sha256": {"tokens": 1, "lengths": None}}, "{done} records no sha256 of the cached files"),
], ids=["list", "string", "files-string", "files-rows", "no-cap", "no-files", "cap-string", "sha-string", "sha-types"])
def test_a_done_json_of_any_shape_is_a_stale_entry_said_in_one_line(cached, capsys, edit, reason):
    out, src, ref = cached
    done = cache_file(out, "done.json")
    done.write_text(json.dumps(edit(json.loads(done.read_text()))))
    assert rebuilt(out, src, ref, capsys) == [f"a: {reason.format(done=done)}, tokenizing again"]


@pytest.mark.parametrize("text, reason", [
    ('{"source": ', "not JSON (Expecting value: line 1 column 12 (char 11))"),
    ("[" * 100_000, "not JSON (nested deeper than a JSON reader follows)"),  # a RecursionError traceback before
], ids=["cut-short", "deep"])
def test_a_done_json_that_is_not_json_is_a_stale_entry(cached, capsys, text, reason):
    out, src, ref = cached
    done = cache_file(out, "done.json")
    done.write_text(text)
    assert rebuilt(out, src, ref, capsys) == [f"a: {done} is {reason}, tokenizing again"]


def test_a_marker_that_vouches_for_what_is_no_lengths_array(cached, capsys):
    """A sha256 is no secret: a marker written by hand can vouch for an empty lengths file."""
    out, src, ref = cached
    done, lengths = cache_file(out, "done.json"), cache_file(out, "lengths.npy")
    lengths.write_bytes(b"")
    marker = json.loads(done.read_text())
    done.write_text(json.dumps({**marker, "sha256": {**marker["sha256"], "lengths": hashlib.sha256().hexdigest()}}))
    assert rebuilt(out, src, ref, capsys) == [f"a: {lengths} holds no document lengths, tokenizing again"]


def test_a_marker_that_vouches_for_lengths_whose_int64_sum_wraps(cached, capsys):
    """Lengths of 2**62 wrap int64's sum around to the real token count, and the size check passed: the
    build then failed with an IndexError deep in writing the splits."""
    out, src, ref = cached
    done, lengths = cache_file(out, "done.json"), cache_file(out, "lengths.npy")
    real = np.load(lengths)
    crafted = np.array([2**62] * 4 + [int(real.sum())], dtype=np.int64)
    assert crafted.sum() == real.sum()  # the wrap the check must not be fooled by
    lengths.write_bytes(P.npy_bytes(crafted))
    marker = json.loads(done.read_text())
    sums = {**marker["sha256"], "lengths": hashlib.sha256(lengths.read_bytes()).hexdigest()}
    done.write_text(json.dumps({**marker, "sha256": sums}))
    assert rebuilt(out, src, ref, capsys) == ["a: cached tokens are incomplete, tokenizing again"]


def test_a_deep_meta_json_is_one_line(tmp_path):
    """data.py's reader names the nesting (it said RecursionError, caught by name), prepare_data.py too."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "meta.json").write_text("[" * 100_000)
    problem = f"{tmp_path / 'd' / 'meta.json'} is not a data folder's meta.json: not JSON (ValueError: nested " \
              f"deeper than a JSON reader follows)"
    with pytest.raises(ValueError) as e:
        D.load_meta(str(tmp_path / "d"))
    assert str(e.value) == f"{problem}; re-run prepare_data.py for {tmp_path / 'd'} (or pass another data folder)"
    with pytest.raises(SystemExit) as e:
        P.main(["anchor", "--out", str(tmp_path / "d"), "--n-train", "50", "--n-eval", "10"])
    assert str(e.value.code) == f"error: {problem}; --force rebuilds {tmp_path / 'd'} (dropping that file), or " \
                                f"pass another --out"


# ---------------------------------------------------------------- FIFOs and symlinks in the cache (F3, F4)


@pytest.mark.parametrize("suffix", ["done.json", "tokens.bin", "lengths.npy"])
def test_a_fifo_in_the_cache_is_a_stale_entry_not_a_hang(cached, capsys, suffix):
    out, src, ref = cached
    path = cache_file(out, suffix)
    os.remove(path)
    os.mkfifo(path)
    with within(60):  # open() of a FIFO waited for a writer forever
        said = rebuilt(out, src, ref, capsys)
    assert said == [f"a: {path} is a FIFO: not opened, tokenizing again"]


@pytest.mark.parametrize("suffix", ["done.json", "tokens.bin", "lengths.npy"])
def test_a_symlink_in_the_cache_is_not_followed(cached, capsys, tmp_path, suffix):
    """The link leads to a copy of the right bytes: only a reader that follows it would reuse it."""
    out, src, ref = cached
    path, target = cache_file(out, suffix), tmp_path / f"outside.{suffix}"
    kept = plant_link(path, target)
    said = rebuilt(out, src, ref, capsys)
    assert said == [f"a: {path} is a symlink: not followed, tokenizing again"]
    assert target.read_bytes() == kept and not target.is_symlink()


def test_a_folder_in_place_of_the_cached_tokens_is_one_line(cached, capsys):
    out, src, _ = cached
    tokens = cache_file(out, "tokens.bin")
    os.remove(tokens)
    (tokens / "inside").mkdir(parents=True)
    assert one_line_error(out, src) == (f"error: cannot write {tokens} (Is a directory): a folder stands where a file "
                                        f"of the data goes: remove it or pass another --out")
    assert f"a: {tokens} is a folder: not opened, tokenizing again" in capsys.readouterr().err
    assert (tokens / "inside").is_dir() and not leftovers(out)


def test_a_symlinked_cache_folder_is_refused_and_its_target_kept(cached, tmp_path):
    out, src, _ = cached
    elsewhere = tmp_path / "elsewhere"
    os.rename(out / "tokenize_cache", elsewhere)
    os.symlink(elsewhere, out / "tokenize_cache")
    before, outside = snapshot(out), snapshot(elsewhere)
    assert one_line_error(out, src) == (f"error: {out / 'tokenize_cache'} is a symlink, not a folder of its own: "
                                        f"the token cache is read and written only there; remove it, then rerun")
    assert snapshot(out) == before and snapshot(elsewhere) == outside and os.path.islink(out / "tokenize_cache")


# ---------------------------------------------------------------- a byte flipped in the cache (F5)


def flip_a_token(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # a token id one off: the size and every document length stay right
    path.write_bytes(bytes(data))


def swap_two_lengths(path):
    import numpy as np
    lengths = np.load(path)
    i = int(np.flatnonzero(lengths != lengths[0])[0])  # two documents of other lengths: the sum stays
    lengths[[0, i]] = lengths[[i, 0]]
    with open(path, "wb") as f:  # in place, as a bit flip on the disk would be
        np.save(f, lengths)


@pytest.mark.parametrize("suffix, damage", [("tokens.bin", flip_a_token), ("lengths.npy", swap_two_lengths)])
def test_cached_bytes_that_changed_are_tokenized_again(cached, capsys, suffix, damage):
    out, src, ref = cached
    damage(cache_file(out, suffix))
    said = rebuilt(out, src, ref, capsys)  # reused before: the shards held the changed bytes
    assert said == [f"a: {cache_file(out, suffix)} does not match the sha256 that {cache_file(out, 'done.json')} "
                    f"records, tokenizing again"]


# ---------------------------------------------------------------- where --out may be (F6, a folder of others)


def test_an_out_that_a_source_reads_is_refused(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "a.json", DOCS[:40])
    write_jsonl(corpus / "b.jsonl", DOCS[40:])
    before = snapshot(corpus)
    for source, out in [(f"a={corpus}", corpus), (f"a={corpus}", corpus / "prepared"),
                        (f"a={corpus}/**/*.json", corpus / "prepared")]:  # the glob would read meta.json
        assert one_line_error(out, source) == (
            f"error: --out {out} is where source a ({source[2:]}) reads: the files written there would become its "
            f"documents; pass an --out outside it")
        assert snapshot(corpus) == before
    # sources that cannot read what is written there: a file beside it, a glob of other names
    for source, docs in [(f"a={corpus / 'a.json'}", DOCS[:40]), (f"a={corpus}/**/*.jsonl", DOCS[40:])]:
        prepare(corpus / "prepared", source, val_fraction=0, force=True)
        assert sorted(decoded_docs(corpus / "prepared", "train")) == sorted(docs)


def test_a_folder_that_is_not_a_data_folder_is_refused(tmp_path):
    """`--out ~` or `--out /`: a folder of other files; --force (rebuild a data folder) does not change that."""
    a = write_jsonl(tmp_path / "a.jsonl", DOCS)
    out = tmp_path / "home"
    (out / "projects").mkdir(parents=True)
    (out / "notes.txt").write_text("the user's own notes\n")
    before = snapshot(out)
    for force in ({}, {"force": True}):
        assert one_line_error(out, f"a={a}", **force) == (
            f"error: {out} holds notes.txt (and 1 more), which prepare_data.py did not write, and no data "
            f"meta.json: it is not a data folder; pass a new or empty folder as --out")
        assert snapshot(out) == before and sorted(os.listdir(out)) == ["notes.txt", "projects"]
    # a data folder with a file of the user's beside its data is one: rebuilt, the file kept
    prepare(tmp_path / "data", f"a={a}")
    (tmp_path / "data" / "README.txt").write_text("where this data came from\n")
    prepare(tmp_path / "data", f"a={a}", seed=1, force=True)
    assert (tmp_path / "data" / "README.txt").read_text() == "where this data came from\n"


# ---------------------------------------------------------------- two runs into one --out (F7)


PAUSED = """
import os, sys, time
import prepare_data as P
write_meta = P.write_meta
def paused(*args):
    open(sys.argv[1], "w").close()  # the shards are written
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
    return write_meta(*args)
P.write_meta = paused
P.main(sys.argv[3:])
"""


def test_a_second_run_into_the_same_out_is_refused_naming_the_first(tmp_path, capsys):
    """The first run stops just before its meta.json: the second one cleared its shards and wrote its own
    before, then the first one's meta.json vouched for them."""
    a = write_jsonl(tmp_path / "a.jsonl", DOCS)
    b = write_jsonl(tmp_path / "b.jsonl", random_docs(60, "uvwxyz", seed=2))
    out, ready, go = tmp_path / "out", tmp_path / "ready", tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", PAUSED, str(ready), str(go), "text", "--out", str(out),
                              "--workers", "1", "--val-fraction", "0", "--source", f"a={a}"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env())
    try:
        deadline = time.time() + 120
        while not ready.exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert ready.exists(), first.communicate()
        before = snapshot(out)
        message = one_line_error(out, f"a={b}", force=True)
        assert message.startswith(f"error: {out} is in use by prepare_data.py pid {first.pid} on host "
                                  f"{socket.gethostname()} (since ")
        assert message.endswith("): wait for that run to end (or stop it), or pass another --out"), message
        assert snapshot(out) == before
    finally:
        go.touch()
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert sorted(decoded_docs(out, "train")) == sorted(DOCS)  # the first run's data, whole
    assert "prepare_data.lock" not in os.listdir(out) and not leftovers(out)
    capsys.readouterr()
    prepare(out, f"a={b}", val_fraction=0, force=True)  # once it ended, the folder is free
    assert sorted(decoded_docs(out, "train")) == sorted(random_docs(60, "uvwxyz", seed=2))


def test_a_symlinked_lock_file_is_refused_and_its_target_kept(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", DOCS)
    out, target = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    target.write_text("the user's own file\n")
    os.symlink(target, out / "prepare_data.lock")
    assert one_line_error(out, f"a={a}") == (
        f"error: {out / 'prepare_data.lock'} is a symlink: not followed (a data folder's files are its own); "
        f"remove it, then rerun")
    assert target.read_text() == "the user's own file\n" and os.listdir(out) == ["prepare_data.lock"]


# ---------------------------------------------------------------- --workers


def test_workers_past_the_machine_are_refused_by_the_parser(tmp_path, capsys):
    bound = 4 * os.cpu_count()  # a worker is a process holding a tokenizer: 100000 of them were OOM-killed
    with pytest.raises(SystemExit) as e:
        P.main(["text", "--out", str(tmp_path / "o"), "--source", f"a={tmp_path / 'none.txt'}",
                "--workers", str(bound + 1)])
    said = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in said and said.startswith(
        f"error: argument --workers: must be <= {bound} (got {bound + 1}): at most 4 tokenizer processes per core, "
        f"of the {os.cpu_count()} here (see "), said
    assert not (tmp_path / "o").exists()
