"""Moving code between files changes no number: config/tiny_bytes.py's run, shortened, gives the losses,
gradient norms and validation losses recorded in same_numbers.json before the lean-core move (issue 48),
bit for bit, on the machine and torch that recorded them (elsewhere floats may differ in the last bits:
the test says so and skips)."""
import json
import os

import pytest
import torch

from report import cpu_name
from test_train import rows, run_train

RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "same_numbers.json")
SHORT = ["--max_steps=8", "--warmup_steps=2", "--log_interval=1", "--eval_interval=4", "--eval_batches=1",
         "--seq_len=64", "--global_batch=8", "--batch_size=8", "--model.max_seq_len=64", "--ckpt_interval=8"]


def tiny_run_numbers(data, out):
    run_train(["config/tiny_bytes.py", *SHORT, f"--data_dir={data}", f"--out_dir={out}"])
    return {field: {str(k): v for k, v in rows(out, field).items()} for field in ("loss", "grad_norm", "val_loss")}


def test_a_tiny_configs_numbers_are_the_recorded_ones(data_dir, tmp_path):
    recorded = json.load(open(RECORDED))
    if (recorded["cpu"], recorded["torch"]) != (cpu_name(), torch.__version__):
        pytest.skip(f"recorded on {recorded['cpu']} with torch {recorded['torch']}; this is {cpu_name()} with "
                    f"torch {torch.__version__}, where the last bits may differ")
    assert tiny_run_numbers(data_dir, str(tmp_path / "run")) == recorded["numbers"]
