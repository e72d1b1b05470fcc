"""What checkpoint checksums cost (checkpoint.py): train.py's save of the 0.1B config's model and
AdamW state with the sha256 of every file taken while writing, and the same save with the hashing
switched off; the check at load against the load itself. Interleaved (with, without, with, ...) so
a busy machine slows both alike: the ratios are the result. Writes results/checkpoint_cost.json.

    OMP_NUM_THREADS=1 python results/checkpoint_cost.py [--repeats 3] [--size 0.1b]
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

import checkpoint  # noqa: E402
import train  # noqa: E402
from fileio import read_json, write_json  # noqa: E402
from report import cpu_name  # noqa: E402


class NoHashing(checkpoint.HashingStream):
    def write(self, data):
        return self.stream.write(data)


class NoLoader:
    def state_dict(self):
        return {}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="pairs of (with, without) timings")
    p.add_argument("--size", default="0.1b", help="a model.SIZES name")
    args = p.parse_args(argv)
    train.setup_distributed()
    cfg = train.load_config([f"--model_size={args.size}", "--keep_last=100"])
    net, _ = train.build_model(cfg, train.model_config(cfg, "cpu"), torch.device("cpu"))
    opt = train.make_optimizer(net, cfg, torch.device("cpu"))
    for p_ in net.parameters():
        p_.grad = torch.zeros_like(p_)
    opt.step()  # AdamW's two moments: the checkpoint a real run writes
    work = tempfile.mkdtemp(dir=os.path.join(ROOT, "out") if os.path.isdir(os.path.join(ROOT, "out")) else None)
    cfg["out_dir"] = work
    times = {"save_with": [], "save_without": [], "verify": [], "load": []}
    try:
        for r in range(args.repeats):
            t0 = time.perf_counter()
            path = checkpoint.save_checkpoint(cfg, 2 * r + 1, net, opt, NoLoader(), {}, None)
            times["save_with"].append(time.perf_counter() - t0)
            hashing, checkpoint.HashingStream = checkpoint.HashingStream, NoHashing
            t0 = time.perf_counter()
            checkpoint.save_checkpoint(cfg, 2 * r + 2, net, opt, NoLoader(), {}, None)
            times["save_without"].append(time.perf_counter() - t0)
            checkpoint.HashingStream = hashing
            meta = read_json(os.path.join(path, "meta.json"))
            t0 = time.perf_counter()
            assert checkpoint.checksum_problem(path, meta) is None
            times["verify"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            model_sd, optim_sd = get_state_dict(net, opt)
            checkpoint.dcp_load({"model": model_sd, "optim": optim_sd}, path)
            times["load"].append(time.perf_counter() - t0)
        nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"size": args.size, "checkpoint_bytes": nbytes, "cpu": cpu_name(), "threads": torch.get_num_threads(),
              "repeats": args.repeats, "seconds": times,
              "save_ratio_with_over_without": med["save_with"] / med["save_without"],
              "verify_over_load": med["verify"] / med["load"]}
    write_json(os.path.join(ROOT, "results", "checkpoint_cost.json"), result)
    print(f"{args.size}: checkpoint {nbytes / 2**30:.2f} GiB; save with checksums / without: "
          f"{result['save_ratio_with_over_without']:.2f}x; verify / load: {result['verify_over_load']:.2f}x")


if __name__ == "__main__":
    main()
