"""
The training loss, chunked: full (B, T, V) logits cost 2 bytes (bf16) + 4 (the fp32 copy that
cross_entropy reads) + 4 + 4 (its softmax and gradient in backward) per logit, ~21 GiB at V=100k and
8 x 2048 tokens, more than the whole 1.5B model's sharded state. GPT.forward's loss, and the plain
GPT's in bench.py; train.compile_model_ compiles its per-chunk math.
"""

import torch

# fp32 values in one chunk of logits (256 MiB); rows per chunk are a multiple of 128 below it.
LOSS_CHUNK_ELEMENTS = 1 << 26


def loss_chunk_rows(vocab_size):
    # Multiples of 128 rows keep the chunk GEMMs on whole tensor-core tiles.
    return max(128, LOSS_CHUNK_ELEMENTS // vocab_size // 128 * 128)


def chunk_loss(h, weight, targets, acc, want_h, grad_w):
    """(summed loss, gradient of h or None) of one chunk of rows; adds the chunk's gradient of
    weight to grad_w unless None. A function of its own so that the chunk's (rows, V) buffers
    are freed on return, before the next chunk's are made. Softmax by max, exp and sum in place
    on the one fp32 buffer: logsumexp would allocate a second one."""
    logits = (h @ weight.T).to(acc)
    counted = targets != -1
    index = targets.clamp_min(0)[:, None]  # ignored rows read a valid column, then count 0
    target_logit = logits.gather(1, index)[:, 0]
    top = logits.amax(dim=1, keepdim=True)
    p = logits.sub_(top).exp_()
    norm = p.sum(dim=1, keepdim=True)
    lse = (top + norm.log())[:, 0]
    part = torch.where(counted, lse - target_logit, 0).sum()
    if not (want_h or grad_w is not None):
        return part, None
    # d(sum of losses)/d(logits) = softmax - onehot(target) on counted rows, 0 elsewhere.
    g = p.div_(norm)
    g.scatter_add_(1, index, torch.full(index.shape, -1.0, dtype=acc, device=g.device))
    g = g.mul_(counted[:, None]).to(h.dtype)
    if grad_w is not None:
        grad_w += g.T @ h
    return part, g @ weight if want_h else None


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of logits h @ weight.T against targets (-1: ignored), one chunk of
    rows at a time, with the arithmetic of F.cross_entropy(logits.float()): logits in the
    model's dtype, softmax in fp32.

    The gradients of h and weight are computed in forward, while each chunk's softmax is at
    hand, and saved; backward only scales them. Chunk-wise checkpointing (saving h and the
    logsumexp, recomputing each chunk's logits in backward) would hold less between forward and
    backward but repeats the lm_head GEMM: +1/3 of the head's FLOPs, and the head is about half
    of all FLOPs at 0.1B. What is saved instead is one gradient of h (N x d) and of weight (the
    V x d the head's backward would produce anyway)."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk_rows, chunk_fn):
        want_h, want_w = ctx.needs_input_grad[:2]
        acc = torch.promote_types(h.dtype, torch.float32)  # fp32, or fp64 for gradcheck
        total = torch.zeros((), dtype=acc, device=h.device)
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        for s in range(0, h.shape[0], chunk_rows):
            part, gh = chunk_fn(h[s:s + chunk_rows], weight, targets[s:s + chunk_rows], acc, want_h, grad_w)
            total = total + part
            if want_h:
                grad_h[s:s + chunk_rows] = gh
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.saved_tensors
        return (None if grad_h is None else grad_h * grad_total.to(grad_h.dtype),
                None if grad_w is None else grad_w * grad_total.to(grad_w.dtype), None, None, None)


def chunked_cross_entropy(h, weight, targets, chunk_rows=None, chunk_fn=chunk_loss):
    """F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=-1, reduction="sum")
    for h (N, d), weight (V, d), targets (N,), holding one chunk of rows' logits at a time.
    chunk_fn: chunk_loss, or its compiled form (train.compile_model_)."""
    if not torch.is_grad_enabled():
        # needs_input_grad still says True under no_grad: detached, forward skips the gradients.
        h, weight = h.detach(), weight.detach()
    return ChunkedCrossEntropy.apply(h, weight, targets, chunk_rows or loss_chunk_rows(weight.shape[0]), chunk_fn)


def loss_tail_bytes(tokens, d_model, vocab_size, act_bytes):
    """Peak bytes the chunked loss adds for one micro-batch of tokens, activations of act_bytes
    each: one chunk's fp32 logits (turned into the gradient in place) and, below fp32, their
    model-dtype copy; the saved gradient of h; the head weight's fp32 gradient accumulator and
    one model-dtype V x d product or copy beside it."""
    rows = min(tokens, loss_chunk_rows(vocab_size))
    return rows * vocab_size * (4 + (act_bytes if act_bytes < 4 else 0)) + tokens * d_model * act_bytes \
        + vocab_size * d_model * (4 + act_bytes)
