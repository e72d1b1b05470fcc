"""model.py against independent references: float64 formulas, SDPA for Flex, brute-force MoE."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import built, greedy_reference, moe_cfg, tiny, tiny_model
from init import gamma_init_
from analysis import capture_attention, token_logprobs, trace_residual
from generate import decode, generate
from init import init_model_
from model import (GPT, SIZES, Attention, GPTConfig, LayerNorm, MoE, RMSNorm, apply_rope, attention_mask_mod,
                   build_attention_mask, config_for, document_ids, rope_cos_sin)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

EOT = 0


# --- RMSNorm ----------------------------------------------------------------------------------

def test_rmsnorm_tiny_eps_normalizes_small_activations():
    x = torch.randn(8, 256, dtype=torch.float64)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * 1e-3  # every row has RMS exactly 1e-3
    rms = {eps: RMSNorm(256, eps)(x.float()).double().pow(2).mean(-1).sqrt() for eps in (1e-12, 1e-5)}
    assert torch.allclose(rms[1e-12], torch.ones(8, dtype=torch.float64), rtol=1e-4)
    # eps=1e-5 swamps the mean square 1e-6: output RMS sqrt(1e-6 / (1e-6 + 1e-5)) = 0.30.
    assert torch.all(rms[1e-5] < 0.31)
    assert torch.allclose(rms[1e-5], torch.full((8,), math.sqrt(1e-6 / 1.1e-5), dtype=torch.float64), rtol=1e-4)


def test_rmsnorm_runs_in_fp32_for_bf16_inputs():
    # Seeded: bf16 rounds |y| > 4 by up to 0.016, past atol, and 512 unseeded draws reach it ~3% of the time.
    x = (torch.randn(4, 128, generator=torch.Generator().manual_seed(0)) * 1e-3).bfloat16()
    y = RMSNorm(128, 1e-12)(x)
    assert y.dtype == torch.bfloat16
    ref = x.double() / x.double().pow(2).mean(-1, keepdim=True).sqrt()
    assert torch.allclose(y.double(), ref, atol=1e-2)


def test_layernorm_against_float64_with_tiny_and_standard_eps():
    x = torch.randn(8, 256, dtype=torch.float64) * 1e-3 + 5e-4  # small activations with a mean
    norm = LayerNorm(256, 1e-12)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 256))
        norm.bias.copy_(torch.linspace(-0.1, 0.1, 256))
    centred = x - x.mean(-1, keepdim=True)
    var = centred.pow(2).mean(-1, keepdim=True)  # biased variance, as LayerNorm defines it
    for eps in (1e-12, 1e-5):
        norm.eps = eps
        ref = centred / (var + eps).sqrt() * norm.weight.double() + norm.bias.double()
        assert torch.allclose(norm(x.float()).double(), ref, atol=1e-5), eps
    # the same failure as RMSNorm: eps=1e-5 swamps a variance of 1e-6
    assert norm(x.bfloat16()).dtype == torch.bfloat16


def test_layernorm_model_is_gamma_initialised_and_trains():
    model = built(tiny(norm="layernorm"), gamma=1.0)
    norms = [m for m in model.modules() if isinstance(m, LayerNorm)]
    assert len(norms) == 2 * 2 + 1 and not any(isinstance(m, RMSNorm) for m in model.modules())
    assert all(torch.equal(m.weight, torch.ones(64)) and torch.equal(m.bias, torch.zeros(64)) for m in norms)
    idx = torch.randint(0, 50, (2, 16))
    _, loss = model.train()(idx, idx)
    loss.backward()
    assert all(m.bias.grad is not None and m.bias.grad.abs().sum() > 0 for m in norms)


# --- Gated attention --------------------------------------------------------------------------

def rope_by_hand(T, hd, theta=10000.0):
    """RoPE angles from the definition: position m, pair i rotates by m * theta^(-2i/hd)."""
    angles = torch.tensor([[m * theta ** (-2 * i / hd) for i in range(hd // 2)] for m in range(T)],
                          dtype=torch.float64)
    return angles.cos(), angles.sin()


def test_rope_depends_only_on_relative_position():
    cos, sin = rope_cos_sin(0, 12, 16, 10000.0, "cpu")
    hand_cos, hand_sin = rope_by_hand(12, 16)
    assert torch.allclose(cos.double(), hand_cos, atol=1e-6) and torch.allclose(sin.double(), hand_sin, atol=1e-6)
    later_cos, later_sin = rope_cos_sin(5, 7, 16, 10000.0, "cpu")
    assert torch.allclose(later_cos, cos[5:], atol=1e-6) and torch.allclose(later_sin, sin[5:], atol=1e-6)
    # The same query and key vectors at positions (m, n) and (m + s, n + s) give the same score.
    q, k = torch.randn(16), torch.randn(16)
    rotated_q = apply_rope(q.expand(1, 12, 1, 16), cos, sin)[0, :, 0]  # (B, T, H, head_dim)
    rotated_k = apply_rope(k.expand(1, 12, 1, 16), cos, sin)[0, :, 0]
    scores = rotated_q @ rotated_k.T
    assert torch.allclose(scores[7, 2], scores[10, 5], atol=1e-5) and torch.allclose(scores[4, 4], scores[11, 11], atol=1e-5)
    assert not torch.allclose(scores[7, 2], scores[7, 5], atol=1e-3)


def attention_reference(attn, x, gate_weight=None):
    """Gated causal attention written out in float64 from the module's weights."""
    B, T, d = x.shape
    H, hd = attn.n_head, attn.head_dim
    xd = x.double()
    cos, sin = rope_by_hand(T, hd)

    def heads(w, n):
        t = (xd @ w.double().T).view(B, T, n, hd).transpose(1, 2)
        return t

    def rope(t):
        t1, t2 = t.chunk(2, -1)
        return torch.cat([t1 * cos - t2 * sin, t1 * sin + t2 * cos], -1)

    q, k, v = rope(heads(attn.wq.weight, H)), rope(heads(attn.wk.weight, attn.n_kv_head)), heads(attn.wv.weight, attn.n_kv_head)
    rep = H // attn.n_kv_head
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = scores.softmax(-1) @ v                                          # (B, H, T, hd)
    if gate_weight is not None:
        g = torch.sigmoid(xd @ gate_weight.double().T).view(B, T, H, -1).transpose(1, 2)
        y = y * g
    merged = y.transpose(1, 2).reshape(B, T, H * hd)
    return merged, merged @ attn.wo.weight.double().T


