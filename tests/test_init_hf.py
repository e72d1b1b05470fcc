"""init.py on Hugging Face transformers models built from tiny configs (nothing is downloaded).

Expected fan-ins are read from each config by hand, never from init.py's report: the report
could be wrong in exactly the way these tests look for.
"""
import math
import os
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (make test installs it)")

from init import HF_LAYOUTS, format_report, gamma_init_  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(config):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def init_without_warnings(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a skipped tensor would warn: fail on it instead
        return gamma_init_(model, **kw)


def assert_std(name, tensor, want):
    # The sample std of n normal draws has relative standard error 1/sqrt(2(n-1)): allow 5 of them.
    got = tensor.detach().double().std().item()
    tol = 5 / math.sqrt(2 * (tensor.numel() - 1))
    assert abs(got / want - 1) < tol, (name, got, want, tol)


def check_every_tensor(model, fan_in_rules, gamma):
    """Each parameter must match exactly one (regex, d_in) rule; d_in None means a norm weight
    (gain 1: weight 1) or a bias (0), "zeros" a tensor that must be 0. Tied aliases are skipped:
    they are the same tensor."""
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        rules = [d_in for pattern, d_in in fan_in_rules if re.search(pattern, name)]
        assert len(rules) == 1, (name, rules)
        if name.endswith("bias") or rules[0] == "zeros":
            assert torch.all(p == 0), name
        elif rules[0] is None:
            assert torch.all(p == 1), name
        else:
            assert_std(name, p, rules[0] ** -gamma)


def test_gpt2_conv1d_is_recognised_without_declaring_it():
    cfg = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=96, n_layer=2, n_head=2, n_inner=320)
    model = build(cfg)
    init_without_warnings(model, gamma=1.0)
    # Conv1D stores (in, out): c_attn/c_fc read n_embd, the MLP's c_proj reads n_inner.
    check_every_tensor(model, [
        (r"\.wte\.|\.wpe\.", cfg.n_embd),
        (r"attn\.c_attn\.weight|attn\.c_proj\.weight|mlp\.c_fc\.weight", cfg.n_embd),
        (r"mlp\.c_proj\.weight", cfg.n_inner),
        (r"ln_\d\.|ln_f\.|\.bias$", None),
    ], gamma=1.0)


def _mixtral():
    return transformers.MixtralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=48, num_local_experts=8, num_experts_per_tok=2)


def _qwen2_moe():
    return transformers.Qwen2MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=80, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        num_experts=8, num_experts_per_tok=2)


def _qwen3_moe():
    return transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=48, num_experts=8, num_experts_per_tok=2)


def moe_fan_ins(cfg):
    d = cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    expert_width = getattr(cfg, "moe_intermediate_size", cfg.intermediate_size)  # Mixtral: intermediate_size
    return [
        (r"embed_tokens\.|lm_head\.", d),
        (r"self_attn\.[qkv]_proj\.weight", d),
        (r"self_attn\.o_proj\.weight", cfg.num_attention_heads * head_dim),
        # Stacked experts (E, out, in): gate_up_proj reads d, down_proj the expert width; never E.
        (r"mlp\.experts\.gate_up_proj", d),
        (r"mlp\.experts\.down_proj", expert_width),
        (r"mlp\.gate\.weight", d),  # TopK router (E, d)
        (r"shared_expert\.(gate|up)_proj\.weight|shared_expert_gate\.weight", d),
        (r"shared_expert\.down_proj\.weight", getattr(cfg, "shared_expert_intermediate_size", None)),
        (r"norm\.weight|\.bias$", None),
    ]


