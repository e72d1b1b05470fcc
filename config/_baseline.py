# The standard baseline's three differences from the paper's recipe (included by gamma05_*.py
# after their gamma1_* counterpart): γ=0.5 init, RMSNorm eps=1e-5, no attention gate.
out_dir = out_dir.replace("gamma1", "gamma05")
gamma = 0.5
model.update(norm_eps=1e-5, attn_gate="none")
