// Decode attention over the packed units of Kitty caches and 2- / 4-bit KIVI caches (XLA FFI
// custom call, sm_90); Python side and layout: jaxlp/ffi/quantized_decode_attention.py.
//
// Two paths in one launch: the packed path (namespace `packed` below: head_dim 128, <= 8 query
// heads per KV head, Kitty pages with 16 or 32 boosted channels or KIVI-2 with value groups of 32
// channels (units_kernel<128, 1, 1, 2, 2, true> and <128, 4, 4, 2, 2, true>); blocks holding only
// packed codes, fed to 8-bit integer MMAs from their packed words; 2-bit codes only) and the
// staged path (any layout, 4-bit KIVI keys and values too), here:
// One CTA of 4 warps per (row b, KV head, split). It walks its share of the row's 128-token
// blocks; per block:
//   1. unpack: the 128 threads read the block's packed codes (16-byte loads, issued one block
//      ahead, into registers) and write it dequantized to shared memory as FP16, keys
//      channel-major Kt[D][128], values token-major V[128][D]. A 32-bit word of planar 2-bit
//      codes holds 4 consecutive elements in each of its 4 planes (4-bit: in each of its 2
//      planes, the low and high nibbles); a byte permute brings the codes of elements (0, 1)
//      and (2, 3) of a plane into the two 16-bit halves, where `code | 0x6400` is the FP16
//      number 1024 + code: then (x - 1024) * scale + min (HFMA2) gives two dequantized
//      elements. Kitty's boosted channels add their high bits (<< 2) before the conversion
//      (row boost_idx[c] of the high plane array).
//   2. attend: warp w takes tokens [32w, 32w + 32) of the block: S = Q K^T with mma.sync
//      m16n8k16 (FP16 in, FP32 accumulate; the query heads of the KV head are the 16 rows, the
//      G <= 16 real ones first), masked to the row's stream range [lo, hi), soft-capped, then an
//      online softmax (base 2) and O += P V (P in FP16), operands from shared memory by ldmatrix.
// The 4 warps' partials are merged in shared memory; the CTA writes its split's unnormalized
// output o (relative to its max m), m (natural log units) and l = sum exp(s - m); a second launch
// merges the splits (split_merge.cuh; a warp per query where the splits are at most the
// `few_splits` attribute). An empty range gives o = 0, m = -inf, l = 0.
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

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "async_copy.cuh"
#include "launch.cuh"
#include "split_merge.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxlp_qattn {

using jaxlp::cp_async16;
using jaxlp::cp_async4;
using jaxlp::cp_async8;
using jaxlp::cp_async_commit;
using jaxlp::cp_async_wait;
using jaxlp::smem_addr;

constexpr int kThreads = 128;
constexpr int kBlock = 128;  // tokens per block (a Kitty page, a KIVI key block)
constexpr int kRows = 16;    // query rows per KV head (the mma's M)
constexpr int kPad = 8;      // FP16 elements of row padding in shared memory (conflict-free ldmatrix)
constexpr float kLog2e = 1.4426950408889634f;

struct Params {
  const float* q;  // [B, KVH, G, D], times the softmax scale
  const int32_t* bounds;  // [B, 8]: lo, hi (stream range), qk, qv, sink_lo, sink_hi, new_ok, 0
  const uint8_t* k_low;    // [B, Uk, KVH, D, 16 KBITS]: 128 tokens of KBITS-bit codes per channel
  const uint8_t* k_high;   // [B, Uk, KVH, NB, 32] (NB = 0: none)
  const uint8_t* k_boost;  // [B, Uk, KVH, D] (NB > 0)
  const __half* k_scale;   // [B, Uk, KVH, KG, D]
  const __half* k_min;
  const uint8_t* v_codes;  // [B, Uv, KVH, VT, D VBITS / 8]
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
  int kbits, vbits;            // bits per key / value code: 2, or 4 (KIVI only; the staged path only)
  int rk, rv, off, tail;        // ring slots, sink tokens, 1: the sink + new-token block after the stream
  int gsplits;                 // the last gsplits splits run the staged path, the others the packed one
  int min_per;                 // packed path: the fewest blocks of a packed CTA (splits past a row's blocks exit)
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

// The packed data of one block held in registers between its load and its unpacking. A thread
// takes D / 64 shares of the key rows, half a channel's row each (2-bit: bytes [16 h, 16 h + 16),
// tokens 16 h + [0, 16) of each of the 4 planes; 4-bit: bytes [32 h, 32 h + 32), tokens
// 32 h + [0, 32) of each of the 2 planes), and D / 64 shares of the value rows, 8 bits bytes each
// (8 bits consecutive channels of each plane): one 16-byte piece (2-bit) or two (4-bit) under the
// same scales, so that 4-bit codes take as many registers as 2-bit KIVI's (ptxas, sm_90, head_dim
// 128: 168 registers, 3 CTAs per SM, as 2-bit; 28 bytes spilled, a few reloads per block).
// KG: key scales per block (1: Kitty, one per channel; 4: KIVI, one per 32-token group); VPL: value
// scales per share of a token (1: one per token (Kitty) or one group over D; else one per plane,
// KIVI's channel groups: 8 / VBITS); KBITS, VBITS: bits per key / value code (2; KIVI also 4).
template <int D, int KG, int VPL, int KBITS, int VBITS>
struct BlockRegs {
  static_assert((KBITS == 2 || (KBITS == 4 && KG == 4)) && (VBITS == 2 || VBITS == 4),
                "2-bit codes (Kitty, KIVI) or 4-bit KIVI codes");
  static_assert(VPL == 1 || VPL == 8 / VBITS, "one value scale per share, or one per plane");
  static constexpr int kN = D / 64;                    // shares per thread, keys and values each
  static constexpr int kKP = KBITS / 2, kVP = VBITS / 2;  // 16-byte pieces per key / value share
  static constexpr int kKS = KG == 1 ? 1 : 8 / KBITS;  // key scales per share: KIVI, one per plane
  uint4 low[kN][kKP], high[kN], val[kN][kVP];
  // Scales and minimums stay scalar until the unpack: broadcasting them to half2 here would wait
  // for the loads at the prefetch instead of a block later.
  __half ks[kN][kKS], km[kN][kKS];  // per share: the key channel's scale / min per token group
  __half vs[kN][VPL], vm[kN][VPL];  // per share: the value token's scale / min per channel group
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
template <int D, int KG, int VPL, int KBITS, int VBITS>
__device__ __forceinline__ void load_block(const Params& p, int b, int kh, int blk, int kend, int lo, int hi,
                                           int tid, const int (&ranks)[D / 64],
                                           BlockRegs<D, KG, VPL, KBITS, VBITS>& r) {
  using Regs = BlockRegs<D, KG, VPL, KBITS, VBITS>;
  constexpr int kN = Regs::kN, kKP = Regs::kKP, kVP = Regs::kVP;
  constexpr int kKRow = 16 * KBITS;  // bytes per key channel row (128 tokens)
  const bool keys = blk < kend;
  const long kbase = (static_cast<long>(b) * p.k_units + (keys ? blk : 0)) * p.kvh + kh;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = tid + kThreads * i;  // share: channel idx / 2, bytes 16 kKP (idx % 2) ..
    const int c = idx >> 1, half = idx & 1;
    // (The address inside the select: hoisted out of it, ptxas spills more at head_dim 256.)
#pragma unroll
    for (int k = 0; k < kKP; ++k)
      r.low[i][k] = keys ? __ldg(reinterpret_cast<const uint4*>(p.k_low + (kbase * D + c) * kKRow +
                                                                (half * kKP + k) * 16))
                         : make_uint4(0, 0, 0, 0);
    if constexpr (KBITS == 2) {  // Kitty: the high row's piece beside the low one (KIVI-2: nb = 0, none;
      // left in its code as before 4-bit: ptxas then compiles the 2-bit kernels as it did)
      r.high[i] = make_uint4(0, 0, 0, 0);
      if (keys && p.nb > 0 && ranks[i] < p.nb)
        r.high[i] = __ldg(reinterpret_cast<const uint4*>(p.k_high + (kbase * p.nb + ranks[i]) * 32 + half * 16));
    }
#pragma unroll
    for (int t = 0; t < Regs::kKS; ++t) {  // KIVI plane t: 2-bit, group t; 4-bit, tokens 64 t + 32 half + [0, 32)
      const int grp = KG == 1 ? 0 : KBITS == 2 ? t : 2 * t + half;
      r.ks[i][t] = keys ? p.k_scale[(kbase * KG + grp) * D + c] : __float2half(0.f);
      r.km[i][t] = keys ? p.k_min[(kbase * KG + grp) * D + c] : __float2half(0.f);
    }
  }
  constexpr int kVRow = D * VBITS / 8;  // bytes per value token (plane u: channels u kVRow + [0, kVRow))
  constexpr int kShares = D / 64;       // shares per value token, 16 kVP bytes each
  const int vgroups = D >> p.v_group_shift;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = tid + kThreads * i;
    const int tok = idx / kShares, share = idx % kShares;
    const int j = blk * kBlock + tok;  // stream index
    const bool ok = j >= lo && j < hi && (j >> p.vt_shift) < p.v_units;
    const long unit = ok ? j >> p.vt_shift : 0, inner = ok ? j & (p.vt - 1) : 0;
    const long vbase = ((static_cast<long>(b) * p.v_units + unit) * p.kvh + kh) * p.vt + inner;
#pragma unroll
    for (int k = 0; k < kVP; ++k)
      r.val[i][k] = ok ? __ldg(reinterpret_cast<const uint4*>(p.v_codes + vbase * kVRow + (share * kVP + k) * 16))
                       : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < VPL; ++u) {  // plane u: channels u kVRow + 16 kVP share + [0, 16 kVP), one group
      const int grp = (u * kVRow + share * 16 * kVP) >> p.v_group_shift;
      r.vs[i][u] = ok ? p.v_scale[vbase * vgroups + grp] : __float2half(0.f);
      r.vm[i][u] = ok ? p.v_min[vbase * vgroups + grp] : __float2half(0.f);
    }
  }
}

// Plane t's BITS-bit codes of a byte-permuted word (byte_perm 0x3120: bytes 0, 2 in the low half,
// 1, 3 in the high one) in its two 16-bit lanes: of bytes 0 and 1 (`upper` false) or 2 and 3 (true).
template <int BITS>
__device__ __forceinline__ uint32_t plane_codes(uint32_t p, int t, bool upper) {
  return (p >> (BITS * t + (upper ? 8 : 0))) & (BITS == 2 ? 0x00030003u : 0x000f000fu);
}

