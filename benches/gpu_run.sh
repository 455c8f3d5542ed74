#!/usr/bin/env bash
# One call on the GPU machine: device discovery against nvidia-smi, every family in every mode and
# dtype, the workload matrix by migprof and by PyTorch with their ratio, and the sampler's disturbance.
# Expects the CUDA build of migprof at .dist/migprof.gz (or .xz, as every .dist/*.gz below may be). Works in /tmp/gpu-out and leaves a
# tarball of it (and the comparison tables) in $OUT when set.
#   bash benches/gpu_run.sh MODE, MODE one of
#     quick    discovery, every family in every mode and dtype, every published model
#     compare  discovery, the comparison with PyTorch (throughput ratio and MFU)
#     matrix   compare, then the sampler's disturbance
#     sampler  discovery and the sampler's disturbance
#     full     all of the above
#     kernels  the GPU kernel and CUDA-graph tests (workloads/tests/{kernels,graphs}.rs, from
#              .dist/{kernels,graphs}-test.gz)
#     graphs   the CUDA-graph tests, then batch-1 latency (ResNet-50, BERT-base, bf16) on the whole GPU
#              and under MPS caps of a 1g and a 3g slice, graphs on and off: small batches must follow
#              the SMs
#     mig      the profile table against nvidia-smi, and a dry-run `mig apply` that must change nothing
#     cellcost a sweep's child process per cell against `migprof run`'s one process (benches/cell_cost.sh)
#     mps      emulated slices: the profiles 1g..7g of this GPU as MPS clients beside the full GPU
#              (benches/mps_slices.toml; MPS_SECS bounds the sweep, which resumes), `run --device mps:`,
#              the verdict beside a second process, and no MPS server left before and after
#     groups   concurrent emulated slices (benches/mps_groups.toml): 3g beside 3g, 1g beside six busy
#              1g neighbours, each against the same cell alone (the interference ratio)
#     capacity capacity at p99 ≤ 50 ms of ResNet-50 and BERT-base on emulated 1g, 3g, 7g
#              (benches/capacity_slices.toml; CAP_SECS bounds the sweep, which resumes in
#              /tmp/capacity-results while the machine stays warm), then `migprof capacity` for
#              20,000 ResNet-50 and 3,000 BERT requests/s, and the report
#     best     migprof against the best PyTorch variant per cell (eager autocast, bf16 weights,
#              channels_last, torch.compile reduce-overhead for inference; benches/pytorch_reference.py
#              --variants); MODELS, BATCHES (default 1), DTYPES (default bf16), MODES (default infer)
#              pick the cells, TRAIN_BATCHES adds training cells at those batches (the 40-cell matrix:
#              BATCHES=1,8,32,128 TRAIN_BATCHES=32 DTYPES=f32,bf16); ROUNDS (default 1) repeats the
#              comparison, and benches/rounds.py gives
#              each cell's median ratio and whether it meets the goal
#     before   no performance lost: the comparison matrix by the build BEFORE_GZ (gzipped, the build
#              before a change) and by this build, one after the other, then PyTorch's once, and each
#              build's ratio to PyTorch and this build's to the one before (MODELS, BATCHES, DTYPES
#              and TRAIN_BATCHES narrow it; defaults: the four families, 1,8,32,128, f32,bf16, 32)
#     ab       a change's effect in one call: migprof's cells with the extra flags AB_ARGS (e.g.
#              AB_ARGS="--attention composed", a kernel option) or by the build AB_BIN (gzipped, e.g.
#              the build before the change), and by this build as it is, alternated twice, then PyTorch's;
#              MODELS, BATCHES, MODES (default infer) and DTYPES (default bf16) pick the cells
#     memory   device memory per cell, each cell in a process of its own: this build's with its ledger
#              (MIGPROF_MEMORY_LOG=1: pool, graphs, cuDNN workspaces) and, with AB_BIN, that build's,
#              beside PyTorch's eager, bf16-weights and channels_last variants' (MODELS, BATCHES
#              default 32, DTYPES default bf16, MODES default infer,train)
#     mixed    mixed-precision training: the master-weight kernels against the CPU and every CUDA-graph
#              test (STEP 1), the update error of bf16 and f16 steps against f64 beside PyTorch
#              autocast's (benches/update_error.py with .dist/update_steps.gz; STEP 1), and (STEP 2, one
#              round per call, ROUND names it) the training cells — MODELS, batch 32, DTYPES (default
#              bf16,f16) over f32 masters and with none — against PyTorch's training variants, with
#              device memory; rounds.py over the rounds found in $OUT
#     serving  a language model served under open-loop load by the continuous batcher (STEP=rates or
#              search; SERVE_DEVICES, SERVE_MODEL, SERVE_QPS, SLO_TTFT, SLO_TPOT: see the mode's block)
#     fidelity emulated slices both ways, alone (mps:) and memory-partitioned (mps-mem:): STEP=probe
#              runs ResNet-50 on mps:1g and mps-mem: 1g..7g and prints what each partition measured;
#              STEP=sweep (the default) runs FID_TOML (benches/slice_fidelity.toml; on two GPUs
#              benches/slice_fidelity_2gpu.toml with FID_JOBS=2) for FID_SECS (resuming from
#              .dist/fidelity-results when carried) and benches/slice_fidelity.py over it;
#              STEP=groups runs benches/mps_mem_groups.toml (mps-mem: members sharing a neighbour);
#              STEP=capacity searches ResNet-50's capacity at p99 <= 50 ms on mps:1g.10gb and
#              mps-mem:1g.10gb and plans 5,000 requests/s from both (the default, then --memory-emulation alone)
#     decoders the Llama and Qwen2 decoders against transformers from the same random weights (logits in
#              f32 and bf16, greedy tokens; benches/decoder_truth.py with .dist/decode_logits.gz), generate
#              runs of the presets and of the folder transformers wrote (hf:DIR), and Llama-3.1-8B bf16
#              refused by the memory estimate on an emulated 1g.10gb; STEP=slices instead sweeps
#              benches/decoder_slices.toml (the whole GPU and 1g to 4g in both emulation modes at context
#              2,048; DEC_SECS bounds it, and a second call resumes it with the same folder)
#              and reports it; STEP=speed runs migprof's generate cells (MODELS, default llama_3_2_1b;
#              BATCHES, default 1,8; prompt 512, 128 tokens, bf16) and PyTorch's decoders
#              (benches/decoder_reference.py: VARIANTS, default eager,static,gptfast, or none for
#              migprof's alone, or REF_RUNS "[MODELS@]VARIANT:BATCHES ..." for some variants at some
#              batches (of some models);
#              REF_SECS bounds each), then compare.py over both, ROUNDS times (default 1) and
#              rounds.py over the rounds; STEP=kernels the decode
#              kernels' and CUDA-graph GPU tests (.dist/{decode_kernels,graphs}-test.gz); STEP=breakdown
#              one decode step's kernels by Nsight Compute beside the graphed step (MODELS, BATCHES
#              default 1; benches/decode_breakdown.py); STEP=ab this build against AB_BIN (the build
#              before a change), alternated ROUNDS times (default 2) on generate cells of MODELS
#              (default qwen2_5_1_5b,llama_3_2_1b) at BATCHES (default 1,8) on each of AB_DEVICES
#              (default 0, the whole GPU; e.g. "0 mps:1g.18gb mps:3g.71gb"), starting runs for at most
#              AB_SECS (480) s, and each build's decode step p50 with their ratio
#              (benches/decode_ab.py), per device
#   MIGPROF_GZ names another build (the CPU build does everything but run models on the GPU).
#   MODELS and BATCHES narrow the comparison (defaults: the four families, inference at 1,8,32,128).
set -uo pipefail
mode="${1:-full}"
out=/tmp/gpu-out
rm -rf "$out"; mkdir -p "$out"
finish() {
    if [ -n "${OUT:-}" ]; then
        tar czf "$OUT/gpu-results.tgz" -C /tmp gpu-out
        cp "$out"/compare.md "$out"/compare.txt "$out"/peak.json "$out"/devices.txt "$out"/sampler.txt "$out"/nvidia-smi-mig-lgip*.txt "$OUT"/ 2>/dev/null
    fi
}
trap finish EXIT
bin=/tmp/migprof
# unpack SRC DST: a build shipped gzipped (.gz) or, smaller, as xz (.xz; the GPU machine's python
# reads it, where no xz tool may be installed).
unpack() {
    case "$1" in
    *.xz) python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$1" "$2" ;;
    *) gunzip -c "$1" > "$2" ;;
    esac && chmod +x "$2"
}
# .dist/NAME.xz or .dist/NAME.gz, the newer where both are shipped.
shipped() { if [ -f ".dist/$1.xz" ] && [ ! ".dist/$1.gz" -nt ".dist/$1.xz" ]; then echo ".dist/$1.xz"; else echo ".dist/$1.gz"; fi; }
unpack "${MIGPROF_GZ:-$(shipped migprof)}" "$bin"
log() { echo "== $*"; }
# MPS servers on the GPU (nvidia-smi's count) and MPS processes: none may be left after a call.
mps_servers() { nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader | grep -c mps-server; ps -eo pid,args | grep "[n]vidia-cuda-mps" || true; }

