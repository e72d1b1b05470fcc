"""The README's code runs as written, as a newcomer runs it: every command of its bash blocks is
executed here in README order, in a copy of the repository that holds the study's files
(results/, whose JSON files are not all eval.py results), on what the README's earlier commands
wrote. A command that takes minutes runs with fewer steps or items (`fewer`: size flags only,
never one that changes whether it works); one that needs GPUs or the network runs a stand-in,
named beside it. A README command missing from COMMANDS fails the first test, so the README
cannot drift from what is tested."""
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest
import torch

import downstream as ds
import eval as ev
from conftest import launch_env, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared")  # the offline data kit is SHARED/data, beside the clone
KIT = os.path.join(SHARED, "data")

# The flags `fewer` may set: how long a command runs, never what it runs.
SIZES = ("--max_steps", "--warmup_steps", "--eval_interval", "--eval_batches", "--ckpt_interval", "--bench_interval",
         "--bench_limit", "--limit", "--seeds", "--eval-tokens", "--set max_steps", "--set warmup_steps",
         "--set eval_interval", "--set eval_batches", "--set ckpt_interval")


def fewer(command, *sizes):
    """`command` with these size flags ('--max_steps=6', '--limit 10', '--set max_steps=4') set in
    place of its own, or added where it has none; any other flag is refused."""
    for size in sizes:
        flag = re.match(r"--set \w+|--[\w-]+", size).group(0)
        assert flag in SIZES, f"{flag} is not a size flag: a reduced command may differ in sizes only"
        own = re.compile(re.escape(flag) + r"[= ]\S+")
        command = own.sub(lambda _: size, command, count=1) if own.search(command) else f"{command} {size}"
    return command


def sizes_only(command):
    """`command` without its size flags and with ckpt_NNNNNNNN (the step a run reached) as
    ckpt_*: two commands equal under it differ in how long they run, not in what they run."""
    for flag in SIZES:
        command = re.sub(re.escape(flag) + r"[= ]\S+", "", command)
    return " ".join(re.sub(r"ckpt_\d{8}", "ckpt_*", command).split())


# A training run is reduced to 1 step, evaluated (on one batch) before and after it, and saved: the evaluation,
# checkpoint and benchmark rows the later commands read, at a fifth of 6 steps' cost.
TINY_STEPS = ("--max_steps=1", "--warmup_steps=0", "--eval_interval=1", "--eval_batches=1", "--ckpt_interval=1")
TINY_CKPT = "out/tiny_bytes/ckpt_00000001"  # what the shortened tiny_bytes run wrote
ANCHOR_STEPS = ("--max_steps=30", "--warmup_steps=5", "--eval_interval=15", "--ckpt_interval=15")
SWEEP_STEPS = ("--seeds 0", "--eval-tokens 8192", "--set max_steps=2", "--set warmup_steps=1", "--set eval_interval=2",
               "--set eval_batches=1", "--set ckpt_interval=2")
TINY = "python train.py config/tiny_bytes.py"
G1 = f"{TINY} --data_dir=data/bi_bytes --out_dir=out/g1 --max_steps=300 --eval_interval=100 --ckpt_interval=100 " \
    "--keep_last=5"
G05 = (f"{TINY} --data_dir=data/bi_bytes --out_dir=out/g05 --max_steps=300 --eval_interval=100 --ckpt_interval=100 "
       "--keep_last=5 --gamma=0.5 --model.norm_eps=1e-5 --model.attn_gate=none")
LR_GRID = ("python sweep.py config/cpu_lm.py --arm recipe= --arm baseline=config/_baseline.py --grid lr=1e-3,3e-3,1e-2 "
           "--seeds 0,1,2 --name lr_grid --jobs 2 --results-dir out")
HF_ARGS = "--model hf --model_args pretrained=out/hf/tiny_bytes,trust_remote_code=True,dtype=float32"
LM_EVAL_LOCAL = f"lm_eval {HF_ARGS} --include_path out/lm_eval_tasks --tasks hellaswag_local --device cpu " \
    "--batch_size 16"
EVAL_KIT = "../shared/data/eval"
HELLASWAG_BENCH = (f"python eval.py bench out/g1 --task hellaswag --source "
                   f"{EVAL_KIT}/hellaswag/hellaswag_val_full.txt.bz2 --limit 200 --truncate left")
