"""Run folders are untrusted input (checkpoint.py): reading a crafted .metadata changes nothing in the
process, a checkpoint reads no file outside its folder or unlisted in meta.json, meta.json has a
sha256 of its own and keys of the right types (else it is damage, and resume falls back), a line of
metrics.jsonl that is not a row is one line, and no lock, log write or prune goes through a symlink."""
import dataclasses
import glob
import hashlib
import importlib
import json
import os
import pathlib
import pickle
import re
import shutil

import pytest
from torch.distributed.checkpoint.metadata import Metadata

import checkpoint
from test_run_folder import ARGS, copy_run, one_line, run6  # noqa: F401  (run6: the shared reference run)
from test_train import rows, run_here, train_error

NEWEST, PREVIOUS = "ckpt_00000006", "ckpt_00000005"
TRUEDIV = pathlib.PosixPath.__truediv__


def write_meta(ckpt, raw):
    """meta.json as given, with the sha256 beside it (sha256sum's format) agreeing: what whoever
    crafts or rewrites a checkpoint would leave."""
    with open(os.path.join(ckpt, "meta.json"), "wb") as f:
        f.write(raw)
    with open(os.path.join(ckpt, "meta.json.sha256"), "w") as f:
        f.write(f"{hashlib.sha256(raw).hexdigest()}  meta.json\n")


def list_sha256(ckpt, name, digest):
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    meta["sha256"][name] = digest
    write_meta(ckpt, json.dumps(meta).encode())


def rewrite(ckpt, name, data):
    """A checkpoint file replaced, its sha256 in meta.json updated to match: only checks of what the
    file says can refuse it."""
    with open(os.path.join(ckpt, name), "wb") as f:
        f.write(data)
    list_sha256(ckpt, name, hashlib.sha256(data).hexdigest())


def folder_bytes(folder):
    return {os.path.relpath(f, folder): open(f, "rb").read()
            for f in glob.glob(os.path.join(folder, "**"), recursive=True) if os.path.isfile(f)}


# ----------------------------------------------------------------------------- .metadata that would act
def allow_listed_classes():
    found = (getattr(importlib.import_module(module), name) for module, name in checkpoint.METADATA_CLASSES)
    return [c for c in found if isinstance(c, type)]


def class_attributes():
    return {c: dict(vars(c)) for c in allow_listed_classes()}


@pytest.fixture
def classes_before():
    """The allow-listed classes' attributes before the test; put back after it, so that a failing
    test leaves the next ones a sane process."""
    before = class_attributes()
    yield before
    for cls, attributes in before.items():
        for name in set(vars(cls)) - set(attributes):
            delattr(cls, name)
        for name, value in attributes.items():
            if vars(cls).get(name) is not value:
                setattr(cls, name, value)


# Each passes the allow-list and, unpickled and read as DCP's index, would set a class attribute
# for the whole process: BUILD applied to the class PosixPath (Path's `/` becomes a dtype), the
# class Metadata as the index (its storage_meta default replaced), a class as its storage_meta.
CRAFTED = {
    "build-on-a-class": b"\x80\x02cpathlib\nPosixPath\nN}X\x0b\x00\x00\x00__truediv__ctorch\nfloat32\ns\x86b.",
    "a-class-as-the-index": b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n.",
    "a-class-as-storage-meta": pickle.dumps(Metadata(state_dict_metadata={}, storage_meta=pathlib.PosixPath)),
}


@pytest.mark.parametrize("payload", CRAFTED.values(), ids=CRAFTED.keys())
def test_a_crafted_metadata_is_damage_and_changes_nothing_in_the_process(run6, tmp_path, classes_before, payload):
    run = copy_run(run6, tmp_path)
    newest = os.path.join(run, NEWEST)
    rewrite(newest, ".metadata", payload)
    problem = checkpoint.checkpoint_problem(newest)
    assert problem.startswith("its .metadata ") and problem.endswith(" (a crafted file?): not loaded"), problem
    with pytest.raises(ValueError, match=r"damaged or half-written checkpoint \(its .metadata .*; complete ones"):
        checkpoint.load_model(newest)  # eval.py and export given the folder
    assert checkpoint.load_model(run)[1]["path"] == os.path.join(run, PREVIOUS)  # a run folder: the intact one
    assert pathlib.PosixPath.__truediv__ is TRUEDIV and pathlib.Path("a") / "b" == pathlib.Path("a/b")
    assert class_attributes() == classes_before


