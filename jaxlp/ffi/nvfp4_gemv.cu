// NVFP4 matmul kernels for Hopper (sm_90) behind XLA FFI custom calls.
//
//   y[m, n] = sum_k act(x)[m, k] * W[n, k]
//
// Four kernels (the dispatch table picks one per (M, N, K), see nvfp4_dispatch.py):
// - gemv_kernel ("regs", M <= 32, any K % 16 == 0): described below; FP16 tensor cores, a staging
//   kernel per call. Handler JaxlpNvfp4Gemv.
// - pipe_kernel ("pipe", M <= 32, K % 64 == 0): cp.async ring per warp, persistent clusters with
//   split-K, BF16 tensor cores; W4A16 reads BF16 x directly (one launch per call). Handler
//   JaxlpNvfp4Matmul. See its section.
// - pipe_kernel<..., kDecF16> ("pipe16", M <= 32, K % 64 == 0): the same ring and clusters with
//   gemv_kernel's arithmetic (FP16 decode, FP16 tensor cores) on the staged FP16 x_eff; launched
//   by JaxlpNvfp4Gemv after its staging kernel (kernel = 3). See PipeDecode.
// - gemm_kernel ("gemm", any M, K % 64 == 0): 64/128 x 64/128 CTA tiles, optional cluster split-K,
//   BF16 mma.sync with weights decoded in registers. Handler JaxlpNvfp4Matmul. See its section.
// W4A4 activations are quantized by stage_a4_kernel (bit-exact ModelOpt numerics); the tensor
// scale g_x comes as a scalar, or as the calibrated amax from which the kernels derive it
// (act_scale), so that no XLA op runs for it inside a decode loop.
//
// The rest of this header describes gemv_kernel:
//
// Weights: NVFP4 with ModelOpt layout: data uint8 [N, K/2] (even k in the low nibble),
// E4M3 block scales uint8 [N, K/16] row-major, FP32 tensor scale g_w (device scalar).
// Activations: BF16/F32 x [M, K]; either used as is (W4A16) or quantized to NVFP4 with a
// static tensor scale g_x and dynamic E4M3 scales per 16 elements of each token (W4A4).
//
// Two kernels per call, the second launched with programmatic dependent launch (PDL) so that
// its weight stream starts while the first one still runs:
//
// 1. stage: activations -> x_eff, FP16 [M, Kp] (Kp = K rounded up to 256, zero padded),
//    each group of 8 stored in the order x0 x4 x1 x5 x2 x6 x3 x7 (see decode below).
//    W4A16: x_eff = x * 2^-e per (token, 256-chunk), e from the chunk's amax, so that every
//           BF16 value is exact in FP16; xs[m, chunk] = 2^e (FP32) scales the chunk's partial.
//    W4A4:  x_eff = e2m1(q) * e4m3(s_x), exact in FP16 (ModelOpt numerics, IEEE divisions).
// 2. gemv: one CTA = 16*R output rows x all of K, its warps split K (KSPLIT) by interleaved
//    256-k chunks (warp w takes chunks w, w + KSPLIT, ...). Each thread loads 64 consecutive k
//    (32 bytes, two 128-bit loads) of rows g and g+8 of each 16-row tile (g = lane/4, t = lane%4
//    owns k in [256c + 64t, +64)); decodes FP4 in registers with the FP16 bit trick: nibble n ->
//    ((n&8)<<12)|((n&7)<<9) read as FP16 is e2m1(n) * 2^-14 (built per byte, 8 nibbles of a
//    32-bit word in 11 integer ops, pairs (i, i+4) placed by PRMT); multiplies by e4m3(s_w) * 2^7 in FP16
//    (HMUL2; e2m1 * e4m3 * 2^-7 is exact in FP16 for every valid scale), and feeds the result
//    as the A operand of mma.sync m16n8k16 (FP16 x FP16 -> FP32) whose B operand is x_eff for
//    8 tokens (n = token). Every product is exact and every sum is FP32, so W4A4 matches the
//    FP32 emulation of ModelOpt up to summation order. Tokens of one launch share each weight
//    tile (NT = ceil(M/8) MMAs per decoded A fragment), each thread keeps R*NT*4 independent
//    FP32 accumulators, and warps reduce their K-partials through shared memory at the end.
//    Output: y = acc * g_w * 2^7 (* g_x for W4A4), rounded once to the output dtype.

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "launch.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxlp_nvfp4 {

constexpr int kChunkK = 256;   // k per warp step (4 threads x 64 k)
constexpr int kMaxKSplit = 8;  // warps per CTA at most
constexpr int kMaxM = 32;

enum ActMode : int { kA16 = 0, kA4 = 1, kProbe = 2 };  // kProbe: W4A16 staging, weights loaded, no math

// ---------------------------------------------------------------------------------------------
// Small device helpers

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Streaming 128-bit load of weights: read-only path, not kept in L1; L2 fetches the
// surrounding 256 bytes, i.e. the next chunks of the same row.
__device__ __forceinline__ uint4 ld_stream_v4(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ uint2 ld_stream_v2(const void* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

// Activations: plain (coherent) loads that stay in L1; the next chunk is prefetched into L1.
__device__ __forceinline__ uint4 ld_act_v4(const void* p) {
  uint4 r;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

__device__ __forceinline__ uint32_t ld_u16(const void* p) {
  unsigned short r;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t ld_u32(const void* p) {
  uint32_t r;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t ld_u8(const void* p) {
  unsigned short r;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}

// FP16x2 multiply, round to nearest, subnormals kept (no .ftz).
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Two E4M3 bytes (low byte first) -> FP16x2, exact.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
  uint32_t d;
  unsigned short s = static_cast<unsigned short>(two_bytes);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(s));
  return d;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// FP4 nibbles of a 32-bit word (n_j in bits 4j..4j+3) -> four FP16x2 pairs {n_i, n_{i+4}}, i = 0..3,
// each value e2m1(n) * 2^-14. The FP16 pattern of nibble n is ((n&8)<<12)|((n&7)<<9): a high byte
// (n&8)<<4 | (n&7)<<1 over a zero low byte. `even` holds that byte for the even nibbles (one per
// byte of w), `odd` for the odd ones; one PRMT per pair places two of them over zero low bytes.
__device__ __forceinline__ void decode_word(uint32_t w, uint32_t (&pair)[4]) {
  const uint32_t even = ((w << 4) & 0x80808080u) | ((w << 1) & 0x0E0E0E0Eu);
  const uint32_t odd = (w & 0x80808080u) | ((w >> 3) & 0x0E0E0E0Eu);
  pair[0] = prmt(even, 0u, 0x2404u);  // n0, n4
  pair[1] = prmt(odd, 0u, 0x2404u);   // n1, n5
  pair[2] = prmt(even, 0u, 0x3414u);  // n2, n6
  pair[3] = prmt(odd, 0u, 0x3414u);   // n3, n7
}

__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Eight consecutive activations (16-byte aligned for BF16, 32 for F32) as floats.
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Eight activations stored in the kernel order x0 x4 x1 x5 x2 x6 x3 x7 as one 16-byte store.
__device__ __forceinline__ void store8_permuted(uint16_t* dst, const float (&v)[8]) {
  uint4 u;
  u.x = pack_half2(v[0], v[4]);
  u.y = pack_half2(v[1], v[5]);
  u.z = pack_half2(v[2], v[6]);
  u.w = pack_half2(v[3], v[7]);
  *reinterpret_cast<uint4*>(dst) = u;
}

// The static NVFP4 tensor scale of activations from their calibrated amax, as
// jaxlp.quantization.nvfp4_dispatch.act_tensor_scale computes it: max(amax, 1e-12) / (6 * 448),
// correctly rounded, at least 2^-117. g_is_amax = 0: *g already is the tensor scale.
__device__ __forceinline__ float act_scale(const float* g, int g_is_amax) {
  if (!g_is_amax) return *g;
  return fmaxf(__fdiv_rn(fmaxf(*g, 1e-12f), 2688.0f), 0x1p-117f);
}

__device__ __forceinline__ float exp2_int(int e) {  // 2^e for -126 <= e <= 127
  return __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
}

// E2M1 code of a quotient: clip to +-6, round to nearest, ties to even (ModelOpt); the sign bit
// is set iff the quotient is negative and nonzero (so -0.0 encodes as +0). NaN -> 0.
__device__ __forceinline__ uint32_t e2m1_code(float q) {
  float a = fabsf(q);
  a = a > 6.0f ? 6.0f : a;
  const uint32_t mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                       (a > 5.0f);
  const uint32_t bits = __float_as_uint(q);
  const uint32_t neg = (bits >> 31) & ((bits & 0x7FFFFFFFu) != 0);
  return mag | (neg << 3);
}

__device__ __forceinline__ float e2m1_value(uint32_t code) {  // the FP16 bit trick, times 2^14
  const unsigned short bits = static_cast<unsigned short>(((code & 8u) << 12) | ((code & 7u) << 9));
  return __half2float(__ushort_as_half(bits)) * 16384.0f;
}

// ---------------------------------------------------------------------------------------------
// Stage 1: activations -> x_eff

// W4A16: one thread per group of 8 k; the 32 threads (one warp) of a 256-chunk share its exponent.
template <typename TIn>
__global__ void __launch_bounds__(256) stage_a16_kernel(const TIn* __restrict__ x, uint16_t* __restrict__ xeff,
                                                        float* __restrict__ xs, int M, int K, int Kp) {
  pdl_launch_dependents();
  const int groups = Kp / 8;  // a multiple of 32, so each warp is one chunk of one token
  const int gid = blockIdx.x * blockDim.x + threadIdx.x;
  const int tok = gid / groups, grp = gid - tok * groups;
  const bool active = tok < M;
  const int k = grp * 8;
  float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (active && k < K) load8(x + static_cast<int64_t>(tok) * K + k, v);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  // amax in [2^e, 2^(e+1)): scale by 2^(14-e) so that the chunk lies below 2^15 (FP16 max 65504).
  int shift = 0;
  if (amax > 0.f && amax <= 3.4028235e38f) {
    int ex;
    frexpf(amax, &ex);
    shift = 15 - ex;
    shift = shift < -100 ? -100 : (shift > 100 ? 100 : shift);
  }
  if (!active) return;
  const float up = exp2_int(shift);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] *= up;  // exact: a power of two, no overflow
  store8_permuted(xeff + static_cast<int64_t>(tok) * Kp + k, v);
  if ((grp & 31) == 0) xs[static_cast<int64_t>(tok) * (Kp / kChunkK) + grp / 32] = exp2_int(-shift);
}

// W4A4 / standalone quantizer: LANES threads (1, 2 or 4, adjacent lanes of a warp) per 16-element
// block of one token, 16 / LANES elements each; the block's amax is shared by shuffles.
// Writes x_eff (if xeff != nullptr; blocks in [K, Kp) as zeros) and the NVFP4 codes and scales
// (if codes != nullptr).
// XOUT: layout of x_eff: kXeffF16 (FP16, groups of 8 permuted, rows padded to Kp; LANES <= 2) for
// gemv_kernel, kXeffBF16 (BF16, natural order, Kp == K) for pipe_kernel and gemm_kernel.
enum XeffLayout : int { kXeffF16 = 0, kXeffBF16 = 1 };

// Four consecutive activations (8-byte aligned for BF16, 16 for F32) as floats.
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&v)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  v[0] = __uint_as_float(u.x << 16);
  v[1] = __uint_as_float(u.x & 0xFFFF0000u);
  v[2] = __uint_as_float(u.y << 16);
  v[3] = __uint_as_float(u.y & 0xFFFF0000u);
}
__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}

