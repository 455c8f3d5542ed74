#!/usr/bin/env bash
# Prepare an OpenAI-compatible server on the GPU machine for `migprof load --protocol openai`:
# llama.cpp's llama-server built with CUDA, serving a model of Llama-3.2-1B's shape (16 blocks,
# n_embd 2048, 32 heads, 8 KV heads, n_ff 8192, vocab 128256) with random f16 weights. Then print
# the command that starts it, with {port} where the port goes.
#
# Run from the repository root, with .dist/openai-gpu carried:
#   bash benches/openai/gpu_server.sh            # prints the server command line, last
# Files land in $WORK (default /tmp/openai-gpu). A second run reuses what is there.
#
# .dist/openai-gpu holds, made on a machine with network:
#   gguf-0.19.0-py3-none-any.whl  (pip download gguf==0.19.0)
#   llama.cpp-src.tar.xz          llama.cpp's tree as vendored in llama-cpp-python 0.3.36's sdist
#                                 (vendor/llama.cpp, as scripts/setup-llama-server.sh fetches it),
#                                 without its docs, tests, examples and models: about 6 MB
#   llama-server.xz               optional: a binary built as below on another machine (sm_90)
# The binary comes from llama-server.xz when it runs here; otherwise it is built from the source
# (259 s on an H200 machine's 16 cores).
set -euo pipefail

src=${OPENAI_GPU_DIR:-.dist/openai-gpu}
work=${WORK:-/tmp/openai-gpu}
model=$work/llama-3.2-1b-shape-f16.gguf
mkdir -p "$work"
log() { echo "gpu_server: $*" >&2; }

# The model does not depend on the binary, so write it (about 2.5 GB) while the binary is made.
if [ ! -s "$model" ]; then
    (
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$work/site" "$src"/gguf-*.whl
        PYTHONPATH=$work/site python3 benches/openai/llama_gguf.py "$model.part" --ctx 131072
        mv "$model.part" "$model"
    ) >"$work/model.log" 2>&1 &
    model_pid=$!
fi

runs() { "$1" --version >/dev/null 2>&1; }

bin=$work/llama-server
if ! runs "$bin" && [ -f "$src/llama-server.xz" ]; then
    xz -dc "$src/llama-server.xz" >"$bin" && chmod +x "$bin"
    runs "$bin" || log "the carried binary does not run here; building"
fi
if ! runs "$bin"; then
    start=$(date +%s)
    rm -rf "$work/llama.cpp" && tar -xJf "$src/llama.cpp-src.tar.xz" -C "$work"
    export PATH=/usr/local/cuda/bin:$PATH
    # Only sm_90 (H100, H200); FlashAttention kernels for f16/bf16 and the usual quant pairs
    # only; static llama/ggml and no OpenMP, so the binary needs only the CUDA libraries already
    # on the machine and can be carried to a later one. No web UI, no SSL.
    cmake -S "$work/llama.cpp" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA_ALL_QUANTS=OFF \
        -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF >"$work/cmake.log" 2>&1
    cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1
    cp "$work/build/bin/llama-server" "$bin"
    log "built llama-server in $(( $(date +%s) - start )) s"
fi
"$bin" --version 2>&1 | tail -n 2 >&2

if [ -n "${model_pid:-}" ]; then
    wait "$model_pid" || { cat "$work/model.log" >&2; exit 1; }
    tail -n 1 "$work/model.log" >&2
fi

# $SLOTS slots (default 16) of 2048 tokens each (-c is split across -np slots): room for a 512-token
# prompt and 128 output tokens per request with margin; a request beyond the slots waits for one. -ngl 99 puts every layer on the GPU. The weights are
# random and the "test" tokenizer has no EOS, so requests run to max_tokens; send prompts as
# token ids for exact lengths. /health answers 200 once the model is loaded.
echo "$bin -m $model --host 127.0.0.1 --port {port} -ngl 99 -c $(( ${SLOTS:-16} * 2048 )) -np ${SLOTS:-16} --no-webui"
