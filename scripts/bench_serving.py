"""Online serving benchmark of the continuous-batching engine (in the spirit of vLLM's benchmark_serving).

The engine runs in this process (no HTTP): one thread replays a workload of ``--num-prompts``
requests whose arrival times follow a Poisson process at ``--rate`` requests/s (gamma
inter-arrival times with ``--burstiness`` 1; ``inf``: every request arrives at t = 0). The loop
submits every request whose arrival time has passed (wall clock since the start), then calls
``Engine.step()`` (admit waiting requests with one prefill each, one decode call of
``--steps-per-call`` steps over every slot); it sleeps only when the engine is idle, until the
next arrival. A request that arrives during a step waits for it, as it would in a server: TTFT is
measured from its scheduled arrival time, not from the moment the loop submitted it.

Workload: random token ids (a random-weight model), prompt and output lengths ``--input-len`` /
``--output-len`` (``N``: N with ``--len-jitter`` r drawing uniformly in ``[N(1-r), N(1+r)]``;
``MIN:MAX``: uniform in that range); the end-of-sequence token does not stop a request (every
request generates exactly its output length, as with vLLM's ``--ignore-eos``); greedy sampling by
default (``--sampler temperature``: T ``--temperature``, top-p ``--top-p``), request ``i`` with
seed ``--seed + i``. For one rate every configuration replays the same requests at the same times.

Sweep: weight recipe (``--recipes``: ``bf16`` or a :mod:`jaxlp.quantization` recipe name)
x KV cache format (``--kv-caches``) x NestedFP precision policy (``--precision``: ``none``,
``fp16``, ``fp8``, ``auto`` or ``slo:MS``, each an engine; recipes without NestedFP layers skip
the policies) x rate (``--rates``). The cache is either a fixed memory
(``--cache-gib``: ``Engine(cache_budget_bytes=...)``, so a 2-bit cache holds more slots than
BF16 in the same bytes; at most ``--max-slots``) or a fixed slot count (``--slots``). One engine
per recipe x cache: warmed up once (``Engine.warmup`` over the workload's prompt buckets: the
decode program and one prefill per bucket; not timed), then every rate is run on it. Saturated
throughput, Kitty's headline (tokens/s at a fixed cache memory), is ``--rates inf`` with
``--cache-gib``: every request queued at once, the engine as full as its slots allow; its
``saturated_tokens_per_s`` counts only the engine steps that begin and end with every slot
busy (finished requests replaced by waiting ones, their prefills included), so the ramp-up and
the last, partly filled wave of a run do not dilute it.

Per run: TTFT (scheduled arrival -> first token) and TPOT (time per output token after the first)
mean / p50 / p99 over requests (TPOT also p90, the NestedFP paper's); ITL p50 / p99 (gap between
consecutive token deliveries of a request divided by the tokens delivered: tokens arrive
``--steps-per-call`` at a time, and a prefill admitted in between shows here); the mean decode
step time of the calls no prefill preceded (``Engine.step_seconds``: the decode program alone);
output tokens/s, total (prompt + output) tokens/s and requests/s over the duration (start -> last
request finished); slots, cache bytes, mean / max running requests, and the programs compiled
after warm-up (must be 0: the engine never recompiles once warm).
With ``--generate-baseline`` each engine also gets a row (rate ``generate``): ``jaxlp.generate``'s
decode step on as many of the workload's prompts as the engine has slots, same model, cache and
sampler, beside the engine's step of its last rate (``engine_over_generate``: the engine's
overhead per decode call, its dispatch and the tokens' trip to the host; the host's work between
calls is not in either).

Results: JSON under ``--out`` (rewritten after every run, so a run cut short keeps what it
measured), a plot (``--plot``, default ``--out`` with ``.png``: TTFT p50, TPOT p50 and output
tokens/s against the rate, one line per recipe x cache; ``inf`` drawn at twice the largest finite
rate), and a table printed last.

H100 (Qwen3-8B shape, 8 layers, random weights), a rate sweep at 64 slots, 1K-token prompts,
256 output tokens (one command per weight recipe keeps each under 10 minutes)::

    python scripts/bench_serving.py --layers 8 --recipes bf16 --kv-caches bf16,kitty-pro --slots 64 \\
        --input-len 1024 --output-len 256 --len-jitter 0.25 --rates 1,2,4,8,inf --num-prompts 64 \\
        --out docs/bench_serving_h100_bf16.json
    python scripts/bench_serving.py --layers 8 --recipes w4a16-nvfp4 --kv-caches bf16,kitty-pro --slots 64 \\
        --input-len 1024 --output-len 256 --len-jitter 0.25 --rates 1,2,4,8,inf --num-prompts 64 \\
        --out docs/bench_serving_h100_nvfp4.json

NestedFP under a TPOT target of 4.19 ms (FP8 while the FP16 mode's predicted step, prefill stalls
included, misses it) against fixed FP16, per rate (docs/perf.md session 33)::

    python scripts/bench_serving.py --layers 8 --recipes nestedfp --kv-caches bf16 --slots 64 \\
        --precision fp16,slo:4.19 --input-len 1024 --output-len 256 --len-jitter 0.25 --rates 4,8,16,inf \\
        --num-prompts 128 --out docs/bench_serving_h100_nestedfp.json

and the saturated throughput at a fixed cache memory on the Kitty reference's shape (short
prompts, long outputs: kitty-pro vs BF16 in the same 4 GiB of cache, 31 BF16 slots of 4160
positions, 151 kitty-pro slots; 302 requests, two waves of kitty-pro's slots)::

    python scripts/bench_serving.py --layers 8 --recipes bf16 --kv-caches bf16,kitty-pro --cache-gib 4 \\
        --max-slots 256 --input-len 64 --output-len 4096 --rates inf --num-prompts 302 \\
        --out docs/bench_serving_capacity_h100.json

CPU smoke run (a tiny model, a few requests)::

    python scripts/bench_serving.py --tiny --out /tmp/bench_serving_tiny.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import QWEN3_8B, build_model  # noqa: E402

from jaxlp import kvcache  # noqa: E402
from jaxlp.evals import harness  # noqa: E402
from jaxlp.generation import generate, prompt_bucket  # noqa: E402
from jaxlp.models import from_hf_config  # noqa: E402
from jaxlp.quantization import RECIPES, LatencyTarget, LoadThreshold, quantize_model, set_implementation  # noqa: E402
from jaxlp.quantization.precision import has_nestedfp  # noqa: E402
from jaxlp.quantization.activations import STATIC  # noqa: E402
from jaxlp.quantization.recipes import get_recipe  # noqa: E402
from jaxlp.sampling.base import Categorical, Greedy  # noqa: E402
from jaxlp.serving.engine import Engine, SamplingParams  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            vocab_size=512, bos_token_id=1, eos_token_id=2)  # special ids inside the vocabulary (warm-up checks them)
# --tiny defaults (a CPU smoke run); an option given on the command line wins.
FP16_RECIPES = {"nestedfp": jnp.float16}  # recipes benchmarked on an FP16 model (the rest: BF16)
TINY_DEFAULTS = dict(layers=2, num_prompts=6, input_len="12:30", output_len="8", rates="8,inf", slots=3,
                     steps_per_call=2)


# ---------------------------------------------------------------- workload

def parse_rate(s: str) -> float:
    rate = float(s)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 (or inf), got {s!r}")
    return rate


def rate_label(rate: float) -> float | str:
    """The rate as stored in the JSON (JSON has no infinity)."""
    return "inf" if math.isinf(rate) else rate


def parse_len(spec: str, jitter: float) -> tuple[int, int]:
    """``N`` (with ``jitter``) or ``MIN:MAX`` -> the inclusive range lengths are drawn from."""
    if ":" in spec:
        lo, hi = (int(x) for x in spec.split(":"))
    else:
        n = int(spec)
        lo, hi = int(round(n * (1 - jitter))), int(round(n * (1 + jitter)))
    if not 1 <= lo <= hi:
        raise SystemExit(f"bad length {spec!r} (jitter {jitter}): need 1 <= min <= max, got {lo}..{hi}")
    return lo, hi


def make_requests(n: int, input_range, output_range, vocab: int, seed: int) -> list[dict]:
    """``n`` requests (prompt ids, output length, seed), the same for every rate and configuration."""
    rng = np.random.default_rng([seed, 0])
    ins = rng.integers(input_range[0], input_range[1] + 1, n)
    outs = rng.integers(output_range[0], output_range[1] + 1, n)
    return [dict(prompt=rng.integers(0, vocab, int(k)).tolist(), max_tokens=int(m), seed=seed + i)
            for i, (k, m) in enumerate(zip(ins, outs))]


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds after the start: the first request at 0, then gamma gaps of mean ``1 / rate``
    (shape ``burstiness``; 1 is a Poisson process); every one at 0 for an infinite rate."""
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng([seed, 1, int(rate * 1000)])
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


