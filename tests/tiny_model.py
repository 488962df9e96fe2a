"""A tiny random Llama and a locally trained byte-level BPE tokenizer, for engine tests.

Built once per cache directory (seconds); no downloads. The model is random, so its text is
noise, but it is a real checkpoint vLLM loads like any other: 2 layers, 4 query heads over
2 KV heads, head_dim 32, fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_retro.capture import real_prose

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_llama(path: Path, vocab_size: int = 512, max_positions: int = 8192,
                     num_layers: int = 2, seed: int = 0) -> Path:
    """Write a tiny LlamaForCausalLM + tokenizer to ``path`` (skipped if already there)."""
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = real_prose(200_000)
    tok.train_from_iterator(text.split("\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(fast), hidden_size=128, intermediate_size=256,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=max_positions, rope_theta=10000.0,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    gen = {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path
