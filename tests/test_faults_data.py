"""prepare_data.py under faults: an existing folder prepared otherwise, a symlinked corpus on a cold
`datasets` cache, a broken meta.json, an output folder that cannot be written, a file-size limit,
Ctrl-C, and size flags below a usable size. Each error is one line naming the file and the fix,
and leaves no temporary file and nothing half-written."""
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

import data as D
import prepare_data as P
from conftest import launch_env
from test_prepare_data import ROOT, decoded_docs, prepare, random_docs, write_jsonl
from test_train import train_error


def one_line_error(out, *sources, **options):
    """The message main() exits with: one line, 'error: ...' (exit status 1)."""
    with pytest.raises(SystemExit) as e:
        prepare(out, *sources, **options)
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def snapshot(folder):
    """Every file under folder: its bytes and modification time."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = (f.read(), os.stat(path).st_mtime_ns)
    return found


def leftovers(folder):
    """Temporary files (fileio.atomic_open's NAME.XXXX.tmp, the old cache's NAME.tmp) under folder."""
    return [os.path.join(r, n) for r, _, names in os.walk(folder) for n in names if n.endswith(".tmp")]


def run_cli(args, **kwargs):
    return subprocess.run([sys.executable, "prepare_data.py", *args], cwd=ROOT, capture_output=True, text=True,
                          env=launch_env(kwargs.pop("env", None)), timeout=120, **kwargs)


def one_error_line(run):
    """The error a failed CLI run ends with: exit 1, one 'error: ' line on stderr, no traceback."""
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and run.stderr.count("error:") == 1, run.stderr
    return last


# ---------------------------------------------------------------- a folder prepared with other settings


def test_other_sources_or_settings_are_refused_naming_each_difference(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", random_docs(60, "abcdef ", seed=1))
    b = write_jsonl(tmp_path / "b.jsonl", random_docs(60, "uvwxyz ", seed=2))
    out = tmp_path / "out"
    prepare(out, f"a={a}")
    before = snapshot(out)
    fix = "--force replaces its data with these, or pass another --out"
    for sources, options, named in [
        ([f"a={b}"], {}, f"--source a={a} -> a={b}"),
        ([f"a={a},weight=2"], {}, f"--source a={a} -> a={a},weight=2.0"),
        ([f"a={a}", f"b={b}"], {}, f"--source a={a} -> a={a} b={b}"),
        ([f"a={a}"], {"seed": 3, "val_fraction": 0.1}, "--val-fraction 0.02 -> 0.1; --seed 0 -> 3"),
        ([f"a={a}"], {"max_tokens": "2K"}, "--max-tokens none -> 2000"),
        ([f"a={a}"], {"shard_tokens": "1M"}, "--shard-tokens 100000000 -> 1000000"),
    ]:
        message = one_line_error(out, *sources, **options)
        assert message == f"error: {out} was prepared with other settings: {named}; {fix}", message
        assert snapshot(out) == before  # not a byte or an mtime changed
    capsys.readouterr()
    prepare(out, f"a={a}")  # the same sources and settings: left alone
    assert "already prepared" in capsys.readouterr().out and snapshot(out) == before
    prepare(out, f"a={b}", force=True)  # the fix the line names
    assert sorted(decoded_docs(out, "train") + decoded_docs(out, "val")) == sorted(random_docs(60, "uvwxyz ", seed=2))


def test_a_folder_without_recorded_settings_is_refused(tmp_path):
    """An anchor-task folder (its meta.json records no text settings) is not overwritten by `text`."""
    out = tmp_path / "anchor"
    P.main(["anchor", "--out", str(out), "--n-train", "100", "--n-eval", "20"])
    before = snapshot(out)
    message = one_line_error(out, f"a={write_jsonl(tmp_path / 'a.jsonl', ['some text'])}")
    assert message.startswith(f"error: {out} was prepared with other settings: --source (not recorded) -> a=")
    assert message.endswith("--force replaces its data with these, or pass another --out")
    assert snapshot(out) == before


# ---------------------------------------------------------------- split inference through a symlink, cold cache


def test_unread_files_are_counted_right_through_a_symlink_on_a_cold_cache(tmp_path, capsys):
    """datasets resolves a folder's symlinks (a macOS temp dir is one); the folder as given must still
    match the files it reads. A fresh HF_DATASETS_CACHE: the cold cache a newcomer has."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text("read me\n")
    (corpus / "test.txt").write_text("a test split\n")
    (corpus / "notes.txt").write_text("names no split\n")
    (tmp_path / "link").symlink_to(corpus)
    link = tmp_path / "link"
    run = run_cli(["text", "--out", str(tmp_path / "o"), "--workers", "1", "--val-fraction", "0",
                   "--source", f"c={link}"], env={"HF_DATASETS_CACHE": str(tmp_path / "hf_cache")})
    assert run.returncode == 0, run.stderr
    warnings = [line for line in run.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: source c: datasets splits {link} by file names (train, test) and reads split "
                        f"'train', so 2 of its 3 data files are not read: {link / 'notes.txt'} (no split), "
                        f"{link / 'test.txt'} (split 'test'); to read every file, pass a glob: "
                        f"--source 'c={link}/**/*.txt'"], run.stderr
    assert decoded_docs(tmp_path / "o", "train") == ["read me\n"]
    os.remove(corpus / "notes.txt")  # one split left: no layout, the one file is read whole
    os.remove(corpus / "test.txt")
    prepare(tmp_path / "one", f"c={link}", val_fraction=0)
    assert "not read" not in capsys.readouterr().err
    assert decoded_docs(tmp_path / "one", "train") == ["read me\n"]