# ---------------------------------------------------------------- one run

def stats_ms(values) -> dict:
    """mean / p50 / p90 / p99 of ``values`` (seconds) in milliseconds; None where there are none."""
    v = np.asarray([x for x in values if x is not None], np.float64)
    if v.size == 0:
        return dict(mean=None, p50=None, p90=None, p99=None)
    return dict(mean=float(v.mean() * 1e3), **{f"p{q}": float(np.percentile(v, q) * 1e3) for q in (50, 90, 99)})


def run_workload(engine: Engine, requests: list[dict], arrivals: np.ndarray, sampler) -> dict:
    """Replay ``requests`` at ``arrivals`` (seconds after the start) on a warm, idle engine."""
    if engine.has_work():
        raise RuntimeError("the engine must be idle before a run")
    engine.step_seconds = collections.deque()  # every clean step of this run (the engine keeps the last 256)
    engine.call_seconds.clear()
    if isinstance(engine.precision, LatencyTarget):
        engine.precision.reset()  # an SLO policy starts each run unmeasured
    counters = dict(engine.counters)
    compiled = engine.compilations
    deliveries: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)

    def listener(out):
        if out.token_ids:
            deliveries[out.request_id].append((time.perf_counter(), len(out.token_ids)))

    submitted, running = [], []
    trace = []  # after each step: (time, generated tokens so far, running slots)
    lag = 0.0
    n = len(requests)
    start = time.perf_counter()
    i = 0
    while i < n or engine.has_work():
        now = time.perf_counter() - start
        while i < n and arrivals[i] <= now:
            r = requests[i]
            params = SamplingParams(sampler=sampler, seed=r["seed"], max_tokens=r["max_tokens"], stop_token_ids=())
            req = engine.submit(r["prompt"], params, listener=listener, request_id=f"req-{i}")
            req.arrival = start + float(arrivals[i])  # TTFT from the scheduled arrival (submit stamps now)
            lag = max(lag, now - float(arrivals[i]))
            submitted.append(req)
            i += 1
        if engine.has_work():
            engine.step()
            running.append(engine.num_running)
            trace.append((time.perf_counter(), engine.counters["generated_tokens"], running[-1]))
        elif i < n:
            time.sleep(max(0.0, float(arrivals[i]) - (time.perf_counter() - start)))
    end = max(r.finished_at for r in submitted)
    duration = end - start

    itl = []
    for times in deliveries.values():
        for (t0, _), (t1, k) in zip(times, times[1:]):
            itl.extend([(t1 - t0) / k] * k)
    done = [r for r in submitted if r.finish_reason in ("stop", "length")]
    out_tokens = sum(len(r.token_ids) for r in submitted)
    in_tokens = sum(len(r.prompt_ids) for r in submitted)
    reasons = collections.Counter(r.finish_reason for r in submitted)
    ttft, tpot, itl_s = stats_ms(r.ttft for r in submitted), stats_ms(r.tpot for r in submitted), stats_ms(itl)
    steps = list(engine.step_seconds)
    full = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(trace, trace[1:]) if a[2] == b[2] == engine.slots]
    saturated_s = sum(dt for dt, _ in full)
    return dict(
        num_requests=n, completed=len(done), finish_reasons=dict(reasons), duration_s=duration,
        input_tokens=in_tokens, output_tokens=out_tokens,
        output_tokens_per_s=out_tokens / duration, total_tokens_per_s=(in_tokens + out_tokens) / duration,
        requests_per_s=len(done) / duration,
        saturated_s=saturated_s,
        saturated_tokens_per_s=sum(n for _, n in full) / saturated_s if saturated_s > 0 else None,
        ttft_mean_ms=ttft["mean"], ttft_p50_ms=ttft["p50"], ttft_p99_ms=ttft["p99"],
        tpot_mean_ms=tpot["mean"], tpot_p50_ms=tpot["p50"], tpot_p90_ms=tpot["p90"],
        tpot_p99_ms=tpot["p99"],
        itl_mean_ms=itl_s["mean"], itl_p50_ms=itl_s["p50"], itl_p99_ms=itl_s["p99"],
        step_mean_ms=float(np.mean(steps) * 1e3) if steps else None,
        decode_calls=engine.counters["decode_calls"] - counters.get("decode_calls", 0),
        running_mean=float(np.mean(running)) if running else 0.0, running_max=max(running, default=0),
        max_submit_lag_ms=lag * 1e3,
        generated_tokens_counted=engine.counters["generated_tokens"] - counters.get("generated_tokens", 0),
        compilations_after_warmup=engine.compilations - compiled,
        fp8_decode_calls=engine.counters["fp8_decode_calls"] - counters.get("fp8_decode_calls", 0),
    )


