"""The run folder never lies (train.py): crash-safe pruning and what "complete" means, fallback
from a damaged newest checkpoint, the out_dir lock against a double launch, no checkpoint with
non-finite state, resume refusing a different experiment, no code from rng pickles, token ids
checked against the vocab, one-line messages (config files, eval.py on damaged input, a full
disk), and the CPU matmul peak."""
import glob
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch

import checkpoint
import eval as ev
import train
from conftest import launch_env
from data import check_token_ids, data_fingerprint, load_meta
from test_faults_eval import error_line
from test_train import ROOT, TINY, command, rows, run_here, run_train, train_error

ARGS = [*TINY, "--max_steps=6", "--ckpt_interval=1", "--keep_last=3"]


@pytest.fixture(scope="module")
def run6(data_dir, tmp_path_factory):
    """A finished 6-step run with a checkpoint every step (the last 3 kept): the reference."""
    out = str(tmp_path_factory.mktemp("ref") / "run")
    run_here([*ARGS, f"--data_dir={data_dir}", f"--out_dir={out}"])
    return out


def copy_run(run, tmp_path, name="run"):
    dst = str(tmp_path / name)
    shutil.copytree(run, dst)
    return dst


def one_line(p):
    """The failed command's error: exactly one line on stderr (no traceback)."""
    err = p.stderr.strip()
    assert p.returncode != 0 and err and "\n" not in err and "Traceback" not in err, p.stderr[-3000:]
    return err


# ----------------------------------------------------------------------------- completeness, pruning
def test_complete_means_every_file_dcp_names(run6, tmp_path):
    run = copy_run(run6, tmp_path)
    newest = os.path.join(run, "ckpt_00000006")
    assert checkpoint.checkpoint_problem(newest) is None
    shard = glob.glob(os.path.join(newest, "*.distcp"))[0]
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    assert checkpoint.checkpoint_problem(newest) == f"{os.path.basename(shard)} is truncated ({size // 2} of {size} bytes)"
    os.remove(shard)
    assert checkpoint.checkpoint_problem(newest) == f"{os.path.basename(shard)} is missing"
    assert [os.path.basename(c) for c in checkpoint.complete_checkpoints(run)] == ["ckpt_00000004", "ckpt_00000005"]
    os.remove(os.path.join(run, "ckpt_00000005", "rng_rank0.pt"))
    assert checkpoint.checkpoint_problem(os.path.join(run, "ckpt_00000005")) == "rng_rank0.pt is missing"
    with open(os.path.join(run, "ckpt_00000004", "meta.json"), "w") as f:
        f.write('{"step": 4, ')
    assert checkpoint.checkpoint_problem(os.path.join(run, "ckpt_00000004")).startswith("meta.json is not valid JSON")


def test_kill_during_prune_leaves_no_complete_looking_folder(run6, tmp_path, monkeypatch):
    """rmtree removes the .distcp data before meta.json/.metadata: killed in between, the old
    pruning left a folder every tool took as complete. Now the folder leaves the ckpt_ namespace
    first; the kill is simulated by an rmtree that dies after the first file."""
    run = copy_run(run6, tmp_path)
    real_rmtree = shutil.rmtree

    def killed_rmtree(path, *a, **k):
        os.remove(glob.glob(os.path.join(path, "*.distcp"))[0])
        raise KeyboardInterrupt("killed mid-prune")
    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_rmtree)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.prune_checkpoint(os.path.join(run, "ckpt_00000004"))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    assert os.path.isdir(os.path.join(run, "deleting_ckpt_00000004"))
    assert [os.path.basename(c) for c in checkpoint.complete_checkpoints(run)] == ["ckpt_00000005", "ckpt_00000006"]
    assert checkpoint.scan_checkpoints(run)[1] == []  # nothing half-deleted is even listed
    checkpoint.clear_leftovers(run)
    assert not glob.glob(os.path.join(run, "deleting_*"))


@pytest.mark.slow
def test_real_kills_while_saving_and_pruning_never_leave_a_damaged_ckpt(data_dir, tmp_path):
    """SIGKILL at random moments of a run that saves and prunes every step: after each kill,
    every ckpt_ folder is complete, and the resumed run ends with the uninterrupted run's losses (the killed runs
    are processes; the reference and the resume run in this process)."""
    args = [*TINY, f"--data_dir={data_dir}", "--max_steps=20", "--ckpt_interval=1", "--keep_last=1", "--eval_interval=50"]
    ref, out = str(tmp_path / "ref"), str(tmp_path / "killed")
    run_here([*args, f"--out_dir={ref}"])
    rng = np.random.default_rng(0)
    for kill in range(4):
        proc = subprocess.Popen(command([*args, f"--out_dir={out}"], 1), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=launch_env())
        deadline = time.time() + 120
        while not glob.glob(os.path.join(out, "ckpt_*")) and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.05, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        complete, damaged = checkpoint.scan_checkpoints(out)
        assert damaged == [], damaged
    run_here([*args, f"--out_dir={out}"])
    assert rows(out, "loss") == rows(ref, "loss")


