"""
Measuring a GPT without changing it: per-token log-probabilities, forward hooks on the residual
stream and the attention probabilities (use them on an uncompiled model), and the weight-structure
metrics of condensation that train.py logs and eval.py's `weights` analysis reports. Imports model.py
and nothing else of the project, so train.py may use it without loading the study's tools.
"""

from contextlib import contextmanager

import torch

from model import MoE


@torch.no_grad()
def token_logprobs(model, x, y, chunk_elements=1 << 26):
    """log p(y_t | x_≤t) per position (float32), 0 where y == −1 (masked).

    The log-softmax is never materialised: per chunk of positions, the target's logit minus
    the logsumexp, in float32, so the extra memory is one chunk of about chunk_elements
    logits (256 MB) instead of fp32 copies of all (B, T, V) (~13 GB at V=100k, B=8, T=2048).
    The model's own (B, T, V) logits stay: model.forward returns them whole."""
    logits, _ = model(x)
    B, T, V = logits.shape
    step = max(1, chunk_elements // (B * V))
    out = torch.empty(B, T, dtype=torch.float32, device=logits.device)
    for s in range(0, T, step):
        chunk = logits[:, s:s + step].float()
        target = chunk.gather(2, y[:, s:s + step].clamp_min(0)[..., None]).squeeze(2)
        out[:, s:s + step] = target - torch.logsumexp(chunk, dim=2)
    return out * (y >= 0)


# Forward hooks.

def _rms(t):
    return t.detach().float().pow(2).mean().sqrt().item()


@contextmanager
def trace_residual(model):
    """Per layer, one entry per forward: RMS of the residual stream entering the block and of
    the attention and MLP branch updates added to it."""
    records = [{"resid_rms": [], "attn_rms": [], "mlp_rms": []} for _ in model.layers]
    handles = []
    for rec, block in zip(records, model.layers):
        handles += [
            block.attn_norm.register_forward_hook(lambda m, args, out, rec=rec: rec["resid_rms"].append(_rms(args[0]))),
            block.attn.register_forward_hook(lambda m, args, out, rec=rec: rec["attn_rms"].append(_rms(out))),
            block.mlp.register_forward_hook(
                # MoE returns (output, aux, counts): the branch update is the output.
                lambda m, args, out, rec=rec: rec["mlp_rms"].append(_rms(out[0] if isinstance(m, MoE) else out))),
        ]
    try:
        yield records
    finally:
        for h in handles:
            h.remove()


@contextmanager
def capture_attention(model, reduce=None):
    """Per layer, the (B, H, T, T) attention probabilities of the last forward (eager backend),
    or reduce(probs) if given: reducing inside the hook keeps one layer's probabilities alive
    at a time instead of all of them (~40 GB at 1.5B for B=8, T=2048)."""
    if model.cfg.attn_backend != "eager":
        raise ValueError("capture_attention needs the eager backend: call model.set_attn_backend('eager') first")
    captured = [None] * len(model.layers)

    def keep(i):
        def hook(module, args, out):
            captured[i] = out.detach() if reduce is None else reduce(out.detach())
        return hook

    handles = [block.attn.probs_tap.register_forward_hook(keep(i)) for i, block in enumerate(model.layers)]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


# Weight structure: the condensation signal (rows aligning to a few directions, low stable rank).

def stable_rank(w):
    """‖W‖_F² / ‖W‖_2², via the Gram matrix of the smaller side (cheap for a 100k-row lm_head)."""
    w = w.detach().double()
    gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
    top = torch.linalg.eigvalsh(gram)[-1]
    return (torch.trace(gram) / top).item()


def row_cosines(w, max_rows=2048, seed=0):
    """Cosine similarity between the rows of w (each row: one output neuron's input weights).

    A V×V matrix for a 50k-token embedding would not fit, so large matrices use a fixed random
    subset of rows: the off-diagonal averages are unbiased estimates of the full ones."""
    w = w.detach().double()
    if w.shape[0] > max_rows:
        rows = torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(seed))[:max_rows]
        w = w[rows]
    unit = w / w.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return unit @ unit.T


def cosine_stats(cos, threshold=0.7):
    """Mean |cos| off the diagonal and the fraction of row pairs with |cos| > threshold.

    |cos| because condensation aligns rows to a few directions up to sign: w and −w span the
    same feature, and a sign flip is absorbed by the next layer."""
    off = cos[~torch.eye(cos.shape[0], dtype=torch.bool)].abs()
    return {"mean_abs_cos": off.mean().item(), "frac_cos_gt": (off > threshold).double().mean().item()}
