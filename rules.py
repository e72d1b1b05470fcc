"""
train.py's settings rules, in one function: each an `if ...: raise ValueError(...)` with the line a user
sees after "config: ". They run in order, and a rule may rely on the ones above it; the model's own
checks (GPTConfig) and init_overrides' patterns are checked on a meta-device build, so a bad setting
stops the run before the data is opened or a run folder made.
"""

import importlib.util

import torch

from init import GAMMA_MAX, check_overrides
from model import ATTN_BACKENDS, GPT, config_for, load_varlen
from optim import OPTIMIZERS

SCHEDULES = ("cosine", "wsd")
FP32 = torch.finfo(torch.float32)  # AdamW's state and the parameters it updates (bf16 is only a compute copy)


def check_settings(c):
    """Raise ValueError("config: ...") for the first rule the settings c break."""
    def refuse(line):
        raise ValueError(f"config: {line}")

    if c["schedule"] not in SCHEDULES:
        refuse(f"schedule={c['schedule']!r}: choose one of {SCHEDULES}")
    if c["optimizer"] not in OPTIMIZERS:
        refuse(f"optimizer={c['optimizer']!r}: choose one of {', '.join(OPTIMIZERS)}")
    if not 0 <= c["muon_momentum"] < 1:
        refuse(f"muon_momentum={c['muon_momentum']} must be in [0, 1), e.g. 0.95")
    if c["attn_backend"] not in ("auto", *ATTN_BACKENDS):
        refuse(f"attn_backend={c['attn_backend']!r}: choose one of {', '.join(('auto', *ATTN_BACKENDS))}")
    for k in ("seq_len", "global_batch", "batch_size", "max_steps", "log_interval", "eval_interval", "eval_batches",
              "ckpt_interval", "keep_last"):
        if c[k] < 1:
            refuse(f"{k}={c[k]} must be >= 1")
    for k in ("warmup_steps", "keep_every", "dry_run", "peak_flops", "grad_clip", "bench_interval"):
        if c[k] < 0:
            refuse(f"{k}={c[k]} must be >= 0")
    if c["adam_eps"] < FP32.tiny:  # where denormals are flushed a subnormal eps is 0 too
        refuse(f"adam_eps={c['adam_eps']:g} must be >= float32's smallest normal {FP32.tiny:.3g} (AdamW's state is "
               f"fp32: smaller is 0 or subnormal there, and a zero gradient's update 0/0 = NaN); use e.g. 1e-8")
    if not all(type(s) is int and 0 <= s <= c["max_steps"] for s in c["keep_steps"]):
        refuse(f"keep_steps={c['keep_steps']} must be whole steps between 0 and max_steps")
    if not 0 <= c["seed"] < 2**64:  # torch takes 64 bits, numpy >= 0
        refuse(f"seed={c['seed']} must be in 0 <= seed < 2**64")
    if c["warmup_steps"] >= c["max_steps"]:
        refuse(f"warmup_steps={c['warmup_steps']} must be < max_steps={c['max_steps']}")
    for k in ("min_lr_ratio", "decay_frac"):
        if not 0 <= c[k] <= 1:
            refuse(f"{k}={c[k]} must be between 0 and 1")
    start = decay_start(c["max_steps"], c["decay_frac"])
    if c["schedule"] == "wsd" and c["warmup_steps"] > start:  # the decay would drop lr from the peak at once
        refuse(f"schedule='wsd' decays from step {start} (decay_frac={c['decay_frac']} of max_steps={c['max_steps']}), "
               f"before warmup_steps={c['warmup_steps']} end: lower decay_frac to <= "
               f"{(c['max_steps'] - c['warmup_steps']) / c['max_steps']:g} or warmup_steps to <= {start}")
    betas = c["betas"]
    if not (len(betas) == 2 and all(type(x) in (int, float) and 0 <= x < 1 for x in betas)):
        refuse(f"betas={betas} must be two numbers in [0, 1), e.g. (0.9, 0.95)")
    if not all(v >= 0 for v in c["weight_decay"].values()):
        refuse(f"weight_decay={c['weight_decay']} must be >= 0 in every group")
    if not c["lr"] > 0:
        refuse(f"lr={c['lr']} must be > 0")
    # AdamW turns lr into two fp32 scalars: the step size lr / (1 - beta1^t), largest at the first step (bias
    # correction), and the decay factor 1 - lr * weight_decay. Past float32's max the first stops torch with an
    # overflow error, the second silently turns that group's weights to inf. (An lr just inside the bound still
    # diverges at once; the loop's non-finite check catches that.)
    step_size = c["lr"] / (1 - betas[0])
    if step_size > FP32.max:
        refuse(f"lr={c['lr']:g} is too large: AdamW's first step size lr/(1 - betas[0]) = {step_size:.3g} is past "
               f"float32's max {FP32.max:.3g}; use e.g. lr=1e-3")
    for group, wd in c["weight_decay"].items():
        if c["lr"] * wd > FP32.max:
            refuse(f"weight_decay.{group}={wd:g} times lr={c['lr']:g} is past float32's max {FP32.max:.3g}: AdamW "
                   f"would scale the weights by 1 - lr*weight_decay = -inf; use e.g. 0.1")
    for k, package in (("tensorboard_dir", "tensorboard"), ("wandb_log", "wandb")):
        if c[k] and importlib.util.find_spec(package) is None:  # now, not at the first log line
            refuse(f"{k}={c[k]!r} needs the {package} package: pip install {package}")
    if c["out_dir"].strip() == "":  # "" would write checkpoints into the current folder
        refuse("out_dir is empty: name the run folder, e.g. --out_dir=out/run")
    refuse_gamma("gamma", c["gamma"], refuse)
    try:
        mcfg = config_for(c["model_size"], **c["model"])  # the model's checks, no GPU needed
    except (ValueError, TypeError) as e:
        refuse(f"model_size={c['model_size']!r}, model={c['model']}: {e}")
    if c["init_overrides"]:
        # Matched against the model's own parameter names (built on meta: no memory, no GPU), so a typo or a bad
        # regex fails with the settings, not after the data is opened, or never (a pattern that matches nothing
        # changes no γ, silently); then each γ in range.
        with torch.device("meta"):
            net = GPT(mcfg)
        try:
            check_overrides(c["init_overrides"], net)
        except ValueError as e:
            refuse(f"init_overrides: {e}")
        for pattern, value in c["init_overrides"].items():
            refuse_gamma(f"init_overrides[{pattern!r}]", value, refuse)
    if c["seq_len"] > mcfg.max_seq_len:
        refuse(f"seq_len={c['seq_len']} > the model's max_seq_len={mcfg.max_seq_len}: lower seq_len or set "
               f"--model.max_seq_len={c['seq_len']}")