# ---------------------------------------------------------------- a broken meta.json


@pytest.fixture
def data_folder(tmp_path):
    prepare(tmp_path / "d", f"a={write_jsonl(tmp_path / 'a.jsonl', random_docs(40, 'abc ', seed=3))}", val_fraction=0)
    return tmp_path / "d"


def with_meta(folder, edit):
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(edit if isinstance(edit, str) else json.dumps(edit(meta)))


def split_edit(key, value):
    return lambda m: {**m, "splits": {"train": {**m["splits"]["train"], key: value}}}


@pytest.mark.parametrize("edit, problem", [
    ("[]", "it holds a JSON list, not an object"),
    ("{\"format_version\": 1, ", "not JSON (JSONDecodeError"),
    (lambda m: {k: v for k, v in m.items() if k != "splits"}, "no 'splits'"),
    (lambda m: {**m, "splits": []}, "'splits' is [], not an object of split name -> split"),
    (lambda m: {**m, "vocab_size": "257"}, "'vocab_size' is \"257\", not a positive integer"),
    (lambda m: {**m, "sources": None}, "'sources' is null, not a list of source names"),
    (split_edit("shard_tokens", ["12"]), "'shard_tokens' of split 'train' is [\"12\"], not a list of token counts"),
    (split_edit("shard_tokens", [1, 2]), "split 'train' has 1 shards but 2 'shard_tokens'"),
    # a name that leads out of the folder is never opened
    (split_edit("shards", ["../train_000000.bin"]),
     "'shards' of split 'train' is [\"../train_000000.bin\"], not a list of shard file names"),
])
def test_a_broken_meta_json_is_one_line_naming_it(data_folder, edit, problem):
    with_meta(data_folder, edit)
    path = data_folder / "meta.json"
    for read in (lambda: D.load_meta(str(data_folder)), lambda: D.TokenLoader(str(data_folder), "train", 1, 8)):
        with pytest.raises(ValueError) as e:
            read()
        message = str(e.value)
        assert message.startswith(f"{path} is not a data folder's meta.json: {problem}") and "\n" not in message
        assert message.endswith(f"; re-run prepare_data.py for {data_folder} (or pass another data folder)")
    # prepare_data.py itself, pointed at the folder: the fix there is --force
    message = one_line_error(data_folder, f"a={data_folder.parent / 'a.jsonl'}")
    assert message.startswith(f"error: {path} is not a data folder's meta.json: {problem}")
    assert message.endswith(f"--force rebuilds {data_folder} (dropping that file), or pass another --out")


@pytest.mark.parametrize("what", ["a FIFO", "a device"])
def test_a_shard_or_meta_json_of_another_kind_is_named_as_it_is(data_folder, what):
    # Was "missing shard" / "not found": the file is there, and is not one (a FIFO would block the read,
    # a link to /dev/zero read forever).
    def replace(path):
        os.remove(path)
        os.mkfifo(path) if what == "a FIFO" else os.symlink("/dev/zero", path)
    shard = data_folder / json.loads((data_folder / "meta.json").read_text())["splits"]["train"]["shards"][0]
    replace(shard)
    with pytest.raises(ValueError, match=rf"^shard {shard} is {what}, not a token shard file; re-run prepare_data.py"):
        D.TokenLoader(str(data_folder), "train", 1, 8)
    replace(data_folder / "meta.json")
    with pytest.raises(ValueError, match=rf"^{data_folder / 'meta.json'} is {what}, not a data folder's meta.json"):
        D.load_meta(str(data_folder))


