"""
The smallinit model: a pre-norm decoder (dense or MoE) built to test small initialization.

- RMSNorm (or LayerNorm) in fp32, eps 1e-12: under γ=1 the residual stream starts at RMS d^-1
  (mean square ≈2e-7 at d=2048), which eps=1e-5 would dominate (output RMS ≈0.15, not 1).
- RoPE, GQA, SwiGLU (default) or GELU MLP, untied embeddings by default.
- Gated attention: each head's output is multiplied by sigmoid(X W_g), X being the same normed
  input that feeds q/k/v, before the heads are merged and projected. The gate is query-dependent
  and lets a head output ~nothing without parking its probability mass on a sink token.
- Attention backends that share ONE mask definition: flex (FlexAttention, block mask built once
  per batch), sdpa (dense mask from the same mask_mod: the CPU training path, since Flex has no
  CPU backward), eager (explicit softmax; its probabilities can be captured for analysis) and
  varlen (flash-attention's varlen kernel on the packed documents; CUDA, bf16/fp16 only).
- MoE: token-choice top-k, dropless, stacked (E, d_in, d_out) experts on torch._grouped_mm (or a
  reference loop), balanced by an aux-loss-free selection bias and/or an auxiliary loss.
- The loss is chunked (loss.py), compiled by train.compile_model_; decoding: generate.py; γ-init: init.py.
"""

import functools
import importlib
import inspect
import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from loss import chunked_cross_entropy

MLP_KINDS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
ATTN_GATES = ("elementwise", "headwise", "none")
ATTN_BACKENDS = ("flex", "sdpa", "eager", "varlen")
ROUTER_SCORES = ("softmax", "sigmoid")
MOE_IMPLS = ("grouped", "reference")


@dataclass
class GPTConfig:
    vocab_size: int = 257           # byte-level tokenizer: 256 bytes + end-of-text
    n_layer: int = 2
    n_head: int = 2
    n_kv_head: int = 0              # 0 -> n_head (multi-head); fewer -> grouped-query attention
    d_model: int = 64
    d_ff: int = 0                   # 0 -> 4*d (gelu) or 8/3*d rounded up (swiglu): same params either way
    ff_multiple_of: int = 64
    mlp: str = "swiglu"
    norm: str = "rmsnorm"           # or "layernorm" (mean-centred, with a bias); same eps rule
    norm_eps: float = 1e-12
    attn_gate: str = "elementwise"
    attn_backend: str = "sdpa"      # one of ATTN_BACKENDS; varlen: CUDA and bf16/fp16 activations only
    doc_mask: bool = False          # document-causal attention; documents end at eot_id
    eot_id: int = -1
    rope_theta: float = 10000.0
    max_seq_len: int = 1024
    tie_embeddings: bool = False
    n_experts: int = 0              # 0 -> dense MLP; >0 -> an MoE MLP in every block
    top_k: int = 2
    d_expert: int = 0               # 0 -> d_ff
    router_score: str = "softmax"
    moe_impl: str = "grouped"
    moe_aux_loss_coef: float = 0.0
    moe_bias_rate: float = 1e-3     # step of the aux-loss-free selection bias; 0 disables it
    activation_checkpointing: bool = False

    def __post_init__(self):
        resolve_config(self)  # below config_for: fills the 0 defaults, raises ValueError on bad values

    # Zero-valued fields (n_kv_head, d_ff, d_expert) are resolved on construction: make a new config
    # with GPTConfig(...)/config_for(...), not dataclasses.replace (it carries resolved values over).

    @property
    def head_dim(self):
        return self.d_model // self.n_head


