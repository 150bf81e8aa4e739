"""Quality of quantization recipes against the unquantized model on held-out text.

Per recipe: perplexity = exp(mean next-token NLL) on the evaluation windows, the mean
KL(reference || quantized) per token against the unquantized model, the relative weight
error ||dequant(W_q) - W|| / ||W|| of every quantized layer, and the bytes of the decoder
linear weights (bits per weight = 32 x bytes / the float32 model's bytes).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

import jaxlp
from jaxlp.data import token_windows
from jaxlp.evals.harness import pyplot
from jaxlp.formats import QuantizedArray
from jaxlp.models.tokenizer import load_tokenizer
from jaxlp.quantization import RECIPES, quantized_layers

DEFAULT_RECIPES = ("w8a16-fp8", "w8a8-fp8", "nestedfp", "nestedfp:fp8", "w4a16-nvfp4", "w4a4-nvfp4",
                   "w4a16-mxfp4", "w4a4-mxfp4", "w4a8-fireq", "w4a16-dialect", "w4a4-dialect")
REFERENCE = "float32 (reference)"


@nnx.jit
def _sequence_stats(model, ids, ref_logprobs):
    """(sum of next-token NLL, sum of KL(ref || model)) over one batch of sequences."""
    logp = jax.nn.log_softmax(model(ids)[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).sum()
    kl = jnp.sum(jnp.exp(ref_logprobs) * (ref_logprobs - logp)) if ref_logprobs is not None else 0.0
    return nll, kl


@nnx.jit
def _reference_logprobs(model, ids):
    return jax.nn.log_softmax(model(ids)[:, :-1], axis=-1)


def linear_bytes(model) -> int:
    """Bytes of the decoder linear weights (quantized or not)."""
    total = 0
    for path, module in nnx.iter_modules(model):
        name = ".".join(map(str, path))
        if ("self_attn." in name or "mlp." in name) and hasattr(module, "weight") and name.endswith("_proj"):
            w = module.weight.get_value()
            total += w.nbytes
    return total


def weight_errors(reference, quantized, recipe) -> dict[str, float]:
    """||dequant(W_q) - W|| / ||W|| per layer, W being the weight the recipe quantized (after CAS)."""
    from jaxlp.quantization import model as qm

    layers = qm.linear_layers(nnx.clone(reference), recipe)
    weights = {p: lin.weight[...].astype(jnp.float32) for p, (_, _, lin) in layers.items()}
    if recipe.cas:
        qm._apply_cas(nnx.clone(reference), weights)
    errors = {}
    for path, layer in quantized_layers(quantized):
        q: QuantizedArray = layer.weight.get_value()
        deq = (q.dequantize_fp8(jnp.float32) if layer.format == "nestedfp" and layer.mode == "fp8"
               else q.dequantize(jnp.float32)) * layer.out_scale
        w = weights[path]
        errors[path] = float(jnp.linalg.norm(deq - w) / jnp.linalg.norm(w))
    return errors


@dataclasses.dataclass(frozen=True)
class RecipeQuality:
    """One recipe (``name`` or ``name:mode``): perplexity, KL (nats/token), linear weight bytes,
    relative error per quantized layer, and the layers the recipe kept unquantized."""

    recipe: str
    ppl: float
    kl: float
    bytes: int
    layer_errors: dict[str, float]
    kept: list | None = None  # None for the reference

    def as_dict(self) -> dict:
        """The JSON record (no ``kept`` for the reference)."""
        out = dataclasses.asdict(self)
        if self.kept is None:
            del out["kept"]
        return out


def _recipe_name(spec: str) -> tuple[str, str]:
    name, _, mode = spec.partition(":")
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}")
    return name, mode


def evaluate_recipes(model, evaluation: np.ndarray, calibration: np.ndarray,
                     recipes: Sequence[str] = DEFAULT_RECIPES) -> list[RecipeQuality]:
    """The reference row (``model`` itself), then one :class:`RecipeQuality` per recipe
    (``name:mode`` sets the mode after quantizing, e.g. ``nestedfp:fp8``), on the windows
    ``evaluation [N, S]`` (one at a time), quantized with ``calibration`` windows."""
    parsed = [_recipe_name(spec) for spec in recipes]  # an unknown name fails before any work
    batches = [jnp.asarray(evaluation[i : i + 1]) for i in range(len(evaluation))]
    n_tokens = evaluation.shape[0] * (evaluation.shape[1] - 1)
    ref_nll = sum(float(_sequence_stats(model, b, None)[0]) for b in tqdm(batches, desc="reference", leave=False))
    results = [RecipeQuality(REFERENCE, float(np.exp(ref_nll / n_tokens)), 0.0, linear_bytes(model), {})]
    for spec, (name, mode) in tqdm(list(zip(recipes, parsed)), desc="recipes"):
        quantized = jaxlp.quantize_model(model, name, calibration=calibration)
        if mode:
            jaxlp.quantization.set_mode(quantized, mode)
        nll = kl = 0.0
        for b in tqdm(batches, desc=spec, leave=False):
            n, k = _sequence_stats(quantized, b, _reference_logprobs(model, b))
            nll, kl = nll + float(n), kl + float(k)
        errors = weight_errors(model, quantized, RECIPES[name])
        results.append(RecipeQuality(spec, float(np.exp(nll / n_tokens)), kl / n_tokens, linear_bytes(quantized),
                                     errors, [list(k) for k in quantized.quantization.kept]))
    return results


def quality_table(results: Sequence[RecipeQuality]) -> str:
    """Markdown table: perplexity, KL, linear weight bytes, bits/weight, mean layer relative error."""
    header = "| recipe | perplexity | KL (nats/token) | linear weight bytes | bits/weight | mean layer rel. error |"
    lines = [header, "|---|---|---|---|---|---|"]
    base_bytes = results[0].bytes
    for r in results:
        err = np.mean(list(r.layer_errors.values())) if r.layer_errors else 0.0
        lines.append(f"| {r.recipe} | {r.ppl:.3f} | {r.kl:.4f} | {r.bytes:,} | "
                     f"{32 * r.bytes / base_bytes:.2f} | {err:.4f} |")
    return "\n".join(lines)


def plot_quality(results: Sequence[RecipeQuality], path: Path) -> None:
    """KL against bits per weight per recipe, and the relative weight error per layer."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r.recipe for r in results[1:]]
    bits = [32 * r.bytes / results[0].bytes for r in results[1:]]
    kls = [r.kl for r in results[1:]]
    axes[0].scatter(bits, kls)
    for n, x, y in zip(names, bits, kls):
        axes[0].annotate(n, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes[0].set(xlabel="bits per linear weight", ylabel="KL to float32 (nats/token)", yscale="log",
                title="Gemma 3 270M: error vs size")
    for r in results[1:]:
        errs = r.layer_errors
        axes[1].plot(range(len(errs)), list(errs.values()), label=r.recipe, lw=0.8)
    axes[1].set(xlabel="quantized layer (model order)", ylabel="relative weight error", yscale="log",
                title="per-layer relative weight error")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_quality_report(model_dir: str | Path, out: str | Path, *, recipes: Sequence[str] = DEFAULT_RECIPES,
                       eval_sequences: int = 8, seq_len: int = 512,
                       calibration_sequences: int = 8) -> list[RecipeQuality]:
    """:func:`evaluate_recipes` on the checkpoint at ``model_dir`` (float32) with windows of the
    offline text's evaluation and calibration halves; write OUT.json, OUT.md and OUT.png."""
    for spec in recipes:
        _recipe_name(spec)
    tokenizer = load_tokenizer(model_dir)
    model = jaxlp.from_pretrained(model_dir, dtype=jnp.float32)
    evaluation = token_windows(tokenizer, eval_sequences, seq_len, split="evaluation")
    calibration = token_windows(tokenizer, calibration_sequences, seq_len, split="calibration")
    n_tokens = evaluation.shape[0] * (evaluation.shape[1] - 1)
    start = time.perf_counter()
    results = evaluate_recipes(model, evaluation, calibration, recipes)
    seconds = time.perf_counter() - start

    label, out = str(out), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(model=str(model_dir), eval_tokens=n_tokens, seq_len=seq_len,
                calibration_tokens=int(calibration.size), seconds=seconds, jax=jax.__version__,
                device=str(jax.devices()[0]))
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, results=[r.as_dict() for r in results]),
                                                   indent=1))
    out.with_suffix(".md").write_text(
        f"# Quantization quality on Gemma 3 270M\n\n{n_tokens} evaluation tokens (offline text, "
        f"{eval_sequences} x {seq_len}), calibration on {calibration.size} other tokens; "
        f"reference = the float32 model. KL is KL(reference || quantized) per token.\n"
        f"Command: `python scripts/quality_report.py --model MODEL_DIR --out {label}`\n\n{quality_table(results)}\n\n"
        "Caveat: the checkpoint was Q4_K_M (4-bit) before dequantization: these errors are lower bounds.\n")
    plot_quality(results, out.with_suffix(".png"))
    return results
