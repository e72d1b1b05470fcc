"""The CUDA paths that CPU tests cannot reach: compiled FlexAttention forward and backward, bf16
grouped GEMM experts. Skipped (saying so) on machines without a GPU, which includes CI."""
import pytest
import torch

from init import gamma_init_
from model import GPT, GPTConfig, MoE, init_model_

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
    subprocess.run([sys.executable, "prepare_data.py", "text", "--out", str(data), "--source",
                    f"en={tmp_path / 'txt'}", "--tokenizer", "bytes"], cwd=root, check=True, capture_output=True)
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