log "devices"
nvidia-smi -L | tee "$out/nvidia-smi-L.txt"
"$bin" devices | tee "$out/devices.txt"
"$bin" devices --json > "$out/devices.json"
# Read-only: the GPU-instance profiles and their placements, answered with MIG off too.
nvidia-smi mig -lgip > "$out/nvidia-smi-mig-lgip.txt" 2>&1
nvidia-smi mig -lgipp > "$out/nvidia-smi-mig-lgipp.txt" 2>&1; cat "$out/nvidia-smi-mig-lgipp.txt"
uuid="$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -n 1)"
log "pinned to $uuid"

# gpu_tests NAME...: the test binaries .dist/NAME-test.gz (built with --features cudnn); their
# tests are #[ignore]d (a plain `cargo test` has no GPU) and fail without one.
gpu_tests() {
    local rc=0 t
    for t in "$@"; do
        log "GPU tests: workloads/tests/$t.rs"
        unpack "$(shipped "$t-test")" "/tmp/$t-test" || { rc=1; continue; }
        timeout "${TEST_SECS:-600}" "/tmp/$t-test" --include-ignored --nocapture --test-threads 1 > "$out/$t.txt" 2>&1 || rc=1
        grep -E "^test |panicked|differ|relative error|worst|test result" -A2 "$out/$t.txt" | grep -v "^--$" | head -80
        cp "$out/$t.txt" "${OUT:-/tmp}/" 2>/dev/null
    done
    return $rc
}

if [ "$mode" = kernels ]; then
gpu_tests kernels graphs; exit $?
fi

if [ "$mode" = decoders ] && [ "${STEP:-truth}" = kernels ]; then
gpu_tests decode_kernels graphs; exit $?
fi

if [ "$mode" = decoders ] && [ "${STEP:-truth}" = breakdown ]; then
# One decode step's kernels (ncu, each kernel alone) beside the graphed step's p50: MODELS (default
# llama_3_2_1b), BATCHES (default 1), prompt 512.
rc=0
for model in $(echo "${MODELS:-llama_3_2_1b}" | tr , ' '); do
  for batch in $(echo "${BATCHES:-1}" | tr , ' '); do
    layers=$(python3 -c "import json; print(json.load(open('workloads/configs/$model.json'))['num_hidden_layers'])")
    "$bin" run --model "$model" --dtype bf16 --batch "$batch" --prompt-len 512 --output-len 128 --warmup 1 --iters 3 \
        --device "$uuid" --out "$out/breakdown-$model-$batch" 2>&1 | grep -E "result|decode|error" | head -5
    step=$(python3 -c "import pyarrow.parquet as pq; r=pq.read_table('$out/breakdown-$model-$batch/runs').to_pylist()[-1]; print(r['p50_ms'])")
    # Graphs off under ncu: a kernel's duration is the same, and ncu sees each launch.
    timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
        --launch-skip "${NCU_SKIP:-2500}" --launch-count "${NCU_COUNT:-600}" \
        "$bin" run --model "$model" --dtype bf16 --batch "$batch" --prompt-len 512 --output-len 128 --warmup 0 --iters 1 \
        --cuda-graphs off --device "$uuid" --out "$out/ncu-$model-$batch" > "$out/ncu-$model-$batch.csv" 2> "$out/ncu-$model-$batch.log" || rc=1
    log "$model batch $batch: one decode step's kernels (step p50 $step ms)"
    python3 benches/decode_breakdown.py "$out/ncu-$model-$batch.csv" --layers "$layers" --step-ms "$step" | tee "$out/breakdown-$model-$batch.md" || { rc=1; tail -5 "$out/ncu-$model-$batch.log"; }
    cp "$out/breakdown-$model-$batch.md" "${OUT:-/tmp}/" 2>/dev/null
  done
done
exit $rc
fi

if [ "$mode" = decoders ] && [ "${STEP:-truth}" = speed ]; then
models="${MODELS:-llama_3_2_1b}"; batches="${BATCHES:-1,8}"
# PyTorch's runs: REF_RUNS lists VARIANT:BATCHES items (e.g. "gptfast:1,8 static:8,32"), else
# every variant of VARIANTS at every batch.
runs="${REF_RUNS:-}"
if [ -z "$runs" ]; then runs=$(for v in $(echo "${VARIANTS:-eager,static,gptfast}" | tr , ' '); do printf '%s ' "$v:$batches"; done); fi
pairs=()
for round in $(seq 1 "${ROUNDS:-1}"); do
    log "round $round: migprof generate: $models, bf16, batch $batches, prompt 512, 128 tokens"
    "$bin" run --model "$models" --dtype bf16 --batch "$batches" --prompt-len 512 --output-len 128 \
        --warmup 1 --iters 3 --device "$uuid" --out "$out/speed-r$round" 2>&1 | grep -Ev "^plot:"
    # Kept if the call's time runs out in PyTorch's runs.
    tar czf "${OUT:-/tmp}/speed-r$round.tgz" -C "$out" "speed-r$round" 2>/dev/null
    [ "${VARIANTS:-}" = none ] && continue
    ref="$out/decoder-reference-r$round.jsonl"; : > "$ref"
    for item in $runs; do
        # MODELS@VARIANT:BATCHES narrows an item to some of the models.
        which="$models"; case "$item" in *@*) which="${item%%@*}"; item="${item#*@}" ;; esac
        case "$item" in *:*) ;; *) echo "REF_RUNS item '$item': [MODELS@]VARIANT:BATCHES, e.g. gptfast:1,8" >&2; exit 2 ;; esac
        log "round $round: PyTorch's ${item%%:*} for $which at batch ${item#*:} (benches/decoder_reference.py), at most ${REF_SECS:-420} s"
        timeout "${REF_SECS:-420}" python3 benches/decoder_reference.py --models "$which" --batches "${item#*:}" \
            --variants "${item%%:*}" >> "$ref" 2>> "$out/decoder-reference-r$round.log"
        cp "$ref" "${OUT:-/tmp}/" 2>/dev/null  # kept if the call's time runs out later
    done
    grep -E "^#|Error|error" "$out/decoder-reference-r$round.log" | grep -v "warnings.warn" | tail -5
    python3 benches/compare.py "$out/speed-r$round" "$ref" | tee "$out/decode-compare-r$round.txt"
    python3 benches/compare.py "$out/speed-r$round" "$ref" --markdown > "$out/decode-compare-r$round.md"
    cp "$out/decode-compare-r$round".* "${OUT:-/tmp}/" 2>/dev/null
    pairs+=("$out/speed-r$round" "$ref")