# ----------------------------------------------------------------------------- damaged newest checkpoint
@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_and_says_so(run6, data_dir, tmp_path):
    # Contents damaged in place (sizes right, so only loading can tell): resume falls back.
    run = copy_run(run6, tmp_path)
    shard = glob.glob(os.path.join(run, "ckpt_00000006", "*.distcp"))[0]
    data = bytearray(open(shard, "rb").read())
    data[: len(data) // 2] = os.urandom(len(data) // 2)
    open(shard, "wb").write(bytes(data))
    p = run_here([*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}"])
    assert "ckpt_00000006 could not be resumed" in p.stdout and "falling back" in p.stdout
    assert "resumed from " + os.path.join(run, "ckpt_00000005") in p.stdout
    assert rows(run, "loss") == rows(run6, "loss")  # step 6 redone from 5: bitwise the same
    assert checkpoint.checkpoint_problem(os.path.join(run, "ckpt_00000006")) is None  # rewritten whole
    # Truncated (caught before loading): said and skipped.
    run = copy_run(run6, tmp_path, "trunc")
    with open(glob.glob(os.path.join(run, "ckpt_00000006", "*.distcp"))[0], "r+b") as f:
        f.truncate(100)
    p = run_here([*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}"])
    assert "ckpt_00000006 is damaged (__0_0.distcp is truncated" in p.stdout and "resumed from" in p.stdout


# ----------------------------------------------------------------------------- lock
@pytest.mark.slow
def test_double_launch_exits_at_once_naming_the_holder(data_dir, tmp_path):
    out = str(tmp_path / "run")
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=100000", "--ckpt_interval=20",
            "--log_interval=1", "--warmup_steps=2"]
    first = subprocess.Popen(command(args, 1), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=launch_env())
    try:
        deadline = time.time() + 300
        while not glob.glob(os.path.join(out, "ckpt_*")) and time.time() < deadline:
            time.sleep(0.05)
        second = run_train(args, ok=False)
        err = one_line(second)
        assert f"pid {first.pid} on host" in err and "in use by" in err
        assert first.poll() is None  # the holder trains on, undisturbed
        time.sleep(1)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    logged = sorted(rows(out, "loss"))
    assert logged == list(range(1, len(logged) + 1)) and len(logged) >= 20  # every row of the holder's, in place
    assert len(checkpoint.complete_checkpoints(out)) >= 1 and checkpoint.scan_checkpoints(out)[1] == []
    # the kernel released the lock with its holder: the next launch gets past it (and stops at
    # the experiment check, having been asked for a different schedule)
    assert "max_steps 100000 there, 50 now" in train_error([*args, "--max_steps=50"])


# ----------------------------------------------------------------------------- non-finite state
@pytest.mark.parametrize("eps", [0.0, 1e-50, 1e-40, 1e-38, 1.2e-38, 1e-8])
def test_adam_eps_below_the_fp32_normal_range_is_rejected(eps):
    """float32 (AdamW's state) is the reference: an eps it rounds to 0 or holds only as a
    subnormal is refused; 1e-50 used to pass and train to NaN with a hint blaming lr."""
    fp32 = torch.tensor(eps, dtype=torch.float32)
    if fp32 != 0 and abs(fp32) >= torch.finfo(torch.float32).smallest_normal:
        assert train.load_config([f"--adam_eps={eps!r}"])["adam_eps"] == eps
    else:
        with pytest.raises(ValueError, match=rf"adam_eps={eps:g} must be >= float32's smallest normal 1.18e-38"):
            train.load_config([f"--adam_eps={eps!r}"])


@pytest.mark.slow
def test_non_finite_weights_are_never_saved(data_dir, tmp_path):
    """lr=2e38 with betas (0, 0.95) and weight decay 1 on the norm gains, each within float32 (the
    config takes them): AdamW scales every gain (1 at init) by 1 - lr*wd = -2e38, then moves it by
    about lr against its gradient, so a gain with a positive gradient ends at -4e38 = -inf, while
    the loss and gradient norm that the step checks, taken before the update, are finite. The
    step-1 checkpoint would hold -inf; it is refused, and nothing is left that looks like a
    checkpoint. (An init can't be non-finite: γ is at most 3; nor can adam_eps give 0/0: it is at
    least float32's smallest normal.)"""
    out = str(tmp_path / "run")
    p = run_here([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--ckpt_interval=1", "--max_steps=4",
                  "--warmup_steps=0", "--lr=2e38", "--betas=(0.0, 0.95)", "--weight_decay.norm=1.0"], ok=False)
    err = one_line(p)
    assert "step 1: parameters or optimizer state are not finite" in err and "No checkpoint of this run was saved yet" in err
    assert not glob.glob(os.path.join(out, "*ckpt_*"))


def test_all_finite_sees_one_nan_in_optimizer_state():
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    train.setup_distributed()
    try:
        assert checkpoint.all_finite(net, opt)
        opt.state[net.weight]["exp_avg_sq"][1, 2] = float("nan")
        assert not checkpoint.all_finite(net, opt)
        opt.state[net.weight]["exp_avg_sq"][1, 2] = 0.0
        with torch.no_grad():
            net.bias[0] = float("-inf")
        assert not checkpoint.all_finite(net, opt)
    finally:
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- provenance
# train.py with one more setting in EXPERIMENT, as a forker adds a loop setting that changes what is trained.
WITH_A_NEW_EXPERIMENT_SETTING = """
import sys
import train
train.EXPERIMENT["eval_batches"] = train.DEFAULTS["eval_batches"]
try:
    train.main(sys.argv[1:])
except Exception as e:
    sys.exit(str(e))
"""


def test_a_setting_added_to_train_pys_experiment_list_is_refused_on_resume(run6, data_dir, tmp_path):
    # The one place: train.EXPERIMENT, beside the defaults; the resume (checkpoint.py) reads it from there.
    run = copy_run(run6, tmp_path)
    p = subprocess.run([sys.executable, "-c", WITH_A_NEW_EXPERIMENT_SETTING, *ARGS, f"--data_dir={data_dir}",
                        f"--out_dir={run}", "--eval_batches=2"], cwd=ROOT, capture_output=True, text=True,
                       env=launch_env())
    assert p.returncode == 1 and "was trained with other settings (eval_batches 1 there, 2 now)" in p.stderr, p.stderr
    assert set(train.EXPERIMENT) <= set(train.DEFAULTS)  # every name a setting


@pytest.mark.slow
def test_resume_refuses_a_different_experiment(run6, data_dir, tmp_path):
    run = copy_run(run6, tmp_path)
    base = [*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}"]
    err = one_line(run_here([*base, "--gamma=0.5", "--seed=1"], ok=False))
    assert "gamma 1.0 there, 0.5 now; seed 0 there, 1 now" in err and "allow_resume_changes" in err
    meta = meta_of(run)
    fp = data_fingerprint(data_dir, load_meta(data_dir))
    assert checkpoint.experiment_changes(meta, train.load_config(base), fp, train.EXPERIMENT) == {}
    older = {**meta, "config": {k: v for k, v in meta["config"].items() if k != "optimizer"}}  # before the setting
    assert checkpoint.experiment_changes(older, train.load_config(base), fp, train.EXPERIMENT) == {}
    assert checkpoint.experiment_changes(older, train.load_config([*base, "--optimizer=muon"]), fp,
                                         train.EXPERIMENT) == {"optimizer": {"was": "adamw", "now": "muon"}}
    changed = train.load_config([*base, "--weight_decay.matrix=1.0"])
    assert checkpoint.experiment_changes(meta, changed, fp, train.EXPERIMENT) == {"weight_decay": {
        "was": {"matrix": 0.1, "embed": 0.0, "norm": 0.0}, "now": {"matrix": 1.0, "embed": 0.0, "norm": 0.0}}}
    # the same data, every byte rot13'd: the same size and shapes, other tokens
    other = str(tmp_path / "rot13")
    shutil.copytree(data_dir, other)
    for path in glob.glob(os.path.join(other, "*.bin")):
        raw = bytearray(open(path, "rb").read())
        body = np.frombuffer(raw, np.uint8, offset=64)  # behind the shard header: docs, then tokens
        tail = np.array(body)
        letters = (tail >= 97) & (tail <= 122)
        tail[letters] = (tail[letters] - 97 + 13) % 26 + 97
        open(path, "wb").write(bytes(raw[:64]) + tail.tobytes())
    meta = load_meta(other)
    for info in meta["splits"].values():
        info.pop("shard_sha256")  # as a folder written before fingerprints: hashed from the files
    json.dump(meta, open(os.path.join(other, "meta.json"), "w"))
    assert data_fingerprint(other, meta) != fp
    assert list(checkpoint.experiment_changes(meta_of(run), train.load_config(base), data_fingerprint(other, meta),
                                              train.EXPERIMENT)) == ["data"]
    # explicitly allowed: resumes, and the change is on record
    p = run_here([*base, "--max_steps=7", "--allow_resume_changes=True"])
    assert "resuming with changed settings" in p.stdout
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if "resume_changes" in line]
    assert records == [{"step": 6, "resume_changes": {"max_steps": {"was": 6, "now": 7}}}]
    # the recorded settings stay the first run's, the change listed with its step; the next
    # resume at the changed value is the same experiment
    history = [{"step": 6, "changes": {"max_steps": {"was": 6, "now": 7}}}]
    meta7, config = (json.load(open(os.path.join(run, *f))) for f in (("ckpt_00000007", "meta.json"), ("config.json",)))
    assert meta7["config"]["max_steps"] == 6 == config["max_steps"]
    assert meta7["resume_changes"] == history == config["resume_changes"]
    p = run_here([*base, "--max_steps=7"])  # 7 is what the run now is: no change, no flag needed
    assert "resumed from " + os.path.join(run, "ckpt_00000007") in p.stdout and "changed settings" not in p.stdout


def meta_of(run):
    return json.load(open(os.path.join(run, "ckpt_00000006", "meta.json")))


class Boom:
    """Unpickled, it runs a shell command: what a crafted rng file in a shared run folder could do."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's remark on the crafted file's pickle
def test_rng_file_is_loaded_without_running_code(run6, data_dir, tmp_path):
    run = copy_run(run6, tmp_path)
    with open(os.path.join(run, "ckpt_00000006", "rng_rank0.pt"), "wb") as f:
        pickle.dump({"cpu": Boom(tmp_path / "PWNED")}, f)
    drop_checksums(os.path.join(run, "ckpt_00000006"))  # whoever crafts the file rewrites meta.json too
    p = run_here([*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}"])
    assert not (tmp_path / "PWNED").exists()
    assert "ckpt_00000006 could not be resumed (UnpicklingError" in p.stdout  # refused, not run


def drop_checksums(ckpt):
    """As written before checksums: meta.json without sha256s, and no meta.json.sha256."""
    meta_file = os.path.join(ckpt, "meta.json")
    meta = json.load(open(meta_file))
    del meta["sha256"]
    json.dump(meta, open(meta_file, "w"))
    os.remove(os.path.join(ckpt, "meta.json.sha256"))


def test_crafted_metadata_runs_no_code_on_resume_eval_or_export(run6, data_dir, tmp_path, capsys):
    """DCP reads .metadata with plain pickle.load: a crafted one in a shared run folder would run
    on train.py resume, eval.py and export. Every checkpoint of the run is crafted here."""
    run = copy_run(run6, tmp_path)
    marker = tmp_path / "PWNED"
    for ckpt in glob.glob(os.path.join(run, "ckpt_*")):
        with open(os.path.join(ckpt, ".metadata"), "wb") as f:
            pickle.dump(Boom(marker), f)
        drop_checksums(ckpt)
    newest = os.path.join(run, "ckpt_00000006")
    assert checkpoint.checkpoint_problem(newest) == ("its .metadata names posix.system, which DCP never writes "
                                                     "there (a crafted file?): not loaded")
    def files():  # all but the lock, which says who tried last
        return {f: open(f, "rb").read() for f in glob.glob(os.path.join(run, "**"), recursive=True)
                if os.path.isfile(f) and not f.endswith("train.lock")}
    before = files()
    err = train_error([*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}"])
    assert err.startswith(f"every checkpoint in {run} is damaged (ckpt_00000006: its .metadata names posix.system")
    for argv in (["weights", run], ["loss", newest, "--data", data_dir]):
        assert "DCP never writes there" in error_line(argv, capsys)
    assert "DCP never writes there" in train_error(["export", newest, str(tmp_path / "x.pt")])
    assert not marker.exists()
    assert files() == before  # the refused run folder is left as it was (item: all damaged, nothing pruned)


def test_crafted_byte_entry_runs_no_code(tmp_path):
    """DCP's planner torch.loads byte entries (the optimizer's param_groups) with weights_only=False.
    A checkpoint written by DCP itself with a payload among those entries, loaded the way resume
    loads (checkpoint.dcp_load), is refused."""
    marker = tmp_path / "PWNED"
    crafted = str(tmp_path / "crafted")
    with warnings.catch_warnings():  # single process, no process group: DCP says so in a warning
        warnings.simplefilter("ignore")
        torch.distributed.checkpoint.save({"model": {"w": torch.zeros(2)}, "optim": {"groups": [{"lr": Boom(marker)}]}},
                                          checkpoint_id=crafted)
        with pytest.raises(BaseException) as e:  # DCP's CheckpointException is a BaseException
            checkpoint.dcp_load({"model": {"w": torch.empty(2)}, "optim": {"groups": [{"lr": None}]}}, crafted)
    assert not marker.exists()
    assert checkpoint.load_error(e.value) == ("its entry optim.groups.0.lr is a pickle of more than plain data "
                                              "(a crafted file?): not loaded")


# ----------------------------------------------------------------------------- checksums
@pytest.mark.parametrize("target", ["ckpt_00000006", "."])
def test_load_model_returns_the_meta_json_whose_sha256s_it_checked(run6, tmp_path, monkeypatch, target):
    """A checkpoint folder or a run folder: meta.json is read once, so the settings load_model
    returns are the ones it verified the files against, even when the file is replaced right after
    the check (it was read a second time for the settings, which then came from the new file)."""
    run = copy_run(run6, tmp_path)
    meta_file = os.path.join(run, "ckpt_00000006", "meta.json")
    with open(meta_file) as f:
        on_disk = json.load(f)
    real = checkpoint.checksum_problem
    checked = []

    def check_then_replace(path, meta, *args):
        checked.append(json.loads(json.dumps(meta)))  # as it was when checked
        problem = real(path, meta, *args)
        with open(meta_file, "w") as f:
            json.dump({**meta, "step": 999}, f)
        return problem

    monkeypatch.setattr(checkpoint, "checksum_problem", check_then_replace)
    _, info = checkpoint.load_model(os.path.join(run, target))
    assert checked == [on_disk] and info["step"] == on_disk["step"] == 6
    assert {k: v for k, v in info.items() if k != "path"} == on_disk


def test_checkpoint_records_the_sha256_of_every_file_it_wrote(run6):
    for ckpt in checkpoint.complete_checkpoints(run6):
        recorded = json.load(open(os.path.join(ckpt, "meta.json")))["sha256"]
        on_disk = {name: hashlib.sha256(open(os.path.join(ckpt, name), "rb").read()).hexdigest()
                   for name in os.listdir(ckpt) if name not in ("meta.json", "meta.json.sha256")}
        assert recorded == on_disk


@pytest.mark.slow
def test_a_flipped_byte_in_any_checkpoint_file_is_damage(run6, data_dir, tmp_path, capsys):
    names = sorted(json.load(open(os.path.join(run6, "ckpt_00000006", "meta.json")))["sha256"])
    assert names == [".metadata", "__0_0.distcp", "rng_rank0.pt"]
    for name in names:
        run = copy_run(run6, tmp_path, name.strip("."))
        newest = os.path.join(run, "ckpt_00000006")
        with open(os.path.join(newest, name), "r+b") as f:  # 16 bytes in the middle: sizes stay right
            f.seek(os.path.getsize(f.name) // 2)
            f.write(bytes(16))
        if name != ".metadata":  # a changed index may not unpickle at all: damaged before its sha256 is read
            with pytest.raises(ValueError, match=f"damaged checkpoint \\({name} does not match its sha256"):
                checkpoint.load_model(newest)
        # a run folder: the newest intact one, saying which was passed over and why
        net, info = checkpoint.load_model(run)
        assert info["path"] == os.path.join(run, "ckpt_00000005")
    capsys.readouterr()
    ev.main(["loss", run, "--data", data_dir, "--tokens", "256"])
    assert "using ckpt_00000005; newer but damaged: ckpt_00000006" in capsys.readouterr().err
    assert checkpoint.load_model(newest, verify=False)[1]["path"] == newest  # the explicit way past the check
    p = run_here([*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}"])
    assert "ckpt_00000006 could not be resumed (DamagedCheckpoint: rng_rank0.pt does not match its sha256" in p.stdout
    assert rows(run, "loss") == rows(run6, "loss")  # step 6 redone from 5


# ----------------------------------------------------------------------------- token ids
def test_token_ids_past_the_vocab_are_caught_at_start(data_dir, tmp_path):
    meta = load_meta(data_dir)
    assert max(max(s["shard_max_id"]) for s in meta["splits"].values()) == 256  # the bytes' end-of-text
    check_token_ids(data_dir, meta, 257)
    with pytest.raises(ValueError, match=r"train_000000.bin holds token id 256 >= the model's vocab_size 256"):
        check_token_ids(data_dir, meta, 256)
    # a shard corrupted after writing, in a folder without stored max ids: read from the shards
    other = str(tmp_path / "bad")
    shutil.copytree(data_dir, other)
    path = os.path.join(other, "val_000000.bin")
    raw = bytearray(open(path, "rb").read())
    raw[-2:] = np.array([300], np.uint16).tobytes()
    open(path, "wb").write(bytes(raw))
    meta = load_meta(other)
    for info in meta["splits"].values():
        info.pop("shard_max_id")
    json.dump(meta, open(os.path.join(other, "meta.json"), "w"))
    err = train_error([*TINY, f"--data_dir={other}", f"--out_dir={tmp_path / 'r'}", "--max_steps=4"])
    assert "val_000000.bin holds token id 300 >= the model's vocab_size 257" in err


# ----------------------------------------------------------------------------- messages
@pytest.mark.parametrize("text, message", [
    ("lr = 3e-3\nmax_steps = (\n", r"bad.py:2: syntax error"),
    ("include('nope.py')\n", r"no such config file '.*nope.py'"),
    ("lr = 1e-3\nx = undefined_name\n", r"bad.py:2: NameError: name 'undefined_name' is not defined"),
])
def test_broken_config_files_are_one_line(tmp_path, text, message):
    (tmp_path / "bad.py").write_text(text)
    p = subprocess.run([sys.executable, "train.py", str(tmp_path / "bad.py")], cwd=ROOT, capture_output=True, text=True)
    assert __import__("re").search(message, one_line(p))


@pytest.mark.parametrize("arg, message", [
    # trained silently: every weight 0 at γ=50
    ("--gamma=50", "config: gamma=50.0 is outside 0 < γ <= 3"),
    # a traceback from re, 43 lines, once the model was built
    ("--init_overrides={'[': 0.5}", "overrides pattern '[' is not a valid regex (unterminated character set"),
    # ignored: a typo left the head at the global γ
    ("--init_overrides={'^lm_haed': 0.5}", "overrides pattern '^lm_haed' matches no parameter (names are like lm_head.weight"),
    # a 30-line traceback from AdamW's first step: the step size overflows float32
    ("--lr=1e39", "config: lr=1e+39 is too large: AdamW's first step size lr/(1 - betas[0]) = 1e+40"),
    # trained to NaN at step 2 (0 in fp32: 0/0 where a gradient is 0), the hint blaming lr
    ("--adam_eps=1e-50", "config: adam_eps=1e-50 must be >= float32's smallest normal 1.18e-38"),
])
def test_gamma_and_override_mistakes_are_one_line_before_training(data_dir, tmp_path, arg, message):
    out = tmp_path / "run"
    assert message in train_error([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=2",
                                   "--warmup_steps=1", arg])
    assert not out.exists()  # refused with the config, before the run folder


def test_names_from_other_trainers_get_a_hint():
    with pytest.raises(ValueError, match=r"unknown key 'learning_rate' in the command line; did you mean 'lr'"):
        train.load_config(["--learning_rate=1e-3"])
    with pytest.raises(ValueError, match=r"did you mean 'max_steps'"):
        train.load_config(["--max_iters=10"])


def test_eval_on_damaged_or_wrong_input_is_one_line(run6, data_dir, tmp_path, capsys):
    def eval_error(path):
        line = error_line(["weights", str(path)], capsys)
        assert line.startswith("error: "), line
        return line
    run = copy_run(run6, tmp_path)
    newest = os.path.join(run, "ckpt_00000006")
    with open(glob.glob(os.path.join(newest, "*.distcp"))[0], "r+b") as f:
        f.truncate(10)
    err = eval_error(newest)
    assert "damaged or half-written checkpoint (__0_0.distcp is truncated" in err
    assert "complete ones beside it: ckpt_00000004, ckpt_00000005" in err
    open(os.path.join(run, "ckpt_00000005", "meta.json"), "w").write("{not json")
    assert "meta.json is not valid JSON" in eval_error(os.path.join(run, "ckpt_00000005"))
    assert "is a data folder (prepare_data.py output), not a checkpoint" in eval_error(data_dir)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(os.urandom(4096))
    assert "junk.pt: not a torch file (no zip archive in it" in eval_error(junk)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no ckpt_* folders" in eval_error(empty)


def tmpfs(path, size):
    os.makedirs(path, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("can't mount a small tmpfs here (needs root): the full-disk test needs a filesystem to fill")


@pytest.mark.slow
def test_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_last(run6, data_dir, tmp_path):
    disk = tmp_path / "disk"
    ckpt = sum(os.path.getsize(p) for p in glob.glob(os.path.join(run6, "ckpt_00000006", "*")))
    tmpfs(disk, f"{int(2.5 * ckpt) // 1024}k")  # room for two checkpoints and the logs, not a third
    try:
        out = str(disk / "run")
        args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=8", "--ckpt_interval=1", "--keep_last=3"]
        err = one_line(run_here(args, ok=False))
        assert err.startswith("no space left on device while saving") and "is intact. Free space and resume" in err
        complete, damaged = checkpoint.scan_checkpoints(out)
        assert complete and damaged == [] and not glob.glob(os.path.join(out, "tmp_*"))
        assert err.split(" is intact")[0].endswith(os.path.basename(complete[-1]))
        assert checkpoint.checkpoint_problem(complete[-1]) is None
        assert sorted(rows(out, "loss"))[-1] >= int(complete[-1][-8:])  # metrics kept up to the failure
    finally:
        unmounted = subprocess.run(["umount", str(disk)], capture_output=True).returncode == 0
    assert unmounted, "the run (in this process) left a file open on the disk"


@pytest.mark.slow
@pytest.mark.parametrize("holds_lock", [False, True], ids=["train.lock", "config.json"])
def test_full_disk_at_start_names_the_file(data_dir, tmp_path, holds_lock):
    """A full disk at start-up failed in a write or flush, whose OSError has no file name: the
    one line said only "No space left on device". A folder of an earlier launch has a train.lock
    with a page of its own (rewritten in place), so there config.json is the first to fail."""
    disk = tmp_path / "disk"
    tmpfs(disk, "64k")
    try:
        out = disk / "run"
        if holds_lock:
            out.mkdir()
            (out / "train.lock").write_bytes(bytes(100))
        with open(disk / "filler", "wb", buffering=0) as f:  # fill the rest
            with pytest.raises(OSError):
                while True:
                    f.write(bytes(4096))
        p = run_here([*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=4"], ok=False)
        name = "config.json" if holds_lock else "train.lock"
        assert one_line(p) == (f"no space left on device writing {out / name}: free space and rerun (files written "
                               f"before are intact)")
    finally:
        unmounted = subprocess.run(["umount", str(disk)], capture_output=True).returncode == 0
    assert unmounted, "the run (in this process) left a file open on the disk"


def limit_file_size(limit):
    """A child's preexec_fn: writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored, as a
    shell's ulimit -f under Python leaves it), as on a filesystem with a file-size limit."""
    def apply():
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return apply


