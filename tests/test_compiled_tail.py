"""train.compile_model_: the compiled blocks, final norm and loss chunks against the eager model,
train.py's compiled training against its eager one, and bench.py's compiled variants (the plain GPT
included) built with it."""
import copy
import functools
from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

import bench
import loss as loss_module
from conftest import built
from loss import chunk_loss, chunked_cross_entropy, loss_chunk_rows
from model import config_for
from test_train import TINY, rows, run_here
from train import compile_model_

# The byte-level "tiny" model of train.py's TINY runs with grouped-query attention (2 query heads on 1 key/value
# head: the compiled block repeats k and v for its group), batches of 5 x 60 tokens, the loss cut into chunks of
# 128, 128 and a ragged 44 rows: the model test and the training below compile the same graphs, so the second
# finds them in inductor's cache (~25 s of CPU less than compiling them twice).
GQA = {"n_kv_head": 1}
CONFIG = replace(config_for("tiny"), **GQA)
VOCAB, CHUNK_ELEMENTS, BATCH = CONFIG.vocab_size, 128 * CONFIG.vocab_size, (5, 60)


def batch(seed):
    """5 x 60 = 300 tokens, a few targets ignored."""
    idx = torch.randint(VOCAB, BATCH, generator=torch.Generator().manual_seed(seed))
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
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_ELEMENTS", CHUNK_ELEMENTS)
    chunk = loss_chunk_rows(VOCAB)
    assert chunk == 128 and BATCH[0] * BATCH[1] // chunk == 2 and BATCH[0] * BATCH[1] % chunk  # 3 chunks, a ragged last
    eager = built(CONFIG).train()
    net = copy.deepcopy(eager)
    names, keys = [n for n, _ in net.named_parameters()], list(net.state_dict())
    assert compile_model_(net) is net
    assert [n for n, _ in net.named_parameters()] == names and list(net.state_dict()) == keys

    idx, targets = batch(0)
    (loss, grads), frames = converted_frames(lambda: loss_and_grads(eager, idx, targets))
    assert frames == 0
    (compiled_loss, compiled_grads), frames = converted_frames(lambda: loss_and_grads(net, idx, targets))
    # One graph for both blocks, one for the norm, one per chunk height. Inductor fuses and reorders, so the
    # fp32 rounding differs: gradients measured within 1.5e-6 of a parameter's largest (Intel Xeon, 3 seeds).
    assert frames == 4
    assert torch.allclose(compiled_loss, loss, rtol=1e-6, atol=0)
    for name, g, cg in zip(names, grads, compiled_grads):
        assert torch.allclose(cg, g, rtol=0, atol=5e-6 * g.abs().max().item()), name

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


@pytest.mark.slow
def test_compiled_run_matches_eager(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_ELEMENTS", CHUNK_ELEMENTS)  # the graphs the test above compiled
    args = [*TINY, f"--data_dir={data_dir}", "--max_steps=6", "--ckpt_interval=6", f"--seq_len={BATCH[1]}",
            f"--global_batch={BATCH[0]}", f"--batch_size={BATCH[0]}", f"--model={GQA}"]
    run_here([*args, f"--out_dir={tmp_path / 'eager'}"])
    run_here([*args, f"--out_dir={tmp_path / 'compiled'}", "--compile=True"])
    eager, compiled = rows(tmp_path / "eager", "loss"), rows(tmp_path / "compiled", "loss")
    assert sorted(compiled) == list(range(1, 7))
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-4), step


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
