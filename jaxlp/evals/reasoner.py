"""Accuracy of the testbed reasoner across weight formats x samplers x KV caches (ReSET Tables 1, 2, 5).

Held-out problems (``eval_problems(eval_seed, problems, spec)``, the spec read from the
checkpoint's ``training_log.json``) are solved ``seeds`` times each; a sample is correct iff
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
the reference row (:mod:`jaxlp.evals.stats`).

Speed: one compiled program per (weights, sampler structure, cache format, shapes). The
samplers of Table 2 and the caches of Table 5 run as *row groups* of one program
(:mod:`jaxlp.evals.rowgroups`): group g of a call holds the same (problem, seed) units as
every other group and gets the same random key, so each group draws exactly as it would
alone. Call ``s`` of a program holds seed ``s`` of all problems (or equal slices of the
problems when one seed of all groups exceeds ``max_rows``); its random key is ``seed + s`` and
jaxlp folds the row index into it, so every (problem, seed) unit has its own random stream,
the same one in every config (common random numbers: the paired differences between configs
are not blurred by independent draws). All calls of a program have the same shapes, so each
program compiles once; ``workers`` threads overlap the compilation of different programs (GPU).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

import jaxlp
from jaxlp import kvcache, sampling, testbed
from jaxlp.evals.reasoner_plan import (
    BASE_SAMPLER,
    FIREQ_CALIBRATED,
    WEIGHTS,
    Config,
    EvalSettings,
    Job,
    make_sampler,
    plan_calls,
    plan_jobs,
    sampler_label,
    settings_rows,
)
from jaxlp.evals.reasoner_report import fmt_acc, write_outputs
from jaxlp.evals.rowgroups import RowGroupCache, RowGroupSampler
from jaxlp.evals.stats import CONFIDENCE, accuracy_summary
from jaxlp.generation import prompt_bucket
from jaxlp.sampling.base import Sampler


@dataclasses.dataclass
class Context:
    """What every program of one evaluation shares: problems, prompts, tokenizer, shapes and seeds."""

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


def read_spec(model_dir: Path) -> testbed.ProblemSpec:
    """The problem spec the checkpoint was trained on (``training_log.json``), else the default."""
    log = Path(model_dir) / "training_log.json"
    if log.is_file():
        spec = json.loads(log.read_text()).get("spec")
        if spec:
            fields = {f.name for f in dataclasses.fields(testbed.ProblemSpec)}
            return testbed.ProblemSpec(**{k: v for k, v in spec.items() if k in fields})
    return testbed.ProblemSpec()


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
    """Everything the JSON keeps about one config (``correct``/``kinds``: ``[S, n]``): the
    :class:`~jaxlp.evals.stats.AccuracySummary`, accuracy by number of terms, first-error kinds
    of the wrong samples, the correct bits as one string per seed, and ``stats``."""
    rep = dict(key=cfg.key, weights=cfg.weights, weights_label=WEIGHTS[cfg.weights][0], sampler=cfg.sampler,
               sampler_label=sampler_label(cfg.sampler), cache=cfg.cache)
    rep.update(accuracy_summary(correct, resamples=resamples).as_dict())
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


class Tau0Calibration(NamedTuple):
    """tau0 and the raw-logit entropies it came from (tokens of base decoding on ``problems``
    training problems)."""

    tau0: float
    tokens: int
    problems: int


@dataclasses.dataclass
class JobResult:
    """What one program produced: a report per config (:func:`config_report`) and its timing."""

    job: str
    configs: list[str]
    rows_per_call: int
    first_call_s: float
    calls: int
    seconds: float
    reports: list[dict]
    tau0: Tau0Calibration | None = None

    def record(self) -> dict:
        """The program's entry of the JSON's ``meta.jobs`` (everything but the reports)."""
        out = dict(job=self.job, configs=self.configs, rows_per_call=self.rows_per_call,
                   first_call_s=self.first_call_s)
        if self.tau0 is not None:
            out.update(tau0=self.tau0.tau0, tau0_tokens=self.tau0.tokens, tau0_problems=self.tau0.problems)
        out.update(calls=self.calls, seconds=self.seconds)
        return out


def run_job(job: Job, model_state, ctx: Context, sampler_for: Callable[[Config, float | None], Sampler],
            cache_for: Callable[[Config], Any], deadline: float | None, resamples: int) -> JobResult:
    """Run a job: the tau0 calibration call if asked, then the evaluation calls of its plan.

    Raises TimeoutError when ``deadline`` (``time.monotonic()``) passes before a call.
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

    first_call_s = None
    calibration = None
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
        first_call_s = time.monotonic() - tc
        entropy = result.entropy[base * m:(base + 1) * m]
        entropies = entropy[np.isfinite(entropy)]
        calibration = Tau0Calibration(sampling.calibrate_tau0(entropies, ctx.tau0_percentile), int(entropies.size), m)

    samplers, sampler, cache = program(None if calibration is None else calibration.tau0)
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
        if first_call_s is None:
            first_call_s = time.monotonic() - tc
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
    reports = []
    for g, cfg in enumerate(configs):
        stats = dict(mean_tokens=float(tokens[g].mean()), mean_entropy=float(entropy_sum[g] / max(total_tokens[g], 1)),
                     unfinished=int(unfinished[g]))
        if getattr(samplers[g], "t_low", None) is not None:
            stats.update(tau0=float(samplers[g].tau0), share_t_low=float(low_tokens[g] / max(total_tokens[g], 1)))
        reports.append(config_report(cfg, ctx, correct[g], kinds[g], stats, resamples))
    return JobResult(job.name, [c.key for c in configs], m * groups, first_call_s, len(plan.calls),
                     time.monotonic() - t0, reports, calibration)