# Named sizes: the paper's dense scales in total parameters with cl100k_base (100,277 tokens padded to
# 784*128): Chinese and English at half o200k's embedding cost, which at 0.1B is ~3/4 of the parameters.
# "tiny"/"small" are byte-level CPU sizes.
CL100K_VOCAB = 100352
SIZES = {
    "tiny": dict(n_layer=2, n_head=2, d_model=64),
    "small": dict(n_layer=4, n_head=4, d_model=128),
    "0.1b": dict(vocab_size=CL100K_VOCAB, n_layer=12, n_head=6, d_model=384),
    "0.3b": dict(vocab_size=CL100K_VOCAB, n_layer=18, n_head=12, d_model=768),
    "0.5b": dict(vocab_size=CL100K_VOCAB, n_layer=22, n_head=16, d_model=1024),
    "1b": dict(vocab_size=CL100K_VOCAB, n_layer=24, n_head=12, d_model=1536),
    "1.5b": dict(vocab_size=CL100K_VOCAB, n_layer=20, n_head=16, d_model=2048),
    "moe-0.5b": dict(vocab_size=CL100K_VOCAB, n_layer=12, n_head=12, d_model=768,
                     n_experts=8, top_k=2, d_expert=1536),
    "moe-1.5b": dict(vocab_size=CL100K_VOCAB, n_layer=16, n_head=16, d_model=1024,
                     n_experts=16, top_k=2, d_expert=1536),
}


def config_for(size, **overrides):
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}: choose one of {', '.join(SIZES)}")
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown GPTConfig field(s) {unknown}")
    return GPTConfig(**{**SIZES[size], **overrides})


def resolve_config(cfg):
    """GPTConfig's checks, run on construction: every field has its declared type and an allowed
    value (a ValueError naming the fix otherwise), and the zero defaults n_kv_head, d_ff and
    d_expert are resolved (in this order: d_expert defaults to the resolved d_ff)."""
    for f in fields(cfg):
        value, want = getattr(cfg, f.name), {float: (int, float)}.get(f.type, f.type)
        if not isinstance(value, want) or (f.type is not bool and isinstance(value, bool)):
            raise ValueError(f"GPTConfig.{f.name}={value!r}: expected {f.type.__name__}")
    for name, value, allowed in (("mlp", cfg.mlp, MLP_KINDS), ("attn_gate", cfg.attn_gate, ATTN_GATES),
                                 ("attn_backend", cfg.attn_backend, ATTN_BACKENDS),
                                 ("router_score", cfg.router_score, ROUTER_SCORES),
                                 ("moe_impl", cfg.moe_impl, MOE_IMPLS), ("norm", cfg.norm, NORMS)):
        if value not in allowed:
            raise ValueError(f"GPTConfig.{name}={value!r}: choose one of {', '.join(allowed)}")
    for name in ("vocab_size", "n_layer", "n_head", "d_model", "max_seq_len"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"GPTConfig.{name}={getattr(cfg, name)}: must be >= 1")
    if cfg.n_kv_head == 0:
        cfg.n_kv_head = cfg.n_head
    if cfg.d_model % cfg.n_head:
        raise ValueError(f"d_model={cfg.d_model} is not divisible by n_head={cfg.n_head}: pick n_head "
                         f"so that head_dim = d_model / n_head is a whole number")
    if not 0 < cfg.n_kv_head <= cfg.n_head or cfg.n_head % cfg.n_kv_head:
        raise ValueError(f"n_head={cfg.n_head} is not divisible by n_kv_head={cfg.n_kv_head}: GQA shares "
                         f"each key/value head among n_head / n_kv_head query heads")
    if cfg.head_dim % 2:
        raise ValueError(f"head_dim={cfg.head_dim} must be even for RoPE: change d_model or n_head")
    if not cfg.norm_eps > 0:
        raise ValueError(f"norm_eps={cfg.norm_eps}: must be > 0 (use 1e-12 for small init)")
    if cfg.d_ff == 0:
        cfg.d_ff = 4 * cfg.d_model if cfg.mlp == "gelu" else \
            cfg.ff_multiple_of * math.ceil(8 * cfg.d_model / 3 / cfg.ff_multiple_of)
    if cfg.n_experts and not 1 <= cfg.top_k <= cfg.n_experts:
        raise ValueError(f"top_k={cfg.top_k} must be between 1 and n_experts={cfg.n_experts}")
    if cfg.d_expert == 0:
        cfg.d_expert = cfg.d_ff
    if cfg.n_experts and cfg.moe_impl == "grouped" and (cfg.d_model % 8 or cfg.d_expert % 8):
        # Grouped GEMM kernels (CUDA and CPU) need 16-byte-aligned row strides: 8 bf16 values.
        raise ValueError(f"moe_impl='grouped' needs d_model ({cfg.d_model}) and d_expert ({cfg.d_expert}) "
                         f"divisible by 8; change them or use moe_impl='reference'")
    if cfg.doc_mask and not 0 <= cfg.eot_id < cfg.vocab_size:
        raise ValueError(f"doc_mask=True needs eot_id in [0, vocab_size={cfg.vocab_size}), got {cfg.eot_id}")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # fp32: at RMS 1e-3 the mean square is 1e-6, and bf16's 8-bit mantissa plus a tiny eps
        # would make the rsqrt noisy exactly where small init lives.
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)


