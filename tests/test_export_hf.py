"""`train.py export --format hf`: the HF transformers model is model.py's model (logits within 1e-5
in fp32, the same greedy tokens) and AutoTokenizer gives the run's token ids. The references are
model.py itself and tiktoken; the HF side is transformers' own LlamaForCausalLM or the shipped
modeling file, loaded the way a user loads it."""
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the HF export needs transformers (Makefile test install)")
pytest.importorskip("safetensors", reason="the HF export needs safetensors (Makefile test install)")

from conftest import launch_env  # noqa: E402
import hf_export  # noqa: E402
from hf_export import export_hf  # noqa: E402
from init import init_model_  # noqa: E402
from generate import decode  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from data import get_tokenizer  # noqa: E402
import train  # noqa: E402
from test_train import train_error  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.path.join(ROOT, "..", "shared", "data")
EOT = 256  # the byte tokenizer's end-of-text id

CONFIGS = {
    "gated_elementwise": dict(attn_gate="elementwise"),
    "gated_headwise_gqa_tied": dict(attn_gate="headwise", n_head=4, n_kv_head=2, tie_embeddings=True),
    "ungated": dict(attn_gate="none"),
    "ungated_gqa_tied": dict(attn_gate="none", n_head=4, n_kv_head=1, tie_embeddings=True, rope_theta=500.0,
                             norm_eps=1e-5),
    "moe": dict(n_experts=4, top_k=2, d_expert=64, n_kv_head=1, router_score="sigmoid"),
    "moe_top1_ungated": dict(n_experts=3, top_k=1, d_expert=32, attn_gate="none", moe_impl="reference"),
    "gelu_doc_mask": dict(mlp="gelu", doc_mask=True, eot_id=EOT),
}


def trained_looking_model(**overrides):
    """A γ=0.5 model with every norm gain and MoE selection bias moved off its init value, so
    a weight that the export dropped or misplaced changes the logits."""
    model = GPT(GPTConfig(**overrides))
    init_model_(model, gamma=0.5, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
        for moe in model.moe_layers():
            moe.expert_bias.copy_(0.05 * torch.randn(moe.expert_bias.shape, generator=gen))
    return model.eval()


def save_export(model, path, tokenizer="bytes", eot_id=EOT):
    """The consolidated file `train.py export` writes (the format eval.load_model reads)."""
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.cfg), "config": {}, "step": 7,
                "data_meta": {"tokenizer": tokenizer, "eot_id": eot_id}}, path)


def load_hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_hf_model_matches_model_py(name, tmp_path):
    model = trained_looking_model(**CONFIGS[name])
    save_export(model, tmp_path / "m.pt")
    arch = export_hf(str(tmp_path / "m.pt"), str(tmp_path / "hf"))
    stock = model.cfg.attn_gate == "none" and not model.cfg.n_experts and model.cfg.mlp == "swiglu"
    assert arch == ("LlamaForCausalLM" if stock else "SmallInitForCausalLM")
    # A stock model needs no remote code: nothing to trust, nothing shipped.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert ("auto_map" in config) != stock and (tmp_path / "hf" / "modeling_smallinit.py").exists() != stock
    hf = load_hf(tmp_path / "hf")
    assert type(hf).__name__ == arch

    x = torch.randint(0, EOT, (3, 48), generator=torch.Generator().manual_seed(2))
    x[:, 20] = EOT  # a document boundary: matters for doc_mask, ordinary token otherwise
    with torch.no_grad():
        ours, theirs = model(x)[0], hf(x).logits
    assert ours.abs().max() > 0.1  # logits that carry information, not a degenerate model
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)

    # Greedy decoding with the KV cache on both sides, stopping at end-of-text (the export's
    # generation_config), from a prompt that crosses a document boundary.
    prompt = x[:1, :30]
    ours = decode(model, prompt, 24, stop=lambda toks: toks[-1] == EOT)[0]
    theirs = hf.generate(prompt, max_new_tokens=24, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert theirs == ours


def test_tied_export_stores_the_embedding_once(tmp_path):
    from safetensors import safe_open
    model = trained_looking_model(**CONFIGS["ungated_gqa_tied"])
    save_export(model, tmp_path / "m.pt")
    export_hf(str(tmp_path / "m.pt"), str(tmp_path / "hf"))
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    hf = load_hf(tmp_path / "hf")
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def sample_texts():
    """Edge cases of the regexes (contractions, digit runs, whitespace runs, CRLF, a literal
    special token, emoji) and, with the kit, real English and Chinese text."""
    texts = ["Hello  world!\n\n\t  x", " 'll 's I'M 1234567 ÄÖü 天地玄黄 \r\n  \r\n", "emoji 🤗🤗 ok   \n",
             "a<|endoftext|>b", "$12,345.67  --  x=1/2;\ty\u00a0z", ""]
    for path in sorted(glob.glob(os.path.join(KIT, "corpus", "*", "*", "*.txt")))[:6]:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read(60_000))
    return texts


