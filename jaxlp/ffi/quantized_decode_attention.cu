// Decode attention over the packed 2-bit units of Kitty and KIVI caches (XLA FFI custom call,
// sm_90); Python side and layout: jaxlp/ffi/quantized_decode_attention.py.
//
// One CTA of 4 warps per (row b, KV head, split). It walks its share of the row's 128-token
// blocks; per block:
//   1. unpack: the 128 threads read the block's packed codes (16-byte loads, issued one block
//      ahead, into registers) and write it dequantized to shared memory as FP16, keys
//      channel-major Kt[D][128], values token-major V[128][D]. A 32-bit word of planar 2-bit
//      codes holds 4 consecutive elements in each of its 4 planes; a byte permute brings the
//      codes of elements (0, 1) and (2, 3) of a plane into the two 16-bit halves, where
//      `code | 0x6400` is the FP16 number 1024 + code: then (x - 1024) * scale + min (HFMA2)
//      gives two dequantized elements. Kitty's boosted channels add their high bits (<< 2)
//      before the conversion (row boost_idx[c] of the high plane array).
//   2. attend: warp w takes tokens [32w, 32w + 32) of the block: S = Q K^T with mma.sync
//      m16n8k16 (FP16 in, FP32 accumulate; the query heads of the KV head are the 16 rows, the
//      G <= 16 real ones first), masked to the row's stream range [lo, hi), soft-capped, then an
//      online softmax (base 2) and O += P V (P in FP16), operands from shared memory by ldmatrix.
// The 4 warps' partials are merged in shared memory; the CTA writes its split's unnormalized
// output o (relative to its max m), m (natural log units) and l = sum exp(s - m); XLA merges the
// splits. An empty range gives o = 0, m = -inf, l = 0.
//
// The whole cache in one call (the cache call, `tail` = 1): the stream range [lo, hi) then runs to
// the row's last token, and a token's key (value) is read from the FP16 ring, slot j % R, where
// j >= qk (qv), the row's quantized count, and the ring's slot still holds j; elsewhere from its
// packed unit (a rewound row's overwritten slot), or zero past the units -- as the cache's
// reference view reads it. The ring tokens of a block are copied over its unpacked codes. One
// more block follows the stream's: the FP16 sink (tokens [0, off), visible in [sink_lo, sink_hi))
// and the new token (row off, visible if new_ok). Per-row bounds: lo, hi, qk, qv, sink_lo,
// sink_hi, new_ok (an int32 [B, 8]).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "launch.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxlp_qattn {

constexpr int kThreads = 128;
constexpr int kBlock = 128;  // tokens per block (a Kitty page, a KIVI key block)
constexpr int kRows = 16;    // query rows per KV head (the mma's M)
constexpr int kPad = 8;      // FP16 elements of row padding in shared memory (conflict-free ldmatrix)
constexpr float kLog2e = 1.4426950408889634f;

struct Params {
  const float* q;  // [B, KVH, G, D], times the softmax scale
  const int32_t* bounds;  // [B, 8]: lo, hi (stream range), qk, qv, sink_lo, sink_hi, new_ok, 0
  const uint8_t* k_low;    // [B, Uk, KVH, D, 32]
  const uint8_t* k_high;   // [B, Uk, KVH, NB, 32] (NB = 0: none)
  const uint8_t* k_boost;  // [B, Uk, KVH, D] (NB > 0)
  const __half* k_scale;   // [B, Uk, KVH, KG, D]
  const __half* k_min;
  const uint8_t* v_codes;  // [B, Uv, KVH, VT, D/4]
  const __half* v_scale;   // [B, Uv, KVH, VT, D/VGROUP]
  const __half* v_min;
  const __half* k_ring;        // [B, RK, KVH, D] (RK = 0: none)
  const int32_t* k_ring_pos;   // [B, RK]: the stream index each slot holds
  const __half* v_ring;        // [B, RV, KVH, D]
  const int32_t* v_ring_pos;   // [B, RV]
  const __half* sink_k;        // [B, OFF, KVH, D]
  const __half* sink_v;
  const __half* new_k;         // [B, KVH, D]
  const __half* new_v;
  float* o;  // [B, KVH, S, G, D]
  float* m;  // [B, KVH, S, G]
  float* l;
  int kvh, g, splits;
  int k_units, nb, kg;         // key blocks per row, boosted channels, scale groups per block (1 or 4)
  int v_units, vt, v_group;    // value units per row, tokens per value unit (128 or 1), channels per value scale
  int vt_shift, v_group_shift; // log2 of vt and v_group (both powers of two)
  int rk, rv, off, tail;        // ring slots, sink tokens, 1: the sink + new-token block after the stream
  float softcap;               // <= 0: none
};