@pytest.mark.slow
def test_file_size_limit_is_one_line_at_start_and_while_saving(run6, data_dir, tmp_path):
    """EFBIG (and EDQUOT) were not recognised as a full disk: a 147-line traceback, the partial
    checkpoint left behind. Below a checkpoint shard (~2 MB) but above metrics.jsonl: the save
    fails; below config.json (~1 kB): the start fails naming it."""
    run = copy_run(run6, tmp_path)
    before = {f: open(f, "rb").read() for f in glob.glob(os.path.join(run, "ckpt_*", "*"))}
    cmd = command([*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}", "--max_steps=8", "--allow_resume_changes=True"], 1)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=launch_env(),
                       preexec_fn=limit_file_size(500_000))
    err = one_line(p)
    newest = os.path.join(run, "ckpt_00000006")
    assert err.startswith(f"file too large for the file-size limit (ulimit -f) while saving {run}/tmp_ckpt_00000007 "
                          f"(the limit is 500,000 bytes): not saved, its partial folder removed; {newest} is intact. "
                          f"Raise the limit"), err
    assert not glob.glob(os.path.join(run, "tmp_*")) and checkpoint.complete_checkpoints(run)[-1] == newest
    assert {f: open(f, "rb").read() for f in glob.glob(os.path.join(run, "ckpt_*", "*"))} == before
    assert checkpoint.checksum_problem(newest, meta_of(run)) is None
    assert sorted(rows(run, "loss"))[-1] == 7  # metrics kept up to the failure
    fresh = str(tmp_path / "fresh")
    p = subprocess.run(command([*ARGS, f"--data_dir={data_dir}", f"--out_dir={fresh}"], 1), cwd=ROOT,
                       capture_output=True, text=True, env=launch_env(), preexec_fn=limit_file_size(500))
    assert one_line(p).startswith(f"file too large for the file-size limit (ulimit -f) writing {fresh}/config.json: "
                                  f"raise the limit")


