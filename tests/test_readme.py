"""The README's code runs as written: every command of its bash blocks is executed here, in a
fresh workspace, or by a named test, or (where it needs what this machine lacks) as a reduced
variant written next to it. A README command missing from COMMANDS fails the first test, so
the README cannot drift from what is tested."""
import os
import random
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import launch_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.path.join(ROOT, "..", "shared", "data")

# Fewer steps than the README: the commands and their plumbing are what is tested here.
SHORT_TINY = "--max_steps=6 --warmup_steps=2 --eval_interval=3 --ckpt_interval=3 --global_batch=8 --batch_size=8"
SHORT_SWEEP = " ".join(f"--set {s}" for s in ("max_steps=4", "warmup_steps=1", "eval_interval=2", "ckpt_interval=2"))
SHORT_ANCHOR = "--max_steps=30 --warmup_steps=5 --eval_interval=15 --ckpt_interval=15 --log_interval=10"

# README command -> (where, reduced variant or None for the command as written, why it differs).
# "run" and "side": executed in one workspace in README order, as two lanes side by side (one
# core each). A "side" command reads only what the "run" commands before the first "side" one
# wrote (the data folders), never what a later "run" command writes. "after": once both lanes
# are done (it reads both lanes' output). "kit": after that, needing the offline data kit
# (tokenizer files, benchmark files). None: another test or CI runs it.
COMMANDS = {
    "make quickstart": (None, None, "tests/test_quickstart.py runs quickstart.py --smoke (reduced size)"),
    "make test": (None, None, "CI runs it (.ci/run)"),
    "python prepare_data.py anchor --out data/anchor": ("run", None, ""),
    "python prepare_data.py text --out data/bytes --source en=my_corpus/en --tokenizer bytes": ("run", None, ""),
    "python prepare_data.py text --out data/bi --tokenizer cl100k_base --tokenizer-dir tokenizers "
    "--source en=my_corpus/en,weight=0.5 --source 'zh=my_corpus/zh/*.txt,weight=0.5'": ("kit", None, ""),
    "python prepare_data.py text --out data/fineweb --tokenizer cl100k_base --max-tokens 2B "
    "--source fw=hf:HuggingFaceFW/fineweb-edu,config=sample-10BT":
        ("kit", "python prepare_data.py text --out data/fineweb --tokenizer cl100k_base --tokenizer-dir tokenizers "
                "--max-tokens 20K --source fw=hf:hub_standin", "no network: a local folder stands in for the hub"),
    "python train.py config/tiny_bytes.py": ("run", f"python train.py config/tiny_bytes.py {SHORT_TINY}", "6 steps of 8 sequences"),
    "python train.py config/anchor_gamma1.py":
        ("run", f"python train.py config/anchor_gamma1.py {SHORT_ANCHOR}", "30 steps"),
    "torchrun --standalone --nproc_per_node=8 train.py config/gamma1_1p5b.py":
        ("side", "python train.py config/gamma1_1p5b.py --dry_run=8", "no GPUs here: built and planned for 8 ranks"),
    "torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 --rdzv_id=gamma1 "
    "train.py config/gamma1_1p5b.py":
        ("side", "python train.py config/gamma1_1p5b.py --dry_run=32", "no GPUs here: planned for 4 x 8 ranks"),
    "python train.py config/gamma1_1p5b.py --dry_run=8": ("side", None, ""),
    "python train.py export out/tiny_bytes/ckpt_00000500 tiny_bytes.pt":
        ("run", "python train.py export out/tiny_bytes/ckpt_00000006 tiny_bytes.pt", "the 6-step run's checkpoint"),
    "python sweep.py config/cpu_lm.py --arm recipe= --arm baseline=config/_baseline.py --grid lr=1e-3,3e-3,1e-2 "
    "--seeds 0,1,2 --name lr_grid --jobs 2":
        ("side", "python sweep.py config/cpu_lm.py --arm recipe= --arm baseline=config/_baseline.py --grid lr=1e-3,1e-2 "
                 f"--seeds 0 --name lr_grid --jobs 2 --eval-tokens 4096 {SHORT_SWEEP} --set data_dir=data/bytes",
         "4 steps, 2 lrs, 1 seed, on the English bytes made above (data/bi_bytes comes later)"),
    "python eval.py report results/lr_grid.json --plot-x lr --out report.md": ("side", None, ""),
    "python sweep.py config/cpu_lm.py --arm 'g05=,gamma=0.5,lr=0.01' --arm 'g1=,gamma=1.0,lr=0.003' --seeds 0,1,2 "
    "--name gamma_pair --dry-run": ("side", None, ""),
    "python bench.py":
        ("side", "python bench.py --variants reference,default,moe-grouped --batch 2 --seq-len 16 --steps 1 --repeats 2 "
                "--warmup 1", "3 variants, 32-token steps"),
    "python bench.py --suite cuda --json-out bench_cuda.json":
        (None, None, "needs a GPU: its plan is the --dry-run command below; tests/test_bench.py runs its variants shrunk"),
    "python bench.py --suite cuda --dry-run": ("side", None, ""),
    "python train.py export out/tiny_bytes/ckpt_00000500 hf/tiny_bytes --format hf":
        ("run", "python train.py export out/tiny_bytes/ckpt_00000006 hf/tiny_bytes --format hf",
         "the 6-step run's checkpoint"),
    "lm_eval --model hf --model_args pretrained=hf/tiny_bytes,trust_remote_code=True,dtype=float32 "
    "--tasks hellaswag,gsm8k_cot,minerva_math500 --device cuda --batch_size 16":
        (None, None, "its tasks read the hub and it wants a GPU; tests/test_lm_eval_parity.py runs lm-eval's "
                     "hellaswag task through its Python API on local data"),
    "python prepare_data.py text --out data/bi_bytes --tokenizer bytes --source en=my_corpus/en,weight=0.5 "
    "--source 'zh=my_corpus/zh/*.txt,weight=0.5'": ("run", None, ""),
    "python train.py config/tiny_bytes.py --data_dir=data/bi_bytes --out_dir=out/g1 --max_steps=300 "
    "--eval_interval=100 --ckpt_interval=100 --keep_last=5":
        ("run", f"python train.py config/tiny_bytes.py --data_dir=data/bi_bytes --out_dir=out/g1 {SHORT_TINY} "
                "--keep_last=5", "6 steps of 8 sequences"),
    "python train.py config/tiny_bytes.py --data_dir=data/bi_bytes --out_dir=out/g05 --max_steps=300 "
    "--eval_interval=100 --ckpt_interval=100 --keep_last=5 --gamma=0.5 --model.norm_eps=1e-5 --model.attn_gate=none":
        ("run", f"python train.py config/tiny_bytes.py --data_dir=data/bi_bytes --out_dir=out/g05 {SHORT_TINY} "
                "--keep_last=5 --gamma=0.5 --model.norm_eps=1e-5 --model.attn_gate=none", "6 steps of 8 sequences"),
    "python eval.py loss out/g1 --data data/bi_bytes --json-out results/loss_g1.json": ("run", None, ""),
    "python eval.py tokens out/g1 out/g05 --data data/bi_bytes": ("run", None, ""),
    "python eval.py sink out/g1 --data data/bi_bytes": ("run", None, ""),
    "python eval.py weights out/g1": ("run", None, ""),
    "python eval.py residual out/g1 --data data/bi_bytes": ("run", None, ""),
    "python eval.py residual --init --widths 64 128 256 512 --gamma 1 --mlp swiglu": ("side", None, ""),
    "ln -s ../shared/data/eval evals":
        ("kit", f"ln -s {os.path.join(KIT, 'eval')} evals", "the kit lies beside the repository, not this workspace"),
    "python eval.py bench out/g1 --task hellaswag --source evals/hellaswag/hellaswag_val_full.txt.bz2 --limit 200 "
    "--truncate left":
        ("kit", "python eval.py bench out/g1 --task hellaswag --source evals/hellaswag/hellaswag_val_full.txt.bz2 "
                "--limit 10 --truncate left", "10 items"),
    "python eval.py bench out/g1 --task gsm8k --source evals/gsm8k/test.jsonl --limit 20 --truncate left":
        ("kit", "python eval.py bench out/g1 --task gsm8k --source evals/gsm8k/test.jsonl --limit 2 --truncate left "
                "--max-new-tokens 16", "2 problems, 16 new tokens"),
    "python eval.py bench out/g1 --task math500 --source evals/math500/test.jsonl --limit 20 --truncate left":
        ("kit", "python eval.py bench out/g1 --task math500 --source evals/math500/test.jsonl --limit 2 --truncate left "
                "--max-new-tokens 16", "2 problems, 16 new tokens"),
    "python eval.py bench out/anchor_gamma1 --task anchor --data data/anchor": ("run", None, ""),
    "python eval.py scaling --baseline 1e6=2.10 3e6=1.90 1e7=1.75 3e7=1.66 --compare 3e6=1.80": ("side", None, ""),
    "python eval.py report results/*.json --out report.md": ("after", None, ""),
    'python eval.py sample out/g1 --prompt "ROMEO:" --temperature 0.8':
        ("run", 'python eval.py sample out/g1 --prompt "ROMEO:" --temperature 0.8 --max-new-tokens 20', "20 tokens"),
}


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
    # The study lives in results/README.md; the front page stays short enough to read (issue 24).
    text = readme()
    assert len(text) <= 20_000, f"README.md has {len(text):,} characters, over 20,000: move detail to results/README.md"