// Per-row bounds (see the file's head).
struct Bounds {
  int lo, hi, qk, qv, sink_lo, sink_hi, new_ok;
};

__device__ __forceinline__ Bounds row_bounds(const Params& p, int b) {
  const int32_t* r = p.bounds + 8 * b;
  return {r[0], r[1], r[2], r[3], r[4], r[5], r[6]};
}

__device__ __forceinline__ uint32_t byte_perm(uint32_t x, uint32_t s) { return __byte_perm(x, 0, s); }

// Two dequantized FP16 elements from 16-bit-lane codes `c` (0..15 each): (c - 0) * s + m.
__device__ __forceinline__ uint32_t dequant2(uint32_t c, __half2 s, __half2 mn) {
  uint32_t h = c | 0x64006400u;
  __half2 x = __hsub2(*reinterpret_cast<__half2*>(&h), __float2half2_rn(1024.f));
  x = __hfma2(x, s, mn);
  return *reinterpret_cast<uint32_t*>(&x);
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x by the SFU (ex2.approx.ftz: about 2 ulp; 2^-inf = 0), without exp2f's range handling.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_half2(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

// The packed data of one block held in registers between its load and its unpacking.
// KG: key scales per block (1: Kitty, one per channel; 4: KIVI, one per 32-token plane); VPL: value
// scales per 16-byte piece of a token (1: Kitty, one per token; 4: one per plane, KIVI's channel groups).
template <int D, int KG, int VPL>
struct BlockRegs {
  static constexpr int kN = D / 64;  // 16-byte pieces per thread, keys and values each
  uint4 low[kN], high[kN], val[kN];
  // Scales and minimums stay scalar until the unpack: broadcasting them to half2 here would wait
  // for the loads at the prefetch instead of a block later.
  __half ks[kN][KG], km[kN][KG];  // per piece: the key channel's scale / min per token group
  __half vs[kN][VPL], vm[kN][VPL];  // per piece: the value token's scale / min per channel group
};

// Kitty: the ranks of this thread's key channels in block `blk` (which high row holds their bits),
// loaded one block ahead of the codes so that the high rows' loads do not wait on them.
template <int D>
__device__ __forceinline__ void load_ranks(const Params& p, int b, int kh, int blk, int kend, int tid,
                                           int (&ranks)[D / 64]) {
#pragma unroll
  for (int i = 0; i < D / 64; ++i) {
    const long kbase = (static_cast<long>(b) * p.k_units + blk) * p.kvh + kh;
    ranks[i] = p.nb > 0 && blk < kend ? p.k_boost[kbase * D + ((tid + kThreads * i) >> 1)] : 0;
  }
}

// Block `blk`'s packed keys (if blk < kend: a key unit of a stream block) and the values of its
// tokens in [lo, hi) that a value unit holds; zeros elsewhere.
template <int D, int KG, int VPL>
__device__ __forceinline__ void load_block(const Params& p, int b, int kh, int blk, int kend, int lo, int hi,
                                           int tid, const int (&ranks)[D / 64], BlockRegs<D, KG, VPL>& r) {
  constexpr int kN = BlockRegs<D, KG, VPL>::kN;
  const bool keys = blk < kend;
  const long kbase = (static_cast<long>(b) * p.k_units + (keys ? blk : 0)) * p.kvh + kh;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = tid + kThreads * i;  // piece: channel idx / 2, bytes 16 (idx % 2) ..
    const int c = idx >> 1, half = idx & 1;
    r.low[i] = keys ? __ldg(reinterpret_cast<const uint4*>(p.k_low + (kbase * D + c) * 32 + half * 16))
                    : make_uint4(0, 0, 0, 0);
    r.high[i] = make_uint4(0, 0, 0, 0);
    if (keys && p.nb > 0 && ranks[i] < p.nb)
      r.high[i] = __ldg(reinterpret_cast<const uint4*>(p.k_high + (kbase * p.nb + ranks[i]) * 32 + half * 16));
#pragma unroll
    for (int t = 0; t < KG; ++t) {
      r.ks[i][t] = keys ? p.k_scale[(kbase * KG + t) * D + c] : __float2half(0.f);
      r.km[i][t] = keys ? p.k_min[(kbase * KG + t) * D + c] : __float2half(0.f);
    }
  }
  constexpr int kPieces = D / 64;  // 16-byte pieces per value token (D / 4 bytes)
  const int vgroups = D >> p.v_group_shift;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = tid + kThreads * i;
    const int tok = idx / kPieces, piece = idx % kPieces;
    const int j = blk * kBlock + tok;  // stream index
    const bool ok = j >= lo && j < hi && (j >> p.vt_shift) < p.v_units;
    const long unit = ok ? j >> p.vt_shift : 0, inner = ok ? j & (p.vt - 1) : 0;
    const long vbase = ((static_cast<long>(b) * p.v_units + unit) * p.kvh + kh) * p.vt + inner;
    r.val[i] = ok ? __ldg(reinterpret_cast<const uint4*>(p.v_codes + vbase * (D / 4) + piece * 16))
                  : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < VPL; ++u) {  // plane u: channels u D/4 + [16 piece, 16 piece + 16)
      const int grp = (u * (D / 4) + piece * 16) >> p.v_group_shift;
      r.vs[i][u] = ok ? p.v_scale[vbase * vgroups + grp] : __float2half(0.f);
      r.vm[i][u] = ok ? p.v_min[vbase * vgroups + grp] : __float2half(0.f);
    }
  }
}

