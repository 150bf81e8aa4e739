// pipe_kernel: the small-M GEMV with a cp.async ring, BF16 tensor cores and no staging for W4A16,
// for NVFP4 and (FMT, WeightFormat in nvfp4_kernels.cuh) MXFP4 and DialectFP4 weights.
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
//
// The same ring and clusters also run the regs GEMV's arithmetic on its staged FP16 x_eff ("pipe16",
// handler JaxlpNvfp4Gemv); see PipeDecode. Argument checks and handlers: nvfp4_ffi.cu.
//
// MXFP4 and DialectFP4 ("pipe" with FMT != kFmtNvfp4, handler JaxlpBlockFp4Matmul): a stage's 16
// metadata bytes per row hold the chunk's 8 block scales (E8M0) or exponent codes, and for DialectFP4
// its 4 bytes of dialect ids. Thread (g, t) takes blocks 2t and 2t+1 of the chunk (its two 32-k
// halves) and decodes each 8-code word by table lookup (decode_word_lut: the block's 8 magnitudes as
// BF16, the dialect's table read from shared memory) into natural-order pairs, so the activations
// enter the MMA as loaded. Every product is exact (BF16 holds every magnitude times every scale of
// both formats); no tensor scale. Needs K % 128 == 0.

#include <algorithm>

#include "launch.cuh"
#include "nvfp4_common.cuh"

namespace jaxlp_nvfp4 {

constexpr int kPipeWarps = 8;

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

// DialectFP4: the formatbook's 16 tables (decode_word_lut's layout, from p.tables) in shared memory.
template <int FMT>
__device__ __forceinline__ const uint4* load_dialect_tables(const PipeParams& p) {
  if constexpr (FMT == kFmtDialect) {
    __shared__ uint4 tables[16];
    if (threadIdx.x < 16) tables[threadIdx.x] = reinterpret_cast<const uint4*>(p.tables)[threadIdx.x];
    __syncthreads();
    return tables;
  } else {
    return nullptr;
  }
}

// One (tile, chunk) item of pipe_kernel on MXFP4 or DialectFP4 weights (FMT): thread (g, t) takes
// k [k0, k0 + 64) = blocks 2t and 2t+1 of the chunk, of rows g and g+8 of each 16-row tile,
// decodes them by table lookup (decode_word_lut) and multiplies them with the BF16 activations of
// 8 tokens as loaded (natural-order pairs on both sides).
template <int R, int NT, int FMT>
__device__ __forceinline__ void pipe_item_lut(const PipeParams& p, const uint8_t* st, int kData, int g, int t,
                                              int k0, bool kval, const uint4* dialect_tab, int tile,
                                              float (&acc)[R][NT][4]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint4 x[NT][4];  // token 8*nt + g, k [k0 + 32*half + 8w, +8)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int tok = nt * 8 + g;
      const __nv_bfloat16* src = p.x + static_cast<int64_t>(tok) * p.K + k0 + 32 * half;
#pragma unroll
      for (int w = 0; w < 4; ++w)
        x[nt][w] = (kval && tok < p.M) ? ld_act_nc_v4(src + 8 * w) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int rt = 0; rt < R; ++rt) {
      uint4 wv[2];
      uint32_t tab[2][4], scale2[2];  // [row g / g+8]: the block's table and BF16x2 scale
      int dialect_shift[2];           // where the row's dialect ids start in its 8 staged bytes (0 or 2)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = rt * 16 + g + 8 * h;
        dialect_shift[h] = static_cast<int>((min(tile * 16 * R + row, p.N - 1) * int64_t(p.K / 64)) & 2);
        wv[h] = *reinterpret_cast<const uint4*>(st + row * 128 + (((2 * t + half) ^ g) << 4));
        const uint8_t* meta = st + kData + row * 16;
        const uint32_t e = meta[2 * t + half];
        if constexpr (FMT == kFmtMxfp4) {
          scale2[h] = mxfp4_scale2(e);
          e2m1_table(tab[h]);
        } else {
          scale2[h] = dialect_scale2(e);
          const uint4 tv = dialect_tab[(meta[8 + dialect_shift[h] + t] >> (4 * half)) & 0xFu];
          tab[h][0] = tv.x;
          tab[h][1] = tv.y;
          tab[h][2] = tv.z;
          tab[h][3] = tv.w;
        }
      }
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        uint32_t r0[4], r1[4];
        decode_word_lut(word_of(wv[0], w), tab[0], scale2[0], r0);
        decode_word_lut(word_of(wv[1], w), tab[1], scale2[1], r1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint4 xv = x[nt][w];
          mma_16816_bf16(acc[rt][nt], r0[0], r1[0], r0[1], r1[1], xv.x, xv.y);
          mma_16816_bf16(acc[rt][nt], r0[2], r1[2], r0[3], r1[3], xv.z, xv.w);
        }
      }
    }
  }
}

