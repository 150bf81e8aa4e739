// NVFP4 matmul kernels for Hopper (sm_90) behind XLA FFI custom calls.
//
//   y[m, n] = sum_k act(x)[m, k] * W[n, k]
//
// Four kernels (the dispatch table picks one per (M, N, K), see nvfp4_dispatch.py); "pipe" also
// runs MXFP4 and DialectFP4 weights (handler JaxlpBlockFp4Matmul, jaxlp.ffi.block_fp4):
// - gemv_kernel ("regs", M <= 32, any K % 16 == 0): nvfp4_gemv.cu; FP16 tensor cores, a staging
//   kernel per call. Handler JaxlpNvfp4Gemv.
// - pipe_kernel ("pipe", M <= 32, K % 64 == 0): cp.async ring per warp, persistent clusters with
//   split-K, BF16 tensor cores; W4A16 reads BF16 x directly (one launch per call). Handler
//   JaxlpNvfp4Matmul. See nvfp4_pipe.cu.
// - pipe_kernel<..., kDecF16> ("pipe16", M <= 32, K % 64 == 0): the same ring and clusters with
//   gemv_kernel's arithmetic (FP16 decode, FP16 tensor cores) on the staged FP16 x_eff; launched
//   by JaxlpNvfp4Gemv after its staging kernel (kernel = 3). See PipeDecode in nvfp4_pipe.cu.
// - gemm_kernel ("gemm", any M, K % 64 == 0): 64/128 x 64/128 CTA tiles, optional cluster split-K,
//   BF16 mma.sync with weights decoded in registers. Handler JaxlpNvfp4Matmul. See nvfp4_gemm.cu.
// W4A4 activations are quantized by stage_a4_kernel (nvfp4_quantize.cu; bit-exact ModelOpt
// numerics); the tensor scale g_x comes as a scalar, or as the calibrated amax from which the
// kernels derive it (act_scale), so that no XLA op runs for it inside a decode loop.
//
// This file: argument checks, dispatch and the XLA FFI handlers. Each kernel file defines the host
// launchers of its kernels, declared in nvfp4_kernels.cuh; nvfp4_common.cuh holds the device helpers
// the kernels share.

#include <cuda_runtime.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "nvfp4_kernels.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxlp_nvfp4 {

// ---------------------------------------------------------------------------------------------
// Host side

inline ffi::Error cuda_error(cudaError_t e, const char* where) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxlp nvfp4 ") + where + ": " + cudaGetErrorString(e));
}

inline ffi::Error bad(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp nvfp4: " + msg);
}

inline int round_up(int v, int m) { return (v + m - 1) / m * m; }

enum GemvKernel : int { kRegs = 0, kPipe16 = 3 };  // the kernels behind JaxlpNvfp4Gemv (FP16 x_eff staging)

template <typename T>
cudaError_t run_gemv(cudaStream_t stream, int mode, const T* x, const float* xg, GemvParams p, int rows_per_warp,
                     int ksplit, bool pdl, int kernel = kRegs, int split = 1, GemvVariant v = {}) {
  cudaError_t e = stage_f16<T>(stream, mode, x, xg, p);
  if (e != cudaSuccess) return e;
  if (kernel == kPipe16) return run_pipe16<T>(stream, mode, p, rows_per_warp, split, pdl, v);
  return run_regs<T>(stream, mode, p, rows_per_warp, ksplit, pdl, v);
}

