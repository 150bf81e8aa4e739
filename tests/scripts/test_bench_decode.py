"""scripts/bench_decode.py: the per-token GPU profile (kernel kinds, the long - short difference)
and a tiny CPU run with every run suffix."""

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def bd():
    return load_script("bench_decode")


@pytest.mark.parametrize("name,kind", [
    ("void jaxlp_nvfp4::gemv_kernel<1, 1, 0, __nv_bfloat16, 0, 2>(jaxlp_nvfp4::GemvParams)", "nvfp4 GEMV"),
    ("void jaxlp_nvfp4::pipe_kernel<2, 1, 1, __nv_bfloat16, 1, 3, 1>(jaxlp_nvfp4::PipeParams)", "nvfp4 GEMV"),
    ("void jaxlp_nvfp4::stage_a4_kernel<__nv_bfloat16, 0, 2>(...)", "nvfp4 activation staging"),
    ("void jaxlp_nvfp4::gemm_kernel<128, 64>(jaxlp_nvfp4::PipeParams)", "nvfp4 GEMM"),
    ("void jaxlp_sampling::sample_kernel(jaxlp_sampling::SampleParams)", "sampling kernels"),
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "cuBLAS / cuDNN"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s16816gemm_bf16_64x64_32x6_nt_align2>(...)", "cuBLAS / cuDNN"),
    ("input_reduce_fusion_144", "XLA fusions and other"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "NCCL collectives"),
])
def test_kernel_kinds(bd, name, kind):
    assert bd.kernel_kind(name) == kind


def test_step_profile_is_the_per_step_difference(bd, monkeypatch):
    traces = iter([
        ({"gemv_kernel<1>": 1000.0, "loop_fusion": 300.0, "nvjet_x": 50.0},  # long call
         {"gemv_kernel<1>": 10, "loop_fusion": 20, "nvjet_x": 1}),
        ({"gemv_kernel<1>": 400.0, "loop_fusion": 120.0, "nvjet_x": 50.0, "memset": 2.0},  # short call
         {"gemv_kernel<1>": 4, "loop_fusion": 8, "nvjet_x": 1, "memset": 1}),
    ])
    monkeypatch.setattr(bd, "kernel_times", lambda run: next(traces))
    p = bd.step_profile(None, None, steps=6, top=2)
    assert p["gpu_us_per_token"] == pytest.approx((1350 - 572) / 6)
    assert p["launches_per_token"] == pytest.approx((31 - 14) / 6)
    assert p["by_kind_us"]["nvfp4 GEMV"] == pytest.approx(100.0)
    assert p["by_kind_us"]["XLA fusions and other"] == pytest.approx(30.0)
    assert p["by_kind_us"]["cuBLAS / cuDNN"] == pytest.approx(0.0)
    assert [n for n, _ in p["top_kernels_us"]] == ["gemv_kernel<1>", "loop_fusion"]


def test_tiny_run_with_every_suffix(bd, tmp_path):
    """Each format and suffix once: BF16, then W4A4 with the pipe GEMV, then W4A16 with the lm_head
    quantized (a format switch on the same NVFP4 weights and back to the measured table)."""
    out = tmp_path / "d.json"
    result = bd.main(["--tiny", "--layers", "1", "--n1", "4", "--n2", "12", "--repeats", "1", "--out", str(out),
                      "--runs", "bf16:1:short,w4a4-pipe:1:short,w4a16-lmhead:1:short"])
    runs = {r["format"]: r for r in result["runs"]}
    assert set(runs) == {"bf16", "w4a4-pipe", "w4a16-lmhead"}
    # Each run timed two generation lengths (the time difference of a tiny CPU model is noise, not checked).
    assert all("ms_per_token" in r and r["steps"][1] > r["steps"][0] for r in runs.values()) and out.is_file()
    with pytest.raises(SystemExit, match="unknown run"):
        bd.main(["--tiny", "--layers", "1", "--runs", "w4a4-fast:1:short", "--out", str(out)])
    with pytest.raises(SystemExit, match="after the others"):
        bd.main(["--tiny", "--layers", "1", "--n1", "4", "--n2", "12", "--repeats", "1", "--out", str(out),
                 "--runs", "w4a16-lmhead:1:short,w4a16:1:short"])


def test_tiny_fused_run(bd, tmp_path):
    result = bd.main(["--tiny", "--layers", "1", "--n1", "4", "--n2", "12", "--repeats", "1", "--fused",
                      "--attention", "xla", "--out", str(tmp_path / "f.json"), "--runs", "bf16:1:short,w4a16:1:short"])
    assert result["fused_projections"] and result["attention"] == "xla" and "fused" in result["model"]
    assert all(r["steps"][1] > r["steps"][0] for r in result["runs"])
