#!/usr/bin/env bash
# `make gpu-check`: the GPU machine's check of the GPU path (docs/gpu.md). Sets up as `make setup`
# does, then runs the tests marked gpu, the GPU bench and a short `make train` run on the GPU, each
# logged under $GPU_CHECK_OUT (default gpu-check/). Exits non-zero when the tests fail; the bench and
# the training run go on regardless, so one try shows everything.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${GPU_CHECK_OUT:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; uname -r; python3 --version; } \
    >"$out/machine.txt" 2>&1
if ! bash tools/bootstrap.sh >"$out/setup.log" 2>&1; then
    echo "gpu-check: set-up failed (last lines of $out/setup.log):"
    tail -20 "$out/setup.log"
    exit 1
fi
BIN=.venv/bin
$BIN/python -c 'import sysconfig, os; i = sysconfig.get_paths()["include"]; print("Python.h:", os.path.exists(i + "/Python.h"), i)' \
    >>"$out/machine.txt" 2>&1
command -v cc gcc >>"$out/machine.txt" 2>&1
$BIN/python -c 'from cxltrain.kernels import native; print("native row kernels:", native.lib() is not None)' >>"$out/machine.txt" 2>&1

$BIN/python -m pytest -m 'gpu or not slow' -v tests/test_gpu.py tests/test_bench_gpu.py tests/test_device_rows.py ${PYTEST_ARGS:-} \
    >"$out/pytest-gpu.log" 2>&1
tests=$?
echo "gpu tests: exit $tests"; grep -E "passed|failed|error" "$out/pytest-gpu.log" | tail -3

[ "${GPU_CHECK_BENCH:-1}" = 0 ] && exit $tests
$BIN/cxltrain bench --gpu --json ${BENCH_ARGS:-} >"$out/bench-gpu.txt" 2>"$out/bench-gpu.err"
echo "gpu bench: exit $?"; grep -v '^{' "$out/bench-gpu.txt"; tail -3 "$out/bench-gpu.err"

$BIN/cxltrain train --device auto --steps ${TRAIN_STEPS:-200} --no-progress >"$out/train.txt" 2>&1
echo "make train on the GPU: exit $?"; tail -12 "$out/train.txt"
exit $tests