@pytest.mark.parametrize("make_config", [_mixtral, _qwen2_moe, _qwen3_moe], ids=["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("gamma", [0.5, 1.0])
def test_hf_layouts_give_every_moe_tensor_its_fan_in(make_config, gamma):
    cfg = make_config()
    model = build(cfg)
    experts = model.model.layers[0].mlp.experts
    # The layout the preset relies on, read off the installed source: (E, 2f, d) and (E, d, f).
    assert experts.gate_up_proj.shape[1:] == (2 * experts.intermediate_dim, cfg.hidden_size)
    assert experts.is_transposed is False
    init_without_warnings(model, gamma=gamma, seed=1, fan_in_dims=HF_LAYOUTS)
    check_every_tensor(model, moe_fan_ins(cfg), gamma)


def test_hf_layouts_read_the_transposed_flag_gpt_oss():
    cfg = transformers.GptOssConfig(vocab_size=300, hidden_size=64, intermediate_size=24, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                    num_local_experts=8, num_experts_per_tok=2)
    model = build(cfg)
    experts = model.model.layers[0].mlp.experts
    # GPT-OSS stores (E, in, out): gate_up_proj (E, d, 2f), down_proj (E, f, d).
    assert experts.is_transposed is True and experts.gate_up_proj.shape[1:] == (64, 48)
    with pytest.warns(UserWarning) as caught:
        report = {r["name"]: r for r in gamma_init_(model, gamma=1.0, fan_in_dims=HF_LAYOUTS)}
    assert_std("gate_up_proj", experts.gate_up_proj, cfg.hidden_size ** -1.0)
    assert_std("down_proj", experts.down_proj, cfg.intermediate_size ** -1.0)
    assert_std("router", model.model.layers[0].mlp.router.weight, cfg.hidden_size ** -1.0)
    # Its 2-D expert biases and attention sinks are not classified: left as they were and named.
    skipped = sorted(n for n, r in report.items() if r["action"] == "skipped")
    assert skipped == ["model.layers.0.mlp.experts.down_proj_bias", "model.layers.0.mlp.experts.gate_up_proj_bias",
                       "model.layers.0.self_attn.sinks"]
    assert all(n in str(caught[0].message) for n in skipped)


def test_stacked_experts_without_the_preset_are_skipped_not_guessed():
    model = build(_mixtral())
    experts = model.model.layers[0].mlp.experts
    before = experts.down_proj.detach().clone()
    with pytest.warns(UserWarning, match="experts.down_proj"):
        report = {r["name"]: r for r in gamma_init_(model)}
    assert report["model.layers.0.mlp.experts.down_proj"]["action"] == "skipped"
    assert torch.equal(experts.down_proj, before)


def _gemma():
    return transformers.GemmaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def _gemma3():
    return transformers.Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32)


@pytest.mark.parametrize("make_config", [_gemma, _gemma3], ids=["gemma", "gemma3"])
def test_gemma_offset_norms_get_gain_one_not_two(make_config):
    model = build(make_config())
    init_without_warnings(model, gamma=1.0)
    norms = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}
    assert len(norms) >= 5
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(0))
    for name, norm in norms.items():
        width = norm.weight.shape[0]
        xn = x[..., :width]
        rms = norm(xn).pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.ones_like(rms), atol=1e-4), (name, rms)
        # The reason w is 0 here: this class computes x̂·(1+w), so w=1 would double the output.
        with torch.no_grad():
            norm.weight.fill_(1.0)
        assert torch.allclose(norm(xn).pow(2).mean(-1).sqrt(), 2 * rms, rtol=1e-4), name


def test_gemma_embedding_scale_caveat_and_its_override():
    # GemmaTextScaledWordEmbedding multiplies by sqrt(d) in forward: the residual stream starts
    # at d^-γ·√d, not d^-γ. Raising the embedding's γ by 0.5 puts it back at d^-γ.
    cfg = _gemma()
    model = build(cfg)
    d = cfg.hidden_size
    ids = torch.arange(1, cfg.vocab_size).unsqueeze(0)
    for overrides, want in ((None, d ** -1.0 * d ** 0.5), ({r"embed_tokens\.": 1.5}, d ** -1.0)):
        init_without_warnings(model, gamma=1.0, overrides=overrides)
        start = model.model.embed_tokens(ids)
        assert_std("residual start", start, want)