class LayerNorm(nn.Module):
    """LayerNorm under RMSNorm's rules: fp32 statistics and an explicit eps. Centring does not
    change the small-init problem: the variance of a d^-γ stream is as tiny as its mean square."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps).type_as(x)


def make_norm(cfg):
    return (RMSNorm if cfg.norm == "rmsnorm" else LayerNorm)(cfg.d_model, cfg.norm_eps)


def rope_cos_sin(start, seq_len, head_dim, theta, device):
    """cos/sin of the rotation angles of positions start..start+seq_len-1, (seq_len, head_dim/2), fp32:
    made once by GPT.forward and passed to every block, not a buffer (meta builds, bf16 casts) nor made
    inside a block (results/README.md "Notes on the hot paths": ~7% of a compiled CPU step)."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    positions = torch.arange(start, start + seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    # Rotates the pairs (i, i + head_dim/2) of x (B, T, H, head_dim) as x * [cos, cos] + [x2, x1] * [-sin, sin],
    # bitwise [x1 cos - x2 sin, x1 sin + x2 cos] (results/README.md "Notes on the hot paths": why this form).
    xf = x.float()
    swapped = xf.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    cos, signed_sin = torch.cat([cos, cos], dim=-1)[:, None], torch.cat([-sin, sin], dim=-1)[:, None]
    return (xf * cos + swapped * signed_sin).type_as(x)


# ---------------------------------------------------------------------------------------------
# Masks: one definition (a mask_mod), rendered as a BlockMask for flex or a dense bool mask
# for sdpa/eager, so the backends cannot disagree about who attends to whom.

