"""Train the testbed reasoner: a small Qwen3-architecture model on generated multi-step arithmetic.

    python scripts/train_reasoner.py                            # GPU: auto step count within --time-budget
    python scripts/train_reasoner.py --tiny --steps 200         # CPU smoke test (tiny model, easy problems)

Training: AdamW (optax; clip 1.0, b2 0.98, weight decay on matrices) with linear warmup and
cosine decay to 10% of the peak; float32 master weights, bf16 compute on GPU (float32 on
CPU); loss on solution tokens only; batches of problems packed back to back, batch ``i``
generated from (seed, i) by worker processes. With ``--steps auto`` the step count is fixed
after the first ``--probe-steps`` steps and the first evaluation, from their measured
times, so that training, evaluations and saving end within ``--time-budget`` seconds of
the script's start; the schedule is then cosine over that many steps. A hard guard stops
early (and says so) if steps turn out slower. Every ``--eval-every`` steps: greedy exact-match
accuracy on held-out problems; at the end: greedy and T=0.6/top-p 0.95 accuracy, by number
of terms. Writes an HF checkpoint (bf16 safetensors, sharded to pass 16 MB file limits) and
``training_log.json`` into ``--out``.
"""

from __future__ import annotations

import time

T_START = time.monotonic()

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections import Counter, deque  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import jaxlp  # noqa: E402
from jaxlp.models import ModelConfig, Transformer  # noqa: E402
from jaxlp.models.saving import hf_config_dict, save_pretrained  # noqa: E402
from jaxlp.sampling import Categorical, Greedy  # noqa: E402
from jaxlp.testbed import (  # noqa: E402
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    ProblemSpec,
    check_steps,
    eval_problems,
    is_correct,
    packed_batch,
    make_tokenizer,
)

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "jaxlp" / "assets" / "reasoner"
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint directory (default jaxlp/assets/reasoner)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny model and easy problems (CPU smoke test)")
    ap.add_argument("--steps", default="auto", help="number of steps, or 'auto' (fit --time-budget)")
    ap.add_argument("--time-budget", type=float, default=540.0, help="seconds from start to checkpoint written")
    ap.add_argument("--max-steps", type=int, default=20000, help="cap on the automatic step count")
    ap.add_argument("--probe-steps", type=int, default=30, help="steps timed before fixing the automatic step count")
    ap.add_argument("--batch-size", type=int, default=None, help="rows per step (default 128; tiny 16)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 512; tiny 192)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3; tiny 3e-3)")
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default 200; tiny 20)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--compute-dtype", choices=("auto", "bf16", "f32"), default="auto",
                    help="auto: bf16 on GPU, f32 on CPU (master weights are always f32)")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default 1000; tiny 100)")
    ap.add_argument("--eval-problems", type=int, default=None,
                    help="held-out problems per evaluation (default 256; tiny 32)")
    ap.add_argument("--final-eval-problems", type=int, default=None,
                    help="held-out problems of the final evaluation (default 1024; tiny 64)")
    ap.add_argument("--workers", type=int, default=None, help="data worker processes (default min(4, cpus-1); tiny 0)")
    ap.add_argument("--shard-mb", type=float, default=12.0, help="max safetensors shard size in MB")
    ap.add_argument("--log-every", type=int, default=50, help="steps per row of the loss log")
    for knob in ("min_terms", "max_terms", "max_digits", "start_digits"):
        ap.add_argument("--" + knob.replace("_", "-"), type=int, default=None, help=f"problem {knob} (default: the spec's)")
    ap.add_argument("--multiply-prob", type=float, default=None, help="chance of a final multiplication")
    ap.add_argument("--snapshots", default="",
                    help="comma-separated steps at which the bf16 parameters are kept and evaluated at T = 0.6 "
                         "in BF16 and NVFP4 W4A4 (--snapshot-problems held-out problems)")
    ap.add_argument("--snapshot-problems", type=int, default=512)
    ap.add_argument("--ship-min-accuracy", type=float, default=None,
                    help="save the first snapshot whose BF16 T = 0.6 accuracy reaches this instead of the final "
                         "parameters (the last snapshot if none does)")
    ap.add_argument("--order-window", type=int, default=None,
                    help="terms are added in random order within blocks of this many (1: left to right; "
                         ">= max terms: fully random; default 2)")
    args = ap.parse_args(argv)
    tiny = args.tiny
    defaults = dict(batch_size=(16, 128), seq_len=(192, 512), lr=(3e-3, 1e-3), warmup=(20, 200),
                    eval_every=(100, 1000), eval_problems=(32, 256), final_eval_problems=(64, 1024),
                    workers=(0, max(0, min(4, (os.cpu_count() or 1) - 1))))
    for key, (small, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, small if tiny else full)
    if args.steps != "auto":
        try:
            args.steps = int(args.steps)
        except ValueError:
            ap.error(f"--steps must be an integer or 'auto', got {args.steps!r}")
        if args.steps < 1:
            ap.error("--steps must be >= 1")
    try:
        args.snapshots = sorted({int(x) for x in args.snapshots.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--snapshots must be comma-separated integers, got {args.snapshots!r}")
    if args.ship_min_accuracy is not None and not args.snapshots:
        ap.error("--ship-min-accuracy needs --snapshots")
    return args


class TrainResult(NamedTuple):
    log: dict  # what training_log.json holds
    model: Transformer  # the trained model with bf16 parameters, as saved


def train(args) -> TrainResult:
    """Run training as configured by ``args`` (see :func:`parse_args`)."""
    knobs = ("min_terms", "max_terms", "max_digits", "start_digits", "multiply_prob", "order_window")
    spec = dataclasses.replace(TINY_SPEC if args.tiny else FULL_SPEC,
                               **{k: getattr(args, k) for k in knobs if getattr(args, k, None) is not None})
    config = model_config(args.tiny)
    hf_config_dict(config)  # fail now, not after training, if the checkpoint could not be written
    args.out.mkdir(parents=True, exist_ok=True)
    if spec.max_tokens() > args.seq_len + 1:
        raise ValueError(f"--seq-len {args.seq_len} is below the longest problem ({spec.max_tokens()} tokens)")
    backend = jax.default_backend()
    compute = {"bf16": jnp.bfloat16, "f32": jnp.float32}.get(args.compute_dtype) or (
        jnp.float32 if backend == "cpu" else jnp.bfloat16)
    tokenizer = make_tokenizer()
    final_set = eval_problems(args.seed, max(args.final_eval_problems, args.eval_problems), spec)
    eval_set = final_set[: args.eval_problems]
    max_new = spec.max_solution_chars() + 2  # solution, <eos>, one spare
    eval_batch = min(args.eval_problems, 256)

    model = Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(args.weight_decay)
    opt_state = optimizer.init(params)
    step_fn = make_train_step(graphdef, optimizer, compute)
    stream = BatchStream(args.seed, args.batch_size, args.seq_len, spec, args.workers)
    tokens_per_step = args.batch_size * args.seq_len

    def bf16_params():
        return jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)

    def evaluate(problems, sampler, seed=0, model=None):
        model = nnx.merge(graphdef, bf16_params()) if model is None else model
        texts = generate_texts(model, problems, tokenizer, sampler, batch_size=eval_batch,
                               max_new_tokens=max_new, seed=seed)
        return accuracy_report(problems, texts), texts

    snapshot_set = eval_problems(args.seed, args.snapshot_problems, spec) if args.snapshots else []
    snapshot_calibration = packed_batch(args.seed + 1, 0, 8, args.seq_len, spec)[0] if args.snapshots else None
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
            report, _ = evaluate(snapshot_set, sampler, seed=args.seed, model=model)
            row[name] = report
        log["snapshots"].append(row)
        tqdm.write(f"snapshot {step}: T=0.6 accuracy BF16 {row['bf16']['accuracy']:.4f}, NVFP4 W4A4 "
                   f"{row['w4a4_nvfp4']['accuracy']:.4f} ({len(snapshot_set)} problems)", file=sys.stderr)

    log = {"args": {k: str(v) for k, v in vars(args).items()}, "backend": backend,
           "devices": [str(d) for d in jax.devices()], "num_params": config.num_params,
           "spec": dataclasses.asdict(spec), "compute_dtype": jnp.dtype(compute).name,
           "tokens_per_step": tokens_per_step, "losses": [], "evals": [], "snapshots": []}
    deadline = T_START + args.time_budget
    total = args.steps if args.steps != "auto" else None
    reserve = 0.0  # seconds kept for the final evaluation and saving
    eval_run = None
    final_chunks = math.ceil(args.final_eval_problems / eval_batch)
    probe = min(args.probe_steps, args.warmup)
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
            lr = learning_rate(step, total or 10**9, args.lr, args.warmup)
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
            if step in args.snapshots:
                snapshot()
            if step % args.log_every == 0 or step == total:
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
                reserve = eval_compile + 2 * final_chunks * eval_run + 10.0 + 0.03 * args.time_budget
                remaining = deadline - time.monotonic() - reserve
                per_step = step_time + eval_run / args.eval_every
                total = int(min(args.max_steps, max(step + 1, step + remaining // per_step)))
                log["timing"] = dict(compile_s=t_compile, step_s=step_time, eval_compile_s=eval_compile,
                                     eval_run_s=eval_run, reserve_s=reserve, planned_steps=total)
                log["evals"].append(dict(step=step, **report))
                pbar.total = total
                pbar.refresh()
                tqdm.write(f"step time {step_time * 1e3:.1f} ms (compile {t_compile:.1f} s), eval {eval_run:.1f} s "
                           f"(compile {eval_compile:.1f} s): training {total} steps "
                           f"({total * tokens_per_step / 1e6:.0f}M tokens)", file=sys.stderr)
            elif step % args.eval_every == 0 and step < total:
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
    if args.ship_min_accuracy is not None and snapshot_params:
        good = [r["step"] for r in log["snapshots"] if r["bf16"]["accuracy"] >= args.ship_min_accuracy]
        shipped = good[0] if good else max(snapshot_params)
        tqdm.write(f"shipping the parameters of step {shipped}", file=sys.stderr)
    log["shipped_step"] = shipped or step
    final_model = nnx.merge(graphdef, snapshot_params[shipped] if shipped else bf16_params())

    final = {}
    for name, sampler in (("greedy", Greedy()), ("T0.6_top_p0.95", Categorical(temperature=0.6, top_p=0.95))):
        report, texts = evaluate(final_set[: args.final_eval_problems], sampler, seed=args.seed, model=final_model)
        final[name] = report
        tqdm.write(f"final {name}: accuracy {report['accuracy']:.4f} on {report['n']} held-out problems, "
                   f"by terms {report['by_terms']}, errors {report['error_kinds']}", file=sys.stderr)
    log["final"] = final
    log["sample"] = final_set[0].question + texts[0]

    save_pretrained(final_model, args.out, tokenizer, dtype=jnp.bfloat16,
                    max_shard_bytes=int(args.shard_mb * 1e6), overwrite=True)
    log["total_seconds"] = time.monotonic() - T_START
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.1f} MB) after {log['total_seconds']:.0f} s, {step} steps", file=sys.stderr)
    return TrainResult(log, final_model)


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