done
if [ ${#pairs[@]} -gt 0 ]; then
    log "rounds (benches/rounds.py)"
    python3 benches/rounds.py "${pairs[@]}" | tee "$out/decode-rounds.txt"
    python3 benches/rounds.py "${pairs[@]}" --markdown > "$out/decode-rounds.md"
fi
cp "$out"/decoder-reference*.jsonl "$out"/decoder-reference*.log "$out"/decode-compare* "$out"/decode-rounds* "${OUT:-/tmp}/" 2>/dev/null
exit 0
fi

if [ "$mode" = decoders ] && [ "${STEP:-truth}" = ab ]; then
# Generate cells by the build before a change and by this one, one after the other in each round on
# the same GPU, so that a kernel change is judged against its own card; the table is written after
# every build's run, kept if the call's time runs out.
[ -n "${AB_BIN:-}" ] || { echo "STEP=ab needs AB_BIN, the build before the change (.gz or .xz)" >&2; exit 2; }
unpack "$AB_BIN" /tmp/migprof-ab
models="${MODELS:-qwen2_5_1_5b,llama_3_2_1b}"; batches="${BATCHES:-1,8}"
# Runs start only while AB_SECS (default 480) have not passed since the first, so that no outer
# timeout kills a run (and an emulated slice's MPS daemon with it) midway; the tables say what ran.
log "MPS before"; mps_servers
ab_start=$SECONDS
for dev in ${AB_DEVICES:-0}; do
    [ "$dev" = 0 ] && dev="$uuid"
    name="${dev//[:.]/-}"; [ "$dev" = "$uuid" ] && name=gpu
    folders=()
    for round in $(seq 1 "${ROUNDS:-2}"); do
        for side in before this; do
            if [ $((SECONDS - ab_start)) -ge "${AB_SECS:-480}" ]; then
                log "AB_SECS (${AB_SECS:-480} s) passed: $dev round $round, the build $side and what follows not run"; break 3
            fi
            build="$bin"; [ "$side" = before ] && build=/tmp/migprof-ab
            log "$dev, round $round, the build $side: $models, bf16, batch $batches, prompt 512, 128 tokens"
            "$build" run --model "$models" --dtype bf16 --batch "$batches" --prompt-len 512 --output-len 128 \
                --warmup 1 --iters 3 --device "$dev" --out "$out/ab-$name-$side-r$round" 2>&1 | grep -Ev "^(plot|report):"
            folders+=("$out/ab-$name-$side-r$round")
        done
        python3 benches/decode_ab.py "${folders[@]}" | tee "$out/decode-ab-$name.txt"
        python3 benches/decode_ab.py "${folders[@]}" --markdown > "$out/decode-ab-$name.md"
        python3 -c "import pyarrow.parquet as pq, sys; t = pq.read_table(sys.argv[1] + '/runs'); print('kernel_sm_count', sorted(set(t.column('kernel_sm_count').to_pylist())) if 'kernel_sm_count' in t.column_names else 'absent', 'sm_count', sorted(set(t.column('sm_count').to_pylist())))" "$out/ab-$name-this-r$round" | tee -a "$out/decode-ab-$name.txt"
        cp "$out"/decode-ab-* "${OUT:-/tmp}/" 2>/dev/null
    done
done
log "MPS after"; mps_servers
exit 0
fi

if [ "$mode" = serving ]; then
# A language model served under open-loop load (continuous batcher, paged KV cache): SERVE_MODEL
# (default llama_3_2_1b, bf16), prompts and outputs SERVE_PROMPT / SERVE_OUTPUT (default
# lognormal:512,0.5 and lognormal:128,0.5), on each of SERVE_DEVICES (default the whole GPU; e.g.
# "0 mps-mem:1g.10gb mps-mem:3g.40gb"): STEP=rates serves SERVE_QPS (default 4,16); STEP=plan
# searches PLAN_MODEL's (bert_base) capacity within p99 <= SLO_P99 (50) ms on each and plans
# PLAN_DEMAND beside the language model's capacities carried in, then the report; STEP=search
# searches the highest rate within TTFT p99 <= SLO_TTFT (500) ms and TPOT p99 <= SLO_TPOT (50) ms,
# steps of SERVE_SECS (default 8) s, at most SERVE_STEPS (8) rates; STEP=chunking serves SERVE_QPS
# with chunked prefill and again without; STEP=sweep runs benches/llm_serving.toml (capacity searches
# on emulated slices) for at most SWEEP_SECS (330) s, resumed by the next call. STEP may list several,
# run in order. Rows in $out/serving, returned as serving-results.tgz (carried back as
# .dist/serving-results.tgz, a later call adds to them).
rc=0
res="$out/serving"; mkdir -p "$out"; [ -f .dist/serving-results.tgz ] && tar xzf .dist/serving-results.tgz -C "$out"; mkdir -p "$res"
log "MPS before"; mps_servers
for step in ${STEP:-rates}; do
if [ "$step" = sweep ]; then
  log "sweep benches/llm_serving.toml ${SWEEP_ARGS:-}"
  timeout "${SWEEP_SECS:-330}" "$bin" sweep benches/llm_serving.toml --out "$res" ${SWEEP_ARGS:-} 2>&1 | grep -v "^\s*$" || rc=1
  log "MPS after the sweep"; mps_servers
  continue
fi
for dev in ${SERVE_DEVICES:-$uuid}; do
  [ "$dev" = 0 ] && dev="$uuid"
  common=(--model "${SERVE_MODEL:-llama_3_2_1b}" --dtype bf16 --device "$dev" --prompt-len "${SERVE_PROMPT:-lognormal:512,0.5}"
          --output-len "${SERVE_OUTPUT:-lognormal:128,0.5}" --duration "${SERVE_SECS:-8}" --out "$res")
  if [ "$step" = chunking ]; then
    for chunking in "" --no-chunked-prefill; do
      log "serving $dev: ${SERVE_QPS:-4,16} requests/s ${chunking:-with chunked prefill}"
      "$bin" load "${common[@]}" --qps "${SERVE_QPS:-4,16}" --drain "${SERVE_DRAIN:-20}" \
          --slo-ttft-p99-ms "${SLO_TTFT:-500}" --slo-tpot-p99-ms "${SLO_TPOT:-50}" $chunking ${SERVE_ARGS:-} 2>&1 || rc=1
    done
  elif [ "$step" = plan ]; then
    log "capacity of ${PLAN_MODEL:-bert_base} on $dev within p99 ${SLO_P99:-50} ms, beside the language model's"
    "$bin" load --model "${PLAN_MODEL:-bert_base}" --dtype bf16 --device "$dev" --search --slo-p99-ms "${SLO_P99:-50}" \
        --min-requests "${PLAN_REQUESTS:-2000}" --resolution 10 --out "$res" 2>&1 | grep -E "^capacity|^note|error" || rc=1
  elif [ "$step" = search ]; then
    log "serving $dev: search within TTFT p99 ${SLO_TTFT:-500} ms, TPOT p99 ${SLO_TPOT:-50} ms"
    "$bin" load "${common[@]}" --search --slo-ttft-p99-ms "${SLO_TTFT:-500}" --slo-tpot-p99-ms "${SLO_TPOT:-50}" \
        --max-steps "${SERVE_STEPS:-8}" --drain "${SERVE_DRAIN:-20}" ${SERVE_ARGS:-} 2>&1 || rc=1
  else
    log "serving $dev: ${SERVE_QPS:-4,16} requests/s"
    "$bin" load "${common[@]}" --qps "${SERVE_QPS:-4,16}" --drain "${SERVE_DRAIN:-20}" ${SERVE_ARGS:-} 2>&1 || rc=1
  fi
done
done
log "MPS after"; mps_servers
if [[ " ${STEP:-rates} " == *" plan "* ]]; then
  log "a plan for ${PLAN_DEMAND:-llama_3_2_1b=100,bert_base=3000}"
  "$bin" capacity --gpu h100-80gb --from "$res" --demand "${PLAN_DEMAND:-llama_3_2_1b=100,bert_base=3000}" \
      --slo-p99-ms "${SLO_P99:-50}" --slo-ttft-p99-ms "${SLO_TTFT:-500}" --slo-tpot-p99-ms "${SLO_TPOT:-50}" 2>&1 || rc=1
  "$bin" report "$res" --out "$res/report.html" 2>&1 | tail -1
fi
"$bin" check "$res" 2>&1 | tail -3
python3 - "$res" <<'PY' | tee "$out/serving.md"
import sys, os, pyarrow.parquet as pq
d = sys.argv[1]
rows = pq.read_table(f"{d}/serve").to_pylist() if os.path.isdir(f"{d}/serve") else []
print("| target | chunked | kv blocks | offered/s | finished | achieved/s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | batch mean/max | KV mean/max | preempt | meets | verdict |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"
for r in sorted(rows, key=lambda r: (r["target"], r["started_at"])):
    print(f"| {r['target']} | {r['chunked_prefill']} | {r['kv_blocks']} | {r['offered_qps']:.2f} | {r['finished']}/{r['requests']} | {r['achieved_qps']:.2f} | {r['output_tokens_per_s']:.0f} | "
          f"{f(r['ttft_p50_ms'])}/{f(r['ttft_p99_ms'])} | {f(r['tpot_p50_ms'],2)}/{f(r['tpot_p99_ms'],2)} | {r['batch_mean']:.1f}/{r['batch_max']} | "
          f"{r['kv_occupancy_mean']:.2f}/{r['kv_occupancy_max']:.2f} | {r['preemptions']} | {r['meets_slo']} | {r['verdict']} |")
if os.path.isdir(f"{d}/serve_capacity"):
    for c in pq.read_table(f"{d}/serve_capacity").to_pylist():
        print(f"capacity {c['target']} ({c['sweep']}): {c['capacity_qps']} requests/s ({c['steps']} steps; bracket {c['bracket_low_qps']}..{c['bracket_high_qps']}; {c['note']})")
PY
[ -n "${OUT:-}" ] && tar czf "$OUT/serving-results.tgz" -C "$out" serving
exit $rc
fi

if [ "$mode" = decoders ] && [ "${STEP:-truth}" = slices ]; then
rc=0
log "MPS before"; mps_servers
log "language models on the whole GPU and emulated slices (benches/decoder_slices.toml), at most ${DEC_SECS:-480} s"
timeout "${DEC_SECS:-480}" "$bin" sweep benches/decoder_slices.toml --out "$out/slices" 2>&1 | grep -Ev "^plot:" || rc=1
log "MPS after"; mps_servers
"$bin" report "$out/slices" > "$out/report.txt" 2>&1 || rc=1; tail -2 "$out/report.txt"
"$bin" compare "$out/slices" --baseline target=full --target target=1g 2>&1 | head -20
python3 - "$out/slices" <<'PY' | tee "$out/slices.md"
import sys, pyarrow.parquet as pq
rows = pq.read_table(f"{sys.argv[1]}/runs").to_pylist()
full = {(r["model"], r["batch"]): r["decode_tokens_per_s"] for r in rows if r["target"] == "full" and r["status"] == "ok"}
print("| target | model | batch | TTFT p50 ms | decode step p50 ms | decode tokens/s | / full | measured bandwidth GB/s | verdict |")
print("|---|---|---|---|---|---|---|---|---|")
for r in sorted(rows, key=lambda r: (r["model"], r["batch"], r["target"])):
    if r["status"] != "ok":
        print(f"| {r['target']} | {r['model']} | {r['batch']} | | | | | | {r['status']}: {(r['error'] or '')[:300]} |"); continue
    f = full.get((r["model"], r["batch"]))
    bw = r["measured_bandwidth_gbps"]
    print(f"| {r['target']} | {r['model']} | {r['batch']} | {r['ttft_p50_ms']:.2f} | {r['p50_ms']:.2f} | {r['decode_tokens_per_s']:.1f} | "
          f"{(r['decode_tokens_per_s'] / f) if f else float('nan'):.2f} | {bw if bw is None else round(bw)} | {r['verdict']} |")
PY
exit $rc
fi

if [ "$mode" = decoders ]; then
rc=0
log "decoders against transformers: logits and greedy tokens, f32 and bf16 (benches/decoder_truth.py)"
unpack "$(shipped decode_logits)" /tmp/decode_logits
python3 benches/decoder_truth.py --bin /tmp/decode_logits --work /tmp/decoder-truth 2>&1 | grep -v "^ *warnings.warn" | tee "$out/decoder-truth.txt" || rc=1
log "generate: presets from seeded weights, prompt 512, 128 output tokens, batch 1 and 8, bf16"
"$bin" run --model llama_3_2_1b,qwen2_5_1_5b --dtype bf16 --batch 1,8 --prompt-len 512 --output-len 128 \
    --warmup 1 --iters 5 --device "$uuid" --out "$out/generate" 2>&1 | grep -Ev "^plot:" || rc=1
log "generate: the same with a paged KV cache (blocks of 16)"
"$bin" run --model llama_3_2_1b --dtype bf16 --batch 1,8 --prompt-len 512 --output-len 128 --kv-layout paged \
    --warmup 1 --iters 5 --device "$uuid" --out "$out/generate" 2>&1 | grep -Ev "^plot:" || rc=1
log "generate: the folder transformers wrote, as a user's own checkpoint (hf:DIR)"
"$bin" run --model hf:/tmp/decoder-truth/llama_3_2_1b --dtype bf16 --batch 1 --prompt-len 512 --output-len 128 \
    --warmup 1 --iters 3 --device "$uuid" --out "$out/generate" 2>&1 | grep -Ev "^plot:" || rc=1
log "generate: Llama-3.1-8B on the whole GPU, batch 1"
"$bin" run --model llama_3_1_8b --dtype bf16 --batch 1 --prompt-len 512 --output-len 128 \
    --warmup 1 --iters 3 --device "$uuid" --out "$out/generate" 2>&1 | grep -Ev "^plot:" || rc=1
log "the memory estimate: Llama-3.1-8B bf16 on an emulated 1g.10gb must be refused before it builds"
log "MPS before"; mps_servers
if "$bin" run --model llama_3_1_8b --dtype bf16 --batch 1 --device mps:1g.10gb --out "$out/refused" > "$out/refused.txt" 2>&1; then
    echo "NOT REFUSED"; rc=1
fi
cat "$out/refused.txt"
log "MPS after"; mps_servers
python3 - "$out/generate" <<'PY' | tee "$out/generate.md"
import sys, pyarrow.parquet as pq
rows = pq.read_table(f"{sys.argv[1]}/runs").to_pylist()
print("| model | kv layout | batch | prompt | output | TTFT p50 ms | decode step p50 ms | p99 ms | decode tokens/s | prefill tokens/s | KV cache MiB | device memory max MiB | verdict |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    if r["status"] not in (None, "ok"):
        print(f"| {r['model']} | {r['kv_layout']} | {r['batch']} | | | | | | | | | | {r['status']}: {r['error']} |"); continue
    print(f"| {r['model']} | {r['kv_layout']} | {r['batch']} | {r['prompt_len']} | {r['output_len']} | {r['ttft_p50_ms']:.2f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
          f"{r['decode_tokens_per_s']:.1f} | {r['prefill_tokens_per_s']:.0f} | {r['kv_cache_bytes'] / 2**20:.1f} | {r['fb_used_max_mib']} | {r['verdict']} |")
PY
exit $rc
fi

if [ "$mode" = graphs ]; then
gpu_tests graphs; rc=$?
log "MPS before: servers on the GPU and MPS processes"; mps_servers
log "batch-1 latency, bf16: the whole GPU against MPS caps of a 1g and a 3g slice, CUDA graphs on and off"
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)" in
    *H200*) slices="1g.18gb 3g.71gb" ;;
    *) slices="1g.10gb 3g.40gb" ;;
esac
for g in on off; do
    for dev in "$uuid" $(printf 'mps:%s ' $slices); do
        "$bin" run --model resnet50,bert_base --mode infer --dtype bf16 --batch 1 --device "$dev" --cuda-graphs $g \
            --warmup-secs 1 --duration 3 --out "$out/latency" 2>&1 | grep -E "^\[|warning|error"
    done
done
log "MPS after: servers on the GPU and MPS processes"; mps_servers
python3 - "$out/latency" <<'PY' | tee "$out/latency.txt"
import sys, pyarrow.parquet as pq
rows = [r for r in pq.read_table(f"{sys.argv[1]}/runs").to_pylist() if r["status"] in (None, "ok")]
def graphs(r): return r["kernel_options"].split("graphs=")[1].split(";")[0]
def where(r): return r["emulated_profile"] or "whole GPU"
full = {(r["model"], graphs(r)): r["p50_ms"] for r in rows if not r["emulated_profile"]}
print(f"{'model':<10} {'graphs':<6} {'device':<10} {'SM share':>8} {'p50 ms':>8} {'p99 ms':>8} {'/whole':>7}  verdict")
for r in sorted(rows, key=lambda r: (r["model"], graphs(r), r["mps_share_pct"] or 100)):
    k = (r["model"], graphs(r))
    rel = r["p50_ms"] / full[k] if k in full else float("nan")
    print(f"{r['model']:<10} {graphs(r):<6} {where(r):<10} {str(r['mps_share_pct'] or 100):>8} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {rel:>7.2f}  {r['verdict']}")
PY
cp "$out/latency.txt" "${OUT:-/tmp}/" 2>/dev/null
exit $rc
fi

if [ "$mode" = cellcost ]; then
log "per-cell cost: a child process per cell (sweep) against one process (run), ResNet-50 and BERT-base"
for round in 1 2; do
    WARMUP_SECS=2 DURATION_SECS=3 bash benches/cell_cost.sh "$bin" "$uuid" resnet50,bert_base 1,32 "$out/cellcost-$round" | tee -a "$out/cellcost.txt"
done
cp "$out/cellcost.txt" "${OUT:-/tmp}/" 2>/dev/null
exit 0
fi

if [ "$mode" = mig ]; then
log "MIG profiles: migprof (live NVML) against nvidia-smi mig -lgip/-lgipp"
"$bin" profiles | tee "$out/migprof-profiles.txt"
python3 scripts/check_mig_profiles.py "$out/migprof-profiles.txt" "$out/nvidia-smi-mig-lgip.txt" "$out/nvidia-smi-mig-lgipp.txt"
log "nvidia-smi's -cgi syntax (placement after a colon)"
nvidia-smi mig -h 2>&1 | grep -i -A3 "create-gpu-instance" | head -8
# MIG state as nvidia-smi sees it, before and after: the dry run must leave it as it was.
state() { nvidia-smi --query-gpu=index,mig.mode.current,mig.mode.pending --format=csv; nvidia-smi mig -lgi 2>&1; nvidia-smi mig -lci 2>&1; }
state > "$out/mig-before.txt"
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)" in
    *H200*) layout="3g.71gb: 1, 2g.35gb: 1, 1g.18gb: 2" ;;
    *) layout="3g.40gb: 1, 2g.20gb: 1, 1g.10gb: 2" ;;
