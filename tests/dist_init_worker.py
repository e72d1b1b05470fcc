"""torchrun worker: build on meta, shard with FSDP2, materialise, γ-init, save the full weights.

Run by tests/test_init.py with 1 and 2 processes (gloo, CPU); rank 0 writes the gathered
state dict to the path given as argv[1].
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
from init import init_model_  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def full_weights():
    # An odd vocabulary and 3 experts make dim-0 shards uneven across 2 ranks.
    models = {
        "dense": GPTConfig(vocab_size=257, n_layer=2, n_head=2, d_model=64),
        "moe": GPTConfig(vocab_size=257, n_layer=2, n_head=2, d_model=64, n_experts=3, top_k=2, d_expert=32),
    }
    gathered = {}
    for name, cfg in models.items():
        with torch.device("meta"):
            model = GPT(cfg)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        init_model_(model, gamma=1.0, seed=1234)
        for pname, p in model.named_parameters():
            gathered[f"{name}.{pname}"] = p.full_tensor().clone()
    return gathered


def main(out_path):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    # Destroyed on every way out: a process that leaves gloo's worker threads running into
    # interpreter shutdown can abort there (SIGABRT) instead of exiting with its own error.
    try:
        gathered = full_weights()
        if dist.get_rank() == 0:
            torch.save(gathered, out_path)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
