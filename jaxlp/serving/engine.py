"""Continuous batching: a fixed set of cache slots whose rows are requests that come and go.

The engine holds one KV cache of ``slots`` rows x ``max_len`` positions (any cache format;
with ``cache_budget_bytes`` the slot count is what the format fits in that budget, so a 2-bit
cache admits more concurrent requests than BF16 in the same memory) and two kinds of compiled
program, both taking the device state as a donated argument:

* **prefill** (one per prompt bucket, the next power of two >= 16): one request's prompt on
  a fresh one-row cache (flash prefill attention), the row written into its slot, the last
  position's logits kept for the first token, the slot's sampler settings and state set.
* **decode** (two, or four with a NestedFP precision policy: one per mode): ``steps_per_call``
  steps of every slot (``lax.scan``): sample each running row's token from its logits with its
  own settings, seed and step
  (:class:`jaxlp.sampling.rows.RowSampler`), stop it on a stop token, its token budget or a
  non-finite logit, feed the token back at the row's next position. Idle slots compute on
  position 0 of their own row and emit nothing. One program serves calls whose running rows
  are all greedy (the argmax alone), the other any mix of samplers. A precision policy picks
  the FP16 or the FP8 program on the host before each call.

Between decode calls the host (:meth:`Engine.step`) retires finished and cancelled requests
(their slots are free at once), admits waiting ones (a prefill each), detokenizes, checks stop
strings and calls each request's listener with what it produced. So after warm-up (the
decode programs, one prefill per bucket) nothing recompiles, whatever the mix of requests.

With ``overlap`` (the default) the host keeps one decode call in flight: a step dispatches the
next call before it waits for the previous one's tokens, so the GPU runs the next call while the
host hands out the last one's tokens and dispatches (without it the GPU idles for that host
time at every call). A row that finished in the call in flight is inactive on the device, so the
next call emits nothing for it; the host leaves rows out of a call that are certain to have
finished (their token budget is reached by the calls in flight) and gives their slots to waiting
requests at once (the prefill runs after the call in flight, on the same stream). Tokens still
reach the host one call after they were dispatched, so a request's tokens and finish are the
same either way; what changes is that cancellations and new requests act from the next call.

Same tokens: a request gets exactly the token ids ``jaxlp.generate`` gives it alone with the
same sampler and seed (its prefill has the same shapes; each decode row is independent; the
noise of a row depends only on its seed and step), up to the floating-point rounding of a
different batch size and cache length.

Tensor parallelism: a model placed on a mesh (:func:`jaxlp.models.shard_model`, ``jaxlp serve
--tp N``) is served as it is; the cache is created on its devices' heads (each device holds its
share, as attention reads it) and stays there between calls.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxlp import kvcache
from jaxlp.errors import check_int
from jaxlp.generation import prompt_bucket
from jaxlp.models.sharding import AXIS
from jaxlp.quantization import precision as precision_lib
from jaxlp.sampling.base import Categorical, Greedy, Sampler
from jaxlp.sampling.boundaries import boundary_ids
from jaxlp.sampling.rows import RowSampler, RowSettings

# Device-side finish reasons of a row at a decode step.
RUNNING, STOPPED, LENGTH, NONFINITE = 0, 1, 2, 3
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full (the server answers 503)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What a request asks for.

    ``sampler``: Greedy, Categorical (no top-k) or ReSETConfig (its boundary ids those of the
    engine's tokenizer); ``seed``: as ``jaxlp.generate``'s; ``max_tokens`` >= 1;
    ``stop_token_ids``: None for the model's EOS ids (the stop token is part of the token ids,
    not of the text); ``stop``: strings that end the text (not included in it).
    """

    sampler: Sampler = dataclasses.field(default_factory=Greedy)
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        check_int("SamplingParams", "max_tokens", self.max_tokens, low=1)
        seed = self.seed
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not -(2**63) <= seed < 2**63:
            raise ValueError(f"SamplingParams: seed must be a 64-bit integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("SamplingParams: stop must be non-empty strings")


@dataclasses.dataclass
class Output:
    """What a request produced since the last report: ``token_ids`` and ``text`` (the delta),
    ``finished`` with ``finish_reason`` (one of FINISH_REASONS) at the end."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None


@dataclasses.dataclass
class _Call:
    """A decode call dispatched and not yet read: its outputs (device arrays), the request of
    each slot it ran (None: the slot emitted nothing), when it was dispatched, whether prefills
    were dispatched just before it, and its precision mode."""

    tokens: jax.Array
    reasons: jax.Array
    rows: list
    dispatched: float
    after_prefill: bool
    fp8: bool  # its NestedFP mode


@dataclasses.dataclass(eq=False)
class Request:
    """A request's whole life (host side). ``token_ids``: every generated id (a stop token
    included); ``text``: the completion text (stop token and stop string excluded)."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    listener: Callable[[Output], None] | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    slot: int | None = None
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished_at: float | None = None
    cancel_requested: bool = False
    # Incremental detokenization (offsets into token_ids) and text held back by stop strings.
    _prefix: int = 0
    _read: int = 0
    _sent: int = 0
    _row: dict | None = None
    _greedy: bool = True  # its sampler always takes the argmax (RowSampler.is_greedy)
    _steps_in_flight: int = 0  # decode steps dispatched for it whose tokens the host has not read

    @property
    def _surely_done(self) -> bool:
        """Finished, or certain to finish within the calls in flight: a running row emits one
        token per step until it stops, so these steps reach its token budget if nothing else."""
        return self.finished or len(self.token_ids) + self._steps_in_flight >= self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None below two tokens)."""
        n = len(self.token_ids)
        if self.first_token is None or self.finished_at is None or n < 2:
            return None
        return (self.finished_at - self.first_token) / (n - 1)


class StaticKey:
    """A static jit argument hashed once (:func:`static_key`). A model's ``nnx.GraphDef`` hashes
    by walking the whole graph (about 1 ms for 8 layers on a 2-core host), and jit hashes its
    static arguments at every call: the engine's programs take their graph definitions wrapped."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticKey) and (self.value is other.value or self.value == other.value)


