# The standard baseline (γ=0.5, eps=1e-5, no gate) at 1b; everything else as gamma1_1b.py.
include("gamma1_1b.py")
include("_baseline.py")