template <int D, int KG, int VPL>
__device__ __forceinline__ void unpack_block(const BlockRegs<D, KG, VPL>& r, int tid, __half* kt, __half* vs) {
  constexpr int kN = BlockRegs<D, KG, VPL>::kN;
  constexpr int kKStride = kBlock + kPad, kVStride = D + kPad;
  constexpr int kPieces = D / 64;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = tid + kThreads * i;
    const int c = idx >> 1, half = idx & 1;
    const uint32_t lw[4] = {r.low[i].x, r.low[i].y, r.low[i].z, r.low[i].w};
    const uint32_t hw[4] = {r.high[i].x, r.high[i].y, r.high[i].z, r.high[i].w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      // KIVI (KG = 4) has no boosted channels: no high bits to merge.
      const uint32_t lp = byte_perm(lw[w], 0x3120), hp = KG == 1 ? byte_perm(hw[w], 0x3120) : 0u;
      const int tok0 = half * 16 + w * 4;  // tokens tok0 .. tok0 + 3 of plane 0
#pragma unroll
      for (int t = 0; t < 4; ++t) {  // high bits shifted straight to bits 2-3 of each half
        const uint32_t ha = t == 0 ? hp << 2 : hp >> (2 * t - 2), hb = hp >> (2 * t + 6);
        const uint32_t ca = ((lp >> (2 * t)) & 0x00030003u) | (ha & 0x000c000cu);
        const uint32_t cb = ((lp >> (2 * t + 8)) & 0x00030003u) | (hb & 0x000c000cu);
        uint2 out;
        const __half2 scale = __half2half2(r.ks[i][KG == 1 ? 0 : t]), mn = __half2half2(r.km[i][KG == 1 ? 0 : t]);
        out.x = dequant2(ca, scale, mn);
        out.y = dequant2(cb, scale, mn);
        *reinterpret_cast<uint2*>(kt + c * kKStride + 32 * t + tok0) = out;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = tid + kThreads * i;
    const int tok = idx / kPieces, piece = idx % kPieces;
    const uint32_t vw[4] = {r.val[i].x, r.val[i].y, r.val[i].z, r.val[i].w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t vp = byte_perm(vw[w], 0x3120);
      const int ch0 = piece * 16 + w * 4;  // channels ch0 .. ch0 + 3 of plane 0
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        uint2 out;
        const int vg = VPL == 1 ? 0 : u;
        const __half2 scale = __half2half2(r.vs[i][vg]), mn = __half2half2(r.vm[i][vg]);
        out.x = dequant2((vp >> (2 * u)) & 0x00030003u, scale, mn);
        out.y = dequant2((vp >> (2 * u + 8)) & 0x00030003u, scale, mn);
        *reinterpret_cast<uint2*>(vs + tok * kVStride + u * (D / 4) + ch0) = out;
      }
    }
  }
}

