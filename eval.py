"""Analyses of smallinit checkpoints: the measurements behind the paper's claims.

    python eval.py loss     CKPT --data DIR            validation loss, overall and per source
    python eval.py tokens   CKPT_A CKPT_B --data DIR   per-token gap Δsym by difficulty bucket
    python eval.py sink     CKPT --data DIR            attention on the first token, per layer/head
    python eval.py weights  CKPT [CKPT ...]            stable rank + row cosine (trajectory if several)
    python eval.py residual CKPT --data DIR            branch / residual RMS per layer
    python eval.py residual --init --widths 64 128 256 branch RMS exponent at init vs width
    python eval.py bench    CKPT --task hellaswag|gsm8k|math500|anchor   (downstream.py)
    python eval.py scaling  --baseline A.json ... --compare B.json ...   L(N) = a N^-α + c   (report.py)
    python eval.py report   out/*.json --out out/report.md               tables of result JSONs (report.py)
    python eval.py lm-eval-task --task hellaswag --source FILE   lm-eval's task on a local file
    python eval.py sample   CKPT --prompt "Once upon a time"

CKPT is a consolidated export (`train.py export`, a .pt file), one DCP checkpoint folder
(`ckpt_00001000/` with meta.json) or a run folder (its newest checkpoint; for `weights`, all
of them in step order). Every analysis prints tables, writes --json-out for machines and
--plot PNGs when matplotlib (an optional dependency) is installed.

Δsym, the symmetric probability gap of model A over model B on one token, is
(p_A − p_B) / (p_A + p_B) with p the probability each model gives the true next token:
in [−1, 1], antisymmetric in A and B, +1 when only A predicts the token.
"""
import interrupt

if __name__ == "__main__":  # first: the imports below take seconds
    interrupt.while_starting("eval.py: interrupted while starting, before anything was written; rerun the "
                             "same command")

import argparse
import math
import os
import re
import sys

import numpy as np
import torch

import downstream
import report
from checkpoint import find_checkpoints, load_model
from configurator import at_least
from data import TokenLoader, load_meta, progress_bar
from downstream import check_data_fits, data_dir_of, temperature, tokenizer_of
from analysis import capture_attention, cosine_stats, row_cosines, stable_rank, token_logprobs, trace_residual
from fileio import open_regular, write_json
from generate import generate
from init import GAMMA_MAX, init_model_
from model import GPT, config_for, document_ids
from report import format_table, pyplot, read_result, save_figure


# ----------------------------------------------------------------------------- output paths

def is_result(path):
    try:
        return read_result(path)[1] is None
    except OSError:  # a FIFO (not opened), unreadable
        return False


def starts_with(*heads):
    """A test of whether a path is a plain file beginning with one of heads."""
    def test(path):
        try:
            fd = open_regular(path)  # a FIFO is refused, not waited on
        except OSError:
            return False
        with os.fdopen(fd, "rb") as f:
            return f.read(max(map(len, heads))).startswith(heads)
    return test


# The flags that name a file eval.py writes (report's --plot-x plots go beside its inputs), each with
# the kind of file it writes and how an existing one is recognised: only such a file is replaced, so a
# slip (--json-out RUN/ckpt_00001000/meta.json, --plot onto a data shard) destroys nothing.
is_png = starts_with(b"\x89PNG\r\n\x1a\n")
OUTPUT_FLAGS = {"json_out": ("--json-out", "an eval.py or sweep.py result JSON", is_result),
                "plot": ("--plot", "a PNG", is_png), "heatmap": ("--heatmap", "a PNG", is_png),
                "plot_together": ("--plot-together", "a PNG", is_png),
                # every report's first line is a section title or, with --plot-together, the plot
                "out": ("--out", "an eval.py report", starts_with(b"### ", b"!["))}
# What the commands read, by argparse dest; --pair takes FILE.json:ARM[:KEY=VALUE...] selectors.
INPUTS = ("ckpt", "ckpt_a", "ckpt_b", "ckpts", "data", "source", "fewshot_source", "tokenizer_dir", "baseline",
          "compare", "results")


def input_paths(args):
    values = [getattr(args, dest, None) for dest in INPUTS]
    paths = [v for value in values for v in (value if isinstance(value, list) else [value]) if v]
    return paths + [selector.split(":")[0] for pair in getattr(args, "pair", []) for selector in pair]


def check_output(path, dest, inputs):
    """Refuse an output path that cannot be written when the command line is read, not after an
    analysis of minutes: an existing folder, a file where a folder must be, or a folder this user
    cannot write in (missing folders are fine: they are made); a file the command reads (the results
    JSON a report or a scaling fit reads, a checkpoint's file), or an existing file of another kind."""
    flag, kind, recognised = OUTPUT_FLAGS[dest]
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder: give a file path, e.g. {os.path.join(path, 'result.json')}")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder: choose a path in a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {parent} is not writable (permissions or a read-only file system): "
                         "choose a folder you can write in")
    if not os.path.exists(path):
        return
    for source in inputs:
        if os.path.exists(source) and os.path.samefile(path, source):
            raise ValueError(f"{flag} {path} is also an input of this command ({source}): the output would replace "
                             "it; choose another path")
    if not recognised(path):
        raise ValueError(f"{flag} {path} exists and is not {kind}: it is not replaced; choose another path "
                         "(or remove the file)")


# ----------------------------------------------------------------------------- devices

