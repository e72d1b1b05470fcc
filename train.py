"""
Pretrain a GPT from model.py with γ-init (init.py) on token shards from prepare_data.py.

    python train.py config/tiny_bytes.py                        # CPU, one process
    python train.py config/tiny_bytes.py --lr=3e-3 --model.norm_eps=1e-5
    torchrun --nproc_per_node=8 train.py config/gamma1_1p5b.py  # one node, FSDP2
    python train.py config/gamma1_1p5b.py --dry_run=8           # plan for 8 GPUs, no GPU needed
    python train.py export out/run/ckpt_00001000 model.pt       # consolidated single file
    python train.py export out/run/ckpt_00001000 hf_dir --format hf   # HF transformers folder

Configuration: the module-level names below are the defaults; each config file given on the
command line is executed over them; then `--key=value` (a Python literal, else a string) and
`--key.item=value` (one entry of a dict setting) override. Unknown names and wrong types fail.
In a config file, names starting with _ are its own helpers and include("other.py") runs
another config file (beside it) in place, so a pair of configs can differ in three lines.
One code path: a single process is a 1-rank process group, so FSDP2, DCP checkpoints and the
data order are the same for 1 CPU process and for 64 GPUs.
"""

import argparse
import ast
import builtins
import copy
import difflib
import errno
import fcntl
import glob
import importlib.util
import json
import math
import os
import re
import resource
import shutil
import socket
import sys
import time
import traceback
import warnings
import zipfile
from dataclasses import asdict, fields

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from init import format_report
from model import ATTN_BACKENDS, GPT, GPTConfig, config_for, cosine_stats, init_model_, row_cosines, stable_rank
from prepare_data import (TokenLoader, atomic_open, atomic_write_bytes, check_model_vocab, check_token_ids, cpu_name,
                          data_fingerprint, read_json, write_json)

# ----------------------------------------------------------------------------- defaults
_IMPORTED = set(globals())  # the settings are the names assigned below, not every public name imported above
# run folder and data
out_dir = "out/run"             # the run folder: config.json, metrics.jsonl, ckpt_*
data_dir = "data/bytes"         # a prepare_data.py output folder
resume = True                   # continue from the newest complete checkpoint in out_dir
allow_resume_changes = False    # a resumed run must be the same experiment: a changed gamma, seed,
                                # data, schedule... is an error naming each change, unless this is
                                # True (the changes are then logged in metrics.jsonl)
seed = 0                        # init and data order
# model: a named size from model.SIZES plus GPTConfig fields over it
model_size = "tiny"             # a key of model.SIZES
model = {}                      # GPTConfig fields over the size, e.g. {"norm_eps": 1e-5, "attn_gate": "none"}
gamma = 1.0                     # every weight ~ N(0, d_in^-2γ)
init_overrides = {}             # {regex on parameter name: γ}, e.g. {r"^lm_head\.": 0.5} (a tied
                                # head is tok_emb.weight: match r"^tok_emb\." instead)
attn_backend = "auto"           # "auto": flex on CUDA, sdpa on CPU (Flex has no CPU backward)
compile = False                 # torch.compile each block (~30 s on CPU, minutes at 1.5B)
# batch: the global batch is fixed; grad_accum = global_batch / (batch_size * world_size)
seq_len = 256                   # tokens per sequence
global_batch = 32               # sequences per optimizer step, all ranks together
batch_size = 32                 # sequences per forward on one rank (micro-batch)
max_steps = 1000                # optimizer steps
# optimizer: AdamW with one parameter group per kind of parameter
lr = 1e-3                       # peak learning rate, reached after warmup_steps
betas = (0.9, 0.95)             # AdamW's moment decays
adam_eps = 1e-8                 # AdamW's denominator floor
weight_decay = {"matrix": 0.1, "embed": 0.0, "norm": 0.0}   # decoupled, times lr
grad_clip = 1.0                 # max global grad norm; 0 disables clipping (norm still logged)
schedule = "cosine"             # "cosine" | "wsd" (warmup-stable-decay)
warmup_steps = 100              # linear warmup from 0
min_lr_ratio = 0.1              # final lr = lr * min_lr_ratio
decay_frac = 0.2                # wsd: the last decay_frac of the steps decay linearly
# logging, evaluation, checkpoints
log_interval = 10               # steps between log lines and metrics.jsonl rows (and after step 1)
eval_interval = 200             # validation loss + weight-structure metrics
eval_batches = 8                # global batches of the validation split per evaluation
track_weights = ["layers.0.attn.wq.weight", "layers.0.mlp.w_up.weight",
                 "layers.{last}.attn.wq.weight", "layers.{last}.mlp.w_up.weight"]
                                # matrices whose row cosine and stable rank each evaluation logs
ckpt_interval = 500             # steps between checkpoints
keep_last = 2                   # checkpoints kept, newest first ...
keep_every = 0                  # ... plus every keep_every-th step forever (0: none)
keep_steps = []                 # ... plus these steps, saved and kept whatever the interval: the
                                # "condense then expand" trajectory (eval.py weights) happens early,
                                # e.g. [0, 100, 300, 1000, 3000]; 0 is the init
# live curves beside metrics.jsonl (rank 0): every field of its rows, optional packages
tensorboard_dir = ""            # a torch.utils.tensorboard log folder ("": none)
wandb_log = False               # Weights & Biases; WANDB_MODE=offline writes the run locally
wandb_project = "smallinit"     # the W&B project
wandb_run_name = ""             # "": the out_dir's name
peak_flops = 0.0                # per device for MFU; 0: 989e12 on H100/H200, a measured fp32 peak on CPU
dry_run = 0                     # N > 0: print the plan for N ranks and exit (no data, no GPU)
debug_nan_step = 0              # test knob: poison the loss at this step (0: never)
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items()
            if k not in _IMPORTED and not k.startswith("_") and type(v) in (int, float, bool, str, list, tuple, dict)}