// Eight dequantized FP16 elements, consecutive in plane t, from two consecutive byte-permuted
// words of planar BITS-bit codes (`p0`, `p1`); `h0`, `h1`: the same words of Kitty's boosted high
// bits (2-bit planes added as bits 2-3 of the codes; 0 where there are none).
template <int BITS>
__device__ __forceinline__ uint4 dequant8(uint32_t p0, uint32_t p1, uint32_t h0, uint32_t h1, int t, __half2 s,
                                          __half2 mn) {
  const auto code = [t](uint32_t p, uint32_t h, bool upper) {
    return plane_codes<BITS>(p, t, upper) | (plane_codes<2>(h, t, upper) << 2);
  };
  return make_uint4(dequant2(code(p0, h0, false), s, mn), dequant2(code(p0, h0, true), s, mn),
                    dequant2(code(p1, h1, false), s, mn), dequant2(code(p1, h1, true), s, mn));
}

// Block registers -> the FP16 tiles (keys channel-major, values token-major), 16-byte stores of 8
// consecutive elements of a plane: a 16-byte piece of a key share, word w of its 4, holds tokens
// plane * t + 4 w + [0, 4) of each plane t (4-bit keys: the low and high nibbles, tokens k and
// 64 + k of byte k); a value piece likewise channels of each plane.
template <int D, int KG, int VPL, int KBITS, int VBITS>
__device__ __forceinline__ void unpack_block(const BlockRegs<D, KG, VPL, KBITS, VBITS>& r, int tid, __half* kt,
                                             __half* vs) {
  using Regs = BlockRegs<D, KG, VPL, KBITS, VBITS>;
  constexpr int kN = Regs::kN, kKP = Regs::kKP, kVP = Regs::kVP;
  constexpr int kKStride = kBlock + kPad, kVStride = D + kPad;
  constexpr int kShares = D / 64;
  constexpr int kKPlanes = 8 / KBITS, kKPlane = 16 * KBITS;      // planes of a key row, tokens per plane
  constexpr int kVPlanes = 8 / VBITS, kVPlane = D * VBITS / 8;   // planes of a value row, channels per plane
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = tid + kThreads * i;
    const int c = idx >> 1, half = idx & 1;
#pragma unroll
    for (int k = 0; k < kKP; ++k) {
      const uint4 lo = r.low[i][k], hi = KG == 1 ? r.high[i] : make_uint4(0, 0, 0, 0);  // KIVI: no boosted bits
      const uint32_t lw[4] = {byte_perm(lo.x, 0x3120), byte_perm(lo.y, 0x3120), byte_perm(lo.z, 0x3120),
                              byte_perm(lo.w, 0x3120)};
      const uint32_t hw[4] = {byte_perm(hi.x, 0x3120), byte_perm(hi.y, 0x3120), byte_perm(hi.z, 0x3120),
                              byte_perm(hi.w, 0x3120)};
#pragma unroll
      for (int t = 0; t < kKPlanes; ++t) {
        const __half2 scale = __half2half2(r.ks[i][KG == 1 ? 0 : t]), mn = __half2half2(r.km[i][KG == 1 ? 0 : t]);
#pragma unroll
        for (int w = 0; w < 4; w += 2) {
          const int tok0 = kKPlane * t + 16 * kKP * half + 16 * k + 4 * w;
          *reinterpret_cast<uint4*>(kt + c * kKStride + tok0) =
              dequant8<KBITS>(lw[w], lw[w + 1], hw[w], hw[w + 1], t, scale, mn);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = tid + kThreads * i;
    const int tok = idx / kShares, share = idx % kShares;
#pragma unroll
    for (int k = 0; k < kVP; ++k) {
      const uint4 v = r.val[i][k];
      const uint32_t vw[4] = {byte_perm(v.x, 0x3120), byte_perm(v.y, 0x3120), byte_perm(v.z, 0x3120),
                              byte_perm(v.w, 0x3120)};
#pragma unroll
      for (int u = 0; u < kVPlanes; ++u) {
        const int vg = VPL == 1 ? 0 : u;
        const __half2 scale = __half2half2(r.vs[i][vg]), mn = __half2half2(r.vm[i][vg]);
#pragma unroll
        for (int w = 0; w < 4; w += 2) {
          const int ch0 = kVPlane * u + 16 * kVP * share + 16 * k + 4 * w;
          *reinterpret_cast<uint4*>(vs + tok * kVStride + ch0) =
              dequant8<VBITS>(vw[w], vw[w + 1], 0u, 0u, u, scale, mn);
        }
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
// unpacked) into the tiles: the value row by cp.async, the key through registers eight 16-byte
// pieces at a time (its tile is channel-major), both in flight together; done on return.
template <int D>
__device__ __forceinline__ void copy_token(const __half* ksrc, const __half* vsrc, int tok, __half* kt, __half* vsm) {
  constexpr int kVStride = D + kPad, kC8 = D / 8, kBatch = 8;
  if (vsrc) {
    const uint32_t dst = smem_addr(vsm + tok * kVStride);
#pragma unroll
    for (int c = 0; c < kC8; ++c) cp_async16(dst + 16 * c, vsrc + 8 * c, 16u);
    cp_async_commit();
  }
  if (ksrc) {
#pragma unroll
    for (int c0 = 0; c0 < kC8; c0 += kBatch) {
      uint4 kx[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) kx[i] = __ldg(reinterpret_cast<const uint4*>(ksrc) + c0 + i);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) store_key8<D>(kt, c0 + i, tok, kx[i]);
    }
  }
  cp_async_wait<0>();
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

// The staged path (any supported layout): blocks [first, last + tail) of the row, `nsplits` ways;
// this CTA takes share `split`. Leaves its warps' partials in red_m / red_l and, scaled to the
// CTA's max per query row, in osm [4][kRows][D] (float, over the dynamic shared memory).
template <int D, int KG, int VPL, int KBITS, int VBITS>
__device__ __forceinline__ void staged_path(const Params& p, int b, int kh, const Bounds& rb, int first, int split,
                                            int nsplits, unsigned char* smem, const __half (*qsm)[D + kPad],
                                            float (*red_m)[kRows], float (*red_l)[kRows]) {
  constexpr int kKStride = kBlock + kPad, kVStride = D + kPad;
  __half* kt = reinterpret_cast<__half*>(smem);            // [D][kKStride]
  __half* vsm = kt + D * kKStride;                          // [kBlock][kVStride]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tg = lane & 3;  // mma fragment coordinates
  const int lo = rb.lo, hi = rb.hi;

  // This split's blocks of the row's range: stream blocks [first, last), then (tail) block `last`.
  const int last = hi > lo ? (hi + kBlock - 1) / kBlock : first;
  const int kend = min(last, p.k_units);  // blocks whose keys a unit holds
  const int per = (max(last - first, 0) + p.tail + nsplits - 1) / nsplits;
  const int b0 = first + split * per, b1 = min(b0 + per, last + p.tail);

  float oacc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) oacc[n][0] = oacc[n][1] = oacc[n][2] = oacc[n][3] = 0.f;
  float row_m[2] = {-INFINITY, -INFINITY}, row_l[2] = {0.f, 0.f};

  BlockRegs<D, KG, VPL, KBITS, VBITS> regs;
  int ranks[D / 64];
  if (b0 < b1) {
    load_ranks<D>(p, b, kh, b0, kend, tid, ranks);
    load_block<D, KG, VPL, KBITS, VBITS>(p, b, kh, b0, kend, lo, hi, tid, ranks, regs);
    load_ranks<D>(p, b, kh, b0 + 1, kend, tid, ranks);
  }
  for (int blk = b0; blk < b1; ++blk) {
    __syncthreads();  // the previous block's reads of shared memory are done (and qsm written)
    unpack_block<D, KG, VPL, KBITS, VBITS>(regs, tid, kt, vsm);
    const bool tail = p.tail && blk == last;
    const int end = (blk + 1) * kBlock;
    if (tail || (p.rk > 0 && end > rb.qk) || (p.rv > 0 && end > rb.qv)) {
      __syncthreads();  // the unpacked codes are written: the FP16 tokens go over them
      fill_block<D>(p, b, kh, blk, tail, rb, tid, kt, vsm);  // before the next block's loads: registers
    }
    if (blk + 1 < b1) {
      load_block<D, KG, VPL, KBITS, VBITS>(p, b, kh, blk + 1, kend, lo, hi, tid, ranks, regs);
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
}

// ---------------------------------------------------------------------------------------------
// The packed path (head_dim 128, G <= 8; Kitty pages with 16 or 32 boosted channels, or KIVI-2
// with value groups of 32 channels: the template parameter KIVI, no branch in the loops): the row's
// blocks whose keys and values are all packed, with no shared-memory FP16 tile. Each warp walks
// its own blocks (a cp.async ring of kStages blocks per warp copies the packed bytes, rows
// swizzled) and feeds the 2-bit codes to 8-bit integer MMAs (mma.sync m16n8k32, s32 sums) straight
// from the packed words: one LOP3 turns a word into the 4 codes an operand register holds.
//
// S = Q' K^T: A = Q' (row g: the high byte of query g's 16-bit Q', row g + 8: its low byte; both
// s8), B = K^T codes (u8). Q' = Q * key scale in fixed point: x = round(Q' f), f = 32512 / max |Q'|
// of the query over the page's channels, split as x = 256 hi + lo (hi, lo in [-128, 128)), so that
// S = (256 S_hi + S_lo) / f + sum_c Q_c min_c (exact s32 sums). O = P' V likewise: A = P' = P *
// value scale in unsigned 16-bit fixed point over the block's largest P', B = value codes, and
// sum_t P_t min_t added to every channel.
//
// The B operands: a lane's word g of four channel rows (keys) or four token rows (values), bytes
// transposed by four PRMTs per pair of words, gives per byte b the four rows' codes of plane t at
// bits 2t (4 k-elements of one n). Plane t's codes enter as code * 4^t (no shift; t = 3 as code *
// 16, one shift, so that Kitty's boosted channels' high bits, 4 h * 4^t, fit a byte too), undone in
// the float epilogue. Column n of S's n-tile (b, t) is token 4 n + b + 32 t, so a lane's
// accumulators hold tokens 8 c + {0, 4} + b + 32 t: the eight of plane t are the A fragment of
// P V's k-step t with no exchange between lanes (FlashAttention-2's register reuse), and its B
// fragment reads the same tokens' value rows.
//
// KIVI-2 (packed_path<true>): a block's key codes are Kitty's low plane (no high rows, no
// boost_idx), with four FP16 scale / min sets [4][D], set t for tokens [32 t, 32 t + 32): exactly
// plane t, so the n-tiles (bb, t) of S take Q'_t = Q * scale_t, all four in one fixed-point range f
// (over the largest |Q'_t| of the block) with beta_t = sum_c Q_c min_t,c; plane 3 enters as code * 64
// (no high bits to leave room for).
// Its values are one 32-byte row per token (strided by the KV heads) with FP16 scale / min per 32
// channels: group u is exactly plane u of the row, so the n-tiles (bb, u) of O take P'_u = P *
// scale[., u] (one range fp over the groups, as Kitty's per block), and mb_u = sum_t P_t min_t,u
// adds to channels [32 u, + 32). Few FP32 instructions per element (the loop is issue-bound):
// beta_t and mb_u are FP16 MMAs (m16n8k16, FP32 sums) on the stage's FP16 minimums (beta: Q / qpow
// in FP16 high and low halves, A rows g and g + 8, prebuilt once per CTA in shared memory; mb: P in
// FP16); the largest |Q'_t| are FP16 products (packed halves) of |Q / qpow| and the FP16 scales,
// the largest P' are P times each token's largest scale; each warp converts a block's scales to
// FP32 once (over the stage's key scale area, read by then: key scales for S, value scales for O),
// so the fixed-point A fragments, formed inside the MMA loops (in registers; P * fp from the
// stage's key codes, read by then), take one FMUL and one FFMA (keys) or one FFMA (values) each.
// The stage is 12 KB (Kitty: 10 KB); no inv array, 4 KB of Q fragments: 111.9 KB of shared memory
// per CTA, two per SM as for Kitty. About 3.7e-4 of float64 in a NumPy model of this arithmetic
// (alt/kivi_packed_model.py).
//
// Measured (H100, Kitty-Pro, docs/perf.md session 16): the FP16-MMA design before it (FP16 operands
// 1024 + 4^t code, the offset taken off FP32 sums) was 1.07-1.30x slower and drifted to 1e-2
// relative error over long walks; this one stays within 2e-4 of the float32 reference.
namespace packed {

constexpr int kD = 128;
constexpr int kStages = 2;
constexpr int kMaxBoost = 32;

// Byte offsets of one stage (one 128-token block) of a warp's ring: Kitty (KIVI = false) or KIVI-2.
template <bool KIVI>
struct Stage {
  static constexpr int kLow = 0;                        // key codes [128 channels][32 B], swizzled rows
  static constexpr int kHigh = kLow + kD * 32;          // high codes [<= 32 ranks][32 B], swizzled rows
  static constexpr int kVal = kHigh + kMaxBoost * 32;   // value codes [128 tokens][32 B], swizzled rows
  static constexpr int kKs = kVal + kBlock * 32;        // key scales [128] FP16
  static constexpr int kKm = kKs + kD * 2;              // key minimums
  static constexpr int kVs = kKm + kD * 2;              // value scales [128 tokens] FP16
  static constexpr int kVm = kVs + kBlock * 2;          // value minimums
  static constexpr int kBoost = kVm + kBlock * 2;       // boost_idx [128]
  static constexpr int kBytes = kBoost + kD;
};
template <>
struct Stage<true> {
  static constexpr int kGroups = 4;                     // key scale groups (32 tokens) = value channel groups (32)
  static constexpr int kLow = 0;                        // key codes [128 channels][32 B], swizzled rows
  static constexpr int kVal = kLow + kD * 32;           // value codes [128 tokens][32 B], swizzled rows
  static constexpr int kKs = kVal + kBlock * 32;        // key scales [4 groups][128 channels] FP16
  static constexpr int kKm = kKs + kGroups * kD * 2;    // key minimums
  // (kKs .. kVs, 2 KB, once read: the key scales in FP32, then the value scales in FP32; see packed_path)
  static constexpr int kVs = kKm + kGroups * kD * 2;    // value scales [128 tokens][4 groups] FP16 (then
                                                        // each token's largest, FP32 [128])
  static constexpr int kVm = kVs + kBlock * kGroups * 2;  // value minimums
  static constexpr int kBytes = kVm + kBlock * kGroups * 2;
};

template <bool KIVI>
constexpr size_t smem_bytes() { return static_cast<size_t>(4) * kStages * Stage<KIVI>::kBytes; }

// Rows of a 32-byte-row tile are stored at row ^ ((row >> shift) & 3): the four lanes c that read
// rows (c << shift) + i at the same time then hit four different bank groups.
__device__ __forceinline__ int swz(int row, int shift) { return row ^ ((row >> shift) & 3); }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) { return __byte_perm(a, b, s); }

// A lane's destinations in a stage for its 16-byte pieces lane + 32 i of a 32-byte-row tile (row
// (lane >> 1) + 16 i): keys at low_dst[i >> 1] + 512 i (swizzle shift 5), values at val_dst[i & 1]
// + 512 i (shift 3).
struct CopyDst {
  uint32_t low_dst[4], val_dst[2];
  __device__ __forceinline__ explicit CopyDst(int lane) {
    const int row = lane >> 1, half = (lane & 1) * 16;
#pragma unroll
    for (int q = 0; q < 4; ++q) low_dst[q] = 32 * (row ^ q) + half;
#pragma unroll
    for (int q = 0; q < 2; ++q) val_dst[q] = 32 * (row ^ ((lane >> 4) + 2 * q)) + half;
  }
};

// Copies of block `blk` of row b, KV head kh into stage `st` (one warp; committed by the caller).
template <bool KIVI>
__device__ __forceinline__ void issue_block(const Params& p, int b, int kh, int blk, unsigned char* st, int lane,
                                            int hshift, const CopyDst& cd) {
  using S = Stage<KIVI>;
  const uint32_t sa = smem_addr(st);
  const long kpage = (static_cast<long>(b) * p.k_units + blk) * p.kvh + kh;
  const uint8_t* low = p.k_low + kpage * (kD * 32) + lane * 16;
#pragma unroll
  for (int i = 0; i < 8; ++i) cp_async16(sa + S::kLow + cd.low_dst[i >> 1] + 512 * i, low + 512 * i, 16u);
  if constexpr (KIVI) {
    // Key scales and minimums [4][128] FP16 (1 KB each, 64 chunks); value token rows (one 32-byte
    // code row, 4 FP16 scales and minimums per token) strided by the KV heads. The value store holds
    // any number of tokens (the cache's: its length less the FP16 window): rows past it are zeros
    // (masked tokens, P = 0: zero scales keep P' and P . min finite), none read.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int x = lane + 32 * i;
      cp_async16(sa + S::kKs + x * 16, p.k_scale + kpage * (S::kGroups * kD) + x * 8, 16u);
      cp_async16(sa + S::kKm + x * 16, p.k_min + kpage * (S::kGroups * kD) + x * 8, 16u);
    }
    const int nval = min(p.v_units - blk * kBlock, kBlock);  // the block's tokens the value store holds
    const long vrow = (static_cast<long>(b) * p.v_units + static_cast<long>(blk) * kBlock) * p.kvh + kh;  // token 0
    const uint8_t* codes = p.v_codes + (vrow + static_cast<long>(lane >> 1) * p.kvh) * 32 + (lane & 1) * 16;
    const long row16 = 16l * p.kvh * 32;  // 16 token rows
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const bool ok = (lane >> 1) + 16 * i < nval;
      cp_async16(sa + S::kVal + cd.val_dst[i & 1] + 512 * i, ok ? codes + row16 * i : p.v_codes, ok ? 16u : 0u);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = lane + 32 * i;
      const bool ok = tok < nval;
      const long at = ok ? (vrow + static_cast<long>(tok) * p.kvh) * S::kGroups : 0;
      cp_async8(sa + S::kVs + tok * 8, p.v_scale + at, ok ? 8u : 0u);
      cp_async8(sa + S::kVm + tok * 8, p.v_min + at, ok ? 8u : 0u);
    }
    return;
  } else {
    const uint8_t* high = p.k_high + kpage * p.nb * 32;  // the boosted channels' high rows, the ranks
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int x = lane + 32 * i;
      if (x < 2 * p.nb) cp_async16(smem_addr(st + S::kHigh + swz(x >> 1, hshift) * 32 + (x & 1) * 16), high + x * 16, 16u);
    }
    if (lane < kD / 16) cp_async16(smem_addr(st + S::kBoost + lane * 16), p.k_boost + kpage * kD + lane * 16, 16u);
    {  // key scales and minimums: 128 FP16 each, 16 chunks each
      const bool mins = lane >= 16;
      const int c = lane & 15;
      cp_async16(smem_addr(st + (mins ? S::kKm : S::kKs) + c * 16), (mins ? p.k_min : p.k_scale) + kpage * kD + c * 8,
                 16u);
    }
    const long vpage = (static_cast<long>(b) * p.v_units + blk) * p.kvh + kh;  // codes [128][32 B], scale and min per token
    const uint8_t* codes = p.v_codes + vpage * (kBlock * 32) + lane * 16;
#pragma unroll
    for (int i = 0; i < 8; ++i) cp_async16(sa + S::kVal + cd.val_dst[i & 1] + 512 * i, codes + 512 * i, 16u);
    const bool mins = lane >= 16;
    const int c = lane & 15;
    cp_async16(smem_addr(st + (mins ? S::kVm : S::kVs) + c * 16), (mins ? p.v_min : p.v_scale) + vpage * kBlock + c * 8,
               16u);
  }
}

constexpr float kMagic = 8388608.f;  // 2^23: the low 16 bits of y = 2^23 + v (0 <= v < 2^16) hold round(v)
constexpr float kQRange = 32512.f;   // |x| <= 32512 (margin for the rounding of f)
constexpr float kQOffset = 32896.f;  // v = x + 128 * 257: its bytes less 128 are hi, lo
constexpr float kPRange = 65280.f;   // P' fp <= 65280 (u16; margin for the rounding of fp)

__device__ __forceinline__ void imma_s8u8(int (&c)[4], const uint4& a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void imma_u8u8(int (&c)[4], const uint4& a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

// r[b] = (w0.b, w1.b, w2.b, w3.b): byte b of four words.
__device__ __forceinline__ void transpose4(uint32_t (&r)[4], uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  const uint32_t t0 = prmt(w0, w1, 0x5140u), t1 = prmt(w0, w1, 0x7362u);
  const uint32_t t2 = prmt(w2, w3, 0x5140u), t3 = prmt(w2, w3, 0x7362u);
  r[0] = prmt(t0, t2, 0x5410u);
  r[1] = prmt(t0, t2, 0x7632u);
  r[2] = prmt(t1, t3, 0x5410u);
  r[3] = prmt(t1, t3, 0x7632u);
}

// transpose4 of the words at base + o0 .. base + o3 (a lane's word of four rows).
__device__ __forceinline__ void load_transposed(uint32_t (&r)[4], const unsigned char* base, int o0, int o1, int o2,
                                                int o3) {
  transpose4(r, *reinterpret_cast<const uint32_t*>(base + o0), *reinterpret_cast<const uint32_t*>(base + o1),
             *reinterpret_cast<const uint32_t*>(base + o2), *reinterpret_cast<const uint32_t*>(base + o3));
}

// The low and high bytes of the 16-bit numbers in the low halves of y0..y3 (float bits of 2^23 + v).
__device__ __forceinline__ void split_bytes(uint32_t y0, uint32_t y1, uint32_t y2, uint32_t y3, uint32_t& hi,
                                            uint32_t& lo) {
  const uint32_t t01 = prmt(y0, y1, 0x5140u), t23 = prmt(y2, y3, 0x5140u);
  lo = prmt(t01, t23, 0x5410u);
  hi = prmt(t01, t23, 0x7632u);
}

__device__ __forceinline__ uint32_t fixed(float x, float f, float magic) { return __float_as_uint(fmaf(x, f, magic)); }

// Plane t's codes of a transposed register as u8 code * 4^t (t = 3: code * 16).
__device__ __forceinline__ uint32_t plane(uint32_t r, int t) {
  return t < 3 ? r & (0x03030303u << (2 * t)) : (r >> 2) & 0x30303030u;
}
// Plane t of a high-bits register as u8 4 h * 4^t (t = 3: 4 h * 16).
__device__ __forceinline__ uint32_t high_plane(uint32_t r, int t) {
  return t < 3 ? (r << 2) & (0x03030303u << (2 * t + 2)) : r & 0xc0c0c0c0u;
}

// KIVI: plane t of a transposed register as u8 code * 4^t, in place (t = 3: code * 64; no boosted
// high bits to leave room for).
__device__ __forceinline__ uint32_t plane_kivi(uint32_t r, int t) { return r & (0x03030303u << (2 * t)); }

// A fixed-point scale of 16-bit range over a largest magnitude below this is 0 (x f would pass the
// float range): a Q' that small adds nothing beside beta, a block of P' that small nothing beside l.
constexpr float kTiny = 7.8886090522e-31f;  // 2^-100

// KIVI: the FP16 products that bound |Q'_t| start from the smallest normal FP16 number (their
// rounding then stays within 2^-11 relative, inside kQRange's margin).
constexpr float kHalfFloor = 6.103515625e-05f;  // 2^-14
// KIVI's FFMA magic less 2^23: 2^23 + 65664 + x (|x| <= 32512) keeps x + 128 in the low 16 bits as
// two's complement: the high byte is hi (s8), the low byte lo + 128 (lo ^ 0x80), x = 256 hi + lo.
constexpr float kQMagicLow = 65664.f;

__device__ __forceinline__ __half2 as_half2(uint32_t x) { return *reinterpret_cast<__half2*>(&x); }

// KIVI: qpow = 2^e > max_c |q_gc| of query g (q4 rows; 2^-126 for a zero row): Q / qpow in FP16 is at
// most 1, so its products with FP16 scales stay finite.
__device__ __forceinline__ float q_pow2(const float (*q4)[4][36], int g) {
  float m = 0.f;
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int j = 0; j < 32; j += 4) {
      const float4 v = *reinterpret_cast<const float4*>(&q4[g][c][j]);
      m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
  return __uint_as_float((__float_as_uint(m) & 0x7f800000u) + 0x00800000u);
}

// KIVI: the m16n8k16 A fragments of Q / qpow for the minimums' sums, qfrag[ks][lane] (thread tid
// writes k-steps 2 (tid >> 5) + {0, 1}; all 128 threads): row g the FP16 high halves, row g + 8 the low
// halves (Q / qpow - high), k position 2 c + {0, 1, 8, 9} channel 32 c + 4 ks + {0, 1, 2, 3}.
__device__ __forceinline__ void kivi_qfrag(const float (*q4)[4][36], uint4* qfrag, int tid) {
  const int lane = tid & 31, g = lane >> 2, c = lane & 3;
  const float inv = 1.f / q_pow2(q4, g);  // a power of two: exact
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int ks = 2 * (tid >> 5) + i;
    const float4 v = *reinterpret_cast<const float4*>(&q4[g][c][4 * ks]);
    const float x[4] = {v.x * inv, v.y * inv, v.z * inv, v.w * inv};
    const __half2 h01 = __floats2half2_rn(x[0], x[1]), h23 = __floats2half2_rn(x[2], x[3]);
    const float2 f01 = __half22float2(h01), f23 = __half22float2(h23);
    qfrag[ks * 32 + lane] = make_uint4(pack_half2(x[0], x[1]), pack_half2(x[0] - f01.x, x[1] - f01.y),
                                       pack_half2(x[2], x[3]), pack_half2(x[2] - f23.x, x[3] - f23.y));
  }
}

// One warp's walk over blocks blk0, blk0 + 4, ... < blk1 of row b, KV head kh; leaves its partials
// like staged_path (red_m / red_l, then osm after a __syncthreads). q4[g][c][j]: query g's channel
// 32 c + j in FP32 (rows padded: conflict-free 16-byte reads); frag: Kitty, per warp, a lane's A
// fragments of one block ([k-step][lane]); KIVI, the CTA's FP16 Q fragments of Q . min ([8 k-steps]
// [lane] uint4, kivi_qfrag).
//
// KIVI (KIVI-2 key blocks and value tokens, value groups of 32 channels): key scale group t (tokens
// [32 t, 32 t + 32)) is exactly the codes' plane t, so n-tile (bb, t) of S takes the A fragments of
// Q'_t = Q * key scale_t, in one range f over the groups and query g's channels, and beta_t = Q . min_t; value
// group u (channels [32 u, 32 u + 32)) is exactly plane u of a token's codes, so n-tile (bb, u) of
// O takes P'_u = P * value scale[., u] (one fp over the groups), and mb_u = P . min[., u] adds to
// its channels. f (fp) needs the products' max first: a first pass (FP16 products for f, P times
// each token's largest scale for fp); the fixed-point A fragments are formed again inside the MMA
// loops (4 per k-step, kept in registers) from the FP32 scales each warp writes over the stage's key
// scale area, Q from q4, P * fp from the stage's key codes (read by then; 4 KB per warp).
template <bool KIVI>
__device__ __forceinline__ void packed_path(const Params& p, int b, int kh, const Bounds& rb, int blk0, int blk1,
                                          unsigned char* smem, const float (*q4)[4][36], uint8_t (*inv)[kMaxBoost],
                                          uint4 (*frag)[4][32], float (*red_m)[kRows], float (*red_l)[kRows]) {
  using S = Stage<KIVI>;
  constexpr int kGroups = KIVI ? 4 : 1;  // key scales per channel and value scales per token in a block
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  unsigned char* ring = smem + warp * kStages * S::kBytes;
  const int hshift = p.nb == 16 ? 2 : 3;
  const bool two_high = p.nb == 32;
  // Byte offsets of this lane's words (word g of a row; rows swizzled as packed::CopyDst stores them):
  // key channel 32 c + 8 ks + 4 h + i at koff[i] + 256 ks + 128 h; high rank (c << hshift) + 4 h + i at
  // hoff[i] + 128 h; value token 8 c + d + 32 t at voff[d] + 1024 t.
  int koff[4], hoff[4], voff[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    koff[i] = (32 * c + (i ^ c)) * 32 + 4 * g;
    hoff[i] = ((c << hshift) + (i ^ c)) * 32 + 4 * g;
  }
#pragma unroll
  for (int d = 0; d < 8; ++d) voff[d] = (8 * c + (d ^ c)) * 32 + 4 * g;
  constexpr int kTok[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // k position 4 c + i (i < 4), 16 + 4 c + i: token 8 c + kTok

  // O of query g, channel 8 c + 4 e + b + 32 t at o[b][t][e] (relative to row_m, FP32).
  float o[4][4][2];
#pragma unroll
  for (int bb = 0; bb < 4; ++bb)
#pragma unroll
    for (int t = 0; t < 4; ++t) o[bb][t][0] = o[bb][t][1] = 0.f;
  float row_m = -INFINITY, lsum = 0.f, mb[kGroups];  // mb[u]: P . value min of group u's channels
#pragma unroll
  for (int u = 0; u < kGroups; ++u) mb[u] = 0.f;

  float qpow = 1.f;  // KIVI: the scale of the FP16 Q halves (q_pow2), the A fragments of Q . min
  if constexpr (KIVI) qpow = q_pow2(q4, g);
  const uint4* qfrag = reinterpret_cast<const uint4*>(frag);  // KIVI: [8 k-steps][lane]

  const CopyDst cd(lane);
  const int first_blk = blk0 + warp;
  const int n = first_blk < blk1 ? (blk1 - first_blk + 3) / 4 : 0;
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < n) issue_block<KIVI>(p, b, kh, first_blk + 4 * i, ring + i * S::kBytes, lane, hshift, cd);
    cp_async_commit();
  }
  for (int i = 0; i < n; ++i) {
    const int blk = first_blk + 4 * i;
    if (i + kStages - 1 < n)
      issue_block<KIVI>(p, b, kh, blk + 4 * (kStages - 1), ring + ((i + kStages - 1) % kStages) * S::kBytes, lane,
                        hshift, cd);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncwarp();
    unsigned char* st = ring + (i % kStages) * S::kBytes;
    const __half* ks = reinterpret_cast<const __half*>(st + S::kKs);
    const __half* km = reinterpret_cast<const __half*>(st + S::kKm);

    // ---- Q' = Q * key scale of query g, channels 32 c + j: Kitty its fixed-point A fragments, KIVI
    // the range over its four groups; the minimums' sums.
    float f[1], invf[1], beta[kGroups];  // f: the fixed-point range of Q' (KIVI: one over the groups)
    int sacc[4][4][4];
#pragma unroll
    for (int bb = 0; bb < 4; ++bb)
#pragma unroll
      for (int t = 0; t < 4; ++t) sacc[bb][t][0] = sacc[bb][t][1] = sacc[bb][t][2] = sacc[bb][t][3] = 0;
    if constexpr (!KIVI) {
      {  // the channel of each boosted rank
        const uint32_t ranks = *reinterpret_cast<const uint32_t*>(st + S::kBoost + 4 * lane);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = (ranks >> (8 * e)) & 0xff;
          if (r < p.nb) inv[warp][r] = static_cast<uint8_t>(4 * lane + e);
        }
      }
      beta[0] = 0.f;
      float qs[32], amax = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float4 qv = *reinterpret_cast<const float4*>(&q4[g][c][4 * k]);
        const uint2 sv = *reinterpret_cast<const uint2*>(ks + 32 * c + 4 * k);
        const uint2 mv = *reinterpret_cast<const uint2*>(km + 32 * c + 4 * k);
        const float2 s01 = __half22float2(*reinterpret_cast<const __half2*>(&sv.x));
        const float2 s23 = __half22float2(*reinterpret_cast<const __half2*>(&sv.y));
        const float2 m01 = __half22float2(*reinterpret_cast<const __half2*>(&mv.x));
        const float2 m23 = __half22float2(*reinterpret_cast<const __half2*>(&mv.y));
        qs[4 * k] = qv.x * s01.x;
        qs[4 * k + 1] = qv.y * s01.y;
        qs[4 * k + 2] = qv.z * s23.x;
        qs[4 * k + 3] = qv.w * s23.y;
        beta[0] = fmaf(qv.x, m01.x, fmaf(qv.y, m01.y, fmaf(qv.z, m23.x, fmaf(qv.w, m23.y, beta[0]))));
#pragma unroll
        for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(qs[4 * k + j]));
      }
#pragma unroll
      for (int x = 1; x < 4; x <<= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, x));
        beta[0] += __shfl_xor_sync(0xffffffffu, beta[0], x);
      }
      f[0] = amax > kTiny ? kQRange / amax : 0.f;
      invf[0] = amax * (1.f / kQRange);
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // k-step k: channels 32 c + 8 k + i (a0, a1), + 4 (a2, a3)
        uint32_t y[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) y[j] = fixed(qs[8 * k + j], f[0], kMagic + kQOffset);
        uint32_t hi0, lo0, hi1, lo1;
        split_bytes(y[0], y[1], y[2], y[3], hi0, lo0);
        split_bytes(y[4], y[5], y[6], y[7], hi1, lo1);
        frag[warp][k][lane] = make_uint4(hi0 ^ 0x80808080u, lo0 ^ 0x80808080u, hi1 ^ 0x80808080u, lo1 ^ 0x80808080u);
      }

      // ---- S = Q' K^T in s32: n-tile (bb, t) column n is token 4 n + bb + 32 t. This loop and O's are
      // unrolled for Kitty (8 x 32K: 4% faster), rolled for KIVI (unrolled 3-10% slower; session 29).
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint4 a = frag[warp][k][lane];
        const unsigned char* lk = st + S::kLow + 256 * k;
        uint32_t r0[4], r1[4];
        load_transposed(r0, lk, koff[0], koff[1], koff[2], koff[3]);
        lk += 128;
        load_transposed(r1, lk, koff[0], koff[1], koff[2], koff[3]);
#pragma unroll
        for (int bb = 0; bb < 4; ++bb)
#pragma unroll
          for (int t = 0; t < 4; ++t) imma_s8u8(sacc[bb][t], a, plane(r0[bb], t), plane(r1[bb], t));
      }
      {  // Kitty's boosted channels: rank (c << hshift) + i (a0, a1), + 4 + i (a2, a3; 32 ranks only)
        __syncwarp();  // inv is written
        uint32_t y[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int ch = inv[warp][(c << hshift) + j];
          const float x = (j < 4 || two_high) ? q4[g][ch >> 5][ch & 31] * __half2float(ks[ch]) : 0.f;
          y[j] = fixed(x, f[0], kMagic + kQOffset);
        }
        uint32_t hi0, lo0, hi1, lo1;
        split_bytes(y[0], y[1], y[2], y[3], hi0, lo0);
        split_bytes(y[4], y[5], y[6], y[7], hi1, lo1);
        const uint4 a = two_high ? make_uint4(hi0 ^ 0x80808080u, lo0 ^ 0x80808080u, hi1 ^ 0x80808080u, lo1 ^ 0x80808080u)
                                 : make_uint4(hi0 ^ 0x80808080u, lo0 ^ 0x80808080u, 0u, 0u);
        const unsigned char* hk = st + S::kHigh;
        uint32_t r0[4], r1[4];
        load_transposed(r0, hk, hoff[0], hoff[1], hoff[2], hoff[3]);
        if (two_high) {
          hk += 128;
          load_transposed(r1, hk, hoff[0], hoff[1], hoff[2], hoff[3]);
        } else {
          r1[0] = r1[1] = r1[2] = r1[3] = 0u;
        }
#pragma unroll
        for (int bb = 0; bb < 4; ++bb)
#pragma unroll
          for (int t = 0; t < 4; ++t) imma_s8u8(sacc[bb][t], a, high_plane(r0[bb], t), high_plane(r1[bb], t));
      }
    } else {
      // KIVI, first pass (no FP32 per element): beta_t = Q . min_t by FP16 MMAs (A: Q / qpow split in
      // FP16 high / low halves, rows g / g + 8; B: the stage's FP16 minimums, column n = group n & 3),
      // the largest |Q'_t| by FP16 products of |Q_hi| and the stage's FP16 scales (packed halves).
      // k position 2 c + {0, 1, 8, 9} of k-step ks is channel 32 c + 4 ks + {0, 1, 2, 3}; lane c takes
      // its 16-byte chunks in the order jj = j ^ (c >> 1) (conflict-free scale reads).
      const uint4 cv0 = *reinterpret_cast<const uint4*>(ks + 16 * lane);  // this lane's share of the
      const uint4 cv1 = *reinterpret_cast<const uint4*>(ks + 16 * lane + 8);  // FP32 conversion below
      float bacc[4] = {0.f, 0.f, 0.f, 0.f};
      __half2 hm[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) hm[t] = __float2half2_rn(kHalfFloor);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int jj = j ^ (c >> 1);
        const uint4 a0 = qfrag[(2 * jj) * 32 + lane], a1 = qfrag[(2 * jj + 1) * 32 + lane];
        const uint4 bm = *reinterpret_cast<const uint4*>(km + kD * (g & 3) + 32 * c + 8 * jj);
        mma16816(bacc, reinterpret_cast<const uint32_t(&)[4]>(a0), bm.x, bm.y);
        mma16816(bacc, reinterpret_cast<const uint32_t(&)[4]>(a1), bm.z, bm.w);
        const __half2 qa[4] = {__habs2(as_half2(a0.x)), __habs2(as_half2(a0.z)), __habs2(as_half2(a1.x)),
                               __habs2(as_half2(a1.z))};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const uint4 sv = *reinterpret_cast<const uint4*>(ks + kD * t + 32 * c + 8 * jj);
          const uint32_t sw[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) hm[t] = __hmax2(hm[t], __hmul2(qa[i], as_half2(sw[i])));
        }
      }
      {  // lane c holds beta of groups 2 (c & 1) + {0, 1} (rows g + 8: the low halves' share)
        const float b0 = (bacc[0] + bacc[2]) * qpow, b1 = (bacc[1] + bacc[3]) * qpow;
        const float o0 = __shfl_xor_sync(0xffffffffu, b0, 1), o1 = __shfl_xor_sync(0xffffffffu, b1, 1);
        const bool up = c & 1;
        beta[0] = up ? o0 : b0;
        beta[1] = up ? o1 : b1;
        beta[2] = up ? b0 : o0;
        beta[3] = up ? b1 : o1;
      }
      // One fixed-point range f over the four groups (as Kitty's one per page): a token's score then
      // carries at most the absolute rounding of the block's widest group, and the A fragments take one
      // FFMA per element (Q f, formed once per k-step, times each group's scale).
      __half2 m = __hmax2(__hmax2(hm[0], hm[1]), __hmax2(hm[2], hm[3]));
      m = __hmax2(m, __lowhigh2highlow(m));
