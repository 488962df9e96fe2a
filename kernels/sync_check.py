"""A checking mode for device code run on CPU tensors: fails on every operation that would
make the host wait for a CUDA device, and counts the operations that would launch work.

Under :class:`SyncCheck` a decode step written for the GPU can be run on CPU tensors (where
nothing actually waits) and held to its contract: no host synchronisation, and a known
number of device operations per step. What it treats as a synchronisation:

- reading a device scalar on the host: ``aten._local_scalar_dense`` (``item()``, ``int()``,
  ``float()``, ``bool()`` of a tensor, ``if tensor:``) and ``aten.is_nonzero``;
- operations whose output size depends on the data: ``nonzero``, ``masked_select``,
  indexing with a boolean mask, ``unique`` (all variants), ``repeat_interleave`` without
  ``output_size``, ``bincount``;
- moving device data to the host: ``Tensor.cpu()``, ``.numpy()``, ``.tolist()``;
- turning host data into a tensor inside the step (``torch.tensor(list)``: ``lift_fresh``),
  a blocking host->device copy on CUDA (a step takes its integers as tensors made before it).

Operations that only make a view (reshape, slice, transpose, ...) or only allocate
(``empty``, ...) are not counted as launches; every other ``aten`` operation is (an upper
bound on CUDA kernel launches: some are fused or free there, none are hidden), and so is
every Triton kernel launch (compiled,
or run by the interpreter under ``TRITON_INTERPRET=1``, whose own torch operations are
neither counted nor checked).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten


def _triton_launchers() -> list[type]:
    """Triton's kernel classes whose ``run`` launches (compiled, interpreted), if any."""
    classes = []
    try:
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    return classes


class HostSyncError(RuntimeError):
    """An operation that would synchronise the host with a CUDA device ran under
    :class:`SyncCheck`."""


_SYNC_OPS = {
    aten._local_scalar_dense.default: "reads a device scalar on the host (item/int/bool)",
    aten.is_nonzero.default: "reads a device scalar on the host (bool of a tensor)",
    aten.nonzero.default: "nonzero (output size depends on the data)",
    aten.nonzero_static.default: None,  # static output size: allowed
    aten.masked_select.default: "masked_select (output size depends on the data)",
    aten._unique.default: "unique (output size depends on the data)",
    aten._unique2.default: "unique (output size depends on the data)",
    aten.unique_dim.default: "unique (output size depends on the data)",
    aten.unique_consecutive.default: "unique_consecutive (output size depends on the data)",
    aten.lift_fresh.default: "makes a tensor from host data inside the step",
    aten.bincount.default: "bincount (reads the largest value back to size its output)",
}

_ALLOC_OPS = {
    aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
    aten.empty_strided.default, aten.new_empty_strided.default,
}
"""Allocations: counted in :attr:`SyncCheck.ops`, not as launches (no kernel runs)."""

_VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.as_strided.default, aten.t.default, aten.transpose.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.select.int, aten.slice.Tensor, aten.detach.default, aten.alias.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.view_as_real.default,
    aten.unflatten.int, aten.flatten.using_ints, aten.narrow.default, aten.diagonal.default,
    aten.expand_as.default, aten.view_as.default, aten.chunk.default, aten.lift_fresh.default,
    aten.unfold.default, aten._reshape_alias.default,
}


def _has_bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class SyncCheck(TorchDispatchMode):
    """Raise :class:`HostSyncError` on any operation that would synchronise with a CUDA
    device (see the module docstring) and count the others: :attr:`launches` (operations
    that are neither views nor allocations, and Triton kernels) and :attr:`ops` (per
    operation name, allocations included).

    Use as ``with SyncCheck() as check: step(...)`` around code whose tensors are all
    "device" tensors (on CPU in tests). Tensor-to-host conversions (``cpu``, ``numpy``,
    ``tolist``) are patched for the duration, since they never reach the dispatcher on CPU;
    like the mode itself, the patches check only the thread that entered it.
    """

    def __init__(self, uploads: bool = False) -> None:
        """``uploads``: allow tensors made from host data (``torch.tensor(list)``), which on
        CUDA copy to the device without waiting for it; code run once per request (an
        index build) may upload integers the host knows, a decode step may not."""
        super().__init__()
        self.uploads = uploads
        self.launches = 0
        self.ops: Counter[str] = Counter()
        self._saved: list[tuple[Any, str, Any]] = []
        self._in_kernel = False

    def __enter__(self) -> SyncCheck:
        owner = threading.get_ident()
        for name in ("cpu", "numpy", "tolist"):
            original = getattr(torch.Tensor, name)

            def refuse(*a: Any, _name: str = name, _fn: Any = original, **k: Any) -> Any:
                # other threads (workers) and a Triton kernel's own run are not checked
                if threading.get_ident() != owner or self._in_kernel:
                    return _fn(*a, **k)
                raise HostSyncError(f"Tensor.{_name}() moves device data to the host")

            self._patch(torch.Tensor, name, refuse)
        for cls in _triton_launchers():
            original = cls.run

            def run(fn: Any, *a: Any, _run: Any = original, **k: Any) -> Any:
                if threading.get_ident() != owner or self._in_kernel or k.get("warmup"):
                    return _run(fn, *a, **k)
                self.launches += 1
                self.ops[f"triton:{getattr(fn, '__name__', fn)}"] += 1
                self._in_kernel = True
                try:  # the interpreter runs a kernel with torch ops: not the step's
                    with _disable_current_modes():
                        return _run(fn, *a, **k)
                finally:
                    self._in_kernel = False

            self._patch(cls, "run", run)
        return super().__enter__()

    def _patch(self, owner: Any, name: str, fn: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fn)

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for owner, name, fn in reversed(self._saved):
                setattr(owner, name, fn)
            self._saved.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        why = _SYNC_OPS.get(func)
        if func is aten.lift_fresh.default and self.uploads:
            why = None
        if why is None and func in (aten.index.Tensor, aten.index_put.default,
                                    aten.index_put_.default, aten._index_put_impl_.default) \
                and _has_bool_index(args):
            why = "indexes with a boolean mask (output size depends on the data)"
        if why is None and func in (aten.repeat_interleave.Tensor,
                                    aten.repeat_interleave.self_Tensor) \
                and kwargs.get("output_size") is None:
            why = "repeat_interleave without output_size"
        if why is not None:
            raise HostSyncError(f"{func}: {why}")
        if func not in _VIEW_OPS:
            self.launches += func not in _ALLOC_OPS
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)