@pytest.mark.parametrize("make_config,head,tied_to", [
    (_gemma, r"^lm_head\.", "model.embed_tokens.weight"),
    (lambda: transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=64, n_layer=1, n_head=2),
     r"^lm_head\.", "transformer.wte.weight"),
], ids=["gemma", "gpt2"])
def test_override_of_a_tied_head_raises_naming_the_embedding(make_config, head, tied_to):
    model = build(make_config())
    assert model.lm_head.weight is model.get_input_embeddings().weight
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape(tied_to)):
        gamma_init_(model, overrides={head: 0.5})
    # Raised before drawing anything: the model is exactly as it was.
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def readme_hf_recipe():
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## Using init.py in another codebase", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    recipes = [b for b in blocks if "AutoModelForCausalLM.from_config" in b]
    assert len(recipes) == 1, "the README's HF recipe block is missing"
    return recipes[0]


def test_readme_hf_recipe_survives_post_init_init_weights_and_save_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # init.py warns only about skipped tensors
        exec(readme_hf_recipe(), ns)
    model, cfg = ns["model"], ns["cfg"]
    (gamma,) = {r["gamma"] for r in ns["report"] if r["action"] == "normal"}
    check_every_tensor(model, moe_fan_ins(cfg), gamma)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def unchanged(m):
        return [k for k, v in state.items() if not torch.equal(v, m.state_dict()[k])] == []

    model.post_init()
    assert unchanged(model)
    model.init_weights()
    assert unchanged(model)
    saved = [p for p in os.listdir(".") if os.path.isdir(p)]
    assert len(saved) == 1, saved
    loaded = transformers.AutoModelForCausalLM.from_pretrained(saved[0])
    assert unchanged(loaded)

    # HF's own _init_weights leaves tensors loaded from a checkpoint alone...
    loaded.apply(loaded._init_weights)
    assert unchanged(loaded)
    # ...rows added by resize_token_embeddings are HF's draw, far from d^-γ (the old rows stay)...
    vocab = cfg.vocab_size  # resize_token_embeddings updates the config
    model.resize_token_embeddings(vocab + 64)
    emb = model.get_input_embeddings().weight
    assert torch.equal(emb[:vocab], state["model.embed_tokens.weight"])
    new_std = emb[vocab:].detach().double().std().item()
    assert new_std < 0.1 * cfg.hidden_size ** -gamma, new_std  # the README says 30x below
    # ...and on a model built from a config it redraws every matrix at N(0, initializer_range²).
    model.apply(model._init_weights)
    for layer in model.model.layers:
        assert_std("q_proj after _init_weights", layer.self_attn.q_proj.weight, cfg.initializer_range)


# The ε audit at a real width. At init the residual stream entering a norm has mean square
# d^-2γ, so RMSNorm's sqrt(mean(x²) + ε) is ruled by ε once r = ε·d^2γ is not small: at d=2048,
# γ=1, ε=1e-5, r = 42 and the norm outputs RMS 1/sqrt(1+r) = 0.15 instead of 1.
def _dense_2048(family, eps):
    # Cheap at full width: one head of 64, a 16-wide MLP, a 16-token vocab.
    return getattr(transformers, f"{family}Config")(
        vocab_size=16, hidden_size=2048, intermediate_size=16, num_hidden_layers=2, num_attention_heads=1,
        num_key_value_heads=1, head_dim=64, rms_norm_eps=eps)


