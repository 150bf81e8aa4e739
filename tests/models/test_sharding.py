"""Tensor parallelism: on 4 simulated CPU devices, sharded logits equal single-device ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxlp

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen2_bias_tied"])
def test_sharded_logits_equal_single_device(hf_checkpoint, name):
    _, path = hf_checkpoint(name)
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    single = jaxlp.from_pretrained(path, dtype=jnp.float32)
    sharded = jaxlp.from_pretrained(path, dtype=jnp.float32, mesh=mesh)

    q = sharded.layers[0].self_attn.q_proj.weight[...]
    assert q.sharding.spec == P("tp", None) and len(q.sharding.device_set) == 4
    down = sharded.layers[0].mlp.down_proj.weight[...]
    assert down.sharding.spec == P(None, "tp")

    ids = jnp.asarray(np.random.default_rng(0).integers(3, 256, size=(2, 19)))
    ref = np.asarray(single(ids))
    out = np.asarray(jax.jit(lambda m, x: m(x))(sharded, ids))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

    gen_single = jaxlp.generate(single, [ids[0, :7].tolist()], max_new_tokens=6, kv_cache="fp32", stop_tokens=())
    gen_sharded = jaxlp.generate(sharded, [ids[0, :7].tolist()], max_new_tokens=6, kv_cache="fp32", stop_tokens=())
    assert gen_sharded.sequences() == gen_single.sequences()


def test_mesh_needs_tp_axis(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with pytest.raises(ValueError, match="'tp'"):
        jaxlp.from_pretrained(path, dtype=jnp.float32, mesh=mesh)
