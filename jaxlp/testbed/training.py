"""Training of the testbed reasoner: a small Qwen3-architecture model on generated multi-step arithmetic.

AdamW (optax; clip 1.0, b2 0.98, weight decay on matrices) with linear warmup and cosine decay
to 10% of the peak; float32 master weights, bf16 compute on GPU (float32 on CPU); loss = mean
next-token cross-entropy over the solution tokens only; batches of problems packed back to
back, batch ``i`` generated from (seed, i) by worker processes. With ``steps="auto"`` the step
count is fixed after the first ``probe_steps`` steps and the first evaluation, from their
measured times, so that training, evaluations and saving end within ``time_budget`` seconds
of the start; the schedule is then cosine over that many steps. A hard guard stops early (and
says so) if steps turn out slower. Every ``eval_every`` steps: greedy exact-match accuracy on
held-out problems; at the end: greedy and T=0.6/top-p 0.95 accuracy, by number of terms.
Writes an HF checkpoint (bf16 safetensors, sharded to pass 16 MB file limits) and
``training_log.json`` into ``out``.

Needs optax (the ``train`` extra); ``jaxlp.testbed`` does not import this module.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time
from collections import Counter, deque
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

import jaxlp
from jaxlp.models import ModelConfig, Transformer
from jaxlp.models.saving import hf_config_dict, save_pretrained
from jaxlp.sampling import Categorical, Greedy
from jaxlp.testbed import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    ProblemSpec,
    check_steps,
    eval_problems,
    is_correct,
    make_tokenizer,
    packed_batch,
)

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "assets" / "reasoner"
FULL_SPEC = ProblemSpec(min_terms=1, max_terms=8, max_digits=4, multiply_prob=0.5, start_digits=5)
TINY_SPEC = ProblemSpec(min_terms=1, max_terms=2, max_digits=2, multiply_prob=0.3, start_digits=2)


def model_config(tiny: bool = False) -> ModelConfig:
    """The reasoner's architecture: Qwen3 (q/k norm, tied embeddings, GQA), 11.4M parameters
    (22.9 MB in bf16); ``tiny``: 0.1M parameters for CPU smoke tests."""
    dims = (
        dict(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
        if tiny
        else dict(hidden_size=384, intermediate_size=896, num_layers=8, num_heads=6, num_kv_heads=2, head_dim=64)
    )
    return ModelConfig(
        model_type="qwen3", vocab_size=VOCAB_SIZE, qk_norm=True, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=1024, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID, **dims,
    )


def learning_rate(step: int, total: int, peak: float, warmup: int, final_fraction: float = 0.1) -> float:
    """Linear warmup from 0 to ``peak`` over ``warmup`` steps, then cosine to ``final_fraction * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(weight_decay: float) -> optax.GradientTransformation:
    """AdamW at unit learning rate (the step scales updates by the scheduled rate), clipped."""
    decay = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(1.0, b1=0.9, b2=0.98, eps=1e-8, weight_decay=weight_decay, mask=decay),
    )


def loss_fn(params, graphdef, inputs, targets, mask, compute_dtype):
    """Mean next-token cross-entropy over the tokens where ``mask`` is 1."""
    model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(compute_dtype), params))
    logits = model(inputs)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_train_step(graphdef, optimizer, compute_dtype):
    def step(params, opt_state, inputs, targets, mask, lr):
        loss, grads = jax.value_and_grad(loss_fn)(params, graphdef, inputs, targets, mask, compute_dtype)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p + lr * u, params, updates)
        return params, opt_state, loss, _tree_norm(grads)

    return jax.jit(step, donate_argnums=(0, 1))


_tree_norm = optax.tree.norm if hasattr(optax, "tree") else optax.global_norm


