// NestedFP products for a few tokens (M = 1..8) on tensor cores (XLA FFI custom call, sm_90);
// Python side: jaxlp/ffi/nestedfp.py.
//
//   FP16 mode:  acc[s, m, n] = sum_k x[m, k] * merge(upper, lower)[n, k]   (x FP16)
//   FP8 mode:   acc[s, m, n] = sum_k x8[m, k] * e4m3(upper)[n, k]           (x8 E4M3 codes)
//
// over split s's share of K, in FP32; out[m, n] = (sum_s acc[s, m, n] / divisor[m]) * multiplier in
// the output's dtype (float32, float16 or bfloat16), the splits added in rank order. The
// weights are the register operand of `mma.sync` with the operands swapped (W x^T: 16 output
// features on the MMA's M, the tokens on its N = 8), so the weight bytes go from global memory
// into registers once and are never staged. Each thread loads 16 consecutive K of its two rows
// (g, g + 8) and of token g per 64-wide K window; since a sum does not care about the order of
// its terms, the MMA's k slots are mapped to those loaded K (the same map for both operands):
// no shuffle, no shared memory. FP16 mode rebuilds each 4 FP16 weights from their 4 upper and 4
// lower bytes with one 32-bit merge and two byte permutes (nestedfp_merge.cuh).
// FP8 mode reads the upper bytes only (half the bytes): m16n8k32 E4M3 MMAs.
// A CTA of 8 warps owns 16 output rows and its split's share of K; its warps take K windows in
// turn (1, 2 or 4 windows' loads in flight per warp: `unroll`, fewer registers and more CTAs per SM
// the fewer) and add their accumulators through shared memory; a row block's splits (1..8 CTAs) are
// one thread-block cluster whose rank 0 adds the others' sums through distributed shared memory
// and writes the output: one kernel, nothing in global memory but the output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "gemv_epilogue.cuh"
#include "launch.cuh"
#include "mma_sync.cuh"
#include "nestedfp_merge.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxlp::ldg16;
using jaxlp::mma_e4m3;
using jaxlp::mma_f16;

namespace jaxlp_nestedfp {

constexpr int kWarps = 8;
constexpr int kRows = 16;     // output features per CTA (the MMA's M)
constexpr int kWindow = 64;   // K per warp step: 4 threads x 16 consecutive K
constexpr int kMaxTokens = 8; // the MMA's N

struct Params {
  const uint8_t* upper;   // [N, K]
  const uint8_t* lower;   // [N, K] (FP16 mode)
  const uint8_t* x;       // [M, K]: FP16 (FP16 mode) or E4M3 codes (FP8 mode)
  void* out;              // [M, N] (file head)
  const float* divisor;   // [M]
  float multiplier;
  int m, n, k, splits;
};

// One thread's share of a 64-wide K window: 16 K of rows g and g + 8 (upper bytes, and lower
// bytes in FP16 mode) and of token g (FP16 or E4M3), loaded; then its MMAs into c.
template <bool kFp8>
struct Window {
  uint4 u0, u1, l0, l1, xa, xb;

  __device__ __forceinline__ void load(const uint8_t* up0, const uint8_t* up1, const uint8_t* lo0,
                                       const uint8_t* lo1, const uint8_t* xrow, long k0) {
    u0 = ldg16(up0 + k0);
    u1 = ldg16(up1 + k0);
    if constexpr (kFp8) {
      xa = ldg16(xrow + k0);
    } else {
      l0 = ldg16(lo0 + k0);
      l1 = ldg16(lo1 + k0);
      xa = ldg16(xrow + 2 * k0);
      xb = ldg16(xrow + 2 * k0 + 16);
    }
  }