@pytest.mark.parametrize("gate", ["elementwise", "headwise", "none"])
@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_attention_matches_float64_reference(gate, n_kv_head):
    cfg = tiny(attn_gate=gate, n_kv_head=n_kv_head)
    attn = Attention(cfg)
    torch.nn.init.normal_(attn.wq.weight, std=0.3)
    torch.nn.init.normal_(attn.wk.weight, std=0.3)
    x = torch.randn(2, 10, 64)
    seen = {}
    attn.wo.register_forward_hook(lambda m, args, out: seen.update(wo_input=args[0]))
    out = attn(x, torch.ones(10, 10, dtype=torch.bool).tril())
    merged, ref = attention_reference(attn, x, attn.wg.weight if gate != "none" else None)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    # The gate multiplies each head's output *before* the output projection.
    assert torch.allclose(seen["wo_input"].double(), merged, atol=1e-5)


def test_gate_is_query_dependent_and_zero_gate_halves_the_output():
    cfg = tiny(attn_gate="elementwise")
    attn = Attention(cfg)
    x = torch.randn(1, 12, 64)
    mask = torch.ones(12, 12, dtype=torch.bool).tril()
    gates = []
    attn.wg.register_forward_hook(lambda m, args, out: gates.append(torch.sigmoid(out)))
    attn(x, mask)
    x2 = x.clone()
    x2[0, 5] += 1.0
    attn(x2, mask)
    changed = (gates[0] - gates[1]).abs().amax(-1)[0]
    assert changed[5] > 0 and torch.all(changed[torch.arange(12) != 5] == 0)
    # sigmoid(0) = 1/2 everywhere: exactly half of the ungated module with the same weights.
    ungated = Attention(tiny(attn_gate="none"))
    ungated.load_state_dict({k: v for k, v in attn.state_dict().items() if not k.startswith("wg")})
    torch.nn.init.zeros_(attn.wg.weight)
    assert torch.allclose(attn(x, mask), 0.5 * ungated(x, mask), atol=1e-6)