def usable_devices():
    """The devices an analysis can run on here, as --device names them."""
    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu", *cuda, *(["mps"] if torch.backends.mps.is_available() else [])]


def check_device(name):
    """Refuse a --device nothing can run on before a checkpoint is read: a typo or 'cuda' on a
    machine without one ended in a traceback from deep in the loading, and 'meta' (tensors with
    shapes but no values) as if the checkpoint were damaged."""
    try:
        device = torch.device(name)
    except RuntimeError:
        problem = "is not a torch device"
    else:
        count = {"cuda": torch.cuda.device_count(), "mps": int(torch.backends.mps.is_available())}
        if device.type == "cpu" or (device.index or 0) < count.get(device.type, 0):
            return
        problem = ("holds shapes, not values: nothing can be computed on it" if device.type == "meta"
                   else "is not on this machine")
    raise ValueError(f"--device {name} {problem}; available here: {', '.join(usable_devices())}")


# ----------------------------------------------------------------------------- memory of a request
# Size flags (--widths, --batch-size, --num-samples, --max-rows) have no fixed upper bound: what
# fits depends on the model and the machine. A request is estimated before anything is allocated
# and refused past the memory that is free, instead of a 40 GB allocation failing in a traceback
# or pushing the machine into swap. The estimates are rough upper bounds, not budgets.

