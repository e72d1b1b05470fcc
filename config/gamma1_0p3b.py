# The paper's recipe (γ=1, eps=1e-12, gated attention) at 0.3b: gamma1_1p5b.py rescaled.
# 6B tokens (20/param) at 0.5M tokens/step; lr: GPT-3 350M: lr 3e-4 at a 0.5M batch.
# Per GPU 16 x 2048 tokens (check the memory with --dry_run=8).
include("gamma1_1p5b.py")
out_dir = "out/gamma1_0p3b"
model_size = "0.3b"
global_batch = 256
batch_size = 16
lr = 0.0003
warmup_steps = 1000
max_steps = 11_444