SCHEDULES = ("cosine", "wsd")


def _check_type(key, value, default):
    want = type(default)
    if want is float and type(value) is int:
        return float(value)
    if type(value) is float and not math.isfinite(value):  # 1e999 parses as inf: no setting means that
        raise ValueError(f"config: {key}={value!r} is not a finite number")
    if type(value) is not want:
        raise ValueError(f"config: {key}={value!r} is a {type(value).__name__}, expected a "
                         f"{want.__name__} like the default {default!r}")
    return value


# Names other training scripts (nanoGPT, HF Trainer) use for settings that are spelled
# differently here: difflib can't see that learning_rate is lr.
ALIASES = {"learning_rate": "lr", "max_iters": "max_steps", "warmup_iters": "warmup_steps", "block_size": "seq_len",
           "batch": "batch_size", "micro_batch_size": "batch_size", "gradient_accumulation_steps": "global_batch",
           "wd": "weight_decay", "eps": "adam_eps", "beta1": "betas", "beta2": "betas", "grad_norm_clip": "grad_clip",
           "eval_iters": "eval_batches", "n_layer": "model.n_layer", "n_head": "model.n_head",
           "n_embd": "model.d_model", "d_model": "model.d_model", "init_std": "gamma"}


def _unknown(key, valid, where):
    close = [ALIASES[key]] if key in ALIASES else difflib.get_close_matches(key, list(valid), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"config: unknown key {key!r} in {where}{hint}")


def _set(cfg, key, value, where, merge_dicts=False):
    head, _, item = key.partition(".")
    if head not in DEFAULTS:
        raise _unknown(head, DEFAULTS, where)
    default = DEFAULTS[head]
    if item:
        # `--weight_decay.matrix=0.3` sets one entry and keeps the others (replacing the
        # whole dict from the command line would silently drop them).
        if type(default) is not dict:
            raise ValueError(f"config: {head} is not a dict setting: write --{head}=...")
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


