"""A smallinit checkpoint as a HF transformers folder (`python train.py export CKPT OUT_DIR --format hf`).

    config.json, model.safetensors, generation_config.json   the model
    tokenizer.json, tokenizer_config.json                     the run's tokenizer (byte-level or tiktoken)
    modeling_smallinit.py, model.py, loss.py, generate.py     only for models Llama cannot express
    smallinit_export.json                                     marks the folder as an export, the only kind
                                                              a later export into it replaces

A dense causal SwiGLU model without the attention gate is exactly LlamaForCausalLM (fp32 RMSNorm
with the same eps, RoPE on the pairs (i, i + head_dim/2), GQA head groups in the same order), so
it exports as one, with no remote code. Gated attention, MoE, a GELU MLP and document masking
need modeling_smallinit.py (trust_remote_code=True), which wraps the folder's copy of model.py:
the safetensors file is model.py's state dict.
The tokenizer is the run's tiktoken encoding rewritten as a byte-level BPE (`tokenizers`), so
AutoTokenizer gives the ids prepare_data.py gave; `bytes` is the same BPE with no merges.
"""
import argparse
import ast
import errno
import importlib
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import fields

from checkpoint import check_export_parent, export, export_write_error, load_model
from data import get_tokenizer
from fileio import file_kind
from interrupt import Interrupted, sigint_held

ROOT = os.path.dirname(os.path.abspath(__file__))
MODELING_FILE = "modeling_smallinit.py"
# What tells an earlier export from any other folder: only write_folder writes this file. config.json
# is no sign, since a run folder has one too, and taking it for an export would replace (delete) the run.
MARKER = "smallinit_export.json"
MARKER_BYTES = json.dumps({"exporter": "smallinit hf_export.py", "format": "hf"}).encode()


def require(module, why):
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise ValueError(f"--format hf needs the `{package}` package ({why}): pip install {package}") from None


def llama_obstacles(cfg):
    """The settings of a GPTConfig that LlamaForCausalLM has no way to express."""
    obstacles = []
    if cfg.attn_gate != "none":
        obstacles.append(f"attn_gate={cfg.attn_gate!r} (Llama has no attention-output gate)")
    if cfg.n_experts:
        obstacles.append(f"n_experts={cfg.n_experts} (Llama's MLP is dense)")
    if cfg.mlp != "swiglu":
        obstacles.append(f"mlp={cfg.mlp!r} (Llama's MLP is SwiGLU)")
    if cfg.doc_mask:
        obstacles.append("doc_mask=True (Llama attends across end-of-text tokens)")
    # Any other field of the function (one a forker added to GPTConfig) away from its default: Llama cannot
    # say it, and dropped silently the export would compute another function.
    from modeling_smallinit import RUN_ONLY, field_default
    for field in fields(cfg):
        value = getattr(cfg, field.name)
        if field.name not in LLAMA_FIELDS | RUN_ONLY and value != field_default(field):
            obstacles.append(f"{field.name}={value!r} (Llama has no such setting)")
    return obstacles


# GPTConfig's fields that Llama's config says, or whose Llama form llama_obstacles checks above.
LLAMA_FIELDS = {"vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "norm", "norm_eps", "rope_theta",
                "max_seq_len", "tie_embeddings", "eot_id", "attn_gate", "n_experts", "mlp", "doc_mask", "top_k",
                "d_expert", "router_score"}


