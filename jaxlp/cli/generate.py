"""``jaxlp generate``, ``calibrate-tau0`` and ``demo``: text from a model."""

from __future__ import annotations

import json
import time
from pathlib import Path

from jaxlp.cli.common import (UserError, check_interrupt, check_output_file, check_sampler_args, fused_model,
                              load_model, make_sampler, model_config, normalize_prompt, read_prompts_file,
                              reporter_for, write_atomically)


def cmd_generate(args) -> int:
    import numpy as np

    from jaxlp import kvcache
    from jaxlp.generation import check_generation_settings, generate, raise_nonfinite
    from jaxlp.models.tokenizer import load_tokenizer

    reporter = reporter_for(args)
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UserError("the prompt is empty")
        prompts = [normalize_prompt(args.prompt, args.prompt_newline)]
    else:
        prompts = read_prompts_file(args.prompts_file, args.prompt_newline)
    check_sampler_args(args, reporter)
    kvcache.get(args.kv_cache)
    out = check_output_file(args.out, args.overwrite) if args.out else None
    config = model_config(args.model)
    limit = check_generation_settings(config, max_new_tokens=args.max_new_tokens, seed=args.seed)
    tokenizer = load_tokenizer(args.model)
    ids = [tokenizer.encode(p).ids for p in prompts]
    longest = max(len(i) for i in ids)
    if longest + args.max_new_tokens > limit:
        raise UserError(f"prompt of {longest} tokens + max_new_tokens {args.max_new_tokens} exceeds the context "
                        f"length {limit}")
    sampler = make_sampler(args, tokenizer)
    model, tokenizer = load_model(args, reporter)
    if args.fuse_projections:
        model = fused_model(model)
    precision = args.precision
    if precision is not None:
        from jaxlp.quantization import LoadThreshold
        from jaxlp.quantization.precision import has_nestedfp

        if not has_nestedfp(model):
            raise UserError(f"--precision {precision}: {args.model} has no NestedFP layers (quantize it with "
                            "--recipe nestedfp)")
        precision = LoadThreshold() if precision == "auto" else precision

    start = time.perf_counter()
    texts, counts, finished = [], [], []
    batches = [range(i, min(i + args.batch_size, len(ids))) for i in range(0, len(ids), args.batch_size)]
    with reporter.bar(f"compiling and generating up to {args.max_new_tokens} tokens", len(ids)) as advance:
        for n, rows in enumerate(batches):
            result = generate(model, [ids[i] for i in rows], max_new_tokens=args.max_new_tokens, sampler=sampler,
                              seed=args.seed + n, kv_cache=args.kv_cache, on_nonfinite="return",
                              precision=precision)
            steps = np.full(len(ids), -1)
            steps[list(rows)] = result.nonfinite_step
            raise_nonfinite(steps)  # naming the prompt by its index among all of them
            for seq, done in zip(result.sequences(), result.finished):
                texts.append(tokenizer.decode(seq, skip_special_tokens=True))
                counts.append(len(seq))
                finished.append(bool(done))
            advance(len(rows), description=f"generating up to {args.max_new_tokens} tokens")
    seconds = time.perf_counter() - start
    check_interrupt()  # an interrupt that was swallowed on the way: nothing is written
    if out is not None:
        lines = [json.dumps(dict(prompt=p, completion=t, tokens=c, stopped=f))
                 for p, t, c, f in zip(prompts, texts, counts, finished)]
        write_atomically(out, "\n".join(lines) + "\n")
    if len(texts) == 1:
        print(texts[0], flush=True)
    else:
        for i, text in enumerate(texts):
            print(f"--- prompt {i}", flush=True)
            print(text, flush=True)
    reporter.note(f"{sum(counts)} tokens for {len(texts)} prompt{'s' if len(texts) > 1 else ''} in {seconds:.2f} s "
                  f"(compilation included){f'; written to {out}' if out else ''}")
    return 0


def _is_testbed_reasoner(model_dir) -> bool:
    log = Path(model_dir) / "training_log.json"
    try:
        return isinstance(json.loads(log.read_text()).get("spec"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def cmd_calibrate_tau0(args) -> int:
    import numpy as np

    from jaxlp.data import token_windows
    from jaxlp.errors import check_int
    from jaxlp.generation import check_generation_settings, generate, raise_nonfinite
    from jaxlp.sampling import calibrate_tau0
    from jaxlp.sampling.baselines import base_decoding

    reporter = reporter_for(args)
    check_int(None, "--num-prompts", args.num_prompts, low=1)
    config = model_config(args.model)
    check_generation_settings(config, max_new_tokens=args.max_new_tokens, seed=args.seed)
    source = args.source
    if args.prompts_file:
        source = "file"
        texts = read_prompts_file(args.prompts_file, args.prompt_newline)[: args.num_prompts]
    elif source == "auto":
        source = "testbed" if _is_testbed_reasoner(args.model) else "text"
    if source == "text":
        check_int(None, "--prompt-length", args.prompt_length, low=1,
                  high=max(1, config.max_position_embeddings - args.max_new_tokens),
                  note=f"prompt plus --max-new-tokens must fit the context length {config.max_position_embeddings}")
    model, tokenizer = load_model(args, reporter)
    if source == "file":
        prompts = [tokenizer.encode(t).ids for t in texts]
        what = f"{len(prompts)} prompts of {args.prompts_file}"
    elif source == "testbed":
        from jaxlp.testbed import train_problems
        from jaxlp.testbed.analysis import checkpoint_spec

        stream = train_problems(args.seed + 1000, checkpoint_spec(args.model))
        prompts = [tokenizer.encode(next(stream).question).ids for _ in range(args.num_prompts)]
        what = f"{len(prompts)} training-split testbed problems"
    else:
        prompts = token_windows(tokenizer, args.num_prompts, args.prompt_length).tolist()
        what = f"{len(prompts)} windows of {args.prompt_length} tokens of offline text"
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > config.max_position_embeddings:
        raise UserError(f"prompt of {longest} tokens + max_new_tokens {args.max_new_tokens} exceeds the context "
                        f"length {config.max_position_embeddings}")
    entropies = []
    with reporter.bar(f"compiling and generating {args.max_new_tokens} tokens", len(prompts)) as advance:
        for n, start in enumerate(range(0, len(prompts), args.batch_size)):
            batch = prompts[start : start + args.batch_size]
            result = generate(model, batch, max_new_tokens=args.max_new_tokens, sampler=base_decoding(),
                              seed=args.seed + n, return_stats=True, on_nonfinite="return")
            steps = np.full(len(prompts), -1)
            steps[start : start + len(batch)] = result.nonfinite_step
            raise_nonfinite(steps)
            entropies.append(result.entropy[np.isfinite(result.entropy)])
            advance(len(batch), description=f"generating {args.max_new_tokens} tokens")
    pooled = np.concatenate(entropies)
    tau0 = calibrate_tau0(pooled)
    print(f"tau0 = {tau0:.4f}  (80th percentile of {pooled.size} raw-logit token entropies, generated at T=0.6, "
          f"top-p 0.95, for {what})", flush=True)
    return 0


def cmd_demo(args) -> int:
    from jaxlp import demo

    demo.run(num_problems=args.problems, seed=args.seed, model_dir=args.model, reporter=reporter_for(args),
             check_finite=not args.no_check)
    return 0
