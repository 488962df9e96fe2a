"""tests.triton_compile: Triton kernels compiled for an H100 (sm_90) on a machine without a
GPU, from the launches an interpreted test run records."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, **extra}


def test_the_device_steps_kernels_compile_for_sm90():
    """Every kernel the device step launches (pool scoring — also of Quest's page bounds,
    rows twice the head dimension —, zone selection — also at rows of 2K clusters —,
    resident attention and its merge, the cluster cache's lookup) lowers to a cubin for
    cuda:90 with this environment's Triton."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.triton_compile", "--arch", "90",
         "tests/index/test_device_layer.py::test_decode_step_with_triton_kernels",
         "tests/index/test_resident.py::test_the_baselines_device_step_with_triton_kernels"
         "[True-quest]",
         "tests/kernels/test_zone_select.py::test_triton_equals_torch"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "compiled for cuda:90" in proc.stdout and "FAILED" not in proc.stdout


def test_a_kernel_the_interpreter_runs_but_the_compiler_refuses_is_reported(tmp_path):
    """A plain Python function called on a tensor inside a kernel runs under the interpreter
    but cannot compile: the recorded launch is reported as a failure naming the kernel, and the
    exit status is 1."""
    (tmp_path / "broken_kernel.py").write_text(textwrap.dedent('''
        import triton
        import triton.language as tl

        def double(v):
            return v * 2

        @triton.jit
        def broken(X, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(X + offs, double(tl.load(X + offs, mask=offs < n)), mask=offs < n)
    '''))
    record = {"module": "broken_kernel", "name": "broken",
              "signature": {"X": "*fp32", "n": "i32", "BLOCK": "constexpr"},
              "constexprs": {"BLOCK": 16}, "options": {}}
    records = tmp_path / "launches.json"
    records.write_text(json.dumps([record]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.triton_compile", "--records", str(records)], cwd=ROOT,
        env=_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)])),
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "0 of 1 launches (1 kernels) compiled" in proc.stdout
    assert "FAILED broken_kernel.broken {'BLOCK': 16}" in proc.stdout


def test_a_launch_record_types_every_argument():
    """Tensors by dtype, ints by range, floats, bools and constexprs (by annotation or None)."""
    import torch

    from tests.triton_compile import launch_record

    def kernel(X, Y, n, big, scale, flag, opt, BLOCK: "tl.constexpr"):  # noqa: F821
        pass

    rec = launch_record(kernel, (torch.zeros(2, dtype=torch.bfloat16),
                                 torch.zeros(2, dtype=torch.int64), 7, 2**40, 0.5, True, None),
                        {"BLOCK": 64, "num_warps": 8})
    assert rec["signature"] == {"X": "*bf16", "Y": "*i64", "n": "i32", "big": "i64",
                                "scale": "fp32", "flag": "i1", "opt": "constexpr",
                                "BLOCK": "constexpr"}
    assert rec["constexprs"] == {"opt": None, "BLOCK": 64}
    assert rec["options"] == {"num_warps": 8}
    assert rec["module"] == __name__ and rec["name"].endswith("kernel")


def test_launches_the_interpreter_ran_in_fp32_are_also_compiled_as_a_gpu_runs_them():
    """A launch with 16-bit tensors and DOT16=False (the interpreter's 16-bit dots are wrong,
    so CPU runs multiply in fp32) is compiled with DOT16=True too; fp32 launches are not."""
    from tests.triton_compile import with_gpu_variants

    bf16 = {"module": "m", "name": "k", "signature": {"Q": "*bf16", "DOT16": "constexpr"},
            "constexprs": {"DOT16": False}, "options": {}}
    fp32 = {**bf16, "signature": {"Q": "*fp32", "DOT16": "constexpr"}}
    out = with_gpu_variants([bf16, fp32])
    assert out[:2] == [bf16, fp32]
    assert out[2:] == [{**bf16, "constexprs": {"DOT16": True}}]
