# The standard baseline (γ=0.5, eps=1e-5, no gate) at 0.5b; everything else as gamma1_0p5b.py.
include("gamma1_0p5b.py")
include("_baseline.py")
