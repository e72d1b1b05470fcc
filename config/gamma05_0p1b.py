# The standard baseline (γ=0.5, eps=1e-5, no gate) at 0.1b; everything else as gamma1_0p1b.py.
include("gamma1_0p1b.py")
include("_baseline.py")
