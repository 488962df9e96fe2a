# vllm-retro: `make serve` installs everything and starts the server; `make test` runs the suite.
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup serve test lint kernels-test triton-compile

setup:
	./scripts/setup-venv.sh

# MODEL: a local model directory (default: the embedded Qwen2.5-Coder-0.5B-Instruct);
# SERVE_ARGS: more `vllm-retro serve` options, e.g. SERVE_ARGS="--port 9000 --api-key KEY".
MODEL ?=
SERVE_ARGS ?=
serve: setup
	.venv/bin/vllm-retro serve $(MODEL) $(SERVE_ARGS)

lint: setup
	$(PY) -m ruff check .

# TRITON_INTERPRET=1 lets the Triton kernels run on CPU tensors (no GPU here or in CI);
# VLLM_RETRO_REQUIRE_PARTS=1 fails the run where a test skipped because a part of the install
# is missing (vLLM, a C++ extension: tests/required_parts.py).
# TEST_WORKERS: pytest-xdist workers (default one per core); a file's tests stay on one worker,
# so its module fixtures (servers, engines) start once. Files go out in collection order
# (tests/conftest.py puts the minutes-long real-model files first), not reordered by
# pytest-xdist by their number of tests (which handed those files out last).
# --durations=15: the slowest tests (and fixture set-ups) are listed at the end of the output.
TEST_WORKERS ?= auto
test: setup lint
	TRITON_INTERPRET=1 VLLM_RETRO_REQUIRE_PARTS=1 $(PY) -m pytest -q -ra -n $(TEST_WORKERS) \
		--dist loadfile --no-loadscope-reorder --durations=15 tests

# Every Triton kernel launch of the kernel and device-step tests compiled for an H100/H200
# (cuda:90), no GPU needed (tests/triton_compile.py; ~5 min): with this environment's Triton,
# or with TRITON_PATH=DIR the one installed there (`pip install --target DIR triton==3.6.0`,
# the lent GPUs' version).
TRITON_PATH ?=
triton-compile: setup
	$(PY) -m tests.triton_compile --arch 90 $(if $(TRITON_PATH),--triton-path $(TRITON_PATH))