// Eight FP16 key channels c8 * 8 .. + 7 of token `tok` into the channel-major tile.
template <int D>
__device__ __forceinline__ void store_key8(__half* kt, int c8, int tok, uint4 x) {
  constexpr int kKStride = kBlock + kPad;
  const __half* h = reinterpret_cast<const __half*>(&x);
#pragma unroll
  for (int i = 0; i < 8; ++i) kt[(c8 * 8 + i) * kKStride + tok] = h[i];
}

// Token `tok`'s FP16 key and value (`ksrc`, `vsrc`: D channels in global memory, or null: left as
// unpacked) into the tiles, loads issued two 16-byte pieces of each ahead of their stores.
template <int D>
__device__ __forceinline__ void copy_token(const __half* ksrc, const __half* vsrc, int tok, __half* kt, __half* vsm) {
  constexpr int kVStride = D + kPad, kC8 = D / 8, kBatch = 2;
#pragma unroll
  for (int c0 = 0; c0 < kC8; c0 += kBatch) {
    uint4 kx[kBatch], vx[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (ksrc) kx[i] = __ldg(reinterpret_cast<const uint4*>(ksrc) + c0 + i);
      if (vsrc) vx[i] = __ldg(reinterpret_cast<const uint4*>(vsrc) + c0 + i);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (ksrc) store_key8<D>(kt, c0 + i, tok, kx[i]);
      if (vsrc) *reinterpret_cast<uint4*>(vsm + tok * kVStride + (c0 + i) * 8) = vx[i];
    }
  }
}

// The FP16 tokens of block `blk` over its unpacked codes (see the file's head), one token per
// thread: ring keys and values where the ring holds them, or (the tail block) the sink and the new
// token; the unpacked tail block is zeros elsewhere.
template <int D>
__device__ __forceinline__ void fill_block(const Params& p, int b, int kh, int blk, bool tail, const Bounds& r,
                                           int tid, __half* kt, __half* vsm) {
  static_assert(kThreads == kBlock, "one token per thread");
  const int tok = tid, j = blk * kBlock + tok;
  const __half *ksrc = nullptr, *vsrc = nullptr;
  if (tail) {
    if (tok < p.off) {
      const long at = ((static_cast<long>(b) * p.off + tok) * p.kvh + kh) * D;
      ksrc = p.sink_k + at;
      vsrc = p.sink_v + at;
    } else if (tok == p.off) {
      const long at = (static_cast<long>(b) * p.kvh + kh) * D;
      ksrc = p.new_k + at;
      vsrc = p.new_v + at;
    }
  } else if (j >= r.lo && j < r.hi) {
    const bool kr = p.rk > 0 && j >= r.qk, vr = p.rv > 0 && j >= r.qv;
    const int kslot = kr ? j % p.rk : 0, vslot = vr ? j % p.rv : 0;
    const int kpos = kr ? __ldg(p.k_ring_pos + static_cast<long>(b) * p.rk + kslot) : -1;
    const int vpos = vr ? __ldg(p.v_ring_pos + static_cast<long>(b) * p.rv + vslot) : -1;
    if (kpos == j) ksrc = p.k_ring + ((static_cast<long>(b) * p.rk + kslot) * p.kvh + kh) * D;
    if (vpos == j) vsrc = p.v_ring + ((static_cast<long>(b) * p.rv + vslot) * p.kvh + kh) * D;
  }
  copy_token<D>(ksrc, vsrc, tok, kt, vsm);
}

template <int D>
constexpr int min_ctas() { return D == 256 ? 1 : 3; }

