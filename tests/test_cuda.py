"""The CUDA paths that CPU tests cannot reach: compiled FlexAttention forward and backward, the
varlen (flash) backend, bf16 grouped GEMM experts. Skipped (saying so) on machines without a GPU,
which includes CI."""
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import model as model_module
from init import gamma_init_
from init import init_model_
from model import GPT, GPTConfig, MoE, build_attention_mask, compiled, varlen_attention, varlen_boundaries

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EOT = 0


def loss_and_grads(model, idx):
    model.zero_grad()
    _, loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_compiled_flex_matches_sdpa_forward_and_backward():
    cfg = GPTConfig(vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, d_model=256, max_seq_len=512,
                    doc_mask=True, eot_id=EOT)
    model = GPT(cfg).cuda()
    init_model_(model, gamma=0.5)
    idx = torch.randint(1, 512, (2, 512), device="cuda")
    idx[0, [100, 300]] = EOT
    idx[1, 200] = EOT
    model.set_attn_backend("sdpa")
    ref_loss, ref_grads = loss_and_grads(model, idx)
    model.set_attn_backend("flex")
    for block in model.layers:
        block.compile()
    loss, grads = loss_and_grads(model, idx)
    assert torch.allclose(loss, ref_loss, atol=1e-4)
    for name in ref_grads:
        assert torch.allclose(grads[name], ref_grads[name], atol=1e-4, rtol=1e-3), name


