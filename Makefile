# vllm-retro: `make serve` installs everything and starts the server; `make test` runs the suite.
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup serve test lint kernels-test

setup:
	./scripts/setup-venv.sh

serve: setup
	@echo "vllm-retro serve: not yet -- the OpenAI-compatible server lands with the server issue."
	@echo "Installed: $$($(PY) -c 'import vllm_retro; print(vllm_retro.__file__)')"

lint: setup
	$(PY) -m ruff check .

# TRITON_INTERPRET=1 lets the Triton kernels run on CPU tensors (no GPU here or in CI).
test: setup lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra tests
