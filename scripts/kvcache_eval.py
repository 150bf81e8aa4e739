"""Quality and size of every KV cache on the real Gemma 3 270M checkpoint over long offline text.

Teacher-forced decoding through each cache against the same model over a BF16 cache:
perplexity, mean KL divergence and bytes per token per layer (:mod:`jaxlp.evals.kvcache`).
Prints a table and writes JSON, Markdown and a plot.

    python scripts/kvcache_eval.py --model ~/.cache/jaxlp/gemma3-270m --out docs/kvcache_gemma3_270m
"""

from __future__ import annotations

import argparse

from jaxlp.evals.kvcache import CACHES, kvcache_table, run_kvcache_eval


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default="docs/kvcache_eval")
    parser.add_argument("--caches", default=",".join(CACHES))
    parser.add_argument("--tokens", type=int, default=4097, help="total tokens (prefill + decoded + 1)")
    parser.add_argument("--prefill", type=int, default=3072)
    parser.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args(argv)
    if (args.tokens - 1 - args.prefill) % args.chunk:
        raise SystemExit("--tokens - 1 - --prefill must be a multiple of --chunk")

    def show(r):
        print(f"{r.cache:<12} ppl {r.ppl:8.3f}  KL {r.kl:.5f}  {r.bytes_per_token_per_layer:7.1f} B/token/layer",
              flush=True)

    rows = run_kvcache_eval(args.model, args.out, caches=args.caches.split(","), tokens=args.tokens,
                            prefill=args.prefill, chunk=args.chunk, on_result=show)
    print(kvcache_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