_STATIC_KEYS: dict[StaticKey, StaticKey] = {}


def static_key(value) -> StaticKey | None:
    """``value`` (None stays None) as the one :class:`StaticKey` of every equal value, so that
    engines over equal graphs share compiled programs and a lookup compares by identity."""
    if value is None:
        return None
    key = StaticKey(value)
    return _STATIC_KEYS.setdefault(key, key)


def _value(key: StaticKey | None):
    return None if key is None else key.value


def _prefill_program(graphdef, params, state, tokens, length, slot, row, use_fp8, *, cache_format, max_len, sampler,
                     batched, graphdef_fp8=None):
    """One request's prompt into ``slot`` (see module doc). ``row``: its settings, ``max_new``
    and ``stop_ids`` with a leading axis of 1; ``graphdef`` and ``graphdef_fp8``: :func:`static_key` wrappers."""
    graphdef, graphdef_fp8 = _value(graphdef), _value(graphdef_fp8)
    seq = tokens.shape[1]
    positions = jnp.arange(seq, dtype=jnp.int32)[None]
    positions = jnp.where(positions < length[:, None], positions, max_len)  # padding: outside the cache

    def prefill(model):
        fresh = cache_format.init(model.config, 1, max_len)
        hidden, fresh = model.forward(tokens, positions, fresh, fresh=True)
        last = jnp.take_along_axis(hidden, (length - 1)[:, None, None], axis=1)[:, 0]
        return model.logits(last), fresh

    logits, fresh = precision_lib.run(prefill, graphdef, graphdef_fp8, params, use_fp8)
    slots = slot[None]
    put = lambda big, small: big.at[slots].set(small.astype(big.dtype))  # noqa: E731
    new = dict(state)
    new["cache"] = state["cache"].write_rows(fresh, slots, batched)
    new["logits"] = put(state["logits"], logits)
    new["position"] = put(state["position"], length)
    new["generated"] = put(state["generated"], jnp.zeros((1,), jnp.int32))
    new["max_new"] = put(state["max_new"], row["max_new"])
    new["stop_ids"] = put(state["stop_ids"], row["stop_ids"])
    new["active"] = put(state["active"], jnp.ones((1,), bool))
    new["settings"] = jax.tree.map(put, state["settings"], row["settings"])
    new["sampler_state"] = jax.tree.map(put, state["sampler_state"], sampler.init(1))
    return new


