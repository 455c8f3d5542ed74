#!/usr/bin/env bash
# A real OpenAI-compatible server, llama.cpp's llama-server, and a Python environment with the official
# `openai` client and the `gguf` writer, for the tests and benchmarks of `migprof load --protocol openai`.
# The server is built for the CPU from the llama.cpp that llama-cpp-python 0.3.36's PyPI sdist vendors:
# PyPI has no prebuilt llama-server, and this llama.cpp knows the "test" tokenizer that
# scripts/write_tiny_gguf.py's model uses (one token per chunk, no end of text). The build takes about
# six minutes on two cores, so the binary is kept and only rebuilt when it no longer runs; the source
# and build tree are deleted afterwards. Prints, on stdout:
#
#   MIGPROF_LLAMA_SERVER=DIR/bin/llama-server
#   MIGPROF_OPENAI_PYTHON=DIR/venv/bin/python
#
#   scripts/setup-llama-server.sh DIR
set -euo pipefail
dir="${1:?usage: setup-llama-server.sh DIR}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
server="$dir/bin/llama-server"
python="$dir/venv/bin/python"

# The sdist by its address in PyPI's simple index, and checked against its digest there. PyPI's
# per-version JSON page answered 404 for it when this was written, and `pip download` hangs on it.
sdist_url="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz"
sdist_sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

if ! "$server" --version >/dev/null 2>&1; then
    build="$dir/build"
    rm -rf "$build" "$dir/bin"
    mkdir -p "$build"
    # Deleted however the build ends: the source and objects are of no use once the binary is out.
    trap 'rm -rf "$build"' EXIT
    # cmake and ninja from PyPI, in a throwaway environment: the CI machine has neither.
    python3 -m venv "$build/tools"
    "$build/tools/bin/python" -m pip install --quiet --disable-pip-version-check 'cmake==4.4.5' 'ninja==1.13.2' >&2
    curl -fsSL --retry 3 -o "$build/sdist.tar.gz" "$sdist_url"
    echo "$sdist_sha256  $build/sdist.tar.gz" | sha256sum --check --quiet - >&2
    # Only llama.cpp, with its git metadata: `llama-server --version` then names the commit it was built from.
    tar -xzf "$build/sdist.tar.gz" -C "$build" llama_cpp_python-0.3.36/vendor/llama.cpp \
        llama_cpp_python-0.3.36/.git/modules/vendor/llama.cpp
    rm "$build/sdist.tar.gz"
    # Static libraries, so that the binary can outlive the build tree. No web UI (its assets are not in
    # the sdist and would be downloaded), no OpenSSL (the tests speak plain HTTP on localhost), no
    # tuning for this machine's CPU (the binary is cached and may run on another one) and no
    # llamafile sgemm (a long compile that the tiny test model does not need).
    PATH="$build/tools/bin:$PATH" cmake -S "$build/llama_cpp_python-0.3.36/vendor/llama.cpp" -B "$build/out" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_LLAMAFILE=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >&2
    PATH="$build/tools/bin:$PATH" cmake --build "$build/out" --target llama-server -j "$(nproc)" >&2
    built="$build/out/bin/llama-server"
    # Refuse a binary that still needs a library of the tree about to be deleted.
    if ldd "$built" | grep -e "$build" -e "not found" >&2; then
        echo "llama-server links libraries of its build tree" >&2
        exit 1
    fi
    mkdir -p "$dir/bin"
    cp "$built" "$server"
    rm -rf "$build"
    "$server" --version >&2
fi

if [ ! -x "$python" ] || ! "$python" -c 'import gguf, numpy, openai' >/dev/null 2>&1; then
    rm -rf "$dir/venv"
    python3 -m venv "$dir/venv"
    "$python" -m pip install --quiet --disable-pip-version-check 'gguf==0.19.0' 'numpy==2.4.6' 'openai==3.57.0' >&2
fi

echo "MIGPROF_LLAMA_SERVER=$server"
echo "MIGPROF_OPENAI_PYTHON=$python"