template <typename TIn, int E>
__device__ __forceinline__ void load_elements(const TIn* p, float (&v)[E]) {
  if constexpr (E == 4) {
    load4(p, v);
  } else {
#pragma unroll
    for (int h = 0; h < E / 8; ++h) {
      float a[8];
      load8(p + 8 * h, a);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[8 * h + i] = a[i];
    }
  }
}

template <typename TIn, int XOUT = kXeffF16, int LANES = 1>
__global__ void __launch_bounds__(256) stage_a4_kernel(const TIn* __restrict__ x, const float* __restrict__ gptr,
                                                       uint16_t* __restrict__ xeff, uint8_t* __restrict__ codes,
                                                       uint8_t* __restrict__ scales, int M, int K, int Kp,
                                                       int g_is_amax = 0) {
  static_assert(LANES == 1 || LANES == 2 || LANES == 4, "1, 2 or 4 threads per block");
  static_assert(XOUT == kXeffBF16 || LANES <= 2, "the FP16 x_eff layout permutes groups of 8");
  constexpr int E = 16 / LANES;
  pdl_launch_dependents();
  const int blocks = (xeff != nullptr ? Kp : K) / 16;
  const int gid = blockIdx.x * blockDim.x + threadIdx.x;
  const int bid = gid / LANES, part = gid % LANES;
  const int tok = bid / blocks, blk = bid - tok * blocks;
  if (tok >= M) return;  // whole blocks leave together: the shuffles below see only their own lanes
  const int k = blk * 16 + part * E;
  if (blk * 16 >= K) {
    const float z[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int h = 0; h < E / 8; ++h) store8_permuted(xeff + static_cast<int64_t>(tok) * Kp + k + 8 * h, z);
    return;
  }
  const float g = act_scale(gptr, g_is_amax);
  float v[E];
  load_elements<TIn, E>(x + static_cast<int64_t>(tok) * K + k, v);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < E; ++i) amax = fmaxf(amax, fabsf(v[i]));
  if constexpr (LANES > 1) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned mask = ((1u << LANES) - 1u) << (lane & ~(LANES - 1u));
#pragma unroll
    for (int off = LANES / 2; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, off, LANES));
  }
  float s = __fdiv_rn(amax, __fmul_rn(6.0f, g));
  if (s == 0.f) s = 1.0f;
  s = fminf(fmaxf(s, 0.001953125f), 448.0f);  // [2^-9, 448]
  const __nv_fp8_storage_t s8 = __nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3);
  const float sf = __half2float(__half(__nv_cvt_fp8_to_halfraw(s8, __NV_E4M3)));
  const float denom = __fmul_rn(sf, g);
  uint32_t code[E];
#pragma unroll
  for (int i = 0; i < E; ++i) code[i] = e2m1_code(__fdiv_rn(v[i], denom));
  if (xeff != nullptr && XOUT == kXeffBF16) {
    uint32_t packed[E / 2];
#pragma unroll
    for (int i = 0; i < E / 2; ++i) {  // e2m1 * e4m3: at most 6 significant bits, exact in BF16
      const __nv_bfloat162 b = __floats2bfloat162_rn(e2m1_value(code[2 * i]) * sf, e2m1_value(code[2 * i + 1]) * sf);
      packed[i] = *reinterpret_cast<const uint32_t*>(&b);
    }
    uint16_t* dst = xeff + static_cast<int64_t>(tok) * Kp + k;
    if constexpr (E == 4) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
    } else {
#pragma unroll
      for (int h = 0; h < E / 8; ++h)
        reinterpret_cast<uint4*>(dst)[h] = make_uint4(packed[4 * h], packed[4 * h + 1], packed[4 * h + 2], packed[4 * h + 3]);
    }
  } else if (xeff != nullptr) {
#pragma unroll
    for (int h = 0; h < E / 8; ++h) {
      float e[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) e[i] = e2m1_value(code[8 * h + i]) * sf;  // exact
      store8_permuted(xeff + static_cast<int64_t>(tok) * Kp + k + 8 * h, e);
    }
  }
  if (codes != nullptr) {
    uint32_t word[(E + 7) / 8] = {};
#pragma unroll
    for (int i = 0; i < E; ++i) word[i / 8] |= code[i] << (4 * (i % 8));
    uint8_t* dst = codes + static_cast<int64_t>(tok) * (K / 2) + k / 2;
    if constexpr (E == 16) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(word[0], word[1]);
    } else if constexpr (E == 8) {
      *reinterpret_cast<uint32_t*>(dst) = word[0];
    } else {
      *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(word[0]);
    }
    if (part == 0) scales[static_cast<int64_t>(tok) * (K / 16) + blk] = s8;
  }
}

// ---------------------------------------------------------------------------------------------
// Stage 2: the GEMV

struct GemvParams {
  const uint8_t* wdata;   // [N, K/2]
  const uint8_t* wscale;  // [N, K/16]
  const float* wg;        // g_w
  const float* xg;        // g_x (W4A4)
  const uint16_t* xeff;   // [M, Kp] FP16
  const float* xs;        // [M, Kp/256] (W4A16)
  void* y;                // [M, N]
  int M, N, K, Kp;
  int vec16;  // 1: rows 16-byte aligned (K % 32 == 0), 128-bit loads; 0: 64-bit loads (K % 32 == 16)
  int scale32;  // 1: scale rows 4-byte aligned (K % 64 == 0), one 32-bit load per 4 blocks
  int xg_amax;  // 1: xg holds the activations' calibrated amax (see act_scale)
};

// One warp step: thread t of a 16-row tile owns k in [256c + 64t, +64) of rows g and g+8:
// 32 bytes (two 128-bit loads) of nibbles and 4 E4M3 block scales per row.
template <int R, int NT, int MODE>
struct Stage {
  uint4 w[R][2][2];   // [tile][row g / g+8][first / second 32 k]
  uint32_t s[R][2];   // 4 block scales per row (byte b = block b)
  float xs[NT][2];    // W4A16: chunk scales of tokens 8*nt + 2t, +1
  int k0;
};

