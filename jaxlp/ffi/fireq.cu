// FireQ W4A8 on sm_90 (XLA FFI custom calls; Python side: jaxlp/ffi/fireq.py): products for a few
// tokens (M = 1..32) on tensor cores, and the INT4 weight decoded to its E4M3 values in memory (for
// the FP8 GEMM of many tokens).
//
//   gemv:    out[m, n] = (sum_k x8[m, k] * e4m3(q[n, k] * scale[n, k / 128])) * t[m] * multiplier
//            (t = token_scale, or its BF16 rounding with bf16_token_scale: FireQ's stored scale)
//   decode:  w8[n, k] = e4m3(q[n, k] * scale[n, k / 128])
//
// with FP32 sums (each of `splits` CTAs one share of K, added in rank order) and the output in its
// dtype (float32, float16 or bfloat16): the activation scale per token, PTS's 1/p in the
// multiplier. q: INT4 codes two per byte (element 2i in the low nibble, two's
// complement), scale: E4M3 per group of 128 K (jaxlp.formats.int4_fp8). The weights are the
// register operand of `mma.sync` m16n8k32 E4M3 with the operands swapped (W x^T: 16 output
// features on the MMA's M, the tokens on its N = 8; 2 or 4 token groups past 8 tokens), so the 4-bit
// weights go from global memory into registers once and are never staged. Each thread loads 32
// consecutive K (16 bytes) of its two rows (g, g + 8) and of its tokens per 128-wide K window
// (one scale group); a sum does not care about the order of its terms, so the MMA's k slots are
// mapped to those loaded K (the same map for both operands): no shuffle, no shared memory.
//
// INT4 -> E4M3, exactly e4m3(q * s) (RNE, saturating), per 32-bit word r of 8 codes k0..k7:
//   r ^= 0x88888888 (u = q + 8 per nibble); FP16 lanes 0x6400 | u = 1024 + u (codes of even k:
//   nibble bits 0-3 of bytes 0 and 2, and >> 8 for bytes 1 and 3) or 0x6400 | u << 4 = 1024 + 16u
//   (odd k); minus 1032 (1152) gives q (16q) exactly, times s (s / 16) gives q * s exactly (at most
//   7 significant bits, |q * s| <= 3584), and cvt.rn.satfinite.e4m3x2.f16x2 rounds it to E4M3;
//   two byte permutes put the 8 codes back in k order.
// A CTA of 8 warps owns 16 output rows and its split's share of K; its warps take K windows in
// turn (1, 2 or 4 windows' loads in flight per warp: `unroll`, fewer registers and more CTAs per SM
// the fewer); a row block's splits are one thread-block cluster (gemv_epilogue.cuh).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "gemv_epilogue.cuh"
#include "launch.cuh"
#include "mma_sync.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxlp::ldg16;
using jaxlp::mma_e4m3;

namespace jaxlp_fireq {

constexpr int kWarps = 8;
constexpr int kRows = 16;      // output features per CTA (the MMA's M)
constexpr int kWindow = 128;   // K per warp step: 4 threads x 32 consecutive K; one scale group
constexpr int kTokenGroup = 8; // the MMA's N
constexpr int kMaxTokens = 32; // four token groups

struct Params {
  const uint8_t* codes;   // [N, K / 2]
  const uint8_t* scales;  // [N, K / 128] E4M3
  const uint8_t* x;       // [M, K] E4M3
  void* out;              // [M, N]
  const float* token_scale;  // [M]
  float multiplier;
  bool bf16_token_scale;  // round token_scale to BF16 first
  int m, n, k, splits;
};

// (s, s) and (s / 16, s / 16) as FP16 pairs from an E4M3 scale byte (both exact).
__device__ __forceinline__ void scale_pairs(uint32_t s8, uint32_t& s_even, uint32_t& s_odd) {
  uint32_t s2;
  const uint16_t both = static_cast<uint16_t>(s8 | (s8 << 8));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(s2) : "h"(both));
  s_even = s2;
  const __half2 sixteenth = __float2half2_rn(0.0625f);
  const __half2 h = __hmul2(*reinterpret_cast<const __half2*>(&s2), sixteenth);
  s_odd = *reinterpret_cast<const uint32_t*>(&h);
}

// e4m3(q * s) of the 4 FP16 lanes pairs (file head) -> two E4M3 bytes.
__device__ __forceinline__ uint16_t scaled_e4m3(uint32_t lanes, uint32_t bias, uint32_t s) {
  const __half2 q = __hsub2(*reinterpret_cast<const __half2*>(&lanes), *reinterpret_cast<const __half2*>(&bias));
  const __half2 p = __hmul2(q, *reinterpret_cast<const __half2*>(&s));
  uint16_t out;
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(out) : "r"(*reinterpret_cast<const uint32_t*>(&p)));
  return out;
}