def free_memory(device):
    """Bytes free on device: the GPU's free memory, else the kernel's MemAvailable (physical memory
    where there is no /proc/meminfo)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def forward_bytes(cfg, batch, seq_len, elem=4):
    """About the peak of one no-grad forward of batch x seq_len tokens: the (B, T, V) logits, a few
    (B, T, width) activations and the (B, H, T, T) attention scores, which eager attention makes."""
    width = max(cfg.d_model, cfg.d_ff, cfg.d_expert * cfg.top_k if cfg.n_experts else 0)
    return elem * batch * seq_len * (cfg.vocab_size + 4 * width + cfg.n_head * seq_len)


def check_memory(needs, what, fix):
    """needs: {device: bytes}; a ValueError with the estimate, the limit and fix where one does not fit."""
    for device, need in needs.items():
        have = free_memory(device)
        if need > have:
            raise ValueError(f"{what} needs about {need / 2**30:,.1f} GiB on {device}, more than the "
                             f"{have / 2**30:,.1f} GiB free there: {fix}")


# ----------------------------------------------------------------------------- reading checkpoints and data
# load_model (train.py) is the one checkpoint reader; every analysis below starts here.
# token_logprobs lives in analysis.py, generate in model.py, data_dir_of and tokenizer_of in downstream.py:
# imports go one way, eval.py -> downstream.py -> analysis.py -> model.py, and eval.py -> report.py.

def seq_len_of(wanted, info, max_seq_len):
    """wanted (--seq-len), else the length the run trained at, else the model's window; never
    more than max_seq_len, the longest sequence the model accepts."""
    wanted = wanted or (info.get("config") or {}).get("seq_len") or max_seq_len
    if wanted > max_seq_len:
        print(f"seq_len {wanted} > the model's max_seq_len {max_seq_len}: using {max_seq_len}", file=sys.stderr)
    return min(wanted, max_seq_len)


def val_batches(data, split, batch_size, seq_len, tokens, seed, label):
    """A fixed budget of about `tokens` tokens of `split`, as batches (x, y, source index per
    token) behind a progress bar; returns (meta, seq_len used, batches)."""
    # Record datasets (the anchor task) fix the window to one record.
    if "record_len" in load_meta(data):
        seq_len = None
    loader = TokenLoader(data, split, batch_size, seq_len, seed=seed)
    wanted = max(1, math.ceil(tokens / (batch_size * loader.seq_len)))
    # The loader starts a new epoch (repeating tokens) after n_windows; never count a token twice.
    n = min(wanted, loader.n_windows // batch_size)
    if n < wanted:
        print(f"{label}: the {split} split holds {n} batches, fewer than the --tokens budget", file=sys.stderr)
    batches = (loader.next_batch(with_sources=True) for _ in range(n))
    return loader.meta, loader.seq_len, progress_bar(batches, total=n, desc=label)


def models_and_batches(args, ckpts, label, attn_backend=None):
    """The runners' common start: the models of ckpts on --device, and validation batches from
    the first one's data (--data, --split, --tokens, --batch-size, --seq-len) at a length every
    model accepts. Returns (models, info of the first, meta, seq_len, batches)."""
    loaded = [load_model(ckpt, args.device, attn_backend) for ckpt in ckpts]
    models, info = [model for model, _ in loaded], loaded[0][1]
    data = data_dir_of(args, info)
    for model, model_info in loaded:
        check_data_fits(data, model, model_info)
    max_len = min(model.cfg.max_seq_len for model in models)
    meta, seq_len, batches = val_batches(data, args.split, args.batch_size, seq_len_of(args.seq_len, info, max_len),
                                         args.tokens, args.seed, label)
    check_memory({args.device: max(forward_bytes(m.cfg, args.batch_size, seq_len) for m in models)},
                 f"a forward of --batch-size {args.batch_size} x {seq_len} tokens", "lower --batch-size or --seq-len")
    return models, info, meta, seq_len, batches


# ----------------------------------------------------------------------------- loss

def perplexity(loss):
    # A diverged run's loss is finite (~4,000) but e^loss is past the largest float: math.exp
    # raises instead of saying inf.
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def run_loss(args):
    (model,), info, meta, seq_len, batches = models_and_batches(args, [args.ckpt], "loss")
    sources = meta["sources"]
    total, count = torch.zeros(len(sources), dtype=torch.float64), torch.zeros(len(sources), dtype=torch.float64)
    for x, y, src in batches:
        logp = token_logprobs(model, x.to(args.device), y.to(args.device)).cpu().double()
        keep = y >= 0
        total += torch.bincount(src[keep], weights=-logp[keep], minlength=len(sources))
        count += torch.bincount(src[keep], minlength=len(sources)).double()
    rows = [{"source": s, "tokens": int(n), "loss": float(t / n), "ppl": perplexity(t / n)}
            for s, t, n in zip(sources, total.tolist(), count.tolist()) if n > 0]
    loss = float(total.sum() / count.sum())
    params = model.num_params()
    params["nonembedding"] = params["total"] - params["embedding"]
    summary = {"loss": loss, "ppl": perplexity(loss), "tokens": int(count.sum()), "split": args.split,
               "seq_len": seq_len, "step": info.get("step"), **{f"params_{k}": v for k, v in params.items()}}
    return {"analysis": "loss", "ckpt": args.ckpt, "summary": summary, "rows": rows}


# ----------------------------------------------------------------------------- token-level comparison

def delta_sym(logp_a, logp_b):
    """(p_A − p_B) / (p_A + p_B) from log-probabilities.

    Dividing by e^{(a+b)/2} gives (e^{(a−b)/2} − e^{−(a−b)/2}) / (e^{(a−b)/2} + e^{−(a−b)/2})
    = tanh((a − b)/2): exact, and finite even when both probabilities underflow."""
    return np.tanh((np.asarray(logp_a, np.float64) - np.asarray(logp_b, np.float64)) / 2)


def difficulty_buckets(logp_a, logp_b, n_buckets=10):
    """Equal-count buckets of tokens from easy to hard, difficulty = mean loss of both models.

    Win rate of A counts a tie as half a win, so win(A, B) = 1 − win(B, A)."""
    logp_a, logp_b = np.asarray(logp_a, np.float64), np.asarray(logp_b, np.float64)
    if len(logp_a) < n_buckets:
        raise ValueError(f"{len(logp_a)} tokens cannot fill {n_buckets} difficulty buckets: raise --tokens "
                         "or lower --buckets")
    difficulty = -(logp_a + logp_b) / 2
    gap = delta_sym(logp_a, logp_b)
    rows = []
    for i, idx in enumerate(np.array_split(np.argsort(difficulty, kind="stable"), n_buckets)):
        rows.append({"bucket": i, "count": len(idx),
                     "difficulty_lo": float(difficulty[idx].min()), "difficulty_hi": float(difficulty[idx].max()),
                     "mean_delta_sym": float(gap[idx].mean()),
                     "win_rate_a": float(np.mean((gap[idx] > 0) + 0.5 * (gap[idx] == 0))),
                     "loss_a": float(-logp_a[idx].mean()), "loss_b": float(-logp_b[idx].mean())})
    return rows


def plot_buckets(rows, path, label_a, label_b):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["bucket"] for r in rows]
    ax.bar(x, [r["mean_delta_sym"] for r in rows], color="tab:blue", label=f"mean Δsym ({label_a} vs {label_b})")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("token difficulty bucket (0 = easiest, mean loss of both models)")
    ax.set_ylabel("mean Δsym")
    twin = ax.twinx()
    twin.plot(x, [r["win_rate_a"] for r in rows], color="tab:red", marker="o", label=f"win rate of {label_a}")
    twin.axhline(0.5, color="tab:red", lw=0.6, ls=":")
    twin.set_ylabel("win rate")
    fig.legend(loc="upper left", fontsize=8)
    save_figure(fig, path)
    plt.close(fig)


def run_tokens(args):
    (model_a, model_b), _, _, seq_len, batches = models_and_batches(args, [args.ckpt_a, args.ckpt_b], "tokens")
    if model_a.cfg.vocab_size != model_b.cfg.vocab_size:
        raise ValueError(f"vocab sizes differ ({model_a.cfg.vocab_size} vs {model_b.cfg.vocab_size}): "
                         "per-token comparison needs two models on the same tokenizer")
    logp_a, logp_b = [], []
    for x, y, _ in batches:
        x, y = x.to(args.device), y.to(args.device)
        keep = y >= 0
        logp_a.append(token_logprobs(model_a, x, y)[keep].cpu())
        logp_b.append(token_logprobs(model_b, x, y)[keep].cpu())
    logp_a, logp_b = torch.cat(logp_a).numpy(), torch.cat(logp_b).numpy()
    rows = difficulty_buckets(logp_a, logp_b, args.buckets)
    (overall,) = difficulty_buckets(logp_a, logp_b, 1)  # every token in one bucket: the totals
    summary = {"tokens": overall["count"], "split": args.split, "seq_len": seq_len,
               **{k: overall[k] for k in ("mean_delta_sym", "win_rate_a", "loss_a", "loss_b")}}
    result = {"analysis": "tokens", "ckpt_a": args.ckpt_a, "ckpt_b": args.ckpt_b, "summary": summary, "rows": rows}
    if args.plot:
        plot_buckets(rows, args.plot, os.path.basename(args.ckpt_a.rstrip("/")),
                     os.path.basename(args.ckpt_b.rstrip("/")))
        result["plots"] = [args.plot]
    return result


# ----------------------------------------------------------------------------- attention sink (sink)

def document_starts(x, eot_id):
    """Position of the first token of each token's document, by the model's own rule
    (model.document_ids): the first position holding each non-decreasing document id."""
    ids = document_ids(x, eot_id).contiguous()
    return torch.searchsorted(ids, ids)


@torch.no_grad()
def sink_shares(model, x):
    """Per layer (H,) attention share on the sequence's first token (queries ≥ 1) and, with
    document masking, on each query's document start (queries that are not that start)."""
    if model.cfg.doc_mask:
        q = torch.arange(x.shape[1], device=x.device)
        doc = document_starts(x, model.cfg.eot_id)

    def shares(p):  # reduced inside the hook: one layer's (B, H, T, T) probabilities at a time
        # Only (B, H, T) columns are needed: slice them out before widening to float64, never
        # the whole T x T matrix.
        row = {"first": p[:, :, 1:, 0].double().mean(dim=(0, 2)).tolist()}
        if model.cfg.doc_mask:
            on_doc = p.gather(3, doc[:, None, :, None].expand(-1, p.shape[1], -1, 1)).squeeze(3).double()
            not_start = (q != doc)[:, None, :].expand_as(on_doc)
            row["doc_first"] = (on_doc * not_start).sum(dim=(0, 2)).div(not_start.sum(dim=(0, 2))).tolist()
        return row

    with capture_attention(model, reduce=shares) as layers:
        model(x)
    return layers


