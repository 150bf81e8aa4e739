"""Jit-compiled generation: prefill, then a decode loop on device over a preallocated KV cache.

One compiled program per shape bucket (batch size, prompt length rounded up to a power of
two, ``max_new_tokens``, cache format, sampler structure): sampler hyper-parameters, seeds
and stop tokens are traced values, so changing them does not recompile. The cache buffer is
donated to the program. The loop (``lax.while_loop``) stops when every row has finished or
``max_new_tokens`` tokens were produced; it never synchronises with the host.

Rows of a batch may have different prompt lengths: prompts are right-padded and each row
decodes at its own positions (see :mod:`jaxlp.attention.reference` for why no padding mask is
needed).

Non-finite logits: the loop carries, per row, the first step whose logits held a NaN or an
Inf (one reduction over the logits the sampler reads anyway; no host sync). Such a row stops
there (no token is written for that step). ``generate`` raises
:class:`~jaxlp.errors.NonFiniteLogitsError` naming the first step and row, or with
``on_nonfinite="return"`` returns ``GenerationResult.nonfinite_step``. The KV cache of a call
that met a non-finite logit (in any row, finished ones included) is not kept for reuse.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlp import kvcache
from jaxlp.errors import NonFiniteLogitsError, check_choice, check_int
from jaxlp.quantization import precision as precision_lib
from jaxlp.sampling.base import Greedy, Sampler, token_entropy
from jaxlp.sampling.baselines import base_decoding
from jaxlp.sampling.calibration import TAU0_PERCENTILE, calibrate_tau0


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """Output of :func:`generate` (NumPy arrays on the host).

    tokens: ``[B, max_new_tokens]`` generated ids; after a row's stop token, ``pad_id``.
    num_tokens: ``[B]`` tokens generated per row (the stop token included).
    finished: ``[B]`` whether the row stopped on a stop token.
    entropy, temperature: ``[B, max_new_tokens]`` per step, only with ``return_stats``: the
        Shannon entropy (nats) of the raw logits each token was drawn from, and the
        temperature the sampler used (0 for argmax); NaN after a row finished.
    nonfinite_step: ``[B]`` int, the first step whose logits held a NaN or Inf (the row
        stopped there: ``num_tokens`` equals it), -1 where every step was finite. Only a
        call with ``on_nonfinite="return"`` can return a row that is not -1.
    fp8: ``[B, max_new_tokens]`` bool, only with a :class:`~jaxlp.quantization.precision.LoadThreshold`
        ``precision``: whether the FP8 model computed the logits of each step (the same in every
        row; step 0's come from the prefill).
    """

    tokens: np.ndarray
    num_tokens: np.ndarray
    finished: np.ndarray
    entropy: np.ndarray | None = None
    temperature: np.ndarray | None = None
    nonfinite_step: np.ndarray | None = None
    fp8: np.ndarray | None = None

    def sequences(self) -> list[list[int]]:
        """Each row's generated tokens, without padding."""
        return [row[:n].tolist() for row, n in zip(self.tokens, self.num_tokens)]


def prompt_bucket(length: int, minimum: int = 16) -> int:
    """Padded prompt length: the next power of two, at least ``minimum``."""
    return max(minimum, 1 << max(0, int(length) - 1).bit_length())


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists to a bucket length: ``(tokens [B, S_bucket], lengths [B])``."""
    if len(prompts) == 0:
        raise ValueError("generate needs at least one prompt")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() == 0:
        raise ValueError(f"prompt {int(np.argmin(lengths))} is empty: every prompt needs at least one token")
    tokens = np.full((len(prompts), prompt_bucket(lengths.max())), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = np.asarray(p, np.int32)
    return tokens, lengths


def _generate_program(graphdef, params, tokens, lengths, cache, key, sampler, stop_ids, max_new_tokens, return_stats, pad_id,
                      check_finite=True, graphdef_fp8=None, policy=None):
    batch, seq = tokens.shape

    def call(fn, scheduled_tokens):
        """``fn(model)``; with a precision policy, the FP8 or FP16 model as it decides (a cond)."""
        use_fp8 = None if policy is None else policy.use_fp8(scheduled_tokens)
        return precision_lib.run(fn, graphdef, graphdef_fp8, params, use_fp8), use_fp8

    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    # Padding gets a position past the cache, so that no cache stores or attends it (a
    # quantized cache could otherwise pack padding into a row's page before decode overwrites it).
    positions = jnp.where(positions < lengths[:, None], positions, seq + max_new_tokens)

    def prefill(model):
        hidden, new_cache = model.forward(tokens, positions, cache, fresh=True)
        last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return model.logits(last), new_cache

    (logits, cache), fp8_prefill = call(prefill, jnp.sum(lengths))

    nan = jnp.full((batch, max_new_tokens), jnp.nan, jnp.float32)
    carry = dict(
        step=jnp.int32(0),
        logits=logits,
        cache=cache,
        finished=jnp.zeros((batch,), bool),
        num_tokens=jnp.zeros((batch,), jnp.int32),
        out=jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
        entropy=nan if return_stats else None,
        temperature=nan if return_stats else None,
        sampler_state=sampler.init(batch),
        nonfinite_step=jnp.full((batch,), -1, jnp.int32),
        nonfinite_any=jnp.bool_(False),  # in any row, finished ones included: the cache may hold NaN / Inf
        fp8=None if policy is None else jnp.zeros((batch, max_new_tokens), bool).at[:, 0].set(fp8_prefill),
    )

    def cond(c):
        return (c["step"] < max_new_tokens) & ~jnp.all(c["finished"] | (c["nonfinite_step"] >= 0))

    def sample(c):
        """Step ``c["step"]``'s tokens from ``c["logits"]``: the carry's updated fields (not the
        cache, the logits nor the step), the tokens to feed, and whether the FP8 model decodes
        them (a policy; else None)."""
        step = c["step"]
        # A row whose logits hold a NaN or Inf stops at this step (first such step recorded).
        if check_finite:
            bad = ~jnp.all(jnp.isfinite(c["logits"]), axis=-1)
        else:  # on_nonfinite="ignore": the program without the check (constants, folded away)
            bad = jnp.zeros((batch,), bool)
        running = ~c["finished"] & (c["nonfinite_step"] < 0)
        active = running & ~bad
        sample = sampler.sample(c["sampler_state"], c["logits"], jax.random.fold_in(key, step))
        token = jnp.where(active, sample.tokens, pad_id)
        new = {}
        new["nonfinite_step"] = jnp.where(running & bad, step, c["nonfinite_step"])
        new["nonfinite_any"] = c["nonfinite_any"] | jnp.any(bad)
        new["out"] = c["out"].at[:, step].set(token)
        new["num_tokens"] = c["num_tokens"] + active
        new["finished"] = c["finished"] | (active & jnp.isin(sample.tokens, stop_ids))
        new["sampler_state"] = sample.state
        if return_stats:
            entropy = token_entropy(c["logits"]) if sample.entropy is None else sample.entropy
            new["entropy"] = c["entropy"].at[:, step].set(jnp.where(active, entropy, jnp.nan))
            new["temperature"] = c["temperature"].at[:, step].set(jnp.where(active, sample.temperature, jnp.nan))
        # Scheduled tokens: the rows that go on after this step.
        fp8 = None if policy is None else policy.use_fp8(jnp.sum(active & ~new["finished"]))
        return new, sample.tokens, fp8

    def decode(c, sampled, model_graphdef):
        """The carry after feeding the sampled tokens back in at each row's next position
        (lengths + step) through ``model_graphdef``'s model (finished rows keep computing on their
        sampled token; their output is padding)."""
        new, tokens, fp8 = sampled
        step = c["step"]
        model = nnx.merge(model_graphdef, params)
        hidden, new_cache = model.forward(tokens[:, None], (lengths + step)[:, None], c["cache"])
        out = dict(c, **new, logits=model.logits(hidden[:, 0]), cache=new_cache, step=step + 1)
        if policy is not None:  # the model that computed the logits of step + 1
            out["fp8"] = c["fp8"].at[:, step + 1].set(fp8, mode="drop")
        return out

    if policy is None:
        carry = jax.lax.while_loop(cond, lambda c: decode(c, sample(c), graphdef), carry)
    else:
        # The policy's choice is monotonic (its scheduled tokens, the rows still running, only
        # fall): FP8 steps, then FP16 ones. Two loops, each with its model fixed, carry the next
        # step's sample (computed once more than used, never a conditional per step: one cost
        # 5-50% of a decode step on the H100, docs/perf.md session 19).
        def phase(go, model_graphdef, state):
            def body(state):
                c = decode(*state, model_graphdef)
                return c, sample(c)

            return jax.lax.while_loop(lambda state: cond(state[0]) & go(state[1][2]), body, state)

        state = phase(lambda fp8: fp8, graphdef_fp8, (carry, sample(carry)))
        carry, _ = phase(lambda fp8: True, graphdef, state)
    stats = (carry["entropy"], carry["temperature"])
    nonfinite = (carry["nonfinite_step"], carry["nonfinite_any"])
    return carry["out"], carry["num_tokens"], carry["finished"], nonfinite, stats, carry["fp8"], carry["cache"]


# Caches returned by the last call of each shape, donated to the next call of that shape so
# that the buffer is allocated once (stale contents are never visible: see module doc).
_cache_pool: dict[tuple, kvcache.KVCache] = {}


def clear_cache_pool() -> None:
    """Free the KV-cache buffers that :func:`generate` keeps for reuse."""
    _cache_pool.clear()


_generate_jit = jax.jit(
    _generate_program,
    static_argnames=("graphdef", "max_new_tokens", "return_stats", "pad_id", "check_finite", "graphdef_fp8"),
    donate_argnames=("cache",),
)


ON_NONFINITE = ("raise", "return", "ignore")


def check_generation_settings(config, *, max_new_tokens, seed=0, max_length=None, cache_budget_bytes=None,
                              on_nonfinite="raise") -> int:
    """The checks of :func:`generate`'s settings (the command line runs them before loading
    weights); returns the context length that bounds prompt plus new tokens."""
    context = config.max_position_embeddings
    limit = check_int("generate", "max_length", max_length, low=1, high=context, optional=True,
                      note="the model's context length is the most") or context
    check_int("generate", "max_new_tokens", max_new_tokens, low=1, high=max(1, limit - 1),
              note=f"a prompt of at least one token plus them must fit the context length {limit}")
    if not isinstance(seed, (int, np.integer)) or not -(2**63) <= int(seed) < 2**63:
        raise ValueError(f"generate: seed must be a 64-bit integer, got {seed!r}")
    check_int("generate", "cache_budget_bytes", cache_budget_bytes, low=1, optional=True)
    check_choice("generate", "on_nonfinite", on_nonfinite, ON_NONFINITE)
    return limit


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampler: Sampler | None = None,
    kv_cache: str | kvcache.CacheFormat = "bf16",
    stop_tokens: Sequence[int] | None = None,
    seed: int = 0,
    return_stats: bool = False,
    pad_id: int = 0,
    max_length: int | None = None,
    cache_budget_bytes: int | None = None,
    on_nonfinite: str = "raise",
    precision: str | precision_lib.LoadThreshold | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens for each prompt (lists of token ids).

    ``sampler`` defaults to greedy; ``stop_tokens`` default to the model's EOS ids; the same
    ``seed`` gives the same tokens. ``max_length`` (default and at most the model's
    ``max_position_embeddings``) bounds prompt plus new tokens. With ``cache_budget_bytes``,
    prompts run in consecutive batches as large as the KV cache format fits in that budget
    (rows are independent, so the tokens do not change).

    ``on_nonfinite``: what a NaN or Inf in a row's logits does. The row stops at that step and
    ``"raise"`` (default) raises :class:`~jaxlp.errors.NonFiniteLogitsError` naming the first
    step and row, ``"return"`` returns them in ``result.nonfinite_step``; ``"ignore"`` compiles
    the decode loop without the check (rows go on with whatever they sample; it is there to
    measure the check's cost, one reduction over the logits per step).

    ``precision`` (NestedFP models): ``"fp16"`` or ``"fp8"`` for every step, or a
    :class:`~jaxlp.quantization.precision.LoadThreshold` that picks per step inside the compiled
    program (both models compiled in, no recompilation when it switches or its fields change; its
    choice only goes from FP8 to FP16 as rows finish, so the program runs an FP8 loop then an FP16
    one, with no conditional per step);
    ``result.fp8`` then says which model computed each token's logits. None: the layers' own modes.
    Every setting is checked first (``ValueError`` naming the setting, the value and the range).
    """
    config = model.config
    limit = check_generation_settings(config, max_new_tokens=max_new_tokens, seed=seed, max_length=max_length,
                                      cache_budget_bytes=cache_budget_bytes, on_nonfinite=on_nonfinite)
    precision_lib.check_policy(precision)
    if sampler is not None and not isinstance(sampler, Sampler):
        raise ValueError(f"generate: sampler must be a jaxlp.sampling sampler, got {type(sampler).__name__}")
    if cache_budget_bytes is not None:
        width = prompt_bucket(max(len(p) for p in prompts)) + max_new_tokens if len(prompts) else 1
        size = kvcache.max_batch_size(kvcache.get(kv_cache), config, width, cache_budget_bytes)
        if size < 1:
            raise ValueError(f"a single row's KV cache ({width} positions) does not fit in {cache_budget_bytes} bytes")
        if size < len(prompts):
            kwargs = dict(max_new_tokens=max_new_tokens, sampler=sampler, kv_cache=kv_cache, stop_tokens=stop_tokens,
                          seed=seed, return_stats=return_stats, pad_id=pad_id, max_length=max_length,
                          on_nonfinite="ignore" if on_nonfinite == "ignore" else "return", precision=precision)
            parts = [generate(model, prompts[i : i + size], **kwargs) for i in range(0, len(prompts), size)]
            join = lambda name: (None if getattr(parts[0], name) is None  # noqa: E731
                                 else np.concatenate([getattr(p, name) for p in parts]))
            result = GenerationResult(*(join(f.name) for f in dataclasses.fields(GenerationResult)))
            return _check_finite(result, on_nonfinite)
    for i, p in enumerate(prompts):
        ids = np.asarray(p)
        if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.ndim != 1):
            raise ValueError(f"prompt {i} must be a list of integer token ids, got {ids.dtype} of shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= config.vocab_size):
            raise ValueError(f"prompt {i} holds a token id outside the vocabulary (size {config.vocab_size})")
    tokens, lengths = pad_prompts(prompts)
    longest = int(lengths.max())
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the context length {limit}"
        )
    stop = config.eos_token_ids if stop_tokens is None else tuple(stop_tokens)
    stop_ids = jnp.asarray(stop if stop else (-1,), jnp.int32)
    cache_format = kvcache.get(kv_cache)
    pool_key = (cache_format, config, tokens.shape[0], tokens.shape[1] + max_new_tokens)
    # Only dense caches are reused: their stale slots are provably invisible (a slot is a
    # position); quantized caches keep buffers whose bookkeeping starts from a fresh init.
    cache = _cache_pool.pop(pool_key, None) if isinstance(cache_format, kvcache.Dense) else None
    if cache is None:
        cache = cache_format.init(config, tokens.shape[0], tokens.shape[1] + max_new_tokens)
    graphdef_fp8 = policy = None
    if precision is None:
        graphdef, params = nnx.split(model)
    else:
        graphdef, graphdef_fp8, params = precision_lib.variants(model)
        if precision == "fp8":
            graphdef, graphdef_fp8 = graphdef_fp8, None
        elif precision == "fp16":
            graphdef_fp8 = None
        else:
            policy = precision if precision.max_tokens is not None else dataclasses.replace(
                precision, max_tokens=tokens.shape[0])
    out, num_tokens, finished, (nonfinite_step, nonfinite_any), (entropy, temperature), fp8, cache = _generate_jit(
        graphdef, params, jnp.asarray(tokens), jnp.asarray(lengths), cache, jax.random.key(seed),
        sampler or Greedy(), stop_ids, max_new_tokens=max_new_tokens, return_stats=return_stats, pad_id=pad_id,
        check_finite=on_nonfinite != "ignore", graphdef_fp8=graphdef_fp8, policy=policy,
    )
    # A cache that may hold NaN / Inf (or, unchecked, might) is not reused: a masked stale slot
    # still multiplies its value by a zero weight, and 0 * NaN is NaN.
    if isinstance(cache_format, kvcache.Dense) and on_nonfinite != "ignore" and not bool(nonfinite_any):
        _cache_pool[pool_key] = cache
    result = GenerationResult(
        tokens=np.asarray(out),
        num_tokens=np.asarray(num_tokens),
        finished=np.asarray(finished),
        entropy=None if entropy is None else np.asarray(entropy),
        temperature=None if temperature is None else np.asarray(temperature),
        nonfinite_step=np.asarray(nonfinite_step),
        fp8=None if fp8 is None else np.asarray(fp8),
    )
    return _check_finite(result, on_nonfinite)


