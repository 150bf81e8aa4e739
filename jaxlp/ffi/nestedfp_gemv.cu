// NestedFP products for a few tokens on tensor cores (XLA FFI custom call, sm_90): the GEMV for
// 1..8 tokens (FP16 mode: 1..16) and FP16 mode's skinny GEMM for up to 64. Python side:
// jaxlp/ffi/nestedfp.py.
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
// and writes the output: one kernel, nothing in global memory but the output. FP16 mode for 9..16
// tokens: each thread also loads token g + 8, and each merged weight fragment feeds two MMAs.
//
// FP16 mode for up to 64 tokens (`skinny_kernel`): the same MMAs (weights the A operand in the
// thread's own K order, tokens the N), but a CTA's 8 warps own 8 different row blocks (128 rows)
// over the same K, and a cp.async ring of 4 to 8 stages (one 64-wide K window of both byte planes
// and of the tokens each) streams the CTA's rows and tokens through shared memory: the tokens cross
// L2 M / 128 times the weight bytes (the GEMV's per-thread loads read them M / 16 times) and 3 to 7
// windows of weights are in flight per CTA without holding registers (register-prefetched
// weights left too few bytes in flight: 0.35-0.81x the FP16 dot, docs/perf.md session 33). Each
// warp reads its fragments from the stage, merges, and runs `kGroups` MMAs (8 tokens each) per
// merged fragment. A row tile's K splits are a cluster; each rank adds the splits' sums of
// 8 / splits of the warps' row blocks (gathered in its shared memory through distributed shared
// memory) and writes them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "async_copy.cuh"
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
template <bool kFp8, int kGroups>
struct Window {
  uint4 u0, u1, l0, l1, xa[kGroups], xb[kGroups];

  // xrow[t]: token 8t + g's row at this thread's K offset.
  __device__ __forceinline__ void load(const uint8_t* up0, const uint8_t* up1, const uint8_t* lo0,
                                       const uint8_t* lo1, const uint8_t* const (&xrow)[kGroups], long k0) {
    u0 = ldg16(up0 + k0);
    u1 = ldg16(up1 + k0);
    if constexpr (kFp8) {
      xa[0] = ldg16(xrow[0] + k0);
    } else {
      l0 = ldg16(lo0 + k0);
      l1 = ldg16(lo1 + k0);
#pragma unroll
      for (int t = 0; t < kGroups; ++t) {
        xa[t] = ldg16(xrow[t] + 2 * k0);
        xb[t] = ldg16(xrow[t] + 2 * k0 + 16);
      }
    }
  }

  // keep[t]: all ones for a token of the product, zero for a lane past M (no branch between the
  // loads and the MMAs, which lets the loads of a step run ahead). c: kGroups x 4 accumulators.
  __device__ __forceinline__ void mma(float (&c)[4 * kGroups], const uint32_t (&keep)[kGroups]) const {
    if constexpr (kFp8) {
      const uint4 x0 = make_uint4(xa[0].x & keep[0], xa[0].y & keep[0], xa[0].z & keep[0], xa[0].w & keep[0]);
      float(&c0)[4] = *reinterpret_cast<float(*)[4]>(c);
      mma_e4m3(c0, u0.x, u1.x, u0.y, u1.y, x0.x, x0.y);
      mma_e4m3(c0, u0.z, u1.z, u0.w, u1.w, x0.z, x0.w);
    } else {
      const uint32_t uu0[4] = {u0.x, u0.y, u0.z, u0.w}, ll0[4] = {l0.x, l0.y, l0.z, l0.w};
      const uint32_t uu1[4] = {u1.x, u1.y, u1.z, u1.w}, ll1[4] = {l1.x, l1.y, l1.z, l1.w};
      uint32_t a[4][4];
#pragma unroll
      for (int s = 0; s < 4; ++s) {  // word s: K 4s .. 4s + 3 of the thread's 16
        jaxlp::nestedfp_merge4(uu0[s], ll0[s], a[s][0], a[s][2]);
        jaxlp::nestedfp_merge4(uu1[s], ll1[s], a[s][1], a[s][3]);
      }
#pragma unroll
      for (int t = 0; t < kGroups; ++t) {
        const uint32_t k = keep[t];
        const uint32_t xx[8] = {xa[t].x & k, xa[t].y & k, xa[t].z & k, xa[t].w & k,
                                xb[t].x & k, xb[t].y & k, xb[t].z & k, xb[t].w & k};
        float(&ct)[4] = *reinterpret_cast<float(*)[4]>(c + 4 * t);
#pragma unroll
        for (int s = 0; s < 4; ++s) mma_f16(ct, a[s][0], a[s][1], a[s][2], a[s][3], xx[2 * s], xx[2 * s + 1]);
      }
    }
  }
};