def uniform_shares(x, doc_mask, eot_id):
    """What sink_shares measures for a head that attends uniformly over every key its query may
    see (the chance level of a share): 1/(t + 1) on the first token for query t (0 past the
    first document under document masking), 1/(t - start + 1) on the query's document start."""
    q = torch.arange(x.shape[1], device=x.device)
    start = document_starts(x, eot_id) if doc_mask else torch.zeros_like(x)
    first = torch.where(start == 0, 1 / (q + 1.0), 0.0)[:, 1:].double().mean().item()
    row = {"first": first}
    if doc_mask:
        row["doc_first"] = (1 / (q - start + 1.0))[q != start].double().mean().item()
    return row


def sink_heads(shares, threshold):
    """The head-level sink metric of Gu et al. 2025 ("When Attention Sink Emerges in Language
    Models"): the share of (layer, head) pairs whose mean attention on the first token, over the
    queries that see it, exceeds threshold (theirs: 0.3). shares: (n_layer, n_head) means."""
    return float((np.asarray(shares) > threshold).mean())


def run_sink(args):
    (model,), _, _, seq_len, batches = models_and_batches(args, [args.ckpt], "sink", attn_backend="eager")
    totals, chance, n = None, None, 0
    for x, _, _ in batches:
        layers = sink_shares(model, x.to(args.device))
        arrays = {k: np.array([layer[k] for layer in layers]) for k in layers[0]}
        totals = arrays if totals is None else {k: totals[k] + arrays[k] for k in totals}
        uniform = uniform_shares(x, model.cfg.doc_mask, model.cfg.eot_id)
        chance = uniform if chance is None else {k: chance[k] + uniform[k] for k in chance}
        n += 1
    # Each head's share is already Gu et al.'s per-head average over query positions, with one
    # difference: query 0 (a document's first token) is left out, as it attends only to itself
    # and scores 1 whatever the head does; they include it. That moves a head's mean by at most
    # 1/T (0.002 at T=512). No later query is left out: the first k queries can lift a mean by at
    # most k/(T-1) (under 2% for k=10 at T>=512), and a head that attends uniformly scores
    # uniform_share_* (0.01-0.03 on the study's byte text at T=256-1024), far below a 0.3
    # threshold. Under document masking, doc_first is the same metric on each query's own
    # document start, which is the first token that query can see.
    means = {k: v / n for k, v in totals.items()}
    rows = [{"layer": i, "head": h, **{f"share_{k}": float(v[i, h]) for k, v in means.items()}}
            for i in range(model.cfg.n_layer) for h in range(model.cfg.n_head)]
    summary = {f"mean_share_{k}": float(v.mean()) for k, v in means.items()}
    summary.update({f"max_share_{k}": float(v.max()) for k, v in means.items()})
    summary.update({f"sink_heads_{k}": sink_heads(v, args.threshold) for k, v in means.items()})
    summary.update({f"uniform_share_{k}": v / n for k, v in chance.items()})
    summary.update(threshold=args.threshold, attn_gate=model.cfg.attn_gate, split=args.split, seq_len=seq_len)
    return {"analysis": "sink", "ckpt": args.ckpt, "summary": summary, "rows": rows}


# ----------------------------------------------------------------------------- weight structure
# stable_rank, row_cosines and cosine_stats live in analysis.py: train.py logs them too.

def weight_matrices(state):
    """(name, 2-D matrix with one neuron per row) for every weight matrix of a state dict.

    nn.Linear / nn.Embedding store (out, in) already; stacked MoE experts are (E, d_in, d_out)
    (CONTRACT), so each expert is transposed to put its neurons on rows."""
    for name, p in state.items():
        if p.ndim == 2:
            yield name, p
        elif p.ndim == 3:
            for e in range(p.shape[0]):
                yield f"{name}[{e}]", p[e].T


