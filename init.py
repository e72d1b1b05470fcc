"""
The γ initialization rule, for any nn.Module.

Every weight matrix W with fan-in d_in is drawn from N(0, σ²) with σ = d_in^-γ.
γ = 0.5 is the usual LeCun/Xavier-style scale; γ = 1 (smaller) is the paper's recipe. In this file's
repository (models up to 0.5M parameters) γ = 1 needed RMSNorm ε <= 1e-12 and gated attention, and with
both it did no better than γ = 0.5-0.75 (results/README.md there).
Norm weights are set to gain 1 (w=1 for x̂·w; w=0 for offset norms x̂·(1+w), Gemma-style) and
biases to 0, and so are position-bias tables (T5's relative_attention_bias: a bias on the
attention logits, not an embedding; see POSITION_BIAS_REASON). Anything this file cannot
classify is left untouched and reported (and warned about), never silently mis-scaled.

This file imports only torch and the standard library: copy it into another codebase and call

    from init import gamma_init_, format_report
    report = gamma_init_(model, gamma=1.0, seed=0)
    print(format_report(report))

For Hugging Face transformers models pass fan_in_dims=HF_LAYOUTS (stacked MoE experts, routers).

It also audits every norm's ε. RMSNorm divides by sqrt(mean(x²) + ε), and at init the residual
stream entering a norm has mean square ≈ d^-2γ (d the normalised width; the token embedding's
scale, the smallest the stream is), so what matters is r = ε·d^2γ: the norm outputs RMS
1/sqrt(1+r) instead of 1. At d=2048, γ=1, ε=1e-5 (Llama 2 and 3), r = 42: the norm outputs
RMS 0.15 and scales with its input, it does not normalise. Every norm with r >= 0.1 is named in
the report and in one warning. A norm whose ε it cannot read is not audited.

Every parameter is drawn from its own generator, seeded from `seed` and the parameter's
name, on the CPU, as a full tensor. So the weights do not depend on the order modules are
visited, on the device, or on how the model is sharded: under FSDP2 each rank fills its own
shard from the same full tensor, and 1 rank and N ranks end with identical full weights.
"""

import difflib
import math
import re
import warnings

import torch
from torch import nn

# Wrappers that insert a path component without changing what a parameter is
# (torch.compile's OptimizedModule, activation checkpointing, FSDP1). Names are cleaned of
# them so seeds, overrides and reports are the same with or without the wrapper.
_WRAPPER_PARTS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}

_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)


def clean_name(name):
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _name_seed(seed, name):
    # 64-bit FNV-1a of the name, mixed with the seed: stable across processes and Python
    # versions (unlike hash(), which is salted per process). Folded to 32 bits because the CPU
    # generator (Mersenne Twister) only uses the low 32 bits of its seed.
    h = 0xCBF29CE484222325
    for byte in name.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    h = (h ^ (seed * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
    return (h ^ (h >> 32)) & 0xFFFFFFFF


def _is_norm(module):
    return isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()


def _norm_gain(module):
    """How a norm that is not a torch class applies its weight w, found by running it once on a
    small CPU input with w=0 and w=1 (biases 0): "scale" for x̂·w, "offset" for x̂·(1+w)
    (Gemma), None when it is neither or cannot be run that way."""
    params = {n: torch.zeros(p.shape) for n, p in module.named_parameters(recurse=False)}
    x = torch.randn(4, params["weight"].shape[-1], generator=torch.Generator().manual_seed(0))
    try:
        at_0 = torch.func.functional_call(module, params, (x,))
        at_1 = torch.func.functional_call(module, {**params, "weight": torch.ones(params["weight"].shape)}, (x,))
    except Exception:  # any failure (a norm that needs other inputs) means only "cannot tell"
        return None
    if not (isinstance(at_0, torch.Tensor) and isinstance(at_1, torch.Tensor) and at_0.shape == at_1.shape == x.shape):
        return None
    if torch.all(at_0 == 0) and at_1.abs().sum() > 0:
        return "scale"
    if at_0.abs().sum() > 0 and torch.allclose(at_1, 2 * at_0, rtol=1e-4, atol=0):
        return "offset"
    return None


# Batch, instance and group norms are not audited: they follow convolutions, whose output scale
# is set by the convolution's fan-in, not by the width the norm normalises.
_NOT_AUDITED = (nn.GroupNorm, nn.modules.batchnorm._NormBase)

# Where a norm keeps its ε: torch and most code use eps, HF's Llama family variance_epsilon.
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")
# A norm that keeps none, in a Hugging Face model, is built from one of these config fields.
_CONFIG_EPS_ATTRS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")

# r from which ε visibly rules the norm: output RMS 1/sqrt(1.1) = 0.95 instead of 1.
EPS_RATIO_LIMIT = 0.1


def _norm_eps(module, config):
    """(ε, where it was read) for a norm, or (None, None) when it cannot be read."""
    for attr in _EPS_ATTRS:
        if hasattr(module, attr):
            value = getattr(module, attr)
            if value is None and isinstance(module, nn.RMSNorm):
                # torch then adds finfo(x.dtype).eps: 1.2e-7 for float32 inputs, 7.8e-3 for bf16.
                weight = module.weight
                dtype = weight.dtype if weight is not None else torch.get_default_dtype()
                return torch.finfo(dtype).eps, f"eps=None: torch uses finfo({dtype}).eps"
            try:
                return float(value), attr
            except (TypeError, ValueError):
                return None, None
    for attr in _CONFIG_EPS_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, (int, float)):
            return float(value), f"config.{attr}"
    return None, None


def _norm_width(module):
    """The number of features a norm averages over, or None (a container named *Norm*)."""
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, int):
        return shape
    if isinstance(shape, (tuple, list, torch.Size)):
        return math.prod(shape)
    weight = module._parameters.get("weight")
    return weight.shape[0] if weight is not None and weight.dim() == 1 else None


