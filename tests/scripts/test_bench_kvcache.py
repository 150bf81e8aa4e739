"""scripts/bench_kvcache.py: XLA options from the command line, the donated loop timer with its
per-kernel profile, and the decode part's profile (CPU: the profile holds no GPU kernels, but its
fields are there)."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_script
from jaxlp import kvcache


@pytest.fixture(scope="module")
def bk():
    return load_script("bench_kvcache")


def test_compiler_options_parse_bools_ints_and_strings(bk):
    parsed = bk.compiler_options("xla_gpu_enable_command_buffer=FUSION,CONDITIONAL;a=true;b=False;c=-3;;d=x=y")
    assert parsed == {"xla_gpu_enable_command_buffer": "FUSION,CONDITIONAL", "a": True, "b": False, "c": -3,
                      "d": "x=y"}
    assert bk.compiler_options("") == {}


def test_kernel_options_go_to_the_quantized_formats_only(bk):
    """--kernel-options: the quantized caches' CUDA kernel keywords (parsed as the XLA options are);
    BF16 has no such kernel and is left as it is."""
    args = types.SimpleNamespace(kernel_options=bk.compiler_options("query_merge_splits=8"))
    assert bk.cache_format("kivi-k2v2*", args).kernel_options == (("query_merge_splits", 8),)
    assert bk.cache_format("kitty-pro", args, attention="interpret").attention == "interpret"
    assert bk.cache_format("bf16", args) == kvcache.get("bf16")
    assert bk.cache_format("kitty-pro", types.SimpleNamespace(kernel_options={})) == kvcache.get("kitty-pro")


def test_loop_us_times_the_donated_loop_and_fills_the_profile(bk):
    args = types.SimpleNamespace(n1=1, n2=3, repeats=1, compiler_options={})
    profile = {}
    us = bk.loop_us(lambda i, c: c * 1.5 + 1.0, jnp.zeros((64,), jnp.float32), args, profile)
    assert isinstance(us, float)
    assert set(profile) == {"gpu_us_per_token", "launches_per_token", "by_kind_us", "top_kernels_us"}
    assert profile["gpu_us_per_token"] == 0.0  # no GPU here: no GPU kernels in the traces


def test_loop_us_lengthens_the_long_loop_until_the_difference_is_measurable(bk, monkeypatch):
    """A step far below the host's jitter: the long loop grows (to MAX_STEPS at most) and the
    result is the per-step time of the loop that was measured."""
    lengths = []
    clock = iter(float(t) for t in range(10**6))
    monkeypatch.setattr(bk.time, "perf_counter", lambda: next(clock) * 1e-3)  # every call: +1 ms
    monkeypatch.setattr(bk.jax, "block_until_ready", lambda x: x)
    args = types.SimpleNamespace(n1=2, n2=4, repeats=1, compiler_options={})

    def body(i, c):
        return c + 1.0

    real_jit = bk.jax.jit

    def spy_jit(fn, **kw):
        compiled = real_jit(fn, **kw)

        def run(c, n):
            lengths.append(n)
            return compiled(c, n)
        return run

    monkeypatch.setattr(bk.jax, "jit", spy_jit)
    us = bk.loop_us(body, jnp.zeros((4,), jnp.float32), args)
    # The fake clock makes every call take 1 ms: difference 0 < MIN_DIFFERENCE_S, so n2 grows.
    assert max(lengths) > args.n2 and max(lengths) <= bk.MAX_STEPS
    assert us == pytest.approx(0.0, abs=1e-9)


def test_decode_part_with_profile_writes_the_kernel_split_per_row(bk, tmp_path):
    """``--parts decode --profile`` on a tiny model: each decode row carries its step profile."""
    out = tmp_path / "decode.json"
    bk.main(["--tiny", "--parts", "decode", "--formats", "bf16,kitty-pro", "--layers", "1", "--decode-contexts", "256",
             "--decode-batches", "2", "--n1", "1", "--n2", "2", "--repeats", "1", "--profile", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows] == ["bf16", "kitty-pro"]
    for r in rows:
        assert r["part"] == "decode" and r["ms_per_token"] == r["ms_per_token"]  # a number, not NaN
        assert set(r["step_profile"]) == {"gpu_us_per_token", "launches_per_token", "by_kind_us", "top_kernels_us"}


def test_rotation_copies_read_past_the_cache_and_stay_bounded(bk):
    assert bk.rotation_copies(33.5e6, 256 * 2**20) == 9  # BF16, 1 x 8K, Qwen3-8B heads: 8.0 copies -> 9
    assert bk.rotation_copies(2e9, 256 * 2**20) == 1  # already far past the L2 cache
    assert bk.rotation_copies(1e3, 256 * 2**20) == 64  # tiny layers: capped
    assert bk.rotation_copies(1e6, 0) == 1  # --rotate-mb 0: one copy


def test_attention_part_steps_each_copy_and_reports_per_layer(bk, tmp_path, monkeypatch):
    """``--parts attention`` on a tiny config with two copies per point: rows carry the copy
    count and per-layer times (numbers, not NaN), the quantized rows their parts."""
    monkeypatch.setattr(bk, "MIN_DIFFERENCE_S", 0.0)  # time the given loop lengths only
    monkeypatch.setattr(bk, "copy_bandwidth", lambda: 1e11)  # not 80 GB of copies on the CPU
    out = tmp_path / "attention.json"
    bk.main(["--tiny", "--parts", "attention", "--formats", "bf16,kitty-pro", "--contexts", "1024", "--batches", "1",
             "--rotate-mb", str(1.5 * 1024 * 2 * 2 * 64 * 2 / 2**20), "--n1", "1", "--n2", "2", "--repeats", "1",
             "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows] == ["bf16", "kitty-pro"]
    assert rows[0]["copies"] == 2
    for r in rows:
        assert r["step_us"] == r["step_us"] and r["copies"] >= 2
    assert all(rows[1][k] == rows[1][k] for k in ("attend_us", "store_us", "kernel_us"))


def test_with_rings_restores_the_window_a_loop_starts_from(bk):
    """A KIVI layer stepped past position p and rewound to p: each step's store finds a ring slot
    holding a later token (a rewind), unless the rings are put back as they were at p; then the
    state after a second pass of the same steps equals the first pass's, byte for byte."""
    config = bk.model_config(1, tiny=True)
    fmt = kvcache.get("kivi-k2v2*")
    layer = bk.filled_layer(fmt, config, 2, 200, 260)
    rings = bk.rings_of(layer)
    assert set(rings) == set(bk.RING_FIELDS)
    kv = jax.random.normal(jax.random.key(0), (2, 1, config.num_kv_heads, config.head_dim), jnp.bfloat16)

    def steps(lay):
        for i in range(3):
            lay = lay.store(kv, kv, jnp.full((2, 1), 200 + i, jnp.int32))
        return lay

    first = steps(layer)
    # The value token the first step quantizes (lag 128): its slot held it at 200, not after the pass.
    jt = 200 - layer.sink_len - 128
    slot = jt % layer.v_ring_pos.shape[1]
    assert int(rings["v_ring_pos"][0, slot]) == jt and int(first.v_ring_pos[0, slot]) != jt
    restored = bk.with_rings(first, rings)
    assert int(restored.v_ring_pos[0, slot]) == jt
    np.testing.assert_array_equal(np.asarray(restored.k_store.codes), np.asarray(first.k_store.codes))
    again = steps(restored)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert bk.rings_of(kvcache.get("bf16").init(config, 1, 16).layers[0]) == {}


