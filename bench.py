"""
Training throughput of model variants, measured in one run: a full step (forward, backward,
AdamW step) of each variant, after warm-up, interleaved round-robin over several repeats.

    python bench.py                                   # the CPU suite (~5M parameters)
    python bench.py --variants reference,default,gate-none --repeats 3
    python bench.py --suite cuda --json-out bench_h100.json   # 0.1B and 1.5B on one GPU
    python bench.py --suite cuda --dry-run            # its plan and estimated time, on any machine

Per variant: tokens/s (median over repeats, min-max), ms/step, MFU and the ratio to the first
selected variant of its group (a plain GPT of the same size, written below as the yardstick) as
the ratio of medians and as the paired ratio (the median over repeats of the ratio within each
repeat, which drift between repeats does not move), plus the first step's time apart (it
includes torch.compile). MFU is against the GPU's datasheet peak (mfu.py; none on a CPU); beside
it, the share of the matmul rate measured in the same run, which on a CPU says how much of what
this CPU's matmuls reach now the model uses. Variants are interleaved so that drift (clock,
thermal, a neighbour's load) spreads over all of them instead of biasing the ones timed last.
A variant that fails (to build, compile or step: a missing kernel, out of memory) is a row with
its error and the others go on; --json-out is rewritten after each group, so a run cut short
keeps the groups it finished.
"""

import interrupt

if __name__ == "__main__":  # first: the imports below take seconds
    interrupt.while_starting("bench.py: interrupted while starting, before anything was measured")

import argparse
import fnmatch
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from init import gamma_init_
from init import init_model_
from loss import chunked_cross_entropy
from model import GPT, MLP, SIZES, Attention, GPTConfig
from fileio import atomic_write_bytes, check_outputs
from optim import build_optimizer
from mfu import datasheet_peak, matmul_rate, synchronize
from report import cpu_name
import train


# ----------------------------------------------------------------------------- the yardstick

class PlainBlock(nn.Module):
    """nanoGPT's block: LayerNorm, one fused q/k/v matrix, SDPA's causal kernel, GELU MLP."""

    def __init__(self, d_model, n_head, d_ff):
        super().__init__()
        self.n_head = n_head
        self.ln_attn = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).view(B, T, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, d))
        return x + self.down(F.gelu(self.up(self.ln_mlp(x))))