def attention_mask_mod(offset=0, q_doc=None, kv_doc=None):
    """The one attention rule. A query sees keys at or before its own position (offset: cached
    positions before the first query) and, given document ids, only keys of its own document."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    def document_causal(b, h, q_idx, kv_idx):
        return causal(b, h, q_idx, kv_idx) & (q_doc[b, q_idx] == kv_doc[b, kv_idx])

    return causal if q_doc is None else document_causal


def document_ids(idx, eot_id):
    # The end-of-text token closes its document, so a token's document is the number of
    # end-of-text tokens strictly before it.
    is_eot = (idx == eot_id).int()
    return torch.cumsum(is_eot, dim=1) - is_eot


def compiled(fn, x):
    # On CUDA flex_attention and create_block_mask must run compiled (eager, they materialise the
    # B x H x T x T scores); inside a compiled block dynamo traces fn itself.
    return compile_once(fn) if x.is_cuda and not torch.compiler.is_compiling() else fn


@functools.cache
def compile_once(fn, **options):  # wrapped on first use, so importing model.py stays cheap
    return torch.compile(fn, **options)


class VarlenMask(NamedTuple):
    """The varlen backend's form of the mask: the packed B*T tokens cut into sequences at
    cu_seqlens (int32, rising from 0 to B*T), each attended causally within itself only, none
    longer than max_len."""
    cu_seqlens: torch.Tensor
    max_len: int


def varlen_boundaries(idx, eot_id=None):
    """cu_seqlens for idx (B, T) packed row after row: every row start b*T, given eot_id every
    position after an end-of-text token inside a row (the documents of document_ids: a row that
    starts mid-document starts a sequence, an end-of-text token closes its own), then B*T.
    With documents the sequences are padded to a power-of-two count with empty ones."""
    B, T = idx.shape
    starts = torch.zeros(B, T, dtype=torch.bool, device=idx.device)
    starts[:, 0] = True
    if eot_id is None:
        slots = B
    else:
        starts[:, 1:] = idx[:, :-1] == eot_id
        # A power-of-two count of sequences (empty ones, which the kernels skip, repeat B*T) bounds
        # the recompiles over cu_seqlens' length (results/README.md "Notes on the hot paths").
        count = int(starts.sum())
        slots = min(1 << (count - 1).bit_length(), B * T)
    # size > count: at least one fill value, so the last entry is B*T.
    return torch.nonzero_static(starts.flatten(), size=slots + 1, fill_value=B * T).flatten().int()


# torch.nn.attention.varlen.varlen_attn, imported on first use (load_varlen): the import loads
# torch._dynamo (~3 s), which importing model.py otherwise avoids.
varlen_attn = None


def load_varlen(cfg, device):
    """Make varlen_attn ready for this model on this device, or raise ValueError in one line."""
    global varlen_attn
    if varlen_attn is None:
        try:
            varlen_attn = importlib.import_module("torch.nn.attention.varlen").varlen_attn
        except (ImportError, AttributeError):
            pass
    # window_size=(-1, 0) is the causal mask. Both keywords are missing from some torch
    # releases, so the signature is checked; enable_gqa is needed by a GQA model only.
    need = {"window_size"} | ({"enable_gqa"} if cfg.n_kv_head != cfg.n_head else set())
    missing = need - (set(inspect.signature(varlen_attn).parameters) if varlen_attn else set())
    if missing:
        raise ValueError(f"attn_backend='varlen' needs torch.nn.attention.varlen.varlen_attn with "
                         f"{', '.join(sorted(need))}, which torch {torch.__version__} lacks: upgrade torch "
                         f"or use attn_backend='flex'")
    if device.type != "cuda":
        raise ValueError(f"attn_backend='varlen' runs flash-attention kernels, CUDA only, not {device.type}: "
                         f"use attn_backend='sdpa' here")


def varlen_attention(q, k, v, mask):
    """Causal attention within each sequence of a VarlenMask by the flash-attention varlen kernel.
    q (B, n_head, T, hd), k and v (B, n_kv_head, T, hd) as Attention.forward holds them; they go
    in as (B*T, heads, hd), views of the projection's (B, T, heads, hd) layout."""
    B, H, T, _ = q.shape
    if q.is_cuda and q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attn_backend='varlen' needs bf16 or fp16 activations, got {q.dtype}: train in bf16 "
                         f"(train.py does on CUDA) or use attn_backend='flex'")
    q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (q, k, v))
    gqa = {"enable_gqa": True} if k.shape[1] != H else {}
    cu, n = mask.cu_seqlens, mask.max_len
    y = varlen_attn(q, k, v, cu, cu, n, n, window_size=(-1, 0), **gqa)
    return y.unflatten(0, (B, T)).transpose(1, 2)


