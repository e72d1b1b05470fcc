"""Parity with lm-evaluation-harness itself: lm-eval (Python API, offline) runs its own hellaswag
task definition on a local copy of the kit's HellaSwag items through an exported model, and
`eval.py bench --task hellaswag` on the same items gives the same acc and acc_norm, and the same
text, log-likelihoods and picks on every item compared.

The models are briefly trained byte models, not random inits: at init every ending's
log-likelihood is about -ln(257) per byte, so the normalisations differ by little more than
noise, and a wrong one could pick the same answers. The items are every STRIDE-th of the kit's
10,042, so both the ActivityNet block (the first 3,243, whose ctx_b is recovered from the text)
and the WikiHow items are compared."""
import bz2
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="lm-eval is optional (Makefile test install: pip install lm-eval)")
pytest.importorskip("transformers", reason="the HF export needs transformers (Makefile test install)")

import downstream as ds  # noqa: E402
import eval as ev  # noqa: E402
from conftest import failure_text, launch_env  # noqa: E402
from hf_export import export_hf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.path.join(ROOT, "..", "shared", "data")
HELLASWAG = os.path.join(KIT, "eval", "hellaswag", "hellaswag_val_full.txt.bz2")
TINYSTORIES = os.path.join(KIT, "corpus", "en", "tinystories", "tinystories_train_prefix_2MiB.txt")
STRIDE = 40  # 252 items
GATES = ["elementwise", "none"]  # remote code, and stock LlamaForCausalLM
# 300 steps of 16 x 256 bytes (1.2M of TinyStories' 2M): the byte loss falls from 5.55 (uniform)
# to ~1.8 nats, ~35 s of one free core per model. doc_mask off: Llama cannot express it. The
# window is 1,024 so that no HellaSwag item (at most 722 bytes) is cut on either side.
TRAIN = ["--model_size=tiny", "--model.doc_mask=False", "--model.max_seq_len=1024", "--seq_len=256",
         "--global_batch=16", "--batch_size=16", "--max_steps=300", "--warmup_steps=30", "--lr=3e-3",
         "--log_interval=100", "--eval_interval=300", "--eval_batches=2", "--ckpt_interval=300"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{gate: run folder} of byte models trained by train.py on the kit's TinyStories, both at once."""
    if not (os.path.exists(HELLASWAG) and os.path.exists(TINYSTORIES)):
        pytest.skip("../shared/data (HellaSwag, TinyStories) is not beside this checkout (offline data kit)")
    folder = tmp_path_factory.mktemp("parity")
    data = folder / "bytes"
    prep = subprocess.run([sys.executable, "prepare_data.py", "text", "--out", str(data), "--source",
                           f"en={TINYSTORIES}", "--tokenizer", "bytes"], cwd=ROOT, capture_output=True, text=True,
                          env=launch_env())
    assert prep.returncode == 0, failure_text(prep)
    runs = {gate: folder / gate for gate in GATES}
    procs = {gate: subprocess.Popen([sys.executable, "train.py", *TRAIN, f"--model.attn_gate={gate}",
                                     f"--data_dir={data}", f"--out_dir={run}"], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=launch_env())
             for gate, run in runs.items()}
    for gate, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, failure_text(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    return runs


def local_hellaswag(path, indices):
    """The kit's text-format tasks at `indices` as published-layout records (ctx_a/ctx_b recovered
    by downstream.split_text_context), the fields lm-eval's hellaswag task reads."""
    with bz2.open(HELLASWAG, "rt", encoding="utf-8") as f:
        lines = f.read().rstrip("\n").split("\n")
    with open(path, "w", encoding="utf-8") as f:
        for n in indices:
            label, ctx_a, ctx_b = ds.split_text_context(lines[6 * n])
            f.write(json.dumps({"ind": n, "activity_label": label, "ctx_a": ctx_a, "ctx_b": ctx_b,
                                "endings": lines[6 * n + 2:6 * n + 6], "label": lines[6 * n + 1]}) + "\n")


def task_folder(folder, data_file):
    """lm-eval's hellaswag task (its own yaml and process_docs) pointed at a local jsonl."""
    import lm_eval
    folder.mkdir()
    official = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "hellaswag", "hellaswag.yaml")
    (folder / "hellaswag_local.yaml").write_text(
        f"include: {official}\ntask: hellaswag_local\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    validation: {data_file}\ntraining_split: null\n")


TOLERANCE = 1e-3  # nats: float32 forwards of two implementations over up to 722 bytes


def margin(scores):
    """Gap between the best and the second-best score: below the log-likelihood tolerance, two
    implementations may break the near-tie differently."""
    top = np.sort(scores)
    return top[-1] - top[-2]


@pytest.mark.slow
@pytest.mark.parametrize("gate", GATES)
def test_bench_hellaswag_equals_lm_eval_on_every_item(gate, trained, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    indices = list(range(0, 10042, STRIDE))
    export_hf(str(trained[gate]), str(tmp_path / "hf"))
    local_hellaswag(tmp_path / "hellaswag.jsonl", indices)
    task_folder(tmp_path / "tasks", tmp_path / "hellaswag.jsonl")

    out = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'hf'},trust_remote_code=True,dtype=float32",
        tasks=["hellaswag_local"], task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        batch_size=1, device="cpu", log_samples=True,
        # No global reseeding: it would leak into every later test of the session.
        random_seed=None, numpy_random_seed=None, torch_random_seed=None, fewshot_random_seed=None)
    theirs = out["results"]["hellaswag_local"]
    samples = sorted(out["samples"]["hellaswag_local"], key=lambda s: s["doc_id"])

    ours = ev.main(["bench", str(trained[gate]), "--task", "hellaswag", "--source", str(tmp_path / "hellaswag.jsonl"),
                    "--json-out", str(tmp_path / "ours.json")])
    with open(tmp_path / "ours.json") as f:
        rows = json.load(f)["rows"]
    summary = ours["summary"]
    assert summary["tasks"] == len(rows) == len(samples) == len(indices) and summary["truncated"] == 0

    # Every item: the text scored (lm-eval's context and " " + ending), the four log-likelihoods,
    # and both picks. A pick may differ only on a near-tie (a margin within float32 noise of the
    # two forwards), and each such item may move its metric by one item, no more.
    items, _ = ds.read_hellaswag(str(tmp_path / "hellaswag.jsonl"))
    near_ties, worst = {"acc": 0, "acc_norm": 0}, 0.0
    for item, row, sample in zip(items, rows, samples):
        assert sample["arguments"] == [(item["ctx"], " " + e) for e in item["endings"]]
        loglik = [r[0] for r in sample["filtered_resps"]]
        assert row["loglik"] == pytest.approx(loglik, abs=TOLERANCE)
        worst = max(worst, np.max(np.abs(np.subtract(row["loglik"], loglik))))
        per_char = np.array(row["loglik"]) / [len(e) for e in item["endings"]]
        for pick, metric, scores in (("pick", "acc", row["loglik"]), ("pick_norm", "acc_norm", per_char)):
            if (row[pick] == row["label"]) != bool(sample[metric]):
                assert margin(scores) < TOLERANCE, (item, metric, row, loglik)
                near_ties[metric] += 1
    for metric, ties in near_ties.items():
        assert abs(summary[metric] - theirs[f"{metric},none"]) <= ties / len(rows) + 1e-12, metric

    # The kit's text file read directly gives the items lm-eval was fed.
    kit, _ = ds.read_hellaswag(HELLASWAG)
    assert [kit[n] for n in indices] == items
    # The model learned English (uniform is ln 257 = 5.55 nats per byte on the gold ending), and
    # the conventions it is scored by pick differently on these items, so a wrong one shows.
    gold_bytes = [len((" " + item["endings"][item["label"]]).encode()) for item in items]
    assert np.mean([-r["loglik"][r["label"]] / n for r, n in zip(rows, gold_bytes)]) < 3.0
    per_token = sum(r["pick_norm"] != r["pick_norm_tokens"] for r in rows)
    unnormalised = sum(r["pick"] != r["pick_norm"] for r in rows)
    assert per_token >= 3 and unnormalised >= 30
    print(f"\n{gate}: {len(rows)} items, acc {summary['acc']:.3f}, acc_norm {summary['acc_norm']:.3f}, "
          f"acc_norm_tokens {summary['acc_norm_tokens']:.3f}; per-character pick differs from per-token on "
          f"{per_token}, from the sum on {unnormalised}; near-ties {near_ties}, largest loglik gap {worst:.2g}")