GSM8K_BENCH = f"python eval.py bench out/g1 --task gsm8k --source {EVAL_KIT}/gsm8k/test.jsonl --limit 20 --truncate left"
MATH_BENCH = (f"python eval.py bench out/g1 --task math500 --source {EVAL_KIT}/math500/test.jsonl --limit 20 "
              "--truncate left")
G1_BENCH = (f"{TINY} --data_dir=data/bi_bytes --out_dir=out/g1_bench --max_steps=300 --eval_interval=100 "
            f"--bench_interval=100 --bench_source={EVAL_KIT}/hellaswag/hellaswag_val_full.txt.bz2 --bench_limit=100 "
            "--bench_truncate=left")

# README command -> (where, what runs instead or None for the command as written, why).
# Where: "run" and "side" are executed in one workspace in README order, as two lanes side by
# side (one core each). A "side" command reads only what the "run" commands before the first
# "side" one wrote (the data folders), never what a later "run" command writes. "after": once
# both lanes are done (it reads both lanes' output). "kit": then, needing the offline data kit;
# "lm_eval": last, needing the kit and lm-eval. None: another test or CI runs it.
COMMANDS = {
    "make quickstart": (None, None, "tests/test_quickstart.py runs quickstart.py --smoke (reduced size)"),
    "make test": (None, None, "CI runs it (.ci/run)"),
    "python prepare_data.py anchor --out data/anchor": ("run", None, ""),
    "python prepare_data.py text --out data/bytes --source en=my_corpus/en --tokenizer bytes": ("run", None, ""),
    "python prepare_data.py text --out data/bi_bytes --tokenizer bytes --source en=my_corpus/en,weight=0.5 "
    "--source 'zh=my_corpus/zh/*.txt,weight=0.5'": ("run", None, ""),
    "python prepare_data.py text --out data/bi --tokenizer cl100k_base --tokenizer-dir ../shared/data/tokenizers "
    "--source en=my_corpus/en,weight=0.5 --source 'zh=my_corpus/zh/*.txt,weight=0.5'": ("kit", None, ""),
    "python prepare_data.py text --out data/fineweb --tokenizer cl100k_base --max-tokens 2B "
    "--source fw=hf:HuggingFaceFW/fineweb-edu,config=sample-10BT":
        ("kit", "python prepare_data.py text --out data/fineweb --tokenizer cl100k_base --tokenizer-dir "
                "../shared/data/tokenizers --max-tokens 20K --source fw=hf:hub_standin",
         "stand-in: no network, so a local folder stands in for the hub and the kit for the tokenizer download"),
    TINY: ("run", fewer(TINY, *TINY_STEPS), "500 steps take ~8 minutes"),
    "python train.py config/anchor_gamma1.py":
        ("run", fewer("python train.py config/anchor_gamma1.py", *ANCHOR_STEPS), "4,680 steps take ~4 minutes"),
    "torchrun --standalone --nproc_per_node=8 train.py config/gamma1_1p5b.py":
        ("side", "python train.py config/gamma1_1p5b.py --dry_run=8",
         "stand-in: no GPUs, built and planned for 8 ranks"),
    "torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 --rdzv_id=gamma1 "
    "train.py config/gamma1_1p5b.py":
        ("side", "python train.py config/gamma1_1p5b.py --dry_run=32", "stand-in: no GPUs, planned for 4 x 8 ranks"),
    "python train.py config/gamma1_1p5b.py --dry_run=8": ("side", None, ""),
    LR_GRID: ("side", fewer(LR_GRID, *SWEEP_STEPS), "18 runs of 320 steps take ~40 minutes"),
    "python eval.py report out/lr_grid.json --plot-x lr --out out/lr_grid.md": ("side", None, ""),
    "python sweep.py config/cpu_lm.py --arm 'g05=,gamma=0.5,lr=0.01' --arm 'g1=,gamma=1.0,lr=0.003' --seeds 0,1,2 "
    "--name gamma_pair --results-dir out --dry-run": ("side", None, ""),
    "python bench.py":
        ("side", "python bench.py --variants reference,default,moe-grouped --batch 2 --seq-len 16 --steps 1 --repeats 2 "
                 "--warmup 1", "stand-in: the suite takes ~30 minutes (compiles); 3 of its variants, 32-token steps"),
    "python bench.py --suite cuda --json-out out/bench_cuda.json":
        (None, None, "needs a GPU: its plan is the --dry-run command below; tests/test_bench.py runs its variants shrunk"),
    "python bench.py --suite cuda --dry-run": ("side", None, ""),
    G1: ("run", fewer(G1, *TINY_STEPS), "300 steps take ~5 minutes"),
    G05: ("run", fewer(G05, *TINY_STEPS), "300 steps take ~5 minutes"),
    "python eval.py loss out/g1 --data data/bi_bytes --json-out out/loss_g1.json": ("run", None, ""),
    "python eval.py tokens out/g1 out/g05 --data data/bi_bytes": ("run", None, ""),
    "python eval.py sink out/g1 --data data/bi_bytes": ("run", None, ""),
    "python eval.py weights out/g1": ("run", None, ""),
    "python eval.py residual out/g1 --data data/bi_bytes": ("run", None, ""),
    "python eval.py residual --init --widths 64 128 256 512 --gamma 1 --mlp swiglu": ("side", None, ""),
    HELLASWAG_BENCH: ("kit", fewer(HELLASWAG_BENCH, "--limit 50"), "200 items take ~13 s"),
    GSM8K_BENCH: ("kit", fewer(GSM8K_BENCH, "--limit 5"), "20 items take ~25 s: each generates up to 128 tokens"),
    MATH_BENCH: ("kit", fewer(MATH_BENCH, "--limit 5"), "20 items take ~25 s: each generates up to 128 tokens"),
    "python eval.py bench out/anchor_gamma1 --task anchor --data data/anchor": ("run", None, ""),
    G1_BENCH: ("kit", fewer(G1_BENCH, *TINY_STEPS, "--bench_interval=1", "--bench_limit=25"),
               "300 steps take ~5 minutes, each 100-item benchmark ~4 s"),
    "python eval.py scaling --baseline 1e6=2.10 3e6=1.90 1e7=1.75 3e7=1.66 --compare 3e6=1.80": ("side", None, ""),
    "python eval.py report out/*.json --out out/report.md": ("after", None, ""),
    "python eval.py report results/*.json --out out/study.md": ("side", None, ""),
    'python eval.py sample out/g1 --prompt "ROMEO:" --temperature 0.8': ("run", None, ""),
    "python train.py export out/tiny_bytes/ckpt_00000500 out/tiny_bytes.pt":
        ("run", f"python train.py export {TINY_CKPT} out/tiny_bytes.pt", "the 1-step run's checkpoint"),
    "python train.py export out/tiny_bytes/ckpt_00000500 out/hf/tiny_bytes --format hf":
        ("run", f"python train.py export {TINY_CKPT} out/hf/tiny_bytes --format hf", "the 1-step run's checkpoint"),
    f"lm_eval {HF_ARGS} --tasks hellaswag,gsm8k_cot,minerva_math500 --device cuda --batch_size 16":
        (None, None, "its tasks read the hub and it wants a GPU; the offline route below runs lm-eval here"),
    f"python eval.py lm-eval-task --task hellaswag --source {EVAL_KIT}/hellaswag/hellaswag_val_full.txt.bz2 "
    "--out-dir out/lm_eval_tasks": ("lm_eval", None, ""),
    LM_EVAL_LOCAL: ("lm_eval", fewer(LM_EVAL_LOCAL, "--limit 10"), "10,042 items take ~30 minutes on CPU"),
}
KINDS = {"run", "side", "after", "kit", "lm_eval", None}