class PlainGPT(nn.Module):
    """GPT-2 without the parts smallinit changes: learned positions, LayerNorm, GELU."""

    loss_fn = None  # as in model.GPT: train.compile_model_ gives it the same compiled loss tail

    def __init__(self, vocab_size, n_layer, n_head, d_model, d_ff, seq_len):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.layers = nn.ModuleList(PlainBlock(d_model, n_head, d_ff) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.n_layer, self.d_model = n_layer, d_model

    def forward(self, idx, targets=None):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.layers:
            x = block(x)
        h = self.norm(x)
        if targets is None:
            return self.lm_head(h), None
        # GPT.forward's loss tail (chunked, no logits; compiled with the model), so that the
        # ratio to this yardstick measures the recipe and not the loss.
        loss_fn = self.loss_fn or chunked_cross_entropy
        loss = loss_fn(h.flatten(0, 1), self.lm_head.weight, targets.flatten())
        return None, loss / (targets != -1).sum().clamp(min=1)

    def num_params(self):
        n = sum(p.numel() for p in self.parameters())
        return {"total": n, "active": n}

    def flops_per_token(self, seq_len):
        # GPT.flops_per_token's convention: 6 per matmul weight (the lookups cost nothing)
        # plus 12 * n_layer * d * T for the attention scores and their weighted sum.
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul + 12 * self.n_layer * self.d_model * seq_len


def plain_d_ff(cfg, seq_len):
    """The plain GPT's MLP width that gives it the parameter count of GPT(cfg), rounded to a
    multiple of 64 (a matmul-friendly width): per block 4d² attention + 4d LayerNorm + 2·d·d_ff
    MLP, plus two embeddings, learned positions, a final LayerNorm and the lm_head."""
    with torch.device("meta"):
        target = GPT(cfg).num_params()["total"]
    d, L = cfg.d_model, cfg.n_layer
    fixed = 2 * cfg.vocab_size * d + seq_len * d + L * (4 * d * d + 4 * d) + 2 * d
    return max(64, 64 * round((target - fixed) / (2 * d * L) / 64))


# ----------------------------------------------------------------------------- other forms
# Other forms of what model.py computes, with the same parameters and values, so that a variant
# can time one choice at a time: the textbook forms model.py improves on, and forms it measured
# and did not take. Here, not in model.py, which keeps one form of each.

def rope_by_halves(x, cos, sin):
    """model.apply_rope as [x1 cos - x2 sin, x1 sin + x2 cos]: six half-width ops and a cat."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class RopeByHalves(Attention):
    rope = staticmethod(rope_by_halves)


class RopePerBlock(Attention):
    """The angles derived inside each block (rope_cos_sin there), not once by GPT.forward: compiled,
    inductor then recomputes pow/cos/sin per element of q and k in the backward kernel."""

    def forward(self, x, mask, kv=None, rope=None):
        return super().forward(x, mask, kv)


class FusedProjections(Attention):
    """q, k, v and the gate from ONE GEMM over wq, wk, wv and wg concatenated at run time: the
    parameters, init and checkpoints keep the four matrices."""

    def project(self, x):
        B, T, _ = x.shape
        weights = [m.weight for m in (self.wq, self.wk, self.wv, self.wg) if m is not None]
        parts = F.linear(x, torch.cat(weights)).split([w.shape[0] for w in weights], dim=-1)
        # v as its own buffer, not a slice of the fused rows: compiled on CPU, inductor's
        # flex_attention template reads such a strided value wrongly (errors of O(1)).
        q, k, v = (p.view(B, T, -1, self.head_dim) for p in (parts[0], parts[1], parts[2].contiguous()))
        return q, k, v, None if self.wg is None else parts[3].view(B, T, self.n_head, -1)


class FusedGateUp(MLP):
    """SwiGLU's gate and up from one GEMM over the two matrices concatenated at run time."""

    def forward(self, x):
        if self.w_gate is None:
            return super().forward(x)
        gate, up = F.linear(x, torch.cat([self.w_gate.weight, self.w_up.weight])).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


OTHER_FORMS = ("rope-halves", "fused-gemms", "rope-per-block")


def use_other_forms(model, forms):
    """Switch a GPT's blocks to the forms named (of OTHER_FORMS), in place: the same modules and
    parameters, another forward."""
    if set(forms) - set(OTHER_FORMS):
        raise ValueError(f"forms {sorted(set(forms) - set(OTHER_FORMS))}: choose from {', '.join(OTHER_FORMS)}")
    bases = [cls for form, cls in zip(OTHER_FORMS, (RopeByHalves, FusedProjections, RopePerBlock)) if form in forms]
    attention = type("OtherAttention", tuple(bases), {}) if bases else None
    for block in model.layers:
        if attention is not None:
            block.attn.__class__ = attention
        if "fused-gemms" in forms and type(block.mlp) is MLP:
            block.mlp.__class__ = FusedGateUp


def full_loss(model, idx, targets):
    """The loss from the whole (B, T, V) logits by F.cross_entropy in fp32, the unchunked form of
    GPT.forward's loss (dense models: no MoE auxiliary loss)."""
    logits, _ = model(idx)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)


# ----------------------------------------------------------------------------- variants

@dataclass(frozen=True)
class Group:
    """One model size and shape; ratios are to the group's first variant. Groups run one after
    another (all of a group's models are alive at once, so it can be interleaved)."""
    name: str
    config: dict        # GPTConfig fields of the size, e.g. SIZES["0.1b"]
    batch: int
    seq_len: int
    dtype: str          # float32, or bfloat16 (weights, activations and AdamW state)


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, so usable as a dict key
class Variant:
    name: str
    about: str
    group: Group
    model: dict = field(default_factory=dict)   # GPTConfig fields over the group's
    reference: bool = False                     # the plain GPT instead of model.GPT
    forms: tuple = ()                           # OTHER_FORMS its blocks use instead of model.GPT's
    full_loss: bool = False                     # full_loss instead of GPT.forward's chunked loss
    gamma: float = 1.0
    compile: bool = False                       # train.compile_model_, as train.py compiles
    fsdp: bool = False                          # train.build_model's model: FSDP2, fp32 weights
    optimizer: str = "adamw"                    # train.py's optimizer setting, built by optim.build_optimizer

    @property
    def full_name(self):
        return f"{self.group.name}/{self.name}"

    def gpt_config(self):
        return GPTConfig(**{**self.group.config, "max_seq_len": self.group.seq_len, **self.model})