# model.py's parameter name -> LlamaForCausalLM's ({i}: the layer).
LLAMA_NAMES = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"layers.{{i}}.attn.w{p}.weight": f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkvo"},
    **{f"layers.{{i}}.mlp.w_{p}.weight": f"model.layers.{{i}}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}


def llama_state_dict(state, n_layer):
    names = {ours.format(i=i): theirs.format(i=i) for ours, theirs in LLAMA_NAMES.items() for i in range(n_layer)}
    unmapped = sorted(set(state) - set(names))
    assert not unmapped, f"LLAMA_NAMES has no name for {unmapped}: model.py changed, the mapping did not"
    return {names[k]: v for k, v in state.items()}


def model_config(cfg, eot_id):
    """(transformers config, its architecture) for a GPTConfig."""
    if cfg.norm != "rmsnorm":
        raise ValueError(f"model.norm={cfg.norm!r} has no HF export yet (Llama and modeling_smallinit.py are "
                         f"RMSNorm models): export it with --format pt")
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
                  num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head, rms_norm_eps=cfg.norm_eps,
                  max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
                  eos_token_id=eot_id, pad_token_id=eot_id)
    if not llama_obstacles(cfg):
        from transformers import LlamaConfig
        return LlamaConfig(**common, intermediate_size=cfg.d_ff, hidden_act="silu", head_dim=cfg.head_dim,
                           rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                           attention_bias=False, mlp_bias=False), "LlamaForCausalLM"
    from modeling_smallinit import SmallInitConfig, gpt_fields
    config = SmallInitConfig(**{hf: getattr(cfg, ours) for hf, ours in gpt_fields(type(cfg)).items()},
                             eos_token_id=eot_id, pad_token_id=eot_id)
    config.auto_map = {"AutoConfig": "modeling_smallinit.SmallInitConfig",
                       "AutoModelForCausalLM": "modeling_smallinit.SmallInitForCausalLM"}
    return config, "SmallInitForCausalLM"


# What the remote code may import besides its own files: what every loader of the folder has.
LOADER_PACKAGES = {"torch", "transformers"}