def _suggested_eps(d, gamma):
    # 1e-12 (model.py's default) unless even that is not 100x below d^-2γ (γ well above 1);
    # in log space, where d^-2γ cannot underflow to 0.
    return min(1e-12, 10.0 ** math.floor(-2 - 2 * gamma * math.log10(d)))


def _eps_audit(module, gamma):
    """One report row per norm whose ε is at least EPS_RATIO_LIMIT times its input's mean square
    at init, d^-2γ. That estimate is the embedding's scale; a norm fed by a projection of a
    normalised vector (q/k norms) sees mean square d_model^(1-2γ) instead, so its r is a guide.
    ε is taken to sit inside the square root, as in torch's and transformers' norms."""
    config = getattr(module, "config", None)
    rows = []
    for name, mod in module.named_modules():
        if not _is_norm(mod) or isinstance(mod, _NOT_AUDITED):
            continue
        d = _norm_width(mod)
        eps, source = _norm_eps(mod, config)
        if d is None or eps is None:
            continue
        mean_square = float(d) ** (-2 * gamma)
        r = eps / mean_square
        if r < EPS_RATIO_LIMIT:
            continue
        reason = (f"eps {eps:g} ({source}), input mean square at init d^-2γ = {mean_square:.2g}: r = {r:.3g}, "
                  f"output RMS {(1 + r) ** -0.5:.2g} not 1; use eps <= "
                  f"{_suggested_eps(d, gamma):g} under γ={gamma:g}, or accept that this norm will not normalize")
        rows.append({"name": clean_name(name), "shape": (d,), "d_in": None, "gamma": float(gamma), "std": None,
                     "action": "eps", "reason": reason, "eps": eps, "d": d, "r": r})
    return rows


def _eps_warning(rows, gamma):
    # Identical norms (same ε and width) in one group, named by their path with layer indices as *.
    groups = {}
    for row in rows:
        pattern = ".".join("*" if part.isdigit() else part for part in row["name"].split("."))
        names = groups.setdefault((row["eps"], row["d"]), {})
        names[pattern] = names.get(pattern, 0) + 1
    parts = []
    for (eps, d), names in groups.items():
        count, shown = sum(names.values()), list(names)
        listed = ", ".join(shown[:4]) + (", ..." if len(shown) > 4 else "")
        r = eps * float(d) ** (2 * gamma)
        parts.append(f"{count} norm{'s' if count > 1 else ''} ({listed}) eps {eps:g}, d {d}: r = {r:.3g}")
    suggested = min(_suggested_eps(row["d"], gamma) for row in rows)
    return (f"gamma_init_: {len(rows)} norm(s) have eps >= {EPS_RATIO_LIMIT:g} x their input's mean square at "
            f"init (d^-2γ, r = eps·d^2γ; output RMS 1/sqrt(1+r) instead of 1): " + "; ".join(parts)
            + f". Fix: use eps <= {suggested:g} under γ={gamma:g}, or accept that these norms will not normalize "
            f"(rows 'eps' in the report)")