esac
printf 'version: v1\nmig-configs:\n  mixed:\n    - devices: [0]\n      mig-enabled: true\n      mig-devices: {%s}\n' "$layout" > "$out/layout.yaml"
cat "$out/layout.yaml"
log "mig apply (dry run: no --yes)"; "$bin" mig apply "$out/layout.yaml"; echo "exit $?"
log "mig export"; "$bin" mig export; echo "exit $?"
log "mig destroy (dry run)"; "$bin" mig destroy; echo "exit $?"
state > "$out/mig-after.txt"
diff "$out/mig-before.txt" "$out/mig-after.txt" && echo "MIG state unchanged:" && cat "$out/mig-after.txt"
exit 0
fi

if [ "$mode" = ab ]; then
models="${MODELS:-bert_base}"; batches="${BATCHES:-128}"; modes="${MODES:-infer}"; dtypes="${DTYPES:-bf16}"
cells=(--model "$models" --mode "$modes" --dtype "$dtypes" --batch "$batches" --warmup 5 --iters 20 --device "$uuid")
other="$bin"
if [ -n "${AB_BIN:-}" ]; then other=/tmp/migprof-ab; unpack "$AB_BIN" "$other"; fi
[ -n "${AB_ARGS:-}${AB_BIN:-}" ] || { echo "ab: set AB_ARGS (flags, e.g. a kernel option) or AB_BIN (a build) to compare"; exit 2; }
for round in 1 2; do
    log "round $round: with ${AB_ARGS:-} ${AB_BIN:-}"
    # AB_ARGS is split into words on purpose: several flags.
    "$other" run "${cells[@]}" ${AB_ARGS:-} --out "$out/with-$round" 2>&1 | grep -E "^\[|error"
    log "round $round: without it"
    "$bin" run "${cells[@]}" --out "$out/without-$round" 2>&1 | grep -E "^\[|error"
