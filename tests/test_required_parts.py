"""tests/required_parts.py: under make test, a skip that names a missing part of the install
fails the session; a skip for what the machine cannot have does not."""

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

SUITE = '''
import pytest

def test_needs_a_gpu():
    pytest.skip("needs a CUDA GPU")

def test_runs():
    assert True
'''


def _run(pytester, monkeypatch, extra: str, require: bool, path_first: str = ""):
    pytester.makepyfile(test_suite=SUITE + extra)
    monkeypatch.setenv("PYTHONPATH", ":".join(p for p in (path_first, str(ROOT)) if p))
    if require:
        monkeypatch.setenv("VLLM_RETRO_REQUIRE_PARTS", "1")
    else:
        monkeypatch.delenv("VLLM_RETRO_REQUIRE_PARTS", raising=False)
    return pytester.runpytest_subprocess("-p", "tests.required_parts", "-q", "-rs")


OK = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)


@pytest.mark.parametrize("extra,missing", [
    ("\ndef test_x():\n    pytest.importorskip('tomli_not_here')\n", False),
    ("\ndef test_kernel():\n    pytest.skip('extension not built: no compiler')\n", True),
    ("\ndef test_graph():\n    pytest.skip('graph kernels unavailable: x')\n", True),
])
def test_a_missing_part_fails_only_when_required(pytester, monkeypatch, extra, missing):
    result = _run(pytester, monkeypatch, extra, require=True)
    if missing:
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.stdout.fnmatch_lines(["*missing parts*", "*skip(s) because a part*",
                                     "MISSING test_suite.py::test_*"])
    else:
        assert result.ret in OK
    assert _run(pytester, monkeypatch, extra, require=False).ret in OK


def test_vllm_missing_fails_the_required_run(pytester, monkeypatch):
    # vLLM missing (a stand-in first on the path): the module skips at collection
    pytester.makepyfile(vllm="raise ModuleNotFoundError('not installed', name='vllm')")
    extra = "\nvllm = pytest.importorskip('vllm')\n"
    result = _run(pytester, monkeypatch, extra, require=True, path_first=str(pytester.path))
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["MISSING test_suite.py: *could not import 'vllm'*"])