def generate_step_ms(model, requests: list[dict], batch: int, cache: str, max_len: int, sampler, short: int,
                     long: int, repeats: int = 3) -> float:
    """``jaxlp.generate``'s decode step (ms) on ``batch`` of the workload's prompts (cycled), the
    same model, cache format and sampler as an engine of ``batch`` slots: the time of ``long`` new
    tokens less that of ``short``, over their difference (the prompt call cancels), medians of
    ``repeats`` after one untimed call per length (its compilation). No stop token: every row
    decodes every step, as the engine's fixed-shape slot batch does."""
    prompts = [requests[i % len(requests)]["prompt"] for i in range(batch)]
    times = {}
    for n in (short, long):
        def call(n=n):
            return generate(model, prompts, max_new_tokens=n, sampler=sampler, kv_cache=cache, stop_tokens=[],
                            max_length=max_len).tokens  # NumPy: the call has finished
        call()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t0)
        times[n] = float(np.median(samples))
    return (times[long] - times[short]) / (long - short) * 1e3


# ---------------------------------------------------------------- models and engines

def model_config(layers: int, tiny: bool):
    cfg = dict(QWEN3_8B, num_hidden_layers=layers, max_window_layers=layers)
    if tiny:
        cfg.update(TINY)
    return from_hf_config(cfg)