done
python3 benches/pytorch_reference.py --models "$models" --modes "$modes" --dtypes "$dtypes" --batches "$batches" --warmup 5 --iters 20 > "$out/pytorch.jsonl"
for run in with-1 without-1 with-2 without-2; do
    log "$run against PyTorch"
    python3 benches/compare.py "$out/$run" "$out/pytorch.jsonl" | tee "$out/compare-$run.txt"
done
exit 0
fi

if [ "$mode" = mps ]; then
log "MPS before: servers on the GPU and MPS processes"; mps_servers
log "migprof devices (MPS availability)"; "$bin" devices | tail -3
log "a run beside another process on the GPU: the verdict says shared"
"$bin" run --model resnet50 --dtype bf16 --batch 32 --warmup-secs 1 --duration 8 --device "$uuid" --out "$out/busy" > "$out/neighbour.txt" 2>&1 &
sleep 4
"$bin" run --model resnet50 --dtype bf16 --batch 32 --warmup-secs 1 --duration 3 --device "$uuid" --out "$out/shared" 2>&1 | grep -E "^\[|warning"
wait
python3 - "$out" <<'PY'
import sys, pyarrow.parquet as pq
for r in pq.read_table(f"{sys.argv[1]}/shared/runs").to_pylist():
    print({k: r[k] for k in ("verdict", "verdict_flags", "other_processes", "throttle_share", "power_cap_share")})
for r in pq.read_table(f"{sys.argv[1]}/shared/metrics").to_pylist()[:3]:
    print("compute_processes per reading:", r["compute_processes"])
PY
log "run --device mps:3g.40gb (the daemon started and stopped by run)"
"$bin" run --model resnet50 --dtype bf16 --batch 32 --warmup-secs 1 --duration 2 --device "mps:3g.40gb" --out "$out/mps-run" 2>&1 | grep -E "MPS|^\[|warning|error"
log "the emulated-slice sweep"
( cd "$out" && timeout "${MPS_SECS:-420}" "$bin" sweep "$OLDPWD/benches/mps_slices.toml" --out "$out/mps-sweep" 2>&1 | grep -vE "^\s*$" | tail -60 )
log "MPS after: servers on the GPU and MPS processes"; mps_servers
python3 - "$out" <<'PY' | tee "$out/mps.txt"
import sys, collections, pyarrow.parquet as pq
rows = [r for r in pq.read_table(f"{sys.argv[1]}/mps-sweep/runs").to_pylist() if r["status"] == "ok"]
full = {(r["model"], r["mode"], r["dtype"], r["batch"]): r["throughput"] for r in rows if r["target"] == "full"}
print(f"{'target':<6} {'share%':>6} {'SMs':>4} {'measured':>8} {'mem MiB':>8} {'model':<9} {'mode':<5} {'batch':>5} {'samples/s':>10} {'/full':>6}  verdict")
for r in sorted(rows, key=lambda r: (r["model"], r["mode"], r["batch"], r["sm_count"] or 0)):
    k = (r["model"], r["mode"], r["dtype"], r["batch"])
    rel = r["throughput"] / full[k] if k in full else float("nan")
    print(f"{r['target']:<6} {str(r['mps_share_pct'] or 100):>6} {str(r['profile_sms'] or ''):>4} {str(r['measured_sms'] or ''):>8} {str(r['measured_memory_mib'] or ''):>8} "
          f"{r['model']:<9} {r['mode']:<5} {r['batch']:>5} {r['throughput']:>10.1f} {rel:>6.2f}  {r['verdict']} {r['verdict_flags']}")
PY
tar czf "${OUT:-/tmp}/mps-results.tgz" -C "$out" mps-sweep mps-run shared busy 2>/dev/null
cp "$out/mps.txt" "${OUT:-/tmp}/" 2>/dev/null
exit 0
fi

