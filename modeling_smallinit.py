"""smallinit's model for HF transformers (trust_remote_code=True), written into a folder by
`python train.py export CKPT OUT_DIR --format hf` for the models stock LlamaForCausalLM
cannot express: gated attention, MoE, a GELU MLP, document masking.

The network is model.py's GPT, which the folder carries beside this file (with the files it
imports): SmallInitForCausalLM only adapts HF's calling conventions to it, so a change to the
model is made in model.py alone. The GPT's modules are this model's, under model.py's names, so
the safetensors file is model.py's state dict as it is. transformers loads the folder as a
package and copies the files this one imports relatively, so the folder needs torch and
transformers only, never the smallinit repo.
"""
import contextlib
from dataclasses import MISSING, fields

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4.x spelling
    from transformers import PretrainedConfig as PreTrainedConfig

# The repo imports this file too, for SmallInitConfig alone (hf_export.py): there it is no package,
# and the model.py beside it is not the one an export folder carries.
if __package__:
    from .generate import KVCache
    from .model import GPT, GPTConfig


# The output's cache field: `cache` in recent transformers, `past_key_values` in older ones.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

# SmallInitConfig's field -> the GPTConfig field it holds, where HF has a name of its own: tools such
# as lm-eval read max_position_embeddings, and configs written by earlier exports use these names.
HF_NAMES = {
    "vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head", "intermediate_size": "d_ff",
    "mlp": "mlp", "rms_norm_eps": "norm_eps", "attn_gate": "attn_gate", "rope_theta": "rope_theta",
    "max_position_embeddings": "max_seq_len", "doc_mask": "doc_mask", "eot_id": "eot_id",
    "n_experts": "n_experts", "num_experts_per_tok": "top_k", "d_expert": "d_expert",
    "router_score": "router_score", "tie_word_embeddings": "tie_embeddings",
}
# GPTConfig's fields that say how a model runs or trains, not the function it computes: not exported
# (ff_multiple_of is resolved into d_ff already).
RUN_ONLY = {"attn_backend", "moe_impl", "activation_checkpointing", "moe_aux_loss_coef", "moe_bias_rate",
            "ff_multiple_of"}


def gpt_fields(config_class):
    """SmallInitConfig's field -> GPTConfig's, for every field of config_class but RUN_ONLY: HF's name where
    HF has one, else GPTConfig's own. A field a forker adds to GPTConfig is then exported and loaded back
    with no line here."""
    named = set(HF_NAMES.values()) | RUN_ONLY
    return {**HF_NAMES, **{f.name: f.name for f in fields(config_class) if f.name not in named}}


def field_default(field):
    return field.default if field.default is not MISSING else field.default_factory()