#pragma unroll
      for (int x = 1; x < 4; x <<= 1) m = __hmax2(m, __shfl_xor_sync(0xffffffffu, m, x));
      const float amax = __low2float(m) * qpow;
      f[0] = amax > kTiny ? __fdividef(kQRange, amax) : 0.f;  // 2 ulp: inside kQRange's margin
      invf[0] = amax * (1.f / kQRange);
      {  // the key scales to FP32 over the scale / minimum area: [t][32 chunks of 4], chunk q at q ^ (q >> 3 & 3)
        __syncwarp();  // every lane has read the FP16 scales and minimums
        float4* k32 = reinterpret_cast<float4*>(st + S::kKs);
        const __half2* h = reinterpret_cast<const __half2*>(&cv0);
        const __half2* h2 = reinterpret_cast<const __half2*>(&cv1);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int q = 4 * (lane & 7) + i;
          const __half2 x0 = i < 2 ? h[2 * i] : h2[2 * i - 4], x1 = i < 2 ? h[2 * i + 1] : h2[2 * i - 3];
          const float2 f0 = __half22float2(x0), f1 = __half22float2(x1);
          k32[(lane >> 3) * 32 + (q ^ ((q >> 3) & 3))] = make_float4(f0.x, f0.y, f1.x, f1.y);
        }
        __syncwarp();
      }
      const float4* k32 = reinterpret_cast<const float4*>(st + S::kKs);

      // ---- S = Q'_t K^T in s32: n-tile (bb, t) column n is token 4 n + bb + 32 t (group t), its A
      // fragments x = round(Q f * scale_t) (FP32 scales from the stage).
