"""kernels.cpu_decode's build: one build directory per build command, and a build killed
midway does not hold later loads (in other processes) forever."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_retro.kernels import cpu_decode


def test_a_checkout_at_another_path_builds_in_its_own_directory(tmp_path, monkeypatch) -> None:
    """The same sources at another path (another clone sharing the cache) get another
    directory: ninja would otherwise rebuild everything each time the two alternate."""
    here, _ = cpu_decode._build_dir()
    copies = tuple(Path(shutil.copy(p, tmp_path / p.name)) for p in cpu_decode._SOURCES)
    monkeypatch.setattr(cpu_decode, "_SOURCES", copies)
    there, _ = cpu_decode._build_dir()
    assert there.parent == here.parent and there != here


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path) -> None:
    """torch's ``lock`` file left in the build directory (its builder was killed) is removed
    by the next load, which then finds the extension (before, it waited forever)."""
    if cpu_decode.load() is None:
        pytest.skip(f"extension not built: {cpu_decode.load_error()}")
    built, key = cpu_decode._build_dir()
    root = tmp_path / "cache"
    copy = root / "extensions" / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "build.flock"))
    (copy / "lock").touch()
    code = ("from vllm_retro.kernels import cpu_decode as c\n"
            "print(c.load() is not None, c.load_error())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "VLLM_RETRO_CACHE": str(root)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[0] == "True", res.stdout + res.stderr[-2000:]
    assert "left by a kernel build that was killed" in res.stderr
    assert not (copy / "lock").exists()
    assert (copy / f"vllm_retro_cpu_{key}.so").exists()


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
    live = build_dir("retro_cpu-live", str(cpu_decode._SOURCES[0]))
    busy = build_dir("retro_cpu-busy", str(tmp_path / "other-deleted" / "retro_cpu.cpp"))
    bare = tmp_path / "retro_cpu-bare"
    bare.mkdir()
    keep = build_dir("retro_cpu-mine", str(tmp_path / "also-deleted" / "retro_cpu.cpp"))
    with open(busy / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = cpu_decode._prune_orphans(tmp_path, keep)
    assert removed == [gone] and not gone.exists()
    assert live.exists() and busy.exists() and bare.exists() and keep.exists()
