"""The table of benches/programs.sh: per target, model and batch, the user's program's throughput
(migprof exec) beside migprof's engine (migprof run), their ratio, and what NVML saw of the program.
    python3 benches/programs.py RESULTS_DIR"""

import sys

import pyarrow.dataset as ds

rows = ds.dataset(f"{sys.argv[1]}/runs", format="parquet").to_table().to_pylist()
cells = {}
for r in rows:
    if r["status"] != "ok":
        print(f"failed: {r['target']} {r['model']} {r['mode']}: {r['error']}")
        continue
    key = (r["target"], r["model"], r["mode"], r["dtype"], r["batch"])
    side = "program" if r["family"] == "program" else "engine"
    cells.setdefault(key, {})[side] = r

print("| target | model | mode | dtype | batch | program items/s | engine items/s | program / engine | program p50 ms | engine p50 ms | program's processes seen | program's device memory MiB | program verdict |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for key in sorted(cells):
    c = cells[key]
    p, e = c.get("program"), c.get("engine")
    ratio = p["throughput"] / e["throughput"] if p and e else None
    cell = lambda r, k, f: (f.format(r[k]) if r and r[k] is not None else "-")
    print(
        f"| {' | '.join(str(k) for k in key)} | {cell(p, 'throughput', '{:.1f}')} | {cell(e, 'throughput', '{:.1f}')} | "
        f"{'-' if ratio is None else f'{ratio:.3f}'} | {cell(p, 'p50_ms', '{:.2f}')} | {cell(e, 'p50_ms', '{:.2f}')} | "
        f"{cell(p, 'program_pids_seen', '{}')} | {cell(p, 'program_device_memory_max_mib', '{:.0f}')} | {cell(p, 'verdict', '{}')} |"
    )