class BatchStream:
    """Batches 0, 1, 2, ... of :func:`packed_batch`, built ahead by worker processes (or inline)."""

    def __init__(self, seed, batch_size, seq_len, spec, workers: int = 0, prefetch: int = 8):
        self.args = (seed, batch_size, seq_len, spec)
        self.next_index = 0
        self.pool = None
        self.pending = deque()
        if workers > 0:
            # Workers only run NumPy; JAX_PLATFORMS=cpu keeps them off the GPU should anything touch JAX.
            saved = os.environ.get("JAX_PLATFORMS")
            os.environ["JAX_PLATFORMS"] = "cpu"
            try:
                self.pool = concurrent.futures.ProcessPoolExecutor(
                    workers, mp_context=multiprocessing.get_context("spawn"))
                for _ in range(max(prefetch, workers)):  # spawns the workers now, under that environment
                    self._submit()
            finally:
                if saved is None:
                    del os.environ["JAX_PLATFORMS"]
                else:
                    os.environ["JAX_PLATFORMS"] = saved

    def _submit(self):
        seed, b, s, spec = self.args
        self.pending.append(self.pool.submit(packed_batch, seed, self.next_index, b, s, spec))
        self.next_index += 1

    def __next__(self):
        if self.pool is None:
            seed, b, s, spec = self.args
            self.next_index += 1
            return packed_batch(seed, self.next_index - 1, b, s, spec)
        out = self.pending.popleft().result()
        self._submit()
        return out

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def generate_texts(model, problems, tokenizer, sampler, *, batch_size, max_new_tokens, seed=0) -> list[str]:
    """Generated solutions (decoded, special tokens dropped), in fixed-size batches (one compile)."""
    prompts = [tokenizer.encode(p.question).ids for p in problems]
    texts = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        n = len(chunk)
        chunk = chunk + prompts[: batch_size - n] if len(prompts) >= batch_size else chunk
        result = jaxlp.generate(model, chunk, max_new_tokens=max_new_tokens, sampler=sampler,
                                stop_tokens=(EOS_ID,), seed=seed + start)
        texts += [tokenizer.decode(s) for s in result.sequences()[:n]]
    return texts


def accuracy_report(problems, texts) -> dict:
    """Exact-match accuracy overall and by number of terms; first-error kinds of wrong ones."""
    ok = [is_correct(t, p) for t, p in zip(texts, problems)]
    by_terms: dict[int, list[bool]] = {}
    for p, good in zip(problems, ok):
        by_terms.setdefault(len(p.terms), []).append(good)
    kinds = Counter(check_steps(p, t).kind for p, t, good in zip(problems, texts, ok) if not good)
    return {
        "accuracy": float(np.mean(ok)) if ok else float("nan"),
        "n": len(ok),
        "by_terms": {k: round(float(np.mean(v)), 4) for k, v in sorted(by_terms.items())},
        "error_kinds": dict(kinds),
    }



SIZE_DEFAULTS = dict(  # setting -> (tiny, full): what an unset (None) setting becomes
    batch_size=(16, 128), seq_len=(192, 512), lr=(3e-3, 1e-3), warmup=(20, 200), eval_every=(100, 1000),
    eval_problems=(32, 256), final_eval_problems=(64, 1024),
    workers=(0, max(0, min(4, (os.cpu_count() or 1) - 1))),
)


