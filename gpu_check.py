"""
The first contact with a GPU in one command: every CUDA path of the repo on one H100/H200 in about
6 minutes, one summary table, and results/gpu_check.json.

    make gpu-check                 # = python gpu_check.py
    python gpu_check.py --dry-run  # the plan; every command's arguments checked here, on CPU

Steps, each a subprocess with its own time limit (a failed one is reported, the next still runs),
correctness first and speed last, so that a lease cut short still brings back the checks:
  tests    tests/test_cuda.py: compiled Flex vs SDPA forward and backward, the varlen backend vs
           SDPA and Flex (bf16) and compiled, bf16 grouped experts
  data     byte-level shards made from this repository's own text (no download)
  train    torchrun --nproc_per_node=1 train.py config/gamma1_0p1b.py, 50 steps, flex + bf16 +
           compile, a checkpoint at the end; its peak memory against train.py's own estimate
  export   that checkpoint as a HF folder, loaded back by transformers on the GPU and compared
           with model.py's logits
  bench    bench.py --suite cuda, shortened: the default model vs the plain GPT at 0.1B and 1.5B
           (bf16, compiled as train.py compiles: blocks, final norm and loss chunks; flex), tokens/s
           and MFU; at 0.1B also without the gate, with the other forms of model.py (RoPE halves,
           fused GEMMs, eager full logits against the chunked loss), as train.py's own FSDP2 step
           (fp32 weights) and, uncompiled, with the varlen attention backend in place of flex
--budget S caps the whole check (a step's limit shrinks to the time left); the summary JSON is
rewritten after every step. Without CUDA (and without --dry-run) it exits 1 with one line.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
# The headline pair at both sizes; at 0.1B what the gate and each form of model.py cost or save
# against another (fused GEMMs: taken if a GPU says so), train.py's own step (FSDP2, fp32 weights)
# against the bench's bf16 one, and the varlen kernel against flex (rope-halves and
# uncompiled-varlen are eager: compare them with uncompiled).
BENCH = ["bench.py", "--suite", "cuda", "--variants", "0.1b/reference,0.1b/default,0.1b/gate-none,0.1b/fused-gemms,"
         "0.1b/full-loss,0.1b/train-step,0.1b/uncompiled,0.1b/rope-halves,0.1b/uncompiled-varlen,1.5b/reference,"
         "1.5b/default",
         "--steps", "5", "--repeats", "2", "--warmup", "2"]
# The 0.1B recipe at a token budget one GPU does in a minute: 50 steps of 16 x 1024 byte tokens.
TRAIN = ["train.py", "config/gamma1_0p1b.py", "--attn_backend=flex", "--compile=True", "--max_steps=50",
         "--warmup_steps=10", "--global_batch=16", "--batch_size=16", "--seq_len=1024", "--model.eot_id=256",
         "--log_interval=10", "--eval_interval=50", "--eval_batches=2", "--ckpt_interval=50", "--keep_steps=[]"]


def commands(work):
    """(name, argv, time limit in s) of every step, in order."""
    data, run = os.path.join(work, "data"), os.path.join(work, "run")
    return [
        ("tests", [PY, "-m", "pytest", "-q", "tests/test_cuda.py"], 180),
        ("data", [PY, "prepare_data.py", "text", "--out", data, "--tokenizer", "bytes", "--force",
                  "--val-fraction", "0.05", "--source", f"repo={write_corpus(work)}"], 60),
        ("train", [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *TRAIN,
                   f"--data_dir={data}", f"--out_dir={run}", "--resume=False"], 300),
        ("export", [PY, "train.py", "export", os.path.join(run, "ckpt_00000050"), os.path.join(work, "hf"),
                    "--format", "hf"], 120),
        ("bench", [PY, *BENCH, "--json-out", os.path.join(work, "bench.json")], 420),
    ]


def write_corpus(work):
    """This repository's Python and Markdown files as one text file: real text, no download."""
    path = os.path.join(work, "corpus.txt")
    with open(path, "w") as out:
        for name in sorted(os.listdir(HERE)):
            if name.endswith((".py", ".md")):
                out.write(open(os.path.join(HERE, name), encoding="utf-8").read() + "\n\n")
    return path


