"""The text SAAP is calibrated on.

By default: the long descriptions (README files) of the Python distributions installed in the
running environment, read through :mod:`importlib.metadata` -- English prose mixed with code
and markup, present on any machine where vllm-retro and vLLM are installed, and disjoint from
the accuracy harness's text (CPython's language reference, ``vllm_retro.capture.real_prose``).
``--text FILE_OR_DIR`` reads a file, or every text file under a directory, instead.

Documents are concatenated (blank line between them) in an order shuffled by the seed, and the
token stream is cut into prompts of equal length.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".tex", ".html", ".htm", ".json", ".c", ".h",
                 ".cpp", ".js", ".ts", ".java", ".go", ".rs", ".sh", ".toml", ".yaml", ".yml")
"""Files read from a ``--text`` directory."""

MIN_DOCUMENT_CHARS = 2000
"""Installed distributions with a shorter description are skipped (mostly one-liners)."""


class CorpusError(ValueError):
    """Not enough text, or text that cannot be read."""


@dataclass(frozen=True)
class Document:
    """One document of the corpus."""

    name: str
    text: str


def installed_documents(min_chars: int = MIN_DOCUMENT_CHARS) -> list[Document]:
    """The description of every installed distribution with at least ``min_chars``
    characters, deduplicated, sorted by name."""
    seen: set[str] = set()
    docs: list[Document] = []
    for dist in importlib.metadata.distributions():
        meta: Any = dist.metadata
        name = str(meta.get("Name") or "")
        text = str((meta.get_payload() if hasattr(meta, "get_payload") else "")
                   or meta.get("Description") or "").strip()
        digest = hashlib.sha256(text.encode()).hexdigest()
        if len(text) < min_chars or digest in seen:
            continue
        seen.add(digest)
        docs.append(Document(name, text))
    return sorted(docs, key=lambda d: (d.name.casefold(), d.text))


def path_documents(path: str | Path) -> list[Document]:
    """A text file as one document, or every file with a :data:`TEXT_SUFFIXES` suffix under
    a directory (recursively, sorted by path)."""
    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
    else:
        raise CorpusError(f"--text {path} does not exist")
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8", errors="replace").strip()
        except OSError as exc:
            raise CorpusError(f"--text: cannot read {f} ({exc.strerror})") from None
        if text:
            docs.append(Document(str(f), text))
    if not docs:
        raise CorpusError(f"--text {path} holds no text files ({', '.join(TEXT_SUFFIXES[:4])}"
                          ", ...)")
    return docs


def corpus_prompts(tokenizer: Any, documents: list[Document], n_prompts: int,
                   prompt_tokens: int, seed: int) -> list[torch.Tensor]:
    """``n_prompts`` prompts of exactly ``prompt_tokens`` token ids each ([prompt_tokens]
    int64), cut from the documents concatenated in an order shuffled by ``seed``. Raises
    :class:`CorpusError` when the text is too short."""
    order = list(documents)
    random.Random(seed).shuffle(order)
    need = n_prompts * prompt_tokens
    ids: list[int] = []
    sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    for doc in order:
        ids += tokenizer(doc.text, add_special_tokens=False)["input_ids"] + sep
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise CorpusError(f"the text holds {len(ids)} tokens, fewer than the {need} asked "
                          f"({n_prompts} prompts x {prompt_tokens}); give more text with "
                          "--text or ask for fewer --tokens")
    flat = torch.tensor(ids[:need], dtype=torch.int64)
    return list(flat.reshape(n_prompts, prompt_tokens))


def describe_source(text: str | None) -> str:
    """How the corpus is named in the file's training settings."""
    return "installed distributions' descriptions" if text is None else f"--text {text}"
