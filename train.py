"""
Pretrain a GPT from model.py with γ-init (init.py) on token shards from prepare_data.py.

    python train.py config/tiny_bytes.py                        # CPU, one process
    python train.py config/tiny_bytes.py --lr=3e-3 --model.norm_eps=1e-5
    torchrun --nproc_per_node=8 train.py config/gamma1_1p5b.py  # one node, FSDP2
    python train.py config/gamma1_1p5b.py --dry_run=8           # plan for 8 GPUs, no GPU needed
    python train.py export out/run/ckpt_00001000 model.pt       # consolidated single file
    python train.py export out/run/ckpt_00001000 hf_dir --format hf   # HF transformers folder

Configuration (configurator.py): the module-level names below are the defaults; config files
given on the command line run over them in order, then `--key=value` overrides (--help lists
every setting). A config file can include("other.py"), so a pair of configs can differ in three
lines.
One code path: a single process is a 1-rank process group, so FSDP2, DCP checkpoints and the
data order are the same for 1 CPU process and for 64 GPUs.
"""

import interrupt

if __name__ == "__main__":  # first: the imports below take seconds
    interrupt.while_starting("train.py: interrupted while starting, before anything was written; rerun the "
                             "same command")

import contextlib
import functools
import json
import math
import os
import resource
import signal
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from analysis import cosine_stats, row_cosines, stable_rank
from checkpoint import (Metrics, allocating, diverged_hint, interrupted_line, naming, open_run_dir, resume_command,
                        resume_run, save_checkpoint, write_error_line)
from configurator import configure, settings_help, unknown_key
from data import TokenLoader, check_model_vocab, check_token_ids, data_fingerprint
from fileio import RunDirError, not_own_file, write_json
from mfu import datasheet_peak, matmul_rate
from init import format_report, init_model_
from downstream import open_training_bench
from loss import chunk_loss, chunked_cross_entropy
from model import GPT, compile_once
from optim import build_optimizer
from rules import check_settings, decay_start, grad_accum, model_config

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
gamma = 1.0                     # every weight ~ N(0, d_in^-2γ); 0 < γ <= 3, as are init_overrides' values:
                                # at γ <= 0 no weight shrinks with width (std >= 1), above 3 all start
                                # near 0 (d^-3 is 4e-6 at d=64; γ=50 underflows to exactly 0 in fp32);
                                # the study swept 0.3-1.5
init_overrides = {}             # {regex on parameter name: γ}, e.g. {r"^lm_head\.": 0.5} (a tied
                                # head is tok_emb.weight: match r"^tok_emb\." instead)
attn_backend = "auto"           # "auto": flex on CUDA, sdpa on CPU (Flex has no CPU backward); or one of
                                # model.ATTN_BACKENDS, e.g. "varlen" (flash-attention's varlen kernel, CUDA)
compile = False                 # torch.compile each block (~30 s on CPU, minutes at 1.5B)
# batch: the global batch is fixed; grad_accum = global_batch / (batch_size * world_size)
seq_len = 256                   # tokens per sequence
global_batch = 32               # sequences per optimizer step, all ranks together
batch_size = 32                 # sequences per forward on one rank (micro-batch)
max_steps = 1000                # optimizer steps
# optimizer (optim.py): one parameter group per kind of parameter
optimizer = "adamw"             # "adamw"; or "muon": torch.optim.Muon on the blocks' 2-D matrices, AdamW on the rest
lr = 1e-3                       # peak learning rate, reached after warmup_steps (Muon's scaled to AdamW's RMS)
betas = (0.9, 0.95)             # AdamW's moment decays
muon_momentum = 0.95            # optimizer="muon": Muon's (Nesterov) momentum
adam_eps = 1e-8                 # AdamW's denominator floor, at least float32's smallest normal (1.2e-38)
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
bench_interval = 0              # steps between downstream benchmarks (eval.py bench's scorer, every rank; 0: none)
bench_task = "hellaswag"        # "hellaswag" (bench_source) or "anchor" (data_dir's val/test/heldout splits)
bench_source = ""               # hellaswag: a local file (the data kit's hellaswag_val_full.txt.bz2) or "hub"
bench_limit = 100               # the first N items (anchor: records of each split), the same every time
bench_truncate = ""             # "left": contexts past the window are cut (and counted), as eval.py bench's
bench_tokenizer_dir = ""        # offline files of data_dir's tokenizer (prepare_data.py --tokenizer-dir)
ckpt_interval = 500             # steps between checkpoints
keep_last = 2                   # checkpoints kept, newest first ...
keep_every = 0                  # ... plus every keep_every-th step forever (0: none)
keep_steps = []                 # ... plus these steps, saved and kept whatever the interval: the
                                # "condense then expand" trajectory (eval.py weights) happens early,
                                # e.g. [0, 100, 300, 1000, 3000]; 0 is the init
