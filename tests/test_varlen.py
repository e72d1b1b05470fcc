"""The varlen attention backend on CPU, where its flash kernel cannot run: the packing
(cu_seqlens) plus a reference of varlen_attn's semantics against SDPA with the dense mask of
attention_mask_mod, the one attention rule. The kernel itself is compared in test_cuda.py."""
import sys
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

import model as model_module
import train
from checkpoint import load_model
from conftest import built, tiny
from generate import decode
from model import VarlenMask, attention_mask_mod, document_ids, varlen_attention, varlen_boundaries

EOT = 0


def varlen_reference(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's documented semantics, one packed sequence at a
    time: q (N, n_head, hd), k and v (N, n_kv_head, hd); the rows between two cu_seqlens
    entries attend causally among themselves (window_size=(-1, 0)). It also checks the
    kernel's contract on its inputs."""
    cu = cu_seq_q.tolist()
    assert window_size == (-1, 0) and cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
    assert cu[0] == 0 and cu[-1] == q.shape[0] and all(a <= b for a, b in zip(cu, cu[1:]))
    assert max(b - a for a, b in zip(cu, cu[1:])) <= min(max_q, max_k)
    assert enable_gqa == (k.shape[1] != q.shape[1])
    pieces = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                             enable_gqa=enable_gqa).transpose(0, 1)
              for a, b in zip(cu, cu[1:]) if b > a]
    return torch.cat(pieces)


@pytest.fixture
def cpu_varlen(monkeypatch):
    """The varlen backend on CPU: the reference as the kernel, and the CUDA-only check off."""
    monkeypatch.setattr(model_module, "varlen_attn", varlen_reference)
    monkeypatch.setattr(model_module, "load_varlen", lambda cfg, device: None)


def awkward_batch(T=24):
    """Rows that start mid-document (every row: packing cuts documents), end with an end-of-text
    token, hold none, start with one, or hold two in a row."""
    idx = torch.randint(1, 50, (5, T), generator=torch.Generator().manual_seed(0))
    idx[0, [5, 11]] = EOT
    idx[1, [9, T - 1]] = EOT
    idx[3, [0, 7, 8]] = EOT
    idx[4, [T - 2]] = EOT
    return idx  # row 2: no end-of-text token at all


# --- cu_seqlens -------------------------------------------------------------------------------

BOUNDARIES = [  # (rows, eot_id or None, cu_seqlens written out by hand)
    ([[5, 0, 7, 8, 0, 9], [0, 0, 3, 3, 3, 0]], EOT, [0, 2, 5, 6, 7, 8, 12, 12, 12]),  # 6 sequences -> 8 slots
    ([[5, 0, 7, 8, 0, 9], [0, 0, 3, 3, 3, 0]], None, [0, 6, 12]),  # rows only, no padding
    ([[1, 2, 3, 4]], EOT, [0, 4]),                                # no end-of-text: one sequence
    ([[0, 1, 0, 1, 0, 1, 0, 1]], EOT, [0, 1, 3, 5, 7, 8, 8, 8, 8]),  # 5 -> 8 slots, 3 empty
    ([[0, 0], [0, 0]], EOT, [0, 1, 2, 3, 4]),                     # 4 sequences: a power of two already
    ([[0, 0, 5]], EOT, [0, 1, 2, 3]),                             # 3 -> 4 slots, capped at B*T = 3
]


@pytest.mark.parametrize("rows, eot_id, expected", BOUNDARIES)
def test_boundaries_by_hand(rows, eot_id, expected):
    cu = varlen_boundaries(torch.tensor(rows), eot_id)
    assert cu.dtype == torch.int32 and cu.tolist() == expected


