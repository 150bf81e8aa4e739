"""Accuracy of the testbed reasoner across weight formats x samplers x KV caches (ReSET Tables 1, 2, 5).

    python scripts/eval_reasoner.py --out docs/eval_reasoner               # GPU: full run (256 problems x 8 seeds)
    python scripts/eval_reasoner.py --quick --out /tmp/eval_quick           # CPU smoke run (< 3 min)
    python scripts/eval_reasoner.py --list                                  # planned configs and compiles

Held-out problems (``eval_problems(--eval-seed, --problems, spec)``, the spec read from the
checkpoint's ``training_log.json``) are solved ``--seeds`` times each; a sample is correct iff
the final answer matches exactly (``jaxlp.testbed.is_correct``), and ``check_steps`` names the
first wrong step of every sample. Three tables:

- Table 1 (paper Table 1): every weight format at the base decoding (T 0.6, top-p 0.95), BF16 KV cache.
- Table 2 (paper Tables 2, 5 and 6): samplers under NVFP4 W4A4, with BF16 weights as reference:
  the top-p and min-p sweeps at T 0.6, fixed threshold, sliding window, EMA, within-step mean,
  uniform T_low in confident steps, ReSET. tau0 = 80th percentile of the raw-logit entropies
  of base-decoding generations on *training-split* problems, per weight format (as
  ``jaxlp calibrate-tau0``); T_low 0.1, T_high 1.0, window 32, top-p 0.95.
- Table 5 (paper Table 5 layout, KV caches): every KV cache with BF16 and NVFP4 W4A4 weights.

Accuracy is the mean over the seeds of the per-seed accuracies; the 95% interval is Student's t
over those per-seed accuracies (S-1 degrees of freedom), i.e. the spread due to sampling on
this fixed problem set; the JSON adds a percentile bootstrap over problems (each problem with
its S samples), which also counts the choice of problems, and paired per-seed differences to
the reference row.

Speed: one compiled program per (weights, sampler structure, cache format, shapes). The
samplers of Table 2 and the caches of Table 5 run as *row groups* of one program
(:class:`RowGroupSampler`, :class:`RowGroupCache`): group g of a call holds the same
(problem, seed) units as every other group and gets the same random key, so each group
draws exactly as it would alone. Call ``s`` of a program holds seed ``s`` of all problems
(or equal slices of the problems when one seed of all groups exceeds ``--max-rows``); its
random key is ``--seed + s`` and jaxlp folds the row index into it, so every (problem, seed)
unit has its own random stream, the same one in every config (common random numbers: the
paired differences between configs are not blurred by independent draws). All calls of a
program have the same shapes, so each program compiles once; ``--workers`` threads overlap
the compilation of different programs (GPU).
"""

from __future__ import annotations

import time

T_START = time.monotonic()

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import jaxlp  # noqa: E402
from jaxlp import kvcache, sampling, testbed  # noqa: E402
from jaxlp.generation import prompt_bucket  # noqa: E402
from jaxlp.kvcache.base import CacheFormat, KVCache, LayerCache  # noqa: E402
from jaxlp.sampling.base import SampleOutput, Sampler, register, static_field, token_entropy  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "jaxlp" / "assets" / "reasoner"
CONFIDENCE = 0.95

# ----------------------------------------------------------------------------------------------
# Statistics (pure NumPy)
# ----------------------------------------------------------------------------------------------