def moe_fields(config):
    # Eight experts, top-2, each half the dense MLP's width: the same active parameters (and
    # FLOPs) per token as the dense model, four times its MLP weights.
    d_ff = GPTConfig(**config).d_ff
    return dict(n_experts=8, top_k=2, d_expert=d_ff // 2)


def plain_gpt(name, about, g, compile):
    # γ=0.5, the plain GPT's usual scale: under γ=1 its LayerNorms' ε=1e-5 would dominate
    # (init.py's ε audit warns); speed is the same either way.
    return Variant(name, about, g, reference=True, gamma=0.5, compile=compile)


def common_variants(g, compile, attn):
    """The variants every group shares: what each feature of model.GPT costs against the plain
    GPT, at the group's compile setting."""
    moe = moe_fields(g.config)
    return [
        plain_gpt("reference", "plain GPT: LayerNorm, GELU, learned positions, fused qkv", g, compile),
        Variant("default", "model.GPT: RMSNorm, RoPE, SwiGLU, elementwise gate, γ=1", g, compile=compile),
        Variant("gate-headwise", "one gate per head (d×n_head matrix)", g, dict(attn_gate="headwise"),
                compile=compile),
        Variant("gate-none", "no attention gate", g, dict(attn_gate="none"), compile=compile),
        Variant("gelu", "GELU MLP instead of SwiGLU (same parameters)", g, dict(mlp="gelu"), compile=compile),
        Variant(f"attn-{attn}", f"{attn} attention backend", g, dict(attn_backend=attn), compile=compile),
        Variant("gamma-0.5", "γ=0.5 init: other weights, the same step", g, gamma=0.5, compile=compile),
        Variant("muon", "optimizer='muon': Muon on the blocks' matrices, AdamW on the rest", g, optimizer="muon",
                compile=compile),
        # Each of model.GPT's forms against another one, one at a time (the same values): what a
        # fast path saves, or what a form not taken would (fused GEMMs, taken on neither device
        # until a GPU run measures them). The RoPE forms only eager: compiled, inductor fuses
        # either into one kernel.
        Variant("rope-halves", "RoPE on the two halves, then cat (eager)", g, forms=("rope-halves",)),
        Variant("fused-gemms", "one GEMM for q, k, v and the gate, one for SwiGLU's gate and up", g,
                forms=("fused-gemms",), compile=compile),
        # Compiled or not, its cross-entropy runs eager, outside the compiled modules: the whole
        # unchunked tail is what it times against the default variant.
        Variant("full-loss", "loss on the full (B, T, V) logits, not chunked", g, full_loss=True, compile=compile),
        # The meta kernel of torch._grouped_mm accepts bf16 only, so fp32 runs it eager.
        Variant("moe-grouped", "MoE 8 experts top-2, torch._grouped_mm", g, moe,
                compile=compile and g.dtype == "bfloat16"),
        # The loop's token counts per expert change every step: compiled with static shapes it
        # would recompile each time, so it runs eager.
        Variant("moe-reference", "MoE 8 experts top-2, loop over experts (eager)", g, {**moe, "moe_impl": "reference"}),
    ]


def cpu_variants():
    # ~5M parameters, 4,096 tokens a step: a model one CPU core trains at a few steps a second.
    g = Group("5m", dict(vocab_size=257, n_layer=6, n_head=4, d_model=256), batch=16, seq_len=256, dtype="float32")
    return common_variants(g, compile=False, attn="eager") + [
        plain_gpt("reference-compiled", "plain GPT, compiled (blocks, norm, loss chunks)", g, compile=True),
        Variant("default-compiled", "model.GPT, compiled (blocks, norm, loss chunks)", g, compile=True),
        Variant("train-step-compiled", "default-compiled as train.py builds it: FSDP2 on one rank", g, compile=True,
                fsdp=True),
        Variant("rope-per-block-compiled", "compiled, RoPE angles derived inside each block", g,
                forms=("rope-per-block",), compile=True),
        Variant("fused-gemms-compiled", "compiled, one GEMM for q, k, v and the gate, one for gate and up", g,
                forms=("fused-gemms",), compile=True),
    ]


def cuda_variants():
    # The configs' per-GPU micro-batches at T=2048, bf16, compiled as train.py compiles, FlexAttention,
    # causal masks (the plain GPT has no document masking). At 1.5B only the two headline
    # variants: each holds ~12 GB of weights and AdamW state next to ~40 GB of activations.
    flex = dict(attn_backend="flex")
    small = Group("0.1b", {**SIZES["0.1b"], **flex}, batch=16, seq_len=2048, dtype="bfloat16")
    large = Group("1.5b", {**SIZES["1.5b"], **flex}, batch=8, seq_len=2048, dtype="bfloat16")
    return common_variants(small, compile=True, attn="sdpa") + [
        # The step train.py takes on one GPU, against default's bf16 weights and AdamW state.
        Variant("train-step", "default as train.py builds it: FSDP2 on one rank, fp32 weights and AdamW, "
                "bf16 compute", small, compile=True, fsdp=True),
        Variant("uncompiled", "model.GPT without torch.compile (flex is still compiled)", small),
        # flash-attention's varlen kernel in place of flex: only the attention kernel differs
        # from uncompiled (flex's is compiled either way), and each is the one compiled blocks
        # run. Eager: another ~30 s compile would not fit the suite in 8 minutes.
        Variant("uncompiled-varlen", "uncompiled, varlen attention backend instead of flex", small,
                dict(attn_backend="varlen")),
        plain_gpt("reference", "plain GPT: LayerNorm, GELU, learned positions, fused qkv", large, compile=True),
        Variant("default", "model.GPT: RMSNorm, RoPE, SwiGLU, elementwise gate, γ=1", large, compile=True),
    ]


@dataclass(frozen=True)
class Suite:
    variants: object    # () -> [Variant]
    device: str
    steps: int          # timed steps per repeat
    repeats: int
    warmup: int         # untimed steps first; the first one (compile) is reported apart
    rate_n: int         # n of the n×n×n matmul whose rate is measured ...
    rate_reps: int      # ... timed over this many matmuls (tens of ms), best of 5
    # For --dry-run's estimate only (assumptions, printed with it):
    assumed_mfu: float
    compile_s: float    # per compiled model structure
    nominal_peak: float  # datasheet peak and rate when the suite's device is not this machine's


SUITES = {
    # One step per sample on CPU: a step is already seconds long.
    "cpu": Suite(cpu_variants, "cpu", steps=1, repeats=5, warmup=2, rate_n=1024, rate_reps=3,
                 assumed_mfu=0.6, compile_s=45.0, nominal_peak=0.0),
    # compile_s: the first steps of the compiled variants took 4.7-13.6 s on an H200 (results/gpu/h200_bench.log).
    "cuda": Suite(cuda_variants, "cuda", steps=10, repeats=5, warmup=3, rate_n=8192, rate_reps=50,
                  assumed_mfu=0.4, compile_s=15.0, nominal_peak=989e12),
}


def select(variants, patterns):
    """Variants matching any comma-separated pattern (fnmatch) on 'group/name' or 'name', in the
    patterns' order (a pattern's matches in suite order), each once: the first one selected of a
    group is its yardstick. A pattern matching nothing is an error listing the names."""
    if not patterns:
        return variants
    chosen = {}
    for pattern in patterns.split(","):
        hits = [v for v in variants
                if fnmatch.fnmatchcase(v.full_name, pattern) or fnmatch.fnmatchcase(v.name, pattern)]
        if not hits:
            raise ValueError(f"--variants: {pattern!r} matches no variant; choose from "
                             f"{', '.join(v.full_name for v in variants)}")
        chosen.update((v.full_name, v) for v in hits if v.full_name not in chosen)
    return list(chosen.values())


def groups_of(variants):
    """[(group, [variants])] in first-appearance order."""
    out = {}
    for v in variants:
        out.setdefault(v.group.name, (v.group, []))[1].append(v)
    return list(out.values())


def schedule(variants, repeats):
    """(repeat, variant) in timing order: within a group every repeat visits each variant once,
    in the same order (round-robin); groups one after another."""
    return [(r, v) for _, members in groups_of(variants) for r in range(repeats) for v in members]


# ----------------------------------------------------------------------------- measuring

def make_model(v):
    """The variant's model, uninitialised (call under torch.device("meta") to only count it)."""
    if v.reference:
        cfg = v.gpt_config()
        return PlainGPT(cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.d_model, plain_d_ff(cfg, v.group.seq_len),
                        v.group.seq_len)
    return GPT(v.gpt_config())


def build(v, device):
    """A variant's model on device in its dtype, γ-initialised, compiled as train.py compiles if asked.
    Built on meta and materialised on the device, as train.py does: the full fp32 model never
    sits in host memory first. An fsdp variant is train.py's own build (in a one-rank process group,
    one_rank): FSDP2 per block and at the root with train.py's mixed precision, so its parameters,
    gradients and AdamW state stay fp32 while blocks compute in bf16 on CUDA."""
    if v.fsdp:
        setting = {"compile": v.compile, "model_size": v.group.name, "model": v.model, "gamma": v.gamma, "seed": 0,
                   "init_overrides": None}
        return train.build_model(setting, v.gpt_config(), device)[0]
    with torch.device("meta"):
        model = make_model(v)
    model.to_empty(device=device)
    if v.reference:
        gamma_init_(model, gamma=v.gamma)
    else:
        init_model_(model, gamma=v.gamma)
        use_other_forms(model, v.forms)
    model.to(dtype=getattr(torch, v.group.dtype))
    if v.compile:
        train.compile_model_(model)
    return model


class Runner:
    """A variant ready to step: its model, optimizer and one fixed random batch."""

    def __init__(self, v, device):
        self.v, self.device = v, device
        self.model = build(v, device)
        self.flops_per_token = self.model.flops_per_token(v.group.seq_len)
        self.params = self.model.num_params()
        self.model.train()
        self.opt = build_optimizer(self.model, {**train.DEFAULTS, "optimizer": v.optimizer}, device)  # train.py's
        gen = torch.Generator().manual_seed(0)
        vocab = self.model.lm_head.out_features
        tokens = torch.randint(vocab, (v.group.batch, v.group.seq_len + 1), generator=gen).to(device)
        self.idx, self.targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step(self):
        if self.v.full_loss:
            loss = full_loss(self.model, self.idx, self.targets)
        else:
            _, loss = self.model(self.idx, self.targets)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if isinstance(self.model, GPT):
            self.model.update_moe_bias()  # part of train.py's step for MoE; None for dense

    def timed(self, steps):
        """Seconds per step over `steps` steps."""
        synchronize(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        synchronize(self.device)
        return (time.perf_counter() - start) / steps


def top_ops(runner, steps, n):
    """[{name, ms, calls}] per step of the n operations and compiled kernels with the most self time over
    `steps` profiled steps (device time on CUDA): what a ratio's gap is made of."""
    from torch.profiler import ProfilerActivity, profile
    cuda = runner.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        for _ in range(steps):
            runner.step()
        synchronize(runner.device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"name": e.key, "ms": getattr(e, key) / 1e3 / steps, "calls": e.count / steps} for e in events]


def measure(variants, device, steps, repeats, warmup, peak, rate, profile=0):
    """Each group's rows (see the module docstring) as it finishes, groups one after another. peak: the
    datasheet FLOP/s MFU is against (0: none), rate: the matmul rate measured now. profile=N: each row
    also lists its N costliest operations (top_ops), profiled after the timed steps."""
    for group, members in groups_of(variants):
        runners, first_step, failed = {}, {}, {}
        for v in members:
            try:
                runners[v] = Runner(v, device)
                first_step[v] = runners[v].timed(1)
                for _ in range(warmup - 1):
                    runners[v].step()
            except Exception as e:  # noqa: BLE001 (the variant's row says what failed; the others go on)
                failed[v] = failure(v, e, runners, device)
                continue
            print(f"  {v.full_name}: first step {first_step[v]:.2f} s")
        samples = {v: [] for v in runners}
        for r, v in schedule(list(runners), repeats):
            if v in runners:
                try:
                    samples[v].append(runners[v].timed(steps))
                except Exception as e:  # noqa: BLE001
                    failed[v] = failure(v, e, runners, device)
        tokens = group.batch * group.seq_len
        rows, yardstick = [], next((v for v in members if v in runners), None)
        for v in members:
            if v in failed:
                rows.append({"variant": v.full_name, "about": v.about, "error": failed[v]})
                continue
            tps = sorted(tokens / s for s in samples[v])
            median = statistics.median(tps)
            # Each repeat times the group's variants one right after another: the ratio within a
            # repeat cancels the machine's drift between repeats, which the ratio of medians keeps.
            paired = statistics.median(s0 / s for s0, s in zip(samples[yardstick], samples[v], strict=True))
            run = runners[v]
            rows.append({
                "variant": v.full_name, "about": v.about, "params": run.params["total"],
                "active_params": run.params["active"], "flops_per_token": run.flops_per_token,
                "batch": group.batch, "seq_len": group.seq_len, "dtype": group.dtype, "compile": v.compile,
                "fsdp": v.fsdp,
                "first_step_s": first_step[v], "tokens_per_s": median, "tokens_per_s_min": tps[0],
                "tokens_per_s_max": tps[-1], "ms_per_step": 1e3 * tokens / median,
                "mfu": run.flops_per_token * median / peak if peak else None,
                "of_matmul_rate": run.flops_per_token * median / rate, "ratio_to": yardstick.full_name,
                "ratio": median / statistics.median(tokens / s for s in samples[yardstick]), "paired_ratio": paired,
                "samples_tokens_per_s": [tokens / s for s in samples[v]],
                **({"profile": top_ops(run, steps, profile)} if profile else {}),
            })
        del runners
        free(device)
        yield rows


def failure(v, error, runners, device):
    """The one line a failed variant's row keeps (the traceback goes to stderr, for the log); its
    model is dropped so that the next variants have the memory."""
    traceback.print_exc()
    line = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"
    print(f"  {v.full_name}: FAILED, {line}", flush=True)
    runners.pop(v, None)
    free(device)
    return line


def free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def format_rows(rows):
    lines = [f"{'variant':<28} {'params':>8} {'tok/s':>9} {'min-max':>17} {'ms/step':>8} {'MFU':>6} {'matmul':>6} "
             f"{'ratio':>6} {'paired':>6} {'1st step s':>10}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:<28} FAILED: {r['error']}")
            continue
        spread = f"{r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f}"
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(f"{r['variant']:<28} {r['params'] / 1e6:>7.1f}M {r['tokens_per_s']:>9,.0f} {spread:>17} "
                     f"{r['ms_per_step']:>8.1f} {mfu:>6} {r['of_matmul_rate']:>6.1%} {r['ratio']:>5.2f}x "
                     f"{r['paired_ratio']:>5.2f}x {r['first_step_s']:>10.2f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- loss memory

def _added_peak(tail, vocab, batch, seq_len, d_model, chunk_elements):
    """Bytes of host memory one forward+backward of a 1-layer GPT adds at its peak (this
    process's peak RSS minus its RSS before the step: call in a fresh process). tail: "full"
    (full_loss: fp32 cross-entropy over the whole logits) or "chunked" (GPT.forward's own loss)."""
    import loss
    loss.LOSS_CHUNK_ELEMENTS = chunk_elements or loss.LOSS_CHUNK_ELEMENTS
    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=vocab, n_layer=1, n_head=1, d_model=d_model, max_seq_len=seq_len)).train()
    idx, targets = torch.randint(vocab, (2, batch, seq_len))
    before = _status_kib("VmRSS")
    loss = full_loss(net, idx, targets) if tail == "full" else net(idx, targets)[1]
    loss.backward()
    return (_status_kib("VmHWM") - before) * 1024