// kUnroll: windows per pipelined step (loads in flight per warp); kMinBlocks: CTAs per SM the
// register budget is held to (ptxas -v, sm_90, no spills: FP16 mode unroll 1 / 2 / 4 72 / 124 / 225
// registers, FP8 mode 54 / 76 / 128); kGroups: MMAs of 8 tokens per merged weight fragment (FP16
// mode: 1, or 2 for 9..16 tokens, each thread loading both tokens' K).
// TOut: the output's element type (float for the sums of several splits).
template <bool kFp8, int kUnroll, int kMinBlocks, int kGroups, typename TOut>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) gemv_kernel(Params p) {
  __shared__ jaxlp::SplitSums<kWarps, 4 * kGroups> sums;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tg = lane & 3;  // mma fragment coordinates
  const int row0 = blockIdx.y * kRows, split = blockIdx.x;
  const long ka = static_cast<long>(p.k);
  const uint8_t* up0 = p.upper + (row0 + g) * ka + tg * 16;
  const uint8_t* up1 = up0 + 8 * ka;
  const uint8_t* lo0 = p.lower + (row0 + g) * ka + tg * 16;
  const uint8_t* lo1 = lo0 + 8 * ka;
  uint32_t keep[kGroups];
  const uint8_t* xrow[kGroups];
#pragma unroll
  for (int t = 0; t < kGroups; ++t) {
    keep[t] = 8 * t + g < p.m ? 0xFFFFFFFFu : 0u;
    xrow[t] = p.x + (keep[t] ? 8 * t + g : 0) * ka * (kFp8 ? 1 : 2) + tg * 16 * (kFp8 ? 1 : 2);
  }

  float c[4 * kGroups];
#pragma unroll
  for (int i = 0; i < 4 * kGroups; ++i) c[i] = 0.f;
  const int windows = p.k / kWindow, stride = kWarps * p.splits;
  // Steps of kUnroll windows, software-pipelined: a step's loads are issued before the MMAs of the
  // step loaded the iteration before. Windows past K load window `first` again and feed zeros.
  const int first = split * kWarps + warp;
  Window<kFp8, kGroups> cur[kUnroll], next[kUnroll];
  uint32_t keep_next[kUnroll][kGroups];
  auto load_step = [&](int w0) {
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int w = w0 + j * stride;
#pragma unroll
      for (int t = 0; t < kGroups; ++t) keep_next[j][t] = w < windows ? keep[t] : 0u;
      next[j].load(up0, up1, lo0, lo1, xrow, static_cast<long>(w < windows ? w : first) * kWindow);
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
  if (!jaxlp::split_sums(c, sums, warp, lane, p.splits)) return;
  // c[4t + 0, 1]: row g, tokens 8t + 2tg, 8t + 2tg + 1; c[4t + 2, 3]: row g + 8.
  TOut* out = static_cast<TOut*>(p.out);
#pragma unroll
  for (int i = 0; i < 4 * kGroups; ++i) {
    const int m = 8 * (i >> 2) + 2 * tg + (i & 1), n = row0 + g + 8 * ((i >> 1) & 1);
    if (m < p.m) out[static_cast<long>(m) * p.n + n] = jaxlp::to_out<TOut>((c[i] / p.divisor[m]) * p.multiplier);
  }
}

// ---------------------------------------------------------------------------------------------
// FP16 mode, 9..64 tokens: the skinny GEMM (file head).

constexpr int kSkinnyMaxTokens = 64;
// cp.async ring: a stage is one 64-wide K window of the CTA's rows and tokens; the fewer the tokens,
// the more stages fit (about one CTA per SM: docs/perf.md session 33).
template <int kGroups>
constexpr int kSkinnyStages = kGroups == 2 ? 8 : kGroups == 4 ? 6 : 4;
constexpr int kSkinnyRows = kWarps * kRows;  // 128 output features per CTA

template <int kGroups>
struct SkinnyStage {
  static constexpr int kTokens = 8 * kGroups;
  static constexpr int kPlaneBytes = kSkinnyRows * kWindow;  // one byte plane: 128 rows x 64 K
  static constexpr int kTokenRowBytes = kWindow * 2 + 16;    // padded: the fragment loads hit 32 banks
  static constexpr int kBytes = 2 * kPlaneBytes + kTokens * kTokenRowBytes;
};

// Shared memory of a launch: the ring, or (after it) the split sums' gather, whichever is larger.
template <int kGroups>
inline int skinny_smem_bytes(int splits) {
  const int ring = kSkinnyStages<kGroups> * SkinnyStage<kGroups>::kBytes;
  const int owned = (kWarps + splits - 1) / splits;  // row blocks whose sums a rank adds
  const int gather = splits > 1 ? splits * owned * 32 * 4 * kGroups * 4 : 0;
  return ring > gather ? ring : gather;
}

__device__ __forceinline__ uint4 lds16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

template <int kGroups, typename TOut>
__global__ void __launch_bounds__(kWarps * 32, 1) skinny_kernel(Params p) {
  using Stage = SkinnyStage<kGroups>;
  constexpr int kStages = kSkinnyStages<kGroups>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tg = lane & 3;  // mma fragment coordinates
  const int block = blockIdx.y * kWarps + warp;  // this warp's row block
  const bool has_rows = block < p.n / kRows;
  const long ka = static_cast<long>(p.k), row0 = static_cast<long>(blockIdx.y) * kSkinnyRows;
  const int windows = p.k / kWindow, split = blockIdx.x;
  const int begin = static_cast<int>(static_cast<long>(split) * windows / p.splits);
  const int count = static_cast<int>(static_cast<long>(split + 1) * windows / p.splits) - begin;
  const __half* x = reinterpret_cast<const __half*>(p.x);
  const uint32_t ring = jaxlp::smem_addr(smem);

  // Copy window `w` into ring slot `slot`: both byte planes of the CTA's rows (rows past N and
  // tokens past M zero-filled), then the tokens. Each thread's copies are fixed but for the window's
  // K offset: 4 of the weights (its 16 bytes of rows r0 and r0 + 64 in each plane) and up to 2 of
  // the tokens, their addresses worked out once.
  const int r0 = threadIdx.x >> 2, col = threadIdx.x & 3;
  const uint8_t* wsrc[4];
  uint32_t wdst[4];
  bool wreal[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int plane = j >> 1, r = r0 + 64 * (j & 1);
    wreal[j] = row0 + r < p.n;
    wsrc[j] = (plane ? p.lower : p.upper) + (wreal[j] ? (row0 + r) * ka + col * 16 : 0);
    wdst[j] = plane * Stage::kPlaneBytes + r * kWindow + col * 16;
  }
  constexpr int kTokenCopies = Stage::kTokens * 8;
  constexpr int kTokenCopiesPerThread = (kTokenCopies + kWarps * 32 - 1) / (kWarps * 32);
  const __half* xsrc[kTokenCopiesPerThread];
  uint32_t xdst[kTokenCopiesPerThread];
  bool xreal[kTokenCopiesPerThread], xon[kTokenCopiesPerThread];
#pragma unroll
  for (int q = 0; q < kTokenCopiesPerThread; ++q) {
    const int c = threadIdx.x + q * kWarps * 32, t = c / 8, cc = c % 8;
    xon[q] = c < kTokenCopies;
    xreal[q] = xon[q] && t < p.m;
    xsrc[q] = x + (xreal[q] ? t * ka + cc * 8 : 0);
    xdst[q] = 2 * Stage::kPlaneBytes + t * Stage::kTokenRowBytes + cc * 16;
  }
  auto stage = [&](int w, int slot) {
    const uint32_t base = ring + slot * Stage::kBytes;
    const long k0 = static_cast<long>(w) * kWindow;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      jaxlp::cp_async16(base + wdst[j], wreal[j] ? wsrc[j] + k0 : wsrc[j], wreal[j] ? 16u : 0u);
#pragma unroll
    for (int q = 0; q < kTokenCopiesPerThread; ++q)
      if (xon[q]) jaxlp::cp_async16(base + xdst[q], xreal[q] ? xsrc[q] + k0 : xsrc[q], xreal[q] ? 16u : 0u);
  };

  float c[kGroups][4];
#pragma unroll
  for (int t = 0; t < kGroups; ++t) c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.f;
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < count) stage(begin + i, i);
    jaxlp::cp_async_commit();
  }
  // This thread's fragments in a slot: 16 K (tg) of rows g and g + 8 of the warp's row block, and
  // of tokens 8t + g.
  const uint32_t w_at = (warp * kRows + g) * kWindow + tg * 16;
  const uint32_t x_at = 2 * Stage::kPlaneBytes + g * Stage::kTokenRowBytes + tg * 32;
  for (int i = 0; i < count; ++i) {
    jaxlp::cp_async_wait<kStages - 2>();
    __syncthreads();  // window i is in; every warp is done with window i - 1's slot
    if (i + kStages - 1 < count) stage(begin + i + kStages - 1, (i + kStages - 1) % kStages);
    jaxlp::cp_async_commit();
    const uint32_t base = ring + (i % kStages) * Stage::kBytes;
    const uint4 u0 = lds16(base + w_at), u1 = lds16(base + w_at + 8 * kWindow);
    const uint4 l0 = lds16(base + Stage::kPlaneBytes + w_at);
    const uint4 l1 = lds16(base + Stage::kPlaneBytes + w_at + 8 * kWindow);
    // Word s of the thread's 16 K (K 4s .. 4s + 3): rows g (a0, a2) and g + 8 (a1, a3).
    uint32_t a[4][4];
    const uint32_t uu0[4] = {u0.x, u0.y, u0.z, u0.w}, ll0[4] = {l0.x, l0.y, l0.z, l0.w};
    const uint32_t uu1[4] = {u1.x, u1.y, u1.z, u1.w}, ll1[4] = {l1.x, l1.y, l1.z, l1.w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      jaxlp::nestedfp_merge4(uu0[s], ll0[s], a[s][0], a[s][2]);
      jaxlp::nestedfp_merge4(uu1[s], ll1[s], a[s][1], a[s][3]);
    }
#pragma unroll
    for (int t = 0; t < kGroups; ++t) {
      const uint32_t at = base + x_at + t * 8 * Stage::kTokenRowBytes;
      const uint4 xa = lds16(at), xb = lds16(at + 16);
      const uint32_t xx[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
      for (int s = 0; s < 4; ++s) mma_f16(c[t], a[s][0], a[s][1], a[s][2], a[s][3], xx[2 * s], xx[2 * s + 1]);
    }
  }
  jaxlp::cp_async_wait<0>();

  // c[t][i]: row g + 8 (i >> 1) of the row block, token 8t + 2tg + (i & 1).
  TOut* out = static_cast<TOut*>(p.out);
  auto write = [&]() {
#pragma unroll
    for (int t = 0; t < kGroups; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = 8 * t + 2 * tg + (i & 1), n = block * kRows + g + 8 * (i >> 1);
        if (m < p.m) out[static_cast<long>(m) * p.n + n] = jaxlp::to_out<TOut>((c[t][i] / p.divisor[m]) * p.multiplier);
      }
    }
  };
  if (p.splits == 1) {
    if (has_rows) write();
    return;
  }
  // Rank r adds the splits' sums of the row blocks of warps w = r, r + splits, ...: every rank
  // writes those warps' fragments into slot [its rank][w / splits] of rank r's shared memory.
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank()), owned = (kWarps + p.splits - 1) / p.splits;
  constexpr int kFloats = 4 * kGroups;
  cluster.sync();  // every rank is done with its ring
  {
    float* dst = cluster.map_shared_rank(reinterpret_cast<float*>(smem), warp % p.splits);
    dst += ((rank * owned + warp / p.splits) * 32 + lane) * kFloats;
#pragma unroll
    for (int t = 0; t < kGroups; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[4 * t + i] = c[t][i];
  }
  cluster.sync();
  if (warp % p.splits != rank || !has_rows) return;
  const float* src = reinterpret_cast<const float*>(smem) + ((warp / p.splits) * 32 + lane) * kFloats;
#pragma unroll
  for (int t = 0; t < kGroups; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float acc = 0.f;
      for (int r = 0; r < p.splits; ++r) acc += src[r * owned * 32 * kFloats + 4 * t + i];
      c[t][i] = acc;
    }
  write();
}

