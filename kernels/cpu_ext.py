"""Builds and loads the C++ extension of the fused CPU kernels (``kernels/csrc``): the
batched decode (:mod:`vllm_retro.kernels.cpu_decode`), the k-means assignment
(:mod:`vllm_retro.kernels.kmeans`), the graph index (:mod:`vllm_retro.kernels.graph_cpu`)
and the wave buffer's table work (:mod:`vllm_retro.buffer`).

The extension is compiled by the README's setup command (``python -m
vllm_retro.kernels.cpu_ext``) into ``$VLLM_RETRO_CACHE/extensions`` and loaded from there;
:func:`load` compiles it on first use when missing, and returns None (with the reason in
:func:`load_error`) when it cannot be built, so callers fall back to the per-row path. A
failed build is remembered in its build directory (:data:`FAILED_MARKER`, the compiler's
output): later loads with the same build key, in any process, do not build again until the
marker is deleted. The build directory is keyed by everything the build command contains
(sources and their paths, flags, torch's and Python's include paths, by their real names),
so checkouts and environments sharing one cache never rebuild over each other's builds, and
a library found under its key is imported as it is (no ninja run); a build is
serialised across processes by an advisory file lock that dies with its holder, so a build
killed midway (which leaves torch's own ``lock`` file behind) cannot make every later load
wait forever.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sysconfig
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CSRC = pathlib.Path(__file__).resolve().parent / "csrc"
_SOURCES = (_CSRC / "retro_cpu.cpp", _CSRC / "kmeans_cpu.cpp", _CSRC / "graph_cpu.cpp",
            _CSRC / "buffer_cpu.cpp")
_HEADERS = (_CSRC / "retro_check.h",)
"""Included by the sources: part of the build key, not compiled on their own."""
_lock = threading.Lock()
_module: Any = None
_error: str | None = None

FAILED_MARKER = "build-failed.txt"
"""A build directory's record of its failed build (the build command's output)."""




@functools.cache  # the build key and the build both need them: /proc/cpuinfo read once
def _flags() -> tuple[str, ...]:
    flags = ["-O3", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math"]
    if platform.machine() in ("x86_64", "AMD64"):
        try:
            cpu = pathlib.Path("/proc/cpuinfo").read_text()
        except OSError:
            cpu = ""
        if " avx2 " in cpu and " fma " in cpu:
            flags += ["-mavx2", "-mfma", "-mf16c"]
    return tuple(flags)


@functools.cache
def _ldflags() -> tuple[str, ...]:
    """The link flags: OpenMP, and the C++ runtime this process has loaded (torch's), named
    by its path. A link that cannot find ``libstdc++.so`` falls back to the static archive
    without a word; on the H100 host the extension then carried its own copy of the C++
    runtime beside torch's, and every check that formats a number into its message
    segfaulted (here such a copy truncates the message at the first number). Naming the
    shared library makes it a dependency of the extension whatever the compiler driver
    finds (:func:`linked_libraries` shows it)."""
    flags = ["-fopenmp"]
    try:
        maps = pathlib.Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    loaded = re.search(r"(/\S*/libstdc\+\+\.so[.\d]*)$", maps, re.M)
    if loaded and os.path.isfile(loaded.group(1)):
        flags.append(loaded.group(1))
    return tuple(flags)


def _build_dir() -> tuple[pathlib.Path, str]:
    """The build directory and its key: a hash of every input of the build command (ninja
    rebuilds everything when the command changes, e.g. another checkout's source paths or
    another environment's include paths, so those must not share a directory)."""
    from torch.utils import cpp_extension

    # vllm-retro's cache root (vllm_retro.models.default_cache_dir; kernels import nothing
    # above them)
    root = pathlib.Path(os.environ.get("VLLM_RETRO_CACHE") or "~/.cache/vllm-retro")
    # paths by their real names: a venv reached through a symbolic link (``.venv`` ->
    # the cached venv, as CI's set-up makes it) names torch's headers one way in processes
    # started through the link (``.venv/bin/python``) and another in its console scripts
    # (their ``#!`` line names the target); one build serves both
    real = functools.partial(re.sub, r"^/.*", lambda m: os.path.realpath(m.group()))
    inputs = [*map(str, _SOURCES), *_flags(), *map(real, _ldflags()),
              torch.__version__, *map(os.path.realpath, cpp_extension.include_paths()),
              os.path.realpath(sysconfig.get_paths()["include"])]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in (*_SOURCES, *_HEADERS))
                         + "\0".join(inputs).encode()).hexdigest()[:16]
    return root.expanduser() / "extensions" / f"retro_cpu-{key}", key


class _BuildFailed(RuntimeError):
    """The build with this key failed, now or before (``marker``, its output, exists)."""

    def __init__(self, marker: pathlib.Path, now: bool) -> None:
        super().__init__(_first_error(marker.read_text()))
        self.marker = marker
        self.now = now


def _first_error(output: str) -> str:
    """The line of a failed build's ``output`` that says why: the compiler's first error
    (ninja's last line says only that it stopped)."""
    lines = output.strip().splitlines() or [""]
    return next((ln for ln in lines if "error:" in ln), lines[-1]).strip()


