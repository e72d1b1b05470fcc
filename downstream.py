"""Downstream benchmarks, scored as lm-evaluation-harness scores them (`python eval.py bench ...`).

- hellaswag (lm-eval `hellaswag`): context `activity_label: ctx_a Ctx_b` with lm-eval's clean-up
  (every `[...]` span removed), each ending scored as " " + ending after the context, encoded the
  way lm-eval encodes a pair; acc = argmax of the summed log-likelihood, acc_norm = the sum over
  the ending's length in characters; acc_norm_tokens = the mean per token (a
  tokenizer-dependent normalisation, beside lm-eval's character one).
- gsm8k (lm-eval `gsm8k_cot`): the 8 chain-of-thought exemplars of Wei et al. (2022), "Q: …\\nA: …",
  greedy until "Q:"; strict_match = the number in "The answer is N.", flexible_match = the last
  number; exact match after lm-eval's regexes_to_ignore. With --fewshot-source FILE (train
  records): lm-eval `gsm8k`'s "Question: …\\nAnswer: …" with the first --shots records of FILE, strict
  "#### N". Every test record is scored.
- math500 (lm-eval `minerva_math500`): the 4-shot prompt of Lewkowycz et al. (2022, Minerva),
  until "Problem:"; math_verify = lm-eval's metric (math-verify's parse/verify of the gold
  solution against the completion, when the package is installed) and exact_match = this repo's
  normalisation of the "final answer is" (else the last boxed/number) against the reference
  answer, which is not lm-eval's sympy-based one.
- anchor: the synthetic anchor-function task of anchor.py.

A prompt longer than the model allows (max_seq_len, minus the new tokens when generating:
generation_budget) is an error naming the sizes; --truncate left cuts its oldest tokens, as
lm-eval does silently, and the summary counts how many items were cut.

`eval.py lm-eval-task` writes lm-eval's own task for a local file (lm_eval_task), the offline
route to running lm-eval itself on these benchmarks. open_training_bench runs the hellaswag and
anchor scorers inside train.py every bench_interval steps.
"""
import argparse
import bz2
import io
import json
import math
import os
import re
import time
from fractions import Fraction

import numpy as np
import torch

from analysis import capture_attention, token_logprobs
from anchor import ANCHOR_SHIFTS, anchor_accuracy, anchor_answer_kinds, anchor_fields
from checkpoint import load_model
from configurator import at_least
from data import check_model_vocab, get_tokenizer, load_meta, progress_bar, read_records
from fileio import atomic_write_bytes, parse_json, path_kind
from generate import generate
from model import GPT

# ----------------------------------------------------------------------------- a checkpoint's data and tokenizer
# Here rather than in eval.py, which imports this file for `bench`: imports go one way.

def tokenizer_of(info, tokenizer_dir=None):
    """(encode, decode, eot_id) for the tokenizer the checkpoint's data was prepared with."""
    enc = get_tokenizer(info["data_meta"]["tokenizer"], tokenizer_dir)
    return enc.encode_ordinary, lambda ids: enc.decode(ids, errors="replace"), info["data_meta"]["eot_id"]


def data_dir_of(args, info):
    """--data, else the run's own data_dir: the folder the analyses read validation batches from."""
    data = args.data or (info.get("config") or {}).get("data_dir")
    if not data:
        raise ValueError("no validation data: pass --data <folder written by prepare_data.py>")
    kind = path_kind(data)
    if kind not in (None, "a folder"):  # else "DATA/meta.json not found", as if the folder were incomplete
        raise ValueError(f"{data} is {kind}, not a data folder: pass --data <folder written by prepare_data.py>")
    if not os.path.isfile(os.path.join(data, "meta.json")):
        raise FileNotFoundError(f"{data}/meta.json not found: pass --data <folder written by prepare_data.py>"
                                + ("" if args.data else " (the run's data_dir is gone or was on another machine)"))
    return data


def check_data_fits(data, model, info):
    """train.py's check before it reads data (data.check_model_vocab), here before an
    analysis does: a gpt2 model on byte data scores a silent, meaningless loss (~10.8), a byte
    model on gpt2 data dies of an IndexError in the embedding."""
    try:
        check_model_vocab(load_meta(data), model.cfg.vocab_size, (info.get("data_meta") or {}).get("tokenizer"))
    except ValueError as e:
        raise ValueError(f"{data} does not fit checkpoint {info.get('path')}: {e}") from None


# ----------------------------------------------------------------------------- published sources

LOCAL_COPIES = {"hellaswag": "hellaswag_val_full.txt.bz2", "gsm8k": "test.jsonl", "math500": "test.jsonl"}


def not_a_file(path, what):
    """None where path is a plain file (or a link to one), else why it is not `what` ("a gsm8k file"): missing,
    or what it is instead. A FIFO is named, never opened: reading one waits for a writer forever."""
    kind = path_kind(path)
    return None if kind == "a file" else "no such file" if kind is None else f"{kind}, not {what}"


def check_source(source, task):
    """--source is 'hub' or a local file; anything else (missing, a FIFO) is named, never sent to the hub."""
    problem = source != "hub" and not_a_file(source, f"a {task} file")
    if problem:
        raise ValueError(f"--source {source}: {problem}; pass a local {task} file in its published format "
                         f"(e.g. {task}/{LOCAL_COPIES[task]} of the offline data kit) or 'hub'")