verify_checkpoints = True       # resume checks every file's sha256 (about 1 s per GB); False skips it
# live curves beside metrics.jsonl (rank 0): every field of its rows, optional packages
tensorboard_dir = ""            # a torch.utils.tensorboard log folder ("": none)
wandb_log = False               # Weights & Biases; WANDB_MODE=offline writes the run locally
wandb_project = "smallinit"     # the W&B project
wandb_run_name = ""             # "": the out_dir's name
peak_flops = 0.0                # per device for MFU; 0: H100/H200 datasheet bf16 (989e12 SXM), none on CPU
dry_run = 0                     # N > 0: print the plan for N ranks and exit (no data, no GPU)
debug_nan_step = 0              # test knob: poison the loss at this step (0: never)
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items()
            if k not in _IMPORTED and not k.startswith("_") and type(v) in (int, float, bool, str, list, tuple, dict)}
# The settings that define the experiment (the model's, which a resume compares too, aside): resumed with another
# value, a run would become a different arm under the old one's name, so a resume refuses the change unless
# allow_resume_changes (then it is recorded). A new setting of the loop that changes what is trained goes here;
# a checkpoint older than a setting counts as having run its default.
EXPERIMENT = {k: DEFAULTS[k] for k in ("gamma", "init_overrides", "seed", "global_batch", "seq_len", "optimizer", "lr",
                                       "betas", "adam_eps", "muon_momentum", "weight_decay", "grad_clip", "schedule",
                                       "warmup_steps", "max_steps", "min_lr_ratio", "decay_frac")}


def train(cfg):
    with interrupt.preemption_notices() as preempted, contextlib.ExitStack() as held:
        return train_run(cfg, preempted, held)


