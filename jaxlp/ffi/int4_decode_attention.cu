// Decode attention over per-token INT4 KV units (FireQ's cache) with the new token (XLA FFI custom
// call, sm_90); Python side and layout: jaxlp/ffi/int4_decode_attention.py.
//
// Layout read, per (row b, token t, KV head h): key and value codes [D/2] bytes, signed INT4 nibbles,
// channel i in the low nibble of byte i and channel i + D/2 in its high nibble; one FP8 E4M3 scale
// per token for keys and one for values. Tokens of one head are D/2 * KVH bytes apart.
//
// One CTA of 4 warps per (KV head, row, split). The split's tokens go to the warps 32 at a time
// (round robin); per 32 tokens a warp
//   1. loads the codes straight into registers (a key token's 64 bytes by a quad of threads, 16
//      bytes each; a value token's by 8 threads, 8 bytes each; no shared memory) and converts them
//      to FP16 by one LOP3 per two codes: (w & 0x000F000F) ^ 0x64086408 is the FP16 pair 1024 + (c +
//      8), minus 1032 (HSUB2) the codes c themselves (the high nibbles: ^ 0x64806480, then * 1/16 -
//      72 by HFMA2); exact;
//   2. S = Q K^T by mma.sync m16n8k16 (FP16 in, FP32 accumulate): the G <= 16 query heads of the KV
//      head are the 16 rows (FP16 of the attended queries times the softmax scale), the tokens the
//      columns. Which channel a
//      k-slot holds is free (a dot product): thread (gid, tig) takes channels base + {0, 2} | +1 |
//      +D/2 of bytes base = tig * D/8 + 4 j of its key token, and its query fragments hold the
//      same channels;
//   3. scores times the token's key scale, soft-capped, masked to the split's tokens, then an
//      online softmax (base 2, FP32);
//   4. O += (P * value scale) V by the same MMA: P's accumulator fragments are the A operand as
//      they lie (two n-tiles of scores make one k-step of 16 tokens); the value codes of two
//      consecutive tokens are interleaved by one PRMT so that each FP16 pair holds one channel of
//      both tokens. Output column n of n-tile nt is channel n * D/16 + nt / 2 + (nt & 1) * D/2.
// The 4 warps' partials are merged in shared memory, each warp storing to its own slice (a float
// atomicAdd there is a CAS loop on sm_90: it cost 14 us per CTA). The last split then takes the new
// token (FP16 key and value, if the row's new_ok), in FP32 on CUDA cores. The CTA writes its split's
// unnormalized output o (relative to its max m), m (natural log units) and l = sum exp(s - m); XLA
// merges the splits. An empty split gives o = 0, m = -inf, l = 0.
//
// The queries are transformed as FireQ attends them before any of this (so that XLA runs no kernel
// for it): q / channel_scale[h] (the CRS key scales of the KV head), then, with fp8_queries, through
// FP8 E4M3 per query head with the float32 scale max|x| / 448 (jaxlp.kvcache.quant.fake_quantize_fp8),
// then times the softmax scale.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "launch.cuh"
#include "mma_sync.cuh"
#include "split_merge.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxlp_int4attn {

using jaxlp::mma_f16;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 32;  // tokens per warp step: 4 n-tiles of S, 2 k-steps of O += P V
constexpr int kRows = 16;   // query heads per KV head (the MMA's rows)
constexpr float kLog2e = 1.4426950408889634f;

struct Params {
  const float* q;           // [B, KVH, G, D], as the model gives them
  const float* q_channel_scale;  // [KVH, D]: the queries are divided by them (FireQ's CRS scales)
  const int32_t* bounds;    // [B, 4]: lo, hi (the units' token range), new_ok, 0
  const uint8_t* k_codes;   // [B, T, KVH, D/2]
  const uint8_t* k_scale;   // [B, T, KVH]: E4M3 bits
  const uint8_t* v_codes;
  const uint8_t* v_scale;
  const __half* new_k;      // [B, KVH, D]
  const __half* new_v;
  float* o;                 // [B, KVH, S, G, D]
  float* m;                 // [B, KVH, S, G]
  float* l;
  int kvh, g, splits, tokens;
  int fp8_queries;          // 1: the divided queries through FP8 E4M3 per query head
  float scale;              // the softmax scale
  float softcap;            // 0: none
};