def t_two_sided_cdf(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer ``df`` >= 1 (Abramowitz & Stegun 26.7.3-4)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df must be an integer >= 1, got {df!r}")
    if t <= 0:
        return 0.0
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 1:
        series, term = 0.0, c
        for k in range(1, (df - 1) // 2 + 1):  # c, (2/3) c^3, (2*4)/(3*5) c^5, ... up to c^(df-2)
            if k > 1:
                term *= (2 * k - 2) / (2 * k - 1) * c * c
            series += term
        return (2.0 / math.pi) * (theta + s * series)
    series, term = 1.0, 1.0
    for k in range(1, (df - 2) // 2 + 1):  # 1, (1/2) c^2, (1*3)/(2*4) c^4, ... up to c^(df-2)
        term *= (2 * k - 1) / (2 * k) * c * c
        series += term
    return s * series


def t_critical(df: int, confidence: float = CONFIDENCE) -> float:
    """The two-sided critical value: ``t`` with ``P(|T_df| <= t) = confidence``."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    lo, hi = 0.0, 1.0
    while t_two_sided_cdf(hi, df) < confidence:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_two_sided_cdf(mid, df) < confidence:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """``(mean, half_width)`` of the Student-t interval of the mean of ``values`` (NaN width if n < 2)."""
    x = np.asarray(values, np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError("t_interval needs at least one value")
    if x.size < 2:
        return float(x.mean()), float("nan")
    return float(x.mean()), t_critical(x.size - 1, confidence) * float(x.std(ddof=1)) / math.sqrt(x.size)


def bootstrap_problems(correct: np.ndarray, *, resamples: int = 2000, seed: int = 0,
                       confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Percentile-bootstrap interval of the accuracy, resampling problems (columns of
    ``correct [S, n]``) with replacement, each with all its S samples."""
    c = np.asarray(correct, np.float64)
    if c.ndim != 2 or c.size == 0:
        raise ValueError(f"correct must be a non-empty [seeds, problems] array, got shape {c.shape}")
    per_problem = c.mean(axis=0)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, per_problem.size, size=(resamples, per_problem.size))
    means = per_problem[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def accuracy_summary(correct: np.ndarray, confidence: float = CONFIDENCE, resamples: int = 2000) -> dict:
    """Mean accuracy of ``correct [S, n]`` with its t-interval over the S per-seed accuracies
    and the problem bootstrap."""
    c = np.asarray(correct, bool)
    if c.ndim != 2 or c.size == 0:
        raise ValueError(f"correct must be a non-empty [seeds, problems] array, got shape {c.shape}")
    per_seed = c.mean(axis=1)
    mean, half = t_interval(per_seed, confidence)
    return dict(accuracy=mean, half_width=half, ci=[mean - half, mean + half],
                ci_bootstrap_problems=list(bootstrap_problems(c, resamples=resamples, confidence=confidence)),
                per_seed=[float(a) for a in per_seed], samples=int(c.size))


def paired_delta(correct: np.ndarray, reference: np.ndarray, confidence: float = CONFIDENCE) -> dict:
    """Accuracy difference to ``reference`` (same problems and seeds), t-interval over the
    per-seed differences."""
    a, b = np.asarray(correct, bool), np.asarray(reference, bool)
    if a.shape != b.shape:
        raise ValueError(f"paired_delta needs equal shapes, got {a.shape} and {b.shape}")
    mean, half = t_interval(a.mean(axis=1) - b.mean(axis=1), confidence)
    return dict(delta=mean, half_width=half)


# ----------------------------------------------------------------------------------------------
# Row groups: several samplers or KV caches in one compiled program
# ----------------------------------------------------------------------------------------------


@register
class RowGroupSampler(Sampler):
    """Rows ``[sum(sizes[:g]), sum(sizes[:g+1]))`` are sampled by ``samplers[g]`` with its own
    state and the call's key (so a group draws as it would alone, at its own batch size)."""

    samplers: tuple = ()
    sizes: tuple[int, ...] = static_field(default=())

    def __post_init__(self):
        if not isinstance(self.samplers, tuple):
            raise ValueError(f"RowGroupSampler: samplers must be a tuple, got {type(self.samplers).__name__}")
        if not isinstance(self.sizes, tuple) or not all(isinstance(n, int) and n >= 1 for n in self.sizes):
            raise ValueError(f"RowGroupSampler: sizes must be a tuple of ints >= 1, got {self.sizes!r}")
        if len(self.samplers) != len(self.sizes):
            raise ValueError(f"RowGroupSampler: {len(self.samplers)} samplers for {len(self.sizes)} group sizes")

    def init(self, batch_size: int):
        if batch_size != sum(self.sizes):
            raise ValueError(f"RowGroupSampler: batch size {batch_size} != sum of group sizes {sum(self.sizes)}")
        return tuple(s.init(n) for s, n in zip(self.samplers, self.sizes))

    def sample(self, state, logits, key) -> SampleOutput:
        if logits.ndim != 2 or logits.shape[0] != sum(self.sizes):
            raise ValueError(f"RowGroupSampler: logits {logits.shape} do not have {sum(self.sizes)} rows")
        outs, start = [], 0
        for s, n, st in zip(self.samplers, self.sizes, state):
            outs.append((start, n, s.sample(st, logits[start:start + n], key)))
            start += n
        entropy = None
        if any(o.entropy is not None for _, _, o in outs):
            entropy = jnp.concatenate([o.entropy if o.entropy is not None else token_entropy(logits[a:a + n])
                                       for a, n, o in outs])
        return SampleOutput(jnp.concatenate([o.tokens for _, _, o in outs]),
                            jnp.concatenate([o.temperature for _, _, o in outs]),
                            tuple(o.state for _, _, o in outs), entropy)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowGroupLayerCache(LayerCache):
    """One layer: ``parts[g]`` caches rows of group g (its own format)."""

    parts: tuple
    sizes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    def attend(self, q, k, v, positions, *, scale, window, softcap):
        outs, parts, start = [], [], 0
        for part, n in zip(self.parts, self.sizes):
            rows = slice(start, start + n)
            out, new = part.attend(q[rows], k[rows], v[rows], positions[rows], scale=scale, window=window,
                                   softcap=softcap)
            outs.append(out)
            parts.append(new)
            start += n
        return jnp.concatenate(outs, axis=0), RowGroupLayerCache(tuple(parts), self.sizes)


@dataclasses.dataclass(frozen=True)
class RowGroupCache(CacheFormat):
    """A cache format whose rows are split into groups, group g stored in ``formats[g]``."""

    formats: tuple
    sizes: tuple[int, ...]
    name: str = "row-groups"

    def __post_init__(self):
        if len(self.formats) != len(self.sizes) or not self.sizes:
            raise ValueError(f"RowGroupCache: {len(self.formats)} formats for {len(self.sizes)} group sizes")
        if not all(isinstance(n, int) and n >= 1 for n in self.sizes):
            raise ValueError(f"RowGroupCache: sizes must be ints >= 1, got {self.sizes!r}")

    def init(self, config, batch_size: int, max_len: int) -> KVCache:
        if batch_size != sum(self.sizes):
            raise ValueError(f"RowGroupCache: batch size {batch_size} != sum of group sizes {sum(self.sizes)}")
        caches = [kvcache.get(f).init(config, n, max_len) for f, n in zip(self.formats, self.sizes)]
        return KVCache(tuple(RowGroupLayerCache(tuple(c.layers[i] for c in caches), self.sizes)
                             for i in range(config.num_layers)))

    def bytes_per_token(self, config) -> float:
        total = sum(kvcache.get(f).bytes_per_token(config) * n for f, n in zip(self.formats, self.sizes))
        return total / sum(self.sizes)


# ----------------------------------------------------------------------------------------------
# Call layout: which (seed, problem) units each generate call holds
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """``calls[c]``: the units ``(seed, problem)`` of call c, all of the same length ``rows_per_group``
    (``None``: a filler row whose output is dropped). Every group of a call holds these units."""

    rows_per_group: int
    calls: tuple[tuple[tuple[int, int] | None, ...], ...]


def plan_calls(num_problems: int, num_seeds: int, groups: int, max_rows: int,
               lengths: Sequence[int] | None = None) -> CallPlan:
    """Lay out ``num_seeds x num_problems`` units over calls of ``groups x rows_per_group`` rows.

    If one seed of all problems fits (``groups * num_problems <= max_rows``), call ``s`` holds
    seed ``s`` with problem ``i`` in row ``i`` of every group: every program then draws unit
    ``(s, i)`` from the same random stream (key ``--seed + s``, row ``i``), so configs are
    compared on common random numbers. Otherwise the problems are dealt round-robin (longest
    prompt first, by ``lengths``, so that every call has the same prompt bucket) into equal
    slices, one slice of one seed per call, short slices padded with filler rows.
    """
    if num_problems < 1 or num_seeds < 1 or groups < 1 or max_rows < groups:
        raise ValueError(f"cannot plan {num_problems} problems x {num_seeds} seeds x {groups} groups "
                         f"in calls of at most {max_rows} rows")
    if groups * num_problems <= max_rows:
        return CallPlan(num_problems, tuple(tuple((s, i) for i in range(num_problems)) for s in range(num_seeds)))
    slices = -(-num_problems // (max_rows // groups))
    order = list(range(num_problems))
    if lengths is not None:
        order.sort(key=lambda i: -lengths[i])
    parts = [order[j::slices] for j in range(slices)]
    width = max(len(p) for p in parts)
    calls = tuple(tuple((s, i) for i in part) + (None,) * (width - len(part))
                  for s in range(num_seeds) for part in parts)
    return CallPlan(width, calls)


# ----------------------------------------------------------------------------------------------
# What to evaluate
# ----------------------------------------------------------------------------------------------

WEIGHTS = {  # name -> (label, recipe or None)
    "bf16": ("BF16", None),
    "w8a16-fp8": ("FP8 W8A16", "w8a16-fp8"),
    "w8a8-fp8": ("FP8 W8A8", "w8a8-fp8"),
    "w4a16-nvfp4": ("NVFP4 W4A16", "w4a16-nvfp4"),
    "w4a4-nvfp4": ("NVFP4 W4A4", "w4a4-nvfp4"),
    "w4a16-mxfp4": ("MXFP4 W4A16", "w4a16-mxfp4"),
    "w4a4-mxfp4": ("MXFP4 W4A4", "w4a4-mxfp4"),
    "nestedfp16": ("NestedFP16", "nestedfp"),
    "nestedfp8": ("NestedFP8", "nestedfp"),
    "w4a8-fireq": ("FireQ W4A8", "w4a8-fireq"),
    "w4a4-dialect": ("DialectFP4 W4A4", "w4a4-dialect"),
    "w4a16-dialect": ("DialectFP4 W4A16", "w4a16-dialect"),
}
DEFAULT_FORMATS = ("bf16", "w8a8-fp8", "w4a16-nvfp4", "w4a4-nvfp4", "w4a4-mxfp4", "nestedfp16", "nestedfp8",
                   "w4a8-fireq", "w4a4-dialect")
ENTROPY_SAMPLERS = {  # name -> (label, class)
    "fixed_threshold": ("Fixed threshold", sampling.FixedThreshold),
    "sliding_window": ("Sliding window", sampling.SlidingWindowEstimate),
    "ema": ("EMA (alpha 0.1)", sampling.EMAEstimate),
    "within_step_mean": ("Within-step mean", sampling.WithinStepMeanEstimate),
    "uniform_confident_low": ("Uniform T_low (confident steps)", sampling.UniformConfidentLow),
    "reset": ("ReSET", sampling.ReSETConfig),
}
BASE_SAMPLER = f"top_p={sampling.BASE_TOP_P:g}"  # the truncation sweep's name of base decoding
DEFAULT_SAMPLERS = tuple(sampling.truncation_sweep()) + tuple(ENTROPY_SAMPLERS)
DEFAULT_CACHES = ("bf16", "kivi-k4v4", "kivi-k2v2", "kivi-k2v2*", "kivi-k2v4*", "kivi-k4v2*", "kitty", "kitty-pro",
                  "fireq-int4", "fireq-int4-calibrated")
REFERENCE_WEIGHTS = "bf16"
QUANT_WEIGHTS = "w4a4-nvfp4"
QUICK = dict(problems=4, seeds=2, formats=("bf16", "w4a4-nvfp4"), samplers=(BASE_SAMPLER, "reset"),
             caches=("bf16", "kivi-k2v2"), cache_weights="bf16", calibration_rows=2)
TABLES = {"1": "1", "formats": "1", "2": "2", "samplers": "2", "5": "5", "kv": "5", "caches": "5"}


def sampler_params(name: str) -> dict:
    """The truncation parameters of a sweep sampler name, e.g. ``top_p=0.95,min_p=0.01``."""
    params = dict(T=sampling.BASE_TEMPERATURE, top_p=None, min_p=None)
    for part in name.split(","):
        key, value = part.split("=")
        params[key] = float(value)
    return params


def sampler_label(name: str) -> str:
    if name in ENTROPY_SAMPLERS:
        return ENTROPY_SAMPLERS[name][0]
    if name == BASE_SAMPLER:
        return "Base"
    return "Min-p sweep" if "min_p" in name else "Top-p sweep"


def make_sampler(name: str, tokenizer=None, *, tau0: float | None = None, t_low: float = 0.1,
                 t_high: float = 1.0, window: int = 32) -> Sampler:
    """A sampler by name: a key of ``truncation_sweep()`` (T 0.6) or of ``ENTROPY_SAMPLERS``."""
    sweep = sampling.truncation_sweep()
    if name in sweep:
        return sweep[name]
    if name not in ENTROPY_SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; known: {', '.join(DEFAULT_SAMPLERS)}")
    if tau0 is None:
        raise ValueError(f"sampler {name!r} needs tau0")
    return ENTROPY_SAMPLERS[name][1].from_tokenizer(tokenizer, t_low, tau0, t_high=t_high, window=window,
                                                    top_p=sampling.BASE_TOP_P)


@dataclasses.dataclass(frozen=True)
class Config:
    """One evaluated setting: weights x sampler x KV cache (a row of one or more tables)."""

    weights: str
    sampler: str
    cache: str

    @property
    def key(self) -> str:
        return f"{self.weights}/{self.sampler}/{self.cache}"


@dataclasses.dataclass
class Job:
    """One compiled program: configs that run as row groups of the same generate calls."""

    name: str
    weights: str
    configs: list[Config]
    calibrate_tau0: bool = False  # first generate on training problems (base group) for tau0


def table_rows(tables: Sequence[str], formats: Sequence[str], samplers: Sequence[str], caches: Sequence[str],
               sampler_weights: Sequence[str], cache_weights: Sequence[str]) -> dict[str, list[Config]]:
    """The configs of each selected table, in row order (Table 2 and 5: row-major over weights)."""
    rows: dict[str, list[Config]] = {}
    if "1" in tables:
        rows["1"] = [Config(w, BASE_SAMPLER, "bf16") for w in formats]
    if "2" in tables:
        rows["2"] = [Config(w, s, "bf16") for s in samplers for w in sampler_weights]
    if "5" in tables:
        rows["5"] = [Config(w, BASE_SAMPLER, c) for c in caches for w in cache_weights]
    return rows


def plan_jobs(rows: dict[str, list[Config]], max_cache_groups: int = 3) -> list[Job]:
    """Every distinct config once, grouped into programs: per weights, the samplers of Table 2
    (which also serve Table 1's row of those weights and calibrate tau0) and the caches of
    Table 5 in programs of at most ``max_cache_groups`` caches (each cache adds its own
    attention to every layer, so smaller programs compile faster, and in parallel); single
    base-decoding programs for the other weights of Table 1. Row-group programs first (they
    run longest), quantized weights before BF16."""
    if max_cache_groups < 1:
        raise ValueError(f"max_cache_groups must be >= 1, got {max_cache_groups}")
    done: set[Config] = set()
    jobs: list[Job] = []

    def add(name, weights, configs, calibrate=False):
        configs = [c for c in dict.fromkeys(configs) if c not in done]
        if configs:
            done.update(configs)
            jobs.append(Job(name, weights, configs, calibrate))

    t2 = rows.get("2", [])
    for w in dict.fromkeys(c.weights for c in t2):
        configs = [c for c in t2 if c.weights == w]
        add(f"samplers/{w}", w, configs, any(c.sampler in ENTROPY_SAMPLERS for c in configs))
    t5 = rows.get("5", [])
    for w in dict.fromkeys(c.weights for c in t5):
        todo = [c for c in dict.fromkeys(t5) if c.weights == w and c not in done]
        chunks = -(-len(todo) // max_cache_groups)
        for j in range(chunks):  # chunks of near-equal size
            add(f"kv/{w}" + (f"/{j + 1}" if chunks > 1 else ""), w, todo[j::chunks])
    for c in rows.get("1", []):
        add(f"base/{c.weights}", c.weights, [c])
    return sorted(jobs, key=lambda j: (-len(j.configs), j.weights == REFERENCE_WEIGHTS))


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    problems: list
    prompts: list[list[int]]
    tokenizer: Any
    spec: testbed.ProblemSpec
    seeds: int
    max_rows: int
    max_new_tokens: int
    base_seed: int
    calib_seed: int
    tau0_percentile: float = 80.0


def build_weights(name: str, model, calibration: np.ndarray):
    """The model in weight format ``name`` (see WEIGHTS)."""
    from jaxlp.quantization import get_recipe, quantize_model, set_mode
    from jaxlp.quantization.activations import STATIC

    if name not in WEIGHTS:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(WEIGHTS)}")
    recipe = WEIGHTS[name][1]
    if recipe is None:
        return model
    calib = calibration if get_recipe(recipe).activation in STATIC else None
    quantized = quantize_model(model, recipe, calibration=calib)
    if name == "nestedfp8":
        set_mode(quantized, "fp8")
    return quantized


def calibration_prompts(tokenizer, spec, count: int, bucket: int, seed: int) -> list[list[int]]:
    """``count`` training-split prompts whose padded length is exactly ``bucket`` (so that
    the calibration call reuses the evaluation program)."""
    shorter = bucket // 2 if bucket > 16 else 0
    chosen, long_one = [], None
    for p in testbed.train_problems(seed, spec, index=1):
        ids = tokenizer.encode(p.question).ids
        if len(ids) > bucket:
            continue
        if len(ids) > shorter and long_one is None:
            long_one = ids
        elif len(chosen) < count - 1:
            chosen.append(ids)
        if long_one is not None and len(chosen) == count - 1:
            break
    prompts = [long_one] + chosen
    if prompt_bucket(max(map(len, prompts))) != bucket:
        raise RuntimeError(f"no training prompts fill the prompt bucket {bucket}")
    return prompts


def generate_rows(model, ctx: Context, units, groups: int, sampler, cache, seed: int, prompts=None):
    """One generate call: ``groups`` copies of the rows of ``units``; returns the result."""
    prompts = ctx.prompts if prompts is None else prompts
    filler = next(u for u in units if u is not None)
    rows = [prompts[(u or filler)[1]] for u in units] * groups
    return jaxlp.generate(model, rows, max_new_tokens=ctx.max_new_tokens, sampler=sampler, kv_cache=cache,
                          stop_tokens=(testbed.EOS_ID,), seed=seed, return_stats=True)


def score_texts(problems, texts) -> list[tuple[bool, str | None]]:
    """Per sample: (answer correct, first-error kind or None)."""
    out = []
    for p, t in zip(problems, texts):
        check = testbed.check_steps(p, t)
        out.append((check.correct, check.kind))
    return out


def config_report(cfg: Config, ctx: Context, correct: np.ndarray, kinds: np.ndarray, stats: dict,
                  resamples: int) -> dict:
    """Everything the JSON keeps about one config (``correct``/``kinds``: ``[S, n]``)."""
    rep = dict(key=cfg.key, weights=cfg.weights, weights_label=WEIGHTS[cfg.weights][0], sampler=cfg.sampler,
               sampler_label=sampler_label(cfg.sampler), cache=cfg.cache)
    rep.update(accuracy_summary(correct, resamples=resamples))
    terms = np.array([len(p.terms) for p in ctx.problems])
    rep["by_terms"] = {int(k): dict(accuracy=float(correct[:, terms == k].mean()), problems=int((terms == k).sum()))
                       for k in sorted(set(terms.tolist()))}
    flat = list(zip(kinds.reshape(-1), correct.reshape(-1)))
    wrong = Counter(k or "none" for k, c in flat if not c)
    rep["error_kinds"] = dict(sorted(wrong.items(), key=lambda kv: -kv[1]))
    rep["correct_answer_step_error"] = int(sum(1 for k, c in flat if c and k is not None))
    rep["correct"] = ["".join("1" if x else "0" for x in row) for row in correct]  # [seed][problem]
    rep.update(stats)
    return rep


TAU0_PLACEHOLDER = 1.0  # tau0 is a traced value: the calibration call runs the same program


def run_job(job: Job, model_state, ctx: Context, sampler_for: Callable[[Config, float | None], Sampler],
            cache_for: Callable[[Config], Any], deadline: float | None, resamples: int) -> dict:
    """Run a job: the tau0 calibration call if asked, then the evaluation calls of its plan.

    Returns ``{"reports": [...], "tau0": ..., "seconds": ..., ...}``.
    """
    t0 = time.monotonic()
    model = nnx.merge(*model_state)
    configs = job.configs
    groups = len(configs)
    plan = plan_calls(len(ctx.problems), ctx.seeds, groups, ctx.max_rows, [len(p) for p in ctx.prompts])
    m = plan.rows_per_group

    def program(tau0):
        samplers = [sampler_for(c, tau0) for c in configs]
        if groups == 1:
            return samplers, samplers[0], cache_for(configs[0])
        # Every group samples with the call's key, as it would alone (same draws for the same units).
        sizes = (m,) * groups
        caches = [cache_for(c) for c in configs]
        cache = caches[0] if all(c == caches[0] for c in caches) else \
            RowGroupCache(tuple(kvcache.get(c) for c in caches), sizes)
        return samplers, RowGroupSampler(tuple(samplers), sizes), cache

    def check_time():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"time limit reached before a call of {job.name}")

    out = dict(job=job.name, configs=[c.key for c in configs], rows_per_call=m * groups)
    tau0 = None
    if job.calibrate_tau0:
        # Base decoding on training-split problems (every group gets them; the base group's
        # raw-logit entropies give tau0, the other groups' outputs are dropped).
        check_time()
        base = [g for g, c in enumerate(configs) if c.sampler == BASE_SAMPLER and c.cache == "bf16"]
        if not base:
            raise ValueError(f"{job.name}: tau0 calibration needs the base-decoding group")
        base = base[0]
        _, sampler, cache = program(TAU0_PLACEHOLDER)
        bucket = prompt_bucket(max(len(p) for p in ctx.prompts))
        calib = calibration_prompts(ctx.tokenizer, ctx.spec, m, bucket, ctx.calib_seed)
        tc = time.monotonic()
        result = generate_rows(model, ctx, [(0, i) for i in range(m)], groups, sampler, cache, ctx.calib_seed,
                               prompts=calib)
        out["first_call_s"] = time.monotonic() - tc
        entropy = result.entropy[base * m:(base + 1) * m]
        entropies = entropy[np.isfinite(entropy)]
        tau0 = sampling.calibrate_tau0(entropies, ctx.tau0_percentile)
        out.update(tau0=tau0, tau0_tokens=int(entropies.size), tau0_problems=m)

    samplers, sampler, cache = program(tau0)
    n, S = len(ctx.problems), ctx.seeds
    correct = np.zeros((groups, S, n), bool)
    kinds = np.full((groups, S, n), None, object)
    tokens = np.zeros((groups, S, n), np.int64)
    entropy_sum, low_tokens, total_tokens = np.zeros(groups), np.zeros(groups), np.zeros(groups)
    unfinished = np.zeros(groups, np.int64)
    for c, units in enumerate(plan.calls):
        check_time()
        tc = time.monotonic()
        result = generate_rows(model, ctx, units, groups, sampler, cache, ctx.base_seed + c)
        out.setdefault("first_call_s", time.monotonic() - tc)
        seqs = result.sequences()
        for g in range(groups):
            keep = [(g * m + j, u) for j, u in enumerate(units) if u is not None]
            texts = [ctx.tokenizer.decode(seqs[r]) for r, _ in keep]
            scored = score_texts([ctx.problems[u[1]] for _, u in keep], texts)
            for (r, (s, i)), (ok, kind) in zip(keep, scored):
                correct[g, s, i], kinds[g, s, i], tokens[g, s, i] = ok, kind, len(seqs[r])
            idx = [r for r, _ in keep]
            ent, temp = result.entropy[idx], result.temperature[idx]
            fin = np.isfinite(ent)
            entropy_sum[g] += ent[fin].sum()
            total_tokens[g] += fin.sum()
            t_low = getattr(samplers[g], "t_low", None)
            if t_low is not None:
                low_tokens[g] += np.isclose(temp[fin], t_low if t_low > 1e-6 else 0.0).sum()
            unfinished[g] += int((~result.finished[idx]).sum())
    out["reports"] = []
    for g, cfg in enumerate(configs):
        stats = dict(mean_tokens=float(tokens[g].mean()), mean_entropy=float(entropy_sum[g] / max(total_tokens[g], 1)),
                     unfinished=int(unfinished[g]))
        if getattr(samplers[g], "t_low", None) is not None:
            stats.update(tau0=float(samplers[g].tau0), share_t_low=float(low_tokens[g] / max(total_tokens[g], 1)))
        out["reports"].append(config_report(cfg, ctx, correct[g], kinds[g], stats, resamples))
    out["calls"] = len(plan.calls)
    out["seconds"] = time.monotonic() - t0
    return out


# ----------------------------------------------------------------------------------------------
# Tables, plot
# ----------------------------------------------------------------------------------------------


def fmt_acc(rep: dict | None) -> str:
    """``97.3 ± 0.8`` (percent; the half-width of the t-interval), ``-`` when missing."""
    if rep is None:
        return "-"
    half = rep["half_width"]
    return f"{100 * rep['accuracy']:.1f}" + ("" if not np.isfinite(half) else f" ± {100 * half:.1f}")


def fmt_delta(rep: dict | None, ref: dict | None) -> str:
    if rep is None or ref is None or rep is ref:
        return ""
    d = paired_delta(decode_correct(rep), decode_correct(ref))
    half = "" if not np.isfinite(d["half_width"]) else f" ± {100 * d['half_width']:.1f}"
    return f"{100 * d['delta']:+.1f}{half}"


def decode_correct(rep: dict) -> np.ndarray:
    return np.array([[ch == "1" for ch in row] for row in rep["correct"]], bool)


def term_buckets(spec) -> list[tuple[int, int]]:
    """Columns of Table 1: terms in pairs, ``[(1, 2), (3, 4), ...]`` over the spec's range."""
    return [(a, min(a + 1, spec.max_terms)) for a in range(spec.min_terms, spec.max_terms + 1, 2)]


def bucket_accuracy(rep: dict, lo: int, hi: int) -> str:
    acc = [(v["accuracy"], v["problems"]) for k, v in rep["by_terms"].items() if lo <= int(k) <= hi]
    n = sum(p for _, p in acc)
    return "-" if n == 0 else f"{100 * sum(a * p for a, p in acc) / n:.1f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub Markdown table (``|`` in cells escaped)."""
    if any(len(r) != len(header) for r in rows):
        raise ValueError("every row needs one cell per header column")
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


def table1(reports: dict, spec, rows: Sequence[Config]) -> str:
    """Paper Table 1 layout: weights as rows; columns by number of terms (the paper's models), then all."""
    buckets = term_buckets(spec)
    ref = reports.get(Config(REFERENCE_WEIGHTS, BASE_SAMPLER, "bf16").key)
    header = ["Weights"] + [f"{a}-{b} terms" if a != b else f"{a} terms" for a, b in buckets] + \
        ["All (± 95% CI)", "Δ vs BF16"]
    out = []
    for cfg in rows:
        rep = reports.get(cfg.key)
        if rep is not None:
            out.append([WEIGHTS[cfg.weights][0]] + [bucket_accuracy(rep, a, b) for a, b in buckets]
                       + [fmt_acc(rep), fmt_delta(rep, ref)])
    return markdown_table(header, out)


def table2(reports: dict, samplers: Sequence[str], weights: Sequence[str], t_low: float, t_high: float) -> str:
    """Paper Tables 2 and 5 layout: method, T, top-p, min-p, then accuracy per weight format."""
    header = ["Method", "T", "Top-p", "Min-p"]
    for w in weights:
        header += [WEIGHTS[w][0], f"Δ vs base ({WEIGHTS[w][0]})"]
    out, last_label = [], None
    for s in samplers:
        if s in ENTROPY_SAMPLERS:
            cells = [sampler_label(s), f"{t_low:g} / {t_high:g}", f"{sampling.BASE_TOP_P:g}", "0.0"]
        else:
            p = sampler_params(s)
            cells = [sampler_label(s), f"{p['T']:g}", "1.0" if p["top_p"] is None else f"{p['top_p']:g}",
                     "0.0" if p["min_p"] is None else f"{p['min_p']:g}"]
        reps = [reports.get(Config(w, s, "bf16").key) for w in weights]
        for w, rep in zip(weights, reps):
            cells += [fmt_acc(rep), fmt_delta(rep, reports.get(Config(w, BASE_SAMPLER, "bf16").key))]
        if any(r is not None for r in reps):
            label, cells[0] = cells[0], "" if cells[0] == last_label else cells[0]  # sweeps: label once
            last_label = label
            out.append(cells)
    return markdown_table(header, out)


def table5(reports: dict, caches: Sequence[str], weights: Sequence[str], cache_bytes: dict) -> str:
    """KV caches as rows, with their size; accuracy per weight format."""
    header = ["KV cache", "bytes/token/layer"]
    for w in weights:
        header += [f"{WEIGHTS[w][0]} weights", "Δ vs BF16 cache"]
    out = []
    for c in caches:
        cells = [c, f"{cache_bytes[c]:.0f}" if c in cache_bytes else "-"]
        reps = [reports.get(Config(w, BASE_SAMPLER, c).key) for w in weights]
        for w, rep in zip(weights, reps):
            cells += [fmt_acc(rep), fmt_delta(rep, reports.get(Config(w, BASE_SAMPLER, "bf16").key))]
        if any(r is not None for r in reps):
            out.append(cells)
    return markdown_table(header, out)


def error_table(reports: Sequence[dict]) -> str:
    """First-error kinds (check_steps) of the wrong samples, per config."""
    kinds = sorted({k for r in reports for k in r["error_kinds"]})
    header = ["Weights / sampler / KV cache", "wrong"] + kinds + ["right answer, wrong step"]
    out = []
    for r in reports:
        out.append([f"{r['weights_label']} / {r['sampler']} / {r['cache']}", str(sum(r["error_kinds"].values()))]
                   + [str(r["error_kinds"].get(k, 0)) for k in kinds] + [str(r["correct_answer_step_error"])])
    return markdown_table(header, out)


def plot(reports: dict, path: Path, args) -> None:
    """One horizontal bar chart per table, error bars = the 95% t-intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    get = lambda w, s, c: reports.get(Config(w, s, c).key)  # noqa: E731
    panels = []
    if "1" in args.tables:
        panels.append(("Table 1: weights (T 0.6, top-p 0.95)", ["all problems"],
                       [(WEIGHTS[w][0], [get(w, BASE_SAMPLER, "bf16")]) for w in args.formats]))
    if "2" in args.tables:
        panels.append(("Table 2: samplers", [WEIGHTS[w][0] for w in args.sampler_weights],
                       [(s if s not in ENTROPY_SAMPLERS else sampler_label(s),
                         [get(w, s, "bf16") for w in args.sampler_weights]) for s in args.samplers]))
    if "5" in args.tables:
        panels.append(("Table 5: KV caches (T 0.6, top-p 0.95)",
                       [f"{WEIGHTS[w][0]} weights" for w in args.cache_weights],
                       [(c, [get(w, BASE_SAMPLER, c) for w in args.cache_weights]) for c in args.caches]))
    panels = [(t, legend, [(name, reps) for name, reps in rows if any(r is not None for r in reps)])
              for t, legend, rows in panels]
    panels = [p for p in panels if p[2]]
    if not panels:
        return
    tallest = max(len(p[2]) * len(p[1]) for p in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 1.8 + 0.28 * tallest), squeeze=False)
    for ax, (title, legend, rows) in zip(axes[0], panels):
        k = len(legend)
        height = 0.8 / k
        y = np.arange(len(rows))
        for j in range(k):
            reps = [r[j] for _, r in rows]
            acc = np.array([100 * r["accuracy"] if r is not None else np.nan for r in reps])
            err = np.array([100 * r["half_width"] if r is not None and np.isfinite(r["half_width"]) else 0.0
                            for r in reps])
            ax.barh(y + (j - (k - 1) / 2) * height, acc, height=height, xerr=err, capsize=2, label=legend[j])
        ax.set_yticks(y, [name for name, _ in rows], fontsize=8)
        ax.invert_yaxis()
        finite = [100 * r["accuracy"] for _, reps in rows for r in reps if r is not None]
        ax.set_xlim(max(0.0, min(finite) - 5.0) if finite else 0.0, 100.5)
        ax.set_xlabel("exact-match accuracy (%), 95% t-interval over seeds")
        ax.set_title(title, fontsize=10)
        if k > 1:
            ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                    help="checkpoint directory (default: the embedded reasoner)")
    ap.add_argument("--out", type=Path, default=None, help="output prefix: writes PREFIX.md, PREFIX.json, PREFIX.png")
    ap.add_argument("--problems", type=int, default=None, help="held-out problems (default 256; quick 4)")
    ap.add_argument("--seeds", type=int, default=None, help="samples per problem (default 8; quick 2)")
    ap.add_argument("--eval-seed", type=int, default=0, help="seed of eval_problems")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of the first generate call of each program")
    ap.add_argument("--calib-seed", type=int, default=1, help="training-stream seed of all calibration data")
    ap.add_argument("--tables", default="1,2,5", help="comma-separated: 1 (formats), 2 (samplers), 5 (KV caches)")
    ap.add_argument("--formats", default=None, help=f"Table 1 weights (default {','.join(DEFAULT_FORMATS)}; "
                    f"known: {','.join(WEIGHTS)})")
    ap.add_argument("--samplers", default=None, help="Table 2 samplers (default: all of "
                    f"{','.join(DEFAULT_SAMPLERS)})")
    ap.add_argument("--caches", default=None, help=f"Table 5 KV caches (default {','.join(DEFAULT_CACHES)})")
    ap.add_argument("--sampler-weights", default=None, help=f"weights of Table 2 (default {REFERENCE_WEIGHTS},"
                    f"{QUANT_WEIGHTS})")
    ap.add_argument("--cache-weights", default=None, help=f"weights of Table 5 (default {REFERENCE_WEIGHTS},"
                    f"{QUANT_WEIGHTS}; quick {REFERENCE_WEIGHTS})")
    ap.add_argument("--t-low", type=float, default=0.1, help="entropy samplers: temperature of confident tokens")
    ap.add_argument("--t-high", type=float, default=1.0, help="entropy samplers: temperature of uncertain tokens")
    ap.add_argument("--window", type=int, default=32, help="entropy samplers: window w")
    ap.add_argument("--tau0-percentile", type=float, default=sampling.TAU0_PERCENTILE,
                    help="tau0 = this percentile of the calibration entropies (the paper: 80)")
    ap.add_argument("--calibration-rows", type=int, default=None,
                    help="512-token training rows for static activation scales and FireQ KV (default 8; quick 2)")
    ap.add_argument("--max-rows", type=int, default=4096, help="rows per generate call (all groups together)")
    ap.add_argument("--max-cache-groups", type=int, default=3, help="KV caches per compiled program (Table 5)")
    ap.add_argument("--workers", type=int, default=None, help="programs run concurrently (default 6 on GPU, 1 on CPU)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds from the start after which no generate call starts (what finished is written)")
    ap.add_argument("--bootstrap", type=int, default=2000, help="resamples of the problem bootstrap")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: 4 problems x 2 seeds, few configs")
    ap.add_argument("--list", action="store_true", help="print the planned programs and exit")
    args = ap.parse_args(argv)
    split = lambda s: tuple(dict.fromkeys(x.strip() for x in s.split(",") if x.strip()))  # noqa: E731
    try:
        args.tables = tuple(sorted({TABLES[t] for t in split(args.tables)}))
    except KeyError as e:
        ap.error(f"unknown table {e.args[0]!r}; choose from 1, 2, 5")
    q = args.quick
    args.problems = args.problems or (QUICK["problems"] if q else 256)
    args.seeds = args.seeds or (QUICK["seeds"] if q else 8)
    args.calibration_rows = args.calibration_rows or (QUICK["calibration_rows"] if q else 8)
    args.formats = split(args.formats) if args.formats else (QUICK["formats"] if q else DEFAULT_FORMATS)
    args.samplers = split(args.samplers) if args.samplers else (QUICK["samplers"] if q else DEFAULT_SAMPLERS)
    args.caches = split(args.caches) if args.caches else (QUICK["caches"] if q else DEFAULT_CACHES)
    args.sampler_weights = split(args.sampler_weights or f"{REFERENCE_WEIGHTS},{QUANT_WEIGHTS}")
    args.cache_weights = split(args.cache_weights or (QUICK["cache_weights"] if q else f"{REFERENCE_WEIGHTS},"
                                                      f"{QUANT_WEIGHTS}"))
    for w in args.formats + args.sampler_weights + args.cache_weights:
        if w not in WEIGHTS:
            ap.error(f"unknown weight format {w!r}; known: {', '.join(WEIGHTS)}")
    for s in args.samplers:
        if s not in DEFAULT_SAMPLERS:
            ap.error(f"unknown sampler {s!r}; known: {', '.join(DEFAULT_SAMPLERS)}")
    for c in args.caches:
        if c != "fireq-int4-calibrated" and c not in kvcache.formats():
            ap.error(f"unknown KV cache {c!r}; known: {', '.join(kvcache.formats())}, fireq-int4-calibrated")
    # Base decoding first: the reference of the deltas, and the group whose entropies give tau0.
    args.samplers = (BASE_SAMPLER,) + tuple(s for s in args.samplers if s != BASE_SAMPLER)
    if "bf16" not in args.caches:
        args.caches = ("bf16",) + args.caches
    if min(args.problems, args.seeds, args.max_rows, args.calibration_rows, args.max_cache_groups) < 1:
        ap.error("--problems, --seeds, --max-rows, --calibration-rows and --max-cache-groups must be >= 1")
    if args.workers is None:
        args.workers = 1 if jax.default_backend() == "cpu" else 6
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    return args


def read_spec(model_dir: Path) -> testbed.ProblemSpec:
    """The problem spec the checkpoint was trained on (``training_log.json``), else the default."""
    log = Path(model_dir) / "training_log.json"
    if log.is_file():
        spec = json.loads(log.read_text()).get("spec")
        if spec:
            fields = {f.name for f in dataclasses.fields(testbed.ProblemSpec)}
            return testbed.ProblemSpec(**{k: v for k, v in spec.items() if k in fields})
    return testbed.ProblemSpec()


def render_markdown(meta: dict, reports: dict, rows: dict[str, list[Config]], skipped: Sequence[str], args) -> str:
    spec = testbed.ProblemSpec(**meta["spec"])
    lines = [
        "# Testbed reasoner: accuracy across weight formats, samplers and KV caches", "",
        f"Command: `{meta['command']}`  ",
        f"Device: {meta['device']} ({meta['backend']}), jax {meta['jax']}; {meta['date']}; wall time "
        f"{meta['wall_s']:.0f} s.", "",
        f"Model: `{meta['model']}` ({meta['num_params']:,} parameters). Held-out problems: {meta['problems']} "
        f"(`eval_problems(seed={meta['eval_seed']})`, spec {meta['spec']}), {meta['seeds']} sample(s) each; at most "
        f"{meta['max_new_tokens']} new tokens.", "",
        f"Accuracy: exact match of the final answer, in %, mean over the {meta['seeds']} sampling seed(s). "
        f"{meta['ci_method']}", "",
    ]
    if "1" in rows:
        lines += ["## Table 1: weight formats (T 0.6, top-p 0.95, BF16 KV cache)", "",
                  "Columns: problems by number of terms (where the paper has models), then all problems.", "",
                  table1(reports, spec, rows["1"]), ""]
    if "2" in rows:
        tau = ", ".join(f"{WEIGHTS[w][0]} {v['tau0']:.3g}" for w, v in meta["tau0"].items())
        lines += ["## Table 2: samplers (BF16 KV cache)", "",
                  f"Entropy samplers: T_low / T_high = {args.t_low:g} / {args.t_high:g}, window {args.window}, "
                  f"top-p {sampling.BASE_TOP_P:g}; tau0 per weights: {tau or '-'} ({args.tau0_percentile:g}th percentile of the raw-logit "
                  "entropies of base decoding on training-split problems, on the same weights). Top-p 1.0 is no "
                  "top-p filter.", "",
                  table2(reports, args.samplers, args.sampler_weights, args.t_low, args.t_high), ""]
    if "5" in rows:
        lines += ["## Table 5: KV caches (T 0.6, top-p 0.95)", "",
                  "Bytes per token per layer at a 4096-token context, as the format counts them.", "",
                  table5(reports, args.caches, args.cache_weights, meta["cache_bytes"]), ""]
    if reports:
        lines += ["## First-error kinds of the wrong samples (`check_steps`)", "",
                  error_table(list(reports.values())), ""]
    if skipped:
        lines += ["## Not run", ""] + [f"- {s}" for s in skipped] + [""]
    return "\n".join(lines)


def write_outputs(prefix: Path, meta: dict, reports: dict, rows, skipped: list, args, final: bool) -> None:
    """PREFIX.json (after every program), PREFIX.md and PREFIX.png (at the end)."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    data = dict(meta=meta, configs=list(reports.values()), skipped=skipped)
    prefix.with_name(prefix.name + ".json").write_text(json.dumps(data, indent=1))
    if final:
        prefix.with_name(prefix.name + ".md").write_text(render_markdown(meta, reports, rows, skipped, args))
        try:
            plot(reports, prefix.with_name(prefix.name + ".png"), args)
        except ImportError as e:  # no matplotlib: the tables are still written
            print(f"eval_reasoner: no plot ({e})", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = table_rows(args.tables, args.formats, args.samplers, args.caches, args.sampler_weights,
                      args.cache_weights)
    jobs = plan_jobs(rows, args.max_cache_groups)
    if args.list:
        for job in jobs:
            plan = plan_calls(args.problems, args.seeds, len(job.configs), args.max_rows)
            print(f"{job.name:<24} {len(job.configs):>2} configs, {len(plan.calls)} calls x "
                  f"{plan.rows_per_group * len(job.configs)} rows"
                  + (" + tau0 calibration" if job.calibrate_tau0 else ""))
        print(f"{len(jobs)} compiled programs, {sum(len(j.configs) for j in jobs)} configs")
        return 0
    if args.out is None:
        raise SystemExit("eval_reasoner: --out PREFIX is required (or --list)")
    spec = read_spec(args.model)
    tokenizer = testbed.make_tokenizer()
    problems = testbed.eval_problems(args.eval_seed, args.problems, spec)
    prompts = [tokenizer.encode(p.question).ids for p in problems]
    ctx = Context(problems, prompts, tokenizer, spec, args.seeds, args.max_rows, spec.max_solution_chars() + 2,
                  args.seed, args.calib_seed, args.tau0_percentile)
    model = jaxlp.from_pretrained(args.model, dtype=jnp.bfloat16)
    calibration = testbed.packed_batch(args.calib_seed, 0, args.calibration_rows, 512, spec)[0]
    device = jax.devices()[0]
    meta = dict(
        model=str(args.model), num_params=int(model.config.num_params), spec=dataclasses.asdict(spec),
        problems=args.problems, seeds=args.seeds, eval_seed=args.eval_seed, sampling_seed=args.seed,
        calib_seed=args.calib_seed, calibration_rows=args.calibration_rows, max_new_tokens=ctx.max_new_tokens,
        t_low=args.t_low, t_high=args.t_high, window=args.window, max_rows=args.max_rows, workers=args.workers,
        max_cache_groups=args.max_cache_groups,
        ci_method=(f"±: half-width of the {CONFIDENCE:.0%} Student-t interval over the {args.seeds} per-seed "
                   f"accuracies ({args.seeds - 1} df): the sampling noise on this problem set. Δ: mean per-seed "
                   "difference to the reference row (same problems), with its t-interval. The JSON also has "
                   f"`ci_bootstrap_problems`, a percentile bootstrap over problems ({args.bootstrap} resamples), "
                   "which also counts the choice of problems."),
        device=getattr(device, "device_kind", str(device)), backend=jax.default_backend(), jax=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=shlex.join(["python", "scripts/eval_reasoner.py"] + list(sys.argv[1:] if argv is None else argv)),
        tables={t: [c.key for c in cfgs] for t, cfgs in rows.items()}, tau0={}, cache_bytes={}, jobs={},
    )
    for c in args.caches:
        fmt = "fireq-int4" if c == "fireq-int4-calibrated" else c
        meta["cache_bytes"][c] = float(kvcache.get(fmt).bytes_per_token(model.config))

    deadline = None if args.time_limit is None else T_START + args.time_limit
    models: dict[str, Any] = {}  # weights -> nnx.split(model)
    fireq_formats: dict[str, Any] = {}
    reports: dict[str, dict] = {}
    skipped: list[str] = []

    def cache_for(cfg: Config):
        return fireq_formats[cfg.weights] if cfg.cache == "fireq-int4-calibrated" else cfg.cache

    def sampler_for(cfg: Config, tau0: float | None) -> Sampler:
        return make_sampler(cfg.sampler, tokenizer, tau0=tau0, t_low=args.t_low, t_high=args.t_high,
                            window=args.window)

    def prepare(job: Job) -> None:
        """Quantize the job's weights (once) and calibrate what its caches need (main thread)."""
        w = job.weights
        if w not in models:
            if w == "nestedfp8" and "nestedfp16" in models:
                from jaxlp.quantization import set_mode

                models[w] = nnx.split(set_mode(nnx.clone(nnx.merge(*models["nestedfp16"])), "fp8"))
            else:
                models[w] = nnx.split(build_weights(w, model, calibration))
        if any(c.cache == "fireq-int4-calibrated" for c in job.configs) and w not in fireq_formats:
            from jaxlp.kvcache import fireq

            m = nnx.merge(*models[w])
            if not m.config.qk_norm:  # RPN would be folded into a copy of the model: another program
                raise ValueError("fireq-int4-calibrated runs as a row group only on q/k-norm models")
            fireq_formats[w] = fireq.calibrate(m, calibration[:4])[1]

    bar = tqdm(total=sum(len(j.configs) for j in jobs), desc="configs", unit="cfg", file=sys.stderr)
    pending: dict[concurrent.futures.Future, Job] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.workers) as pool:
        for job in jobs:
            try:
                prepare(job)
            except Exception as e:  # a format that fails is reported; the rest still runs
                skipped.append(f"{job.name}: {type(e).__name__}: {e}")
                bar.update(len(job.configs))
                continue
            pending[pool.submit(run_job, job, models[job.weights], ctx, sampler_for, cache_for, deadline,
                                args.bootstrap)] = job
        for fut in concurrent.futures.as_completed(list(pending)):
            job = pending[fut]
            try:
                out = fut.result()
            except Exception as e:
                skipped.append(f"{job.name}: {type(e).__name__}: {e}")
                bar.update(len(job.configs))
                continue
            for rep in out.pop("reports"):
                rep["tables"] = [t for t, cfgs in rows.items() if rep["key"] in {c.key for c in cfgs}]
                reports[rep["key"]] = rep
                tqdm.write(f"{rep['key']:<44} {fmt_acc(rep):>13}", file=sys.stderr)
            if "tau0" in out:
                meta["tau0"][job.weights] = dict(tau0=out["tau0"], tokens=out["tau0_tokens"],
                                                 problems=out["tau0_problems"])
            meta["jobs"][job.name] = out
            tqdm.write(f"{job.name}: {out['seconds']:.1f} s (first call {out.get('first_call_s', 0):.1f} s, "
                       f"{out['calls']} calls x {out['rows_per_call']} rows)", file=sys.stderr)
            bar.update(len(job.configs))
            meta["wall_s"] = time.monotonic() - T_START
            write_outputs(args.out, meta, reports, rows, skipped, args, final=False)
    bar.close()
    order = {c.key: i for i, c in reversed(list(enumerate(c for cfgs in rows.values() for c in cfgs)))}
    reports = dict(sorted(reports.items(), key=lambda kv: order[kv[0]]))  # table order
    meta["wall_s"] = time.monotonic() - T_START
    write_outputs(args.out, meta, reports, rows, skipped, args, final=True)
    jaxlp.generation.clear_cache_pool()
    print(args.out.with_name(args.out.name + ".md").read_text())
    print(f"total wall time {meta['wall_s']:.1f} s ({len(reports)} configs, {len(skipped)} programs not run)")
    return 0 if not skipped else 1


if __name__ == "__main__":
    raise SystemExit(main())
