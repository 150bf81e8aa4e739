"""``jaxlp serve``: the OpenAI-compatible server (:mod:`jaxlp.serving.server`) on a checkpoint."""

from __future__ import annotations

from pathlib import Path

from jaxlp.cli.common import UserError, fused_model, load_model, model_config, reporter_for


def _check_bindable(host: str, port: int) -> None:
    """UserError if ``host:port`` cannot be bound (checked before the weights load)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise UserError(f"--host {host!r}: {e.strerror or e}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def cmd_serve(args) -> int:
    from jaxlp import kvcache
    from jaxlp.errors import check_int
    from jaxlp.generation import prompt_bucket

    try:
        from jaxlp.serving import server
    except ImportError as e:
        raise UserError(f"jaxlp serve needs the serve extra (pip install 'jaxlp[serve]'): {e}") from None
    from jaxlp.serving.chat import ChatTemplate

    reporter = reporter_for(args)
    kvcache.get(args.kv_cache)
    recipe = None
    if args.recipe is not None:
        from jaxlp.quantization import get_recipe
        from jaxlp.quantization.activations import STATIC

        recipe = get_recipe(args.recipe)
        if recipe.activation in STATIC:
            raise UserError(f"recipe {recipe.name!r} calibrates activation scales: quantize with jaxlp quantize "
                            "first, then serve the quantized checkpoint")
    config = model_config(args.model)
    max_len = check_int(None, "--max-len", args.max_len, low=2, high=config.max_position_embeddings, optional=True,
                        note="the model's context length is the most") or config.max_position_embeddings
    check_int(None, "--port", args.port, low=0, high=65535)
    _check_bindable(args.host, args.port)
    if args.slo_tpot_ms is not None and not args.slo_tpot_ms > 0:
        raise UserError(f"--slo-tpot-ms must be > 0, got {args.slo_tpot_ms}")
    if args.slo_tpot_ms is not None and args.precision is not None:
        raise UserError("--slo-tpot-ms and --precision are two policies: give one")
    budget = None
    if args.cache_gib is not None:
        if not args.cache_gib > 0:
            raise UserError(f"--cache-gib must be > 0, got {args.cache_gib}")
        budget = int(args.cache_gib * 2**30)
    chat_template = ChatTemplate.from_model_dir(args.model)
    model, tokenizer = load_model(args, reporter)
    if args.fuse_projections:
        model = fused_model(model)
    if recipe is not None:
        from jaxlp.quantization import quantize_model

        with reporter.status(f"quantizing to {recipe.name}"):
            model = quantize_model(model, recipe)
    engine_kwargs = dict(max_len=max_len, slots=args.slots, cache_budget_bytes=budget,
                         steps_per_call=args.steps_per_call, max_waiting=args.max_waiting,
                         precision=_precision_policy(args, model))
    buckets = sorted({min(prompt_bucket(n), max_len - 1) for n in (2**k for k in range(4, max_len.bit_length() + 1))
                      if n < max_len})
    model_id = args.model_id or Path(args.model).resolve().name
    over = f", over {args.tp} devices" if args.tp > 1 else ""
    reporter.note(f"serving {model_id} ({args.kv_cache} cache, {max_len} positions per slot{over}) on "
                  f"http://{args.host}:{args.port}/v1 ; compiling {len(buckets)} prefill buckets and the decode step")
    server.serve(model, tokenizer, model_id=model_id, kv_cache=args.kv_cache, host=args.host, port=args.port,
                 chat_template=chat_template, warmup_lengths=buckets, log_level="info" if args.debug else "warning",
                 **engine_kwargs)
    return 0


def _precision_policy(args, model):
    """The engine's NestedFP precision policy from --precision / --slo-tpot-ms (None: neither)."""
    if args.precision is None and args.slo_tpot_ms is None:
        return None
    from jaxlp.quantization import LatencyTarget, LoadThreshold
    from jaxlp.quantization.precision import has_nestedfp

    option = "--slo-tpot-ms" if args.slo_tpot_ms is not None else f"--precision {args.precision}"
    if not has_nestedfp(model):
        raise UserError(f"{option}: the model has no NestedFP layers (serve a checkpoint quantized with --recipe "
                        "nestedfp, or pass --recipe nestedfp)")
    if args.slo_tpot_ms is not None:
        return LatencyTarget(target_ms=args.slo_tpot_ms)
    return LoadThreshold() if args.precision == "auto" else args.precision