def interrupt(args, after):
    """train.py given SIGINT (Ctrl-C) once it has printed a line starting with `after`."""
    proc = subprocess.Popen(command(args, 1), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=launch_env())
    try:
        for line in proc.stdout:
            if line.startswith(after):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(args, proc.returncode, "", err)


@pytest.mark.slow
def test_ctrl_c_is_one_line_naming_the_step_and_the_resume_point(data_dir, tmp_path):
    """Ctrl-C printed 124-148 lines of traceback. Now: exit code 130, one line with the step
    reached and where the same command resumes (or that it starts over), nothing half-written."""
    out = str(tmp_path / "run")
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=100000", "--ckpt_interval=1000"]
    p = interrupt(args, "step 1/")
    assert p.returncode == 130 and re.fullmatch(r"interrupted at step \d+/100000; no checkpoint was saved yet: the "
                                                r"same command starts over", one_line(p)), p.stderr
    p = interrupt([*args[:-1], "--ckpt_interval=2"], f"saved {out}")
    err = one_line(p)
    assert p.returncode == 130 and re.fullmatch(rf"interrupted at step \d+/100000; the same command resumes from "
                                                rf"{re.escape(out)}/ckpt_\d+", err), err
    step = int(err.split("at step ")[1].split("/")[0])
    assert err.endswith(checkpoint.complete_checkpoints(out)[-1]) and int(err[-8:]) <= step
    assert not glob.glob(os.path.join(out, "tmp_*")) and checkpoint.scan_checkpoints(out)[1] == []
    assert sorted(rows(out, "loss"))[-1] >= int(err[-8:])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads through Linux's /proc")