def readme():
    return open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def readme_section(title):
    text = readme()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def readme_commands():
    """Each command line of the README's bash blocks: continuations joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(re.sub(r"\s+#\s.*$", "", line).split())
            if line:
                commands.append(line)
    return commands


def test_readme_is_a_front_page():
    # How to run things comes first, the study lives in results/README.md (issue 24, 39).
    text = readme()
    assert len(text) <= 20_000, f"README.md has {len(text):,} characters, over 20,000: move detail to results/README.md"
    titles = re.findall(r"(?m)^## (.*)$", text)
    assert titles[0] == "Quick start" and titles.index("Verdicts") > titles.index("Using init.py in another codebase")
    assert "| claim | verdict" not in text, "the verdict table lives in results/README.md"


def test_every_readme_command_is_covered():
    commands = readme_commands()
    assert len(commands) == len(set(commands))
    assert {where for where, _, _ in COMMANDS.values()} <= KINDS  # a typo never runs
    assert set(commands) == set(COMMANDS), (
        f"not covered: {sorted(set(commands) - set(COMMANDS))}; gone from the README: {sorted(set(COMMANDS) - set(commands))}")
    # Every variant says why, and differs from the README in sizes only, or is a named stand-in
    # for what this machine lacks (GPUs, the network, half an hour).
    for command, (_, instead, why) in COMMANDS.items():
        assert instead is None or why, command
        assert instead is None or why.startswith("stand-in") or sizes_only(instead) == sizes_only(command), command


def test_readme_outputs_stay_out_of_the_tracked_tree():
    # User outputs go to out/ (git-ignored): never into results/ (the study's) or the repo root.
    ignored = open(os.path.join(ROOT, ".gitignore")).read().split()
    assert "out/" in ignored and "data/" in ignored
    for command in readme_commands():
        for flag, path in re.findall(r"(--json-out|--out|--out-dir|--results-dir)[ =](\S+)", command):
            assert path.split("/")[0] in ("out", "data"), f"{command}: {flag} {path}"
        if " export " in command:
            assert command.split()[-1 if "--format" not in command else -3].startswith("out/"), command


def lines_to_run(where):
    """(README command, shell line) for the commands run `where`, in README order."""
    for command in readme_commands():
        kind, instead, _ = COMMANDS[command]
        if kind == where:
            yield command, instead or command


def run(line, cwd):
    """stdout and stderr of one shell line, which must succeed."""
    env = launch_env({"PYTHONUNBUFFERED": "1"})
    line = re.sub(r"^python ", f"{sys.executable} ", line)
    proc = subprocess.run(line, shell=True, cwd=cwd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout + proc.stderr


def write_corpus(folder, alphabet, docs, seed):
    rng = random.Random(seed)
    os.makedirs(folder, exist_ok=True)
    words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(200)]
    paragraphs = [" ".join(rng.choice(words) for _ in range(rng.randint(30, 80))) for _ in range(docs)]
    with open(os.path.join(folder, "part0.txt"), "w") as f:
        f.write("\n\n".join(paragraphs))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A clone's files (code, configs, the study's results/) with small generated corpora, the
    offline kit beside it as it lies beside this checkout, and every 'run', 'side' and 'after'
    command of the README executed there. Returns (folder, {command: output})."""
    base = tmp_path_factory.mktemp("readme")
    ws = base / "smallinit"
    ws.mkdir()
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), ws)
    for folder in ("config", "results"):
        shutil.copytree(os.path.join(ROOT, folder), ws / folder, ignore=shutil.ignore_patterns("__pycache__"))
    if os.path.isdir(SHARED):
        os.symlink(os.path.realpath(SHARED), base / "shared")
    write_corpus(ws / "my_corpus" / "en", "abcdefghijklmnopqrstuvwxyz", 2000, seed=0)
    write_corpus(ws / "my_corpus" / "zh", "天地玄黄宇宙洪荒日月盈昃辰宿列张寒来暑往秋收冬藏", 2000, seed=1)
    return ws, run_lanes(ws)


