# The anchor task with the standard baseline (γ=0.5, eps=1e-5, no gate); else as anchor_gamma1.py.
include("anchor_gamma1.py")
include("_baseline.py")