ffi::Error GemvImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> wdata, ffi::Buffer<ffi::U8> wscale,
                    ffi::Buffer<ffi::F32> wg, ffi::Buffer<ffi::F32> xg, ffi::Result<ffi::AnyBuffer> y,
                    ffi::Result<ffi::Buffer<ffi::F16>> xeff, ffi::Result<ffi::Buffer<ffi::F32>> xs, int64_t mode,
                    int64_t rows_per_warp, int64_t k_split, int64_t pdl, int64_t xg_amax, int64_t kernel,
                    int64_t split, int64_t blocks_per_sm, int64_t accumulators, int64_t stages) {
  const auto xd = x.dimensions();
  const auto wd = wdata.dimensions();
  const auto sd = wscale.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 2) return bad("x, data and scales must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (M < 1 || M > kMaxM) return bad("M (tokens) must be in [1, 32], got " + std::to_string(M));
  if (K < 16 || K % 16) return bad("K must be a positive multiple of 16, got " + std::to_string(K));
  if (N < 1) return bad("N must be positive");
  if (K > (int64_t(1) << 30) || N > (int64_t(1) << 30)) return bad("N and K must be below 2^30");
  if (wd[1] != K / 2) return bad("weight data must be [N, K/2]");
  if (sd[0] != N || sd[1] != K / 16) return bad("block scales must be [N, K/16]");
  const int Kp = round_up(static_cast<int>(K), kChunkK);
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != M || yd[1] != N) return bad("output must be [M, N]");
  const auto ed = xeff->dimensions();
  if (ed.size() != 2 || ed[0] != M || ed[1] != Kp) return bad("x_eff workspace must be [M, Kp]");
  const auto qd = xs->dimensions();
  if (qd.size() != 2 || qd[0] != M || qd[1] != Kp / kChunkK) return bad("xs workspace must be [M, Kp/256]");
  if (mode != kA16 && mode != kA4 && mode != kProbe) return bad("mode must be 0 (W4A16), 1 (W4A4) or 2 (probe)");
  if (mode == kProbe && M > 8) return bad("the probe mode takes M <= 8");
  if (kernel != kRegs && kernel != kPipe16) return bad("kernel must be 0 (regs) or 3 (pipe16)");
  if (kernel == kPipe16 && K % 64) return bad("the pipe16 kernel needs K % 64 == 0, got K = " + std::to_string(K));
  if (split != 1 && split != 2 && split != 4) return bad("split must be 1, 2 or 4");
  if (rows_per_warp != 1 && rows_per_warp != 2) return bad("rows_per_warp must be 1 or 2");
  if (k_split != 2 && k_split != 4 && k_split != 8) return bad("k_split must be 2, 4 or 8");
  if (blocks_per_sm != 0 && blocks_per_sm != 3) return bad("blocks_per_sm must be 0 or 3");
  if (accumulators != 1 && accumulators != 2) return bad("accumulators must be 1 or 2");
  if (stages != 0 && stages != 2) return bad("stages must be 0 (3) or 2");
  if (blocks_per_sm && (kernel != kRegs || rows_per_warp != 1))
    return bad("blocks_per_sm = 3 is a variant of the regs kernel with rows_per_warp = 1");
  if (stages && kernel != kPipe16) return bad("stages = 2 is a variant of the pipe16 kernel");
  GemvVariant variant;
  variant.blocks = static_cast<int>(blocks_per_sm);
  variant.acc = static_cast<int>(accumulators);
  variant.stages = static_cast<int>(stages);
  if (!variant.is_default() && M > 8) return bad("the blocks_per_sm / accumulators / stages variants take M <= 8");
  if (mode == kProbe && (variant.blocks || variant.acc != 1))
    return bad("the probe runs the default variants (and pipe16's stages = 2)");
  if (x.element_type() != y->element_type()) return bad("output dtype must match the activation dtype");
  if (wg.element_count() != 1 || xg.element_count() != 1) return bad("tensor scales must be scalars");

  GemvParams p;
  p.wdata = wdata.typed_data();
  p.wscale = wscale.typed_data();
  p.wg = wg.typed_data();
  p.xg = xg.typed_data();
  p.xeff = reinterpret_cast<const uint16_t*>(xeff->untyped_data());
  p.xs = xs->typed_data();
  p.y = y->untyped_data();
  p.M = static_cast<int>(M);
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.Kp = Kp;
  const uintptr_t wptr = reinterpret_cast<uintptr_t>(p.wdata);
  p.vec16 = (K % 32 == 0) && (wptr % 16 == 0);
  p.scale32 = (K % 64 == 0) && (reinterpret_cast<uintptr_t>(p.wscale) % 4 == 0);
  p.xg_amax = xg_amax != 0;
  if (!p.vec16 && wptr % 8 != 0) return bad("weight data must be 8-byte aligned");
  if (kernel == kPipe16 && (wptr % 16 || reinterpret_cast<uintptr_t>(p.wscale) % 4))
    return bad("pipe16: weight data must be 16-byte and scales 4-byte aligned");
  if (reinterpret_cast<uintptr_t>(x.untyped_data()) % 16 != 0 || reinterpret_cast<uintptr_t>(p.xeff) % 16 != 0)
    return bad("activation buffers must be 16-byte aligned");

  cudaError_t e;
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      e = run_gemv<__nv_bfloat16>(stream, static_cast<int>(mode),
                                  reinterpret_cast<const __nv_bfloat16*>(x.untyped_data()), p.xg, p,
                                  static_cast<int>(rows_per_warp), static_cast<int>(k_split), pdl != 0,
                                  static_cast<int>(kernel), static_cast<int>(split), variant);
      break;
    case ffi::DataType::F32:
      e = run_gemv<float>(stream, static_cast<int>(mode), reinterpret_cast<const float*>(x.untyped_data()), p.xg, p,
                          static_cast<int>(rows_per_warp), static_cast<int>(k_split), pdl != 0,
                          static_cast<int>(kernel), static_cast<int>(split), variant);
      break;
    default:
      return bad("activations must be bfloat16 or float32");
  }
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(e, "gemv launch");
  return ffi::Error::Success();
}

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> g,
                        ffi::Result<ffi::Buffer<ffi::U8>> codes, ffi::Result<ffi::Buffer<ffi::U8>> scales,
                        int64_t lanes) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return bad("x must be 2-D [M, K]");
  const int64_t M = xd[0], K = xd[1];
  if (K < 16 || K % 16) return bad("K must be a positive multiple of 16, got " + std::to_string(K));
  if (M < 1 || M * K > (int64_t(1) << 31)) return bad("M * K must be in [1, 2^31]");
  if (lanes != 1 && lanes != 2 && lanes != 4) return bad("lanes (threads per block) must be 1, 2 or 4");
  const auto cd = codes->dimensions();
  const auto sd = scales->dimensions();
  if (cd.size() != 2 || cd[0] != M || cd[1] != K / 2) return bad("codes must be [M, K/2]");
  if (sd.size() != 2 || sd[0] != M || sd[1] != K / 16) return bad("scales must be [M, K/16]");
  if (g.element_count() != 1) return bad("tensor scale must be a scalar");
  if (reinterpret_cast<uintptr_t>(x.untyped_data()) % 16 != 0) return bad("x must be 16-byte aligned");
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      launch_quantize(stream, reinterpret_cast<const __nv_bfloat16*>(x.untyped_data()), g.typed_data(),
                      codes->typed_data(), scales->typed_data(), static_cast<int>(M), static_cast<int>(K),
                      static_cast<int>(lanes));
      break;
    case ffi::DataType::F32:
      launch_quantize(stream, reinterpret_cast<const float*>(x.untyped_data()), g.typed_data(), codes->typed_data(),
                      scales->typed_data(), static_cast<int>(M), static_cast<int>(K), static_cast<int>(lanes));
      break;
    default:
      return bad("activations must be bfloat16 or float32");
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(e, "quantize launch");
  return ffi::Error::Success();
}

