"""Fault injection for the suite's 2-rank gloo launches (issue: a one-off SIGABRT under load).

    python tests/stress_distributed.py N {train,init} [HOGS]

Launches the 2-rank MoE training of tests/test_train.py (train) or tests/dist_init_worker.py
(init) N times. While each runs, a thread stops one worker at random with SIGSTOP for 0.01-5 s
and resumes it, every 0.05-1 s: a loaded machine's scheduling stalls, made frequent and
repeatable. HOGS busy-looping processes (default 0) starve the workers of CPU all the while,
as a second test suite on the same cores would. Prints one JSON line per launch and keeps the
output of any failed launch (with its stall log) in its temporary folder. Not collected by
pytest: it runs for minutes.
"""
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from conftest import launch_env
from test_init import torchrun_init_command  # run as a script, this folder is sys.path[0]
from test_train import MOE, ROOT, byte_dataset, command


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
    data = byte_dataset(pathlib.Path(work)) if mode == "train" else None
    failures = 0
    for i in range(n):
        out = os.path.join(work, f"run_{i}")
        cmd = (torchrun_init_command(2, out + ".pt") if mode == "init"
               else command([*MOE, "--batch_size=2", f"--data_dir={data}", f"--out_dir={out}"], 2))
        start, log, done = time.time(), [], threading.Event()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=launch_env())
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
        shutil.rmtree(out, ignore_errors=True)
        if os.path.exists(out + ".pt"):
            os.remove(out + ".pt")
    print(f"{failures} of {n} launches failed" + (f"; their output is in {work}" if failures else ""))
    if not failures:
        shutil.rmtree(work)


if __name__ == "__main__":
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 0)]
    try:
        main(int(sys.argv[1]), sys.argv[2])
    finally:
        for hog in hogs:
            hog.kill()
