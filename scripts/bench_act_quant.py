"""NVFP4 activation quantization (the W4A4 path's standalone CUDA quantizer) on a GPU.

For M in (1, 8) and K in the Qwen3 reduction sizes: device time per call of
``jaxlp.ffi.nvfp4.quantize_activations`` for each ``lanes`` (threads per 16-element block), next to
XLA's own one-pass kernels on the same array (``x * 2``, ``max(|x|)``) as the launch floor. Same
method as ``scripts/bench_nvfp4.py`` (16 calls per jit on distinct arrays; device time = union of
the GPU kernel intervals per call from a profiler trace). Each ``lanes`` is first checked bit for
bit against ``jaxlp.formats.nvfp4.quantize``.

    python scripts/bench_act_quant.py --out act_quant.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_nvfp4 import Jobs  # noqa: E402

from jaxlp.evals import harness  # noqa: E402
from jaxlp.ffi import nvfp4 as ffi_nvfp4  # noqa: E402
from jaxlp.formats import nvfp4  # noqa: E402

LANES = (1, 2, 4)


def check_exact(g) -> dict:
    """``{lanes: bit-identical to nvfp4.quantize}`` on rows with zero, tiny and saturated blocks."""
    out = {}
    for lanes in LANES:
        ok = True
        for m, k in ((1, 4096), (8, 25600), (3, 48)):
            x = jax.random.normal(jax.random.key(m * k), (m, k), jnp.bfloat16) * 3
            x = x.at[0, :16].set(0).at[0, 16:32].set(1e4).at[-1, 32:48].set(1e-30)
            got = ffi_nvfp4.quantize_activations(x, g, lanes=lanes)
            want = nvfp4.quantize(x.astype(jnp.float32), tensor_scale=g)
            ok &= bool((got.data == want.data).all())
            ok &= bool((got.block_scale.view(jnp.uint8) == want.block_scale.view(jnp.uint8)).all())
        out[lanes] = ok
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--ks", default="4096,12288,25600")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        sys.exit("bench_act_quant needs a GPU")
    ffi_nvfp4.load()
    g = jnp.float32(0.01)
    exact = check_exact(g)
    jobs = Jobs(args.reps)
    cases = []
    for k in map(int, args.ks.split(",")):
        for m in (1, 8):
            for lanes in LANES:
                jobs.add((m, k, f"lanes={lanes}"),
                         lambda x, _w, n=lanes: ffi_nvfp4.quantize_activations(x, g, lanes=n).data, [None] * 16, m, k)
            jobs.add((m, k, "xla x*2"), lambda x, _w: x * 2, [None] * 16, m, k)
            jobs.add((m, k, "xla max|x|"), lambda x, _w: jnp.max(jnp.abs(x)), [None] * 16, m, k)
            cases.append((m, k))
    times = jobs.run()
    cols = [f"lanes={n}" for n in LANES] + ["xla x*2", "xla max|x|"]
    rows = [{"m": m, "k": k, **{c: (None if times.get((m, k, c), (None,))[0] is None
                                    else 1e6 * times[(m, k, c)][0]) for c in cols}} for m, k in cases]
    print(f"# {jax.devices()[0].device_kind}; bit-exact: {exact}")
    print(f"{'M x K':>10s} " + " ".join(f"{c:>11s}" for c in cols) + "   (device us per call)")
    for r in rows:
        print(f"{r['m']:>3d} x {r['k']:<5d} " + " ".join(f"{np.nan if r[c] is None else r[c]:11.2f}" for c in cols))
    if args.out:
        harness.write_json(args.out, {**harness.run_metadata(argv), "exact": exact, "rows": rows})


if __name__ == "__main__":
    main()