def load_hub(task, *names, split):
    """Records of a hub data set; unreachable hub -> one line saying to use a local --source."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--source hub needs the `datasets` package (pip install datasets); offline, "
                         f"pass --source <local {LOCAL_COPIES[task]}>") from None
    try:
        return list(datasets.load_dataset(*names, split=split))
    except Exception as e:  # datasets reports no network as one of many types (ConnectionError, OSError, ...)
        raise ValueError(f"could not load {'/'.join(names)} from the hub ({type(e).__name__}: {e}); offline, pass "
                         f"--source <local {LOCAL_COPIES[task]}> (the offline data kit has one)") from None


def read_whole(path, opener=open):
    """path's bytes (opener: bz2.open for a compressed file); a compressed stream cut short (a partial
    download), which bz2 reports as a bare EOFError, is a ValueError naming the file."""
    try:
        with opener(path, "rb") as f:
            return f.read()
    except EOFError:
        raise ValueError(f"{path}: its compressed data ends early (a partial download or copy): fetch the file "
                         "again") from None


def read_jsonl(path, opener=open):
    """The records of a JSON-lines file (opener: bz2.open for a compressed one); a line that is not
    JSON, not UTF-8 or nested past the decoder is a ValueError naming the file and the line."""
    lines = read_whole(path, opener).splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(parse_json(line))
            except ValueError as e:
                raise ValueError(f"{path}: line {n} is not a JSON record ({e})") from None
    return records


# The fields each benchmark reads of its records (the published layouts; lm-eval's tasks read the
# same), with what each must hold: another benchmark's file (GSM8K's test.jsonl as --task hellaswag)
# is named before an item is scored or a task is written, not a KeyError in the middle of one.
TEXT = (lambda v: isinstance(v, str), "a text")
RECORD_FIELDS = {
    "hellaswag": {"activity_label": TEXT, "ctx_a": TEXT, "ctx_b": TEXT,
                  "endings": (lambda v: isinstance(v, list) and v and all(isinstance(e, str) for e in v),
                              "a list of texts"),
                  # an int in the published jsonl, a digit string on the hub and in the text format
                  "label": (lambda v: type(v) is int or isinstance(v, str) and v.isdigit(), "an ending's index")},
    "gsm8k": {"question": TEXT, "answer": TEXT},
    "math500": {"problem": TEXT, "solution": TEXT, "answer": TEXT},
}


def check_records(records, task, source):
    fix = (f"not a {task} file: pass {task}'s own file in its published format (e.g. {task}/{LOCAL_COPIES[task]} "
           "of the offline data kit)")
    for n, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"{source}: record {n} is not a JSON object; {fix}")
        for field, (ok, what) in RECORD_FIELDS[task].items():
            if field not in record:
                raise ValueError(f"{source}: record {n} has no {field!r} field; {fix}")
            if not ok(record[field]):
                raise ValueError(f"{source}: record {n}'s {field!r} is not {what}; {fix}")
    return records


def fit_prompt(tokens, room, what, truncate):
    """tokens, or their newest `room` with --truncate left; (tokens, cut?). Too long without it:
    the error names the sizes and the fixes."""
    if room < 1:
        raise ValueError(f"{what}: no room for a prompt (max_seq_len minus --max-new-tokens is {room}); "
                         "lower --max-new-tokens")
    if len(tokens) <= room:
        return tokens, False
    if truncate != "left":
        raise ValueError(f"{what} is {len(tokens)} tokens but the model takes {room}: pass --truncate left to cut its "
                         "oldest tokens (counted in the output), or use fewer shots, fewer new tokens or a "
                         "longer-context model")
    return tokens[-room:], True


# ----------------------------------------------------------------------------- HellaSwag

def lm_eval_clean(text):
    """lm-eval hellaswag's preprocess: WikiHow markup out (" [title]" ends a sentence, every other
    [...] span dropped), double spaces collapsed once."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag_item(activity_label, ctx_a, ctx_b, endings, label):
    # str.capitalize also lower-cases the rest of ctx_b: lm-eval's definition, kept as it is.
    return {"ctx": lm_eval_clean(f"{activity_label}: {ctx_a} {ctx_b.capitalize()}"),
            "endings": [lm_eval_clean(e) for e in endings], "label": int(label)}


# A sentence ends at '.', '!' or '?', after any closing quotes or brackets ('He says "hi." he').
SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s")
ENDS_SENTENCE = re.compile(r"[.!?][\"')\]]*$")


def split_text_context(line):
    """(activity_label, ctx_a, ctx_b) of a text-format line `activity_label: ctx`, which lost the
    boundary between ctx_a and ctx_b. HellaSwag's rule: ctx is ctx_a, then a space and ctx_b when
    ctx_b is not empty, and ctx_b is the unfinished noun phrase the ending completes (ActivityNet;
    empty for WikiHow, whose contexts end a sentence). So ctx_b is taken to be the unfinished
    sentence at the end, none when ctx ends a sentence. Wrong only where ctx_a itself ends
    mid-sentence or ctx_b holds an abbreviation ('st. louis'); on the kit's file the recovered
    ctx_b fall on exactly the ActivityNet items. The jsonl or the hub give the fields exactly."""
    label, _, ctx = line.partition(": ")
    if not ctx or ENDS_SENTENCE.search(ctx.rstrip()):
        return label, ctx, ""
    cut = max((m.end() for m in SENTENCE_END.finditer(ctx)), default=0)
    return label, ctx[:cut].rstrip(), ctx[cut:]


def hellaswag_records(source):
    """(records in the published layout {ind, activity_label, ctx_a, ctx_b, endings, label}, how
    ctx_b was obtained) from the published jsonl (or the hub: ctx_a/ctx_b exact) or llama.cpp's
    6-line text format (context, label, four endings; see shared/data/README), optionally
    bz2-compressed."""
    check_source(source, "hellaswag")
    if source == "hub":
        return load_hub("hellaswag", "Rowan/hellaswag", split="validation"), "exact (ctx_a, ctx_b from the records)"
    opener = bz2.open if source.endswith(".bz2") else open
    if ".jsonl" in source:
        return read_jsonl(source, opener), "exact (ctx_a, ctx_b from the records)"
    # Decoded as text mode would (universal newlines: a CRLF copy reads the same)
    lines = io.TextIOWrapper(io.BytesIO(read_whole(source, opener)), encoding="utf-8").read().rstrip("\n").split("\n")
    if len(lines) % 6:
        raise ValueError(f"{source}: {len(lines)} lines is not a multiple of 6; expected the HellaSwag "
                         "text format (context, label, 4 endings per task) or a .jsonl file")
    records = []
    for i in range(0, len(lines), 6):
        label, ctx_a, ctx_b = split_text_context(lines[i])
        records.append({"ind": i // 6, "activity_label": label, "ctx_a": ctx_a, "ctx_b": ctx_b,
                        "endings": lines[i + 2:i + 6], "label": lines[i + 1]})
    return records, "text format: ctx_b taken as the unfinished last sentence"


def read_hellaswag(source):
    """(items {ctx, endings, label}, how the context was built): hellaswag_records as scored."""
    records, how = hellaswag_records(source)
    check_records(records, "hellaswag", source)
    return [hellaswag_item(r["activity_label"], r["ctx_a"], r["ctx_b"], r["endings"], r["label"]) for r in records], how


def encode_pair(encode, context, continuation):
    """lm-eval's split of a (context, continuation) pair into tokens: trailing spaces of the
    context move to the continuation, the whole string is encoded once and the continuation is
    what follows the context's own tokens (BPE merges across the boundary stay as in the text)."""
    stripped = context.rstrip()
    continuation, context = context[len(stripped):] + continuation, stripped
    whole, ctx = encode(context + continuation), encode(context)
    return ctx, whole[len(ctx):]


