#!/usr/bin/env python3
"""The GPU's measured dense matmul peak, the denominator of model FLOP utilisation (MFU): the best of
several 8192^3 matmuls in bf16 (f32 accumulation), in f32 with TF32 off (as the comparison runs f32)
and with TF32 on (for --dtype tf32 runs).
Prints one JSON object: {"gpu", "torch", "bf16_tflops", "f32_tflops", "tf32_tflops"}.
"""
import json
import time

import torch


def best_tflops(dtype, n=8192, reps=20):
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    print(json.dumps({
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "bf16_tflops": best_tflops(torch.bfloat16), "f32_tflops": best_tflops(torch.float32),
        "tf32_tflops": tf32_tflops(),
    }))


def tf32_tflops():
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return best_tflops(torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


if __name__ == "__main__":
    main()