def _declared_dim(module, param_name, fan_in_dims):
    """Input dimension declared for this parameter, or None.

    A module declares it with a class attribute `gamma_fan_in_dims = {"w_up": 1}` (the index
    of the dimension that holds d_in); a caller declares it for classes it cannot edit with
    `fan_in_dims={MyLayer: {"w": 0}}`. A key is a class or a regex that must match a class name
    whole ("MyLayer", r".*Experts"); a value is {param name: dim} or a function of the module
    returning one. Keys are tried along the MRO (FSDP2 and other wrappers swap a module's class
    for a subclass of it), then in dict order.
    """
    for cls in type(module).__mro__:
        for key, dims in (fan_in_dims or {}).items():
            if key is cls or (isinstance(key, str) and re.fullmatch(key, cls.__name__)):
                dims = dims(module) if callable(dims) else dims
                if param_name in dims:
                    return dims[param_name]
    return getattr(module, "gamma_fan_in_dims", {}).get(param_name)


def _hf_stacked_experts(module):
    # transformers 5.x stores stacked experts as (E, out, in) (F.linear per expert) and marks the
    # classes stored (E, in, out), e.g. GPT-OSS, with is_transposed=True: the flag its own
    # expert kernels read. No flag (an experts class it does not decorate): declare nothing, so
    # the tensors are skipped and warned about rather than guessed.
    transposed = getattr(module, "is_transposed", None)
    if not isinstance(transposed, bool):
        return {}
    return dict.fromkeys(("gate_up_proj", "up_proj", "down_proj"), 1 if transposed else 2)


# Layouts of Hugging Face transformers (5.x) modules that are not torch layers: pass
# fan_in_dims=HF_LAYOUTS, or {**HF_LAYOUTS, MyLayer: {...}} to add your own. GPT-2's Conv1D
# needs no entry (recognised by default).
HF_LAYOUTS = {
    r".*Experts": _hf_stacked_experts,         # MixtralExperts, Qwen2MoeExperts, Qwen3MoeExperts, ...
    r".*Top[Kk]Router": {"weight": 1},         # router weight (E, d_model), applied as F.linear
}


# T5's relative_attention_bias (also LongT5, UMT5, MPNet, Pix2Struct, ...) is an
# nn.Embedding(num_buckets, n_heads): one scalar per relative-position bucket and head, added to
# the attention logits. It is a bias, not a token embedding: the embedding rule would give it
# d_in = n_heads (std 1/16 at γ=1 for 16 heads), far above the logits q·k, which under γ=1 start
# near 0 (q and k have RMS d^(1/2-γ)), so attention would start purely positional. It starts at 0
# like every other bias: positions add nothing at init, and the table still learns from step one,
# since it enters the logits additively (its gradient is the logits' gradient summed over its bucket).
# Recognised as an nn.Embedding whose attribute name contains "bias"; for another rule, fill the
# table yourself after gamma_init_.
POSITION_BIAS_REASON = "position-bias table (added to attention logits): 0, like a bias, not the embedding rule"


def classify(module, param_name, param, fan_in_dims=None, embedding_fan_in="embedding_dim", module_name=""):
    """Return (action, d_in, reason): action is "normal", "ones", "zeros" or "skipped".
    module_name (the module's path in the model) tells a position-bias table from an embedding."""
    dim = _declared_dim(module, param_name, fan_in_dims)
    if dim is not None:
        return "normal", param.shape[dim], "declared"
    if param_name == "bias" or (param_name.endswith("_bias") and param.dim() == 1):
        return "zeros", None, "bias"
    if _is_norm(module):
        if param_name != "weight" or param.dim() != 1:
            return "skipped", None, f"unrecognised norm parameter of {type(module).__name__}"
        gain = "scale" if isinstance(module, _NORM_TYPES) else _norm_gain(module)
        if gain == "scale":
            return "ones", None, "norm weight"
        if gain == "offset":
            return "zeros", None, "offset norm x*(1+w): w=0 is gain 1"
        return "skipped", None, (f"norm {type(module).__name__} computes neither x*w nor x*(1+w) on a test "
                                 f"input: set its weight to gain 1 yourself")
    if (type(module).__name__ == "Conv1D" and param_name == "weight"
            and param.shape == (getattr(module, "nx", None), getattr(module, "nf", None))):
        return "normal", param.shape[0], "HF Conv1D (in, out)"  # GPT-2's transposed Linear
    if isinstance(module, nn.Linear) and param_name == "weight":
        return "normal", param.shape[1], "Linear (out, in)"
    if isinstance(module, nn.Embedding) and param_name == "weight":
        if "bias" in module_name.rsplit(".", 1)[-1]:
            return "zeros", None, POSITION_BIAS_REASON
        return "normal", getattr(module, embedding_fan_in), f"Embedding ({embedding_fan_in})"
    if isinstance(module, nn.modules.conv._ConvNd) and not module.transposed and param_name == "weight":
        # (out, in/groups, *kernel): every input channel of every kernel tap feeds one output.
        return "normal", math.prod(param.shape[1:]), "Conv (out, in/groups, *kernel)"
    if isinstance(module, nn.MultiheadAttention) and param_name.endswith("proj_weight"):
        return "normal", param.shape[1], "MultiheadAttention (out, in)"
    return "skipped", None, (f"unknown parameter {param_name!r} of {type(module).__name__}: declare its "
                             f"fan-in with fan_in_dims={{{type(module).__name__}: {{{param_name!r}: DIM}}}}")


