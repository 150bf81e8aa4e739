"""Quality of every quantization recipe on the real Gemma 3 270M checkpoint and offline English text.

For each recipe: perplexity on held-out text, mean KL divergence KL(reference || quantized)
per token against the unquantized model, the relative weight error ||W_q - W|| / ||W|| of
every quantized layer, and the bytes of the decoder linear weights. Prints a table, writes
JSON, a Markdown table and a plot.

    python scripts/quality_report.py --model ~/.cache/jaxlp/gemma3-270m --out docs/quality

Caveat: the checkpoint's weights were already 4-bit (GGUF Q4_K_M) before dequantization, so
the errors measured here are a lower bound of what a full-precision checkpoint would show.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

import jaxlp
from jaxlp.data import token_windows
from jaxlp.formats import QuantizedArray
from jaxlp.models.tokenizer import load_tokenizer
from jaxlp.quantization import RECIPES, quantized_layers

DEFAULT_RECIPES = ("w8a16-fp8", "w8a8-fp8", "nestedfp", "nestedfp:fp8", "w4a16-nvfp4", "w4a4-nvfp4",
                   "w4a16-mxfp4", "w4a4-mxfp4", "w4a8-fireq", "w4a16-dialect", "w4a4-dialect")


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default="docs/quality")
    parser.add_argument("--recipes", default=",".join(DEFAULT_RECIPES))
    parser.add_argument("--eval-sequences", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--calibration-sequences", type=int, default=8)
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer(args.model)
    model = jaxlp.from_pretrained(args.model, dtype=jnp.float32)
    evaluation = token_windows(tokenizer, args.eval_sequences, args.seq_len, split="evaluation")
    calibration = token_windows(tokenizer, args.calibration_sequences, args.seq_len, split="calibration")
    batches = [jnp.asarray(evaluation[i : i + 1]) for i in range(len(evaluation))]
    n_tokens = evaluation.shape[0] * (evaluation.shape[1] - 1)

    results = []
    start = time.perf_counter()
    ref_nll = sum(float(_sequence_stats(model, b, None)[0]) for b in tqdm(batches, desc="reference", leave=False))
    results.append(dict(recipe="float32 (reference)", ppl=float(np.exp(ref_nll / n_tokens)), kl=0.0,
                        bytes=linear_bytes(model), layer_errors={}))
    for spec in tqdm(args.recipes.split(","), desc="recipes"):
        name, _, mode = spec.partition(":")
        if name not in RECIPES:
            raise SystemExit(f"unknown recipe {name!r}")
        quantized = jaxlp.quantize_model(model, name, calibration=calibration)
        if mode:
            jaxlp.quantization.set_mode(quantized, mode)
        nll = kl = 0.0
        for b in tqdm(batches, desc=spec, leave=False):
            n, k = _sequence_stats(quantized, b, _reference_logprobs(model, b))
            nll, kl = nll + float(n), kl + float(k)
        errors = weight_errors(model, quantized, RECIPES[name])
        results.append(dict(recipe=spec, ppl=float(np.exp(nll / n_tokens)), kl=kl / n_tokens,
                            bytes=linear_bytes(quantized), layer_errors=errors,
                            kept=[list(k) for k in quantized.quantization.kept]))
    seconds = time.perf_counter() - start

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(model=str(args.model), eval_tokens=n_tokens, seq_len=args.seq_len,
                calibration_tokens=int(calibration.size), seconds=seconds, jax=jax.__version__,
                device=str(jax.devices()[0]))
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))

    header = "| recipe | perplexity | KL (nats/token) | linear weight bytes | bits/weight | mean layer rel. error |"
    lines = [header, "|---|---|---|---|---|---|"]
    base_bytes = results[0]["bytes"]
    for r in results:
        err = np.mean(list(r["layer_errors"].values())) if r["layer_errors"] else 0.0
        lines.append(f"| {r['recipe']} | {r['ppl']:.3f} | {r['kl']:.4f} | {r['bytes']:,} | "
                     f"{32 * r['bytes'] / base_bytes:.2f} | {err:.4f} |")
    table = "\n".join(lines)
    out.with_suffix(".md").write_text(
        f"# Quantization quality on Gemma 3 270M\n\n{n_tokens} evaluation tokens (offline text, "
        f"{args.eval_sequences} x {args.seq_len}), calibration on {calibration.size} other tokens; "
        f"reference = the float32 model. KL is KL(reference || quantized) per token.\n"
        f"Command: `python scripts/quality_report.py --model MODEL_DIR --out {args.out}`\n\n{table}\n\n"
        "Caveat: the checkpoint was Q4_K_M (4-bit) before dequantization: these errors are lower bounds.\n")
    print(table)
    _plot(results, out.with_suffix(".png"))
    return 0


def _plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r["recipe"] for r in results[1:]]
    bits = [32 * r["bytes"] / results[0]["bytes"] for r in results[1:]]
    kls = [r["kl"] for r in results[1:]]
    axes[0].scatter(bits, kls)
    for n, x, y in zip(names, bits, kls):
        axes[0].annotate(n, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes[0].set(xlabel="bits per linear weight", ylabel="KL to float32 (nats/token)", yscale="log",
                title="Gemma 3 270M: error vs size")
    for r in results[1:]:
        errs = r["layer_errors"]
        axes[1].plot(range(len(errs)), list(errs.values()), label=r["recipe"], lw=0.8)
    axes[1].set(xlabel="quantized layer (model order)", ylabel="relative weight error", yscale="log",
                title="per-layer relative weight error")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
