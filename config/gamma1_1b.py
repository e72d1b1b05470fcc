# The paper's recipe (γ=1, eps=1e-12, gated attention) at 1b: gamma1_1p5b.py rescaled.
# 20B tokens (20/param) at 1M tokens/step; lr: the 1.5B settings.
# Per GPU 8 x 2048 tokens (check the memory with --dry_run=8).
include("gamma1_1p5b.py")
out_dir = "out/gamma1_1b"
model_size = "1b"
max_steps = 19_073