def test_no_thread_outlives_a_run_that_stopped_on_an_error(data_dir, tmp_path):
    """The NaN guard's exit, the gloo group of the 1-rank run still alive: DTensor's caches kept the
    model's device meshes and each mesh its group, so gloo's threads ran on through the
    interpreter's exit ("terminate called without an active exception", SIGABRT, rc 134, in 2 of
    17 such exits under CPU load). Only the main thread may be left when atexit runs."""
    probe = ("import atexit, os, runpy, sys\n"
             "atexit.register(lambda: print('threads at exit:', len(os.listdir('/proc/self/task')), file=sys.stderr))\n"
             "sys.argv[0] = 'train.py'\n"
             "runpy.run_path('train.py', run_name='__main__')\n")
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'run'}", "--max_steps=12", "--debug_nan_step=3"]
    p = subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT, capture_output=True, text=True,
                       env=launch_env(), timeout=600)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 2 and "non-finite loss nan" in lines[0], p.stderr[-3000:]
    assert lines[1] == "threads at exit: 1"


# ----------------------------------------------------------------------------- MFU peak
def test_mfu_on_cpu_only_against_a_peak_the_user_gives():
    # A CPU has no datasheet peak: a start-up timing under load once printed MFU 148-152%.
    cpu = torch.device("cpu")
    assert train.mfu_peak({"peak_flops": 0.0}, cpu)[0] == 0.0 and train.matmul_now(cpu) == ""
    assert train.mfu_peak({"peak_flops": 2e11}, cpu) == (2e11, "peak_flops setting")


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12), ("NVIDIA A100", 0.0)])
def test_mfu_is_against_the_datasheet_peak_for_train_and_bench_alike(monkeypatch, name, peak):
    # NVIDIA's dense bf16 figures by the name CUDA reports; a GPU not listed gets no MFU, not a guess.
    import mfu
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    gpu = torch.device("cuda", 0)
    assert mfu.datasheet_peak(gpu)[0] == peak
    assert train.mfu_peak({"peak_flops": 0.0}, gpu)[0] == peak


