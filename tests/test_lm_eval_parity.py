"""Parity with lm-evaluation-harness itself: lm-eval (Python API, offline) runs its own hellaswag
task definition, pointed by `eval.py lm-eval-task` (the README's offline route) at a local copy
of the kit's HellaSwag items, through an exported model, and
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
from test_train import run_here  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.path.join(ROOT, "..", "shared", "data")
HELLASWAG = os.path.join(KIT, "eval", "hellaswag", "hellaswag_val_full.txt.bz2")
TINYSTORIES = os.path.join(KIT, "corpus", "en", "tinystories", "tinystories_train_prefix_2MiB.txt")
STRIDE = 40  # 252 items
GATES = ["elementwise", "none"]  # remote code, and stock LlamaForCausalLM
# 150 steps of 16 x 256 bytes (0.6M of TinyStories' 2M): the byte loss falls from 5.55 (uniform) to
# 2.0 (gate) and 2.3 nats (no gate), far enough that the log-likelihoods depend on the text; ~20 s
# of one core per model (300 steps, to ~1.8 nats, doubled the suite's share). doc_mask off: Llama
# cannot express it. The window is 1,024 so that no HellaSwag item (at most 722 bytes) is cut.
TRAIN = ["--model_size=tiny", "--model.doc_mask=False", "--model.max_seq_len=1024", "--seq_len=256",
         "--global_batch=16", "--batch_size=16", "--max_steps=150", "--warmup_steps=15", "--lr=3e-3",
         "--log_interval=50", "--eval_interval=150", "--eval_batches=2", "--ckpt_interval=150"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{gate: run folder} of byte models trained by train.py on the kit's TinyStories."""
    if not (os.path.exists(HELLASWAG) and os.path.exists(TINYSTORIES)):
        pytest.skip("../shared/data (HellaSwag, TinyStories) is not beside this checkout (offline data kit)")
    folder = tmp_path_factory.mktemp("parity")
    data = folder / "bytes"
    prep = subprocess.run([sys.executable, "prepare_data.py", "text", "--out", str(data), "--source",
                           f"en={TINYSTORIES}", "--tokenizer", "bytes"], cwd=ROOT, capture_output=True, text=True,
                          env=launch_env())
    assert prep.returncode == 0, failure_text(prep)
    runs = {gate: folder / gate for gate in GATES}
    for gate, run in runs.items():  # in this process (test_train.run_here): the same run without a process's imports
        run_here([*TRAIN, f"--model.attn_gate={gate}", f"--data_dir={data}", f"--out_dir={run}"])
    return runs


def kit_subset(path, indices):
    """The kit's text-format HellaSwag, only the tasks at `indices` (6 lines each), at `path`."""
    with bz2.open(HELLASWAG, "rt", encoding="utf-8") as f:
        lines = f.read().rstrip("\n").split("\n")
    path.write_text("".join("\n".join(lines[6 * n:6 * n + 6]) + "\n" for n in indices), encoding="utf-8")
    return str(path)