def apply_recipe(model, recipe: str, implementation: str):
    """``model`` itself for bf16, else a quantized copy (static activation scales calibrated on
    two random token batches, as bench_decode does)."""
    if recipe == "bf16":
        return model
    rec = get_recipe(recipe)
    calibration = None
    if rec.activation in STATIC:
        calibration = np.random.default_rng(5).integers(0, model.config.vocab_size, (2, 256))
    quantized = quantize_model(model, rec, calibration=calibration, calibration_batch_size=1)
    return set_implementation(quantized, implementation)


def parse_precision(spec: str):
    """An engine precision policy from ``--precision``'s items: ``none`` (no policy), ``fp16`` /
    ``fp8`` (one mode throughout), ``auto`` (:class:`LoadThreshold`: FP8 while more requests run
    or wait than half the slots) or ``slo:MS`` (:class:`LatencyTarget`: FP8 while the FP16 mode's
    predicted time per step misses MS milliseconds)."""
    if spec in ("none", "fp16", "fp8"):
        return None if spec == "none" else spec
    if spec == "auto":
        return LoadThreshold()
    if spec.startswith("slo:"):
        try:
            return LatencyTarget(target_ms=float(spec[4:]))
        except ValueError as e:
            raise SystemExit(f"--precision {spec!r}: {e}") from None
    raise SystemExit(f"--precision {spec!r}: expected none, fp16, fp8, auto or slo:MS")


def make_engine(model, cache: str, args, max_len: int, precision=None) -> Engine:
    budget = None if args.cache_gib is None else int(args.cache_gib * 2**30)
    slots = args.slots if args.slots is not None else args.max_slots
    return Engine(model, kv_cache=cache, max_len=max_len, slots=slots, cache_budget_bytes=budget, precision=precision,
                  steps_per_call=args.steps_per_call, max_waiting=max(1024, args.num_prompts),
                  overlap=not args.no_overlap)


# ---------------------------------------------------------------- output