def test_a_model_field_newer_than_the_checkpoint_counts_as_its_default(run6, tmp_path):
    run = copy_run(run6, tmp_path)
    path = os.path.join(run, "ckpt_00000006")
    meta = meta_of(run)
    mcfg = train.model_config(meta["config"], "cpu")
    del meta["model_config"]["norm"]  # as written before GPTConfig had the field
    json.dump(meta, open(os.path.join(path, "meta.json"), "w"))
    checkpoint.check_resumable(path, mcfg)
    meta["model_config"]["norm"] = "layernorm"
    json.dump(meta, open(os.path.join(path, "meta.json"), "w"))
    with pytest.raises(ValueError, match="norm 'layernorm' there, 'rmsnorm' now"):
        checkpoint.check_resumable(path, mcfg)


@pytest.mark.slow
def test_saving_the_init_does_not_change_the_run(data_dir, tmp_path):
    """DCP's get_state_dict materialises AdamW's state with a zero-gradient step (step count 1):
    a kept step-0 checkpoint used to shift every later bias correction. With and without it, and
    resumed from it, the run is the same, bitwise."""
    args = [*TINY, f"--data_dir={data_dir}", "--max_steps=6", "--ckpt_interval=6"]
    plain, kept = str(tmp_path / "plain"), str(tmp_path / "kept")
    run_here([*args, f"--out_dir={plain}"])
    run_here([*args, f"--out_dir={kept}", "--keep_steps=[0]"])
    assert rows(kept, "loss") == rows(plain, "loss")
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(kept, "ckpt_00000000"), os.path.join(resumed, "ckpt_00000000"))
    p = run_here([*args, f"--out_dir={resumed}", "--keep_steps=[0]"])
    assert "resumed from" in p.stdout and rows(resumed, "loss") == rows(plain, "loss")


