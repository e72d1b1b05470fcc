import os
import re
import signal
import sys

import pytest
import torch

# Tests import the flat top-level modules (model.py, init.py, ...) directly.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Two cores: keep each test process on one intra-op thread so parallel helpers
# (torchrun workers) don't oversubscribe the machine.
torch.set_num_threads(1)

# The Ctrl-C tests send real SIGINTs to this process and to the scripts it launches. A shell
# starts a background job (`pytest ... &`) with SIGINT ignored, an exec keeps an ignored signal
# ignored, and Python then installs no KeyboardInterrupt handler: every such test would wait for
# its timeout and fail. A handler here resets to the default in every child, as in a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The training tests' byte-level dataset (test_train.byte_dataset), built once per test process
    (each xdist worker) rather than once per module: the runs only read it."""
    from test_train import byte_dataset
    return byte_dataset(tmp_path_factory.mktemp("data"))


# Shared model builders and the greedy reference. Test files import them (`from conftest import
# ...`): pytest puts this folder on sys.path.

def tiny(**overrides):
    """A small random-token config: big enough for 4 heads and GQA, small enough for exact checks."""
    from model import GPTConfig
    return GPTConfig(**{**dict(vocab_size=50, n_layer=2, n_head=4, d_model=64, max_seq_len=64), **overrides})


def moe_cfg(**overrides):
    return tiny(**{**dict(n_experts=6, top_k=2, d_expert=48), **overrides})


def built(cfg, gamma=0.5, seed=0):
    """GPT(cfg) γ-initialised, in eval mode. γ=0.5 makes attention patterns far from uniform, so
    mask mistakes show in the outputs."""
    from init import init_model_
    from model import GPT
    model = GPT(cfg)
    init_model_(model, gamma=gamma, seed=seed)
    return model.eval()


def tiny_model(gamma=1.0, seed=0, **overrides):
    """The byte-level "tiny" size (vocab 257), the model of the byte-tokenized test checkpoints."""
    from model import config_for
    return built(config_for("tiny", **{"max_seq_len": 64, **overrides}), gamma=gamma, seed=seed)


def greedy_reference(model, idx, n, stop=None):
    """Greedy decoding by full recomputation, without a KV cache: the reference for
    generate.decode and generate.generate. idx (B, T); returns each row's n new tokens, cut after the
    first token at which stop(tokens so far) holds. Rows never attend to each other, so decoding
    all n and cutting afterwards is the same as stopping."""
    seq = idx
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    rows = seq[:, idx.shape[1]:].tolist()
    if stop is None:
        return rows
    return [row[:next((k for k in range(1, n + 1) if stop(row[:k])), n)] for row in rows]


def launch_env(env=None):
    """The environment of a launched script (train.py, torchrun, sweep.py, ...): one intra-op
    thread per process (2 cores), and Python's fault handler on, so a process that aborts
    (SIGABRT) prints the Python stack it died in, or "<no Python frame>" for an abort at
    interpreter shutdown, instead of torchrun's bare "Signal 6"."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}


def ctrl_c_after(argv, marker, stream="stdout", timeout=120):
    """Run `python *argv` in the repository, send it SIGINT once a line of its `stream` starts with
    marker, and return (its exit status, the stderr it wrote after that)."""
    import subprocess
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=launch_env())
    try:
        for line in getattr(proc, stream):
            if line.startswith(marker):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, err


def failure_text(proc):
    """A failed subprocess's output for an assertion message. A torchrun worker's own last words
    (a C++ abort's "terminate called ... what(): ...", the fault handler's "Fatal Python error",
    a Python error) come before torchrun's ~2 kB failure summary, so a plain tail shows only
    that the worker died, not why: the lines that name a failure come first, then the tail."""
    said = (proc.stdout or "") + (proc.stderr or "")
    named = [line for line in said.splitlines()
             if re.search(r"terminate called|what\(\)|Fatal Python error|Error|error:|Signal|Abort|exitcode|Timed out|reset by peer", line)]
    return "\n".join(named[-40:]) + "\n--- last 3000 characters ---\n" + said[-3000:]