def plot(path, runs: list[dict], title: str) -> None:
    rates = sorted({r["rate"] for r in runs if r["rate"] != "inf"})
    top = 2 * max(rates) if rates else 1.0
    x_of = lambda rate: top if rate == "inf" else rate  # noqa: E731
    xs = sorted({x_of(r["rate"]) for r in runs})
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("ttft_p50_ms", "TTFT p50 (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)"),
              ("output_tokens_per_s", "output tokens/s"))
    series = collections.defaultdict(dict)
    for r in runs:
        series[f"{run_label(r)} / {r['kv_cache']} (B={r['slots']})"][x_of(r["rate"])] = r
    for ax, (key, ylabel) in zip(axes, panels):
        for name, by_x in series.items():
            ax.plot(xs, [by_x[x][key] if x in by_x and by_x[x].get(key) is not None else np.nan for x in xs],
                    marker="o", ms=4, label=name)
        ax.set(xlabel="request rate (req/s)", ylabel=ylabel)
        if len(xs) > 1 and min(xs) > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [("inf" if x == top and "inf" in {r["rate"] for r in runs} else f"{x:g}") for x in xs])
        ax.minorticks_off()
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_label(r: dict) -> str:
    """A run's weight recipe, with its NestedFP precision policy when it has one."""
    precision = r.get("precision", "none")
    return r["recipe"] if precision == "none" else f"{r['recipe']}@{precision}"


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def print_table(runs: list[dict], header: str) -> None:
    base = {(run_label(r), r["rate"]): r for r in runs if r["kv_cache"] == "bf16" and "output_tokens_per_s" in r}
    print(f"\n## {header}")
    cols = (f"{'recipe':12s} {'kv cache':10s} {'rate':>5s} {'slots':>5s} {'cache MiB':>9s} {'ttft p50':>9s} "
            f"{'ttft p99':>9s} {'tpot p50':>9s} {'tpot p99':>9s} {'step ms':>8s} {'out tok/s':>9s} {'x bf16':>6s} "
            f"{'sat tok/s':>9s} {'x bf16':>6s} {'req/s':>6s} {'dur s':>6s} {'compiles':>8s}")
    print(cols)
    for r in runs:
        head = f"{run_label(r):12s} {r['kv_cache']:10s} {str(r['rate']):>5s}"
        if "generate_step_ms" in r:
            versus = (f"; the engine's {r['engine_step_ms']:.2f} ms is x{r['engine_over_generate']:.3f} of it"
                      if "engine_step_ms" in r else "")
            print(f"{head} {r['slots']:5d} jaxlp.generate's decode step {r['generate_step_ms']:.2f} ms{versus}")
            continue
        if "output_tokens_per_s" not in r:
            print(f"{head} {r.get('error', r.get('skipped', ''))[:100]}")
            continue
        ref = base.get((run_label(r), r["rate"]), {})
        ratio = lambda key: (f"{r[key] / ref[key]:.2f}" if r.get(key) and ref.get(key) else "-")  # noqa: E731
        print(f"{head} {r['slots']:5d} {r['cache_bytes'] / 2**20:9.2f} {fmt(r['ttft_p50_ms']):>9s} "
              f"{fmt(r['ttft_p99_ms']):>9s} {fmt(r['tpot_p50_ms'], '.2f'):>9s} {fmt(r['tpot_p99_ms'], '.2f'):>9s} "
              f"{fmt(r['step_mean_ms'], '.2f'):>8s} {r['output_tokens_per_s']:9.1f} {ratio('output_tokens_per_s'):>6s} "
              f"{fmt(r.get('saturated_tokens_per_s')):>9s} {ratio('saturated_tokens_per_s'):>6s} "
              f"{r['requests_per_s']:6.2f} {r['duration_s']:6.2f} {r['compilations_after_warmup']:8d}"
              + (f"  fp8 {r['fp8_decode_calls']}/{r['decode_calls']} calls" if r.get("fp8_decode_calls") else ""))
    print("(ms; x bf16: output tokens/s over the bf16 cache's at the same recipe, precision policy and rate; "
          "sat: over the steps with every slot busy)")


