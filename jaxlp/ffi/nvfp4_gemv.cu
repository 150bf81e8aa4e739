// gemv_kernel ("regs"): the first NVFP4 GEMV for Hopper (sm_90), M <= 32 tokens, any K % 16 == 0.
// Handler JaxlpNvfp4Gemv (nvfp4_ffi.cu, where an overview of all the NVFP4 kernels is).
//
// Weights: NVFP4 with ModelOpt layout: data uint8 [N, K/2] (even k in the low nibble),
// E4M3 block scales uint8 [N, K/16] row-major, FP32 tensor scale g_w (device scalar).
// Activations: BF16/F32 x [M, K]; either used as is (W4A16) or quantized to NVFP4 with a
// static tensor scale g_x and dynamic E4M3 scales per 16 elements of each token (W4A4).
//
// Two kernels per call, the second launched with programmatic dependent launch (PDL) so that
// its weight stream starts while the first one still runs:
//
// 1. stage (nvfp4_quantize.cu): activations -> x_eff, FP16 [M, Kp] (Kp = K rounded up to 256,
//    zero padded), each group of 8 stored in the order x0 x4 x1 x5 x2 x6 x3 x7 (see decode below).
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

#include "launch.cuh"
#include "nvfp4_common.cuh"

namespace jaxlp_nvfp4 {

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

// ---------------------------------------------------------------------------------------------
// Stage 2: the GEMV

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
// Host side

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

template <typename T>
cudaError_t run_regs(cudaStream_t stream, int mode, const GemvParams& p, int rows_per_warp, int ksplit, bool pdl,
                     GemvVariant v) {
  if (mode == kA16) return launch_gemv_dispatch<kA16, T>(stream, p, rows_per_warp, ksplit, pdl, v);
  if (mode == kProbe) {
    return rows_per_warp == 1 ? launch_gemv<1, 1, kProbe, T>(stream, p, ksplit, pdl)
                              : launch_gemv<2, 1, kProbe, T>(stream, p, ksplit, pdl);
  }
  return launch_gemv_dispatch<kA4, T>(stream, p, rows_per_warp, ksplit, pdl, v);
}

template cudaError_t run_regs<__nv_bfloat16>(cudaStream_t, int, const GemvParams&, int, int, bool, GemvVariant);
template cudaError_t run_regs<float>(cudaStream_t, int, const GemvParams&, int, int, bool, GemvVariant);

}  // namespace jaxlp_nvfp4