// 8 INT4 codes (k0..k7, one word) -> 8 E4M3 weights e4m3(q * s) in k order (lo: k0..k3, hi: k4..k7).
__device__ __forceinline__ void decode8(uint32_t r, uint32_t s_even, uint32_t s_odd, uint32_t& lo, uint32_t& hi) {
  constexpr uint32_t kBiasEven = 0x64086408u;  // 1032 = 1024 + 8
  constexpr uint32_t kBiasOdd = 0x64806480u;   // 1152 = 1024 + 16 * 8
  r ^= 0x88888888u;
  const uint32_t r8 = r >> 8;
  const uint16_t a = scaled_e4m3((r & 0x000F000Fu) | 0x64006400u, kBiasEven, s_even);   // k0, k4
  const uint16_t b = scaled_e4m3((r & 0x00F000F0u) | 0x64006400u, kBiasOdd, s_odd);     // k1, k5
  const uint16_t c = scaled_e4m3((r8 & 0x000F000Fu) | 0x64006400u, kBiasEven, s_even);  // k2, k6
  const uint16_t d = scaled_e4m3((r8 & 0x00F000F0u) | 0x64006400u, kBiasOdd, s_odd);    // k3, k7
  const uint32_t ab = static_cast<uint32_t>(a) | (static_cast<uint32_t>(b) << 16);     // k0 k4 k1 k5
  const uint32_t cd = static_cast<uint32_t>(c) | (static_cast<uint32_t>(d) << 16);     // k2 k6 k3 k7
  lo = __byte_perm(ab, cd, 0x6420);
  hi = __byte_perm(ab, cd, 0x7531);
}

// One thread's share of a 128-wide K window: 32 K of rows g and g + 8 (16 bytes of codes each,
// their group scales) and of its tokens g (and g + 8), loaded; then the MMAs into c.
template <int kGroups>
struct Window {
  uint4 w0, w1;
  uint4 xa[kGroups], xb[kGroups];
  uint32_t s0, s1;

  __device__ __forceinline__ void load(const uint8_t* row0, const uint8_t* row1, const uint8_t* sc0,
                                       const uint8_t* sc1, const uint8_t* const (&xrow)[kGroups], long w) {
    w0 = ldg16(row0 + w * (kWindow / 2));
    w1 = ldg16(row1 + w * (kWindow / 2));
    s0 = __ldg(sc0 + w);
    s1 = __ldg(sc1 + w);
#pragma unroll
    for (int t = 0; t < kGroups; ++t) {
      xa[t] = ldg16(xrow[t] + w * kWindow);
      xb[t] = ldg16(xrow[t] + w * kWindow + 16);
    }
  }

  // keep: all ones for a token of the product, zero for a lane past M (no branch between the
  // loads and the MMAs, which lets the loads of a step run ahead).
  __device__ __forceinline__ void mma(float (&c)[kGroups][4], const uint32_t (&keep)[kGroups]) const {
    uint32_t e0, o0, e1, o1;
    scale_pairs(s0, e0, o0);
    scale_pairs(s1, e1, o1);
    const uint32_t r0[4] = {w0.x, w0.y, w0.z, w0.w}, r1[4] = {w1.x, w1.y, w1.z, w1.w};
    uint32_t a0[8], a1[8];  // E4M3 weights of rows g and g + 8, K 4j .. 4j + 3 of the thread's 32
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      decode8(r0[i], e0, o0, a0[2 * i], a0[2 * i + 1]);
      decode8(r1[i], e1, o1, a1[2 * i], a1[2 * i + 1]);
    }
#pragma unroll
    for (int t = 0; t < kGroups; ++t) {
      const uint32_t xx[8] = {xa[t].x & keep[t], xa[t].y & keep[t], xa[t].z & keep[t], xa[t].w & keep[t],
                              xb[t].x & keep[t], xb[t].y & keep[t], xb[t].z & keep[t], xb[t].w & keep[t]};
#pragma unroll
      for (int j = 0; j < 4; ++j)  // MMA j: K 8j .. 8j + 7 of the thread's 32
        mma_e4m3(c[t], a0[2 * j], a1[2 * j], a0[2 * j + 1], a1[2 * j + 1], xx[2 * j], xx[2 * j + 1]);
    }
  }
};