def matrix_kind(name):
    """Group key for averaging: 'wq', 'w_up', 'w_up[experts]', 'tok_emb', 'lm_head', ..."""
    base = re.sub(r"\[\d+\]$", "", name)
    parts = base.split(".")
    kind = parts[-2] if parts[-1] == "weight" else parts[-1]
    return kind + "[experts]" if base != name else kind


def weight_stats(state, threshold=0.7, max_rows=2048):
    rows = []
    for name, w in weight_matrices(state):
        stats = cosine_stats(row_cosines(w, max_rows), threshold)
        rows.append({"name": name, "kind": matrix_kind(name), "shape": "x".join(map(str, w.shape)),
                     "stable_rank": stable_rank(w), **stats})
    return rows


def mean_by_kind(rows):
    kinds = {}
    for r in rows:
        kinds.setdefault(r["kind"], []).append(r)
    return [{"kind": k, "matrices": len(rs),
             **{m: float(np.mean([r[m] for r in rs])) for m in ("stable_rank", "mean_abs_cos", "frac_cos_gt")}}
            for k, rs in kinds.items()]


def spectral_order(cos):
    """Row order that puts aligned rows next to each other, for a readable heatmap: sort by the
    angle in the plane of the top two eigenvectors of |cos| (rows condensed onto one direction
    load on the same eigenvectors)."""
    _, vecs = torch.linalg.eigh(cos.abs())
    return torch.argsort(torch.atan2(vecs[:, -2], vecs[:, -1]))


def plot_cosine_heatmap(w, path, title):
    plt = pyplot()
    cos = row_cosines(w, max_rows=512)
    order = spectral_order(cos)
    fig, ax = plt.subplots(figsize=(5, 4.5))
    im = ax.imshow(cos[order][:, order].numpy(), cmap="RdBu_r", vmin=-1, vmax=1)
    fig.colorbar(im, ax=ax)
    ax.set_title(title)
    save_figure(fig, path)
    plt.close(fig)


def plot_trajectory(steps, by_kind, path):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for kind, series in by_kind.items():
        axes[0].plot(steps, [s["mean_abs_cos"] for s in series], marker=".", label=kind)
        axes[1].plot(steps, [s["stable_rank"] for s in series], marker=".", label=kind)
    axes[0].set_ylabel("mean |row cosine|")
    axes[1].set_ylabel("stable rank")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("step")
    axes[1].legend(fontsize=7)
    save_figure(fig, path)
    plt.close(fig)


def run_weights(args):
    paths = [p for arg in args.ckpts for p in find_checkpoints(arg)]
    series, last_state = [], None
    for path in progress_bar(paths, desc="weights"):
        model, info = load_model(path)
        # Parameters only: buffers such as the MoE selection bias are not weights.
        last_state = dict(model.named_parameters())
        # row_cosines and cosine_stats hold about four float64 m x m matrices, m = min(rows, --max-rows):
        # 80 GB each for a 100k-token embedding at --max-rows 100000.
        rows = max(min(len(w), args.max_rows) for _, w in weight_matrices(last_state))
        check_memory({"cpu": 4 * 8 * rows ** 2}, f"the row cosines of {rows} rows", "lower --max-rows")
        rows = weight_stats(last_state, args.threshold, args.max_rows)
        series.append({"ckpt": path, "step": info.get("step"), "rows": rows, "by_kind": mean_by_kind(rows)})
    last = series[-1]
    if args.heatmap:  # of the last checkpoint
        matrices = dict(weight_matrices(last_state))
        if args.heatmap_matrix not in matrices:
            raise ValueError(f"--heatmap-matrix {args.heatmap_matrix!r} is not a weight matrix; "
                             f"choose one of: {', '.join(list(matrices)[:6])}, ...")
        plot_cosine_heatmap(matrices[args.heatmap_matrix], args.heatmap, f"{args.heatmap_matrix} row cosine")
    summary = {"checkpoints": len(series), "step": last["step"],
               **{f"{m}": float(np.mean([r[m] for r in last["rows"]]))
                  for m in ("stable_rank", "mean_abs_cos", "frac_cos_gt")}}
    trajectory = [{"step": s["step"], **{f"{k['kind']}:{m}": k[m] for k in s["by_kind"]
                                         for m in ("mean_abs_cos", "stable_rank")}} for s in series]
    result = {"analysis": "weights", "summary": summary, "rows": last["by_kind"], "matrices": last["rows"],
              "trajectory": trajectory, "threshold": args.threshold}
    if args.plot:
        kinds = [k["kind"] for k in last["by_kind"]]
        by_kind = {kind: [next(k for k in s["by_kind"] if k["kind"] == kind) for s in series] for kind in kinds}
        plot_trajectory([s["step"] for s in series], by_kind, args.plot)
        result["plots"] = [args.plot]
    return result


# ----------------------------------------------------------------------------- residual stream (residual)

@torch.no_grad()
def branch_ratios(model, inputs):
    """Per layer: RMS of the attention / MLP branch update over the RMS of the residual stream
    entering the block, each RMS averaged over the forwards of all inputs."""
    device = next(model.parameters()).device
    with trace_residual(model) as trace:
        for x in inputs:
            model(x.to(device))
    return [{"layer": i, "resid_rms": float(np.mean(t["resid_rms"])),
             "attn_ratio": float(np.mean(t["attn_rms"]) / np.mean(t["resid_rms"])),
             "mlp_ratio": float(np.mean(t["mlp_rms"]) / np.mean(t["resid_rms"]))} for i, t in enumerate(trace)]


