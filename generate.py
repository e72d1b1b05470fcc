"""
Decoding with a trained GPT (eval.py sample, downstream.py's benchmarks, the HF export's checks): a
KV cache, greedy or sampled next tokens, and continuations of a prompt.
"""

import torch

from model import document_ids

class KVCache:
    """Per-layer key/value buffers for decoding; the first `length` positions are filled."""

    def __init__(self, cfg, batch, max_len, device, dtype):
        shape = (batch, cfg.n_kv_head, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.length = 0
        # Document masking while decoding: the document id of every cached position, and how
        # many documents each row has closed so far.
        self.doc = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.docs_before = torch.zeros(batch, dtype=torch.long, device=device)

    def add_documents(self, idx, eot_id):
        """Record the document ids of the positions idx (B, T) is about to fill. Ids continue
        each row's count, so a document cut by a decoding step keeps its id across the cut."""
        T = idx.shape[1]
        doc = document_ids(idx, eot_id) + self.docs_before[:, None]
        self.doc[:, self.length:self.length + T] = doc
        self.docs_before = doc[:, -1] + (idx[:, -1] == eot_id)


def sample_next(logits, temperature=0.0, top_k=None, generator=None):
    """Next token per row of (B, V) logits: argmax at temperature 0, else a softmax sample."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def decode(model, idx, max_new_tokens, temperature=0.0, top_k=None, generator=None, stop=None):
    """Continue each row of idx (B, T) by up to max_new_tokens, with a KV cache: greedy at
    temperature 0, else sampled (optionally from the top_k logits). stop(tokens) -> True ends
    a row, tokens being that row's new tokens so far; decoding ends when every row has.
    Returns each row's new tokens, a list of B lists of ints."""
    B, T = idx.shape
    if T + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) > max_seq_len={model.cfg.max_seq_len}: "
                         f"shorten the prompt or generate fewer tokens")
    cache = KVCache(model.cfg, B, T + max_new_tokens, idx.device, model.lm_head.weight.dtype)
    logits, _ = model(idx, kv_cache=cache)
    new, done = [[] for _ in range(B)], [False] * B
    for _ in range(max_new_tokens):
        next_token = sample_next(logits[:, -1], temperature, top_k, generator)
        for row, token in enumerate(next_token.tolist()):
            if not done[row]:
                new[row].append(token)
                done[row] = stop is not None and stop(new[row])
        if all(done):
            break
        logits, _ = model(next_token[:, None], kv_cache=cache)
    return new


def generate(model, prompt, max_new_tokens, num_samples=1, temperature=0.0, top_k=None, seed=0, stop=None):
    """num_samples continuations of one prompt (token ids) by decode (KV cache). The
    prompt loses its oldest tokens when it and the answer would not fit in max_seq_len.
    stop(tokens) -> True ends a row; returns each row's new tokens."""
    device = next(model.parameters()).device
    max_new_tokens = min(max_new_tokens, model.cfg.max_seq_len - 1)
    prompt = prompt[-(model.cfg.max_seq_len - max_new_tokens):]
    idx = torch.tensor([prompt] * num_samples, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    return decode(model, idx, max_new_tokens, temperature, top_k, gen, stop)