  // keep: all ones for a token of the product, zero for a lane past M (no branch between the
  // loads and the MMAs, which lets the loads of a step run ahead).
  __device__ __forceinline__ void mma(float (&c)[4], uint32_t keep) const {
    const uint4 x0 = make_uint4(xa.x & keep, xa.y & keep, xa.z & keep, xa.w & keep);
    if constexpr (kFp8) {
      mma_e4m3(c, u0.x, u1.x, u0.y, u1.y, x0.x, x0.y);
      mma_e4m3(c, u0.z, u1.z, u0.w, u1.w, x0.z, x0.w);
    } else {
      const uint4 x1 = make_uint4(xb.x & keep, xb.y & keep, xb.z & keep, xb.w & keep);
      const uint32_t uu0[4] = {u0.x, u0.y, u0.z, u0.w}, ll0[4] = {l0.x, l0.y, l0.z, l0.w};
      const uint32_t uu1[4] = {u1.x, u1.y, u1.z, u1.w}, ll1[4] = {l1.x, l1.y, l1.z, l1.w};
      const uint32_t xx[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
      for (int s = 0; s < 4; ++s) {  // word s: K 4s .. 4s + 3 of the thread's 16
        uint32_t a0, a2, a1, a3;
        jaxlp::nestedfp_merge4(uu0[s], ll0[s], a0, a2);
        jaxlp::nestedfp_merge4(uu1[s], ll1[s], a1, a3);
        mma_f16(c, a0, a1, a2, a3, xx[2 * s], xx[2 * s + 1]);
      }
    }
  }
};

// kUnroll: windows per pipelined step (loads in flight per warp); kMinBlocks: CTAs per SM the
// register budget is held to (ptxas -v, sm_90, no spills: FP16 mode unroll 1 / 2 / 4 72 / 124 / 225
// registers, FP8 mode 54 / 76 / 128).
// TOut: the output's element type (float for the sums of several splits).
template <bool kFp8, int kUnroll, int kMinBlocks, typename TOut>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) gemv_kernel(Params p) {
  __shared__ jaxlp::SplitSums<kWarps, 4> sums;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tg = lane & 3;  // mma fragment coordinates
  const int row0 = blockIdx.y * kRows, split = blockIdx.x;
  const long ka = static_cast<long>(p.k);
  const uint8_t* up0 = p.upper + (row0 + g) * ka + tg * 16;
  const uint8_t* up1 = up0 + 8 * ka;
  const uint8_t* lo0 = p.lower + (row0 + g) * ka + tg * 16;
  const uint8_t* lo1 = lo0 + 8 * ka;
  const uint32_t keep = g < p.m ? 0xFFFFFFFFu : 0u;
  const uint8_t* xrow = p.x + (keep ? g : 0) * ka * (kFp8 ? 1 : 2) + tg * 16 * (kFp8 ? 1 : 2);

  float c[4] = {0.f, 0.f, 0.f, 0.f};
  const int windows = p.k / kWindow, stride = kWarps * p.splits;
  // Steps of kUnroll windows, software-pipelined: a step's loads are issued before the MMAs of the
  // step loaded the iteration before. Windows past K load window `first` again and feed zeros.
  const int first = split * kWarps + warp;
  Window<kFp8> cur[kUnroll], next[kUnroll];
  uint32_t keep_next[kUnroll];
  auto load_step = [&](int w0) {
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int w = w0 + j * stride;
      keep_next[j] = w < windows ? keep : 0u;
      next[j].load(up0, up1, lo0, lo1, xrow, static_cast<long>(w < windows ? w : first) * kWindow);
    }
  };
  if (first < windows) load_step(first);
  for (int w0 = first; w0 < windows; w0 += kUnroll * stride) {
    uint32_t keep_cur[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      cur[j] = next[j];
      keep_cur[j] = keep_next[j];
    }
    if (w0 + kUnroll * stride < windows) load_step(w0 + kUnroll * stride);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) cur[j].mma(c, keep_cur[j]);
  }
  if (!jaxlp::split_sums(c, sums, warp, lane, p.splits)) return;
  // c0, c1: row g, tokens 2tg, 2tg + 1; c2, c3: row g + 8.
  TOut* out = static_cast<TOut*>(p.out);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = 2 * tg + (i & 1), n = row0 + g + 8 * (i >> 1);
    if (m < p.m) out[static_cast<long>(m) * p.n + n] = jaxlp::to_out<TOut>((c[i] / p.divisor[m]) * p.multiplier);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

inline ffi::Error bad(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp nestedfp gemv: " + msg);
}