def _gamma_for(name, gamma, overrides):
    # First matching pattern wins, so put specific patterns before general ones.
    for pattern, value in (overrides or {}).items():
        if re.search(pattern, name):
            return value
    return gamma


def check_overrides(overrides, module):
    """Raise a one-line ValueError for an overrides entry that would not do what it says: a key
    that is not a valid regex, a γ that is not a number, a pattern that matches no parameter (a
    typo would leave every tensor at the global γ, silently), or one that matches only the alias
    of a tied tensor (which is drawn under its first name, so the override would change nothing).
    Callers can check a config against a model built on the meta device before training."""
    drawn = _drawn_names(module)
    for pattern, value in (overrides or {}).items():
        try:
            regex = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"overrides pattern {pattern!r} is not a valid regex ({e}): fix it, e.g. "
                             f"r'^lm_head\\.' for the output head") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"overrides pattern {pattern!r} maps to {value!r}: the value must be a number, the "
                             f"γ of the parameters it matches")
        hits = [(name, first) for name, first in drawn if regex.search(name)]
        if not hits:
            close = difflib.get_close_matches(pattern, [name for name, _ in drawn], n=3, cutoff=0)
            raise ValueError(f"overrides pattern {pattern!r} matches no parameter (names are like "
                             f"{', '.join(close)}): fix the pattern or remove it")
        if all(name != first for name, first in hits):
            raise ValueError(f"overrides pattern {pattern!r} matches only {hits[0][0]}, which is tied to "
                             f"{hits[0][1]} and drawn under that name: write the pattern for {hits[0][1]}")


def _drawn_names(module):
    """(cleaned name, name the tensor is drawn under) for every parameter, in module order: a tied
    tensor is drawn once, under its first name."""
    names, drawn_as = [], {}
    for module_name, mod in module.named_modules():
        for param_name, param in mod.named_parameters(recurse=False):
            name = clean_name(f"{module_name}.{param_name}" if module_name else param_name)
            names.append((name, drawn_as.setdefault(id(param), name)))
    return names


@torch.no_grad()
def _fill_(param, full):
    """Copy a full CPU tensor into a parameter, or into this rank's shard of a DTensor."""
    if hasattr(param, "device_mesh") and hasattr(param, "placements"):
        from torch.distributed.tensor import distribute_tensor
        # src_data_rank=None: every rank already holds the identical full tensor, so each
        # takes its own chunk locally, with the same chunking rule FSDP2 uses, and no comms.
        full = distribute_tensor(full.to(param.device_mesh.device_type), param.device_mesh,
                                 param.placements, src_data_rank=None)
    param.copy_(full.to(dtype=param.dtype))


