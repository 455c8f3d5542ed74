#!/usr/bin/env python3
"""Sums per-kernel GPU time from `ncu --csv --metrics gpu__time_duration.sum` output and prints the
kernels that take the most, grouped by name, with their share of the total.

usage: ncu_summary.py NCU.csv [--top 25] [--iterations N]   (times are divided by N: per iteration)
"""
import csv
import sys
from collections import defaultdict


def main():
    path = sys.argv[1]
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 25
    iters = int(sys.argv[sys.argv.index("--iterations") + 1]) if "--iterations" in sys.argv else 1
    lines = open(path).read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    rows = [r for r in csv.DictReader(lines[start:]) if r.get("Metric Name") == "gpu__time_duration.sum"]
    total = defaultdict(float)
    count = defaultdict(int)
    for r in rows:
        unit = r["Metric Unit"]
        v = float(r["Metric Value"].replace(",", ""))
        ns = v * {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9, "second": 1e9}[unit]
        name = r["Kernel Name"].split("(")[0][:90]
        total[name] += ns / iters
        count[name] += 1
    grand = sum(total.values())
    print(f"per iteration: {len(rows) // iters} kernel launches, {grand / 1e6:.2f} ms of GPU time")
    print(f"{'ms':>9} {'share':>6} {'launches':>8}  kernel")
    for name, ns in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{ns / 1e6:9.3f} {ns / grand:6.1%} {count[name] // iters:8d}  {name}")


if __name__ == "__main__":
    main()
