"""downstream.py (`eval.py bench`): lm-eval's definitions, checked against lm-eval's own code where
it is installed and against hand computations and brute-force forwards everywhere."""
import ast
import bz2
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import downstream as ds
import eval as ev
from conftest import launch_env
import generate as gen
from init import init_model_
from model import GPT, config_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_DATA = os.path.join(ROOT, "..", "shared", "data", "eval")
BYTES_META = {"tokenizer": "bytes", "vocab_size": 257, "eot_id": 256}
HAS_LM_EVAL = __import__("importlib").util.find_spec("lm_eval") is not None


def kit_file(*parts):
    path = os.path.join(EVAL_DATA, *parts)
    if not os.path.exists(path):
        pytest.skip(f"../shared/data/eval/{'/'.join(parts)} is not beside this checkout (offline data kit)")
    return path


def tiny_model(seed=0, **overrides):
    model = GPT(config_for("tiny", **{"max_seq_len": 128, **overrides}))
    init_model_(model, gamma=1.0, seed=seed)
    return model.eval()


def export(model, path, data_dir=None, data_meta=BYTES_META):
    """The consolidated layout of `train.py export`, written directly."""
    from dataclasses import asdict
    torch.save({"model": model.state_dict(), "model_config": asdict(model.cfg), "step": 0,
                "config": {"data_dir": data_dir}, "data_meta": data_meta}, path)
    return str(path)


def run_expecting_error(argv, capsys, *fragments):
    with pytest.raises(SystemExit) as exit_info:
        ev.main(argv)
    err = capsys.readouterr().err.strip().splitlines()  # a progress bar may come before
    assert exit_info.value.code == 2 and err[-1].startswith("error: ")
    for fragment in fragments:
        assert fragment in err[-1]


# ----------------------------------------------------------------------------- imports

def test_imports_go_one_way_eval_then_downstream_then_model():
    # A cycle only works while every module happens to be imported in one order: downstream.py
    # imported first (a test, another script) would load eval.py half-initialised.
    fresh = subprocess.run([sys.executable, "-c", "import sys, downstream; print(sorted({'eval', 'downstream'} & set(sys.modules)))"],
                           cwd=ROOT, capture_output=True, text=True, env=launch_env())
    assert fresh.returncode == 0 and fresh.stdout.strip() == "['downstream']", fresh.stdout + fresh.stderr
    order = ["model", "downstream", "eval"]  # each may import only those before it
    for name in order:
        tree = ast.parse(open(os.path.join(ROOT, f"{name}.py"), encoding="utf-8").read())
        for node in ast.walk(tree):
            imported = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) else []
            for module in set(imported) & set(order):
                assert order.index(module) < order.index(name), f"{name}.py imports {module} (line {node.lineno})"
        for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            lazy = {a.name for n in ast.walk(func) if isinstance(n, ast.Import) for a in n.names}
            lazy |= {n.module for n in ast.walk(func) if isinstance(n, ast.ImportFrom)}
            assert not lazy & set(order), f"{name}.py imports {lazy & set(order)} inside {func.name}()"


# ----------------------------------------------------------------------------- HellaSwag

# Published-style records (WikiHow markup, a lower-case ctx_b, a capital inside ctx_b) and the
# query/choices lm-eval builds from them, worked out by hand from its hellaswag/utils.py.
RECORDS = [
    ({"activity_label": "Home and Garden", "ctx_a": "[header] How to plant a tree [title] Dig a hole. [step] Make it  wide.",
      "ctx_b": "", "endings": ["[title] Water it. [step] Daily.", "runs away.", "[substeps] Add soil.", "sings [title] loudly"]},
     "Home and Garden: How to plant a tree. Dig a hole. Make it wide.",
     # strip() comes first, so a leading mark leaves its space behind, as in lm-eval
     [" Water it. Daily.", "runs away.", " Add soil.", "sings. loudly"]),
    ({"activity_label": "Cooking", "ctx_a": "A man cracks an egg.", "ctx_b": "he puts it in a Pan",
      "endings": ["and eats it.", "drops the bowl on the floor.", "laughs", "cooks it slowly."]},
     "Cooking: A man cracks an egg. He puts it in a pan", ["and eats it.", "drops the bowl on the floor.", "laughs",
                                                           "cooks it slowly."]),
    ({"activity_label": "Running", "ctx_a": "She ties her shoes.", "ctx_b": "then, she",
      "endings": ["runs.", "sits down quietly.", "waves", "jumps up high."]},
     "Running: She ties her shoes. Then, she", ["runs.", "sits down quietly.", "waves", "jumps up high."]),
]


def test_hellaswag_items_follow_lm_evals_definition_by_hand():
    for record, query, choices in RECORDS:
        item = ds.hellaswag_item(record["activity_label"], record["ctx_a"], record["ctx_b"], record["endings"], "2")
        assert item == {"ctx": query, "endings": choices, "label": 2}


@pytest.mark.skipif(not HAS_LM_EVAL, reason="lm-eval is optional (Makefile test install)")
def test_hellaswag_items_equal_lm_evals_process_docs_on_the_kit():
    """lm-eval's own process_docs on records built from the kit's file (split by
    split_text_context) gives the very query and choices we score."""
    import datasets
    from lm_eval.tasks.hellaswag.utils import process_docs
    path = kit_file("hellaswag", "hellaswag_val_full.txt.bz2")
    with bz2.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().rstrip("\n").split("\n")[:6 * 400]
    records = []
    for i in range(0, len(lines), 6):
        label, ctx_a, ctx_b = ds.split_text_context(lines[i])
        records.append({"activity_label": label, "ctx_a": ctx_a, "ctx_b": ctx_b, "endings": lines[i + 2:i + 6],
                        "label": lines[i + 1]})
    records += [{**r, "label": "1"} for r, _, _ in RECORDS]
    theirs = process_docs(datasets.Dataset.from_list(records))
    ours, _ = ds.read_hellaswag(path)
    ours = ours[:400] + [ds.hellaswag_item(r["activity_label"], r["ctx_a"], r["ctx_b"], r["endings"], 1)
                         for r, _, _ in RECORDS]
    assert [(o["ctx"], o["endings"], o["label"]) for o in ours] == \
        [(t["query"], t["choices"], t["gold"]) for t in theirs]
    assert sum(o["ctx"] != line for o, line in zip(ours, lines[::6])) > 100  # capitalisation changed many