template <int D, int KG, int VPL>
__global__ void __launch_bounds__(kThreads, min_ctas<D>()) units_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kKStride = kBlock + kPad, kVStride = D + kPad;
  __half* kt = reinterpret_cast<__half*>(smem);            // [D][kKStride]
  __half* vsm = kt + D * kKStride;                          // [kBlock][kVStride]
  __shared__ float red_m[4][kRows], red_l[4][kRows];
  __shared__ __align__(16) __half qsm[kRows][D + kPad];   // the query rows, FP16 (rows >= G zero)

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tg = lane & 3;  // mma fragment coordinates
  const int split = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
  const Bounds rb = row_bounds(p, b);
  const int lo = rb.lo, hi = rb.hi;

  // This split's blocks of the row's range: stream blocks [first, last), then (tail) block `last`.
  const int first = max(lo, 0) / kBlock, last = hi > lo ? (hi + kBlock - 1) / kBlock : first;
  const int kend = min(last, p.k_units);  // blocks whose keys a unit holds
  const int per = (last - first + p.tail + p.splits - 1) / p.splits;
  const int b0 = first + split * per, b1 = min(b0 + per, last + p.tail);

  // Q (times the softmax scale) to shared memory as FP16; read as mma A fragments by ldmatrix.
  {
    const float* qrow = p.q + (static_cast<long>(b) * p.kvh + kh) * p.g * D;
    for (int e = tid; e < kRows * D; e += kThreads) {
      const int row = e / D, col = e % D;
      qsm[row][col] = __float2half_rn(row < p.g ? __ldg(qrow + row * D + col) : 0.f);
    }
  }
  float oacc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) oacc[n][0] = oacc[n][1] = oacc[n][2] = oacc[n][3] = 0.f;
  float row_m[2] = {-INFINITY, -INFINITY}, row_l[2] = {0.f, 0.f};

  BlockRegs<D, KG, VPL> regs;
  int ranks[D / 64];
  if (b0 < b1) {
    load_ranks<D>(p, b, kh, b0, kend, tid, ranks);
    load_block<D, KG, VPL>(p, b, kh, b0, kend, lo, hi, tid, ranks, regs);
    load_ranks<D>(p, b, kh, b0 + 1, kend, tid, ranks);
  }
  for (int blk = b0; blk < b1; ++blk) {
    __syncthreads();  // the previous block's reads of shared memory are done (and qsm written)
    unpack_block<D, KG, VPL>(regs, tid, kt, vsm);
    const bool tail = p.tail && blk == last;
    const int end = (blk + 1) * kBlock;
    if (tail || (p.rk > 0 && end > rb.qk) || (p.rv > 0 && end > rb.qv)) {
      __syncthreads();  // the unpacked codes are written: the FP16 tokens go over them
      fill_block<D>(p, b, kh, blk, tail, rb, tid, kt, vsm);  // before the next block's loads: registers
    }
    if (blk + 1 < b1) {
      load_block<D, KG, VPL>(p, b, kh, blk + 1, kend, lo, hi, tid, ranks, regs);
      load_ranks<D>(p, b, kh, blk + 2, kend, tid, ranks);
    }
    __syncthreads();

    // S = Q K^T for this warp's 32 tokens: 4 n-tiles of 8 tokens.
    float s[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    const int mat = lane >> 3, mrow = lane & 7;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[4];
      ldmatrix_x4(qa, &qsm[(mat & 1) * 8 + mrow][kk * 16 + (mat >> 1) * 8]);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t bfr[4];
        const int krow = kk * 16 + (mat & 1) * 8 + mrow;
        const int kcol = warp * 32 + half * 16 + (mat >> 1) * 8;
        ldmatrix_x4_trans(bfr, kt + krow * kKStride + kcol);
        mma16816(s[2 * half], qa, bfr[0], bfr[1]);
        mma16816(s[2 * half + 1], qa, bfr[2], bfr[3]);
      }
    }
    // Mask, soft-cap, base-2 units; online softmax over rows gq (c0, c1) and gq + 8 (c2, c3).
    float mx[2] = {-INFINITY, -INFINITY};
    const bool interior = !tail && blk * kBlock >= lo && end <= hi;  // every token seen
    if (interior && p.softcap <= 0.f) {
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] *= kLog2e;
          mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
        }
      }
    } else {
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = warp * 32 + n * 8 + 2 * tg + (e & 1), j = blk * kBlock + tok;
          const bool seen = tail ? (tok >= rb.sink_lo && tok < rb.sink_hi) || (tok == p.off && rb.new_ok)
                                 : j >= lo && j < hi;
          float x = s[n][e];
          if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap);
          x = seen ? x * kLog2e : -INFINITY;
          s[n][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      }
    }
    float alpha[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
      mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
      const float m_new = fmaxf(row_m[rr], mx[rr]);
      alpha[rr] = m_new == -INFINITY ? 1.f : fast_exp2(row_m[rr] - m_new);
      row_m[rr] = m_new;
    }
    float psum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float mref = row_m[e >> 1];
        const float pe = mref == -INFINITY ? 0.f : fast_exp2(s[n][e] - mref);
        s[n][e] = pe;
        psum[e >> 1] += pe;
      }
    }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) row_l[rr] = row_l[rr] * alpha[rr] + psum[rr];
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // rare once the maxima settle
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        oacc[n][0] *= alpha[0];
        oacc[n][1] *= alpha[0];
        oacc[n][2] *= alpha[1];
        oacc[n][3] *= alpha[1];
      }
    }
    // O += P V: two 16-token k-steps, 16 channels per ldmatrix.
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      uint32_t pa[4];
      pa[0] = pack_half2(s[2 * ks][0], s[2 * ks][1]);
      pa[1] = pack_half2(s[2 * ks][2], s[2 * ks][3]);
      pa[2] = pack_half2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
      pa[3] = pack_half2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
      const int vrow = warp * 32 + ks * 16 + (mat & 1) * 8 + mrow;