@torch.no_grad()
def gamma_init_(module, gamma=1.0, seed=0, overrides=None, fan_in_dims=None,
                embedding_fan_in="embedding_dim"):
    """Initialise every parameter of `module` in place by the γ rule; return a report.

    gamma:            exponent in σ = d_in^-γ for every weight matrix.
    seed:             with the parameter name, decides every value (see the module docstring).
    overrides:        {regex: gamma}, searched in the cleaned parameter name, first match wins,
                      e.g. {r"^lm_head\\.": 0.5} keeps the output head at the standard scale.
                      A pattern that is not a regex, matches no parameter, or matches only a
                      tied alias (lm_head.weight when it is the embedding) raises, naming the
                      fix (check_overrides).
    fan_in_dims:      {class or class-name regex: {param name: index of the d_in dimension}} for
                      layers this file does not know, e.g. {"MyLayer": {"w": 0}} for a (in, out)
                      weight; HF_LAYOUTS for Hugging Face transformers models.
    embedding_fan_in: "embedding_dim" (default: token vectors start at RMS d^-γ, the scale the
                      residual-stream balance assumes) or "num_embeddings".

    Returns a list of rows {name, shape, d_in, gamma, std, action, reason}, one per parameter,
    then one per norm module whose ε rules it at init (action "eps", name the module's, shape
    (d,), and also eps, d and r = ε·d^2γ), which are also warned about together.
    """
    if embedding_fan_in not in ("embedding_dim", "num_embeddings"):
        raise ValueError(f"embedding_fan_in={embedding_fan_in!r}: use 'embedding_dim' or 'num_embeddings'")
    # Every parameter with the name it is drawn under: a tied tensor is drawn once, under its first name.
    params, drawn_as = [], {}
    for module_name, mod in module.named_modules():
        for param_name, param in mod.named_parameters(recurse=False):
            name = clean_name(f"{module_name}.{param_name}" if module_name else param_name)
            params.append((name, clean_name(module_name), mod, param_name, param, drawn_as.setdefault(id(param), name)))
    check_overrides(overrides, module)
    report = []
    for name, module_name, mod, param_name, param, first in params:
        row = {"name": name, "shape": tuple(param.shape), "d_in": None, "gamma": None, "std": None}
        if first != name:
            report.append({**row, "action": "tied", "reason": f"same tensor as {first}"})
            continue
        if param.is_meta:
            raise ValueError(f"{name} is on the meta device: call module.to_empty(device=...) before gamma_init_")
        action, d_in, reason = classify(mod, param_name, param, fan_in_dims, embedding_fan_in, module_name)
        if action == "normal":
            g = _gamma_for(name, gamma, overrides)
            std = float(d_in) ** -g
            generator = torch.Generator().manual_seed(_name_seed(seed, name))
            full = torch.randn(param.shape, generator=generator, dtype=torch.float32).mul_(std)
            if isinstance(mod, nn.Embedding) and mod.padding_idx is not None:
                full[mod.padding_idx] = 0  # the padding row stays zero, as nn.Embedding makes it
            _fill_(param, full)
            row.update(d_in=int(d_in), gamma=float(g), std=std)
        elif action in ("ones", "zeros"):
            _fill_(param, torch.full(param.shape, 1.0 if action == "ones" else 0.0))
        report.append({**row, "action": action, "reason": reason})
    skipped = [r["name"] for r in report if r["action"] == "skipped"]
    if skipped:
        warnings.warn(f"gamma_init_ left {len(skipped)} parameter(s) untouched (see the report): {', '.join(skipped)}")
    eps_rows = _eps_audit(module, gamma)
    if eps_rows:
        warnings.warn(_eps_warning(eps_rows, gamma))
    return report + eps_rows


def format_report(report):
    """The report as a fixed-width table, one parameter a line."""
    lines = [f"{'parameter':<44} {'shape':<20} {'d_in':>7} {'gamma':>6} {'std':>10}  action"]
    for r in report:
        d_in = "" if r["d_in"] is None else str(r["d_in"])
        g = "" if r["gamma"] is None else f"{r['gamma']:g}"
        std = "" if r["std"] is None else f"{r['std']:.3e}"
        # The reason is shown wherever the action alone does not explain the value (a zero that is
        # not a bias: an offset norm's weight, a position-bias table; anything skipped).
        plain = r["action"] == "normal" or r["reason"] in ("bias", "norm weight")
        action = r["action"] if plain else f"{r['action']}: {r['reason']}"
        lines.append(f"{r['name']:<44} {str(r['shape']):<20} {d_in:>7} {g:>6} {std:>10}  {action}")
    return "\n".join(lines)


# The largest γ train.py and eval.py accept: d^-3 is already 4e-6 at d=64, and γ=50 underflows every
# weight to exactly 0 in fp32 (train.py's `gamma` setting says more).
GAMMA_MAX = 3.0


def init_model_(model, gamma=1.0, seed=0, overrides=None):
    """gamma_init_ for this repository's GPT (model.py), which then resets its MoE buffers; returns the
    report. Identical weights for any world size, and valid after building on meta + to_empty()."""
    report = gamma_init_(model, gamma=gamma, seed=seed, overrides=overrides)
    model.reset_buffers()
    return report