template <int R, int NT, int MODE>
__device__ __forceinline__ void load_weights(Stage<R, NT, MODE>& st, const GemvParams& p,
                                             const uint8_t* const (&wrow)[R][2], const uint8_t* const (&srow)[R][2],
                                             int k0) {
#pragma unroll
  for (int rt = 0; rt < R; ++rt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint8_t* wp = wrow[rt][h] + k0 / 2;
      const uint8_t* sp = srow[rt][h] + k0 / 16;
      uint4 a = make_uint4(0u, 0u, 0u, 0u), b = make_uint4(0u, 0u, 0u, 0u);
      uint32_t s = 0u;
      if (p.vec16) {
        if (k0 < p.K) a = ld_stream_v4(wp);
        if (k0 + 32 < p.K) b = ld_stream_v4(wp + 16);
      } else {  // four 64-bit pieces, each one 16-element block
        if (k0 < p.K) {
          const uint2 v = ld_stream_v2(wp);
          a.x = v.x;
          a.y = v.y;
        }
        if (k0 + 16 < p.K) {
          const uint2 v = ld_stream_v2(wp + 8);
          a.z = v.x;
          a.w = v.y;
        }
        if (k0 + 32 < p.K) {
          const uint2 v = ld_stream_v2(wp + 16);
          b.x = v.x;
          b.y = v.y;
        }
        if (k0 + 48 < p.K) {
          const uint2 v = ld_stream_v2(wp + 24);
          b.z = v.x;
          b.w = v.y;
        }
      }
      if (p.scale32) {
        if (k0 < p.K) s = ld_u32(sp);
      } else {
#pragma unroll
        for (int blk = 0; blk < 4; ++blk)
          if (k0 + 16 * blk < p.K) s |= ld_u8(sp + blk) << (8 * blk);
      }
      st.w[rt][h][0] = a;
      st.w[rt][h][1] = b;
      st.s[rt][h] = s;
    }
  }
}

// Prefetch the chunk's activations into L1 and load its W4A16 chunk scales.
template <int R, int NT, int MODE>
__device__ __forceinline__ void load_acts(Stage<R, NT, MODE>& st, const GemvParams& p, int g, int t, int k0, int c) {
  st.k0 = k0;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = nt * 8 + g;
    if (tok < p.M) {
      const uint16_t* src = p.xeff + static_cast<int64_t>(tok) * p.Kp + k0;
      prefetch_l1(src);
      prefetch_l1(src + 32);
    }
    if (MODE == kA16) {
      const int chunks = p.Kp / kChunkK;
      const int t0 = nt * 8 + 2 * t;
      st.xs[nt][0] = t0 < p.M ? p.xs[static_cast<int64_t>(t0) * chunks + c] : 0.f;
      st.xs[nt][1] = t0 + 1 < p.M ? p.xs[static_cast<int64_t>(t0 + 1) * chunks + c] : 0.f;
    }
  }
}

// ACC = 2: the two 32-k halves of the item accumulate into separate MMA chains (8 dependent
// MMAs each instead of 16), added at the end of the item. LEAN: the activations of each 8-k word
// are loaded (from L1) just before its MMAs instead of per 32 k (12 fewer live registers).
template <int R, int NT, int MODE, int ACC = 1, bool LEAN = false>
__device__ __forceinline__ void compute(const Stage<R, NT, MODE>& st, const GemvParams& p, int g,
                                        float (&acc)[R][NT][4]) {
  constexpr uint32_t kTwo7 = 0x58005800u;  // FP16x2 {128, 128}
  if constexpr (MODE == kProbe) {  // diagnostic: the memory stream alone (result ~0, loads kept)
#pragma unroll
    for (int rt = 0; rt < R; ++rt) {
      uint32_t v = st.s[rt][0] ^ st.s[rt][1];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < 2; ++q) v ^= st.w[rt][h][q].x ^ st.w[rt][h][q].y ^ st.w[rt][h][q].z ^ st.w[rt][h][q].w;
      acc[rt][0][0] += static_cast<float>(v & 1u) * 1e-30f;
    }
    return;
  }
  float part[ACC][R][NT][4];
#pragma unroll
  for (int a = 0; a < ACC; ++a)
#pragma unroll
    for (int rt = 0; rt < R; ++rt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) part[a][rt][nt][i] = (MODE == kA16 || a > 0) ? 0.f : acc[rt][nt][i];

#pragma unroll
  for (int half = 0; half < 2; ++half) {  // the thread's first / second 32 k: blocks 2*half, 2*half+1
    const int a = ACC == 2 ? half : 0;
    // B operands: x_eff of token 8*nt + g (16 FP16 pairs), zeros past M.
    uint4 x[NT][LEAN ? 1 : 4];
    if constexpr (!LEAN) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int tok = nt * 8 + g;
        const uint16_t* src = p.xeff + static_cast<int64_t>(tok) * p.Kp + st.k0 + 32 * half;
#pragma unroll
        for (int i = 0; i < 4; ++i) x[nt][i] = tok < p.M ? ld_act_v4(src + 8 * i) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
#pragma unroll
    for (int rt = 0; rt < R; ++rt) {
      // The two block scales * 2^7 in FP16, each broadcast to both halves: sc[row g / g+8][block].
      uint32_t sc[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t s2 = hmul2(e4m3x2_to_f16x2(half ? st.s[rt][h] >> 16 : st.s[rt][h] & 0xFFFFu), kTwo7);
        sc[h][0] = prmt(s2, s2, 0x1010u);
        sc[h][1] = prmt(s2, s2, 0x3232u);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // word j of this half: k in [8j, 8j+8), block j / 2 of the half
        const int blk = j >> 1;
        uint32_t r0[4], r1[4];
        decode_word(word_of(st.w[rt][0][half], j), r0);
        decode_word(word_of(st.w[rt][1][half], j), r1);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          r0[i] = hmul2(r0[i], sc[0][blk]);
          r1[i] = hmul2(r1[i], sc[1][blk]);
        }
        // Pairs q = 4j + i hold k (8j+i, 8j+i+4): MMA step 2j takes pairs 4j, 4j+1; 2j+1 takes 4j+2, 4j+3.
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if constexpr (LEAN) {
            const int tok = nt * 8 + g;
            x[nt][0] = tok < p.M ? ld_act_v4(p.xeff + static_cast<int64_t>(tok) * p.Kp + st.k0 + 32 * half + 8 * j)
                                 : make_uint4(0u, 0u, 0u, 0u);
          }
          const uint4 xv = x[nt][LEAN ? 0 : j];
          mma_16816(part[a][rt][nt], r0[0], r1[0], r0[1], r1[1], xv.x, xv.y);
          mma_16816(part[a][rt][nt], r0[2], r1[2], r0[3], r1[3], xv.z, xv.w);
        }
      }
    }
  }
  if constexpr (ACC == 2) {
#pragma unroll
    for (int rt = 0; rt < R; ++rt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) part[0][rt][nt][i] += part[1][rt][nt][i];
  }
#pragma unroll
  for (int rt = 0; rt < R; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (MODE == kA16) {  // C fragment: c0, c2 -> token 2t; c1, c3 -> token 2t+1
        acc[rt][nt][0] = fmaf(part[0][rt][nt][0], st.xs[nt][0], acc[rt][nt][0]);
        acc[rt][nt][1] = fmaf(part[0][rt][nt][1], st.xs[nt][1], acc[rt][nt][1]);
        acc[rt][nt][2] = fmaf(part[0][rt][nt][2], st.xs[nt][0], acc[rt][nt][2]);
        acc[rt][nt][3] = fmaf(part[0][rt][nt][3], st.xs[nt][1], acc[rt][nt][3]);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[rt][nt][i] = part[0][rt][nt][i];
      }
    }
}

// Resident CTAs (of 256 threads) per SM that the register budget aims for; OCC > 0 overrides it
// (OCC = 3: at most 80 registers per thread, 24 warps per SM; the "B3" variant, R = 1, M <= 8).
template <int R, int NT, int OCC>
constexpr int kMinBlocks = OCC > 0 ? OCC : (R * NT == 1 ? 2 : 1);

