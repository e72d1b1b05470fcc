# The paper's recipe (γ=1, eps=1e-12, gated attention) at moe-1.5b: gamma1_1p5b.py rescaled.
# 20B tokens at 1M tokens/step (~45 per active parameter); lr: the 1.5B settings; selection-bias load balancing (model.moe_bias_rate).
# Per GPU 8 x 2048 tokens (check the memory with --dry_run=8).
include("gamma1_1p5b.py")
out_dir = "out/gamma1_moe1p5b"
model_size = "moe-1.5b"
max_steps = 19_073