def run_lanes(ws):
    """The "run" commands up to the first "side" one, then the rest of "run" and the "side"
    commands as two lanes side by side (each in README order), then the "after" commands.
    Returns {command: output}."""
    order = readme_commands()
    todo = sorted(((command, COMMANDS[command][0], line) for kind in ("run", "side", "after")
                   for command, line in lines_to_run(kind)), key=lambda item: order.index(item[0]))
    first_side = next(i for i, (_, kind, _) in enumerate(todo) if kind == "side")
    said = {}

    def once(line):  # a stand-in may be another README command's own line (the torchrun dry runs): run it once
        if line not in said:
            said[line] = run(line, ws)
        return said[line]
    out = {command: once(line) for command, kind, line in todo[:first_side] if kind == "run"}

    def lane(kind):
        return {command: once(line) for command, k, line in todo[first_side:] if k == kind}
    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(lane, "run"), pool.submit(lane, "side")]:
            out.update(done.result())
    out.update((command, once(line)) for command, kind, line in todo if kind == "after")
    return out


def study_files_in(report_md, output):
    """{results/*.json name: 'reported' | 'skipped'} as `eval.py report results/*.json` left them."""
    seen = {}
    for path in glob.glob(os.path.join(ROOT, "results", "*.json")):
        name = os.path.basename(path)
        reported, skipped = f"({name};" in report_md or f"| {name} |" in report_md, f"skipped results/{name}:" in output
        assert reported != skipped, f"{name}: reported {reported}, skipped {skipped}"
        seen[name] = "reported" if reported else "skipped"
    return seen