#pragma unroll 1
      for (int k = 0; k < 4; ++k) {
        const unsigned char* lk = st + S::kLow + 256 * k;
        uint32_t r0[4], r1[4];
        load_transposed(r0, lk, koff[0], koff[1], koff[2], koff[3]);
        lk += 128;
        load_transposed(r1, lk, koff[0], koff[1], koff[2], koff[3]);
        const float4 qa = *reinterpret_cast<const float4*>(&q4[g][c][8 * k]);
        const float4 qb = *reinterpret_cast<const float4*>(&q4[g][c][8 * k + 4]);
        const float qf[8] = {qa.x * f[0], qa.y * f[0], qa.z * f[0], qa.w * f[0],
                             qb.x * f[0], qb.y * f[0], qb.z * f[0], qb.w * f[0]};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const float4 s0 = k32[t * 32 + ((8 * c + 2 * k) ^ c)], s1 = k32[t * 32 + ((8 * c + 2 * k + 1) ^ c)];
          const float sc[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
          uint32_t y[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) y[j] = fixed(qf[j], sc[j], kMagic + kQMagicLow);
          uint32_t hi0, lo0, hi1, lo1;
          split_bytes(y[0], y[1], y[2], y[3], hi0, lo0);
          split_bytes(y[4], y[5], y[6], y[7], hi1, lo1);
          const uint4 a = make_uint4(hi0, lo0 ^ 0x80808080u, hi1, lo1 ^ 0x80808080u);
#pragma unroll
          for (int bb = 0; bb < 4; ++bb) imma_s8u8(sacc[bb][t], a, plane_kivi(r0[bb], t), plane_kivi(r1[bb], t));
        }
      }
    }

    // ---- Scores (base 2) of query g, tokens 8 c + 4 e + bb + 32 t; mask; online softmax.
    float s[4][4][2];
    const int base = blk * kBlock;
    const bool interior = base >= rb.lo && base + kBlock <= rb.hi;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const float unit = invf[0] / static_cast<float>(KIVI || t < 3 ? 1 << (2 * t) : 16);
      const float bt = beta[KIVI ? t : 0];