# --- Masks and backends -----------------------------------------------------------------------

def test_document_ids_by_hand():
    idx = torch.tensor([[5, EOT, 7, 8, EOT, 9], [EOT, EOT, 3, 3, 3, 3]])
    assert document_ids(idx, EOT).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]


def packed_batch(T=40, B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, 50, (B, T), generator=g)
    idx[0, [7, 20, 21]] = EOT
    idx[1, [0, 33]] = EOT
    idx[2, [15]] = EOT
    return idx


@pytest.mark.parametrize("doc_mask", [False, True])
@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_flex_sdpa_eager_agree(doc_mask, mlp):
    model = built(tiny(doc_mask=doc_mask, eot_id=EOT, mlp=mlp, n_kv_head=2))
    idx = packed_batch()
    outputs = {}
    with torch.no_grad():
        for backend in ("sdpa", "flex", "eager"):
            model.set_attn_backend(backend)
            outputs[backend] = model(idx)[0]
    assert torch.allclose(outputs["flex"], outputs["sdpa"], atol=2e-5)
    assert torch.allclose(outputs["eager"], outputs["sdpa"], atol=2e-5)


@pytest.mark.parametrize("backend", ["sdpa", "flex", "eager"])
def test_no_attention_across_documents(backend):
    model = built(tiny(doc_mask=True, eot_id=EOT, attn_backend=backend))
    idx = packed_batch()
    changed = idx.clone()
    # Row 0's second document is positions 8..20 (its end-of-text at 20 belongs to it); every
    # token of it is replaced by a different one.
    changed[0, 8:20] = (idx[0, 8:20] + torch.arange(1, 13)) % 49 + 1
    with torch.no_grad():
        a, b = model(idx)[0], model(changed)[0]
    moved = (a - b).abs().amax(-1)[0]
    assert torch.all(moved[:8] == 0) and torch.all(moved[21:] == 0)  # other documents: untouched
    assert torch.all(moved[8:21] > 0)
    # Without document masking the later documents do see the change.
    model.cfg.doc_mask = False
    with torch.no_grad():
        assert (model(idx)[0] - model(changed)[0]).abs()[0, 25:].amax() > 0


def test_eager_probabilities_sum_to_one_and_respect_the_mask():
    model = built(tiny(doc_mask=True, eot_id=EOT, attn_backend="eager"))
    idx = packed_batch()
    with torch.no_grad(), capture_attention(model) as probs:
        model(idx)
    doc = document_ids(idx, EOT)
    T = idx.shape[1]
    allowed = (torch.arange(T)[:, None] >= torch.arange(T)[None, :]) & (doc[:, :, None] == doc[:, None, :])
    for p in probs:
        assert p.shape == (3, 4, T, T)
        assert torch.allclose(p.sum(-1), torch.ones(3, 4, T), atol=1e-6)
        assert torch.all(p.masked_select(~allowed[:, None]) == 0)
        assert torch.all(p.masked_select(allowed[:, None]) > 0)
    with torch.no_grad(), capture_attention(model, reduce=lambda p: p[:, :, :, 0].sum()) as first_column:
        model(idx)
    assert all(torch.allclose(r, p[:, :, :, 0].sum()) for r, p in zip(first_column, probs))
    model.set_attn_backend("sdpa")
    with pytest.raises(ValueError, match="eager"):
        with capture_attention(model):
            pass