@pytest.mark.slow
def test_resume_falls_back_from_a_crafted_metadata(run6, data_dir, tmp_path):  # noqa: F811
    run = copy_run(run6, tmp_path)
    rewrite(os.path.join(run, NEWEST), ".metadata", CRAFTED["build-on-a-class"])
    p = run_here([*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}"])
    assert f"{NEWEST} is damaged (its .metadata sets attributes of <class 'pathlib.PosixPath'>" in p.stdout
    assert "resumed from " + os.path.join(run, PREVIOUS) in p.stdout
    assert rows(run, "loss") == rows(run6, "loss")  # step 6 redone from 5: the process was sane throughout


@pytest.mark.slow
def test_a_checkpoint_without_its_sidecar_is_named_and_an_edited_data_position_refused(run6, data_dir, tmp_path):  # noqa: F811
    # Whole, its sidecar deleted (or from before sidecars): resumed, and said so.
    run = copy_run(run6, tmp_path)
    os.remove(os.path.join(run, NEWEST, checkpoint.META_SUM))
    p = run_here([*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}"])
    assert f"{os.path.join(run, NEWEST)} has no meta.json.sha256 (deleted, or written before checkpoints had one): " \
        "its meta.json is checked only against its step" in p.stdout
    assert "resumed from " + os.path.join(run, NEWEST) in p.stdout
    # Its data position moved by one window and the sidecar gone: the resume would read other batches, silently.
    run = copy_run(run6, tmp_path, "edited")
    meta = json.load(open(os.path.join(run, NEWEST, "meta.json")))
    meta["data_state"]["pos"] += 1
    with open(os.path.join(run, NEWEST, "meta.json"), "w") as f:
        json.dump(meta, f)
    os.remove(os.path.join(run, NEWEST, checkpoint.META_SUM))
    p = run_here([*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}"])
    assert re.search(rf"{NEWEST} could not be resumed \(meta.json puts the data at epoch \d+, window \d+, where 6 steps "
                     r"of 4 windows end at epoch \d+, window \d+: edited after it was written\)", p.stdout), p.stdout
    assert "resumed from " + os.path.join(run, PREVIOUS) in p.stdout
    assert rows(run, "loss") == rows(run6, "loss")  # step 6 redone from 5, on the batches it read the first time


def test_the_data_position_check_follows_the_loader(data_dir):
    # data.TokenLoader's own positions, step by step over several epochs (an epoch ends where the next
    # batch would not fit), against the check; one window off is caught at every step.
    import data as D
    loader = D.TokenLoader(data_dir, "train", batch_size=96, seq_len=32)
    assert loader.n_windows % 96  # a remainder dropped at each epoch's end
    for step in range(3 * loader.n_windows // 96 + 2):
        meta = {"step": step, "config": {"global_batch": 96}, "data_state": loader.state_dict()}
        assert checkpoint.data_position_problem(meta) is None, step
        moved = {**meta, "data_state": {**meta["data_state"], "pos": loader.pos + 1}}
        assert "edited after it was written" in checkpoint.data_position_problem(moved)
        loader.next_batch()
    # After a resume that changed the batch the position depends on that history: not checked.
    changed = {**moved, "resume_changes": [{"step": 3, "changes": {"global_batch": {"was": 96, "now": 48}}}]}
    assert checkpoint.data_position_problem(changed) is None


# ----------------------------------------------------------------------------- files outside the folder
def point_storage_at(ckpt, name):
    index = checkpoint.CheckpointReader(ckpt).read_metadata()
    for key, item in index.storage_data.items():
        index.storage_data[key] = dataclasses.replace(item, relative_path=name)
    rewrite(ckpt, ".metadata", pickle.dumps(index))


@pytest.mark.parametrize("where", ["parent", "absolute", "unlisted", "symlink"])
def test_a_checkpoint_reads_only_listed_files_inside_its_folder(run6, tmp_path, where):
    """Another checkpoint's weights (ckpt_4's shard: the same size, so every range is on disk), reached
    from the newest one; its sha256 check passes, as it hashes the files meta.json names."""
    run = copy_run(run6, tmp_path)
    newest = os.path.join(run, NEWEST)
    other = os.path.join(run, "other", "__0_0.distcp")
    os.makedirs(os.path.dirname(other))
    shutil.copy(os.path.join(run, "ckpt_00000004", "__0_0.distcp"), other)
    if where == "parent":
        point_storage_at(newest, "../other/__0_0.distcp")
        expected = "its .metadata points a storage entry at '../other/__0_0.distcp', not a file inside the checkpoint"
    elif where == "absolute":
        point_storage_at(newest, other)
        expected = f"its .metadata points a storage entry at {other!r}, not a file inside the checkpoint"
    elif where == "unlisted":
        shutil.copy(other, os.path.join(newest, "extra.distcp"))
        point_storage_at(newest, "extra.distcp")
        expected = "extra.distcp is not among the files meta.json has sha256s of"
    else:
        os.remove(os.path.join(newest, "__0_0.distcp"))
        os.symlink(other, os.path.join(newest, "__0_0.distcp"))
        list_sha256(newest, "__0_0.distcp", hashlib.sha256(open(other, "rb").read()).hexdigest())
        expected = "__0_0.distcp is a symlink: not followed"
    assert checkpoint.checkpoint_problem(newest).startswith(expected)
    with pytest.raises(ValueError, match="damaged or half-written checkpoint"):
        checkpoint.load_model(newest)
    assert checkpoint.load_model(run)[1]["path"] == os.path.join(run, PREVIOUS)


# ----------------------------------------------------------------------------- meta.json itself
def flip_data_position(ckpt):
    """One bit of meta.json flipped: the loader's position's last digit, which stays a digit."""
    with open(os.path.join(ckpt, "meta.json"), "rb") as f:
        raw = f.read()
    at = re.search(rb'"pos": \d+', raw).end() - 1
    flipped = raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:]
    assert json.loads(flipped)["data_state"]["pos"] != json.loads(raw)["data_state"]["pos"]
    with open(os.path.join(ckpt, "meta.json"), "wb") as f:
        f.write(flipped)


def test_meta_json_has_a_sha256_beside_it_and_a_flipped_bit_is_damage(run6, tmp_path):
    for ckpt in checkpoint.complete_checkpoints(run6):  # `sha256sum -c meta.json.sha256` in the folder
        digest = hashlib.sha256(open(os.path.join(ckpt, "meta.json"), "rb").read()).hexdigest()
        assert open(os.path.join(ckpt, "meta.json.sha256")).read() == f"{digest}  meta.json\n"
    run = copy_run(run6, tmp_path)
    newest = os.path.join(run, NEWEST)
    flip_data_position(newest)
    assert checkpoint.checkpoint_problem(newest) == ("meta.json does not match its sha256 in meta.json.sha256 (its "
                                                     "bytes changed after it was written)")
    assert checkpoint.load_model(run)[1]["path"] == os.path.join(run, PREVIOUS)


def test_checkpoints_written_before_the_meta_sha256_still_load(run6, tmp_path):
    run = copy_run(run6, tmp_path)
    for sidecar in glob.glob(os.path.join(run, "ckpt_*", "meta.json.sha256")):
        os.remove(sidecar)
    assert checkpoint.scan_checkpoints(run)[1] == []
    assert checkpoint.load_model(run)[1]["path"] == os.path.join(run, NEWEST)


META_DAMAGE = {
    "a-list": (lambda meta: [], "meta.json holds a JSON list, not an object"),
    "no-step": (lambda meta: {k: v for k, v in meta.items() if k != "step"}, "meta.json has no 'step'"),
    "no-model-config": (lambda meta: {k: v for k, v in meta.items() if k != "model_config"},
                        "meta.json has no 'model_config'"),
    "world-size-text": (lambda meta: {**meta, "world_size": "1"}, "meta.json has 'world_size' of type str, not int"),
    "data-state-list": (lambda meta: {**meta, "data_state": [0]}, "meta.json has 'data_state' of type list, not dict"),
    "listed-outside": (lambda meta: {**meta, "sha256": {**meta["sha256"], "../x": "0" * 64}},
                       "meta.json lists '../x' among its files, not a file inside the checkpoint folder"),
}


@pytest.mark.parametrize("damage, expected", META_DAMAGE.values(), ids=META_DAMAGE.keys())
def test_meta_json_without_the_keys_readers_use_is_damage(run6, tmp_path, damage, expected):
    run = copy_run(run6, tmp_path)
    newest = os.path.join(run, NEWEST)
    write_meta(newest, json.dumps(damage(json.load(open(os.path.join(newest, "meta.json"))))).encode())
    assert checkpoint.checkpoint_problem(newest) == expected
    with pytest.raises(ValueError, match=re.escape(f"damaged or half-written checkpoint ({expected})")):
        checkpoint.find_checkpoints(newest)
    assert checkpoint.load_model(run)[1]["path"] == os.path.join(run, PREVIOUS)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped-bit", "a-list"])
def test_resume_falls_back_from_a_damaged_meta_json(run6, data_dir, tmp_path, damage):  # noqa: F811
    run = copy_run(run6, tmp_path)
    newest = os.path.join(run, NEWEST)
    if damage == "flipped-bit":
        flip_data_position(newest)
    else:
        write_meta(newest, b"[]")
    p = run_here([*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}"])
    assert f"{newest} is damaged (meta.json " in p.stdout and "resumed from " + os.path.join(run, PREVIOUS) in p.stdout
    assert rows(run, "loss") == rows(run6, "loss")  # step 6 redone from 5, at the data position saved there


# ----------------------------------------------------------------------------- metrics.jsonl
@pytest.mark.parametrize("bad", ["5", '{"step": "x", "loss": 1.0}', "{not json", '{"loss": 1.0}'])
def test_a_metrics_line_that_is_not_a_row_is_one_line_and_changes_nothing(tmp_path, bad):
    path = tmp_path / "metrics.jsonl"
    text = '{"step": 1, "loss": 3.0}\n' + bad + '\n{"step": 2, "loss": 2.0}\n'
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        checkpoint.truncate_metrics(str(path), 2)
    assert str(e.value).startswith(f"{path} line 2 is not a metrics row ({bad!r}") and "\n" not in str(e.value)
    assert "repair or delete that line" in str(e.value)
    assert path.read_text() == text


def test_metrics_rows_after_the_checkpoint_and_a_half_written_last_row_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')  # killed mid-row
    checkpoint.truncate_metrics(str(path), 1)
    assert path.read_text() == '{"step": 1, "loss": 3.0}\n'
    # a whole last row without its newline (a disk that filled): kept, and the next row starts a line
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}')
    checkpoint.truncate_metrics(str(path), 2)
    assert path.read_text() == '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n'


@pytest.mark.slow
def test_resume_with_a_damaged_metrics_line_is_one_line(run6, data_dir, tmp_path):  # noqa: F811
    run = copy_run(run6, tmp_path)
    metrics = os.path.join(run, "metrics.jsonl")
    lines = open(metrics).readlines()
    damaged = "".join(lines[:2] + ["5\n"] + lines[2:])
    open(metrics, "w").write(damaged)
    assert train_error([*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}"]).startswith(
        f"{metrics} line 3 is not a metrics row ('5'")
    assert open(metrics).read() == damaged


# ----------------------------------------------------------------------------- symlinks in a run folder
def plant_link(link, target, data=b"the user's own file\n"):
    """A symlink in a run folder to an outside file with known bytes (data None: to no file yet)."""
    if data is not None:
        target.write_bytes(data)
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(target, link)


@pytest.mark.slow
def test_a_symlinked_train_lock_is_refused_and_its_target_kept(data_dir, tmp_path):
    out, target = tmp_path / "run", tmp_path / "precious.txt"
    plant_link(out / "train.lock", target)
    assert train_error([*ARGS, f"--data_dir={data_dir}", f"--out_dir={out}"]).startswith(
        f"{out / 'train.lock'} is a symlink: not followed")
    assert target.read_bytes() == b"the user's own file\n"


@pytest.mark.slow
@pytest.mark.parametrize("data", [b"the user's own file\n", None], ids=["to-a-file", "to-no-file"])
def test_a_symlinked_metrics_jsonl_is_refused_and_its_target_kept(data_dir, tmp_path, data):
    out, target = tmp_path / "run", tmp_path / "precious.txt"
    plant_link(out / "metrics.jsonl", target, data)
    assert train_error([*ARGS, f"--data_dir={data_dir}", f"--out_dir={out}"]).startswith(
        f"{out / 'metrics.jsonl'} is a symlink: not followed")
    if data is None:
        assert not target.exists()  # not created through the link either
    else:
        assert target.read_bytes() == data


def test_pruning_or_clearing_a_symlink_removes_the_link_not_its_target(run6, tmp_path):
    run = copy_run(run6, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(os.path.join(run, NEWEST), elsewhere)
    before = folder_bytes(elsewhere)
    for name in ("ckpt_00000009", "tmp_ckpt_00000010", "deleting_ckpt_00000011"):
        os.symlink(elsewhere, os.path.join(run, name))
    checkpoint.prune_checkpoint(os.path.join(run, "ckpt_00000009"))
    checkpoint.clear_leftovers(run)
    assert not [n for n in os.listdir(run) if n.endswith(("09", "10", "11"))]
    assert folder_bytes(elsewhere) == before


@pytest.mark.slow
def test_a_symlinked_checkpoint_is_never_read_and_only_its_link_is_pruned(run6, data_dir, tmp_path):  # noqa: F811
    """ckpt_6 moved elsewhere and linked back: not used (resume is from ckpt_5), and when step 6 is
    saved again the link is pruned in its place, its target untouched."""
    run = copy_run(run6, tmp_path)
    link, elsewhere = os.path.join(run, NEWEST), tmp_path / "elsewhere"
    shutil.move(link, elsewhere)
    os.symlink(elsewhere, link)
    before = folder_bytes(elsewhere)
    p = run_here([*ARGS, f"--data_dir={data_dir}", f"--out_dir={run}"])
    assert f"{link} is damaged (a symlink: not followed" in p.stdout
    assert "resumed from " + os.path.join(run, PREVIOUS) in p.stdout
    assert folder_bytes(elsewhere) == before
    assert not os.path.islink(link) and checkpoint.checkpoint_problem(link) is None
    assert rows(run, "loss") == rows(run6, "loss")