#pragma unroll
      for (int nn = 0; nn < D / 16; ++nn) {
        uint32_t bfr[4];
        ldmatrix_x4_trans(bfr, vsm + vrow * kVStride + nn * 16 + (mat >> 1) * 8);
        mma16816(oacc[2 * nn], pa, bfr[0], bfr[1]);
        mma16816(oacc[2 * nn + 1], pa, bfr[2], bfr[3]);
      }
    }
  }

  // Merge the 4 warps: row sums over the quad, then through shared memory.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    row_l[rr] += __shfl_xor_sync(0xffffffffu, row_l[rr], 1);
    row_l[rr] += __shfl_xor_sync(0xffffffffu, row_l[rr], 2);
  }
  if (tg == 0) {
    red_m[warp][gq] = row_m[0];
    red_m[warp][gq + 8] = row_m[1];
    red_l[warp][gq] = row_l[0];
    red_l[warp][gq + 8] = row_l[1];
  }
  __syncthreads();  // also: every warp is done with kt / vsm
  float* osm = reinterpret_cast<float*>(smem);  // [4][kRows][D]
  float wscale[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = gq + 8 * rr;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) mm = fmaxf(mm, red_m[w][row]);
    wscale[rr] = row_m[rr] == -INFINITY ? 0.f : exp2f(row_m[rr] - mm);
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int col = n * 8 + 2 * tg;
    float* base = osm + (warp * kRows) * D;
    *reinterpret_cast<float2*>(base + gq * D + col) = make_float2(oacc[n][0] * wscale[0], oacc[n][1] * wscale[0]);
    *reinterpret_cast<float2*>(base + (gq + 8) * D + col) =
        make_float2(oacc[n][2] * wscale[1], oacc[n][3] * wscale[1]);
  }
  __syncthreads();
  const long out_row = ((static_cast<long>(b) * p.kvh + kh) * p.splits + split) * p.g;
  for (int e = tid; e < p.g * D; e += kThreads) {
    const int row = e / D, col = e % D;
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) acc += osm[(w * kRows + row) * D + col];
    p.o[out_row * D + e] = acc;
  }
  if (tid < p.g) {
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) mm = fmaxf(mm, red_m[w][tid]);
    float ll = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) ll += red_m[w][tid] == -INFINITY ? 0.f : red_l[w][tid] * exp2f(red_m[w][tid] - mm);
    p.m[out_row + tid] = mm == -INFINITY ? -INFINITY : mm / kLog2e;
    p.l[out_row + tid] = ll;
  }
}

template <int D>
constexpr size_t smem_bytes() {
  const size_t tiles = (static_cast<size_t>(D) * (kBlock + kPad) + kBlock * (D + kPad)) * sizeof(__half);
  const size_t merge = 4ul * kRows * D * sizeof(float);
  return tiles > merge ? tiles : merge;
}

// ---------------------------------------------------------------------------------------------
// Host side

inline ffi::Error bad(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp quantized decode attention: " + msg);
}