INIT_SEQ_LEN = 256  # residual --init without --seq-len


def init_seq_len(args, cfg):
    # Random tokens at init: no training length to follow, only the model's window.
    return min(args.seq_len or INIT_SEQ_LEN, cfg.max_seq_len)


def init_config(args, width):
    try:
        return config_for(args.size, d_model=width, mlp=args.mlp, attn_gate=args.attn_gate)
    except ValueError as e:
        raise ValueError(f"--widths {width} with --size {args.size}: {e}") from None


def meta_model(cfg):
    """GPT(cfg) without memory behind its tensors: their shapes, for an estimate."""
    with torch.device("meta"):
        return GPT(cfg)


def run_residual(args):
    if args.ckpt is None and not args.init:
        raise ValueError("residual needs a checkpoint (eval.py residual CKPT --data DIR) or --init (fresh models "
                         "across --widths): give one of them")
    if args.ckpt is not None and args.init:
        raise ValueError(f"residual --init measures fresh models, not {args.ckpt}: drop --init to measure the "
                         "checkpoint, or the checkpoint to measure fresh models")
    if not args.init:
        (model,), _, _, seq_len, batches = models_and_batches(args, [args.ckpt], "residual")
        rows = branch_ratios(model, (x for x, _, _ in batches))
        summary = {k: float(np.mean([r[k] for r in rows])) for k in ("attn_ratio", "mlp_ratio")}
        summary.update(split=args.split, seq_len=seq_len)
        return {"analysis": "residual", "ckpt": args.ckpt, "summary": summary, "rows": rows}
    if len(set(args.widths)) < 2:
        raise ValueError(f"--widths {' '.join(map(str, args.widths))}: the exponent is a slope over widths; "
                         "give at least two different ones (e.g. --widths 64 128 256)")
    configs = [init_config(args, width) for width in args.widths]  # every width refused before the first runs
    largest = max(configs, key=lambda cfg: cfg.d_model)
    sizes = [p.numel() for p in meta_model(largest).parameters()]
    # Built and γ-initialised on the CPU (init draws each parameter whole in float32), then moved.
    device = str(torch.device(args.device))
    needs = {"cpu": 4 * (sum(sizes) + max(sizes))}
    needs[device] = needs.get(device, 0) + 4 * sum(sizes) + forward_bytes(largest, args.batch_size,
                                                                         init_seq_len(args, largest))
    check_memory(needs, f"a model of d_model {largest.d_model} ({sum(sizes):,} parameters) and its forward",
                 "lower --widths (or --batch-size)")
    rows = []
    for cfg in progress_bar(configs, desc="residual@init"):
        model = GPT(cfg)
        init_model_(model, gamma=args.gamma, seed=args.seed)
        seq_len = init_seq_len(args, cfg)
        x = torch.randint(cfg.vocab_size, (args.batch_size, seq_len),
                          generator=torch.Generator().manual_seed(args.seed))
        layers = branch_ratios(model.to(args.device).eval(), [x])
        # Block 0 sees the embedding alone, where the d^(1−γ) law is clean; later blocks see a
        # residual already grown by earlier branches (by a width-dependent amount when γ < 1).
        rows.append({"d_model": cfg.d_model, **{f"{k}_block0": layers[0][k] for k in ("attn_ratio", "mlp_ratio")},
                     **{f"{k}_mean": float(np.mean([r[k] for r in layers])) for k in ("attn_ratio", "mlp_ratio")}})
    log_d = np.log([r["d_model"] for r in rows])
    # Theory (README): attention and gelu branches scale as d^(1−γ), SwiGLU as d^(1.5−2γ).
    summary = {f"{k}_exponent": float(np.polyfit(log_d, np.log([r[k] for r in rows]), 1)[0])
               for k in rows[0] if k != "d_model"}
    summary.update(gamma=args.gamma, mlp=args.mlp)
    return {"analysis": "residual_init", "summary": summary, "rows": rows}


# ----------------------------------------------------------------------------- sample

def run_sample(args):
    model, info = load_model(args.ckpt, args.device)
    encode, decode, eot_id = tokenizer_of(info, args.tokenizer_dir)
    # A model predicts each token from the ones before it, so it needs at least one. --prompt ''
    # samples a document from its start: conditioned on end-of-text, the token before every
    # document boundary in training.
    prompt = encode(args.prompt) or [eot_id]
    cfg, elem = model.cfg, model.lm_head.weight.element_size()
    length = min(len(prompt) + args.max_new_tokens, cfg.max_seq_len)  # generate's window
    kv_cache = 2 * elem * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * args.num_samples * length
    check_memory({args.device: kv_cache + forward_bytes(cfg, args.num_samples, length, elem)},
                 f"--num-samples {args.num_samples} of {length} tokens", "lower --num-samples")
    outs = generate(model, prompt, args.max_new_tokens, args.num_samples, args.temperature,
                    args.top_k, args.seed, stop=lambda toks: toks[-1] == eot_id)
    for i, out in enumerate(outs):
        print(f"--- sample {i}\n{args.prompt}{decode([t for t in out if t != eot_id])}")
    return None


