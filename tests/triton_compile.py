"""Compile, for a CUDA GPU, every Triton kernel launch a test run makes, on a machine with
no GPU.

The kernel tests run Triton in its interpreter (``TRITON_INTERPRET=1``), which executes a
kernel as Python and never lowers it: a kernel can pass every test here and still fail to
compile on a GPU (a device function's default ``tl.constexpr`` argument did, on an H100).
Triton's compiler needs no GPU, only a target: this module records each launch's argument
types and constexpr values while tests run under the interpreter (a pytest plugin), then
compiles each distinct specialization for ``cuda:<arch>`` down to a cubin (Triton's bundled
``ptxas``) in a process without the interpreter.

    python -m tests.triton_compile [--arch 90] [--triton-path DIR] [PYTEST ARGS...]

runs pytest (default: the Triton kernel tests and the device step's) with the recorder, then
compiles what it recorded; exit status 0 only when every kernel compiled. ``--triton-path``
compiles with the Triton installed in DIR (``pip install --target DIR triton==3.6.0``: the
lent GPUs' version, whose frontend refused what 3.9's accepts) while the tests record with
this environment's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

RECORD_ENV = "RETRO_TRITON_RECORD"
"""Where the recorder plugin writes its launches (JSON), when set."""

DEFAULT_TESTS = ["tests/kernels/test_flash_decode.py", "tests/kernels/test_gather.py",
                 "tests/kernels/test_kmeans.py", "tests/kernels/test_resident_attention.py",
                 "tests/kernels/test_scoring.py", "tests/kernels/test_tripartite_attention.py",
                 "tests/index/test_device_layer.py"]

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64",
           "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8",
           "bool": "i1"}


def launch_record(fn: Any, args: tuple, kwargs: dict) -> dict:
    """One launch of the Python kernel function ``fn`` as a JSON-able record: its module and
    name, Triton's signature (argument name -> type: ``*bf16`` for a tensor, ``i32``/``i64``
    for an int, ``fp32`` for a float, ``constexpr``), the constexpr values and the launch
    options (``num_warps``, ``num_stages``)."""
    import inspect

    import torch

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    sig = inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        annotation = sig.parameters[name].annotation
        is_constexpr = "constexpr" in str(annotation)
        if is_constexpr or value is None:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[str(value.dtype).removeprefix("torch.")]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__qualname__}: argument {name} of type "
                            f"{type(value).__name__} has no Triton type here")
    return {"module": fn.__module__, "name": fn.__qualname__, "signature": signature,
            "constexprs": constexprs, "options": options}


class Recorder:
    """A pytest plugin: while tests run, every interpreted Triton launch is recorded (once
    per distinct specialization); the records are written to ``path`` at the end."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.records: dict[str, dict] = {}
        self._saved: Any = None

    def pytest_configure(self, config: Any) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        recorder = self

        def run(fn: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
            record = launch_record(fn.fn, args, kwargs)
            recorder.records.setdefault(json.dumps(record, sort_keys=True), record)
            return original(fn, *args, grid=grid, warmup=warmup, **kwargs)

        self._saved = (InterpretedFunction, original)
        InterpretedFunction.run = run

    def pytest_unconfigure(self, config: Any) -> None:
        if self._saved is not None:
            cls, original = self._saved
            cls.run = original
        self.path.write_text(json.dumps(list(self.records.values()), indent=1))


def pytest_configure(config: Any) -> None:
    """Registers the :class:`Recorder` when ``RETRO_TRITON_RECORD`` names its output (this
    module is loaded with ``-p tests.triton_compile``)."""
    path = os.environ.get(RECORD_ENV)
    if path:
        recorder = Recorder(pathlib.Path(path))
        config.pluginmanager.register(recorder, "retro_triton_recorder")
        recorder.pytest_configure(config)


def with_gpu_variants(records: list[dict]) -> list[dict]:
    """``records`` and, for each launch with 16-bit tensors and a ``DOT16`` constexpr that the
    interpreter ran False (its 16-bit dots are wrong: ``kernels._common.tensor_cores_16bit``),
    the same launch with ``DOT16=True``, as it runs on a GPU."""
    out = list(records)
    for rec in records:
        if rec["constexprs"].get("DOT16") is False and any(
                t in ("*bf16", "*fp16") for t in rec["signature"].values()):
            out.append({**rec, "constexprs": {**rec["constexprs"], "DOT16": True}})
    return out


def compile_records(records: list[dict], arch: int) -> list[str]:
    """Compiles each record's kernel for ``cuda:arch`` (in this process, which must not run
    the interpreter). Returns one line per failure, naming the kernel, its specialization
    and the compiler's message."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert os.environ.get("TRITON_INTERPRET") != "1", "compile outside the interpreter"
    target = GPUTarget("cuda", arch, 32)
    failures = []
    for rec in records:
        kernel = getattr(importlib.import_module(rec["module"]), rec["name"])
        what = f"{rec['module']}.{rec['name']} {rec['constexprs']} {rec['options']}"
        try:
            triton.compile(ASTSource(kernel, rec["signature"], rec["constexprs"]),
                           target=target, options=rec["options"])
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            failures.append(f"{what}: {type(exc).__name__}: {exc}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90,
                        help="CUDA compute capability x 10 (90: H100/H200)")
    parser.add_argument("--records", type=pathlib.Path, default=None,
                        help="compile these records (JSON) instead of running tests")
    parser.add_argument("--triton-path", type=pathlib.Path, default=None,
                        help="compile with the Triton installed in this directory")
    args, pytest_args = parser.parse_known_args(argv)
    root = pathlib.Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if args.records is None:
        with tempfile.TemporaryDirectory() as tmp:
            path = pathlib.Path(tmp) / "launches.json"
            run = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                 "tests.triton_compile", *(pytest_args or DEFAULT_TESTS)],
                # the GPU hidden: on a GPU host the tests would hand the interpreter CUDA
                # tensors, which it cannot read as the CPU tensors it records from
                cwd=root, env={**env, RECORD_ENV: str(path), "TRITON_INTERPRET": "1",
                               "CUDA_VISIBLE_DEVICES": ""})
            if run.returncode != 0:
                print(f"the recording test run failed (exit {run.returncode})")
                return 1
            if args.triton_path is not None:
                env["PYTHONPATH"] = os.pathsep.join(
                    [str(args.triton_path.resolve()), str(root), env.get("PYTHONPATH", "")])
            return subprocess.run([sys.executable, "-m", "tests.triton_compile", "--arch",
                                   str(args.arch), "--records", str(path)], cwd=root,
                                  env=env).returncode
    import triton

    records = with_gpu_variants(json.loads(args.records.read_text()))
    print(f"Triton {triton.__version__} from {pathlib.Path(triton.__file__).parent}")
    t0 = time.perf_counter()
    failures = compile_records(records, args.arch)
    kernels = {f"{r['module']}.{r['name']}" for r in records}
    print(f"{len(records) - len(failures)} of {len(records)} launches ({len(kernels)} kernels) "
          f"compiled for cuda:{args.arch} in {time.perf_counter() - t0:.0f} s")
    for line in failures:
        print("FAILED", line[:3000])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
