"""
Every GPU number in one command of under 9 minutes, on one H100/H200 as a lent machine has it: no
package index (nothing is installed), no `datasets`, no network; only what lands under --out is
kept. Each step is a subprocess with its own time limit, its log and numbers written under --out
as it ends (a later hang keeps them), in the order of what the numbers are worth:

  pair      bench: the default model vs the plain GPT at 0.1B and 1.5B (bf16, compiled, flex)
  data      byte-level shards of this repository's own text (prepare_data, no datasets)
  train     torchrun train.py config/gamma1_1p5b.py on one GPU, 10 steps: tokens/s, MFU, peak
            memory against train.py's estimate (its checkpoint is deleted, not brought back)
  compiled  bench at 0.1B: what the gate, fused GEMMs and the unchunked loss cost (compiled)
  fsdp      bench at 0.1B: train.py's own FSDP2 step (fp32 weights) against the bench's
  eager     bench at 0.1B, uncompiled: RoPE by halves, the varlen kernel in place of flex
  tests     tests/test_cuda.py

    python3 gpu_check.py --out "$OUT"        # on the GPU machine (the device tool's $OUT)
    python3 gpu_check.py --dry-run --out D   # anywhere: the plan, each step's expected time, every
                                             # command checked on CPU (pytest collects, bench and
                                             # train.py plan, the data is really made)

--out gets gpu_check.json (rewritten after every step: device, torch, the API checks, each step's
command, time, numbers and log tail), one log per step, bench_<step>.json, and scratch/ (the data and
the 1.5B run's metrics). MFU is against the datasheet peak, the measured matmul rate beside it (mfu.py).
"""

import argparse
import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
BUDGET_S = 540  # the lent machine allows 10 minutes a command: this leaves one for its start and the copy back

# The torch APIs the GPU steps call that a CPU run does not reach, checked by name first: a torch
# older than the repo's pin (the lent image has 2.11) then shows as one line, not a failed step.
APIS = {
    "torch.nn.attention.flex_attention.flex_attention": "attn_backend flex (train, bench, tests)",
    "torch.nn.attention.flex_attention.create_block_mask": "flex's document masks",
    "torch.nn.attention.varlen.varlen_attn": "attn_backend varlen (eager step, tests)",
    "torch.nonzero_static": "varlen's sequence boundaries",
    "torch._grouped_mm": "MoE grouped experts (tests)",
    "torch.distributed.fsdp.fully_shard": "train.py and the fsdp step",
    "torch.distributed.fsdp.MixedPrecisionPolicy": "train.py's bf16 compute on fp32 weights",
    "torch.compile": "every compiled step",
}

# bench's shortened CUDA runs, one process each; the first variant of each is its group's yardstick.
SHORT = ["--steps", "5", "--repeats", "2", "--warmup", "2"]
BENCHES = {
    "pair": "0.1b/reference,0.1b/default,1.5b/reference,1.5b/default",
    "compiled": "0.1b/default,0.1b/gate-none,0.1b/fused-gemms,0.1b/full-loss",
    "fsdp": "0.1b/default,0.1b/train-step",
    "eager": "0.1b/uncompiled,0.1b/rope-halves,0.1b/uncompiled-varlen",
}
# config/gamma1_1p5b.py on byte tokens (its vocab and sizes kept), its per-GPU batch, one micro-batch a
# step; steps 1-2 compile, 3-10 are timed.
TRAIN = ["train.py", "config/gamma1_1p5b.py", "--model.eot_id=256", "--global_batch=8", "--max_steps=10",
         "--warmup_steps=2", "--log_interval=1", "--eval_interval=10", "--eval_batches=1", "--ckpt_interval=10",
         "--keep_steps=[]"]
TESTS_S = 100  # tests/test_cuda.py took 88-95 s on an H200 (results/gpu/)
STARTUP_S = 10  # a step's process: imports, CUDA's start, bench's matmul rate


