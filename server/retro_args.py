"""``--retro-*`` command-line options: one per :class:`~vllm_retro.config.RetroConfig` field."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from vllm_retro.config import (
    CACHE_POLICIES,
    DEVICE_RESIDENT,
    ESTIMATORS,
    INDEXES,
    KERNEL_BACKENDS,
    RetroConfig,
)

_CHOICES = {"cache_policy": CACHE_POLICIES, "kernel_backend": KERNEL_BACKENDS,
            "estimator": ESTIMATORS, "index": INDEXES, "device_resident": DEVICE_RESIDENT}
_DEST = "retro__"


def _field_docs() -> dict[str, str]:
    """Each field's attribute docstring (the line after it in config.py), for ``--help``."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(RetroConfig))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for stmt, nxt in zip(body, body[1:], strict=False):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def add_retro_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--retro-<field>`` for every RetroConfig field (``--retro-enabled`` /
    ``--no-retro-enabled`` style for booleans). Options not given keep the config's value."""
    group = parser.add_argument_group(
        "Retro", "RetroInfer wave index / wave buffer settings (override "
        "--additional-config '{\"retro\": {...}}')")
    hints = typing.get_type_hints(RetroConfig)
    docs = _field_docs()
    for f in dataclasses.fields(RetroConfig):
        flag = "--retro-" + f.name.replace("_", "-")
        kind = hints[f.name]
        # argparse %-formats help texts: a literal % in a docstring must be doubled
        help_ = f"{docs.get(f.name, '')} (default: {f.default})".replace("%", "%%")
        # SUPPRESS: an option not given leaves no attribute (and no "(default: None)").
        kwargs: dict[str, Any] = {"dest": _DEST + f.name, "default": argparse.SUPPRESS,
                                  "help": help_}
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if f.name in _CHOICES:
            kwargs["choices"] = _CHOICES[f.name]
        elif kind in (float, float | None):
            kwargs.update(type=float, metavar="FLOAT")
        elif kind in (str, str | None):  # a path (saap_file)
            kwargs.update(type=str, metavar="FILE")
        else:  # int or int | None
            kwargs.update(type=int, metavar="INT")
        group.add_argument(flag, **kwargs)


def retro_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--retro-*`` values given on the command line, keyed by RetroConfig field."""
    return {k[len(_DEST):]: v for k, v in vars(args).items() if k.startswith(_DEST)}


def strip_retro_arguments(args: argparse.Namespace) -> None:
    """Remove the ``--retro-*`` attributes so vLLM sees only its own options."""
    for k in [k for k in vars(args) if k.startswith(_DEST)]:
        delattr(args, k)
