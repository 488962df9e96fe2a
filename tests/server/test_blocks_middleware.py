"""vllm_retro.server.blocks_middleware: Block-Attention requests get their cache salt
before vLLM reads them; bad block starts get a 400; everything else passes untouched."""

from __future__ import annotations

import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from vllm_retro.blocks.request import block_salt
from vllm_retro.server.blocks_middleware import BlockSaltMiddleware, BlocksOffMiddleware


async def echo(request: Request) -> JSONResponse:
    body = await request.body()
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = body.decode()
    return JSONResponse({"body": parsed, "length": request.headers.get("content-length")})


def client(middleware: type = BlockSaltMiddleware) -> TestClient:
    paths = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
    app = Starlette(routes=[Route(p, echo, methods=["POST"]) for p in paths])
    app.add_middleware(middleware)
    return TestClient(app)


def test_a_block_request_gets_the_salt_of_its_starts():
    c = client()
    for path in ("/v1/completions", "/v1/chat/completions"):
        sent = {"prompt": "x", "vllm_xargs": {"retro_blocks": [0, 30, 70]}}
        got = c.post(path, json=sent).json()
        assert got["body"] == {**sent, "cache_salt": block_salt([0, 30, 70])}
        assert int(got["length"]) == len(json.dumps(got["body"]).encode())
    mine = {"prompt": "x", "cache_salt": "tenant-7", "vllm_xargs": {"retro_blocks": [0, 9]}}
    assert c.post("/v1/completions", json=mine).json()["body"]["cache_salt"] == \
        block_salt([0, 9], "tenant-7")


def test_other_requests_pass_untouched():
    c = client()
    for body in ({"prompt": "retro_blocks are mentioned here"},
                 {"prompt": "x", "vllm_xargs": {"other": 1}}):
        assert c.post("/v1/completions", json=body).json()["body"] == body
    raw = b'{"prompt": "retro_blocks", '  # malformed: left to vLLM's own error
    assert c.post("/v1/completions", content=raw).json()["body"] == raw.decode()
    body = {"input": "x", "vllm_xargs": {"retro_blocks": "bad"}}
    assert c.post("/v1/embeddings", json=body).json()["body"] == body  # not a generation


def test_bad_starts_get_a_400_naming_them():
    c = client()
    r = c.post("/v1/chat/completions",
               json={"messages": [], "vllm_xargs": {"retro_blocks": [0, 50, 40]}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"] == "retro_blocks must ascend strictly, got 40 after 50"
    assert err["code"] == 400 and err["param"] == "retro_blocks"
    r = c.post("/v1/completions", json={"prompt": [5, 6, 7, 8],
                                        "vllm_xargs": {"retro_blocks": [0, 2, 4]}})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "retro_blocks: the last block starts at 4, past the prompt's 4 tokens "
        "(accepted: 1 .. 3)")
    ok = {"prompt": [5, 6, 7, 8], "vllm_xargs": {"retro_blocks": [0, 2, 3]}}
    assert c.post("/v1/completions", json=ok).status_code == 200
    r = c.post("/v1/completions", json={"prompt": "x", "cache_salt": 5,
                                        "vllm_xargs": {"retro_blocks": [0, 5]}})
    assert r.status_code == 400 and "cache_salt must be a string" in r.json()["error"]["message"]


def test_with_retro_off_a_block_request_gets_a_400_and_others_pass():
    c = client(BlocksOffMiddleware)
    r = c.post("/v1/completions", json={"prompt": "x", "vllm_xargs": {"retro_blocks": [0, 9]}})
    assert r.status_code == 400 and "retro is off" in r.json()["error"]["message"]
    assert c.post("/v1/completions", json={"prompt": "x"}).json()["body"] == {"prompt": "x"}


def test_a_model_without_block_tuning_is_warned_about_once(caplog, tmp_path):
    import logging

    from vllm_retro.blocks.tune import TUNED_KEY
    from vllm_retro.server.blocks_middleware import UntunedBlockSaltMiddleware
    from vllm_retro.server.cli import blocks_middleware

    c = client(UntunedBlockSaltMiddleware)
    sent = {"prompt": "x", "vllm_xargs": {"retro_blocks": [0, 3]}}
    # under vLLM's logger, whose handler prints it when served
    with caplog.at_level(logging.WARNING, logger="vllm.retro.blocks"):
        c.post("/v1/completions", json={"prompt": "plain"})
        assert not caplog.records  # only Block-Attention requests are warned about
        for _ in range(3):
            assert c.post("/v1/completions", json=sent).json()["body"]["cache_salt"]
    assert [r.getMessage() for r in caplog.records if "block-fine-tuned" in r.getMessage()] \
        and len(caplog.records) == 1
    assert "vllm-retro blocktune" in caplog.records[0].getMessage()
    plain, tuned = tmp_path / "plain", tmp_path / "tuned"
    for d, config in ((plain, {}), (tuned, {TUNED_KEY: {"steps": 3}})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
    pkg = "vllm_retro.server.blocks_middleware."
    assert blocks_middleware({}, str(plain)) == pkg + "UntunedBlockSaltMiddleware"
    assert blocks_middleware({}, str(tuned)) == pkg + "BlockSaltMiddleware"
    assert blocks_middleware({}, "org/hub-name") == pkg + "BlockSaltMiddleware"  # unknown
    assert blocks_middleware({"enabled": False}, str(plain)) == pkg + "BlocksOffMiddleware"


def test_starts_past_a_text_prompt_end_get_a_400_counted_by_the_servers_tokenize():
    seen: list[dict] = []

    async def tokenize(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        seen.append(body)
        if request.headers.get("authorization") != "Bearer k":
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        text = body["prompt"] if "prompt" in body else " ".join(
            m["content"] for m in body["messages"])
        return JSONResponse({"count": len(text.split()), "tokens": []})

    paths = ("/v1/completions", "/v1/chat/completions")
    app = Starlette(routes=[*(Route(p, echo, methods=["POST"]) for p in paths),
                            Route("/tokenize", tokenize, methods=["POST"])])
    app.add_middleware(BlockSaltMiddleware)
    c = TestClient(app, headers={"Authorization": "Bearer k"})
    xargs = {"vllm_xargs": {"retro_blocks": [0, 2, 5]}}
    r = c.post("/v1/completions", json={"prompt": "one two three four five", **xargs})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "retro_blocks: the last block starts at 5, past the prompt's 5 tokens "
        "(accepted: 1 .. 4)")
    assert seen[-1] == {"prompt": "one two three four five"}
    ok = c.post("/v1/completions", json={"prompt": ["a b c d e f", "a b c d e f g"],
                                         "model": "m", "add_special_tokens": False, **xargs})
    assert ok.json()["body"]["cache_salt"] == block_salt([0, 2, 5])
    assert seen[-2:] == [{"model": "m", "add_special_tokens": False, "prompt": p}
                         for p in ("a b c d e f", "a b c d e f g")]
    chat = {"messages": [{"role": "user", "content": "a b c"}], "chat_template_kwargs": {
        "enable_thinking": False}, "temperature": 0.5, **xargs}
    r = c.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and "past the prompt's 3 tokens" in r.text
    assert seen[-1] == {"messages": chat["messages"],
                        "chat_template_kwargs": {"enable_thinking": False}}
    r = c.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer x"})
    assert r.json()["body"]["cache_salt"]  # /tokenize refused: left to vLLM, which answers