# ---------------------------------------------------------------- main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/jaxlp_bench_serving.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    ap.add_argument("--tiny", action="store_true",
                    help=f"a tiny model (hidden 64) and a small workload for CPU smoke runs; defaults {TINY_DEFAULTS}")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the Qwen3-8B shape (default 8)")
    ap.add_argument("--recipes", default="bf16",
                    help=f"comma-separated: bf16 (unquantized) or recipes of jaxlp.quantization: {', '.join(RECIPES)}")
    ap.add_argument("--implementation", default="auto", help="matmul implementation of the quantized layers")
    ap.add_argument("--kv-caches", default="bf16,kitty-pro", help=f"comma-separated: {', '.join(kvcache.formats())}")
    ap.add_argument("--rates", default=None, help="comma-separated requests/s, 'inf' for all at t=0 "
                                                  "(default 1,2,4,8,inf)")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per run (default 64)")
    ap.add_argument("--input-len", default=None, help="prompt tokens: N or MIN:MAX (default 1024)")
    ap.add_argument("--output-len", default=None, help="output tokens: N or MIN:MAX (default 256)")
    ap.add_argument("--len-jitter", type=float, default=0.0,
                    help="with N: lengths uniform in [N(1-r), N(1+r)] (0: fixed)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the inter-arrival times (1: Poisson)")
    ap.add_argument("--sampler", choices=("greedy", "temperature"), default="greedy")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0, help="workload seed; request i samples with seed + i")
    mem = ap.add_mutually_exclusive_group()
    mem.add_argument("--cache-gib", type=float, default=None,
                     help="fixed KV cache memory (GiB, all layers): the slots are what each format fits")
    mem.add_argument("--slots", type=int, default=None, help="fixed slot count (default --max-slots)")
    ap.add_argument("--max-slots", type=int, default=64, help="at most this many slots")
    ap.add_argument("--max-len", type=int, default=None,
                    help="positions per slot (default: longest prompt + longest output)")
    ap.add_argument("--steps-per-call", type=int, default=None, help="decode steps per device call (default 4)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip runs that start after this many seconds")
    ap.add_argument("--no-overlap", action="store_true",
                    help="the engine waits for each decode call's tokens before dispatching the next "
                         "(Engine(overlap=False))")
    ap.add_argument("--precision", default="none",
                    help="comma-separated NestedFP precision policies, an engine each (recipes with NestedFP layers): "
                         "none, fp16, fp8, auto (FP8 past half the slots' load), "
                         "slo:MS (FP8 while FP16's predicted step misses MS)")
    ap.add_argument("--generate-baseline", action="store_true",
                    help="also time jaxlp.generate's decode step at each engine's slot count (the engine-overhead "
                         "goal: its decode step against generate's, same batch and formats)")
    args = ap.parse_args(argv)
    defaults = dict(layers=8, num_prompts=64, input_len="1024", output_len="256", rates="1,2,4,8,inf",
                    steps_per_call=4)
    if args.tiny:
        defaults.update(TINY_DEFAULTS)
    for name, value in defaults.items():
        if getattr(args, name) is None and not (name == "slots" and args.cache_gib is not None):
            setattr(args, name, value)
    if args.slots is None and args.cache_gib is None:
        args.slots = args.max_slots

    start = time.time()
    recipes = args.recipes.split(",")
    for r in recipes:
        if r != "bf16":
            get_recipe(r)  # ValueError naming the known recipes
    precisions = args.precision.split(",")
    for q in precisions:
        parse_precision(q)
    caches = args.kv_caches.split(",")
    for c in caches:
        kvcache.get(c)
    rates = [parse_rate(s) for s in args.rates.split(",")]
    in_range = parse_len(args.input_len, args.len_jitter)
    out_range = parse_len(args.output_len, args.len_jitter)
    max_len = args.max_len or in_range[1] + out_range[1]
    config = model_config(args.layers, args.tiny)
    requests = make_requests(args.num_prompts, in_range, out_range, config.vocab_size, args.seed)
    buckets = sorted({min(prompt_bucket(len(r["prompt"])), max_len) for r in requests})
    sampler = Greedy() if args.sampler == "greedy" else Categorical(temperature=args.temperature, top_p=args.top_p)
    plot_path = args.plot or str(Path(args.out).with_suffix(".png"))
    dev = jax.devices()[0]
    shape = "tiny Qwen3 shape (hidden 64)" if args.tiny else "Qwen3-8B shape"
    result = {**harness.run_metadata(argv),
              "model": f"{shape}, {args.layers} layers, random BF16 weights (FP16 for nestedfp)",
              "workload": dict(num_prompts=args.num_prompts, input_len=list(in_range), output_len=list(out_range),
                               burstiness=args.burstiness, sampler=args.sampler, seed=args.seed, ignore_eos=True,
                               prompt_buckets=buckets),
              "max_len": max_len, "steps_per_call": args.steps_per_call, "overlap": not args.no_overlap,
              "cache_gib": args.cache_gib,
              "max_slots": args.max_slots, "fixed_slots": args.slots, "runs": []}
    runs = result["runs"]

    models = {}  # base model per dtype, built on first use

    def base_model(dtype):
        if dtype not in models:
            models[dtype] = build_model(config, dtype=dtype)
        return models[dtype]

    print(f"# prompt buckets {buckets}, max_len {max_len}", flush=True)
    for recipe in recipes:
        t0 = time.time()
        # NestedFP's FP16 mode runs its kernels on FP16 activations only (an FP16 model): on a BF16
        # model every GPU path declines it and "auto" falls back to the XLA reference.
        dtype = FP16_RECIPES.get(recipe, jnp.bfloat16)
        model_r = apply_recipe(base_model(dtype), recipe, args.implementation)
        if recipe != "bf16":
            print(f"# {recipe} applied in {time.time() - t0:.1f}s", flush=True)
        for cache, precision in [(c, q) for c in caches for q in precisions]:
            base = dict(recipe=recipe, kv_cache=cache, precision=precision, model_dtype=jnp.dtype(dtype).name)
            if precision != "none" and not has_nestedfp(model_r):
                runs.extend(dict(base, rate=rate_label(rate), skipped=f"--precision {precision}: recipe {recipe} has "
                                 "no NestedFP layers") for rate in rates)
                continue
            if time.time() - start > args.budget_s:
                runs.extend(dict(base, rate=rate_label(rate), skipped="time budget") for rate in rates)
                continue
            engine = None
            try:
                engine = make_engine(model_r, cache, args, max_len, parse_precision(precision))
                t0 = time.time()
                engine.warmup(buckets)
                warm_s = time.time() - t0
                print(f"# {recipe} / {cache}: {engine.slots} slots, {engine.cache_bytes / 2**20:.2f} MiB of cache, "
                      f"warm-up {warm_s:.1f}s", flush=True)
            except Exception as e:  # noqa: BLE001 - record and go on (e.g. out of memory)
                runs.extend(dict(base, rate=rate_label(rate), error=f"{type(e).__name__}: {str(e)[:300]}")
                            for rate in rates)
                engine = None  # free what was built
                continue
            failed = None
            for rate in rates:
                rec = dict(base, rate=rate_label(rate), slots=engine.slots, cache_bytes=engine.cache_bytes,
                           slot_bytes=engine.slot_bytes, max_len=engine.max_len, warmup_s=warm_s)
                if failed or time.time() - start > args.budget_s:
                    runs.append(dict(rec, skipped=f"an earlier run failed ({failed})" if failed else "time budget"))
                    continue
                arrivals = arrival_times(args.num_prompts, rate, args.burstiness, args.seed)
                try:
                    rec.update(run_workload(engine, requests, arrivals, sampler))
                except Exception as e:  # noqa: BLE001 - the engine may hold requests: the other rates are skipped
                    rec["error"] = failed = f"{type(e).__name__}: {str(e)[:300]}"
                runs.append(rec)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()}, flush=True)
                result["elapsed_s"] = time.time() - start
                harness.write_json(args.out, result)
            if args.generate_baseline and not failed and precision == "none":
                short, long = max(1, out_range[0] // 8), out_range[0]  # within max_len for every prompt
                ms = generate_step_ms(model_r, requests, engine.slots, cache, max_len, sampler, short, long)
                steps = [r["step_mean_ms"] for r in runs[-len(rates):] if r.get("step_mean_ms")]
                row = dict(base, rate="generate", slots=engine.slots, generate_step_ms=ms, generate_steps=[short, long])
                if steps:  # the engine's decode step (its fullest run's: the last rate) against generate's
                    row.update(engine_step_ms=steps[-1], engine_over_generate=steps[-1] / ms)
                runs.append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                harness.write_json(args.out, result)
            del engine
            gc.collect()
        del model_r
        gc.collect()

    result["elapsed_s"] = time.time() - start
    harness.write_json(args.out, result)
    measured = [r for r in runs if "output_tokens_per_s" in r]
    memory = (f"{args.cache_gib:g} GiB of KV cache (at most {args.max_slots} slots)" if args.cache_gib is not None
              else f"{args.slots} slots")
    header = (f"serving, {dev.device_kind}, {result['model']}, {memory}, prompts {in_range[0]}..{in_range[1]}, "
              f"outputs {out_range[0]}..{out_range[1]}, {args.num_prompts} requests per run")
    if measured:
        plot(plot_path, measured, header)
        result["plot"] = plot_path
        harness.write_json(args.out, result)
    print_table(runs, header)
    return result


if __name__ == "__main__":
    main()
