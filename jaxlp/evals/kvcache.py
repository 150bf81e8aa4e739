"""Quality and size of KV caches over long text, by teacher-forced decoding.

The text is prefilled for its first ``prefill`` tokens (attended in full precision, then
stored in the cache under test), then fed one token per step through the cache, exactly as
decoding reads it. At every decode step the model runs twice, once over the BF16 cache and
once over the cache under test: the perplexity is exp(mean NLL of the next token) over the
decoded steps, and the KL is the mean of KL(p_bf16 cache || p_cache) per step, in nats.
Bytes per token per layer come from the format (metadata and full-precision buffers included).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

import jaxlp
from jaxlp import kvcache
from jaxlp.data import token_windows
from jaxlp.evals.harness import pyplot
from jaxlp.models.tokenizer import load_tokenizer

CACHES = ("bf16", "kivi-k4v4", "kivi-k2v2", "kivi-k2v2*", "kivi-k2v4*", "kivi-k4v2*", "kitty", "kitty-pro",
          "fireq-int4", "fireq-int4-calibrated")


class TeacherForcedScore(NamedTuple):
    """Sums over the decoded steps: next-token NLL of the cache under test, KL to the BF16 cache."""

    nll: float
    kl: float
    tokens: float  # decoded steps


def teacher_forced_score(model, test_model, cache_format, ids: np.ndarray, prefill: int,
                         chunk: int = 256) -> TeacherForcedScore:
    """Teacher-forced decoding of ``ids [1, T]`` by ``test_model`` through ``cache_format``
    against ``model`` over the BF16 cache (``chunk`` steps per compiled scan)."""
    graphdef, params = nnx.split(model)
    test_graphdef, test_params = nnx.split(test_model)
    total = ids.shape[1]
    caches = tuple(f.init(model.config, 1, total) for f in (kvcache.get("bf16"), cache_format))
    ids = jnp.asarray(ids)

    def models(both):
        return nnx.merge(graphdef, both[0]), nnx.merge(test_graphdef, both[1])

    @jax.jit
    def prefill_fn(both, caches):
        pos = jnp.arange(prefill)[None]
        out = [m.forward(ids[:, :prefill], pos, c) for m, c in zip(models(both), caches)]
        return tuple(m.logits(h[:, -1]) for m, (h, _) in zip(models(both), out)), tuple(c for _, c in out)

    @jax.jit
    def decode_chunk(both, caches, logits, start):
        ms = models(both)

        def body(carry, t):
            caches, logits, nll, kl = carry
            target = jax.lax.dynamic_slice(ids, (0, t), (1, 1))
            ref_lp, lp = (jax.nn.log_softmax(x, axis=-1) for x in logits)
            nll = nll - jnp.take_along_axis(lp, target, axis=-1).sum()
            kl = kl + jnp.sum(jnp.exp(ref_lp) * (ref_lp - lp))
            out = [m.forward(target, jnp.full((1, 1), t), c) for m, c in zip(ms, caches)]
            return (tuple(c for _, c in out), tuple(m.logits(h[:, 0]) for m, (h, _) in zip(ms, out)), nll, kl), None

        steps = start + jnp.arange(chunk)
        (caches, logits, nll, kl), _ = jax.lax.scan(body, (caches, logits, 0.0, 0.0), steps)
        return caches, logits, nll, kl

    both = (params, test_params)
    logits, caches = prefill_fn(both, caches)
    nll = kl = 0.0
    for start in tqdm(range(prefill, total - 1, chunk), desc=cache_format.name, leave=False):
        caches, logits, n, k = decode_chunk(both, caches, logits, start)
        nll, kl = nll + float(n), kl + float(k)
    return TeacherForcedScore(nll, kl, float(total - 1 - prefill))


@dataclasses.dataclass(frozen=True)
class CacheQuality:
    """One cache: perplexity, mean KL to the BF16 cache (nats/token), bytes per token per layer."""

    cache: str
    ppl: float
    kl: float
    bytes_per_token_per_layer: float


def evaluate_caches(model, tokenizer, ids: np.ndarray, caches: Sequence[str], prefill: int, chunk: int = 256,
                    on_result: Callable[[CacheQuality], None] | None = None) -> list[CacheQuality]:
    """:class:`CacheQuality` of each cache on ``ids [1, T]``; ``fireq-int4-calibrated`` is FireQ
    with RPN + CRS calibrated on 4 x 512 tokens of the text's calibration half (disjoint from
    the evaluation half). ``on_result`` is called with each result as it is done."""
    from jaxlp.quantization import fireq_kv

    if (ids.shape[1] - 1 - prefill) % chunk:
        raise ValueError(f"tokens - 1 - prefill ({ids.shape[1] - 1 - prefill}) must be a multiple of chunk ({chunk})")
    rows = []
    for name in tqdm(caches, desc="caches"):
        if name == "fireq-int4-calibrated":
            calib = token_windows(tokenizer, 4, 512, split="calibration")
            test_model, fmt = fireq_kv.calibrate(model, calib)
        else:
            test_model, fmt = model, kvcache.get(name)
        score = teacher_forced_score(model, test_model, fmt, ids, prefill, chunk)
        rows.append(CacheQuality(name, float(np.exp(score.nll / score.tokens)), score.kl / score.tokens,
                                 float(fmt.bytes_per_token(model.config))))
        if on_result is not None:
            on_result(rows[-1])
    return rows


def kvcache_table(rows: Sequence[CacheQuality]) -> str:
    """Markdown table; the last column is the BF16 cache's bytes / the cache's (when BF16 is the first row)."""
    bf16 = rows[0].bytes_per_token_per_layer if rows and rows[0].cache == "bf16" else None
    lines = ["| cache | perplexity | KL to BF16 cache (nats/token) | bytes/token/layer | BF16 bytes / bytes |",
             "|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{bf16 / r.bytes_per_token_per_layer:.2f}x" if bf16 else ""
        lines.append(f"| {r.cache} | {r.ppl:.3f} | {r.kl:.5f} | {r.bytes_per_token_per_layer:.1f} | {ratio} |")
    return "\n".join(lines)


def plot_kvcache(rows: Sequence[CacheQuality], path: Path) -> None:
    """KL to the BF16 cache against bytes per token per layer, one labelled point per cache."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows[1:] if rows[0].cache == "bf16" else rows:
        ax.scatter(r.bytes_per_token_per_layer, r.kl)
        ax.annotate(r.cache, (r.bytes_per_token_per_layer, r.kl), fontsize=8, xytext=(3, 3),
                    textcoords="offset points")
    ax.set(xlabel="bytes per token per layer", ylabel="KL to the BF16 cache (nats/token)", yscale="log",
           title="Gemma 3 270M: KV cache error vs size")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_kvcache_eval(model_dir: str | Path, out: str | Path, *, caches: Sequence[str] = CACHES, tokens: int = 4097,
                     prefill: int = 3072, chunk: int = 256,
                     on_result: Callable[[CacheQuality], None] | None = None) -> list[CacheQuality]:
    """Evaluate ``caches`` on ``tokens`` tokens of the offline text's evaluation half with the
    checkpoint at ``model_dir`` (float32); write OUT.json, OUT.md and OUT.png."""
    tokenizer = load_tokenizer(model_dir)
    model = jaxlp.from_pretrained(model_dir, dtype=jnp.float32)
    ids = token_windows(tokenizer, 1, tokens, split="evaluation")
    start = time.perf_counter()
    rows = evaluate_caches(model, tokenizer, ids, caches, prefill, chunk, on_result)
    decoded = tokens - 1 - prefill
    meta = dict(model=str(model_dir), tokens=tokens, prefill=prefill, decoded=decoded,
                seconds=time.perf_counter() - start, device=str(jax.devices()[0]))
    label, out = str(out), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=[dataclasses.asdict(r) for r in rows]),
                                                   indent=1))
    out.with_suffix(".md").write_text(
        f"# KV caches on Gemma 3 270M\n\n{tokens} tokens of offline text: {prefill} prefilled (attended in full "
        f"precision, then stored in the cache under test), {decoded} decoded one at a time through each cache "
        f"(teacher forcing); KL against the same "
        f"model over a BF16 cache. Bytes per token per layer include metadata and full-precision buffers, "
        f"averaged over a 4096-token context. Gemma 3 270M has 1 KV head of dimension 256, and 15 of its 18 "
        f"layers attend a 512-token sliding window.\n\nCommand: `python scripts/kvcache_eval.py --model "
        f"MODEL_DIR --out {label}`\n\n{kvcache_table(rows)}\n")
    plot_kvcache(rows, out.with_suffix(".png"))
    return rows
