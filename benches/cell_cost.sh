#!/usr/bin/env bash
# What a sweep's child process per cell costs against `migprof run`'s one process: the same cells both
# ways, and per cell the wall time outside warm-up and measurement (process start, CUDA context, model
# build, Parquet writes). Works on the CPU and, with a GPU build, on a GPU.
#   bash benches/cell_cost.sh BIN DEVICE MODELS BATCHES [OUT]
#   e.g. bash benches/cell_cost.sh target/release/migprof cpu resnet18 1,2,3,4
set -euo pipefail
bin="$1"; device="$2"; models="$3"; batches="$4"; out="${5:-$(mktemp -d)}"
warmup="${WARMUP_SECS:-0.2}"; duration="${DURATION_SECS:-0.5}"
rm -rf "$out/sweep" "$out/run"; mkdir -p "$out"
list() { echo "$1" | sed 's/\([^,][^,]*\)/"\1"/g'; }
cat > "$out/cost.toml" <<TOML
name = "cell-cost"
[defaults]
warmup_secs = $warmup
duration_secs = $duration
sample_interval_ms = 0
[[targets]]
label = "device"
device = "$device"
[[matrix]]
models = [$(list "$models")]
batches = [$batches]
TOML
now() { date +%s.%N; }
t0=$(now); "$bin" sweep "$out/cost.toml" --out "$out/sweep" >/dev/null 2>&1; t1=$(now)
"$bin" run --model "$models" --batch "$batches" --warmup-secs "$warmup" --duration "$duration" --sample-interval-ms 0 \
    --device "$device" --out "$out/run" >/dev/null 2>&1; t2=$(now)
python3 - "$out" "$t0" "$t1" "$t2" <<'PY'
import sys, pyarrow.parquet as pq
out, t0, t1, t2 = sys.argv[1], *map(float, sys.argv[2:])
for name, wall in (("sweep (a child per cell)", t1 - t0), ("run (one process)", t2 - t1)):
    rows = pq.read_table(f"{out}/{name.split()[0]}/runs").to_pylist()
    inside = sum((r["finished_at"] - r["started_at"]).total_seconds() for r in rows)
    print(f"{name:<26} wall {wall:7.2f} s, warm-up + measurement {inside:7.2f} s, "
          f"outside {(wall - inside) / len(rows):6.3f} s per cell over {len(rows)} cells")
PY
