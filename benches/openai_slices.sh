#!/usr/bin/env bash
# "A language model's server on the whole GPU against slices" on a GPU machine with MIG off:
# llama.cpp's llama-server, built with CUDA, serving Llama-3.2-1B's shape (random f16 weights,
# benches/openai/gpu_server.sh), measured by `migprof load --protocol openai` on the whole GPU and on
# emulated 3g and 1g slices (started by migprof, pinned: the GPU's UUID, or an MPS client of
# migprof's daemon) at concurrency 1 to 16 and by a capacity search within TTFT p99 <= 500 ms and
# TPOT p99 <= 50 ms; migprof's own serving engine on the same targets and objectives; and, on the
# whole GPU, one server measured in turn by the official `openai` client
# (benches/openai/reference_client.py) and by migprof at the same concurrencies. Run from the
# repository root with migprof in .dist/migprof-server.xz (a stripped release build, xz), its CUDA
# build in .dist/migprof.xz (for `engine`), and .dist/openai-gpu carried (llama.cpp's source or its
# built binary, the gguf wheel, the openai client's wheels in wheels/):
#
#   OUT=/tmp/out [PHASES="slices engine agree"] [TARGETS="full mps:3g.71gb mps:1g.18gb"] \
#       [STEP_SECS=8] bash benches/openai_slices.sh
#
# The server's binary, where it was built here, is left xz'd in $OUT for a later call to carry.
# Everything started is stopped before the script ends; it says so with ps and nvidia-smi.
set -u
OUT=${OUT:-/tmp/openai-out}
PHASES=${PHASES:-slices engine agree}
TARGETS=${TARGETS:-full mps:3g.71gb mps:1g.18gb}
STEP_SECS=${STEP_SECS:-8}
PROMPT=${PROMPT:-512}
OUTPUT=${OUTPUT:-128}
CONCURRENCY=${CONCURRENCY:-1,2,4,8,16}
SLO=(--slo-ttft-p99-ms 500 --slo-tpot-p99-ms 50)
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
python3 -c "import lzma; open('/tmp/migprof', 'wb').write(lzma.open('.dist/migprof-server.xz').read())"
chmod +x /tmp/migprof
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
nvidia-smi --query-gpu=name,uuid,memory.total,mig.mode.current --format=csv,noheader

el "prepare the server"
CMD=$(bash benches/openai/gpu_server.sh) || { el "the server could not be prepared"; exit 1; }
BIN=${CMD%% *}
[ -f .dist/openai-gpu/llama-server.xz ] || xz -T8 -c "$BIN" > "$OUT/llama-server.xz"
SERVE=${CMD//\{port\}/8000}
el "server: $SERVE"
device() { [ "$1" = full ] && echo "$UUID" || echo "$1"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }
# The server reads the slice's memory from the environment migprof gives it.
if has slices; then
    for t in $TARGETS; do
        el "== migprof load --device $t: the server at concurrency $CONCURRENCY, then its capacity"
        timeout 570 /tmp/migprof load --device "$(device "$t")" --protocol openai --out "$OUT/results" \
            --endpoint http://127.0.0.1:8000 --server-cmd "echo target memory \$MIGPROF_TARGET_MEMORY_MIB MiB; exec $SERVE" \
            --server-timeout 240 --prompt-len "$PROMPT" --output-len "$OUTPUT" --warmup 2 \
            --duration "$STEP_SECS" --drain 30 --concurrency "$CONCURRENCY" --search "${SLO[@]}" \
            --max-steps 6 --sample-interval-ms 200 2>&1 | grep -v '^report:'
        latest=$(ls -td "$OUT"/results/servers/*/ | head -1)
        grep -h "target memory\|CUDA0\|model buffer\|KV buffer\|compute buffer\|n_ctx_slot\|error" "$latest"*.log | head -12
    done
fi
if has engine && [ -f .dist/migprof.xz ]; then
    python3 -c "import lzma; open('/tmp/migprof-cuda', 'wb').write(lzma.open('.dist/migprof.xz').read())"
    chmod +x /tmp/migprof-cuda
    for t in $TARGETS; do
        el "== migprof's engine on $t: llama_3_2_1b bf16, prompts $PROMPT and outputs $OUTPUT tokens"
        timeout 400 /tmp/migprof-cuda load --device "$(device "$t")" --model llama_3_2_1b --dtype bf16 \
            --out "$OUT/results" --prompt-len "$PROMPT" --output-len "$OUTPUT" --warmup 1 \
            --duration "$STEP_SECS" --drain 20 --search "${SLO[@]}" --max-steps 6 2>&1 | grep -v '^report:'
    done
fi
if has agree; then
    el "== one server on the whole GPU: the openai client, then migprof, at each concurrency"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .dist/openai-gpu/wheels/*.whl
    CUDA_VISIBLE_DEVICES=$UUID $SERVE > "$OUT/agree-server.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 240); do
        curl -sf http://127.0.0.1:8000/health > /dev/null && break
        sleep 0.5
    done
    for c in 1 4 16; do
        for round in 1 2; do
            PYTHONPATH=/tmp/site timeout 60 python3 benches/openai/reference_client.py \
                --base-url http://127.0.0.1:8000/v1 --concurrency $c --warmup 2 --duration "$STEP_SECS" \
                --prompt-len "$PROMPT" --output-len "$OUTPUT" --seed $((c * 10 + round))
            timeout 60 /tmp/migprof load --device "$UUID" --protocol openai --endpoint http://127.0.0.1:8000 \
                --out "$OUT/agree" --prompt-len "$PROMPT" --output-len "$OUTPUT" --warmup 2 \
                --duration "$STEP_SECS" --concurrency $c 2>&1 | grep '^concurrency'
        done
    done
    kill -TERM $SERVER
    for _ in $(seq 20); do kill -0 $SERVER 2>/dev/null || break; sleep 0.5; done
    kill -9 $SERVER 2>/dev/null
fi
sleep 2
el "== left running (none expected):"
ps -eo pid,args | grep -E 'llama[-]server|nvidia-cuda-mps|reference_clien[t]' | grep -v grep
nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader
tar -C "$OUT" -czf "$OUT/results.tar.gz" results agree 2>/dev/null && rm -rf "$OUT/results" "$OUT/agree"
el "done"