// kUnroll: windows per pipelined step (loads in flight per warp); kMinBlocks: CTAs per SM the
// register budget is held to (ptxas -v, sm_90, <kGroups, kUnroll>: <1, 1> 77 registers, <1, 2> 126,
// <1, 4> 246, <2, 1> 116, <2, 2> 212, <2, 4> 255 and 32 bytes of stack; 17..32 tokens run
// <4, 1>, 191, unroll ignored; eight groups (64 tokens, 255 and spills) measured slower than the
// GEMMs: 104.8 us on 4096 x 14336 against 83.1).
// TOut: the output's element type.
template <int kGroups, int kUnroll, int kMinBlocks, typename TOut>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) gemv_kernel(Params p) {
  __shared__ jaxlp::SplitSums<kWarps, kGroups * 4> sums;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tg = lane & 3;  // mma fragment coordinates
  const int row0 = blockIdx.y * kRows, split = blockIdx.x;
  const long half_k = static_cast<long>(p.k) / 2, groups = static_cast<long>(p.k) / kWindow;
  const uint8_t* row_a = p.codes + (row0 + g) * half_k + tg * 16;
  const uint8_t* row_b = row_a + 8 * half_k;
  const uint8_t* sc_a = p.scales + (row0 + g) * groups;
  const uint8_t* sc_b = sc_a + 8 * groups;
  uint32_t keep[kGroups];
  const uint8_t* xrow[kGroups];
#pragma unroll
  for (int t = 0; t < kGroups; ++t) {
    const int token = g + kTokenGroup * t;
    keep[t] = token < p.m ? 0xFFFFFFFFu : 0u;
    xrow[t] = p.x + (keep[t] ? token : 0) * static_cast<long>(p.k) + tg * 32;
  }

  float c[kGroups][4] = {};
  const int windows = static_cast<int>(groups), stride = kWarps * p.splits;
  // Steps of kUnroll windows, software-pipelined: a step's loads are issued before the MMAs of the
  // step loaded the iteration before. Windows past K load window `first` again and feed zeros.
  const int first = split * kWarps + warp;
  Window<kGroups> cur[kUnroll], next[kUnroll];
  uint32_t keep_next[kUnroll][kGroups];
  auto load_step = [&](int w0) {
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int w = w0 + j * stride;
#pragma unroll
      for (int t = 0; t < kGroups; ++t) keep_next[j][t] = w < windows ? keep[t] : 0u;
      next[j].load(row_a, row_b, sc_a, sc_b, xrow, w < windows ? w : first);
    }
  };
  if (first < windows) load_step(first);
  for (int w0 = first; w0 < windows; w0 += kUnroll * stride) {
    uint32_t keep_cur[kUnroll][kGroups];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      cur[j] = next[j];
#pragma unroll
      for (int t = 0; t < kGroups; ++t) keep_cur[j][t] = keep_next[j][t];
    }
    if (w0 + kUnroll * stride < windows) load_step(w0 + kUnroll * stride);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) cur[j].mma(c, keep_cur[j]);
  }
  float sum[kGroups * 4];  // c flat: 4 per token group
#pragma unroll
  for (int t = 0; t < kGroups; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) sum[4 * t + i] = c[t][i];
  if (!jaxlp::split_sums(sum, sums, warp, lane, p.splits)) return;
  TOut* out = static_cast<TOut*>(p.out);
#pragma unroll
  for (int t = 0; t < kGroups; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // c0, c1: row g, tokens 2tg, 2tg + 1 of the group; c2, c3: row g + 8.
      const int m = kTokenGroup * t + 2 * tg + (i & 1), n = row0 + g + 8 * (i >> 1);
      if (m < p.m) {
        float ts = p.token_scale[m];
        if (p.bf16_token_scale) ts = __bfloat162float(__float2bfloat16_rn(ts));
        out[static_cast<long>(m) * p.n + n] = jaxlp::to_out<TOut>((sum[4 * t + i] * ts) * p.multiplier);
      }
    }
  }
}

// The whole weight decoded: each thread 32 K of a row (16 bytes of codes, one scale) -> 32 E4M3
// bytes, grid-stride over the [N, K / 32] chunks.
__global__ void __launch_bounds__(256) decode_kernel(const uint8_t* __restrict__ codes,
                                                     const uint8_t* __restrict__ scales, uint8_t* __restrict__ w8,
                                                     long chunks, int chunks_per_row, int groups) {
  for (long c = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; c < chunks;
       c += static_cast<long>(gridDim.x) * blockDim.x) {
    const long row = c / chunks_per_row;
    const int j = static_cast<int>(c - row * chunks_per_row);  // 32-wide chunk of the row
    const uint4 r = ldg16(codes + c * 16);
    uint32_t s_even, s_odd;
    scale_pairs(__ldg(scales + row * groups + j / (kWindow / 32)), s_even, s_odd);
    uint4 lo, hi;
    decode8(r.x, s_even, s_odd, lo.x, lo.y);
    decode8(r.y, s_even, s_odd, lo.z, lo.w);
    decode8(r.z, s_even, s_odd, hi.x, hi.y);
    decode8(r.w, s_even, s_odd, hi.z, hi.w);
    uint4* out = reinterpret_cast<uint4*>(w8 + c * 32);
    out[0] = lo;
    out[1] = hi;
  }
}

