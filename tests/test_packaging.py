"""The built wheel: its import names are all inside ``vllm_retro`` (no top-level ``kernels`` or
``server`` to collide with other distributions), it installs beside Hugging Face's ``kernels``
package without touching it, and every run-time import has its dependency declared."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib

from vllm_retro.kernels import cpu_ext

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # from a copy: setuptools leaves build/ in the source tree, and a stale one would leak
    # files of removed modules into later wheels
    src = tmp_path_factory.mktemp("src") / "vllm-retro"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)], check=True)
    (whl,) = out.glob("vllm_retro-*.whl")
    return whl


def test_wheel_has_only_the_vllm_retro_import_package(wheel: Path) -> None:
    """Every module in the wheel is under ``vllm_retro/`` (kernels and server included); the
    console script points inside it."""
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"vllm_retro"}
    # the extension's sources and headers, compiled on first use (the same build as a
    # checkout's, tests/kernels/test_cpu_ext.py): every one the build reads must be there
    csrc = [f"vllm_retro/kernels/csrc/{p.name}" for p in (*cpu_ext._SOURCES, *cpu_ext._HEADERS)]
    assert len(csrc) >= 5
    for module in ("vllm_retro/kernels/tripartite_attention.py", "vllm_retro/server/cli.py",
                   "vllm_retro/vllm/connector.py", "vllm_retro/saap/calibrate.py", *csrc):
        assert module in names
    (ep,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(ep).decode()
    assert "vllm-retro = vllm_retro.server.cli:main" in text


def test_every_package_of_the_checkout_is_packaged() -> None:
    """Each package directory under ``vllm_retro/`` (one with an ``__init__.py``) is listed
    in pyproject's packages, so a wheel install has every module a checkout has."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(meta["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "vllm_retro").rglob("__init__.py")}
    assert found <= listed, f"not in pyproject's packages: {sorted(found - listed)}"


def test_installs_beside_huggingface_kernels(wheel: Path, tmp_path: Path) -> None:
    """A fresh virtual environment with the registry's ``kernels`` and this wheel: both import,
    ``kernels`` is still Hugging Face's, and no ``server`` package appears. torch and numpy come
    from the project's environment through a path entry appended after the venv's own."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    res = subprocess.run([*pip, "kernels"], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"the registry's kernels package could not be installed: {res.stderr[-500:]}")
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "zz_project_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    probe = """
import importlib.util, json, sys
import kernels
import vllm_retro, vllm_retro.kernels, vllm_retro.server.cli
from vllm_retro.config import RetroConfig
from vllm_retro.index import sparse_attention
import torch
# the torch kernels: the C++ extension would be built again here (its build key names its
# sources' paths), ~2 min that test nothing about the install
out, _ = sparse_attention(torch.randn(4, 32), torch.randn(2, 2000, 32), torch.randn(2, 2000, 32),
                          RetroConfig(kernel_backend="torch"))
print(json.dumps({
    "hf_kernels": kernels.__file__, "has_get_kernel": hasattr(kernels, "get_kernel"),
    "ours": vllm_retro.kernels.__file__, "server": importlib.util.find_spec("server") is not None,
    "finite": bool(torch.isfinite(out).all()),
}))
"""
    res = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["hf_kernels"].startswith(site) and got["has_get_kernel"]
    assert got["ours"].startswith(str(Path(site) / "vllm_retro" / "kernels"))
    assert not got["server"] and got["finite"]
    check = subprocess.run([str(py), "-m", "pip", "show", "-f", "kernels"], capture_output=True,
                           text=True, check=True).stdout
    assert "vllm_retro" not in check


def _imported_distributions(paths: list[Path]) -> set[str]:
    mods = set()
    for path in paths:
        for f in path.rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    mods |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods.add(node.module.split(".")[0])
    return mods - set(sys.stdlib_module_names) - {"vllm_retro", "__future__"}


def test_every_runtime_import_is_declared() -> None:
    """Each third-party module the installed package imports is a declared dependency (core or
    an extra); Triton is optional and imported in one guarded place."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {d.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower()
                for d in meta["dependencies"]}
    for extra in meta["optional-dependencies"].values():
        declared |= {d.split(">")[0].split("=")[0].split("<")[0].strip().lower() for d in extra}
    # module name -> distribution name where they differ; vLLM's CPU build provides `vllm`.
    provided_by = {"vllm": "vllm", "prometheus_client": "vllm", "openai": "vllm",
                   "huggingface_hub": "vllm"}
    used = _imported_distributions([ROOT / "vllm_retro", ROOT / "kernels", ROOT / "server"])
    missing = {m for m in used if provided_by.get(m, m).lower() not in declared}
    assert not missing, f"imported but not declared: {sorted(missing)}"
    common = (ROOT / "kernels" / "_common.py").read_text()
    assert "except ImportError" in common
    for f in (ROOT / "kernels").glob("*.py"):
        if f.name != "_common.py":
            assert "import triton" not in f.read_text(), f"{f.name} imports triton directly"


def test_torch_reference_path_imports_without_triton(tmp_path: Path) -> None:
    """With Triton unimportable, the kernels package imports, the torch references run, and a
    forced Triton launch says Triton is missing."""
    probe = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("blocked")
sys.meta_path.insert(0, Block())
import torch
from vllm_retro import kernels
from vllm_retro.kernels._common import HAVE_TRITON
from vllm_retro.index import sparse_attention
assert not HAVE_TRITON
out, _ = sparse_attention(torch.randn(4, 32), torch.randn(2, 3000, 32), torch.randn(2, 3000, 32))
assert torch.isfinite(out).all()
try:
    kernels.cluster_scores(torch.randn(2, 2, 32), torch.randn(2, 8, 32), torch.ones(2, 8), 0.2,
                           backend="triton")
except ModuleNotFoundError as exc:
    print("MISSING:", exc)
"""
    env = {"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "MISSING: Triton is not installed" in res.stdout


def test_source_checkout_imports_without_install(tmp_path: Path) -> None:
    """Without site-packages (no install, no editable finder), a checkout on sys.path still
    resolves vllm_retro.kernels and vllm_retro.server to the repository's folders (how the GPU
    benchmark runs on a machine with only torch + triton)."""
    probe = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
             "import vllm_retro.server.kv_budget as k, vllm_retro.server.supervisor; "
             "import importlib.util as u; print(k.__file__); "
             "print(u.find_spec('vllm_retro.kernels').origin)")
    res = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    kv, kern = res.stdout.split()
    assert kv == str(ROOT / "server" / "kv_budget.py")
    assert kern == str(ROOT / "kernels" / "__init__.py")