// Per head_dim: bytes of a token's codes, words a thread loads per key token (4 threads) and per
// value token (8 threads), k-steps of S = Q K^T and n-tiles of O.
template <int D>
struct Shape {
  static constexpr int kBytes = D / 2;
  static constexpr int kKeyWords = D / 32;
  static constexpr int kValueWords = D / 64;
  static constexpr int kSteps = D / 16;
  static constexpr int kTiles = D / 8;
};

__device__ __forceinline__ uint32_t pack_half2(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float e4m3(uint8_t bits) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(bits), __NV_E4M3);
  return __half2float(__half(h));
}

// The four FP16 code pairs of a word of INT4 nibbles: c[0] = low nibbles of bytes (0, 2), c[1] =
// their high nibbles, c[2], c[3] the same of bytes (1, 3). Exact.
__device__ __forceinline__ void int4_to_half2(uint32_t w, uint32_t (&c)[4]) {
  const __half2 k1032 = __float2half2_rn(1032.f), k16th = __float2half2_rn(0.0625f), k72 = __float2half2_rn(-72.f);
  const uint32_t w8 = w >> 8;
  uint32_t r[4] = {(w & 0x000F000Fu) ^ 0x64086408u, (w & 0x00F000F0u) ^ 0x64806480u,
                   (w8 & 0x000F000Fu) ^ 0x64086408u, (w8 & 0x00F000F0u) ^ 0x64806480u};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 x = *reinterpret_cast<__half2*>(&r[i]);
    x = (i & 1) ? __hfma2(x, k16th, k72) : __hsub2(x, k1032);
    c[i] = *reinterpret_cast<uint32_t*>(&x);
  }
}

template <int N>
__device__ __forceinline__ void load_words(const uint8_t* p, uint32_t (&w)[N]) {
  if constexpr (N == 4) {
    const uint4 x = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
  } else if constexpr (N == 2) {
    const uint2 x = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = x.x, w[1] = x.y;
  } else {
    static_assert(N == 1, "1, 2 or 4 words");
    w[0] = __ldg(reinterpret_cast<const uint32_t*>(p));
  }
}

// A warp's 32 tokens in registers: key codes of n-tile j (token c0 + 8 j + gid, bytes tig * D/8 on),
// value codes of k-step i (tokens c0 + 16 i + {2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9}, bytes gid *
// D/16 on), and lane t's token c0 + t's key scale (byte 0) and value scale (byte 1). Tokens past
// the split read its last one (masked).
template <int D>
struct Chunk {
  uint32_t k[4][Shape<D>::kKeyWords];
  uint32_t v[2][4][Shape<D>::kValueWords];
  uint32_t scales;
};

template <int D>
__device__ __forceinline__ void load_chunk(Chunk<D>& c, const uint8_t* kbase, const uint8_t* vbase,
                                           const uint8_t* ksc, const uint8_t* vsc, size_t stride, int kvh, int c0,
                                           int last, int lane) {
  const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int j = 0; j < 4; ++j) load_words(kbase + min(c0 + 8 * j + gid, last) * stride, c.k[j]);
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      load_words(vbase + min(c0 + 16 * i + 2 * tig + (e & 1) + 8 * (e >> 1), last) * stride, c.v[i][e]);
  const size_t t = static_cast<size_t>(min(c0 + lane, last)) * kvh;
  c.scales = __ldg(ksc + t) | (static_cast<uint32_t>(__ldg(vsc + t)) << 8);
}

