"""The study's data rebuilds with its documented command (`bash results/cpu_lm.sh data`) into the
fingerprint committed in results/data.json, and a changed corpus file stops it in one line naming
the file. Needs the offline kit beside the checkout (../shared/data); skips, saying so, without it."""
import json
import os
import shutil
import subprocess

import pytest

from conftest import launch_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.path.join(ROOT, "..", "shared", "data")
pytestmark = pytest.mark.slow


def study_workspace(tmp_path, corpus):
    """repo/ with what the data section runs, and shared/data/corpus beside it as `corpus` gives it."""
    repo = tmp_path / "repo"
    (repo / "results").mkdir(parents=True)
    # Every top-level module, so that a new import in prepare_data.py's chain cannot break the copy.
    modules = [name for name in os.listdir(ROOT) if name.endswith(".py")]
    for name in modules + ["results/cpu_lm.sh", "results/data_check.py", "results/data.json"]:
        shutil.copy(os.path.join(ROOT, name), repo / name)
    (tmp_path / "shared" / "data").mkdir(parents=True)
    corpus(tmp_path / "shared" / "data" / "corpus")
    return repo


def run_data_section(repo):
    return subprocess.run(["bash", "results/cpu_lm.sh", "data"], cwd=repo, capture_output=True, text=True,
                          env=launch_env(), timeout=600)


@pytest.fixture
def kit_corpus():
    if not os.path.isdir(os.path.join(KIT, "corpus")):
        pytest.skip("../shared/data (the offline kit's corpora) is not beside this checkout: the study's data cannot be built")
    return os.path.realpath(os.path.join(KIT, "corpus"))


def test_documented_command_rebuilds_the_committed_fingerprint(tmp_path, kit_corpus):
    repo = study_workspace(tmp_path, lambda dst: os.symlink(kit_corpus, dst))
    p = run_data_section(repo)
    assert p.returncode == 0, p.stdout + p.stderr
    want = json.loads((repo / "results" / "data.json").read_text())["bi_bytes"]["data_fingerprint"]
    assert f"data/bi_bytes is the study's data (fingerprint {want})" not in p.stdout  # it was built, not found
    assert f"is the study's data (fingerprint {want})" in p.stdout
    meta = json.loads((repo / "data" / "bi_bytes" / "meta.json").read_text())
    assert {s: meta["source_stats"][s]["val_tokens"] for s in ("en", "zh")} == {"en": 160293, "zh": 162560}
    again = run_data_section(repo)  # an existing data/bi_bytes is checked too, and kept
    assert again.returncode == 0 and f"data/bi_bytes is the study's data (fingerprint {want})" in again.stdout


def test_a_changed_corpus_file_fails_in_one_line_naming_it(tmp_path, kit_corpus):
    def corpus_with_one_edit(dst):
        shutil.copytree(kit_corpus, dst, symlinks=False,
                        copy_function=lambda src, d: os.symlink(os.path.realpath(src), d))
        edited = dst / "en" / "tinyshakespeare" / "input.txt"
        text = edited.read_text()
        edited.unlink()
        edited.write_text(text.replace("Citizen", "Citizan", 1))
    repo = study_workspace(tmp_path, corpus_with_one_edit)
    p = run_data_section(repo)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data/.rebuild_bi_bytes is not the study's bi_bytes data: source "
                           "en: tinyshakespeare/input.txt differs from the study's"), p.stderr
    assert not (repo / "data" / "bi_bytes").exists()  # nothing is kept under the study's name
