"""save_pretrained: checkpoints that jaxlp and transformers both load, with equal logits."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlp
from conftest import TINY_CONFIGS
from jaxlp.models import ModelConfig, RopeConfig, Transformer, from_hf_config, read_config
from jaxlp.models.saving import hf_config_dict, save_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DIRECT_CONFIGS = {
    "qwen3": ModelConfig(
        model_type="qwen3", vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=True, max_position_embeddings=256,
        bos_token_id=1, eos_token_ids=(2,), pad_token_id=0,
    ),
    "llama": ModelConfig(
        model_type="llama", vocab_size=120, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=6,
        num_kv_heads=3, head_dim=8, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=128,
        rope=(("full_attention", RopeConfig(theta=500000.0)),), bos_token_id=1, eos_token_ids=(2, 5),
    ),
}


def _random_model(config: ModelConfig, seed: int) -> Transformer:
    """A float32 model with every parameter random (norm gains too), so no tensor can go unnoticed."""
    model = Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    flat = nnx.to_flat_state(nnx.state(model))
    for path, var in flat:
        v = var.get_value()
        name = ".".join(map(str, path))
        new = (1.0 if "norm" in name else 0.0) + (0.2 if "norm" in name else 0.15) * rng.standard_normal(v.shape)
        var.set_value(jnp.asarray(new, jnp.float32))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def _hf_logits(path, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return hf(torch.as_tensor(ids)).logits.numpy()


def _params(model):
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("name", sorted(DIRECT_CONFIGS))
def test_transformers_logits_equal_jaxlp(name, tmp_path):
    config = DIRECT_CONFIGS[name]
    model = _random_model(config, seed=len(name) + 31)
    save_pretrained(model, tmp_path)
    ids = np.random.default_rng(len(name)).integers(0, config.vocab_size, size=(2, 19))
    ref = _hf_logits(tmp_path, ids)
    ours = np.asarray(model(jnp.asarray(ids)))
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-4
    # jaxlp reads back the same config and bit-identical float32 parameters.
    assert read_config(tmp_path) == config
    loaded = jaxlp.from_pretrained(tmp_path, dtype=jnp.float32)
    a, b = _params(model), _params(loaded)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_every_family_round_trips(hf_checkpoint, name, tmp_path):
    hf_model, src = hf_checkpoint(name)
    model = jaxlp.from_pretrained(src, dtype=jnp.float32)
    save_pretrained(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == model.config.model_type
    assert read_config(tmp_path) == model.config
    ids = np.random.default_rng(abs(hash(name)) % 2**32).integers(3, 256, size=(2, 23))
    with torch.no_grad():
        ref = hf_model(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_array_equal(_hf_logits(tmp_path, ids), ref)  # the same float32 weights and config


def test_bfloat16_storage_and_shards(tmp_path):
    from safetensors import safe_open

    config = DIRECT_CONFIGS["qwen3"]
    model = _random_model(config, seed=7)
    total = sum(v.size * 2 for v in _params(model).values())
    save_pretrained(model, tmp_path, dtype=jnp.bfloat16, max_shard_bytes=total // 3)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 3 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    assert sorted(index["weight_map"]) == sorted("model." + k for k in _params(model))  # tied: no lm_head
    for shard in shards:
        assert shard.stat().st_size <= total // 3 + 4096
        with safe_open(str(shard), "np") as f:
            assert f.metadata() == {"format": "pt"}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = jaxlp.from_pretrained(tmp_path, dtype=jnp.float32)
    want = {k: np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32)) for k, v in _params(model).items()}
    got = _params(loaded)
    assert all(np.array_equal(want[k], got[k]) for k in want)
    ids = np.random.default_rng(8).integers(0, config.vocab_size, size=(1, 11))
    ref = _hf_logits(tmp_path, ids)
    ours = np.asarray(loaded(jnp.asarray(ids)))
    assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-4


def test_tokenizer_files(tmp_path):
    from jaxlp.models.tokenizer import load_tokenizer
    from jaxlp.testbed import make_tokenizer

    tok = make_tokenizer()
    model = _random_model(DIRECT_CONFIGS["qwen3"], seed=3)
    save_pretrained(model, tmp_path / "a", tok)
    text = "Q: (12+3)*4\n+3: 2100000+3000000 c0000000 =5100000"
    assert load_tokenizer(tmp_path / "a").encode(text).ids == tok.encode(text).ids
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "a")
    assert hf_tok(text).input_ids == tok.encode(text).ids
    assert hf_tok.eos_token == "<eos>" and hf_tok.pad_token == "<pad>" and hf_tok.bos_token == "<bos>"
    gen = json.loads((tmp_path / "a" / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    save_pretrained(model, tmp_path / "b", tmp_path / "a")  # copy from a directory
    assert (tmp_path / "b" / "tokenizer.json").read_text() == (tmp_path / "a" / "tokenizer.json").read_text()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        save_pretrained(model, tmp_path / "c", tmp_path / "b" / "missing")


def test_errors(tmp_path):
    model = _random_model(DIRECT_CONFIGS["qwen3"], seed=4)
    save_pretrained(model, tmp_path)
    with pytest.raises(FileExistsError, match="overwrite"):
        save_pretrained(model, tmp_path)
    save_pretrained(model, tmp_path, max_shard_bytes=10_000, overwrite=True)  # old single file removed
    assert not (tmp_path / "model.safetensors").exists()
    jaxlp.from_pretrained(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        save_pretrained(model, tmp_path / "file")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_pretrained(model, tmp_path / "z", max_shard_bytes=0)
    # Architectures a family's config.json cannot express.
    base = DIRECT_CONFIGS["qwen3"]
    bad = [
        (dict(model_type="qwen2", qk_norm=False), "qkv_bias"),  # qwen2 always has q/k/v biases
        (dict(qk_norm=False), "qk_norm"),  # qwen3 always has q/k norms
        (dict(model_type="llama", qk_norm=False, qkv_bias=True), "o_bias"),  # llama's attention_bias covers o_proj too
        (dict(model_type="llama", qk_norm=False, embed_scale=2.0), "embed_scale"),
        (dict(model_type="phi3"), "phi3"),
    ]
    import dataclasses

    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            hf_config_dict(dataclasses.replace(base, **change))
    # A quantized model is refused.
    q = jaxlp.quantize_model(model, "w4a16-nvfp4")
    with pytest.raises(ValueError, match="save_quantized"):
        save_pretrained(q, tmp_path / "q")


def test_config_dict_reads_back():
    for config in DIRECT_CONFIGS.values():
        assert from_hf_config(hf_config_dict(config)) == config
    d = hf_config_dict(DIRECT_CONFIGS["llama"], jnp.bfloat16)
    assert d["eos_token_id"] == [2, 5] and d["dtype"] == "bfloat16" and d["architectures"] == ["LlamaForCausalLM"]
    assert d["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