template <int D, int KG, int VPL>
cudaError_t launch_variant(cudaStream_t stream, const Params& p, int batch) {
  constexpr size_t smem = smem_bytes<D>();
  static const cudaError_t attr = cudaFuncSetAttribute(
      units_kernel<D, KG, VPL>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (attr != cudaSuccess) return attr;
  return jaxlp::launch_kernel(units_kernel<D, KG, VPL>, dim3(p.splits, p.kvh, batch), dim3(kThreads), smem, stream,
                              1, false, p);
}

// Kitty (one key scale per channel, one value scale per token) or KIVI-2 (key scales per 32-token
// plane, value scales per channel group).
template <int D>
cudaError_t launch(cudaStream_t stream, const Params& p, int batch) {
  const bool one_value_scale = p.v_group == D;
  if (p.kg == 1 && one_value_scale) return launch_variant<D, 1, 1>(stream, p, batch);
  if (p.kg == 1) return launch_variant<D, 1, 4>(stream, p, batch);
  if (one_value_scale) return launch_variant<D, 4, 1>(stream, p, batch);
  return launch_variant<D, 4, 4>(stream, p, batch);
}

ffi::Error UnitsImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> bounds,
                     ffi::Buffer<ffi::U8> k_low, ffi::Buffer<ffi::U8> k_high, ffi::Buffer<ffi::U8> k_boost,
                     ffi::Buffer<ffi::F16> k_scale, ffi::Buffer<ffi::F16> k_min, ffi::Buffer<ffi::U8> v_codes,
                     ffi::Buffer<ffi::F16> v_scale, ffi::Buffer<ffi::F16> v_min, ffi::Buffer<ffi::F16> k_ring,
                     ffi::Buffer<ffi::S32> k_ring_pos, ffi::Buffer<ffi::F16> v_ring, ffi::Buffer<ffi::S32> v_ring_pos,
                     ffi::Buffer<ffi::F16> sink_k, ffi::Buffer<ffi::F16> sink_v, ffi::Buffer<ffi::F16> new_k,
                     ffi::Buffer<ffi::F16> new_v, ffi::Result<ffi::Buffer<ffi::F32>> o,
                     ffi::Result<ffi::Buffer<ffi::F32>> m, ffi::Result<ffi::Buffer<ffi::F32>> l, int64_t nb, int64_t kg,
                     int64_t vt, int64_t v_group, int64_t tail, float softcap) {
  auto qd = q.dimensions();
  auto od = o->dimensions();
  auto kd = k_low.dimensions();
  auto vd = v_codes.dimensions();
  if (qd.size() != 4 || od.size() != 5 || kd.size() != 5 || vd.size() != 5)
    return bad("expected q [B, KVH, G, D], o [B, KVH, S, G, D], key codes [B, U, KVH, D, 32], value codes "
               "[B, U, KVH, T, D/4]");
  const int64_t batch = qd[0], kvh = qd[1], g = qd[2], d = qd[3];
  if (g < 1 || g > kRows) return bad("1 to 16 query heads per KV head, got " + std::to_string(g));
  if (kd[0] != batch || kd[2] != kvh || kd[3] != d || kd[4] != 32) return bad("key codes do not match q");
  if (vd[0] != batch || vd[2] != kvh || vd[3] != vt || vd[4] != d / 4) return bad("value codes do not match q");
  if (kg != 1 && kg != 4) return bad("key scale groups per block must be 1 or 4");
  if (vt != 1 && vt != kBlock) return bad("tokens per value unit must be 1 or 128, got " + std::to_string(vt));
  if (v_group < 16 || v_group % 16 || d % v_group || (v_group & (v_group - 1)))  // a thread's piece of 16 channels takes one scale
    return bad("value scale group must be a multiple of 16 channels dividing head_dim");
  if (od[0] != batch || od[1] != kvh || od[3] != g || od[4] != d) return bad("output shape does not match q");
  auto bd = bounds.dimensions();
  if (bd.size() != 2 || bd[0] != batch || bd[1] != 8) return bad("bounds must be int32 [B, 8]");
  auto rkd = k_ring.dimensions(), rvd = v_ring.dimensions(), skd = sink_k.dimensions(), svd = sink_v.dimensions();
  auto nkd = new_k.dimensions(), nvd = new_v.dimensions();
  auto heads = [&](decltype(rkd) x) { return x.size() == 4 && x[0] == batch && x[2] == kvh && x[3] == d; };
  if (!heads(rkd) || !heads(rvd)) return bad("rings must be FP16 [B, R, KVH, D]");
  if (k_ring_pos.dimensions().size() != 2 || k_ring_pos.dimensions()[0] != batch || k_ring_pos.dimensions()[1] != rkd[1] ||
      v_ring_pos.dimensions().size() != 2 || v_ring_pos.dimensions()[0] != batch || v_ring_pos.dimensions()[1] != rvd[1])
    return bad("ring positions must be int32 [B, R] beside their rings");
  if (!heads(skd) || !heads(svd) || skd[1] != svd[1]) return bad("sinks must be FP16 [B, OFF, KVH, D], keys as values");
  if (tail && skd[1] >= kBlock) return bad("the sink and the new token must fit one block: sink < 128 tokens");
  if (nkd.size() != 3 || nvd.size() != 3 || nkd[0] != batch || nkd[1] != kvh || nkd[2] != d || nvd[0] != batch ||
      nvd[1] != kvh || nvd[2] != d)
    return bad("new keys / values must be FP16 [B, KVH, D]");
  Params p;
  p.q = q.typed_data();
  p.bounds = bounds.typed_data();
  auto f16 = [](auto& x) { return reinterpret_cast<const __half*>(x.typed_data()); };
  p.k_ring = f16(k_ring);
  p.k_ring_pos = k_ring_pos.typed_data();
  p.v_ring = f16(v_ring);
  p.v_ring_pos = v_ring_pos.typed_data();
  p.sink_k = f16(sink_k);
  p.sink_v = f16(sink_v);
  p.new_k = f16(new_k);
  p.new_v = f16(new_v);
  p.rk = static_cast<int>(rkd[1]);
  p.rv = static_cast<int>(rvd[1]);
  p.off = static_cast<int>(skd[1]);
  p.tail = tail ? 1 : 0;
  p.k_low = k_low.typed_data();
  p.k_high = k_high.typed_data();
  p.k_boost = k_boost.typed_data();
  p.k_scale = reinterpret_cast<const __half*>(k_scale.typed_data());
  p.k_min = reinterpret_cast<const __half*>(k_min.typed_data());
  p.v_codes = v_codes.typed_data();
  p.v_scale = reinterpret_cast<const __half*>(v_scale.typed_data());
  p.v_min = reinterpret_cast<const __half*>(v_min.typed_data());
  p.o = o->typed_data();
  p.m = m->typed_data();
  p.l = l->typed_data();
  p.kvh = static_cast<int>(kvh);
  p.g = static_cast<int>(g);
  p.splits = static_cast<int>(od[2]);
  p.k_units = static_cast<int>(kd[1]);
  p.nb = static_cast<int>(nb);
  p.kg = static_cast<int>(kg);
  p.v_units = static_cast<int>(vd[1]);
  p.vt = static_cast<int>(vt);
  p.v_group = static_cast<int>(v_group);
  p.vt_shift = __builtin_ctz(static_cast<unsigned>(vt));
  p.v_group_shift = __builtin_ctz(static_cast<unsigned>(v_group));
  p.softcap = softcap;
  if (batch == 0 || kvh == 0) return ffi::Error::Success();
  cudaError_t e;
  switch (d) {
    case 64: e = launch<64>(stream, p, static_cast<int>(batch)); break;
    case 128: e = launch<128>(stream, p, static_cast<int>(batch)); break;
    case 256: e = launch<256>(stream, p, static_cast<int>(batch)); break;
    default: return bad("head_dim must be 64, 128 or 256, got " + std::to_string(d));
  }
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jaxlp quantized decode attention launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace jaxlp_qattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpQuantizedDecodeAttention, jaxlp_qattn::UnitsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, KVH, G, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // bounds [B, 8]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // key low codes
                                  .Arg<ffi::Buffer<ffi::U8>>()   // key high codes
                                  .Arg<ffi::Buffer<ffi::U8>>()   // key boost index
                                  .Arg<ffi::Buffer<ffi::F16>>()  // key scale
                                  .Arg<ffi::Buffer<ffi::F16>>()  // key min
                                  .Arg<ffi::Buffer<ffi::U8>>()   // value codes
                                  .Arg<ffi::Buffer<ffi::F16>>()  // value scale
                                  .Arg<ffi::Buffer<ffi::F16>>()  // value min
                                  .Arg<ffi::Buffer<ffi::F16>>()  // key ring [B, RK, KVH, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // key ring positions [B, RK]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // value ring [B, RV, KVH, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // value ring positions [B, RV]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // sink keys [B, OFF, KVH, D]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // sink values
                                  .Arg<ffi::Buffer<ffi::F16>>()  // new key [B, KVH, D]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // new value
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o [B, KVH, S, G, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m [B, KVH, S, G]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // l
                                  .Attr<int64_t>("nb")
                                  .Attr<int64_t>("kg")
                                  .Attr<int64_t>("vt")
                                  .Attr<int64_t>("v_group")
                                  .Attr<int64_t>("tail")
                                  .Attr<float>("softcap"),
                              {ffi::Traits::kCmdBufferCompatible});