@pytest.mark.parametrize("name", ["bytes", "gpt2", "cl100k_base"])
def test_auto_tokenizer_gives_the_run_ids(name, tmp_path):
    if name != "bytes" and not os.path.isdir(os.path.join(KIT, "tokenizers")):
        pytest.skip("../shared/data/tokenizers (the published tiktoken files) is not beside this checkout")
    enc = get_tokenizer(name, os.path.join(KIT, "tokenizers") if name != "bytes" else None)
    model = trained_looking_model(vocab_size=enc.n_vocab, attn_gate="none")
    save_export(model, tmp_path / "m.pt", tokenizer=name, eot_id=enc.eot_token)
    export_hf(str(tmp_path / "m.pt"), str(tmp_path / "hf"), os.path.join(KIT, "tokenizers"))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    texts = sample_texts()
    # prepare_data.py tokenizes with encode_ordinary: no special tokens parsed from the text.
    for text in texts:
        assert tok(text)["input_ids"] == enc.encode_ordinary(text), text[:80]
        assert tok.decode(enc.encode_ordinary(text)) == text
    assert tok.eos_token_id == enc.eot_token == json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"]


def test_cli_writes_the_folder_and_refuses_a_foreign_one(tmp_path):
    # `train.py export`'s main in this process (the command as a process: the README's, tests/test_readme.py)
    model = trained_looking_model(**CONFIGS["gated_elementwise"])
    save_export(model, tmp_path / "m.pt")
    train.main(["export", str(tmp_path / "m.pt"), str(tmp_path / "hf"), "--format", "hf"])
    names = set(os.listdir(tmp_path / "hf"))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "modeling_smallinit.py"} <= names
    assert not os.path.exists(tmp_path / "hf.tmp")
    umask = os.umask(0)
    os.umask(umask)
    modes = {name: os.stat(tmp_path / "hf" / name).st_mode & 0o777 for name in names}
    assert set(modes.values()) == {0o666 & ~umask}, modes  # as readable as any new file (safetensors: 0600)
    # Exporting again over an earlier export replaces it.
    (tmp_path / "hf" / "config.json").write_text("{}")
    export_hf(str(tmp_path / "m.pt"), str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "smallinit"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert "is not an earlier export" in train_error(["export", str(tmp_path / "m.pt"), str(tmp_path / "other"),
                                                      "--format", "hf"])
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_missing_package_is_one_line_naming_it(tmp_path, monkeypatch):
    model = trained_looking_model()
    save_export(model, tmp_path / "m.pt")
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"needs the `safetensors` package .*pip install safetensors$"):
        export_hf(str(tmp_path / "m.pt"), str(tmp_path / "hf"))


