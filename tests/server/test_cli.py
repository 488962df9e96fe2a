"""``vllm-retro serve`` command line: ``--retro-*`` options folded into vLLM's engine options,
bad values rejected with a clear message, defaults, model resolution and the start-up banner.
No server is started: the parser and the functions ``serve`` chains are called directly."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm_retro.server.cli as cli  # noqa: E402
from vllm_retro.config import RetroConfig  # noqa: E402
from vllm_retro.server.default_model import DEFAULT_SERVED_NAME  # noqa: E402
from vllm_retro.vllm.settings import CONNECTOR_MODULE, CONNECTOR_NAME, WORKER_EXTENSION  # noqa: E402


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    """The ``vllm-retro`` parser (built once: vLLM's serve options take seconds to add)."""
    return cli.build_parser()


@pytest.fixture(scope="module")
def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``serve`` subcommand's parser."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _serve(parser: argparse.ArgumentParser, *argv: str) -> argparse.Namespace:
    return cli.parse_args(["serve", *argv], parser)


def test_apply_retro_folds_flags_and_json_into_engine_options(
        parser: argparse.ArgumentParser) -> None:
    """``--retro-*`` flags and ``--additional-config '{"retro": ...}'`` end up in
    ``additional_config["retro"]`` (other keys kept), the retro connector and worker
    extension are set, no ``retro__*`` attribute is left for vLLM, and the full config in
    force is returned."""
    args = _serve(parser, "/some/dir", "--retro-retrieval-budget", "0.05",
                  "--no-retro-async-updates", "--additional-config",
                  '{"retro": {"cluster_size": 32}, "other": 1}')
    settings = cli.apply_retro(args)
    assert args.additional_config == {
        "retro": {"cluster_size": 32, "retrieval_budget": 0.05, "async_updates": False},
        "other": 1}
    ktc = args.kv_transfer_config
    assert ktc.kv_connector == CONNECTOR_NAME == "RetroConnector"
    assert ktc.kv_connector_module_path == CONNECTOR_MODULE == "vllm_retro.vllm.connector"
    assert ktc.kv_role == "kv_both"
    assert args.worker_extension_cls == WORKER_EXTENSION
    assert not [k for k in vars(args) if k.startswith("retro__")]
    assert settings == RetroConfig(cluster_size=32, retrieval_budget=0.05,
                                   async_updates=False).to_dict()

    from vllm.platforms import current_platform

    assert args.attention_backend == ("CUSTOM" if current_platform.is_cuda() else None)


def test_flags_override_additional_config(parser: argparse.ArgumentParser) -> None:
    """A ``--retro-*`` flag wins over the same setting in ``--additional-config``; the
    JSON's other retro settings stay."""
    args = _serve(parser, "--additional-config",
                  '{"retro": {"retrieval_budget": 0.1, "page_size": 16}}',
                  "--retro-retrieval-budget", "0.02")
    settings = cli.apply_retro(args)
    assert args.additional_config["retro"] == {"retrieval_budget": 0.02, "page_size": 16}
    assert settings["retrieval_budget"] == 0.02
    assert settings["page_size"] == 16


def test_no_retro_options_gives_defaults(parser: argparse.ArgumentParser) -> None:
    """Without any retro option the retro connector is still set, ``additional_config``
    carries an empty retro section, and the returned settings are the defaults."""
    args = _serve(parser)
    assert cli.apply_retro(args) == RetroConfig().to_dict()
    assert args.additional_config == {"retro": {}}
    assert args.kv_transfer_config.kv_connector == CONNECTOR_NAME


def test_every_field_has_an_option(serve_parser: argparse.ArgumentParser) -> None:
    """Every RetroConfig setting has ``--retro-<flat-name-with-dashes>`` (booleans also
    ``--no-retro-...``; a policy group's fields by their flat names, e.g.
    ``--retro-pq-bits``), and there is no ``--retro-*`` option for anything else."""
    options = {s: a for a in serve_parser._actions for s in a.option_strings}
    retro = {s for s in options if s.startswith(("--retro-", "--no-retro-"))}
    expected = set()
    for name in RetroConfig.flat_names():
        flag = "--retro-" + name.replace("_", "-")
        expected.add(flag)
        assert options[flag].dest == "retro__" + name
        if isinstance(RetroConfig().get(name), bool):
            expected.add("--no-" + flag[2:])
    assert {"--retro-pq-bits", "--retro-quest-page-size", "--retro-saap-file"} <= expected
    assert retro == expected


def test_every_option_parses_to_the_fields_type(parser: argparse.ArgumentParser) -> None:
    """Each field's default, given back on the command line as text, reaches the retro
    settings with the field's own type (int stays int, float float, choice str)."""
    argv: list[str] = []
    defaults = RetroConfig().to_dict()
    # a default None cannot be given on the command line
    defaults["cache_pages"], defaults["build_steps"] = 100, 8
    defaults["host_memory_gb"], defaults["table_threads"] = 2.5, 4
    defaults["saap_file"] = "model.saap"  # a path; checked only with index 'saap'
    for name, value in defaults.items():
        flag = "--retro-" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    args = _serve(parser, *argv)
    cli.apply_retro(args)
    given = args.additional_config["retro"]
    assert given == defaults
    assert {k: type(v) for k, v in given.items()} == {k: type(v) for k, v in defaults.items()}


# ---------------------------------------------------------------------- bad values

def test_out_of_range_value_names_field_value_and_range(parser: argparse.ArgumentParser) -> None:
    """A retrieval budget outside (0, 1] stops with a message naming the setting, the value
    and the accepted range."""
    args = _serve(parser, "--retro-retrieval-budget", "2")
    with pytest.raises(SystemExit) as exc:
        cli.apply_retro(args)
    msg = str(exc.value.code)
    assert "retrieval_budget" in msg
    assert "2.0" in msg
    assert "(0.0, 1.0]" in msg


@pytest.mark.parametrize(("argv", "needles"), [
    (["--retro-retrieval-budget", "x"], ["--retro-retrieval-budget", "'x'"]),
    (["--retro-cluster-size", "1.5"], ["--retro-cluster-size", "'1.5'"]),
    (["--retro-cache-policy", "lfu"], ["--retro-cache-policy", "'lfu'", "'lru'"]),
    (["--retro-index", "hnsw"], ["--retro-index", "'hnsw'", "'wave'", "'pqcache'"]),
])
def test_unparsable_value_is_an_argparse_error(parser: argparse.ArgumentParser,
                                               capsys: pytest.CaptureFixture[str],
                                               argv: list[str], needles: list[str]) -> None:
    """A value of the wrong type or outside the choices is a usage error (exit code 2) whose
    message names the option, the value and, for choices, the accepted ones."""
    with pytest.raises(SystemExit) as exc:
        _serve(parser, *argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err


def test_other_connector_rejected(parser: argparse.ArgumentParser) -> None:
    """Another KV connector cannot be combined with retro: the message names both."""
    args = _serve(parser, "--kv-transfer-config",
                  '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    with pytest.raises(SystemExit) as exc:
        cli.apply_retro(args)
    assert "NixlConnector" in str(exc.value.code)
    assert CONNECTOR_NAME in str(exc.value.code)


def test_retro_connector_given_explicitly_is_accepted(parser: argparse.ArgumentParser) -> None:
    """Naming the retro connector in ``--kv-transfer-config`` is allowed (it is retro's)."""
    args = _serve(parser, "--kv-transfer-config", json.dumps({"kv_connector": CONNECTOR_NAME,
                                                              "kv_role": "kv_both"}))
    cli.apply_retro(args)
    assert args.kv_transfer_config.kv_connector_module_path == CONNECTOR_MODULE


def test_foreign_worker_extension_rejected(parser: argparse.ArgumentParser) -> None:
    """A worker extension other than retro's stops with a message naming both; retro's own
    is accepted."""
    args = _serve(parser, "--worker-extension-cls", "foo.Bar")
    with pytest.raises(SystemExit) as exc:
        cli.apply_retro(args)
    assert "foo.Bar" in str(exc.value.code)
    assert WORKER_EXTENSION in str(exc.value.code)
    args = _serve(parser, "--worker-extension-cls", WORKER_EXTENSION)
    cli.apply_retro(args)
    assert args.worker_extension_cls == WORKER_EXTENSION


@pytest.mark.parametrize(("extra", "needle"), [
    ('{"retro": 5}', "JSON object"),
    ('{"retro": {"bogus": 1}}', "'bogus'"),
    ('{"retro": {"cache_policy": "fifo"}}', "cache_policy"),
])
def test_bad_additional_config_retro_rejected(parser: argparse.ArgumentParser, extra: str,
                                              needle: str) -> None:
    """A retro section that is not an object, has an unknown key or a bad value stops with
    a message saying what is wrong."""
    args = _serve(parser, "--additional-config", extra)
    with pytest.raises(SystemExit) as exc:
        cli.apply_retro(args)
    assert needle in str(exc.value.code)


# ---------------------------------------------------------------------- defaults, model

def test_defaults(parser: argparse.ArgumentParser) -> None:
    """Loopback host, port 8000, the draining shutdown timeout, and no model when none is
    given."""
    args = _serve(parser)
    assert args.host == "127.0.0.1" == cli.DEFAULT_HOST
    assert args.port == 8000
    assert args.shutdown_timeout == cli.DEFAULT_SHUTDOWN_TIMEOUT_S
    assert args.model is None
    assert args.model_tag in (None, cli.DEFAULT_MODEL_TOKEN)  # "no MODEL" either way


def test_resolve_model_local_dir_goes_offline(parser: argparse.ArgumentParser, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A positional model directory becomes ``args.model`` and switches the hub offline
    (without overriding a value the user already set)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    (tmp_path / "config.json").write_text("{}")
    args = _serve(parser, str(tmp_path))
    cli.resolve_model(args)
    assert args.model == str(tmp_path)
    assert args.model_tag is None
    assert args.served_model_name is None
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert os.environ["TRANSFORMERS_OFFLINE"] == "0"


def test_resolve_model_hub_name_stays_online(parser: argparse.ArgumentParser,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that is not a local directory (a hub name) leaves hub access alone."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    args = _serve(parser, "--model", "org/not-a-local-dir")
    cli.resolve_model(args)
    assert args.model == "org/not-a-local-dir"
    assert "HF_HUB_OFFLINE" not in os.environ


def test_resolve_model_without_model_uses_embedded_default(
        parser: argparse.ArgumentParser, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """No MODEL: the embedded default's directory is served under its own name (an explicit
    ``--served-model-name`` is kept). The real default is a ~400 MB download, so its
    directory lookup is replaced by ``tmp_path`` here."""
    monkeypatch.setattr(cli, "default_model_dir", lambda: tmp_path)
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    args = _serve(parser)
    cli.resolve_model(args)
    assert args.model == str(tmp_path)
    assert args.served_model_name == [DEFAULT_SERVED_NAME] == ["Qwen2.5-Coder-0.5B-Instruct"]
    assert DEFAULT_SERVED_NAME in capsys.readouterr().out
    # Set on the namespace: vLLM's parser refuses --served-model-name without a positional
    # MODEL (see test_served_model_name_without_model below); a --config file can set it.
    args = _serve(parser)
    args.served_model_name = ["mine"]
    cli.resolve_model(args)
    assert args.model == str(tmp_path)
    assert args.served_model_name == ["mine"]


def test_served_model_name_without_model(parser: argparse.ArgumentParser, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``vllm-retro serve --served-model-name X`` (embedded default model, own name) parses
    although vLLM's own preprocessing insists on a positional model, and serves the default
    model under that name."""
    monkeypatch.setattr(cli, "default_model_dir", lambda: tmp_path)
    (tmp_path / "config.json").write_text("{}")
    for argv in (("--served-model-name", "mine"), ("--served-model-name=mine",)):
        args = _serve(parser, *argv)
        assert args.served_model_name == ["mine"]
        cli.resolve_model(args)
        assert args.model == str(tmp_path) and args.served_model_name == ["mine"]


# ---------------------------------------------------------------------- banner

def _banner(parser: argparse.ArgumentParser, tmp_path: Path, *argv: str) -> str:
    (tmp_path / "config.json").write_text("{}")
    args = _serve(parser, str(tmp_path), *argv)
    settings = cli.apply_retro(args)
    cli.resolve_model(args)
    return cli.banner(args, settings)


def test_banner_urls_and_marked_settings(parser: argparse.ArgumentParser,
                                         tmp_path: Path) -> None:
    """The banner names the model and its served name, the base URL with the API, health
    and metrics paths, and every retro setting, non-defaults marked with ``*`` and
    defaults not."""
    text = _banner(parser, tmp_path, "--port", "8123", "--served-model-name", "tiny",
                   "--retro-cluster-size", "32", "--retro-page-size", "16")
    assert f"serving {tmp_path} as 'tiny'" in text
    url = "http://127.0.0.1:8123"
    for path in ("/v1", "/health", "/metrics"):
        assert url + path in text
    assert "API key required" not in text
    line = next(x for x in text.splitlines() if "retro on:" in x)
    shown = dict(re.findall(r"(\w+)=(\S+)", line.split("retro on:", 1)[1]))
    defaults = RetroConfig().to_dict()
    assert set(shown) == set(defaults) - {"enabled"}
    assert {k for k, v in shown.items() if v.endswith("*")} == {"cluster_size", "page_size"}
    assert shown["cluster_size"] == "32*"
    assert shown["page_size"] == "16*"
    assert shown["cache_policy"] == str(defaults["cache_policy"])
    assert shown["build_steps"] == "None(0"  # its default resolved here: "0 on cpu"
    assert "build_steps=None(0 on cpu)" in line and "table_threads=None(1 on cpu)" in line


def test_banner_api_key_and_retro_off(parser: argparse.ArgumentParser, tmp_path: Path) -> None:
    """With ``--api-key`` the banner says a key is required; with ``--no-retro-enabled`` it
    says retro is OFF."""
    text = _banner(parser, tmp_path, "--api-key", "secret", "--no-retro-enabled")
    assert "API key required" in text
    assert "secret" not in text
    assert "retro OFF" in text
    assert "retro on" not in text


# ---------------------------------------------------------------------- help

def test_help_exits_zero_and_lists_retro_group(parser: argparse.ArgumentParser,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``serve --help`` exits 0 and lists the Retro group; ``serve --help=Retro`` lists every
    ``--retro-*`` option with its default."""
    with pytest.raises(SystemExit) as exc:
        _serve(parser, "--help")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "vllm-retro serve" in out
    assert "Retro" in out
    with pytest.raises(SystemExit) as exc:
        _serve(parser, "--help=Retro")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in RetroConfig.flat_names():
        assert "--retro-" + name.replace("_", "-") in out
    assert "(default: 0.018)" in out


@pytest.mark.parametrize(("group", "option", "default"), [
    ("ModelConfig", "--dtype", "(default: float32 on a CPU without native bfloat16"),
    ("ModelConfig", "--enforce-eager", "(default: True on CPU, else False)"),
    ("CacheConfig", "--gpu-memory-utilization", "(default: 0.92 on a GPU; on CPU"),
])
def test_help_gives_the_defaults_the_server_chooses(
        parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str], group: str,
        option: str, default: str) -> None:
    """Options whose default the server picks at start (None on its parser) say what it
    picks, not "default: None"."""
    with pytest.raises(SystemExit):
        _serve(parser, f"--help={group}")
    import re

    entry = re.search(rf"^  {option}\b.*?(?=^  -)", capsys.readouterr().out + "\n  -",
                      flags=re.M | re.S)
    assert entry is not None, option
    text = " ".join(entry.group(0).split())
    assert default in text and "(default: None)" not in text


def test_hub_name_offline_is_accepted_only_when_cached(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With hub access off, a hub name is served if the Hugging Face cache holds it, and
    refused in one line otherwise; a path-like name that does not exist is always refused."""
    import huggingface_hub.constants as hf_constants

    snap = tmp_path / "models--org--cached" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "models--org--cached" / "refs").mkdir()
    (tmp_path / "models--org--cached" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cli.check_model("org/cached")
    with pytest.raises(SystemExit, match="org/missing does not exist"):
        cli.check_model("org/missing")
    with pytest.raises(SystemExit, match="./models/x does not exist"):
        cli.check_model("./models/x")


def test_the_command_line_prints_only_its_own_lines() -> None:
    """``vllm-retro --help`` (and a usage error) as a user runs them: the help on stdout and
    nothing else — no vLLM notice about its Triton kernels, no nanobind leak report at exit."""
    import subprocess
    import sys

    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-c", "import sys; from vllm_retro.server.cli import main; "
         "main(sys.argv[1:])", *a], capture_output=True, text=True, timeout=300)
    helped = run("--help")
    assert helped.returncode == 0
    assert helped.stdout.startswith("usage: vllm-retro") and "serve" in helped.stdout
    assert helped.stderr == ""
    wrong = run("sevre")
    assert wrong.returncode == 2 and wrong.stdout == ""
    lines = wrong.stderr.strip().splitlines()
    assert lines[0].startswith("usage: vllm-retro") and "invalid choice: 'sevre'" in lines[-1]
    assert not any("nanobind" in line or "leaked" in line for line in lines), wrong.stderr