# Where a 2-layer Llama, Qwen2 or Gemma keeps its norms (read off their modeling files).
DECODER_NORMS = {f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")}
DECODER_NORMS.add("model.norm")


def init_recording_warnings(model, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = gamma_init_(model, **kw)
    return report, [str(w.message) for w in caught]


def output_rms_at_init_scale(norm, d, gamma):
    # A stream whose every row has mean square exactly d^-2γ: the norm's input at init.
    x = torch.randn(4, d, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * d ** -gamma
    return norm(x).pow(2).mean(-1).sqrt()


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Gemma"])
@pytest.mark.parametrize("eps,gamma", [(1e-5, 1.0), (1e-6, 1.0), (1e-5, 0.5), (1e-6, 0.5), (1e-12, 1.0)])
def test_eps_audit_names_the_norms_that_will_not_normalize(family, eps, gamma):
    cfg = _dense_2048(family, eps)
    model = build(cfg)
    report, caught = init_recording_warnings(model, gamma=gamma, seed=0)
    d = cfg.hidden_size
    r = cfg.rms_norm_eps * d ** (2 * gamma)  # from the config, by hand
    # What r means, on the model's own norm (Gemma's x̂·(1+w) included): output RMS 1/sqrt(1+r).
    rms = output_rms_at_init_scale(model.model.norm, d, gamma)
    assert torch.allclose(rms, torch.full_like(rms, (1 + r) ** -0.5), rtol=1e-4), (rms, r)
    flagged = {row["name"]: row for row in report if row["action"] == "eps"}
    if r < 0.1:  # γ=0.5: r = ε·d ≤ 0.02; ε=1e-12: r = 4e-6
        assert flagged == {} and caught == [], (flagged, caught)
        return
    assert set(flagged) == DECODER_NORMS
    assert all(f"r = {r:.3g}" in row["reason"] and "1e-12" in row["reason"] for row in flagged.values())
    # One warning, the five identical norms in one group.
    (message,) = caught
    assert (f"5 norms (model.layers.*.input_layernorm, model.layers.*.post_attention_layernorm, model.norm) "
            f"eps {eps:g}, d 2048: r = {r:.3g}") in message, message
    assert "use eps <= 1e-12 under γ=1, or accept that" in message


def test_eps_audit_groups_norms_by_width_qwen3_qk_norms():
    # Qwen3's q/k norms normalise head_dim (128), not hidden: a group of their own, with r = ε·128^2γ.
    cfg = transformers.Qwen3Config(vocab_size=16, hidden_size=2048, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=1, num_key_value_heads=1, head_dim=128, rms_norm_eps=1e-5)
    model = build(cfg)
    report, (message,) = init_recording_warnings(model, gamma=1.0)
    flagged = {row["name"] for row in report if row["action"] == "eps"}
    assert flagged == {"model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm", "model.norm",
                       "model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.k_norm"}
    assert (f"3 norms (model.layers.*.input_layernorm, model.layers.*.post_attention_layernorm, model.norm) "
            f"eps 1e-05, d 2048: r = {1e-5 * 2048 ** 2:.3g}") in message
    assert f"2 norms (model.layers.*.self_attn.q_norm, model.layers.*.self_attn.k_norm) eps 1e-05, d 128: " \
           f"r = {1e-5 * 128 ** 2:.3g}" in message


def test_t5_relative_attention_bias_is_a_logit_bias_set_to_zero_and_named():
    # T5's relative_attention_bias is nn.Embedding(num_buckets, n_heads): one number per bucket
    # and head, added to the attention logits. Read as a token embedding it would get d_in =
    # n_heads (std 1/16 at γ=1 for 16 heads) and dominate logits that start near 0.
    cfg = transformers.T5Config(vocab_size=300, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2,
                                num_heads=16, relative_attention_num_buckets=32)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg)
    report = {r["name"]: r for r in init_without_warnings(model, gamma=1.0)}
    inner = cfg.num_heads * cfg.d_kv
    check_every_tensor(model, [
        (r"^shared\.|lm_head\.", cfg.d_model),
        (r"Attention\.[qkv]\.weight|DenseReluDense\.wi\.weight", cfg.d_model),
        (r"Attention\.o\.weight", inner),
        (r"DenseReluDense\.wo\.weight", cfg.d_ff),
        (r"relative_attention_bias\.weight", "zeros"),
        (r"layer_norm\.weight", None),
    ], gamma=1.0)
    # Only the first block of each stack holds a table (the others reuse its bias).
    tables = ["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
              "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    assert sorted(n for n in report if "relative_attention_bias" in n) == tables
    for name in tables:
        assert report[name]["action"] == "zeros" and "position-bias table" in report[name]["reason"]
    # HF's own compute_bias, what forward adds to the logits, is then 0 for every head and offset.
    for stack in (model.encoder, model.decoder):
        bias = stack.block[0].layer[0].SelfAttention.compute_bias(9, 9)
        assert bias.shape == (1, cfg.num_heads, 9, 9) and torch.all(bias == 0)
    # The printed report says why the table is 0.
    lines = [line for line in format_report(list(report.values())).splitlines() if "relative_attention_bias" in line]
    assert len(lines) == 2 and all("position-bias table" in line for line in lines)
