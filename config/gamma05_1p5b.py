# The standard baseline at 1.5B (γ=0.5, eps=1e-5, no gate); everything else as gamma1_1p5b.py.
include("gamma1_1p5b.py")
include("_baseline.py")