def lm_eval_task(task, folder, name):
    """lm-eval's task `name` as lm-eval builds it from `folder` (its own tasks left unindexed:
    seconds instead of a minute), and the documents it scores."""
    from lm_eval.tasks import TaskManager
    built = TaskManager(include_path=str(folder), include_defaults=False).load([name])["tasks"][name]
    return built, list(built.eval_docs)


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
    # The README's offline route: eval.py lm-eval-task writes lm-eval's own task over the items.
    ev.main(["lm-eval-task", "--task", "hellaswag", "--source", kit_subset(tmp_path / "hellaswag.txt", indices),
             "--out-dir", str(tmp_path / "tasks")])

    out = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'hf'},trust_remote_code=True,dtype=float32",
        tasks=["hellaswag_local"], task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        batch_size=1, device="cpu", log_samples=True,
        # No global reseeding: it would leak into every later test of the session.
        random_seed=None, numpy_random_seed=None, torch_random_seed=None, fewshot_random_seed=None)
    theirs = out["results"]["hellaswag_local"]
    samples = sorted(out["samples"]["hellaswag_local"], key=lambda s: s["doc_id"])

    local = str(tmp_path / "tasks" / "hellaswag_local.jsonl")
    ours = ev.main(["bench", str(trained[gate]), "--task", "hellaswag", "--source", local,
                    "--json-out", str(tmp_path / "ours.json")])
    with open(tmp_path / "ours.json") as f:
        rows = json.load(f)["rows"]
    summary = ours["summary"]
    assert summary["tasks"] == len(rows) == len(samples) == len(indices) and summary["truncated"] == 0

    # Every item: the text scored (lm-eval's context and " " + ending), the four log-likelihoods,
    # and both picks. A pick may differ only on a near-tie (a margin within float32 noise of the
    # two forwards), and each such item may move its metric by one item, no more.
    items, _ = ds.read_hellaswag(local)
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


GSM8K = os.path.join(KIT, "eval", "gsm8k", "test.jsonl")
MATH500 = os.path.join(KIT, "eval", "math500", "test.jsonl")


@pytest.mark.parametrize("task,source,name", [("hellaswag", HELLASWAG, "hellaswag_local"),
                                              ("gsm8k", GSM8K, "gsm8k_cot_local"),
                                              ("math500", MATH500, "minerva_math500_local")])
def test_lm_eval_task_feeds_lm_evals_own_task_what_bench_scores(task, source, name, tmp_path, monkeypatch):
    # The offline route of the README: lm-eval's task definition (prompt, exemplars, target),
    # loaded by lm-eval, on the local file's first items, equals what `eval.py bench` scores.
    if not os.path.exists(source):
        pytest.skip(f"{source} is not beside this checkout (offline data kit)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ev.main(["lm-eval-task", "--task", task, "--source", source, "--out-dir", str(tmp_path), "--limit", "5"])
    written = ds.read_jsonl(str(tmp_path / f"{name}.jsonl"))
    if task != "hellaswag":  # published jsonl: the records pass through unchanged
        assert written == ds.read_jsonl(source)[:5]
    if task == "math500":
        try:
            __import__("lm_eval.tasks.minerva_math.utils")
        except (ImportError, AssertionError) as e:  # it asserts antlr4-python3-runtime 4.11
            pytest.skip(f"lm-eval's minerva_math cannot load here ({str(e)[:80]}...): pip install 'lm-eval[math]'")
    built, docs = lm_eval_task(task, tmp_path, name)
    assert len(docs) == 5
    if task == "hellaswag":
        items = ds.read_hellaswag(source)[0][:5]
        assert [(built.doc_to_text(d), built.doc_to_choice(d), built.doc_to_target(d)) for d in docs] == \
            [(i["ctx"], i["endings"], i["label"]) for i in items]
        return
    records = ds.read_math_records(source, task)[:5]
    convention = ds.gsm8k_convention(None, None) if task == "gsm8k" else ds.MINERVA
    prompts = [built.fewshot_context(d, num_fewshot=len(convention["exemplars"])) for d in docs]
    assert prompts == [ds.few_shot_prompt(convention, r["question"]) for r in records]
    if task == "gsm8k":
        assert [built.doc_to_target(d) for d in docs] == [r["reference"] for r in records]


def test_lm_eval_task_bad_input_is_one_line(tmp_path, capsys):
    for argv, said in ((["--task", "gsm8k", "--source", "hub"], "lm_eval reads the hub itself"),
                       (["--task", "gsm8k", "--source", str(tmp_path / "nope.jsonl")], "no such file")):
        with pytest.raises(SystemExit) as exit_info:
            ev.main(["lm-eval-task", *argv, "--out-dir", str(tmp_path / "tasks")])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and said in err[0]
    assert not (tmp_path / "tasks").exists()
