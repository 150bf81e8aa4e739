// gemm_kernel: the large-M path. CTA tile BN (64 or 128) weight rows x BM tokens x all K in 64-k
// stages, four shared-memory stages filled by cp.async (weights: BN rows x 32 bytes + 4 scale bytes;
// activations: BM tokens x 128 bytes, 16-byte units XOR-swizzled by token). 8 warps as BN/32 (rows) x
// 256/BN (tokens), each 32 rows x BM*BN/256 tokens; optionally split-K over a cluster of 2 or 4 CTAs
// (partials reduced through distributed shared memory, in rank order): thread (g, t) owns k [16t, 16t+16) of the stage (one 16-element block, one
// scale byte), decodes it to BF16 as pipe_kernel does and runs BF16 mma.sync m16n8k16 with FP32
// accumulators. CTAs are ordered in groups of 8 token tiles so that concurrent CTAs share weight
// and activation tiles in L2. Needs K % 64 == 0; x is BF16 (W4A16) or the BF16 x_eff (W4A4).
//
// MXFP4 and DialectFP4 (FMT, handler JaxlpBlockFp4Matmul): wscale is then the per-call packed metadata,
// one 32-bit word per (row, 64-k stage): bytes 0 and 1 the scale bytes (E8M0 / exponent codes) of the
// stage's two 32-blocks, byte 2 their dialect ids (block_fp4.py's gemm_metadata), so a stage's copy is
// NVFP4's. Thread (g, t) decodes its 16 k (block t / 2) by table lookup (decode_word_lut) into
// natural-order pairs, which meet the activations as loaded.
//
// Handler JaxlpNvfp4Matmul; argument checks and handlers: nvfp4_ffi.cu.

#include "launch.cuh"
#include "nvfp4_common.cuh"

namespace jaxlp_nvfp4 {

constexpr int kGemmK = 64, kGemmStages = 4, kGemmGroup = 8;

template <int BN, int BM>
constexpr int kGemmStageBytes = BN * 32 + BN * 4 + BM * 128;
template <int BN, int BM>
constexpr int kGemmSmemBytes = kGemmStages * kGemmStageBytes<BN, BM>;

// DialectFP4: the formatbook's 16 tables (decode_word_lut's layout, from p.tables) in shared memory.
template <int FMT>
__device__ __forceinline__ const uint4* gemm_dialect_tables(const PipeParams& p) {
  if constexpr (FMT == kFmtDialect) {
    __shared__ uint4 tables[16];
    if (threadIdx.x < 16) tables[threadIdx.x] = reinterpret_cast<const uint4*>(p.tables)[threadIdx.x];
    return tables;  // read after the main loop's first __syncthreads
  } else {
    return nullptr;
  }
}

template <int BN, int BM, int KS, typename TOut, int FMT = kFmtNvfp4>
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

