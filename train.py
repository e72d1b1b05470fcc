"""
Pretrain a GPT from model.py with γ-init (init.py) on token shards from prepare_data.py.

    python train.py config/tiny_bytes.py                        # CPU, one process
    python train.py config/tiny_bytes.py --lr=3e-3 --model.norm_eps=1e-5
    torchrun --nproc_per_node=8 train.py config/gamma1_1p5b.py  # one node, FSDP2
    python train.py config/gamma1_1p5b.py --dry_run=8           # plan for 8 GPUs, no GPU needed
    python train.py export out/run/ckpt_00001000 model.pt       # consolidated single file

Configuration: the module-level names below are the defaults; each config file given on the
command line is executed over them; then `--key=value` (a Python literal, else a string) and
`--key.item=value` (one entry of a dict setting) override. Unknown names and wrong types fail.
In a config file, names starting with _ are its own helpers and include("other.py") runs
another config file (beside it) in place, so a pair of configs can differ in three lines.
One code path: a single process is a 1-rank process group, so FSDP2, DCP checkpoints and the
data order are the same for 1 CPU process and for 64 GPUs.
"""

import ast
import builtins
import copy
import difflib
import glob
import json
import math
import os
import re
import resource
import shutil
import sys
import time
from dataclasses import asdict, fields

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from eval import complete_checkpoints, cosine_stats, load_model, row_cosines, stable_rank, write_json
from init import format_report
from model import GPT, GPTConfig, config_for, init_model_
from prepare_data import TokenLoader, check_model_vocab

# ----------------------------------------------------------------------------- defaults
# run folder and data
out_dir = "out/run"
data_dir = "data/bytes"         # a prepare_data.py output folder
resume = True                   # continue from the newest complete checkpoint in out_dir
seed = 0                        # init and data order
# model: a named size from model.SIZES plus GPTConfig fields over it
model_size = "tiny"
model = {}                      # e.g. {"norm_eps": 1e-5, "attn_gate": "none"}
gamma = 1.0                     # every weight ~ N(0, d_in^-2γ)
init_overrides = {}             # {regex on parameter name: γ}, e.g. {r"^lm_head\.": 0.5}
attn_backend = "auto"           # "auto": flex on CUDA, sdpa on CPU (Flex has no CPU backward)
compile = False                 # torch.compile each block (~30 s on CPU, minutes at 1.5B)
# batch: the global batch is fixed; grad_accum = global_batch / (batch_size * world_size)
seq_len = 256
global_batch = 32               # sequences per optimizer step, all ranks together
batch_size = 32                 # sequences per forward on one rank (micro-batch)
max_steps = 1000
# optimizer: AdamW with one parameter group per kind of parameter
lr = 1e-3
betas = (0.9, 0.95)
adam_eps = 1e-8
weight_decay = {"matrix": 0.1, "embed": 0.0, "norm": 0.0}   # decoupled, times lr
grad_clip = 1.0                 # max global grad norm; 0 disables clipping (norm still logged)
schedule = "cosine"             # "cosine" | "wsd" (warmup-stable-decay)
warmup_steps = 100
min_lr_ratio = 0.1              # final lr = lr * min_lr_ratio
decay_frac = 0.2                # wsd: the last decay_frac of the steps decay linearly
# logging, evaluation, checkpoints
log_interval = 10
eval_interval = 200             # validation loss + weight-structure metrics
eval_batches = 8                # global batches of the validation split per evaluation
track_weights = ["layers.0.attn.wq.weight", "layers.0.mlp.w_up.weight",
                 "layers.{last}.attn.wq.weight", "layers.{last}.mlp.w_up.weight"]
ckpt_interval = 500
keep_last = 2                   # checkpoints kept, newest first ...
keep_every = 0                  # ... plus every keep_every-th step forever (0: none)
# ... plus these steps, saved and kept whatever the interval: the "condense then expand"
# trajectory (eval.py weights) happens early, e.g. [0, 100, 300, 1000, 3000]; 0 is the init.
keep_steps = []
peak_flops = 0.0                # per device for MFU; 0: 989e12 on H100/H200, else not reported
dry_run = 0                     # N > 0: print the plan for N ranks and exit (no data, no GPU)
debug_nan_step = 0              # test knob: poison the loss at this step (0: never)
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items()
            if not k.startswith("_") and type(v) in (int, float, bool, str, list, tuple, dict)}
