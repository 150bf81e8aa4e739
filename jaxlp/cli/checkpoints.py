"""``jaxlp info`` and ``jaxlp quantize``: describe a checkpoint, write a quantized one."""

from __future__ import annotations

from pathlib import Path

from jaxlp.cli.common import check_interrupt, fused_model, load_model, model_config, reporter_for


def _checkpoint_tensors(path: Path) -> tuple[int, int, dict[str, int]]:
    """(parameter count, bytes, bytes per dtype) read from the safetensors headers."""
    import math

    from safetensors import SafetensorError, safe_open

    from jaxlp.errors import CheckpointFormatError
    from jaxlp.models.loading import describe_safetensors_error, safetensors_files

    count, nbytes, per_dtype = 0, 0, {}
    sizes = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}
    for f in safetensors_files(path):
        try:
            with safe_open(str(f), framework="numpy") as h:
                for name in h.keys():
                    sl = h.get_slice(name)
                    n = math.prod(sl.get_shape())
                    b = n * sizes.get(sl.get_dtype(), 4)
                    count, nbytes = count + n, nbytes + b
                    per_dtype[sl.get_dtype()] = per_dtype.get(sl.get_dtype(), 0) + b
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointFormatError(describe_safetensors_error(f, e)) from None
    return count, nbytes, per_dtype


def _cache_formats(config) -> str:
    """The KV cache formats that take this model, with their bytes per token."""
    import jax

    from jaxlp import kvcache

    rows = []
    for name in kvcache.formats():
        try:
            fmt = kvcache.get(name)
            jax.eval_shape(lambda: fmt.init(config, 1, 256))
            per_token = kvcache.cache_bytes(fmt, config, 1, 4096) / 4096
        except Exception:  # noqa: BLE001  (a format that does not take this shape)
            continue
        rows.append(f"{name} ({per_token / 1024:.3g} KiB/token)")
    return ", ".join(rows) if rows else "none"


def _print_rows(rows) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _info_quantized(path: Path) -> int:
    import jax
    from flax import nnx

    from jaxlp.formats import QuantizedArray
    from jaxlp.quantization.saving import load_quantized

    model = load_quantized(path)
    leaves = jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, QuantizedArray))
    quantized = sum(x.nbytes for x in leaves if isinstance(x, QuantizedArray))
    other = sum(x.nbytes for x in leaves if not isinstance(x, QuantizedArray))
    c, report = model.config, model.quantization
    total = quantized + other
    _print_rows([
        ("architecture", f"{c.model_type}, {c.num_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}"),
        ("context length", f"{c.max_position_embeddings:,} tokens"),
        ("recipe", f"{report.recipe}: {len(report.quantized)} layers quantized, {len(report.kept)} kept"),
        ("parameters", f"{c.num_params:,}"),
        ("bytes", f"{total:,} ({quantized:,} in quantized layers, {other:,} high precision)"),
        ("bytes per parameter", f"{total / c.num_params:.3f}"),
        ("KV cache formats", _cache_formats(c)),
    ])
    return 0


def cmd_info(args) -> int:
    from jaxlp.models.loading import check_model_dir, read_config
    from jaxlp.quantization.saving import is_quantized_checkpoint

    path = check_model_dir(args.model)
    if is_quantized_checkpoint(path):
        return _info_quantized(path)
    c = read_config(path)
    count, nbytes, per_dtype = _checkpoint_tensors(path)
    _print_rows([
        ("architecture", c.model_type),
        ("layers", c.num_layers),
        ("hidden / intermediate", f"{c.hidden_size} / {c.intermediate_size}"),
        ("heads (query / kv) x head_dim", f"{c.num_heads} / {c.num_kv_heads} x {c.head_dim}"),
        ("vocabulary", c.vocab_size),
        ("context length", f"{c.max_position_embeddings:,} tokens"),
        ("sliding window", f"{c.sliding_window} on {c.layer_types.count('sliding_attention')} layers"
         if c.sliding_window else "none"),
        ("tied embeddings", c.tie_word_embeddings),
        ("recipe", "none (high precision; jaxlp quantize --recipe ...)"),
        ("parameters", f"{count:,} (config: {c.num_params:,})"),
        ("bytes on disk", f"{nbytes:,} ({', '.join(f'{k}: {v:,}' for k, v in sorted(per_dtype.items()))})"),
        ("bytes per parameter", f"{nbytes / max(count, 1):.3f}"),
        ("KV cache formats", _cache_formats(c)),
    ])
    return 0


def cmd_quantize(args) -> int:
    from jaxlp.data import token_windows
    from jaxlp.errors import check_int
    from jaxlp.quantization import get_recipe, quantize_model, save_quantized
    from jaxlp.quantization.activations import STATIC
    from jaxlp.quantization.saving import check_output_dir

    reporter = reporter_for(args)
    recipe = get_recipe(args.recipe).replace(lm_head=args.lm_head)
    out = check_output_dir(args.out, overwrite=args.overwrite, source=args.model)
    config = model_config(args.model)
    if args.lm_head and config.tie_word_embeddings:
        raise ValueError(f"--lm-head: {args.model} ties its output projection to the embeddings "
                         "(tie_word_embeddings): there is no separate lm_head to quantize")
    calibrate = recipe.activation in STATIC
    if calibrate:
        check_int(None, "--calibration-length", args.calibration_length, low=1, high=config.max_position_embeddings,
                  note="the model's context length is the most")
        check_int(None, "--calibration-sequences", args.calibration_sequences, low=1)
    model, tokenizer = load_model(args, reporter)
    calibration = None
    if calibrate:
        calibration = token_windows(tokenizer, args.calibration_sequences, args.calibration_length)
        reporter.note(f"calibrating on {calibration.shape[0]} x {calibration.shape[1]} tokens of offline text")
    if args.fuse_projections:
        model = fused_model(model)
    progress = reporter.callback({"calibrating": "calibrating activation scales (compiling first)",
                                  "quantizing": f"quantizing to {recipe.name}"})
    if calibration is not None:
        progress("calibrating", 0, len(calibration))  # the bar shows while the calibration program compiles
    try:
        quantized = quantize_model(model, recipe, calibration=calibration, progress=progress)
    finally:
        progress.close()
    with reporter.status(f"saving to {out}"):
        check_interrupt()
        save_quantized(quantized, out, tokenizer_from=args.model, overwrite=args.overwrite)
    report = quantized.quantization
    print(f"{recipe.name}: {len(report.quantized)} layers quantized, {len(report.kept)} kept high precision -> {out}",
          flush=True)
    for path, why in report.kept:
        print(f"  kept {path}: {why}", flush=True)
    return 0