def train_run(cfg, preempted, held):
    rank, world, device = setup_distributed()
    torch.manual_seed(cfg["seed"])
    accum = grad_accum(cfg, world)
    mcfg = model_config(cfg, device.type)
    loader, val_loader, data_fp = open_data(cfg, mcfg, rank, world)
    bench = open_bench(cfg, mcfg)  # before the run folder exists: a bad bench_* setting is one line
    done = open_run_dir(cfg["out_dir"], cfg["resume"], rank, log0, held)
    net, init_report = build_model(cfg, mcfg, device)
    opt = build_optimizer(net, cfg, device)
    track = tracked_weights(net, cfg, mcfg.n_layer)
    step, resumed, changes, meta = resume_run(cfg, EXPERIMENT, done, net, opt, loader, mcfg, data_fp, log0)
    save_config(cfg, rank, meta, None if resumed else init_report)
    # Metrics is closed on every way out (a tensorboard writer or wandb run is a thread of its own), inside the
    # Ctrl-C handler: a Ctrl-C during the close (wandb's finish uploads) still names the step reached.
    try:
        with Metrics(cfg, rank, step if resumed else None) as metrics:
            if changes:
                metrics.record({"step": step, "resume_changes": changes})
            peak, source = mfu_peak(cfg, device)
            log0(f"MFU against a peak of {peak / 1e12:.3g} TFLOP/s per device ({source}){matmul_now(device)}"
                 if peak else f"MFU not reported: {source}; set --peak_flops")
            log_step = StepLog(cfg, metrics, device, net.flops_per_token(cfg["seq_len"]), peak * world, step)
            last_ckpt = resumed
            if not resumed:
                metrics.record(evaluation(net, val_loader, cfg, device, step, track))
                if bench:
                    metrics.record(bench(net, step))
                if 0 in cfg["keep_steps"]:
                    last_ckpt = save_and_record(cfg, step, net, opt, loader, meta, last_ckpt, metrics, " (the init)")
            train_time = 0.0  # training time only: no eval/checkpoints
            while step < cfg["max_steps"]:
                t0 = time.time()
                lr = lr_at(cfg, step)
                for group in opt.param_groups:
                    group["lr"] = lr
                x, y = loader.next_batch()
                # Gradients sync on the last micro-step only: a batch of another size would skip or repeat the sync.
                assert len(x) == accum * cfg["batch_size"], (len(x), accum, cfg["batch_size"])
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
                # A preemption notice on any rank stops every rank after this same step (its signal's number).
                stop = torch.tensor(float(preempted[0] if preempted else 0), device=device)
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                grads = [p.grad for p in net.parameters() if p.grad is not None]
                norm = torch.nn.utils.get_total_norm(grads)
                if isinstance(norm, DTensor):
                    norm = norm.full_tensor()  # sum of the shards' squares over ranks: the global norm
                if cfg["grad_clip"] > 0:
                    torch.nn.utils.clip_grads_with_norm_(grads, cfg["grad_clip"], norm)
                loss_val, norm_val, stop_val = torch.stack([loss_sum, norm.to(loss_sum), stop]).tolist()  # one sync
                if not (math.isfinite(loss_val) and math.isfinite(norm_val)):
                    raise FloatingPointError(f"non-finite loss {loss_val} / grad norm {norm_val} at step {step + 1}; "
                                             f"the update was not applied. {diverged_hint(last_ckpt)}")
                opt.step()
                opt.zero_grad(set_to_none=True)
                moe_counts = net.update_moe_bias(all_reduce=dist.all_reduce)
                step += 1
                train_time += time.time() - t0
                log_step({"step": step, "loss": loss_val, "lr": lr, "grad_norm": norm_val}, train_time, moe_counts,
                         aux_sum)
                if step % cfg["eval_interval"] == 0 or step == cfg["max_steps"]:
                    metrics.record(evaluation(net, val_loader, cfg, device, step, track))
                if bench and (step % cfg["bench_interval"] == 0 or step == cfg["max_steps"]):
                    metrics.record(bench(net, step))  # on every rank: FSDP's all-gathers are collective
                if step % cfg["ckpt_interval"] == 0 or step == cfg["max_steps"] or step in cfg["keep_steps"]:
                    last_ckpt = save_and_record(cfg, step, net, opt, loader, meta, last_ckpt, metrics)
                if stop_val and step < cfg["max_steps"]:
                    if not last_ckpt or os.path.basename(last_ckpt) != f"ckpt_{step:08d}":
                        last_ckpt = save_and_record(cfg, step, net, opt, loader, meta, last_ckpt, metrics)
                    raise interrupt.Preempted(
                        f"{signal.Signals(int(stop_val)).name} at step {step}/{cfg['max_steps']}: saved {last_ckpt}; "
                        f"{resume_command(cfg)} resumes from it (exit status {interrupt.PREEMPTED_STATUS}: requeue "
                        "the job)")
    except KeyboardInterrupt:
        raise interrupt.Interrupted(interrupted_line(cfg, step)) from None
    return step


