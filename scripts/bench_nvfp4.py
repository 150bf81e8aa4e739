"""Benchmark the NVFP4 matmul kernels against XLA on the paper's Qwen3 projection shapes.

For each shape [N, K] and M tokens: XLA BF16 dot, XLA dequantize-then-dot (W4A16, and W4A4 from
M = 16), and the CUDA kernels in W4A16: the "regs", "pipe" and "pipe16" GEMVs (every
configuration at M in SWEEP_MS, each family's winner of the nearest swept M at the other M <= 32)
and the "gemm" kernel (every configuration, M >= 16); then W4A4 with each family's best W4A16
configuration. With --probe, also the loads-only diagnostics of "regs" and "pipe16" at M = 1 (the
same weight traffic without decode or MMA: the memory structure's own ceiling).
The dispatched time per mode is the fastest of all of them; the dispatch table records its
choice per M. Also: the device's copy bandwidth and BF16 matmul rate measured in the same run,
the standalone activation quantizer, and a correctness spot check of every family per shape.

Timing (see :class:`Jobs`): each measured function makes one call per weight buffer inside one
jit, every call on its own activations and its own weights (B buffers together > 4x the 50 MB
L2, so weights come from HBM, and XLA can neither merge nor reuse the products). Reported:
device time per call from a profiler trace (the union of the call's GPU kernel intervals:
back-to-back execution as under CUDA-graph replay, host overhead excluded), and the wall time
per call of ``reps`` back-to-back dispatches (host-bound for small layers) as ``*_wall_us``.

    python scripts/bench_nvfp4.py --out docs/bench_nvfp4.json --table jaxlp/ffi/nvfp4_dispatch.json
    python scripts/bench_nvfp4.py --shapes 1,2 --table jaxlp/ffi/nvfp4_dispatch.json --merge  # add shapes
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxlp.evals import harness  # noqa: E402
from jaxlp.ffi import nvfp4 as ffi_nvfp4  # noqa: E402
from jaxlp.formats import nvfp4  # noqa: E402
from jaxlp.quantization import nvfp4_dispatch as dispatch  # noqa: E402


def qwen3_shapes() -> list[tuple[str, int, int]]:
    """(name, N, K) of qkv (fused), o, gate/up (one of the two), down for Qwen3-8B/14B/32B, then gate_up fused."""
    configs = {  # hidden, intermediate, heads, kv heads, head_dim (public HF configs)
        "Qwen3-8B": (4096, 12288, 32, 8, 128),
        "Qwen3-14B": (5120, 17408, 40, 8, 128),
        "Qwen3-32B": (5120, 25600, 64, 8, 128),
    }
    out = []
    for name, (h, inter, nh, nkv, d) in configs.items():
        out += [
            (f"{name} qkv", (nh + 2 * nkv) * d, h),
            (f"{name} o", h, nh * d),
            (f"{name} gate_up", inter, h),
            (f"{name} down", h, inter),
        ]
    # Appended (indices 12-14), so that the indices above stay: gate and up as one linear
    # (jaxlp.models.fuse_projections), as the decode runs them with --fused.
    out += [(f"{name} gate_up fused", 2 * inter, h) for name, (h, inter, *_) in configs.items()]
    return out


MS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
C = ffi_nvfp4.GemvConfig
REGS = [C(1, 8), C(2, 8), C(2, 4)]  # the first GEMV (FP16 tensor cores, staging kernel)
PIPE = [C(1, kernel="pipe"), C(1, kernel="pipe", split=2), C(1, kernel="pipe", split=4),
        C(2, kernel="pipe"), C(2, kernel="pipe", split=2)]  # the cp.async GEMV (BF16, no staging for W4A16)
PIPE16 = [C(1, kernel="pipe16"), C(1, kernel="pipe16", split=2), C(2, kernel="pipe16"),
          C(2, kernel="pipe16", split=2)]  # pipe's ring with regs' FP16 decode (staging kernel)
# The M <= 8 variants (session 4): more warps per SM (regs B3: 80 registers, 3 CTAs; pipe16 S2: a
# 2-stage ring, 4 CTAs at R = 1) and two MMA accumulator chains per item (A2).
REGS += [C(1, 8, blocks_per_sm=3), C(1, 4, blocks_per_sm=3), C(1, 8, accumulators=2),
         C(1, 8, blocks_per_sm=3, accumulators=2), C(2, 8, accumulators=2)]
PIPE16 += [C(1, kernel="pipe16", stages=2), C(1, kernel="pipe16", split=2, stages=2),
           C(1, kernel="pipe16", stages=2, accumulators=2), C(1, kernel="pipe16", accumulators=2),
           C(2, kernel="pipe16", stages=2)]
PROBES = {"regs": [C(1, 8), C(2, 4)],
          "pipe16": [C(1, kernel="pipe16"), C(2, kernel="pipe16"), C(1, kernel="pipe16", stages=2)]}
GEMM = [C(kernel="gemm", block_n=64, block_m=64), C(kernel="gemm", block_n=64, block_m=64, split=2),
        C(kernel="gemm", block_n=64, block_m=64, split=4), C(kernel="gemm", block_n=128, block_m=64, split=2),
        C(kernel="gemm", block_n=128, block_m=128)]
FAMILIES = {"regs": REGS, "pipe": PIPE, "pipe16": PIPE16, "gemm": GEMM}
SWEEP_MS = (1, 8, 16, 32)  # every GEMV configuration is timed at these M
GEMM_MIN_M = 16
L2_BYTES = 50e6


def _name(cfg):
    return cfg.name


def nvfp4_bytes(n, k):
    return n * k // 2 + n * k // 16 + 4


def timeit(fn, args, *, calls, reps, trials) -> float:
    """Wall seconds per call: ``fn(*args)`` performs ``calls`` calls; dispatched ``reps`` times per trial
    (after one warm-up call), the median over ``trials``."""
    return harness.time_call(fn, *args, warmup=1, repeats=trials, number=reps).median_us * 1e-6 / calls


def copy_bandwidth(nbytes=1 << 30) -> dict:
    """Device memory bandwidth: an elementwise op over nbytes (read + write) and a full read."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    scale = jax.jit(lambda x: x * 1.0001)
    total = jax.jit(lambda x: jnp.sum(x))
    t_copy = timeit(scale, (x,), calls=1, reps=10, trials=5)
    t_read = timeit(total, (x,), calls=1, reps=10, trials=5)
    del x
    return {"copy_TBps": 2 * nbytes / t_copy / 1e12, "read_TBps": nbytes / t_read / 1e12, "bytes": nbytes}


