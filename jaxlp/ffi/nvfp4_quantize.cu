// Activation staging and quantization kernels of the NVFP4 matmuls (host side: nvfp4_ffi.cu).
//
// stage_a16_kernel: W4A16 staging of the FP16 GEMVs ("regs", "pipe16"): x -> x_eff FP16 [M, Kp] and
//   the power-of-two chunk scales xs (step 1 in the description at the top of nvfp4_gemv.cu).
// stage_a4_kernel: W4A4 staging and the standalone quantizer: x quantized to NVFP4 with a static
//   tensor scale g_x and dynamic E4M3 scales per 16 elements of each token (ModelOpt numerics,
//   bit-exact), written as the FP16 x_eff of the FP16 GEMVs, the BF16 x_eff of pipe_kernel and
//   gemm_kernel, or as NVFP4 codes and scales (handler JaxlpNvfp4Quantize).
// stage_block_fp4_kernel: W4A4 staging of the MXFP4 / DialectFP4 matmuls (handler JaxlpBlockFp4Matmul):
//   BF16 x quantized per 32-element block (4 threads each) as jaxlp.quantization.activations.fake_quantize does
//   (MXFP4: the OCP rule; DialectFP4: two-stage selection) and written back decoded, as BF16 x_eff.

#include "nvfp4_common.cuh"

namespace jaxlp_nvfp4 {

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

// W4A4 of the MXFP4 / DialectFP4 matmuls: four threads per 32-element block of a token (8 values each,
// the block's maxima and DialectFP4's range counts reduced by shuffles), x_eff [M, K] BF16 = the block's
// values as jaxlp.formats quantizes and dequantizes them (exact in BF16):
// - MXFP4: e = clamp(floor(log2(amax)) - 2, -127, 127) from amax's FP32 exponent bits (zero and
//   FP32-subnormal maxima: -127), codes e2m1_code(x * 2^-e), values e2m1 * 2^e;
// - DialectFP4, two-stage selection (jaxlp.formats.dialect_fp4): exponent code c = clamp(floor(log2
//   amax) + 16, 0, 31) (0 below 2^-16), e = c - 18, h = |x| 2^(1-e) in half units; stage 1 takes the
//   pair p whose shared maximum is nearest round-half-up(max h) (ties: the larger maximum), stage 2
//   the member with more h in its beneficial range (ties: even); each value is the nearest of the
//   dialect's magnitudes (ties up) times 2^(e-1), with x's sign. `sel` holds the formatbook
//   [16][8] (half units), the beneficial ranges [16][2] and the pairs' maxima [8], as floats.
// Threads past the last block compute on the last block and store nothing (the shuffles need every lane).
template <int FMT>
__global__ void __launch_bounds__(256) stage_block_fp4_kernel(const __nv_bfloat16* __restrict__ x,
                                                              const float* __restrict__ sel,
                                                              __nv_bfloat16* __restrict__ xeff, int M, int K) {
  pdl_launch_dependents();
  const int64_t all = static_cast<int64_t>(M) * (K / 32);
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool store = gid < 4 * all;
  const int64_t at = store ? gid : 4 * all - 4 + (gid & 3);  // this thread's 8 values: x[8 at, +8)
  float v[8];
  load8(x + 8 * at, v);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
  const int floor_log2 = static_cast<int>((__float_as_uint(amax) >> 23) & 0xFFu) - 127;
  float out[8];
  if constexpr (FMT == kFmtMxfp4) {
    const int e = min(max(floor_log2 - 2, -127), 127);
    const float down = exp2_int(-e), up = __uint_as_float(e >= -126 ? static_cast<uint32_t>(e + 127) << 23
                                                                     : 0x00400000u >> (-127 - e));
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t code = e2m1_code(v[i] * down);
      const float mag = e2m1_value(code & 7u) * up;
      out[i] = (code & 8u) ? -mag : mag;
    }
  } else {
    const int code = amax >= 0x1p-16f ? min(max(floor_log2 + 16, 0), 31) : 0;
    const int e = code - 18;
    const float to_half = exp2_int(1 - e), scale = exp2_int(e - 1);
    float h[8], hmax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      h[i] = fabsf(v[i]) * to_half;
      hmax = fmaxf(hmax, h[i]);
    }
    hmax = fmaxf(hmax, __shfl_xor_sync(0xFFFFFFFFu, hmax, 1));
    hmax = fmaxf(hmax, __shfl_xor_sync(0xFFFFFFFFu, hmax, 2));
    const float rounded = floorf(hmax + 0.5f);
    const float* book = sel;
    const float* ranges = sel + 128;
    const float* pair_max = sel + 160;
    int pair = 0;
    float best = 3.0e38f;
    for (int q = 0; q < 8; ++q) {
      const float key = 2.f * fabsf(pair_max[q] - rounded) + (pair_max[q] < rounded ? 1.f : 0.f);
      if (key < best) {
        best = key;
        pair = q;
      }
    }
    const float lo0 = ranges[4 * pair], hi0 = ranges[4 * pair + 1];  // the even member's range
    const float lo1 = ranges[4 * pair + 2], hi1 = ranges[4 * pair + 3];
    int count = 0;  // even member's count in the low 16 bits, odd member's in the high 16
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      count += (h[i] >= lo0) & (h[i] < hi0);
      count += ((h[i] >= lo1) & (h[i] < hi1)) << 16;
    }
    count += __shfl_xor_sync(0xFFFFFFFFu, count, 1);
    count += __shfl_xor_sync(0xFFFFFFFFu, count, 2);
    const float* row = book + 8 * ((count & 0xFFFF) >= (count >> 16) ? 2 * pair : 2 * pair + 1);
    float mid[7];