def test_text_format_context_split_and_bad_file(tmp_path):
    assert ds.split_text_context("Roof shingle removal: A man is sitting on a roof. he") == \
        ("Roof shingle removal", "A man is sitting on a roof.", "he")
    assert ds.split_text_context("Run: She ties her shoes. Then she waits.") == ("Run", "She ties her shoes. Then she waits.", "")
    assert ds.split_text_context("Cooking: people are cooking") == ("Cooking", "", "people are cooking")
    path = tmp_path / "hs.txt.bz2"
    with bz2.open(path, "wt", encoding="utf-8") as f:
        f.write("Cooking: A man cracks an egg. he\n1\na\nb\nc\nd\n")
    items, how = ds.read_hellaswag(str(path))
    assert items == [{"ctx": "Cooking: A man cracks an egg. He", "endings": list("abcd"), "label": 1}] and "text" in how
    (tmp_path / "bad.txt").write_text("ctx\n1\nonly one ending\n")
    with pytest.raises(ValueError, match="multiple of 6"):
        ds.read_hellaswag(str(tmp_path / "bad.txt"))


# Records built by HellaSwag's own rules (rowanz/hellaswag README): ctx is ctx_a, then a space and
# ctx_b when ctx_b is not empty; ctx_b is the unfinished noun phrase the ending completes
# (ActivityNet), empty where the context ends a sentence (WikiHow). Beside each, its line in the
# kit's text format, written by hand: `activity_label: ctx` after the carrier's clean-up
# ([header]/[step]/[substeps] dropped, " [title]" -> ". ", double spaces collapsed once, one
# leading space trimmed).
RECOVERED = [
    (("Roof shingle removal", "A man is sitting on a roof.", "he"), "Roof shingle removal: A man is sitting on a roof. he"),
    # several sentences; a capital inside ctx_b (capitalize() lower-cases it, as lm-eval does)
    (("Kayaking", "Two men paddle a boat. They reach the shore!", "the man in the Red jacket"),
     "Kayaking: Two men paddle a boat. They reach the shore! the man in the Red jacket"),
    (("Archery", "Is the target far? A woman draws her bow?", "then, she"),
     "Archery: Is the target far? A woman draws her bow? then, she"),
    # a point that ends no sentence: a decimal (no space after it)
    (("Springboard diving", "A girl climbs the 2.5 m ladder.", "the girl on the 2.5 m board"),
     "Springboard diving: A girl climbs the 2.5 m ladder. the girl on the 2.5 m board"),
    # numbered caption steps, as in the kit
    (("Playing saxophone", "1 a guy is playing the saxophone.", "2 a guy"),
     "Playing saxophone: 1 a guy is playing the saxophone. 2 a guy"),
    # ctx_a ending in a quotation or a bracket: the sentence ends after the closing mark
    (("Walking the dog", 'A sign reads "Keep Out." A man walks past it.', "the dog"),
     'Walking the dog: A sign reads "Keep Out." A man walks past it. the dog'),
    (("Walking the dog", 'A sign reads "Keep Out."', "the dog"), 'Walking the dog: A sign reads "Keep Out." the dog'),
    (("Walking the dog", "A man walks his dog (a Big poodle.)", "the dog"),
     "Walking the dog: A man walks his dog (a Big poodle.) the dog"),
    # an opening quote in ctx_b, as on the kit's screen captions
    (("Basketball", 'The words "Power Dribble" appear on screen.', '" power dribble'),
     'Basketball: The words "Power Dribble" appear on screen. " power dribble'),
    # WikiHow: ctx_b empty, markup cleaned by the carrier; ends with '.', '!' or a quotation
    (("Home and Garden", "[header] How to plant a tree [title] Dig a hole. [step] Make it  wide.", ""),
     "Home and Garden: How to plant a tree. Dig a hole. Make it wide."),
    (("Relationships", "[header] How to apologize [title] Be sincere. [step] Say it out Loud!", ""),
     "Relationships: How to apologize. Be sincere. Say it out Loud!"),
    (("Relationships", '[header] How to apologize [title] Be sincere. [step] Tell them "I am Sorry."', ""),
     'Relationships: How to apologize. Be sincere. Tell them "I am Sorry."'),
]
# What the text cannot tell apart, pinned so a change shows: a ctx_a that ends mid-sentence
# with no ctx_b reads as an unfinished ctx_b (none of the kit's WikiHow contexts does), and an
# abbreviation's point inside ctx_b cuts it short (no kit ctx_a ends in one).
NOT_RECOVERED = [
    (("Finance and Business", "[header] How to save [title] Open an account. [step] Ask Tom to", ""),
     "Finance and Business: How to save. Open an account. Ask Tom to",
     ("Finance and Business", "How to save. Open an account.", "Ask Tom to")),
    (("Parade", "People march down the street.", "the man in the st. louis shirt"),
     "Parade: People march down the street. the man in the st. louis shirt",
     ("Parade", "People march down the street. the man in the st.", "louis shirt")),
]


@pytest.mark.parametrize("record,line", RECOVERED)
def test_text_format_split_recovers_hand_built_records(record, line):
    label, ctx_a, ctx_b = record
    assert ctx_a and (ctx_b or "[header]" in ctx_a)  # the two forms of the published records
    recovered = ds.split_text_context(line)
    endings = ["runs.", "sits down.", "waves", "jumps."]
    assert recovered[2] == ctx_b
    if "[" not in ctx_a:  # markup-free: the fields themselves come back
        assert recovered == record
    # What is scored: lm-eval's query from the recovered fields equals the one from the record.
    assert ds.hellaswag_item(*recovered, endings, 0) == ds.hellaswag_item(*record, endings, 0)


@pytest.mark.parametrize("record,line,recovered", NOT_RECOVERED)
def test_text_format_split_limits_on_hand_built_records(record, line, recovered):
    endings = ["runs.", "sits down.", "waves", "jumps."]
    assert ds.split_text_context(line) == recovered
    assert ds.hellaswag_item(*recovered, endings, 0)["ctx"] != ds.hellaswag_item(*record, endings, 0)["ctx"]


