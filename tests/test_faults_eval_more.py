"""eval.py under the faults of the second outside fault run (issue 37): outputs written over the
command's own inputs or over files of other kinds, result and benchmark files of the wrong shape
(JSON null, 100k-deep nesting, a FIFO, another benchmark's records), devices nothing runs on, and
flags past what the numbers allow. Each ends in one line (exit 2) and leaves every file as it was."""
import bz2
import json
import os

import pytest
import torch

import downstream as ds
import eval as ev
from conftest import tiny_model
from fileio import write_json
from test_eval import export, greedy_by_hand, save_dcp
from test_faults_data import snapshot
from test_faults_eval import RESIDUAL, error_line
from test_faults_links import within
from init import GAMMA_MAX

SCALING = ["scaling", "--baseline", "1e6=2.10", "3e6=1.90", "1e7=1.75", "3e7=1.66"]
DEEP = "[" * 100_000  # the decoder recursed once per level: a RecursionError past every `except ValueError`


def loss_result(path, loss=2.5, **summary):
    """A result file as `eval.py loss --json-out` writes one (the fields scaling and report read)."""
    write_json(path, {"analysis": "loss", "summary": {"loss": loss, "params_total": 1000, "params_embedding": 100,
                                                      **summary}, "rows": []})
    return str(path)


# ----------------------------------------------------------------------------- outputs over inputs (F9, F10)

def test_json_out_onto_a_checkpoints_file_or_another_input_is_refused_and_leaves_it(tmp_path, capsys):
    # --json-out RUN/ckpt_.../meta.json replaced the checkpoint's meta.json with the result (and a
    # weights file likewise): the run's checkpoint was gone.
    ckpt = save_dcp(tiny_model(seed=1), tmp_path / "run" / "ckpt_00000001", 1)
    pt = export(tiny_model(seed=2), tmp_path / "m.pt")
    before = snapshot(tmp_path)
    meta = os.path.join(ckpt, "meta.json")
    assert error_line(["loss", str(tmp_path / "run"), "--json-out", meta], capsys) == (
        f"error: --json-out {meta} exists and is not an eval.py or sweep.py result JSON: it is not replaced; "
        "choose another path (or remove the file)")
    weights = os.path.join(ckpt, "__0_0.distcp")
    assert error_line(["sink", ckpt, "--json-out", weights], capsys).startswith(f"error: --json-out {weights} exists")
    assert error_line(["loss", pt, "--json-out", pt], capsys) == (
        f"error: --json-out {pt} is also an input of this command ({pt}): the output would replace it; "
        "choose another path")
    assert snapshot(tmp_path) == before


def test_an_output_is_refused_on_any_name_of_an_input_even_a_result_json(tmp_path, capsys):
    # The inputs of scaling and report are result JSONs themselves, which --json-out may replace:
    # only the comparison with the inputs (by file, not by name) protects them.
    base = [loss_result(tmp_path / f"b{i}.json", loss, params_total=n)
            for i, (n, loss) in enumerate(((1e6, 2.1), (3e6, 1.9), (1e7, 1.75), (3e7, 1.66)))]
    os.symlink(base[0], tmp_path / "link.json")
    os.link(base[1], tmp_path / "hard.json")
    (tmp_path / "sub").mkdir()
    before = snapshot(tmp_path)
    for out, source in ((tmp_path / "link.json", base[0]), (tmp_path / "hard.json", base[1]),
                        (tmp_path / "sub" / ".." / "b2.json", base[2])):
        line = error_line(["scaling", "--baseline", *base, "--json-out", str(out)], capsys)
        assert line == (f"error: --json-out {out} is also an input of this command ({source}): the output would "
                        "replace it; choose another path")
    # F10: report --out onto one of the result files it gathers
    line = error_line(["report", base[0], base[3], "--out", base[3]], capsys)
    assert line == (f"error: --out {base[3]} is also an input of this command ({base[3]}): the output would replace "
                    "it; choose another path")
    assert snapshot(tmp_path) == before