def test_log_line_mfu_and_time_left(monkeypatch):
    lines = []
    monkeypatch.setattr(train, "log0", lines.append)

    class Metrics:  # what StepLog reads and writes of checkpoint.Metrics
        spent = {"eval_s": [30.0], "bench_s": [], "ckpt_s": [6.0]}
        record = [].append

    cfg = {"log_interval": 1, "max_steps": 4, "global_batch": 2, "seq_len": 64, "eval_interval": 4,
           "ckpt_interval": 4, "keep_steps": [], "bench_interval": 0}
    cpu = torch.device("cpu")
    for step, peak in ((2, 0.0), (4, 1e6)):  # 128 tokens in 1 s, 4,000 FLOPs a token
        log_step = train.StepLog(cfg, Metrics, cpu, 4000.0, peak, step - 2)
        log_step({"step": step - 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0}, 1.0)  # the launch's first line
        del lines[-1]
        log_step({"step": step, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0}, 2.0)
    # Step 2: steps 3-4 at 1 s, then step 4's evaluation (30 s) and checkpoint (6 s): 38 s.
    assert "mfu n/a" in lines[0] and lines[0].endswith("eta 0.6 min")
    # The last step: 512,000 FLOP/s against a 1e6 peak; only the final evaluation and checkpoint left.
    assert "mfu 51.2%" in lines[1] and lines[1].endswith("final evaluation and checkpoint ~0.6 min")
