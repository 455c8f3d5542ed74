#!/usr/bin/env python3
"""One decode step's kernels from Nsight Compute's CSV (`ncu --csv --metrics gpu__time_duration.sum`):
per kernel, launches a step and microseconds a step, and their sum against the step's graphed time.

  python3 benches/decode_breakdown.py NCU.csv --layers 16 [--step-ms 1.23]

The profiled window holds whole decode steps and maybe parts of others; a step is recognised by
the q/k/v kernel, launched once a layer (`decode_qkv`), so figures are per `decode_qkv` launch times
the layers. ncu runs each kernel alone, so the sum leaves out the gaps between kernels that the
step's CUDA graph still has: the step's own time (`--step-ms`, the run's p50) minus the sum is those
gaps.
"""
import argparse
import csv
import re
import sys
from collections import defaultdict


def short(name):
    # "void decode_gemv_bf16_b1(...)" or candle's "rmsnorm_bf16": the function's name alone.
    name = re.sub(r"\(.*", "", name).split()[-1]
    return name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--step-ms", type=float)
    a = ap.parse_args()
    rows = []
    with open(a.csv) as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "ns")
        v = float(r["Metric Value"].replace(",", ""))
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit, 1e-3)
        rows.append((short(r["Kernel Name"]), v * scale, r.get("Grid Size", "")))
    if not rows:
        sys.exit("no kernel durations in the CSV")
    qkv = sum(1 for n, _, _ in rows if n.startswith("decode_qkv"))
    if qkv < a.layers:
        sys.exit(f"the window holds {qkv} q/k/v launches, less than one step of {a.layers} layers")
    steps = qkv / a.layers
    by = defaultdict(lambda: [0, 0.0])
    for n, us, _ in rows:
        by[n][0] += 1
        by[n][1] += us
    total = sum(us for _, us in by.values()) / steps
    print(f"# {len(rows)} kernels, {steps:.2f} decode steps of {a.layers} layers")
    print("| kernel | launches a step | µs a step | share |")
    print("|---|---|---|---|")
    for n, (count, us) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"| `{n}` | {count / steps:.1f} | {us / steps:.1f} | {us / steps / total:.1%} |")
    print(f"| sum of kernels | {sum(c for c, _ in by.values()) / steps:.1f} | {total:.1f} | |")
    if a.step_ms:
        print(f"| step as graphed (p50) | | {a.step_ms * 1e3:.1f} | gaps {a.step_ms * 1e3 - total:.1f} µs |")


if __name__ == "__main__":
    main()