template <int R, int NT, int MODE, typename TOut, int OCC = 0, int ACC = 1>
__global__ void __launch_bounds__(256, (kMinBlocks<R, NT, OCC>)) gemv_kernel(const GemvParams p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row_base = blockIdx.x * (16 * R);
  const int chunks = p.Kp / kChunkK;
  const int64_t row_bytes = p.K / 2, row_scales = p.K / 16;

  const uint8_t* wrow[R][2];
  const uint8_t* srow[R][2];
#pragma unroll
  for (int rt = 0; rt < R; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = min(row_base + rt * 16 + g + 8 * h, p.N - 1);  // rows past N: load row N-1, never stored
      wrow[rt][h] = p.wdata + r * row_bytes;
      srow[rt][h] = p.wscale + r * row_scales;
    }

  float acc[R][NT][4];
#pragma unroll
  for (int rt = 0; rt < R; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rt][nt][i] = 0.f;

  // Warps take chunks warp, warp + nwarps, ...: at any time the CTA's warps read neighbouring
  // chunks, so each row is streamed in runs of nwarps * 128 bytes.
  Stage<R, NT, MODE> sa, sb;
  const int c0 = warp;
  if (c0 < chunks) load_weights(sa, p, wrow, srow, c0 * kChunkK + 64 * t);
  pdl_wait();  // x_eff is written by the stage kernel
  if (c0 < chunks) load_acts(sa, p, g, t, c0 * kChunkK + 64 * t, c0);
  for (int c = c0; c < chunks; c += 2 * nwarps) {
    const int c1 = c + nwarps, c2 = c + 2 * nwarps;
    if (c1 < chunks) {
      load_weights(sb, p, wrow, srow, c1 * kChunkK + 64 * t);
      load_acts(sb, p, g, t, c1 * kChunkK + 64 * t, c1);
    }
    compute<R, NT, MODE, ACC, (OCC >= 3)>(sa, p, g, acc);
    if (c1 >= chunks) break;
    if (c2 < chunks) {
      load_weights(sa, p, wrow, srow, c2 * kChunkK + 64 * t);
      load_acts(sa, p, g, t, c2 * kChunkK + 64 * t, c2);
    }
    compute<R, NT, MODE, ACC, (OCC >= 3)>(sb, p, g, acc);
  }

  // Reduce the K-partials of the warps; a fixed order, so results are deterministic.
  __shared__ float red[kMaxKSplit * R * NT * 4 * 32];
  constexpr int kPerWarp = R * NT * 4 * 32;
#pragma unroll
  for (int rt = 0; rt < R; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp * kPerWarp + ((rt * NT + nt) * 4 + i) * 32 + lane] = acc[rt][nt][i];
  __syncthreads();
  const float gscale = *p.wg * 128.0f * (MODE == kA4 ? act_scale(p.xg, p.xg_amax) : 1.0f);
  TOut* y = static_cast<TOut*>(p.y);
  for (int idx = threadIdx.x; idx < kPerWarp; idx += blockDim.x) {
    float s = 0.f;
    for (int w = 0; w < nwarps; ++w) s += red[w * kPerWarp + idx];
    const int l = idx & 31, i = (idx >> 5) & 3, tile = idx >> 7;
    const int nt = tile % NT, rt = tile / NT;
    const int row = row_base + rt * 16 + (l >> 2) + ((i & 2) ? 8 : 0);
    const int tok = nt * 8 + 2 * (l & 3) + (i & 1);
    if (row < p.N && tok < p.M) y[static_cast<int64_t>(tok) * p.N + row] = from_float<TOut>(s * gscale);
  }
}

// ---------------------------------------------------------------------------------------------
// BF16 building blocks of pipe_kernel and gemm_kernel

// FP4 nibbles of a 32-bit word -> four BF16x2 pairs {n_i, n_{i+4}}, i = 0..3, each e2m1(n) * 2^-126:
// the BF16 pattern of nibble n is ((n&8)<<12)|((n&7)<<6) (sign; 2 exponent bits and 1 mantissa bit
// over exponent bias 127 instead of E2M1's 1; code 1 (0.5) becomes the subnormal 2^-127).
// Two shifts and two masks per pair.
__device__ __forceinline__ void decode_word_bf16(uint32_t w, uint32_t (&pair)[4]) {
  pair[0] = ((w << 12) & 0x80008000u) | ((w << 6) & 0x01C001C0u);
  pair[1] = ((w << 8) & 0x80008000u) | ((w << 2) & 0x01C001C0u);
  pair[2] = ((w << 4) & 0x80008000u) | ((w >> 2) & 0x01C001C0u);
  pair[3] = (w & 0x80008000u) | ((w >> 6) & 0x01C001C0u);
}

// BF16x2 multiply, round to nearest, subnormal inputs kept (BF16 arithmetic has no .ftz).
__device__ __forceinline__ uint32_t hmul2_bf16(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Two E4M3 bytes (low byte first) -> BF16x2 {e4m3(b0) * 2^119, e4m3(b1) * 2^119}, exact
// (448 * 2^119 < 2^128). Times a decoded nibble: e2m1 * e4m3 * 2^-7, in [2^-17, 21], exact.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2_scaled(uint32_t two_bytes) {
  const uint32_t h = e4m3x2_to_f16x2(two_bytes);
  const float lo = __half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xFFFFu))) * 0x1p119f;
  const float hi = __half2float(__ushort_as_half(static_cast<unsigned short>(h >> 16))) * 0x1p119f;
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

__device__ __forceinline__ void mma_16816_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Eight BF16 activations in natural order (one 16-byte load) -> the B pairs that meet decode_word_bf16's
// pairs: b[0] = (x0, x4), b[1] = (x1, x5), b[2] = (x2, x6), b[3] = (x3, x7).
__device__ __forceinline__ void act_pairs(const uint4& v, uint32_t (&b)[4]) {
  b[0] = prmt(v.x, v.z, 0x5410u);
  b[1] = prmt(v.x, v.z, 0x7632u);
  b[2] = prmt(v.y, v.w, 0x5410u);
  b[3] = prmt(v.y, v.w, 0x7632u);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async: 16 bytes (L2 only) or 4 bytes; src_bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint4 ld_act_nc_v4(const void* p) {  // activations: read-only, kept in L1
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync_all() {  // every thread of every CTA of the cluster
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float ld_dsmem_f32(uint32_t local_addr, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_addr), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// ---------------------------------------------------------------------------------------------
// pipe_kernel: the small-M GEMV with a cp.async ring, BF16 tensor cores and no staging for W4A16.
//
// A cluster of C CTAs (8 warps each) owns tiles of 16*R output rows, persistently: cluster i takes
// tiles i, i + clusters, ... Its C*8 warps split K by interleaved 256-k chunks (warp w of CTA r takes
// chunks 8r + w, + 8C, ...), so every tile is streamed by C SMs. Each warp streams its (tile, chunk)
// items through a private S-stage shared-memory ring filled by cp.async (S-1 items in flight, across
// tile boundaries: the stream never drains between tiles). Per item a stage holds 16R rows x 128
// bytes of nibbles (16-byte units XOR-swizzled by row, conflict-free reads) and 16R x 16 scale bytes.
// Thread (g, t) reads 64 consecutive k of rows g and g+8 of each 16-row tile, decodes them to BF16
// (decode_word_bf16 times e4m3 * 2^119 -> e2m1 * e4m3 * 2^-7, exact), and feeds them as the A operand
// of mma.sync m16n8k16 (BF16 x BF16 -> FP32) whose B operand is the activations of 8 tokens: BF16 x as
// it is (W4A16; the products are exact) or the NVFP4-dequantized x_eff of the staging kernel (W4A4,
// exact in BF16), read through L1 (prefetched two items ahead). Per tile the warps' partials are
// reduced in a fixed order through shared memory (C = 1) or distributed shared memory (C > 1; one
// cluster barrier per tile); no atomics, deterministic. Needs K % 64 == 0.

constexpr int kPipeWarps = 8;

struct PipeParams {
  const uint8_t* wdata;             // [N, K/2]
  const uint8_t* wscale;            // [N, K/16]
  const float* wg;                  // g_w
  const float* xg;                  // g_x (W4A4) or nullptr
  const __nv_bfloat16* x;           // [M, K] BF16: x (W4A16) or x_eff (W4A4); kDecBF16 only
  const uint16_t* xh;               // [M, Kp] FP16 x_eff of the regs staging kernels; kDecF16 / kDecProbe
  const float* xs;                  // [M, Kp/256] W4A16 chunk scales of xh, or nullptr (W4A4)
  void* y;                          // [M, N]
  int M, N, K, Kp, tiles, chunks;
  int xg_amax;  // 1: xg holds the activations' calibrated amax (see act_scale)
};

// How pipe_kernel turns a stage into products:
// kDecBF16 ("pipe"): BF16 decode (decode_word_bf16, 16 integer ops per 8 nibbles) and BF16 mma.sync
//   on natural-order BF16 activations (4 PRMT per 8 to pair them).
// kDecF16 ("pipe16"): the regs GEMV's FP16 decode (decode_word, 11 integer ops per 8 nibbles) and
//   FP16 mma.sync on the staged, pre-permuted FP16 x_eff (W4A16: chunk-scaled by a power of two,
//   xs; W4A4: NVFP4-dequantized), i.e. regs' arithmetic inside the cp.async ring.
// kDecProbe: kDecF16's memory traffic (weights through the ring) without decode or MMA (diagnostic).
enum PipeDecode : int { kDecBF16 = 0, kDecF16 = 1, kDecProbe = 2 };

template <int R>
constexpr int kPipeStages = R == 1 ? 4 : 3;
// pipe16 (and its probe) with 16-row tiles: 3 stages, so that 3 CTAs (24 warps) fit an SM's shared
// memory instead of 2 (Nsight Compute on the H100: the GEMVs run at 25% occupancy, latency-bound).
template <int R, int DEC>
constexpr int kPipeStagesDec = DEC == kDecBF16 ? kPipeStages<R> : 3;
template <int R>
constexpr int kPipeStageBytes = R * 16 * (128 + 16);
template <int R, int NT>
constexpr int kPipeRedFloats = R * NT * 4 * 32;  // per warp
template <int R, int NT, int S>
constexpr int kPipeSmemBytes = kPipeWarps * S * kPipeStageBytes<R> + 2 * kPipeWarps * kPipeRedFloats<R, NT> * 4;
// Register budget (CTAs per SM of __launch_bounds__): the FP16 variants with a 2-stage ring fit 4 CTAs
// (R = 1, 45 KB of shared memory, <= 64 registers) or 2 (R = 2, 90 KB) per SM; otherwise the default.
template <int R, int DEC, int S>
constexpr int kPipeMinBlocks = (DEC != kDecBF16 && S == 2) ? (R == 1 ? 4 : 2) : 0;  // 0: not given

// kDecProbe: read the stage as pipe_item_f16 does, no arithmetic (the ring's traffic alone).
template <int R, int NT>
__device__ __forceinline__ void pipe_item_probe(const uint8_t* st, int kData, int g, int t, float (&acc)[R][NT][4]) {
#pragma unroll
  for (int rt = 0; rt < R; ++rt) {
    uint32_t v = 0u;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = rt * 16 + g + 8 * h;
      v ^= *reinterpret_cast<const uint32_t*>(st + kData + row * 16 + 4 * t);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint4 w = *reinterpret_cast<const uint4*>(st + row * 128 + (((2 * t + half) ^ g) << 4));
        v ^= w.x ^ w.y ^ w.z ^ w.w;
      }
    }
    acc[rt][0][0] += static_cast<float>(v & 1u) * 1e-30f;
  }
}

// One (tile, chunk) item of pipe_kernel<..., kDecF16>: thread (g, t) takes k [k0, k0 + 64)
// of rows g and g+8 of each 16-row tile from the ring stage `st`, decodes it as the regs GEMV does
// (FP16 bit trick, times e4m3 * 2^7 in FP16, exact) and multiplies it with FP16 x_eff of 8 tokens
// per MMA. W4A16: the chunk's partial times its power-of-two scale xs; W4A4: added as it is.
// ACC = 2: the two 32-k halves accumulate into separate MMA chains, added at the end of the item.
template <int R, int NT, int ACC = 1>
__device__ __forceinline__ void pipe_item_f16(const PipeParams& p, const uint8_t* st, int kData, int g, int t, int c,
                                              int k0, bool kval, float (&acc)[R][NT][4]) {
  constexpr uint32_t kTwo7 = 0x58005800u;  // FP16x2 {128, 128}
  float part[ACC][R][NT][4];
#pragma unroll
  for (int a = 0; a < ACC; ++a)
#pragma unroll
    for (int rt = 0; rt < R; ++rt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) part[a][rt][nt][i] = 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int a = ACC == 2 ? half : 0;
    uint4 x[NT][4];  // B operands: x_eff of token 8*nt + g, k [k0 + 32*half, +32) (16 FP16 pairs)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int tok = nt * 8 + g;
      const uint16_t* src = p.xh + static_cast<int64_t>(tok) * p.Kp + k0 + 32 * half;
#pragma unroll
      for (int i = 0; i < 4; ++i) x[nt][i] = (kval && tok < p.M) ? ld_act_v4(src + 8 * i) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int rt = 0; rt < R; ++rt) {
      uint32_t sc[2][2];  // [row g / g+8][block of the half]: e4m3 * 2^7 in FP16, broadcast to both halves
      uint4 wv[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = rt * 16 + g + 8 * h;
        wv[h] = *reinterpret_cast<const uint4*>(st + row * 128 + (((2 * t + half) ^ g) << 4));
        const uint32_t s4 = *reinterpret_cast<const uint32_t*>(st + kData + row * 16 + 4 * t);
        const uint32_t s2 = hmul2(e4m3x2_to_f16x2(half ? s4 >> 16 : s4 & 0xFFFFu), kTwo7);
        sc[h][0] = prmt(s2, s2, 0x1010u);
        sc[h][1] = prmt(s2, s2, 0x3232u);
      }
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        uint32_t r0[4], r1[4];
        decode_word(word_of(wv[0], w), r0);
        decode_word(word_of(wv[1], w), r1);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          r0[i] = hmul2(r0[i], sc[0][w >> 1]);
          r1[i] = hmul2(r1[i], sc[1][w >> 1]);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint4 xv = x[nt][w];
          mma_16816(part[a][rt][nt], r0[0], r1[0], r0[1], r1[1], xv.x, xv.y);
          mma_16816(part[a][rt][nt], r0[2], r1[2], r0[3], r1[3], xv.z, xv.w);
        }
      }
    }
  }
  if constexpr (ACC == 2) {
#pragma unroll
    for (int rt = 0; rt < R; ++rt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) part[0][rt][nt][i] += part[1][rt][nt][i];
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    float s0 = 1.f, s1 = 1.f;  // C fragment: c0, c2 -> token 2t; c1, c3 -> token 2t+1
    if (p.xs != nullptr) {
      const int t0 = nt * 8 + 2 * t;
      s0 = t0 < p.M ? p.xs[static_cast<int64_t>(t0) * p.chunks + c] : 0.f;
      s1 = t0 + 1 < p.M ? p.xs[static_cast<int64_t>(t0 + 1) * p.chunks + c] : 0.f;
    }
#pragma unroll
    for (int rt = 0; rt < R; ++rt) {
      acc[rt][nt][0] = fmaf(part[0][rt][nt][0], s0, acc[rt][nt][0]);
      acc[rt][nt][1] = fmaf(part[0][rt][nt][1], s1, acc[rt][nt][1]);
      acc[rt][nt][2] = fmaf(part[0][rt][nt][2], s0, acc[rt][nt][2]);
      acc[rt][nt][3] = fmaf(part[0][rt][nt][3], s1, acc[rt][nt][3]);
    }
  }
}