  const uint4* dialect_tab = gemm_dialect_tables<FMT>(p);
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
    uint32_t tab[FMT == kFmtNvfp4 ? 1 : 2][2][4];  // MXFP4 / DialectFP4: the block's table per row
#pragma unroll
    for (int rt = 0; rt < 2; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = wr * 32 + rt * 16 + g + 8 * h;
        wv[rt][h] = *reinterpret_cast<const uint2*>(st + row * 32 + 8 * t);
        if constexpr (FMT == kFmtNvfp4) {
          const uint32_t sb = st[kScaleOff + row * 4 + t];
          sc[rt][h] = e4m3x2_to_bf16x2_scaled(sb | (sb << 8));
        } else {
          const uint32_t meta = *reinterpret_cast<const uint32_t*>(st + kScaleOff + row * 4);
          const uint32_t e = (meta >> (8 * (t >> 1))) & 0xFFu;
          if constexpr (FMT == kFmtMxfp4) {
            sc[rt][h] = mxfp4_scale2(e);
            e2m1_table(tab[rt][h]);
          } else {
            sc[rt][h] = dialect_scale2(e);
            const uint4 tv = dialect_tab[(meta >> (16 + 4 * (t >> 1))) & 0xFu];
            tab[rt][h][0] = tv.x;
            tab[rt][h][1] = tv.y;
            tab[rt][h][2] = tv.z;
            tab[rt][h][3] = tv.w;
          }
        }
      }
#pragma unroll
    for (int w = 0; w < 2; ++w) {  // word w: k [16t + 8w, +8)
      uint32_t a[2][2][4];
#pragma unroll
      for (int rt = 0; rt < 2; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (FMT == kFmtNvfp4) {
            decode_word_bf16(w ? wv[rt][h].y : wv[rt][h].x, a[rt][h]);
#pragma unroll
            for (int i = 0; i < 4; ++i) a[rt][h][i] = hmul2_bf16(a[rt][h][i], sc[rt][h]);
          } else {
            decode_word_lut(w ? wv[rt][h].y : wv[rt][h].x, tab[rt][h], sc[rt][h], a[rt][h]);
          }
        }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int tok = wc * TW + nt * 8 + g;  // tok & 7 == g
        const uint4 v = *reinterpret_cast<const uint4*>(st + kXOff + tok * 128 + (((2 * t + w) ^ g) << 4));
        uint32_t b[4];
        if constexpr (FMT == kFmtNvfp4) {
          act_pairs(v, b);
        } else {
          b[0] = v.x;
          b[1] = v.y;
          b[2] = v.z;
          b[3] = v.w;
        }
#pragma unroll
        for (int rt = 0; rt < 2; ++rt) {
          mma_16816_bf16(acc[rt][nt], a[rt][0][0], a[rt][1][0], a[rt][0][1], a[rt][1][1], b[0], b[1]);
          mma_16816_bf16(acc[rt][nt], a[rt][0][2], a[rt][1][2], a[rt][0][3], a[rt][1][3], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  const float gscale =
      FMT == kFmtNvfp4 ? *p.wg * 128.0f * (p.xg != nullptr ? act_scale(p.xg, p.xg_amax) : 1.0f) : 1.0f;
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

template <int BN, int BM, int KS, typename T, int FMT = kFmtNvfp4>
cudaError_t launch_gemm(cudaStream_t stream, const PipeParams& p, bool pdl) {
  const void* kernel = reinterpret_cast<const void*>(gemm_kernel<BN, BM, KS, T, FMT>);
  constexpr int smem = kGemmSmemBytes<BN, BM>;
  int unused = 0;
  cudaError_t e = resident_ctas(kernel, smem, KS, &unused);  // raises the shared-memory limit
  if (e != cudaSuccess) return e;
  if (p.K / kGemmK < KS) return cudaErrorInvalidValue;
  const int64_t tiles = int64_t((p.N + BN - 1) / BN) * ((p.M + BM - 1) / BM) * KS;
  if (tiles > (int64_t(1) << 31) - 1) return cudaErrorInvalidConfiguration;
  return jaxlp::launch_kernel(gemm_kernel<BN, BM, KS, T, FMT>, dim3(static_cast<unsigned>(tiles)), dim3(256), smem,
                              stream, KS, pdl, p);
}

template <int BN, int BM, typename T, int FMT>
cudaError_t launch_gemm_split(cudaStream_t stream, const PipeParams& p, int split, bool pdl) {
  if (split == 1) return launch_gemm<BN, BM, 1, T, FMT>(stream, p, pdl);
  if (split == 2) return launch_gemm<BN, BM, 2, T, FMT>(stream, p, pdl);
  return launch_gemm<BN, BM, 4, T, FMT>(stream, p, pdl);
}

template <typename T, int FMT = kFmtNvfp4>
cudaError_t run_gemm_fmt(cudaStream_t stream, const PipeParams& p, int block_m, int block_n, int split, bool pdl) {
  if (block_n == 64)
    return block_m == 64 ? launch_gemm_split<64, 64, T, FMT>(stream, p, split, pdl)
                         : launch_gemm_split<64, 128, T, FMT>(stream, p, split, pdl);
  return block_m == 64 ? launch_gemm_split<128, 64, T, FMT>(stream, p, split, pdl)
                       : launch_gemm_split<128, 128, T, FMT>(stream, p, split, pdl);
}

template <typename T>
cudaError_t run_gemm(cudaStream_t stream, const PipeParams& p, int block_m, int block_n, int split, bool pdl) {
  return run_gemm_fmt<T>(stream, p, block_m, block_n, split, pdl);
}

template <typename T>
cudaError_t run_gemm_block_fp4(cudaStream_t stream, const PipeParams& p, int fmt, int block_m, int block_n,
                               int split, bool pdl) {
  return fmt == kFmtMxfp4 ? run_gemm_fmt<T, kFmtMxfp4>(stream, p, block_m, block_n, split, pdl)
                          : run_gemm_fmt<T, kFmtDialect>(stream, p, block_m, block_n, split, pdl);
}

template cudaError_t run_gemm<__nv_bfloat16>(cudaStream_t, const PipeParams&, int, int, int, bool);
template cudaError_t run_gemm<float>(cudaStream_t, const PipeParams&, int, int, int, bool);
template cudaError_t run_gemm_block_fp4<__nv_bfloat16>(cudaStream_t, const PipeParams&, int, int, int, int, bool);
template cudaError_t run_gemm_block_fp4<float>(cudaStream_t, const PipeParams&, int, int, int, int, bool);

}  // namespace jaxlp_nvfp4