def remote_code():
    """{file name: source} of the remote code: modeling_smallinit.py and the project files it imports,
    transitively (model.py, generate.py, loss.py). transformers loads the folder as a package and
    copies into it only the files imported relatively, by lines starting `from .FILE import`, so a
    project import is made relative on the way: left as `from loss import`, it would load the repo's
    loss.py where the repo is on the path, and fail everywhere else."""
    project = {name[:-3] for name in os.listdir(ROOT) if name.endswith(".py")}
    sources, todo = {}, [MODELING_FILE[:-3]]
    while todo:
        name = todo.pop()
        with open(os.path.join(ROOT, name + ".py"), encoding="utf-8") as f:
            lines = f.read().splitlines(keepends=True)
        for node in ast.walk(ast.parse("".join(lines))):
            if isinstance(node, ast.Import):
                imported = [(alias.name, 0) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                imported = [(node.module or "", node.level)]
            else:
                continue
            for module, level in imported:
                top, where = module.split(".")[0], f"{name}.py line {node.lineno}"
                if level or top in project:
                    form = re.compile(rf"(\s*from\s+)\.?{re.escape(top)}(\s+import\b)")
                    if not (isinstance(node, ast.ImportFrom) and level <= 1 and module == top and top in project
                            and form.match(lines[node.lineno - 1])):
                        raise ValueError(f"{where}: import a project file as `from FILE import NAME` at the start "
                                         "of a line, the one form a HF export carries")
                    lines[node.lineno - 1] = form.sub(rf"\1.{top}\2", lines[node.lineno - 1], count=1)
                    if top + ".py" not in sources and top not in todo:
                        todo.append(top)
                elif top not in LOADER_PACKAGES and top not in sys.stdlib_module_names:
                    raise ValueError(f"{where} imports {top}, which a HF export cannot carry: its files may "
                                     f"import {', '.join(sorted(LOADER_PACKAGES))} and the standard library")
        sources[name + ".py"] = "".join(lines)
    return sources


def byte_chars():
    """GPT-2's byte -> printable character map, the alphabet of HF's ByteLevel pre-tokenizer:
    printable Latin-1 bytes stand for themselves, the rest for the characters from U+0100 up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in keep)
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def onig_pattern(pat):
    """tiktoken's regex for HF tokenizers' Oniguruma: there `X{1,3}+` is `(X{1,3})+`, not the
    possessive `X{1,3}` tiktoken means (cl100k would cut 1234567 as one piece, not 123|456|7), so
    each possessive interval becomes the equivalent atomic group. ?+ *+ ++ mean the same in both."""
    return re.sub(r"(\\p\{\w+\}|\\.|\[[^\]]*\]|[^\\])(\{\d+(?:,\d*)?\})\+", r"(?>\1\2)", pat)


def hf_tokenizer(enc, max_len):
    """A tiktoken Encoding as a PreTrainedTokenizerFast giving the same ids.

    tiktoken merges, within each piece its regex cut, the adjacent pair whose concatenation has
    the lowest rank, and takes a piece that is itself a token whole. That is a BPE whose merges
    are ordered by the rank of their result, with ignore_merges; every split of a token into two
    tokens is listed, since the parts present depend on the piece. Special tokens keep their ids."""
    tokenizers = require("tokenizers", "writes tokenizer.json")
    from transformers import PreTrainedTokenizerFast
    chars = byte_chars()
    text = lambda b: "".join(chars[x] for x in b)
    ranks = enc._mergeable_ranks  # tiktoken has no public accessor for its ranks and regex
    merges = sorted((rank, ranks[b[:i]], text(b[:i]), text(b[i:]))
                    for b, rank in ranks.items() for i in range(1, len(b)) if b[:i] in ranks and b[i:] in ranks)
    vocab = {text(b): rank for b, rank in ranks.items()}
    vocab.update(enc._special_tokens)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [(a, b) for _, _, a, b in merges], ignore_merges=True))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(onig_pattern(enc._pat_str)), behavior="isolated"),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in enc._special_tokens])
    eot = enc.decode([enc.eot_token])
    # split_special_tokens: prepare_data.py encodes documents with encode_ordinary, so a literal
    # "<|endoftext|>" inside a text was bytes in training, not the end-of-text id.
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eot, pad_token=eot, model_max_length=max_len,
                                   clean_up_tokenization_spaces=False, split_special_tokens=True)


def check_replaceable(out_dir):
    """Raise unless out_dir is absent, an empty folder, or an earlier export: anything else there
    (a run folder, a user's folder or file, a link) is not this exporter's to replace. The folder is
    looked at through one descriptor: another export swapping its own in meanwhile can't make one
    export look like a foreign folder (listed before it moved, its marker looked for after). A folder
    that lacks the marker is looked at again if it has left out_dir meanwhile: the other export, having
    moved it aside, deletes it, its marker among the first files."""
    while True:
        try:
            fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except NotADirectoryError:  # also a link, to a folder or not: replacing it would swap the link
            try:
                what = file_kind(os.lstat(out_dir).st_mode)
            except FileNotFoundError:  # gone since the open: look again
                continue
            break
        try:
            if not os.listdir(fd) or has_marker(fd):
                return
            try:
                moved = not os.path.samestat(os.fstat(fd), os.lstat(out_dir))
            except FileNotFoundError:
                moved = True
        finally:
            os.close(fd)
        if not moved:
            what = f"a folder without the {MARKER} that every export holds"
            break
    raise ValueError(f"{out_dir} exists and is not an earlier export ({what}): choose another OUT_DIR "
                     "or remove it yourself")


def has_marker(dir_fd):
    try:
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        return f.read(len(MARKER_BYTES) + 1) == MARKER_BYTES


def put_in_place(tmp, out_dir):
    """Rename the finished folder tmp to out_dir. What was there is renamed aside under a name of its
    own and deleted only once tmp is in place: a death in between leaves it whole beside out_dir, and
    nothing that happens to be called OUT.old is touched. Ctrl-C is held back until the swap is done:
    between the two renames it would leave out_dir missing. A second export to the same out_dir
    finishing at the same moment makes one of the renames fail (the folder it moved is gone, or its
    place is taken): the state is then looked at again, so the last one to land wins, whole."""
    parent, name = os.path.split(out_dir)
    aside = []
    with sigint_held():
        while True:
            check_replaceable(out_dir)
            if os.path.lexists(out_dir):
                old = tempfile.mkdtemp(dir=parent, prefix=name + ".", suffix=".old")
                try:
                    os.rename(out_dir, old)  # onto mkdtemp's empty folder: a rename may replace one
                except FileNotFoundError:
                    os.rmdir(old)
                    continue
                aside.append(old)
            try:
                os.rename(tmp, out_dir)
                break
            except OSError as e:  # ENOTEMPTY / EEXIST: the other export landed between the two renames
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        for old in aside:
            shutil.rmtree(old)


def write_folder(out_dir, write):
    """write(tmp) fills a fresh folder that then becomes out_dir in one rename: a reader never sees
    half an export. An earlier export at out_dir is replaced; anything else there is refused. Missing folders
    above out_dir are made (check_export_parent), as the pt export makes them."""
    check_export_parent(out_dir, make=True)
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    tmp = tempfile.mkdtemp(dir=parent, prefix=os.path.basename(out_dir) + ".", suffix=".tmp")
    try:
        write(tmp)
        with open(os.path.join(tmp, MARKER), "wb") as f:
            f.write(MARKER_BYTES)
        # mkdtemp makes its folder 0700 and safetensors its file 0600, while the rest gets the umask's
        # mode: exports are copied to shared servers, so each gets what a plain new one would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        put_in_place(tmp, out_dir)
    except BaseException:  # a refusal, a full disk, Ctrl-C: no half-written folder left beside out_dir
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)
        raise


def export_hf(ckpt, out_dir, tokenizer_dir=None):
    """Write CKPT (any checkpoint checkpoint.load_model loads) as a transformers folder; returns the architecture."""
    if not out_dir:  # abspath would make it the current folder, and the refusal would advise removing that
        raise ValueError("export: OUT_DIR is empty: name the folder to write, e.g. out/hf/model")
    check_export_parent(out_dir)
    check_replaceable(os.path.abspath(out_dir))  # before the work, not only before the rename
    require("transformers", "the config and tokenizer classes")
    safetensors_torch = require("safetensors.torch", "writes model.safetensors")
    model, info = load_model(ckpt)
    cfg, meta = model.cfg, info["data_meta"]
    config, arch = model_config(cfg, meta["eot_id"])
    config.architectures = [arch]
    state = model.state_dict()
    if cfg.tie_embeddings:  # safetensors stores a tensor once; transformers re-ties lm_head on load
        del state["lm_head.weight"]
    if arch == "LlamaForCausalLM":
        state = llama_state_dict(state, cfg.n_layer)
    from transformers import GenerationConfig
    generation = GenerationConfig(eos_token_id=meta["eot_id"], pad_token_id=meta["eot_id"], do_sample=False)
    # Anchor-task ids are not text: that model ships without a tokenizer.
    enc = None if meta["tokenizer"] == "anchor" else get_tokenizer(meta["tokenizer"], tokenizer_dir)
    code = {} if arch == "LlamaForCausalLM" else remote_code()

    def write(folder):
        config.save_pretrained(folder)
        generation.save_pretrained(folder)
        tensors = {k: v.detach().float().contiguous() for k, v in state.items()}
        safetensors_torch.save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        for name, source in code.items():
            with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                f.write(source)
        if enc is not None:
            hf_tokenizer(enc, cfg.max_seq_len).save_pretrained(folder)

    try:
        write_folder(out_dir, write)
    except ValueError:  # a refusal (check_replaceable), not a failed write
        raise
    except Exception as e:  # safetensors and tokenizers report a failed write in errors of their own
        error = export_write_error(e, out_dir, sum(v.nbytes for v in state.values()))
        if error is None:
            raise
        raise error from None
    why = "" if arch == "LlamaForCausalLM" else f" with {MODELING_FILE} (trust_remote_code=True): " + \
        "; ".join(llama_obstacles(cfg))
    print(f"exported {info['path']} (step {info.get('step')}) -> {out_dir} as {arch}{why}"
          + ("" if enc else "; no tokenizer (anchor-task ids are not text)"))
    return arch


def export_command(argv):
    """`python train.py export ...`: one file (pt: checkpoint.export) or a HF transformers folder (hf: export_hf)."""
    p = argparse.ArgumentParser(prog="train.py export", description="one file (pt) or a HF transformers folder (hf)")
    p.add_argument("ckpt", help="checkpoint folder (hf: also a .pt export or a run folder)")
    p.add_argument("out", help="pt: the file to write; hf: the folder")
    p.add_argument("--format", choices=["pt", "hf"], default="pt", help="pt: one torch file; hf: a transformers folder")
    p.add_argument("--tokenizer-dir", help="hf: offline tiktoken files (prepare_data.py --tokenizer-dir)")
    a = p.parse_args(argv)
    try:
        if a.format == "pt":
            export(a.ckpt, a.out)
        else:
            export_hf(a.ckpt, a.out, a.tokenizer_dir)
    except KeyboardInterrupt:  # both write under a temporary name, removed on the way out, and rename it into place
        raise Interrupted(f"interrupted: the export to {a.out} stopped before it finished; nothing is "
                          f"half-written, the same command exports again") from None