// CTAs per SM each unroll is compiled for (FP16 mode holds twice the bytes per window).
// The grid: (split, row block), each row block's splits one cluster.
template <bool kFp8, typename TOut>
cudaError_t launch(int unroll, cudaStream_t stream, const Params& p) {
  const dim3 grid(p.splits, p.n / kRows), block(kWarps * 32);
  switch (unroll) {
    case 1:
      return jaxlp::launch_kernel(gemv_kernel<kFp8, 1, kFp8 ? 4 : 3, TOut>, grid, block, 0, stream, p.splits, false, p);
    case 2:
      return jaxlp::launch_kernel(gemv_kernel<kFp8, 2, kFp8 ? 3 : 2, TOut>, grid, block, 0, stream, p.splits, false, p);
    default:
      return jaxlp::launch_kernel(gemv_kernel<kFp8, 4, kFp8 ? 2 : 1, TOut>, grid, block, 0, stream, p.splits, false, p);
  }
}

template <bool kFp8>
ffi::Error Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> upper, ffi::Buffer<ffi::U8> lower,
                ffi::Buffer<ffi::F32> divisor, ffi::Result<ffi::AnyBuffer> out, int32_t splits, int32_t unroll,
                float multiplier) {
  auto xd = x.dimensions(), wd = upper.dimensions(), ld = lower.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return bad("expected x [M, K] and upper [N, K]");
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  const auto want = kFp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::F16;
  if (x.element_type() != want)
    return bad(kFp8 ? "FP8 mode takes float8_e4m3fn activations" : "FP16 mode takes float16 activations");
  if (wd[1] != k) return bad("upper bytes [N, K] do not match x's K");
  if (!kFp8 && (ld.size() != 2 || ld[0] != n || ld[1] != k)) return bad("lower bytes must match upper [N, K]");
  if (m < 1 || m > kMaxTokens) return bad("1 to 8 tokens, got " + std::to_string(m));
  if (n % kRows) return bad("N must be a multiple of 16, got " + std::to_string(n));
  if (k % kWindow) return bad("K must be a multiple of 64, got " + std::to_string(k));
  if (divisor.dimensions().size() != 1 || divisor.dimensions()[0] != m) return bad("divisor must be float32 [M]");
  if (const char* e = jaxlp::output_error(out, m, n, splits)) return bad(e);
  if (unroll != 1 && unroll != 2 && unroll != 4) return bad("unroll must be 1, 2 or 4, got " + std::to_string(unroll));
  Params p;
  p.upper = upper.typed_data();
  p.lower = kFp8 ? upper.typed_data() : lower.typed_data();
  p.x = static_cast<const uint8_t*>(x.untyped_data());
  p.out = out->untyped_data();
  p.divisor = divisor.typed_data();
  p.multiplier = multiplier;
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.splits = splits;
  if (n == 0) return ffi::Error::Success();
  const cudaError_t e = jaxlp::with_out_type(out->element_type(), [&](auto out_type) {
    return launch<kFp8, decltype(out_type)>(unroll, stream, p);
  });
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxlp nestedfp gemv launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace jaxlp_nestedfp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpNestedFP16Gemv, jaxlp_nestedfp::Impl<false>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // x [M, K] float16
                                  .Arg<ffi::Buffer<ffi::U8>>()   // upper [N, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // lower [N, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // divisor [M]
                                  .Ret<ffi::AnyBuffer>()         // out [M, N]
                                  .Attr<int32_t>("splits")       // CTAs per row block along K: 1..8
                                  .Attr<int32_t>("unroll")       // windows per pipelined step: 1, 2, 4
                                  .Attr<float>("multiplier"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpNestedFP8Gemv, jaxlp_nestedfp::Impl<true>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // x [M, K] float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::U8>>()   // upper [N, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // upper again (no lower bytes read)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // divisor [M]
                                  .Ret<ffi::AnyBuffer>()         // out [M, N]
                                  .Attr<int32_t>("splits")       // CTAs per row block along K: 1..8
                                  .Attr<int32_t>("unroll")       // windows per pipelined step: 1, 2, 4
                                  .Attr<float>("multiplier"),
                              {ffi::Traits::kCmdBufferCompatible});