@torch.no_grad()
def continuation_logprobs(model, context, continuations):
    """Sum of log p(continuation tokens | context) and token count, for each continuation (token
    ids), in one padded batch. The caller fits context + continuation into the window."""
    seqs = [context + c for c in continuations]
    x = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    y = torch.full_like(x, -1)
    for i, (seq, c) in enumerate(zip(seqs, continuations)):
        x[i, :len(seq)] = torch.tensor(seq)
        y[i, len(seq) - len(c):len(seq)] = torch.tensor(c)
    device = next(model.parameters()).device
    logp = token_logprobs(model, x[:, :-1].to(device), y[:, 1:].to(device)).cpu()
    return logp.sum(1).tolist(), [len(c) for c in continuations]


def hellaswag_tokens(encode, item):
    """(context tokens, each ending's tokens) of an item, as lm-eval splits each pair."""
    pairs = [encode_pair(encode, item["ctx"], " " + e) for e in item["endings"]]
    return pairs[0][0], [c for _, c in pairs]


def hellaswag_fit(context, endings, max_seq_len, truncate):
    """(positions the item needs, whether a model of max_seq_len has them): the one rule of
    hellaswag_scores and of train.py's bench check. Its longest ending after the whole context, or
    with truncate (left) after at least one context token, the one the ending's first token is
    predicted from; the model scores max_seq_len + 1 positions (the last token is only a target)."""
    need = max(map(len, endings)) + (1 if truncate else len(context))
    return need, need <= max_seq_len + 1


def hellaswag_scores(model, encode, items, truncate=None, progress=True):
    """(summary {acc, acc_norm, acc_norm_tokens, truncated}, per item rows)."""
    max_len = model.cfg.max_seq_len
    rows, truncated = [], 0
    for n, item in enumerate(progress_bar(items, desc="hellaswag", disable=not progress)):
        context, endings = hellaswag_tokens(encode, item)
        need, fits = hellaswag_fit(context, endings, max_len, truncate)
        if not fits and truncate:
            raise ValueError(f"hellaswag item {n}: its longest ending, {need - 1} tokens, leaves no context token in "
                             f"the model's {max_len}-token window (it scores {max_len + 1} positions); use a "
                             "longer-context model")
        if not fits:
            raise ValueError(f"hellaswag item {n}'s context and longest ending are {need} tokens, past the model's "
                             f"{max_len}-token window (it scores {max_len + 1} positions): pass --truncate left to cut "
                             "the context's oldest tokens (counted in the output), or use a longer-context model")
        room = max_len + 1 - max(map(len, endings))  # the context's newest tokens beside the longest ending
        truncated += len(context) > room
        context = context[-room:]
        sums, counts = continuation_logprobs(model, context, endings)
        chars = [len(e) for e in item["endings"]]
        rows.append({"label": item["label"], "pick": int(np.argmax(sums)),
                     "pick_norm": int(np.argmax([s / c for s, c in zip(sums, chars)])),
                     "pick_norm_tokens": int(np.argmax([s / c for s, c in zip(sums, counts)])), "loglik": sums})
    summary = {m: float(np.mean([r[f"pick{k}"] == r["label"] for r in rows]))
               for m, k in (("acc", ""), ("acc_norm", "_norm"), ("acc_norm_tokens", "_norm_tokens"))}
    return {**summary, "truncated": truncated}, rows


# ----------------------------------------------------------------------------- GSM8K

# Wei et al. (2022), "Chain-of-thought prompting elicits reasoning in large language models",
# the 8 GSM8K exemplars of its appendix, as lm-eval's gsm8k_cot task uses them.
GSM8K_COT = [
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
     "there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have "
     "been 21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, "
     "they had 74 - 35 = 39. The answer is 39."),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did "
     "Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. "
     "The answer is 8."),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. 5 + 4 = 9. "
     "The answer is 9."),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday to "
     "thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 computers "
     "were added. 9 + 20 is 29. The answer is 29."),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf "
     "balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, he "
     "had 35 - 2 = 33 golf balls. The answer is 33."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars "
     "left. 23 - 15 is 8. The answer is 8."),
]

# lm-eval's gsm8k metric: these removed from answer and reference, then compared case-insensitively.
GSM8K_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")
FLEXIBLE = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"


def regex_answer(pattern, text, which):
    """lm-eval's regex filter: the first (which=0) or last (-1) match, a group tuple's first
    non-empty group, stripped; "[invalid]" without a match."""
    found = re.findall(pattern, text)
    if not found:
        return "[invalid]"
    match = found[which]
    if isinstance(match, tuple):
        match = next((g for g in match if g), "[invalid]")
    return match.strip()


def gsm8k_normalize(s):
    for pattern in GSM8K_IGNORE:
        s = re.sub(pattern, "", s)
    return s.lower()


def gsm8k_convention(fewshot_source, shots):
    """The prompt and answer rules GSM8K is scored by (see generation_convention)."""
    if fewshot_source is None:
        shots = len(GSM8K_COT) if shots is None else shots
        if not 0 <= shots <= len(GSM8K_COT):
            raise ValueError(f"--shots {shots}: the published chain-of-thought set has {len(GSM8K_COT)} exemplars; "
                             "pass --fewshot-source <gsm8k train.jsonl> for other counts")
        return {"name": f"lm-eval gsm8k_cot: Wei et al. 2022 chain-of-thought exemplars, {shots}-shot; strict_match "
                        "'The answer is N.', flexible_match the last number",
                "exemplars": GSM8K_COT[:shots], "template": "Q: {}\nA:", "stop": "Q:",
                "strict": r"The answer is (\-?[0-9\.\,]+)."}
    problem = not_a_file(fewshot_source, "a gsm8k file")
    if problem:  # no 'hub' here: the exemplars come from a local train file
        raise ValueError(f"--fewshot-source {fewshot_source}: {problem}; pass gsm8k's train.jsonl in its published "
                         "format (its first --shots records are the exemplars)")
    shots = 5 if shots is None else shots
    records = check_records(read_jsonl(fewshot_source), "gsm8k", fewshot_source)[:shots]
    if len(records) < shots:
        raise ValueError(f"--fewshot-source {fewshot_source} holds {len(records)} records, fewer than --shots {shots}")
    return {"name": f"lm-eval gsm8k: the first {shots} records of {os.path.basename(fewshot_source)} as exemplars "
                    "(lm-eval draws them at random from train); strict_match '#### N', flexible_match the last number",
            "exemplars": [(r["question"], r["answer"]) for r in records], "template": "Question: {}\nAnswer:",
            "stop": "Question:", "strict": r"#### (\-?[0-9\.\,]+)"}


# ----------------------------------------------------------------------------- MATH-500

