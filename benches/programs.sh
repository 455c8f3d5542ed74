#!/usr/bin/env bash
# A user's own PyTorch programs under `migprof exec` beside migprof's engine on the same model,
# batch and precision, on each of PROG_DEVICES (default: the whole GPU, then emulated 3g and 1g
# slices of an H200): a torchvision ResNet-50 training script and a Hugging Face BERT-base
# inference script (benches/programs/), each reporting its steps through scripts/migprof_steps.py.
# The ratio program / engine says how far a plan made with migprof's engine stands from the
# user's code. Runs on the GPU machine with the CUDA build at $1 (default /tmp/migprof); results
# in $RES (default /tmp/programs-results), the table by benches/programs.py.
set -uo pipefail
bin="${1:-/tmp/migprof}"
res="${RES:-/tmp/programs-results}"
batch="${PROG_BATCH:-32}"
secs="${PROG_SECS:-10}"
mkdir -p "$res"
for d in ${PROG_DEVICES:-0 mps:3g.71gb mps:1g.18gb}; do
    echo "== $d: resnet50 train bf16 batch $batch, the program, then migprof's engine"
    "$bin" exec --device "$d" --out "$res" --name resnet50 --mode train --dtype bf16 -- \
        python3 benches/programs/resnet50_train.py --batch "$batch" --seconds "$secs" 2>&1 | grep -v "^$"
    "$bin" run --device "$d" --out "$res" --model resnet50 --mode train --dtype bf16 --batch "$batch" \
        --duration "$secs" 2>&1 | tail -n 4
    echo "== $d: bert_base infer bf16 batch $batch seq 128, the program, then migprof's engine"
    "$bin" exec --device "$d" --out "$res" --name bert_base --mode infer --dtype bf16 -- \
        python3 benches/programs/bert_infer.py --batch "$batch" --seconds "$secs" 2>&1 | grep -v "^$"
    "$bin" run --device "$d" --out "$res" --model bert_base --mode infer --dtype bf16 --batch "$batch" \
        --seq-len 128 --duration "$secs" 2>&1 | tail -n 4
done
echo "== compute processes left on the GPU (none expected)"
nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader
ps -eo pid,args | grep "[n]vidia-cuda-mps" || echo "no MPS process"
python3 benches/programs.py "$res"