#pragma unroll
      for (int bb = 0; bb < 4; ++bb)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          s[bb][t][e] = fmaf(static_cast<float>(sacc[bb][t][e] * 256 + sacc[bb][t][2 + e]), unit, bt);
    }
    if (p.softcap > 0.f) {
      const float inv_cap = 1.f / p.softcap;
#pragma unroll
      for (int bb = 0; bb < 4; ++bb)
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
          for (int e = 0; e < 2; ++e) s[bb][t][e] = p.softcap * tanhf(s[bb][t][e] * inv_cap) * kLog2e;
    } else {
#pragma unroll
      for (int bb = 0; bb < 4; ++bb)
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
          for (int e = 0; e < 2; ++e) s[bb][t][e] *= kLog2e;
    }
    if (!interior) {
#pragma unroll
      for (int bb = 0; bb < 4; ++bb)
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = base + 8 * c + 4 * e + bb + 32 * t;
            if (j < rb.lo || j >= rb.hi) s[bb][t][e] = -INFINITY;
          }
    }
    float mx = -INFINITY;
#pragma unroll
    for (int bb = 0; bb < 4; ++bb)
#pragma unroll
      for (int t = 0; t < 4; ++t) mx = fmaxf(mx, fmaxf(s[bb][t][0], s[bb][t][1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(row_m, mx);
    const float alpha = m_new == -INFINITY ? 1.f : fast_exp2(row_m - m_new);
    row_m = m_new;
    const float mref = m_new == -INFINITY ? 0.f : m_new;
    float psum = 0.f;
#pragma unroll
    for (int bb = 0; bb < 4; ++bb)
#pragma unroll
      for (int t = 0; t < 4; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[bb][t][e] = fast_exp2(s[bb][t][e] - mref);  // <= 1; a row of -inf: 0
          psum += s[bb][t][e];
        }
    lsum = lsum * alpha + psum;
#pragma unroll
    for (int u = 0; u < kGroups; ++u) mb[u] *= alpha;
    if (__any_sync(0xffffffffu, alpha != 1.f)) {
#pragma unroll
      for (int bb = 0; bb < 4; ++bb)
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          o[bb][t][0] *= alpha;
          o[bb][t][1] *= alpha;
        }
    }

    // ---- P' = P * value scale in u16 fixed point (scale fp: the block's largest P'; P itself is
    // relative to the running max, often far below 1), as the A fragments of k-step t (tokens
    // 8 c + kTok + 32 t); the value minimums' sum.
    const __half* vs = reinterpret_cast<const __half*>(st + S::kVs);
    const __half* vm = reinterpret_cast<const __half*>(st + S::kVm);
    float fp[1], invfp[1];
    int oacc[4][4][4];
#pragma unroll
    for (int bb = 0; bb < 4; ++bb)
#pragma unroll
      for (int u = 0; u < 4; ++u) oacc[bb][u][0] = oacc[bb][u][1] = oacc[bb][u][2] = oacc[bb][u][3] = 0;
    if constexpr (!KIVI) {
      float pmax = 0.f;
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const uint4 sw = *reinterpret_cast<const uint4*>(vs + 8 * c + 32 * t);
        const uint4 mw = *reinterpret_cast<const uint4*>(vm + 8 * c + 32 * t);
        const __half* sh = reinterpret_cast<const __half*>(&sw);
        const __half* mh = reinterpret_cast<const __half*>(&mw);
#pragma unroll
        for (int d = 0; d < 8; ++d) {  // token 8 c + d + 32 t = 8 c + 4 e + bb + 32 t
          const int bb = d & 3, e = d >> 2;
          mb[0] = fmaf(s[bb][t][e], __half2float(mh[d]), mb[0]);
          s[bb][t][e] *= __half2float(sh[d]);
          pmax = fmaxf(pmax, s[bb][t][e]);
        }
      }
      pmax = fmaxf(pmax, __shfl_xor_sync(0xffffffffu, pmax, 1));
      pmax = fmaxf(pmax, __shfl_xor_sync(0xffffffffu, pmax, 2));
      fp[0] = pmax > kTiny ? kPRange / pmax : 0.f;
      invfp[0] = pmax * (1.f / kPRange);
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        uint32_t y[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] = fixed(s[kTok[i] & 3][t][kTok[i] >> 2], fp[0], kMagic);
        uint32_t hi0, lo0, hi1, lo1;
        split_bytes(y[0], y[1], y[2], y[3], hi0, lo0);
        split_bytes(y[4], y[5], y[6], y[7], hi1, lo1);
        frag[warp][t][lane] = make_uint4(hi0, lo0, hi1, lo1);
      }

      // ---- O = P' V in s32 per block: k-step t (tokens 8 c + kTok + 32 t), n-tile (bb, u) column n is
      // channel 4 n + bb + 32 u; then into o.
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const uint4 a = frag[warp][t][lane];
        const unsigned char* vt = st + S::kVal + 1024 * t;
        uint32_t r0[4], r1[4];
        load_transposed(r0, vt, voff[0], voff[4], voff[1], voff[5]);
        load_transposed(r1, vt, voff[2], voff[6], voff[3], voff[7]);
#pragma unroll
        for (int bb = 0; bb < 4; ++bb)
#pragma unroll
          for (int u = 0; u < 4; ++u)
            imma_u8u8(oacc[bb][u], a, r0[bb] & (0x03030303u << (2 * u)), r1[bb] & (0x03030303u << (2 * u)));
      }
    } else {
      // KIVI: the value scales to FP32 over the key scale area (rows [token][4 groups], token row r at
      // r ^ (r >> 3 & 3): conflict-free reads), each token's largest scale over the FP16 scales (FP32
      // [128]); one fixed-point range fp over the groups: the largest P' = P * scale is P times that.
      __syncwarp();  // every lane's S loop is done with the key codes and FP32 key scales
      {
        const uint4 h0 = *reinterpret_cast<const uint4*>(vs + 16 * lane);  // tokens 4 lane .. + 3
        const uint4 h1 = *reinterpret_cast<const uint4*>(vs + 16 * lane + 8);
        const uint32_t hw[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
        float4 v32[4];
        float vmax[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 a = __half22float2(as_half2(hw[2 * i])), b = __half22float2(as_half2(hw[2 * i + 1]));
          v32[i] = make_float4(a.x, a.y, b.x, b.y);
          vmax[i] = fmaxf(fmaxf(a.x, a.y), fmaxf(b.x, b.y));
        }
        __syncwarp();  // every lane has read the FP16 scales
        float4* v32s = reinterpret_cast<float4*>(st + S::kKs);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tok = 4 * lane + i;
          v32s[tok ^ ((tok >> 3) & 3)] = v32[i];
        }
        reinterpret_cast<float4*>(st + S::kVs)[lane] = make_float4(vmax[0], vmax[1], vmax[2], vmax[3]);
      }
      // P . min[., u] by FP16 MMAs into mb (A: P in FP16, rows g; B: the stage's FP16 minimums,
      // column n = group n & 3; k position 2 c + {0, 1, 8, 9} of k-step (t, h) is token
      // 8 c + 4 h + 32 t + {0, 1, 2, 3}): lane c holds groups 2 (c & 1) + {0, 1} of query g.
      {
        const uint32_t sel = (g & 1) ? 0x7632u : 0x5410u;
        const uint32_t* vmw = reinterpret_cast<const uint32_t*>(vm) + ((g & 3) >> 1);
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int tok = 8 * c + 4 * h + 32 * t;
            const uint32_t a[4] = {pack_half2(s[0][t][h], s[1][t][h]), 0u, pack_half2(s[2][t][h], s[3][t][h]), 0u};
            const uint32_t b0 = prmt(vmw[2 * tok], vmw[2 * tok + 2], sel);
            const uint32_t b1 = prmt(vmw[2 * tok + 4], vmw[2 * tok + 6], sel);
            mma16816(mb, a, b0, b1);
          }
      }
      __syncwarp();  // the FP32 scales and the largest scales are written
      const float* vmx = reinterpret_cast<const float*>(st + S::kVs);
      float pmax = 0.f;
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const float4 m0 = *reinterpret_cast<const float4*>(vmx + 8 * c + 32 * t);
        const float4 m1 = *reinterpret_cast<const float4*>(vmx + 8 * c + 32 * t + 4);
        const float mw[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
#pragma unroll
        for (int d = 0; d < 8; ++d) pmax = fmaxf(pmax, s[d & 3][t][d >> 2] * mw[d]);
      }
      pmax = fmaxf(pmax, __shfl_xor_sync(0xffffffffu, pmax, 1));
      pmax = fmaxf(pmax, __shfl_xor_sync(0xffffffffu, pmax, 2));
      fp[0] = pmax > kTiny ? __fdividef(kPRange, pmax) : 0.f;  // 2 ulp: inside kPRange's margin
      invfp[0] = pmax * (1.f / kPRange);
      // P * fp to the stage's key codes (read by now) in k order: [t][half][lane] float4.
      float4* pst = reinterpret_cast<float4*>(st + S::kLow);
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        float pk[8];  // token 8 c + kTok[i] + 32 t
#pragma unroll
        for (int i = 0; i < 8; ++i) pk[i] = s[kTok[i] & 3][t][kTok[i] >> 2] * fp[0];
        pst[(2 * t) * 32 + lane] = make_float4(pk[0], pk[1], pk[2], pk[3]);
        pst[(2 * t + 1) * 32 + lane] = make_float4(pk[4], pk[5], pk[6], pk[7]);
      }
      __syncwarp();  // P * fp is written
      const float4* v32s = reinterpret_cast<const float4*>(st + S::kKs);

      // ---- O = P'_u V in s32 per block: k-step t (tokens 8 c + kTok + 32 t), n-tile (bb, u) column n
      // is channel 4 n + bb + 32 u (group u), its A fragments round(P * fp * scale[., u]) (one FFMA).