template <int D>
__global__ void __launch_bounds__(kThreads) int4_tokens_kernel(Params p) {
  using S = Shape<D>;
  const int h = blockIdx.x, b = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  const int32_t* bounds = p.bounds + 4 * b;
  const int lo = bounds[0], hi = bounds[1];
  const int n = hi > lo ? hi - lo : 0;
  const int per = (n + p.splits - 1) / p.splits;  // tokens per split (the last may have fewer)
  const int t0 = lo + split * per;
  const int t1 = min(t0 + per, hi);

  // Query fragments (rows gid, gid + 8; zero past G), channels as the key fragments take them,
  // from a copy of the KV head's queries in shared memory (one coalesced load, no branches).
  __shared__ float q_sm[kRows][D];
  const float* qh = p.q + (static_cast<size_t>(b) * p.kvh + h) * p.g * D;
  for (int i = threadIdx.x; i < kRows * D; i += kThreads)
    (&q_sm[0][0])[i] = i < p.g * D ? __ldg(qh + i) / __ldg(p.q_channel_scale + h * D + i % D) : 0.f;
  __syncthreads();
  for (int row = warp; row < p.g; row += kWarps) {  // FP8 per query head, then the softmax scale
    float amax = 0.f;
    if (p.fp8_queries) {
      for (int c = lane; c < D; c += 32) amax = fmaxf(amax, fabsf(q_sm[row][c]));
#pragma unroll
      for (int off = 16; off; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    }
    const float qscale = amax / 448.f > 0.f ? amax / 448.f : 1.f;
    for (int c = lane; c < D; c += 32) {
      float x = q_sm[row][c];
      if (p.fp8_queries)
        x = e4m3(static_cast<uint8_t>(__nv_cvt_float_to_fp8(x / qscale, __NV_SATFINITE, __NV_E4M3))) * qscale;
      q_sm[row][c] = x * p.scale;
    }
  }
  __syncthreads();
  auto qv = [&](int r, int c) { return q_sm[r][c]; };
  uint32_t qa[S::kSteps][4];
#pragma unroll
  for (int s = 0; s < S::kSteps; ++s) {
    const int c = tig * (D / 8) + 4 * (s >> 1) + (s & 1);
    qa[s][0] = pack_half2(qv(gid, c), qv(gid, c + 2));
    qa[s][1] = pack_half2(qv(gid + 8, c), qv(gid + 8, c + 2));
    qa[s][2] = pack_half2(qv(gid, c + D / 2), qv(gid, c + D / 2 + 2));
    qa[s][3] = pack_half2(qv(gid + 8, c + D / 2), qv(gid + 8, c + D / 2 + 2));
  }

  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
  float o[S::kTiles][4];
#pragma unroll
  for (int nt = 0; nt < S::kTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;

  const size_t stride = static_cast<size_t>(p.kvh) * S::kBytes;  // between tokens of a head
  const size_t head0 = static_cast<size_t>(b) * p.tokens * p.kvh + h;  // token 0 of (b, h), in tokens
  const uint8_t* kbase = p.k_codes + head0 * S::kBytes + tig * (D / 8);
  const uint8_t* vbase = p.v_codes + head0 * S::kBytes + gid * (D / 16);
  const uint8_t* ksc = p.k_scale + head0;
  const uint8_t* vsc = p.v_scale + head0;
  const float cap = p.softcap, inv_cap = p.softcap > 0.f ? 1.f / p.softcap : 0.f;

  const int last = t1 - 1;
  for (int c0 = t0 + warp * kChunk; c0 < t1; c0 += kWarps * kChunk) {
    Chunk<D> cur;
    load_chunk<D>(cur, kbase, vbase, ksc, vsc, stride, p.kvh, c0, last, lane);
    const auto& kw = cur.k;
    const auto& vw = cur.v;
    // Scales of this thread's score columns (n-tile j, tokens c0 + 8 j + 2 tig + {0, 1}) from the
    // lanes that loaded them (lane t: token c0 + t, key scale in byte 0, value scale in byte 1).
    float ks[4][2], vs[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t x = __shfl_sync(0xffffffffu, cur.scales, 8 * j + 2 * tig + e);
        ks[j][e] = e4m3(static_cast<uint8_t>(x));
        vs[j][e] = e4m3(static_cast<uint8_t>(x >> 8));
      }

    // S = Q K^T.
    float sc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
      for (int w = 0; w < S::kKeyWords; ++w) {
        uint32_t c[4];
        int4_to_half2(kw[j][w], c);
        mma_f16(sc[j], qa[2 * w][0], qa[2 * w][1], qa[2 * w][2], qa[2 * w][3], c[0], c[1]);
        mma_f16(sc[j], qa[2 * w + 1][0], qa[2 * w + 1][1], qa[2 * w + 1][2], qa[2 * w + 1][3], c[2], c[3]);
      }
    }

    // Online softmax, base 2; c[j][e]: row gid (e < 2) or gid + 8, token c0 + 8 j + 2 tig + (e & 1).
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = sc[j][e] * ks[j][e & 1];
        if (cap > 0.f) x = cap * tanhf(x * inv_cap);
        x = c0 + 8 * j + 2 * tig + (e & 1) <= last ? x * kLog2e : -INFINITY;
        sc[j][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float base[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float mnew = fmaxf(mrow[r], mx[r]);
      base[r] = mnew == -INFINITY ? 0.f : mnew;
      alpha[r] = mrow[r] == -INFINITY ? 0.f : fast_exp2(mrow[r] - mnew);
      mrow[r] = mnew;
      lrow[r] *= alpha[r];
    }
#pragma unroll
    for (int nt = 0; nt < S::kTiles; ++nt) {
      o[nt][0] *= alpha[0], o[nt][1] *= alpha[0];
      o[nt][2] *= alpha[1], o[nt][3] *= alpha[1];
    }
    uint32_t pa[4][2];  // per n-tile j: FP16 (P * value scale) of rows gid, gid + 8
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float pr[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        pr[e] = fast_exp2(sc[j][e] - base[e >> 1]);
        lrow[e >> 1] += pr[e];
      }
      pa[j][0] = pack_half2(pr[0] * vs[j][0], pr[1] * vs[j][1]);
      pa[j][1] = pack_half2(pr[2] * vs[j][0], pr[3] * vs[j][1]);
    }

    // O += P V: k-step i = n-tiles 2 i, 2 i + 1 of P; B columns gid: the thread's value channels.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t a0 = pa[2 * i][0], a1 = pa[2 * i][1], a2 = pa[2 * i + 1][0], a3 = pa[2 * i + 1][1];
#pragma unroll
      for (int w = 0; w < S::kValueWords; ++w) {
        uint32_t lo_b0[4], hi_b0[4], lo_b1[4], hi_b1[4];  // bytes (0, 1) and (2, 3) of the word, both tokens
        int4_to_half2(__byte_perm(vw[i][0][w], vw[i][1][w], 0x5410), lo_b0);
        int4_to_half2(__byte_perm(vw[i][0][w], vw[i][1][w], 0x7632), hi_b0);
        int4_to_half2(__byte_perm(vw[i][2][w], vw[i][3][w], 0x5410), lo_b1);
        int4_to_half2(__byte_perm(vw[i][2][w], vw[i][3][w], 0x7632), hi_b1);
        // lo_b0[x]: x = 0 low nibble of byte 0, 1 its high nibble, 2 byte 1 low, 3 byte 1 high.
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          mma_f16(o[8 * w + x], a0, a1, a2, a3, lo_b0[x], lo_b1[x]);
          mma_f16(o[8 * w + 4 + x], a0, a1, a2, a3, hi_b0[x], hi_b1[x]);
        }
      }
    }
  }

  // Merge the warps: row sums over the quad; each warp's unnormalized output, max and sum to
  // shared memory (plain stores), then every row summed over the warps, weighted by exp2(m_w - m).
  __shared__ float m_sm[kWarps][kRows], l_sm[kWarps][kRows];
  __shared__ float o_sm[kWarps][kRows][D];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);
    lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);
  }
  if (tig == 0) {
    m_sm[warp][gid] = mrow[0], m_sm[warp][gid + 8] = mrow[1];
    l_sm[warp][gid] = lrow[0], l_sm[warp][gid + 8] = lrow[1];
  }