SCHEDULES = ("cosine", "wsd")


def _check_type(key, value, default):
    want = type(default)
    if want is float and type(value) is int:
        return float(value)
    if type(value) is not want:
        raise SystemExit(f"config: {key}={value!r} is a {type(value).__name__}, expected a "
                         f"{want.__name__} like the default {default!r}")
    return value


def _unknown(key, valid, where):
    close = difflib.get_close_matches(key, list(valid), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return SystemExit(f"config: unknown key {key!r} in {where}{hint}")


def _set(cfg, key, value, where, merge_dicts=False):
    head, _, item = key.partition(".")
    if head not in DEFAULTS:
        raise _unknown(head, DEFAULTS, where)
    default = DEFAULTS[head]
    if item:
        # `--weight_decay.matrix=0.3` sets one entry and keeps the others (replacing the
        # whole dict from the command line would silently drop them).
        if type(default) is not dict:
            raise SystemExit(f"config: {head} is not a dict setting: write --{head}=...")
        value = {item: value}
    if type(default) is dict and default:  # fixed entries (weight_decay): each checked
        value = dict(_check_type(head, value, default))
        for k, v in value.items():
            if k not in default:
                raise _unknown(f"{head}.{k}", [f"{head}.{d}" for d in default], where)
            value[k] = _check_type(f"{head}.{k}", v, default[k])
        cfg[head] = {**cfg[head], **value}
    elif item or (type(default) is dict and merge_dicts):
        # Free-form dicts (model, init_overrides) are checked by GPTConfig / init.py. From the
        # command line they merge: --model={'attn_gate': 'none'} must not silently drop the
        # config file's doc_mask or max_seq_len. A config file's `model = dict(...)` replaces,
        # as the Python says (use model.update(...) there to merge).
        cfg[head] = {**cfg[head], **_check_type(head, value, default)}
    else:
        cfg[head] = _check_type(head, value, default)


def load_config(argv):
    """Defaults <- config files (in order) <- --key=value overrides; validated."""
    cfg = copy.deepcopy(DEFAULTS)
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if not eq:
                text = "True"  # a bare --flag
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text  # --out_dir=out/x needs no quotes
            _set(cfg, key, value, "the command line", merge_dicts=True)
        else:
            if not os.path.isfile(arg):
                raise SystemExit(f"config: no such config file {arg!r} (arguments are config "
                                 f"files and --key=value)")
            ns = copy.deepcopy(cfg)
            ns["include"] = lambda name, _dir=os.path.dirname(arg): _run_file(os.path.join(_dir, name), ns)
            _run_file(arg, ns)
            for key, value in ns.items():
                # _names are the file's own helpers; imported modules are not settings.
                if key.startswith("_") or key == "include" or type(value).__name__ == "module":
                    continue
                _set(cfg, key, value, arg)
    validate(cfg)
    return cfg


def _run_file(path, ns):
    """Execute a config file in ns. Config files share settings by include("other.py"),
    resolved beside the includer. (builtins.compile: the setting `compile` shadows the name.)"""
    with open(path) as f:
        exec(builtins.compile(f.read(), path, "exec"), ns)


def validate(cfg):
    if cfg["schedule"] not in SCHEDULES:
        raise SystemExit(f"config: schedule={cfg['schedule']!r}: choose one of {SCHEDULES}")
    if cfg["attn_backend"] not in ("auto", "flex", "sdpa", "eager"):
        raise SystemExit(f"config: attn_backend={cfg['attn_backend']!r}: choose auto, flex, sdpa or eager")
    for key in ("seq_len", "global_batch", "batch_size", "max_steps", "log_interval",
                "eval_interval", "eval_batches", "ckpt_interval", "keep_last"):
        if cfg[key] < 1:
            raise SystemExit(f"config: {key}={cfg[key]} must be >= 1")
    for key in ("warmup_steps", "keep_every", "dry_run", "peak_flops", "grad_clip", "adam_eps"):
        if cfg[key] < 0:
            raise SystemExit(f"config: {key}={cfg[key]} must be >= 0")
    if not all(type(s) is int and 0 <= s <= cfg["max_steps"] for s in cfg["keep_steps"]):
        raise SystemExit(f"config: keep_steps={cfg['keep_steps']} must be whole steps between 0 and max_steps")
    if not cfg["warmup_steps"] < cfg["max_steps"]:
        raise SystemExit(f"config: warmup_steps={cfg['warmup_steps']} must be < max_steps={cfg['max_steps']}")
    if not cfg["lr"] > 0:
        raise SystemExit(f"config: lr={cfg['lr']} must be > 0")
    for key in ("min_lr_ratio", "decay_frac"):
        if not 0 <= cfg[key] <= 1:
            raise SystemExit(f"config: {key}={cfg[key]} must be between 0 and 1")
    if len(cfg["betas"]) != 2 or not all(0 <= b < 1 for b in cfg["betas"]):
        raise SystemExit(f"config: betas={cfg['betas']} must be two numbers in [0, 1), e.g. (0.9, 0.95)")
    if any(v < 0 for v in cfg["weight_decay"].values()):
        raise SystemExit(f"config: weight_decay={cfg['weight_decay']} must be >= 0 in every group")
    mcfg = model_config(cfg, "cpu")  # unknown size / GPTConfig field / bad value fails here, no GPU needed
    if cfg["seq_len"] > mcfg.max_seq_len:
        raise SystemExit(f"config: seq_len={cfg['seq_len']} > the model's max_seq_len={mcfg.max_seq_len}: "
                         f"lower seq_len or set --model.max_seq_len={cfg['seq_len']}")


def model_config(cfg, device_type):
    backend = cfg["attn_backend"]
    if backend == "auto":
        backend = "flex" if device_type == "cuda" else "sdpa"
    try:
        return config_for(cfg["model_size"], **{"attn_backend": backend, **cfg["model"]})
    except (ValueError, TypeError) as e:
        raise SystemExit(f"config: model_size={cfg['model_size']!r}, model={cfg['model']}: {e}")


def grad_accum(cfg, world):
    per_step = cfg["batch_size"] * world
    if cfg["global_batch"] % per_step:
        raise SystemExit(f"config: global_batch={cfg['global_batch']} is not a multiple of "
                         f"batch_size*world_size={cfg['batch_size']}*{world}; change batch_size")
    return cfg["global_batch"] // per_step


def lr_at(cfg, step):
    """Learning rate for the update that produces step+1."""
    peak, low, warm, total = cfg["lr"], cfg["lr"] * cfg["min_lr_ratio"], cfg["warmup_steps"], cfg["max_steps"]
    if step < warm:
        return peak * (step + 1) / warm
    if cfg["schedule"] == "cosine":
        progress = (step - warm) / max(total - warm - 1, 1)
        return low + 0.5 * (1 + math.cos(math.pi * progress)) * (peak - low)
    decay_start = total - int(cfg["decay_frac"] * total)
    if step < decay_start:
        return peak
    return peak - (peak - low) * (step - decay_start + 1) / (total - decay_start)


# ----------------------------------------------------------------------------- model and optimizer
def setup_distributed():
    """torchrun -> its process group; plain python -> a 1-rank group (same code path)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        # Bound before the process group exists, and named to it, so NCCL never guesses the
        # device (a guessed device 0 on every rank hangs or crowds one GPU).
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if cuda else {}
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo", **kwargs)
    else:
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return dist.get_rank(), dist.get_world_size(), device


def build_model(cfg, mcfg, device):
    """meta -> compile blocks -> FSDP2 blocks + root -> to_empty -> γ-init (torchtitan's order).
    Building on meta never allocates the full model on one rank; the init fills each rank's
    shard from the same full tensors, so the weights do not depend on the world size."""
    with torch.device("meta"):
        net = GPT(mcfg)
    if cfg["compile"]:
        for block in net.layers:
            block.compile()  # in place: parameter names (and so checkpoints) don't change
    # bf16 params with fp32 gradient reduction on CUDA; fp32 on CPU, where bf16 matmuls are
    # ~70x slower and exact-resume / cross-world-size tests need fp32.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    for i, block in enumerate(net.layers):
        # The last block is needed again right away by backward: don't free its params.
        fully_shard(block, mp_policy=mp, reshard_after_forward=i < len(net.layers) - 1)
    fully_shard(net, mp_policy=mp)
    net.to_empty(device=device)
    report = init_model_(net, gamma=cfg["gamma"], seed=cfg["seed"], overrides=cfg["init_overrides"] or None)
    return net, report


def param_groups(net, cfg):
    """matrix: weights inside blocks (incl. MoE experts and router); embed: tok_emb and lm_head;
    norm: 1-d gains. Each group has its own decoupled weight decay (the γ=1 recipe pairs small
    init with larger decay on matrices, so it is swept per group)."""
    groups = {name: [] for name in cfg["weight_decay"]}
    for name, p in net.named_parameters():
        kind = "norm" if p.dim() < 2 else "embed" if name.startswith(("tok_emb.", "lm_head.")) else "matrix"
        groups[kind].append(p)
    return [{"name": k, "params": ps, "weight_decay": cfg["weight_decay"][k]} for k, ps in groups.items() if ps]


def make_optimizer(net, cfg, device):
    return torch.optim.AdamW(param_groups(net, cfg), lr=cfg["lr"], betas=cfg["betas"], eps=cfg["adam_eps"],
                             fused=device.type == "cuda")


# ----------------------------------------------------------------------------- checkpoints
# Settings that may change between a checkpoint and its resumption: how the same model is run.
RUNTIME_MODEL_FIELDS = {"attn_backend", "activation_checkpointing", "moe_impl"}


def check_resumable(path, mcfg):
    saved = read_json(os.path.join(path, "meta.json"))["model_config"]
    # A field added to GPTConfig after the checkpoint was written (e.g. norm) counts as its
    # default there: the code that wrote it had no other behaviour.
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    saved = {**{k: v for k, v in defaults.items() if k not in saved}, **saved}
    changed = [f"{k} {saved.get(k)!r} there, {v!r} now" for k, v in asdict(mcfg).items()
               if k not in RUNTIME_MODEL_FIELDS and saved.get(k) != v]
    if changed:
        raise SystemExit(f"{path} holds a different model ({'; '.join(changed)}): resume with its settings "
                         f"or choose another out_dir")


def save_checkpoint(cfg, step, net, opt, loader, meta):
    rank = dist.get_rank()
    name = f"ckpt_{step:08d}"
    tmp, final = os.path.join(cfg["out_dir"], "tmp_" + name), os.path.join(cfg["out_dir"], name)
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    # RNG streams differ per rank, so they can't be DCP entries (which are deduplicated).
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    with open(os.path.join(tmp, f"rng_rank{rank}.pt"), "wb") as f:
        torch.save(rng, f)
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()  # every rank's shards are on disk before the folder becomes visible
    if rank == 0:
        write_json(os.path.join(tmp, "meta.json"), {
            **meta, "step": step, "world_size": dist.get_world_size(), "data_state": loader.state_dict()})
        os.rename(tmp, final)
        done = complete_checkpoints(cfg["out_dir"])
        for old in done[:-cfg["keep_last"]]:
            old_step = int(os.path.basename(old)[5:])
            if not (cfg["keep_every"] and old_step % cfg["keep_every"] == 0) and old_step not in cfg["keep_steps"]:
                shutil.rmtree(old)
    dist.barrier()
    return final


def load_checkpoint(path, net, opt, loader, cfg_weight_decay):
    model_sd, optim_sd = get_state_dict(net, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)  # DCP reshards when the world size changed
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for group in opt.param_groups:  # the config's weight decay wins over the checkpoint's (sweeps)
        group["weight_decay"] = cfg_weight_decay[group["name"]]
    meta = read_json(os.path.join(path, "meta.json"))
    try:
        loader.load_state_dict(meta["data_state"])
    except ValueError as e:
        raise SystemExit(f"resume from {path}: {e}")
    rng_file = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    if meta["world_size"] == dist.get_world_size():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta


def export(ckpt_dir, out_file):
    """DCP folder -> one torch.save file with the full fp32 model; no process group needed."""
    if not os.path.isfile(os.path.join(ckpt_dir, "meta.json")):
        raise SystemExit(f"export: {ckpt_dir} is not a complete checkpoint folder (no meta.json); "
                         f"pass an out_dir/ckpt_XXXXXXXX folder")
    net, info = load_model(ckpt_dir)  # eval.py's one loading path: one process reads every shard
    payload = {"model": net.state_dict(), **{k: info[k] for k in ("model_config", "config", "step", "data_meta")}}
    tmp = out_file + ".tmp"
    torch.save(payload, tmp)
    os.replace(tmp, out_file)
    print(f"exported {ckpt_dir} (step {info['step']}) -> {out_file}")


def read_json(path):
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- measurement
def memory_estimate(net, mcfg, cfg, world, accum):
    """Bytes per GPU on CUDA (bf16 compute), roughly: sharded fp32 state + gathered blocks +
    activations + logits."""
    n = sum(p.numel() for p in net.parameters())
    compiled = cfg["compile"]
    embed = sum(p.numel() for name, p in net.named_parameters() if name.startswith(("tok_emb.", "lm_head.")))
    per_block = (n - embed) / mcfg.n_layer
    act = 2  # bytes per bf16 activation value
    tokens = cfg["batch_size"] * cfg["seq_len"]
    parts = {
        "params+grads+adam (fp32, sharded)": 16 * n / world,
        # root params (embeddings/head) and ~2 blocks (current + prefetched) all-gathered
        "gathered params": act * (embed + 2 * per_block),
        # Bytes saved for backward per token, d_model and layer (no T x T scores: flex/sdpa are
        # fused): ~34 with compiled blocks (Korthikanti et al.'s ~17 bf16 values), ~61 eager
        # (measured on this model). With checkpointing each block keeps its input, plus one
        # block's activations while it is recomputed.
        "activations": tokens * mcfg.d_model * (
            act * mcfg.n_layer + (34 if compiled else 61) if mcfg.activation_checkpointing
            else (34 if compiled else 61) * mcfg.n_layer),
        # bf16 logits, their fp32 copy for the loss, and fp32 softmax + gradient in its backward
        "logits (+fp32 loss copy, grads)": tokens * mcfg.vocab_size * (act + 4 + 4 + 4),
    }
    if accum > 1:  # with sync off FSDP2 keeps unsharded fp32 gradients between micro-steps
        parts["unsharded grads (accumulation)"] = 4 * n
    return parts


def matmul_peak(cfg, device):
    """Peak FLOP/s of one device for MFU: peak_flops if set; H100/H200 bf16 dense from the
    datasheet; on CPU the fp32 matmul rate measured here (what this CPU's matmuls reach now,
    so MFU says how much of it the model uses). 0: unknown, MFU not reported."""
    if cfg["peak_flops"]:
        return cfg["peak_flops"]
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if "H100" in name and "PCIe" in name:
            return 756e12
        if "H100" in name and "NVL" in name:
            return 835e12
        return 989e12 if re.search(r"H100|H200", name) else 0.0  # SXM parts
    a = torch.randn(512, 512)
    a @ a  # warm-up
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.2:
        a @ a
        n += 1
    return 2 * 512**3 * n / (time.perf_counter() - start)


@torch.no_grad()
def weight_structure(net, names):
    """Stable rank ||W||_F^2 / ||W||_2^2 and row-cosine statistics (eval.py's definitions) of a
    few matrices: the condensation signal (γ=1 should show high cosine / low rank early that
    later relaxes)."""
    params = dict(net.named_parameters())
    out = {}
    for name in names:
        w = params[name]
        w = w.full_tensor() if isinstance(w, DTensor) else w  # collective: all ranks
        if w.dim() == 3:
            w = w[0].T  # stacked experts (E, d_in, d_out): expert 0, one row per neuron
        out[name] = {"stable_rank": stable_rank(w), **cosine_stats(row_cosines(w))}
    return out


@torch.no_grad()
def evaluate(net, loader, cfg, device):
    """Token-weighted validation loss over eval_batches fixed global batches (same every time)."""
    loader.epoch, loader.pos = 0, 0  # rewound: every evaluation scores the same batches
    total = torch.zeros(2, device=device)
    net.eval()
    for _ in range(cfg["eval_batches"]):
        x, y = loader.next_batch()
        for xb, yb in zip(x.split(cfg["batch_size"]), y.split(cfg["batch_size"])):
            _, loss = net(xb.to(device), yb.to(device))
            n = (yb != -1).sum()
            if n:
                total += torch.stack([loss.float() * n, n.to(total)])
    net.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def open_loader(cfg, split, rank, world):
    """This rank's share of each global batch: grad_accum micro-batches. The loader's position
    counts windows of the global order, so the data order depends only on (seed, global_batch),
    never on the world size or micro-batch size: resuming on another world size, 1 vs N ranks
    and 1x4 vs 4x1 accumulation all see the same tokens in each step."""
    try:
        return TokenLoader(cfg["data_dir"], split, cfg["global_batch"] // world, cfg["seq_len"],
                           rank=rank, world_size=world, seed=cfg["seed"])
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"data: {e}")


# ----------------------------------------------------------------------------- main
def log0(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def print_plan(cfg, world):
    mcfg = model_config(cfg, "cuda")
    with torch.device("meta"):
        net = GPT(mcfg)
    accum = grad_accum(cfg, world)
    counts = net.num_params()
    tokens_step = cfg["global_batch"] * cfg["seq_len"]
    fpt = net.flops_per_token(cfg["seq_len"])
    mem = memory_estimate(net, mcfg, cfg, world, accum)
    print(f"model {cfg['model_size']}: {counts['total']:,} params ({counts['active']:,} active, "
          f"{counts['embedding']:,} embedding); {mcfg.n_layer} layers, d_model {mcfg.d_model}, "
          f"{mcfg.n_head} heads, gate {mcfg.attn_gate}, norm_eps {mcfg.norm_eps:g}, gamma {cfg['gamma']}")
    print(f"world {world}: batch {cfg['batch_size']} x {cfg['seq_len']} per rank, grad_accum {accum}, "
          f"{tokens_step:,} tokens/step, {cfg['max_steps']:,} steps = {tokens_step * cfg['max_steps']:,} tokens")
    print(f"FLOPs/token {fpt:.4g}; total {fpt * tokens_step * cfg['max_steps']:.3g} FLOPs")
    for part, b in mem.items():
        print(f"  {part:<36} {b / 2**30:8.2f} GiB")
    print(f"memory/GPU (estimate, bf16 on CUDA)     {sum(mem.values()) / 2**30:8.2f} GiB")
    return {"params": counts, "tokens_per_step": tokens_step, "grad_accum": accum,
            "flops_per_token": fpt, "memory_bytes": sum(mem.values())}


def train(cfg):
    rank, world, device = setup_distributed()
    torch.manual_seed(cfg["seed"])
    accum = grad_accum(cfg, world)
    mcfg = model_config(cfg, device.type)
    loader = open_loader(cfg, "train", rank, world)
    val_loader = open_loader(cfg, "val", rank, world)  # opened now: a missing split fails at start
    data_meta = loader.meta
    try:
        check_model_vocab(data_meta, mcfg.vocab_size)
    except ValueError as e:
        raise SystemExit(f"data: {e}")
    if mcfg.doc_mask and mcfg.eot_id != data_meta["eot_id"]:
        raise SystemExit(f"config: model.eot_id={mcfg.eot_id} but {cfg['data_dir']} ends documents with "
                         f"{data_meta['eot_id']}: set --model.eot_id={data_meta['eot_id']}")
    out = cfg["out_dir"]
    # Rank 0 lists the checkpoints and tells the others: on a shared filesystem another node's
    # stale directory cache could otherwise pick a different one (or none) and hang the job.
    listing = [complete_checkpoints(out) if rank == 0 else None]
    dist.broadcast_object_list(listing, src=0)
    done = listing[0]
    if done and not cfg["resume"]:
        raise SystemExit(f"{out} already holds checkpoints ({os.path.basename(done[-1])}); "
                         f"pass --resume=True or choose another out_dir")
    net, init_report = build_model(cfg, mcfg, device)
    opt = make_optimizer(net, cfg, device)
    names = dict(net.named_parameters())
    # MoE expert weights are bare (E, d_in, d_out) parameters: "mlp.w_up.weight" -> "mlp.w_up"
    track = [n if n in names else n.removesuffix(".weight")
             for n in (n.format(last=mcfg.n_layer - 1) for n in cfg["track_weights"])]
    for n in track:
        if n not in names:
            raise _unknown(n, names, "track_weights")
    step = 0
    if rank == 0:  # multi-node: out_dir must be on a filesystem every node sees (rank 0 renames)
        os.makedirs(out, exist_ok=True)
        for stale in glob.glob(os.path.join(out, "tmp_ckpt_*")):
            shutil.rmtree(stale)  # left by a run killed while saving
    dist.barrier()
    if done:
        check_resumable(done[-1], mcfg)
        meta = load_checkpoint(done[-1], net, opt, loader, cfg["weight_decay"])
        step = meta["step"]
        log0(f"resumed from {done[-1]} at step {step}")
        if meta["world_size"] != world:
            log0(f"world size {meta['world_size']} -> {world}: DCP resharded model and optimizer; the "
                 f"data order is unchanged (global batches), grad_accum is now {accum}, per-rank RNG "
                 f"streams restart from seed, and float reductions run in a different order")
    meta_common = {"config": cfg, "model_config": asdict(mcfg), "data_meta": data_meta}
    metrics_path = os.path.join(out, "metrics.jsonl")
    if rank == 0:
        log0(json.dumps(cfg, indent=1))
        write_json(os.path.join(out, "config.json"), cfg)
        if step == 0:
            log0(format_report(init_report))
        truncate_metrics(metrics_path, step if done else -1)  # no checkpoint: everything is redone
    metrics = open(metrics_path, "a") if rank == 0 else None

    def record(row):
        if rank == 0:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

    def evaluate_and_record():
        val = evaluate(net, val_loader, cfg, device)
        row = {"step": step, "val_loss": val, "weights": weight_structure(net, track)}
        log0(f"step {step}: val loss {val:.4f}")
        record(row)

    peak = matmul_peak(cfg, device)
    log0(f"MFU against a peak of {peak / 1e12:.3g} TFLOP/s per device" if peak else
         f"MFU not reported: unknown peak for {torch.cuda.get_device_name(device)}; set --peak_flops")
    fpt = net.flops_per_token(cfg["seq_len"])
    tokens_step = cfg["global_batch"] * cfg["seq_len"]
    last_ckpt = done[-1] if done else None
    if step == 0:
        evaluate_and_record()
        if 0 in cfg["keep_steps"]:
            last_ckpt = save_checkpoint(cfg, step, net, opt, loader, meta_common)
            log0(f"saved {last_ckpt} (the init)")
    train_time, step_log, time_log = 0.0, step, 0.0  # training time only: no eval/checkpoints
    while step < cfg["max_steps"]:
        t0 = time.time()
        lr = lr_at(cfg, step)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = loader.next_batch()
        n_total = (y != -1).sum().to(device)
        dist.all_reduce(n_total)  # loss tokens in the global batch
        loss_sum = torch.zeros((), device=device)
        aux_sum = torch.zeros((), device=device)  # MoE balance loss, averaged like the LM loss
        for m, (xb, yb) in enumerate(zip(x.split(cfg["batch_size"]), y.split(cfg["batch_size"]))):
            # FSDP2: reduce-scatter gradients only after the last micro-step.
            net.set_requires_gradient_sync(m == accum - 1)
            _, loss = net(xb.to(device, non_blocking=True), yb.to(device, non_blocking=True))
            if step + 1 == cfg["debug_nan_step"]:
                loss = loss * float("nan")
            # Weight by this micro-batch's share of the global batch's loss tokens: the update is
            # then the gradient of the global token mean for any split. FSDP averages over ranks,
            # so undo that division with * world.
            share = (yb != -1).sum().to(device) / n_total
            (loss * share * world).backward()
            loss_sum += loss.detach() * share
            if net.aux_loss is not None:
                aux_sum += net.aux_loss / (accum * world)
        dist.all_reduce(loss_sum)
        dist.all_reduce(aux_sum)
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # sum of the shards' squares over ranks: the global norm
        if cfg["grad_clip"] > 0:
            torch.nn.utils.clip_grads_with_norm_(grads, cfg["grad_clip"], norm)
        loss_val, norm_val = torch.stack([loss_sum, norm.to(loss_sum)]).tolist()  # one sync per step
        if not (math.isfinite(loss_val) and math.isfinite(norm_val)):
            raise SystemExit(f"non-finite loss {loss_val} / grad norm {norm_val} at step {step + 1}; the "
                             f"update was not applied. Last good checkpoint: {last_ckpt or 'none'} (intact). "
                             f"Resume from it with a lower lr, longer warmup or tighter grad_clip.")
        opt.step()
        opt.zero_grad(set_to_none=True)
        moe_counts = net.update_moe_bias(all_reduce=dist.all_reduce)
        step += 1
        train_time += time.time() - t0
        if step % cfg["log_interval"] == 0 or step == cfg["max_steps"]:
            tps = tokens_step * (step - step_log) / (train_time - time_log)
            eta = (cfg["max_steps"] - step) * tokens_step / tps
            row = {"step": step, "loss": loss_val, "lr": lr, "grad_norm": norm_val, "tokens_per_s": tps,
                   "mfu": fpt * tps / (peak * world) if peak else None, "mem_gib": memory_used(device),
                   "eta_s": eta, "tokens": step * tokens_step}
            if moe_counts is not None:
                load = moe_counts.float() / moe_counts.sum(-1, keepdim=True) * moe_counts.shape[-1]
                row.update(expert_load=load.tolist(), aux_loss=aux_sum.item())
            mfu = f"{row['mfu']:.1%}" if peak else "n/a"
            moe = f" expert load max {load.max():.2f} aux {row['aux_loss']:.3g}" if moe_counts is not None else ""
            log0(f"step {step}/{cfg['max_steps']} loss {loss_val:.4f} lr {lr:.3g} grad norm {norm_val:.3g} "
                 f"{tps:,.0f} tok/s mfu {mfu} mem {row['mem_gib']:.2f} GiB eta {eta / 60:.1f} min{moe}")
            record(row)
            step_log, time_log = step, train_time
        if step % cfg["eval_interval"] == 0 or step == cfg["max_steps"]:
            evaluate_and_record()
        if step % cfg["ckpt_interval"] == 0 or step == cfg["max_steps"] or step in cfg["keep_steps"]:
            last_ckpt = save_checkpoint(cfg, step, net, opt, loader, meta_common)
            log0(f"saved {last_ckpt}")
    if metrics:
        metrics.close()


def memory_used(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS, KiB on Linux


def truncate_metrics(path, step):
    """On resume, drop rows the killed run wrote after its last checkpoint: they are redone."""
    if not os.path.exists(path):
        return
    rows = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    rows.append(line)
            except (json.JSONDecodeError, KeyError):
                pass  # the half-written last row of a killed run
    with open(path + ".tmp", "w") as f:
        f.writelines(rows)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["export"]:
        if len(sys.argv) != 4:
            raise SystemExit("usage: python train.py export <ckpt_dir> <file.pt>")
        export(sys.argv[2], sys.argv[3])
    else:
        config = load_config(sys.argv[1:])
        if config["dry_run"]:
            print_plan(config, config["dry_run"])
        else:
            try:
                train(config)
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
