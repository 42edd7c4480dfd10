#!/usr/bin/env bash
# Sets up everything `make train` and `make test` need, from a fresh clone, idempotently:
#   1. PMDK's libpmem (OS package) when running as root; otherwise one warning line, and the pool
#      falls back to the msync backend.
#   2. A virtual environment in .venv. If the system Python already has torch (the GPU machine, which
#      has no network), the venv sees it through --system-site-packages and torch is not installed
#      again; otherwise torch comes from `pip install torch==2.13.0`, which this machine kind serves
#      from a local CPU wheel. torch is installed *before* the package, so pip never resolves torch
#      from an index (that would pull the multi-GB CUDA build).
#   3. This package, editable, with its test extra; setup.py compiles the C row kernels in kernels/.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PY=${PYTHON:-python3}
STAMP=$VENV/.bootstrap-done

ensure_libpmem() {
    export DEBIAN_FRONTEND=noninteractive
    if ldconfig -p 2>/dev/null | grep -q 'libpmem\.so\.1'; then
        return
    fi
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        if { apt-get install -y -qq libpmem1 || { apt-get update -qq && apt-get install -y -qq libpmem1; }; } \
            >/dev/null 2>&1; then
            return
        fi
    fi
    echo "warning: PMDK's libpmem is not installed (needs root and apt); continuing with the msync backend" >&2
}

ensure_venv() {
    if [ -f "$STAMP" ] && [ -z "$(find pyproject.toml setup.py kernels -maxdepth 1 \( -name pyproject.toml -o -name setup.py -o -name '*.c' \) -newer "$STAMP" 2>/dev/null)" ]; then
        return  # set up, and no build input changed since (a kernels/*.c edit rebuilds the extension)
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        if "$PY" -c 'import torch' >/dev/null 2>&1; then
            "$PY" -m venv --system-site-packages "$VENV"
        else
            "$PY" -m venv "$VENV"
        fi
    fi
    local pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
    if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        "${pip[@]}" install torch==2.13.0
    fi
    # An isolated build fetches setuptools from the index; where the venv already has a setuptools
    # that builds editable wheels (>= 64, plus wheel), use it, so a machine without network works.
    local isolation=()
    if "$VENV/bin/python" -c 'import setuptools, wheel, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 64)' \
        >/dev/null 2>&1; then
        isolation=(--no-build-isolation)
    fi
    "${pip[@]}" install "${isolation[@]}" -e '.[test]'
    touch "$STAMP"
}

ensure_libpmem
ensure_venv