enum MatmulKernel : int { kPipe = 1, kGemm = 2 };

// One call of the BF16-tensor-core kernels: W4A4 first quantizes x into the BF16 x_eff workspace
// (stage_a4_kernel), then pipe_kernel (small M) or gemm_kernel (large M) reads it; W4A16 reads x.
template <typename T>
cudaError_t run_matmul(cudaStream_t stream, int mode, int kernel, const T* x, const float* xg, uint16_t* xeff,
                       PipeParams p, int rows, int split, int block_m, int block_n, bool pdl) {
  bool after_stage = false;
  if (mode == kA4) {
    cudaError_t e = stage_bf16<T>(stream, x, xg, xeff, p.M, p.K, p.xg_amax);
    if (e != cudaSuccess) return e;
    p.x = reinterpret_cast<const __nv_bfloat16*>(xeff);
    p.xg = xg;
    after_stage = pdl;
  } else {
    p.x = reinterpret_cast<const __nv_bfloat16*>(x);
    p.xg = nullptr;
  }
  if (kernel == kPipe) return run_pipe<T>(stream, p, rows, split, after_stage);
  return run_gemm<T>(stream, p, block_m, block_n, split, after_stage);
}

ffi::Error MatmulImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> wdata, ffi::Buffer<ffi::U8> wscale,
                      ffi::Buffer<ffi::F32> wg, ffi::Buffer<ffi::F32> xg, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::Buffer<ffi::BF16>> xeff, int64_t mode, int64_t kernel, int64_t rows_per_warp,
                      int64_t split, int64_t block_m, int64_t block_n, int64_t pdl, int64_t xg_amax) {
  const auto xd = x.dimensions();
  const auto wd = wdata.dimensions();
  const auto sd = wscale.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 2) return bad("x, data and scales must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (kernel != kPipe && kernel != kGemm) return bad("kernel must be 1 (pipe) or 2 (gemm)");
  if (M < 1 || (kernel == kPipe && M > kMaxM)) return bad("M (tokens) out of range: " + std::to_string(M));
  if (K < 64 || K % 64) return bad("K must be a positive multiple of 64, got " + std::to_string(K));
  if (N < 1) return bad("N must be positive");
  if (K > (int64_t(1) << 30) || N > (int64_t(1) << 30) || M > (int64_t(1) << 30) || M * K > (int64_t(1) << 40))
    return bad("M, N and K must be below 2^30");
  if (wd[1] != K / 2) return bad("weight data must be [N, K/2]");
  if (sd[0] != N || sd[1] != K / 16) return bad("block scales must be [N, K/16]");
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != M || yd[1] != N) return bad("output must be [M, N]");
  if (mode != kA16 && mode != kA4) return bad("mode must be 0 (W4A16) or 1 (W4A4)");
  const auto ed = xeff->dimensions();
  if (mode == kA4 && (ed.size() != 2 || ed[0] != M || ed[1] != K)) return bad("x_eff workspace must be [M, K]");
  if (rows_per_warp != 1 && rows_per_warp != 2) return bad("rows_per_warp must be 1 or 2");
  if (split != 1 && split != 2 && split != 4) return bad("split must be 1, 2 or 4");
  if (block_m != 64 && block_m != 128) return bad("block_m must be 64 or 128");
  if (block_n != 64 && block_n != 128) return bad("block_n must be 64 or 128");
  if (kernel == kGemm && K / 64 < split) return bad("split-K needs at least 64 * split values of K");
  if (x.element_type() != y->element_type()) return bad("output dtype must match the activation dtype");
  if (mode == kA16 && x.element_type() != ffi::DataType::BF16) return bad("W4A16 takes bfloat16 activations");
  if (wg.element_count() != 1 || xg.element_count() != 1) return bad("tensor scales must be scalars");
  PipeParams p = {};
  p.wdata = wdata.typed_data();
  p.wscale = wscale.typed_data();
  p.wg = wg.typed_data();
  p.y = y->untyped_data();
  p.M = static_cast<int>(M);
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.xg_amax = xg_amax != 0;
  if (reinterpret_cast<uintptr_t>(p.wdata) % 16 || reinterpret_cast<uintptr_t>(p.wscale) % 4 ||
      reinterpret_cast<uintptr_t>(x.untyped_data()) % 16 || reinterpret_cast<uintptr_t>(xeff->untyped_data()) % 16)
    return bad("buffers must be 16-byte aligned (scales 4-byte)");
  uint16_t* ws = reinterpret_cast<uint16_t*>(xeff->untyped_data());
  cudaError_t e;
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      e = run_matmul<__nv_bfloat16>(stream, static_cast<int>(mode), static_cast<int>(kernel),
                                    reinterpret_cast<const __nv_bfloat16*>(x.untyped_data()), xg.typed_data(), ws, p,
                                    static_cast<int>(rows_per_warp), static_cast<int>(split),
                                    static_cast<int>(block_m), static_cast<int>(block_n), pdl != 0);
      break;
    case ffi::DataType::F32:
      e = run_matmul<float>(stream, static_cast<int>(mode), static_cast<int>(kernel),
                            reinterpret_cast<const float*>(x.untyped_data()), xg.typed_data(), ws, p,
                            static_cast<int>(rows_per_warp), static_cast<int>(split), static_cast<int>(block_m),
                            static_cast<int>(block_n), pdl != 0);
      break;
    default:
      return bad("activations must be bfloat16 or float32");
  }
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(e, "matmul launch");
  return ffi::Error::Success();
}