def test_train_and_eval_read_a_broken_meta_json_in_one_line(data_folder, tmp_path):
    import eval as E
    with_meta(data_folder, "[]")
    wanted = f"{data_folder / 'meta.json'} is not a data folder's meta.json: it holds a JSON list, not an object"
    with pytest.raises(ValueError, match="^" + wanted.replace(".", r"\.")):
        E.val_batches(str(data_folder), "train", 1, 8, 100, 0, "loss")
    line = train_error(["--model_size=tiny", "--seq_len=8", "--global_batch=1", "--batch_size=1", "--max_steps=2",
                        "--warmup_steps=1", f"--data_dir={data_folder}", f"--out_dir={tmp_path / 'run'}"])
    assert line == f"data: {wanted}; re-run prepare_data.py for {data_folder} (or pass another data folder)"


# ---------------------------------------------------------------- output folders that cannot be written


def test_out_that_is_a_file_or_under_one(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ["some text"])
    (tmp_path / "f").write_bytes(b"not a folder")
    assert one_line_error(tmp_path / "f", f"a={a}") == (
        f"error: cannot write {tmp_path / 'f'} (File exists): it is a file: pass a folder as --out")
    assert one_line_error(tmp_path / "f" / "sub", f"a={a}") == (
        f"error: cannot write {tmp_path / 'f' / 'sub'} (Not a directory): a folder of the path is a file: "
        f"pass another --out")
    assert (tmp_path / "f").read_bytes() == b"not a folder" and not leftovers(tmp_path)


def read_only_run(folder, args):
    """prepare_data.py with `folder` bind-mounted read-only (a user and mount namespace: the root
    of a container ignores file modes, not a read-only mount)."""
    script = f'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" && exec "$1" prepare_data.py "${{@:2}}"'
    return subprocess.run(["unshare", "-rm", "bash", "-c", script, str(folder), sys.executable, *args], cwd=ROOT,
                          capture_output=True, text=True, env=launch_env(), timeout=120)


