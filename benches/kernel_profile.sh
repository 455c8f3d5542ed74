#!/usr/bin/env bash
# Where a migprof workload spends its GPU time, kernel by kernel, with Nsight Compute (ncu, in the
# CUDA toolkit of the GPU machine): the measured iterations only (migprof brackets them with
# cuProfilerStart/Stop; warm-up and cuDNN's algorithm search stay out), per case given as
# "model mode dtype batch"; "pytorch model mode dtype batch" profiles benches/pytorch_reference.py's
# same cell, bracketed the same way, in eager mode, and "pytorch:VARIANT ..." in another of its
# variants (compile, cl, bf16w). Expects .dist/migprof.gz (the CUDA build).
#   bash benches/kernel_profile.sh "vit_b_16 infer bf16 128" "pytorch:compile vit_b_16 infer bf16 128"
set -uo pipefail
bin=/tmp/migprof
gunzip -c "${MIGPROF_GZ:-.dist/migprof.gz}" > "$bin" && chmod +x "$bin"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for case in "$@"; do
    set -- $case
    echo "== $case"
    if [ "${1%%:*}" = pytorch ]; then
        variant=eager
        [ "$1" != pytorch ] && variant=${1#pytorch:}
        shift
        out=/tmp/ncu-pytorch-$variant-$1-$2-$3-$4.csv
        # compile's warm-up must reach its CUDA graphs before the bracket opens.
        cmd=(python3 benches/pytorch_reference.py --models "$1" --modes "$2" --dtypes "$3" --batches "$4"
             --variants "$variant" --warmup "${WARMUP:-3}" --iters "${ITERS:-2}" --profile)
    else
        out=/tmp/ncu-$1-$2-$3-$4.csv
        cmd=("$bin" run --model "$1" --mode "$2" --dtype "$3" --batch "$4" --warmup 2 --iters "${ITERS:-2}"
             --device 0 --out /tmp/ncu-runs)
    fi
    # Every launch is timed on its own (ncu serialises them): the sum is the GPU time of the kernels,
    # without the gaps between them that a host-bound run also has. The clocks are left as they run
    # (ncu would lock them at base otherwise: a change of the card's settings, and every kernel slower).
    "$ncu" --csv --clock-control none --profile-from-start off --metrics gpu__time_duration.sum "${cmd[@]}" > "$out" 2>/tmp/ncu.err \
        || { tail -5 /tmp/ncu.err; continue; }
    python3 benches/ncu_summary.py "$out" --top "${TOP:-20}" --iterations "${ITERS:-2}"
    [ -n "${OUT:-}" ] && cp "$out" "$OUT"/
done