# Lewkowycz et al. (2022), "Solving quantitative reasoning problems with language models"
# (Minerva), the 4-shot MATH prompt of its appendix, as lm-eval's minerva_math tasks use it.
MINERVA_4SHOT = [
    ("Find the domain of the expression  $\\frac{\\sqrt{x-2}}{\\sqrt{5-x}}$.",
     "The expressions inside each square root must be non-negative. Therefore, $x-2 \\ge 0$, so $x\\ge2$, and "
     "$5 - x \\ge 0$, so $x \\le 5$. Also, the denominator cannot be equal to zero, so $5-x>0$, which gives $x<5$. "
     "Therefore, the domain of the expression is $\\boxed{[2,5)}$.\nFinal Answer: The final answer is $[2,5)$. "
     "I hope it is correct."),
    ("If $\\det \\mathbf{A} = 2$ and $\\det \\mathbf{B} = 12,$ then find $\\det (\\mathbf{A} \\mathbf{B}).$",
     "We have that $\\det (\\mathbf{A} \\mathbf{B}) = (\\det \\mathbf{A})(\\det \\mathbf{B}) = (2)(12) = "
     "\\boxed{24}.$\nFinal Answer: The final answer is $24$. I hope it is correct."),
    ("Terrell usually lifts two 20-pound weights 12 times. If he uses two 15-pound weights instead, how many times "
     "must Terrell lift them in order to lift the same total weight?",
     "If Terrell lifts two 20-pound weights 12 times, he lifts a total of $2\\cdot 12\\cdot20=480$ pounds of weight.  "
     "If he lifts two 15-pound weights instead for $n$ times, he will lift a total of $2\\cdot15\\cdot n=30n$ "
     "pounds of weight.  Equating this to 480 pounds, we can solve for $n$:\n\\begin{align*}\n30n&=480\\\\\n"
     "\\Rightarrow\\qquad n&=480/30=\\boxed{16}\n\\end{align*}\nFinal Answer: The final answer is $16$. "
     "I hope it is correct."),
    ("If the system of equations\n\n\\begin{align*}\n6x-4y&=a,\\\\\n6y-9x &=b.\n\\end{align*}has a solution $(x, y)$ "
     "where $x$ and $y$ are both nonzero,\nfind $\\frac{a}{b},$ assuming $b$ is nonzero.",
     "If we multiply the first equation by $-\\frac{3}{2}$, we obtain\n\n$$6y-9x=-\\frac{3}{2}a.$$Since we also know "
     "that $6y-9x=b$, we have\n\n$$-\\frac{3}{2}a=b\\Rightarrow\\frac{a}{b}=\\boxed{-\\frac{2}{3}}.$$\nFinal Answer: "
     "The final answer is $-\\frac{2}{3}$. I hope it is correct."),
]


def last_boxed(text):
    """Content of the last \\boxed{...} (or \\fbox{...}), with nested braces; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    command = "\\boxed" if text.startswith("\\boxed", start) else "\\fbox"
    rest = text[start + len(command):]
    if rest.startswith(" "):  # \boxed 5
        return rest.split()[0] if rest.split() else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i]
    return None


# Thousands groups (1,250) or plain digits, then a decimal or fraction tail: "12, then" is 12.
NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"


def extract_answer(text):
    """Final answer of a completion: Minerva's "Final Answer: The final answer is X. I hope it is
    correct.", else after '####', else the last \\boxed{}, else after 'the answer is', else the
    last number in the text; None if there is none."""
    minerva = re.search(r"Final Answer: The final answer is(.*?)\. I hope it is correct\.",
                        text + " I hope it is correct.")
    if minerva and minerva.group(1).strip():
        return minerva.group(1).strip()
    if "####" in text:
        return text.split("####", 1)[1].strip().split("\n")[0].strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    said = list(re.finditer(r"answer is[:\s]*", text, flags=re.IGNORECASE))
    if said:  # the last statement wins: "the answer is 5. Wait, actually the answer is 6."
        rest = text[said[-1].end():]
        number = re.match(r"\$?(" + NUMBER + ")", rest)
        if number:  # "18 apples." -> 18
            return number.group(1)
        # Otherwise an expression ($\frac{1}{2}$, (C)) up to the end of its sentence or line.
        expression = re.match(r"(.*?)(?:\.\s|\.?$|\n)", rest, flags=re.MULTILINE).group(1).strip()
        if expression:
            return expression
    numbers = re.findall(NUMBER, text)
    return numbers[-1] if numbers else None


def unwrap_command(s, command):
    """Replace \\command{X} by X (one brace level), e.g. \\text{cm} -> cm."""
    while (i := s.find(command + "{")) >= 0:
        depth, j = 0, i + len(command)
        for j in range(i + len(command), len(s)):
            depth += (s[j] == "{") - (s[j] == "}")
            if depth == 0:
                break
        s = s[:i] + s[i + len(command) + 1:j] + s[j + 1:]
    return s


def normalize_answer(s):
    """Canonical string of an answer: no LaTeX spacing/sizing, no $, %, degree signs,
    thousands separators or trailing period; \\frac{a}{b} -> a/b; 'x = 5' -> 5."""
    s = s.strip().strip("$").strip()
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "^\\circ", "^{\\circ}",
                 "\\%", "%", "\\$", "$", "\\displaystyle"):
        s = s.replace(junk, "")
    # A unit written as \text{ cm}^2 after the value (leading space = a word, not a symbol).
    s = re.sub(r"\\(?:text|mbox)\{\s[^{}]*\}(\^\{?\d\}?)?$", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for command in ("\\text", "\\textbf", "\\mbox", "\\mathrm"):
        s = unwrap_command(s, command)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", r"\1/\2", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\1/\2", s)  # \frac12
    # Thousands separators: a comma between digits followed by exactly three digits.
    while re.search(r"(\d),(\d{3})(?!\d)", s):
        s = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", s)
    s = re.sub(r"^[a-zA-Z]\w*=", "", s)
    return s


def as_number(s):
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted, reference):
    """Exact match after normalisation; numbers compare by value (18.00 == 18, 0.5 == 1/2)."""
    if predicted is None:
        return False
    p, r = normalize_answer(predicted), normalize_answer(reference)
    if p == r:
        return True
    p_num, r_num = as_number(p), as_number(r)
    return p_num is not None and p_num == r_num


def math_verifier():
    """lm-eval's math_verify metric, verify(parse(gold solution), parse(completion)), or None
    when the optional math-verify package is missing."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    return lambda solution, completion: bool(verify(parse(solution), parse(completion)))


# ----------------------------------------------------------------------------- generation benchmarks

