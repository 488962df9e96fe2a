"""kernels.cpu_ext's build: one build directory per build command, a build killed
midway does not hold later loads (in other processes) forever, a failed build is not retried
for the same build key, and every source compiles as C++17."""

import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from vllm_retro.kernels import cpu_ext


def test_a_checkout_at_another_path_builds_in_its_own_directory(tmp_path, monkeypatch) -> None:
    """The same sources at another path (another clone sharing the cache) get another
    directory: ninja would otherwise rebuild everything each time the two alternate."""
    here, _ = cpu_ext._build_dir()
    copies = tuple(Path(shutil.copy(p, tmp_path / p.name)) for p in cpu_ext._SOURCES)
    monkeypatch.setattr(cpu_ext, "_SOURCES", copies)
    there, _ = cpu_ext._build_dir()
    assert there.parent == here.parent and there != here


def _cache_copy(tmp_path: Path) -> tuple[Path, str, Path, Path]:
    """This checkout's build copied into a cache of its own under ``tmp_path`` (skips when
    there is no build): (the build's directory, its key, the cache root, the copy)."""
    if cpu_ext.load() is None:
        pytest.skip(f"extension not built: {cpu_ext.load_error()}")
    built, key = cpu_ext._build_dir()
    root = tmp_path / "cache"
    copy = root / "extensions" / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "build.flock"))
    return built, key, root, copy


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path) -> None:
    """torch's ``lock`` file left in the build directory (its builder was killed) is removed
    by the next load, which then finds the extension (before, it waited forever)."""
    built, key, root, copy = _cache_copy(tmp_path)
    (copy / "lock").touch()
    code = ("from vllm_retro.kernels import cpu_ext as c\n"
            "print(c.load() is not None, c.load_error())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "VLLM_RETRO_CACHE": str(root)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[0] == "True", res.stdout + res.stderr[-2000:]
    assert "left by a kernel build that was killed" in res.stderr
    assert not (copy / "lock").exists()
    assert (copy / f"vllm_retro_cpu_{key}.so").exists()


def test_a_venv_reached_through_a_link_and_by_its_real_path_share_one_build(tmp_path):
    """Processes started through a link to the venv (``.venv/bin/python`` where ``.venv``
    links to a cached venv, as CI's set-up makes it) and by its real path (the console
    scripts' ``#!`` line) name torch's headers differently; they find the same build and
    load it as it is (before, the server's first start rebuilt it: ~2.5 min of a test run)."""
    built, key, root, copy = _cache_copy(tmp_path)
    library = copy / f"vllm_retro_cpu_{key}.so"
    stamp = library.stat().st_mtime_ns
    real = Path(os.path.realpath(sys.prefix))
    (tmp_path / "venv-link").symlink_to(real, target_is_directory=True)
    code = ("import time; t = time.monotonic()\n"
            "from vllm_retro.kernels import cpu_ext as c\n"
            "print(c._build_dir()[0], c.load() is not None, c.load_error())")
    repo = Path(cpu_ext.__file__).resolve().parents[1]
    for venv in (tmp_path / "venv-link", real):
        res = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                             text=True, timeout=300, cwd=repo,
                             env={**os.environ, "VLLM_RETRO_CACHE": str(root)})
        assert res.returncode == 0, res.stderr[-2000:]
        where, loaded = res.stdout.split()[:2]
        assert (where, loaded) == (str(copy), "True"), res.stdout + res.stderr[-2000:]
        assert "compiling" not in res.stderr
    assert library.stat().st_mtime_ns == stamp  # loaded as built, not built again
    assert sorted(p.name for p in (root / "extensions").iterdir()) == [built.name]


