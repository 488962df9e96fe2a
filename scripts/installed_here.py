"""Exit 0 when every top-level package of this checkout imports from this checkout (the
editable install is current), 1 otherwise."""

import importlib
import pathlib
import sys

root = pathlib.Path(__file__).resolve().parent.parent
for name in ("vllm_retro", "kernels", "server"):
    mod = importlib.import_module(name)
    if mod.__file__ is None or pathlib.Path(mod.__file__).resolve().parent.parent != root:
        sys.exit(1)
