"""``calibrate`` end to end on a tiny Llama: the file it writes, resuming after an
interruption, refusing another calibration's work, and one-line errors for bad options."""

from __future__ import annotations

import shutil

import pytest
import torch

from vllm_retro.index.saap_model import ModelIdentity, load_saap
from vllm_retro.saap import corpus
from vllm_retro.saap.calibrate import CalibrationError, Settings, calibrate, work_dir

TINY = Settings(buckets=8, hidden=16, tokens=3 * 640, prompt_tokens=640, query_samples=48,
                steps=25, batch_size=32, kmeans_iters=5, eval_probes=2)


def test_calibrate_writes_a_checked_file_and_resumes(tiny_llama, tmp_path):
    out = tmp_path / "tiny.saap"
    lines: list[str] = []
    model = calibrate(tiny_llama, out, TINY, progress=False, log=lines.append, keep_work=True)
    got = load_saap(out, ModelIdentity.of_directory(tiny_llama))
    assert got.num_buckets == 8 and got.hidden == 16 and got.dense_layers == (0,)
    assert got.tensors["centroids"].shape == (2, 2, 8, 32)
    t = got.training
    assert t["buckets"] == 8 and t["text_source"] == "installed distributions' descriptions"
    assert len(t["train_queries"]) == 2 and min(min(q) for q in t["train_queries"]) > 0
    q = got.quality
    assert q["probes"] == 2 and len(q["layers"]) == 2
    assert 0 < q["mean"]["served_saap"] <= q["mean"]["served_oracle"] <= 1 + 1e-6
    assert "wrote" in lines[-1] and "--retro-index saap" in lines[-1]
    for name, tensor in model.tensors.items():
        assert torch.equal(tensor.float(), got.tensors[name])
    work = work_dir(out)
    # interrupted after recording and one layer: the rerun keeps the recordings
    (work / "layer-001.pt").unlink()
    out.unlink()
    stamps = {p.name: p.stat().st_mtime_ns for p in work.glob("prompt-*.pt")}
    lines.clear()
    again = calibrate(tiny_llama, out, TINY, progress=False, log=lines.append, keep_work=True)
    assert "(resuming)" in lines[0]
    assert {p.name: p.stat().st_mtime_ns for p in work.glob("prompt-*.pt")} == stamps
    for name, tensor in again.tensors.items():  # the same training, layer 1 redone
        torch.testing.assert_close(tensor, model.tensors[name], atol=1e-5, rtol=1e-5)
    calibrate(tiny_llama, out, TINY, progress=False, log=lines.append)  # nothing left to do
    assert not work.exists()  # removed once the file is written


def test_other_settings_do_not_resume_another_calibration(tiny_llama, tmp_path):
    out = tmp_path / "x.saap"
    work = work_dir(out)
    work.mkdir()
    (work / "plan.json").write_text('{"settings": {"buckets": 16}}')
    with pytest.raises(CalibrationError, match=r"^calibrate: .*x\.saap\.work holds a "
                                               r"calibration started with other settings"):
        calibrate(tiny_llama, out, TINY, progress=False, log=lambda _: None)
    shutil.rmtree(work)


@pytest.mark.parametrize(("changes", "message"), [
    ({"buckets": 1}, r"--buckets=1 is invalid; accepted: an integer in \[2, 65536\]"),
    ({"tokens": 1000, "prompt_tokens": 640},
     r"--tokens=1000 is invalid; accepted: an integer in \[1280, "),
    ({"holdout_prompts": 3}, r"--holdout-prompts=3 is invalid; accepted: an integer in "
                             r"\[1, 2\]"),
    ({"queries": "all"}, r"--queries='all' is invalid; accepted: 'weighted' or 'long-range'"),
    ({"lr": 0.0}, r"--lr=0.0 is invalid; accepted: a number in \(0, 1\]"),
    ({"dtype": "float16"}, r"--dtype='float16' is invalid"),
    ({"eval_probes": 9}, r"--eval-probes=9 is invalid; accepted: an integer in \[1, 8\]"),
])
def test_bad_settings_name_the_option_and_range(changes, message):
    base = {f: getattr(TINY, f) for f in TINY.__dataclass_fields__}
    with pytest.raises(CalibrationError, match="^calibrate: " + message):
        Settings(**{**base, **changes})


def test_bad_model_out_and_text_get_one_line_errors(tiny_llama, tmp_path):
    quiet = {"progress": False, "log": lambda _: None}
    with pytest.raises(CalibrationError, match="is not a model directory"):
        calibrate(tmp_path, tmp_path / "a.saap", TINY, **quiet)
    with pytest.raises(CalibrationError, match="is a directory"):
        calibrate(tiny_llama, tmp_path, TINY, **quiet)
    with pytest.raises(CalibrationError, match=r"--dense-layers=\[5\] is invalid; accepted: "
                                               r"layer indices below the model's 2 layers"):
        calibrate(tiny_llama, tmp_path / "a.saap", Settings(**{
            **{f: getattr(TINY, f) for f in TINY.__dataclass_fields__}, "dense_layers": (5,)}),
            **quiet)
    (tmp_path / "short.txt").write_text("only a few words")
    small = Settings(**{**{f: getattr(TINY, f) for f in TINY.__dataclass_fields__},
                        "text": str(tmp_path / "short.txt")})
    with pytest.raises(corpus.CorpusError, match=r"the text holds \d+ tokens, fewer than the "
                                                 r"1920 asked"):
        calibrate(tiny_llama, tmp_path / "a.saap", small, **quiet)
    with pytest.raises(corpus.CorpusError, match="does not exist"):
        corpus.path_documents(tmp_path / "missing")


def test_text_directories_and_installed_documents(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_text("beta")
    (tmp_path / "sub" / "a.txt").write_text("alpha")
    (tmp_path / "c.bin").write_bytes(b"\x00\x01")
    docs = corpus.path_documents(tmp_path)
    assert [d.text for d in docs] == ["beta", "alpha"]
    installed = corpus.installed_documents()
    assert len(installed) > 10 and all(len(d.text) >= corpus.MIN_DOCUMENT_CHARS
                                       for d in installed)
    # not the accuracy harness's text (CPython's language reference)
    from vllm_retro.capture import real_prose

    reference = real_prose(20_000)[:2000]
    assert all(reference not in d.text for d in installed)


def test_every_training_option_explains_itself():
    import argparse
    import dataclasses

    from vllm_retro.saap.calibrate import SETTING_HELP, Settings, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    names = {f.name for f in dataclasses.fields(Settings)} - {"text", "dense_layers"}
    assert set(SETTING_HELP) == names
    for action in parser._actions:
        if action.dest in names:
            assert action.help.startswith(SETTING_HELP[action.dest]), action.dest