template <int kGroups, typename TOut>
cudaError_t launch_skinny_with(cudaStream_t stream, const Params& p) {
  auto* kernel = skinny_kernel<kGroups, TOut>;
  const int smem = skinny_smem_bytes<kGroups>(p.splits);
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem))
    return e;
  // All of the unified L1 / shared memory as shared memory (the ring's depth).
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                 cudaSharedmemCarveoutMaxShared))
    return e;
  const dim3 grid(p.splits, (p.n + kSkinnyRows - 1) / kSkinnyRows), block(kWarps * 32);
  return jaxlp::launch_kernel(kernel, grid, block, smem, stream, p.splits, false, p);
}

// The skinny GEMM for p.m tokens (9..64): token groups of 8, rounded up to 2, 4 or 8.
template <typename TOut>
cudaError_t launch_skinny(cudaStream_t stream, const Params& p) {
  if (p.m <= 16) return launch_skinny_with<2, TOut>(stream, p);
  if (p.m <= 32) return launch_skinny_with<4, TOut>(stream, p);
  return launch_skinny_with<8, TOut>(stream, p);
}

// ---------------------------------------------------------------------------------------------
// Host side

inline ffi::Error bad(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp nestedfp gemv: " + msg);
}

// CTAs per SM each unroll is compiled for (FP16 mode holds twice the bytes per window; two token
// groups hold more registers: one CTA fewer).
// The grid: (split, row block), each row block's splits one cluster.
template <bool kFp8, int kGroups, typename TOut>
cudaError_t launch(int unroll, cudaStream_t stream, const Params& p) {
  const dim3 grid(p.splits, p.n / kRows), block(kWarps * 32);
  constexpr int kLess = kGroups - 1;
  switch (unroll) {
    case 1:
      return jaxlp::launch_kernel(gemv_kernel<kFp8, 1, (kFp8 ? 4 : 3) - kLess, kGroups, TOut>, grid, block, 0, stream,
                                  p.splits, false, p);
    case 2:
      return jaxlp::launch_kernel(gemv_kernel<kFp8, 2, (kFp8 ? 3 : 2) - kLess, kGroups, TOut>, grid, block, 0, stream,
                                  p.splits, false, p);
    default:
      return jaxlp::launch_kernel(gemv_kernel<kFp8, 4, 1, kGroups, TOut>, grid, block, 0, stream, p.splits, false, p);
  }
}