def _status_kib(field):
    # VmHWM (peak RSS) rather than ru_maxrss: the latter survives exec, so a child forked from a
    # large process (a test run) would start at its parent's size.
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def loss_memory(vocab=100352, batch=8, seq_len=512, d_model=64, chunk_elements=0):
    """{"full", "chunked": peak bytes a training step's loss tail adds (_added_peak, each in a
    fresh process on one thread), "fp32_logits": bytes of the fp32 logits}. Linux only (reads
    /proc)."""
    import subprocess
    out = {}
    for tail in ("full", "chunked"):
        code = (f"import bench; print(bench._added_peak({tail!r}, {vocab}, {batch}, {seq_len}, {d_model}, "
                f"{chunk_elements}))")
        # A fixed mmap threshold: glibc would otherwise raise it as blocks are freed and keep
        # later ones of up to 32 MB in its heap, which makes the peak drift by tens of MB.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(__file__)),
                              env=env, capture_output=True, text=True, check=True)
        out[tail] = int(proc.stdout.split()[-1])
    out["fp32_logits"] = 4 * vocab * batch * seq_len
    return out


# ----------------------------------------------------------------------------- plan

# init.py draws every value on the CPU, one generator per parameter: ~20-40 ns a value on this
# repo's CPU, so building the 1.5B models is part of the suite's time.
INIT_S_PER_PARAM = 2e-8


