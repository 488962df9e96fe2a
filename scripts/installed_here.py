"""Exit 0 when every top-level package of this checkout imports from this checkout and the
installed entry points and console scripts match pyproject's (the editable install is
current), 1 otherwise."""

import importlib
import pathlib
import sys
from importlib.metadata import entry_points

import tomllib

root = pathlib.Path(__file__).resolve().parent.parent
for name in ("vllm_retro", "vllm_retro.kernels", "vllm_retro.server"):
    mod = importlib.import_module(name)
    if mod.__file__ is None or pathlib.Path(mod.__file__).resolve().parent.parent != root:
        sys.exit(1)

project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
declared = dict(project.get("entry-points", {}))
if "scripts" in project:
    declared["console_scripts"] = project["scripts"]
for group, items in declared.items():
    installed = {e.name: e.value for e in entry_points(group=group)}
    if any(installed.get(name) != value for name, value in items.items()):
        sys.exit(1)

# A console script made from another checkout sharing this venv (VENV_CACHE_DIR) names that
# checkout's interpreter path in its first line; once that checkout is gone it cannot start.
bindir = pathlib.Path(sys.executable).parent
for name in project.get("scripts", {}):
    script = bindir / name
    try:
        first = script.read_text().splitlines()[0]
    except (OSError, IndexError):
        sys.exit(1)
    if not first.startswith("#!") or not pathlib.Path(first[2:].split()[0]).exists():
        sys.exit(1)
