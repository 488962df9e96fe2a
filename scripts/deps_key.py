"""Print a short hash of everything that decides the virtual environment's contents:
pyproject's build system and dependency lists, and the set-up script itself."""

import hashlib
import json
import pathlib

import tomllib

root = pathlib.Path(__file__).resolve().parent.parent
meta = tomllib.loads((root / "pyproject.toml").read_text())
key = {
    "build": meta.get("build-system", {}),
    "deps": meta["project"].get("dependencies", []),
    "extras": meta["project"].get("optional-dependencies", {}),
    "setup": (root / "scripts" / "setup-venv.sh").read_text(),
}
print(hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16])
