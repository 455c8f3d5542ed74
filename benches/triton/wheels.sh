#!/usr/bin/env bash
# The wheels benches/triton_slices.sh installs on the GPU machine (Python 3.12, no network), made on a
# machine with PyPI: nvidia-pytriton 0.7.0 (tritonserver 2.51.0), numpy 1.26.4, tritonclient 2.60.0
# (whose wheel holds perf_analyzer) and their dependencies, about 46 MB, under the 64 MiB a device
# call carries. PyTriton's wheel is repacked from 55 to 26 MB: the Python backend stubs and the
# libpython of other Pythons left out, tritonserver and its library stripped, LZMA throughout.
#
#   bash benches/triton/wheels.sh DIR
set -euo pipefail
out="${1:?usage: wheels.sh DIR}"
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
platforms=""
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms="$platforms --platform ${p}_x86_64"
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms --platform any -d "$tmp" \
    nvidia-pytriton==0.7.0 numpy==1.26.4 tritonclient==2.60.0 python-rapidjson geventhttpclient gevent \
    'greenlet<3.4' zope.event zope.interface brotli pyzmq sh
lib=nvidia_pytriton.libs/libtritonserver-717102f0.so
server=pytriton/tritonserver/bin/tritonserver
analyzer=tritonclient-2.60.0.data/data/bin/perf_analyzer
(cd "$tmp" && unzip -q nvidia_pytriton-0.7.0-*.whl "$lib" "$server" && strip --strip-unneeded "$lib" "$server" \
    && unzip -q tritonclient-2.60.0-*.whl "$analyzer" && strip "$analyzer")
mkdir -p "$out"
stubs=pytriton/tritonserver/python_backend_stubs
python3 "$here/repack.py" "$tmp"/nvidia_pytriton-0.7.0-*.whl "$out/$(basename "$tmp"/nvidia_pytriton-0.7.0-*.whl)" \
    --drop 'nvidia_pytriton.libs/libpython3-*.13.so*' --drop "$stubs/3.8/*" --drop "$stubs/3.9/*" \
    --drop "$stubs/3.10/*" --drop "$stubs/3.11/*" --drop "$stubs/3.13/*" \
    --replace "$lib=$tmp/$lib" --replace "$server=$tmp/$server"
python3 "$here/repack.py" "$tmp"/tritonclient-2.60.0-*.whl "$out/$(basename "$tmp"/tritonclient-2.60.0-*.whl)" \
    --drop 'tritonclient-2.60.0.data/data/bin/perf_client' --replace "$analyzer=$tmp/$analyzer"
for w in "$tmp"/*.whl; do
    case "$(basename "$w")" in
        nvidia_pytriton*|tritonclient*) ;;
        *) python3 "$here/repack.py" "$w" "$out/$(basename "$w")" ;;
    esac
done
du -sh "$out"