#pragma unroll
  for (int nt = 0; nt < S::kTiles; ++nt) {
    const int ch = 2 * tig * (D / 16) + (nt >> 1) + (nt & 1) * (D / 2);  // column 2 tig; 2 tig + 1 is D/16 on
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = gid + 8 * (e >> 1);
      if (row < p.g) o_sm[warp][row][ch + (e & 1) * (D / 16)] = o[nt][e];
    }
  }
  __syncthreads();

  // Rows of the output: warp w takes query heads w, w + 4, ...; the last split adds the new token.
  const bool with_new = split == p.splits - 1 && bounds[2] != 0;
  for (int row = warp; row < p.g; row += kWarps) {
    float mall = -INFINITY, lall = 0.f, weight[kWarps];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mall = fmaxf(mall, m_sm[w][row]);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      weight[w] = m_sm[w][row] == -INFINITY ? 0.f : fast_exp2(m_sm[w][row] - mall);
      lall += l_sm[w][row] * weight[w];
    }
    float alpha = 1.f, beta = 0.f;
    const __half* nv = p.new_v + (static_cast<size_t>(b) * p.kvh + h) * D;
    if (with_new) {
      const __half* nk = p.new_k + (static_cast<size_t>(b) * p.kvh + h) * D;
      float s = 0.f;
      for (int c = lane; c < D; c += 32) s += q_sm[row][c] * __half2float(nk[c]);
#pragma unroll
      for (int off = 16; off; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (cap > 0.f) s = cap * tanhf(s * inv_cap);
      s *= kLog2e;
      const float mnew = fmaxf(mall, s);
      alpha = mall == -INFINITY ? 0.f : fast_exp2(mall - mnew);
      beta = fast_exp2(s - mnew);
      mall = mnew;
      lall = lall * alpha + beta;
    }
    const size_t out = ((static_cast<size_t>(b) * p.kvh + h) * p.splits + split) * p.g + row;
    for (int c = lane; c < D; c += 32) {
      float x = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) x += o_sm[w][row][c] * weight[w];
      p.o[out * D + c] = with_new ? x * alpha + beta * __half2float(nv[c]) : x;
    }
    if (lane == 0) {
      p.m[out] = mall == -INFINITY ? -INFINITY : mall / kLog2e;
      p.l[out] = lall;
    }
  }
}