# ----------------------------------------------------------------------------- model, optimizer, data
def setup_distributed():
    """torchrun -> its process group; plain python -> a 1-rank group (same code path)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        # Bound before the process group exists, and named to it, so NCCL never guesses the
        # device (a guessed device 0 on every rank hangs or crowds one GPU).
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
    else:
        init_one_rank(device)
    return dist.get_rank(), dist.get_world_size(), device


def init_one_rank(device):
    """A 1-rank process group on device (an indexed CUDA device, or the CPU): plain python, and bench.py's
    train-step variants, take the code path of torchrun's ranks."""
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            **({"device_id": device} if cuda else {}))


def compile_model_(net):
    """torch.compile a GPT (or bench.py's plain GPT) in place for training: each block, the
    final norm and the per-chunk loss math. Parameter names do not change, so checkpoints, the
    init and the export see the same model; only this model changes, and another one in the same
    process keeps the eager path that the compiled one is tested against. Call it before FSDP2's
    fully_shard (torchtitan's order): the compiled modules then run inside FSDP's hooks, on the
    gathered parameters.

    The chunk loop stays eager and calls the compiled chunk_loss once per chunk: compiled as a
    whole, the loop would be unrolled (a graph per chunk count) and nothing would hold inductor
    to one chunk's logits at a time. Static shapes: a micro-batch has two chunk heights at most
    (the full one and the ragged last one), so each branch (training, evaluation under no_grad)
    compiles two graphs at most. Automatic dynamic shapes would instead recompile at the first
    ragged chunk to a dynamic height and run the full chunks on that graph from then on."""
    for block in net.layers:
        block.compile()
    net.norm.compile()
    net.loss_fn = functools.partial(chunked_cross_entropy, chunk_fn=compile_once(chunk_loss, dynamic=False))
    return net


def build_model(cfg, mcfg, device):
    """meta -> compile -> FSDP2 blocks + root -> to_empty -> γ-init (torchtitan's order).
    Building on meta never allocates the full model on one rank; the init fills each rank's
    shard from the same full tensors, so the weights do not depend on the world size."""
    with torch.device("meta"):
        net = GPT(mcfg)
    if cfg["compile"]:
        compile_model_(net)  # in place (names, so checkpoints, unchanged): blocks, final norm, loss chunks
    block_mp, mp = mixed_precision(device)
    for i, block in enumerate(net.layers):
        # The last block is needed again right away by backward: don't free its params.
        fully_shard(block, mp_policy=block_mp, reshard_after_forward=i < len(net.layers) - 1)
    fully_shard(net, mp_policy=mp)
    n = sum(p.numel() for p in net.parameters())
    with allocating(f"config: model_size={cfg['model_size']!r}, model={cfg['model']}: the model ({n:,} parameters, "
                    f"{n * 4 / 2**30:.3g} GiB in fp32)",
                    "choose a smaller model (--dry_run=N prints the memory a size needs on N GPUs)"):
        net.to_empty(device=device)
        report = init_model_(net, gamma=cfg["gamma"], seed=cfg["seed"], overrides=cfg["init_overrides"] or None)
    return net, report