@pytest.mark.parametrize("doc_mask", [False, True])
@pytest.mark.parametrize("cached", [0, 9])
def test_the_dense_mask_is_torchs_rendering_of_the_mask_mod(doc_mask, cached):
    # build_attention_mask calls the mask_mod once on broadcast indices; torch's create_mask (the mask_mod
    # vmapped over every (b, h, q, kv)) is the reference, for a batch alone and for queries after 9 cached ones.
    from types import SimpleNamespace
    from torch.nn.attention.flex_attention import create_mask
    full = packed_batch(T=40)
    idx, doc = full[:, cached:], document_ids(full, EOT)
    cache = SimpleNamespace(length=cached, doc=doc) if cached else None
    mask = build_attention_mask(idx, tiny(doc_mask=doc_mask, eot_id=EOT), "eager", cache)
    rule = attention_mask_mod(cached, doc[:, cached:], doc) if doc_mask else attention_mask_mod(cached)
    want = create_mask(rule, 3 if doc_mask else 1, 1, 40 - cached, 40)
    assert mask.dtype == want.dtype == torch.bool and mask.shape == want.shape and torch.equal(mask, want)


# --- MoE --------------------------------------------------------------------------------------

def moe_brute_force(moe, x):
    """Per token in float64: top-k of (score + bias), weights renormalised over the chosen."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    chosen = []
    for n, xt in enumerate(x.double()):
        logits = xt @ moe.router.weight.double().T
        scores = logits.softmax(-1) if moe.score == "softmax" else torch.sigmoid(logits)
        top = sorted(range(moe.n_experts), key=lambda e: -(scores[e] + moe.expert_bias[e]).item())[:moe.top_k]
        chosen.append(set(top))
        total = sum(scores[e] for e in top)
        for e in top:
            up = xt @ moe.w_up[e].double()
            h = F.silu(xt @ moe.w_gate[e].double()) * up if moe.w_gate is not None else F.gelu(up)
            out[n] += scores[e] / total * (h @ moe.w_down[e].double())
    return out, chosen


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_moe_grouped_and_reference_match_brute_force(score, mlp):
    cfg = moe_cfg(router_score=score, mlp=mlp)
    grouped = MoE(cfg)
    gamma_init_(grouped, gamma=0.5)
    grouped.expert_bias.copy_(torch.tensor([0.0, 0.05, -0.05, 0.1, 0.0, 0.02]))
    reference = MoE(moe_cfg(router_score=score, mlp=mlp, moe_impl="reference"))
    reference.load_state_dict(grouped.state_dict())
    x = torch.randn(3, 7, 64)
    x_g, x_r = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_g, aux_g, counts_g = grouped(x_g)
    out_r, aux_r, counts_r = reference(x_r)
    want, chosen = moe_brute_force(grouped, x.view(-1, 64))
    assert torch.allclose(out_g.view(-1, 64).double(), want, atol=1e-5)
    assert torch.allclose(out_r.view(-1, 64).double(), want, atol=1e-5)
    # Every token reaches exactly top_k experts, and the counts say so.
    assert all(len(c) == 2 for c in chosen) and counts_g.sum() == 21 * 2
    assert counts_g.tolist() == [sum(e in c for c in chosen) for e in range(6)]
    assert torch.equal(counts_g, counts_r) and torch.allclose(aux_g, aux_r)
    # Gradients agree between the two paths.
    (out_g.square().sum() + aux_g).backward()
    (out_r.square().sum() + aux_r).backward()
    for (name, pg), pr in zip(grouped.named_parameters(), reference.parameters()):
        assert torch.allclose(pg.grad, pr.grad, atol=1e-5), name
    assert torch.allclose(x_g.grad, x_r.grad, atol=1e-5)


def test_top1_router_still_learns():
    # With one expert per token the routing weight is the raw score, so the LM loss reaches
    # the router (renormalising s/s = 1 would cut that gradient).
    moe = MoE(moe_cfg(top_k=1))
    gamma_init_(moe, gamma=0.5)
    out, _, counts = moe(torch.randn(2, 9, 64))
    out.square().sum().backward()
    assert counts.sum() == 18 and moe.router.weight.grad.norm() > 1e-3


def test_moe_aux_loss_by_hand():
    moe = MoE(moe_cfg())
    gamma_init_(moe, gamma=0.5)
    x = torch.randn(1, 10, 64)
    _, aux, counts = moe(x)
    probs = (x.view(-1, 64) @ moe.router.weight.T).softmax(-1)
    want = 6 * sum(counts[e] / 20 * probs[:, e].mean() for e in range(6))
    assert aux.item() == pytest.approx(want.item(), rel=1e-5)


def test_selection_bias_moves_load_toward_balance():
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=1, vocab_size=256, n_experts=6, top_k=2, d_expert=48, moe_bias_rate=0.01))
    init_model_(model, gamma=0.5)
    moe = model.layers[0].mlp
    # Skew: every input leans along one direction, and expert 0's router row points along it.
    direction = torch.randn(64)
    with torch.no_grad():
        moe.router.weight[0] += 0.02 * direction
        model.tok_emb.weight.add_(0.125 * direction)
    idx = torch.randint(0, 256, (8, 64))
    model.train()
    imbalance = []  # busiest expert's load over the mean load (1 = balanced, 3 = one expert in every top-2)
    for _ in range(60):
        model(idx)
        counts = model.update_moe_bias()[0].float()
        imbalance.append((counts.max() / counts.mean()).item())
    assert imbalance[0] > 2.0
    assert np.mean(imbalance[-10:]) < 0.6 * imbalance[0]
    assert torch.all(moe.tokens_per_expert == 0)  # counters restart after each update


def test_moe_counts_only_training_forwards():
    model = GPT(moe_cfg())
    init_model_(model)
    idx = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        model.eval()(idx)
    assert model.update_moe_bias().sum() == 0
    model.train()(idx)
    counts = model.update_moe_bias()
    assert counts.dtype == torch.long and counts.sum(1).tolist() == [2 * 8 * 2] * 2


def test_aux_loss_coefficient_enters_the_loss():
    idx = torch.randint(0, 50, (2, 8))
    losses = {}
    for coef in (0.0, 0.5):
        model = built(moe_cfg(moe_aux_loss_coef=coef))
        losses[coef] = model(idx, idx)[1]
    aux = model.aux_loss  # mean over layers of E * sum_e f_e P_e, >= 1 (its value at balance)
    assert aux >= 1.0
    assert losses[0.5].item() == pytest.approx(losses[0.0].item() + 0.5 * aux.item(), rel=1e-5)


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    idx = torch.randint(0, 50, (2, 16))
    grads, counts = [], []
    for ac in (False, True):
        model = built(moe_cfg(activation_checkpointing=ac)).train()
        loss = model(idx, idx)[1]
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        counts.append(model.update_moe_bias())
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])
    assert torch.equal(counts[0], counts[1])  # recomputation in backward doesn't count tokens twice


# --- Residual-flow theory ---------------------------------------------------------------------

def branch_ratios(d, gamma, mlp, seed=0):
    cfg = GPTConfig(vocab_size=512, n_layer=1, n_head=max(2, d // 64), d_model=d, mlp=mlp, max_seq_len=128)
    model = built(cfg, gamma=gamma, seed=seed)
    idx = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad(), trace_residual(model) as rec:
        model(idx)
    r = rec[0]
    return r["attn_rms"][0] / r["resid_rms"][0], r["mlp_rms"][0] / r["resid_rms"][0]


@pytest.mark.parametrize("gamma", [0.5, 1.0, 1.5])
def test_branch_to_residual_ratio_scales_as_theory_predicts(gamma):
    """At init the residual stream is the embedding, RMS d^-γ. A linear map of a normalized
    input has RMS d^(1/2-γ), so attention (v then o) and the GELU MLP (up then down) add
    d^(1-2γ): ratio d^(1-γ). SwiGLU multiplies two such maps: d^(3/2-3γ), ratio d^(3/2-2γ)."""
    widths = [64, 128, 256, 512, 1024]
    logd = np.log(widths)
    for mlp, predicted_mlp in (("gelu", 1 - gamma), ("swiglu", 1.5 - 2 * gamma)):
        ratios = np.array([branch_ratios(d, gamma, mlp) for d in widths])
        attn_slope = np.polyfit(logd, np.log(ratios[:, 0]), 1)[0]
        mlp_slope = np.polyfit(logd, np.log(ratios[:, 1]), 1)[0]
        assert abs(attn_slope - (1 - gamma)) < 0.1, (mlp, attn_slope)
        assert abs(mlp_slope - predicted_mlp) < 0.1, (mlp, mlp_slope)


# --- Sizes, counts, config errors ------------------------------------------------------------

# Every size named by a parameter count: a new one is checked without editing this list.
@pytest.mark.parametrize("size", [s for s in SIZES if s.endswith("b")])
def test_named_sizes_match_their_names(size):
    with torch.device("meta"):
        model = GPT(config_for(size))
    target = float(size.removeprefix("moe-").removesuffix("b")) * 1e9
    n = model.num_params()
    assert abs(n["total"] / target - 1) < 0.10, n
    if size.startswith("moe"):
        assert n["active"] < 0.6 * n["total"]


def test_param_and_flop_counts_by_hand():
    d, f, V, L, T = 64, 192, 50, 2, 32
    model = GPT(tiny(d_ff=f, n_layer=L))
    attn = 4 * d * d + d * d                    # q, k, v, o + elementwise gate
    per_layer = attn + 3 * d * f + 2 * d        # swiglu + two norms
    total = 2 * V * d + L * per_layer + d
    n = model.num_params()
    assert n["total"] == total and n["active"] == total and n["embedding"] == V * d
    matmul = L * (attn + 3 * d * f) + V * d
    assert model.flops_per_token(T) == 6 * matmul + 12 * L * d * T

    moe = GPT(moe_cfg(n_layer=1))
    experts = 6 * 3 * 64 * 48
    n = moe.num_params()
    assert n["total"] - n["active"] == experts - experts * 2 // 6


@pytest.mark.parametrize("bad, message", [
    (dict(d_model=60, n_head=8), "not divisible by n_head"),
    (dict(n_head=4, n_kv_head=3), "not divisible by n_kv_head"),
    (dict(n_head=4, n_kv_head=-2), "n_kv_head"),
    (dict(n_head=0), "n_head"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(n_experts=4, top_k=5), "top_k"),
    (dict(n_experts=4, d_expert=36), "divisible by 8"),
    (dict(attn_gate="sigmoid"), "attn_gate"),
    (dict(attn_backend="flash"), "attn_backend"),
    (dict(mlp="relu"), "mlp"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(norm="batchnorm"), "norm"),
    (dict(n_layer=2.5), "n_layer"),
    (dict(doc_mask=True), "eot_id"),
])
def test_impossible_configs_fail_at_construction(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny(**bad)


def test_unknown_size_or_field():
    with pytest.raises(ValueError, match="unknown model size"):
        config_for("2b")
    with pytest.raises(ValueError, match="n_layers"):
        config_for("tiny", n_layers=3)


def test_loss_ignores_masked_targets():
    model = built(tiny())
    idx = torch.randint(0, 50, (2, 9))
    targets = torch.full_like(idx, -1)
    targets[:, -1] = idx[:, 0]
    (logits, _), (_, loss) = model(idx), model(idx, targets)
    want = F.cross_entropy(logits[:, -1].double(), idx[:, 0])
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    # A micro-batch with no targets at all contributes zero, not NaN.
    _, empty = model(idx, torch.full_like(idx, -1))
    assert empty.item() == 0.0


# --- Generation -------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(n_kv_head=1, attn_gate="headwise"), dict(attn_backend="flex"),
                                dict(n_experts=4, top_k=2, d_expert=32), dict(doc_mask=True, eot_id=EOT)])
def test_cached_greedy_generation_equals_full_recomputation(kw):
    model = built(tiny(max_seq_len=40, **kw))
    idx = torch.randint(1, 50, (3, 7))
    idx[0, 3] = idx[1, 6] = EOT  # documents end inside the prompt (matters with doc_mask)
    assert decode(model, idx, 20) == greedy_reference(model, idx, 20)


def test_sampling_follows_the_tempered_distribution_and_stop_ends_rows():
    model = built(tiny(vocab_size=5, max_seq_len=40))
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        logits = model(prompt)[0][0, -1].double()
    g = torch.Generator().manual_seed(0)
    first = [t[0] for t in decode(model, prompt.expand(4000, 3), 1, temperature=0.5, generator=g)]
    freq = np.bincount(first, minlength=5) / 4000
    np.testing.assert_allclose(freq, (logits / 0.5).softmax(-1).numpy(), atol=0.03)
    # top_k=1 sampling is greedy; the same generator seed gives the same samples.
    idx = torch.randint(1, 5, (4, 5))
    greedy = decode(model, idx, 12)
    assert decode(model, idx, 12, temperature=1.0, top_k=1) == greedy
    draws = [decode(model, idx, 12, temperature=1.0, generator=torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    assert draws[0] == draws[1] and draws[0] != draws[2]
    # stop ends each row at the token that satisfied it.
    stop_at = greedy[0][3]
    out = decode(model, idx, 12, stop=lambda toks: toks[-1] == stop_at)
    for row, full in zip(out, greedy):
        cut = full.index(stop_at) + 1 if stop_at in full else len(full)
        assert row == full[:cut]
    with pytest.raises(ValueError, match="max_seq_len"):
        decode(model, idx, 40)


def test_generate_crops_long_prompts_and_passes_stop_through():
    model = built(GPTConfig(vocab_size=30, n_layer=1, n_head=2, d_model=32, max_seq_len=16))
    prompt = list(range(1, 25))  # longer than max_seq_len
    out = generate(model, prompt, 6)
    # Reference: greedy on the last 10 prompt tokens (16 - 6 new).
    assert out == greedy_reference(model, torch.tensor([prompt[-10:]]), 6)
    stop_at = out[0][2]
    assert generate(model, prompt, 6, stop=lambda toks: toks[-1] == stop_at)[0][-1] == stop_at
    assert len(generate(model, prompt, 40)[0]) == 15  # capped to leave one prompt token


def test_token_logprobs_in_chunks_match_float64_log_softmax():
    model = tiny_model(seed=7)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 257, (3, 10), generator=g), torch.randint(0, 257, (3, 10), generator=g)
    y[0, 2] = y[2, 9] = -1
    with torch.no_grad():
        ref = torch.log_softmax(model(x)[0].double(), -1).gather(2, y.clamp_min(0)[..., None]).squeeze(2)
    ref = ref * (y >= 0)
    # 3 rows x 257 logits x 3 positions per chunk: chunks of 3, 3, 3, 1 positions.
    for chunk_elements in (3 * 257 * 3, 1 << 26):
        got = token_logprobs(model, x, y, chunk_elements=chunk_elements)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
        assert got[0, 2] == 0 and got[2, 9] == 0
