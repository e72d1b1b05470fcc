"""
The optimizer of a run, chosen by train.py's `optimizer` setting. train.py steps it, checkpoint.py
saves and reloads it, and bench.py times it: all three get it from build_optimizer.

    adamw  AdamW on every parameter.
    muon   torch.optim.Muon on the blocks' 2-D weight matrices: attention, MLP, router and gate.
           AdamW on the rest: embeddings, the head, norm gains, and MoE's 3-D expert weights.
           Muon orthogonalises a matrix's update (Newton-Schulz on its momentum). That has no
           meaning for a gain vector or for an embedding's rows, each looked up on its own.

Both use one group per kind of parameter (param_groups), each with its own decoupled weight decay.
Muon's step is lr * 0.2 * sqrt(max(d_out, d_in)) (torch's adjust_lr_fn="match_rms_adamw", from
Moonshot's "Muon is Scalable for LLM Training"). Its update then has about AdamW's RMS, so one
lr schedule and one weight_decay table serve both.

On more than one rank FSDP2 hands Muon each matrix as a DTensor sharded by rows. Muon's matmuls
run as DTensor ops: they gather what each product needs, so the update is the whole matrix's,
not one per shard. It equals the single-process update up to rounding: Newton-Schulz runs in
bf16, and the shards' partial sums are added in another order (tests/test_optim.py, 2 ranks).
What those gathers cost on GPUs is not measured.
"""

import torch

OPTIMIZERS = ("adamw", "muon")


class Optimizers(list):
    """The run's optimizers, used as one: a single param_groups list, a merged state, one step. DCP's
    get_state_dict and set_state_dict take the list itself (a parameter's state is keyed by its name)."""

    @property
    def param_groups(self):
        return [group for opt in self for group in opt.param_groups]

    @property
    def state(self):
        """Every parameter's state, read-only (clear_state empties it)."""
        return {p: s for opt in self for p, s in opt.state.items()}

    def clear_state(self):
        for opt in self:
            opt.state.clear()

    def step(self):
        for opt in self:
            opt.step()

    def zero_grad(self, set_to_none=True):
        for opt in self:
            opt.zero_grad(set_to_none=set_to_none)


def param_kind(name, p):
    """matrix: weights inside blocks (incl. MoE experts and router); embed: tok_emb and lm_head;
    norm: 1-d gains."""
    return "norm" if p.dim() < 2 else "embed" if name.startswith(("tok_emb.", "lm_head.")) else "matrix"


def muon_takes(name, p):
    """Whether optimizer="muon" steps p with Muon: the blocks' 2-D matrices (MoE's 3-D experts stay on AdamW)."""
    return param_kind(name, p) == "matrix" and p.dim() == 2


def param_groups(named_params, weight_decay):
    """One group per kind with its decoupled weight decay (the γ=1 recipe pairs small init with
    larger decay on matrices, so it is swept per group). A group's name keys weight_decay."""
    groups = {kind: [] for kind in weight_decay}
    for name, p in named_params:
        groups[param_kind(name, p)].append(p)
    return [{"name": k, "params": ps, "weight_decay": weight_decay[k]} for k, ps in groups.items() if ps]


def build_optimizer(net, cfg, device):
    """cfg: train.py's settings (optimizer, lr, betas, adam_eps, weight_decay, muon_momentum)."""
    named = list(net.named_parameters())
    to_muon = cfg["optimizer"] == "muon"
    matrices = [(n, p) for n, p in named if to_muon and muon_takes(n, p)]
    taken = {id(p) for _, p in matrices}
    opts = Optimizers([torch.optim.AdamW(param_groups([(n, p) for n, p in named if id(p) not in taken],
                                                      cfg["weight_decay"]),
                                         lr=cfg["lr"], betas=cfg["betas"], eps=cfg["adam_eps"],
                                         fused=device.type == "cuda")])
    if matrices:
        opts.insert(0, torch.optim.Muon(param_groups(matrices, cfg["weight_decay"]), lr=cfg["lr"],
                                        momentum=cfg["muon_momentum"], adjust_lr_fn="match_rms_adamw"))
    return opts
