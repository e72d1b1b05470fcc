"""
The dry run's plan (`python train.py CONFIG --dry_run=N`): parameters, FLOPs and memory per GPU of a
run on N ranks, from a meta-device build: no data, no GPU, any machine.
"""

import torch

from loss import loss_tail_bytes
from model import GPT
from optim import muon_takes
from rules import grad_accum, model_config


def print_plan(cfg, world):
    mcfg = model_config(cfg, "cuda")
    with torch.device("meta"):
        net = GPT(mcfg)
    accum = grad_accum(cfg, world)
    counts = net.num_params()
    tokens_step = cfg["global_batch"] * cfg["seq_len"]
    fpt = net.flops_per_token(cfg["seq_len"])
    mem = memory_estimate(net, mcfg, cfg, world, accum)
    print(f"model {cfg['model_size']}: {counts['total']:,} params ({counts['active']:,} active, "
          f"{counts['embedding']:,} embedding); {mcfg.n_layer} layers, d_model {mcfg.d_model}, "
          f"{mcfg.n_head} heads, gate {mcfg.attn_gate}, norm_eps {mcfg.norm_eps:g}, gamma {cfg['gamma']}")
    print(f"world {world}: batch {cfg['batch_size']} x {cfg['seq_len']} per rank, grad_accum {accum}, "
          f"{tokens_step:,} tokens/step, {cfg['max_steps']:,} steps = {tokens_step * cfg['max_steps']:,} tokens")
    print(f"FLOPs/token {fpt:.4g}; total {fpt * tokens_step * cfg['max_steps']:.3g} FLOPs")
    for part, b in mem.items():
        print(f"  {part:<36} {b / 2**30:8.2f} GiB")
    print(f"memory/GPU (estimate, bf16 on CUDA)     {sum(mem.values()) / 2**30:8.2f} GiB")
    return {"params": counts, "tokens_per_step": tokens_step, "grad_accum": accum,
            "flops_per_token": fpt, "memory_bytes": sum(mem.values())}


def memory_estimate(net, mcfg, cfg, world, accum):
    """Bytes per GPU on CUDA (bf16 compute), roughly: sharded fp32 state + gathered blocks +
    activations + logits."""
    n = sum(p.numel() for p in net.parameters())
    compiled = cfg["compile"]
    embed = sum(p.numel() for name, p in net.named_parameters() if name.startswith(("tok_emb.", "lm_head.")))
    per_block = (n - embed) / mcfg.n_layer
    # AdamW keeps two fp32 moments per parameter; Muon one momentum buffer per matrix it takes (optim.py).
    muon = sum(p.numel() for name, p in net.named_parameters()
               if cfg["optimizer"] == "muon" and muon_takes(name, p))
    act = 2  # bytes per bf16 activation value
    tokens = cfg["batch_size"] * cfg["seq_len"]
    parts = {
        "params+grads+optimizer (fp32, sharded)": (16 * n - 4 * muon) / world,
        # root params (embeddings/head) and ~2 blocks (current + prefetched) all-gathered
        "gathered params": act * (embed + 2 * per_block),
        # Bytes saved for backward per token, d_model and layer (no T x T scores: flex/sdpa are
        # fused): ~34 with compiled blocks (Korthikanti et al.'s ~17 bf16 values), ~61 eager
        # (measured on this model). With checkpointing each block keeps its input, plus one
        # block's activations while it is recomputed.
        "activations": tokens * mcfg.d_model * (
            act * mcfg.n_layer + (34 if compiled else 61) if mcfg.activation_checkpointing
            else (34 if compiled else 61) * mcfg.n_layer),
        # The chunked loss: one chunk of logits at a time, and its saved gradients (model.py)
        "loss (chunked logits, saved grads)": loss_tail_bytes(tokens, mcfg.d_model, mcfg.vocab_size, act),
    }
    if accum > 1:  # with sync off FSDP2 keeps unsharded fp32 gradients between micro-steps
        parts["unsharded grads (accumulation)"] = 4 * n
    return parts