// The "pipe" (kernel = 1) and "gemm" (kernel = 2) kernels on MXFP4 or DialectFP4 weights
// (jaxlp.ffi.block_fp4): BF16 x; BF16 or FP32 y. "pipe" reads the scale bytes [N, K/32] and the
// dialect ids [N, K/64]; "gemm" one packed metadata word per (row, 64 k) in place of the scales,
// [N, K/16] bytes. act = 0: W4A16; act = kFmtMxfp4 / kFmtDialect: W4A4, x first quantized into the BF16
// x_eff workspace [M, K] by stage_block_fp4 (the selection tables `sel`, 168 floats, for DialectFP4),
// the GEMV launched after it with programmatic dependent launch.
ffi::Error BlockFp4MatmulImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> codes,
                              ffi::Buffer<ffi::U8> scales, ffi::Buffer<ffi::U8> dialects, ffi::Buffer<ffi::U8> tables,
                              ffi::Buffer<ffi::F32> sel, ffi::Result<ffi::AnyBuffer> y,
                              ffi::Result<ffi::Buffer<ffi::BF16>> xeff, int64_t format, int64_t act, int64_t kernel,
                              int64_t rows_per_warp, int64_t split, int64_t block_m, int64_t block_n) {
  const auto xd = x.dimensions();
  const auto cd = codes.dimensions();
  const auto sd = scales.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2) return bad("x, codes and scales must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = cd[0];
  if (format != kFmtMxfp4 && format != kFmtDialect) return bad("format must be 1 (MXFP4) or 2 (DialectFP4)");
  if (kernel != kPipe && kernel != kGemm) return bad("kernel must be 1 (pipe) or 2 (gemm)");
  if (act != 0 && act != kFmtMxfp4 && act != kFmtDialect) return bad("act must be 0, 1 (MXFP4) or 2 (DialectFP4)");
  if (M < 1 || (kernel == kPipe && M > kMaxM)) return bad("M (tokens) out of range: " + std::to_string(M));
  if (K < 128 || K % 128) return bad("K must be a positive multiple of 128, got " + std::to_string(K));
  if (N < 1) return bad("N must be positive");
  if (K > (int64_t(1) << 30) || N > (int64_t(1) << 30) || N * K > (int64_t(1) << 40))
    return bad("N and K must be below 2^30");
  if (cd[1] != K / 2) return bad("codes must be [N, K/2]");
  if (kernel == kPipe && (sd[0] != N || sd[1] != K / 32)) return bad("block scales / exponents must be [N, K/32]");
  if (kernel == kGemm && (sd[0] != N || sd[1] != K / 16)) return bad("the gemm's metadata must be [N, K/16] bytes");
  if (kernel == kPipe && format == kFmtDialect) {
    const auto dd = dialects.dimensions();
    if (dd.size() != 2 || dd[0] != N || dd[1] != K / 64) return bad("dialect ids must be [N, K/64]");
  }
  if (format == kFmtDialect && tables.element_count() != 256) return bad("the dialect tables must be [16, 16] bytes");
  if (act == kFmtDialect && sel.element_count() != 168) return bad("the selection tables must be 168 floats");
  const auto ed = xeff->dimensions();
  if (act != 0 && (ed.size() != 2 || ed[0] != M || ed[1] != K)) return bad("the x_eff workspace must be [M, K]");
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != M || yd[1] != N) return bad("output must be [M, N]");
  if (rows_per_warp != 1 && rows_per_warp != 2) return bad("rows_per_warp must be 1 or 2");
  if (split != 1 && split != 2 && split != 4) return bad("split must be 1, 2 or 4");
  if (block_m != 64 && block_m != 128) return bad("block_m must be 64 or 128");
  if (block_n != 64 && block_n != 128) return bad("block_n must be 64 or 128");
  if (kernel == kGemm && K / 64 < split) return bad("split-K needs at least 64 * split values of K");
  if (M > (int64_t(1) << 30) || M * K > (int64_t(1) << 40)) return bad("M must be below 2^30");
  PipeParams p = {};
  p.wdata = codes.typed_data();
  p.wscale = scales.typed_data();
  p.wdialect = dialects.typed_data();
  p.tables = tables.typed_data();
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.untyped_data());
  p.y = y->untyped_data();
  p.M = static_cast<int>(M);
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  const bool ids_misaligned = kernel == kPipe && reinterpret_cast<uintptr_t>(p.wdialect) % 4;
  const bool dialect_misaligned =
      format == kFmtDialect && (ids_misaligned || reinterpret_cast<uintptr_t>(p.tables) % 16);
  if (reinterpret_cast<uintptr_t>(p.wdata) % 16 || reinterpret_cast<uintptr_t>(p.wscale) % 4 ||
      reinterpret_cast<uintptr_t>(p.x) % 16 || reinterpret_cast<uintptr_t>(xeff->untyped_data()) % 16 ||
      dialect_misaligned)
    return bad("buffers must be 16-byte aligned (scales and dialect ids 4-byte)");
  const int fmt = static_cast<int>(format), rows = static_cast<int>(rows_per_warp), sp = static_cast<int>(split);
  const int bm = static_cast<int>(block_m), bn = static_cast<int>(block_n);
  if (y->element_type() != ffi::DataType::BF16 && y->element_type() != ffi::DataType::F32)
    return bad("the output must be bfloat16 or float32");
  cudaError_t e = cudaSuccess;
  if (act != 0) {
    __nv_bfloat16* ws = reinterpret_cast<__nv_bfloat16*>(xeff->untyped_data());
    e = stage_block_fp4(stream, static_cast<int>(act), p.x, sel.typed_data(), ws, p.M, p.K);
    p.x = ws;
  }
  // PDL behind the staging kernel for the GEMV only: the GEMM's 64-row tilings ran 1.7x slower with it
  // (docs/perf.md "Session 31").
  const bool pdl = act != 0 && kernel == kPipe;
  if (e == cudaSuccess) {
    if (y->element_type() == ffi::DataType::BF16) {
      e = kernel == kPipe ? run_pipe_block_fp4<__nv_bfloat16>(stream, p, fmt, rows, sp, pdl)
                          : run_gemm_block_fp4<__nv_bfloat16>(stream, p, fmt, bm, bn, sp, pdl);
    } else {
      e = kernel == kPipe ? run_pipe_block_fp4<float>(stream, p, fmt, rows, sp, pdl)
                          : run_gemm_block_fp4<float>(stream, p, fmt, bm, bn, sp, pdl);
    }
  }
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(e, "block fp4 matmul launch");
  return ffi::Error::Success();
}

