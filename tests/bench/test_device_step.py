"""bench/device_step.py and bench/gpu_check.py: the GPU check's stages fit its time, and the
device-step benchmark runs end to end (on the CPU here, small)."""

import json
import subprocess
import sys

from bench import device_step, gpu_check
from vllm_retro.kernels.resident_attention import RETRIEVAL_MAPS


def test_device_step_bench_runs_and_checks_against_the_reference(tmp_path):
    out = tmp_path / "ds.json"
    result = device_step.main(["--device", "cpu", "--contexts", "2048", "--batches", "1", "2",
                               "--heads", "4", "2", "32", "--steps", "2",
                               "--placements", "copy", "in_place", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [(c["context"], c["batch"], c["placement"]) for c in result["cases"]] == [
        (2048, 1, "copy"), (2048, 1, "in_place"), (2048, 2, "copy"), (2048, 2, "in_place")]
    copy, in_place = result["cases"][:2]
    assert in_place["layer_bytes"] < copy["layer_bytes"] / 2  # the meta index alone
    for case in result["cases"]:
        assert case["rel_err_vs_reference"] < 1e-5  # fp32: the step is the reference's
        assert case["graph_vs_eager_max_abs"] == 0  # off CUDA the "graph" runs eagerly
        assert case["dense_ms"] > 0 and case["eager_ms"] > 0
        # the CPU's step is the fused kernel (one extension call) where the layer has no
        # cluster cache and the backend is 'auto'; else the torch reference's operations
        assert case["fused_cpu"] == (case["placement"] != "in_place_cache")
        assert (case["torch_ops"] == 0) == case["fused_cpu"]
        assert case["rank_ms"] > 0 and case["attend_ms"] > 0


def test_kernels_option_compares_the_attention_by_each_retrieval_map(tmp_path):
    """``--kernels`` (here on the CPU, the Triton kernels interpreted: no device times) runs
    the step's attention launch by each retrieval map on the step's own zones, in place
    through the cluster cache too, and they agree."""
    result = device_step.main(["--device", "cpu", "--contexts", "2048", "--batches", "2",
                               "--heads", "4", "2", "32", "--steps", "1", "--kernels",
                               "--placements", "copy", "in_place_cache",
                               "--out", str(tmp_path / "ds.json")])
    for case in result["cases"]:
        att = case["attention_us"]
        assert att["default"] in RETRIEVAL_MAPS
        for how in RETRIEVAL_MAPS:
            assert att[f"{how}_max_abs"] <= 1e-5, (case["placement"], how, att)


def test_gpu_check_fits_a_device_lease(tmp_path):
    # one 10-minute command of a 15-minute lease, with room for a rerun: <= 8 minutes
    stages = gpu_check.stages(tmp_path)
    tests = gpu_check.test_stages()  # side by side
    assert max(limit for *_, limit in tests) + sum(limit for *_, limit in stages) <= 480
    for path in [*gpu_check.TESTS, *gpu_check.CPU_EXTENSION_TESTS]:
        assert (gpu_check.ROOT / path).exists(), path
    # every CUDA test file once, none of the C++ extension's (they run last, on their own)
    files = [cmd[-1] for _, cmd, _ in tests]
    assert len(set(files)) == len(files) >= len(gpu_check.TESTS)
    assert not set(files) & set(gpu_check.CPU_EXTENSION_TESTS)
    assert "tests/kernels/test_kmeans.py" in files
    for path, k in gpu_check.TESTS.items():  # a -k selection picks at least one test
        if k:
            proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                                   "-p", "no:cacheprovider", "-k", k, path],
                                  cwd=gpu_check.ROOT, capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 0 and f"{path}::" in proc.stdout, proc.stdout[-2000:]
    benches = [(name, cmd) for name, cmd, _ in stages if "--out" in cmd]
    assert [name for name, _ in benches] == ["device_step", "device_step_quest", "gpu_stack",
                                             "index_build"]
    for name, cmd in benches:  # the benchmarks accept their arguments
        help_cmd = cmd[:cmd.index("--out")] + ["--help"]
        proc = subprocess.run(help_cmd, cwd=gpu_check.ROOT, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, (name, proc.stderr[-2000:])


def test_gpu_check_needs_its_output_directory():
    proc = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=gpu_check.ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage: python3 bench/gpu_check.py OUTDIR" in proc.stderr


def test_cpu_profile_prints_the_threading_and_the_costliest_functions():
    proc = subprocess.run([sys.executable, "bench/cpu_profile.py",
                           "tests/index/test_wave_index.py::test_full_budget_equals_full_attention"
                           "[2-2-1200-32-512]"],
                          cwd=gpu_check.ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "ATen/Parallel" in proc.stdout and "1 passed" in proc.stdout
    assert "tottime" in proc.stdout and "function calls" in proc.stdout
