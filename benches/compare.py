#!/usr/bin/env python3
"""Joins migprof's runs (a results folder) with pytorch_reference.py's rows and prints, per model, mode,
dtype and batch, both throughputs and their ratio migprof / PyTorch (above 1: migprof is faster),
PyTorch being the best of the variants measured for the cell (each variant's throughput is shown). With
--peak (peak_flops.py's output), also each side's model FLOP utilisation: samples/s x FLOPs per
sample (migprof's count: 2 per multiply-add of convolutions, linears and attention matmuls; 3x the
forward for a training step) over the GPU's measured matmul peak in that dtype.

Generate rows (benches/decoder_reference.py: throughput is decoded tokens/s) also get a table of the
time to first token and the decode step, migprof's against each variant's; a variant that could not
run is named with its error.

With --memory, a table of device memory instead: migprof's against each PyTorch variant's, and the
ratios to the fastest variant's and to the leanest one's (at or below 1: migprof needs no more).

usage: compare.py RESULTS_DIR pytorch.jsonl [--peak peak.json] [--memory] [--markdown]
"""
import json
import sys

import pyarrow.parquet as pq


def print_table(head, rows, markdown):
    """Rows of strings under `head`: a Markdown table, or columns aligned to the right."""
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)] if rows else [len(h) for h in head]
        for r in [head] + rows:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def memory_table(ours, best, variants, markdown):
    """Per cell that both sides measured: migprof's largest sampled device memory, each PyTorch
    variant's device memory after its steps, and migprof's against the fastest and the leanest."""
    head = ["model", "mode", "dtype", "batch", "MiB migprof", "MiB pytorch variants", "vs fastest", "vs leanest"]
    out = []
    for key, fastest in best.items():
        m = ours.get(key)
        mine = m and m.get("fb_used_max_mib")
        if not mine:
            continue
        each = variants[key]
        leanest = min(each, key=lambda v: v["device_used_mib"])
        out.append([*map(str, key), f"{mine:.0f}", " ".join(f"{v.get('variant', 'eager')}={v['device_used_mib']:.0f}" for v in each),
                    f"{mine / fastest['device_used_mib']:.2f}", f"{mine / leanest['device_used_mib']:.2f}"])
    print_table(head, out, markdown)


def generate_table(ours, variants, markdown):
    """Per generate cell: migprof's time to first token and decode step (p50, ms) against each PyTorch
    variant's, and the ratio of the best variant's decode step to migprof's (above 1: migprof faster)."""
    head = ["model", "batch", "prompt", "output", "TTFT migprof", "TTFT pytorch", "step migprof", "step pytorch", "best step / migprof's"]
    out = []
    for key, each in variants.items():
        if key[1] != "generate":
            continue
        m = ours.get(key)
        ok = [v for v in each if "decode_step_p50_ms" in v]
        ttft = " ".join(f"{v['variant']}={v['ttft_p50_ms']:.1f}" for v in ok)
        step = " ".join(f"{v['variant']}={v['decode_step_p50_ms']:.2f}" for v in ok)
        best = min((v["decode_step_p50_ms"] for v in ok), default=None)
        row = [key[0], str(key[3]), str(ok[0]["prompt_len"] if ok else "-"), str(ok[0]["output_len"] if ok else "-"),
               f"{m['ttft_p50_ms']:.1f}" if m else "-", ttft or "-", f"{m['p50_ms']:.2f}" if m else "-", step or "-",
               f"{best / m['p50_ms']:.2f}" if m and best else "-"]
        out.append(row)
    if out:
        print()
        print_table(head, out, markdown)
    for each in variants.values():
        for v in each:
            if "error" in v:
                print(f"{v['model']} batch {v['batch']} {v['variant']}: not measured: {v['error']}")


def migprof_rows(folder):
    """migprof's rows by (model, mode, dtype, batch), the latest run winning (parts are in time order).
    bf16 and f16 training rows without f32 master weights (`master_weights` none) are left out: PyTorch
    trains under autocast over f32 weights, and those rows are the cost of the masters, not the
    comparison."""
    ours = {}
    for r in pq.read_table(f"{folder}/runs").to_pylist():
        masters = r.get("master_weights")
        # A bf16/f16 training row without the column was written before masters existed: `none`.
        if masters is None and r["mode"] == "train" and r["dtype"] in ("bf16", "f16"):
            masters = "none"
        if masters != "none":
            ours[(r["model"], r["mode"], r["dtype"], r["batch"])] = r
    return ours


