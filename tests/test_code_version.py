"""The code version a run records (config.json and every checkpoint's meta.json): the git commit and a
dirty flag in a git checkout, and always the sha256 of the source files; and the one chooser of a run's
newest intact checkpoint, which sweep.py's result rows read through too."""
import glob
import hashlib
import json
import os
import shutil
import subprocess

import pytest

import checkpoint
import configurator
import downstream
import eval as ev
import sweep
from test_train import ROOT, TINY, command, run_here
from conftest import failure_text, launch_env

RUN = [*TINY, "--max_steps=3", "--ckpt_interval=3"]


@pytest.fixture(scope="module")
def run3(data_dir, tmp_path_factory):
    """A finished 3-step run of the repo's code, its one checkpoint at step 3: tests copy it."""
    out = str(tmp_path_factory.mktemp("ref") / "run")
    run_here([*RUN, f"--data_dir={data_dir}", f"--out_dir={out}"])
    return out


def sha256sum_reference(root):
    """The source hash as the shell computes it: sha256sum over the files in sorted order, hashed."""
    script = "(ls *.py; find config -name '*.py') | LC_ALL=C sort | xargs sha256sum | sha256sum"
    out = subprocess.run(["bash", "-c", script], cwd=root, capture_output=True, text=True, check=True).stdout
    return out.split()[0]


def git(root, *args):
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout


def copy_sources(dst):
    """The repo's code as a tarball would give it: top-level modules and config files, no .git."""
    os.makedirs(dst)
    for name in glob.glob(os.path.join(ROOT, "*.py")):
        shutil.copy(name, dst)
    shutil.copytree(os.path.join(ROOT, "config"), os.path.join(dst, "config"))
    return str(dst)


def recorded(run):
    """(config.json's code version, {checkpoint name: its meta.json's code version})."""
    with open(os.path.join(run, "config.json")) as f:
        config = json.load(f)["code_version"]
    return config, {os.path.basename(c): checkpoint.read_meta(c)["code_version"]
                    for c in checkpoint.complete_checkpoints(run)}


# ----------------------------------------------------------------------------- code version
@pytest.mark.slow
def test_a_copy_without_git_records_the_source_hash_that_wrote_each_checkpoint(data_dir, tmp_path):
    code = copy_sources(tmp_path / "code")
    run = os.path.join(code, "out", "run")  # the default place: a run folder inside the code's folder
    p = subprocess.run(command([*RUN, f"--data_dir={data_dir}", f"--out_dir={run}"], 1), cwd=code,
                       capture_output=True, text=True, timeout=600, env=launch_env())
    assert p.returncode == 0, failure_text(p)
    first = {"git_commit": None, "git_dirty": None, "source_sha256": sha256sum_reference(code)}
    assert recorded(run) == (first, {"ckpt_00000003": first})
    # A run folder's files are never read as code: one planted there leaves the hash as it was.
    with open(os.path.join(run, "notes.py"), "w") as f:
        f.write("x = 1\n")
    assert checkpoint.code_version(code) == first
    # Changed code, resumed: the new checkpoint and config.json say so, the old checkpoint keeps its own.
    with open(os.path.join(code, "configurator.py"), "a") as f:
        f.write("# an edit\n")
    second = {**first, "source_sha256": sha256sum_reference(code)}
    assert second != first
    p = subprocess.run(command([*RUN, f"--data_dir={data_dir}", f"--out_dir={run}", "--max_steps=4",
                                "--ckpt_interval=1", "--allow_resume_changes=True"], 1),
                       cwd=code, capture_output=True, text=True, timeout=600, env=launch_env())
    assert p.returncode == 0 and "resumed from" in p.stdout, failure_text(p)
    assert recorded(run) == (second, {"ckpt_00000003": first, "ckpt_00000004": second})


def test_in_the_repo_it_records_the_commit_and_the_dirty_flag():
    try:
        head = git(ROOT, "rev-parse", "HEAD").strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the repo is not a git checkout here")
    # git status's own lines, filtered here to the source files: top-level *.py and config/**.py
    paths = [line[3:].split(" -> ")[-1] for line in git(ROOT, "status", "--porcelain").splitlines()]
    dirty = any(p.endswith(".py") and ("/" not in p or p.startswith("config/")) for p in paths)
    version = checkpoint.code_version()
    assert version == {"git_commit": head, "git_dirty": dirty, "source_sha256": sha256sum_reference(ROOT)}
    assert sweep.git_commit() == head + ("-dirty" if dirty else "")  # the sweep's rows: one implementation