#pragma unroll
    for (int j = 0; j < 7; ++j) mid[j] = 0.5f * (row[j] + row[j + 1]);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float mag = row[0];
#pragma unroll
      for (int t = 0; t < 7; ++t) mag = h[i] >= mid[t] ? row[t + 1] : mag;
      mag *= scale;
      out[i] = (__float_as_uint(v[i]) >> 31) ? -mag : mag;
    }
  }
  uint32_t word[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(out[2 * i], out[2 * i + 1]);
    word[i] = *reinterpret_cast<const uint32_t*>(&b);
  }
  if (store) reinterpret_cast<uint4*>(xeff)[gid] = make_uint4(word[0], word[1], word[2], word[3]);
}

// ---------------------------------------------------------------------------------------------
// Host side

cudaError_t stage_block_fp4(cudaStream_t stream, int act_fmt, const __nv_bfloat16* x, const float* sel,
                            __nv_bfloat16* xeff, int M, int K) {
  const int threads = 256;
  const int64_t n = int64_t(M) * (K / 32) * 4;  // four threads per block
  const unsigned grid = static_cast<unsigned>((n + threads - 1) / threads);
  if (act_fmt == kFmtMxfp4) {
    stage_block_fp4_kernel<kFmtMxfp4><<<grid, threads, 0, stream>>>(x, sel, xeff, M, K);
  } else {
    stage_block_fp4_kernel<kFmtDialect><<<grid, threads, 0, stream>>>(x, sel, xeff, M, K);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t stage_f16(cudaStream_t stream, int mode, const T* x, const float* xg, const GemvParams& p) {
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
  return cudaGetLastError();
}

template <typename T>
cudaError_t stage_bf16(cudaStream_t stream, const T* x, const float* xg, uint16_t* xeff, int M, int K, int xg_amax) {
  const int threads = 256;
  const int64_t n = int64_t(M) * (K / 16) * 4;
  stage_a4_kernel<T, kXeffBF16, 4><<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0, stream>>>(
      x, xg, xeff, nullptr, nullptr, M, K, K, xg_amax);
  return cudaGetLastError();
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

template cudaError_t stage_f16<__nv_bfloat16>(cudaStream_t, int, const __nv_bfloat16*, const float*, const GemvParams&);
template cudaError_t stage_f16<float>(cudaStream_t, int, const float*, const float*, const GemvParams&);
template cudaError_t stage_bf16<__nv_bfloat16>(cudaStream_t, const __nv_bfloat16*, const float*, uint16_t*, int, int,
                                               int);
template cudaError_t stage_bf16<float>(cudaStream_t, const float*, const float*, uint16_t*, int, int, int);
template void launch_quantize<__nv_bfloat16>(cudaStream_t, const __nv_bfloat16*, const float*, uint8_t*, uint8_t*, int,
                                             int, int);
template void launch_quantize<float>(cudaStream_t, const float*, const float*, uint8_t*, uint8_t*, int, int, int);

}  // namespace jaxlp_nvfp4