def test_text_format_split_falls_on_the_kits_activitynet_items():
    # HellaSwag's ActivityNet items have a ctx_b, its WikiHow items none, and their activity
    # labels are disjoint (WikiHow's are its 19 categories): the recovered split must separate
    # the labels, or it put a boundary into a context of the other kind.
    with bz2.open(kit_file("hellaswag", "hellaswag_val_full.txt.bz2"), "rt", encoding="utf-8") as f:
        contexts = f.read().rstrip("\n").split("\n")[::6]
    split = [ds.split_text_context(c) for c in contexts]
    with_b = {label for label, _, ctx_b in split if ctx_b}
    without_b = {label for label, _, ctx_b in split if not ctx_b}
    assert not with_b & without_b
    assert len(without_b) == 19 and {"Home and Garden", "Personal Care and Style", "Sports and Fitness"} < without_b
    assert sum(bool(ctx_b) for _, _, ctx_b in split) == 3243  # every ActivityNet item: the file's first 3,243
    assert all(ctx_b for _, _, ctx_b in split[:3243]) and not any(ctx_b for _, _, ctx_b in split[3243:])


def test_hellaswag_reads_the_published_validation_file():
    items, _ = ds.read_hellaswag(kit_file("hellaswag", "hellaswag_val_full.txt.bz2"))
    assert len(items) == 10042  # the README of the data kit
    assert items[0]["ctx"] == "Roof shingle removal: A man is sitting on a roof. He" and items[0]["label"] == 3
    assert all(len(t["endings"]) == 4 and 0 <= t["label"] < 4 for t in items)


def test_encode_pair_moves_trailing_spaces_to_the_continuation():
    encode = lambda s: list(s.encode())
    assert ds.encode_pair(encode, "abc ", "d") == (list(b"abc"), list(b" d"))
    # A tokenizer that merges across the boundary: the continuation is what follows the context's
    # own tokens in the joint encoding, as lm-eval takes it.
    merge = lambda s: [s.count("xy")] + [ord(c) for c in s.replace("xy", "")]
    assert ds.encode_pair(merge, "ax", "yb")[1] == merge("axyb")[len(merge("ax")):]


class Bigram(torch.nn.Module):
    """A model with known next-token log-probabilities: logits = table[previous token]."""

    def __init__(self, logp, max_seq_len=64):
        super().__init__()
        self.table = torch.nn.Parameter(logp)
        self.cfg = SimpleNamespace(max_seq_len=max_seq_len)

    def forward(self, idx, targets=None):
        return self.table[idx], None


def bigram_table(rows):
    """(256, 256) next-byte probabilities: the given entries exact, the rest of each row uniform."""
    p = torch.full((256, 256), 1 / 256, dtype=torch.float64)
    for prev, nexts in rows.items():
        rest = (1 - sum(nexts.values())) / (256 - len(nexts))
        p[prev] = rest
        for tok, q in nexts.items():
            p[prev, tok] = q
    return p


def test_acc_acc_norm_and_per_token_norm_on_known_probabilities():
    """Endings "é" (3 tokens with its space, 1 character), "ab" (3 tokens, 2 characters) and "z"
    (2 tokens, 1 character), with log-likelihoods -5.99, -3.00 and -1.80 (by hand, below): the
    sum and the per-token mean pick "z", the per-character one "ab"."""
    e1, e2 = "é".encode()
    p = bigram_table({ord("q"): {32: 0.5}, 32: {ord("z"): 0.33, ord("a"): 0.3, e1: 0.01},
                      ord("a"): {ord("b"): 0.332}, e1: {e2: 0.5}})
    logp = lambda seq: sum(math.log(p[x, y]) for x, y in zip(seq, seq[1:]))
    sums = [logp(list(b"q ") + [e1, e2]), logp(list(b"q ab")), logp(list(b"q z"))]
    assert sums == pytest.approx([-5.99, -3.00, -1.80], abs=0.01)
    items = [{"ctx": "q", "endings": ["é", "ab", "z"], "label": 1}]
    summary, rows = ds.hellaswag_scores(Bigram(p.float().log()), lambda s: list(s.encode()), items)
    np.testing.assert_allclose(rows[0]["loglik"], sums, rtol=1e-5)
    assert (rows[0]["pick"], rows[0]["pick_norm"], rows[0]["pick_norm_tokens"]) == (2, 1, 2)
    assert summary == {"acc": 0.0, "acc_norm": 1.0, "acc_norm_tokens": 0.0, "truncated": 0}


def brute_force_logliks(model, ctx, endings):
    """Sum of log p over each ending's tokens: one forward per ending, no batching or padding."""
    ctx_ids, sums = list(ctx.encode()), []
    for e in endings:
        end = list((" " + e).encode())
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ctx_ids + end])[:, :-1])[0].double(), -1)[0]
        sums.append(sum(logp[len(ctx_ids) - 1 + i, tok].item() for i, tok in enumerate(end)))
    return sums