@pytest.mark.slow
def test_readme_commands_run(workspace):
    ws, out = workspace
    assert "world 8:" in out["python train.py config/gamma1_1p5b.py --dry_run=8"]
    assert (ws / "out" / "tiny_bytes.pt").exists() and (ws / "out" / "hf" / "tiny_bytes" / "model.safetensors").exists()
    loss = out["python eval.py loss out/g1 --data data/bi_bytes --json-out out/loss_g1.json"]
    assert re.search(r"^\s*en\s", loss, flags=re.M) and re.search(r"^\s*zh\s", loss, flags=re.M)
    assert "heldout" in out["python eval.py bench out/anchor_gamma1 --task anchor --data data/anchor"]
    assert "ROMEO:" in out['python eval.py sample out/g1 --prompt "ROMEO:" --temperature 0.8']
    # The user's results in one report: the loss JSON and the sweep, from out/ only.
    report = (ws / "out" / "report.md").read_text()
    assert "loss_g1.json" in report and "### sweep lr_grid (lr_grid.json" in report
    assert (ws / "out" / "lr_grid.png").exists()
    # The study's files as a clone has them: every result reported, every other JSON file named.
    said = out["python eval.py report results/*.json --out out/study.md"]
    seen = study_files_in((ws / "out" / "study.md").read_text(), said)
    assert "skipped" in seen.values() and "reported" in seen.values()
    # Nothing written outside out/ and data/ (and the corpora the test made).
    tracked = {"config", "results", "my_corpus"} | {n for n in os.listdir(ROOT) if n.endswith(".py")}
    assert set(os.listdir(ws)) - tracked - {"__pycache__"} == {"out", "data"}
    assert sorted(os.listdir(ws / "results")) == sorted(n for n in os.listdir(os.path.join(ROOT, "results"))
                                                        if n != "__pycache__")


def kit_lines(where, ws):
    if not os.path.isdir(KIT):
        pytest.skip("../shared/data (tokenizer files, HellaSwag, GSM8K, MATH-500) is not beside this checkout")
    return {command: run(line, ws) for command, line in lines_to_run(where)}


@pytest.mark.slow
def test_readme_commands_needing_the_offline_kit(workspace):
    ws, _ = workspace
    os.makedirs(ws / "hub_standin", exist_ok=True)
    shutil.copy(ws / "my_corpus" / "en" / "part0.txt", ws / "hub_standin" / "part0.txt")
    outputs = kit_lines("kit", ws)
    assert len(outputs) == 6
    # the benchmark during training: steps 0 and 1, each a row beside the validation loss
    assert outputs[G1_BENCH].count("bench hellaswag: acc ") == 2
    with open(ws / "out" / "g1_bench" / "metrics.jsonl") as f:
        rows = [row for row in map(json.loads, f) if "bench_hellaswag_acc" in row]
    assert [row["step"] for row in rows] == [0, 1] and all(0 <= row["bench_hellaswag_acc"] <= 1 for row in rows)
    hellaswag = outputs[HELLASWAG_BENCH]
    assert "acc_norm" in hellaswag and "truncated" in hellaswag
    for task, metric in (("gsm8k", "flexible_match"), ("math500", "exact_match")):
        out = outputs[GSM8K_BENCH if task == "gsm8k" else MATH_BENCH]
        # The README's model has 256 positions: half of them go to the completion, the prompt is cut.
        assert metric in out and "lm-eval" in out and re.search(r"max_new_tokens\s.*\n.*\b128\b", out), out[-1500:]


@pytest.mark.slow
def test_readme_offline_lm_eval_route(workspace):
    pytest.importorskip("lm_eval", reason="lm-eval is optional (make test installs it)")
    ws, _ = workspace
    outputs = kit_lines("lm_eval", ws)
    assert (ws / "out" / "lm_eval_tasks" / "hellaswag_local.yaml").exists()
    assert re.search(r"hellaswag_local\s*\|.*\|\s*acc\s", outputs[LM_EVAL_LOCAL]), outputs[LM_EVAL_LOCAL][-2000:]


# ----------------------------------------------------------------------------- the fixes behind the path

def export(model, path):
    """A byte model in `train.py export`'s consolidated layout."""
    torch.save({"model": model.state_dict(), "model_config": asdict(model.cfg), "step": 0, "config": {},
                "data_meta": {"tokenizer": "bytes", "vocab_size": 257, "eot_id": 256}}, path)
    return str(path)