// MXFP4 / DialectFP4 weights decoded to BF16 (decode_block_fp4 in block_fp4_decode.cu).
ffi::Error BlockFp4DecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::U8> scales,
                              ffi::Buffer<ffi::U8> dialects, ffi::Buffer<ffi::U8> tables,
                              ffi::Result<ffi::Buffer<ffi::BF16>> out, int64_t format) {
  const auto cd = codes.dimensions();
  const auto sd = scales.dimensions();
  if (cd.size() != 2 || sd.size() != 2) return bad("codes and scales must be 2-D");
  const int64_t N = cd[0], K = 2 * cd[1];
  if (format != kFmtMxfp4 && format != kFmtDialect) return bad("format must be 1 (MXFP4) or 2 (DialectFP4)");
  if (K < 32 || K % 32) return bad("K must be a positive multiple of 32, got " + std::to_string(K));
  if (sd[0] != N || sd[1] != K / 32) return bad("block scales / exponents must be [N, K/32]");
  if (format == kFmtDialect) {
    const auto dd = dialects.dimensions();
    if (dd.size() != 2 || dd[0] != N || dd[1] != (K / 32 + 1) / 2) return bad("dialect ids must be [N, ceil(K/64)]");
    if (tables.element_count() != 256) return bad("the dialect tables must be [16, 16] bytes");
    if (reinterpret_cast<uintptr_t>(tables.typed_data()) % 16) return bad("the tables must be 16-byte aligned");
  }
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != N || od[1] != K) return bad("output must be [N, K]");
  if (reinterpret_cast<uintptr_t>(codes.typed_data()) % 16 || reinterpret_cast<uintptr_t>(out->untyped_data()) % 16)
    return bad("codes and output must be 16-byte aligned");
  if (N * K == 0) return ffi::Error::Success();
  cudaError_t e = decode_block_fp4(stream, static_cast<int>(format), codes.typed_data(), scales.typed_data(),
                                   dialects.typed_data(), tables.typed_data(),
                                   reinterpret_cast<__nv_bfloat16*>(out->untyped_data()), N, K);
  if (e != cudaSuccess) return cuda_error(e, "block fp4 decode launch");
  return ffi::Error::Success();
}

}  // namespace jaxlp_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpBlockFp4Decode, jaxlp_nvfp4::BlockFp4DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // codes [N, K/2]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // E8M0 scales / exponent codes [N, K/32]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // DialectFP4: dialect ids [N, ceil(K/64)]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // DialectFP4: tables [16, 16]
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // [N, K]
                                  .Attr<int64_t>("format"),       // 1: MXFP4, 2: DialectFP4
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpBlockFp4Matmul, jaxlp_nvfp4::BlockFp4MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // codes [N, K/2]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // E8M0 scales / exponent codes [N, K/32]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // DialectFP4: dialect ids [N, K/64]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // DialectFP4: tables [16, 16]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // W4A4 DialectFP4: selection tables [168]
                                  .Ret<ffi::AnyBuffer>()          // y [M, N], bfloat16 or float32
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // W4A4: x_eff [M, K], else [1, 8]
                                  .Attr<int64_t>("format")        // 1: MXFP4, 2: DialectFP4
                                  .Attr<int64_t>("act")           // 0: none, 1: MXFP4, 2: DialectFP4
                                  .Attr<int64_t>("kernel")        // 1: pipe, 2: gemm
                                  .Attr<int64_t>("rows_per_warp")
                                  .Attr<int64_t>("split")
                                  .Attr<int64_t>("block_m")
                                  .Attr<int64_t>("block_n"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpNvfp4Gemv, jaxlp_nvfp4::GemvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()           // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()     // weight codes [N, K/2]
                                  .Arg<ffi::Buffer<ffi::U8>>()     // weight block scales (E4M3 bits) [N, K/16]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // g_w
                                  .Arg<ffi::Buffer<ffi::F32>>()    // g_x (ignored for W4A16)
                                  .Ret<ffi::AnyBuffer>()           // y [M, N]
                                  .Ret<ffi::Buffer<ffi::F16>>()    // x_eff workspace [M, Kp]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // chunk scales workspace [M, Kp/256]
                                  .Attr<int64_t>("mode")
                                  .Attr<int64_t>("rows_per_warp")
                                  .Attr<int64_t>("k_split")
                                  .Attr<int64_t>("pdl")
                                  .Attr<int64_t>("xg_amax")
                                  .Attr<int64_t>("kernel")         // 0: regs, 3: pipe16
                                  .Attr<int64_t>("split")          // pipe16: CTAs of a cluster splitting K
                                  .Attr<int64_t>("blocks_per_sm")  // regs: 0 or 3 (M <= 8)
                                  .Attr<int64_t>("accumulators")   // regs, pipe16: 1 or 2 (M <= 8)
                                  .Attr<int64_t>("stages"),        // pipe16: 0 (3) or 2 (M <= 8)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpNvfp4Quantize, jaxlp_nvfp4::QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g_x
                                  .Ret<ffi::Buffer<ffi::U8>>()   // codes [M, K/2]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // scales (E4M3 bits) [M, K/16]
                                  .Attr<int64_t>("lanes"),       // threads per 16-element block: 1, 2, 4
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpNvfp4Matmul, jaxlp_nvfp4::MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()           // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()     // weight codes [N, K/2]
                                  .Arg<ffi::Buffer<ffi::U8>>()     // weight block scales (E4M3 bits) [N, K/16]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // g_w
                                  .Arg<ffi::Buffer<ffi::F32>>()    // g_x (ignored for W4A16)
                                  .Ret<ffi::AnyBuffer>()           // y [M, N]
                                  .Ret<ffi::Buffer<ffi::BF16>>()   // x_eff workspace [M, K] (W4A4), else [1, 8]
                                  .Attr<int64_t>("mode")
                                  .Attr<int64_t>("kernel")
                                  .Attr<int64_t>("rows_per_warp")
                                  .Attr<int64_t>("split")
                                  .Attr<int64_t>("block_m")
                                  .Attr<int64_t>("block_n")
                                  .Attr<int64_t>("pdl")
                                  .Attr<int64_t>("xg_amax"),
                              {ffi::Traits::kCmdBufferCompatible});
