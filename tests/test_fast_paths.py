"""model.py's forms against the other forms bench.py keeps to time them: RoPE without a
concatenation against the textbook halves (bench.rope_by_halves), and one GEMM per matrix against
one for q, k, v and the gate and one for SwiGLU's gate and up (bench.use_other_forms). Values bitwise
where the arithmetic is the same; the gradients, whose sums run in another order, within the
rounding stated at each test."""
import collections
import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.overrides import TorchFunctionMode

import bench
import train
from init import init_model_
from generate import decode
from model import GPT, Block, GPTConfig, apply_rope, rope_cos_sin
from train import compile_model_


class Calls(TorchFunctionMode):
    """Counts the torch functions called inside it, and the sizes of what torch.cat makes."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()
        self.cat_sizes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count[func] += 1
        out = func(*args, **(kwargs or {}))
        if func is torch.cat:
            self.cat_sizes.append(out.numel())
        return out


# --- RoPE -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T, H, hd, start", [(2, 7, 3, 8, 0), (1, 33, 4, 64, 5), (3, 1, 2, 2, 100),
                                                (2, 16, 6, 128, 0)])
def test_rope_is_bitwise_the_halves_form(dtype, B, T, H, hd, start):
    g = torch.Generator().manual_seed(hd + T)
    # q as the fused projection hands it over: a slice of a wider row, not contiguous.
    wide = (3 * torch.randn(B, T, H * hd + 5, generator=g)).to(dtype)
    x = wide[..., :H * hd].view(B, T, H, hd)
    cos, sin = rope_cos_sin(start, T, hd, 10000.0, "cpu")
    got = apply_rope(x, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, bench.rope_by_halves(x, cos, sin))


def test_rope_concatenates_no_activations():
    # Only the (T, head_dim) cos/sin tables may be concatenated, never anything of x's size.
    x = torch.randn(2, 9, 4, 16)
    cos, sin = rope_cos_sin(0, 9, 16, 10000.0, "cpu")
    with Calls() as calls:
        apply_rope(x, cos, sin)
    assert all(n <= 9 * 16 for n in calls.cat_sizes), calls.cat_sizes


# --- one GEMM per matrix, or one for q, k, v, gate and one for SwiGLU's gate, up ---------------------

@pytest.mark.parametrize("mlp, gate", [("swiglu", "elementwise"), ("swiglu", "none"), ("gelu", "headwise")])
def test_a_block_makes_one_gemm_per_matrix_and_the_fused_form_four(mlp, gate):
    cfg = GPTConfig(d_model=64, n_head=4, n_kv_head=2, mlp=mlp, attn_gate=gate)
    block = Block(cfg)
    x = torch.randn(2, 5, 64)
    counts = []
    for forms in ((), ("fused-gemms",)):
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([copy.deepcopy(block)])
        bench.use_other_forms(model, forms)
        with Calls() as calls:
            model.layers[0](x, None)
        counts.append(calls.count[F.linear])
    # q, k, v, the gate (if any), wo; gate and up (or up), down. Fused: q/k/v/gate, wo, gate/up, down.
    assert counts[0] == 3 + (gate != "none") + 1 + 1 + (mlp == "swiglu") + 1
    assert counts[1] == 4


CONFIGS = [dict(), dict(attn_gate="headwise", n_kv_head=1), dict(mlp="gelu", attn_gate="none", n_kv_head=2)]


def model_and_fused(dtype, **overrides):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, n_layer=2, n_head=4, d_model=64, max_seq_len=64, **overrides))
    init_model_(model, gamma=1.0)
    model.to(dtype)
    fused = copy.deepcopy(model)
    bench.use_other_forms(fused, ("fused-gemms",))
    return model, fused


def grads_agree(a_net, b_net, rel):
    """Every parameter's gradient within rel x the largest |gradient| of that parameter."""
    for (name, p), q in zip(a_net.named_parameters(), b_net.parameters()):
        a, b = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in (p.grad, q.grad)]
        assert torch.allclose(a.float(), b.float(), rtol=0, atol=rel * b.float().abs().max().item()), name


