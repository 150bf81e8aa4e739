"""``jaxlp demo``: generation on a small built-in model, on any machine, in seconds.

Until the trained reasoning model ships (the testbed issue), the built-in model is a
randomly initialised Qwen3-architecture transformer with a character tokenizer: the demo
shows the pipeline (tokenize, jit-compiled prefill and decode loop, samplers) and its
speed, not meaningful text.
"""

from __future__ import annotations

import string
import time

import jax.numpy as jnp
from flax import nnx
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

CHARACTERS = string.printable  # 100 characters: digits, letters, punctuation, whitespace


def char_tokenizer() -> Tokenizer:
    """A character-level tokenizer: ids 0..2 are <pad>, <eos>, <unk>, then ``CHARACTERS``."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens(["<pad>", "<eos>", "<unk>"])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")  # "." would miss "\n"
    tok.decoder = decoders.Fuse()
    return tok


def tiny_config():
    from jaxlp.models.config import ModelConfig

    return ModelConfig(
        model_type="qwen3", vocab_size=104, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, qk_norm=True, tie_word_embeddings=True, max_position_embeddings=1024,
        eos_token_ids=(1,), rms_norm_eps=1e-6,
    )


def run(max_new_tokens: int = 48, seed: int = 0) -> None:
    import jaxlp
    from jaxlp.models import Transformer
    from jaxlp.sampling.base import Categorical, Greedy

    tokenizer = char_tokenizer()
    config = tiny_config()
    model = Transformer(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
    weight_bytes = sum(v[...].nbytes for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    prompts = ["12 + 35 =", "The quick brown fox", "def add(a, b):"]
    ids = [tokenizer.encode(p).ids for p in prompts]
    print(f"built-in model: {config.model_type}, {config.num_params:,} parameters (random weights), "
          f"{weight_bytes:,} bytes of BF16 weights")
    print(f"{'sampler':<22} {'tokens':>7} {'seconds':>8} {'tok/s':>8}")
    for name, sampler in [("greedy", Greedy()), ("T=0.6 top-p 0.95", Categorical(temperature=0.6, top_p=0.95))]:
        jaxlp.generate(model, ids, max_new_tokens=max_new_tokens, sampler=sampler, seed=seed)  # compile
        start = time.perf_counter()
        result = jaxlp.generate(model, ids, max_new_tokens=max_new_tokens, sampler=sampler, seed=seed)
        seconds = time.perf_counter() - start
        n = int(result.num_tokens.sum())
        print(f"{name:<22} {n:>7} {seconds:>8.3f} {n / seconds:>8.1f}")
    sample = tokenizer.decode(result.sequences()[0], skip_special_tokens=True)
    print(f"sample continuation of {prompts[0]!r}: {sample[:60]!r}")