if [ "$mode" = fidelity ]; then
log "MPS before: servers on the GPU and MPS processes"; mps_servers
export MIGPROF_CACHE_DIR="$out/cache"
if [ "${STEP:-sweep}" = capacity ]; then
    for dev in mps:1g.10gb mps-mem:1g.10gb; do
        log "load --search on $dev"
        "$bin" load --model resnet50 --dtype bf16 --device "$dev" --search --slo-p99-ms 50 --max-batch 32 --out "$out/capacity" 2>&1 | grep -E "MPS|capacity|warning|error" | tail -8
        log "MPS processes right after: $(mps_servers | tr '\n' ' ')"
    done
    log "capacity, default"
    "$bin" capacity --gpu h100-80gb --from "$out/capacity" --demand resnet50=5000 --slo-p99-ms 50 2>&1 | tee "$out/capacity-plan.txt"
    log "capacity, --memory-emulation alone"
    "$bin" capacity --gpu h100-80gb --from "$out/capacity" --demand resnet50=5000 --slo-p99-ms 50 --memory-emulation alone 2>&1 | tee -a "$out/capacity-plan.txt"
    log "MPS after: servers on the GPU and MPS processes"; mps_servers
    cp "$out/capacity-plan.txt" "${OUT:-/tmp}/" 2>/dev/null
    tar czf "${OUT:-/tmp}/capacity-results.tgz" -C "$out" capacity 2>/dev/null
    exit 0
fi
if [ "${STEP:-sweep}" = groups ]; then
    ( cd "$out" && timeout "${FID_SECS:-300}" "$bin" sweep "$OLDPWD/benches/mps_mem_groups.toml" --out "$out/groups" 2>&1 | grep -vE "^\s*$" | tail -30 )
    log "MPS after: servers on the GPU and MPS processes"; mps_servers
    python3 - "$out/groups" <<'PY'
import sys, pyarrow.parquet as pq
for r in sorted(pq.read_table(f"{sys.argv[1]}/runs").to_pylist(), key=lambda r: r["started_at"]):
    print(r["target"], r["concurrency_group"], r["status"], r["calibration"], r["memory_share_gbps"], r["measured_bandwidth_gbps"],
          r["alone_bandwidth_gbps"], r["neighbour_blocks"], r["neighbour_pause_ns"], r["neighbour_sms"], r["throughput"], r["verdict"])
PY
    tar czf "${OUT:-/tmp}/groups-results.tgz" -C "$out" groups cache 2>/dev/null
    exit 0
fi
if [ "${STEP:-sweep}" = probe ]; then
    for dev in mps:1g.10gb mps-mem:1g.10gb mps-mem:2g.20gb mps-mem:3g.40gb mps-mem:4g.40gb mps-mem:7g.80gb mps-mem:1g.10gb; do
        log "run --device $dev"
        "$bin" run --model resnet50 --dtype bf16 --batch 32 --warmup-secs 1 --duration 2 --device "$dev" --out "$out/probe" 2>&1 | grep -E "MPS|neighbour|calibrat|^\[|warning|error"
        log "MPS processes right after: $(mps_servers | tr '\n' ' ')"
    done
    cat "$out/cache/memory-calibration.json"
else
    mkdir -p "$out/fidelity"
    [ -d .dist/fidelity-results ] && cp -r .dist/fidelity-results/. "$out/fidelity/"
    ( cd "$out" && timeout "${FID_SECS:-480}" "$bin" sweep "$OLDPWD/${FID_TOML:-benches/slice_fidelity.toml}" --jobs "${FID_JOBS:-1}" --out "$out/fidelity" 2>&1 | grep -vE "^\s*$" | tee "$out/fidelity-sweep.log" | tail -30 )
    cp "$out/cache/memory-calibration.json" "$out/fidelity/" 2>/dev/null
fi
log "MPS after: servers on the GPU and MPS processes"; mps_servers
if [ "${STEP:-sweep}" = probe ]; then dir="$out/probe"; else dir="$out/fidelity"; fi
python3 benches/slice_fidelity.py "$dir" 2>&1 | tee "$out/fidelity.txt"
tar czf "${OUT:-/tmp}/fidelity-results.tgz" -C "$out" fidelity probe cache 2>/dev/null
cp "$out/fidelity.txt" "${OUT:-/tmp}/" 2>/dev/null
exit 0
fi

if [ "$mode" = best ]; then
models="${MODELS:-resnet50,bert_base}"; batches="${BATCHES:-1}"; dtypes="${DTYPES:-bf16}"; modes="${MODES:-infer}"
log "the GPU's measured matmul peak (for MFU)"
python3 benches/peak_flops.py > "$out/peak.json"; cat "$out/peak.json"
pairs=()
for round in $(seq 1 "${ROUNDS:-1}"); do
    log "round $round: migprof: $models $modes, $dtypes, batch $batches${TRAIN_BATCHES:+; train at $TRAIN_BATCHES}"
    "$bin" run --model "$models" --mode "$modes" --dtype "$dtypes" --batch "$batches" --device "$uuid" --warmup-secs 1 --duration 3 --out "$out/best-$round" 2>&1 | grep -E "^\[|error"
    [ -n "${TRAIN_BATCHES:-}" ] && "$bin" run --model "$models" --mode train --dtype "$dtypes" --batch "$TRAIN_BATCHES" --device "$uuid" --warmup-secs 1 --duration 3 --out "$out/best-$round" 2>&1 | grep -E "^\[|error"
    log "round $round: PyTorch, every variant (compile time apart; the second round reuses Inductor's cache)"
    python3 benches/pytorch_reference.py --models "$models" --modes "$modes" --dtypes "$dtypes" --batches "$batches" --variants eager,bf16w,cl,compile --warmup 10 --iters 50 > "$out/pytorch-$round.jsonl"
    [ -n "${TRAIN_BATCHES:-}" ] && python3 benches/pytorch_reference.py --models "$models" --modes train --dtypes "$dtypes" --batches "$TRAIN_BATCHES" --variants eager,bf16w,cl,compile --warmup 10 --iters 50 >> "$out/pytorch-$round.jsonl"
    python3 benches/compare.py "$out/best-$round" "$out/pytorch-$round.jsonl" --peak "$out/peak.json" | tee "$out/compare-best-$round.txt"
    pairs+=("$out/best-$round" "$out/pytorch-$round.jsonl")
done
log "the rounds together"
python3 benches/rounds.py "${pairs[@]}" --peak "$out/peak.json" | tee "$out/rounds.txt"
python3 benches/rounds.py "${pairs[@]}" --peak "$out/peak.json" --markdown > "$out/rounds.md"
cp "$out"/pytorch-*.jsonl "$out"/compare-best-*.txt "$out"/rounds.txt "$out"/rounds.md "${OUT:-/tmp}/" 2>/dev/null
exit 0
fi

