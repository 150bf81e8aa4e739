"""Checkpoint loading: sharded checkpoints, configs that change the math, broken files."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp
from jaxlp.errors import CheckpointFormatError, UnsupportedConfigError
from jaxlp.models import from_hf_config

torch = pytest.importorskip("torch")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_with_index(hf_checkpoint, tmp_path):
    hf_model, _ = hf_checkpoint("qwen3_qknorm_window")
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = np.random.default_rng(0).integers(3, 256, size=(1, 9))
    with torch.no_grad():
        ref = hf_model(torch.as_tensor(ids)).logits.numpy()
    out = np.asarray(jaxlp.from_pretrained(tmp_path, dtype=jnp.float32)(jnp.asarray(ids)))
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-4


def test_bfloat16_load_is_close(hf_checkpoint):
    hf_model, path = hf_checkpoint("llama")
    ids = np.random.default_rng(1).integers(3, 256, size=(1, 12))
    with torch.no_grad():
        ref = hf_model(torch.as_tensor(ids)).logits.numpy()
    model = jaxlp.from_pretrained(path, dtype=jnp.bfloat16)
    assert model.layers[0].mlp.up_proj.weight[...].dtype == jnp.bfloat16
    out = np.asarray(model(jnp.asarray(ids)))
    assert np.abs(out - ref).max() / np.abs(ref).max() < 5e-2


def test_missing_and_corrupt_files(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("llama")
    with pytest.raises(CheckpointFormatError, match="does not exist"):
        jaxlp.from_pretrained(tmp_path / "nowhere")
    d = _copy(path, tmp_path / "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointFormatError, match="no config.json"):
        jaxlp.from_pretrained(d)
    d = _copy(path, tmp_path / "badjson")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointFormatError, match="corrupt JSON"):
        jaxlp.from_pretrained(d)
    d = _copy(path, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointFormatError, match="no \\*.safetensors"):
        jaxlp.from_pretrained(d)
    d = _copy(path, tmp_path / "truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFormatError, match="cannot read safetensors"):
        jaxlp.from_pretrained(d)


def _rewrite_tensors(path, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_tensor_mismatches_name_the_tensor(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("llama")
    d = _copy(path, tmp_path / "missing")
    _rewrite_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointFormatError, match="model.layers.1.mlp.up_proj.weight.*missing"):
        jaxlp.from_pretrained(d)
    d = _copy(path, tmp_path / "shape")
    _rewrite_tensors(d, lambda t: t.update({"model.norm.weight": np.ones(3, np.float32)}))
    with pytest.raises(CheckpointFormatError, match="model.norm.weight.*shape"):
        jaxlp.from_pretrained(d)
    d = _copy(path, tmp_path / "extra")
    _rewrite_tensors(d, lambda t: t.update({"model.layers.0.mlp.router.weight": np.ones(3, np.float32)}))
    with pytest.raises(CheckpointFormatError, match="unexpected tensors.*router"):
        jaxlp.from_pretrained(d)


BASE = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(model_type="mixtral"), "unsupported architecture.*mixtral"),
        (dict(model_type="gemma3"), "multimodal"),
        (dict(num_experts=8), "unsupported config key.*num_experts"),
        (dict(rope_parameters=dict(rope_type="yarn", factor=4.0)), "RoPE type 'yarn'"),
        (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "RoPE type 'dynamic'"),
        (dict(hidden_act="relu"), "activation 'relu'"),
        (dict(quantization_config=dict(quant_method="gptq")), "quantization_config"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(model_type="gemma3_text", attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ],
)
def test_unsupported_config_options_raise(change, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        from_hf_config({**BASE, **change})


def test_missing_required_key():
    cfg = dict(BASE)
    del cfg["vocab_size"]
    with pytest.raises(ValueError, match="vocab_size"):
        from_hf_config(cfg)


def test_rope_inverse_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192)
    hf = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=params)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = from_hf_config(json.loads(hf.to_json_string())).rope_for("full_attention").inv_freq(128)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)
    hf = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=dict(rope_type="linear", factor=4.0,
                                                                                 rope_theta=10000.0))
    ref, _ = ROPE_INIT_FUNCTIONS["linear"](hf, "cpu")
    ours = from_hf_config(json.loads(hf.to_json_string())).rope_for("full_attention").inv_freq(128)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)


def test_gemma3_defaults_from_legacy_keys():
    cfg = from_hf_config(dict(BASE, model_type="gemma3_text", num_hidden_layers=6, head_dim=8, sliding_window=4,
                              rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=8))
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert cfg.rope_for("sliding_attention").theta == 1e4 and cfg.rope_for("full_attention").theta == 1e6
    assert cfg.tie_word_embeddings and cfg.norm_offset and cfg.embed_scale == 4.0 and cfg.query_scale == 8**-0.5