def plan(variants, suite, steps, repeats, warmup, rate):
    """(text, estimated seconds) of a run, without building a model: parameter counts and
    FLOPs from meta-device builds, step time from the FLOPs at the suite's assumed MFU, one
    compilation per compiled model structure (γ changes weights, not the graph) and the init."""
    lines, total, compiled = [], 0.0, set()
    for group, members in groups_of(variants):
        lines.append(f"group {group.name}: batch {group.batch} x seq_len {group.seq_len} = "
                     f"{group.batch * group.seq_len:,} tokens/step, {group.dtype}")
        for v in members:
            with torch.device("meta"):
                model = make_model(v)
            fpt = model.flops_per_token(group.seq_len)
            step_s = fpt * group.batch * group.seq_len / (rate * suite.assumed_mfu)
            # Not v.fsdp: FSDP2's wrapping has dynamo trace the blocks again, but to the graphs of the
            # same variant without it, which inductor's cache then serves (the CPU suite, cache
            # emptied: default-compiled's first step 30.1 s, train-step-compiled's after it 1.0 s).
            structure = (group.name, v.reference, tuple(sorted(v.model.items())), v.forms)
            compile_s = suite.compile_s if v.compile and structure not in compiled else 0.0
            if v.compile:
                compiled.add(structure)
            n = model.num_params()["total"]
            total += compile_s + n * INIT_S_PER_PARAM + (warmup + repeats * steps) * step_s
            lines.append(f"  {v.full_name:<28} {n / 1e6:>8.1f}M params {fpt / 1e6:>9.1f} MFLOP/token "
                         f"{'compiled' if v.compile else 'eager':>8}  ~{1e3 * step_s:,.0f} ms/step  {v.about}")
    lines.append(f"steps: {warmup} warm-up, then {repeats} repeats x {steps} timed steps per variant, round-robin")
    lines.append(f"estimated time: {total / 60:.1f} min (matmul rate {rate / 1e12:.3g} TFLOP/s x assumed "
                 f"{suite.assumed_mfu:.0%}, {suite.compile_s:.0f} s per compiled structure, "
                 f"{INIT_S_PER_PARAM * 1e9:.0f} ns per parameter to initialise)")
    return "\n".join(lines), total