def test_a_tiktoken_run_offline_without_tokenizer_dir_is_one_line(tmp_path, monkeypatch):
    import tiktoken

    def offline(name):
        raise ConnectionError("no network")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    model = trained_looking_model(vocab_size=50304, attn_gate="none")
    save_export(model, tmp_path / "m.pt", tokenizer="gpt2", eot_id=50256)
    with pytest.raises(SystemExit, match=r"could not download tokenizer 'gpt2'.*--tokenizer-dir"):
        export_hf(str(tmp_path / "m.pt"), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()  # nothing half-written


# Run where the repo is not importable: loads the folder and saves what a test compares.
LOAD_ELSEWHERE = """
import dataclasses, importlib.util, sys, torch, transformers
folder, x_path, out_path = sys.argv[1:]
assert importlib.util.find_spec("model") is None and importlib.util.find_spec("init") is None
hf = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
with torch.no_grad():
    logits = hf(torch.load(x_path)).logits
torch.save({"logits": logits, "modules": sorted(sys.modules), "gpt": type(hf.gpt).__module__,
            "shared": all(a is b for a, b in zip(hf.children(), hf.gpt.children())),
            "names": sorted(hf.state_dict()), "cfg": dataclasses.asdict(hf.gpt.cfg)}, out_path)
"""


def test_the_model_is_the_folders_model_py_and_needs_no_repo(tmp_path):
    """The remote code wraps model.py's GPT from the folder's own copies of model.py and the project files
    it needs (the repo's files, their imports of each other made relative, the one form transformers copies along):
    in a process that cannot import the repo, the model loads, is that GPT under model.py's parameter
    names and config, and gives model.py's logits."""
    model = trained_looking_model(**CONFIGS["moe"])
    save_export(model, tmp_path / "m.pt")
    export_hf(str(tmp_path / "m.pt"), str(tmp_path / "hf"))
    shipped = sorted(name for name in os.listdir(tmp_path / "hf") if name.endswith(".py"))
    assert shipped == ["generate.py", "loss.py", "model.py", "modeling_smallinit.py"]
    for name in shipped:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            repo = f.read()
        relative = re.sub(r"(?m)^from (generate|loss|model) import ", r"from .\1 import ", repo)
        assert (relative != repo) == (name in ("generate.py", "model.py"))
        assert (tmp_path / "hf" / name).read_text(encoding="utf-8") == relative, name

    x = torch.randint(0, EOT, (2, 40), generator=torch.Generator().manual_seed(3))
    torch.save(x, tmp_path / "x.pt")
    (tmp_path / "elsewhere").mkdir()
    env = {k: v for k, v in launch_env({"HF_MODULES_CACHE": str(tmp_path / "modules")}).items() if k != "PYTHONPATH"}
    args = [sys.executable, "-c", LOAD_ELSEWHERE, *(str(tmp_path / name) for name in ("hf", "x.pt", "out.pt"))]
    proc = subprocess.run(args, cwd=tmp_path / "elsewhere", env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert not {"model", "loss", "generate", "init"} & set(out["modules"])
    assert out["gpt"].startswith("transformers_modules.hf.") and out["gpt"].endswith(".model") and out["shared"]
    assert out["names"] == sorted(model.state_dict())
    # The config round trip loses nothing but how the model runs (MoE: the reference loop, not grouped GEMMs).
    ours = dataclasses.asdict(model.cfg)
    assert {k for k in ours if out["cfg"][k] != ours[k]} == {"moe_impl"}
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], model(x)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["gelu_doc_mask", "moe"])
def test_a_left_padded_batch_generates_each_row_as_alone(name, tmp_path):
    """Prompts of three lengths, left-padded with end-of-text and their attention_mask, as lm-eval's
    batched generation passes them: each row's first logits and greedy tokens are model.py's for
    that prompt alone (the positions of a padded row are shifted, which RoPE does not see)."""
    model = trained_looking_model(**CONFIGS[name])
    save_export(model, tmp_path / "m.pt")
    export_hf(str(tmp_path / "m.pt"), str(tmp_path / "hf"))
    hf = load_hf(tmp_path / "hf")
    T, pads = 16, [0, 5, 11]
    prompts = torch.randint(0, EOT, (3, T), generator=torch.Generator().manual_seed(4))
    prompts[:, T - 3] = EOT  # a document boundary inside every prompt
    ids, mask = torch.full((3, T), EOT), torch.zeros(3, T, dtype=torch.long)
    for row, pad in enumerate(pads):
        ids[row, pad:], mask[row, pad:] = prompts[row, pad:], 1
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                      output_logits=True, return_dict_in_generate=True)
    for row, pad in enumerate(pads):
        alone = prompts[row:row + 1, pad:]
        with torch.no_grad():
            torch.testing.assert_close(out.logits[0][row], model(alone)[0][0, -1], atol=1e-4, rtol=0)
        assert out.sequences[row, T:].tolist() == decode(model, alone, 12)[0]


