"""Parity with lm-evaluation-harness itself: lm-eval (Python API, offline) runs its own hellaswag
task definition on a local copy of the kit's HellaSwag items through an exported model, and
`eval.py bench --task hellaswag` on the same items gives the same acc and acc_norm, item by item."""
import bz2
import dataclasses
import json
import os

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is optional (Makefile test install: pip install lm-eval)")
pytest.importorskip("transformers", reason="the HF export needs transformers (Makefile test install)")

import downstream as ds  # noqa: E402
import eval as ev  # noqa: E402
from hf_export import export_hf  # noqa: E402
from model import GPT, GPTConfig, init_model_  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELLASWAG = os.path.join(ROOT, "..", "shared", "data", "eval", "hellaswag", "hellaswag_val_full.txt.bz2")
ITEMS = 24


def local_hellaswag(path, n):
    """The kit's first n text-format tasks as published-layout records (ctx_a/ctx_b recovered by
    downstream.split_text_context), the fields lm-eval's hellaswag task reads."""
    with bz2.open(HELLASWAG, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")[:6 * n]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(0, len(lines), 6):
            label, ctx_a, ctx_b = ds.split_text_context(lines[i])
            f.write(json.dumps({"ind": i // 6, "activity_label": label, "ctx_a": ctx_a, "ctx_b": ctx_b,
                                "endings": lines[i + 2:i + 6], "label": lines[i + 1]}) + "\n")


def task_folder(folder, data_file):
    """lm-eval's hellaswag task (its own yaml and process_docs) pointed at a local jsonl."""
    import lm_eval
    folder.mkdir()
    official = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "hellaswag", "hellaswag.yaml")
    (folder / "hellaswag_local.yaml").write_text(
        f"include: {official}\ntask: hellaswag_local\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    validation: {data_file}\ntraining_split: null\n")


@pytest.mark.slow
@pytest.mark.parametrize("gate", ["elementwise", "none"])  # remote code, and stock LlamaForCausalLM
def test_bench_hellaswag_equals_lm_eval_item_by_item(gate, tmp_path, monkeypatch):
    if not os.path.exists(HELLASWAG):
        pytest.skip("../shared/data/eval/hellaswag is not beside this checkout (offline data kit)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=64, max_seq_len=1024, attn_gate=gate))
    init_model_(model, gamma=0.5, seed=3)
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.cfg), "config": {}, "step": 0,
                "data_meta": {"tokenizer": "bytes", "eot_id": 256}}, tmp_path / "m.pt")
    export_hf(str(tmp_path / "m.pt"), str(tmp_path / "hf"))
    local_hellaswag(tmp_path / "hellaswag.jsonl", ITEMS)
    task_folder(tmp_path / "tasks", tmp_path / "hellaswag.jsonl")

    out = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'hf'},trust_remote_code=True,dtype=float32",
        tasks=["hellaswag_local"], task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        batch_size=1, device="cpu", log_samples=True,
        # No global reseeding: it would leak into every later test of the session.
        random_seed=None, numpy_random_seed=None, torch_random_seed=None, fewshot_random_seed=None)
    theirs = out["results"]["hellaswag_local"]
    samples = sorted(out["samples"]["hellaswag_local"], key=lambda s: s["doc_id"])
    assert len(samples) == ITEMS

    ours = ev.main(["bench", str(tmp_path / "m.pt"), "--task", "hellaswag", "--source", str(tmp_path / "hellaswag.jsonl")])
    summary = ours["summary"]
    assert summary["tasks"] == ITEMS and summary["truncated"] == 0
    assert summary["acc"] == pytest.approx(theirs["acc,none"], abs=1e-12)
    assert summary["acc_norm"] == pytest.approx(theirs["acc_norm,none"], abs=1e-12)
    # Per item (the 20 rows bench reports): the same log-likelihoods, the same picks.
    for row, sample in zip(ours["rows"], samples):
        loglik = [r[0] for r in sample["filtered_resps"]]
        assert row["loglik"] == pytest.approx(loglik, abs=1e-3)
        assert (row["pick"] == row["label"]) == bool(sample["acc"])
        assert (row["pick_norm"] == row["label"]) == bool(sample["acc_norm"])
    # The items tell the conventions apart: per-token normalisation (the old acc_norm) picks
    # differently on some of them, so it could not have passed.
    assert any(r["pick_norm"] != r["pick_norm_tokens"] for r in ours["rows"])
    assert any(r["pick"] != r["pick_norm"] for r in ours["rows"])