# ----------------------------------------------------------------------------- command line

def finite_at_least(minimum, maximum=math.inf):
    """argparse type of a real-valued flag, like configurator.at_least for counts: float() takes 'nan'
    and 'inf', and a nan threshold counts no head, a γ of 50 underflows the weights to 0 (--temperature:
    downstream.temperature)."""
    def parse(text):
        value = float(text)
        if not (math.isfinite(value) and minimum <= value <= maximum):
            allowed = f">= {minimum:g}" if maximum == math.inf else f"in [{minimum:g}, {maximum:g}]"
            raise argparse.ArgumentTypeError(f"must be a finite number {allowed} (got {text})")
        return value
    parse.__name__ = "float"  # argparse's message for a non-number: "invalid float value: 'x'"
    return parse


def seed_value(text):
    """--seed as torch's and numpy's generators take it, refused when the command line is read (not after the
    model has loaded): 0 <= seed < 2**64."""
    value = at_least(0)(text)
    if value >= 2**64:
        raise argparse.ArgumentTypeError(f"must be < 2**64 (got {text})")
    return value


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, func, help, data=False, ckpt=True, plot=False, output=True, runs_model=True):
        """data: False, "folder" (--data only) or "batches" (--data and the batch budget flags)."""
        p = sub.add_parser(name, help=help)
        p.set_defaults(func=func, json_out=None, plot=None)
        if ckpt:
            p.add_argument("ckpt", help=".pt export, checkpoint folder or run folder")
        if runs_model:
            p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                           help="torch device of the model (default: cuda when there is one, else cpu)")
            p.add_argument("--seed", type=seed_value, default=0, help="data order, init and sampling")
        if output:
            p.add_argument("--json-out", help="write the result as JSON here")
        if plot:
            p.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
        if data:
            p.add_argument("--data", help="data folder from prepare_data.py (default: the run's data_dir)")
        # Only the analyses that read a token budget of batches take these; bench scores whole
        # records or published items and would silently ignore them.
        if data == "batches":
            p.add_argument("--split", default="val", help="split of --data to read (val, test, ...)")
            p.add_argument("--tokens", type=at_least(1), default=65536, help="token budget")
            p.add_argument("--batch-size", type=at_least(1), default=8, help="sequences per forward")
            p.add_argument("--seq-len", type=at_least(1), default=None,
                           help="default: the run's training seq_len, at most the model's max_seq_len")
        return p

    command("loss", run_loss, "validation loss overall and per source", data="batches")
    p = command("tokens", run_tokens, "per-token Δsym of A over B by difficulty bucket", data="batches", ckpt=False,
                plot=True)
    p.add_argument("ckpt_a", help="model A (.pt export, checkpoint folder or run folder): Δsym > 0 where A is better")
    p.add_argument("ckpt_b", help="model B, on the same tokenizer")
    p.add_argument("--buckets", type=at_least(1), default=10, help="equal-count difficulty buckets, easy to hard")
    p = command("sink", run_sink, "attention share on the first token per layer/head", data="batches")
    p.add_argument("--threshold", type=finite_at_least(0, 1), default=0.3,
                   help="sink_heads_*: the share of heads whose mean attention on the first token exceeds this "
                   "(Gu et al. 2025's sink metric uses 0.3)")
    p = command("weights", run_weights, "stable rank and row cosine of every matrix", ckpt=False, plot=True,
                runs_model=False)
    p.add_argument("ckpts", nargs="+", help="checkpoints or run folders; several -> trajectory")
    p.add_argument("--threshold", type=finite_at_least(0, 1), default=0.7,
                   help="|cos| above which a row pair counts as aligned")
    p.add_argument("--max-rows", type=at_least(2), default=2048,
                   help="row subsample for the cosine matrix (>= 2: cosines are between rows)")
    p.add_argument("--heatmap", help="PNG of the clustered row-cosine matrix of --heatmap-matrix")
    p.add_argument("--heatmap-matrix", default="layers.0.attn.wq.weight", help="the matrix --heatmap draws")
    p = command("residual", run_residual, "branch / residual RMS per layer, or its exponent at init",
                data="batches", ckpt=False)
    p.add_argument("ckpt", nargs="?", help=".pt export, checkpoint folder or run folder (none with --init)")
    p.add_argument("--init", action="store_true", help="fresh models across --widths instead of a checkpoint")
    p.add_argument("--widths", type=at_least(1), nargs="+", default=[64, 128, 256, 512],
                   help="--init: d_model of each model")
    p.add_argument("--size", default="tiny", help="--init: the named size (model.SIZES) the widths override")
    p.add_argument("--gamma", type=finite_at_least(0, GAMMA_MAX), default=1.0,
                   help=f"--init: init exponent, std = d_in^-gamma, at most {GAMMA_MAX:g} (as train.py)")
    p.add_argument("--mlp", default="gelu", help="--init: swiglu or gelu")
    p.add_argument("--attn-gate", default="none", help="--init: elementwise, headwise or none")
    # The benchmarks' code and options live in downstream.py; bench is a subcommand here for the one CLI.
    p = command("bench", downstream.run_bench, "HellaSwag, GSM8K, MATH-500 (lm-eval's definitions) or the anchor task",
                data="folder")
    downstream.add_arguments(p)
    p = command("lm-eval-task", downstream.run_lm_eval_task, "lm-eval's own task on a local benchmark file "
                "(the offline route to lm_eval)", ckpt=False, output=False, runs_model=False)
    p.add_argument("--task", required=True, choices=sorted(downstream.LM_EVAL_TASKS),
                   help="hellaswag, gsm8k (lm-eval gsm8k_cot) or math500 (lm-eval minerva_math500)")
    p.add_argument("--source", required=True, help="the local file in its published format (as bench --source)")
    p.add_argument("--out-dir", default="out/lm_eval_tasks", help="folder of the task yaml and its jsonl "
                   "(lm_eval --include_path)")
    p.add_argument("--limit", type=at_least(1), default=None, help="only the first N items")
    # The scaling fit and the report read result JSONs; their code lives in report.py.
    p = command("scaling", report.run_scaling, "fit L(N) = a N^-α + c; effective size of compared runs", ckpt=False,
                plot=True, runs_model=False)
    p.add_argument("--baseline", nargs="+", required=True, help="loss JSONs (or N=loss) of the baseline sizes")
    p.add_argument("--compare", nargs="*", default=[], help="loss JSONs (or N=loss) to express as effective sizes")
    p.add_argument("--count", default="nonembedding", choices=["nonembedding", "total", "active"],
                   help="which parameter count is N (nonembedding: total minus the input embedding)")
    p = command("report", report.run_report, "gather result JSONs into a markdown table", ckpt=False, output=False,
                runs_model=False)
    p.add_argument("results", nargs="+",
                   help="result JSONs (--json-out of the analyses, sweep.py's results/<name>.json)")
    p.add_argument("--out", default="report.md", help="the markdown report (also printed)")
    p.add_argument("--plot-x", help="sweeps: plot --plot-metric against this setting (gamma, lr, ...; "
                   "'arm': arms as categories) beside each results JSON")
    p.add_argument("--pair", nargs=2, action="append", default=[], metavar=("A", "B"),
                   help="sweeps: B - A by seed, each FILE.json:ARM[:KEY=VALUE...] (repeatable; across files too)")
    p.add_argument("--pair-metric", default="loss", help="sweeps: the metric --pair compares (a --plot-metric name, "
                   "or heldout_margin: the anchor's inferential minus symmetric share)")
    p.add_argument("--per-seed", type=lambda names: names.split(","), default=[],
                   help="sweeps: these table columns also seed by seed (comma-separated, e.g. loss)")
    p.add_argument("--plot-y", help="sweeps: with --plot-x, a heatmap over the two settings (e.g. model.n_layer)")
    p.add_argument("--plot-together", metavar="PNG",
                   help="sweeps: one --plot-x plot over the rows of every sweep given, "
                   "at this path, instead of one beside each results JSON")
    p.add_argument("--plot-metric", default="loss", help="sweeps: what --plot-x plots, comma-separated "
                   f"(loss, best_val_loss, sink_first, sink_heads, sink_doc_first, sink_doc_heads, loss_<source>, "
                   f"{', '.join(report.ANCHOR_METRICS)})")
    p = command("sample", run_sample, "print continuations of a prompt", output=False)
    p.add_argument("--tokenizer-dir", help="offline tokenizer files (prepare_data.py --tokenizer-dir)")
    p.add_argument("--prompt", default="\n",
                   help="text the continuations start from ('': a document from its start, after end-of-text)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=100, help="tokens per continuation, at most")
    p.add_argument("--num-samples", type=at_least(1), default=1, help="continuations to print")
    p.add_argument("--temperature", type=temperature, default=0.8,
                   help=f"0 = greedy, else >= {downstream.MIN_TEMPERATURE:g}")
    p.add_argument("--top-k", type=at_least(1), default=200, help="sample from the k most likely tokens only")
    return parser


def main(argv=None):
    torch.set_num_threads(int(os.environ.get("EVAL_THREADS", "1")))
    args = build_parser().parse_args(argv)
    try:
        try:
            return run_command(args)
        except Exception:
            if interrupt.received():  # an error the Ctrl-C caused (interrupt.received): the interruption it is
                raise KeyboardInterrupt from None
            raise
    # Library functions raise; here bad input becomes one line with the fix, no traceback.
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        # Every file is written whole or not at all (fileio.atomic_open removes its temporary).
        raise interrupt.Interrupted(f"interrupted: eval.py {args.command} stopped before it finished; nothing is "
                                    "half-written, run the same command again for its results") from None


def run_command(args):
    if getattr(args, "device", None) is not None:
        check_device(args.device)
    inputs = input_paths(args)
    for dest in OUTPUT_FLAGS:
        if getattr(args, dest, None):
            check_output(getattr(args, dest), dest, inputs)
    result = args.func(args)
    if result is None:
        return None
    print(format_table([result["summary"]]))
    if result.get("rows"):
        # bench returns every item's row for the JSON and prints only the first few.
        rows, shown = result["rows"], result.get("rows_printed", len(result["rows"]))
        print(format_table(rows[:shown]))
        if shown < len(rows):
            print(f"(the first {shown} of {len(rows)} rows; --json-out writes them all)")
    if len(result.get("trajectory", [])) > 1:
        print(format_table(result["trajectory"]))
    if args.json_out:
        write_json(args.json_out, result)
    return result


if __name__ == "__main__":
    interrupt.run(main, "interrupted: eval.py stopped; nothing is half-written, run the same command again for its "
                        "results")