#pragma unroll 1
      for (int t = 0; t < 4; ++t) {
        const unsigned char* vt = st + S::kVal + 1024 * t;
        uint32_t r0[4], r1[4];
        load_transposed(r0, vt, voff[0], voff[4], voff[1], voff[5]);
        load_transposed(r1, vt, voff[2], voff[6], voff[3], voff[7]);
        const float4 pa = pst[(2 * t) * 32 + lane], pb = pst[(2 * t + 1) * 32 + lane];
        const float pk[8] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
        float4 sv[8];  // token 8 c + kTok[i] + 32 t: its 4 groups' scales
#pragma unroll
        for (int i = 0; i < 8; ++i) sv[i] = v32s[(8 * c + kTok[i] + 32 * t) ^ c];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          uint32_t y[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float sc = u == 0 ? sv[i].x : u == 1 ? sv[i].y : u == 2 ? sv[i].z : sv[i].w;
            y[i] = __float_as_uint(fmaf(pk[i], sc, kMagic));
          }
          uint32_t hi0, lo0, hi1, lo1;
          split_bytes(y[0], y[1], y[2], y[3], hi0, lo0);
          split_bytes(y[4], y[5], y[6], y[7], hi1, lo1);
          const uint4 a = make_uint4(hi0, lo0, hi1, lo1);
#pragma unroll
          for (int bb = 0; bb < 4; ++bb)
            imma_u8u8(oacc[bb][u], a, r0[bb] & (0x03030303u << (2 * u)), r1[bb] & (0x03030303u << (2 * u)));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float unit = invfp[0] / static_cast<float>(1 << (2 * u));
#pragma unroll
      for (int bb = 0; bb < 4; ++bb)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          o[bb][u][e] = fmaf(static_cast<float>(oacc[bb][u][e] * 256 + oacc[bb][u][2 + e]), unit, o[bb][u][e]);
    }
    __syncwarp();  // the stage and inv are read: the next copies may overwrite them
  }
  cp_async_wait<0>();

  // ---- This warp's partials: sums over the 4 lanes c of a query, then through shared memory.