// S: ring stages per warp (S - 1 items in flight); ACC: MMA chains per item (kDecF16).
template <int R, int NT, int C, typename TOut, int DEC = kDecBF16, int S = kPipeStagesDec<R, DEC>, int ACC = 1>
__global__ void __launch_bounds__(256, (kPipeMinBlocks<R, DEC, S>)) pipe_kernel(const PipeParams p) {
  static_assert(S >= 2, "the ring needs at least 2 stages");
  constexpr int kStage = kPipeStageBytes<R>;
  constexpr int kData = R * 16 * 128;
  constexpr int kRed = kPipeRedFloats<R, NT>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint8_t* ring = smem + warp * S * kStage;
  float* red = reinterpret_cast<float*>(smem + kPipeWarps * S * kStage);  // [2][warps][kRed]
  const int rank = C > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int cluster = blockIdx.x / C, clusters = gridDim.x / C;
  const int wq = rank * kPipeWarps + warp;  // this warp's index among the cluster's warps
  constexpr int kWarpsPerTile = C * kPipeWarps;
  const int nc = wq < p.chunks ? (p.chunks - wq + kWarpsPerTile - 1) / kWarpsPerTile : 0;  // chunks per tile
  const int64_t row_bytes = p.K / 2, row_scales = p.K / 16;

  // The item stream: (tile index i: tile = cluster + i * clusters, chunk index j: chunk = wq + j * C*8).
  int it_i = 0, it_j = 0;  // next item to issue
  auto issue = [&](int slot) {
    const int tile = cluster + it_i * clusters;
    const int c = wq + it_j * kWarpsPerTile;
    uint8_t* st = ring + slot * kStage;
    const int base = tile * 16 * R;
#pragma unroll
    for (int q = 0; q < 4 * R; ++q) {  // 16R rows x 8 units of 16 bytes
      const int u = lane + 32 * q, row = u >> 3, cu = u & 7;
      const int r = min(base + row, p.N - 1);  // rows past N: row N-1, never stored
      const bool ok = c * kChunkK + cu * 32 < p.K;
      const uint8_t* src = p.wdata + r * row_bytes + (ok ? c * 128 + cu * 16 : 0);
      cp_async16(smem_addr(st + row * 128 + ((cu ^ (row & 7)) << 4)), src, ok ? 16u : 0u);
    }
#pragma unroll
    for (int q = 0; q < 2 * R; ++q) {  // 16R rows x 4 units of 4 scale bytes
      const int u = lane + 32 * q, row = u >> 2, cu = u & 3;
      const int r = min(base + row, p.N - 1);
      const bool ok = c * kChunkK + cu * 64 < p.K;
      const uint8_t* src = p.wscale + r * row_scales + (ok ? c * 16 + cu * 4 : 0);
      cp_async4(smem_addr(st + kData + row * 16 + cu * 4), src, ok ? 4u : 0u);
    }
    if (++it_j == nc) {
      it_j = 0;
      ++it_i;
    }
  };
  const int my_tiles = cluster < p.tiles ? (p.tiles - cluster + clusters - 1) / clusters : 0;
  const int items = my_tiles * nc;
  int issued = 0;
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (issued < items) {
      issue(s);
      ++issued;
    }
    cp_async_commit();
  }
  pdl_wait();  // W4A4: x_eff is written by the staging kernel

  auto prefetch_x = [&](int item) {  // activations of an item into L1
    if (DEC == kDecProbe || item >= items || g >= p.M) return;
    const int c = wq + (item % nc) * kWarpsPerTile;
    const int k0 = c * kChunkK + 64 * t;
    if (k0 >= p.K) return;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int tok = nt * 8 + g;
      if (tok < p.M) {
        const void* src = DEC == kDecBF16 ? static_cast<const void*>(p.x + static_cast<int64_t>(tok) * p.K + k0)
                                          : static_cast<const void*>(p.xh + static_cast<int64_t>(tok) * p.Kp + k0);
        prefetch_l1(src);
        prefetch_l1(static_cast<const uint8_t*>(src) + 64);
      }
    }
  };
  prefetch_x(0);
  prefetch_x(1);

  const float gscale = *p.wg * 128.0f * (p.xg != nullptr ? act_scale(p.xg, p.xg_amax) : 1.0f);
  TOut* y = static_cast<TOut*>(p.y);
  int item = 0, slot = 0;
  for (int ti = 0; ti < my_tiles; ++ti) {
    const int tile = cluster + ti * clusters;
    float acc[R][NT][4];
#pragma unroll
    for (int rt = 0; rt < R; ++rt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[rt][nt][i] = 0.f;

    for (int j = 0; j < nc; ++j, ++item) {
      cp_async_wait<S - 2>();
      __syncwarp();
      {  // refill the slot consumed last iteration
        const int issue_slot = slot == 0 ? S - 1 : slot - 1;
        if (issued < items) {
          issue(issue_slot);
          ++issued;
        }
        cp_async_commit();
      }
      prefetch_x(item + 2);
      const uint8_t* st = ring + slot * kStage;
      slot = slot + 1 == S ? 0 : slot + 1;
      const int c = wq + j * kWarpsPerTile;
      const int k0 = c * kChunkK + 64 * t;
      const bool kval = k0 < p.K;
      if constexpr (DEC == kDecProbe) {
        pipe_item_probe<R, NT>(st, kData, g, t, acc);
      } else if constexpr (DEC == kDecF16) {
        pipe_item_f16<R, NT, ACC>(p, st, kData, g, t, c, k0, kval, acc);
      } else {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint32_t b[NT][4][4];  // [token group][word j][pair]
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const int tok = nt * 8 + g;
            const __nv_bfloat16* src = p.x + static_cast<int64_t>(tok) * p.K + k0 + 32 * half;
#pragma unroll
            for (int w = 0; w < 4; ++w) {
              const uint4 v = (kval && tok < p.M) ? ld_act_nc_v4(src + 8 * w) : make_uint4(0u, 0u, 0u, 0u);
              act_pairs(v, b[nt][w]);
            }
          }
#pragma unroll
          for (int rt = 0; rt < R; ++rt) {
            uint32_t sc[2][2];  // [row g / g+8][block of the half], broadcast to both halves
            uint4 wv[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = rt * 16 + g + 8 * h;
              wv[h] = *reinterpret_cast<const uint4*>(st + row * 128 + (((2 * t + half) ^ g) << 4));
              const uint32_t s4 = *reinterpret_cast<const uint32_t*>(st + kData + row * 16 + 4 * t);
              const uint32_t s2 = e4m3x2_to_bf16x2_scaled(half ? s4 >> 16 : s4 & 0xFFFFu);
              sc[h][0] = prmt(s2, s2, 0x1010u);
              sc[h][1] = prmt(s2, s2, 0x3232u);
            }
#pragma unroll
            for (int w = 0; w < 4; ++w) {
              uint32_t r0[4], r1[4];
              decode_word_bf16(word_of(wv[0], w), r0);
              decode_word_bf16(word_of(wv[1], w), r1);
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                r0[i] = hmul2_bf16(r0[i], sc[0][w >> 1]);
                r1[i] = hmul2_bf16(r1[i], sc[1][w >> 1]);
              }
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) {
                mma_16816_bf16(acc[rt][nt], r0[0], r1[0], r0[1], r1[1], b[nt][w][0], b[nt][w][1]);
                mma_16816_bf16(acc[rt][nt], r0[2], r1[2], r0[3], r1[3], b[nt][w][2], b[nt][w][3]);
              }
            }
          }
        }
      }
    }

    // Reduce the tile over the cluster's warps in a fixed order.
    float* mine = red + ((ti & 1) * kPipeWarps + warp) * kRed;
