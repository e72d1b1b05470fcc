"""A run read and stopped while it trains: evals and exports beside a training that saves and prunes a
checkpoint every step, and a scheduler's preemption notice (SIGTERM, SIGUSR1) saving the step."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import checkpoint
import eval as ev
import interrupt
from conftest import launch_env
from test_train import ROOT, TINY, command, rows, run_here

# Readers started at once beside the training, which prunes what they read meanwhile (the test checks it). Ten evals
# and three exports took 85 s on one core, these 40 s.
EVALS, EXPORTS = 4, 2
EVERY_STEP = [*TINY, "--max_steps=100000", "--ckpt_interval=1", "--keep_last=2", "--eval_interval=100000",
              "--log_interval=100000"]


def start(args):
    return subprocess.Popen(command(args, 1), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=launch_env())


def wait_for(path, proc, timeout=120):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None and time.time() < deadline, "".join(proc.communicate(timeout=60))[-3000:]
        time.sleep(0.02)


def stop(proc, sig=signal.SIGTERM):
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


@pytest.mark.slow
def test_evals_and_exports_beside_a_training_that_prunes_every_step(data_dir, tmp_path):
    run = str(tmp_path / "run")
    training = start([*EVERY_STEP, f"--data_dir={data_dir}", f"--out_dir={run}"])
    wait_for(os.path.join(run, "ckpt_00000003"), training)
    evals = [subprocess.Popen([sys.executable, "eval.py", "loss", run, "--data", data_dir, "--tokens", "2048",
                               "--json-out", str(tmp_path / f"e{i}.json")], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=launch_env()) for i in range(EVALS)]
    exports = [subprocess.Popen([sys.executable, "train.py", "export", run, str(tmp_path / f"x{i}.pt")], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env())
               for i in range(EXPORTS)]
    for proc in evals + exports:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "Traceback" not in err and "damaged" not in err, out + err
    assert training.poll() is None, "the training ended before the readers did: no race was tested"
    code, _, err = stop(training)
    assert code == interrupt.PREEMPTED_STATUS, err
    results = [json.load(open(tmp_path / f"e{i}.json")) for i in range(EVALS)]
    blobs = [torch.load(tmp_path / f"x{i}.pt", weights_only=True) for i in range(EXPORTS)]
    steps = sorted({r["summary"]["step"] for r in results} | {b["step"] for b in blobs})
    # they read a run that went on and pruned what they had read
    assert steps[-1] > 3 and not os.path.exists(os.path.join(run, f"ckpt_{steps[0]:08d}"))
    # The same training again, keeping every checkpoint the readers read: each number is the one that
    # checkpoint gives alone (one machine, one thread: the runs are bitwise equal).
    ref = str(tmp_path / "ref")
    again = start([*EVERY_STEP, f"--data_dir={data_dir}", f"--out_dir={ref}", f"--keep_steps={steps}"])
    wait_for(os.path.join(ref, f"ckpt_{steps[-1] + 1:08d}"), again)
    stop(again)
    for r in results:
        alone = ev.main(["loss", os.path.join(ref, f"ckpt_{r['summary']['step']:08d}"), "--data", data_dir,
                         "--tokens", "2048"])
        assert alone["summary"]["loss"] == r["summary"]["loss"]
    for blob in blobs:
        model, _ = checkpoint.load_model(os.path.join(ref, f"ckpt_{blob['step']:08d}"))
        assert all(torch.equal(blob["model"][k], v) for k, v in model.state_dict().items())


def test_a_reader_holds_its_checkpoint_and_the_pruner_keeps_it_for_later(tmp_path, monkeypatch):
    # The lock itself, in-process: a held checkpoint is not pruned (the pruner does not wait), a free one
    # is; once its reader is done it goes at the next prune. A checkpoint pruned before it was held is
    # "pruned", in one line, not damaged.
    held_one, free_one = tmp_path / "ckpt_00000001", tmp_path / "ckpt_00000002"
    for folder in (held_one, free_one):
        folder.mkdir()
        (folder / "meta.json").write_text("{}")
    with checkpoint.held_whole(str(held_one)) as whole:
        assert whole
        t0 = time.time()
        assert checkpoint.prune_checkpoint(str(held_one)) is False and time.time() - t0 < 1
        assert checkpoint.prune_checkpoint(str(free_one)) is True and not free_one.exists()
        assert held_one.exists()
    assert checkpoint.prune_checkpoint(str(held_one)) is True and not held_one.exists()
    with checkpoint.held_whole(str(held_one)) as whole:
        assert not whole
    # Found (find_checkpoints) just before the pruner renamed it away: the reader says so, not "damaged".
    monkeypatch.setattr(checkpoint, "find_checkpoints", lambda path: [path])
    with pytest.raises(ValueError, match=r"ckpt_00000001 was pruned by its training \(keep_last\) before it could "
                                         r"be read, not damaged: pass another, or the run folder"):
        checkpoint.load_model(str(held_one))


def logged_step(out, step, proc):
    """Wait until the run's metrics.jsonl has reached step."""
    path, deadline = os.path.join(out, "metrics.jsonl"), time.time() + 120
    while not (os.path.exists(path) and any(json.loads(line).get("step", 0) >= step for line in open(path))):
        assert proc.poll() is None and time.time() < deadline, "".join(proc.communicate(timeout=60))[-3000:]
        time.sleep(0.02)