@pytest.mark.parametrize("window,shots,want", [
    (256, None, 128),   # the README's tiny_bytes model: the 8-shot prompt (~3,000 bytes) cut, half the window new
    (256, 0, 256 - len(b"Q: What is 2+2?\nA:")),  # a short prompt leaves more than half: all that is left
    (2048, 0, 256),     # a long window: lm-eval's 256
])
def test_bench_generation_budget_fits_the_window(tmp_path, monkeypatch, window, shots, want):
    # A fixed default of 256 new tokens left a 256-position model no room for a prompt: exit 2.
    (tmp_path / "gsm.jsonl").write_text(json.dumps({"question": "What is 2+2?", "answer": "#### 4"}) + "\n")
    ckpt = export(tiny_model(max_seq_len=window), tmp_path / "m.pt")
    calls, generate = [], ds.generate
    monkeypatch.setattr(ds, "generate", lambda model, prompt, n, *args: calls.append((len(prompt), n))
                        or generate(model, prompt, n, *args))
    argv = ["bench", ckpt, "--task", "gsm8k", "--source", str(tmp_path / "gsm.jsonl"), "--truncate", "left"]
    summary = ev.main(argv + ([] if shots is None else ["--shots", str(shots)]))["summary"]
    assert summary["max_new_tokens"] == want and summary["truncated"] == (shots is None)
    ((prompt, new),) = calls
    assert new == want and prompt == (window - want if shots is None else len(b"Q: What is 2+2?\nA:"))


def test_report_skips_what_is_not_a_result_and_names_it(tmp_path, capsys):
    loss = {"analysis": "loss", "ckpt": "out/g1", "summary": {"loss": 2.5, "ppl": 12.18}, "rows": []}
    files = {"loss_g1.json": json.dumps(loss), "bench_cpu.json": json.dumps({"suite": "cpu", "rows": []}),
             "eps_regime_r.json": json.dumps({"analysis": "eps_regime_r", "points": []}),
             "broken.json": '{"analysis": "loss", "summ', "list.json": "[1, 2]"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    paths = [str(tmp_path / n) for n in sorted(files)]
    ev.main(["report", *paths, "--out", str(tmp_path / "report.md")])
    err = capsys.readouterr().err.splitlines()
    skipped = sorted(f"skipped {tmp_path / n}" for n in files if n != "loss_g1.json")
    assert sorted(line.split(":")[0] for line in err) == skipped
    report = (tmp_path / "report.md").read_text()
    assert "| loss_g1.json | 2.5" in report and "bench_cpu" not in report
    # Nothing to report: one line, and no report written.
    with pytest.raises(SystemExit) as exit_info:
        ev.main(["report", str(tmp_path / "bench_cpu.json"), "--out", str(tmp_path / "none.md")])
    assert exit_info.value.code == 2 and "none of the 1 file(s)" in capsys.readouterr().err
    assert not (tmp_path / "none.md").exists()


def test_report_of_the_study_names_every_file_it_does_not_report(tmp_path, capsys):
    # What `eval.py report results/*.json` meets in a clone: sweeps and other JSON files.
    paths = sorted(glob.glob(os.path.join(ROOT, "results", "*.json")))
    ev.main(["report", *paths, "--out", str(tmp_path / "study.md")])
    err = capsys.readouterr().err.replace(os.path.join(ROOT, ""), "")
    seen = study_files_in((tmp_path / "study.md").read_text(), err)
    for path in paths:
        result = json.load(open(path))
        is_result = isinstance(result, dict) and "analysis" in result and "summary" in result
        assert seen[os.path.basename(path)] == ("reported" if is_result else "skipped"), path


def test_init_example_runs_with_init_py_alone(tmp_path):
    # The section's Hugging Face recipe needs transformers: tests/test_init_hf.py runs that one.
    blocks = re.findall(r"```python\n(.*?)```", readme_section("Using init.py in another codebase"), flags=re.S)
    (example,) = [b for b in blocks if "transformers" not in b]
    shutil.copy(os.path.join(ROOT, "init.py"), tmp_path)
    (tmp_path / "example.py").write_text(example)
    out = subprocess.run([sys.executable, "-E", "-s", "example.py"], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    # Conv1D declared with d_in on dim 0 (256); the Linear overridden to γ=0.5 (d_in 768).
    assert "256" in rows["1.weight"] and "3.906e-03" in rows["1.weight"]
    assert "768" in rows["3.weight"] and f"{768 ** -0.5:.3e}" in rows["3.weight"]
    assert "zeros" in rows["1.bias"] and "ones" in rows["2.weight"]