MINERVA = {"name": "lm-eval minerva_math500: Lewkowycz et al. 2022 4-shot prompt; math_verify as lm-eval; "
                   "exact_match by this repo's normalisation (not lm-eval's sympy is_equiv)",
           "exemplars": MINERVA_4SHOT, "template": "Problem:\n{}\n\nSolution:", "stop": "Problem:"}


def few_shot_prompt(convention, question):
    """lm-eval's few-shot context: each exemplar as template + " " + its answer, blank lines
    between, then the question in the template."""
    shots = [convention["template"].format(q) + " " + a for q, a in convention["exemplars"]]
    return "\n\n".join(shots + [convention["template"].format(question)])


def read_math_records(source, task):
    """GSM8K / MATH-500 test records {question, reference, solution} from a local jsonl in its
    published layout, or from the hub on a connected machine (openai/gsm8k, HuggingFaceH4/MATH-500)."""
    check_source(source, task)
    if source == "hub":
        names = ("openai/gsm8k", "main") if task == "gsm8k" else ("HuggingFaceH4/MATH-500",)
        records = load_hub(task, *names, split="test")
    else:
        records = read_jsonl(source)
    check_records(records, task, source)
    if task == "gsm8k":
        return [{"question": r["question"], "solution": r["answer"], "reference": r["answer"].split("####")[-1].strip()}
                for r in records]
    return [{"question": r["problem"], "solution": r["solution"], "reference": r["answer"]} for r in records]


def score_completion(task, convention, record, text, verifier):
    """{metric: correct} and {metric: extracted answer} of one completion."""
    if task == "gsm8k":
        answers = {"strict_match": regex_answer(convention["strict"], text, 0),
                   "flexible_match": regex_answer(FLEXIBLE, text, -1)}
        want = gsm8k_normalize(record["reference"])
        return {m: gsm8k_normalize(a) == want for m, a in answers.items()}, answers
    answer = extract_answer(text)
    correct = {"exact_match": answers_match(answer, record["reference"])}
    if verifier is not None:
        correct["math_verify"] = verifier(record["solution"], text)
    return correct, {"exact_match": answer}


def check_exemplars_unscored(exemplars, records, args):
    """An exemplar that is also a scored item hands the model its own answer in the prompt
    (--fewshot-source given the test file makes its first --shots items free). Compared by
    question text, whitespace collapsed, so a copy of the file under another name is caught."""
    scored = {" ".join(r["question"].split()): n for n, r in enumerate(records)}
    for i, (question, _) in enumerate(exemplars):
        n = scored.get(" ".join(question.split()))
        if n is None:
            continue
        if args.fewshot_source:
            raise ValueError(f"--fewshot-source {args.fewshot_source}: exemplar {i} is also scored item {n} of "
                             f"--source {args.source}; take the exemplars from the train split (gsm8k train.jsonl), "
                             "not the test file")
        raise ValueError(f"--source {args.source}: item {n} is exemplar {i} of the published prompt; drop it from "
                         "--source (the published test sets hold none of them)")


MAX_NEW_TOKENS = 256  # lm-eval's default max_gen_toks (neither gsm8k_cot nor minerva_math500 sets its own)


