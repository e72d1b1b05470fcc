"""downstream.open_training_bench: train.py's benchmark every bench_interval steps scores as
`eval.py bench` does (the reference here: its command on the same weights), on the FSDP2 model
train.py builds, with every bad setting refused in one line before a run starts."""
import bz2
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import checkpoint
import downstream as ds
import eval as ev
import interrupt
import train
from conftest import launch_env
from init import init_model_
from model import GPT, config_for
from test_train import run_here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT_HELLASWAG = os.path.join(ROOT, "..", "shared", "data", ds.KIT_HELLASWAG)
BYTES_META = {"tokenizer": "bytes", "vocab_size": 257, "eot_id": 256}

# HellaSwag's text format (context, label, four endings); contexts of different lengths, so the
# items' scores differ from one another.
ITEMS = [("Cooking: A man cracks an egg. He puts it in a pan", 0, ["and eats it.", "drops the bowl.", "laughs",
                                                                   "cooks it slowly."]),
         ("Running: She ties her shoes. Then, she", 2, ["runs.", "sits down quietly.", "waves", "jumps up high."]),
         ("Home and Garden: How to plant a tree. Dig a hole.", 1, ["Water it daily.", "Add soil.", "Sing loudly.",
                                                                   "Run away."]),
         ("Sports: The team walks onto the field. The coach", 3, ["shouts.", "sleeps.", "eats a cake.",
                                                                  "blows a whistle."])] * 3


def write_hellaswag(path, items=ITEMS):
    with open(path, "w", encoding="utf-8") as f:
        for ctx, label, endings in items:
            f.write("\n".join([ctx, str(label), *endings]) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    """A byte-level data folder (prepare_data.py): the tokenizer the benchmark encodes with."""
    root = tmp_path_factory.mktemp("text")
    (root / "txt").mkdir()
    (root / "txt" / "a.txt").write_text("the cat sat on the mat. " * 400)
    subprocess.run([sys.executable, os.path.join(ROOT, "prepare_data.py"), "text", "--out", str(root / "bytes"),
                    "--source", f"en={root / 'txt'}", "--tokenizer", "bytes", "--workers", "1"],
                   check=True, capture_output=True, env=launch_env())
    return str(root / "bytes")


@pytest.fixture(scope="module")
def anchor_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("anchor") / "data"
    subprocess.run([sys.executable, os.path.join(ROOT, "prepare_data.py"), "anchor", "--out", str(out),
                    "--n-train", "200", "--n-eval", "100"], check=True, capture_output=True, env=launch_env())
    return str(out)


def train_cfg(**model):
    return {**train.DEFAULTS, "gamma": 1.0, "seed": 3, "model": {"max_seq_len": 128, **model}}


@contextlib.contextmanager
def fsdp_model(**model):
    """train.py's model: a 1-rank gloo group (setup_distributed), FSDP2 on every block and the root."""
    cfg = train_cfg(**model)
    train.setup_distributed()
    try:
        net, _ = train.build_model(cfg, train.model_config(cfg, "cpu"), torch.device("cpu"))
        yield net
    finally:
        interrupt.close_process_group()


def export(net, path, data_dir, data_meta=BYTES_META):
    """`train.py export`'s layout from the full weights of a (sharded) model."""
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in net.state_dict().items()}
    torch.save({"model": state, "model_config": asdict(net.cfg), "step": 0, "config": {"data_dir": data_dir},
                "data_meta": data_meta}, path)
    return str(path)


def fields(summary, task):
    """eval.py bench's scores under the row's flat names (its item count aside)."""
    return {f"bench_{task}_{k}": v for k, v in summary.items() if type(v) in (int, float) and k != "tasks"}


# ----------------------------------------------------------------------------- the same scores as eval.py bench

