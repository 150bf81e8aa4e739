"""All-reduce latency across the local devices: what a row-parallel layer's sum costs (issue #22).

    python scripts/bench_allreduce.py --sizes 8192,16384,65536,1048576 --dtypes bf16,f32 --out ar.json
    NCCL_PROTO=LL python scripts/bench_allreduce.py ...                     # an NCCL setting to compare
    XLA_FLAGS=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true python scripts/bench_allreduce.py ...

Tensor-parallel decode at batch 1 sums each row-parallel layer's partial products over the devices:
two all-reduces of ``hidden_size`` elements per layer (8 KB in BF16 for Qwen3-8B), as
``jax.lax.psum`` under ``shard_map`` (jaxlp's quantized layers) or XLA's own (its SPMD partitioner).
Here one jitted program runs ``steps`` dependent all-reduces of ``size`` bytes per device in a
``lax.fori_loop`` (each device's block summed over the devices, then scaled by ``1 / n``); the time
per all-reduce is the difference of two step counts over their difference (launch and host time
cancel). After the loop every device must hold the mean of the initial blocks (checked). Prints a
table (us per all-reduce, bytes / time), writes JSON with the NCCL environment variables and
XLA_FLAGS of the run, so that settings can be compared run against run on one machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxlp.evals import harness  # noqa: E402

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def chained_allreduce(mesh: Mesh, steps: int):
    """A jitted ``x [n, elems] -> x`` running ``steps`` dependent all-reduces of each device's row."""

    def local(x):
        def body(_, x):
            return jax.lax.psum(x, "tp") * jnp.asarray(1.0 / mesh.shape["tp"], x.dtype)  # the sum in x's dtype

        return jax.lax.fori_loop(0, steps, body, x)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None), check_vma=False))


def measure(mesh: Mesh, size: int, dtype, steps: tuple[int, int], repeats: int) -> dict:
    """us per all-reduce of ``size`` bytes of ``dtype`` per device (step-count differencing)."""
    n = mesh.shape["tp"]
    elems = max(1, size // jnp.dtype(dtype).itemsize)
    rows = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, elems), np.float32)  # device d's row: d
    x = jax.device_put(jnp.asarray(rows, dtype), NamedSharding(mesh, P("tp", None)))
    times = {}
    for s in steps:
        fn = chained_allreduce(mesh, s)
        out = fn(x)
        times[s] = harness.time_call(fn, x, warmup=1, repeats=repeats).median_us
    want = float(np.mean(np.arange(n)))
    got = np.asarray(out, np.float32)
    if not np.allclose(got, want, rtol=1e-2, atol=1e-2):
        raise SystemExit(f"all-reduce of {size} bytes ({jnp.dtype(dtype).name}) gave {got.min()}..{got.max()}, "
                         f"not the mean {want}")
    per = (times[steps[1]] - times[steps[0]]) / (steps[1] - steps[0])
    return dict(bytes=elems * jnp.dtype(dtype).itemsize, dtype=jnp.dtype(dtype).name, devices=n,
                us_per_allreduce=per, gb_per_s=elems * jnp.dtype(dtype).itemsize / max(per, 1e-9) / 1e3,
                call_us={str(s): t for s, t in times.items()})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=None, help="the first N local devices (default: all, >= 2)")
    ap.add_argument("--sizes", default="8192,16384,65536,1048576", help="bytes per device, comma separated")
    ap.add_argument("--dtypes", default="bf16,f32", help=f"comma separated, of {sorted(DTYPES)}")
    ap.add_argument("--steps", default="50,250", help="two step counts to difference")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    n = args.devices or jax.local_device_count()
    if not 2 <= n <= jax.local_device_count():
        ap.error(f"--devices must be 2..{jax.local_device_count()} (the local devices), got {n}")
    dtypes = args.dtypes.split(",")
    if set(dtypes) - set(DTYPES):
        ap.error(f"unknown --dtypes {sorted(set(dtypes) - set(DTYPES))}; known: {sorted(DTYPES)}")
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        steps = tuple(int(s) for s in args.steps.split(","))
    except ValueError:
        ap.error("--sizes and --steps take comma-separated integers")
    if any(s < 1 for s in sizes) or len(steps) != 2 or not 0 < steps[0] < steps[1]:
        ap.error("--sizes must be >= 1 and --steps two counts 0 < a < b")

    mesh = Mesh(np.array(jax.local_devices()[:n]), ("tp",))
    result = {**harness.run_metadata(argv), "devices": n, "device": jax.local_devices()[0].device_kind,
              "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
              "xla_flags_env": os.environ.get("XLA_FLAGS", ""), "rows": []}
    for dtype in dtypes:
        for size in sizes:
            row = measure(mesh, size, DTYPES[dtype], steps, args.repeats)
            result["rows"].append(row)
            if args.out:  # after every row: a run cut at its time limit keeps what it measured
                harness.write_json(args.out, result)
    print(f"\n## all-reduce over {n} x {result['device']} (NCCL env: {result['nccl_env'] or 'none'})")
    print(f"{'dtype':>8s} {'bytes':>9s} {'us':>8s} {'GB/s':>7s}")
    for r in result["rows"]:
        print(f"{r['dtype']:>8s} {r['bytes']:9d} {r['us_per_allreduce']:8.2f} {r['gb_per_s']:7.2f}")
    return result


if __name__ == "__main__":
    main()