inline ffi::Error bad(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp int4 decode attention: " + msg);
}

ffi::Error Int4Impl(cudaStream_t stream, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> q_channel_scale,
                    ffi::Buffer<ffi::S32> bounds,
                    ffi::Buffer<ffi::U8> k_codes, ffi::Buffer<ffi::U8> k_scale, ffi::Buffer<ffi::U8> v_codes,
                    ffi::Buffer<ffi::U8> v_scale, ffi::Buffer<ffi::F16> new_k, ffi::Buffer<ffi::F16> new_v,
                    ffi::Result<ffi::Buffer<ffi::F32>> o, ffi::Result<ffi::Buffer<ffi::F32>> m,
                    ffi::Result<ffi::Buffer<ffi::F32>> l, ffi::Result<ffi::Buffer<ffi::F32>> out,
                    ffi::Result<ffi::Buffer<ffi::F32>> m_all, ffi::Result<ffi::Buffer<ffi::F32>> den, float scale,
                    float softcap, int32_t fp8_queries) {
  auto qd = q.dimensions(), od = o->dimensions(), kd = k_codes.dimensions(), vd = v_codes.dimensions();
  auto ksd = k_scale.dimensions(), vsd = v_scale.dimensions(), bd = bounds.dimensions();
  if (qd.size() != 4 || od.size() != 5 || kd.size() != 4 || vd.size() != 4 || ksd.size() != 3 || vsd.size() != 3)
    return bad("expected q [B, KVH, G, D], o [B, KVH, S, G, D], codes [B, T, KVH, D/2], scales [B, T, KVH]");
  const int64_t batch = qd[0], kvh = qd[1], g = qd[2], d = qd[3], tokens = kd[1];
  if (g < 1 || g > kRows) return bad("1 to 16 query heads per KV head, got " + std::to_string(g));
  for (auto x : {kd, vd})
    if (x[0] != batch || x[1] != tokens || x[2] != kvh || x[3] != d / 2) return bad("codes do not match q");
  for (auto x : {ksd, vsd})
    if (x[0] != batch || x[1] != tokens || x[2] != kvh) return bad("scales do not match the codes");
  if (od[0] != batch || od[1] != kvh || od[3] != g || od[4] != d) return bad("output shape does not match q");
  if (const char* e = jaxlp::merged_outputs_error(out->element_count(), m_all->element_count(), den->element_count(),
                                                  batch * kvh, g, d))
    return bad(e);
  if (bd.size() != 2 || bd[0] != batch || bd[1] != 4) return bad("bounds must be int32 [B, 4]");
  auto cd = q_channel_scale.dimensions();
  if (cd.size() != 2 || cd[0] != kvh || cd[1] != d) return bad("query channel scales must be float32 [KVH, D]");
  for (auto x : {new_k.dimensions(), new_v.dimensions()})
    if (x.size() != 3 || x[0] != batch || x[1] != kvh || x[2] != d) return bad("new keys / values must be FP16 [B, KVH, D]");
  if (batch > 65535 || od[2] > 65535) return bad("at most 65535 rows and 65535 splits (the grid's y and z)");
  Params p;
  p.q = q.typed_data();
  p.q_channel_scale = q_channel_scale.typed_data();
  p.bounds = bounds.typed_data();
  p.k_codes = k_codes.typed_data();
  p.k_scale = k_scale.typed_data();
  p.v_codes = v_codes.typed_data();
  p.v_scale = v_scale.typed_data();
  p.new_k = reinterpret_cast<const __half*>(new_k.typed_data());
  p.new_v = reinterpret_cast<const __half*>(new_v.typed_data());
  p.o = o->typed_data();
  p.m = m->typed_data();
  p.l = l->typed_data();
  p.kvh = static_cast<int>(kvh);
  p.g = static_cast<int>(g);
  p.splits = static_cast<int>(od[2]);
  p.tokens = static_cast<int>(tokens);
  p.scale = scale;
  p.softcap = softcap;
  p.fp8_queries = fp8_queries != 0;
  if (batch == 0 || kvh == 0 || p.splits == 0) return ffi::Error::Success();
  const dim3 grid(static_cast<unsigned>(kvh), static_cast<unsigned>(batch), static_cast<unsigned>(p.splits));
  cudaError_t e;
  switch (d) {
    case 64: e = jaxlp::launch_kernel(int4_tokens_kernel<64>, grid, dim3(kThreads), 0, stream, 1, false, p); break;
    case 128: e = jaxlp::launch_kernel(int4_tokens_kernel<128>, grid, dim3(kThreads), 0, stream, 1, false, p); break;
    default: return bad("head_dim must be 64 or 128, got " + std::to_string(d));
  }
  if (e == cudaSuccess)
    e = jaxlp::split_merge(stream, p.o, p.m, p.l, out->typed_data(), m_all->typed_data(), den->typed_data(),
                           static_cast<int>(batch * kvh), p.splits, p.g, static_cast<int>(d));
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxlp int4 decode attention launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace jaxlp_int4attn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpInt4DecodeAttention, jaxlp_int4attn::Int4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, KVH, G, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // query channel scales [KVH, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // bounds [B, 4]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // key codes [B, T, KVH, D/2]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // key scales [B, T, KVH] (E4M3 bits)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // value codes
                                  .Arg<ffi::Buffer<ffi::U8>>()   // value scales
                                  .Arg<ffi::Buffer<ffi::F16>>()  // new key [B, KVH, D]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // new value
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o [B, KVH, S, G, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m [B, KVH, S, G]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // l
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, KVH, G, D]: merged (split_merge.cuh)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m [B, KVH, G]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // l
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int32_t>("fp8_queries"),
                              {ffi::Traits::kCmdBufferCompatible});
