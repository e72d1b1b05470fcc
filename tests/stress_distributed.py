"""Fault injection for the suite's 2-rank gloo launches (issue: a one-off SIGABRT under load).

    python tests/stress_distributed.py N {train,init}

Launches the 2-rank MoE training of tests/test_train.py (train) or tests/dist_init_worker.py
(init) N times. While each runs, a thread stops one worker at random with SIGSTOP for 0.01-5 s
and resumes it, every 0.05-1 s: a loaded machine's scheduling stalls, made frequent and
repeatable. Prints one JSON line per launch and writes the output of any failed launch (with
its stall log) beside the working folder. Not collected by pytest: it runs for minutes.
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def byte_data(root):
    rng = random.Random(0)
    words = "the cat sat on a mat and dog ran to big red house with small green tree".split()
    os.makedirs(os.path.join(root, "txt"))
    with open(os.path.join(root, "txt", "corpus.txt"), "w") as f:
        f.write("\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) + "."
                            for _ in range(600)))
    out = os.path.join(root, "bytes")
    subprocess.run([sys.executable, "prepare_data.py", "text", "--out", out, "--source", f"en={root}/txt",
                    "--tokenizer", "bytes"], cwd=ROOT, check=True, env=ENV, capture_output=True)
    return out


def children(ppid):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == ppid:
                    found.append(int(pid))
        except (OSError, IndexError):
            pass  # gone meanwhile
    return found


def stall_workers(proc, done, rng, log):
    while not done.is_set():
        time.sleep(rng.uniform(0.05, 1.0))
        workers = children(proc.pid)
        if workers:
            pid, seconds = rng.choice(workers), rng.choice([0.01, 0.1, 0.5, 2.0, 5.0])
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(seconds)
                os.kill(pid, signal.SIGCONT)
                log.append([round(time.time(), 2), pid, seconds])
            except ProcessLookupError:
                pass


def main(n, mode):
    work = tempfile.mkdtemp(prefix="stress_distributed_")
    data = byte_data(work) if mode == "train" else None
    failures = 0
    for i in range(n):
        out = os.path.join(work, f"run_{i}")
        if mode == "init":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=localhost:0", os.path.join(ROOT, "tests", "dist_init_worker.py"), out + ".pt"]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                   "--model_size=tiny", "--seq_len=32", "--global_batch=4", "--batch_size=2", "--warmup_steps=2",
                   "--lr=3e-3", "--log_interval=1", "--eval_interval=5", "--eval_batches=1", f"--data_dir={data}",
                   "--max_steps=10", "--ckpt_interval=5", f"--out_dir={out}",
                   "--model={'n_experts': 4, 'top_k': 2, 'moe_bias_rate': 0.05}"]
        start, log, done = time.time(), [], threading.Event()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        staller = threading.Thread(target=stall_workers, args=(proc, done, random.Random(i), log))
        staller.start()
        said, _ = proc.communicate(timeout=900)
        done.set()
        staller.join()
        print(json.dumps({"launch": i, "mode": mode, "rc": proc.returncode, "s": round(time.time() - start, 1),
                          "stalls": len(log)}), flush=True)
        if proc.returncode != 0:
            failures += 1
            with open(os.path.join(work, f"failed_{i}.txt"), "w") as f:
                f.write(json.dumps(log) + "\n" + said)
        subprocess.run(["rm", "-rf", out, out + ".pt"])
    print(f"{failures} of {n} launches failed" + (f"; their output is in {work}" if failures else ""))
    if not failures:
        shutil.rmtree(work)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
