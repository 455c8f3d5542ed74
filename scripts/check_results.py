#!/usr/bin/env python3
"""Read a migprof results folder with pyarrow, as any downstream user would, and check what every row
promises: every row has the documented columns; a measured row (status ok or probe) has throughput =
1000 / mean_ms * batch, min <= p50 <= p90 <= p95 <= p99 <= p99.9 <= max, a verdict from the documented
set with its reason, and one sample per iteration (a generation's decode steps; its prefills are
samples of phase `prefill`, one per generation, with decode_tokens_per_s = throughput and the time to
the first token's percentiles in order); a failed cell's row has its error and no measurement.

usage: scripts/check_results.py DIR [--runs N]    (exit 1 on the first broken promise)
"""
import re
import argparse
import sys

import pyarrow.parquet as pq

COLUMNS = (
    "schema_version run_id invocation_id started_at finished_at host model family mode dtype batch seq_len "
    "device_kind device_name gpu_name gpu_uuid mig_uuid mig_profile gpu_instance_id compute_instance_id sm_count device_memory_mib seed weights optimizer kernel_options warmup_iterations iterations measured_s mean_ms std_ms min_ms max_ms p50_ms "
    "p90_ms p95_ms p99_ms p999_ms throughput wall_throughput loss_first loss_last params flops_per_sample "
    "verdict verdict_reason histogram migprof_version git_commit"
).split()
VERDICTS = {"ok", "too_few_iterations", "unstable", "throttled", "shared"}
MEASURED = {None, "ok", "probe"}  # rows written before the status column are measured runs


def check(folder, expected_runs):
    runs = pq.read_table(f"{folder}/runs").to_pylist()
    samples = pq.read_table(f"{folder}/samples").to_pylist()
    problems = []
    if expected_runs is not None and len(runs) != expected_runs:
        problems.append(f"{len(runs)} runs, expected {expected_runs}")
    per_run, prefills = {}, {}
    for s in samples:
        count = prefills if s.get("phase") == "prefill" else per_run
        count[s["run_id"]] = count.get(s["run_id"], 0) + 1
    for r in runs:
        rid = r.get("run_id")
        missing = [c for c in COLUMNS if c not in r]
        if missing:
            problems.append(f"{rid}: missing columns {missing}")
            continue
        if r.get("status") not in MEASURED:
            if not r.get("error") or r["throughput"] is not None or r["iterations"] is not None:
                problems.append(f"{rid}: a {r['status']} row needs its error and no measurement")
            continue
        want = 1000.0 / r["mean_ms"] * r["batch"]
        if abs(r["throughput"] - want) > 1e-9 * want:
            problems.append(f"{rid}: throughput {r['throughput']} != 1000/mean_ms*batch = {want}")
        chain = [r[c] for c in ("min_ms", "p50_ms", "p90_ms", "p95_ms", "p99_ms", "p999_ms", "max_ms")]
        if chain != sorted(chain):
            problems.append(f"{rid}: percentiles out of order {chain}")
        if r["verdict"] not in VERDICTS or not r["verdict_reason"]:
            problems.append(f"{rid}: verdict {r['verdict']!r} reason {r['verdict_reason']!r}")
        if per_run.get(rid, 0) != r["iterations"]:
            problems.append(f"{rid}: {per_run.get(rid, 0)} samples for {r['iterations']} iterations")
        lo, hi = r.get("throughput_ci_low"), r.get("throughput_ci_high")
        if lo is not None and not lo <= r["throughput"] <= hi:
            problems.append(f"{rid}: throughput {r['throughput']} outside its interval [{lo}, {hi}]")
        if not re.fullmatch(r"v[0-9]+(;[a-z]+=[a-z0-9]+)+", r["kernel_options"] or ""):
            problems.append(f"{rid}: kernel_options {r['kernel_options']!r} is not a versioned canonical string")
        if r["mode"] == "generate":
            if prefills.get(rid, 0) != r.get("generations"):
                problems.append(f"{rid}: {prefills.get(rid, 0)} prefill samples for {r.get('generations')} generations")
            decode = r.get("decode_tokens_per_s")
            if decode is None or abs(decode - r["throughput"]) > 1e-9 * r["throughput"]:
                problems.append(f"{rid}: decode_tokens_per_s {decode} is not the throughput {r['throughput']}")
            ttft = [r.get(c) for c in ("ttft_p50_ms", "ttft_p99_ms")]
            if None in ttft or ttft != sorted(ttft):
                problems.append(f"{rid}: time to first token's percentiles {ttft}")
        elif prefills.get(rid):
            problems.append(f"{rid}: prefill samples in a {r['mode']} run")
        if r["mode"] == "train" and (r["loss_first"] is None or r["loss_last"] is None):
            problems.append(f"{rid}: a training run without loss_first/loss_last")
    return runs, problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--runs", type=int, help="the number of runs the folder must hold")
    args = ap.parse_args()
    runs, problems = check(args.folder, args.runs)
    for r in (r for r in runs if r.get("status") not in MEASURED):
        print(f"{r['model']:<12} {r['mode']:<5} {r['dtype']:<4} batch {r['batch']:>4}  {r['status']}: {r['error'].splitlines()[0]}")
    for r in (r for r in runs if r.get("status") in MEASURED):
        print(f"{r['model']:<12} {r['mode']:<5} {r['dtype']:<4} batch {r['batch']:>4}  p50 {r['p50_ms']:9.3f} ms"
              f"  p99 {r['p99_ms']:9.3f} ms  {r['throughput']:10.1f}/s  {r['verdict']}")
    for p in problems:
        print("FAIL:", p, file=sys.stderr)
    print(f"{len(runs)} runs checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