def test_boundaries_are_the_documents_of_document_ids():
    idx = awkward_batch()
    B, T = idx.shape
    cu, doc = varlen_boundaries(idx, EOT).tolist(), document_ids(idx, EOT)
    # Each non-empty sequence is one (row, document) of document_ids, in order, and they tile B*T.
    rows_docs = [(a // T, doc.flatten()[a].item()) for a, b in zip(cu, cu[1:]) if b > a]
    assert rows_docs == [(b, d) for b in range(B) for d in doc[b].unique().tolist()]
    lengths = [b - a for a, b in zip(cu, cu[1:]) if b > a]
    assert lengths == [(doc[b] == d).sum().item() for b, d in rows_docs]
    # Documents by row 3 + 2 + 1 + 4 + 2 = 12, padded to 16 sequences (a power of two).
    assert len(rows_docs) == 12 and len(cu) - 1 == 16


# --- the reference on the packing = the dense mask --------------------------------------------

def dense_attention(q, k, v, idx, doc_mask):
    B, T = idx.shape
    doc = document_ids(idx, EOT) if doc_mask else None
    mask = create_mask(attention_mask_mod(0, doc, doc), B, 1, T, T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


@pytest.mark.parametrize("n_kv_head", [4, 2])
@pytest.mark.parametrize("doc_mask", [True, False])
def test_packing_and_reference_equal_the_dense_mask_forward_and_backward(cpu_varlen, n_kv_head, doc_mask):
    idx = awkward_batch()
    B, T = idx.shape
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(B, h, T, 8, generator=g, dtype=torch.float64, requires_grad=True)
              for h in (4, n_kv_head, n_kv_head)]
    grad_out = torch.randn(B, 4, T, 8, generator=g, dtype=torch.float64)
    mask = VarlenMask(varlen_boundaries(idx, EOT if doc_mask else None), T)
    outputs = [varlen_attention(*leaves, mask), dense_attention(*leaves, idx, doc_mask)]
    grads = [torch.autograd.grad(y, leaves, grad_out) for y in outputs]
    assert outputs[0].shape == (B, 4, T, 8)
    assert torch.allclose(outputs[0], outputs[1], atol=1e-12)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("kw", [dict(n_kv_head=2), dict(attn_gate="headwise", activation_checkpointing=True)])
def test_model_on_the_varlen_path_equals_sdpa(cpu_varlen, kw):
    # GPT.forward -> build_attention_mask -> Attention.forward's varlen branch, the reference as
    # the kernel: the loss and every gradient equal the dense-mask model's.
    model = built(tiny(doc_mask=True, eot_id=EOT, **kw)).train()
    idx = awkward_batch()
    results = {}
    for backend in ("sdpa", "varlen"):
        model.set_attn_backend(backend)
        model.zero_grad()
        _, loss = model(idx, idx)
        loss.backward()
        results[backend] = loss.detach(), [p.grad.clone() for p in model.parameters()]
    assert torch.allclose(results["varlen"][0], results["sdpa"][0], atol=1e-6)
    for a, b in zip(results["varlen"][1], results["sdpa"][1]):
        assert torch.allclose(a, b, atol=1e-6)


# --- where it cannot run ----------------------------------------------------------------------

def old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
    """torch 2.10's signature: causal by a flag, no window_size."""


def no_gqa_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1)):
    """A signature with window_size but without enable_gqa."""


UNUSABLE = [  # (varlen_attn, importable, config overrides, the error)
    (None, True, {}, r"varlen' runs flash-attention kernels, CUDA only, not cpu: use attn_backend='sdpa'"),
    (None, False, {}, r"needs torch.nn.attention.varlen.varlen_attn with window_size, which torch .* lacks: upgrade"),
    (old_varlen_attn, True, {}, r"with window_size, which torch"),
    (no_gqa_varlen_attn, True, dict(n_kv_head=2), r"with enable_gqa, window_size, which torch"),
]


@pytest.mark.parametrize("kernel, importable, kw, error", UNUSABLE)
def test_unusable_varlen_is_one_line_naming_the_fix(monkeypatch, kernel, importable, kw, error):
    monkeypatch.setattr(model_module, "varlen_attn", kernel)
    if not importable:
        monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # import raises ImportError
    model = built(tiny(doc_mask=True, eot_id=EOT, attn_backend="varlen", **kw))
    with pytest.raises(ValueError, match=error) as e:
        model(awkward_batch())
    assert "\n" not in str(e.value)


def test_train_refuses_varlen_without_cuda():
    cfg = {**train.DEFAULTS, "attn_backend": "varlen"}
    with pytest.raises(ValueError, match="attn_backend='varlen' runs flash-attention kernels, CUDA only, not cpu"):
        train.model_config(cfg, "cpu")
    assert train.model_config(cfg, "cuda").attn_backend == "varlen"


def test_decoding_with_a_cache_takes_the_dense_path():
    # On CPU the varlen kernel cannot run, so generation working at all shows the KV-cache
    # forwards never reach it; their tokens are the sdpa model's.
    model = built(tiny(doc_mask=True, eot_id=EOT, max_seq_len=40, attn_backend="varlen"))
    idx = torch.randint(1, 50, (3, 7), generator=torch.Generator().manual_seed(2))
    idx[0, 3] = idx[1, 6] = EOT
    new = decode(model, idx, 12)
    model.set_attn_backend("sdpa")
    assert new == decode(model, idx, 12)


def test_a_loaded_varlen_model_runs_on_sdpa(tmp_path):
    # load_model gives an fp32 model, which the bf16/fp16 varlen kernel cannot run (on CPU, no
    # varlen kernel at all): it switches to sdpa, and computes what the saved model did.
    model = built(tiny(doc_mask=True, eot_id=EOT, attn_backend="varlen"))
    torch.save({"model": model.state_dict(), "model_config": asdict(model.cfg)}, tmp_path / "m.pt")
    loaded, _ = load_model(str(tmp_path / "m.pt"))
    assert loaded.cfg.attn_backend == "sdpa"
    model.set_attn_backend("sdpa")
    with torch.no_grad():
        assert torch.equal(loaded(awkward_batch())[0], model(awkward_batch())[0])