@dataclasses.dataclass
class Evaluation:
    """The result of :func:`run_evaluation`: what PREFIX.json holds (``meta``, the config
    reports in table order, the programs not run) and the configs of each table."""

    meta: dict
    reports: dict[str, dict]  # config key -> config_report
    rows: dict[str, list[Config]]
    skipped: list[str]


def run_evaluation(settings: EvalSettings, *, command: str = "jaxlp.evals.run_evaluation",
                   start: float | None = None) -> Evaluation:
    """Run every program of ``settings`` and write the outputs (when ``settings.out`` is set).

    ``start`` (``time.monotonic()``, default now) is when the run began: the wall time and
    ``settings.time_limit`` count from it. A program that fails (or meets the time limit) is
    listed in ``skipped``; the others still run. PREFIX.json is rewritten after every program.
    """
    start = time.monotonic() if start is None else start
    rows = settings_rows(settings)
    jobs = plan_jobs(rows, settings.max_cache_groups)
    spec = read_spec(settings.model)
    tokenizer = testbed.make_tokenizer()
    problems = testbed.eval_problems(settings.eval_seed, settings.problems, spec)
    prompts = [tokenizer.encode(p.question).ids for p in problems]
    ctx = Context(problems, prompts, tokenizer, spec, settings.seeds, settings.max_rows,
                  spec.max_solution_chars() + 2, settings.seed, settings.calib_seed, settings.tau0_percentile)
    model = jaxlp.from_pretrained(settings.model, dtype=jnp.bfloat16)
    calibration = testbed.packed_batch(settings.calib_seed, 0, settings.calibration_rows, 512, spec)[0]
    device = jax.devices()[0]
    s = settings
    meta = dict(
        model=str(s.model), num_params=int(model.config.num_params), spec=dataclasses.asdict(spec),
        problems=s.problems, seeds=s.seeds, eval_seed=s.eval_seed, sampling_seed=s.seed,
        calib_seed=s.calib_seed, calibration_rows=s.calibration_rows, max_new_tokens=ctx.max_new_tokens,
        t_low=s.t_low, t_high=s.t_high, window=s.window, max_rows=s.max_rows, workers=s.workers,
        max_cache_groups=s.max_cache_groups,
        ci_method=(f"±: half-width of the {CONFIDENCE:.0%} Student-t interval over the {s.seeds} per-seed "
                   f"accuracies ({s.seeds - 1} df): the sampling noise on this problem set. Δ: mean per-seed "
                   "difference to the reference row (same problems), with its t-interval. The JSON also has "
                   f"`ci_bootstrap_problems`, a percentile bootstrap over problems ({s.bootstrap} resamples), "
                   "which also counts the choice of problems."),
        device=getattr(device, "device_kind", str(device)), backend=jax.default_backend(), jax=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=command, tables={t: [c.key for c in cfgs] for t, cfgs in rows.items()}, tau0={}, cache_bytes={},
        jobs={},
    )
    for c in s.caches:
        fmt = "fireq-int4" if c == FIREQ_CALIBRATED else c
        meta["cache_bytes"][c] = float(kvcache.get(fmt).bytes_per_token(model.config))

    deadline = None if s.time_limit is None else start + s.time_limit
    models: dict[str, Any] = {}  # weights -> nnx.split(model)
    fireq_formats: dict[str, Any] = {}
    reports: dict[str, dict] = {}
    skipped: list[str] = []

    def cache_for(cfg: Config):
        return fireq_formats[cfg.weights] if cfg.cache == FIREQ_CALIBRATED else cfg.cache

    def sampler_for(cfg: Config, tau0: float | None) -> Sampler:
        return make_sampler(cfg.sampler, tokenizer, tau0=tau0, t_low=s.t_low, t_high=s.t_high, window=s.window)

    def prepare(job: Job) -> None:
        """Quantize the job's weights (once) and calibrate what its caches need (main thread)."""
        w = job.weights
        if w not in models:
            if w == "nestedfp8" and "nestedfp16" in models:
                from jaxlp.quantization import set_mode

                models[w] = nnx.split(set_mode(nnx.clone(nnx.merge(*models["nestedfp16"])), "fp8"))
            else:
                models[w] = nnx.split(build_weights(w, model, calibration))
        if any(c.cache == FIREQ_CALIBRATED for c in job.configs) and w not in fireq_formats:
            from jaxlp.quantization import fireq_kv

            m = nnx.merge(*models[w])
            if not m.config.qk_norm:  # RPN would be folded into a copy of the model: another program
                raise ValueError(f"{FIREQ_CALIBRATED} runs as a row group only on q/k-norm models")
            fireq_formats[w] = fireq_kv.calibrate(m, calibration[:4])[1]

    def write(final: bool) -> None:
        if s.out is not None:
            write_outputs(s.out, meta, reports, rows, skipped, s, final=final)

    bar = tqdm(total=sum(len(j.configs) for j in jobs), desc="configs", unit="cfg", file=sys.stderr)
    pending: dict[concurrent.futures.Future, Job] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=s.workers) as pool:
        for job in jobs:
            try:
                prepare(job)
            except Exception as e:  # a format that fails is reported; the rest still runs
                skipped.append(f"{job.name}: {type(e).__name__}: {e}")
                bar.update(len(job.configs))
                continue
            pending[pool.submit(run_job, job, models[job.weights], ctx, sampler_for, cache_for, deadline,
                                s.bootstrap)] = job
        for fut in concurrent.futures.as_completed(list(pending)):
            job = pending[fut]
            try:
                out = fut.result()
            except Exception as e:
                skipped.append(f"{job.name}: {type(e).__name__}: {e}")
                bar.update(len(job.configs))
                continue
            for rep in out.reports:
                rep["tables"] = [t for t, cfgs in rows.items() if rep["key"] in {c.key for c in cfgs}]
                reports[rep["key"]] = rep
                tqdm.write(f"{rep['key']:<44} {fmt_acc(rep):>13}", file=sys.stderr)
            if out.tau0 is not None:
                meta["tau0"][job.weights] = out.tau0._asdict()
            meta["jobs"][job.name] = out.record()
            tqdm.write(f"{job.name}: {out.seconds:.1f} s (first call {out.first_call_s or 0:.1f} s, "
                       f"{out.calls} calls x {out.rows_per_call} rows)", file=sys.stderr)
            bar.update(len(job.configs))
            meta["wall_s"] = time.monotonic() - start
            write(final=False)
    bar.close()
    order = {c.key: i for i, c in reversed(list(enumerate(c for cfgs in rows.values() for c in cfgs)))}
    reports = dict(sorted(reports.items(), key=lambda kv: order[kv[0]]))  # table order
    meta["wall_s"] = time.monotonic() - start
    write(final=True)
    jaxlp.generation.clear_cache_pool()
    return Evaluation(meta, reports, rows, skipped)