# The fused GEMM's columns are the separate GEMMs' columns, the same dot products, so q, k and v are
# bitwise equal (Intel Xeon and AMD EPYC BLAS at these shapes). The headwise gate's own GEMM is 4
# columns wide, which the EPYC's BLAS sums in another order than the wide fused one: its logits differ
# there by up to 2 ulp of the largest (bitwise on the Xeon), so they are held to 4.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overrides", CONFIGS)
def test_the_fused_projection_is_bitwise_the_separate_ones(dtype, overrides):
    model, fused = model_and_fused(dtype, **overrides)
    x = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    (*qkv, gate), (*qkv_want, gate_want) = fused.layers[0].attn.project(x), model.layers[0].attn.project(x)
    assert all(torch.equal(got, want) for got, want in zip(qkv, qkv_want, strict=True))
    if overrides.get("attn_gate") == "headwise":
        ulp = torch.finfo(dtype).eps * gate_want.abs().max()
        assert torch.allclose(gate, gate_want, rtol=0, atol=4 * ulp.item())
    else:
        assert (gate is None and gate_want is None) or torch.equal(gate, gate_want)


# The whole model: the gate's sigmoid reads the logits as a strided slice of the fused GEMM's rows,
# and ATen computes an elementwise op on the leftover of a row narrower than its vectors with scalar
# code, whose exp can differ by one ulp from the vectorised one: a headwise gate (4 columns here)
# then differs from the separate form by ~1e-7 in fp32. Forward within 1e-6 of the largest value in
# fp32 (2^-6 in bf16, one ulp flips a rounding). Backward: d(loss)/dx is ONE GEMM over the fused rows
# instead of four summed, so gradients differ by rounding: measured up to 4e-7 of the largest in
# fp32 (a few ulp; asserted 2e-6) and 6e-3 in bf16 (under one bf16 ulp of 2^-7 relative; 2^-6).
@pytest.mark.parametrize("dtype, rel, forward_rel", [(torch.float32, 2e-6, 1e-6), (torch.bfloat16, 2 ** -6, 2 ** -6)])
@pytest.mark.parametrize("overrides", CONFIGS)
def test_fused_gemms_match_separate_ones(dtype, rel, forward_rel, overrides):
    model, fused = model_and_fused(dtype, **overrides)
    idx = torch.randint(97, (3, 40), generator=torch.Generator().manual_seed(1))
    want, logits = model(idx)[0].float(), fused(idx)[0].float()
    assert torch.allclose(logits, want, rtol=0, atol=forward_rel * want.abs().max().item())
    (_, loss_model), (_, loss_fused) = model(idx, idx), fused(idx, idx)
    assert torch.allclose(loss_model, loss_fused, rtol=forward_rel, atol=0)
    loss_model.backward()
    loss_fused.backward()
    grads_agree(model, fused, rel)
    assert decode(model, idx[:, :4], 8) == decode(fused, idx[:, :4], 8)  # the KV-cache path


def test_fused_gemms_under_fsdp2_bf16_mixed_precision():
    # train.py's setup on a GPU: FSDP2 per block and at the root with its policies, bf16 parameters in
    # forward and backward, fp32 gradients (one process, gloo). Loss bitwise, gradients within 2^-6 as
    # above. Each block gets the bf16 residual stream and GPT.forward's RoPE tables unrounded, in fp32.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        block_mp, root_mp = train.mixed_precision(torch.device("cuda"))
        nets = model_and_fused(torch.float32)
        seen = []
        for net in nets:
            for block in net.layers:
                fully_shard(block, mp_policy=block_mp)
                block.register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, args[3])))
            fully_shard(net, mp_policy=root_mp)
        idx = torch.randint(97, (3, 40), generator=torch.Generator().manual_seed(2))
        losses = [net(idx, idx)[1] for net in nets]
        want = rope_cos_sin(0, 40, nets[0].cfg.head_dim, nets[0].cfg.rope_theta, "cpu")
        assert len(seen) == 2 * len(nets[0].layers)
        assert all(x_dtype == torch.bfloat16 and all(got.dtype == torch.float32 and torch.equal(got, w)
                                                     for got, w in zip(rope, want)) for x_dtype, rope in seen)
        assert torch.equal(*losses)
        for loss in losses:
            loss.backward()
        assert nets[0].layers[0].attn.wq.weight.grad.dtype == torch.float32
        grads_agree(*nets, 2 ** -6)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the eager reference, on purpose