def can_mount_read_only(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        run = subprocess.run(["unshare", "-rm", "bash", "-c", f'mount --bind "{probe}" "{probe}" && '
                              f'mount -o remount,ro,bind "{probe}" && ! touch "{probe}/x" 2>/dev/null'],
                             capture_output=True, timeout=30)
    except FileNotFoundError:
        return False
    return run.returncode == 0


def test_read_only_out_is_one_line_and_untouched(tmp_path):
    if not can_mount_read_only(tmp_path):
        pytest.skip("no user namespaces here to mount a read-only folder")
    a = write_jsonl(tmp_path / "a.jsonl", random_docs(40, "abc ", seed=4))
    prepared = tmp_path / "prepared"
    prepare(prepared, f"a={a}")
    (tmp_path / "empty").mkdir()
    for folder, extra in [(tmp_path / "empty", []), (prepared, ["--force"])]:
        before = snapshot(folder)
        run = read_only_run(folder, ["text", "--out", str(folder), "--workers", "1", "--source", f"a={a}", *extra])
        line = one_error_line(run)
        assert line.startswith(f"error: cannot write {folder}") and "(Read-only file system)" in line, line
        assert line.endswith("pass an --out on a writable file system"), line
        assert snapshot(folder) == before


def limited(limit):
    """A child's preexec_fn: writes past `limit` bytes fail with EFBIG (Python ignores SIGXFSZ)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_file_size_limit_is_one_line_and_leaves_no_temporary_file(tmp_path, capsys):
    docs = random_docs(300, "abcdefgh ", seed=5)
    a = write_jsonl(tmp_path / "a.jsonl", docs)
    n_tokens = sum(len(d.encode()) + 1 for d in docs)
    args = ["text", "--workers", "1", "--val-fraction", "0", "--source", f"a={a}", "--out"]
    # below the token cache (2 bytes a token): it fails, and the folder this run made goes
    run = run_cli([*args, str(tmp_path / "o1")], preexec_fn=limited(n_tokens))
    line = one_error_line(run)
    assert line == (f"error: cannot write {tmp_path / 'o1' / 'tokenize_cache' / 'a.tokens.bin'} (File too large): "
                    f"the file-size limit (ulimit -f) is below the file: raise it (ulimit -f unlimited)"), line
    assert not (tmp_path / "o1").exists()
    # above the cache, below the shard (the cache plus a header and a doc table): the cache stays for the rerun
    out = tmp_path / "o2"
    run = run_cli([*args, str(out)], preexec_fn=limited(2 * n_tokens + 64))
    assert one_error_line(run).startswith(f"error: cannot write {out / 'train_000000.bin'} (File too large)")
    assert sorted(os.listdir(out)) == ["tokenize_cache"] and not leftovers(out)
    prepare(out, f"a={a}", val_fraction=0)
    assert "a: reusing tokens from an interrupted run" in capsys.readouterr().err
    assert sorted(decoded_docs(out, "train")) == sorted(docs)


# ---------------------------------------------------------------- Ctrl-C


# prepare_data.py whose read of source b (a file named b.jsonl) waits, after a's tokens are cached
SLOW_B = """
import runpy, sys, time
import datasets
load = datasets.load_dataset

def slow(*args, data_files=None, **kwargs):
    if any(str(f).endswith("b.jsonl") for f in data_files or []):
        time.sleep(600)
    return load(*args, data_files=data_files, **kwargs)

datasets.load_dataset = slow
sys.argv = ["prepare_data.py", *sys.argv[1:]]
runpy.run_path("prepare_data.py", run_name="__main__")
"""


@pytest.mark.parametrize("earlier", [False, True])
def test_ctrl_c_is_one_line_exit_130_and_leaves_no_temporary_file(tmp_path, capsys, earlier):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while the second source is being
    read, after the first source's tokens are cached. A --force rebuild of a prepared folder stopped there
    keeps its earlier data: it goes only once the new tokens are all at hand (it went first)."""
    a = write_jsonl(tmp_path / "a.jsonl", random_docs(200, "abcdef ", seed=6))
    b = write_jsonl(tmp_path / "b.jsonl", random_docs(200, "uvwxyz ", seed=7))
    out = tmp_path / "out"
    args = ["text", "--out", str(out), "--workers", "2", "--source", f"a={a}", "--source", f"b={b}"]
    if earlier:
        P.main([*args[:-4], "--source", f"a={a}"])  # a folder prepared from a alone
        before = snapshot(out)
        args.append("--force")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_B, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=launch_env(), start_new_session=True)
    deadline = time.time() + 60
    while not (out / "tokenize_cache" / "a.done.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # on to source b
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    state = "keeps its earlier data" if earlier else "is not prepared"
    assert err.strip().splitlines()[-1] == (f"interrupted; {out} {state}: the same command resumes, reusing "
                                            f"the tokens of a"), err
    assert not leftovers(out)
    if earlier:
        assert {k: v for k, v in snapshot(out).items() if not k.startswith("tokenize_cache")} == before
    else:
        assert sorted(os.listdir(out)) == ["tokenize_cache"]
    P.main(args)  # the rerun resumes from a's tokens
    assert "a: reusing tokens from an interrupted run" in capsys.readouterr().err
    assert D.load_meta(str(out))["sources"] == ["a", "b"]


# ---------------------------------------------------------------- size flags


@pytest.mark.parametrize("argv, message", [
    (["--shard-tokens", "1"], "argument --shard-tokens: must be >= 65536 (got 1)"),  # a file per token before
    (["--shard-tokens", "65535"], "argument --shard-tokens: must be >= 65536 (got 65535)"),
    (["--max-tokens", "2"], "argument --max-tokens: must be >= 1000 (got 2)"),  # 2B without its B: an empty folder
])
def test_size_flags_below_a_usable_size_are_refused(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        P.main(["text", "--out", str(tmp_path / "o"), "--source", f"a={tmp_path / 'a.jsonl'}", *argv])
    said = capsys.readouterr().err.strip()
    assert e.value.code == 2 and said.startswith("error: ") and "\n" not in said and message in said, said
    assert not (tmp_path / "o").exists()


def test_the_floors_themselves_are_accepted(tmp_path):
    docs = random_docs(100, "abcdef ", seed=8)
    a = write_jsonl(tmp_path / "a.jsonl", docs)
    meta = prepare(tmp_path / "o", f"a={a},max_tokens=1K", shard_tokens="65536", max_tokens=1000, val_fraction=0)
    assert meta["splits"]["train"]["tokens"] == 1000