def write_text_format(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write("\n".join([f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b']}".strip(), str(r["label"]),
                               *r["endings"]]) + "\n")


def test_bench_hellaswag_every_source_against_one_forward_per_ending(tmp_path, monkeypatch):
    model = tiny_model(seed=4)
    ckpt = export(model, tmp_path / "m.pt")
    # Markup-free records, so the text format holds exactly what the jsonl does.
    records = [{**r, "label": i % 4, "ind": i} for i, (r, _, _) in enumerate(RECORDS[1:])]
    expected = [brute_force_logliks(model, query, choices) for _, query, choices in RECORDS[1:]]
    write_text_format(tmp_path / "hs.txt", records)
    with open(tmp_path / "hs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    monkeypatch.setitem(sys.modules, "datasets",
                        SimpleNamespace(load_dataset=lambda name, split: records if name == "Rowan/hellaswag" else None))
    for source in (str(tmp_path / "hs.txt"), str(tmp_path / "hs.jsonl"), "hub"):
        result = ev.main(["bench", ckpt, "--task", "hellaswag", "--source", source])
        summary = result["summary"]
        assert summary["tasks"] == 2 and "lm-eval hellaswag" in summary["convention"]
        for row, sums, record, (_, _, choices) in zip(result["rows"], expected, records, RECORDS[1:]):
            assert row["loglik"] == pytest.approx(sums, rel=1e-5)
            assert row["pick_norm"] == int(np.argmax([s / len(c) for s, c in zip(sums, choices)]))
        acc = np.mean([int(np.argmax(s)) == r["label"] for s, r in zip(expected, records)])
        assert summary["acc"] == acc


def test_bench_json_holds_every_items_row_and_the_table_the_first_20(tmp_path, capsys):
    # A per-item comparison (tests/test_lm_eval_parity.py) needs every row; bench kept only the
    # first 20 in its result and JSON.
    model = tiny_model(seed=4)
    ckpt = export(model, tmp_path / "m.pt")
    records = [{**r, "label": i % 4} for i, (r, _, _) in enumerate(RECORDS[1:] * 13)]  # 26 items
    expected = [brute_force_logliks(model, query, choices) for _, query, choices in RECORDS[1:] * 13]
    write_text_format(tmp_path / "hs.txt", records)
    capsys.readouterr()
    result = ev.main(["bench", ckpt, "--task", "hellaswag", "--source", str(tmp_path / "hs.txt"),
                      "--json-out", str(tmp_path / "hs.json")])
    printed = capsys.readouterr().out
    with open(tmp_path / "hs.json") as f:
        written = json.load(f)
    for rows in (result["rows"], written["rows"]):
        assert len(rows) == 26
        for row, sums, record in zip(rows, expected, records):
            assert row["loglik"] == pytest.approx(sums, rel=1e-5) and row["label"] == record["label"]
    # The table: a header and 20 rows (each row starts with its label), then the count of the rest.
    table = printed.split("loglik", 1)[1].strip().splitlines()
    assert len(table) == 21 and table[-1] == "(the first 20 of 26 rows; --json-out writes them all)"
    # The generation tasks: every problem's row too.
    problems = [{"question": f"What is {n}+1?", "answer": f"#### {n + 1}"} for n in range(25)]
    (tmp_path / "gsm.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
    model = Scripted(lambda prompt: ["The answer is 1.\n"])
    summary, rows = ds.generation_bench(model, BYTES, bench_args(source=str(tmp_path / "gsm.jsonl")))
    assert summary["problems"] == len(rows) == 25 and [r["reference"] for r in rows] == [str(n + 1) for n in range(25)]


def test_a_context_that_does_not_fit_is_an_error_or_cut_on_request(tmp_path, capsys):
    model = tiny_model(seed=4, max_seq_len=32)
    ckpt = export(model, tmp_path / "m.pt")
    record = {"activity_label": "Cooking", "ctx_a": "A man cracks an egg into a bowl and stirs.", "ctx_b": "he",
              "endings": ["eats.", "sits.", "runs.", "waits."], "label": 0}
    with open(tmp_path / "hs.jsonl", "w") as f:
        f.write(json.dumps(record) + "\n")
    argv = ["bench", ckpt, "--task", "hellaswag", "--source", str(tmp_path / "hs.jsonl")]
    run_expecting_error(argv, capsys, "hellaswag item 0", "--truncate left", "32-token window")
    result = ev.main(argv + ["--truncate", "left"])
    assert result["summary"]["truncated"] == 1
    # By hand: the context's newest tokens that leave room for the longest ending (" waits.",
    # 7 tokens) in the 33 positions a 32-token window scores.
    kept = "Cooking: A man cracks an egg into a bowl and stirs. He".encode()[-(33 - 7):].decode()
    assert result["rows"][0]["loglik"] == pytest.approx(brute_force_logliks(model, kept, record["endings"]), rel=1e-5)


# ----------------------------------------------------------------------------- GSM8K

# (completion, strict, flexible) under gsm8k_cot's filters, by hand.
GSM8K_COMPLETIONS = [
    ("She has 5 + 4 = 9. The answer is 9.", "9", "9."),
    ("He pays $1,250 in total. The answer is 1,250.", "1,250", "1,250."),
    ("So 8 - 3 = 5 and then 2", "[invalid]", "2"),
    ("The answer is -3.\n\nQ: next", "-3", "-3."),
    ("no digits at all", "[invalid]", "[invalid]"),
]


@pytest.mark.parametrize("completion,strict,flexible", GSM8K_COMPLETIONS)
def test_gsm8k_filters_by_hand(completion, strict, flexible):
    pattern = ds.gsm8k_convention(None, None)["strict"]
    assert ds.regex_answer(pattern, completion, 0) == strict
    assert ds.regex_answer(ds.FLEXIBLE, completion, -1) == flexible


@pytest.mark.skipif(not HAS_LM_EVAL, reason="lm-eval is optional (Makefile test install)")
@pytest.mark.parametrize("fewshot_source", [None, "train"])
def test_gsm8k_filters_and_exact_match_equal_lm_evals(fewshot_source, tmp_path):
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter
    if fewshot_source:
        fewshot_source = tmp_path / "train.jsonl"
        fewshot_source.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
        fewshot_source = str(fewshot_source)
    convention = ds.gsm8k_convention(fewshot_source, 1 if fewshot_source else None)
    completions = [c for c, _, _ in GSM8K_COMPLETIONS] + ["x\n#### 1,250.", "#### $12", "the answer is 7 apples. #### 7"]
    references = ["9", "1250", "2", "-3", "4", "1250", "12", "7"]
    for pattern, which in ((convention["strict"], 0), (ds.FLEXIBLE, -1)):
        theirs = [r[0] for r in RegexFilter(pattern, which).apply([[c] for c in completions], None)]
        assert [ds.regex_answer(pattern, c, which) for c in completions] == theirs
        for answer, reference in zip(theirs, references):
            want = exact_match_hf_evaluate([answer], [reference], regexes_to_ignore=list(ds.GSM8K_IGNORE),
                                           ignore_case=True)["exact_match"]
            assert (ds.gsm8k_normalize(answer) == ds.gsm8k_normalize(reference)) == bool(want)


def test_gsm8k_prompt_is_the_published_chain_of_thought_set():
    convention = ds.gsm8k_convention(None, None)
    prompt = ds.few_shot_prompt(convention, "What is 2+3?")
    shots = prompt.split("\n\n")
    assert len(shots) == 9 and shots[-1] == "Q: What is 2+3?\nA:"
    assert shots[0] == ("Q: There are 15 trees in the grove. Grove workers will plant trees in the grove today. After "
                        "they are done, there will be 21 trees. How many trees did the grove workers plant today?\nA: "
                        "There are 15 trees originally. Then there were 21 trees after some more were planted. So there "
                        "must have been 21 - 15 = 6. The answer is 6.")
    assert [s.rsplit("The answer is ", 1)[1] for s in shots[:-1]] == ["6.", "5.", "39.", "8.", "9.", "29.", "33.", "8."]
    with pytest.raises(ValueError, match="8 exemplars"):
        ds.gsm8k_convention(None, 9)


@pytest.fixture(autouse=True)
def scripted_decoding(monkeypatch):
    """A Scripted model decodes by its script; every other model as generate.decode does."""
    decode = gen.decode
    monkeypatch.setattr(gen, "decode", lambda model, *args: (model.decode if isinstance(model, Scripted) else
                                                              lambda *a: decode(model, *a))(*args))


class Scripted(torch.nn.Module):
    """A model whose completions are known: sample i is script(prompt)[i], emitted byte by
    byte and ended by stop() as generate.decode does."""

    def __init__(self, script, max_seq_len=1 << 16):
        super().__init__()
        self.script, self.prompts = script, []
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.cfg = SimpleNamespace(max_seq_len=max_seq_len)

    def decode(self, idx, max_new_tokens, temperature, top_k, generator, stop):
        prompt = bytes(idx[0].tolist()).decode(errors="replace")
        self.prompts.append(prompt)
        rows = []
        for text in self.script(prompt)[:idx.shape[0]]:
            new = []
            for tok in text.encode()[:max_new_tokens]:
                new.append(tok)
                if stop(new):
                    break
            rows.append(new)
        return rows


BYTES = (lambda s: list(s.encode()), lambda ids: bytes(ids).decode(errors="replace"), 256)


def bench_args(**kw):
    return SimpleNamespace(**{"task": "gsm8k", "fewshot_source": None, "shots": None, "limit": None, "max_new_tokens": 200,
                              "num_samples": 1, "temperature": 0.0, "top_k": None, "seed": 0, "truncate": None, **kw})


def test_gsm8k_cuts_at_the_next_question_scores_both_matches_and_votes(tmp_path):
    with open(tmp_path / "gsm.jsonl", "w") as f:
        for q, a in (("What is 4*2?", "4*2=<<4*2=8>>8\n#### 8"), ("What is 9-2?", "#### 7")):
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    script = {  # strict / flexible per sample, by hand
        # "...9" after the invented next question: read only if the "Q:" cut failed.
        "What is 4*2?": ["4*2 = 8. The answer is 8.\n\nQ: What is 9? The answer is 9.",  # 8 / 8.  -> both right
                         "The answer is 9.", "So 8"],                                     # 9 / 9.; [invalid] / 8
        "What is 9-2?": ["It is 7", "The answer is 7.", "The answer is 6."],             # [inv]/7; 7/7.; 6/6.
    }
    model = Scripted(lambda p: script[p.rsplit("Q: ", 1)[1].split("\n")[0]])
    summary, rows = ds.generation_bench(model, BYTES, bench_args(source=str(tmp_path / "gsm.jsonl"), num_samples=3,
                                                                   temperature=1.0))
    assert all(p.startswith("Q: There are 15 trees") and p.count("\n\nQ: ") == 8 for p in model.prompts)
    assert summary["problems"] == 2 and [r["reference"] for r in rows] == ["8", "7"]
    assert rows[0]["completion"] == "4*2 = 8. The answer is 8.\n\n"
    assert [r["strict_match"] for r in rows] == pytest.approx([1 / 3, 1 / 3])
    assert [r["flexible_match"] for r in rows] == pytest.approx([2 / 3, 2 / 3])
    # Majority of the extracted answers: strict ("8", "9", "[invalid]") -> the first sample's "8".
    assert [r["maj_strict_match"] for r in rows] == [1.0, 0.0] and [r["maj_flexible_match"] for r in rows] == [1.0, 1.0]
    assert "gsm8k_cot" in summary["convention"] and summary["truncated"] == 0


def test_gsm8k_with_train_exemplars_uses_lm_evals_plain_format(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"})
                                                  + "\n" for i in range(6)))
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
    model = Scripted(lambda p: ["2+2=4\n#### 4\n\nQuestion: 3+3?"])
    summary, rows = ds.generation_bench(model, BYTES, bench_args(source=str(tmp_path / "test.jsonl"),
                                                                   fewshot_source=str(tmp_path / "train.jsonl")))
    assert model.prompts[0] == "".join(f"Question: {i}+1?\nAnswer: {i}+1={i + 1}\n#### {i + 1}\n\n" for i in range(5)) + \
        "Question: 2+2?\nAnswer:"
    assert summary["strict_match"] == summary["flexible_match"] == 1.0 and "train.jsonl" in summary["convention"]


def test_exemplars_that_are_scored_items_are_refused(tmp_path, capsys):
    # --fewshot-source given the test file itself: items 0-4 would be scored with their own worked
    # answers in the prompt. Compared by question text, so a copy under another name (here with
    # its spaces doubled) is caught too.
    records = [{"question": f"What is {i} plus {i}?", "answer": f"#### {2 * i}"} for i in range(6)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "copy.jsonl").write_text("".join(json.dumps({**r, "question": r["question"].replace(" ", "  ")}) + "\n"
                                                 for r in records[3:]))
    ckpt = export(tiny_model(), tmp_path / "m.pt")
    test, copy = str(tmp_path / "test.jsonl"), str(tmp_path / "copy.jsonl")
    run_expecting_error(["bench", ckpt, "--task", "gsm8k", "--source", test, "--fewshot-source", test], capsys,
                        "exemplar 0 is also scored item 0", "train split")
    run_expecting_error(["bench", ckpt, "--task", "gsm8k", "--source", test, "--fewshot-source", copy, "--shots", "2"],
                        capsys, f"--fewshot-source {copy}: exemplar 0 is also scored item 3 of --source {test}")
    # --limit 3 scores items 0-2 only, none of them an exemplar: it runs
    summary, _ = ds.generation_bench(Scripted(lambda p: ["#### 0"]), BYTES, bench_args(
        source=test, fewshot_source=copy, shots=2, limit=3))
    assert summary["problems"] == 3 and summary["strict_match"] == pytest.approx(1 / 3)
    # the published chain-of-thought exemplars are exemplars too
    (tmp_path / "cot.jsonl").write_text(json.dumps(records[0]) + "\n" + json.dumps({"question": ds.GSM8K_COT[2][0],
                                                                                    "answer": "#### 39"}) + "\n")
    with pytest.raises(ValueError, match="item 1 is exemplar 2 of the published prompt"):
        ds.generation_bench(Scripted(lambda p: ["#### 0"]), BYTES, bench_args(source=str(tmp_path / "cot.jsonl")))


def test_gsm8k_scores_all_1319_test_problems():
    records = ds.read_math_records(kit_file("gsm8k", "test.jsonl"), "gsm8k")
    answer = {r["question"]: r["reference"] for r in records}
    model = Scripted(lambda p: [f"Easy. The answer is {answer[p.rsplit('Q: ', 1)[1][:-len(chr(10) + 'A:')]]}."])
    summary, _ = ds.generation_bench(model, BYTES, bench_args(source=kit_file("gsm8k", "test.jsonl")))
    assert summary["problems"] == 1319 and summary["strict_match"] == summary["flexible_match"] == 1.0


def test_a_prompt_that_does_not_fit_is_an_error_or_cut_on_request(tmp_path, capsys):
    model = Scripted(lambda p: ["The answer is 4."], max_seq_len=300)
    (tmp_path / "gsm.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
    args = bench_args(source=str(tmp_path / "gsm.jsonl"), max_new_tokens=100)
    prompt = ds.few_shot_prompt(ds.gsm8k_convention(None, None), "2+2?")
    with pytest.raises(ValueError, match=rf"is {len(prompt.encode())} tokens but the model takes 200: pass --truncate left"):
        ds.generation_bench(model, BYTES, args)
    summary, _ = ds.generation_bench(model, BYTES, bench_args(**{**vars(args), "truncate": "left"}))
    assert summary["truncated"] == 1 and model.prompts[-1] == prompt.encode()[-200:].decode(errors="replace")


# ----------------------------------------------------------------------------- MATH-500

COMPLETIONS = [
    # (completion, reference, extracted, correct) for the in-house exact match
    ("We get $x=3$.\nFinal Answer: The final answer is $3$. I hope it is correct.", "3", "$3$", True),
    ("Final Answer: The final answer is $\\frac{14}{3}$", "\\frac{14}{3}", "$\\frac{14}{3}$", True),
    ("Janet sells 16 - 3 - 4 = 9 duck eggs a day.\nShe makes 9 * 2 = $18 every day.\n#### 18", "18", "18", True),
    ("So the answer is $\\boxed{\\dfrac{14}{3}}$.", "\\frac{14}{3}", "\\dfrac{14}{3}", True),
    ("The polar form is $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$", "\\left( 3, \\frac{\\pi}{2} \\right)",
     "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("We get $\\boxed{0.75}$", "\\frac34", "0.75", True),
    ("The area is $\\boxed{864 \\mbox{ inches}^2}$.", "864", "864 \\mbox{ inches}^2", True),
    ("First \\boxed{2}, but correcting: \\boxed{x=-2}", "-2", "x=-2", True),
    ("The angle is $\\boxed{30^\\circ}$", "30", "30^\\circ", True),
    ("The correct option is $\\boxed{\\text{(C)}}$", "\\text{(C)}", "\\text{(C)}", True),
    ("She ends with 18.00 dollars", "18", "18.00", True),
    ("So the answer is 5. Wait, actually the answer is 6.", "6", "6", True),
    ("He saved $1,234,567, then stopped", "1234567", "1,234,567", True),
    ("Hence the answer is $\\frac{1}{2}$.", "0.5", "$\\frac{1}{2}$", True),
    ("So the answer is $\\boxed{2\\sqrt{3}}$", "3\\sqrt{2}", "2\\sqrt{3}", False),
    ("I am not sure.", "7", None, False),
]


@pytest.mark.parametrize("completion,reference,extracted,correct", COMPLETIONS)
def test_answer_extraction_and_matching(completion, reference, extracted, correct):
    assert ds.extract_answer(completion) == extracted
    assert ds.answers_match(ds.extract_answer(completion), reference) == correct


def test_math_verify_accepts_equivalent_forms_the_in_house_match_rejects():
    verify = ds.math_verifier()
    if verify is None:
        pytest.skip("math-verify is optional (Makefile test install)")
    for gold, said in (("$\\boxed{2\\sqrt{2}}$", "\\sqrt{8}"), ("$\\boxed{x^2+2x+1}$", "(x+1)^2")):
        completion = f"Final Answer: The final answer is ${said}$. I hope it is correct."
        assert verify(gold, completion) and not ds.answers_match(ds.extract_answer(completion), ds.last_boxed(gold))
    assert not verify("$\\boxed{3}$", "Final Answer: The final answer is $4$. I hope it is correct.")


def test_math500_scores_all_500_with_the_minerva_prompt():
    path = kit_file("math500", "test.jsonl")
    records = ds.read_math_records(path, "math500")
    answer = {r["question"]: r["reference"] for r in records}
    problem = lambda p: p.rsplit("Problem:\n", 1)[1][:-len("\n\nSolution:")]
    model = Scripted(lambda p: [f"Final Answer: The final answer is ${answer[problem(p)]}$. I hope it is correct."])
    summary, _ = ds.generation_bench(model, BYTES, bench_args(task="math500", source=path, max_new_tokens=400))
    assert summary["problems"] == 500 and summary["exact_match"] >= 0.99
    if ds.math_verifier() is not None:
        assert summary["math_verify"] >= 0.95
    prompt = model.prompts[0]
    assert prompt.startswith("Problem:\nFind the domain of the expression") and prompt.count("\n\nProblem:\n") == 4
    assert prompt.endswith("\n\nSolution:") and "minerva" in summary["convention"]


def test_bench_gsm8k_on_a_tiny_checkpoint_against_greedy_by_hand(tmp_path):
    model = tiny_model(seed=5, max_seq_len=2048)
    ckpt = export(model, tmp_path / "m.pt")
    (tmp_path / "gsm.jsonl").write_text(json.dumps({"question": "What is 4*2?", "answer": "4*2=8\n#### 8"}) + "\n")
    result = ev.main(["bench", ckpt, "--task", "gsm8k", "--source", str(tmp_path / "gsm.jsonl"), "--shots", "1",
                      "--max-new-tokens", "12"])
    prompt = list(ds.few_shot_prompt(ds.gsm8k_convention(None, 1), "What is 4*2?").encode())
    decode = lambda ids: bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
    new = []
    for _ in range(12):  # greedy by full recomputation, no KV cache
        with torch.no_grad():
            new.append(int(model(torch.tensor([prompt + new]))[0][0, -1].argmax()))
        if new[-1] == 256 or "Q:" in decode(new):
            break
    assert result["rows"][0]["completion"] == decode(new).split("Q:")[0]


def test_missing_or_hub_only_source_is_one_line(tmp_path, capsys, monkeypatch):
    ckpt = export(tiny_model(), tmp_path / "m.pt")
    run_expecting_error(["bench", ckpt, "--task", "gsm8k", "--source", str(tmp_path / "gsm8k_tset.jsonl")], capsys,
                        "gsm8k_tset.jsonl", "no such file")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")
    monkeypatch.setitem(sys.modules, "datasets", SimpleNamespace(load_dataset=offline))
    run_expecting_error(["bench", ckpt, "--task", "gsm8k"], capsys, "from the hub", "--source")
    run_expecting_error(["bench", ckpt, "--task", "hellaswag"], capsys, "from the hub", "hellaswag_val_full.txt.bz2")


# ----------------------------------------------------------------------------- anchor task

class AnchorOracle(torch.nn.Module):
    """Hand-made predictions: answers key + shift(a, b) with its own rule for every record."""

    def __init__(self, rule, vocab=128):
        super().__init__()
        self.rule, self.vocab = rule, vocab
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.cfg = SimpleNamespace(vocab_size=vocab)

    def forward(self, idx, targets=None):
        logits = torch.zeros(*idx.shape, self.vocab)
        for i, row in enumerate(idx.tolist()):
            p = next(t for t in range(1, len(row)) if 1 <= row[t] <= 4)  # first anchor; key before it
            logits[i, -1, self.rule(row[p - 1], row[p], row[p + 1])] = 1
        return logits, None


@pytest.fixture(scope="module")
def anchor_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("anchor") / "data"
    subprocess.run([sys.executable, os.path.join(ROOT, "prepare_data.py"), "anchor", "--out", str(out),
                    "--n-train", "200", "--n-eval", "100"], check=True, capture_output=True)
    return str(out)


def test_anchor_scores_on_hand_made_predictions(anchor_data):
    shift = {1: 5, 2: 1, 3: -2, 4: -8}  # the task's single functions (issue 3)
    composite = lambda x, a, b: x + shift[a] + shift[b]
    trained = lambda x, a, b: x - 6 if (a, b) == (3, 4) else composite(x, a, b)
    symmetric = lambda x, a, b: x - 6 if (a, b) in ((3, 4), (4, 3)) else composite(x, a, b)
    summary, _ = ds.anchor_scores(AnchorOracle(trained), anchor_data)
    assert summary["seen_pair_acc"] == summary["test_key_acc"] == 1.0
    assert summary["heldout_inferential"] == 1.0 and summary["heldout_symmetric"] == 0.0
    summary, _ = ds.anchor_scores(AnchorOracle(symmetric), anchor_data)
    assert summary["seen_pair_acc"] == 1.0 and summary["heldout_symmetric"] == 1.0 and summary["heldout_other"] == 0.0
    # Answer "x" itself: wrong everywhere, neither kind on the held-out pair.
    summary, _ = ds.anchor_scores(AnchorOracle(lambda x, a, b: x), anchor_data)
    assert summary["seen_pair_acc"] == 0.0 and summary["heldout_other"] == 1.0


def test_heldout_shares_on_trained_keys_by_hand():
    # Held-out (4,3) records, the key anywhere in 9 inputs of fillers (>= 20); keys 20, 21, 30
    # trained, 50 and 51 never. Answers by hand: composite x-10, mirror x-6, else other.
    meta = {"anchor": {"train_keys": [20, 21, 30], "mirror_shift": -6}}
    def record(key, at):
        inputs = [60] * 9
        inputs[at:at + 3] = [key, 4, 3]
        return inputs + [key - 10]
    records = np.array([record(20, 0), record(21, 3), record(50, 6), record(30, 2), record(51, 1)])
    predictions = [10, 15, 40, 77, 99]  # inferential, symmetric, inferential (untrained key), other, other
    shares = ds.heldout_shares(records, predictions, meta)
    assert (shares["inferential"], shares["symmetric"], shares["other"]) == pytest.approx((2 / 5, 1 / 5, 2 / 5))
    assert shares["records_trained_keys"] == 3
    assert (shares["inferential_trained_keys"], shares["symmetric_trained_keys"], shares["other_trained_keys"]) == \
        pytest.approx((1 / 3, 1 / 3, 1 / 3))
    # No trained key among the records: no share to report, not a division by zero.
    assert ds.heldout_shares(records[[2, 4]], [40, 99], meta)["inferential_trained_keys"] is None


def test_bench_anchor_reports_shares_on_trained_keys_beside_all_keys(tmp_path, anchor_data, monkeypatch, capsys):
    # A model that composes on trained keys only (and answers the key itself on the rest):
    # every trained-key answer is inferential, while the all-key share is the trained keys' share.
    from data import load_meta, read_records
    meta = load_meta(anchor_data)
    train_keys = set(meta["anchor"]["train_keys"])
    shift = {1: 5, 2: 1, 3: -2, 4: -8}
    rule = lambda x, a, b: x - 6 if (a, b) == (3, 4) else (x + shift[a] + shift[b] if x in train_keys else x)
    monkeypatch.setattr(ds, "load_model", lambda path, device: (AnchorOracle(rule), {"config": {}, "data_meta": meta}))
    result = ev.main(["bench", "unused.pt", "--task", "anchor", "--data", anchor_data, "--json-out", str(tmp_path / "a.json")])
    held = read_records(anchor_data, "heldout")
    on_trained = np.mean([k in train_keys for k in held[:, -1] + 10])  # the stored target is x-10
    summary = result["summary"]
    assert 0.5 < on_trained < 1 and summary["heldout_inferential"] == pytest.approx(on_trained)
    assert summary["heldout_inferential_trained_keys"] == 1.0
    assert summary["heldout_symmetric_trained_keys"] == summary["heldout_other_trained_keys"] == 0.0
    assert result["rows"][-1]["records_trained_keys"] == round(on_trained * len(held))
    with open(tmp_path / "a.json") as f:
        assert json.load(f)["summary"] == summary
    assert "heldout_inferential_trained_keys" in capsys.readouterr().out


def hand_answer_attention(model, records):
    """answer_attention by hand in float64: each layer's input (hooked), its RMSNorm, q and k,
    RoPE as a rotation of the pairs (j, j + head_dim/2) by pos * theta^(-2j/head_dim), the
    causal softmax of the last query, the mean over heads; the key position read record by record."""
    inputs = torch.as_tensor(records[:, :-1])
    seen = []
    hooks = [block.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().double()))
             for block in model.layers]
    with torch.no_grad():
        model(inputs)
    for h in hooks:
        h.remove()
    cfg, T = model.cfg, inputs.shape[1]
    hd = cfg.d_model // cfg.n_head
    angle = torch.arange(T, dtype=torch.float64)[:, None] * cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    turn = torch.polar(torch.ones_like(angle), angle)  # (T, hd/2) unit complex numbers

    def rotate(x):  # (B, T, heads, hd), pairs (j, j + hd/2) as complex numbers
        z = torch.complex(x[..., :hd // 2], x[..., hd // 2:]) * turn[None, :, None]
        return torch.cat([z.real, z.imag], dim=-1)

    out = {}
    for i, (x, block) in enumerate(zip(seen, model.layers)):
        norm = block.attn_norm
        h = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
        q = rotate((h @ block.attn.wq.weight.double().T).view(len(x), T, cfg.n_head, hd))
        k = rotate((h @ block.attn.wk.weight.double().T).view(len(x), T, cfg.n_kv_head, hd))
        k = k.repeat_interleave(cfg.n_head // cfg.n_kv_head, dim=2)  # head n reads kv head n // group
        last = torch.einsum("bnd,btnd->bnt", q[:, -1], k) / math.sqrt(hd)  # the last query sees every key
        p = last.softmax(-1).mean(1)  # (B, T)
        to_key, to_pair = [], []
        for row, record in zip(p, records.tolist()):
            at = next(t for t in range(1, T) if 1 <= record[t] <= 4) - 1
            to_key.append(row[at].item())
            to_pair.append(row[at + 1].item() + row[at + 2].item())
        out[f"attn_to_key_L{i}"], out[f"attn_to_pair_L{i}"] = np.mean(to_key), np.mean(to_pair)
    return out


def test_answer_attention_equals_a_hand_softmax():
    from model import GPTConfig
    # 4 heads on 2 kv heads (grouped); queries scaled up so that attention is far from uniform
    # (1/9 per position). Records of the held-out pair with the key at every position 0..6 (the
    # pair up to the answer position itself).
    model = GPT(GPTConfig(vocab_size=128, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=16))
    init_model_(model, gamma=0.5, seed=7)
    with torch.no_grad():
        for block in model.layers:
            block.attn.wq.weight.mul_(8)
    model.eval()
    rng = np.random.default_rng(0)
    records = rng.integers(20, 100, size=(14, 10))
    for n, at in enumerate(list(range(7)) * 2):
        records[n, at:at + 3] = [records[n, at], 4, 3]
    assert (ds.anchor_key_positions(records) == list(range(7)) * 2).all()
    got = ds.answer_attention(model, records, batch_size=5)  # 3 batches, the last one short
    want = hand_answer_attention(model, records)
    assert set(got) == set(want) == {f"attn_to_{w}_L{i}" for w in ("key", "pair") for i in (0, 1)}
    for name, value in want.items():
        assert got[name] == pytest.approx(value, abs=1e-6), name
    assert len({round(v, 3) for v in want.values()}) == 4  # distinct numbers: a mix-up would show
    assert model.cfg.attn_backend == "sdpa"  # the eager backend was for the measurement only


def test_bench_anchor_end_to_end(tmp_path, anchor_data):
    from data import load_meta, read_records
    meta = load_meta(anchor_data)
    model = tiny_model(vocab_size=meta["vocab_size"], eot_id=meta["eot_id"], max_seq_len=64)
    data_meta = {k: meta[k] for k in ("tokenizer", "vocab_size", "eot_id")}
    result = ev.main(["bench", export(model, tmp_path / "a.pt", data_dir=anchor_data, data_meta=data_meta), "--task", "anchor"])
    held = result["rows"][-1]
    # By hand: the model's argmax answer on each held-out record, whose stored target is the
    # inferential answer x-10; the symmetric one is x-6, i.e. target + 4.
    records = torch.from_numpy(read_records(anchor_data, "heldout"))
    with torch.no_grad():
        predicted = model(records[:, :-1])[0][:, -1].argmax(-1)
    target = records[:, -1]
    assert held["split"] == "heldout"
    assert held["inferential"] == pytest.approx((predicted == target).double().mean().item())
    assert held["symmetric"] == pytest.approx((predicted == target + 4).double().mean().item())
    # The key positions read off the generator's layout: key at p, the pair (4,3) at p+1 and p+2,
    # the target the key's composite; and the answer's attention to them, by hand.
    at = ds.anchor_key_positions(records.numpy())
    rows = np.arange(len(records))
    assert (records[rows, at + 1] == 4).all() and (records[rows, at + 2] == 3).all()
    assert (records[rows, at] - 10 == target).all() and len(set(at.tolist())) == 7  # positions 0..6 all used
    want = hand_answer_attention(model, records.numpy())
    assert {k: v for k, v in result["summary"].items() if k.startswith("attn_")} == pytest.approx(want, abs=1e-6)


def test_bench_anchor_refuses_a_model_of_other_data(tmp_path, anchor_data, capsys):
    # a byte-level model (vocab 257) would score the anchor records silently: train.py's check first
    ckpt = export(tiny_model(), tmp_path / "b.pt", data_dir=anchor_data)
    run_expecting_error(["bench", ckpt, "--task", "anchor"], capsys, f"{anchor_data} does not fit checkpoint {ckpt}",
                        "tokenized with 'anchor'", "--tokenizer bytes")


def test_bench_anchor_command_reports_a_correct_models_answers(tmp_path, anchor_data, monkeypatch):
    # The command line end to end (checkpoint -> scores -> table and JSON) on a model built to
    # answer: composite rule on the held-out pair, and the mirror pair's rule (symmetric).
    # load_model is replaced only because a hand-made rule is no GPT checkpoint; loading
    # itself is tested above.
    from data import load_meta
    meta = load_meta(anchor_data)
    shift = {1: 5, 2: 1, 3: -2, 4: -8}
    composite = lambda x, a, b: x + shift[a] + shift[b]
    trained = lambda x, a, b: x - 6 if (a, b) == (3, 4) else composite(x, a, b)
    symmetric = lambda x, a, b: x - 6 if (a, b) in ((3, 4), (4, 3)) else composite(x, a, b)
    for rule, inferential in ((trained, 1.0), (symmetric, 0.0)):
        monkeypatch.setattr(ds, "load_model", lambda path, device: (AnchorOracle(rule), {"config": {}, "data_meta": meta}))
        out = tmp_path / "anchor.json"
        result = ev.main(["bench", "unused.pt", "--task", "anchor", "--data", anchor_data, "--json-out", str(out)])
        val, test, held = result["rows"]
        assert [r["split"] for r in result["rows"]] == ["val", "test", "heldout"]
        assert val["accuracy"] == test["accuracy"] == 1.0 and held["accuracy"] == inferential
        assert held["inferential"] == inferential and held["symmetric"] == 1.0 - inferential
        with open(out) as f:
            assert json.load(f)["summary"] == result["summary"]