if [ "$mode" = mixed ]; then
models="${MODELS:-resnet50,vit_b_16,swin_t,bert_base}"; dtypes="${DTYPES:-bf16,f16}"; round="${ROUND:-1}"
if [ "${STEP:-1}" = 1 ]; then
    rc=0
    log "GPU tests: the master-weight kernels (GRAPHS=1: and every CUDA-graph test)"
    unpack "$(shipped kernels-test)" /tmp/kernels-test
    /tmp/kernels-test --include-ignored --nocapture --test-threads 1 master > "$out/kernels-masters.txt" 2>&1 || rc=1
    grep -E "^test |panicked|masters|test result" "$out/kernels-masters.txt"
    [ -n "${GRAPHS:-}" ] && { gpu_tests graphs || rc=1; }
    log "update error against f64: PyTorch autocast and migprof, 1 and 3 SGD steps, one process per model"
    unpack "$(shipped update_steps)" /tmp/update_steps
    # The weights files (hundreds of MB a model) stay out of $out, which is archived at the end.
    work=/tmp/update-error; rm -rf "$work"
    for m in ${models//,/ }; do
        (cd benches && python3 update_error.py --bin /tmp/update_steps --models "$m" --work "$work" > "$out/update-error-$m.log" 2>&1) &
    done
    wait
    tail -n 3 "$out"/update-error-*.log
    cp "$work"/*.jsonl "$out/"
    (cd benches && python3 update_error.py --report --work "$work" --markdown) | tee "$out/update-error.md" || rc=1
    cp "$out/update-error.md" "$work"/*.jsonl "$out/kernels-masters.txt" "${OUT:-/tmp}/" 2>/dev/null
    log "MPS after"; mps_servers
    exit $rc
fi
log "round $round: migprof training at batch 32, $dtypes, over f32 masters and with none"
for masters in f32 none; do
    "$bin" run --model "$models" --mode train --dtype "$dtypes" --batch 32 --master-weights "$masters" --device "$uuid" --warmup-secs 1 --duration 3 --out "$out/train-$round" > "$out/migprof-train-$round-$masters.log" 2>&1
    tail -n 25 "$out/migprof-train-$round-$masters.log"
done
[ -n "${NO_PYTORCH:-}" ] && { tar czf "${OUT:-/tmp}/train-$round.tgz" -C "$out" "train-$round"; exit 0; }
log "round $round: PyTorch training variants (compile time apart)"
python3 benches/pytorch_reference.py --models "$models" --modes train --dtypes "$dtypes" --batches 32 --variants eager,fused,cl,compile --warmup 10 --iters 30 > "$out/pytorch-train-$round.jsonl"
python3 benches/compare.py "$out/train-$round" "$out/pytorch-train-$round.jsonl" | tee "$out/compare-train-$round.txt"
python3 benches/compare.py "$out/train-$round" "$out/pytorch-train-$round.jsonl" --memory | tee "$out/memory-train-$round.txt"
log "round $round: the cost of the masters (f32 masters / none, throughput and sampled device memory)"
python3 - "$out/train-$round" <<'PY' | tee "$out/masters-cost-$round.txt"
import sys
import pyarrow.parquet as pq
rows = pq.read_table(f"{sys.argv[1]}/runs").to_pylist()
by = {(r["model"], r["dtype"], r["master_weights"]): r for r in rows}
for (model, dtype, m), r in sorted(by.items()):
    if m == "f32" and (model, dtype, "none") in by:
        n = by[(model, dtype, "none")]
        print(f"{model:<10} {dtype:<5} masters {r['throughput']:9.1f}/s {r['fb_used_max_mib']:7.0f} MiB  none {n['throughput']:9.1f}/s {n['fb_used_max_mib']:7.0f} MiB"
              f"  throughput masters/none {r['throughput'] / n['throughput']:.3f}  loss_scale {r['loss_scale']}  skipped {r['skipped_steps']}")
PY
tar czf "${OUT:-/tmp}/train-$round.tgz" -C "$out" "train-$round"
cp "$out"/pytorch-train-$round.jsonl "$out"/compare-train-$round.txt "$out"/memory-train-$round.txt "$out"/masters-cost-$round.txt "${OUT:-/tmp}/" 2>/dev/null
exit 0
fi

if [ "$mode" = memory ]; then
models="${MODELS:-resnet50,vit_b_16,swin_t,bert_base}"; batches="${BATCHES:-32}"; dtypes="${DTYPES:-bf16}"; modes="${MODES:-infer,train}"
sides=(this); [ -n "${AB_BIN:-}" ] && { unpack "$AB_BIN" /tmp/migprof-ab; sides+=(before); }
# Each cell in a process of its own, on both sides: a process's later cells would count what its
# earlier ones left (loaded kernels, libraries' caches), and a user measuring one cell runs one.
# On PyTorch's side one process runs the cell's variants in turn (eager, bf16 weights,
# channels_last; not torch.compile, whose CUDA graphs hold more), so a later variant counts the
# kernels an earlier one loaded. compare.py's ratio is against the fastest variant, and its
# --memory table's against the leanest too.
for m in ${models//,/ }; do for mo in ${modes//,/ }; do for d in ${dtypes//,/ }; do for bt in ${batches//,/ }; do
    for side in "${sides[@]}"; do
        b="$bin"; [ "$side" = before ] && b=/tmp/migprof-ab
        log "$side build: $m $mo $d batch $bt (MIGPROF_MEMORY_LOG: where the memory went)"
        MIGPROF_MEMORY_LOG=1 "$b" run --model "$m" --mode "$mo" --dtype "$d" --batch "$bt" --device "$uuid" --warmup 5 --iters 20 --out "$out/memory-$side" 2>&1 | grep -E "^\[|^memory|error"
    done
    log "PyTorch: $m $mo $d batch $bt, every variant but torch.compile"
    python3 benches/pytorch_reference.py --models "$m" --modes "$mo" --dtypes "$d" --batches "$bt" --variants eager,bf16w,cl --warmup 5 --iters 10 >> "$out/pytorch.jsonl"
done; done; done; done
for side in "${sides[@]}"; do
    log "$side build against PyTorch (MiB columns)"
    python3 benches/compare.py "$out/memory-$side" "$out/pytorch.jsonl" | tee "$out/compare-memory-$side.txt"
    python3 benches/compare.py "$out/memory-$side" "$out/pytorch.jsonl" --memory | tee "$out/memory-cells-$side.txt"
done
cp "$out"/compare-memory-*.txt "$out"/memory-cells-*.txt "$out/pytorch.jsonl" "${OUT:-/tmp}/" 2>/dev/null
exit 0
fi

if [ "$mode" = capacity ]; then
res=/tmp/capacity-results; mkdir -p "$res"
log "MPS before"; mps_servers
( cd "$out" && timeout "${CAP_SECS:-540}" "$bin" sweep "$OLDPWD/benches/capacity_slices.toml" --out "$res" 2>&1 | grep -vE "^\s*$" | tail -40 )
log "MPS after"; mps_servers
log "the plan"
"$bin" capacity --gpu h100-80gb --from "$res" --demand resnet50=20000,bert_base=3000 --slo-p99-ms 50 --emit-layouts "$out/layouts.yaml" 2>&1 | tee "$out/capacity.txt"
"$bin" capacity --gpu h100-80gb --from "$res" --demand resnet50=20000,bert_base=3000 --slo-p99-ms 50 --json > "$out/capacity.json" 2>&1
"$bin" report "$res" --out "$out/report.html" 2>&1 | tail -2
python3 - "$res" <<'PY' | tee "$out/load-steps.txt"
import sys, pyarrow.parquet as pq
for r in sorted(pq.read_table(f"{sys.argv[1]}/load").to_pylist(), key=lambda r: (r["model"], r["profile"], r["started_at"])):
    print(f"{r['profile']:<8} {r['model']:<10} offered {r['offered_qps']:>8.1f} served {r['achieved_qps']:>8.1f} n {r['requests']:>6} "
          f"p99 {r['p99_ms']:>7.2f} [{r['p99_ms_ci_low'] or float('nan'):.2f}, {r['p99_ms_ci_high'] or float('nan'):.2f}] batch {r['mean_batch']:>5.1f} "
          f"queue {r['queue_mean']:>6.1f}/{r['queue_max']:<5} {r['ending']:<8} meets {r['meets_slo']}")
PY
tar czf "${OUT:-/tmp}/capacity-results.tgz" -C /tmp capacity-results 2>/dev/null
cp "$out/capacity.txt" "$out/capacity.json" "$out/layouts.yaml" "$out/load-steps.txt" "$out/report.html" "${OUT:-/tmp}/" 2>/dev/null
exit 0
fi

if [ "$mode" = groups ]; then
log "MPS before"; mps_servers
( cd "$out" && timeout "${MPS_SECS:-300}" "$bin" sweep "$OLDPWD/benches/mps_groups.toml" --out "$out/groups" 2>&1 | grep -vE "^\s*$" | tail -30 )
log "MPS after"; mps_servers
python3 - "$out" <<'PY' | tee "$out/groups.txt"
import sys, pyarrow.parquet as pq
rows = pq.read_table(f"{sys.argv[1]}/groups/runs").to_pylist()
alone = {(r["model"], r["mode"], r["dtype"], r["batch"], r["emulated_profile"]): r["throughput"] for r in rows if r["status"] == "ok" and not r["concurrency_group"]}
for r in rows:
    k = (r["model"], r["mode"], r["dtype"], r["batch"], r["emulated_profile"])
    ratio = f"{r['throughput'] / alone[k]:.2f} of alone" if r["status"] == "ok" and r["concurrency_group"] and k in alone else ""
    tp = f"{r['throughput']:.1f}/s" if r["throughput"] else ""
    print(r["target"], r["concurrency_group"], r["model"], r["mode"], r["batch"], r["status"], tp, ratio, r["verdict"], r["verdict_flags"], r["measured_sms"], (r["error"] or "")[:120])
PY
tar czf "${OUT:-/tmp}/groups-results.tgz" -C "$out" groups 2>/dev/null
cp "$out/groups.txt" "${OUT:-/tmp}/" 2>/dev/null
exit 0
fi

if [ "$mode" = before ]; then
[ -n "${BEFORE_GZ:-}" ] || { echo "before: set BEFORE_GZ to the gzipped build before the change"; exit 2; }
models="${MODELS:-resnet50,vit_b_16,swin_t,bert_base}"; batches="${BATCHES:-1,8,32,128}"
dtypes="${DTYPES:-f32,bf16}"; train_batches="${TRAIN_BATCHES:-32}"
unpack "$BEFORE_GZ" /tmp/migprof-before
for side in before after; do
    b="$bin"; [ "$side" = before ] && b=/tmp/migprof-before
    log "$side: the comparison matrix"
    "$b" run --model "$models" --mode infer --dtype "$dtypes" --batch "$batches" --warmup 5 --iters 20 --device "$uuid" --out "$out/$side" 2>&1 | grep -E "^\[|error|warning"
    "$b" run --model "$models" --mode train --dtype "$dtypes" --batch "$train_batches" --warmup 3 --iters 10 --device "$uuid" --out "$out/$side" 2>&1 | grep -E "^\[|error|warning"
done
log "pytorch: the same matrix"
python3 benches/pytorch_reference.py --models "$models" --modes infer --dtypes "$dtypes" --batches "$batches" --warmup 5 --iters 20 > "$out/pytorch.jsonl"
python3 benches/pytorch_reference.py --models "$models" --modes train --dtypes "$dtypes" --batches "$train_batches" --warmup 3 --iters 10 >> "$out/pytorch.jsonl"
for side in before after; do
    log "$side against PyTorch"
    python3 benches/compare.py "$out/$side" "$out/pytorch.jsonl" | tee "$out/compare-$side.txt"
done
log "after / before, per cell (throughput)"
python3 - "$out" <<'PY' | tee "$out/before-after.txt"
import sys, statistics, pyarrow.parquet as pq
out = sys.argv[1]
key = lambda r: (r["model"], r["mode"], r["dtype"], r["batch"])
side = {s: {key(r): r["throughput"] for r in pq.read_table(f"{out}/{s}/runs").to_pylist()} for s in ("before", "after")}
ratios = []
for k in sorted(side["after"]):
    if k in side["before"]:
        r = side["after"][k] / side["before"][k]
        ratios.append(r)
        print(f"{k[0]:<10} {k[1]:<5} {k[2]:<5} {k[3]:>4}  before {side['before'][k]:10.1f}/s  after {side['after'][k]:10.1f}/s  after/before {r:5.2f}")
print(f"{len(ratios)} cells: after/before median {statistics.median(ratios):.3f}, min {min(ratios):.2f}, max {max(ratios):.2f}")
PY
cp "$out"/compare-*.txt "$out/before-after.txt" "${OUT:-/tmp}/" 2>/dev/null
exit 0
fi

if [ "$mode" = quick ] || [ "$mode" = full ]; then
log "every family, mode and dtype (tiny presets)"
"$bin" run --model resnet_tiny,vit_tiny,swin_tiny,bert_tiny --mode infer,train --dtype f32,bf16,f16 \
    --batch 4 --iters 5 --warmup 2 --device "$uuid" --out "$out/tiny" 2>&1 | tail -30

log "every published model, both modes, bf16, batch 2"
"$bin" run --model resnet18,resnet34,resnet50,resnet101,resnet152,vit_ti_16,vit_s_16,vit_b_16,swin_t,swin_s,swin_b,bert_base,bert_large \
    --mode infer,train --dtype bf16 --batch 2 --iters 5 --warmup 2 --device "$uuid" --out "$out/zoo" 2>&1 | grep -E "^\[|error" | tail -30

fi
[ "$mode" = quick ] && exit 0
if [ "$mode" != sampler ]; then

models="${MODELS:-resnet50,vit_b_16,swin_t,bert_base}"
batches="${BATCHES:-1,8,32,128}"
log "migprof: the comparison matrix"
"$bin" run --model "$models" --mode infer --dtype f32,bf16 --batch "$batches" --warmup 5 --iters 20 --device "$uuid" --out "$out/matrix" 2>&1 | grep -E "^\[|error|warning"
"$bin" run --model "$models" --mode train --dtype f32,bf16 --batch 32 --warmup 3 --iters 10 --device "$uuid" --out "$out/matrix" 2>&1 | grep -E "^\[|error|warning"
log "pytorch: the same matrix"
python3 benches/pytorch_reference.py --models "$models" --modes infer --dtypes f32,bf16 --batches "$batches" --warmup 5 --iters 20 > "$out/pytorch.jsonl"
python3 benches/pytorch_reference.py --models "$models" --modes train --dtypes f32,bf16 --batches 32 --warmup 3 --iters 10 >> "$out/pytorch.jsonl"
log "the GPU's measured matmul peak (for MFU)"
python3 benches/peak_flops.py | tee "$out/peak.json"
python3 benches/compare.py "$out/matrix" "$out/pytorch.jsonl" --peak "$out/peak.json" | tee "$out/compare.txt"
python3 benches/compare.py "$out/matrix" "$out/pytorch.jsonl" --peak "$out/peak.json" --markdown > "$out/compare.md"

fi
if [ "$mode" = full ] || [ "$mode" = matrix ] || [ "$mode" = sampler ]; then
# A GPU-bound, stable workload (ResNet-50 in candle is host-bound and varies 30% run to run, which hides
# any sampler effect): ViT-B/16 bf16 at batch 128, sampler off and at 100 ms, alternated four times.
log "sampler disturbance: vit_b_16 infer bf16 bs128, sampler off / 100 ms, alternated"
for i in 1 2 3 4; do
    for ms in 0 100; do
        "$bin" run --model vit_b_16 --dtype bf16 --batch 128 --warmup-secs 2 --duration 6 --device "$uuid" --sample-interval-ms $ms --out "$out/sampler-$ms" 2>&1 | grep -E "^\["
    done
done
python3 - "$out" <<'PY' | tee "$out/sampler.txt"
import sys, statistics, pyarrow.parquet as pq
out = sys.argv[1]
t = {ms: [r["throughput"] for r in pq.read_table(f"{out}/sampler-{ms}/runs").to_pylist()] for ms in (0, 100)}
off, on = statistics.median(t[0]), statistics.median(t[100])
print("sampler off   :", [round(x, 1) for x in t[0]])
print("sampler 100 ms:", [round(x, 1) for x in t[100]])
print("pairwise on/off:", [round(b / a, 4) for a, b in zip(t[0], t[100])])
print(f"median on/off = {on / off:.4f} ({(on / off - 1) * 100:+.2f}%)")
r = pq.read_table(f"{out}/sampler-100/runs").to_pylist()[-1]
print({k: r[k] for k in ("metric_samples", "fb_used_mean_mib", "fb_used_max_mib", "gract_mean", "gract_std", "sm_util_mean", "tensor_mean", "dram_mean", "gpu_power_mean_w", "gpu_energy_j", "j_per_sample", "sampler_error")})
m = pq.read_table(f"{out}/sampler-100/metrics").to_pylist()
for run in sorted({x["run_id"] for x in m}):
    rows = [x for x in m if x["run_id"] == run]
    gaps = [round(b["t_ms"] - a["t_ms"], 1) for a, b in zip(rows, rows[1:])]
    print(f"{run}: {len(rows)} readings, GPM missing in {sum(x['gract'] is None for x in rows)}, gaps {min(gaps)}..{max(gaps)} ms")
PY
fi