def main():
    folder, ref_file = sys.argv[1], sys.argv[2]
    markdown = "--markdown" in sys.argv
    peak = json.load(open(sys.argv[sys.argv.index("--peak") + 1])) if "--peak" in sys.argv else None
    ours = migprof_rows(folder)
    measured = [json.loads(line) for line in open(ref_file) if line.strip()]
    # The best variant per cell; every variant's throughput beside it (a variant that failed has none).
    best, variants = {}, {}
    for p in measured:
        key = (p["model"], p["mode"], p["dtype"], p["batch"])
        variants.setdefault(key, []).append(p)
        if "throughput" not in p:
            continue
        if key not in best or p["throughput"] > best[key]["throughput"]:
            best[key] = p
    rows = list(best.values())
    if "--memory" in sys.argv:
        memory_table(ours, best, variants, markdown)
        return
    # Each side's verdict: migprof's run's, and whether the GPU slowed its clocks while PyTorch's best
    # variant was measured ("-" where the reference could not read NVML).
    head = ["model", "mode", "dtype", "batch", "migprof/s", "pytorch/s", "ratio", "migprof p50 ms", "verdict", "pytorch verdict", "pytorch variants/s"]
    if peak:
        head += ["MFU migprof", "MFU pytorch"]
    # Device memory in use (MiB) during the cell: migprof's sampler's largest reading against the
    # best PyTorch variant's, and their ratio (at or below 1: migprof needs no more).
    head += ["MiB migprof", "MiB pytorch", "memory ratio"]
    out = []
    for p in rows:
        key = (p["model"], p["mode"], p["dtype"], p["batch"])
        each = " ".join(
            f"{v.get('variant', 'eager')}={v['throughput']:.0f}" + (f" (compile {v['compile_s']:.0f} s)" if v.get("compile_s") else "")
            for v in variants[key]
            if "throughput" in v
        )
        m = ours.get(key)
        if m is None:
            out.append([p["model"], p["mode"], p["dtype"], str(p["batch"]), "-", f"{p['throughput']:.1f}", "-", "-", "missing", p.get("verdict") or "-", each] + (["-", "-"] if peak else []) + ["-"] * 3)
            continue
        row = [p["model"], p["mode"], p["dtype"], str(p["batch"]), f"{m['throughput']:.1f}", f"{p['throughput']:.1f}",
               f"{m['throughput'] / p['throughput']:.2f}", f"{m['p50_ms']:.3f}", m["verdict"], p.get("verdict") or "-", each]
        if peak:
            top = peak.get(f"{p['dtype']}_tflops", float("nan")) * 1e12
            row += [f"{m['throughput'] * m['flops_per_sample'] / top:.1%}", f"{p['throughput'] * m['flops_per_sample'] / top:.1%}"]
        mine, theirs = m.get("fb_used_max_mib"), p.get("device_used_mib")
        row += [f"{mine:.0f}" if mine else "-", f"{theirs:.0f}" if theirs else "-", f"{mine / theirs:.2f}" if mine and theirs else "-"]
        out.append(row)
    print_table(head, out, markdown)
    generate_table(ours, variants, markdown)
    if rows:
        print(f"\nPyTorch {rows[0]['torch']} on {rows[0]['gpu']}; precision: f32 TF32 off; tf32 TF32 on for matmuls and convolutions; bf16/f16 autocast or half weights in inference (PyTorch) / half weights (migprof); bf16/f16 training over f32 weights (PyTorch autocast) / f32 master weights (migprof)")
    if peak:
        tf32 = f", tf32 {peak['tf32_tflops']:.0f} TFLOP/s" if "tf32_tflops" in peak else ""
        print(f"measured peak: bf16 {peak['bf16_tflops']:.0f} TFLOP/s, f32 (no TF32) {peak['f32_tflops']:.1f} TFLOP/s{tf32}")


if __name__ == "__main__":
    main()