def max_error(a, b):
    """Largest elementwise difference, relative to b's largest magnitude."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_varlen_matches_sdpa_and_flex_in_bf16(n_kv_head):
    cfg = GPTConfig(vocab_size=512, n_head=4, n_kv_head=n_kv_head, d_model=256, max_seq_len=512,
                    doc_mask=True, eot_id=EOT)
    model_module.load_varlen(GPTConfig(), torch.device("cuda"))  # imports the kernel, whatever the model
    if n_kv_head != 4 and "enable_gqa" not in inspect.signature(model_module.varlen_attn).parameters:
        pytest.skip(f"torch {torch.__version__}'s varlen_attn has no enable_gqa (GQA)")
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(1, 512, (2, 512), device="cuda", generator=g)
    idx[0, [100, 300, 301]] = EOT  # two end-of-text tokens in a row: a one-token document
    idx[1, [200, 511]] = EOT       # one at the last position
    truth = [torch.randn(2, h, 512, 64, device="cuda", generator=g) for h in (4, n_kv_head, n_kv_head)]
    grad_out = torch.randn(2, 4, 512, 64, device="cuda", generator=g)
    dense = build_attention_mask(idx, cfg, "sdpa")
    block_mask = build_attention_mask(idx, cfg, "flex")
    varlen_mask = build_attention_mask(idx, cfg, "varlen")
    gqa = n_kv_head != 4

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa)

    backends = {  # name: (attention, dtype); fp32 SDPA is the most exact of them
        "fp32": (sdpa, torch.float32), "sdpa": (sdpa, torch.bfloat16),
        "flex": (lambda q, k, v: compiled(flex_attention, q)(q, k, v, block_mask=block_mask, enable_gqa=gqa),
                 torch.bfloat16),
        "varlen": (lambda q, k, v: varlen_attention(q, k, v, varlen_mask), torch.bfloat16),
    }
    results = {}
    for name, (attend, dtype) in backends.items():
        leaves = [t.clone().to(dtype).requires_grad_() for t in truth]
        y = attend(*leaves)
        y.backward(grad_out.to(y.dtype))
        results[name] = [y.detach()] + [t.grad for t in leaves]
    # Tolerance: 2e-2 of the largest magnitude, a few bf16 roundings (8 significant bits: 2^-8 =
    # 3.9e-3 each). A row attending across a document boundary, or not to itself, is off by O(1).
    for other in ("fp32", "sdpa", "flex"):
        for what, a, b in zip(("output", "dq", "dk", "dv"), results["varlen"], results[other]):
            assert max_error(a, b) < 2e-2, (other, what, max_error(a, b))


def test_compiled_varlen_model_trains_without_recompiling_inside_a_bucket():
    cfg = GPTConfig(vocab_size=512, n_layer=2, n_head=4, d_model=256, max_seq_len=512, doc_mask=True, eot_id=EOT)
    model = GPT(cfg).cuda()
    init_model_(model, gamma=0.5)
    model = model.bfloat16()
    idx = torch.randint(1, 512, (2, 512), device="cuda")
    idx[0, [100, 300]] = EOT  # 3 documents in row 0 ...
    idx[1, 250] = EOT         # ... and 2 in row 1: 5, cu_seqlens padded to 8 sequences
    later = idx.clone()
    later[1, 400] = EOT       # 6 documents: the same 8, so the same compiled graphs
    assert [len(varlen_boundaries(x, EOT)) for x in (idx, later)] == [9, 9]
    with torch.no_grad():
        _, sdpa_loss = model(later, later)  # eager, dense mask: the reference
    model.set_attn_backend("varlen")
    for block in model.layers:
        block.compile()
    _, loss = model(idx, idx)
    loss.backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        _, loss = model(later, later)
        loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert abs(loss.item() - sdpa_loss.item()) < 1e-2 * sdpa_loss.item()


def test_bf16_grouped_experts_match_the_reference_loop():
    cfg = dict(vocab_size=512, n_layer=1, n_head=4, d_model=256, n_experts=8, top_k=2, d_expert=512)
    grouped = MoE(GPTConfig(**cfg)).cuda()
    gamma_init_(grouped, gamma=0.5)
    reference = MoE(GPTConfig(**cfg, moe_impl="reference")).cuda()
    reference.load_state_dict(grouped.state_dict())
    grouped, reference = grouped.bfloat16(), reference.bfloat16()
    x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16)
    x_g, x_r = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_g, _, counts_g = grouped(x_g)
    out_r, _, counts_r = reference(x_r)
    assert torch.equal(counts_g, counts_r)
    assert torch.allclose(out_g.float(), out_r.float(), atol=2e-2, rtol=2e-2)
    out_g.float().square().sum().backward()
    out_r.float().square().sum().backward()
    assert torch.allclose(x_g.grad.float(), x_r.grad.float(), atol=5e-2, rtol=5e-2)
    for (name, pg), pr in zip(grouped.named_parameters(), reference.parameters()):
        assert torch.allclose(pg.grad.float(), pr.grad.float(), atol=5e-2, rtol=5e-2), name


def test_train_py_on_the_gpu_compiled_flex_bf16_then_export(tmp_path):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("\n\n".join(f"document {i}: " + "the cat sat on the mat. " * 40
                                                        for i in range(400)))
    data, out = tmp_path / "bytes", tmp_path / "run"
    # A .txt file, not a folder: read without datasets, which the lent GPU machine lacks.
    subprocess.run([sys.executable, "prepare_data.py", "text", "--out", str(data), "--source",
                    f"en={tmp_path / 'txt' / 'a.txt'}", "--tokenizer", "bytes"], cwd=root, check=True,
                   capture_output=True)
    run = subprocess.run([sys.executable, "train.py", "--model_size=tiny", f"--data_dir={data}", f"--out_dir={out}",
                          "--seq_len=128", "--global_batch=8", "--batch_size=4", "--max_steps=6", "--warmup_steps=2",
                          "--eval_interval=3", "--ckpt_interval=3", "--eval_batches=1", "--compile=True",
                          "--model={'doc_mask': True, 'eot_id': 256, 'max_seq_len': 128}"],
                         cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "mfu" in run.stdout and "saved" in run.stdout
    export = subprocess.run([sys.executable, "train.py", "export", str(out / "ckpt_00000006"), str(tmp_path / "m.pt")],
                            cwd=root, capture_output=True, text=True)
    assert export.returncode == 0, export.stderr[-3000:]
    blob = torch.load(tmp_path / "m.pt", weights_only=False)
    assert blob["model_config"]["attn_backend"] == "flex"
    assert all(v.dtype == torch.float32 for v in blob["model"].values() if v.is_floating_point())
