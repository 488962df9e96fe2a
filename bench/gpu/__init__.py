"""Standalone GPU benchmark: a Llama-3-8B-shaped attention stack, dense vs RetroInfer decode.

Plain torch + triton (no vLLM). Modules:

- :mod:`bench.gpu.shapes` — stack shapes, presets, and the memory estimates used to skip
  configurations that do not fit;
- :mod:`bench.gpu.synthetic` — clustered, RoPE-rotated synthetic KV and drifting queries;
- :mod:`bench.gpu.stacks` — the dense (SDPA, KV resident on the device) and the retro (wave
  index + wave buffer per request-layer) decode stacks;
- :mod:`bench.gpu.runner` — one (context, batch) case: build, interleaved timing, counters;
- :mod:`bench.gpu.cli` — ``python -m bench.gpu``: options, table, JSON.
"""
