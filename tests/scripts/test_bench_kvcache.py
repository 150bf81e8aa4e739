"""scripts/bench_kvcache.py: XLA options from the command line and the donated loop timer with its
per-kernel profile (CPU: the profile holds no GPU kernels, but its fields are there)."""

import types

import jax.numpy as jnp
import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def bk():
    return load_script("bench_kvcache")


def test_compiler_options_parse_bools_ints_and_strings(bk):
    parsed = bk.compiler_options("xla_gpu_enable_command_buffer=FUSION,CONDITIONAL;a=true;b=False;c=-3;;d=x=y")
    assert parsed == {"xla_gpu_enable_command_buffer": "FUSION,CONDITIONAL", "a": True, "b": False, "c": -3,
                      "d": "x=y"}
    assert bk.compiler_options("") == {}


def test_loop_us_times_the_donated_loop_and_fills_the_profile(bk):
    args = types.SimpleNamespace(n1=1, n2=3, repeats=1, compiler_options={})
    profile = {}
    us = bk.loop_us(lambda i, c: c * 1.5 + 1.0, jnp.zeros((64,), jnp.float32), args, profile)
    assert isinstance(us, float)
    assert set(profile) == {"gpu_us_per_token", "by_kind_us", "top_kernels_us"}
    assert profile["gpu_us_per_token"] == 0.0  # no GPU here: no GPU kernels in the traces
