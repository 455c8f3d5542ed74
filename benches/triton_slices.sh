#!/usr/bin/env bash
# "Triton on a whole GPU against a slice" on a GPU machine with MIG off: a PyTriton server with a
# PyTorch model inside (benches/triton/serve.py) measured by `migprof load --endpoint` on the whole
# GPU and on emulated 3g and 1g slices (the server started by migprof, pinned: the GPU's UUID, or an
# MPS client of migprof's daemon) at concurrency 1-3 and by a capacity search; then, on the whole
# GPU, one server measured in turn by perf_analyzer, by migprof and by Triton's own client
# (benches/triton/closed_loop.py). Run from the repository root with migprof in
# .dist/migprof-server.xz (a stripped release build, xz) and the wheels that benches/triton/wheels.sh
# makes (nvidia-pytriton 0.7.0, numpy 1.26.4, tritonclient 2.60.0 and theirs, for the machine's
# python 3.12) in $WHEELS, both carried to the machine:
#
#   OUT=/tmp/out MODEL=resnet50|bert_base WHEELS=.dist/triton-wheels [PHASES="slices search trio engine"] \
#       [ROUNDS=2] bash benches/triton_slices.sh
#
# `slices` runs ROUNDS times (default 1). `trio` reads Triton's own statistics before and after each
# client (benches/triton/stats.py): the server's time per request beside each client's latency.
# `engine` runs migprof's own engine on the same targets at the same batch, fp16, from the CUDA
# build in .dist/migprof.xz (skipped where it is not there): the ratio server / engine says how far
# a plan made with migprof's engine stands from this server. The wheels are installed once per
# machine: a later call on the same machine need not carry them again.
#
# Everything started is stopped before the script ends; it says so with ps and nvidia-smi.
set -u
OUT=${OUT:-/tmp/triton-out}
MODEL=${MODEL:-resnet50}
WHEELS=${WHEELS:-.dist/triton-wheels}
SLO=${SLO:-50}
PHASES=${PHASES:-slices search trio}
ROUNDS=${ROUNDS:-1}
STEP_SECS=${STEP_SECS:-5}
mkdir -p "$OUT"
[ -f .dist/migprof-server.xz ] && python3 -c "import lzma; open('/tmp/migprof', 'wb').write(lzma.open('.dist/migprof-server.xz').read())"
chmod +x /tmp/migprof
# A venv of the machine's PyTorch python whose own site-packages come first: numpy 1.26 (PyTriton
# 0.7 answers empty outputs under numpy 2) before the PyTorch venv's packages.
BASE=/opt/torch/.venv/bin/python
V=/tmp/tv
S=$V/lib/python3.12/site-packages
if [ ! -x $S/bin/perf_analyzer ]; then
    $BASE -m venv --without-pip $V
    $BASE -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check --target $S "$WHEELS"/*.whl
    echo "import site; site.addsitedir('/opt/torch/.venv/lib/python3.12/site-packages')" > $S/zz_torch_venv.pth
fi
PY=$V/bin/python
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
case $MODEL in
    resnet50) REQ=(--batch 8); PA_SHAPE=(); TRIO_DATA=(); ENGINE=(--model resnet50) ;;
    # One request's tokens (valid ids of BERT's vocabulary, every one attended), sent by perf_analyzer
    # and migprof alike: perf_analyzer's own random ids fall outside the vocabulary.
    bert_base) REQ=(--batch 8 --shape input_ids:128 --shape attention_mask:128); DATA=benches/triton/bert_base_request.json
        PA_SHAPE=(--shape input_ids:128 --shape attention_mask:128 --input-data "$DATA"); TRIO_DATA=(--input-data "$DATA")
        ENGINE=(--model bert_base --seq-len 128) ;;
esac
SERVE="$PY benches/triton/serve.py --model $MODEL"
load() {
    echo "== migprof load --device $1 ${*:2}"
    timeout 420 /tmp/migprof load --device "$1" --out "$OUT/results" --endpoint http://127.0.0.1:8000 \
        --served-model "$MODEL" "${REQ[@]}" --warmup 2 --server-timeout 240 "${@:2}" 2>&1 \
        | grep -v '^report:'
}
has() { [[ " $PHASES " == *" $1 "* ]]; }
if has slices; then
    for round in $(seq "$ROUNDS"); do
        for target in "$UUID" mps:3g.71gb mps:1g.18gb; do
            echo "== round $round"
            load "$target" --server-cmd "$SERVE" --concurrency 1,2,3 --duration "$STEP_SECS"
        done
    done
fi
if has engine && [ -f .dist/migprof.xz ]; then
    python3 -c "import lzma; open('/tmp/migprof-cuda', 'wb').write(lzma.open('.dist/migprof.xz').read())"
    chmod +x /tmp/migprof-cuda
    for target in "$UUID" mps:3g.71gb mps:1g.18gb; do
        echo "== migprof's engine on $target: ${ENGINE[*]} infer f16 batch 8"
        timeout 300 /tmp/migprof-cuda run --device "$target" --out "$OUT/results" "${ENGINE[@]}" --mode infer \
            --dtype f16 --batch 8 --duration "$STEP_SECS" 2>&1 | grep -vE '^(plot|report):' 
    done
fi
if has search; then
    for target in "$UUID" mps:1g.18gb; do
        load "$target" --server-cmd "$SERVE" --search --slo-p99-ms "$SLO" --resolution 10 --duration 3
    done
fi
has trio || { tar -C "$OUT" -czf "$OUT/results-$MODEL.tar.gz" results && rm -rf "$OUT/results"; exit 0; }

echo "== one server on the whole GPU: perf_analyzer, migprof, tritonclient"
CUDA_VISIBLE_DEVICES=$UUID $SERVE > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 240); do
    $PY -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/v2/models/$MODEL/ready', timeout=1)" 2>/dev/null && break
    sleep 1
done
STATS="$PY benches/triton/stats.py --model $MODEL"
for c in 1 2 3; do
    $STATS snapshot "$OUT/stats.json"
    timeout 100 $S/bin/perf_analyzer -m "$MODEL" -u localhost:8000 -i http --concurrency-range $c:$c -b 8 \
        "${PA_SHAPE[@]}" --measurement-interval 5000 -H triton-access-token:migprof-bench > "$OUT/perf_analyzer-c$c.log" 2>&1
    echo "perf_analyzer c$c rc $?"
    grep -E 'Concurrency: |Avg HTTP time|Server:|Avg request latency|Client:' -A0 "$OUT/perf_analyzer-c$c.log" | tail -6
    $STATS since "$OUT/stats.json" --label "perf_analyzer c$c"
done
for c in 1 2 3; do
    $STATS snapshot "$OUT/stats.json"
    load "$UUID" --concurrency $c --duration 5 "${TRIO_DATA[@]}"
    $STATS since "$OUT/stats.json" --label "migprof c$c"
done
echo "== tritonclient closed loop: concurrency requests/s p50_ms p99_ms"
for c in 1 2 3; do
    $STATS snapshot "$OUT/stats.json"
    timeout 60 $PY benches/triton/closed_loop.py --model "$MODEL" --batch 8 --concurrency $c --seconds 5
    $STATS since "$OUT/stats.json" --label "tritonclient c$c"
done
kill -TERM $SERVER
for _ in $(seq 20); do kill -0 $SERVER 2>/dev/null || break; sleep 1; done
pkill -9 -f "benches/triton/serve.py" 2>/dev/null
pkill -9 -f tritonserver 2>/dev/null
sleep 2
echo "== left running (none expected):"
ps -eo pid,args | grep -E 'tritonserver|serve.py|triton_python_backend|nvidia-cuda-mps' | grep -v grep
nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader
tar -C "$OUT" -czf "$OUT/results-$MODEL.tar.gz" results && rm -rf "$OUT/results"
