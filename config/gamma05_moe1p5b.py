# The standard baseline (γ=0.5, eps=1e-5, no gate) at moe-1.5b; everything else as gamma1_moe1p5b.py.
include("gamma1_moe1p5b.py")
include("_baseline.py")