def _decode_program(graphdef, params, state, alive, *, steps, sampler, greedy=False):
    """``steps`` decode steps of every slot: ``(state, tokens [B, steps], reasons [B, steps])``;
    a token is -1 where the row emitted none, a reason is RUNNING until the row's last token.
    ``greedy``: every running row is greedy (:meth:`RowSampler.sample`'s argmax-only path).
    ``graphdef``: a :func:`static_key` wrapper; with a NestedFP precision policy the host picks
    the FP16 or the FP8 graph definition per call, one program each (a ``lax.cond`` between
    two whole loops inside one program cost 1.5 ms a step at 64 slots x 1.6K positions on the
    H100, docs/perf.md session 32: the state, cache included, crossed the conditional)."""
    graphdef = _value(graphdef)
    state = dict(state, active=state["active"] & alive)

    def body(s, _):
        running = s["active"]
        bad = ~jnp.all(jnp.isfinite(s["logits"]), axis=-1)
        out = sampler.sample(s["settings"], s["sampler_state"], s["logits"], s["generated"], greedy=greedy)
        emit = running & ~bad
        generated = s["generated"] + emit
        stop = jnp.any(out.tokens[:, None] == s["stop_ids"], axis=-1)
        reason = jnp.where(bad, NONFINITE, jnp.where(stop, STOPPED, jnp.where(generated >= s["max_new"], LENGTH,
                                                                               RUNNING)))
        reason = jnp.where(running, reason, RUNNING)
        active = running & (reason == RUNNING)
        # A row that goes on feeds its token at its next position; the others write position 0
        # of their own row (garbage in a free slot, overwritten by the next prefill).
        position = jnp.where(active, s["position"], 0)

        model = nnx.merge(graphdef, params)
        hidden, cache = model.forward(out.tokens[:, None], position[:, None], s["cache"])
        logits = model.logits(hidden[:, 0])
        new = dict(s, cache=cache, logits=logits, generated=generated, active=active,
                   position=s["position"] + emit, sampler_state=out.state)
        return new, (jnp.where(emit, out.tokens, -1), reason)

    state, (tokens, reasons) = jax.lax.scan(body, state, None, length=steps)
    return state, tokens.T, reasons.T


_prefill_jit = jax.jit(_prefill_program, static_argnames=("graphdef", "cache_format", "max_len", "sampler", "batched",
                                                         "graphdef_fp8"), donate_argnames=("state",))
_decode_jit = jax.jit(_decode_program, static_argnames=("graphdef", "steps", "sampler", "greedy"),
                      donate_argnames=("state",))


