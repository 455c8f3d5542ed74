#!/usr/bin/env python3
"""Joins migprof's runs (a results folder) with pytorch_reference.py's rows and prints, per model, mode,
dtype and batch, both throughputs and their ratio migprof / PyTorch (above 1: migprof is faster).

usage: compare.py RESULTS_DIR pytorch.jsonl [--markdown]
"""
import json
import sys

import pyarrow.parquet as pq


def main():
    folder, ref_file = sys.argv[1], sys.argv[2]
    markdown = "--markdown" in sys.argv
    ours = {}
    for r in pq.read_table(f"{folder}/runs").to_pylist():
        ours[(r["model"], r["mode"], r["dtype"], r["batch"])] = r  # latest run wins: parts are in time order
    rows = [json.loads(line) for line in open(ref_file) if line.strip()]
    head = ["model", "mode", "dtype", "batch", "migprof/s", "pytorch/s", "ratio", "migprof p50 ms", "verdict"]
    out = []
    for p in rows:
        m = ours.get((p["model"], p["mode"], p["dtype"], p["batch"]))
        if m is None:
            out.append([p["model"], p["mode"], p["dtype"], str(p["batch"]), "-", f"{p['throughput']:.1f}", "-", "-", "missing"])
            continue
        out.append([p["model"], p["mode"], p["dtype"], str(p["batch"]), f"{m['throughput']:.1f}", f"{p['throughput']:.1f}",
                    f"{m['throughput'] / p['throughput']:.2f}", f"{m['p50_ms']:.3f}", m["verdict"]])
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in out:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(h), *(len(r[i]) for r in out)) for i, h in enumerate(head)] if out else [len(h) for h in head]
        for r in [head] + out:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    if rows:
        print(f"\nPyTorch {rows[0]['torch']} on {rows[0]['gpu']}; precision: f32 TF32 off, bf16 autocast (PyTorch) / bf16 weights (migprof)")


if __name__ == "__main__":
    main()