def refuse_gamma(key, value, refuse):
    if not (type(value) in (int, float) and 0 < value <= GAMMA_MAX):  # also refuses nan
        refuse(f"{key}={value} is outside 0 < γ <= {GAMMA_MAX:g}: at γ <= 0 weights do not shrink with width, above "
               f"{GAMMA_MAX:g} they start near 0; use e.g. 0.5 (standard) or 1.0")


def decay_start(max_steps, decay_frac):
    """The first step of the wsd schedule's decay (train.lr_at)."""
    return max_steps - int(decay_frac * max_steps)


# What the settings imply for a run (train.py, the dry run's plan.py)

def grad_accum(cfg, world):
    per_step = cfg["batch_size"] * world
    if cfg["global_batch"] % per_step:
        raise ValueError(f"config: global_batch={cfg['global_batch']} is not a multiple of "
                         f"batch_size*world_size={cfg['batch_size']}*{world}; change batch_size")
    return cfg["global_batch"] // per_step


def model_config(cfg, device_type):
    """The GPTConfig of validated settings on device_type ("cuda" or "cpu"): attn_backend "auto" resolved, and
    varlen's device and torch checks run, before any run folder exists."""
    backend = cfg["attn_backend"]
    if backend == "auto":
        backend = "flex" if device_type == "cuda" else "sdpa"
    mcfg = config_for(cfg["model_size"], **{"attn_backend": backend, **cfg["model"]})
    if mcfg.attn_backend == "varlen":
        load_varlen(mcfg, torch.device(device_type))
    return mcfg