class SmallInitConfig(PreTrainedConfig):
    model_type = "smallinit"

    def __init__(self, vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, intermediate_size=192, mlp="swiglu", rms_norm_eps=1e-12,
                 attn_gate="elementwise", rope_theta=10000.0, max_position_embeddings=1024, doc_mask=False,
                 eot_id=-1, n_experts=0, num_experts_per_tok=2, d_expert=192, router_score="softmax",
                 tie_word_embeddings=False, use_cache=True, **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads
        self.intermediate_size, self.mlp, self.rms_norm_eps = intermediate_size, mlp, rms_norm_eps
        self.attn_gate, self.rope_theta, self.max_position_embeddings = attn_gate, rope_theta, max_position_embeddings
        self.doc_mask, self.eot_id = doc_mask, eot_id
        self.n_experts, self.num_experts_per_tok = n_experts, num_experts_per_tok  # HF's name for top_k
        self.d_expert, self.router_score, self.use_cache = d_expert, router_score, use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


def gpt_config(config, config_class=None):
    """The GPTConfig (config_class: the folder's model.GPTConfig) of a SmallInitConfig. A field that an
    earlier export did not write takes GPTConfig's default. MoE's reference loop: grouped GEMMs need
    sizes divisible by 8 and a kernel for the device and dtype, and a loaded model goes on whatever
    device and dtype its user picks."""
    config_class = config_class or GPTConfig
    carried = {ours: getattr(config, hf) for hf, ours in gpt_fields(config_class).items() if hasattr(config, hf)}
    return config_class(**carried, attn_backend="sdpa", moe_impl="reference")


class SmallInitCache:
    """The cache generate passes from one forward to the next: model.py's KVCache, grown as tokens
    arrive (doubling, up to max_position_embeddings), so a forward without a cache to continue
    stores only its own keys."""

    def __init__(self, cfg, batch, device, dtype):
        self.cfg, self.batch, self.device, self.dtype = cfg, batch, device, dtype
        self.kv = KVCache(cfg, batch, 0, device, dtype)

    def get_seq_length(self, layer_idx=0):
        return self.kv.length

    def reserve(self, tokens):
        old, size = self.kv, self.kv.k[0].shape[2]
        if old.length + tokens <= size:
            return
        # Capped: past max_position_embeddings GPT.forward refuses the tokens in one line.
        self.kv = KVCache(self.cfg, self.batch, min(max(2 * size, old.length + tokens), self.cfg.max_seq_len),
                          self.device, self.dtype)
        for src, dst in zip(old.k + old.v, self.kv.k + self.kv.v):
            dst[:, :, :old.length] = src[:, :, :old.length]
        self.kv.doc[:, :old.length] = old.doc[:, :old.length]
        self.kv.docs_before, self.kv.length = old.docs_before, old.length


@contextlib.contextmanager
def padding_hidden(blocks, keep):
    """While inside, each block's attention also hides the keys where keep (B, cached + new) is
    False: a padded batch (generate's left padding). GPT.forward builds one mask, causal or
    document-causal, for all blocks and takes no padding of its own; a forward pre-hook narrows
    that mask where Block.forward(x, mask, kv, rope) receives it."""
    if keep is None:
        yield
        return
    narrowed = {}

    def hide(block, args):
        x, mask, kv, rope = args
        if "mask" not in narrowed:
            S, T = keep.shape[1], x.shape[1]
            q_pos, k_pos = torch.arange(S - T, S, device=x.device), torch.arange(S, device=x.device)
            rule = k_pos <= q_pos[:, None] if mask is None else mask  # None: GPT's plain causal kernel
            # A padding query sees no key and its softmax would be NaN: it sees itself.
            narrowed["mask"] = (rule & keep[:, None, None, :]) | (k_pos == q_pos[:, None])
        return x, narrowed["mask"], kv, rope

    handles = [block.register_forward_pre_hook(hide) for block in blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class SmallInitForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = SmallInitConfig
    base_model_prefix = "smallinit"
    _tied_weights_keys = {"lm_head.weight": "tok_emb.weight"}

    def __init__(self, config):
        super().__init__(config)
        gpt = GPT(gpt_config(config))
        # The GPT's modules are registered here under their own names, so the state dict is model.py's.
        # The GPT itself stays off the module tree: registered, each weight would have a second name.
        for name, module in gpt.named_children():
            self.add_module(name, module)
        self.__dict__["gpt"] = gpt
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # generate's DynamicCache has no use here: forward makes a SmallInitCache

    def train(self, mode=True):
        self.gpt.train(mode)  # not a child, but GPT.forward reads its flag (MoE token counts)
        return super().train(mode)

    def _init_weights(self, module):
        # A checkpoint overwrites every weight; only a model built from the config alone starts here.
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=module.weight.shape[-1] ** -0.5)

    def get_input_embeddings(self):
        return self.tok_emb

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, cache=None, past_key_values=None, use_cache=None,
                labels=None, **kwargs):
        """Logits of input_ids (B, T), continuing cache (the one an earlier call returned) if given.
        Positions follow the cache; RoPE sees only their differences, so a left-padded row needs no
        position_ids. attention_mask (B, cached + T): 0 marks padding, hidden from every query."""
        for name in ("inputs_embeds", "position_ids"):
            if kwargs.get(name) is not None:
                raise ValueError(f"SmallInitForCausalLM takes no {name}: pass input_ids (and attention_mask "
                                 "for padding)")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = past_key_values if cache is None else cache  # older transformers name it past_key_values
        if cache is not None and not isinstance(cache, SmallInitCache):
            if cache.get_seq_length():
                raise ValueError(f"a {type(cache).__name__} holding tokens cannot be continued: pass the cache "
                                 "this model returned")
            cache = None  # an empty cache of another kind, handed in to start one
        if use_cache and cache is None:
            cache = SmallInitCache(self.gpt.cfg, input_ids.shape[0], input_ids.device, self.lm_head.weight.dtype)
        start = 0 if cache is None else cache.get_seq_length()
        keep = None
        if attention_mask is not None and not attention_mask.bool().all():
            if attention_mask.shape[1] != start + input_ids.shape[1]:
                raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions, the cache and "
                                 f"input_ids {start + input_ids.shape[1]}: pass the whole sequence's mask")
            keep = attention_mask.bool()
        if cache is not None:
            cache.reserve(input_ids.shape[1])
        with padding_hidden(self.layers, keep):
            logits, _ = self.gpt(input_ids, kv_cache=None if cache is None else cache.kv)
        loss = None
        if labels is not None:  # HF convention: labels are the inputs, shifted here
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})
