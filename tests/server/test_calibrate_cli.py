"""``vllm-retro calibrate`` on the command line, and ``vllm-retro serve --retro-index saap``'s
checks of the SAAP file before the server starts."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import vllm_retro.server.cli as cli
from tests.tiny_model import build_tiny_llama
from vllm_retro.index.saap_model import ModelIdentity, random_saap_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-cli"))


def test_calibrate_help_lists_its_options_without_importing_vllm() -> None:
    probe = ("import sys; import vllm_retro.server.cli as c\n"
             "try:\n    c.main(['calibrate', '--help'])\n"
             "except SystemExit as e:\n    print('EXIT', e.code, 'vllm' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "--out FILE" in res.stdout and "--buckets" in res.stdout
    assert "--text FILE_OR_DIR" in res.stdout and "(default: 256)" in res.stdout
    assert res.stdout.strip().endswith("EXIT 0 False")


def test_calibrate_bad_option_is_one_line(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["calibrate", str(tmp_path), "--out", str(tmp_path / "x.saap"),
                  "--buckets", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("vllm-retro: error: --buckets=1 is invalid; accepted: an integer in "
                   "[2, 65536]")
    with pytest.raises(SystemExit) as exc:
        cli.main(["calibrate", str(tmp_path), "--out", str(tmp_path / "x.saap")])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"vllm-retro: error: {tmp_path} is not a model directory (no config.json)")


def test_calibrate_runs_from_the_command_line(tiny: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.saap"
    with pytest.raises(SystemExit) as exc:
        cli.main(["calibrate", str(tiny), "--out", str(out), "--buckets", "8", "--hidden",
                  "16", "--tokens", "1280", "--prompt-tokens", "640", "--query-samples", "32",
                  "--steps", "10", "--eval-probes", "2", "--dense-layers"])
    assert exc.value.code == 0
    captured = capsys.readouterr()
    assert "record 100%" in captured.err and "train  100%" in captured.err
    assert f"wrote {out}" in captured.out
    payload = torch.load(out, weights_only=True)
    assert payload["format"] == "vllm-retro-saap" and payload["version"] == 1


def test_serve_checks_the_saap_file_against_the_model(tiny: Path, tmp_path: Path) -> None:
    idn = ModelIdentity.of_directory(tiny)
    path = tmp_path / "other.saap"
    random_saap_model(replace(idn, num_layers=3, fingerprint="0" * 16), 8, 16).save(path)
    settings = {"index": "saap", "saap_file": str(path)}
    with pytest.raises(SystemExit, match=r"^vllm-retro: error: saap file .*other\.saap was "
                                         r"trained for 3 layers x 2 KV heads x head_dim 32 .*;"
                                         r" the model served is 2 layers x 2 KV heads x "
                                         r"head_dim 32"):
        cli.check_saap_file(settings, str(tiny))
    good = tmp_path / "good.saap"
    random_saap_model(idn, 8, 16).save(good)
    cli.check_saap_file({**settings, "saap_file": str(good)}, str(tiny))
    cli.check_saap_file({"index": "wave"}, str(tiny))  # nothing to check