def test_hellaswag_on_the_fsdp_model_equals_eval_py_bench(tmp_path, text_data):
    source = write_hellaswag(tmp_path / "hs.txt")
    lines = []
    bench = ds.open_training_bench("hellaswag", source, 9, text_data, config_for("tiny", max_seq_len=128),
                                   log=lines.append)
    with fsdp_model() as net:
        row = bench(net, 40)
        ckpt = export(net, tmp_path / "m.pt", text_data)
    want = ev.main(["bench", ckpt, "--task", "hellaswag", "--source", source, "--limit", "9"])["summary"]
    assert want["tasks"] == 9
    assert set(row) == {"step", "bench_s", "bench_hellaswag_acc", "bench_hellaswag_acc_norm",
                        "bench_hellaswag_acc_norm_tokens", "bench_hellaswag_truncated"}
    assert {k: v for k, v in row.items() if k not in ("step", "bench_s")} == fields(want, "hellaswag")
    assert row["step"] == 40 and row["bench_s"] > 0
    assert lines == [f"bench hellaswag: acc {want['acc']:.3f}, acc_norm {want['acc_norm']:.3f} on 9 items in "
                     f"{row['bench_s']:.1f} s"]


def test_hellaswag_subset_of_the_kit_file_equals_eval_py_bench(tmp_path, text_data):
    if not os.path.isfile(KIT_HELLASWAG):
        pytest.skip(f"../shared/data/{ds.KIT_HELLASWAG} is not beside this checkout (offline data kit)")
    # The README's byte-level window (256): most of the kit's contexts do not fit beside their
    # endings, so they are cut from the left, as eval.py bench --truncate left cuts them.
    lines = []
    bench = ds.open_training_bench("hellaswag", KIT_HELLASWAG, 12, text_data, config_for("tiny", max_seq_len=256),
                                   truncate="left", log=lines.append)
    with fsdp_model(max_seq_len=256) as net:
        row = bench(net, 0)
        ckpt = export(net, tmp_path / "m.pt", text_data)
    want = ev.main(["bench", ckpt, "--task", "hellaswag", "--source", KIT_HELLASWAG, "--limit", "12",
                    "--truncate", "left"])["summary"]
    assert want["truncated"] > 0
    assert {k: v for k, v in row.items() if k not in ("step", "bench_s")} == fields(want, "hellaswag")
    assert f"on 12 items ({want['truncated']} contexts cut) in " in lines[0]


def test_anchor_on_the_fsdp_model_equals_eval_py_bench_with_its_limit(tmp_path, anchor_data):
    from data import load_meta
    meta = load_meta(anchor_data)
    data_meta = {k: meta[k] for k in ("tokenizer", "vocab_size", "eot_id")}
    shape = dict(vocab_size=meta["vocab_size"], eot_id=meta["eot_id"], max_seq_len=64)
    lines = []
    bench = ds.open_training_bench("anchor", "", 30, anchor_data, config_for("tiny", **shape), log=lines.append)
    with fsdp_model(**shape) as net:
        row = bench(net, 7)
        ckpt = export(net, tmp_path / "a.pt", anchor_data, data_meta)
    result = ev.main(["bench", ckpt, "--task", "anchor", "--limit", "30"])
    # eval.py bench's --limit cuts each split (it used to score all 100 records whatever the limit)
    assert [r["records"] for r in result["rows"]] == [30, 30, 30]
    want = fields(result["summary"], "anchor")
    assert {"bench_anchor_seen_pair_acc", "bench_anchor_heldout_inferential",
            "bench_anchor_attn_to_key_L1"} <= set(want)
    assert {k: v for k, v in row.items() if k not in ("step", "bench_s")} == want
    full = fields(ev.main(["bench", ckpt, "--task", "anchor"])["summary"], "anchor")
    assert full["bench_anchor_attn_to_key_L0"] != want["bench_anchor_attn_to_key_L0"]  # the limit mattered
    assert lines[0].startswith(f"bench anchor: seen_pair_acc {want['bench_anchor_seen_pair_acc']:.3f}, ")
    assert " on 30/30/30 val/test/heldout records in " in lines[0]


