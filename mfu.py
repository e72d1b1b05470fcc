"""
MFU's one convention, for train.py, bench.py and gpu_check.py: the model's FLOP/s (GPT.flops_per_token
times tokens/s) over the device's datasheet dense bf16 peak. The rate this device's matmuls reach now
is measured and printed beside it, never divided by: it moves with clocks, power and the matrix size
(an H200 reached 757 of its 989 TFLOP/s), so an MFU against it would not compare across runs or
machines. A CPU has no datasheet figure: no MFU there unless a peak is given (train.py's peak_flops).
"""

import math
import time

import torch

# Dense bf16 tensor-core peaks per GPU, without sparsity (NVIDIA's datasheets), matched in order
# against torch.cuda.get_device_name: every word of the key must appear in the name.
DATASHEET = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12))


def datasheet_peak(device):
    """(FLOP/s, where it comes from) of one device; 0 when it has none (a CPU, a GPU not listed)."""
    if device.type != "cuda":
        return 0.0, "no datasheet peak for a CPU"
    name = torch.cuda.get_device_name(device)
    for key, flops in DATASHEET:
        if all(word in name for word in key.split()):
            return flops, f"{name} datasheet"
    return 0.0, f"{name} is not in mfu.DATASHEET"


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device, dtype, n, reps, trials=5):
    """FLOP/s of an n×n×n matmul now, best of `trials` timings of `reps` matmuls: large enough to
    reach the BLAS's best rate, and the best of several so a scheduler hiccup doesn't count."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up: thread pool, cuBLAS handle and heuristics
    best = math.inf
    for _ in range(trials):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / reps)
    return 2 * n**3 / best