@pytest.mark.slow
def test_sigterm_saves_the_step_and_the_resume_is_bitwise(data_dir, tmp_path):
    args = [*TINY, f"--data_dir={data_dir}", "--max_steps=120", "--ckpt_interval=1000", "--eval_interval=30"]
    ref = str(tmp_path / "ref")
    run_here([*args, f"--out_dir={ref}"])
    sig = signal.SIGTERM  # SIGUSR1: test_a_notice_to_one_rank_stops_every_rank_after_the_same_step
    out = str(tmp_path / sig.name)
    proc = start([*args, f"--out_dir={out}"])
    logged_step(out, 20, proc)
    proc.send_signal(sig)
    time.sleep(0.05)
    code, _, err = stop(proc, sig)  # a second notice, likely during the save: it changes nothing
    assert code == interrupt.PREEMPTED_STATUS == 75, err
    saved = checkpoint.complete_checkpoints(out)
    assert len(saved) == 1 and not saved[0].endswith("ckpt_00000120")
    assert err.strip().splitlines() == [
        f"{sig.name} at step {int(saved[0][-8:])}/120: saved {saved[0]}; the same command resumes from it "
        f"(exit status 75: requeue the job)"], err
    resumed = run_here([*args, f"--out_dir={out}"])
    assert f"resumed from {saved[0]}" in resumed.stdout
    for field in ("loss", "grad_norm", "val_loss"):
        assert rows(out, field) == rows(ref, field), field


@pytest.mark.slow
def test_ctrl_c_at_any_point_of_an_eval_is_one_line(data_dir, tmp_path):
    # Startup, loading, compiling the mask function, the batches, the end: an error that a Ctrl-C caused
    # inside a compiled function or a C++ op (torch's INTERNAL ASSERT) is the interrupted line too.
    run = str(tmp_path / "run")
    run_here([*TINY, f"--data_dir={data_dir}", f"--out_dir={run}", "--max_steps=3"])
    # The third line is interrupt.run's own: a Ctrl-C between the imports and main's try, or after its result.
    lines = {"eval.py: interrupted while starting, before anything was written; rerun the same command",
             "interrupted: eval.py loss stopped before it finished; nothing is half-written, run the same command "
             "again for its results",
             "interrupted: eval.py stopped; nothing is half-written, run the same command again for its results"}
    command = [sys.executable, "eval.py", "loss", run, "--data", data_dir, "--tokens", "30000"]
    began = time.time()
    subprocess.run(command, cwd=ROOT, capture_output=True, env=launch_env(), check=True, timeout=300)
    whole = time.time() - began  # the Ctrl-Cs are spread over the uninterrupted eval's time, whatever the load
    outcomes = []
    for fraction in (0.1, 0.3, 0.45, 0.6, 0.75, 0.9):
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=launch_env())
        time.sleep(fraction * whole)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        said = [line for line in err.splitlines() if not line.startswith("loss:")]  # the progress lines
        assert (proc.returncode, said) == (0, []) or (proc.returncode == 130 and len(said) == 1 and
                                                     said[0] in lines), (fraction, err)
        outcomes.append(said[0][:20] if said else "finished")
    assert len(set(outcomes)) > 1, outcomes  # the Ctrl-Cs met it at different points


def workers_of(pid):
    """{RANK: pid} of a torchrun's worker processes."""
    found = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in open(f"/proc/{pid}/task/{task}/children").read().split():
            env = dict(v.split("=", 1) for v in open(f"/proc/{child}/environ").read().split("\0") if "=" in v)
            if "RANK" in env:
                found[int(env["RANK"])] = int(child)
    return found


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="finds torchrun's workers in /proc")
def test_a_notice_to_one_rank_stops_every_rank_after_the_same_step(data_dir, tmp_path):
    # SIGUSR1 to rank 1 alone: rank 0 learns it in the step's all-reduce, and both save that step together.
    out = str(tmp_path / "run")
    args = [*TINY, "--batch_size=2", f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=100000",
            "--ckpt_interval=100000", "--eval_interval=100000"]
    proc = subprocess.Popen(command(args, 2),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env())
    logged_step(out, 5, proc)
    os.kill(workers_of(proc.pid)[1], signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    saved = checkpoint.complete_checkpoints(out)
    assert len(saved) == 1 and json.load(open(os.path.join(saved[0], "meta.json")))["world_size"] == 2
    assert f"SIGUSR1 at step {int(saved[0][-8:])}/100000: saved {saved[0]}; the same command resumes from it" in err
    # torchrun reports a worker that ended with 75 as failed: its own status is 1
    assert proc.returncode == 1 and "exitcode  : 75" in err, err[-2000:]