#pragma unroll
    for (int rt = 0; rt < R; ++rt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) mine[((rt * NT + nt) * 4 + i) * 32 + lane] = acc[rt][nt][i];
    if (C > 1) {
      cluster_sync_all();
    } else {
      __syncthreads();
    }
    const float* part = red + (ti & 1) * kPipeWarps * kRed;
    for (int idx = rank * 256 + threadIdx.x; idx < kRed; idx += C * 256) {
      float s = 0.f;
      if (C > 1) {
        for (int r = 0; r < C; ++r)
          for (int w = 0; w < kPipeWarps; ++w) s += ld_dsmem_f32(smem_addr(part + w * kRed + idx), r);
      } else {
        for (int w = 0; w < kPipeWarps; ++w) s += part[w * kRed + idx];
      }
      const int l = idx & 31, i = (idx >> 5) & 3, tl = idx >> 7;
      const int nt = tl % NT, rt = tl / NT;
      const int row = tile * 16 * R + rt * 16 + (l >> 2) + ((i & 2) ? 8 : 0);
      const int tok = nt * 8 + 2 * (l & 3) + (i & 1);
      if (row < p.N && tok < p.M) y[static_cast<int64_t>(tok) * p.N + row] = from_float<TOut>(s * gscale);
    }
  }
  cp_async_wait<0>();
  if (C > 1) cluster_sync_all();  // keep this CTA's shared memory alive until the others have read it
}

// ---------------------------------------------------------------------------------------------
// gemm_kernel: the large-M path. CTA tile BN (64 or 128) weight rows x BM tokens x all K in 64-k
// stages, four shared-memory stages filled by cp.async (weights: BN rows x 32 bytes + 4 scale bytes;
// activations: BM tokens x 128 bytes, 16-byte units XOR-swizzled by token). 8 warps as BN/32 (rows) x
// 256/BN (tokens), each 32 rows x BM*BN/256 tokens; optionally split-K over a cluster of 2 or 4 CTAs
// (partials reduced through distributed shared memory, in rank order): thread (g, t) owns k [16t, 16t+16) of the stage (one 16-element block, one
// scale byte), decodes it to BF16 as pipe_kernel does and runs BF16 mma.sync m16n8k16 with FP32
// accumulators. CTAs are ordered in groups of 8 token tiles so that concurrent CTAs share weight
// and activation tiles in L2. Needs K % 64 == 0; x is BF16 (W4A16) or the BF16 x_eff (W4A4).

constexpr int kGemmK = 64, kGemmStages = 4, kGemmGroup = 8;

template <int BN, int BM>
constexpr int kGemmStageBytes = BN * 32 + BN * 4 + BM * 128;
template <int BN, int BM>
constexpr int kGemmSmemBytes = kGemmStages * kGemmStageBytes<BN, BM>;