def parse_value(text):
    """A --key=value's value: a Python literal, else the text itself (--out_dir=out/x needs no quotes)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def usage():
    """--help: how to call train.py, then every setting with its default and the comment beside it
    in the defaults block above (read from this file, so the help is the code's own documentation)."""
    with open(__file__) as f:
        block = f.read().split("# " + "-" * 77 + " defaults\n")[1].split("\n# ---")[0]
    lines = [__doc__.strip().split("\n\n")[0], "",
             "usage: python train.py [CONFIG.py ...] [--key=value ...]",
             "       torchrun --nproc_per_node=N train.py CONFIG.py [--key=value ...]",
             "       python train.py export CKPT OUT [--format pt|hf]   (python train.py export --help)", "",
             "Config files run in order over the defaults below, then --key=value (a Python literal, else a",
             "string) and --key.item=value (one entry of a dict setting) override them. Settings, with defaults:"]
    for line in block.splitlines():
        name, eq, rest = line.partition(" = ")
        if line.startswith("# "):  # a group of settings
            lines += ["", line[2:]]
        elif eq and name in DEFAULTS:
            lines.append(f"  {name}={DEFAULTS[name]!r}  {rest.partition('#')[2].strip()}".rstrip())
        elif line.lstrip().startswith("# "):  # a comment continued under its setting
            lines[-1] += " " + line.strip()[2:]
    return "\n".join(lines)


def load_config(argv):
    """Defaults <- config files (in order) <- --key=value overrides; validated."""
    cfg = copy.deepcopy(DEFAULTS)
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if not eq:
                text = "True"  # a bare --flag
            _set(cfg, key, parse_value(text), "the command line", merge_dicts=True)
        else:
            if not os.path.isfile(arg):
                raise FileNotFoundError(f"config: no such config file {arg!r} (arguments are config "
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
    resolved beside the includer. (builtins.compile: the setting `compile` shadows the name.)
    A broken file is one line naming the file and line, not the traceback of exec."""
    if not os.path.isfile(path):
        raise ValueError(f"config: no such config file {path!r} (include() resolves names beside the including file)")
    with open(path) as f:
        text = f.read()
    try:
        code = builtins.compile(text, path, "exec")
    except SyntaxError as e:
        raise ValueError(f"config: {path}:{e.lineno}: syntax error: {e.msg}") from None
    try:
        exec(code, ns)
    except Exception as e:
        if str(e).startswith("config: "):
            raise  # an include() of a missing or broken file: already one line naming it
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == path), "?")
        raise ValueError(f"config: {path}:{line}: {type(e).__name__}: {e}") from None


def validate(cfg):
    if cfg["schedule"] not in SCHEDULES:
        raise ValueError(f"config: schedule={cfg['schedule']!r}: choose one of {SCHEDULES}")
    if cfg["attn_backend"] not in ("auto", *ATTN_BACKENDS):
        raise ValueError(f"config: attn_backend={cfg['attn_backend']!r}: choose one of auto, {', '.join(ATTN_BACKENDS)}")
    for key in ("seq_len", "global_batch", "batch_size", "max_steps", "log_interval",
                "eval_interval", "eval_batches", "ckpt_interval", "keep_last"):
        if cfg[key] < 1:
            raise ValueError(f"config: {key}={cfg[key]} must be >= 1")
    for key in ("warmup_steps", "keep_every", "dry_run", "peak_flops", "grad_clip"):
        if cfg[key] < 0:
            raise ValueError(f"config: {key}={cfg[key]} must be >= 0")
    if not cfg["adam_eps"] > 0:  # 0: a parameter whose gradient is 0 gets the update 0/0 = NaN
        raise ValueError(f"config: adam_eps={cfg['adam_eps']} must be > 0 (e.g. 1e-8)")
    if not all(type(s) is int and 0 <= s <= cfg["max_steps"] for s in cfg["keep_steps"]):
        raise ValueError(f"config: keep_steps={cfg['keep_steps']} must be whole steps between 0 and max_steps")
    if not cfg["warmup_steps"] < cfg["max_steps"]:
        raise ValueError(f"config: warmup_steps={cfg['warmup_steps']} must be < max_steps={cfg['max_steps']}")
    if not cfg["lr"] > 0:
        raise ValueError(f"config: lr={cfg['lr']} must be > 0")
    for key in ("min_lr_ratio", "decay_frac"):
        if not 0 <= cfg[key] <= 1:
            raise ValueError(f"config: {key}={cfg[key]} must be between 0 and 1")
    if len(cfg["betas"]) != 2 or not all(0 <= b < 1 for b in cfg["betas"]):
        raise ValueError(f"config: betas={cfg['betas']} must be two numbers in [0, 1), e.g. (0.9, 0.95)")
    if any(v < 0 for v in cfg["weight_decay"].values()):
        raise ValueError(f"config: weight_decay={cfg['weight_decay']} must be >= 0 in every group")
    for key, package in (("tensorboard_dir", "tensorboard"), ("wandb_log", "wandb")):
        if cfg[key] and importlib.util.find_spec(package) is None:  # fail now, not at the first log
            raise ValueError(f"config: {key}={cfg[key]!r} needs the {package} package: pip install {package}")
    mcfg = model_config(cfg, "cpu")  # unknown size / GPTConfig field / bad value fails here, no GPU needed
    if cfg["seq_len"] > mcfg.max_seq_len:
        raise ValueError(f"config: seq_len={cfg['seq_len']} > the model's max_seq_len={mcfg.max_seq_len}: "
                         f"lower seq_len or set --model.max_seq_len={cfg['seq_len']}")


def model_config(cfg, device_type):
    backend = cfg["attn_backend"]
    if backend == "auto":
        backend = "flex" if device_type == "cuda" else "sdpa"
    try:
        return config_for(cfg["model_size"], **{"attn_backend": backend, **cfg["model"]})
    except (ValueError, TypeError) as e:
        raise ValueError(f"config: model_size={cfg['model_size']!r}, model={cfg['model']}: {e}") from None


def grad_accum(cfg, world):
    per_step = cfg["batch_size"] * world
    if cfg["global_batch"] % per_step:
        raise ValueError(f"config: global_batch={cfg['global_batch']} is not a multiple of "
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


def steps_due(first, last, interval, extra=()):
    """How many steps in [first, last] are a multiple of interval, the last one, or in extra:
    the evaluations (or checkpoints) still to run."""
    return (last // interval - (first - 1) // interval + (last % interval != 0)
            + len({s for s in extra if first <= s < last and s % interval}))


def eta_seconds(cfg, step, step_s, spent):
    """Time left after the update that produced `step`: the remaining steps at step_s each, plus
    the evaluations and checkpoints still due (this step's too: they run after its log line) at
    their mean duration so far (spent: lists of seconds; none counted until one was timed)."""
    mean = {k: sum(v) / len(v) if v else 0.0 for k, v in spent.items()}
    last = cfg["max_steps"]
    return ((last - step) * step_s + steps_due(step, last, cfg["eval_interval"]) * mean["eval_s"]
            + steps_due(step, last, cfg["ckpt_interval"], cfg["keep_steps"]) * mean["ckpt_s"])


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
# The checkpoint format, its writer and its one reader (eval.py and export load through
# load_model). A checkpoint is a folder out_dir/ckpt_{step:08d} holding DCP's shards and
# .metadata index (model + optimizer), one rng_rank{r}.pt per rank, and meta.json (config,
# model_config, data_meta, step, world_size, the loader's data_state). It is written as tmp_...
# and renamed only when every part is on disk.

# Settings that may change between a checkpoint and its resumption: how the same model is run.
RUNTIME_MODEL_FIELDS = {"attn_backend", "activation_checkpointing", "moe_impl"}


class RunDirError(Exception):
    """The run folder can't be used as asked: locked by another run, or a resume that would
    change the experiment. One line naming the problem and the fix."""


def checkpoint_problem(path):
    """None if the checkpoint folder is complete, else what is wrong with it. Complete means
    meta.json and DCP's .metadata parse, every byte range .metadata names is on disk, and each
    rank that saved left its rng file: a folder pruned or copied halfway fails one of these."""
    try:
        meta = read_json(os.path.join(path, "meta.json"))
    except FileNotFoundError:
        return "no meta.json"
    except (ValueError, UnicodeDecodeError) as e:
        return f"meta.json is not valid JSON ({e})"
    try:
        index = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        return "no .metadata (DCP's index)"
    except Exception as e:  # a truncated or foreign pickle: any unpickling error
        return f".metadata is unreadable ({type(e).__name__})"
    needed = {}
    for item in index.storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) < size:
            return f"{name} is truncated ({os.path.getsize(file)} of {size} bytes)"
    for r in range(meta.get("world_size", 1)):
        if not os.path.isfile(os.path.join(path, f"rng_rank{r}.pt")):
            return f"rng_rank{r}.pt is missing"
    return None


def scan_checkpoints(run_dir):
    """(complete, damaged): a run's complete ckpt_* folders oldest first, and [(path, problem)]
    for the others. A run killed while saving leaves a tmp_ folder and one killed while pruning
    a deleting_ folder, never a ckpt_ one; damage after that (a disk error, a partial copy) is
    caught by checkpoint_problem."""
    complete, damaged = [], []
    for path in sorted(glob.glob(os.path.join(run_dir, "ckpt_*"))):
        problem = checkpoint_problem(path)
        if problem:
            damaged.append((path, problem))
        else:
            complete.append(path)
    return complete, damaged


def complete_checkpoints(run_dir):
    return scan_checkpoints(run_dir)[0]


def prune_checkpoint(path):
    """Delete a checkpoint so that a kill at any moment leaves no half-deleted ckpt_ folder:
    renamed out of the ckpt_* namespace first (atomic), then removed; train.py clears leftover
    deleting_ folders at start."""
    trash = os.path.join(os.path.dirname(path), "deleting_" + os.path.basename(path))
    os.rename(path, trash)
    shutil.rmtree(trash)


def clear_leftovers(run_dir):
    """tmp_ckpt_* (killed while saving) and deleting_ckpt_* (killed while pruning). Only ever
    called under the run folder's lock: another run's tmp_ folder is its checkpoint in progress."""
    for stale in glob.glob(os.path.join(run_dir, "tmp_ckpt_*")) + glob.glob(os.path.join(run_dir, "deleting_ckpt_*")):
        shutil.rmtree(stale)


def lock_run_dir(run_dir):
    """An exclusive OS lock on run_dir/train.lock, held for the life of this process and released
    by the kernel when it dies (no stale lock after a crash or SIGKILL). The file says who holds
    it, for the error a second launch gets."""
    path = os.path.join(run_dir, "train.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 512).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunDirError(f"{run_dir} is in use by {holder}: wait for that run to end (or stop it), "
                          f"or choose another out_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"train.py pid {os.getpid()} on host {socket.gethostname()} "
                 f"(since {time.strftime('%Y-%m-%d %H:%M:%S')})\n".encode())
    return fd


def all_finite(net, opt):
    """True on every rank iff every parameter and optimizer-state tensor is finite: one fused
    max-abs per tensor list (local shards), one all-reduce. A NaN written by an update whose loss
    and gradient were finite (e.g. 0/0 in Adam) would otherwise be checkpointed as good."""
    local = [t.to_local() if isinstance(t, DTensor) else t
             for t in [*net.parameters(), *(v for st in opt.state.values() for v in st.values())]
             if torch.is_tensor(t) and t.is_floating_point()]
    local = [t.detach() for t in local if t.numel()]
    bad = torch.zeros((), device=next(net.parameters()).device)
    if local:
        bad = (~torch.stack(torch._foreach_norm(local, ord=float("inf"))).isfinite()).any().float()
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bad.item()


def check_resumable(path, mcfg):
    saved = read_json(os.path.join(path, "meta.json"))["model_config"]
    # A field added to GPTConfig after the checkpoint was written (e.g. norm) counts as its
    # default there: the code that wrote it had no other behaviour.
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    saved = {**{k: v for k, v in defaults.items() if k not in saved}, **saved}
    changed = [f"{k} {saved.get(k)!r} there, {v!r} now" for k, v in asdict(mcfg).items()
               if k not in RUNTIME_MODEL_FIELDS and saved.get(k) != v]
    if changed:
        raise ValueError(f"{path} holds a different model ({'; '.join(changed)}): resume with its settings "
                         f"or choose another out_dir")


# Settings that define the experiment (with the model, which check_resumable compares): resumed
# with another value, a run would become a different arm under the old one's name.
EXPERIMENT_KEYS = ("gamma", "init_overrides", "seed", "global_batch", "seq_len", "lr", "betas", "adam_eps",
                   "weight_decay", "grad_clip", "schedule", "warmup_steps", "max_steps", "min_lr_ratio", "decay_frac")


def experiment_changes(saved_meta, cfg, data_fp):
    """{setting: {"was", "now"}} between a checkpoint and this run. Data is compared by content
    (prepare_data.data_fingerprint), so a refilled folder of the same size is caught; checkpoints
    written before fingerprints existed are compared on settings only."""
    was, now = saved_meta["config"], json.loads(json.dumps(cfg))  # as saved: tuples are lists
    changes = {k: {"was": was.get(k), "now": now[k]} for k in EXPERIMENT_KEYS if was.get(k) != now[k]}
    if saved_meta.get("data_fingerprint") not in (None, data_fp):
        changes["data"] = {"was": saved_meta["data_fingerprint"][:12], "now": data_fp[:12]}
    return changes


def describe_changes(changes):
    return "; ".join(f"{k} {v['was']!r} there, {v['now']!r} now" for k, v in changes.items())


def save_checkpoint(cfg, step, net, opt, loader, meta, last_good):
    """Write ckpt_{step} (as tmp_, renamed when whole) and prune old ones. Refuses to save
    non-finite weights or optimizer state; a full disk is one line, the partial folder removed."""
    if not all_finite(net, opt):
        raise FloatingPointError(f"step {step}: parameters or optimizer state are not finite (NaN/Inf); not saved. "
                                 f"Last good checkpoint: {last_good or 'none'} (intact). Resume from it with a lower "
                                 f"lr, longer warmup or tighter grad_clip.")
    rank = dist.get_rank()
    name = f"ckpt_{step:08d}"
    tmp, final = os.path.join(cfg["out_dir"], "tmp_" + name), os.path.join(cfg["out_dir"], name)
    fresh_optimizer = not opt.state  # the init checkpoint: no update has run yet
    try:
        model_sd, optim_sd = get_state_dict(net, opt)
        if fresh_optimizer:
            # get_state_dict materialises AdamW's state by a zero-gradient step, which counts as
            # step 1: left in place, saving the init would shift every later bias correction.
            opt.state.clear()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
        # RNG streams differ per rank, so they can't be DCP entries (which are deduplicated).
        rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
        with atomic_open(os.path.join(tmp, f"rng_rank{rank}.pt")) as f:
            torch.save(rng, f)
        dist.barrier()  # every rank's shards are on disk before the folder becomes visible
        if rank == 0:
            write_json(os.path.join(tmp, "meta.json"), {
                **meta, "step": step, "world_size": dist.get_world_size(), "data_state": loader.state_dict()})
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        if not disk_full(e, cfg["out_dir"], local_state_bytes(net, opt)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(errno.ENOSPC, f"no space left on device while saving {tmp} "
                      f"({shutil.disk_usage(cfg['out_dir']).free:,} bytes free): not saved, its partial folder "
                      f"removed; {last_good or 'no earlier checkpoint'} is intact. Free space and resume") from None
    if rank == 0:
        if os.path.exists(final):  # a damaged one that resume fell back from: replaced
            prune_checkpoint(final)
        os.rename(tmp, final)
        # keep_last counts complete checkpoints (each .metadata read, ms apiece), so a damaged
        # newer folder never displaces a good older one
        done = complete_checkpoints(cfg["out_dir"])
        for old in done[:-cfg["keep_last"]]:
            old_step = int(os.path.basename(old)[5:])
            if not (cfg["keep_every"] and old_step % cfg["keep_every"] == 0) and old_step not in cfg["keep_steps"]:
                prune_checkpoint(old)
    dist.barrier()
    return final


def local_state_bytes(net, opt):
    """Bytes of this rank's parameters and optimizer state: about what its checkpoint shard needs."""
    tensors = [*net.parameters(), *(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))]
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def disk_full(error, folder, need_bytes):
    """Whether an exception from a save is the disk filling up. torch.save's writer loses the
    errno ("unexpected pos 704 vs 598"), so besides ENOSPC anywhere down the exception chain,
    less free space than one checkpoint needs counts as full."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        error = error.__cause__ or error.__context__
    return shutil.disk_usage(folder).free < need_bytes


def load_checkpoint(path, meta, net, opt, loader, cfg_weight_decay):
    """Load ckpt folder `path` (its meta.json already read as `meta`) into net, opt and loader."""
    model_sd, optim_sd = get_state_dict(net, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)  # DCP reshards when the world size changed
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if meta["step"] == 0:
        opt.state.clear()  # the init checkpoint's optimizer is fresh (see save_checkpoint)
    for group in opt.param_groups:  # the config's weight decay wins over the checkpoint's (sweeps)
        group["weight_decay"] = cfg_weight_decay[group["name"]]
    try:
        loader.load_state_dict(meta["data_state"])
    except ValueError as e:
        raise ValueError(f"resume from {path}: {e}") from None
    rng_file = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    if meta["world_size"] == dist.get_world_size():
        rng = torch.load(rng_file, weights_only=True)  # tensors only: a crafted pickle can't run code
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def find_checkpoints(path):
    """Checkpoint paths in a run folder (complete ckpt_* folders, step order), or [path] for a
    complete checkpoint folder or a file. Anything else is a one-line error saying what it is."""
    if not (os.path.isfile(path) or os.path.isdir(path)):
        raise FileNotFoundError(f"{path}: no such checkpoint file or folder")
    if os.path.isfile(path):
        return [path]
    if glob.glob(os.path.join(path, "*_000000.bin")):  # prepare_data.py's first shard of a split
        raise ValueError(f"{path} is a data folder (prepare_data.py output), not a checkpoint: pass a run folder, "
                         f"a ckpt_* folder or a .pt export")
    if os.path.exists(os.path.join(path, "meta.json")) or os.path.exists(os.path.join(path, ".metadata")):
        problem = checkpoint_problem(path)
        if problem:
            others = complete_checkpoints(os.path.dirname(os.path.abspath(path)))
            hint = f"complete ones beside it: {', '.join(os.path.basename(o) for o in others)}" if others else \
                "pass another checkpoint"
            raise ValueError(f"{path}: damaged or half-written checkpoint ({problem}); {hint}")
        return [path]
    found, damaged = scan_checkpoints(path)
    if not found:
        what = f"only damaged checkpoints ({damaged[-1][0]}: {damaged[-1][1]})" if damaged else "no ckpt_* folders"
        raise ValueError(f"{path}: {what}; pass a .pt export, a complete checkpoint folder or a run folder "
                         "written by train.py")
    return found


def load_model(path, device="cpu", attn_backend=None):
    """The one model-loading path (export and every analysis): (GPT in eval mode, info) where info holds
    the checkpoint's model_config, config, step and data_meta."""
    path = find_checkpoints(path)[-1]
    if os.path.isfile(path):
        if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; its error would only say "weights only"
            raise ValueError(f"{path}: not a torch file (no zip archive in it: random bytes or a truncated copy); "
                             "pass a .pt made by `python train.py export`, or a checkpoint folder")
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a damaged zip, a pickle with code in it
            raise ValueError(f"{path}: not a readable torch file ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                             "pass a .pt made by `python train.py export`, or a checkpoint folder") from None
        if not isinstance(blob, dict) or "model" not in blob or "model_config" not in blob:
            raise ValueError(f"{path}: not a smallinit export (needs 'model' and 'model_config'); "
                             "make one with `python train.py export <ckpt_dir> <file.pt>`")
        info = {k: v for k, v in blob.items() if k != "model"}
    else:
        info = read_json(os.path.join(path, "meta.json"))
    # Built on the meta device: the random init of GPT(cfg) would be overwritten anyway, and at
    # 1.5B it costs a minute and a full extra copy of the weights in host memory.
    with torch.device("meta"):
        net = GPT(GPTConfig(**info["model_config"]))
    net.to_empty(device=device)  # GPT.to_empty keeps tied embeddings tied
    net.reset_buffers()  # non-persistent buffers are not in the checkpoint
    if os.path.isfile(path):
        net.load_state_dict(blob["model"])
    else:
        # DCP fills the given tensors in place and reads only the keys asked for ("model.*",
        # not the optimizer); in a single process it needs no process group, and says so in a
        # warning that would only confuse here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            try:
                dcp.load({"model": net.state_dict()}, checkpoint_id=path)
            except (Exception, CheckpointException) as e:  # bytes damaged in place: the sizes were right, the contents not
                raise ValueError(f"{path}: its weights could not be read ({type(e).__name__}); the checkpoint is "
                                 f"damaged: pass another one") from None
    if attn_backend or (net.cfg.attn_backend == "flex" and not str(device).startswith("cuda")):
        # Flex kernels are CUDA-only here; sdpa shares its mask definition (model.py).
        net.set_attn_backend(attn_backend or "sdpa")
    info["path"] = path
    return net.eval(), info


def export(ckpt_dir, out_file):
    """DCP folder -> one torch.save file with the full fp32 model; no process group needed."""
    if not os.path.isfile(os.path.join(ckpt_dir, "meta.json")):
        raise ValueError(f"export: {ckpt_dir} is not a complete checkpoint folder (no meta.json); "
                         f"pass an out_dir/ckpt_XXXXXXXX folder")
    net, info = load_model(ckpt_dir)  # the one loading path: one process reads every shard
    payload = {"model": net.state_dict(), **{k: info[k] for k in ("model_config", "config", "step", "data_meta")}}
    with atomic_open(out_file) as f:
        torch.save(payload, f)
    print(f"exported {ckpt_dir} (step {info['step']}) -> {out_file}")


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
    """(peak FLOP/s of one device for MFU, where it came from): peak_flops if set; H100/H200 bf16
    dense from the datasheet; on CPU the best fp32 matmul rate this machine has shown (see
    cpu_matmul_peak). 0: unknown, MFU not reported."""
    if cfg["peak_flops"]:
        return cfg["peak_flops"], "peak_flops setting"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if "H100" in name and "PCIe" in name:
            return 756e12, f"{name} datasheet"
        if "H100" in name and "NVL" in name:
            return 835e12, f"{name} datasheet"
        return (989e12, f"{name} datasheet") if re.search(r"H100|H200", name) else (0.0, name)  # SXM parts
    return cpu_matmul_peak()


def cpu_matmul_peak(size=1024, trials=5, seconds=0.1):
    """The fp32 matmul rate of this CPU at this thread count: the best of several timed trials
    now, and the best ever seen here (cached per CPU model and thread count), whichever is
    higher. A single short timing reads low whenever a neighbour is busy, which inflates MFU;
    the machine's best is what its matmuls can reach. A local generator: drawing the operands
    must not move the global RNG that a resumed run has just restored."""
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
    a @ a  # warm-up
    now = 0.0
    for _ in range(trials):
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            a @ a
            n += 1
        now = max(now, 2 * size**3 * n / (time.perf_counter() - start))
    key = f"{cpu_name()} x{torch.get_num_threads()} threads"
    path = os.path.join(os.environ.get("SMALLINIT_CACHE", os.path.expanduser("~/.cache/smallinit")), "cpu_peak.json")
    try:
        cache = read_json(path)
    except (OSError, ValueError):
        cache = {}
    best = max(now, cache.get(key, 0.0))
    if best > cache.get(key, 0.0):
        try:
            write_json(path, {**cache, key: best})
        except OSError:
            pass  # a read-only home: the peak of this run is still measured
    return best, f"{key}: best seen on this machine, {now / 1e12:.3g} TFLOP/s measured now"


@torch.no_grad()
def weight_structure(net, names):
    """Stable rank ||W||_F^2 / ||W||_2^2 and row-cosine statistics (model.py's definitions) of a
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
        raise type(e)(f"data: {e}") from None


# ----------------------------------------------------------------------------- main
def log0(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def scalars(row, prefix=""):
    """(name, number) pairs of a metrics.jsonl row, nested keys joined by "/" (weights/<matrix>/
    stable_rank, expert_load/<layer>/<expert>); the step is the x axis, not a curve."""
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list)):
            yield from scalars(value if isinstance(value, dict) else dict(enumerate(value)), name + "/")
        elif isinstance(value, (int, float)) and name != "step":  # None: not measured (MFU)
            yield name, value


class Curves:
    """metrics.jsonl's rows as live curves in TensorBoard (tensorboard_dir) and/or wandb (wandb_log).
    metrics.jsonl stays the record; this only mirrors it, on rank 0."""

    def __init__(self, cfg, resumed_step):
        self.writer = self.run = None
        if cfg["tensorboard_dir"]:
            from torch.utils.tensorboard import SummaryWriter
            # A resumed run redoes the steps after its checkpoint: purge_step hides the killed
            # run's copies of them, as truncate_metrics drops them from metrics.jsonl.
            self.writer = SummaryWriter(cfg["tensorboard_dir"],
                                        purge_step=None if resumed_step is None else resumed_step + 1)
        if cfg["wandb_log"]:
            import wandb
            self.run = wandb.init(project=cfg["wandb_project"], dir=cfg["out_dir"], config=cfg,
                                  name=cfg["wandb_run_name"] or os.path.basename(os.path.abspath(cfg["out_dir"])))

    def log(self, row):
        values = dict(scalars(row))
        if self.writer:
            for name, value in values.items():
                self.writer.add_scalar(name, value, row["step"])
            self.writer.flush()  # like metrics.jsonl: on disk when the row is logged
        if self.run:
            self.run.log(values, step=row["step"])

    def close(self):
        if self.writer:
            self.writer.close()
        if self.run:
            self.run.finish()


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
        check_token_ids(cfg["data_dir"], data_meta, mcfg.vocab_size)  # a bad id would crash mid-run (a device assert on CUDA)
    except ValueError as e:
        raise ValueError(f"data: {e}") from None
    data_fp = data_fingerprint(cfg["data_dir"], data_meta)
    if mcfg.doc_mask and mcfg.eot_id != data_meta["eot_id"]:
        raise ValueError(f"config: model.eot_id={mcfg.eot_id} but {cfg['data_dir']} ends documents with "
                         f"{data_meta['eot_id']}: set --model.eot_id={data_meta['eot_id']}")
    out = cfg["out_dir"]
    # Rank 0 takes the run folder's lock, clears what killed runs left, and lists the checkpoints;
    # then it tells the others: on a shared filesystem another node's stale directory cache could
    # otherwise pick a different checkpoint (or none) and hang the job. Multi-node: out_dir must be
    # on a filesystem every node sees (rank 0 renames).
    found = [None, [], []]
    if rank == 0:
        try:
            os.makedirs(out, exist_ok=True)
            lock = lock_run_dir(out)  # noqa: F841 (held until the process exits)
            clear_leftovers(out)
            found = [None, *scan_checkpoints(out)]
        except RunDirError as e:
            found = [str(e), [], []]
    dist.broadcast_object_list(found, src=0)
    problem, done, damaged = found
    if problem:
        raise RunDirError(problem)
    if (done or damaged) and not cfg["resume"]:
        newest = os.path.basename((done or [p for p, _ in damaged])[-1])
        raise RunDirError(f"{out} already holds checkpoints ({newest}); pass --resume=True or choose another out_dir")
    for path, why in damaged:
        log0(f"{path} is damaged ({why}): not used")
    net, init_report = build_model(cfg, mcfg, device)
    opt = make_optimizer(net, cfg, device)
    names = dict(net.named_parameters())
    # MoE expert weights are bare (E, d_in, d_out) parameters: "mlp.w_up.weight" -> "mlp.w_up"
    track = [n if n in names else n.removesuffix(".weight")
             for n in (n.format(last=mcfg.n_layer - 1) for n in cfg["track_weights"])]
    for n in track:
        if n not in names:
            raise _unknown(n, names, "track_weights")
    step, resumed, changes = 0, None, {}
    for path in reversed(done):  # newest first; one that fails to load falls back to the one before
        meta = read_json(os.path.join(path, "meta.json"))
        check_resumable(path, mcfg)
        changes = experiment_changes(meta, cfg, data_fp)
        if changes and not cfg["allow_resume_changes"]:
            raise RunDirError(f"{out} was trained with other settings ({describe_changes(changes)}): resume with "
                              f"the run's settings, choose another out_dir, or pass --allow_resume_changes=True "
                              f"(the changes are recorded in metrics.jsonl)")
        why = None
        try:
            load_checkpoint(path, meta, net, opt, loader, cfg["weight_decay"])
        except ValueError:
            raise  # the data no longer fits the checkpoint: the user's to fix, not damage
        except (Exception, CheckpointException) as e:  # unreadable bytes: DCP raises a BaseException
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ok = torch.tensor(why is None, device=device, dtype=torch.float32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank falls back together
        if ok.item() and not all_finite(net, opt):
            why = "its parameters or optimizer state are not finite"
        elif not ok.item():
            why = why or "another rank could not load it"
        if why is None:
            step, resumed = meta["step"], path
            break
        log0(f"{path} could not be resumed ({why}): falling back to the previous checkpoint")
    if done and resumed is None:
        raise RunDirError(f"no checkpoint in {out} could be resumed (see above): move them away to start over, "
                          f"or choose another out_dir")
    if resumed:
        log0(f"resumed from {resumed} at step {step}")
        if meta["world_size"] != world:
            log0(f"world size {meta['world_size']} -> {world}: DCP resharded model and optimizer; the "
                 f"data order is unchanged (global batches), grad_accum is now {accum}, per-rank RNG "
                 f"streams restart from seed, and float reductions run in a different order")
        if changes:
            log0(f"resuming with changed settings (allow_resume_changes): {describe_changes(changes)}")
    meta_common = {"config": cfg, "model_config": asdict(mcfg), "data_meta": data_meta, "data_fingerprint": data_fp}
    metrics_path = os.path.join(out, "metrics.jsonl")
    if rank == 0:
        log0(json.dumps(cfg, indent=1))
        write_json(os.path.join(out, "config.json"), cfg)
        if step == 0:
            log0(format_report(init_report))
        truncate_metrics(metrics_path, step if resumed else -1)  # no checkpoint: everything is redone
    metrics = open(metrics_path, "a") if rank == 0 else None
    curves = Curves(cfg, step if done else None) if rank == 0 else None
    spent = {"eval_s": [], "ckpt_s": []}  # durations of evaluations and checkpoints, for the ETA

    def record(row):
        if rank == 0:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            curves.log(row)

    if changes:
        record({"step": step, "resume_changes": changes})

    def evaluate_and_record():
        t0 = time.time()
        val = evaluate(net, val_loader, cfg, device)
        row = {"step": step, "val_loss": val, "weights": weight_structure(net, track), "eval_s": time.time() - t0}
        spent["eval_s"].append(row["eval_s"])
        log0(f"step {step}: val loss {val:.4f}")
        record(row)

    def checkpoint_and_record():
        t0 = time.time()
        path = save_checkpoint(cfg, step, net, opt, loader, meta_common, last_ckpt)
        spent["ckpt_s"].append(time.time() - t0)
        record({"step": step, "ckpt_s": spent["ckpt_s"][-1]})
        return path

    peak, source = matmul_peak(cfg, device)
    log0(f"MFU against a peak of {peak / 1e12:.3g} TFLOP/s per device ({source})" if peak else
         f"MFU not reported: unknown peak for {source}; set --peak_flops")
    fpt = net.flops_per_token(cfg["seq_len"])
    tokens_step = cfg["global_batch"] * cfg["seq_len"]
    last_ckpt = resumed
    if step == 0:
        evaluate_and_record()
        if 0 in cfg["keep_steps"]:
            last_ckpt = checkpoint_and_record()
            log0(f"saved {last_ckpt} (the init)")
    train_time, step_log, time_log = 0.0, step, 0.0  # training time only: no eval/checkpoints
    step_start = step
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
            raise FloatingPointError(f"non-finite loss {loss_val} / grad norm {norm_val} at step {step + 1}; the "
                             f"update was not applied. Last good checkpoint: {last_ckpt or 'none'} (intact). "
                             f"Resume from it with a lower lr, longer warmup or tighter grad_clip.")
        opt.step()
        opt.zero_grad(set_to_none=True)
        moe_counts = net.update_moe_bias(all_reduce=dist.all_reduce)
        step += 1
        train_time += time.time() - t0
        first_line = step == step_start + 1  # a sign of life before log_interval steps (minutes on CPU)
        if step % cfg["log_interval"] == 0 or step == cfg["max_steps"] or first_line:
            tps = tokens_step * (step - step_log) / (train_time - time_log)
            eta = eta_seconds(cfg, step, tokens_step / tps, spent)
            row = {"step": step, "loss": loss_val, "lr": lr, "grad_norm": norm_val, "tokens_per_s": tps,
                   "mfu": fpt * tps / (peak * world) if peak else None, "mem_gib": memory_used(device),
                   "eta_s": eta, "tokens": step * tokens_step}
            if moe_counts is not None:
                load = moe_counts.float() / moe_counts.sum(-1, keepdim=True) * moe_counts.shape[-1]
                row.update(expert_load=load.tolist(), aux_loss=aux_sum.item())
            mfu = f"{row['mfu']:.1%}" if peak else "n/a"
            moe = f" expert load max {load.max():.2f} aux {row['aux_loss']:.3g}" if moe_counts is not None else ""
            log0(f"step {step}/{cfg['max_steps']} loss {loss_val:.4f} lr {lr:.3g} grad norm {norm_val:.3g} "
                 f"{tps:,.0f} tok/s mfu {mfu} mem {row['mem_gib']:.2f} GiB eta {eta / 60:.1f} min{moe}"
                 + (" (first step: compile and warm-up included)" if first_line else ""))
            if step % cfg["log_interval"] == 0 or step == cfg["max_steps"]:  # metrics.jsonl keeps its interval
                record(row)
                step_log, time_log = step, train_time
        if step % cfg["eval_interval"] == 0 or step == cfg["max_steps"]:
            evaluate_and_record()
        if step % cfg["ckpt_interval"] == 0 or step == cfg["max_steps"] or step in cfg["keep_steps"]:
            last_ckpt = checkpoint_and_record()
            log0(f"saved {last_ckpt}")
    if metrics:
        metrics.close()
        curves.close()


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
    atomic_write_bytes(path, [row.encode() for row in rows])


def main(argv):
    if argv[:1] == ["export"]:
        p = argparse.ArgumentParser(prog="train.py export", description="one file (pt) or a HF transformers folder (hf)")
        p.add_argument("ckpt", help="checkpoint folder (hf: also a .pt export or a run folder)")
        p.add_argument("out", help="pt: the file to write; hf: the folder")
        p.add_argument("--format", choices=["pt", "hf"], default="pt")
        p.add_argument("--tokenizer-dir", help="hf: offline tiktoken files (prepare_data.py --tokenizer-dir)")
        a = p.parse_args(argv[1:])
        if a.format == "pt":
            export(a.ckpt, a.out)
        else:
            from hf_export import export_hf  # transformers/safetensors only when asked for
            export_hf(a.ckpt, a.out, a.tokenizer_dir)
        return
    if "--help" in argv or "-h" in argv:
        print(usage())
        return
    config = load_config(argv)
    if config["dry_run"]:
        print_plan(config, config["dry_run"])
        return
    try:
        train(config)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    # Bad input, a busy or changed run folder, a diverged run, a full disk: one line, no traceback.
    except (ValueError, FloatingPointError, RunDirError) as e:
        raise SystemExit(str(e)) from None
    except OSError as e:
        if e.errno == errno.ENOSPC and e.filename:
            raise SystemExit(f"no space left on device writing {e.filename}: free space and rerun "
                             f"(files written before are intact)") from None
        raise SystemExit(e.strerror if e.strerror and not e.filename else str(e)) from None