#pragma unroll
  for (int x = 1; x < 4; x <<= 1) {
    lsum += __shfl_xor_sync(0xffffffffu, lsum, x);
    if constexpr (!KIVI) {
#pragma unroll
      for (int u = 0; u < kGroups; ++u) mb[u] += __shfl_xor_sync(0xffffffffu, mb[u], x);
    }
  }
  if constexpr (KIVI) {  // mb[0], mb[1]: the MMA's sums of groups 2 (c & 1) + {0, 1} (rows g + 8: zeros)
    const float o0 = __shfl_xor_sync(0xffffffffu, mb[0], 1), o1 = __shfl_xor_sync(0xffffffffu, mb[1], 1);
    const float m0 = mb[0], m1 = mb[1];
    const bool up = c & 1;
    mb[0] = up ? o0 : m0;
    mb[1] = up ? o1 : m1;
    mb[2] = up ? m0 : o0;
    mb[3] = up ? m1 : o1;
  }
  if (c == 0) {
    red_m[warp][g] = row_m;
    red_l[warp][g] = lsum;
  }
  __syncthreads();  // every warp is done with its ring
  float* osm = reinterpret_cast<float*>(smem);  // [4][kRows][D]
  float mm = -INFINITY;
#pragma unroll
  for (int w = 0; w < 4; ++w) mm = fmaxf(mm, red_m[w][g]);
  const float wscale = row_m == -INFINITY ? 0.f : exp2f(row_m - mm);
#pragma unroll
  for (int u = 0; u < 4; ++u)
#pragma unroll
    for (int bb = 0; bb < 4; ++bb)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        osm[(warp * kRows + g) * kD + 8 * c + 4 * e + bb + 32 * u] = (o[bb][u][e] + mb[KIVI ? u : 0]) * wscale;
}

}  // namespace packed

template <int D>
constexpr int min_ctas() { return D == 256 ? 1 : 3; }

// The first stream block a row's staged path takes when the packed path runs: the blocks before
// it hold only packed keys and values (a block past the row's last token counts as packed).
__device__ __forceinline__ int packed_end(const Params& p, const Bounds& r, int first, int last) {
  const int klim = min(p.rk > 0 ? r.qk : INT_MAX, p.k_units * kBlock);
  const int vlim = min(p.rv > 0 ? r.qv : INT_MAX, p.v_units * p.vt);
  const int lim = min(klim, vlim);
  return r.hi <= lim ? last : min(max(lim / kBlock, first), last);
}