template <bool kFp8>
ffi::Error Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> upper, ffi::Buffer<ffi::U8> lower,
                ffi::Buffer<ffi::F32> divisor, ffi::Result<ffi::AnyBuffer> out, int32_t splits, int32_t unroll,
                int32_t skinny, float multiplier) {
  auto xd = x.dimensions(), wd = upper.dimensions(), ld = lower.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return bad("expected x [M, K] and upper [N, K]");
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  const auto want = kFp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::F16;
  if (x.element_type() != want)
    return bad(kFp8 ? "FP8 mode takes float8_e4m3fn activations" : "FP16 mode takes float16 activations");
  if (wd[1] != k) return bad("upper bytes [N, K] do not match x's K");
  if (!kFp8 && (ld.size() != 2 || ld[0] != n || ld[1] != k)) return bad("lower bytes must match upper [N, K]");
  if (skinny && kFp8) return bad("the skinny GEMM computes the FP16 mode");
  const int64_t max_m = skinny ? kSkinnyMaxTokens : kFp8 ? kMaxTokens : 2 * kMaxTokens;
  if (m < 1 || m > max_m)
    return bad("1 to " + std::to_string(max_m) + " tokens in the " + (skinny ? "skinny GEMM" : "GEMV") + ", got " +
               std::to_string(m));
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
    if (skinny) return launch_skinny<decltype(out_type)>(stream, p);
    if (!kFp8 && m > kMaxTokens) return launch<kFp8, 2, decltype(out_type)>(unroll, stream, p);
    return launch<kFp8, 1, decltype(out_type)>(unroll, stream, p);
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
                                  .Attr<int32_t>("skinny")       // 1: the skinny GEMM (FP16 mode), 0: the GEMV
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
                                  .Attr<int32_t>("skinny")       // 1: the skinny GEMM (FP16 mode), 0: the GEMV
                                  .Attr<float>("multiplier"),
                              {ffi::Traits::kCmdBufferCompatible});
