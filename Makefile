# `make train` and `make test` each set everything up from a fresh clone, then run.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup train test test-slow gpu-check bench bench-extras clean

setup:
	@bash tools/bootstrap.sh

# --device auto: the GPU when one is present (and CuPy with it), else the CPU
train: setup
	$(BIN)/cxltrain train --device auto $(ARGS)

# Two pytest workers (pytest-xdist), a file each at a time, where xdist is installed; TEST_WORKERS=0 runs
# the suite in one process.
TEST_WORKERS ?= 2
XDIST = $(shell $(BIN)/python -c 'import xdist' 2>/dev/null && [ "$(TEST_WORKERS)" != 0 ] \
	&& echo "-n $(TEST_WORKERS) --dist loadfile")

# The lint needs ruff, which a machine without network may lack: then one line says it is skipped.
test: setup
	@if $(BIN)/python -m ruff --version >/dev/null 2>&1; then echo "$(BIN)/python -m ruff check ."; \
		$(BIN)/python -m ruff check .; else echo "lint skipped: ruff is not installed"; fi
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# On a GPU machine: the tests marked gpu, the GPU bench and a short training run, logs in $(GPU_CHECK_OUT)
gpu-check:
	@bash tools/gpu_check.sh

test-slow: setup
	$(BIN)/python -m pytest -m slow $(XDIST) $(PYTEST_ARGS)

# The bench's optional contenders: matplotlib for --plot, and torchrec with FBGEMM's CPU kernels.
# --no-deps throughout the torchrec set: torchrec asks for fbgemm-gpu (the CUDA build) and tensordict
# and torchmetrics for torch, which would replace the CPU torch; their other needs are listed here.
TORCHREC_SET := torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 tensordict cloudpickle "pyvers>=0.2,<0.3" \
	pyre-extensions typing-inspect mypy-extensions torchmetrics lightning-utilities

bench-extras: setup
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m pip install -q --no-deps $(TORCHREC_SET)

bench: bench-extras
	$(BIN)/cxltrain bench --plot bench.png $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
