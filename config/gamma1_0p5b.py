# The paper's recipe (γ=1, eps=1e-12, gated attention) at 0.5b: gamma1_1p5b.py rescaled.
# 10B tokens (20/param) at 0.5M tokens/step; lr: between GPT-3 350M (3e-4) and 760M (2.5e-4).
# Per GPU 8 x 2048 tokens (check the memory with --dry_run=8).
include("gamma1_1p5b.py")
out_dir = "out/gamma1_0p5b"
model_size = "0.5b"
global_batch = 256
batch_size = 8
lr = 0.0003
warmup_steps = 1000
max_steps = 19_073