@pytest.mark.parametrize("mode", [True, False])
def test_the_models_mode_and_weights_are_as_they_were(tmp_path, text_data, mode):
    bench = ds.open_training_bench("hellaswag", write_hellaswag(tmp_path / "hs.txt"), 2, text_data,
                                   config_for("tiny", max_seq_len=128), log=lambda line: None)
    with fsdp_model() as net:
        net.train(mode)
        before = {k: v.full_tensor().clone() for k, v in net.state_dict().items()}
        seen = []  # the mode and grad mode the forwards ran in
        hook = net.register_forward_pre_hook(lambda m, args: seen.append((m.training, torch.is_grad_enabled())))
        bench(net, 1)
        hook.remove()
        assert seen and set(seen) == {(False, False)}
        assert {m.training for m in net.modules()} == {mode}
        after = {k: v.full_tensor() for k, v in net.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("truncate", ["", "left"])
def test_an_item_exactly_filling_the_window_is_scored_one_token_more_is_refused(tmp_path, text_data, truncate):
    # By hand, bytes: item 1's context, then its longest ending " sits down quietly." (19 bytes);
    # cut from the left, one context token beside that ending is the least that fits.
    ctx, _, endings = ITEMS[1]
    need = 19 + (1 if truncate else len(ctx))
    source = write_hellaswag(tmp_path / "hs.txt", [("Cats: A cat", 1, ["naps.", "eats.", "runs.", "sits."]), ITEMS[1]])
    fits = ds.open_training_bench("hellaswag", source, 2, text_data, config_for("tiny", max_seq_len=need - 1),
                                  truncate=truncate, log=lambda line: None)
    model = GPT(config_for("tiny", max_seq_len=need - 1))
    init_model_(model, gamma=1.0, seed=0)
    assert 0 <= fits(model, 0)["bench_hellaswag_acc"] <= 1  # hellaswag_scores takes it as it is...
    with pytest.raises(ValueError) as e:
        ds.hellaswag_scores(GPT(config_for("tiny", max_seq_len=need - 2)), lambda s: list(s.encode()),
                            ds.read_hellaswag(source)[0], truncate or None)
    assert "item 1" in str(e.value)  # ... and refuses one token less
    with pytest.raises(ValueError) as e:
        ds.open_training_bench("hellaswag", source, 2, text_data, config_for("tiny", max_seq_len=need - 2),
                               truncate=truncate)
    cut = "" if truncate else "bench_truncate='left' (its oldest context tokens cut, counted), "
    assert str(e.value) == (f"config: bench_task='hellaswag': item 1 of {source} needs {need} tokens (its longest "
                            f"ending{'' if truncate else ' and the context'}), past model.max_seq_len={need - 2} + 1; "
                            f"set {cut}bench_limit=1 (the items before it fit), a longer model.max_seq_len")


# ----------------------------------------------------------------------------- bad settings: one line, before any run

def bad_file(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


# (task, source, limit, data folder, max_seq_len[, truncate]) -> fragments of the one line
BAD = {
    "unknown task": (("mmlu", "", 10, "text", 128), ["config: bench_task='mmlu' is not a benchmark",
                                                     "hellaswag, anchor"]),
    "generation task": (("gsm8k", "", 10, "text", 128), ["bench_task='gsm8k' is a generation benchmark",
                                                        "eval.py bench"]),
    "limit 0": (("hellaswag", "hs", 0, "text", 128), ["config: bench_limit=0 must be a whole number >= 1"]),
    "limit 2.5": (("hellaswag", "hs", 2.5, "text", 128), ["config: bench_limit=2.5 must be a whole number"]),
    "no source": (("hellaswag", "", 10, "text", 128), ["config: bench_source is empty", ds.KIT_HELLASWAG]),
    "missing source": (("hellaswag", "nope.txt", 10, "text", 128), ["config: bench_source='nope.txt': no such file"]),
    "7 lines": (("hellaswag", "seven", 10, "text", 128), ["is not a HellaSwag file", "not a multiple of 6"]),
    "not bz2": (("hellaswag", "junk.bz2", 10, "text", 128), ["is not a HellaSwag file (OSError"]),
    "cut bz2": (("hellaswag", "cut.bz2", 10, "text", 128),
                ["is not a HellaSwag file (ValueError", "its compressed data ends early (a partial download or copy)"]),
    "empty jsonl": (("hellaswag", "empty.jsonl", 10, "text", 128), ["holds no HellaSwag items"]),
    "jsonl of others": (("hellaswag", "other.jsonl", 10, "text", 128),
                        ["not a HellaSwag file (ValueError", "has no 'activity_label' field"]),
    "first item too long": (("hellaswag", "hs", 10, "text", 40), ["item 0 of", "set bench_truncate='left' (its "
                                                                  "oldest context tokens cut, counted), a longer"]),
    "truncate right": (("hellaswag", "hs", 10, "text", 128, "right"), ["config: bench_truncate='right': choose ''"]),
    "hellaswag on anchor data": (("hellaswag", "hs", 10, "anchor", 128), ["needs text data", "bench_task='anchor'"]),
    "anchor on text": (("anchor", "", 10, "text", 128), ["bench_task='anchor' needs an anchor-task data_dir",
                                                         "holds bytes text"]),
    "anchor with a source": (("anchor", "hs", 10, "anchor", 128), ["the anchor task scores data_dir's own",
                                                                   "leave bench_source empty"]),
    "anchor records too long": (("anchor", "", 10, "anchor", 4), ["do not fit model.max_seq_len=4; raise it to"]),
    "tokenizer missing": (("hellaswag", "hs", 10, "gpt2", 128), ["needs data_dir's tokenizer 'gpt2'",
                                                                 "bench_tokenizer_dir"]),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_setting_is_one_config_line(case, tmp_path, text_data, anchor_data):
    (task, source, limit, data, max_seq_len, *truncate), fragments = BAD[case]
    good = write_hellaswag(tmp_path / "hs.txt")
    sources = {"hs": good, "seven": bad_file(tmp_path, "seven.txt", b"a\n" * 7),
               "junk.bz2": bad_file(tmp_path, "junk.bz2", b"not bzip2 at all"),
               "cut.bz2": bad_file(tmp_path, "cut.bz2", bz2.compress(open(good, "rb").read())[:-10]),
               "empty.jsonl": bad_file(tmp_path, "empty.jsonl", b"\n"),
               "other.jsonl": bad_file(tmp_path, "other.jsonl", json.dumps({"question": "1+1?"}).encode() + b"\n")}
    folders = {"text": text_data, "anchor": anchor_data}
    if data == "gpt2":  # the byte folder relabelled: a tokenizer that needs files, none where it looks
        folders["gpt2"] = str(tmp_path / "gpt2")
        os.mkdir(folders["gpt2"])
        with open(os.path.join(text_data, "meta.json")) as f:
            meta = {**json.load(f), "tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256}
        with open(os.path.join(folders["gpt2"], "meta.json"), "w") as f:
            json.dump(meta, f)
    with pytest.raises(ValueError) as e:
        ds.open_training_bench(task, sources.get(source, source), limit, folders[data],
                               config_for("tiny", max_seq_len=max_seq_len), *truncate,
                               tokenizer_dir=str(tmp_path / "no_tokenizers"), log=lambda line: None)
    message = str(e.value)
    assert message.startswith("config: bench_") and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


# ----------------------------------------------------------------------------- resume and 2 ranks

def test_a_resumed_run_continues_the_series(tmp_path, text_data):
    # checkpoint.Metrics on resume keeps the rows up to the checkpoint's step and drops the rest
    # (redone): the bench rows carry their step, so the series goes on from the checkpoint.
    bench = ds.open_training_bench("hellaswag", write_hellaswag(tmp_path / "hs.txt"), 4, text_data,
                                   config_for("tiny", max_seq_len=128), log=lambda line: None)
    cfg = {**train.DEFAULTS, "out_dir": str(tmp_path / "run")}
    os.mkdir(cfg["out_dir"])
    with fsdp_model() as net:
        metrics = checkpoint.Metrics(cfg, 0, None)
        for step in (0, 10, 20):
            metrics.record(bench(net, step))
        metrics.close()
        metrics = checkpoint.Metrics(cfg, 0, 10)  # resumed from the step-10 checkpoint
        metrics.record(bench(net, 20))
        metrics.close()
    with open(os.path.join(cfg["out_dir"], "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 10, 20]
    assert all(set(r) >= {"bench_hellaswag_acc", "bench_s"} for r in rows)


def two_rank_worker(rank, store, source, data_dir, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # a rank left alone fails, not hangs
    try:
        cfg = train_cfg()
        net, _ = train.build_model(cfg, train.model_config(cfg, "cpu"), torch.device("cpu"))
        bench = ds.open_training_bench("hellaswag", source, 9, data_dir, net.cfg, log=lambda line: None)
        rows = [bench(net, step) for step in (10, 20)]
        with open(f"{out}.{rank}", "w") as f:
            json.dump(rows, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes importing torch: ~10 s of CPU
def test_two_ranks_score_together_and_agree_with_one_process(tmp_path, text_data):
    source = write_hellaswag(tmp_path / "hs.txt")
    mp.start_processes(two_rank_worker, (str(tmp_path / "store"), source, text_data, str(tmp_path / "rows")),
                       nprocs=2, start_method="spawn")
    ranks = []
    for rank in (0, 1):
        with open(tmp_path / f"rows.{rank}") as f:
            ranks.append([{k: v for k, v in r.items() if k != "bench_s"} for r in json.load(f)])
    with fsdp_model() as net:  # the same weights on one rank: build_model's init is world-size independent
        ckpt = export(net, tmp_path / "m.pt", text_data)
    want = fields(ev.main(["bench", ckpt, "--task", "hellaswag", "--source", source, "--limit", "9"])["summary"],
                  "hellaswag")
    assert ranks[0] == ranks[1] == [{"step": 10, **want}, {"step": 20, **want}]


def test_train_py_logs_the_benchmark_and_a_resume_redoes_only_its_own_rows(tmp_path, anchor_data):
    """train.py end to end: bench rows at step 0, every bench_interval and the last step, each
    equal to eval.py bench on that step's checkpoint; killed after step 4 (its checkpoints past
    step 4 removed), the resumed run redoes step 6's row and no other."""
    out = tmp_path / "run"
    args = [os.path.join(ROOT, "config", "anchor_gamma1.py"), f"--data_dir={anchor_data}", f"--out_dir={out}",
            "--max_steps=6", "--warmup_steps=1", "--eval_interval=2", "--eval_batches=1", "--ckpt_interval=2",
            "--keep_last=3", "--log_interval=1", "--global_batch=32", "--batch_size=32", "--bench_interval=2",
            "--bench_task=anchor", "--bench_limit=20"]

    def bench_rows():
        with open(out / "metrics.jsonl") as f:
            return [r for r in map(json.loads, f) if "bench_anchor_seen_pair_acc" in r]

    run = run_here(args)
    first = bench_rows()
    assert [r["step"] for r in first] == [0, 2, 4, 6]
    assert run.stdout.count("bench anchor: seen_pair_acc ") == 4
    for step in (2, 6):
        ckpt = out / f"ckpt_{step:08d}"
        want = fields(ev.main(["bench", str(ckpt), "--task", "anchor", "--limit", "20"])["summary"], "anchor")
        got = next(r for r in first if r["step"] == step)
        assert {k: v for k, v in got.items() if k not in ("step", "bench_s")} == want
    shutil.rmtree(out / "ckpt_00000006")
    run_here(args)
    again = bench_rows()
    assert [r["step"] for r in again] == [0, 2, 4, 6]
    assert again[:3] == first[:3]  # the rows before the checkpoint are kept as they were
    same = ("bench_s",)
    assert {k: v for k, v in again[3].items() if k not in same} == {k: v for k, v in first[3].items() if k not in same}