@dataclasses.dataclass
class TrainSettings:
    """How to train; the settings that default to None take the ``tiny`` or full value of
    :data:`SIZE_DEFAULTS` (``tiny``: tiny model and easy problems, a CPU smoke test).

    ``steps``: a count, or ``"auto"`` (fit ``time_budget`` seconds from the start to the written
    checkpoint, at most ``max_steps``, measured over ``probe_steps`` steps). ``compute_dtype``:
    ``auto`` (bf16 on GPU, f32 on CPU), ``bf16`` or ``f32`` (master weights are always f32).
    ``min_terms`` .. ``order_window``: the problem spec's knobs (None: the spec's own).
    ``snapshots``: steps at which the bf16 parameters are kept and evaluated at T = 0.6 in BF16
    and NVFP4 W4A4 on ``snapshot_problems`` held-out problems (a list, or comma-separated).
    ``ship_min_accuracy``: save the first snapshot whose BF16 T = 0.6 accuracy reaches it instead
    of the final parameters (the last snapshot if none does).
    """

    out: Path = DEFAULT_OUT
    seed: int = 0
    tiny: bool = False
    steps: int | str = "auto"
    time_budget: float = 540.0
    max_steps: int = 20000
    probe_steps: int = 30
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    warmup: int | None = None
    weight_decay: float = 0.1
    compute_dtype: str = "auto"
    eval_every: int | None = None
    eval_problems: int | None = None
    final_eval_problems: int | None = None
    workers: int | None = None
    shard_mb: float = 12.0
    log_every: int = 50
    min_terms: int | None = None
    max_terms: int | None = None
    max_digits: int | None = None
    start_digits: int | None = None
    multiply_prob: float | None = None
    snapshots: list[int] | str = dataclasses.field(default_factory=list)
    snapshot_problems: int = 512
    ship_min_accuracy: float | None = None
    order_window: int | None = None

    def __post_init__(self):
        self.out = Path(self.out)
        for key, (small, full) in SIZE_DEFAULTS.items():
            if getattr(self, key) is None:
                setattr(self, key, small if self.tiny else full)
        if self.steps != "auto":
            try:
                self.steps = int(self.steps)
            except ValueError:
                raise ValueError(f"--steps must be an integer or 'auto', got {self.steps!r}") from None
            if self.steps < 1:
                raise ValueError("--steps must be >= 1")
        if self.compute_dtype not in ("auto", "bf16", "f32"):
            raise ValueError(f"--compute-dtype must be auto, bf16 or f32, got {self.compute_dtype!r}")
        snapshots = self.snapshots.split(",") if isinstance(self.snapshots, str) else self.snapshots
        try:
            self.snapshots = sorted({int(x) for x in snapshots if str(x).strip()})
        except ValueError:
            raise ValueError(f"--snapshots must be comma-separated integers, got {self.snapshots!r}") from None
        if self.ship_min_accuracy is not None and not self.snapshots:
            raise ValueError("--ship-min-accuracy needs --snapshots")

    def spec(self) -> ProblemSpec:
        """The problem spec: the tiny or full one with the knobs that are set."""
        knobs = ("min_terms", "max_terms", "max_digits", "start_digits", "multiply_prob", "order_window")
        return dataclasses.replace(TINY_SPEC if self.tiny else FULL_SPEC,
                                   **{k: getattr(self, k) for k in knobs if getattr(self, k) is not None})


class TrainResult(NamedTuple):
    """The training log and the trained model."""

    log: dict  # what training_log.json holds
    model: Transformer  # the trained model with bf16 parameters, as saved


