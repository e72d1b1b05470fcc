"""smallinit's decoder for HF transformers (trust_remote_code=True), written into a folder by
`python train.py export CKPT OUT_DIR --format hf` for the models stock LlamaForCausalLM
cannot express: gated attention, MoE, a GELU MLP, document masking.

The maths is model.py's, evaluated the way its sdpa backend evaluates it (fp32 RMSNorm, RoPE on
the pairs (i, i + head_dim/2), the sigmoid gate on each head's output, fp32 top-k routing with
the selection bias), and the parameter names are model.py's, so the safetensors file is
model.py's state dict as it is. This file imports only torch and transformers: the folder
works without the smallinit repo.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4.x spelling
    from transformers import PretrainedConfig as PreTrainedConfig


# The output's cache field: `cache` in recent transformers, `past_key_values` in older ones.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class SmallInitConfig(PreTrainedConfig):
    # HF's names where one exists (tools such as lm-eval read max_position_embeddings).
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


def rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).type_as(x)


def rotate(x, positions, theta):
    """RoPE of x (B, H, T, head_dim) at integer positions (B, T), pairs (i, i + head_dim/2)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** -(torch.arange(0, 2 * half, 2, device=x.device, dtype=torch.float32) / (2 * half))
    angles = positions.float()[:, None, :, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def swiglu_or_gelu(x, kind, w_gate, w_up, w_down):
    """The MLP on rows x (N, d) with (d_in, d_out) weights: one expert or, transposed, nn.Linear's."""
    h = F.silu(x @ w_gate) * (x @ w_up) if kind == "swiglu" else F.gelu(x @ w_up)
    return h @ w_down


class SmallInitForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = SmallInitConfig
    base_model_prefix = "smallinit"
    _tied_weights_keys = {"lm_head.weight": "tok_emb.weight"}
    _supports_sdpa = True

    def __init__(self, config):
        super().__init__(config)
        c = config
        d, hd = c.hidden_size, c.head_dim
        # Plain containers named like model.py's modules, so the state dicts are the same.
        self.tok_emb = nn.Embedding(c.vocab_size, d)
        self.layers = nn.ModuleList()
        for _ in range(c.num_hidden_layers):
            block, attn, mlp = nn.Module(), nn.Module(), nn.Module()
            block.attn_norm, block.mlp_norm = nn.Module(), nn.Module()
            block.attn_norm.weight, block.mlp_norm.weight = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
            attn.wq = nn.Linear(d, c.num_attention_heads * hd, bias=False)
            attn.wk = nn.Linear(d, c.num_key_value_heads * hd, bias=False)
            attn.wv = nn.Linear(d, c.num_key_value_heads * hd, bias=False)
            if c.attn_gate != "none":
                attn.wg = nn.Linear(d, c.num_attention_heads * (hd if c.attn_gate == "elementwise" else 1), bias=False)
            attn.wo = nn.Linear(c.num_attention_heads * hd, d, bias=False)
            f = c.d_expert if c.n_experts else c.intermediate_size
            if c.n_experts:
                # Stacked experts (E, d_in, d_out) and the aux-loss-free selection bias.
                mlp.router = nn.Linear(d, c.n_experts, bias=False)
                names_shapes = [("w_up", (d, f)), ("w_down", (f, d))] + ([("w_gate", (d, f))] if c.mlp == "swiglu" else [])
                for name, shape in names_shapes:
                    setattr(mlp, name, nn.Parameter(torch.empty(c.n_experts, *shape)))
                mlp.register_buffer("expert_bias", torch.zeros(c.n_experts))
            else:
                if c.mlp == "swiglu":
                    mlp.w_gate = nn.Linear(d, f, bias=False)
                mlp.w_up, mlp.w_down = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)
            block.attn, block.mlp = attn, mlp
            self.layers.append(block)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(d))
        self.lm_head = nn.Linear(d, c.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        # A checkpoint overwrites every weight; only a model built from the config alone starts here.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=module.weight.shape[-1] ** -0.5)

    def get_input_embeddings(self):
        return self.tok_emb

    def get_output_embeddings(self):
        return self.lm_head

    def attention(self, attn, x, positions, mask, cache, layer):
        c = self.config
        B, T, _ = x.shape
        q = attn.wq(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = attn.wk(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = attn.wv(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = rotate(q, positions, c.rope_theta), rotate(k, positions, c.rope_theta)
        if cache is not None:
            k, v = cache.update(k, v, layer)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=c.num_key_value_heads != c.num_attention_heads)
        if c.attn_gate != "none":
            g = torch.sigmoid(attn.wg(x).float()).view(B, T, c.num_attention_heads, -1).transpose(1, 2)
            y = (y.float() * g).type_as(y)
        return attn.wo(y.transpose(1, 2).reshape(B, T, -1))

    def moe(self, mlp, x):
        c = self.config
        B, T, d = x.shape
        xf = x.reshape(-1, d)
        scores = F.linear(xf.float(), mlp.router.weight.float())
        scores = scores.softmax(-1) if c.router_score == "softmax" else torch.sigmoid(scores)
        chosen = torch.topk(scores + mlp.expert_bias, c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if c.num_experts_per_tok > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros(xf.shape, dtype=torch.float32, device=x.device)
        for e in range(c.n_experts):
            token, slot = torch.where(chosen == e)
            w_gate = mlp.w_gate[e] if c.mlp == "swiglu" else None
            y = swiglu_or_gelu(xf[token], c.mlp, w_gate, mlp.w_up[e], mlp.w_down[e])
            out.index_add_(0, token, y.float() * weights[token, slot, None])
        return out.view(B, T, d).type_as(x)

    def attention_mask(self, input_ids, attention_mask, start, cache):
        """None (plain causal, SDPA's own kernel) or a bool (B, 1, T, start + T) mask: causal,
        padded keys hidden, and with doc_mask only keys of the query's own document."""
        c = self.config
        B, T = input_ids.shape
        if not c.doc_mask and attention_mask is None and start == 0:
            return None
        q_pos = torch.arange(start, start + T, device=input_ids.device)
        mask = (torch.arange(start + T, device=input_ids.device) <= q_pos[:, None])[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, -(start + T):].bool()
        if c.doc_mask:
            # A token's document is the number of end-of-text tokens strictly before it; while
            # decoding, the documents of the cached positions ride along on the cache.
            is_eot = (input_ids == c.eot_id).long()
            docs = torch.cumsum(is_eot, 1) - is_eot
            if start:
                docs = docs + cache.smallinit_closed[:, None]
                docs = torch.cat([cache.smallinit_docs, docs], 1)
            if cache is not None:
                cache.smallinit_docs, cache.smallinit_closed = docs, docs[:, -1] + is_eot[:, -1]
            mask = mask & (docs[:, None, -T:, None] == docs[:, None, None, :])
        # A query that sees no key (left padding) would give NaN: let it see itself.
        return mask | (torch.arange(start + T, device=mask.device) == q_pos[:, None])

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                use_cache=None, labels=None, logits_to_keep=0, **kwargs):
        c = self.config
        use_cache = c.use_cache if use_cache is None else use_cache
        cache = past_key_values if cache is None else cache  # older transformers pass past_key_values
        if use_cache and cache is None:
            cache = DynamicCache()
        start = cache.get_seq_length() if cache is not None else 0
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        mask = self.attention_mask(input_ids, attention_mask, start, cache)
        x = self.tok_emb(input_ids)
        for i, block in enumerate(self.layers):
            x = x + self.attention(block.attn, rms_norm(x, block.attn_norm.weight, c.rms_norm_eps), position_ids,
                                   mask, cache, i)
            h = rms_norm(x, block.mlp_norm.weight, c.rms_norm_eps)
            if c.n_experts:
                x = x + self.moe(block.mlp, h)
            else:
                m = block.mlp
                x = x + swiglu_or_gelu(h, c.mlp, m.w_gate.weight.T if c.mlp == "swiglu" else None,
                                       m.w_up.weight.T, m.w_down.weight.T)
        x = rms_norm(x, self.norm.weight, c.rms_norm_eps)
        logits = self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x)
        loss = None
        if labels is not None:  # HF convention: labels are the inputs, shifted here
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})