template <int BN, int BM, int KS, typename TOut>
__global__ void __launch_bounds__(256, 1) gemm_kernel(const PipeParams p) {
  constexpr int WR = BN / 32, WC = 8 / WR;  // warps along rows (32 each) and along tokens
  constexpr int TW = BM / WC;               // tokens per warp
  constexpr int NT = TW / 8;                // token groups of 8 per warp
  constexpr int kStage = kGemmStageBytes<BN, BM>;
  constexpr int kScaleOff = BN * 32, kXOff = kScaleOff + BN * 4;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wr = warp % WR, wc = warp / WR;

  const int tiles_n = (p.N + BN - 1) / BN, tiles_m = (p.M + BM - 1) / BM;
  const int pid = blockIdx.x / KS, width = kGemmGroup * tiles_n;
  const int rank = KS > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int first_m = (pid / width) * kGemmGroup;
  const int gsize = min(tiles_m - first_m, kGemmGroup);
  const int pid_m = first_m + (pid % width) % gsize, pid_n = (pid % width) / gsize;
  const int n0 = pid_n * BN, m0 = pid_m * BM;
  // Split-K: the KS CTAs of a cluster take consecutive shares of the 64-k stages.
  const int all_ktiles = p.K / kGemmK;
  const int kt0 = all_ktiles * rank / KS, ktiles = all_ktiles * (rank + 1) / KS - kt0;
  const int64_t row_bytes = p.K / 2, row_scales = p.K / 16;

  auto issue = [&](int kt_local, int slot) {
    const int kt = kt0 + kt_local;
    uint8_t* st = smem + slot * kStage;
    if (tid < 2 * BN) {  // weights: BN rows x 2 units of 16 bytes
      const int row = tid >> 1, cu = tid & 1;
      const int r = min(n0 + row, p.N - 1);
      cp_async16(smem_addr(st + row * 32 + cu * 16), p.wdata + r * row_bytes + kt * 32 + cu * 16, 16u);
    }
    if (tid < BN) {
      const int r = min(n0 + tid, p.N - 1);
      cp_async4(smem_addr(st + kScaleOff + tid * 4), p.wscale + r * row_scales + kt * 4, 4u);
    }
#pragma unroll
    for (int q = 0; q < BM / 32; ++q) {  // activations: BM tokens x 8 units of 16 bytes
      const int u = tid + 256 * q, row = u >> 3, cu = u & 7;
      const bool ok = m0 + row < p.M;
      const __nv_bfloat16* src = p.x + static_cast<int64_t>(ok ? m0 + row : 0) * p.K + kt * kGemmK + cu * 8;
      cp_async16(smem_addr(st + kXOff + row * 128 + ((cu ^ (row & 7)) << 4)), src, ok ? 16u : 0u);
    }
  };

  pdl_wait();  // W4A4: x_eff is written by the staging kernel (the prologue below reads it)
#pragma unroll
  for (int s = 0; s < kGemmStages - 1; ++s) {
    if (s < ktiles) issue(s, s);
    cp_async_commit();
  }

  float acc[2][NT][4];
#pragma unroll
  for (int rt = 0; rt < 2; ++rt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rt][nt][i] = 0.f;

  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kGemmStages - 2>();
    __syncthreads();
    if (kt + kGemmStages - 1 < ktiles) issue(kt + kGemmStages - 1, (kt + kGemmStages - 1) % kGemmStages);
    cp_async_commit();
    const uint8_t* st = smem + (kt % kGemmStages) * kStage;
    uint2 wv[2][2];
    uint32_t sc[2][2];
#pragma unroll
    for (int rt = 0; rt < 2; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = wr * 32 + rt * 16 + g + 8 * h;
        wv[rt][h] = *reinterpret_cast<const uint2*>(st + row * 32 + 8 * t);
        const uint32_t sb = st[kScaleOff + row * 4 + t];
        sc[rt][h] = e4m3x2_to_bf16x2_scaled(sb | (sb << 8));
      }
#pragma unroll
    for (int w = 0; w < 2; ++w) {  // word w: k [16t + 8w, +8)
      uint32_t a[2][2][4];
#pragma unroll
      for (int rt = 0; rt < 2; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          decode_word_bf16(w ? wv[rt][h].y : wv[rt][h].x, a[rt][h]);
#pragma unroll
          for (int i = 0; i < 4; ++i) a[rt][h][i] = hmul2_bf16(a[rt][h][i], sc[rt][h]);
        }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int tok = wc * TW + nt * 8 + g;  // tok & 7 == g
        const uint4 v = *reinterpret_cast<const uint4*>(st + kXOff + tok * 128 + (((2 * t + w) ^ g) << 4));
        uint32_t b[4];
        act_pairs(v, b);
#pragma unroll
        for (int rt = 0; rt < 2; ++rt) {
          mma_16816_bf16(acc[rt][nt], a[rt][0][0], a[rt][1][0], a[rt][0][1], a[rt][1][1], b[0], b[1]);
          mma_16816_bf16(acc[rt][nt], a[rt][0][2], a[rt][1][2], a[rt][0][3], a[rt][1][3], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  const float gscale = *p.wg * 128.0f * (p.xg != nullptr ? act_scale(p.xg, p.xg_amax) : 1.0f);
  TOut* y = static_cast<TOut*>(p.y);
  auto store = [&](int e, float v) {  // element e = (rt * NT + nt) * 4 + i of this thread
    const int i = e & 3, nt = (e >> 2) % NT, rt = (e >> 2) / NT;
    const int row = n0 + wr * 32 + rt * 16 + g + ((i & 2) ? 8 : 0);
    const int tok = m0 + wc * TW + nt * 8 + 2 * t + (i & 1);
    if (row < p.N && tok < p.M) y[static_cast<int64_t>(tok) * p.N + row] = from_float<TOut>(v * gscale);
  };
  if constexpr (KS == 1) {
#pragma unroll
    for (int rt = 0; rt < 2; ++rt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) store((rt * NT + nt) * 4 + i, acc[rt][nt][i]);
  } else {
    // Partials through distributed shared memory: red[e][tid]; CTA r sums elements
    // [r*E/KS, (r+1)*E/KS) over the cluster in rank order (deterministic).
    constexpr int E = 2 * NT * 4;
    static_assert(E * 256 * 4 <= kGemmSmemBytes<BN, BM>, "partials must fit the pipeline's shared memory");
    float* red = reinterpret_cast<float*>(smem);
    __syncthreads();  // every warp is done with the pipeline stages
#pragma unroll
    for (int rt = 0; rt < 2; ++rt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[((rt * NT + nt) * 4 + i) * 256 + tid] = acc[rt][nt][i];
    cluster_sync_all();
    for (int e = rank * E / KS; e < (rank + 1) * E / KS; ++e) {
      float v = 0.f;
      for (int q = 0; q < KS; ++q) v += ld_dsmem_f32(smem_addr(red + e * 256 + tid), q);
      store(e, v);
    }
    cluster_sync_all();  // keep this CTA's shared memory alive until the others have read it
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

inline ffi::Error cuda_error(cudaError_t e, const char* where) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxlp nvfp4 ") + where + ": " + cudaGetErrorString(e));
}

inline ffi::Error bad(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp nvfp4: " + msg);
}

inline int round_up(int v, int m) { return (v + m - 1) / m * m; }

// Variants of the M <= 8 GEMVs (GemvConfig fields; 0 / 1 = the kernel's default):
// blocks: regs, CTAs per SM of its register budget (3: the "B3" variant, R = 1);
// acc: regs and pipe16, MMA chains per item (2: "A2"); stages: pipe16 ring stages (2: "S2").
struct GemvVariant {
  int blocks = 0, acc = 1, stages = 0;
  bool is_default() const { return blocks == 0 && acc == 1 && stages == 0; }
};

template <int R, int NT, int MODE, typename TOut, int OCC = 0, int ACC = 1>
cudaError_t launch_gemv(cudaStream_t stream, const GemvParams& p, int ksplit, bool pdl) {
  return jaxlp::launch_kernel(gemv_kernel<R, NT, MODE, TOut, OCC, ACC>, dim3((p.N + 16 * R - 1) / (16 * R)),
                              dim3(32 * ksplit), 0, stream, 1, pdl, p);
}

template <int MODE, typename T>
cudaError_t launch_gemv_dispatch(cudaStream_t stream, const GemvParams& p, int rows_per_warp, int ksplit, bool pdl,
                                 GemvVariant v = {}) {
  const int nt = (p.M + 7) / 8;
  if (!v.is_default()) {  // M <= 8 and (blocks == 3 only with R = 1): checked by the handler
    if (v.blocks == 3) {
      return v.acc == 2 ? launch_gemv<1, 1, MODE, T, 3, 2>(stream, p, ksplit, pdl)
                        : launch_gemv<1, 1, MODE, T, 3, 1>(stream, p, ksplit, pdl);
    }
    return rows_per_warp == 1 ? launch_gemv<1, 1, MODE, T, 0, 2>(stream, p, ksplit, pdl)
                              : launch_gemv<2, 1, MODE, T, 0, 2>(stream, p, ksplit, pdl);
  }
  if (rows_per_warp == 1) {
    if (nt == 1) return launch_gemv<1, 1, MODE, T>(stream, p, ksplit, pdl);
    if (nt == 2) return launch_gemv<1, 2, MODE, T>(stream, p, ksplit, pdl);
    return launch_gemv<1, 4, MODE, T>(stream, p, ksplit, pdl);
  }
  if (nt == 1) return launch_gemv<2, 1, MODE, T>(stream, p, ksplit, pdl);
  if (nt == 2) return launch_gemv<2, 2, MODE, T>(stream, p, ksplit, pdl);
  return launch_gemv<2, 4, MODE, T>(stream, p, ksplit, pdl);
}

enum GemvKernel : int { kRegs = 0, kPipe16 = 3 };  // the kernels behind JaxlpNvfp4Gemv (FP16 x_eff staging)

template <typename T>
cudaError_t run_pipe16(cudaStream_t stream, int mode, const GemvParams& g, int rows, int split, bool pdl,
                       GemvVariant v);

template <typename T>
cudaError_t run_gemv(cudaStream_t stream, int mode, const T* x, const float* xg, GemvParams p, int rows_per_warp,
                     int ksplit, bool pdl, int kernel = kRegs, int split = 1, GemvVariant v = {}) {
  const int threads = 256;
  if (mode == kA16 || mode == kProbe) {
    const int n = p.M * (p.Kp / 8);
    stage_a16_kernel<T><<<(n + threads - 1) / threads, threads, 0, stream>>>(
        x, const_cast<uint16_t*>(p.xeff), const_cast<float*>(p.xs), p.M, p.K, p.Kp);
  } else {
    const int n = p.M * (p.Kp / 16) * 2;
    stage_a4_kernel<T, kXeffF16, 2><<<(n + threads - 1) / threads, threads, 0, stream>>>(
        x, xg, const_cast<uint16_t*>(p.xeff), nullptr, nullptr, p.M, p.K, p.Kp, p.xg_amax);
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  if (kernel == kPipe16) return run_pipe16<T>(stream, mode, p, rows_per_warp, split, pdl, v);
  if (mode == kA16) return launch_gemv_dispatch<kA16, T>(stream, p, rows_per_warp, ksplit, pdl, v);
  if (mode == kProbe) {
    return rows_per_warp == 1 ? launch_gemv<1, 1, kProbe, T>(stream, p, ksplit, pdl)
                              : launch_gemv<2, 1, kProbe, T>(stream, p, ksplit, pdl);
  }
  return launch_gemv_dispatch<kA4, T>(stream, p, rows_per_warp, ksplit, pdl, v);
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

// The standalone quantizer: codes and scales only (no x_eff), LANES threads per 16-element block.
template <typename T, int LANES>
void launch_quantize(cudaStream_t stream, const T* x, const float* g, uint8_t* codes, uint8_t* scales, int M, int K) {
  const int threads = 256;
  const int64_t n = int64_t(M) * (K / 16) * LANES;
  stage_a4_kernel<T, kXeffBF16, LANES><<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0, stream>>>(
      x, g, nullptr, codes, scales, M, K, K);
}

template <typename T>
void launch_quantize(cudaStream_t stream, const T* x, const float* g, uint8_t* codes, uint8_t* scales, int M, int K,
                     int lanes) {
  if (lanes == 1) return launch_quantize<T, 1>(stream, x, g, codes, scales, M, K);
  if (lanes == 2) return launch_quantize<T, 2>(stream, x, g, codes, scales, M, K);
  return launch_quantize<T, 4>(stream, x, g, codes, scales, M, K);
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


// ---------------------------------------------------------------------------------------------
// Host side of pipe_kernel and gemm_kernel

// Largest useful grid (resident CTAs, a multiple of the cluster size) of a kernel on the current
// device; also raises its dynamic shared-memory limit. Cached per (kernel, device).
inline cudaError_t resident_ctas(const void* kernel, int smem, int cluster, int* out) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int>, int> cache;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const auto key = std::make_tuple(kernel, dev, cluster);
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = cache.find(key);
    if (it != cache.end()) {
      *out = it->second;
      return cudaSuccess;
    }
  }
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  int n = 0;
  if (cluster == 1) {
    int per_sm = 0, sms = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, smem);
    if (e != cudaSuccess) return e;
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return e;
    n = per_sm * sms;
  } else {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(cluster * 64);
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
    if (e != cudaSuccess) return e;
    n = clusters * cluster;
  }
  if (n < cluster) return cudaErrorInvalidConfiguration;
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = n;
  *out = n;
  return cudaSuccess;
}

template <int R, int NT, int C, typename T, int DEC, int S = kPipeStagesDec<R, DEC>, int ACC = 1>
cudaError_t launch_pipe(cudaStream_t stream, PipeParams p, bool pdl) {
  const void* kernel = reinterpret_cast<const void*>(pipe_kernel<R, NT, C, T, DEC, S, ACC>);
  constexpr int smem = kPipeSmemBytes<R, NT, S>;
  int max_ctas = 0;
  cudaError_t e = resident_ctas(kernel, smem, C, &max_ctas);
  if (e != cudaSuccess) return e;
  p.tiles = (p.N + 16 * R - 1) / (16 * R);
  p.chunks = (p.K + kChunkK - 1) / kChunkK;
  const int clusters = std::max(1, std::min(p.tiles, max_ctas / C));
  return jaxlp::launch_kernel(pipe_kernel<R, NT, C, T, DEC, S, ACC>, dim3(clusters * C), dim3(256), smem, stream, C,
                              pdl, p);
}

// S == 0: the default ring (then ACC == 1, any M <= 32); otherwise M <= 8 (checked by the handler).
template <int R, int C, typename T, int DEC, int S = 0, int ACC = 1>
cudaError_t launch_pipe_nt(cudaStream_t stream, const PipeParams& p, bool pdl) {
  const int nt = (p.M + 7) / 8;
  constexpr int kS = S == 0 ? kPipeStagesDec<R, DEC> : S;
  if constexpr (DEC == kDecProbe || S != 0 || ACC != 1) {  // the probe and the variants take M <= 8
    return launch_pipe<R, 1, C, T, DEC, kS, ACC>(stream, p, pdl);
  } else {
    if (nt == 1) return launch_pipe<R, 1, C, T, DEC>(stream, p, pdl);
    if (nt == 2) return launch_pipe<R, 2, C, T, DEC>(stream, p, pdl);
    return launch_pipe<R, 4, C, T, DEC>(stream, p, pdl);
  }
}

template <typename T, int DEC = kDecBF16, int S = 0, int ACC = 1>
cudaError_t launch_pipe_cfg(cudaStream_t stream, const PipeParams& p, int rows, int split, bool pdl) {
  if (rows == 1) {
    if (split == 1) return launch_pipe_nt<1, 1, T, DEC, S, ACC>(stream, p, pdl);
    if (split == 2) return launch_pipe_nt<1, 2, T, DEC, S, ACC>(stream, p, pdl);
    return launch_pipe_nt<1, 4, T, DEC, S, ACC>(stream, p, pdl);
  }
  if (split == 1) return launch_pipe_nt<2, 1, T, DEC, S, ACC>(stream, p, pdl);
  if (split == 2) return launch_pipe_nt<2, 2, T, DEC, S, ACC>(stream, p, pdl);
  return launch_pipe_nt<2, 4, T, DEC, S, ACC>(stream, p, pdl);
}

template <int BN, int BM, int KS, typename T>
cudaError_t launch_gemm(cudaStream_t stream, const PipeParams& p, bool pdl) {
  const void* kernel = reinterpret_cast<const void*>(gemm_kernel<BN, BM, KS, T>);
  constexpr int smem = kGemmSmemBytes<BN, BM>;
  int unused = 0;
  cudaError_t e = resident_ctas(kernel, smem, KS, &unused);  // raises the shared-memory limit
  if (e != cudaSuccess) return e;
  if (p.K / kGemmK < KS) return cudaErrorInvalidValue;
  const int64_t tiles = int64_t((p.N + BN - 1) / BN) * ((p.M + BM - 1) / BM) * KS;
  if (tiles > (int64_t(1) << 31) - 1) return cudaErrorInvalidConfiguration;
  return jaxlp::launch_kernel(gemm_kernel<BN, BM, KS, T>, dim3(static_cast<unsigned>(tiles)), dim3(256), smem, stream,
                              KS, pdl, p);
}

template <int BN, int BM, typename T>
cudaError_t launch_gemm_split(cudaStream_t stream, const PipeParams& p, int split, bool pdl) {
  if (split == 1) return launch_gemm<BN, BM, 1, T>(stream, p, pdl);
  if (split == 2) return launch_gemm<BN, BM, 2, T>(stream, p, pdl);
  return launch_gemm<BN, BM, 4, T>(stream, p, pdl);
}

// pipe16: pipe_kernel with the FP16 decode on the x_eff / xs workspaces that run_gemv's staging kernel
// just wrote (launched with PDL after it when `pdl`).
template <typename T>
cudaError_t run_pipe16(cudaStream_t stream, int mode, const GemvParams& g, int rows, int split, bool pdl,
                       GemvVariant v) {
  PipeParams p = {};
  p.wdata = g.wdata;
  p.wscale = g.wscale;
  p.wg = g.wg;
  p.xg = mode == kA4 ? g.xg : nullptr;
  p.xh = g.xeff;
  p.xs = mode == kA4 ? nullptr : g.xs;
  p.y = g.y;
  p.M = g.M;
  p.N = g.N;
  p.K = g.K;
  p.Kp = g.Kp;
  p.xg_amax = g.xg_amax;
  if (mode == kProbe) {
    return v.stages == 2 ? launch_pipe_cfg<T, kDecProbe, 2>(stream, p, rows, split, pdl)
                         : launch_pipe_cfg<T, kDecProbe>(stream, p, rows, split, pdl);
  }
  if (v.stages == 2) {
    return v.acc == 2 ? launch_pipe_cfg<T, kDecF16, 2, 2>(stream, p, rows, split, pdl)
                      : launch_pipe_cfg<T, kDecF16, 2, 1>(stream, p, rows, split, pdl);
  }
  if (v.acc == 2) return launch_pipe_cfg<T, kDecF16, 3, 2>(stream, p, rows, split, pdl);
  return launch_pipe_cfg<T, kDecF16>(stream, p, rows, split, pdl);
}

enum MatmulKernel : int { kPipe = 1, kGemm = 2 };

// One call of the BF16-tensor-core kernels: W4A4 first quantizes x into the BF16 x_eff workspace
// (stage_a4_kernel), then pipe_kernel (small M) or gemm_kernel (large M) reads it; W4A16 reads x.
template <typename T>
cudaError_t run_matmul(cudaStream_t stream, int mode, int kernel, const T* x, const float* xg, uint16_t* xeff,
                       PipeParams p, int rows, int split, int block_m, int block_n, bool pdl) {
  bool after_stage = false;
  if (mode == kA4) {
    const int threads = 256;
    const int64_t n = int64_t(p.M) * (p.K / 16) * 4;
    stage_a4_kernel<T, kXeffBF16, 4><<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0, stream>>>(
        x, xg, xeff, nullptr, nullptr, p.M, p.K, p.K, p.xg_amax);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    p.x = reinterpret_cast<const __nv_bfloat16*>(xeff);
    p.xg = xg;
    after_stage = pdl;
  } else {
    p.x = reinterpret_cast<const __nv_bfloat16*>(x);
    p.xg = nullptr;
  }
  if (kernel == kPipe) return launch_pipe_cfg<T>(stream, p, rows, split, after_stage);
  if (block_n == 64)
    return block_m == 64 ? launch_gemm_split<64, 64, T>(stream, p, split, after_stage)
                         : launch_gemm_split<64, 128, T>(stream, p, split, after_stage);
  return block_m == 64 ? launch_gemm_split<128, 64, T>(stream, p, split, after_stage)
                       : launch_gemm_split<128, 128, T>(stream, p, split, after_stage);
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

}  // namespace jaxlp_nvfp4

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