// S: ring stages per warp (S - 1 items in flight); ACC: MMA chains per item (kDecF16).
template <int R, int NT, int C, typename TOut, int DEC = kDecBF16, int S = kPipeStagesDec<R, DEC>, int ACC = 1,
          int FMT = kFmtNvfp4>
__global__ void __launch_bounds__(256, (kPipeMinBlocks<R, DEC, S>)) pipe_kernel(const PipeParams p) {
  static_assert(S >= 2, "the ring needs at least 2 stages");
  static_assert(FMT == kFmtNvfp4 || DEC == kDecBF16, "MXFP4 and DialectFP4 run the BF16 decode");
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
  const int64_t row_bytes = p.K / 2, row_scales = p.K / (FMT == kFmtNvfp4 ? 16 : 32), row_ids = p.K / 64;
  const uint4* dialect_tab = load_dialect_tables<FMT>(p);

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
    if constexpr (FMT == kFmtNvfp4) {
#pragma unroll
      for (int q = 0; q < 2 * R; ++q) {  // 16R rows x 4 units of 4 scale bytes
        const int u = lane + 32 * q, row = u >> 2, cu = u & 3;
        const int r = min(base + row, p.N - 1);
        const bool ok = c * kChunkK + cu * 64 < p.K;
        const uint8_t* src = p.wscale + r * row_scales + (ok ? c * 16 + cu * 4 : 0);
        cp_async4(smem_addr(st + kData + row * 16 + cu * 4), src, ok ? 4u : 0u);
      }
    } else {
#pragma unroll
      for (int q = 0; q < R; ++q) {  // 16R rows x 2 units of 4 scale bytes (8 blocks of 32)
        const int u = lane + 32 * q, row = u >> 1, cu = u & 1;
        const int r = min(base + row, p.N - 1);
        const bool ok = c * kChunkK + cu * 128 < p.K;
        const uint8_t* src = p.wscale + r * row_scales + (ok ? c * 8 + cu * 4 : 0);
        cp_async4(smem_addr(st + kData + row * 16 + cu * 4), src, ok ? 4u : 0u);
      }
      if constexpr (FMT == kFmtDialect) {
        // 16R rows x the 4-byte-aligned 8 bytes holding the chunk's (up to) 4 bytes of dialect ids, which
        // start 2 bytes in where K % 256 == 128 and the row is odd (dialect_shift); none past the array.
        for (int u = lane; u < 32 * R; u += 32) {
          const int row = u >> 1, cu = u & 1;
          const int r = min(base + row, p.N - 1);
          const int64_t at = ((r * row_ids + c * 4) & ~int64_t(3)) + 4 * cu;
          const int64_t left = p.N * row_ids - at;
          const uint32_t bytes = left >= 4 ? 4u : left > 0 ? static_cast<uint32_t>(left) : 0u;
          cp_async4(smem_addr(st + kData + row * 16 + 8 + 4 * cu), p.wdialect + (bytes ? at : 0), bytes);
        }
      }
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

  const float gscale =
      FMT == kFmtNvfp4 ? *p.wg * 128.0f * (p.xg != nullptr ? act_scale(p.xg, p.xg_amax) : 1.0f) : 1.0f;
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
      if constexpr (FMT != kFmtNvfp4) {
        pipe_item_lut<R, NT, FMT>(p, st, kData, g, t, k0, kval, dialect_tab, tile, acc);
      } else if constexpr (DEC == kDecProbe) {
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
// Host side

template <int R, int NT, int C, typename T, int DEC, int S = kPipeStagesDec<R, DEC>, int ACC = 1, int FMT = kFmtNvfp4>
cudaError_t launch_pipe(cudaStream_t stream, PipeParams p, bool pdl) {
  const void* kernel = reinterpret_cast<const void*>(pipe_kernel<R, NT, C, T, DEC, S, ACC, FMT>);
  constexpr int smem = kPipeSmemBytes<R, NT, S>;
  int max_ctas = 0;
  cudaError_t e = resident_ctas(kernel, smem, C, &max_ctas);
  if (e != cudaSuccess) return e;
  p.tiles = (p.N + 16 * R - 1) / (16 * R);
  p.chunks = (p.K + kChunkK - 1) / kChunkK;
  const int clusters = std::max(1, std::min(p.tiles, max_ctas / C));
  return jaxlp::launch_kernel(pipe_kernel<R, NT, C, T, DEC, S, ACC, FMT>, dim3(clusters * C), dim3(256), smem, stream,
                              C, pdl, p);
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

template <typename T>
cudaError_t run_pipe(cudaStream_t stream, const PipeParams& p, int rows, int split, bool pdl) {
  return launch_pipe_cfg<T>(stream, p, rows, split, pdl);
}

template <int R, int C, int FMT, typename TOut>
cudaError_t launch_block_fp4_nt(cudaStream_t stream, const PipeParams& p, bool pdl) {
  const int nt = (p.M + 7) / 8;
  constexpr int S = kPipeStages<R>;
  if (nt == 1) return launch_pipe<R, 1, C, TOut, kDecBF16, S, 1, FMT>(stream, p, pdl);
  if (nt == 2) return launch_pipe<R, 2, C, TOut, kDecBF16, S, 1, FMT>(stream, p, pdl);
  return launch_pipe<R, 4, C, TOut, kDecBF16, S, 1, FMT>(stream, p, pdl);
}

template <int FMT, typename TOut>
cudaError_t launch_block_fp4(cudaStream_t stream, const PipeParams& p, int rows, int split, bool pdl) {
  if (rows == 1) {
    if (split == 1) return launch_block_fp4_nt<1, 1, FMT, TOut>(stream, p, pdl);
    if (split == 2) return launch_block_fp4_nt<1, 2, FMT, TOut>(stream, p, pdl);
    return launch_block_fp4_nt<1, 4, FMT, TOut>(stream, p, pdl);
  }
  if (split == 1) return launch_block_fp4_nt<2, 1, FMT, TOut>(stream, p, pdl);
  if (split == 2) return launch_block_fp4_nt<2, 2, FMT, TOut>(stream, p, pdl);
  return launch_block_fp4_nt<2, 4, FMT, TOut>(stream, p, pdl);
}

template <typename TOut>
cudaError_t run_pipe_block_fp4(cudaStream_t stream, const PipeParams& p, int fmt, int rows, int split, bool pdl) {
  return fmt == kFmtMxfp4 ? launch_block_fp4<kFmtMxfp4, TOut>(stream, p, rows, split, pdl)
                          : launch_block_fp4<kFmtDialect, TOut>(stream, p, rows, split, pdl);
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

template cudaError_t run_pipe<__nv_bfloat16>(cudaStream_t, const PipeParams&, int, int, bool);
template cudaError_t run_pipe<float>(cudaStream_t, const PipeParams&, int, int, bool);
template cudaError_t run_pipe_block_fp4<__nv_bfloat16>(cudaStream_t, const PipeParams&, int, int, int, bool);
template cudaError_t run_pipe_block_fp4<float>(cudaStream_t, const PipeParams&, int, int, int, bool);
template cudaError_t run_pipe16<__nv_bfloat16>(cudaStream_t, int, const GemvParams&, int, int, bool, GemvVariant);
template cudaError_t run_pipe16<float>(cudaStream_t, int, const GemvParams&, int, int, bool, GemvVariant);

}  // namespace jaxlp_nvfp4