def run_step(name, argv, limit, work):
    """One step as a subprocess in its own session: on its time limit the whole group goes (torchrun's
    workers too, which would otherwise hold the GPU for the steps after). Its output: work/<name>.log."""
    t0 = time.time()
    p = subprocess.Popen(argv, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, ok = p.communicate(timeout=limit)[0], p.returncode == 0
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, ok = p.communicate()[0] + f"\ntimed out after {limit:.0f} s", False
    with open(os.path.join(work, f"{name}.log"), "w") as f:
        f.write(out)
    return {"step": name, "ok": ok, "seconds": round(time.time() - t0, 1), "command": " ".join(argv),
            "tail": [line[:300] for line in out.strip().splitlines()[-12:]]}


def bench_numbers(path):
    rows = json.load(open(path))["rows"]
    return {r["variant"]: {"tokens_per_s": round(r["tokens_per_s"]), "mfu": round(r["mfu"], 3)} for r in rows}


def compare_export(work):
    """Max |logits| difference between transformers' load of the export and model.py, fp32 on the GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from checkpoint import load_model
    net, _ = load_model(os.path.join(work, "run", "ckpt_00000050"), device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(work, "hf"), trust_remote_code=True).cuda().eval()
    idx = torch.randint(0, 256, (2, 256), device="cuda")
    with torch.no_grad():
        ours, _ = net.float()(idx)
        theirs = hf.float()(idx).logits
    return {"max_abs_logit_diff": (ours.float() - theirs.float()).abs().max().item()}


def memory(work):
    """train.py's measured peak (metrics.jsonl) against its plan's estimate for the same settings."""
    import contextlib
    import io

    import train
    cfg = train.load_config([*TRAIN[1:], f"--data_dir={work}/data"])
    with contextlib.redirect_stdout(io.StringIO()):
        estimate = train.print_plan(cfg, 1)["memory_bytes"] / 2**30
    rows = [json.loads(line) for line in open(os.path.join(work, "run", "metrics.jsonl"))]
    peak = max(r["mem_gib"] for r in rows if "mem_gib" in r)
    return {"peak_gib": round(peak, 2), "estimate_gib": round(estimate, 2), "ratio": round(peak / estimate, 3)}


def dry_run(work):
    """Every step's command, its arguments checked on CPU: pytest collects, bench and train plan,
    the data is really made (seconds); the export and comparisons need the trained checkpoint."""
    checks = {"tests": [PY, "-m", "pytest", "-q", "--collect-only", "tests/test_cuda.py"],
              "bench": [PY, *BENCH, "--dry-run"],
              "train": [PY, *TRAIN, f"--data_dir={work}/data", f"--out_dir={work}/run", "--dry_run=1"]}
    failed = 0
    for name, argv, limit in commands(work):
        print(f"{name:<7} {' '.join(argv)}  (limit {limit} s)")
        check = checks.get(name, argv if name == "data" else None)
        if check:
            p = subprocess.run(check, cwd=HERE, capture_output=True, text=True, timeout=300)
            failed += p.returncode != 0
            print(f"        check: {'ok' if p.returncode == 0 else 'FAILED: ' + (p.stderr or p.stdout).strip()[-300:]}")
    print("then: the export loaded by transformers vs model.py; peak memory vs train.py's estimate")
    return 1 if failed else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--dry-run", action="store_true", help="print the plan and check each command's arguments on CPU")
    p.add_argument("--work", default="out/gpu_check", help="folder for the data, the run and the export")
    p.add_argument("--json-out", default="results/gpu_check.json", help="where the summary is written")
    p.add_argument("--only", help="comma-separated steps to run (default: all, in order)")
    p.add_argument("--budget", type=float, default=900,
                   help="seconds for the whole check; a step's limit shrinks to what is left")
    args = p.parse_args(argv)
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    if args.dry_run:
        return dry_run(work)
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): run it on a GPU machine, "
              "or pass --dry-run for the plan", file=sys.stderr)
        return 1
    from fileio import write_json
    extras = {"bench": lambda: bench_numbers(os.path.join(work, "bench.json")), "export": lambda: compare_export(work),
              "train": lambda: memory(work)}
    deadline, rows = time.time() + args.budget, []
    for name, argv, limit in commands(work):
        if args.only and name not in args.only.split(","):
            continue
        left = deadline - time.time()
        if left < 20:
            rows.append({"step": name, "ok": False, "seconds": 0, "command": " ".join(argv),
                         "tail": [f"not run: {args.budget} s budget spent"]})
        else:
            rows.append(run_step(name, argv, min(limit, left), work))
        row = rows[-1]
        if row["ok"] and name in extras:
            try:
                row["numbers"] = extras[name]()
            except Exception as e:  # noqa: BLE001 (a summary row, not a crash: the other numbers still count)
                row.update(ok=False, numbers={"error": f"{type(e).__name__}: {e}"})
        elif name == "tests" and "passed" in " ".join(row["tail"]):
            row["numbers"] = {"summary": row["tail"][-1]}
        print(f"{name}: {'ok' if row['ok'] else 'FAILED'} in {row['seconds']} s", flush=True)
        # Rewritten after each step: a check killed from outside still leaves what it measured.
        write_json(args.json_out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                   "when": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": rows})
    print(f"\n{'step':<8}{'ok':<5}{'s':>7}  numbers")
    for r in rows:
        numbers = json.dumps(r.get("numbers", ""))[:200]
        print(f"{r['step']:<8}{'yes' if r['ok'] else 'NO':<5}{r['seconds']:>7}  {numbers}")
    print(f"wrote {args.json_out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