def build_attention_mask(idx, cfg, backend, kv_cache=None):
    """A BlockMask (flex), a VarlenMask (varlen), a dense bool mask (B|1, 1, T, T_kv) (sdpa/eager,
    and any backend while decoding), or None for sdpa's own causal kernel. With a KVCache the
    queries continue the cached sequence (dense only); with document masking the cache must
    already hold idx's document ids (KVCache.add_documents)."""
    B, T = idx.shape
    if backend == "varlen" and kv_cache is None:
        load_varlen(cfg, idx.device)
        return VarlenMask(varlen_boundaries(idx, cfg.eot_id if cfg.doc_mask else None), T)
    start = 0 if kv_cache is None else kv_cache.length
    if cfg.doc_mask:
        if kv_cache is None:
            q_doc = kv_doc = document_ids(idx, cfg.eot_id)
        else:
            q_doc, kv_doc = kv_cache.doc[:, start:start + T], kv_cache.doc[:, :start + T]
        mask_mod, batch = attention_mask_mod(start, q_doc, kv_doc), B
    else:
        mask_mod, batch = attention_mask_mod(start), None
    if backend == "flex" and kv_cache is None:
        # Built once per batch and shared by every layer.
        build = compiled(create_block_mask, idx)
        return build(mask_mod, batch, None, T, T, device=idx.device)
    if backend in ("sdpa", "varlen") and batch is None and start == 0:
        # Plain causal: SDPA's is_causal path can use the flash kernel; a dense mask cannot.
        return None
    # Dense: mask_mod on broadcast indices (create_mask's vmap would import torch._dynamo, ~1 s per eval process)
    b, h, q, kv = (torch.arange(n, device=idx.device) for n in (batch or 1, 1, T, start + T))
    return mask_mod(b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), q.view(1, 1, -1, 1), kv.view(1, 1, 1, -1))


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        # The model's config, shared by every layer: set_attn_backend changes them all at once.
        self.cfg = cfg
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        d, hd = cfg.d_model, cfg.head_dim
        self.wq = nn.Linear(d, cfg.n_head * hd, bias=False)
        self.wk = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
        self.wv = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
        # The output gate: one sigmoid per head and channel (elementwise) or per head (headwise).
        gate_width = {"elementwise": hd, "headwise": 1, "none": 0}[cfg.attn_gate]
        self.wg = nn.Linear(d, cfg.n_head * gate_width, bias=False) if gate_width else None
        self.wo = nn.Linear(cfg.n_head * hd, d, bias=False)
        # Identity tap: a forward hook on it sees the eager backend's attention probabilities.
        self.probs_tap = nn.Identity()

    # A class attribute, so that a subclass can swap the form (bench.py times the textbook one).
    rope = staticmethod(apply_rope)

    def project(self, x):
        """q, k, v as (B, T, heads, head_dim) and the gate's logits (B, T, n_head, 1 or head_dim), None
        without a gate: one GEMM per matrix. Concatenated into one GEMM at run time (bench.py's
        fused-gemms variant), a compiled CPU step was slower, not faster (results/README.md, "Speed")."""
        B, T, _ = x.shape
        q, k, v = (m(x).view(B, T, -1, self.head_dim) for m in (self.wq, self.wk, self.wv))
        return q, k, v, None if self.wg is None else self.wg(x).view(B, T, self.n_head, -1)

    def forward(self, x, mask, kv=None, rope=None):
        """mask: from build_attention_mask. kv: (k_cache, v_cache, start) while decoding: this
        call's keys/values are written at positions start.., and attention reads all cached so far.
        rope: rope_cos_sin of these positions (GPT.forward's), else computed here."""
        B, T, _ = x.shape
        start = 0 if kv is None else kv[2]
        q, k, v, gate = self.project(x)
        cos, sin = rope if rope is not None else rope_cos_sin(start, T, self.head_dim, self.rope_theta, x.device)
        q, k, v = self.rope(q, cos, sin).transpose(1, 2), self.rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)
        if kv is not None:
            k_cache, v_cache, _ = kv
            k_cache[:, :, start:start + T], v_cache[:, :, start:start + T] = k, v
            k, v = k_cache[:, :, :start + T], v_cache[:, :, :start + T]
        gqa = self.n_kv_head != self.n_head
        if isinstance(mask, BlockMask):
            y = compiled(flex_attention, q)(q, k, v, block_mask=mask, enable_gqa=gqa)
        elif isinstance(mask, VarlenMask):
            y = varlen_attention(q, k, v, mask)
        elif self.cfg.attn_backend != "eager":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        else:
            y = self.eager_attention(q, k, v, mask)
        if gate is not None:
            # A headwise gate (width 1) broadcasts over its head's channels.
            y = (y.float() * torch.sigmoid(gate.float()).transpose(1, 2)).type_as(y)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))

    def eager_attention(self, q, k, v, mask):
        if mask is None:  # a Block called directly, outside GPT.forward: plain causal
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        repeat = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(self.head_dim)
        probs = self.probs_tap(scores.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        return probs.type_as(v) @ v


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False) if cfg.mlp == "swiglu" else None
        self.w_up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        if self.w_gate is not None:  # SwiGLU
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        return self.w_down(F.gelu(self.w_up(x)))