def _compile(directory: pathlib.Path, key: str) -> Any:
    """Build (unless built) and import the extension in ``directory``, holding the directory's
    build lock (an ``flock``, released by the kernel when its holder dies). Raises
    :class:`_BuildFailed` when the build command fails (writing :data:`FAILED_MARKER`) or
    failed before."""
    from torch.utils import cpp_extension

    name = f"vllm_retro_cpu_{key}"
    with open(directory / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits while another process builds here
        # torch's own lock file: whoever creates it holds the flock above, so one found here
        # was left by a build that was killed (and would make torch wait for it forever)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("vllm-retro: removing %s, left by a kernel build that was killed",
                           stale)
            stale.unlink()
        failed = directory / FAILED_MARKER
        if failed.exists():
            raise _BuildFailed(failed, now=False)
        built = directory / f"{name}.so"
        if built.exists():
            # the key covers every input, so a library under it is current: import it as
            # it is (cpp_extension.load would run ninja, which rebuilds when the command's
            # path spellings differ from the builder's; see _build_dir)
            try:
                return _import_built(name, built)
            except ImportError as exc:  # e.g. a link killed midway: build it again
                logger.warning("vllm-retro: %s does not load (%s); building it again",
                               built, exc)
        else:
            logger.info("vllm-retro: compiling the fused CPU kernels into %s (once per "
                        "checkout and environment, a minute or two)", directory)
        try:
            return cpp_extension.load(
                name=name, sources=[str(p) for p in _SOURCES], extra_cflags=list(_flags()),
                extra_ldflags=list(_ldflags()), build_directory=str(directory), verbose=False)
        except RuntimeError as exc:
            # only a failed build command is remembered (the same sources, flags and headers
            # fail the same way again); a missing ninja or a failed import is not
            if not isinstance(exc.__cause__, subprocess.CalledProcessError):
                raise
            failed.write_text(str(exc))
            raise _BuildFailed(failed, now=True) from exc


def _import_built(name: str, path: pathlib.Path) -> Any:
    """Import the built extension module ``name`` from ``path``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module {name} in {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prune_orphans(extensions: pathlib.Path, keep: pathlib.Path) -> list[pathlib.Path]:
    """Remove the build directories under ``extensions`` (other than ``keep``) whose sources
    no longer exist (a deleted checkout's: its key names their paths, so nothing can use it
    again), skipping any whose build lock is held; returns those removed."""
    removed = []
    for other in extensions.glob("retro_cpu-*"):
        ninja = other / "build.ninja"
        if other == keep or not ninja.is_file():
            continue
        sources = re.findall(r"^build \S+\.o: compile (\S+)$", ninja.read_text(), re.M)
        if not sources or any(os.path.exists(src) for src in sources):
            continue
        with open(other / "build.flock", "w") as held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # being built or pruned right now
            shutil.rmtree(other, ignore_errors=True)
        removed.append(other)
    return removed


def load() -> Any:
    """The compiled extension module (built on first use), or None if it cannot be built."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    with _lock:
        if _module is not None or _error is not None:
            return _module
        try:
            directory, key = _build_dir()
            directory.mkdir(parents=True, exist_ok=True)
            _module = _compile(directory, key)
            try:  # every clone (CI's included) builds once; a deleted one's build goes
                _prune_orphans(directory.parent, directory)
            except OSError as exc:
                logger.debug("vllm-retro: pruning old kernel builds: %s", exc)
        except _BuildFailed as exc:
            _error = f"{exc}; remembered in {exc.marker}: delete it to retry the build"
            logger.warning("vllm-retro: the fused CPU kernels %s (%s); decoding falls back to "
                           "the per-row path and index builds to the torch k-means",
                           "could not be built" if exc.now else "failed to build before",
                           _error)
        except Exception as exc:  # compiler missing, headers missing, ...
            _error = f"{type(exc).__name__}: {_first_error(str(exc))}"
            logger.warning("vllm-retro: the fused CPU kernels could not be built (%s); "
                           "decoding falls back to the per-row path and index builds to "
                           "the torch k-means", _error)
        return _module


def linked_libraries(path: str | os.PathLike) -> list[str] | None:
    """The shared libraries the ELF file ``path`` depends on (its ``DT_NEEDED`` names, as
    ``readelf -d`` lists them), or None when ``readelf`` cannot tell."""
    try:
        out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out.stdout)


def load_error() -> str | None:
    """Why :func:`load` returned None (None when it has not failed)."""
    return _error


def available() -> bool:
    """True when the extension is (or can be) loaded."""
    return load() is not None


SCORING_ISAS = ("avx512bf16", "avx2")


def scoring_isa() -> str | None:
    """The instruction set the fused kernel scores bf16 clusters with on this CPU:
    ``"avx512bf16"`` (``vdpbf16ps``, picked at run time where the CPU has it), ``"avx2"`` or
    ``"scalar"``; None without the extension."""
    mod = load()
    return None if mod is None else str(mod.scoring_isa())


def set_scoring_isa(isa: str) -> str:
    """Cap the bf16 scoring path at ``isa`` (one of :data:`SCORING_ISAS`, best first; the
    CPU may offer less), for tests and benchmarks comparing the paths in one process;
    returns the path now in use. Serving never calls it (the best path is the default)."""
    if isa not in SCORING_ISAS:
        raise ValueError(f"scoring isa {isa!r} is not one of {', '.join(SCORING_ISAS)}")
    mod = load()
    if mod is None:
        raise RuntimeError(f"the fused CPU kernel is unavailable: {load_error()}")
    return str(mod.set_scoring_isa(isa))


def main() -> int:
    """Build (or find) the extension; print where it is. Used by the setup script."""
    if os.environ.get("VLLM_RETRO_SKIP_CPU_EXT"):
        print("== fused CPU decode and k-means kernels: skipped (VLLM_RETRO_SKIP_CPU_EXT)")
        return 0
    directory, _ = _build_dir()
    mod = load()
    if mod is None:
        print(f"== fused CPU decode, k-means and graph kernels: NOT built ({_error}); "
              "decoding will use the slower per-row path, index builds the torch k-means")
        return 1
    print(f"== fused CPU decode, k-means and graph kernels: ready in {directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
