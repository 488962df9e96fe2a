"""``--retro-*`` command-line options: one per setting of
:class:`~vllm_retro.config.RetroConfig` (its flat names: :meth:`RetroConfig.flat_names`)."""

from __future__ import annotations

import argparse
import typing
from typing import Any

from vllm_retro.config import (
    CACHE_POLICIES,
    DEVICE_RESIDENT,
    ESTIMATORS,
    FLAGS,
    GROUPS,
    INDEXES,
    KERNEL_BACKENDS,
    RetroConfig,
)

_CHOICES = {"cache_policy": CACHE_POLICIES, "kernel_backend": KERNEL_BACKENDS,
            "estimator": ESTIMATORS, "index": INDEXES, "device_resident": DEVICE_RESIDENT}
_DEST = "retro__"
_GROUP_LABEL = {"pq": "PQCache", "saap": "SAAP", "graph": "Graph"}
"""The policy a group's help texts start with (the page group's name theirs)."""


def _class_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring in ``cls`` (the line after it in config.py)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for stmt, nxt in zip(body, body[1:], strict=False):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _flags() -> list[tuple[str, Any, Any, str]]:
    """(flat name, type, default, docstring) of every setting, as
    :meth:`RetroConfig.flat_names` orders them: the wave index's and buffer's fields, and
    each policy group's fields under their flat names (:data:`FLAGS`)."""
    hints = {None: typing.get_type_hints(RetroConfig)}
    docs = {None: _class_docs(RetroConfig)}
    defaults = {None: RetroConfig()}
    for group, cls in GROUPS.items():
        hints[group], docs[group] = typing.get_type_hints(cls), _class_docs(cls)
        defaults[group] = cls()
    out = []
    for flat in RetroConfig.flat_names():
        group, name = FLAGS.get(flat, (None, flat))
        doc = docs[group].get(name, "")
        out.append((flat, hints[group][name], getattr(defaults[group], name),
                    f"{_GROUP_LABEL[group]}: {doc}" if group in _GROUP_LABEL else doc))
    return out


def add_retro_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--retro-<name>`` for every setting (:meth:`RetroConfig.flat_names`;
    ``--retro-enabled`` / ``--no-retro-enabled`` style for booleans). Options not given keep
    the config's value."""
    group = parser.add_argument_group(
        "Retro", "RetroInfer wave index / wave buffer settings (override "
        "--additional-config '{\"retro\": {...}}')")
    for name, kind, default, doc in _flags():
        flag = "--retro-" + name.replace("_", "-")
        # argparse %-formats help texts: a literal % in a docstring must be doubled
        help_ = f"{doc} (default: {default})".replace("%", "%%")
        # SUPPRESS: an option not given leaves no attribute (and no "(default: None)").
        kwargs: dict[str, Any] = {"dest": _DEST + name, "default": argparse.SUPPRESS,
                                  "help": help_}
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if name in _CHOICES:
            kwargs["choices"] = _CHOICES[name]
        elif kind in (float, float | None):
            kwargs.update(type=float, metavar="FLOAT")
        elif kind in (str, str | None):  # a path (saap_file)
            kwargs.update(type=str, metavar="FILE")
        else:  # int or int | None
            kwargs.update(type=int, metavar="INT")
        group.add_argument(flag, **kwargs)


def retro_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--retro-*`` values given on the command line, keyed by flat name
    (:meth:`RetroConfig.from_dict` takes them)."""
    return {k[len(_DEST):]: v for k, v in vars(args).items() if k.startswith(_DEST)}


def strip_retro_arguments(args: argparse.Namespace) -> None:
    """Remove the ``--retro-*`` attributes so vLLM sees only its own options."""
    for k in [k for k in vars(args) if k.startswith(_DEST)]:
        delattr(args, k)