def test_loop_us_resets_the_carry_before_every_loop(bk, monkeypatch):
    monkeypatch.setattr(bk, "MIN_DIFFERENCE_S", 0.0)  # the loop lengths 1 and 3 only
    args = types.SimpleNamespace(n1=1, n2=3, repeats=2, compiler_options={})
    resets = []

    def reset(c):
        resets.append(float(c[0]))
        return jnp.zeros_like(c)

    bk.loop_us(lambda i, c: c + 1.0, jnp.zeros((4,), jnp.float32), args, reset=reset)
    # before every loop (4 lengths x 2 repeats): the carry is the last loop's, then back to zero
    assert len(resets) >= 8 and resets[0] == 0.0 and set(resets[1:]) <= {1.0, 3.0} and 3.0 in resets


def test_replot_draws_the_attention_points_from_saved_rows(bk, tmp_path):
    """``--replot`` of saved attention rows (no GPU): the table, and a PNG with both panels."""
    rows = [dict(part="attention", format=f, batch=b, context=c, step_us=us, copy_pct=pct, x_bf16=x)
            for b, c in ((1, 4096), (8, 32768))
            for f, us, pct, x in (("bf16", 20.0, 30.0, 1.0), ("kitty-pro", 15.0, 8.0, 20.0 / 15.0),
                                  ("kivi-k4v4", 19.0, 11.0, 20.0 / 19.0))]
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps({"rows": rows}))
    png = tmp_path / "attention.png"
    bk.main(["--replot", str(saved), "--attention-plot", str(png)])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_replot_draws_the_decode_and_capacity_points_from_saved_rows(bk, tmp_path, capsys):
    """``--replot`` of saved decode and capacity rows: both PNGs and the table's lines."""
    rows = [dict(part="decode", format=f, batch=b, context=8192, ms_per_token=ms, x_bf16=2.0 / ms)
            for b in (1, 32) for f, ms in (("bf16", 2.0), ("kitty-pro", 1.6), ("kivi-k2v2*", 1.8))]
    rows += [dict(part="capacity", format=f, batch=n, context=8192, budget_gb=40.0, ms_per_token=20.0,
                  tokens_per_s=n / 20.0 * 1e3) for f, n in (("bf16", 157), ("kitty-pro", 867))]
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps({"rows": rows}))
    decode_png, capacity_png = tmp_path / "decode.png", tmp_path / "capacity.png"
    bk.main(["--replot", str(saved), "--decode-plot", str(decode_png), "--plot", str(capacity_png)])
    for png in (decode_png, capacity_png):
        assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "1.600 ms/token, x1.25 vs bf16" in out and "43350 tok/s at B=867" in out