// The CUTLASS FireQ GEMM's lookup tables (jaxlp/ffi/cutlass_fireq_gemm.cu): per group g and row n,
// e4m3(q * s) for q = -8 .. -1, the codes 8 .. 15 through decode8 (8 bytes; tables [groups, N, 8],
// each thread one entry, rows fastest: coalesced 8-byte stores).
__global__ void __launch_bounds__(256) tables_kernel(const uint8_t* __restrict__ scales, uint2* __restrict__ tables,
                                                     long entries, int n, int groups) {
  constexpr uint32_t kNegatives = 0xFEDCBA98u;  // nibble i = 8 + i: q = i - 8
  for (long e = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; e < entries;
       e += static_cast<long>(gridDim.x) * blockDim.x) {
    const long g = e / n, row = e - g * n;
    uint32_t s_even, s_odd;
    scale_pairs(__ldg(scales + row * groups + g), s_even, s_odd);
    uint2 t;
    decode8(kNegatives, s_even, s_odd, t.x, t.y);
    tables[e] = t;
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

inline ffi::Error bad(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp fireq gemv: " + msg);
}

// The grid: (split, row block), each row block's splits one cluster.
template <int kGroups, typename TOut>
cudaError_t launch(int unroll, cudaStream_t stream, const Params& p) {
  const dim3 grid(p.splits, p.n / kRows), block(kWarps * 32);
  const int c = p.splits;
  if constexpr (kGroups > 2) {  // 17..32 tokens: one window at a time (the tokens' loads fill the registers)
    return jaxlp::launch_kernel(gemv_kernel<kGroups, 1, 1, TOut>, grid, block, 0, stream, c, false, p);
  } else {
    switch (unroll) {
      case 1:
        return jaxlp::launch_kernel(gemv_kernel<kGroups, 1, kGroups == 1 ? 3 : 2, TOut>, grid, block, 0, stream, c,
                                    false, p);
      case 2:
        return jaxlp::launch_kernel(gemv_kernel<kGroups, 2, kGroups == 1 ? 2 : 1, TOut>, grid, block, 0, stream, c,
                                    false, p);
      default:
        return jaxlp::launch_kernel(gemv_kernel<kGroups, 4, 1, TOut>, grid, block, 0, stream, c, false, p);
    }
  }
}

template <typename TOut>
cudaError_t launch_groups(int unroll, cudaStream_t stream, const Params& p) {
  const int groups = (p.m + kTokenGroup - 1) / kTokenGroup;
  return groups == 1   ? launch<1, TOut>(unroll, stream, p)
         : groups == 2 ? launch<2, TOut>(unroll, stream, p)
                       : launch<4, TOut>(unroll, stream, p);
}

ffi::Error Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> codes, ffi::AnyBuffer scales,
                ffi::Buffer<ffi::F32> token_scale, ffi::Result<ffi::AnyBuffer> out, int32_t splits, int32_t unroll,
                float multiplier, int32_t bf16_token_scale) {
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2)
    return bad("expected x [M, K], codes [N, K / 2], scales [N, K / 128]");
  const int64_t m = xd[0], k = xd[1], n = cd[0];
  if (x.element_type() != ffi::DataType::F8E4M3FN || scales.element_type() != ffi::DataType::F8E4M3FN)
    return bad("x and scales must be float8_e4m3fn");
  if (m < 1 || m > kMaxTokens) return bad("1 to 32 tokens, got " + std::to_string(m));
  if (k % kWindow) return bad("K must be a multiple of 128, got " + std::to_string(k));
  if (cd[1] * 2 != k) return bad("codes [N, K / 2] do not match x's K");
  if (sd[0] != n || sd[1] * kWindow != k) return bad("scales must be [N, K / 128]");
  if (n % kRows) return bad("N must be a multiple of 16, got " + std::to_string(n));
  if (token_scale.dimensions().size() != 1 || token_scale.dimensions()[0] != m)
    return bad("token_scale must be float32 [M]");
  if (const char* e = jaxlp::output_error(out, m, n, splits)) return bad(e);
  if (unroll != 1 && unroll != 2 && unroll != 4) return bad("unroll must be 1, 2 or 4, got " + std::to_string(unroll));
  Params p;
  p.codes = codes.typed_data();
  p.scales = reinterpret_cast<const uint8_t*>(scales.untyped_data());
  p.x = reinterpret_cast<const uint8_t*>(x.untyped_data());
  p.out = out->untyped_data();
  p.token_scale = token_scale.typed_data();
  p.multiplier = multiplier;
  p.bf16_token_scale = bf16_token_scale != 0;
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.splits = splits;
  if (n == 0) return ffi::Error::Success();
  const cudaError_t e = jaxlp::with_out_type(out->element_type(), [&](auto out_type) {
    return launch_groups<decltype(out_type)>(unroll, stream, p);
  });
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxlp fireq gemv launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error DecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> codes, ffi::AnyBuffer scales,
                      ffi::Result<ffi::AnyBuffer> w8) {
  auto cd = codes.dimensions(), sd = scales.dimensions(), wd = w8->dimensions();
  if (cd.size() != 2 || sd.size() != 2 || wd.size() != 2)
    return bad("decode: expected codes [N, K / 2], scales [N, K / 128], w8 [N, K]");
  const int64_t n = wd[0], k = wd[1];
  if (scales.element_type() != ffi::DataType::F8E4M3FN || w8->element_type() != ffi::DataType::F8E4M3FN)
    return bad("decode: scales and w8 must be float8_e4m3fn");
  if (k % kWindow || cd[0] != n || cd[1] * 2 != k || sd[0] != n || sd[1] * kWindow != k)
    return bad("decode: codes [N, K / 2] and scales [N, K / 128] must match w8 [N, K] with K a multiple of 128");
  const long chunks = n * k / 32;
  if (chunks == 0) return ffi::Error::Success();
  const int blocks = static_cast<int>(std::min<long>((chunks + 255) / 256, 132L * 16));
  decode_kernel<<<blocks, 256, 0, stream>>>(codes.typed_data(), reinterpret_cast<const uint8_t*>(scales.untyped_data()),
                                            reinterpret_cast<uint8_t*>(w8->untyped_data()), chunks,
                                            static_cast<int>(k / 32), static_cast<int>(k / kWindow));
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxlp fireq decode launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error TablesImpl(cudaStream_t stream, ffi::AnyBuffer scales, ffi::Result<ffi::Buffer<ffi::U8>> tables) {
  auto sd = scales.dimensions(), td = tables->dimensions();
  if (scales.element_type() != ffi::DataType::F8E4M3FN || sd.size() != 2)
    return bad("tables: scales must be float8_e4m3fn [N, K / 128]");
  const int64_t n = sd[0], groups = sd[1];
  if (td.size() != 3 || td[0] != groups || td[1] != n || td[2] != 8)
    return bad("tables: the tables must be uint8 [K / 128, N, 8] for scales [N, K / 128]");
  const long entries = n * groups;
  if (entries == 0) return ffi::Error::Success();
  const int blocks = static_cast<int>(std::min<long>((entries + 255) / 256, 132L * 16));
  tables_kernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<const uint8_t*>(scales.untyped_data()),
                                            reinterpret_cast<uint2*>(tables->typed_data()), entries,
                                            static_cast<int>(n), static_cast<int>(groups));
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxlp fireq tables launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace jaxlp_fireq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpFireqGemv, jaxlp_fireq::Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x8 [M, K] float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::U8>>()    // codes [N, K / 2]
                                  .Arg<ffi::AnyBuffer>()          // scales [N, K / 128] float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()   // token_scale [M]
                                  .Ret<ffi::AnyBuffer>()          // out [M, N]
                                  .Attr<int32_t>("splits")        // CTAs per row block along K: 1..8
                                  .Attr<int32_t>("unroll")        // windows per pipelined step: 1, 2, 4
                                  .Attr<float>("multiplier")
                                  .Attr<int32_t>("bf16_token_scale"),  // 1: round token_scale to BF16 first
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpFireqDecode, jaxlp_fireq::DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()  // codes [N, K / 2]
                                  .Arg<ffi::AnyBuffer>()        // scales [N, K / 128] float8_e4m3fn
                                  .Ret<ffi::AnyBuffer>(),       // w8 [N, K] float8_e4m3fn
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpFireqTables, jaxlp_fireq::TablesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // scales [N, K / 128] float8_e4m3fn
                                  .Ret<ffi::Buffer<ffi::U8>>(),   // tables [K / 128, N, 8]
                              {ffi::Traits::kCmdBufferCompatible});
