"""Real pretrained models under retro, against stock vLLM (CPU; bf16 where the CPU multiplies
it natively, else fp32: :func:`bench.machine.model_dtype`): Gemma 3's hybrid layers, and aborted
neighbours on Qwen. Qwen's needles and continuation are in ``test_real_model_needles.py`` (a
file of its own, so pytest-xdist runs it beside these)."""

from __future__ import annotations

import pytest

from bench.machine import model_dtype
from tests.vllm.engines import engine, finish_step, runtime_of
from vllm_retro.capture import real_prose
from vllm_retro.config import RetroConfig

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("inprocess")]


def _gemma_run(model_dir, retro):
    """Greedy ids and texts of a 3000-token document and a short prompt, the two likeliest
    tokens at each position with their log probabilities, and the run's counters."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    doc = tok(real_prose(20000))["input_ids"][:3000]
    prompts = [TokensPrompt(prompt_token_ids=doc), "Once upon a time,"]
    with engine(model_dir, retro=retro, dtype=model_dtype(), max_model_len=8192) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, logprobs=2))
        rt = runtime_of(llm)
        counters = None if rt is None else rt.counters  # None: stock
    top2 = [[sorted(((t, lp.logprob) for t, lp in pos.items()), key=lambda x: -x[1])[:2]
             for pos in o.outputs[0].logprobs] for o in outs]
    return ([list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs],
            top2, counters)


def test_gemma3_hybrid_sliding_window_mqa_head_dim_256(gemma_model_dir):
    stock_ids, _, stock_top2, _ = _gemma_run(gemma_model_dir, None)
    # Retro at its defaults, the tilted estimator included. Before the retrieval zone's floor
    # (min_retrieval_clusters, issue 40) this continuation left stock vLLM's after 2 tokens
    # with either estimator (4 of ~188 clusters retrieved); with it, after 20 with either
    # (bench/README, "A floor on the retrieval zone").
    ids, texts, _, c = _gemma_run(gemma_model_dir, {})
    # Only the 3 full-attention layers (5, 11, 17) of the long request are indexed; the 15
    # sliding-window layers and the short request stay on vLLM's path.
    assert c.indexed_requests == 1 and c.indexes_built == 3
    assert c.kv_heads == 1  # MQA
    # 31 decode steps, the first build_steps on the paged KV while the index builds
    assert c.retro_decode_tokens == 3 * (31 - RetroConfig().build_steps_on("cpu"))
    assert ids[1] == stock_ids[1]  # the short prompt is served exactly as stock vLLM
    same = next((i for i, (a, b) in enumerate(zip(ids[0], stock_ids[0], strict=True))
                 if a != b), 32)
    print(f"gemma continuation of a 3000-token document: first {same}/32 tokens identical")
    assert len(set(texts[1].split())) > 10  # prose, not a repetition loop
    assert same >= 4, f"Gemma 3 continuation left stock vLLM's after {same} tokens"
    if same < 32:
        # Where it leaves stock's, stock itself nearly tied and retro took stock's second
        # choice (measured: 0.14 nats there; retro at full budget gives all 32 tokens).
        (_, lp1), (second, lp2) = stock_top2[0][same]
        print(f"there stock's top-1 led its top-2 by {lp1 - lp2:.3f} nats")
        assert ids[0][same] == second and lp1 - lp2 < 0.5, (
            f"token {same}: retro wrote {ids[0][same]} where stock's top-1 led by "
            f"{lp1 - lp2:.3f} nats (its top-2 {stock_top2[0][same]})")


ROOMS = ("north", "south", "east", "west", "upper", "lower", "inner", "outer", "garden")


def _rooms_prompts(tok):
    """One shared ~2K-token document of real prose with a 4-digit code per room hidden in
    it, and one question per room (chat template): prompts that share a long prefix."""
    ids = tok(real_prose(2000 * 6), add_special_tokens=False)["input_ids"]
    paras = tok.decode(ids[:2000]).split("\n\n")
    step = max(1, len(paras) // (len(ROOMS) + 1))
    for i, room in enumerate(ROOMS):
        paras.insert((i + 1) * step + i,
                     f"The secret code of the {room} room is {4100 + 37 * i}. Remember it.")
    doc = "\n\n".join(paras)
    return [tok.apply_chat_template(
        [{"role": "user", "content": f"Read this document.\n\n{doc}\n\nWhat is the secret code "
                                     f"of the {room} room mentioned in the document above? "
                                     "Answer with the code only."}],
        tokenize=False, add_generation_prompt=True) for room in ROOMS]


def test_aborted_neighbours_never_change_a_survivors_answer(qwen_model_dir):
    """Prefix caching on (vLLM's default), requests sharing a 2K-token document: requests
    aborted while others prefill, at the step that indexes them, mid-decode and right after
    an update block leave every survivor's greedy answer exactly as it is alone, over two
    abort timings (update blocks every 64 tokens so they occur within the test)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(qwen_model_dir))
    prompts = _rooms_prompts(tok)
    survivors, victims = prompts[:6], prompts[6:]
    answer = SamplingParams(max_tokens=16, temperature=0.0)
    long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    # build_steps 4: survivors answering in 16 tokens get indexed and switch mid-answer
    retro = {"update_segment": 64, "update_clusters": 4, "local_window": 16, "build_steps": 4}
    # fp32: in bf16 stock vLLM itself answers some of these differently in a batch than
    # alone (measured: 1 of 6 survivors, the same under stock and retro), which would hide
    # what this test looks for; in fp32 stock gives every survivor its answer alone.
    with engine(qwen_model_dir, retro=retro, dtype="float32", max_model_len=4096,
                enable_prefix_caching=True) as llm:
        alone = [llm.generate([p], answer)[0].outputs[0].text for p in survivors]
        found = sum(f"{4100 + 37 * i}" in a for i, a in enumerate(alone))
        print(f"alone, {found} of 6 survivors name their room's code: {alone}")
        assert found >= 2, alone
        eng = llm.llm_engine
        rt = runtime_of(llm)
        outs: dict[str, str] = {}
        produced: dict[str, int] = {}

        def step() -> None:
            for o in eng.step():
                produced[o.request_id] = len(o.outputs[0].token_ids)
                if o.finished:
                    outs[o.request_id] = o.outputs[0].text

        for timing in ("staggered", "together"):
            for j, p in enumerate(victims):
                eng.add_request(f"{timing}-v{j}", p, long)
            if timing == "staggered":  # victims indexed and decoding before survivors come
                while min(produced.get(f"{timing}-v{j}", 0) for j in range(3)) < 2:
                    step()
            for i, p in enumerate(survivors):
                eng.add_request(f"{timing}-s{i}", p, answer)
            step()
            eng.abort_request([f"{timing}-v0"])  # during prefill (survivors' or its own)
            while not any(produced.get(f"{timing}-s{i}", 0) for i in range(6)):
                step()
            eng.abort_request([f"{timing}-v1"])  # at the step that indexed survivors
            updates = rt.counters.index_updates
            while (produced.get(f"{timing}-v2", 0) < 300
                   and rt.counters.index_updates == updates):
                step()
            eng.abort_request([f"{timing}-v2"])  # right after an update block
            assert rt.counters.index_updates > updates
            while eng.has_unfinished_requests():
                step()
            got = [outs[f"{timing}-s{i}"] for i in range(6)]
            assert got == alone, (timing, got, alone)
        finish_step(llm)
        assert rt.registry.live() == []
        assert rt.live_bytes() == (0, 0)