def test_labels_give_model_py_loss(tmp_path):
    """HF's convention (labels are the inputs, -100 ignored, shifted inside) is model.py's loss on
    the shifted targets (-1 ignored)."""
    model = trained_looking_model(**CONFIGS["gated_headwise_gqa_tied"])
    save_export(model, tmp_path / "m.pt")
    export_hf(str(tmp_path / "m.pt"), str(tmp_path / "hf"))
    hf = load_hf(tmp_path / "hf")
    x = torch.randint(0, EOT, (2, 24), generator=torch.Generator().manual_seed(6))
    labels = x.clone()
    labels[0, 5:9] = -100
    targets = labels[:, 1:].masked_fill(labels[:, 1:] == -100, -1)
    with torch.no_grad():
        torch.testing.assert_close(hf(x, labels=labels).loss, model(x[:, :-1], targets=targets)[1], atol=1e-6, rtol=0)


REMOTE_CODE_CASES = {  # model.py's source -> the refusal, or None: what it imports
    "import math\nfrom torch import nn\nfrom init import f\n": None,
    "import numpy\n": "model.py line 1 imports numpy, which a HF export cannot carry",
    "import init\n": "model.py line 1: import a project file as `from FILE import NAME` at the start of a line",
    "x = 1; from init import f\n": "model.py line 1: import a project file",
    "from init.sub import f\n": "model.py line 1: import a project file",
    "def f():\n    from fileio import g\n": None,
}


@pytest.mark.parametrize("source", REMOTE_CODE_CASES)
def test_remote_code_carries_project_imports_relative_and_refuses_the_rest(source, tmp_path, monkeypatch):
    for name, text in {"modeling_smallinit.py": "import transformers\nfrom .model import GPT\n", "model.py": source,
                       "init.py": "import torch\n", "fileio.py": "import os\n"}.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(hf_export, "ROOT", str(tmp_path))
    refusal = REMOTE_CODE_CASES[source]
    if refusal:
        with pytest.raises(ValueError, match=re.escape(refusal)):
            hf_export.remote_code()
        return
    code = hf_export.remote_code()
    imported = "init" if "init" in source else "fileio"
    assert sorted(code) == sorted(["modeling_smallinit.py", "model.py", f"{imported}.py"])
    assert code["model.py"] == source.replace(f"from {imported} import", f"from .{imported} import")
    assert code[f"{imported}.py"] == (tmp_path / f"{imported}.py").read_text()


def test_a_refused_import_writes_nothing(tmp_path, monkeypatch):
    model = trained_looking_model()
    save_export(model, tmp_path / "m.pt")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "modeling_smallinit.py").write_text("from .model import GPT\n")
    (tmp_path / "code" / "model.py").write_text("import numpy\n")
    monkeypatch.setattr(hf_export, "ROOT", str(tmp_path / "code"))
    with pytest.raises(ValueError, match="imports numpy"):
        export_hf(str(tmp_path / "m.pt"), str(tmp_path / "hf"))
    assert sorted(os.listdir(tmp_path)) == ["code", "m.pt"]


def test_a_field_a_forker_adds_to_gptconfig_is_exported_and_read_back():
    # A new setting of the attention (here a logit soft-cap) needs no line in modeling_smallinit.py: the
    # folder's config carries it under its own name, the loader reads it back, and a model that sets it
    # leaves the Llama route (which would drop it) for the remote code's. A run-only field is not carried.
    import modeling_smallinit as ms
    Extended = dataclasses.make_dataclass("GPTConfig", [("attn_softcap", float, 0.0)], bases=(GPTConfig,))
    assert ms.gpt_fields(Extended)["attn_softcap"] == "attn_softcap"
    assert not {"attn_backend", "moe_impl"} & set(ms.gpt_fields(Extended).values())
    plain = Extended(vocab_size=300, n_layer=1, n_head=2, d_model=32, attn_gate="none")
    assert hf_export.llama_obstacles(plain) == []
    capped = Extended(vocab_size=300, n_layer=1, n_head=2, d_model=32, attn_gate="none", attn_softcap=30.0,
                      norm_eps=1e-6)
    assert hf_export.llama_obstacles(capped) == ["attn_softcap=30.0 (Llama has no such setting)"]
    config, architecture = hf_export.model_config(capped, EOT)
    assert architecture == "SmallInitForCausalLM"
    again = ms.SmallInitConfig.from_dict(json.loads(config.to_json_string()))  # as config.json holds it
    assert ms.gpt_config(again, Extended) == Extended(**{**dataclasses.asdict(capped), "attn_backend": "sdpa",
                                                        "moe_impl": "reference"})
    # A folder an earlier export wrote, without the field: its default.
    del again.attn_softcap
    assert ms.gpt_config(again, Extended).attn_softcap == 0.0