def generation_budget(window, prompt_len, wanted):
    """New tokens per completion: --max-new-tokens when given, else MAX_NEW_TOKENS where the window
    holds them beside the prompt, else what the prompt leaves, but at least half the window (a
    longer prompt is cut to the rest with --truncate left). A fixed 256 would leave a model of 256
    positions no room for any prompt."""
    if wanted is not None:
        return wanted
    return min(MAX_NEW_TOKENS, max(window - prompt_len, window // 2, 1))


def budget_range(budgets):
    """The summary's max_new_tokens: one number, or 'least-most' where the prompts' lengths set it."""
    if not budgets:
        return None
    low, high = min(budgets), max(budgets)
    return low if low == high else f"{low}-{high}"


def generation_bench(model, tokenizer, args):
    encode, decode, eot_id = tokenizer
    convention = gsm8k_convention(args.fewshot_source, args.shots) if args.task == "gsm8k" else MINERVA
    if args.task == "math500" and (args.shots not in (None, 4) or args.fewshot_source):
        raise ValueError("--shots/--fewshot-source: MATH-500 is scored with the published Minerva 4-shot prompt; "
                         "drop them")
    verifier = math_verifier() if args.task == "math500" else None
    records = read_math_records(args.source, args.task)[:args.limit]
    check_exemplars_unscored(convention["exemplars"], records, args)
    window, marker = model.cfg.max_seq_len, convention["stop"]
    rows, truncated, budgets = [], 0, []
    for n, record in enumerate(progress_bar(records, desc=args.task)):
        prompt = encode(few_shot_prompt(convention, record["question"]))
        budget = generation_budget(window, len(prompt), args.max_new_tokens)
        prompt, cut = fit_prompt(prompt, window - budget, f"{args.task} item {n}'s prompt (+ {budget} new tokens)",
                                 args.truncate)
        truncated += cut
        budgets.append(budget)
        # Checked after every token: the newest token and a short decoded tail only, not the
        # whole continuation (that would be quadratic in its length).
        stop = lambda toks: toks[-1] == eot_id or marker in decode(toks[-32:])
        outs = generate(model, prompt, budget, args.num_samples, args.temperature, args.top_k, args.seed, stop)
        # lm-eval's `until`: the completion ends where the model starts the next exemplar.
        texts = [decode([t for t in o if t != eot_id]).split(marker)[0] for o in outs]
        scored = [score_completion(args.task, convention, record, t, verifier) for t in texts]
        row = {"reference": record["reference"], "completion": texts[0],
               **{f"answer_{m}": a for m, a in scored[0][1].items()}}
        for metric in scored[0][0]:
            row[metric] = float(np.mean([c[metric] for c, _ in scored]))
        if args.num_samples > 1:  # majority vote over the samples' extracted answers (ties: the first sample's)
            for metric in scored[0][1]:
                votes = [a for _, answers in scored for m, a in answers.items() if m == metric]
                best = max(votes, key=votes.count)
                row[f"maj_{metric}"] = float(next(c[metric] for c, a in scored if a[metric] == best))
        rows.append(row)
    metrics = [k for k in rows[0] if k in ("strict_match", "flexible_match", "exact_match", "math_verify")
               or k.startswith("maj_")] if rows else []
    summary = {"task": args.task, "convention": convention["name"], "problems": len(rows),
               **{m: float(np.mean([r[m] for r in rows])) for m in metrics}, "truncated": truncated,
               "max_new_tokens": budget_range(budgets),
               "temperature": args.temperature, "num_samples": args.num_samples}
    if args.task == "math500" and verifier is None:
        summary["math_verify"] = "not installed (pip install math-verify)"
    return summary, rows


# ----------------------------------------------------------------------------- anchor task

@torch.no_grad()
def last_token_predictions(model, records, batch_size=1024):
    """The model's argmax answer at the last input position of each record (n, record_len)."""
    device = next(model.parameters()).device
    inputs = torch.as_tensor(records[:, :-1], device=device)
    return torch.cat([model(chunk)[0][:, -1].argmax(-1).cpu() for chunk in inputs.split(batch_size)]).numpy()


KINDS = ("inferential", "symmetric", "other")


def heldout_shares(records, predictions, meta):
    """The held-out pair's answer shares on all keys, and on the keys training saw (the other
    keys, meta's test_keys, are never trained with any pair: even a model that composes
    perfectly is not expected to answer on them, so the all-key shares top out near the share
    of trained keys, ~0.8). None where no record has a trained key."""
    records, predictions = np.asarray(records), np.asarray(predictions)
    trained = np.isin(anchor_fields(records)[0], meta["anchor"]["train_keys"])
    kinds = anchor_answer_kinds(records, predictions, meta)
    on_trained = anchor_answer_kinds(records[trained], predictions[trained], meta) if trained.any() else {}
    return {**{k: kinds[k] for k in KINDS}, "records_trained_keys": int(trained.sum()),
            **{f"{k}_trained_keys": on_trained.get(k) for k in KINDS}}


def anchor_key_positions(records):
    """Where each record's key sits among its inputs: the token before the first anchor (1..4),
    as anchor.anchor_records writes them (key at p, the pair at p+1 and p+2; fillers and
    keys are never anchors, check_anchor_task refuses such ranges)."""
    inputs = np.asarray(records, np.int64)[:, :-1]
    return ((inputs >= 1) & (inputs <= max(ANCHOR_SHIFTS))).argmax(1) - 1


@torch.no_grad()
def answer_attention(model, records, batch_size=1024):
    """Per layer, the attention of the answer position (the last input, whose output is the
    answer) to the key and to the anchor pair (its two positions summed), averaged over heads and
    records: {attn_to_key_L{i}, attn_to_pair_L{i}}. Does the answer read the pair it has to
    compose, and where? Through the eager backend, the one that exposes the probabilities."""
    device = next(model.parameters()).device
    key = torch.as_tensor(anchor_key_positions(records))
    inputs = torch.as_tensor(np.asarray(records)[:, :-1], device=device)
    backend, totals = model.cfg.attn_backend, None
    model.set_attn_backend("eager")
    try:
        for chunk, at in zip(inputs.split(batch_size), key.split(batch_size)):
            # Reduced in the hook: the last query's row, mean over heads, (B, T) per layer.
            with capture_attention(model, reduce=lambda p: p[:, :, -1].double().mean(1).cpu()) as layers:
                model(chunk)
            rows = torch.arange(len(chunk))
            sums = torch.stack([torch.stack([a[rows, at].sum(), (a[rows, at + 1] + a[rows, at + 2]).sum()])
                                for a in layers])  # (layers, [key, pair])
            totals = sums if totals is None else totals + sums
    finally:
        model.set_attn_backend(backend)
    means = (totals / len(records)).tolist()
    return {f"attn_to_{what}_L{i}": layer[j] for i, layer in enumerate(means) for j, what in enumerate(("key", "pair"))}


ANCHOR_SPLITS = ("val", "test", "heldout")


def anchor_scores(model, data_dir, limit=None):
    """The anchor-function task: accuracy on seen pairs (train keys: val split; unseen keys: test
    split) and, on the held-out pair, the share of inferential (composite) vs symmetric (the
    mirror pair's rule) answers, on all keys and on trained keys, over the first `limit` records
    of each split (None: all); scoring rules live with the generator in anchor.py."""
    meta = load_meta(data_dir)
    if "anchor" not in meta:
        raise ValueError(f"{data_dir} is not an anchor-task folder; make one with `python prepare_data.py anchor`")
    rows = []
    for split in ANCHOR_SPLITS:
        records = read_records(data_dir, split)[:limit]
        predictions = last_token_predictions(model, records)
        row = {"split": split, "records": len(records), "accuracy": anchor_accuracy(records, predictions)}
        if split == "heldout":
            row.update(heldout_shares(records, predictions, meta))
            # The mechanism behind the shares. Only a GPT exposes its attention probabilities
            # (capture_attention); a stand-in model is scored without them.
            attention = answer_attention(model, records) if isinstance(model, GPT) else {}
        rows.append(row)
    val, test, held = rows
    # The all-key fields keep their names and meaning, so committed results read the same.
    summary = {"task": "anchor", "seen_pair_acc": val["accuracy"], "test_key_acc": test["accuracy"],
               **{f"heldout_{k}": held[k] for k in KINDS},
               **{f"heldout_{k}_trained_keys": held[f"{k}_trained_keys"] for k in KINDS}, **attention}
    return summary, rows


# ----------------------------------------------------------------------------- eval.py lm-eval-task

# Our task -> (lm-eval's own task file, under lm_eval/tasks/; the local task's name; the split it scores).
LM_EVAL_TASKS = {"hellaswag": ("hellaswag/hellaswag.yaml", "hellaswag_local", "validation"),
                 "gsm8k": ("gsm8k/gsm8k-cot.yaml", "gsm8k_cot_local", "test"),
                 "math500": ("minerva_math/minerva_math500.yaml", "minerva_math500_local", "test")}


def lm_eval_task(task, source, folder, limit=None):
    """lm-eval's own task, fed a local file instead of the hub: folder/NAME.jsonl holds the records
    in the layout the task reads (HellaSwag's text format converted, ctx_b recovered as bench
    does) and folder/NAME.yaml includes the installed lm-eval's task file, so prompt, exemplars,
    filters and metrics stay lm-eval's and only the data's origin changes. Returns (NAME, yaml)."""
    if source == "hub":
        raise ValueError(f"--source hub: lm_eval reads the hub itself (its task {LM_EVAL_TASKS[task][0]}); "
                         "lm-eval-task is for a local file")
    try:
        import lm_eval
    except ImportError:
        raise ImportError("lm-eval-task needs lm-eval: pip install lm-eval (or pip install '.[eval]')") from None
    official, name, split = LM_EVAL_TASKS[task]
    official = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", official)
    if not os.path.isfile(official):
        raise ValueError(f"the installed lm-eval has no {official}: install lm-eval 0.4.x (pip install '.[eval]')")
    if task == "hellaswag":
        records = hellaswag_records(source)[0]
    else:
        check_source(source, task)
        records = read_jsonl(source)
    check_records(records, task, source)  # lm-eval would fail on the task only when it is run
    data, yaml = (os.path.join(os.path.abspath(folder), name + ext) for ext in (".jsonl", ".yaml"))
    # Read whole and written anew: --source the task's own data file would be replaced by its first --limit records.
    if any(os.path.exists(path) and os.path.samefile(path, source) for path in (data, yaml)):
        raise ValueError(f"--source {source} is the file lm-eval-task writes in --out-dir {folder}: pass the "
                         "published file, or another --out-dir")
    os.makedirs(folder, exist_ok=True)
    atomic_write_bytes(data, [json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records[:limit]])
    # Paths as JSON strings: valid YAML double-quoted scalars whatever characters a path holds.
    # The data file is absolute: lm-eval resolves data_files against its working directory. No
    # tag: the local task joins none of lm-eval's groups; no training split: there is no train
    # file, and the few-shot tasks take their exemplars from the task file itself.
    atomic_write_bytes(yaml, [f"include: {json.dumps(official)}\ntask: {name}\ntag: []\ndataset_path: json\n"
                              f"dataset_name: null\ndataset_kwargs:\n  data_files:\n    {split}: {json.dumps(data)}\n"
                              "training_split: null\n".encode()])
    return name, yaml


def run_lm_eval_task(args):
    name, yaml = lm_eval_task(args.task, args.source, args.out_dir, args.limit)
    print(f"wrote {yaml} and its data; lm-eval runs it on an HF export (train.py export RUN HF_FOLDER --format hf):\n"
          f"lm_eval --model hf --model_args pretrained=HF_FOLDER,trust_remote_code=True,dtype=float32 "
          f"--include_path {args.out_dir} --tasks {name}")


# ----------------------------------------------------------------------------- during training (train.py bench_*)

# The benchmarks train.py scores every bench_interval steps, and the metrics its log line shows.
# Not gsm8k/math500: generation takes minutes per evaluation, and under FSDP every rank must run
# the same number of forwards, which greedy decodes that stop at their own tokens keep only while
# the ranks' logits agree bit for bit.
TRAINING_BENCH = {"hellaswag": ("acc", "acc_norm"),
                  "anchor": ("seen_pair_acc", "heldout_inferential", "heldout_symmetric")}
KIT_HELLASWAG = "eval/hellaswag/hellaswag_val_full.txt.bz2"


def open_training_bench(task, source, limit, data_dir, model_cfg, truncate="", tokenizer_dir="", log=print):
    """train.py's bench_* settings, checked and their items read once, before any run folder is
    written: -> bench(model, step), which scores the first `limit` items (anchor: of each split of
    data_dir) with eval.py bench's own functions (hellaswag_scores, anchor_scores; truncate='left'
    is its --truncate left), the model in eval mode under no_grad and then back in the mode it was
    in, logs one line and returns the metrics.jsonl row {step, bench_<task>_<metric>, ...,
    bench_s}. A bad setting is one ValueError "config: bench_...: <the fix>", so that no item can
    fail in the middle of a run.

    FSDP: every rank calls bench at the same step. Each forward all-gathers the parameters from
    all ranks, so rank 0 scoring alone would wait forever for the others; here every rank scores
    the same items (the cost does not shrink with more ranks) and only rank 0 logs (log=log0) and
    records the row (checkpoint.Metrics). Gathering the full weights to score on rank 0 would hold
    the whole model there and leave the other ranks waiting in their next collective, where a
    long benchmark trips NCCL's timeout. With bf16 parameters (train.py on CUDA) near-ties can pick
    another ending than eval.py bench's fp32 scores do; on CPU (fp32) they are the same numbers."""
    if task not in TRAINING_BENCH:
        kind = ("a generation benchmark (minutes per evaluation): score checkpoints with eval.py bench"
                if task in LOCAL_COPIES else "not a benchmark")
        raise ValueError(f"config: bench_task={task!r} is {kind}; during training choose one of "
                         f"{', '.join(TRAINING_BENCH)}")
    if type(limit) is not int or limit < 1:
        raise ValueError(f"config: bench_limit={limit!r} must be a whole number >= 1 (the first N items are scored)")
    if truncate not in ("", "left"):
        raise ValueError(f"config: bench_truncate={truncate!r}: choose '' (a context that does not fit is refused) "
                         f"or 'left' (its oldest tokens cut, counted)")
    meta = load_meta(data_dir)
    if task == "anchor":
        count, score = anchor_bench(source, limit, data_dir, meta, model_cfg)
    else:
        count, score = hellaswag_bench(source, limit, data_dir, meta, model_cfg, truncate, tokenizer_dir)

    def bench(model, step):
        t0 = time.time()
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                summary = score(model)
        finally:
            model.train(training)
        row = {"step": step, **bench_fields(task, summary), "bench_s": time.time() - t0}
        shown = ", ".join(f"{k} {summary[k]:.3f}" for k in TRAINING_BENCH[task])
        cut = f" ({summary['truncated']} contexts cut)" if summary.get("truncated") else ""
        log(f"bench {task}: {shown} on {count}{cut} in {row['bench_s']:.1f} s")
        return row
    return bench


def bench_fields(task, summary):
    """A summary's numbers as flat metrics.jsonl fields (TensorBoard/W&B curves): bench_<task>_<name>."""
    return {f"bench_{task}_{k}": v for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def anchor_bench(source, limit, data_dir, meta, model_cfg):
    """(what is scored, in words; score(model) -> summary) of the anchor task on data_dir."""
    if source:
        raise ValueError(f"config: bench_source={source!r}: the anchor task scores data_dir's own "
                         f"{'/'.join(ANCHOR_SPLITS)} splits; leave bench_source empty")
    if "anchor" not in meta:
        raise ValueError(f"config: bench_task='anchor' needs an anchor-task data_dir (python prepare_data.py anchor); "
                         f"{data_dir} holds {meta['tokenizer']} text: use bench_task='hellaswag'")
    missing = [s for s in ANCHOR_SPLITS if s not in meta["splits"]]
    if missing:
        raise ValueError(f"config: bench_task='anchor': {data_dir} has no {'/'.join(missing)} split; "
                         f"rewrite it with python prepare_data.py anchor")
    if meta["record_len"] - 1 > model_cfg.max_seq_len:
        raise ValueError(f"config: bench_task='anchor': records of {meta['record_len'] - 1} inputs do not fit "
                         f"model.max_seq_len={model_cfg.max_seq_len}; raise it to {meta['record_len'] - 1}")
    sizes = [sum(meta["splits"][s]["shard_tokens"]) // meta["record_len"] for s in ANCHOR_SPLITS]
    count = f"{'/'.join(str(min(limit, n)) for n in sizes)} {'/'.join(ANCHOR_SPLITS)} records"
    return count, lambda model: anchor_scores(model, data_dir, limit)[0]


def hellaswag_bench(source, limit, data_dir, meta, model_cfg, truncate, tokenizer_dir):
    """(what is scored, in words; score(model) -> summary) of the first `limit` HellaSwag items,
    each checked to fit the model's window as hellaswag_scores fits it."""
    kit = f"the published jsonl, or the text format such as the offline data kit's {KIT_HELLASWAG}"
    if "record_len" in meta:
        raise ValueError(f"config: bench_task='hellaswag' needs text data; {data_dir} holds {meta['tokenizer']} "
                         f"records: use bench_task='anchor'")
    if not source:
        raise ValueError(f"config: bench_source is empty: bench_task='hellaswag' needs a HellaSwag file ({kit}) "
                         f"or 'hub'")
    problem = source != "hub" and not_a_file(source, "a HellaSwag file")
    if problem:
        raise ValueError(f"config: bench_source={source!r}: {problem}; pass a HellaSwag file ({kit})")
    try:
        items = read_hellaswag(source)[0][:limit]
    except (OSError, EOFError, ValueError) as e:  # bz2, JSON, UTF-8 or layout (check_records) errors
        raise ValueError(f"config: bench_source={source!r} is not a HellaSwag file ({type(e).__name__}: {e}); "
                         f"pass {kit}") from None
    if not items:
        raise ValueError(f"config: bench_source={source!r} holds no HellaSwag items; pass {kit}")
    try:
        encode = get_tokenizer(meta["tokenizer"], tokenizer_dir or None).encode_ordinary
    except (OSError, ValueError, SystemExit) as e:  # get_tokenizer exits on a failed download
        raise ValueError(f"config: bench_task='hellaswag' needs data_dir's tokenizer {meta['tokenizer']!r}: {e} "
                         f"(train.py's --tokenizer-dir is bench_tokenizer_dir)") from None
    for n, item in enumerate(items):
        need, fits = hellaswag_fit(*hellaswag_tokens(encode, item), model_cfg.max_seq_len, truncate)
        if not fits:
            fixes = ["bench_truncate='left' (its oldest context tokens cut, counted)"] if not truncate else []
            fixes += [f"bench_limit={n} (the items before it fit)"] if n else []
            raise ValueError(f"config: bench_task='hellaswag': item {n} of {source} needs {need} tokens (its longest "
                             f"ending{'' if truncate else ' and the context'}), past model.max_seq_len="
                             f"{model_cfg.max_seq_len} + 1; set {', '.join(fixes + ['a longer model.max_seq_len'])}")
    return f"{len(items)} items", lambda model: hellaswag_scores(model, encode, items, truncate or None,
                                                                  progress=False)[0]


# ----------------------------------------------------------------------------- command line (eval.py bench)

# Below this a sampling temperature is refused: logits / T overflow float32 (1e-300 is 0 in float32,
# giving inf and nan), while a sample at 1e-5 is already the greedy token unless two logits lie
# within about 1e-4 of each other; 0 is greedy decoding itself.
MIN_TEMPERATURE = 1e-5


def temperature(text):
    """argparse type of --temperature (bench, eval.py sample): 0 or a finite T >= MIN_TEMPERATURE. float()
    takes 'nan' and 'inf' (nan fails in torch.multinomial) and a negative T samples the least likely tokens."""
    value = float(text)
    if not (value == 0 or MIN_TEMPERATURE <= value < math.inf):
        raise argparse.ArgumentTypeError(f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} "
                                         f"(got {text})")
    return value


temperature.__name__ = "float"  # argparse's message for a non-number: "invalid float value: 'x'"


def add_arguments(p):
    """The options of `eval.py bench` (its parser gives ckpt, --device, --seed, --json-out, --data)."""
    p.add_argument("--task", required=True, choices=["hellaswag", "gsm8k", "math500", "anchor"],
                   help="the benchmark (anchor: the anchor-function task on --data)")
    p.add_argument("--source", default="hub", help="local file in its published format (gsm8k/math500 test.jsonl, "
                   "hellaswag_val.jsonl or hellaswag_val_full.txt.bz2), or 'hub' on a connected machine")
    p.add_argument("--tokenizer-dir", help="offline tokenizer files (prepare_data.py --tokenizer-dir)")
    p.add_argument("--limit", type=at_least(1), default=None,
                   help="score only the first N items (anchor: of each split)")
    p.add_argument("--truncate", choices=["left"], default=None,
                   help="cut prompts that do not fit the model from the left (counted); default: an error")
    p.add_argument("--shots", type=at_least(0), default=None,
                   help="gsm8k: exemplars (default 8 of the published set, 5 with --fewshot-source)")
    p.add_argument("--fewshot-source", help="gsm8k: a jsonl of train records; its first --shots are the exemplars "
                   "(one that is also a scored --source item is refused)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=None,
                   help=f"gsm8k/math500: tokens per completion, at most (default: {MAX_NEW_TOKENS} where the model's "
                   "window holds them beside the prompt, else what the prompt leaves, at least half the window)")
    p.add_argument("--temperature", type=temperature, default=0.0, help=f"0 = greedy, else >= {MIN_TEMPERATURE:g}")
    p.add_argument("--top-k", type=at_least(1), default=None, help="sample from the k most likely tokens only "
                   "(default: all)")
    p.add_argument("--num-samples", type=at_least(1), default=1, help=">1: mean accuracy and majority vote")


PRINTED_ROWS = 20


def run_bench(args):
    model, info = load_model(args.ckpt, args.device)
    if args.task == "anchor":
        data = data_dir_of(args, info)
        check_data_fits(data, model, info)
        summary, rows = anchor_scores(model, data, args.limit)
    elif args.task == "hellaswag":
        items, context = read_hellaswag(args.source)
        items = items[:args.limit]
        encode = tokenizer_of(info, args.tokenizer_dir)[0]
        scores, rows = hellaswag_scores(model, encode, items, args.truncate)
        summary = {"task": "hellaswag", "convention": f"lm-eval hellaswag; context {context}; acc_norm per character, "
                   "acc_norm_tokens per token", "tasks": len(items), **scores}
    else:
        summary, rows = generation_bench(model, tokenizer_of(info, args.tokenizer_dir), args)
    # Every item's row goes to --json-out (a per-item comparison needs them all); the printed
    # table shows the first PRINTED_ROWS, not thousands.
    return {"analysis": "bench", "ckpt": args.ckpt, "summary": summary, "rows": rows, "rows_printed": PRINTED_ROWS}