# ----------------------------------------------------------------------------- main

@contextmanager
def one_rank(device, needed):
    """The one-process group the fsdp variants' FSDP2 runs in (train.py's on one GPU or CPU), torn
    down after them as train.py tears down its own."""
    if not needed:
        yield
        return
    train.init_one_rank(torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device)
    try:
        yield
    finally:
        if interrupt.close_process_group():  # a Ctrl-C held back while the group was torn down
            raise KeyboardInterrupt


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), default="cpu",
                   help="cpu: ~5M parameters here; cuda: 0.1B and 1.5B on one GPU")
    p.add_argument("--variants", default="", help="comma-separated names or patterns on group/name (default: all)")
    p.add_argument("--steps", type=int, help="timed steps per repeat (suite default)")
    p.add_argument("--repeats", type=int, help="round-robin passes over the variants (suite default)")
    p.add_argument("--warmup", type=int, help="untimed steps before timing, >= 1 (suite default)")
    p.add_argument("--batch", type=int, help="sequences per step, for every group")
    p.add_argument("--seq-len", type=int, help="tokens per sequence, for every group")
    p.add_argument("--json-out", help="write the rows and the setup as JSON")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its estimated time; build nothing")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, each variant's N costliest operations and compiled kernels per step "
                   "(torch.profiler; printed and in --json-out)")
    p.add_argument("--loss-memory", action="store_true",
                   help="instead: peak memory a 1-layer d64 model's step adds, full vs chunked loss (CPU, Linux)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.loss_memory:
        mem = loss_memory(batch=args.batch or 8, seq_len=args.seq_len or 512)
        print(f"peak memory added by forward+backward, vocab 100,352, {args.batch or 8} x {args.seq_len or 512} "
              f"tokens: fp32 logits {mem['fp32_logits'] / 2**30:.2f} GiB")
        for tail in ("full", "chunked"):
            print(f"  {tail:<8} {mem[tail] / 2**30:6.2f} GiB = {mem[tail] / mem['fp32_logits']:.2f}x the fp32 logits")
        return 0
    suite = SUITES[args.suite]
    steps, repeats, warmup = (suite.steps if args.steps is None else args.steps,
                              suite.repeats if args.repeats is None else args.repeats,
                              suite.warmup if args.warmup is None else args.warmup)
    for name, value in (("--steps", steps), ("--repeats", repeats), ("--warmup", warmup),
                        ("--batch", args.batch), ("--seq-len", args.seq_len), ("--profile", args.profile or None)):
        if value is not None and value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    variants = select(suite.variants(), args.variants)
    if args.batch or args.seq_len:
        variants = [replace(v, group=replace(v.group, batch=args.batch or v.group.batch,
                                             seq_len=args.seq_len or v.group.seq_len)) for v in variants]
    here = suite.device == "cpu" or torch.cuda.is_available()
    if not here and not args.dry_run:
        raise ValueError(f"--suite {args.suite} needs a CUDA GPU: run it there, or add --dry-run for its plan")
    if args.json_out:  # before the run, not after it: a bad path should not cost the measurement
        check_json_out(args.json_out)
    device = torch.device(suite.device)
    if args.dry_run and not here:
        peak, source, rate = suite.nominal_peak, "nominal", suite.nominal_peak
    else:
        peak, source = datasheet_peak(device)
        rate = matmul_rate(device, getattr(torch, variants[0].group.dtype), suite.rate_n, suite.rate_reps)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" and here else suite.device
    print(f"device {name}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads; "
          f"MFU against {f'{peak / 1e12:.3g} TFLOP/s ({source})' if peak else f'nothing ({source})'}; matmul rate "
          f"{rate / 1e12:.3g} TFLOP/s ({suite.rate_n}^3 {variants[0].group.dtype}, "
          f"{'nominal' if args.dry_run and not here else 'best of 5, measured now'})")
    text, _ = plan(variants, suite, steps, repeats, warmup, rate)
    print(text)
    if args.dry_run:
        return 0
    # Every compiled variant compiles the same code again (the blocks' and the norm's forward,
    # chunk_loss at up to two chunk heights): allow a few graphs per variant, and keep shapes
    # static (a dynamic recompile would time slower kernels).
    with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 4 * len(variants)),
                                    automatic_dynamic_shapes=False), \
            torch._inductor.config.patch({"cpp.enable_kernel_profile": bool(args.profile)}):  # kernels by name
        with one_rank(device, any(v.fsdp for v in variants)):
            rows = []
            for group_rows in measure(variants, device, steps, repeats, warmup, peak, rate, args.profile):
                rows += group_rows
                print(format_rows(group_rows))
                for r in group_rows:
                    for op in r.get("profile", []):
                        print(f"  {r['variant']:<28} {op['ms']:>9.1f} ms {op['calls']:>6.0f}x  {op['name'][:100]}")
                if args.json_out:  # after each group: a run cut short keeps what it measured
                    setup = {"suite": args.suite, "device": name, "cpu": cpu_name(), "torch": torch.__version__,
                             "threads": torch.get_num_threads(), "datasheet_peak_flops": peak or None,
                             "peak_source": source, "matmul_rate_flops": rate, "matmul_rate_n": suite.rate_n,
                             "steps": steps, "repeats": repeats, "warmup": warmup}
                    write_rows(args.json_out, setup, rows)
    failed = [r["variant"] for r in rows if "error" in r]
    if failed:
        print(f"bench.py: {len(failed)} variant(s) failed: {', '.join(failed)} (their errors are in the table"
              f"{' and --json-out' if args.json_out else ''})", file=sys.stderr)
    return 1 if failed else 0


def write_rows(path, setup, rows):
    try:
        atomic_write_bytes(path, [json.dumps({**setup, "rows": rows}, indent=1, allow_nan=False).encode()])
    except OSError as e:  # it changed since check_json_out
        raise ValueError(f"--json-out {path}: not written ({e.strerror}); the rows are printed above") from None


def check_json_out(path):
    """Refuse, before anything is measured, a --json-out that is not a file (a folder, a FIFO) or lies under a
    file, and a folder it cannot be made or written in: met only when written, it would cost the run."""
    check_outputs([(path, "file")], "choose another --json-out")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        os.unlink(tempfile.mkstemp(dir=folder, prefix=".bench.", suffix=".tmp")[1])  # the write's own first step
    except OSError as e:
        raise ValueError(f"--json-out {path}: cannot write in {folder} ({e.strerror}): choose another "
                         f"--json-out") from None


if __name__ == "__main__":
    interrupt.run(main, "bench.py: interrupted; --json-out holds only the groups finished before it, run the same "
                        "command again", errors=(ValueError,), line=lambda e: f"bench.py: {e}")