class Engine:
    """Continuous batching over ``slots`` cache rows (see module doc).

    ``model``: a jaxlp Transformer (any weight recipe); ``kv_cache``: a cache format or its
    name; ``max_len``: positions per slot, prompt plus generated (default: the model's
    context); ``slots``: concurrent requests (default 8), at most what ``cache_budget_bytes``
    fits; ``steps_per_call``: decode steps per device call (tokens reach listeners in groups of
    this many); ``tokenizer`` (a ``tokenizers.Tokenizer``): needed for text, stop strings and
    ReSET rows; ``max_waiting``: requests that may wait for a slot before :meth:`submit`
    raises :class:`QueueFullError`; ``max_stop_tokens``: stop ids per request.
    ``precision`` (NestedFP models, :mod:`jaxlp.quantization.precision`): ``"fp16"`` / ``"fp8"``,
    a ``LoadThreshold`` (FP8 while running plus waiting requests exceed ``fraction`` of
    ``max_tokens``, default the slot count) or a ``LatencyTarget`` (FP8 while the FP16 mode's
    predicted time per step, decode step plus prefill stalls, misses the TPOT target; it is
    updated with every call read, in that call's mode, marked when a prefill preceded it); the policy is
    asked before every device call, which runs the decode program of its mode (:meth:`warmup`
    compiles both: switching compiles nothing).
    ``overlap``: keep one decode call in flight while the host handles the previous one's tokens
    (module doc); False waits for each call's tokens before the next dispatch.

    Thread safety: :meth:`submit` and :meth:`cancel` may be called from any thread; :meth:`step`
    from one thread at a time (see :class:`jaxlp.serving.EngineLoop`).
    """

    def __init__(self, model, *, kv_cache: str | kvcache.CacheFormat = "bf16", max_len: int | None = None,
                 slots: int | None = None, cache_budget_bytes: int | None = None, steps_per_call: int = 4,
                 tokenizer=None, max_waiting: int = 1024, max_stop_tokens: int = 8, reset_window: int = 32,
                 precision=None, overlap: bool = True):
        config = model.config
        context = config.max_position_embeddings
        self.max_len = check_int("Engine", "max_len", max_len, low=2, high=context, optional=True,
                                 note="the model's context length is the most") or context
        check_int("Engine", "slots", slots, low=1, optional=True)
        check_int("Engine", "cache_budget_bytes", cache_budget_bytes, low=1, optional=True)
        self.steps_per_call = check_int("Engine", "steps_per_call", steps_per_call, low=1, high=256)
        self.max_waiting = check_int("Engine", "max_waiting", max_waiting, low=0)
        self.max_stop_tokens = check_int("Engine", "max_stop_tokens", max_stop_tokens, low=1, high=64)
        self.cache_format = kvcache.get(kv_cache)
        self.config = config
        fit = None
        if cache_budget_bytes is not None:
            fit = kvcache.max_batch_size(self.cache_format, config, self.max_len, cache_budget_bytes)
            if fit < 1:
                raise ValueError(f"Engine: one slot of {self.max_len} positions in {self.cache_format.name!r} needs "
                                 f"{kvcache.cache_bytes(self.cache_format, config, 1, self.max_len)} bytes, more "
                                 f"than cache_budget_bytes {cache_budget_bytes}")
        self.slots = min(slots or fit or 8, fit or slots or 8)
        self.tokenizer = tokenizer
        ids = boundary_ids(tokenizer) if tokenizer is not None else None
        self.sampler = RowSampler(window=reset_window, double_newline_ids=ids.double_newline_ids if ids else (),
                                  newline_ids=ids.newline_ids if ids else ())
        self.precision, self.graphdef_fp8, self.fp8 = precision, None, False
        if precision is None:
            self.graphdef, self.params = nnx.split(model)
        else:
            precision_lib.check_policy(precision, host_side=True)
            self.graphdef, self.graphdef_fp8, self.params = precision_lib.variants(model)
            if isinstance(precision, str):  # a fixed mode: one graph definition, no conditional
                if precision == "fp8":
                    self.graphdef = self.graphdef_fp8
                self.graphdef_fp8 = None
            elif isinstance(precision, precision_lib.LoadThreshold) and precision.max_tokens is None:
                self.precision = dataclasses.replace(precision, max_tokens=self.slots)
        self._graphdef_key, self._graphdef_fp8_key = static_key(self.graphdef), static_key(self.graphdef_fp8)
        # The decode program's graph definition per mode (self.fp8): a fixed mode has one.
        self._decode_keys = (self._graphdef_key, self._graphdef_fp8_key or self._graphdef_key)
        self._batched = self.cache_format.batched_leaves(config, self.max_len)
        self._cache_mesh = getattr(model.layers[0].self_attn, "mesh", None)  # TP over the heads, or None
        self.state = self._init_state()
        self.cache_bytes = kvcache.cache_bytes(self.cache_format, config, self.slots, self.max_len)
        self.slot_bytes = kvcache.cache_bytes(self.cache_format, config, 1, self.max_len)
        self._running: list[Request | None] = [None] * self.slots
        self._waiting: collections.deque[Request] = collections.deque()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}  # admitted and not yet reported finished
        self.counters = collections.Counter()  # prompt_tokens, generated_tokens, requests_<reason>, decode_calls
        self.overlap = bool(overlap)
        self._in_flight: _Call | None = None
        self._last_read = 0.0  # when the host last read a call's tokens
        # Seconds per decode step: of every call (from its dispatch, or the previous call's tokens
        # on the host if later, to its tokens on the host, so the prefills dispatched just before
        # it count too: what a running request waits), and of the calls no prefill preceded (the
        # decode program alone).
        self.call_seconds: collections.deque[float] = collections.deque(maxlen=256)
        self.step_seconds: collections.deque[float] = collections.deque(maxlen=256)

    # ------------------------------------------------------------------ state

    def _init_state(self) -> dict:
        b, k = self.slots, self.max_stop_tokens
        zeros = lambda dtype: jnp.zeros((b,), dtype)  # noqa: E731
        settings = self.sampler.row(Greedy(), 0)
        state = dict(
            cache=self._new_cache(b),
            logits=jnp.zeros((b, self.config.vocab_size), jnp.float32),
            position=zeros(jnp.int32), generated=zeros(jnp.int32), max_new=zeros(jnp.int32),
            stop_ids=jnp.full((b, k), -1, jnp.int32), active=zeros(bool),
            settings=RowSettings(**{name: jnp.broadcast_to(jnp.asarray(v), (b,) + np.shape(v))
                                    for name, v in settings.items()}),
            sampler_state=self.sampler.init(b),
        )
        return jax.tree.map(jnp.copy, state)  # one buffer per leaf (the state is donated)

    def _new_cache(self, b: int) -> kvcache.KVCache:
        """The empty cache of ``b`` slots, created on its devices' share of the heads under tensor
        parallelism (no device ever holds the whole of it), else on the default device."""
        init = lambda: self.cache_format.init(self.config, b, self.max_len)  # noqa: E731
        mesh = self._cache_mesh
        if mesh is None:
            return init()
        shape = jax.eval_shape(init)
        specs = kvcache.KVCache(tuple(layer.head_specs(AXIS) for layer in shape.layers))
        shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), specs, is_leaf=lambda x: isinstance(x, P))
        return jax.jit(init, out_shardings=shardings)()

    @property
    def compilations(self) -> int:
        """Programs compiled so far for this engine's functions (all engines of the process)."""
        return _prefill_jit._cache_size() + _decode_jit._cache_size()

    # ------------------------------------------------------------------ requests

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> dict:
        """The device row of a request, or ValueError naming what is wrong with it."""
        ids = np.asarray(prompt_ids)
        if ids.size == 0:
            raise ValueError("the prompt is empty: it needs at least one token")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("the prompt must be a list of integer token ids")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"the prompt holds a token id outside the vocabulary (size {self.config.vocab_size})")
        if len(ids) + params.max_tokens > self.max_len:
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} exceeds the context "
                             f"length {self.max_len}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need an engine with a tokenizer")
        stop = self.config.eos_token_ids if params.stop_token_ids is None else tuple(params.stop_token_ids)
        if len(stop) > self.max_stop_tokens:
            raise ValueError(f"at most {self.max_stop_tokens} stop token ids, got {len(stop)}")
        if any(not 0 <= int(t) < self.config.vocab_size for t in stop):
            raise ValueError(f"a stop token id is outside the vocabulary (size {self.config.vocab_size})")
        settings = self.sampler.row(params.sampler, int(params.seed))
        return dict(
            settings=RowSettings(**{name: jnp.asarray(v)[None] for name, v in settings.items()}),
            max_new=jnp.asarray([params.max_tokens], jnp.int32),
            stop_ids=jnp.asarray([list(stop) + [-1] * (self.max_stop_tokens - len(stop))], jnp.int32),
        )

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
               listener: Callable[[Output], None] | None = None, request_id: str | None = None) -> Request:
        """Queue a request (checked first: ValueError naming the problem; QueueFullError when
        ``max_waiting`` requests already wait beyond the free slots). ``listener(output)`` is called from the thread
        running :meth:`step` with each group of new tokens and once finished."""
        params = params or SamplingParams()
        row = self.check_request(prompt_ids, params)
        if request_id is not None and request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = Request(request_id or f"req-{next(self._ids)}", [int(t) for t in prompt_ids], params, listener)
        request._row = row
        request._greedy = self.sampler.is_greedy(params.sampler)
        with self._lock:
            free = sum(r is None for r in self._running)
            if len(self._waiting) >= self.max_waiting + free:
                raise QueueFullError(f"every slot is busy and {len(self._waiting) - free} requests wait "
                                     f"(max_waiting {self.max_waiting})")
            self._waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request: its slot is freed at the next :meth:`step` (finish_reason
        "cancelled"); a finished request is left as it is."""
        request.cancel_requested = True

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self._running)

    def has_work(self) -> bool:
        return bool(self._waiting) or any(r is not None for r in self._running) or self._in_flight is not None

    # ------------------------------------------------------------------ the loop

    def warmup(self, prompt_lengths: Sequence[int] = (1,)) -> None:
        """Compile the decode programs (calls whose rows are all greedy, and the others; with a
        precision policy, in each mode) and the prefill of the buckets of ``prompt_lengths`` (the
        state is left as it was: every slot free; the step times of the warm-up are dropped)."""
        buckets = sorted({prompt_bucket(n) for n in prompt_lengths})
        # A greedy request per bucket, then a sampled one: the decode program of calls whose rows
        # are all greedy (argmax only) and the one of calls with a sampled row.
        warm = [(n, SamplingParams(max_tokens=1)) for n in buckets]
        warm.append((buckets[0], SamplingParams(sampler=Categorical(temperature=1.0), max_tokens=1)))
        policy = self.precision
        modes = ("fp16", "fp8") if self._graphdef_fp8_key is not None else (policy,)
        try:
            for mode in modes:
                self.precision = mode  # a fixed mode while warming up
                for n, params in warm:
                    request = self.submit([0] * min(n, self.max_len - 1), params)
                    while not request.finished:
                        self.step()
        finally:
            self.precision = policy
        self.call_seconds.clear()
        self.step_seconds.clear()

    def step(self) -> list[Output]:
        """One iteration: retire cancelled requests, admit waiting ones into free slots, run one
        decode call, hand out what it produced. Returns the outputs (also sent to listeners)."""
        outputs: list[Output] = []
        with self._lock:
            dropped = [r for r in self._waiting if r.cancel_requested]
            for request in dropped:
                self._waiting.remove(request)
        for request in dropped + [r for r in self._running if r is not None and r.cancel_requested]:
            self._requests[request.id] = request
            outputs.append(self._finish(request, "cancelled"))
        self._choose_precision()
        admitted = self._admit()
        previous, self._in_flight = self._in_flight, None
        if any(r is not None and not r._surely_done for r in self._running):
            self._in_flight = self._dispatch(after_prefill=admitted > 0)
        if previous is not None:
            self._read(previous, outputs)
        if not self.overlap and self._in_flight is not None:
            call, self._in_flight = self._in_flight, None
            self._read(call, outputs)
        for out in outputs:
            request = self._requests.pop(out.request_id) if out.finished else self._requests.get(out.request_id)
            if request is not None and request.listener is not None:
                try:
                    request.listener(out)
                except Exception as e:  # noqa: BLE001  (one consumer's failure is that request's alone)
                    if not request.finished:
                        request.error = f"listener failed: {type(e).__name__}: {e}"
                        self.cancel(request)
        return outputs

    def _admit(self) -> int:
        """Prefill waiting requests into free slots; returns how many."""
        admitted = 0
        while True:
            # A slot whose request is certain to finish within the call in flight is free: the
            # prefill runs after that call on the device, and its tokens are read by the call's rows.
            free = [i for i, r in enumerate(self._running) if r is None or r._surely_done]
            with self._lock:
                if not free or not self._waiting:
                    return admitted
                request = self._waiting.popleft()
            self._requests[request.id] = request
            slot = free[0]
            n = len(request.prompt_ids)
            bucket = min(prompt_bucket(n), self.max_len)
            tokens = np.zeros((1, bucket), np.int32)
            tokens[0, :n] = request.prompt_ids
            self.state = _prefill_jit(self._graphdef_key, self.params, self.state, jnp.asarray(tokens),
                                      jnp.asarray([n], jnp.int32), jnp.int32(slot), request._row,
                                      jnp.bool_(self.fp8), cache_format=self.cache_format, max_len=self.max_len,
                                      sampler=self.sampler, batched=self._batched, graphdef_fp8=self._graphdef_fp8_key)
            request.slot = slot
            self._running[slot] = request
            self.counters["prompt_tokens"] += n
            admitted += 1

    def _choose_precision(self) -> None:
        """The NestedFP mode of the next device call (``self.fp8``), from the policy: the load
        (running plus waiting requests) or the last measured step time."""
        if isinstance(self.precision, precision_lib.LoadThreshold):
            with self._lock:
                load = sum(r is not None for r in self._running) + len(self._waiting)
            self.fp8 = load > self.precision.fraction * self.precision.max_tokens
        elif isinstance(self.precision, precision_lib.LatencyTarget):
            self.fp8 = self.precision.fp8  # as of the last call read (_read records its time)
        else:
            self.fp8 = self.precision == "fp8"

    def _dispatch(self, after_prefill: bool) -> _Call:
        """Dispatch one decode call over the slots whose requests may still run."""
        rows = [r if r is not None and not r._surely_done else None for r in self._running]
        start = time.perf_counter()
        greedy = all(r is None or r._greedy for r in rows)
        self.state, tokens, reasons = _decode_jit(self._decode_keys[self.fp8], self.params, self.state,
                                                  jnp.asarray([r is not None for r in rows]),
                                                  steps=self.steps_per_call, sampler=self.sampler, greedy=greedy)
        for out in (tokens, reasons):
            out.copy_to_host_async()
        for request in rows:
            if request is not None:
                request._steps_in_flight += self.steps_per_call
        self.counters["decode_calls"] += 1
        self.counters["fp8_decode_calls"] += self.fp8
        return _Call(tokens, reasons, rows, start, after_prefill, self.fp8)

    def _read(self, call: _Call, outputs: list[Output]) -> None:
        """Wait for ``call``'s tokens and hand them to its rows' requests."""
        tokens, reasons = np.asarray(call.tokens), np.asarray(call.reasons)
        now = time.perf_counter()
        self.call_seconds.append((now - max(call.dispatched, self._last_read)) / self.steps_per_call)
        self._last_read = now
        if isinstance(self.precision, precision_lib.LatencyTarget):
            self.precision.update(self.call_seconds[-1] * 1e3, fp8=call.fp8, prefill=call.after_prefill)
        if not call.after_prefill:
            self.step_seconds.append(self.call_seconds[-1])
        for slot, request in enumerate(call.rows):
            if request is None:
                continue
            request._steps_in_flight -= self.steps_per_call
            if request.finished:  # cancelled, or failed, after the call was dispatched
                continue
            new = [int(t) for t in tokens[slot] if t >= 0]
            ends = reasons[slot][reasons[slot] != RUNNING]
            if new and request.first_token is None:
                request.first_token = now
            request.token_ids.extend(new)
            self.counters["generated_tokens"] += len(new)
            reason = None
            if ends.size:
                reason = {STOPPED: "stop", LENGTH: "length", NONFINITE: "error"}[int(ends[0])]
                if reason == "error":
                    request.error = (f"the model produced NaN or Inf logits at decode step {len(request.token_ids)}"
                                     " (its weights or activations are not finite)")
            before = len(request.token_ids)
            text, stop_hit = self._detokenize(request, final=reason is not None, drop_last=reason == "stop")
            if stop_hit:
                reason = "stop"
                new = new[: max(0, len(new) - (before - len(request.token_ids)))]
            if reason is not None:
                outputs.append(self._finish(request, reason, new, text))
            elif new or text:
                outputs.append(Output(request.id, new, text))

    def _detokenize(self, request: Request, final: bool, drop_last: bool) -> tuple[str, bool]:
        """New text of ``request`` (held back while it may be the start of a stop string);
        whether a stop string was met (the text is then cut before it)."""
        if self.tokenizer is None:
            return "", False
        ids = request.token_ids[:-1] if drop_last else request.token_ids
        decode = lambda a, b: self.tokenizer.decode(ids[a:b], skip_special_tokens=True)  # noqa: E731
        before = decode(request._prefix, request._read)
        after = decode(request._prefix, len(ids))
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            request.text += after[len(before):]
            request._prefix, request._read = request._read, len(ids)
        stop = request.params.stop
        hit = False
        if stop:
            cut = min((i for i in (request.text.find(s, max(0, request._sent - len(s) + 1)) for s in stop) if i >= 0),
                      default=-1)
            if cut >= 0:
                request.text, hit = request.text[:cut], True
                self._drop_tokens_after_stop(request, ids)
        ready = len(request.text)
        if stop and not (hit or final):  # hold back a tail that may start a stop string
            longest = max(len(s) for s in stop) - 1
            ready = max(request._sent, len(request.text) - longest)
        delta = request.text[request._sent:ready]
        request._sent = ready
        return delta, hit

    def _drop_tokens_after_stop(self, request: Request, ids: list[int]) -> None:
        """Keep the generated ids up to the one whose text completes a stop string (a decode call
        runs several steps: the ones after it are dropped, from the ids and the usage counts)."""
        stop = request.params.stop
        for n in range(max(1, request._prefix), len(ids) + 1):  # _prefix: no later than this call's first id
            text = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            if any(s in text for s in stop):
                dropped = len(request.token_ids) - n
                del request.token_ids[n:]
                self.counters["generated_tokens"] -= dropped
                return

    def _finish(self, request: Request, reason: str, new: list[int] | None = None, text: str = "") -> Output:
        if request.slot is not None and self._running[request.slot] is request:  # not yet handed on (_admit)
            self._running[request.slot] = None
        text += request.text[request._sent:]  # text held back for stop strings
        request._sent = len(request.text)
        request.finish_reason = reason
        request.finished_at = time.perf_counter()
        self.counters[f"requests_{reason}"] += 1
        return Output(request.id, new or [], text, finished=True, finish_reason=reason)

    def fail_running(self, message: str) -> list[Output]:
        """After an error inside :meth:`step` (the device state may be lost): every admitted
        request not yet finished (in a slot, or handed a slot's successor while a call in flight
        ends it) ends with finish_reason "error" and ``message``; the state is made afresh."""
        outputs = []
        self._in_flight = None
        admitted = [r for r in self._running if r is not None]
        admitted += [r for r in self._requests.values() if r.slot is not None]
        for request in dict.fromkeys(r for r in admitted if not r.finished):
            request.error = message
            request._steps_in_flight = 0
            outputs.append(self._finish(request, "error"))
        self.state = self._init_state()
        for out in outputs:
            request = self._requests.pop(out.request_id, None)
            if request is not None and request.listener is not None:
                try:
                    request.listener(out)
                except Exception as e:  # noqa: BLE001  (one consumer's failure is that request's alone)
                    if not request.finished:
                        request.error = f"listener failed: {type(e).__name__}: {e}"
                        self.cancel(request)
        return outputs

    # ------------------------------------------------------------------ convenience

    def run(self, requests: Sequence[Request] | None = None) -> None:
        """Step until ``requests`` (default: every queued and running one) have finished."""
        while (self.has_work() if requests is None else not all(r.finished for r in requests)):
            self.step()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[Request]:
        """Submit every prompt (one params for all, or one per prompt), run to completion and
        return the finished requests in order (admitted as slots free up)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        requests = []
        for prompt, p in zip(prompts, params):
            while len(self._waiting) >= self.max_waiting + sum(r is None for r in self._running):
                self.step()
            requests.append(self.submit(prompt, p))
        self.run(requests)
        return requests

    def stats(self) -> dict[str, Any]:
        """Counters and gauges for metrics: queue length, running slots, cache bytes."""
        running = self.num_running
        return dict(waiting=self.num_waiting, running=running, slots=self.slots,
                    cache_bytes_total=self.cache_bytes, cache_bytes_in_use=running * self.slot_bytes,
                    **dict(self.counters))


class EngineLoop:
    """Runs :meth:`Engine.step` on a background thread whenever there is work.

    ``submit`` / ``cancel`` from any thread (listeners are called on the loop's thread). An
    exception inside a step fails the running requests (finish_reason "error") and the loop goes
    on: one bad step never takes the server down. ``stop()`` ends the thread."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._wake = threading.Condition()
        self._stopping = False
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="jaxlp-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """Whether the loop's thread is alive and not stopping."""
        return self._thread.is_alive() and not self._stopping

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        self._thread.join(timeout)

    def submit(self, prompt_ids, params: SamplingParams | None = None, **kwargs) -> Request:
        request = self.engine.submit(prompt_ids, params, **kwargs)
        with self._wake:
            self._wake.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        self.engine.cancel(request)
        with self._wake:
            self._wake.notify_all()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.engine.has_work():
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.engine.step()
            except Exception as e:  # noqa: BLE001  (the loop outlives any one step)
                self.errors += 1
                self.engine.fail_running(f"engine step failed: {type(e).__name__}: {e}")
