#!/usr/bin/env bash
# A Python environment with a real Triton Inference Server (nvidia-pytriton bundles tritonserver) and
# Triton's own client, for the tests and benchmarks of `migprof load --endpoint`. Made from Debian's
# python3: under another build of Python, PyTriton's Python backend stub links a libpython that is not
# the one it runs with and its models fail to load. numpy below 2: PyTriton 0.7 answers empty outputs
# under numpy 2. Prints the environment's python.
#
#   scripts/setup-triton-venv.sh DIR
set -euo pipefail
dir="${1:?usage: setup-triton-venv.sh DIR}"
python="$dir/bin/python"
if [ ! -x "$python" ] || ! "$python" -c 'import pytriton, tritonclient.http, numpy' >/dev/null 2>&1; then
    rm -rf "$dir"
    /usr/bin/python3 -m venv "$dir"
    "$python" -m pip install --quiet --disable-pip-version-check \
        'nvidia-pytriton==0.7.0' 'numpy==1.26.4' 'tritonclient[http]==2.73.0' >&2
fi
echo "$python"