def bf16_peak() -> float:
    a = jnp.ones((8192, 8192), jnp.bfloat16) * 0.01
    mm = jax.jit(lambda a, b: a @ b)
    t = timeit(mm, (a, a), calls=1, reps=10, trials=3)
    return 2 * 8192**3 / t / 1e12


class Shape:
    """Weight buffers of one [N, K] shape (NVFP4 and BF16): one per call, together > 4x L2."""

    def __init__(self, n, k, seed, target_bytes):
        self.n, self.k = n, k
        key = jax.random.key(seed)
        nb = max(4, min(24, math.ceil(target_bytes / nvfp4_bytes(n, k))))
        bb = max(2, min(24, math.ceil(target_bytes / (2 * n * k))))
        quant = jax.jit(lambda kk: nvfp4.quantize(jax.random.normal(kk, (n, k), jnp.float32) * 0.02))
        self.q = [quant(jax.random.fold_in(key, i)) for i in range(nb)]
        self.w = [jax.random.normal(jax.random.fold_in(key, 100 + i), (n, k), jnp.bfloat16) * 0.02 for i in range(bb)]
        jax.block_until_ready((self.q, self.w))

    def free(self):
        del self.q, self.w


class Jobs:
    """Timed functions of one phase: compiled and wall-timed when added, then device-timed together.

    Each job calls ``fn_one(x_i, w_i)`` once per weight buffer, every call with its own activation
    array and its own weights, so XLA can neither merge the dots (a shared operand) nor reuse a
    result. Device time: one profiler trace of all jobs (``reps`` executions each, separated by
    idle gaps); a job's time per call is the union of its GPU kernel intervals (launch gaps and
    host overhead excluded, overlapping kernels counted once) over ``reps * calls``.
    """

    GAP_S = 0.03

    def __init__(self, reps: int):
        self.reps, self.jobs = reps, []

    def add(self, key, fn_one, weights, m, k, dtype=jnp.bfloat16):
        xs = [jax.random.normal(jax.random.key(1000 + i), (m, k), dtype) for i in range(len(weights))]

        @jax.jit
        def many(xs, ws):
            return tuple(fn_one(x, w) for x, w in zip(xs, ws))

        try:
            wall = timeit(many, (xs, weights), calls=len(weights), reps=self.reps, trials=1)
        except Exception as e:  # noqa: BLE001 - a failing kernel is reported, the sweep goes on
            print(f"!! job {key} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return
        self.jobs.append(dict(key=key, fn=many, args=(xs, weights), calls=len(weights), wall_s=wall))

    def run(self) -> dict:
        """``{key: (device_s_per_call or None, wall_s_per_call)}``."""
        device = [None] * len(self.jobs)
        try:
            d = tempfile.mkdtemp(prefix="nvfp4_trace_")
            jax.profiler.start_trace(d)
            for job in self.jobs:
                out = None
                for _ in range(self.reps):
                    out = job["fn"](*job["args"])
                jax.block_until_ready(out)
                time.sleep(self.GAP_S)
            jax.profiler.stop_trace()
            clusters = gpu_clusters(d, gap_ns=self.GAP_S * 0.5e9)
            shutil.rmtree(d, ignore_errors=True)
            if len(clusters) == len(self.jobs):
                device = [busy_ns(c) * 1e-9 / (self.reps * job["calls"]) for c, job in zip(clusters, self.jobs)]
            else:
                print(f"# profiler: {len(clusters)} GPU activity clusters for {len(self.jobs)} jobs; wall times only",
                      flush=True)
        except Exception as e:  # noqa: BLE001 - fall back to wall times
            print(f"# profiler failed ({type(e).__name__}: {e}); wall times only", flush=True)
        out = {job["key"]: (dev, job["wall_s"]) for job, dev in zip(self.jobs, device)}
        self.jobs = []
        return out


def gpu_clusters(trace_dir, gap_ns) -> list[list[tuple[int, int]]]:
    """GPU kernel/memcpy intervals of a trace, sorted, split where the GPU idled longer than gap_ns."""
    from jax.profiler import ProfileData

    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    lines = []
    for f in files:
        for plane in ProfileData.from_file(f).planes:
            if plane.name.startswith("/device:GPU"):
                lines += [(line.name, [(int(e.start_ns), int(e.start_ns + e.duration_ns)) for e in line.events])
                          for line in plane.lines]
    # Kernel activity sits on the "Stream #..." lines; derived lines (XLA ops/modules) repeat it.
    streams = [iv for name, iv in lines if "stream" in name.lower()]
    if not streams:
        derived = ("xla", "step", "launch", "source", "framework")
        streams = [iv for name, iv in lines if not any(d in name.lower() for d in derived)]
    intervals = sorted(iv for line in streams for iv in line)
    clusters, cur, end = [], [], None
    for a, b in intervals:
        if cur and a - end > gap_ns:
            clusters.append(cur)
            cur = []
        cur.append((a, b))
        end = b if end is None or not cur[:-1] else max(end, b)
    if cur:
        clusters.append(cur)
    return clusters


def busy_ns(intervals) -> int:
    total, cur_a, cur_b = 0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/bench_nvfp4.json")
    ap.add_argument("--table", default=None, help="write the dispatch table here")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default="all", help="comma-separated indices into the shape list, or 'all'")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new shapes after this many seconds")
    ap.add_argument("--custom-shapes", default=None, help="'N:K,N:K' instead of the Qwen3 shapes")
    ap.add_argument("--kernels", default="regs,pipe,pipe16,gemm", help="kernel families to time")
    ap.add_argument("--probe", action="store_true", help="also time the loads-only probes at M = 1")
    ap.add_argument("--configs", default=None,
                    help="comma-separated configuration names (GemvConfig.name): time only these (and probes, "
                         "spot checks) of the GEMV families; the gemm family is not restricted")
    ap.add_argument("--no-act-quant", action="store_true", help="skip the standalone activation quantizer")
    ap.add_argument("--merge", action="store_true",
                    help="keep the --table file's other shapes (measured on the same device)")
    ap.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # smoke tests of this script
    args = ap.parse_args(argv)

    start = time.time()
    if args.configs:
        keep = set(args.configs.split(","))
        for name in keep:
            C.from_name(name)  # a typo fails here, not silently
        for fam in ("regs", "pipe", "pipe16"):
            FAMILIES[fam][:] = [c for c in FAMILIES[fam] if c.name in keep]
            if fam in PROBES:
                PROBES[fam][:] = [c for c in PROBES[fam] if c.name in keep]
    dev = jax.devices()[0]
    if dev.platform != "gpu" and not args.allow_cpu:
        sys.exit("bench_nvfp4 needs a GPU")
    if dev.platform == "gpu":
        ffi_nvfp4.load()
    ms = [int(v) for v in args.ms.split(",")]
    shapes = qwen3_shapes()
    if args.custom_shapes:
        shapes = [(f"{nk}", *map(int, nk.split(":"))) for nk in args.custom_shapes.split(",")]
    elif args.shapes != "all":
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]

    result = {
        **harness.run_metadata(argv),
        "method": "one call per weight buffer (> 4x L2) per jit, distinct activations; device time = union of "
                  "GPU kernel intervals per call from a profiler trace; wall = back-to-back dispatches",
    }
    bw = copy_bandwidth()
    result["bandwidth"] = bw
    result["bf16_matmul_TFLOPs"] = bf16_peak()
    copy_bps = bw["copy_TBps"] * 1e12
    print(f"# {dev.device_kind}: copy {bw['copy_TBps']:.2f} TB/s, read {bw['read_TBps']:.2f} TB/s, "
          f"BF16 matmul {result['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)

    # Standalone activation quantization, one launch per call.
    jobs = Jobs(args.reps)
    g_act = jnp.float32(0.01)
    for k in sorted({k for _, _, k in qwen3_shapes()}) if dev.platform == "gpu" and not args.no_act_quant else ():
        for m in (1, 8):
            jobs.add(f"{m}x{k}", lambda x, _w: ffi_nvfp4.quantize_activations(x, g_act).data, [None] * 16, m, k)
    aq = {key: {"device_us": _us(t[0]), "wall_us": _us(t[1])} for key, t in jobs.run().items()}
    result["act_quant"] = aq
    print("# activation quantization, device us (wall us): " + ", ".join(
        f"{key}: {v['device_us'] or float('nan'):.2f} ({v['wall_us']:.2f})" for key, v in aq.items()), flush=True)

    rows, table_shapes = [], []
    for si, (name, n, k) in enumerate(shapes):
        if time.time() - start > args.budget_s:
            print(f"# budget reached, skipping {name} and later", flush=True)
            break
        t_shape = time.time()
        sh = Shape(n, k, si, target_bytes=4 * L2_BYTES)
        g_x = jnp.float32(0.004)
        checks = []
        variants = [c for c in REGS + PIPE16 if c.is_small_m_variant]
        if args.configs:  # the named configurations only
            base = ([c for c in REGS + PIPE + PIPE16 if not c.is_small_m_variant],) * 2
        else:
            base = ([REGS[0], PIPE[0], PIPE16[0]], [REGS[1], PIPE[3], PIPE16[3]])
        for m, cfgs in ((1, base[0] + variants), (8, base[1] + variants), (64, [GEMM[0], GEMM[2]])):
            if m not in ms or dev.platform != "gpu":
                continue
            x = jax.random.normal(jax.random.key(7), (m, k), jnp.bfloat16)
            for gx in (None, g_x):
                ref = jax.jit(dispatch.dequantize_dot)(x.astype(jnp.float32), sh.q[0], gx)
                for cfg in cfgs:
                    if cfg.unsupported(m, k, x.dtype, gx is not None):
                        continue
                    y = ffi_nvfp4.nvfp4_gemv(x, sh.q[0], act_tensor_scale=gx, config=cfg)
                    checks.append({"m": m, "mode": "w4a4" if gx is not None else "w4a16", "config": cfg.name,
                                   "rel_err_vs_xla": harness.relative_error(y.astype(jnp.float32), ref)})
                    if checks[-1]["rel_err_vs_xla"] > 4e-3:
                        print(f"!! {name} M={m} {cfg.name} {checks[-1]['mode']} rel err "
                              f"{checks[-1]['rel_err_vs_xla']:.2e}", flush=True)

        # Phase 1: XLA paths and every kernel configuration (W4A16).
        jobs = Jobs(args.reps)

        def families(m):
            fams = []
            if m <= ffi_nvfp4.MAX_M:
                fams += ["regs", "pipe", "pipe16"]
            if m >= GEMM_MIN_M:
                fams.append("gemm")
            return [f for f in fams if f in args.kernels.split(",")]

        for m in ms:
            jobs.add(("bf16", m), lambda x, w: x @ w.T, sh.w, m, k)
            jobs.add(("xla_dq_w4a16", m), lambda x, q: dispatch.dequantize_dot(x, q), sh.q, m, k)
            if m >= 16:  # below, the XLA W4A4 path (quantize + decode + dot) never wins: not timed
                jobs.add(("xla_dq_w4a4", m), lambda x, q: dispatch.dequantize_dot(x, q, g_x, act_quantizer="cuda"),
                         sh.q, m, k)
            for fam in families(m):
                if fam == "gemm" or m in SWEEP_MS:
                    for cfg in FAMILIES[fam]:
                        if cfg.unsupported(m, k, jnp.bfloat16, False):  # the M <= 8 variants above 8
                            continue
                        jobs.add(("w4a16", m, cfg.name),
                                 lambda x, q, cfg=cfg: ffi_nvfp4.nvfp4_gemv(x, q, config=cfg), sh.q, m, k)
            if args.probe and m == 1:
                for fam in [f for f in PROBES if f in args.kernels.split(",")]:
                    for cfg in PROBES[fam]:
                        if not cfg.unsupported(m, k, jnp.bfloat16, False):
                            jobs.add(("probe", m, cfg.name), lambda x, q, cfg=cfg: ffi_nvfp4.gemv_call(
                                x, q.data, jax.lax.bitcast_convert_type(q.block_scale, jnp.uint8), q.tensor_scale,
                                config=cfg, probe=True)[0], sh.q, m, k)
        t1 = jobs.run()
        # Phase 2: W4A16 at the other M <= 32 with each family's winner at the nearest swept M;
        # W4A4 with each family's best W4A16 configuration at that M.
        swept = [m for m in ms if m in SWEEP_MS]

        def best_of(timings, m, fam):
            cands = {key[2]: _pick(t) for key, t in timings.items()
                     if key[:2] == ("w4a16", m) and C.from_name(key[2]).kernel == fam}
            return min(cands, key=cands.get) if cands else None

        for m in ms:
            if m <= ffi_nvfp4.MAX_M and m not in SWEEP_MS and swept:
                near = min(swept, key=lambda v: abs(math.log(v / m)))
                for fam in families(m):
                    c = best_of(t1, near, fam)
                    if c and fam != "gemm":
                        jobs.add(("w4a16", m, c), lambda x, q, cfg=C.from_name(c): ffi_nvfp4.nvfp4_gemv(
                            x, q, config=cfg), sh.q, m, k)
        t2 = jobs.run()
        timings = {**t1, **t2}
        for m in ms:
            for fam in families(m):
                c = best_of(timings, m, fam)
                if c:
                    jobs.add(("w4a4", m, c), lambda x, q, cfg=C.from_name(c): ffi_nvfp4.nvfp4_gemv(
                        x, q, act_tensor_scale=g_x, config=cfg), sh.q, m, k)
        timings.update(jobs.run())

        entry = {"n": n, "k": k, "name": name, "w4a16": [], "w4a4": []}
        for m in ms:
            rec = {"shape": name, "n": n, "k": k, "m": m}
            for key, t in timings.items():
                if key[1] != m:
                    continue
                label = "_".join([key[0]] + list(key[2:]))
                rec[f"{label}_us"] = _us(_pick(t))
                rec[f"{label}_wall_us"] = _us(t[1])
            rec.setdefault("xla_dq_w4a4_us", math.inf)
            probes = {key[2]: _pick(t) for key, t in timings.items() if key[:2] == ("probe", m)}
            for fam in PROBES:
                fp = {c: v for c, v in probes.items() if C.from_name(c).kernel == fam}
                if fp:
                    c = min(fp, key=fp.get)
                    rec[f"probe_{fam}_us"], rec[f"probe_{fam}_config"] = _us(fp[c]), c
            for mode in ("w4a16", "w4a4"):
                kern = {key[2]: _pick(t) for key, t in timings.items() if key[:2] == (mode, m)}
                for fam in FAMILIES:
                    fk = {c: v for c, v in kern.items() if C.from_name(c).kernel == fam}
                    if fk:
                        c = min(fk, key=fk.get)
                        rec[f"{fam}_{mode}_us"], rec[f"{fam}_{mode}_config"] = _us(fk[c]), c
                dq = rec[f"xla_dq_{mode}_us"]
                best = min(kern, key=kern.get) if kern else None
                if best is not None and _us(kern[best]) < dq:
                    rec[f"ours_{mode}_us"], rec[f"ours_{mode}_path"] = _us(kern[best]), best
                    entry[mode].append([m, dispatch.config_choice(C.from_name(best))])
                else:
                    rec[f"ours_{mode}_us"], rec[f"ours_{mode}_path"] = dq, "xla"
                    entry[mode].append([m, dispatch.XLA])
            nbytes = nvfp4_bytes(n, k) + 2 * m * k + 2 * m * n
            rec["nvfp4_bytes"] = nbytes
            rec["floor_us"] = 1e6 * max(nbytes / copy_bps, 2 * m * n * k / (result["bf16_matmul_TFLOPs"] * 1e12))
            rec["TBps"] = nbytes / (rec["ours_w4a16_us"] * 1e-6) / 1e12
            rec["pct_copy"] = 100 * rec["TBps"] / bw["copy_TBps"]
            rec["speedup_w4a16_vs_bf16"] = rec["bf16_us"] / rec["ours_w4a16_us"]
            rec["speedup_w4a4_vs_bf16"] = rec["bf16_us"] / rec["ours_w4a4_us"]
            rows.append(rec)
            print(f"{name:18s} M={m:4d} bf16 {rec['bf16_us']:8.2f}  dq {rec['xla_dq_w4a16_us']:8.2f}  "
                  + "  ".join(f"{f} {rec[f + '_w4a16_us']:7.2f} ({rec[f + '_w4a16_config']})"
                              for f in FAMILIES if f + "_w4a16_us" in rec)
                  + f"  ours-a16 {rec['ours_w4a16_us']:8.2f} ({rec['ours_w4a16_path']})  "
                  f"ours-a4 {rec['ours_w4a4_us']:8.2f} ({rec['ours_w4a4_path']})  x{rec['speedup_w4a16_vs_bf16']:.2f}  "
                  f"{rec['TBps']:.2f} TB/s {rec['pct_copy']:.0f}%  floor {rec['floor_us']:.2f}", flush=True)
        table_shapes.append(entry)
        result.setdefault("checks", []).append({"shape": name, "checks": checks})
        sh.free()
        print(f"# {name}: {time.time() - t_shape:.0f}s", flush=True)
        result["rows"] = rows
        result["elapsed_s"] = time.time() - start
        harness.write_json(args.out, result)
        if args.table:
            write_table(args.table, dev.device_kind, result["date"], table_shapes, args.merge)

    summary(result)
    return result


def write_table(path, device_kind, date, shapes, merge):
    """Write the dispatch table: this device's entry holds ``shapes``; with ``merge``, also the
    file's other shapes of this device and every other device's entry (see nvfp4_dispatch)."""
    table = {"note": "", "default": dispatch.DEFAULT_RULE, "devices": {}}
    kept = []
    if merge and Path(path).is_file():
        table = dispatch.split_by_device(json.loads(Path(path).read_text()))
        done = {(e["n"], e["k"]) for e in shapes}
        old = table["devices"].get(device_kind, {})
        kept = [e for e in old.get("shapes", []) if (e["n"], e["k"]) not in done]
    base = ("Measured by scripts/bench_nvfp4.py, per GPU model (device_kind): per shape and mode, "
            "[M, choice] pairs; the first M >= the call's M decides (device kernel time). A GPU not "
            "listed uses 'fallback'.")
    if not str(table.get("note", "")).startswith(base):  # a merge keeps the provenance added to the note
        table["note"] = base
    table["devices"][device_kind] = {"date": date, "shapes": kept + shapes}
    table.setdefault("fallback", device_kind)
    Path(path).write_text(json.dumps(table))


def _pick(t):
    """Device time when the profiler gave one, else wall time (seconds)."""
    dev, wall = t
    return dev if dev is not None else wall


def _us(t):
    return None if t is None else 1e6 * t


def summary(result):
    rows = [r for r in result.get("rows", []) if "bf16_us" in r]
    print(f"\n## {result['device']}  copy {result['bandwidth']['copy_TBps']:.2f} TB/s  ({result['date']})")
    print(f"{'shape':18s} {'M':>3s} {'bf16':>7s} {'xla-dq':>7s} {'regs':>7s} {'pipe':>7s} {'pipe16':>7s} {'gemm':>7s} "
          f"{'a16':>7s} {'a4':>7s} {'x16':>5s} {'x4':>5s} {'%cp':>4s} {'floor':>6s} {'prb-r':>6s} {'prb-16':>6s} path")
    f = lambda v, w=7: f"{v:{w}.2f}" if v is not None else " " * (w - 1) + "-"  # noqa: E731
    for r in rows:
        if r["m"] not in (1, 8, 16, 32, 128, 512):
            continue
        print(f"{r['shape']:18s} {r['m']:3d} {f(r['bf16_us'])} {f(r['xla_dq_w4a16_us'])} {f(r.get('regs_w4a16_us'))} "
              f"{f(r.get('pipe_w4a16_us'))} {f(r.get('pipe16_w4a16_us'))} {f(r.get('gemm_w4a16_us'))} "
              f"{f(r['ours_w4a16_us'])} {f(r['ours_w4a4_us'])} "
              f"{r['speedup_w4a16_vs_bf16']:5.2f} {r['speedup_w4a4_vs_bf16']:5.2f} {r['pct_copy']:4.0f} "
              f"{r['floor_us']:6.2f} {f(r.get('probe_regs_us'), 6)} {f(r.get('probe_pipe16_us'), 6)} "
              f"{r['ours_w4a16_path']}")


if __name__ == "__main__":
    main()