# Each expert's rows are padded (zeros, never gathered back) to a multiple of this: the grouped GEMMs'
# 16-byte TMA tiles need groups of 8 rows in bf16, 16 in fp8 (the weight gradient contracts over rows).
GROUP_ALIGN = 16


class MoE(nn.Module):
    # Experts are (E, d_in, d_out): the per-expert fan-in is dimension 1, never the expert count.
    gamma_fan_in_dims = {"w_gate": 1, "w_up": 1, "w_down": 1}

    def __init__(self, cfg):
        super().__init__()
        self.impl, self.score = cfg.moe_impl, cfg.router_score
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        E, d, f = cfg.n_experts, cfg.d_model, cfg.d_expert
        self.router = nn.Linear(d, E, bias=False)
        self.w_gate = nn.Parameter(torch.empty(E, d, f)) if cfg.mlp == "swiglu" else None
        self.w_up = nn.Parameter(torch.empty(E, d, f))
        self.w_down = nn.Parameter(torch.empty(E, f, d))
        # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores only to
        # choose experts, never to weigh them. Persistent: it is training state.
        # Keep it fp32 (FSDP2 mixed precision leaves buffers alone): steps of 1e-3 vanish in bf16.
        self.register_buffer("expert_bias", torch.zeros(E))
        # int64: exact at any count (fp32 stops counting at 2^24), and .to(bf16) leaves it alone.
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.long), persistent=False)

    def forward(self, x):
        """Returns (output, aux_loss, tokens routed to each expert)."""
        B, T, d = x.shape
        xf = x.reshape(-1, d)
        # Router in fp32 end to end: under bf16 mixed precision the logits' rounding would
        # otherwise decide near-tied expert choices.
        scores = F.linear(xf.float(), self.router.weight.float())
        scores = scores.softmax(dim=-1) if self.score == "softmax" else torch.sigmoid(scores)
        expert_idx = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, expert_idx)
        if self.top_k > 1:
            # Renormalised over the chosen experts. Not for top-1: s/s = 1 would leave the
            # router without a gradient from the loss.
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_expert = expert_idx.flatten()
        # scatter_add, not bincount: a fixed output shape keeps torch.compile graphs whole.
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat_expert, torch.ones_like(flat_expert))
        # Switch/GShard balance loss E * sum_e f_e * P_e: f = share of routed slots, P = mean
        # (normalised) score. Its minimum, 1, is uniform routing.
        probs = scores / scores.sum(dim=-1, keepdim=True)
        aux = self.n_experts * (counts.float() / flat_expert.numel() * probs.mean(dim=0)).sum()
        if self.impl == "grouped":
            out = self.grouped_experts(xf, expert_idx, weights, counts)
        else:
            out = self.reference_experts(xf, expert_idx, weights)
        return out.view(B, T, d).type_as(x), aux, counts

    def grouped_experts(self, xf, expert_idx, weights, counts):
        N, k = expert_idx.shape
        flat_expert = expert_idx.flatten()
        order = torch.argsort(flat_expert, stable=True)
        sorted_expert = flat_expert[order]
        token_of_slot = order // k
        padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
        padded_end = torch.cumsum(padded, 0)
        rank_in_group = torch.arange(N * k, device=xf.device) - (torch.cumsum(counts, 0) - counts)[sorted_expert]
        row = (padded_end - padded)[sorted_expert] + rank_in_group
        # Upper bound on the padded size keeps the buffer's shape static.
        xs = xf.new_zeros(N * k + self.n_experts * (GROUP_ALIGN - 1), xf.shape[1])
        xs[row] = xf[token_of_slot]
        offsets = padded_end.to(torch.int32)
        ys = self.expert_mlp(xs, lambda t, w: torch._grouped_mm(t, w, offs=offsets))
        # Back to (token, slot) order and a weighted sum over the k slots in fp32: deterministic,
        # unlike index_add_ (atomics on CUDA), and the routing weights are never rounded to bf16.
        y_slot = torch.empty_like(ys[:N * k])
        y_slot[order] = ys[row]
        return (y_slot.view(N, k, -1).float() * weights[..., None]).sum(dim=1)

    def reference_experts(self, xf, expert_idx, weights):
        out = torch.zeros(xf.shape, dtype=torch.float32, device=xf.device)
        for e in range(self.n_experts):
            token, slot = torch.where(expert_idx == e)
            y = self.expert_mlp(xf[token], lambda t, w: t @ w[e])
            out.index_add_(0, token, y.float() * weights[token, slot, None])
        return out

    def expert_mlp(self, x, matmul):
        """MLP.forward on the stacked expert weights: matmul(t, w) multiplies t by the right
        expert's slice of w (grouped: every group at once; reference: expert e)."""
        if self.w_gate is not None:  # SwiGLU
            return matmul(F.silu(matmul(x, self.w_gate)) * matmul(x, self.w_up), self.w_down)
        return matmul(F.gelu(matmul(x, self.w_up)), self.w_down)

    @torch.no_grad()
    def update_bias(self, counts, rate):
        # Sign update: overloaded experts become less likely to be chosen, underloaded more,
        # by a fixed step, independent of the loss.
        counts = counts.float()
        self.expert_bias += rate * torch.sign(counts.mean() - counts)
        self.tokens_per_expert.zero_()


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x, mask, kv=None, rope=None):
        """Always (x, moe_stats): moe_stats is the MoE layer's (aux_loss, counts), None for a dense MLP."""
        x = x + self.attn(self.attn_norm(x), mask, kv, rope)
        if isinstance(self.mlp, MoE):
            out, aux, counts = self.mlp(self.mlp_norm(x))
            return x + out, (aux, counts)
        return x + self.mlp(self.mlp_norm(x)), None