def test_the_fused_form_under_compiled_flex_is_the_model():
    # The model compiled as train.py compiles it (FlexAttention with packed documents) against the eager model on
    # FlexAttention and on SDPA's dense mask. And bench's fused form under it: compiled on CPU, inductor's
    # flex_attention template read a value handed over as a strided slice of the fused GEMM's rows wrongly (logits
    # off by 0.3 of 0.5): bench.FusedProjections copies v out. One compile of each serves both checks.
    model, fused = model_and_fused(torch.float32, attn_backend="flex", doc_mask=True, eot_id=3)
    idx = torch.randint(4, 97, (2, 32), generator=torch.Generator().manual_seed(6))
    idx[0, [7, 20, 21]] = 3  # document ends: two documents, an empty one, a third
    idx[1, [0, 25]] = 3
    with torch.no_grad():  # FlexAttention has no CPU backward
        eager = model(idx)[0]
        model.set_attn_backend("sdpa")
        sdpa = model(idx)[0]
        model.set_attn_backend("flex")
        for net in (model, fused):
            compile_model_(net)
        want, got = model(idx)[0], fused(idx)[0]
    assert torch.allclose(eager, sdpa, rtol=0, atol=2e-5) and torch.allclose(want, eager, rtol=0, atol=2e-5)
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


# --- bench.py's variants of other forms ------------------------------------------------------------

def test_full_loss_is_the_chunked_loss():
    model, _ = model_and_fused(torch.float32)
    idx = torch.randint(97, (3, 40), generator=torch.Generator().manual_seed(3))
    targets = idx.clone()
    targets[0, :7] = -1  # ignored positions count in neither
    logp = torch.log_softmax(model(idx)[0].double(), -1).gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    by_hand = -logp[targets != -1].mean()
    for loss in (bench.full_loss(model, idx, targets), model(idx, targets)[1]):
        assert loss.dtype == torch.float32 and torch.allclose(loss.double(), by_hand, rtol=1e-6)


def test_rope_per_block_is_the_same_model():
    # The angles GPT.forward hands the blocks are those a block derives itself: the same values.
    model, _ = model_and_fused(torch.float32)
    per_block = copy.deepcopy(model)
    bench.use_other_forms(per_block, ("rope-per-block",))
    idx = torch.randint(97, (3, 40), generator=torch.Generator().manual_seed(4))
    assert torch.equal(model(idx)[0], per_block(idx)[0])
    assert decode(model, idx[:, :4], 8) == decode(per_block, idx[:, :4], 8)  # positions past the cache start


def test_variants_of_other_forms_use_them_and_step():
    v = {x.name: x for x in bench.cpu_variants()}
    g = bench.Group("t", dict(vocab_size=64, n_layer=1, n_head=2, d_model=64), batch=2, seq_len=16, dtype="float32")
    runners = {name: bench.Runner(replace(v[name], group=g, compile=False), torch.device("cpu"))
               for name in ("default", "rope-halves", "fused-gemms", "full-loss", "rope-per-block-compiled")}
    forms = {name: (isinstance(r.model.layers[0].attn, bench.RopeByHalves),
                    isinstance(r.model.layers[0].attn, bench.FusedProjections),
                    isinstance(r.model.layers[0].mlp, bench.FusedGateUp),
                    isinstance(r.model.layers[0].attn, bench.RopePerBlock)) for name, r in runners.items()}
    assert forms == {"default": (False,) * 4, "rope-halves": (True, False, False, False),
                     "fused-gemms": (False, True, True, False), "full-loss": (False,) * 4,
                     "rope-per-block-compiled": (False, False, False, True)}
    assert [name for name, x in v.items() if x.full_loss] == ["full-loss"]
    for r in runners.values():
        before = [p.detach().clone() for p in r.model.parameters()]
        r.step()
        assert all(not torch.equal(a, p) for a, p in zip(before, r.model.parameters())), r.v.name
    with pytest.raises(ValueError, match="forms \\['typo'\\]"):
        bench.use_other_forms(runners["default"].model, ("typo",))