def steps(out):
    """(name, argv, time limit in s) of every step, in order."""
    scratch = os.path.join(out, "scratch")
    data, run = os.path.join(scratch, "data"), os.path.join(scratch, "run")
    bench = {name: [PY, "bench.py", "--suite", "cuda", "--variants", variants, *SHORT,
                    "--json-out", os.path.join(out, f"bench_{name}.json")] for name, variants in BENCHES.items()}
    return [
        ("pair", bench["pair"], 180),
        ("data", [PY, "prepare_data.py", "text", "--out", data, "--tokenizer", "bytes", "--force",
                  "--val-fraction", "0.05", "--source", f"repo={os.path.join(scratch, 'corpus.txt')}"], 60),
        ("train", [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *TRAIN,
                   f"--data_dir={data}", f"--out_dir={run}", "--resume=False"], 180),
        ("compiled", bench["compiled"], 150),
        ("fsdp", bench["fsdp"], 120),
        ("eager", bench["eager"], 90),
        ("tests", [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"], 150),
    ]


def write_corpus(scratch):
    """This repository's Python and Markdown files as one text file: real text, no download."""
    os.makedirs(scratch, exist_ok=True)
    with open(os.path.join(scratch, "corpus.txt"), "w") as out:
        for name in sorted(os.listdir(HERE)):
            if name.endswith((".py", ".md")):
                out.write(open(os.path.join(HERE, name), encoding="utf-8").read() + "\n\n")


def api_checks():
    """{api: 'ok' or 'missing (what needs it)'} for this torch."""
    found = {}
    for api, user in APIS.items():
        module, _, name = api.rpartition(".")
        try:
            ok = hasattr(importlib.import_module(module), name)
        except ImportError:
            ok = False
        found[api] = "ok" if ok else f"missing ({user})"
    return found


def expected_seconds(out):
    """{step: seconds expected on an H100/H200}: bench's own plan for the bench steps (its nominal peak
    and assumed MFU), train.py's FLOPs at 40% of the datasheet peak plus a compile and the init for
    train, the measured time for the tests."""
    import bench
    suite = bench.SUITES["cuda"]
    expected = {name: round(bench.plan(bench.select(suite.variants(), variants), suite, 5, 2, 2,
                                       suite.nominal_peak)[1]) for name, variants in BENCHES.items()}
    cfg, plan = train_plan(out)
    flops = plan["flops_per_token"] * plan["tokens_per_step"] * cfg["max_steps"]
    init = plan["params"]["total"] * bench.INIT_S_PER_PARAM
    expected["train"] = round(flops / (0.4 * suite.nominal_peak) + suite.compile_s + init + 20)
    expected.update(data=10, tests=TESTS_S)
    return {name: seconds + STARTUP_S for name, seconds in expected.items()}


def train_plan(out):
    """The train step's settings and train.py's plan for them (FLOPs, memory per GPU), printed nowhere."""
    import train
    from plan import print_plan
    cfg = train.load_config([*TRAIN[1:], f"--data_dir={out}/scratch/data"])
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        return cfg, print_plan(cfg, 1)


def run_step(name, argv, limit, out):
    """One step in its own session: on its time limit the whole group goes (torchrun's workers too,
    which would otherwise hold the GPU for the steps after). Its output goes to out/<name>.log as it
    comes, so a step killed from outside still leaves its log."""
    t0 = time.time()
    log = os.path.join(out, f"{name}.log")
    with open(log, "w") as f:
        p = subprocess.Popen(argv, cwd=HERE, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            ok = p.wait(timeout=limit) == 0
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            f.write(f"\ntimed out after {limit:.0f} s\n")
            ok = False
    tail = open(log, errors="replace").read().strip().splitlines()[-12:]
    return {"step": name, "ok": ok, "seconds": round(time.time() - t0, 1), "command": " ".join(argv),
            "tail": [line[:300] for line in tail]}


def bench_numbers(path):
    """Each variant's tokens/s, MFU, share of the matmul rate and ratio, or its error: rows are kept as
    bench finishes each group, so a failed or cut run still gives the ones it measured."""
    if not os.path.exists(path):
        return {}
    rows = json.load(open(path))["rows"]
    return {r["variant"]: {"error": r["error"]} if "error" in r else
            {"tokens_per_s": round(r["tokens_per_s"]), "mfu": r["mfu"] and round(r["mfu"], 3),
             "of_matmul_rate": round(r["of_matmul_rate"], 3), "ratio": round(r["ratio"], 3),
             "paired_ratio": round(r["paired_ratio"], 3), "ratio_to": r["ratio_to"]} for r in rows}


def train_numbers(out):
    """The 1.5B run's steady steps (3 on: 1-2 compile) and its peak memory against train.py's estimate;
    its checkpoint (~18 GB of fp32 weights and AdamW state) is deleted, not brought back."""
    import statistics

    run = os.path.join(out, "scratch", "run")
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if '"tokens_per_s"' in line]
    for name in os.listdir(run):
        if name.startswith("ckpt_"):
            shutil.rmtree(os.path.join(run, name))
    estimate = train_plan(out)[1]["memory_bytes"] / 2**30
    steady = [r for r in rows if r["step"] >= 3]
    peak = max(r["mem_gib"] for r in rows)
    return {"tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steady)),
            "mfu": round(statistics.median(r["mfu"] for r in steady), 3), "peak_gib": round(peak, 2),
            "estimate_gib": round(estimate, 2), "peak_over_estimate": round(peak / estimate, 3)}


def dry_run(out):
    """The plan with each step's expected time; every command checked on CPU: pytest collects, bench
    and train.py plan, the data is really made (seconds). 0 when every check passed and it fits."""
    write_corpus(os.path.join(out, "scratch"))
    expected = expected_seconds(out)
    checks = {"pair": "--dry-run", "compiled": "--dry-run", "fsdp": "--dry-run", "eager": "--dry-run"}
    failed, apis = 0, api_checks()
    for name, api in apis.items():
        failed += api != "ok"
        print(f"api     {name}: {api}")
    for name, argv, limit in steps(out):
        print(f"{name:<8} ~{expected[name]:>3} s (limit {limit} s)  {' '.join(argv)}")
        check = ([*argv[:-2], checks[name]] if name in checks else
                 [*argv[:3], "--collect-only", *argv[3:]] if name == "tests" else
                 [PY, *TRAIN, *argv[-3:-1], "--dry_run=1"] if name == "train" else argv)
        p = subprocess.run(check, cwd=HERE, capture_output=True, text=True, timeout=300)
        failed += p.returncode != 0
        print(f"         check: {'ok' if p.returncode == 0 else 'FAILED: ' + (p.stderr or p.stdout).strip()[-300:]}")
    total = sum(expected.values())
    print(f"expected {total} s in all, budget {BUDGET_S} s{'' if total <= BUDGET_S else ': OVER'}")
    write_summary(out, {"dry_run": True, "expected_s": expected, "apis": apis, "steps": []})
    return 1 if failed or total > BUDGET_S else 0


def write_summary(out, summary):
    from fileio import write_json
    write_json(os.path.join(out, "gpu_check.json"), summary)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--out", default=os.environ.get("OUT") or "out/gpu_check",
                   help="folder for everything it writes (default: $OUT, else out/gpu_check)")
    p.add_argument("--dry-run", action="store_true", help="the plan and each command checked, on any machine")
    p.add_argument("--only", help="comma-separated steps to run (default: all, in order)")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help="seconds for the whole check; a step's limit shrinks to what is left")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    if args.dry_run:
        return dry_run(out)
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): run it on a GPU machine, "
              "or pass --dry-run for the plan", file=sys.stderr)
        return 1
    write_corpus(os.path.join(out, "scratch"))
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "when": time.strftime("%Y-%m-%d %H:%M:%S"), "apis": api_checks(), "steps": []}
    numbers = {"train": lambda: train_numbers(out),
               **{name: (lambda name=name: bench_numbers(os.path.join(out, f"bench_{name}.json"))) for name in BENCHES}}
    deadline = time.time() + args.budget
    for name, argv, limit in steps(out):
        if args.only and name not in args.only.split(","):
            continue
        left = deadline - time.time()
        row = (run_step(name, argv, min(limit, left), out) if left >= 20 else
               {"step": name, "ok": False, "seconds": 0, "command": " ".join(argv),
                "tail": [f"not run: the {args.budget:.0f} s budget is spent"]})
        if name in numbers and (row["ok"] or name in BENCHES):
            try:
                row["numbers"] = numbers[name]()
            except Exception as e:  # noqa: BLE001 (a summary row, not a crash: the other numbers still count)
                row.update(ok=False, numbers={"error": f"{type(e).__name__}: {e}"})
        summary["steps"].append(row)
        print(f"{name}: {'ok' if row['ok'] else 'FAILED'} in {row['seconds']} s", flush=True)
        write_summary(out, summary)
    print(f"\n{'step':<9}{'ok':<5}{'s':>7}")
    for r in summary["steps"]:
        print(f"{r['step']:<9}{'yes' if r['ok'] else 'NO':<5}{r['seconds']:>7}")
        for key, value in (r.get("numbers") or {}).items():
            print(f"    {key}: {json.dumps(value)}")
    print(f"wrote {os.path.join(out, 'gpu_check.json')}")
    return 0 if all(r["ok"] for r in summary["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
