"""train.compile_model_: the compiled blocks, final norm and loss chunks against the eager model,
and bench.py's compiled variants (the plain GPT included) built with it."""
import copy
import functools
from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

import bench
import loss as loss_module
from conftest import built, tiny
from loss import chunk_loss, chunked_cross_entropy, loss_chunk_rows
from train import compile_model_

VOCAB = 300


def batch(seed):
    """5 x 60 = 300 tokens, a few targets ignored."""
    idx = torch.randint(VOCAB, (5, 60), generator=torch.Generator().manual_seed(seed))
    targets = idx.roll(-1, 1)
    targets[:, -4:] = -1
    return idx, targets


def loss_and_grads(net, idx, targets):
    _, loss = net(idx, targets)
    return loss.detach(), torch.autograd.grad(loss, list(net.parameters()))


def converted_frames(fn):
    """fn(), and how many frames dynamo compiled while it ran."""
    counters.clear()
    out = fn()
    return out, counters["frames"]["ok"]


@pytest.mark.slow
def test_compiled_model_matches_the_eager_one_and_leaves_other_models_eager(monkeypatch):
    torch._dynamo.reset()  # a compile earlier in this process (an in-process training run) would be reused, uncounted
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_ELEMENTS", 128 * VOCAB)
    rows = loss_chunk_rows(VOCAB)
    assert rows == 128 and 300 % rows  # three chunks, the last one ragged
    eager = built(tiny(vocab_size=VOCAB)).train()
    net = copy.deepcopy(eager)
    names, keys = [n for n, _ in net.named_parameters()], list(net.state_dict())
    assert compile_model_(net) is net
    assert [n for n, _ in net.named_parameters()] == names and list(net.state_dict()) == keys

    idx, targets = batch(0)
    (loss, grads), frames = converted_frames(lambda: loss_and_grads(eager, idx, targets))
    assert frames == 0
    (compiled_loss, compiled_grads), frames = converted_frames(lambda: loss_and_grads(net, idx, targets))
    # One graph for both blocks, one for the norm, one per chunk height.
    assert frames == 4
    assert torch.allclose(compiled_loss, loss, rtol=1e-6, atol=0)
    for name, g, cg in zip(names, grads, compiled_grads):
        assert torch.allclose(cg, g, rtol=0, atol=1e-5 * g.abs().max().item()), name

    # Another batch of the same shape compiles nothing more.
    idx, targets = batch(1)
    (compiled_loss, _), frames = converted_frames(lambda: loss_and_grads(net, idx, targets))
    assert frames == 0 and torch.allclose(compiled_loss, loss_and_grads(eager, idx, targets)[0], rtol=1e-6, atol=0)

    # Evaluation: the no_grad branch of the loss chunks, and the logits through the compiled norm.
    eager.eval()
    net.eval()
    with torch.no_grad():
        assert torch.allclose(net(idx, targets)[1], eager(idx, targets)[1], rtol=1e-6, atol=0)
        logits = eager(idx)[0]
        assert torch.allclose(net(idx)[0], logits, rtol=0, atol=1e-5 * logits.abs().max().item())


def test_bench_compiles_both_models_of_a_group_with_compile_model():
    """No compilation here (compile_model_ only wraps; the first call compiles): the compiled
    variants carry the compiled loss tail, the eager ones none, and the plain GPT's forward
    takes its loss from loss_fn as model.GPT's does."""
    v = {x.name: x for x in bench.cpu_variants()}
    g = bench.Group("t", dict(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=64), batch=2, seq_len=80,
                    dtype="float32")
    nets = {name: bench.build(replace(v[name], group=g), torch.device("cpu"))
            for name in ("reference", "default", "reference-compiled", "default-compiled")}
    for name, net in nets.items():
        compiled = name.endswith("-compiled")
        modules = [*net.layers, net.norm]
        assert all((m._compiled_call_impl is not None) == compiled for m in modules), name
        assert (net.loss_fn is not None) == compiled, name
    assert nets["reference-compiled"].loss_fn.keywords == nets["default-compiled"].loss_fn.keywords

    heights = []

    def recording(h, *args):
        heights.append(h.shape[0])
        return chunk_loss(h, *args)

    plain = nets["reference"]
    idx = torch.randint(VOCAB, (2, 80), generator=torch.Generator().manual_seed(2))
    reference = plain(idx, idx)[1]
    plain.loss_fn = functools.partial(chunked_cross_entropy, chunk_rows=64, chunk_fn=recording)
    assert torch.allclose(plain(idx, idx)[1], reference, rtol=1e-6) and heights == [64, 64, 32]