def _check_finite(result: GenerationResult, on_nonfinite: str) -> GenerationResult:
    if on_nonfinite == "raise" and result.nonfinite_step is not None:
        raise_nonfinite(result.nonfinite_step)
    return result


def raise_nonfinite(steps: np.ndarray) -> None:
    """Raise :class:`~jaxlp.errors.NonFiniteLogitsError` if a row of ``steps`` (as
    ``GenerationResult.nonfinite_step``, one entry per prompt) met a non-finite logit."""
    steps = np.asarray(steps)
    if not np.any(steps >= 0):
        return
    step = int(steps[steps >= 0].min())
    row = int(np.flatnonzero(steps == step)[0])
    rows = int(np.sum(steps >= 0))
    raise NonFiniteLogitsError(
        f"the model produced NaN or Inf logits at decode step {step} of prompt {row}"
        f"{f' ({rows} of {len(steps)} prompts affected)' if rows > 1 else ''}: its weights or activations are not "
        "finite (a damaged checkpoint, or an overflow: try a wider --dtype); generate(on_nonfinite='return') "
        "returns the partial result",
        step=step, row=row,
    )


def tau0_from_generation(model, prompts, *, max_new_tokens: int, sampler=None, seed: int = 0,
                         percentile: float = TAU0_PERCENTILE) -> tuple[float, np.ndarray]:
    """Generate for ``prompts`` and calibrate tau0 on the generated tokens' raw-logit entropies.

    ``sampler`` defaults to base decoding (T = 0.6, top-p 0.95), the paper's calibration
    decoding. Returns ``(tau0, entropies)`` (entropies: the pooled float32 values used).
    """
    result = generate(model, prompts, max_new_tokens=max_new_tokens, sampler=sampler or base_decoding(), seed=seed,
                      return_stats=True)
    entropies = result.entropy[np.isfinite(result.entropy)]
    return calibrate_tau0(entropies, percentile), entropies