// A CTA's split to the outputs: the warps' partials (osm [4][kRows][D] over the dynamic shared
// memory, red_m / red_l) summed to o, m (natural-log units), l at `split`.
template <int D>
__device__ __forceinline__ void write_split(const Params& p, int b, int kh, int split, const unsigned char* smem,
                                            const float (*red_m)[kRows], const float (*red_l)[kRows]) {
  const int tid = threadIdx.x;
  const float* osm = reinterpret_cast<const float*>(smem);  // [4][kRows][D]
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

// KG, VPL, KBITS, VBITS: see BlockRegs. PACKED (Kitty pages, KG = VPL = 1; KIVI-2, KG = VPL = 4; 2-bit
// codes): splits [0, ns = splits - gsplits) run the packed path, the last gsplits splits the staged
// path over the blocks the packed path leaves (those holding FP16 ring tokens, the tail block).
// (Running those inside the last packed CTAs instead measured slower at every point, H100: 8 x 8K
// 58.9 us vs 39.3, 1 x 8K 27.2 vs 16.2.)
template <int D, int KG, int VPL, int KBITS, int VBITS, bool PACKED>
__global__ void __launch_bounds__(kThreads, PACKED ? 2 : min_ctas<D>()) units_kernel(Params p) {
  static_assert(!PACKED || (D == packed::kD && KG == VPL && (KG == 1 || KG == 4) && KBITS == 2 && VBITS == 2),
                "the packed path reads Kitty pages and KIVI-2 (value groups of 32 channels), head_dim 128");
  constexpr bool kKivi = KG == 4;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float red_m[4][kRows], red_l[4][kRows];
  __shared__ __align__(16) __half qsm[kRows][D + kPad];   // the query rows, FP16 (rows >= G zero)
  const int tid = threadIdx.x;
  const int kh = blockIdx.x, b = blockIdx.y, split = blockIdx.z;  // split-major: see launch_variant
  const Bounds rb = row_bounds(p, b);

  // Q (times the softmax scale) to shared memory as FP16.
  {
    const float* qrow = p.q + (static_cast<long>(b) * p.kvh + kh) * p.g * D;
    for (int e = tid; e < kRows * D; e += kThreads) {
      const int row = e / D, col = e % D;
      qsm[row][col] = __float2half_rn(row < p.g ? __ldg(qrow + row * D + col) : 0.f);
    }
  }
  const int first = max(rb.lo, 0) / kBlock, last = rb.hi > rb.lo ? (rb.hi + kBlock - 1) / kBlock : first;
  if constexpr (PACKED) {
    __shared__ __align__(16) float q4[8][4][36];      // the query rows in FP32, 32-channel rows padded
    // Kitty: per warp the channel of each boosted rank, a block's A fragments [k-step][lane]. KIVI
    // (its A fragments formed in registers; its shared memory the larger stages): the CTA's FP16 Q
    // fragments of Q . min [8 k-steps][lane] (packed::kivi_qfrag).
    using KittySmem = struct {
      uint8_t inv[4][packed::kMaxBoost];
      uint4 frag[4][4][32];
    };
    __shared__ __align__(16) unsigned char kitty_smem[kKivi ? 8 * 32 * 16 : sizeof(KittySmem)];
    auto* ks_ = reinterpret_cast<KittySmem*>(kitty_smem);
    uint8_t (*inv)[packed::kMaxBoost] = kKivi ? nullptr : ks_->inv;
    uint4 (*frag)[4][32] = kKivi ? reinterpret_cast<uint4 (*)[4][32]>(kitty_smem) : ks_->frag;
    const int fend = packed_end(p, rb, first, last);
    const int ns = p.splits - p.gsplits;  // packed splits first
    if (split < ns) {
      if constexpr (!kKivi) {
        if (tid < 4 * packed::kMaxBoost) inv[tid / packed::kMaxBoost][tid % packed::kMaxBoost] = 0;
      }
      const float* qrow = p.q + (static_cast<long>(b) * p.kvh + kh) * p.g * D;
      for (int e = tid; e < 8 * D; e += kThreads) {
        const int row = e / D, col = e % D;
        q4[row][col >> 5][col & 31] = row < p.g ? __ldg(qrow + row * D + col) : 0.f;
      }
      __syncthreads();  // q4, inv
      if constexpr (kKivi) {
        packed::kivi_qfrag(q4, reinterpret_cast<uint4*>(kitty_smem), tid);
        __syncthreads();
      }
      const int per = max((fend - first + ns - 1) / ns, p.min_per);
      const int blk0 = first + split * per, blk1 = min(blk0 + per, fend);
      packed::packed_path<kKivi>(p, b, kh, rb, blk0, blk1, smem, q4, inv, frag, red_m, red_l);
    } else {
      staged_path<D, KG, VPL, KBITS, VBITS>(p, b, kh, rb, fend, split - ns, p.gsplits, smem, qsm, red_m, red_l);
    }
  } else {
    staged_path<D, KG, VPL, KBITS, VBITS>(p, b, kh, rb, first, split, p.splits, smem, qsm, red_m, red_l);
  }
  __syncthreads();
  write_split<D>(p, b, kh, split, smem, red_m, red_l);
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

// Whether the packed path reads this layout (see the packed namespace's head): 2-bit codes, Kitty
// pages with 16 or 32 boosted channels, or KIVI-2 (key groups of 32 tokens, value groups of 32
// channels).
inline bool packed_reads(const Params& p, int64_t d) {
  const bool kitty = p.kg == 1 && (p.nb == 16 || p.nb == 32) && p.vt == kBlock && p.v_group == d;
  const bool kivi = p.kg == 4 && p.nb == 0 && p.vt == 1 && p.v_group == 32;
  return d == packed::kD && p.g <= 8 && p.kbits == 2 && p.vbits == 2 && (kitty || kivi);
}

template <int D, int KG, int VPL, int KBITS, int VBITS, bool PACKED>
cudaError_t launch_variant(cudaStream_t stream, const Params& p, int batch) {
  size_t smem = smem_bytes<D>();
  if constexpr (PACKED) smem = std::max(smem, packed::smem_bytes<KG == 4>());
  static const cudaError_t attr =
      cudaFuncSetAttribute(units_kernel<D, KG, VPL, KBITS, VBITS, PACKED>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
  if (attr != cudaSuccess) return attr;
  // The grid split-major (blocks are dispatched in x, y, z order): every packed CTA (the first
  // splits, sized to fill the GPU once) starts before the short staged CTAs, which then fill the
  // slots the packed ones leave instead of pushing half of them into a second wave.
  return jaxlp::launch_kernel(units_kernel<D, KG, VPL, KBITS, VBITS, PACKED>, dim3(p.kvh, batch, p.splits),
                              dim3(kThreads), smem, stream, 1, false, p);
}

// The staged path for these keys (KG scale groups of KBITS-bit codes) and the values: 2-bit with
// one scale per token (Kitty) or over D, else one per plane (KIVI's groups); 4-bit KIVI with one
// scale per plane (a single group over D reads as the same group in both planes).
template <int D, int KG, int KBITS>
cudaError_t launch_staged(cudaStream_t stream, const Params& p, int batch) {
  if (p.vbits == 4) return launch_variant<D, KG, 2, KBITS, 4, false>(stream, p, batch);
  if (p.v_group == D) return launch_variant<D, KG, 1, KBITS, 2, false>(stream, p, batch);
  return launch_variant<D, KG, 4, KBITS, 2, false>(stream, p, batch);
}

// Kitty (one key scale per channel, one value scale per token) or KIVI with 2- or 4-bit keys and
// values (key scales per 32 tokens, value scales per channel group); the packed path where gsplits
// < splits (head_dim 128: Kitty pages, or KIVI-2 with value groups of 32 channels, packed_reads).
template <int D>
cudaError_t launch(cudaStream_t stream, const Params& p, int batch) {
  if constexpr (D == packed::kD) {
    if (p.gsplits < p.splits)
      return p.kg == 1 ? launch_variant<D, 1, 1, 2, 2, true>(stream, p, batch)    // Kitty
                       : launch_variant<D, 4, 4, 2, 2, true>(stream, p, batch);   // KIVI-2
  }
  if (p.kbits == 4) return launch_staged<D, 4, 4>(stream, p, batch);  // KIVI, 4-bit keys
  return p.kg == 1 ? launch_staged<D, 1, 2>(stream, p, batch) : launch_staged<D, 4, 2>(stream, p, batch);
}

ffi::Error UnitsImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> bounds,
                     ffi::Buffer<ffi::U8> k_low, ffi::Buffer<ffi::U8> k_high, ffi::Buffer<ffi::U8> k_boost,
                     ffi::Buffer<ffi::F16> k_scale, ffi::Buffer<ffi::F16> k_min, ffi::Buffer<ffi::U8> v_codes,
                     ffi::Buffer<ffi::F16> v_scale, ffi::Buffer<ffi::F16> v_min, ffi::Buffer<ffi::F16> k_ring,
                     ffi::Buffer<ffi::S32> k_ring_pos, ffi::Buffer<ffi::F16> v_ring, ffi::Buffer<ffi::S32> v_ring_pos,
                     ffi::Buffer<ffi::F16> sink_k, ffi::Buffer<ffi::F16> sink_v, ffi::Buffer<ffi::F16> new_k,
                     ffi::Buffer<ffi::F16> new_v, ffi::Result<ffi::Buffer<ffi::F32>> o,
                     ffi::Result<ffi::Buffer<ffi::F32>> m, ffi::Result<ffi::Buffer<ffi::F32>> l,
                     ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> m_all,
                     ffi::Result<ffi::Buffer<ffi::F32>> den, int64_t nb, int64_t kg,
                     int64_t vt, int64_t v_group, int64_t kbits, int64_t vbits, int64_t tail, int64_t gsplits,
                     int64_t min_per, int64_t few_splits, float softcap) {
  auto qd = q.dimensions();
  auto od = o->dimensions();
  auto kd = k_low.dimensions();
  auto vd = v_codes.dimensions();
  if (qd.size() != 4 || od.size() != 5 || kd.size() != 5 || vd.size() != 5)
    return bad("expected q [B, KVH, G, D], o [B, KVH, S, G, D], key codes [B, U, KVH, D, 16 kbits], value codes "
               "[B, U, KVH, T, D vbits / 8]");
  const int64_t batch = qd[0], kvh = qd[1], g = qd[2], d = qd[3];
  if (g < 1 || g > kRows) return bad("1 to 16 query heads per KV head, got " + std::to_string(g));
  if ((kbits != 2 && kbits != 4) || (vbits != 2 && vbits != 4)) return bad("key and value codes of 2 or 4 bits");
  if (kbits == 4 && (kg != 4 || nb != 0)) return bad("4-bit keys are KIVI blocks: 4 scale groups, no boosted channels");
  if (vbits == 4 && vt != 1) return bad("4-bit values are KIVI tokens: one token per unit");
  if (kd[0] != batch || kd[2] != kvh || kd[3] != d || kd[4] != 16 * kbits) return bad("key codes do not match q");
  if (vd[0] != batch || vd[2] != kvh || vd[3] != vt || vd[4] != d * vbits / 8) return bad("value codes do not match q");
  if (kg != 1 && kg != 4) return bad("key scale groups per block must be 1 or 4");
  if (vt != 1 && vt != kBlock) return bad("tokens per value unit must be 1 or 128, got " + std::to_string(vt));
  // A thread's share of a token row (BlockRegs), 8 vbits bytes, holds 8 vbits channels of each plane:
  // with groups of a multiple of 8 vbits channels (2-bit: 16, 4-bit: 32), one scale per plane.
  if (v_group < 8 * vbits || v_group % (8 * vbits) || d % v_group || (v_group & (v_group - 1)))
    return bad("value scale group must be a multiple of 8 vbits channels (16 at 2 bits, 32 at 4) dividing head_dim");
  if (od[0] != batch || od[1] != kvh || od[3] != g || od[4] != d) return bad("output shape does not match q");
  if (const char* e = jaxlp::merged_outputs_error(out->element_count(), m_all->element_count(), den->element_count(),
                                                  batch * kvh, g, d))
    return bad(e);
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
  p.kbits = static_cast<int>(kbits);
  p.vbits = static_cast<int>(vbits);
  p.softcap = softcap;
  p.gsplits = static_cast<int>(gsplits);
  if (gsplits < 0 || gsplits > p.splits) return bad("gsplits must be in [0, splits]");
  if (min_per < 1 || min_per > INT_MAX) return bad("min_per must be >= 1");
  p.min_per = static_cast<int>(min_per);
  if (batch > 65535 || p.splits > 65535) return bad("at most 65535 rows and 65535 splits (the grid's y and z)");
  if (gsplits < p.splits && !packed_reads(p, d))
    return bad("the packed path takes head_dim 128, at most 8 query heads per KV head, Kitty pages with 16 or 32 "
               "boosted channels or KIVI-2 with value groups of 32 channels (2-bit codes only)");
  if (batch == 0 || kvh == 0) return ffi::Error::Success();
  cudaError_t e;
  switch (d) {
    case 64: e = launch<64>(stream, p, static_cast<int>(batch)); break;
    case 128: e = launch<128>(stream, p, static_cast<int>(batch)); break;
    case 256: e = launch<256>(stream, p, static_cast<int>(batch)); break;
    default: return bad("head_dim must be 64, 128 or 256, got " + std::to_string(d));
  }
  if (e == cudaSuccess)
    e = jaxlp::split_merge(stream, p.o, p.m, p.l, out->typed_data(), m_all->typed_data(), den->typed_data(),
                           static_cast<int>(batch * kvh), p.splits, p.g, static_cast<int>(d),
                           static_cast<int>(std::min<int64_t>(std::max<int64_t>(few_splits, 0), 32)));
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
                                  .Arg<ffi::Buffer<ffi::U8>>()   // key codes (Kitty: the low plane)
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
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, KVH, G, D]: merged (split_merge.cuh)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m [B, KVH, G]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // l
                                  .Attr<int64_t>("nb")
                                  .Attr<int64_t>("kg")
                                  .Attr<int64_t>("vt")
                                  .Attr<int64_t>("v_group")
                                  .Attr<int64_t>("kbits")
                                  .Attr<int64_t>("vbits")
                                  .Attr<int64_t>("tail")
                                  .Attr<int64_t>("gsplits")
                                  .Attr<int64_t>("min_per")
                                  .Attr<int64_t>("few_splits")  // the merge: a warp per query up to these splits
                                  .Attr<float>("softcap"),
                              {ffi::Traits::kCmdBufferCompatible});