def mixed_precision(device):
    """FSDP2's (block, root) policies: bf16 params with fp32 gradient reduction on CUDA; fp32 on CPU,
    where bf16 matmuls are ~70x slower and exact-resume / cross-world-size tests need fp32. A block's
    inputs keep their dtypes: the residual stream is already bf16 (the embedding's parameters are),
    and the RoPE tables GPT.forward hands every block stay fp32 (model.rope_cos_sin)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    return replace(mp, cast_forward_inputs=False), mp


def open_data(cfg, mcfg, rank, world):
    """(train loader, val loader, data fingerprint), the data checked against the model first: a
    wrong tokenizer or an id past the vocab would crash mid-run (a device assert on CUDA)."""
    loader = open_loader(cfg, "train", rank, world)
    val_loader = open_loader(cfg, "val", rank, world)  # opened now: a missing split fails at start
    try:
        check_model_vocab(loader.meta, mcfg.vocab_size)
        check_token_ids(cfg["data_dir"], loader.meta, mcfg.vocab_size)
    except ValueError as e:
        raise ValueError(f"data: {e}") from None
    if mcfg.doc_mask and mcfg.eot_id != loader.meta["eot_id"]:
        raise ValueError(f"config: model.eot_id={mcfg.eot_id} but {cfg['data_dir']} ends documents with "
                         f"{loader.meta['eot_id']}: set --model.eot_id={loader.meta['eot_id']}")
    return loader, val_loader, data_fingerprint(cfg["data_dir"], loader.meta)


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


def tracked_weights(net, cfg, n_layer):
    """The parameter names of track_weights ("{last}" is the last layer)."""
    names = dict(net.named_parameters())
    # MoE expert weights are bare (E, d_in, d_out) parameters: "mlp.w_up.weight" -> "mlp.w_up"
    track = [n if n in names else n.removesuffix(".weight")
             for n in (n.format(last=n_layer - 1) for n in cfg["track_weights"])]
    for n in track:
        if n not in names:
            raise unknown_key(n, names, "track_weights")
    return track


def save_config(cfg, rank, meta, init_report):
    """Rank 0: the settings into the log and config.json (with every resume's changes and the code
    version of this start), and the init report unless None (resumed)."""
    if rank:
        return
    log0(json.dumps(cfg, indent=1))
    config_file = os.path.join(cfg["out_dir"], "config.json")
    try:
        with naming(config_file):
            write_json(config_file, {**meta["config"], "resume_changes": meta["resume_changes"],
                                     "code_version": meta["code_version"]})
    except IsADirectoryError:  # the rename into place fails only now, with a bare EISDIR
        raise not_own_file(config_file, "a folder") from None
    if init_report is not None:
        log0(format_report(init_report))


# ----------------------------------------------------------------------------- schedule and measurement
def lr_at(cfg, step):
    """Learning rate for the update that produces step+1."""
    peak, low, warm, total = cfg["lr"], cfg["lr"] * cfg["min_lr_ratio"], cfg["warmup_steps"], cfg["max_steps"]
    if step < warm:
        return peak * (step + 1) / warm
    if cfg["schedule"] == "cosine":
        progress = (step - warm) / max(total - warm - 1, 1)
        return low + 0.5 * (1 + math.cos(math.pi * progress)) * (peak - low)
    start = decay_start(total, cfg["decay_frac"])
    if step < start:
        return peak
    return peak - (peak - low) * (step - start + 1) / (total - start)


def mfu_peak(cfg, device):
    """(peak FLOP/s of one device for MFU, where it came from): peak_flops if set, else the datasheet's
    (mfu.py; 0, no MFU, on a CPU or a GPU it does not list)."""
    return (cfg["peak_flops"], "peak_flops setting") if cfg["peak_flops"] else datasheet_peak(device)


def matmul_now(device):
    """'; bf16 matmuls reach X TFLOP/s here now': printed beside the datasheet peak, never divided by
    (mfu.py). Half a second on a GPU; not on a CPU, which has no MFU to compare it with."""
    if device.type != "cuda":
        return ""
    return f"; bf16 matmuls reach {matmul_rate(device, torch.bfloat16, 8192, 20) / 1e12:.3g} TFLOP/s here now"


def memory_used(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS, KiB on Linux


def evaluation(net, val_loader, cfg, device, step, track):
    t0 = time.time()
    val = evaluate(net, val_loader, cfg, device)
    log0(f"step {step}: val loss {val:.4f}")
    return {"step": step, "val_loss": val, "weights": weight_structure(net, track), "eval_s": time.time() - t0}


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


@torch.no_grad()
def weight_structure(net, names):
    """Stable rank ||W||_F^2 / ||W||_2^2 and row-cosine statistics (analysis.py's definitions) of a
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


def open_bench(cfg, mcfg):
    """The downstream benchmark run every bench_interval steps (downstream.open_training_bench), or None."""
    if not cfg["bench_interval"]:
        return None
    return open_training_bench(cfg["bench_task"], cfg["bench_source"], cfg["bench_limit"], cfg["data_dir"], mcfg,
                               cfg["bench_truncate"], cfg["bench_tokenizer_dir"], log0)


def save_and_record(cfg, step, net, opt, loader, meta, last_ckpt, metrics, note=""):
    t0 = time.time()
    path = save_checkpoint(cfg, step, net, opt, loader, meta, last_ckpt)
    metrics.record({"step": step, "ckpt_s": time.time() - t0})
    log0(f"saved {path}{note}")
    return path


# ----------------------------------------------------------------------------- logging
def log0(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


class StepLog:
    """The log line after this launch's first step (a sign of life before log_interval steps: minutes on
    CPU) and every log_interval steps and the last, and a metrics.jsonl row on the latter. Throughput
    counts from the previous line, so the first step's compile and warm-up stay on a line of their own.
    peak: FLOP/s of all ranks (0: unknown, no MFU)."""

    def __init__(self, cfg, metrics, device, flops_per_token, peak, step):
        self.cfg, self.metrics, self.device = cfg, metrics, device
        self.flops_per_token, self.peak = flops_per_token, peak
        self.first, self.since = step + 1, (step, 0.0)  # the step and training seconds throughput counts from

    def __call__(self, row, train_time, moe_counts=None, aux=None):
        """row: the step's {"step", "loss", "lr", "grad_norm"}, completed here and recorded."""
        cfg, step = self.cfg, row["step"]
        recorded = step % cfg["log_interval"] == 0 or step == cfg["max_steps"]  # metrics.jsonl keeps its interval
        if not (recorded or step == self.first):
            return
        tokens_step = cfg["global_batch"] * cfg["seq_len"]
        tps = tokens_step * (step - self.since[0]) / (train_time - self.since[1])
        row.update(tokens_per_s=tps, mfu=self.flops_per_token * tps / self.peak if self.peak else None,
                   mem_gib=memory_used(self.device),
                   eta_s=eta_seconds(cfg, step, tokens_step / tps, self.metrics.spent), tokens=step * tokens_step)
        moe = ""
        if moe_counts is not None:
            load = moe_counts.float() / moe_counts.sum(-1, keepdim=True) * moe_counts.shape[-1]
            row.update(expert_load=load.tolist(), aux_loss=aux.item())
            moe = f" expert load max {load.max():.2f} aux {row['aux_loss']:.3g}"
        mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
        # After the last step only the final evaluation and checkpoint remain: said so, not as "eta".
        left = (f"final evaluation and checkpoint ~{row['eta_s'] / 60:.1f} min" if step == cfg["max_steps"]
                else f"eta {row['eta_s'] / 60:.1f} min")
        log0(f"step {step}/{cfg['max_steps']} loss {row['loss']:.4f} lr {row['lr']:.3g} grad norm "
             f"{row['grad_norm']:.3g} {tps:,.0f} tok/s mfu {mfu} mem {row['mem_gib']:.2f} GiB {left}{moe}"
             + (" (first step: compile and warm-up included)" if step == self.first else ""))
        if recorded:
            self.metrics.record(row)
        # Moved on the first line too: else the next line's throughput averages in the first step's compile.
        self.since = step, train_time


def eta_seconds(cfg, step, step_s, spent):
    """Time left after the update that produced `step`: the remaining steps at step_s each, plus
    the evaluations, benchmarks and checkpoints still due (this step's too: they run after its log
    line) at their mean duration so far (spent: lists of seconds; none counted until one was timed)."""
    mean = {k: sum(v) / len(v) if v else 0.0 for k, v in spent.items()}
    last = cfg["max_steps"]
    benches = steps_due(step, last, cfg["bench_interval"]) if cfg["bench_interval"] else 0
    return ((last - step) * step_s + steps_due(step, last, cfg["eval_interval"]) * mean["eval_s"]
            + benches * mean["bench_s"]
            + steps_due(step, last, cfg["ckpt_interval"], cfg["keep_steps"]) * mean["ckpt_s"])


def steps_due(first, last, interval, extra=()):
    """How many steps in [first, last] are a multiple of interval, the last one, or in extra:
    the evaluations (or checkpoints) still to run."""
    return (last // interval - (first - 1) // interval + (last % interval != 0)
            + len({s for s in extra if first <= s < last and s % interval}))


# ----------------------------------------------------------------------------- settings: reading and checking
# Names other training scripts (nanoGPT, HF Trainer) use for settings that are spelled
# differently here: difflib can't see that learning_rate is lr.
ALIASES = {"learning_rate": "lr", "max_iters": "max_steps", "warmup_iters": "warmup_steps", "block_size": "seq_len",
           "batch": "batch_size", "micro_batch_size": "batch_size", "gradient_accumulation_steps": "global_batch",
           "wd": "weight_decay", "eps": "adam_eps", "beta1": "betas", "beta2": "betas", "grad_norm_clip": "grad_clip",
           "eval_iters": "eval_batches", "n_layer": "model.n_layer", "n_head": "model.n_head",
           "n_embd": "model.d_model", "d_model": "model.d_model", "init_std": "gamma"}


def usage():
    """--help: how to call train.py, then every setting with its default and the comment beside it
    in the defaults block above."""
    lines = [__doc__.strip().split("\n\n")[0], "",
             "usage: python train.py [CONFIG.py ...] [--key=value ...]",
             "       torchrun --nproc_per_node=N train.py CONFIG.py [--key=value ...]",
             "       python train.py export CKPT OUT [--format pt|hf]   (python train.py export --help)", "",
             "Config files run in order over the defaults below, then --key=value (a Python literal, else a",
             "string) and --key.item=value (one entry of a dict setting) override them. Settings, with defaults:"]
    return "\n".join(lines + settings_help(__file__, DEFAULTS))


def load_config(argv):
    """Defaults <- config files (in order) <- --key=value overrides (configurator.py); checked (rules.py)."""
    cfg = configure(DEFAULTS, argv, ALIASES)
    check_settings(cfg)
    return cfg





# ----------------------------------------------------------------------------- main
def main(argv):
    if argv[:1] == ["export"]:
        from hf_export import export_command  # transformers only for --format hf
        return export_command(argv[1:])
    if "--help" in argv or "-h" in argv:
        return print(usage())
    config = load_config(argv)  # runs the config files' code
    if config["dry_run"]:
        from plan import print_plan  # the dry run's plan: FLOPs and memory per GPU, no data, no GPU
        return print_plan(config, config["dry_run"])
    try:
        step = train(config)
    except KeyboardInterrupt:  # Ctrl-C before the first step (train() names the step from then on)
        raise interrupt.Interrupted(interrupted_line(config, None)) from None
    finally:
        try:
            held = interrupt.close_process_group()
        except KeyboardInterrupt:  # it came before the close held Ctrl-C back: close to the end
            held = True
            interrupt.close_process_group()
    if held:  # Ctrl-C while the finished run was torn down: held back until that was done
        raise interrupt.Interrupted(interrupted_line(config, step))


# Bad input, a busy or changed run folder, a diverged run, a full disk: one line, no traceback.
ERRORS = (ValueError, FloatingPointError, RunDirError, OSError)


def error_line(e):
    return write_error_line(e) if isinstance(e, OSError) else str(e)


if __name__ == "__main__":
    interrupt.run(lambda: main(sys.argv[1:]), "interrupted before the run started; nothing was written",
                  errors=ERRORS, line=error_line)
