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


def run(num_problems: int = 8, seed: int = 0, model_dir: str | Path | None = None, quiet: bool = False) -> list[DemoRow]:
    import jax.numpy as jnp

    import jaxlp
    from jaxlp.models.tokenizer import load_tokenizer
    from jaxlp.quantization import quantize_model
    from jaxlp.sampling import ReSETConfig
    from jaxlp.testbed import ProblemSpec, eval_problems, is_correct, packed_batch

    say = (lambda *a, **k: None) if quiet else print
    model_dir = Path(model_dir or REASONER_DIR)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no reasoner checkpoint in {model_dir} (config.json missing)")
    start = time.perf_counter()
    tokenizer = load_tokenizer(model_dir)
    bf16 = jaxlp.from_pretrained(model_dir, dtype=jnp.bfloat16)
    spec = ProblemSpec()
    problems = eval_problems(seed, num_problems, spec)
    prompts = [tokenizer.encode(p.question).ids for p in problems]
    max_new = spec.max_solution_chars() + 2
    w4a4 = quantize_model(bf16, "w4a4-nvfp4", calibration=packed_batch(seed + 1, 0, 8, 512, spec)[0])
    tau0 = calibrate_reasoner_tau0(bf16, tokenizer, num_prompts=num_problems, seed=seed)  # compiles BF16
    reset = ReSETConfig.from_tokenizer(tokenizer, t_low=RESET_T_LOW, tau0=tau0)
    say(f"reasoner: {bf16.config.num_params:,} parameters ({model_dir}); {num_problems} held-out problems; "
        f"ReSET t_low={RESET_T_LOW}, tau0={tau0:.4g} (calibrated)")
    say(f"example: {problems[0].question.strip()}  (answer {problems[0].answer})")

    rows = []
    base = base_as_reset(tokenizer)
    configs = [("BF16, T=0.6 top-p 0.95", bf16, base),
               ("NVFP4 W4A4, T=0.6 top-p 0.95", w4a4, base),
               ("NVFP4 W4A4, ReSET", w4a4, reset)]
    say("compiling the NVFP4 W4A4 program ...")
    jaxlp.generate(w4a4, prompts, max_new_tokens=max_new, sampler=reset, seed=seed + 1, return_stats=True)
    say(f"{'configuration':<30} {'accuracy':>9} {'tokens':>7} {'tok/s':>8} {'weight bytes':>13}")
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
        say(f"{name:<30} {row.accuracy:>8.1%} {row.tokens:>7} {row.tokens_per_second:>8.0f} {row.weight_bytes:>13,}")
    say(f"sample ({configs[-1][0]}):\n{problems[0].question}{texts[0]}")
    say(f"total {time.perf_counter() - start:.0f} s. Full evaluation (8 seeds, all formats and samplers): "
        "scripts/eval_reasoner.py")
    return rows
