#!/usr/bin/env bash
# Prepares a GPU-less Linux x86-64 box to build migprof with `--features cuda` (or `cudnn`): the CUDA 13.0
# compiler and link-time libraries from PyPI wheels, and a libcuda stub (the driver's real libcuda.so.1
# replaces it at run time on the GPU machine). Prints the environment to build with.
#
#   scripts/setup-cuda-build.sh [ROOT]          (default ROOT: ~/.cache/migprof-cuda)
#   eval "$(scripts/setup-cuda-build.sh)"       then: cargo build --release --features cudnn
#
# Pinned to CUDA 13.0.x: cudarc 0.19 refuses a newer nvcc, and the GPU machine's driver is 13.0.
set -euo pipefail

root="${1:-$HOME/.cache/migprof-cuda}"
here="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$root/lib/stubs"

if [ ! -x "$root/venv/bin/python" ]; then
    python3 -m venv "$root/venv" >&2
fi
pip=("$root/venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 \
    nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cublas==13.0.0.19 nvidia-curand==10.4.0.35 \
    nvidia-cuda-nvrtc==13.0.88 >&2
# cuDNN's wheel pulls a CUDA 12 runtime as a dependency; the 13.0 one above is what we link.
"${pip[@]}" --no-deps nvidia-cudnn-cu13==9.13.0.50 >&2

site="$("$root/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cu13="$site/nvidia/cu13"
[ -x "$cu13/bin/nvcc" ] || { echo "nvcc not found under $cu13" >&2; exit 1; }

# Unversioned names for the linker, pointing at the wheels' versioned libraries.
for lib in cublas cublasLt curand nvrtc cudart cudnn; do
    found="$(find "$site/nvidia" -name "lib$lib.so.[0-9]*" | sort | head -n 1)"
    [ -n "$found" ] || { echo "lib$lib.so.* not found in the wheels" >&2; exit 1; }
    ln -sf "$found" "$root/lib/lib$lib.so"
done

# libcuda has no wheel: a stub with every driver symbol cudarc binds, each a dummy.
cudarc="$(cd "$here" && cargo metadata --format-version 1 --features cudnn 2>/dev/null \
    | "$root/venv/bin/python" -c 'import json,sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"]=="cudarc"))')"
symbols="$(dirname "$cudarc")/src/driver/sys/mod.rs"
grep -o 'pub unsafe fn cu[A-Za-z0-9_]*(' "$symbols" | sed 's/pub unsafe fn \(.*\)(/\1/' | sort -u \
    | awk '{ printf "int %s(void) { return 999; }\n", $1 }' > "$root/lib/stubs/libcuda_stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so" "$root/lib/stubs/libcuda_stub.c"

echo "export PATH=\"$cu13/bin:\$PATH\""
echo "export CUDA_ROOT=\"$root\""
echo "export CUDA_COMPUTE_CAP=90"
echo "export LIBRARY_PATH=\"$root/lib:$root/lib/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}\""
