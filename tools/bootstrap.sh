#!/usr/bin/env bash
# Sets up everything `make train` and `make test` need, from a fresh clone, idempotently:
#   1. PMDK's libpmem (OS package) when running as root; otherwise one warning line, and the pool
#      falls back to the msync backend.
#   2. A virtual environment in .venv. Where `python3` already has torch (the GPU machine: no network,
#      and python3 is itself a virtual environment), .venv sees every package of python3 through a
#      .pth file naming python3's site-packages folders (`--system-site-packages` would show only
#      the base interpreter's when python3 is a venv), so torch is not installed again; otherwise
#      torch comes from `pip install torch==2.13.0`, which this machine kind serves from a local CPU
#      wheel. torch is installed *before* the package, so pip never resolves torch from an index
#      (that would pull the multi-GB CUDA build).
#   3. This package, editable, with --no-deps, then only the requirements (its own and the test
#      extra's) that are not already satisfied. Where an optional tool cannot be installed (no
#      network) one warning line says so and `make test` skips what needs it.
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

# Test tools whose absence `make test` handles (lint skipped, serial run, one test skipped).
OPTIONAL_TOOLS=" ruff pytest-xdist expecttest "

ensure_venv() {
    if [ -f "$STAMP" ] && [ -z "$(find pyproject.toml setup.py kernels -maxdepth 1 \( -name pyproject.toml -o -name setup.py -o -name '*.c' \) -newer "$STAMP" 2>/dev/null)" ]; then
        return  # set up, and no build input changed since (a kernels/*.c edit rebuilds the extension)
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
        if "$PY" -c 'import torch' >/dev/null 2>&1; then
            # .pth lines are appended to sys.path after .venv's own site-packages: what .venv
            # installs itself comes first.
            "$PY" -c 'import os, sys; print("\n".join(p for p in sys.path
                      if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)))' \
                >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/python3-site.pth"
        fi
    fi
    local pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
    if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        "${pip[@]}" install torch==2.13.0
    fi
    # An isolated build fetches setuptools from the index; where one that builds wheels without it is
    # here (>= 70.1, or >= 64 with the wheel package), use it, so a machine without network works.
    local isolation=()
    if "$VENV/bin/python" -c 'import sys, setuptools
v = tuple(int(p) for p in setuptools.__version__.split(".")[:2])
try:
    import wheel
except ImportError:
    sys.exit(v < (70, 1))
sys.exit(v < (64, 0))' >/dev/null 2>&1; then
        isolation=(--no-build-isolation)
    fi
    # --no-deps: pip would otherwise ask the index about the test extra's tools even where they are
    # satisfied or optional; the requirements are installed next, only those missing.
    "${pip[@]}" install --no-deps "${isolation[@]}" -e .
    local missing required=() optional=()
    missing=$("$VENV/bin/python" - <<'PY'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement

for line in md.requires("cxltrain") or []:
    req = Requirement(line)
    if req.marker and not req.marker.evaluate({"extra": "test"}):
        continue  # another extra (gpu, bench): installed on request only
    try:
        if req.specifier.contains(md.version(req.name), prereleases=True):
            continue
    except md.PackageNotFoundError:
        pass
    print(req.name, str(req.specifier) or "-")
PY
)
    local name spec
    while read -r name spec; do
        [ -n "$name" ] || continue
        [ "$spec" = - ] && spec=""
        if [[ "$OPTIONAL_TOOLS" == *" $name "* ]]; then optional+=("$name$spec"); else required+=("$name$spec"); fi
    done <<<"$missing"
    if [ ${#required[@]} -gt 0 ] && ! "${pip[@]}" install "${required[@]}"; then
        echo "error: cannot install ${required[*]}, which cxltrain and its tests need" >&2
        exit 1
    fi
    if [ ${#optional[@]} -gt 0 ] && ! "${pip[@]}" install "${optional[@]}" >/dev/null 2>&1; then
        local tool skipped=()
        for tool in "${optional[@]}"; do  # one at a time: which ones can be had
            "${pip[@]}" install --retries 0 "$tool" >/dev/null 2>&1 || skipped+=("$tool")
        done
        [ ${#skipped[@]} -eq 0 ] || echo "warning: cannot install ${skipped[*]} (no network?); make test goes on without them" >&2
    fi
    ensure_native_kernels
    touch "$STAMP"
}

# The C row kernels are an optional extension (setup.py): an editable install that left them out, or
# a build that failed, would leave the slower torch kernels in use without a word. Build them in place
# then, and where that fails too, say so in one line with the log's name.
ensure_native_kernels() {
    local check='from cxltrain.kernels import native; import sys; sys.exit(native.lib() is None)'
    if "$VENV/bin/python" -W ignore -c "$check" >/dev/null 2>&1; then
        return
    fi
    if ! "$VENV/bin/python" setup.py -q build_ext --inplace >"$VENV/native-build.log" 2>&1 \
        || ! "$VENV/bin/python" -W ignore -c "$check" >/dev/null 2>&1; then
        echo "warning: the native row kernels did not build (see $VENV/native-build.log); using the torch kernels" >&2
    fi
}

ensure_libpmem
ensure_venv
