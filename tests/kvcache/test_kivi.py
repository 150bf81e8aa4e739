"""KIVI blocks against NumPy, the variants' registry entries, bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import kvcache
from jaxlp.kvcache import kivi
from jaxlp.models import ModelConfig

quantize_keys = jax.jit(kivi.quantize_keys, static_argnums=(1, 2))
dequantize_keys = jax.jit(kivi.dequantize_keys, static_argnums=1)
quantize_values = jax.jit(kivi.quantize_values, static_argnums=(1, 2))
dequantize_values = jax.jit(kivi.dequantize_values, static_argnums=1)


def np_minmax(x, bits, axis):
    levels = 2**bits - 1
    lo = x.min(axis, keepdims=True)
    scale = np.maximum((x.max(axis, keepdims=True) - lo) * (np.float32(1) / np.float32(levels)),
                       np.float32(1e-6)).astype(np.float16)
    lo = lo.astype(np.float16)
    codes = np.floor((x - lo.astype(np.float32)) * (np.float32(1) / scale.astype(np.float32)) + np.float32(0.5))
    return np.clip(codes, 0, levels).astype(np.uint8), scale, lo


def np_pack(codes, bits):
    """Planar: of N codes, element t*M + i (M = N * bits / 8) in byte i at bits [t * bits, (t + 1) * bits)."""
    per = 8 // bits
    m = codes.shape[-1] // per
    c = codes.astype(np.uint32)
    return sum(c[..., t * m:(t + 1) * m] << (bits * t) for t in range(per)).astype(np.uint8)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_planar_packing_round_trip(bits):
    """quant.pack_bits: element i of N in byte i % (N bits / 8), bits (i // (N bits / 8)) * bits."""
    from jaxlp.kvcache.quant import pack_bits, pack_int4, unpack_bits, unpack_int4

    codes = np.random.default_rng(bits).integers(0, 2**bits, size=(3, 64)).astype(np.uint8)
    packed = np.asarray(pack_bits(jnp.asarray(codes), bits))
    assert packed.shape == (3, 64 * bits // 8) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packed, np_pack(codes, bits))
    m = packed.shape[-1]
    i = np.arange(64)
    np.testing.assert_array_equal((packed[:, i % m] >> (i // m * bits)) & (2**bits - 1), codes)
    np.testing.assert_array_equal(np.asarray(unpack_bits(jnp.asarray(packed), bits)), codes)
    signed = codes.astype(np.int8) % 16 - 8
    np.testing.assert_array_equal(np.asarray(unpack_int4(pack_int4(jnp.asarray(signed)))), signed)
    if bits < 8:
        with pytest.raises(ValueError, match="multiple of"):
            pack_bits(jnp.zeros((3, 63), jnp.uint8), bits)
    with pytest.raises(ValueError, match="bits must be"):
        unpack_bits(jnp.asarray(packed), 3)


@pytest.mark.parametrize("bits, d, seed", [(2, 32, 0), (4, 32, 1), (2, 64, 2), (4, 16, 3)])
def test_keys_match_numpy(bits, d, seed):
    rng = np.random.default_rng(seed)
    k = (rng.normal(size=(2, 128, d)) * np.exp(rng.normal(size=d)) + rng.normal(size=d)).astype(np.float16).astype(np.float32)
    block = quantize_keys(jnp.asarray(k), bits, 32)
    codes, scale, lo = np_minmax(k.reshape(2, 4, 32, d), bits, axis=2)  # groups of 32 tokens per channel
    assert block.codes.shape == (2, d, 128 * bits // 8) and block.scale.shape == (2, 4, d)
    np.testing.assert_array_equal(np.asarray(block.codes), np_pack(np.swapaxes(codes.reshape(2, 128, d), 1, 2), bits))
    np.testing.assert_array_equal(np.asarray(block.scale), scale[:, :, 0])
    np.testing.assert_array_equal(np.asarray(block.min), lo[:, :, 0])
    deq = np.asarray(dequantize_keys(block, bits))
    want = (codes * scale.astype(np.float64) + lo).reshape(2, 128, d)
    np.testing.assert_allclose(deq, want, rtol=1e-6, atol=1e-6)
    step = np.repeat(scale.astype(np.float64), 32, axis=2).reshape(2, 128, d)
    assert (np.abs(deq - k) <= 0.5 * step + 2.0**-10 * (np.abs(k) + (2**bits) * step) + 1e-6).all()


@pytest.mark.parametrize("bits, d, group, seed", [(2, 32, 32, 10), (4, 64, 32, 11), (2, 24, 24, 12), (4, 128, 32, 13)])
def test_values_match_numpy(bits, d, group, seed):
    rng = np.random.default_rng(seed)
    v = (rng.normal(size=(3, 5, d)) * np.exp(rng.normal(size=(3, 5, 1)))).astype(np.float16).astype(np.float32)
    tokens = quantize_values(jnp.asarray(v), bits, group)
    codes, scale, lo = np_minmax(v.reshape(3, 5, d // group, group), bits, axis=3)  # groups of channels per token
    np.testing.assert_array_equal(np.asarray(tokens.codes), np_pack(codes.reshape(3, 5, d), bits))
    np.testing.assert_array_equal(np.asarray(tokens.scale), scale[..., 0])
    np.testing.assert_array_equal(np.asarray(tokens.min), lo[..., 0])
    deq = np.asarray(dequantize_values(tokens, bits))
    np.testing.assert_allclose(deq, (codes * scale.astype(np.float64) + lo).reshape(3, 5, d), rtol=1e-6, atol=1e-6)


def test_four_bit_layout_and_edge_cases():
    v = np.concatenate([np.arange(16), 15 - np.arange(16)]).astype(np.float32)[None]  # one token: codes = values
    tokens = quantize_values(jnp.asarray(v), 4, 32)
    # planar: channel i in the low nibble of byte i, channel i + 16 in its high nibble
    assert np.asarray(tokens.codes)[0].tolist() == [i | (15 - i) << 4 for i in range(16)]
    np.testing.assert_allclose(np.asarray(dequantize_values(tokens, 4)), v, atol=1e-3)
    t = np.arange(128, dtype=np.float32)
    block = quantize_keys(jnp.asarray(np.stack([t // 32, t % 32 // 8], 1)), 2, 32)  # 2-bit: plane t = group t
    codes = np.asarray(block.codes)  # [2 channels, 32 bytes]
    assert (codes[0] == 0b00000000).all()  # each 32-token group is constant: code 0 (its min)
    assert codes[1].tolist() == [0b00000000] * 8 + [0b01010101] * 8 + [0b10101010] * 8 + [0b11111111] * 8
    np.testing.assert_allclose(np.asarray(block.min)[:, 0], [0, 1, 2, 3])
    zero = quantize_keys(jnp.zeros((128, 8)), 2, 32)
    assert (np.asarray(dequantize_keys(zero, 2)) == 0).all()
    inf = quantize_values(jnp.full((1, 32), jnp.inf), 2, 32)
    assert not np.isfinite(np.asarray(dequantize_values(inf, 2))).any()


def test_variants_and_checks():
    cfg = ModelConfig("llama", 8, 8, 8, 1, 2, 1, 32)
    for name, kb, vb, sink in [("kivi-k2v2", 2, 2, 0), ("kivi-k4v4", 4, 4, 0), ("kivi-k2v2*", 2, 2, 32),
                               ("kivi-k2v4*", 2, 4, 32), ("kivi-k4v2*", 4, 2, 32)]:
        fmt = kvcache.get(name)
        assert (fmt.key_bits, fmt.value_bits, fmt.sink, fmt.group, fmt.residual, fmt.name) == (kb, vb, sink, 32, 128, name)
        layer = fmt.init(cfg, 1, 300).layers[0]
        assert layer.sink_k.shape == (1, sink, 1, 32)
        assert layer.k_spec.ring == 127 and layer.v_spec.ring == 128
    with pytest.raises(ValueError, match="key_bits"):
        kivi.Kivi(key_bits=3)
    with pytest.raises(ValueError, match="do not tile"):
        kvcache.get("kivi-k2v2").init(ModelConfig("llama", 8, 8, 8, 1, 2, 1, 48), 1, 64)
    with pytest.raises(ValueError, match="multiple of the group"):
        kivi.quantize_keys(jnp.zeros((100, 8)), 2)


def test_bytes_hand_computed():
    cfg = ModelConfig("llama", 16, 16, 16, 2, 32, 8, 128)
    h, d, n = 8, 128, 4096
    ring = lambda slots: slots * (h * d * 2 + 4)  # noqa: E731  FP16 slots + int32 slot positions
    for name, kb, vb, sink in [("kivi-k2v2", 2, 2, 0), ("kivi-k4v2*", 4, 2, 32)]:
        m = n - sink
        key_block = d * 128 * kb // 8 + 2 * 4 * d * 2  # codes + FP16 scale/min per 32-token group and channel
        value_token = d * vb // 8 + 2 * (d // 32) * 2  # codes + FP16 scale/min per 32-channel group
        want = 2 * sink * h * d * 2 + ring(127) + (m // 128) * h * key_block + ring(128) + (m - 128) * h * value_token
        assert kvcache.get(name).bytes_for(cfg, n) == want
    assert kvcache.get("kivi-k2v2").bytes_for(cfg, n) == 3_619_836
    assert kvcache.get("kivi-k2v2").init(cfg, 2, n).nbytes == 2 * 2 * 3_619_836
