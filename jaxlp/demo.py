"""``jaxlp demo``: the embedded reasoner solves held-out arithmetic in BF16 and NVFP4 W4A4.

The package ships a small trained Qwen3 reasoner (``jaxlp/assets/reasoner``, see
``docs/testbed.md``). The demo loads it, quantizes it to NVFP4 W4A4 (static activation
scales calibrated on training-split problems), calibrates ReSET's ``tau0`` (80th percentile
of raw-logit entropies of BF16 generations on training-split problems) and solves a few
held-out problems with three configurations: BF16 at T = 0.6 / top-p 0.95, NVFP4 W4A4 with
the same sampler, and NVFP4 W4A4 with ReSET. It prints accuracy, tokens per second (of calls
whose program is already compiled) and the bytes of the weights. Runs on a CPU in 1-2 minutes,
most of it compiling the W4A4 program.

Base decoding is run as ``ReSETConfig`` with ``t_low = t_high = 0.6``: every token then gets
T = 0.6 and top-p 0.95, the same distribution as ``base_decoding()``, and all three
configurations of a model share one compiled program (temperatures and tau0 are pytree leaves).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

REASONER_DIR = Path(__file__).parent / "assets" / "reasoner"
RESET_T_LOW = 0.1  # the paper's setting for Qwen3-8B/32B


@dataclass(frozen=True)
class DemoRow:
    name: str
    accuracy: float
    correct: int
    problems: int
    tokens: int
    seconds: float
    weight_bytes: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def weight_bytes(model) -> int:
    """Bytes of every parameter array of ``model`` (quantized weights count their packed bytes and scales)."""
    import jax
    from flax import nnx

    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)) if hasattr(x, "nbytes"))


def base_as_reset(tokenizer, temperature: float = 0.6):
    """T = 0.6 / top-p 0.95 sampling written as a ReSET sampler with one temperature (same program)."""
    from jaxlp.sampling import ReSETConfig

    return ReSETConfig.from_tokenizer(tokenizer, t_low=temperature, tau0=1.0, t_high=temperature)


def calibrate_reasoner_tau0(model, tokenizer, *, num_prompts: int = 8, seed: int = 0) -> float:
    """tau0 from generations at T = 0.6, top-p 0.95 on training-split problems (raw-logit entropies)."""
    from jaxlp.generation import tau0_from_generation
    from jaxlp.testbed import ProblemSpec, train_problems

    spec = ProblemSpec()
    stream = train_problems(seed + 1000, spec)
    prompts = [tokenizer.encode(next(stream).question).ids for _ in range(num_prompts)]
    tau0, _ = tau0_from_generation(model, prompts, max_new_tokens=spec.max_solution_chars() + 2,
                                   sampler=base_as_reset(tokenizer), seed=seed)
    return tau0


def run(num_problems: int = 8, seed: int = 0, model_dir: str | Path | None = None, quiet: bool = False,
        reporter=None, check_finite: bool = True) -> list[DemoRow]:
    """Run the demo and return its rows. Results go to stdout (flushed line by line, also
    when piped); status lines and progress bars to stderr through ``reporter`` (a
    :class:`jaxlp.progress.Reporter`; default: one that is quiet when ``quiet``)."""
    import jax
    import jax.numpy as jnp

    import jaxlp
    from jaxlp.errors import check_int
    from jaxlp.models.loading import check_model_dir
    from jaxlp.models.tokenizer import load_tokenizer
    from jaxlp.progress import Reporter
    from jaxlp.quantization import quantize_model
    from jaxlp.sampling import ReSETConfig
    from jaxlp.testbed import ProblemSpec, eval_problems, is_correct, packed_batch

    check_int("demo", "num_problems", num_problems, low=1)
    reporter = reporter or Reporter(quiet=quiet)
    say = (lambda *a, **k: None) if quiet else (lambda *a, **k: print(*a, **k, flush=True))
    model_dir = check_model_dir(model_dir or REASONER_DIR)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no reasoner checkpoint in {model_dir} (config.json missing)")
    start = time.perf_counter()
    with reporter.status(f"loading the reasoner ({model_dir})"):
        tokenizer = load_tokenizer(model_dir)
        bf16 = jaxlp.from_pretrained(model_dir, dtype=jnp.bfloat16, check_finite=check_finite)
    spec = ProblemSpec()
    problems = eval_problems(seed, num_problems, spec)
    prompts = [tokenizer.encode(p.question).ids for p in problems]
    max_new = spec.max_solution_chars() + 2
    progress = reporter.callback({"calibrating": "calibrating NVFP4 activation scales (compiling first)",
                                  "quantizing": "quantizing to NVFP4 W4A4"})
    calibration = packed_batch(seed + 1, 0, 8, 512, spec)[0]
    progress("calibrating", 0, len(calibration))  # the bar shows while the calibration program compiles
    try:
        w4a4 = quantize_model(bf16, "w4a4-nvfp4", calibration=calibration, progress=progress)
    finally:
        progress.close()
    with reporter.status("calibrating ReSET's tau0 (compiling the BF16 program)"):
        tau0 = calibrate_reasoner_tau0(bf16, tokenizer, num_prompts=num_problems, seed=seed)
    reset = ReSETConfig.from_tokenizer(tokenizer, t_low=RESET_T_LOW, tau0=tau0)
    say(f"reasoner: {bf16.config.num_params:,} parameters ({model_dir}); {num_problems} held-out problems; "
        f"ReSET t_low={RESET_T_LOW}, tau0={tau0:.4g} (calibrated)")
    say(f"example: {problems[0].question.strip()}  (answer {problems[0].answer})")
    if jax.default_backend() == "cpu":
        say("note: on the CPU, NVFP4 runs jaxlp's pure-JAX reference (dequantize, then matmul), slower than BF16; "
            "the NVFP4 kernels that make it fast are GPU-only")

    rows = []
    base = base_as_reset(tokenizer)
    configs = [("BF16, T=0.6 top-p 0.95", bf16, base),
               ("NVFP4 W4A4, T=0.6 top-p 0.95", w4a4, base),
               ("NVFP4 W4A4, ReSET", w4a4, reset)]
    with reporter.status("compiling the NVFP4 W4A4 program"):
        jaxlp.generate(w4a4, prompts, max_new_tokens=max_new, sampler=reset, seed=seed + 1, return_stats=True)
    say(f"{'configuration':<30} {'accuracy':>9} {'tokens':>7} {'tok/s':>8} {'weight bytes':>13}")
    with reporter.bar(f"solving {num_problems} problems x {len(configs)} configurations",
                      num_problems * len(configs)) as advance:
        for name, model, sampler in configs:
            kwargs = dict(max_new_tokens=max_new, sampler=sampler, seed=seed, return_stats=True)
            t0 = time.perf_counter()
            result = jaxlp.generate(model, prompts, **kwargs)
            seconds = time.perf_counter() - t0
            texts = [tokenizer.decode(s) for s in result.sequences()]
            correct = sum(is_correct(t, p) for t, p in zip(texts, problems))
            row = DemoRow(name, correct / len(problems), correct, len(problems), int(result.num_tokens.sum()), seconds,
                          weight_bytes(model))
            rows.append(row)
            advance(num_problems)
            say(f"{name:<30} {row.accuracy:>8.1%} {row.tokens:>7} {row.tokens_per_second:>8.0f} "
                f"{row.weight_bytes:>13,}")
    say(f"sample ({configs[-1][0]}):\n{problems[0].question}{texts[0]}")
    say(f"total {time.perf_counter() - start:.0f} s. Full evaluation (8 seeds, all formats and samplers): "
        "scripts/eval_reasoner.py")
    return rows