def train(settings: TrainSettings, start: float | None = None) -> TrainResult:
    """Train as ``settings`` say; ``start`` (``time.monotonic()``, default now) is when the run
    began: the time budget and the logged total time count from it."""
    start = time.monotonic() if start is None else start
    spec = settings.spec()
    config = model_config(settings.tiny)
    hf_config_dict(config)  # fail now, not after training, if the checkpoint could not be written
    settings.out.mkdir(parents=True, exist_ok=True)
    if spec.max_tokens() > settings.seq_len + 1:
        raise ValueError(f"--seq-len {settings.seq_len} is below the longest problem ({spec.max_tokens()} tokens)")
    backend = jax.default_backend()
    compute = {"bf16": jnp.bfloat16, "f32": jnp.float32}.get(settings.compute_dtype) or (
        jnp.float32 if backend == "cpu" else jnp.bfloat16)
    tokenizer = make_tokenizer()
    final_set = eval_problems(settings.seed, max(settings.final_eval_problems, settings.eval_problems), spec)
    eval_set = final_set[: settings.eval_problems]
    max_new = spec.max_solution_chars() + 2  # solution, <eos>, one spare
    eval_batch = min(settings.eval_problems, 256)

    model = Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(settings.seed))
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(settings.weight_decay)
    opt_state = optimizer.init(params)
    step_fn = make_train_step(graphdef, optimizer, compute)
    stream = BatchStream(settings.seed, settings.batch_size, settings.seq_len, spec, settings.workers)
    tokens_per_step = settings.batch_size * settings.seq_len

    def bf16_params():
        return jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)

    def evaluate(problems, sampler, seed=0, model=None):
        model = nnx.merge(graphdef, bf16_params()) if model is None else model
        texts = generate_texts(model, problems, tokenizer, sampler, batch_size=eval_batch,
                               max_new_tokens=max_new, seed=seed)
        return accuracy_report(problems, texts), texts

    snapshot_set = eval_problems(settings.seed, settings.snapshot_problems, spec) if settings.snapshots else []
    snapshot_calibration = (packed_batch(settings.seed + 1, 0, 8, settings.seq_len, spec)[0] if settings.snapshots
                            else None)
    snapshot_params = {}

    def snapshot():
        """Keep the bf16 parameters; accuracy at T = 0.6 in BF16 and NVFP4 W4A4 (RTN, static scales)."""
        from jaxlp.quantization import quantize_model

        snapshot_params[step] = bf16_params()
        bf16 = nnx.merge(graphdef, snapshot_params[step])
        w4a4 = quantize_model(bf16, "w4a4-nvfp4", calibration=snapshot_calibration)
        sampler = Categorical(temperature=0.6, top_p=0.95)
        row = dict(step=step)
        for name, model in (("bf16", bf16), ("w4a4_nvfp4", w4a4)):
            report, _ = evaluate(snapshot_set, sampler, seed=settings.seed, model=model)
            row[name] = report
        log["snapshots"].append(row)
        tqdm.write(f"snapshot {step}: T=0.6 accuracy BF16 {row['bf16']['accuracy']:.4f}, NVFP4 W4A4 "
                   f"{row['w4a4_nvfp4']['accuracy']:.4f} ({len(snapshot_set)} problems)", file=sys.stderr)

    log = {"args": {k: str(v) for k, v in dataclasses.asdict(settings).items()}, "backend": backend,
           "devices": [str(d) for d in jax.devices()], "num_params": config.num_params,
           "spec": dataclasses.asdict(spec), "compute_dtype": jnp.dtype(compute).name,
           "tokens_per_step": tokens_per_step, "losses": [], "evals": [], "snapshots": []}
    deadline = start + settings.time_budget
    total = settings.steps if settings.steps != "auto" else None
    reserve = 0.0  # seconds kept for the final evaluation and saving
    eval_run = None
    final_chunks = math.ceil(settings.final_eval_problems / eval_batch)
    probe = min(settings.probe_steps, settings.warmup)
    step_times, t_compile = [], None
    pbar = tqdm(total=total, desc="train", mininterval=1.0 if sys.stderr.isatty() else 15.0, file=sys.stderr)
    pending_losses = []

    def flush_losses():  # one row per window: last step, mean loss, mean gradient norm, last lr
        if pending_losses:
            s, _, _, r = pending_losses[-1]
            lo = np.mean([float(x[1]) for x in pending_losses])
            gn = np.mean([float(x[2]) for x in pending_losses])
            log["losses"].append([s, round(float(lo), 5), round(float(gn), 4), r])
            pending_losses.clear()
    stopped_early = False
    step = 0
    t_loop = time.monotonic()
    try:
        while total is None or step < total:
            t0 = time.monotonic()
            inputs, targets, mask = next(stream)
            lr = learning_rate(step, total or 10**9, settings.lr, settings.warmup)
            params, opt_state, loss, gnorm = step_fn(params, opt_state, inputs, targets, mask, jnp.float32(lr))
            pending_losses.append((step, loss, gnorm, lr))
            if step < probe or (total is None and step == probe):
                loss.block_until_ready()
                dt = time.monotonic() - t0
                if step == 0:
                    t_compile = dt
                elif step >= min(5, probe - 1):
                    step_times.append(dt)
            step += 1
            pbar.update(1)
            if step in settings.snapshots:
                snapshot()
            if step % settings.log_every == 0 or step == total:
                flush_losses()
                elapsed = time.monotonic() - t_loop
                pbar.set_postfix(loss=f"{log['losses'][-1][1]:.4f}", lr=f"{lr:.2e}",
                                 tok_s=f"{step * tokens_per_step / elapsed:.3g}")
            if total is None and step == probe:
                # Time one evaluation (compile, then run) and fix the step count.
                t0 = time.monotonic()
                report, _ = evaluate(eval_set, Greedy())
                t_eval_first = time.monotonic() - t0
                t0 = time.monotonic()
                evaluate(eval_set, Greedy())
                eval_run = time.monotonic() - t0
                eval_compile = max(0.0, t_eval_first - eval_run)
                step_time = float(np.median(step_times)) if step_times else 1.0
                reserve = eval_compile + 2 * final_chunks * eval_run + 10.0 + 0.03 * settings.time_budget
                remaining = deadline - time.monotonic() - reserve
                per_step = step_time + eval_run / settings.eval_every
                total = int(min(settings.max_steps, max(step + 1, step + remaining // per_step)))
                log["timing"] = dict(compile_s=t_compile, step_s=step_time, eval_compile_s=eval_compile,
                                     eval_run_s=eval_run, reserve_s=reserve, planned_steps=total)
                log["evals"].append(dict(step=step, **report))
                pbar.total = total
                pbar.refresh()
                tqdm.write(f"step time {step_time * 1e3:.1f} ms (compile {t_compile:.1f} s), eval {eval_run:.1f} s "
                           f"(compile {eval_compile:.1f} s): training {total} steps "
                           f"({total * tokens_per_step / 1e6:.0f}M tokens)", file=sys.stderr)
            elif step % settings.eval_every == 0 and step < total:
                t0 = time.monotonic()
                report, _ = evaluate(eval_set, Greedy())
                dt = time.monotonic() - t0
                if eval_run is not None and dt > eval_run:  # outputs grew longer: keep more time back
                    reserve += 2 * final_chunks * (dt - eval_run)
                    eval_run = dt
                log["evals"].append(dict(step=step, **report))
                tqdm.write(f"step {step}: loss {log['losses'][-1][1]:.4f}, greedy accuracy "
                           f"{report['accuracy']:.3f} {report['by_terms']}", file=sys.stderr)
            if time.monotonic() > deadline - reserve and step < (total or step + 1):
                stopped_early = True
                tqdm.write(f"time budget reached: stopping at step {step} of {total}", file=sys.stderr)
                break
    finally:
        pbar.close()
        stream.close()
    flush_losses()
    log["steps"] = step
    log["stopped_early"] = stopped_early
    log["train_seconds"] = time.monotonic() - t_loop

    shipped = None
    if settings.ship_min_accuracy is not None and snapshot_params:
        good = [r["step"] for r in log["snapshots"] if r["bf16"]["accuracy"] >= settings.ship_min_accuracy]
        shipped = good[0] if good else max(snapshot_params)
        tqdm.write(f"shipping the parameters of step {shipped}", file=sys.stderr)
    log["shipped_step"] = shipped or step
    final_model = nnx.merge(graphdef, snapshot_params[shipped] if shipped else bf16_params())

    final = {}
    for name, sampler in (("greedy", Greedy()), ("T0.6_top_p0.95", Categorical(temperature=0.6, top_p=0.95))):
        report, texts = evaluate(final_set[: settings.final_eval_problems], sampler, seed=settings.seed,
                                 model=final_model)
        final[name] = report
        tqdm.write(f"final {name}: accuracy {report['accuracy']:.4f} on {report['n']} held-out problems, "
                   f"by terms {report['by_terms']}, errors {report['error_kinds']}", file=sys.stderr)
    log["final"] = final
    log["sample"] = final_set[0].question + texts[0]

    save_pretrained(final_model, settings.out, tokenizer, dtype=jnp.bfloat16,
                    max_shard_bytes=int(settings.shard_mb * 1e6), overwrite=True)
    log["total_seconds"] = time.monotonic() - start
    (settings.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    size = sum(f.stat().st_size for f in settings.out.iterdir())
    print(f"wrote {settings.out} ({size / 1e6:.1f} MB) after {log['total_seconds']:.0f} s, {step} steps",
          file=sys.stderr)
    return TrainResult(log, final_model)

