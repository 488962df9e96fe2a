"""The OpenAI server's side of Block-Attention: a request body whose ``vllm_xargs`` lists
``retro_blocks`` gets the ``cache_salt`` its block starts need
(:func:`vllm_retro.blocks.request.block_salt`; a salt the client gave is kept after it), or
a 400 naming what is wrong with them, starts past the prompt's end included (a text prompt
or chat is counted by the server's own ``/tokenize``, with the request's template options).
Every other request passes untouched.

An ASGI middleware (vLLM's ``--middleware``), so the body is rewritten before vLLM parses
it: clients only list the starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from vllm_retro.blocks.request import KEY, block_salt, check_blocks

PATHS = ("/v1/completions", "/v1/chat/completions")
logger = logging.getLogger("vllm.retro.blocks")


def rewrite(body: bytes) -> tuple[bytes | None, str | None]:
    """(the new body, None), (None, None) when the body is not a block request, or
    (None, the error) when its block starts are bad."""
    if KEY.encode() not in body:
        return None, None
    try:
        request = json.loads(body)
    except ValueError:
        return None, None  # vLLM answers malformed JSON itself
    xargs = request.get("vllm_xargs") if isinstance(request, dict) else None
    if not isinstance(xargs, dict) or KEY not in xargs:
        return None, None
    try:
        blocks = check_blocks(xargs[KEY])
    except ValueError as exc:
        return None, str(exc)
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt) \
            and blocks[-1] >= len(prompt):  # token ids: the length is known here already
        return None, past_end(blocks, len(prompt))
    salt = request.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return None, f"cache_salt must be a string, got {salt!r}"
    request["cache_salt"] = block_salt(blocks, salt)
    return json.dumps(request).encode(), None


def past_end(blocks: list[int], prompt_tokens: int) -> str:
    """The error of block starts whose last is not inside a prompt of ``prompt_tokens``."""
    return (f"{KEY}: the last block starts at {blocks[-1]}, past the prompt's "
            f"{prompt_tokens} tokens (accepted: 1 .. {prompt_tokens - 1})")


TOKENIZE_FIELDS = {
    "/v1/completions": ("model", "add_special_tokens"),
    "/v1/chat/completions": ("model", "messages", "add_generation_prompt",
                             "continue_final_message", "add_special_tokens", "chat_template",
                             "chat_template_kwargs", "tools", "mm_processor_kwargs"),
}
"""What a request's ``/tokenize`` body copies from it (vLLM's tokenize request takes the
same fields, defaults and template options as the generation request)."""


def tokenize_bodies(path: str, request: dict) -> list[dict]:
    """``/tokenize`` bodies counting the prompts of a block request whose prompt is text
    (one per prompt of a completion; one for a chat), none for token ids."""
    base = {k: request[k] for k in TOKENIZE_FIELDS[path] if k in request}
    if path == "/v1/chat/completions":
        return [base]
    prompt = request.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) \
        else []
    return [{**base, "prompt": p} for p in prompts if isinstance(p, str)]


class BlockSaltMiddleware:
    """See module docstring."""

    enabled = True
    """Retro is on (the block mask is computed by retro's attention route)."""
    untuned = False
    """The served model does not record block fine-tuning: the first Block-Attention
    request logs a warning."""

    def __init__(self, app: Any):
        self.app = app
        self._warned = False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or scope.get("path") not in PATHS):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to serve
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        new, error = rewrite(body)
        if new is not None and not self.enabled:
            error = (f"{KEY} needs retro's attention route, and retro is off for this server "
                     "(additional_config retro.enabled=false)")
        if error is not None:
            await _bad_request(send, error)
            return
        if new is not None:
            error = await self._check_length(scope, json.loads(new))
            if error is not None:
                await _bad_request(send, error)
                return
            if self.untuned and not self._warned:
                self._warned = True
                logger.warning(
                    "retro: Block-Attention was asked of a model that was not block-fine-"
                    "tuned: its answers may be worse than under full attention (the paper: "
                    "48.0 against 67.9 for Llama3-8B on RAG sets); tune it once with "
                    "`vllm-retro blocktune MODEL --out DIR` and serve DIR")
            body = new
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _check_length(self, scope: dict, request: dict) -> str | None:
        """The error of block starts past the end of a text prompt (or chat), counted by
        the app's ``/tokenize``; None when they fit, or when the app cannot count it (the
        request then gets vLLM's own answer)."""
        blocks = request["vllm_xargs"][KEY]
        for body in tokenize_bodies(scope["path"], request):
            count = await self._count(scope, body)
            if count is not None and blocks[-1] >= count:
                return past_end(blocks, count)
        return None

    async def _count(self, scope: dict, body: dict) -> int | None:
        """Tokens of ``body``'s prompt by the app's ``/tokenize`` (the request's own
        headers, so its API key), or None when that does not answer 200."""
        data = json.dumps(body).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        sub = {**scope, "path": "/tokenize", "raw_path": b"/tokenize",
               "headers": [*headers, (b"content-length", str(len(data)).encode())]}
        status, chunks, sent = 0, [], False

        async def receive() -> dict:
            nonlocal sent
            if sent:  # vLLM's handlers listen for a disconnect: none comes
                await asyncio.Event().wait()
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}

        async def collect(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(sub, receive, collect)
        if status != 200:
            return None
        try:
            count = json.loads(b"".join(chunks)).get("count")
        except (ValueError, AttributeError):
            return None
        return count if isinstance(count, int) else None


class UntunedBlockSaltMiddleware(BlockSaltMiddleware):
    """:class:`BlockSaltMiddleware` for a model without block fine-tuning (warns once)."""

    untuned = True


class BlocksOffMiddleware(BlockSaltMiddleware):
    """For a server with retro off: Block-Attention requests get a 400 saying so."""

    enabled = False


async def _bad_request(send: Any, message: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "BadRequestError",
                                    "param": KEY, "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