def test_builds_of_deleted_checkouts_are_pruned(tmp_path) -> None:
    """A build directory whose sources are gone (a deleted clone's) is removed; one whose
    sources exist, one without a build file and one being built (its lock held) stay."""
    import fcntl

    def build_dir(name: str, source: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "build.ninja").write_text(f"rule compile\n  command = c++\n\n"
                                       f"build retro_cpu.o: compile {source}\n")
        (d / "retro_cpu.o").write_bytes(b"\0")
        return d

    gone = build_dir("retro_cpu-gone", str(tmp_path / "deleted-clone" / "retro_cpu.cpp"))
    live = build_dir("retro_cpu-live", str(cpu_ext._SOURCES[0]))
    busy = build_dir("retro_cpu-busy", str(tmp_path / "other-deleted" / "retro_cpu.cpp"))
    bare = tmp_path / "retro_cpu-bare"
    bare.mkdir()
    keep = build_dir("retro_cpu-mine", str(tmp_path / "also-deleted" / "retro_cpu.cpp"))
    with open(busy / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = cpu_ext._prune_orphans(tmp_path, keep)
    assert removed == [gone] and not gone.exists()
    assert live.exists() and busy.exists() and bare.exists() and keep.exists()


def _compiler() -> str | None:
    """The C++ compiler torch's extension builds use ($CXX, else c++), else g++."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def test_every_source_compiles_as_cxx17() -> None:
    """Every ``kernels/csrc/*.cpp`` is C++17 (torch 2.11's extension builds pass -std=c++17,
    2.13's -std=c++20): a syntax-only compile with the build's defines, include paths and
    flags. -pedantic-errors makes the C++20 features GCC takes as extensions in C++17 mode
    (designated initialisers) fail too."""
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    from torch.utils import cpp_extension

    _, key = cpu_ext._build_dir()
    includes = [*cpp_extension.include_paths(),
                sysconfig.get_path("include", scheme="posix_prefix")]
    # the build's own -O3 kept: __OPTIMIZE__ changes which code the intrinsics headers hold
    flags = [f"-DTORCH_EXTENSION_NAME=vllm_retro_cpu_{key}", "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(flag for path in includes for flag in ("-isystem", path)),
             "-fPIC", "-std=c++17", "-pedantic-errors", "-fsyntax-only", *cpu_ext._flags()]
    sources = sorted(cpu_ext._CSRC.glob("*.cpp"))
    assert set(cpu_ext._SOURCES) <= set(sources)
    # all at once: parsing torch's headers takes most of each compile's time
    procs = {src: subprocess.Popen([cxx, *flags, str(src)], stderr=subprocess.PIPE, text=True)
             for src in sources}
    failed = {}
    for src, proc in procs.items():
        err = proc.communicate(timeout=900)[1]
        if proc.returncode:
            failed[src.name] = err
    assert not failed, "not C++17:\n" + "\n".join(f"== {name}\n{err[:6000]}"
                                                   for name, err in failed.items())


def test_a_failed_build_is_remembered_per_build_key(tmp_path, monkeypatch, caplog) -> None:
    """A failed build leaves the compiler's output in its build directory; a later load with
    the same build key (the process's own memory cleared, as in a new process) does not build
    again and warns once, naming the marker; deleting the marker lets it build again."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        pytest.skip("ninja is not installed: torch builds no extension")
    broken = tmp_path / "broken.cpp"
    broken.write_text('#error "deliberately broken"\n')
    monkeypatch.setenv("VLLM_RETRO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_ext, "_SOURCES", (broken,))
    monkeypatch.setattr(cpu_ext, "_module", None)
    monkeypatch.setattr(cpu_ext, "_error", None)
    marker = cpu_ext._build_dir()[0] / cpu_ext.FAILED_MARKER

    assert cpu_ext.load() is None
    assert "deliberately broken" in marker.read_text()
    assert "deliberately broken" in cpu_ext.load_error()
    assert str(marker) in cpu_ext.load_error()

    builds = []

    def build(**kwargs):
        builds.append(kwargs["name"])
        return object()

    monkeypatch.setattr(cpp_extension, "load", build)
    monkeypatch.setattr(cpu_ext, "_error", None)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=cpu_ext.logger.name):
        assert cpu_ext.load() is None
    assert builds == []
    error = cpu_ext.load_error()
    assert "deliberately broken" in error and f"{marker}: delete it to retry" in error
    warned = [r.getMessage() for r in caplog.records if r.name == cpu_ext.logger.name]
    assert len(warned) == 1 and "\n" not in warned[0] and error in warned[0], warned

    marker.unlink()
    monkeypatch.setattr(cpu_ext, "_error", None)
    assert cpu_ext.load() is not None and len(builds) == 1


_NUMBER_IN_AN_ERROR = """
#include <pybind11/pybind11.h>
#include <c10/util/StringUtil.h>
#include <stdexcept>
void fail(long value) {
  throw std::runtime_error(c10::str("probe: value ", value, " (accepted 0..4)"));
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("fail", &fail); }
"""

_BUILD_AND_FAIL = """
import sys
from torch.utils import cpp_extension
mod = cpp_extension.load(name=sys.argv[1], sources=[sys.argv[2]], build_directory=sys.argv[3],
                         extra_ldflags=sys.argv[4:], verbose=False)
print(mod.__file__, flush=True)  # before a crash, where the runtime breaks
try:
    mod.fail(5)
except RuntimeError as exc:
    print(exc)
"""


def _build_and_fail(tmp_path: Path, name: str, ldflags: list[str]) -> subprocess.CompletedProcess:
    (tmp_path / name).mkdir()
    return subprocess.run([sys.executable, "-c", _BUILD_AND_FAIL, name,
                           str(tmp_path / "probe.cpp"), str(tmp_path / name), *ldflags],
                          capture_output=True, text=True, timeout=600)


def test_the_cpp_runtime_stays_torchs_where_the_link_would_take_the_static_one(tmp_path):
    """A link that takes the static C++ runtime (as a compiler driver that finds no
    ``libstdc++.so`` does; the H100 host's build did) gives the extension its own copy of
    iostreams beside torch's: a check's message loses everything from its first number on
    (here) or the process segfaults (there). The build's link flags keep the shared runtime
    a dependency even then, and the message whole. A small extension stands in for ours (a
    few seconds to build, not minutes)."""
    from torch.utils import cpp_extension

    if _compiler() is None:
        pytest.skip("no C++ compiler on PATH")
    if not cpp_extension.is_ninja_available():
        pytest.skip("ninja is not installed: torch builds no extension")
    (tmp_path / "probe.cpp").write_text(_NUMBER_IN_AN_ERROR)
    whole = "probe: value 5 (accepted 0..4)"

    def cpp_runtime_linked(so: str) -> bool | None:
        needed = cpu_ext.linked_libraries(so)
        return None if needed is None else any(n.startswith("libstdc++.so") for n in needed)

    # the control: how the message fares (cut here, a crash there) depends on the platform;
    # that the link took the static runtime does not
    static = _build_and_fail(tmp_path, "static_runtime", ["-static-libstdc++"])
    built = [ln for ln in static.stdout.splitlines() if ln.endswith(".so")]
    assert built and cpp_runtime_linked(built[0]) in (False, None), static.stdout

    ours = _build_and_fail(tmp_path, "our_link", [*cpu_ext._ldflags(), "-static-libstdc++"])
    assert ours.returncode == 0, ours.stderr[-3000:]
    so, message = ours.stdout.strip().splitlines()[-2:]
    assert message == whole
    assert cpp_runtime_linked(so) in (True, None)


def test_the_extension_depends_on_the_shared_cpp_runtime():
    """The built extension names ``libstdc++.so`` among its dependencies (no copy of its
    own: see the test above), and a check's message keeps its numbers."""
    mod = cpu_ext.load()
    if mod is None:
        pytest.skip(f"extension not built: {cpu_ext.load_error()}")
    needed = cpu_ext.linked_libraries(mod.__file__)
    if needed is None:
        pytest.skip("readelf cannot list the extension's dependencies")
    assert any(lib.startswith("libstdc++.so") for lib in needed), needed
