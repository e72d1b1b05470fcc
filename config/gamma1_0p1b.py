# The paper's recipe (γ=1, eps=1e-12, gated attention) at 0.1b: gamma1_1p5b.py rescaled.
# 2B tokens (20/param) at 0.5M tokens/step; lr: GPT-3 125M: lr 6e-4 at a 0.5M batch.
# Per GPU 16 x 2048 tokens (check the memory with --dry_run=8).
include("gamma1_1p5b.py")
out_dir = "out/gamma1_0p1b"
model_size = "0.1b"
global_batch = 256
batch_size = 16
lr = 0.0006
warmup_steps = 500
max_steps = 3_815