class GPT(nn.Module):
    # The summed training loss, loss_fn(h (N, d), lm_head weight, targets (N,)): None is
    # chunked_cross_entropy (looked up when called); train.compile_model_ sets a compiled form on one
    # model's instance, leaving the class and every other model eager.
    loss_fn = None

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.aux_loss = None

    def forward(self, idx, targets=None, kv_cache=None):
        """idx, targets: (B, T) int64; targets == -1 are ignored. Returns (logits, None) without
        targets, (None, loss) with them (see chunked_cross_entropy). With a KVCache, idx
        continues the cached sequence (generate.py)."""
        B, T = idx.shape
        start = 0 if kv_cache is None else kv_cache.length
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {start + T} > max_seq_len={self.cfg.max_seq_len}: use shorter "
                             f"sequences or a model config with a larger max_seq_len")
        if kv_cache is not None and self.cfg.doc_mask:
            kv_cache.add_documents(idx, self.cfg.eot_id)  # before the mask, which reads them
        mask = build_attention_mask(idx, self.cfg, self.cfg.attn_backend, kv_cache)
        rope = rope_cos_sin(start, T, self.cfg.head_dim, self.cfg.rope_theta, idx.device)
        x = self.tok_emb(idx)
        aux_total = None
        for i, block in enumerate(self.layers):
            kv = None if kv_cache is None else (kv_cache.k[i], kv_cache.v[i], start)
            if self.cfg.activation_checkpointing and self.training:
                x, moe_stats = checkpoint(block, x, mask, kv, rope, use_reentrant=False)
            else:
                x, moe_stats = block(x, mask, kv, rope)
            if moe_stats is not None:
                aux, counts = moe_stats
                aux_total = aux if aux_total is None else aux_total + aux
                # Counted here, outside the block, so activation-checkpoint recomputation and
                # evaluation forwards don't count tokens twice or at all.
                if self.training:
                    block.mlp.tokens_per_expert += counts.detach()
        if kv_cache is not None:
            kv_cache.length += T
        h = self.norm(x)
        self.aux_loss = None if aux_total is None else aux_total.detach() / self.cfg.n_layer
        # With targets the (B, T, V) logits are never materialised (chunked_cross_entropy), in
        # training and evaluation alike; a caller that wants both calls twice.
        logits = self.lm_head(h) if targets is None else None
        loss = None
        if targets is not None:
            # Sum over counted targets, divided by at least 1: a micro-batch whose targets are all
            # masked (possible with loss masks) contributes 0, not 0/0 = NaN.
            loss_fn = self.loss_fn or chunked_cross_entropy
            total = loss_fn(h.flatten(0, 1), self.lm_head.weight, targets.flatten())
            loss = total / (targets != -1).sum().clamp(min=1)
            if aux_total is not None and self.cfg.moe_aux_loss_coef:
                loss = loss + self.cfg.moe_aux_loss_coef * aux_total / self.cfg.n_layer
        return logits, loss

    def to_empty(self, *, device, recurse=True):
        # A new tensor per module would silently untie a tied lm_head from the embedding: tie them again
        super().to_empty(device=device, recurse=recurse)
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        return self

    def set_attn_backend(self, name):
        if name not in ATTN_BACKENDS:
            raise ValueError(f"attn_backend={name!r}: choose one of {', '.join(ATTN_BACKENDS)}")
        self.cfg.attn_backend = name

    def moe_layers(self):
        return [block.mlp for block in self.layers if isinstance(block.mlp, MoE)]

    @torch.no_grad()
    def update_moe_bias(self, all_reduce=None):
        """Call after each optimizer step: per-(layer, expert) token counts since the last call,
        summed over ranks by all_reduce(tensor) if given, update the selection bias (when
        moe_bias_rate > 0) and are returned for logging. None for a dense model."""
        layers = self.moe_layers()
        if not layers:
            return None
        counts = torch.stack([m.tokens_per_expert for m in layers])
        if all_reduce is not None:
            all_reduce(counts)
        for m, c in zip(layers, counts):
            if self.cfg.moe_bias_rate:
                m.update_bias(c, self.cfg.moe_bias_rate)
            else:
                m.tokens_per_expert.zero_()
        return counts

    @torch.no_grad()
    def reset_buffers(self):
        for m in self.moe_layers():
            m.expert_bias.zero_()
            m.tokens_per_expert.zero_()

    def num_params(self):
        """{"total", "active", "embedding"}; active counts each expert weight top_k/E times."""
        total = sum(p.numel() for p in self.parameters())
        experts = sum(p.numel() for m in self.moe_layers() for n, p in m.named_parameters() if n != "router.weight")
        active = total - experts + experts * self.cfg.top_k // max(self.cfg.n_experts, 1)
        return {"total": total, "active": active, "embedding": self.tok_emb.weight.numel()}

    def flops_per_token(self, seq_len):
        """Training FLOPs per token, PaLM's convention: 6 per active matmul weight (forward +
        backward) plus 12 * n_layer * d_attn * seq_len for the attention scores and their
        weighted sum (counted over the full T x T square, as nanoGPT/PaLM do, not the causal
        half). The input embedding is a lookup and costs nothing; a tied lm_head still does."""
        n = self.num_params()
        matmul = n["active"] - n["embedding"] - sum(p.numel() for p in self.parameters() if p.dim() == 1)
        if self.cfg.tie_embeddings:
            matmul += n["embedding"]
        return 6 * matmul + 12 * self.cfg.n_layer * self.cfg.n_head * self.cfg.head_dim * seq_len
