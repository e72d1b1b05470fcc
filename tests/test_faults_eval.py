"""eval.py under faults: Ctrl-C, flags out of range, requests too large for the machine, output
paths that cannot be written. Each ends in one line naming the flag or file and the fix (exit 2,
argparse's and eval.py's error status; 130 for Ctrl-C) and leaves no file behind."""
import ctypes
import os
import re
import subprocess
import sys

import pytest

import eval as ev
from conftest import ctrl_c_after, launch_env, tiny_model
from test_eval import export, greedy_by_hand

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# residual --init needs no checkpoint or data: the cheapest command that writes --json-out.
RESIDUAL = ["residual", "--init", "--widths", "8", "16", "--batch-size", "1", "--seq-len", "8"]


def error_line(argv, capsys):
    """eval.main's one line for bad input: exit status 2, the last stderr line, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        ev.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2, err
    assert not any("Traceback" in line for line in err)
    return err[-1]


# ----------------------------------------------------------------------------- Ctrl-C

def test_ctrl_c_is_one_line_exit_130_and_writes_nothing(tmp_path):
    # A traceback ending in KeyboardInterrupt (the interpreter's own exit by SIGINT, status -2)
    # before. The widths take seconds; SIGINT comes once the progress bar shows the loop started.
    out = tmp_path / "out"
    out.mkdir()
    argv = ["residual", "--init", "--widths", "64", "256", "1024", "2048", "--batch-size", "16",
            "--json-out", str(out / "r.json")]
    code, err = ctrl_c_after(["eval.py", *argv], "residual@init", stream="stderr")
    lines = err.strip().splitlines()
    assert code == 130, err
    assert lines[-1] == ("interrupted: eval.py residual stopped before it finished; nothing is half-written, "
                         "run the same command again for its results"), err
    assert all(line.startswith("residual@init") for line in lines[:-1]), err  # progress lines only
    assert os.listdir(out) == []  # no result, no temporary file


# ----------------------------------------------------------------------------- real-valued flags

TEMPERATURE = "0 (greedy) or a finite number >= 1e-05"


@pytest.mark.parametrize("argv,flag,bad,allowed", [
    (["sample", "m.pt"], "--temperature", "nan", TEMPERATURE),
    (["sample", "m.pt"], "--temperature", "inf", TEMPERATURE),
    (["sample", "m.pt"], "--temperature", "-0.5", TEMPERATURE),
    (["sink", "m.pt"], "--threshold", "nan", "a finite number in [0, 1]"),
    (["sink", "m.pt"], "--threshold", "1.5", "a finite number in [0, 1]"),
    (["weights", "m.pt"], "--threshold", "inf", "a finite number in [0, 1]"),
    (["residual", "--init"], "--gamma", "nan", "a finite number in [0, 3]"),
    (["residual", "--init"], "--gamma", "-1", "a finite number in [0, 3]"),
    # γ past train.py's GAMMA_MAX: d^-γ underflowed the weights to 0 (1e300: every one), a meaningless exponent
    (["residual", "--init"], "--gamma", "50", "a finite number in [0, 3]"),
    (["residual", "--init"], "--gamma", "1e300", "a finite number in [0, 3]"),
    # logits / 1e-300 overflowed to inf and nan: a RuntimeError traceback from torch.multinomial
    (["sample", "m.pt"], "--temperature", "1e-300", TEMPERATURE),
    (["bench", "m.pt", "--task", "gsm8k"], "--temperature", "1e-300", TEMPERATURE),
    (["bench", "m.pt", "--task", "gsm8k"], "--temperature", "nan", TEMPERATURE),
])
def test_real_valued_flags_are_refused_outside_their_range_when_parsed(argv, flag, bad, allowed, capsys):
    # float() takes nan and inf: a nan temperature died in torch.multinomial, inf and negative ones
    # sampled (uniformly; the least likely tokens first), a nan threshold counted no head.
    dest = flag[2:].replace("-", "_")
    for edge in ("0", "1"):  # the ends of every range are allowed
        assert getattr(ev.build_parser().parse_args(argv + [flag, edge]), dest) == float(edge)
    with pytest.raises(SystemExit) as exit_info:
        ev.build_parser().parse_args(argv + [flag, bad])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: argument {flag}: must be {allowed} (got {bad})")


def test_sampling_at_temperature_nan_or_inf_ends_in_one_line(tmp_path, capsys):
    ckpt = export(tiny_model(seed=5, max_seq_len=256), tmp_path / "m.pt")
    for bad in ("nan", "inf"):
        with pytest.raises(SystemExit) as exit_info:
            ev.main(["sample", ckpt, "--max-new-tokens", "3", "--temperature", bad])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].endswith(f"--temperature: must be {TEMPERATURE} (got {bad})")


def test_an_empty_prompt_samples_a_document_from_its_start(tmp_path, capsys):
    # Encoded, '' is no token at all, and a forward of zero tokens died in the embedding. Defined
    # instead as a continuation of end-of-text (256 in the byte tokenizer): a document's start.
    model = tiny_model(seed=5, max_seq_len=256)
    ev.main(["sample", export(model, tmp_path / "m.pt"), "--prompt", "", "--max-new-tokens", "8",
             "--temperature", "0"])
    new = greedy_by_hand(model, [256], 8, lambda t: t[-1] == 256)
    printed = capsys.readouterr().out.split("--- sample 0\n")[1]
    assert printed.rstrip("\n") == bytes(t for t in new if t < 256).decode("utf-8", errors="replace").rstrip("\n")


# ----------------------------------------------------------------------------- requests too large

def gib_numbers(line):
    need, have = re.search(r"needs about ([\d,.]+) GiB on cpu, more than the ([\d,.]+) GiB free there", line).groups()
    return float(need.replace(",", "")), float(have.replace(",", ""))


def test_a_width_too_large_for_the_machine_is_refused_before_allocating(capsys):
    # --widths 100000 allocated a 40 GB attention matrix and died in a traceback (or swapped).
    d, vocab = 100000, 257
    # tiny: 2 layers, each 4 d^2 attention + 8 d^2 gelu MLP + 2 norms, a final norm, 2 embedding tables
    params = 2 * (12 * d * d + 2 * d) + d + 2 * vocab * d
    line = error_line(["residual", "--init", "--widths", "64", str(d), "--mlp", "gelu", "--device", "cpu"], capsys)
    assert f"a model of d_model {d} ({params:,} parameters)" in line
    assert line.endswith("lower --widths (or --batch-size)")
    need, have = gib_numbers(line)
    assert need >= 2 * 4 * params / 2**30 > have  # built on the CPU and used there: the float32 weights twice, at least


def test_residual_widths_are_refused_before_the_first_model_is_built(capsys):
    # A width the size cannot take (head_dim 3 is odd for RoPE) came after minutes on the others,
    # and one width fitted a line through one point (a RankWarning and a meaningless exponent).
    line = error_line(["residual", "--init", "--widths", "64", "6"], capsys)
    assert line.startswith("error: --widths 6 with --size tiny: head_dim=3 must be even")
    line = error_line(["residual", "--init", "--widths", "64", "64"], capsys)
    assert line.startswith("error: --widths 64 64: the exponent is a slope over widths") and "at least two" in line


def test_too_many_samples_are_refused_before_allocating(tmp_path, capsys):
    model = tiny_model(seed=5, max_seq_len=256)
    n = 10 ** 8
    # One layer's key cache alone: n samples x 2 heads x (1 prompt token + 100) x 32 dims x 4 bytes
    line = error_line(["sample", export(model, tmp_path / "m.pt"), "--prompt", "a", "--num-samples", str(n),
                       "--device", "cpu"], capsys)
    assert line.startswith(f"error: --num-samples {n} of 101 tokens needs about")
    assert line.endswith("lower --num-samples")
    need, have = gib_numbers(line)
    assert need >= 4 * n * 2 * 101 * 32 * 4 / 2**30 > have  # keys and values of both layers


def test_max_rows_past_the_machine_is_refused_before_allocating(tmp_path, capsys):
    # A 100,352-row embedding at --max-rows 100000: an 80 GB float64 cosine matrix.
    ckpt = export(tiny_model(vocab_size=100352, d_model=8), tmp_path / "m.pt")
    line = error_line(["weights", ckpt, "--max-rows", "100000"], capsys)
    assert line.startswith("error: the row cosines of 100000 rows needs about") and line.endswith("lower --max-rows")
    need, have = gib_numbers(line)
    assert need >= 8 * 100000 ** 2 / 2**30 > have


def test_a_batch_too_large_for_the_machine_is_refused_before_the_forward(capsys):
    # 10^8 sequences of 256 random tokens: 200 GB of token ids before the first layer.
    line = error_line(["residual", "--init", "--widths", "8", "16", "--batch-size", str(10 ** 8), "--device", "cpu"],
                      capsys)
    need, have = gib_numbers(line)
    assert need >= 8 * 10 ** 8 * 256 / 2**30 > have and line.endswith("lower --widths (or --batch-size)")


# ----------------------------------------------------------------------------- --json-out that cannot be written

def test_json_out_a_folder_or_under_a_file_is_one_line_and_leaves_nothing(tmp_path, capsys):
    # IsADirectoryError / FileExistsError tracebacks before, after the analysis had run.
    folder = tmp_path / "results"
    folder.mkdir()
    (tmp_path / "notes.txt").write_text("kept")
    line = error_line(RESIDUAL + ["--json-out", str(folder)], capsys)
    assert line == f"error: --json-out {folder} is a folder: give a file path, e.g. {folder / 'result.json'}"
    for path in (tmp_path / "notes.txt" / "r.json", tmp_path / "notes.txt" / "sub" / "r.json"):
        line = error_line(RESIDUAL + ["--json-out", str(path)], capsys)
        assert line == (f"error: --json-out {path}: {tmp_path / 'notes.txt'} is a file, not a folder: "
                        "choose a path in a folder")
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "results"] and os.listdir(folder) == []
    assert (tmp_path / "notes.txt").read_text() == "kept"


def without_write_override():
    """preexec_fn for root: drop CAP_DAC_OVERRIDE from the bounding set, so the command exec'd
    next runs without it and a folder's permission bits hold for it as for any user."""
    if os.geteuid() == 0 and ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE)")


PR_CAPBSET_DROP, CAP_DAC_OVERRIDE = 24, 1  # linux/prctl.h, linux/capability.h


def test_json_out_in_a_read_only_folder_is_one_line_and_leaves_nothing(tmp_path):
    # A PermissionError traceback from the temporary file before, after the analysis had run.
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    path = locked / "r.json"
    try:
        p = subprocess.run([sys.executable, "eval.py", *RESIDUAL, "--json-out", str(path)], cwd=ROOT, text=True,
                           capture_output=True, env=launch_env(), preexec_fn=without_write_override)
    finally:
        locked.chmod(0o755)  # for pytest's clean-up
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1] == (f"error: --json-out {path}: {locked} is not writable (permissions "
                                                 "or a read-only file system): choose a folder you can write in")
    assert os.listdir(locked) == []