def test_every_readme_command_is_covered():
    commands = readme_commands()
    assert len(commands) == len(set(commands))
    assert {where for where, _, _ in COMMANDS.values()} <= {"run", "side", "after", "kit", None}  # a typo never runs
    assert set(commands) == set(COMMANDS), (
        f"not covered: {sorted(set(commands) - set(COMMANDS))}; gone from the README: {sorted(set(COMMANDS) - set(commands))}")


def lines_to_run(where):
    """(README command, shell line) for the commands run `where`, in README order."""
    for command in readme_commands():
        kind, reduced, _ = COMMANDS[command]
        if kind == where:
            yield command, reduced or command


def run(line, cwd):
    env = launch_env({"PYTHONUNBUFFERED": "1"})
    line = re.sub(r"^python ", f"{sys.executable} ", line)
    proc = subprocess.run(line, shell=True, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


def write_corpus(folder, alphabet, docs, seed):
    rng = random.Random(seed)
    os.makedirs(folder, exist_ok=True)
    words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(200)]
    paragraphs = [" ".join(rng.choice(words) for _ in range(rng.randint(30, 80))) for _ in range(docs)]
    with open(os.path.join(folder, "part0.txt"), "w") as f:
        f.write("\n\n".join(paragraphs))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A copy of the repo's code and configs with small generated corpora; every 'run' command
    of the README executed there in README order. Returns (folder, {command: stdout})."""
    ws = tmp_path_factory.mktemp("readme")
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), ws)
    shutil.copytree(os.path.join(ROOT, "config"), ws / "config")
    write_corpus(ws / "my_corpus" / "en", "abcdefghijklmnopqrstuvwxyz", 2000, seed=0)
    write_corpus(ws / "my_corpus" / "zh", "天地玄黄宇宙洪荒日月盈昃辰宿列张寒来暑往秋收冬藏", 2000, seed=1)
    return ws, run_lanes(ws)


def run_lanes(ws):
    """The "run" commands up to the first "side" one, then the rest of "run" and the "side"
    commands as two lanes side by side (each in README order), then the "after" commands.
    Returns {command: stdout}."""
    todo = [(command, COMMANDS[command][0], line) for kind in ("run", "side", "after")
            for command, line in lines_to_run(kind)]
    order = readme_commands()
    todo.sort(key=lambda item: order.index(item[0]))
    first_side = next(i for i, (_, kind, _) in enumerate(todo) if kind == "side")
    out = {command: run(line, ws) for command, kind, line in todo[:first_side] if kind == "run"}

    def lane(kind):
        return {command: run(line, ws) for command, k, line in todo[first_side:] if k == kind}
    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(lane, "run"), pool.submit(lane, "side")]:
            out.update(done.result())
    out.update((command, run(line, ws)) for command, kind, line in todo if kind == "after")
    return out


@pytest.mark.slow
def test_readme_commands_run(workspace):
    ws, out = workspace
    assert "world 8:" in out["python train.py config/gamma1_1p5b.py --dry_run=8"]
    assert (ws / "tiny_bytes.pt").exists() and (ws / "report.md").exists()
    assert (ws / "hf" / "tiny_bytes" / "model.safetensors").exists()
    loss = out["python eval.py loss out/g1 --data data/bi_bytes --json-out results/loss_g1.json"]
    assert re.search(r"^\s*en\s", loss, flags=re.M) and re.search(r"^\s*zh\s", loss, flags=re.M)
    assert "heldout" in out["python eval.py bench out/anchor_gamma1 --task anchor --data data/anchor"]
    assert "ROMEO:" in out['python eval.py sample out/g1 --prompt "ROMEO:" --temperature 0.8']


@pytest.mark.slow
def test_readme_commands_needing_the_offline_kit(workspace):
    if not os.path.isdir(KIT):
        pytest.skip("../shared/data (tokenizer files, HellaSwag, GSM8K) is not beside this checkout")
    ws, _ = workspace
    shutil.copytree(os.path.join(KIT, "tokenizers"), ws / "tokenizers", dirs_exist_ok=True)
    os.makedirs(ws / "hub_standin", exist_ok=True)
    shutil.copy(ws / "my_corpus" / "en" / "part0.txt", ws / "hub_standin" / "part0.txt")
    outputs = {command: run(line, ws) for command, line in lines_to_run("kit")}
    assert len(outputs) == 6
    hellaswag = outputs["python eval.py bench out/g1 --task hellaswag --source evals/hellaswag/hellaswag_val_full.txt.bz2 "
                        "--limit 200 --truncate left"]
    assert "acc_norm" in hellaswag and "truncated" in hellaswag
    for task, metric in (("gsm8k", "flexible_match"), ("math500", "exact_match")):
        out = outputs[f"python eval.py bench out/g1 --task {task} --source evals/{task}/test.jsonl --limit 20 --truncate left"]
        assert metric in out and "lm-eval" in out


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