def test_outputs_replace_only_files_of_their_own_kind(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("kept")
    assert error_line(SCALING + ["--plot", str(notes)], capsys) == (
        f"error: --plot {notes} exists and is not a PNG: it is not replaced; choose another path (or remove the file)")
    assert error_line(["report", loss_result(tmp_path / "l.json"), "--out", str(notes)], capsys) == (
        f"error: --out {notes} exists and is not an eval.py report: it is not replaced; choose another path "
        "(or remove the file)")
    assert notes.read_text() == "kept"
    # An earlier result or report of the same kind is replaced, as before.
    old = loss_result(tmp_path / "old.json", loss=9.0)
    result = ev.main(RESIDUAL + ["--json-out", old])
    with open(old) as f:
        assert json.load(f)["summary"] == pytest.approx(result["summary"])
    report = tmp_path / "report.md"
    ev.main(["report", str(tmp_path / "l.json"), "--out", str(report)])
    first = report.read_text()
    ev.main(["report", str(tmp_path / "l.json"), old, "--out", str(report)])
    assert report.read_text() != first and report.read_text().startswith("### loss")


# ------------------------------------------------------------------ result files of the wrong shape (F1, F20, F21)

@pytest.mark.parametrize("text,why", [
    ("null", "not an eval.py --json-out or sweep.py result (no 'analysis' and 'summary')"),
    ("[1, 2]", "not an eval.py --json-out or sweep.py result (no 'analysis' and 'summary')"),
    pytest.param(DEEP, "not JSON (nested deeper than a JSON reader follows)", id="100k-deep"),
    ('{"analysis": "sink", "summary": {}}', "a sink result, not a loss result"),
])
def test_scaling_inputs_of_the_wrong_shape_are_one_line(text, why, tmp_path, capsys):
    # JSON null: TypeError ('NoneType' object is not subscriptable); 100k '[': RecursionError.
    path = tmp_path / "x.json"
    path.write_text(text)
    assert error_line(SCALING + ["--compare", str(path)], capsys) == (
        f"error: --compare {path}: {why}; pass loss JSONs from `eval.py loss --json-out` (or N=loss)")


@pytest.mark.parametrize("literal", ["1=2=3", "x=2.1", "0=2.1", "1e6=nan", "1e6=inf"])
def test_a_literal_that_is_not_n_equals_loss_is_one_line(literal, capsys):
    # "1=2=3": ValueError's "too many values to unpack"; 0 or a negative N: log of it inside the fit
    assert error_line(SCALING + ["--compare", literal], capsys) == (
        f"error: --compare {literal}: not N=loss (a positive parameter count and a finite loss, e.g. 1.5e9=2.41)")


def test_a_loss_result_without_a_finite_loss_is_one_line(tmp_path, capsys):
    diverged = loss_result(tmp_path / "d.json", loss=None)  # json_safe writes an infinite loss as null
    assert error_line(SCALING + ["--compare", diverged], capsys) == (
        f"error: --compare {diverged}: no finite loss in its summary; pass loss JSONs from `eval.py loss --json-out` "
        "(or N=loss)")


def test_report_skips_a_100k_deep_json_and_pair_names_it(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    good = loss_result(tmp_path / "l.json")
    ev.main(["report", str(deep), good, "--out", str(tmp_path / "r.md")])
    assert f"skipped {deep}: not JSON (nested deeper than a JSON reader follows)" in capsys.readouterr().err
    assert error_line(["report", good, "--out", str(tmp_path / "r.md"), "--pair", f"{deep}:a", f"{deep}:b"],
                      capsys) == (f"error: --pair {deep}: not JSON (nested deeper than a JSON reader follows); write "
                                  "FILE.json:ARM[:KEY=VALUE...] with a sweep.py results file")
    assert error_line(["report", good, "--out", str(tmp_path / "r.md"), "--pair", f"{good}:a", f"{good}:b"],
                      capsys).startswith(f"error: --pair {good}: a loss result, not a sweep result;")


@pytest.mark.parametrize("argv", [SCALING + ["--compare", "{fifo}"], ["report", "{fifo}"]])
def test_a_fifo_as_a_result_file_is_one_line_without_waiting(argv, tmp_path, capsys):
    # open() of a FIFO waits for a writer that never comes: the command hung.
    fifo = tmp_path / "r.json"
    os.mkfifo(fifo)
    argv = [a.format(fifo=fifo) for a in argv] + ["--json-out" if argv[0] == "scaling" else "--out",
                                                  str(tmp_path / "out")]
    with within(60):  # a test that fails, not one that hangs, if it waits
        line = error_line(argv, capsys)
    assert line.startswith("error: ") and str(fifo) in line and "a FIFO: not opened" in line
    assert sorted(os.listdir(tmp_path)) == ["r.json"]


# ----------------------------------------------------------------------------- devices (F13, F14)

@pytest.mark.parametrize("device,problem", [
    ("nope", "is not a torch device"),
    ("meta", "holds shapes, not values: nothing can be computed on it"),  # reported as a damaged checkpoint
    ("cuda:99", "is not on this machine"),
    pytest.param("cuda", "is not on this machine",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine has cuda")),
])
def test_a_device_nothing_runs_on_is_one_line_naming_what_there_is(device, problem, tmp_path, capsys):
    ckpt = export(tiny_model(seed=1), tmp_path / "m.pt")
    there = ", ".join(["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())])
    for argv in (["sample", ckpt], ["loss", ckpt], RESIDUAL):
        line = error_line(argv + ["--device", device], capsys)
        assert line.startswith(f"error: --device {device} {problem}; available here: {there}"), line


# ----------------------------------------------------------------------------- residual's flags (F15, F16)

def test_residual_without_a_checkpoint_or_init_or_with_both_is_one_line(tmp_path, capsys):
    # No checkpoint and no --init: a TypeError from os.path.isfile(None).
    assert error_line(["residual"], capsys) == ("error: residual needs a checkpoint (eval.py residual CKPT --data DIR) "
                                                "or --init (fresh models across --widths): give one of them")
    ckpt = export(tiny_model(seed=1), tmp_path / "m.pt")
    assert error_line(RESIDUAL + [ckpt], capsys) == (f"error: residual --init measures fresh models, not {ckpt}: drop "
                                                     "--init to measure the checkpoint, or the checkpoint to measure "
                                                     "fresh models")


def test_gamma_is_bounded_as_train_py_bounds_it():
    parse = ev.build_parser().parse_args
    assert parse(RESIDUAL + ["--gamma", str(GAMMA_MAX)]).gamma == GAMMA_MAX
    with pytest.raises(SystemExit):
        parse(RESIDUAL + ["--gamma", str(GAMMA_MAX * 1.0001)])


# ----------------------------------------------------------------------------- temperature (F17)

def test_the_smallest_temperature_samples_the_greedy_tokens(tmp_path, capsys):
    # At the floor logits / T is still finite (1e-300 gave inf and nan) and the sample is the argmax.
    model = tiny_model(seed=5, max_seq_len=256)
    ckpt = export(model, tmp_path / "m.pt")
    ev.main(["sample", ckpt, "--prompt", "ab", "--max-new-tokens", "8", "--temperature", "1e-05", "--device", "cpu",
             "--top-k", "257"])
    new = greedy_by_hand(model, list(b"ab"), 8, lambda t: t[-1] == 256)
    printed = capsys.readouterr().out.split("--- sample 0\nab")[1]
    assert printed.rstrip("\n") == bytes(t for t in new if t < 256).decode("utf-8", errors="replace").rstrip("\n")


# ------------------------------------------------------------ benchmark files of another benchmark (F18, F19)

GSM8K = {"question": "What is 1+1?", "answer": "1+1=2\n#### 2"}
HELLASWAG = {"ind": 0, "activity_label": "Cooking", "ctx_a": "A man cracks an egg.", "ctx_b": "he",
             "endings": ["eats.", "sits.", "runs.", "waits."], "label": 0}
MATH500 = {"problem": "What is 1+1?", "solution": "$\\boxed{2}$", "answer": "2"}
KIT = {"hellaswag": "hellaswag/hellaswag_val_full.txt.bz2", "gsm8k": "gsm8k/test.jsonl",
       "math500": "math500/test.jsonl"}
# (task, the file's records, what the line says of record 0): a KeyError traceback before
WRONG_FILES = [
    ("hellaswag", [GSM8K], " has no 'activity_label' field"),
    ("gsm8k", [HELLASWAG], " has no 'question' field"),
    ("math500", [GSM8K], " has no 'problem' field"),
    ("gsm8k", [[1, 2]], " is not a JSON object"),
    ("hellaswag", [{**HELLASWAG, "endings": "eats."}], "'s 'endings' is not a list of texts"),
    ("hellaswag", [{**HELLASWAG, "label": "x"}], "'s 'label' is not an ending's index"),
    ("math500", [{**MATH500, "answer": 2}], "'s 'answer' is not a text"),
]


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("task,records,problem", WRONG_FILES)
def test_bench_on_another_benchmarks_file_is_one_line(task, records, problem, tmp_path, capsys):
    ckpt = export(tiny_model(seed=1), tmp_path / "m.pt")
    source = jsonl(tmp_path / "x.jsonl", records)
    assert error_line(["bench", ckpt, "--task", task, "--source", source], capsys) == (
        f"error: {source}: record 0{problem}; not a {task} file: pass {task}'s own file in its published format "
        f"(e.g. {KIT[task]} of the offline data kit)")


@pytest.mark.parametrize("name,text", [("hs.jsonl.bz2", json.dumps(HELLASWAG) + "\n"),
                                       ("hs.txt.bz2", "Cooking: A man cracks an egg. he\n0\n" + "eats.\n" * 4)])
def test_a_truncated_bz2_benchmark_file_is_one_line(name, text, tmp_path, capsys):
    # bz2 reports a stream cut short as a bare EOFError: a traceback before
    path = tmp_path / name
    whole = bz2.compress(text.encode())
    path.write_bytes(whole)
    assert ds.read_hellaswag(str(path))[0][0]["endings"][0].strip() == "eats."  # the whole file reads
    path.write_bytes(whole[:len(whole) // 2])
    ckpt = export(tiny_model(seed=1), tmp_path / "m.pt")
    assert error_line(["bench", ckpt, "--task", "hellaswag", "--source", str(path)], capsys) == (
        f"error: {path}: its compressed data ends early (a partial download or copy): fetch the file again")


def test_gsm8k_exemplars_from_another_benchmarks_file_and_a_100k_deep_line_are_one_line(tmp_path, capsys):
    ckpt = export(tiny_model(seed=1), tmp_path / "m.pt")
    source, hellaswag = jsonl(tmp_path / "gsm.jsonl", [GSM8K]), jsonl(tmp_path / "hs.jsonl", [HELLASWAG])
    line = error_line(["bench", ckpt, "--task", "gsm8k", "--source", source, "--fewshot-source", hellaswag], capsys)
    assert line.startswith(f"error: {hellaswag}: record 0 has no 'question' field; not a gsm8k file")
    deep = tmp_path / "deep.jsonl"
    deep.write_text(json.dumps(GSM8K) + "\n" + DEEP + "\n")
    assert error_line(["bench", ckpt, "--task", "gsm8k", "--source", str(deep)], capsys) == (
        f"error: {deep}: line 2 is not a JSON record (nested deeper than a JSON reader follows)")


@pytest.mark.parametrize("task,records,problem", WRONG_FILES[:3])
def test_lm_eval_task_checks_the_records_before_writing_anything(task, records, problem, tmp_path, capsys):
    # The task was written for any file; lm-eval failed on it only when run.
    pytest.importorskip("lm_eval")
    source = jsonl(tmp_path / "x.jsonl", records)
    line = error_line(["lm-eval-task", "--task", task, "--source", source, "--out-dir", str(tmp_path / "tasks")],
                      capsys)
    assert line.startswith(f"error: {source}: record 0{problem}; not a {task} file")
    assert sorted(os.listdir(tmp_path)) == ["x.jsonl"]


def test_lm_eval_task_refuses_its_own_output_as_source(tmp_path, capsys):
    # Read whole, then written anew as its first --limit records: the source lost the rest.
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    ev.main(["lm-eval-task", "--task", "gsm8k", "--source", jsonl(tmp_path / "g.jsonl", [GSM8K] * 3),
             "--out-dir", str(tasks)])
    data = tasks / "gsm8k_cot_local.jsonl"
    before = snapshot(tmp_path)
    assert error_line(["lm-eval-task", "--task", "gsm8k", "--source", str(data), "--out-dir", str(tasks),
                       "--limit", "1"], capsys) == (
        f"error: --source {data} is the file lm-eval-task writes in --out-dir {tasks}: pass the published file, or "
        "another --out-dir")
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- HellaSwag's window rule

def test_one_window_rule_by_hand():
    # Context 5 tokens, endings of 3 and 7: 12 positions whole, 1 + 7 = 8 cut from the left; a model
    # of max_seq_len L scores L + 1 positions (the last token is only a target).
    context, endings = [1] * 5, [[2] * 3, [3] * 7]
    assert ds.hellaswag_fit(context, endings, 11, None) == (12, True)
    assert ds.hellaswag_fit(context, endings, 10, None) == (12, False)
    assert ds.hellaswag_fit(context, endings, 7, "left") == (8, True)
    assert ds.hellaswag_fit(context, endings, 6, "left") == (8, False)