def test_dirty_means_a_source_file_differs_from_the_commit(tmp_path):
    repo = copy_sources(tmp_path / "repo")
    with open(os.path.join(repo, "README.md"), "w") as f:
        f.write("notes\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "x")
    head = git(repo, "rev-parse", "HEAD").strip()
    assert checkpoint.code_version(repo) == {"git_commit": head, "git_dirty": False,
                                             "source_sha256": sha256sum_reference(repo)}
    with open(os.path.join(repo, "README.md"), "a") as f:  # not code
        f.write("more\n")
    assert checkpoint.code_version(repo)["git_dirty"] is False
    new_config = os.path.join(repo, "config", "new.py")  # untracked, yet a config a run can use
    with open(new_config, "w") as f:
        f.write("lr = 1e-3\n")
    assert checkpoint.code_version(repo)["git_dirty"] is True
    os.remove(new_config)
    with open(os.path.join(repo, "model.py"), "a") as f:
        f.write("# an edit\n")
    assert checkpoint.code_version(repo)["git_dirty"] is True
    # A copy of the code inside another project's checkout is not at that project's commit.
    nested = copy_sources(os.path.join(repo, "vendor"))
    assert checkpoint.code_version(nested) == {"git_commit": None, "git_dirty": None,
                                               "source_sha256": sha256sum_reference(nested)}


@pytest.mark.slow
def test_a_checkpoint_written_without_a_code_version_still_resumes_and_exports(run3, data_dir, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(run3, run)
    ckpt = os.path.join(run, "ckpt_00000003")
    with open(os.path.join(ckpt, "meta.json")) as f:
        meta = json.load(f)
    del meta["code_version"]  # as written before it existed, meta.json's sha256 beside it to match
    raw = json.dumps(meta).encode()
    with open(os.path.join(ckpt, "meta.json"), "wb") as f:
        f.write(raw)
    with open(os.path.join(ckpt, "meta.json.sha256"), "w") as f:
        f.write(f"{hashlib.sha256(raw).hexdigest()}  meta.json\n")
    checkpoint.export(ckpt, str(tmp_path / "m.pt"))  # what `train.py export` runs
    assert checkpoint.load_model(str(tmp_path / "m.pt"))[1]["step"] == 3
    p = run_here([*RUN, f"--data_dir={data_dir}", f"--out_dir={run}", "--max_steps=4", "--ckpt_interval=1",
                  "--allow_resume_changes=True"])
    assert "resumed from " + ckpt in p.stdout
    assert "code_version" not in checkpoint.read_meta(ckpt)
    # (not compared with today's code version: the working tree may change while the test runs)
    assert set(checkpoint.read_meta(os.path.join(run, "ckpt_00000004"))["code_version"]) == \
        {"git_commit", "git_dirty", "source_sha256"}


# ----------------------------------------------------------------------------- one chooser, shared helpers
def test_the_sweep_reads_the_data_fingerprint_of_the_checkpoint_eval_uses(run3, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(run3, run)
    intact = os.path.join(run, "ckpt_00000003")
    fingerprint = checkpoint.read_meta(intact)["data_fingerprint"]
    # Newer ones: a link to another run's checkpoint, and one whose meta.json no longer matches its sha256.
    other = tmp_path / "elsewhere" / "ckpt_00000009"
    shutil.copytree(intact, other)
    with open(other / "meta.json") as f:
        meta = json.load(f)
    meta["data_fingerprint"] = "f" * 64
    with open(other / "meta.json", "w") as f:
        json.dump(meta, f)
    shutil.copytree(other, os.path.join(run, "ckpt_00000004"))
    os.symlink(other, os.path.join(run, "ckpt_00000005"))
    assert checkpoint.load_model(run)[1]["path"] == intact
    assert sweep.trained_data_fingerprint(run) == fingerprint


def test_a_metrics_line_that_is_not_a_row_fails_the_sweep_point_instead_of_being_skipped(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"lr": 0.01}')
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "tokens": 128}\n{"step": 2, "lo\n'
                                       '{"step": 2, "loss": 4.0, "tokens": 256}\n')

    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not a metrics row"):
        sweep.point_result([], {"name": "p", "arm": "a", "configs": [], "arm_set": {}, "setting": {}, "seed": 0},
                           str(run), 1.0, [])
    # the half-written last row of a killed run is the one line that is dropped
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "tokens": 128}\n{"step": 2, "lo')
    row = sweep.point_result([], {"name": "p", "arm": "a", "configs": [], "arm_set": {}, "setting": {}, "seed": 0},
                             str(run), 1.0, [])
    assert row["tokens"] == 128 and row["final_train_loss"] == 5.0


def test_one_at_least_for_every_command_line():
    assert sweep.at_least is ev.at_least is downstream.at_least is configurator.at_least
