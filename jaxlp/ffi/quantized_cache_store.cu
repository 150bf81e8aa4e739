// One-token store into a Kitty or KIVI cache (XLA FFI custom calls, sm_90); Python side, layout and
// contract: jaxlp/ffi/quantized_cache_store.py. The reference is QuantizedLayerCache.store (XLA),
// which this kernel replaces on one-token (decode) steps: one launch, no lax.cond, the cache updated
// in place (every state buffer is an input aliased to an output). One kernel template, instantiated
// per format and KIVI's key and value bit widths (store_kernel<kKitty>, store_kernel<kKivi, KB, VB>
// for KB, VB in {2, 4}; neither is a runtime branch), and one FFI handler per format (their state
// buffers differ; the KIVI handler picks the instance from its key_bits and value_bits attributes).
//
// Grid (KVH, B, 2): one CTA of 256 threads per (KV head h, row b, stream), stream 0 the keys, 1 the
// values; the CTA writes head h's part of the token and of a completed unit. For the row's position
// p (skipped outside [0, max_len)):
//   * p < off: the new token goes to the sink, slot p (off may be 0: no sink).
//   * else j = p - off: if the stream's quantized count grows at this step (quantized(m) = unit *
//     floor(max(m - lag, 0) / unit) from m = j to j + 1), unit u = quantized(j) / unit is encoded
//     from its tokens j' = unit * u + t as the cache held them: the new token where j' = j, the
//     FP16 ring where slot j' % R holds j', else the unit's old codes decoded to FP16 (a rewound
//     row); then, if j stays in full precision (j >= quantized(j + 1)), the token goes to ring slot
//     j % R. The ring is written after the encode has read it (the new token's slot held the unit's
//     first token, or for KIVI values the very token being quantized): each head's CTA writes its
//     part after its own encode, and the slot's position, which every head's CTA reads, is written
//     by the last of them to arrive (a counter per row and stream that wraps to 0 on its own; no CTA
//     waits for another).
//
// Encoding (asymmetric min-max of jaxlp.kvcache.quant, float32 math on the FP16 tokens, its
// divisions as products with the float32 reciprocal, products and sums rounded separately):
//   Kitty (jaxlp.kvcache.kitty; unit 128 for both streams, keys lag 0, values lag 128):
//   keys, per channel over the page: score = mean |k|; the n_boost channels of highest score
//     (ties to the lower channel, NaN last) get 4-bit codes, the others 2-bit; low bits planar
//     [D][32], the boosted channels' high bits [n_boost][32] in rank order, boost_idx[D] = rank or
//     n_boost; FP16 scale = max((max - min) * (1 / levels), 1e-6) and min per channel.
//   values, per token over the head: 2-bit codes planar [128][D/4], FP16 scale and min per token.
//   KIVI (jaxlp.kvcache.kivi, KB-bit keys and VB-bit values, 2 or 4 each, levels 2^bits - 1,
//   groups of 32; keys unit 128 lag 0, values unit 1 lag 128):
//   keys, a block of 128 tokens per channel in 4 groups of 32 tokens: FP16 scale and min [4][D]
//     (group g, channel c), codes planar [D][M], M = 128 KB / 8 bytes per channel (byte k of
//     channel c: token k + M q at bits KB q; 2-bit: M = 32, plane q = group q; 4-bit: M = 64, the
//     low nibble tokens 0..63 = groups 0, 1, the high nibble tokens 64..127 = groups 2, 3).
//   values, one token per step (the one leaving the 128-token ring window, read from its ring slot
//     before the new token overwrites that same slot), per group of 32 channels: FP16 scale and
//     min [D/32], codes planar [m], m = D VB / 8 (byte k: channels k + m q at bits VB q; 2-bit:
//     m = D/4, 4 planes; 4-bit: m = D/2, channel k in the low nibble, k + D/2 in the high).
// The Kitty page's score sums run in a different order than XLA's reduction: channels whose scores
// tie to float32 rounding may rank differently (the same codes, another boosted set only at such a
// tie). KIVI has no such step: min, max and the per-element rule are order-free, its bytes are the
// reference's wherever the reference rounds its products and sums separately (module doc of the
// Python side: XLA:GPU may contract the rule's product and + 0.5 into one FMA).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxlp_cache_store {

constexpr int kThreads = 256;
constexpr int kPage = 128;  // tokens per unit (a Kitty page, a KIVI key block)
constexpr int kGroup = 32;  // KIVI scale groups: 32 tokens of a key block, 32 channels of a value token
constexpr int kPad = 8;     // FP16 elements of row padding in the shared tile
constexpr float kScaleFloor = 1e-6f;

enum Format : int { kKitty = 0, kKivi = 1 };  // the kernel's template parameter

// KIVI's planar packing of kBits-bit codes (jaxlp.kvcache.quant): kPer codes per byte (planes).
template <int kBits>
struct Packing {
  static constexpr int kPer = 8 / kBits;
  static constexpr uint32_t kMask = (1u << kBits) - 1;
  static constexpr float kLevels = (1 << kBits) - 1;  // codes in [0, 2^bits - 1]
  static constexpr int kKeyBytes = kPage / kPer;      // bytes per channel of a key block: 32 or 64
};

struct Stream {
  __half* ring;       // [B, R, KVH, D] (R = 0: none)
  int32_t* ring_pos;  // [B, R]: the stream index each slot holds
  __half* sink;       // [B, OFF, KVH, D]
  const __half* x;    // the new token [B, KVH, D]
  int r, units, lag;
};

// Kitty / KIVI shapes of the unit buffers (KIVI: no k_high, k_boost).
struct Params {
  const int32_t* positions;  // [B]
  Stream s[2];               // keys, values
  uint8_t* k_low;            // [B, Uk, KVH, D, 32] (KIVI: the key codes [B, Uk, KVH, D, 128 KB / 8])
  uint8_t* k_high;           // [B, Uk, KVH, NB, 32]
  uint8_t* k_boost;          // [B, Uk, KVH, D]
  __half* k_scale;           // [B, Uk, KVH, D] (KIVI: [B, Uk, KVH, 4, D])
  __half* k_min;
  uint8_t* v_codes;  // [B, Uv, KVH, 128, D/4] (KIVI: [B, Uv, KVH, 1, D VB / 8], Uv one-token units)
  __half* v_scale;   // [B, Uv, KVH, 128] (KIVI: [B, Uv, KVH, 1, D/32])
  __half* v_min;
  int off, max_len, kvh, d, nb;
};

// NaN-propagating min / max (XLA's reduce semantics).
__device__ __forceinline__ float nan_min(float a, float b) { return (a != a || a < b) ? a : b; }
__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

template <int kUnit>
__device__ __forceinline__ int quantized(int m, int lag) { return kUnit * (max(m - lag, 0) / kUnit); }

// clamp(floor((x - min) * rcp + 0.5), 0, levels) as uint8 (NaN: 0), rcp = 1 / scale rounded to
// float32 (jaxlp.kvcache.quant's rule; products and sums rounded separately, no FMA).
__device__ __forceinline__ uint32_t code_of(float x, float mn, float rcp, float levels) {
  const float c = floorf(__fadd_rn(__fmul_rn(__fsub_rn(x, mn), rcp), 0.5f));
  if (c != c) return 0;
  return static_cast<uint32_t>(fminf(fmaxf(c, 0.f), levels));
}

// FP16 max((hi - lo) * (1 / levels), 1e-6) (NaN stays NaN).
__device__ __forceinline__ __half scale_of(float lo, float hi, float levels) {
  const float s = __fmul_rn(__fsub_rn(hi, lo), __frcp_rn(levels));
  return __float2half_rn(s != s ? s : fmaxf(s, kScaleFloor));
}

// The old value of token t, channel c of unit u (a rewound row's overwritten ring slot), as FP16:
// code * scale + min in float32 (one FMA; code * scale is exact, so the FMA rounds as XLA's product
// and sum do). KB: KIVI's key bits.
template <int F, int KB>
__device__ __half old_value(const Params& p, int which, size_t unit, int t, int c) {
  const int d = p.d;
  if constexpr (F == kKivi) {  // key blocks only: KIVI values never go through the tile
    constexpr int kBytes = Packing<KB>::kKeyBytes;  // token t: byte t % M of the channel, plane t / M
    const size_t g = unit * 4 * d + (t / kGroup) * d + c;
    const uint32_t code =
        (p.k_low[unit * d * kBytes + c * kBytes + t % kBytes] >> (KB * (t / kBytes))) & Packing<KB>::kMask;
    return __float2half_rn(fmaf(static_cast<float>(code), __half2float(p.k_scale[g]), __half2float(p.k_min[g])));
  }
  if (which == 0) {
    const uint32_t shift = 2 * (t / 32);
    uint32_t code = (p.k_low[unit * d * 32 + c * 32 + t % 32] >> shift) & 3;
    const int rank = p.k_boost[unit * d + c];
    if (rank < p.nb) code |= ((p.k_high[unit * p.nb * 32 + rank * 32 + t % 32] >> shift) & 3) << 2;
    return __float2half_rn(fmaf(static_cast<float>(code), __half2float(p.k_scale[unit * d + c]),
                                __half2float(p.k_min[unit * d + c])));
  }
  const int m = d / 4;
  const uint32_t code = (p.v_codes[(unit * kPage + t) * m + c % m] >> (2 * (c / m))) & 3;
  return __float2half_rn(fmaf(static_cast<float>(code), __half2float(p.v_scale[unit * kPage + t]),
                              __half2float(p.v_min[unit * kPage + t])));
}

// tile[t][c] = token 128 u + t of head h, channel c, as the cache holds it (file head).
template <int F, int KB>
__device__ void load_unit(const Params& p, const Stream& s, int which, int b, int h, int u, int j, __half* tile) {
  const int d = p.d, stride = d + kPad, chunks = d / 8;
  const size_t unit = (static_cast<size_t>(b) * s.units + u) * p.kvh + h;
  for (int i = threadIdx.x; i < kPage * chunks; i += kThreads) {
    const int t = i / chunks, c = (i % chunks) * 8;
    const int jt = u * kPage + t;
    uint4* dst = reinterpret_cast<uint4*>(tile + t * stride + c);
    if (jt == j) {
      *dst = *reinterpret_cast<const uint4*>(s.x + (static_cast<size_t>(b) * p.kvh + h) * d + c);
      continue;
    }
    if (s.r > 0) {
      const int slot = jt % s.r;
      if (s.ring_pos[static_cast<size_t>(b) * s.r + slot] == jt) {
        *dst = *reinterpret_cast<const uint4*>(s.ring + ((static_cast<size_t>(b) * s.r + slot) * p.kvh + h) * d + c);
        continue;
      }
    }
    for (int e = 0; e < 8; ++e) tile[t * stride + c + e] = old_value<F, KB>(p, which, unit, t, c + e);
  }
}

// Kitty key page of one head from the tile (file head). Shared scratch: score, lo, hi [D] floats,
// ranks [D] and order [NB] ints.
__device__ void encode_keys(const Params& p, size_t unit, const __half* tile, float* score, float* lo, float* hi,
                            int* ranks, int* order) {
  const int d = p.d, stride = d + kPad, nb = p.nb;
  for (int c = threadIdx.x; c < d; c += kThreads) {
    float sum = 0.f, mn = INFINITY, mx = -INFINITY;
    for (int t = 0; t < kPage; ++t) {
      const float x = __half2float(tile[t * stride + c]);
      sum += fabsf(x);
      mn = nan_min(mn, x);
      mx = nan_max(mx, x);
    }
    score[c] = sum / kPage;
    lo[c] = mn;
    hi[c] = mx;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < d; c += kThreads) {
    const float sc = score[c];
    int rank = 0;
    for (int o = 0; o < d; ++o) {  // channels ahead of c in argsort(-score, stable), NaN last
      const float so = score[o];
      const bool ahead = (sc != sc) ? (so == so || o < c) : (so == so && (so > sc || (so == sc && o < c)));
      rank += ahead;
    }
    ranks[c] = rank;
  }
  __syncthreads();  // every score read before the loop below reuses the arrays
  for (int c = threadIdx.x; c < d; c += kThreads) {
    const int rank = ranks[c];
    const bool boosted = rank < nb;
    if (boosted) order[rank] = c;
    const float levels = boosted ? 15.f : 3.f;
    const __half s16 = scale_of(lo[c], hi[c], levels), m16 = __float2half_rn(lo[c]);
    p.k_scale[unit * d + c] = s16;
    p.k_min[unit * d + c] = m16;
    p.k_boost[unit * d + c] = static_cast<uint8_t>(boosted ? rank : nb);
    // lo / hi now hold the FP16-rounded min and the scale's reciprocal the codes are computed from;
    // score the levels.
    lo[c] = __half2float(m16);
    hi[c] = __frcp_rn(__half2float(s16));
    score[c] = levels;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < d * 32; i += kThreads) {  // low planes: byte i of channel c
    const int c = i % d, k = i / d;
    uint32_t byte = 0;
    for (int plane = 0; plane < 4; ++plane)
      byte |= (code_of(__half2float(tile[(k + 32 * plane) * stride + c]), lo[c], hi[c], score[c]) & 3) << (2 * plane);
    p.k_low[unit * d * 32 + c * 32 + k] = static_cast<uint8_t>(byte);
  }
  for (int i = threadIdx.x; i < nb * 32; i += kThreads) {  // high planes in rank order
    const int r = i % nb, k = i / nb, c = order[r];
    uint32_t byte = 0;
    for (int plane = 0; plane < 4; ++plane)
      byte |= (code_of(__half2float(tile[(k + 32 * plane) * stride + c]), lo[c], hi[c], score[c]) >> 2) << (2 * plane);
    p.k_high[unit * nb * 32 + r * 32 + k] = static_cast<uint8_t>(byte);
  }
}

// Kitty value page of one head: per token over the head, a warp per token.
__device__ void encode_values(const Params& p, size_t unit, const __half* tile) {
  const int d = p.d, stride = d + kPad, m = d / 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int t = warp; t < kPage; t += kThreads / 32) {
    const __half* row = tile + t * stride;
    float mn = INFINITY, mx = -INFINITY;
    for (int c = lane; c < d; c += 32) {
      const float x = __half2float(row[c]);
      mn = nan_min(mn, x);
      mx = nan_max(mx, x);
    }
    for (int o = 16; o; o >>= 1) {
      mn = nan_min(mn, __shfl_xor_sync(0xffffffffu, mn, o));
      mx = nan_max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    }
    const __half s16 = scale_of(mn, mx, 3.f), m16 = __float2half_rn(mn);
    if (lane == 0) {
      p.v_scale[unit * kPage + t] = s16;
      p.v_min[unit * kPage + t] = m16;
    }
    const float rcp = __frcp_rn(__half2float(s16)), lo = __half2float(m16);
    for (int k = lane; k < m; k += 32) {
      uint32_t byte = 0;
      for (int plane = 0; plane < 4; ++plane) byte |= code_of(__half2float(row[k + m * plane]), lo, rcp, 3.f) << (2 * plane);
      p.v_codes[(unit * kPage + t) * m + k] = static_cast<uint8_t>(byte);
    }
  }
}

// KIVI key block (KB bits) of one head from the tile: per (group g of 32 tokens, channel c) min-max,
// FP16 scale and min at [g][c]; codes planar [D][M], M = 128 KB / 8 (plane q of byte k: token
// k + M q, of group (k + M q) / 32: 2-bit q, 4-bit 2 q + k / 32). Shared scratch: lo, rcp [4][D]
// floats (the FP16-rounded min and the FP16 scale's reciprocal).
template <int KB>
__device__ void encode_kivi_keys(const Params& p, size_t unit, const __half* tile, float* lo, float* rcp) {
  using Bits = Packing<KB>;
  constexpr int kBytes = Bits::kKeyBytes;
  const int d = p.d, stride = d + kPad;
  for (int i = threadIdx.x; i < 4 * d; i += kThreads) {  // i = g * D + c
    const int g = i / d, c = i % d;
    float mn = INFINITY, mx = -INFINITY;
    for (int t = 0; t < kGroup; ++t) {
      const float x = __half2float(tile[(g * kGroup + t) * stride + c]);
      mn = nan_min(mn, x);
      mx = nan_max(mx, x);
    }
    const __half s16 = scale_of(mn, mx, Bits::kLevels), m16 = __float2half_rn(mn);
    p.k_scale[unit * 4 * d + i] = s16;
    p.k_min[unit * 4 * d + i] = m16;
    lo[i] = __half2float(m16);
    rcp[i] = __frcp_rn(__half2float(s16));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < d * kBytes; i += kThreads) {  // byte k of channel c
    const int c = i % d, k = i / d;
    const int g0 = kBytes == kGroup ? 0 : k / kGroup;  // the group of plane 0's token k
    uint32_t byte = 0;
    for (int q = 0; q < Bits::kPer; ++q) {
      const int g = g0 + q * (kBytes / kGroup);
      byte |= code_of(__half2float(tile[(k + kBytes * q) * stride + c]), lo[g * d + c], rcp[g * d + c], Bits::kLevels)
              << (KB * q);
    }
    p.k_low[unit * d * kBytes + c * kBytes + k] = static_cast<uint8_t>(byte);
  }
}

// KIVI value token jt (unit jt, VB bits) of head h: the new token where jt = j, else ring slot jt % R
// where it holds jt, else the unit's old codes (a rewound row). Thread c < D takes channel c, warp w
// the scale group w (channels [32 w, 32 w + 32)); the new token, the slot's value and the slot's
// position are loaded together (the value before its position is known: one round trip, not two).
// `to_ring`: thread c then writes the new token's channel c to ring slot j % R itself, after its
// own read of the ring (the slots' heads and channels are the threads'; no other thread reads it).
// The codes meet in shared memory (D bytes) to be packed, m = D VB / 8 bytes (byte k: channels
// k + m q at bits VB q). Ends with a __syncthreads after every read of the slot's position.
template <int VB>
__device__ void encode_kivi_value(const Params& p, const Stream& s, int b, int h, int j, int jt, const __half* x,
                                  bool to_ring, uint8_t* codes) {
  using Bits = Packing<VB>;
  const int d = p.d, c = threadIdx.x, m = d / Bits::kPer, groups = d / kGroup;
  const size_t unit = (static_cast<size_t>(b) * s.units + jt) * p.kvh + h;
  if (c < d) {  // whole warps (D is a multiple of 32)
    const bool ring = s.r > 0 && jt != j;
    const size_t slots = static_cast<size_t>(b) * (s.r > 0 ? s.r : 1);
    const int slot = s.r > 0 ? jt % s.r : 0;
    const __half xn = x[c];
    const __half xr = ring ? s.ring[((slots + slot) * p.kvh + h) * d + c] : __float2half(0.f);
    const int held = ring ? s.ring_pos[slots + slot] : -1;
    __half xh;
    if (jt == j) {
      xh = xn;
    } else if (held == jt) {
      xh = xr;
    } else {
      const uint32_t code = (p.v_codes[unit * m + c % m] >> (VB * (c / m))) & Bits::kMask;
      xh = __float2half_rn(fmaf(static_cast<float>(code), __half2float(p.v_scale[unit * groups + c / kGroup]),
                                __half2float(p.v_min[unit * groups + c / kGroup])));
    }
    if (to_ring) s.ring[((slots + j % s.r) * p.kvh + h) * d + c] = xn;
    const float xf = __half2float(xh);
    float mn = xf, mx = xf;
    for (int o = 16; o; o >>= 1) {
      mn = nan_min(mn, __shfl_xor_sync(0xffffffffu, mn, o));
      mx = nan_max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    }
    const __half s16 = scale_of(mn, mx, Bits::kLevels), m16 = __float2half_rn(mn);
    if (c % 32 == 0) {
      p.v_scale[unit * groups + c / kGroup] = s16;
      p.v_min[unit * groups + c / kGroup] = m16;
    }
    codes[c] = static_cast<uint8_t>(code_of(xf, __half2float(m16), __frcp_rn(__half2float(s16)), Bits::kLevels));
  }
  __syncthreads();  // every read of the slot's position by this head is done; the codes are in shared memory
  if (c < m) {
    uint32_t byte = 0;
    for (int q = 0; q < Bits::kPer; ++q) byte |= codes[c + q * m] << (VB * q);
    p.v_codes[unit * m + c] = static_cast<uint8_t>(byte);
  }
}

// Arrivals of a page-completing step's head CTAs per (row, stream): atomicInc wraps each back to 0
// after the KVH-th, so it is 0 between launches.
__device__ unsigned int g_arrivals[2 * 65536];

// Copy n FP16 values (16-byte pieces): one head of a token.
__device__ __forceinline__ void copy_token(__half* dst, const __half* src, int n) {
  for (int i = threadIdx.x; i < n / 8; i += kThreads)
    reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
}

// KB, VB: KIVI's key and value bits (2 or 4; Kitty: unused, 2).
template <int F, int KB = 2, int VB = 2>
__global__ void __launch_bounds__(kThreads) store_kernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int h = blockIdx.x, b = blockIdx.y, which = blockIdx.z;
  const Stream& s = p.s[which];
  const int pos = p.positions[b];
  if (pos < 0 || pos >= p.max_len) return;
  const int d = p.d, token = p.kvh * d;
  const __half* x = s.x + static_cast<size_t>(b) * token + h * d;  // head h of the new token
  if (pos < p.off) {
    copy_token(s.sink + (static_cast<size_t>(b) * p.off + pos) * token + h * d, x, d);
    return;
  }
  const int j = pos - p.off;
  bool encode, to_ring;
  if (F == kKivi && which == 1) {  // KIVI values: unit 1, a token every step past the lag
    const int q0 = quantized<1>(j, s.lag), q1 = quantized<1>(j + 1, s.lag);
    encode = q1 > q0 && q0 < s.units;
    to_ring = s.r > 0 && j >= q1;
    if (encode) encode_kivi_value<VB>(p, s, b, h, j, q0, x, to_ring, smem);  // and the ring's copy
  } else {  // 128-token units
    const int q0 = quantized<kPage>(j, s.lag), q1 = quantized<kPage>(j + 1, s.lag), u = q0 / kPage;
    encode = q1 > q0 && u < s.units;
    to_ring = s.r > 0 && j >= q1;
    if (encode) {
      __half* tile = reinterpret_cast<__half*>(smem);
      float* scratch = reinterpret_cast<float*>(tile + kPage * (d + kPad));
      const size_t unit = (static_cast<size_t>(b) * s.units + u) * p.kvh + h;
      load_unit<F, KB>(p, s, which, b, h, u, j, tile);
      __syncthreads();  // every ring read of this head is done
      if constexpr (F == kKivi)
        encode_kivi_keys<KB>(p, unit, tile, scratch, scratch + 4 * d);
      else if (which == 0)
        encode_keys(p, unit, tile, scratch, scratch + d, scratch + 2 * d, reinterpret_cast<int*>(scratch + 3 * d),
                    reinterpret_cast<int*>(scratch + 4 * d));
      else
        encode_values(p, unit, tile);
    }
  }
  if (to_ring) {
    const int slot = j % s.r;
    if (!(F == kKivi && which == 1 && encode))  // (KIVI values: encode_kivi_value copied it)
      copy_token(s.ring + (static_cast<size_t>(b) * s.r + slot) * token + h * d, x, d);
    if (threadIdx.x == 0) {
      bool last = h == 0;
      if (encode) {  // the other heads' CTAs may still read the slot's position: the last one writes it
        // No fence: this CTA's reads of the position returned before the barrier that ended its
        // encode (branches used them), so the last CTA's write cannot reach them.
        last = atomicInc(&g_arrivals[2 * b + which], static_cast<unsigned>(p.kvh - 1)) ==
               static_cast<unsigned>(p.kvh - 1);
      }
      if (last) s.ring_pos[static_cast<size_t>(b) * s.r + slot] = j;
    }
  }
}

// FireQ (per-token INT4 units, no sink, no ring): one warp per (KV head, row, stream) encodes the
// new token into unit `position` (jaxlp.kvcache.quant: scale = e4m3(clip(max|x| / 7, 2^-9, 448)),
// code = clip(round_half_even(x / scale), -8, 7), channel i in the low nibble of byte i, i + D/2
// in its high nibble); float32 math on the float32 token (no FP16 ring: the reference encodes the
// token as given), both divisions as XLA computes them: products with the float32 reciprocal.
struct Int4Params {
  const int32_t* positions;
  const float* x[2];    // new keys, values [B, KVH, D], float32 as given (FireQ has no FP16 ring)
  uint8_t* codes[2];    // [B, T, KVH, D/2]
  uint8_t* scale[2];    // [B, T, KVH] E4M3
  int kvh, d, tokens, max_len;
};

__global__ void __launch_bounds__(32) int4_store_kernel(Int4Params p) {
  const int h = blockIdx.x, b = blockIdx.y, st = blockIdx.z, lane = threadIdx.x;
  const int pos = p.positions[b];
  if (pos < 0 || pos >= p.max_len || pos >= p.tokens) return;
  const int half = p.d / 2, per = p.d / 64;  // bytes a lane packs (1, 2 or 4)
  const float* x = p.x[st] + (static_cast<size_t>(b) * p.kvh + h) * p.d;
  float lo[4], hi[4], amax = 0.f;
  for (int i = 0; i < per; ++i) {
    lo[i] = x[lane * per + i];
    hi[i] = x[lane * per + i + half];
    amax = fmaxf(amax, fmaxf(fabsf(lo[i]), fabsf(hi[i])));
  }
  for (int off = 16; off; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  float s = amax * (1.f / 7.f);  // XLA's product with the reciprocal of a constant divisor
  s = s < 0.001953125f ? 0.001953125f : (s > 448.f ? 448.f : s);  // NaN stays NaN
  const __nv_fp8_storage_t s8 = __nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3);
  const float rcp = 1.f / __half2float(__half(__nv_cvt_fp8_to_halfraw(s8, __NV_E4M3)));  // and of a broadcast one
  const size_t unit = static_cast<size_t>(b) * p.tokens + pos;
  uint8_t* out = p.codes[st] + (unit * p.kvh + h) * half + lane * per;
  auto code = [&](float v) {
    const float c = fminf(fmaxf(rintf(v * rcp), -8.f), 7.f);
    return static_cast<uint32_t>(static_cast<int>(c)) & 0xFu;
  };
  for (int i = 0; i < per; ++i) out[i] = static_cast<uint8_t>(code(lo[i]) | (code(hi[i]) << 4));
  if (lane == 0) p.scale[st][unit * p.kvh + h] = s8;
}

// The FP16 tile [128][D + pad] and the key scratch: Kitty's score, lo, hi, ranks, order (5 x D
// words), KIVI's lo and rcp [4][D] (8 x D words; its value token's D code bytes fit the tile).
template <int F>
size_t smem_bytes(int d) {
  return static_cast<size_t>(kPage) * (d + kPad) * sizeof(__half) + (F == kKivi ? 8 : 5) * d * sizeof(float);
}

ffi::Error bad(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp quantized cache store: " + what);
}

template <typename T>
bool shape_is(const T& buffer, std::initializer_list<int64_t> shape) {
  auto dims = buffer.dimensions();
  if (dims.size() != shape.size()) return false;
  size_t i = 0;
  for (int64_t s : shape)
    if (dims[i++] != s) return false;
  return true;
}

template <typename T>
int64_t dim(const T& buffer, size_t rank, size_t i) {
  return buffer.dimensions().size() == rank ? buffer.dimensions()[i] : -1;
}

using F16Out = ffi::Result<ffi::Buffer<ffi::F16>>;
using S32Out = ffi::Result<ffi::Buffer<ffi::S32>>;
using U8Out = ffi::Result<ffi::Buffer<ffi::U8>>;

__half* f16(F16Out& x) { return reinterpret_cast<__half*>(x->typed_data()); }

// The checks and parameters both formats share (tokens, positions, sinks, rings, lags); p.s[i].units
// and the unit buffers are the caller's. batch, kvh, d: from the new keys.
ffi::Error common(Params& p, ffi::Buffer<ffi::S32>& positions, ffi::Buffer<ffi::F16>& new_k,
                  ffi::Buffer<ffi::F16>& new_v, F16Out& sink_k, F16Out& sink_v, F16Out& k_ring, S32Out& k_ring_pos,
                  F16Out& v_ring, S32Out& v_ring_pos, int64_t max_len, int64_t k_lag, int64_t v_lag, int64_t& batch,
                  int64_t& kvh, int64_t& d) {
  auto nd = new_k.dimensions();
  if (nd.size() != 3) return bad("new keys must be FP16 [B, KVH, D]");
  batch = nd[0], kvh = nd[1], d = nd[2];
  if (d != 64 && d != 128 && d != 256) return bad("head_dim must be 64, 128 or 256, got " + std::to_string(d));
  if (!shape_is(new_v, {batch, kvh, d})) return bad("new values must be FP16 [B, KVH, D] as the keys");
  if (!shape_is(positions, {batch})) return bad("positions must be int32 [B]");
  if (batch > 65535) return bad("at most 65535 rows (the grid's y), got " + std::to_string(batch));
  const int64_t off = dim(*sink_k, 4, 1);
  if (!shape_is(*sink_k, {batch, off, kvh, d}) || !shape_is(*sink_v, {batch, off, kvh, d}))
    return bad("sinks must be FP16 [B, OFF, KVH, D], keys as values");
  const int64_t rk = dim(*k_ring, 4, 1), rv = dim(*v_ring, 4, 1);
  if (!shape_is(*k_ring, {batch, rk, kvh, d}) || !shape_is(*v_ring, {batch, rv, kvh, d}))
    return bad("rings must be FP16 [B, R, KVH, D]");
  if (!shape_is(*k_ring_pos, {batch, rk}) || !shape_is(*v_ring_pos, {batch, rv}))
    return bad("ring positions must be int32 [B, R] beside their rings");
  if (k_lag < 0 || v_lag < 0 || max_len < 1) return bad("lags must be >= 0 and max_len >= 1");
  p.positions = positions.typed_data();
  p.s[0] = {f16(k_ring), k_ring_pos->typed_data(), f16(sink_k), reinterpret_cast<const __half*>(new_k.typed_data()),
            static_cast<int>(rk), 0, static_cast<int>(k_lag)};
  p.s[1] = {f16(v_ring), v_ring_pos->typed_data(), f16(sink_v), reinterpret_cast<const __half*>(new_v.typed_data()),
            static_cast<int>(rv), 0, static_cast<int>(v_lag)};
  p.off = static_cast<int>(off);
  p.max_len = static_cast<int>(max_len);
  p.kvh = static_cast<int>(kvh);
  p.d = static_cast<int>(d);
  p.nb = 0;
  return ffi::Error::Success();
}

template <int F, int KB = 2, int VB = 2>
ffi::Error launch(cudaStream_t stream, const Params& p, int64_t batch, int64_t kvh) {
  if (batch == 0 || kvh == 0) return ffi::Error::Success();
  static const cudaError_t attr = cudaFuncSetAttribute(
      store_kernel<F, KB, VB>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes<F>(256)));
  if (attr != cudaSuccess) return bad(std::string("shared memory attribute: ") + cudaGetErrorString(attr));
  store_kernel<F, KB, VB><<<dim3(static_cast<unsigned>(kvh), static_cast<unsigned>(batch), 2), kThreads,
                            smem_bytes<F>(p.d), stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxlp quantized cache store launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error StoreImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F16> new_k,
                     ffi::Buffer<ffi::F16> new_v, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                     ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                     ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, F16Out sink_k, F16Out sink_v,
                     F16Out k_ring, S32Out k_ring_pos, F16Out v_ring, S32Out v_ring_pos, U8Out k_low, U8Out k_high,
                     U8Out k_boost, F16Out k_scale, F16Out k_min, U8Out v_codes, F16Out v_scale, F16Out v_min,
                     int64_t max_len, int64_t k_lag, int64_t v_lag) {
  Params p;
  int64_t batch, kvh, d;
  if (auto e = common(p, positions, new_k, new_v, sink_k, sink_v, k_ring, k_ring_pos, v_ring, v_ring_pos, max_len,
                      k_lag, v_lag, batch, kvh, d);
      e.failure())
    return e;
  const int64_t uk = dim(*k_low, 5, 1), uv = dim(*v_codes, 5, 1), nb = dim(*k_high, 5, 3);
  if (!shape_is(*k_low, {batch, uk, kvh, d, 32}) || !shape_is(*k_high, {batch, uk, kvh, nb, 32}) ||
      !shape_is(*k_boost, {batch, uk, kvh, d}) || !shape_is(*k_scale, {batch, uk, kvh, d}) ||
      !shape_is(*k_min, {batch, uk, kvh, d}))
    return bad("key pages must be low [B, U, KVH, D, 32], high [B, U, KVH, NB, 32], boost_idx, scale, min "
               "[B, U, KVH, D]");
  if (nb > d || nb > 255) return bad("more boosted channels than head_dim (or 255)");
  if (!shape_is(*v_codes, {batch, uv, kvh, kPage, d / 4}) || !shape_is(*v_scale, {batch, uv, kvh, kPage}) ||
      !shape_is(*v_min, {batch, uv, kvh, kPage}))
    return bad("value pages must be codes [B, U, KVH, 128, D/4], scale and min [B, U, KVH, 128]");
  p.s[0].units = static_cast<int>(uk);
  p.s[1].units = static_cast<int>(uv);
  p.k_low = k_low->typed_data();
  p.k_high = k_high->typed_data();
  p.k_boost = k_boost->typed_data();
  p.k_scale = f16(k_scale);
  p.k_min = f16(k_min);
  p.v_codes = v_codes->typed_data();
  p.v_scale = f16(v_scale);
  p.v_min = f16(v_min);
  p.nb = static_cast<int>(nb);
  return launch<kKitty>(stream, p, batch, kvh);
}

ffi::Error StoreKiviImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F16> new_k,
                         ffi::Buffer<ffi::F16> new_v, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                         ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                         ffi::AnyBuffer, ffi::AnyBuffer, F16Out sink_k, F16Out sink_v, F16Out k_ring, S32Out k_ring_pos,
                         F16Out v_ring, S32Out v_ring_pos, U8Out k_codes, F16Out k_scale, F16Out k_min, U8Out v_codes,
                         F16Out v_scale, F16Out v_min, int64_t max_len, int64_t k_lag, int64_t v_lag,
                         int64_t key_bits, int64_t value_bits) {
  Params p;
  int64_t batch, kvh, d;
  if (auto e = common(p, positions, new_k, new_v, sink_k, sink_v, k_ring, k_ring_pos, v_ring, v_ring_pos, max_len,
                      k_lag, v_lag, batch, kvh, d);
      e.failure())
    return e;
  if ((key_bits != 2 && key_bits != 4) || (value_bits != 2 && value_bits != 4))
    return bad("KIVI key and value bits must be 2 or 4, got " + std::to_string(key_bits) + " and " +
               std::to_string(value_bits));
  const int64_t uk = dim(*k_codes, 5, 1), uv = dim(*v_codes, 5, 1);
  if (!shape_is(*k_codes, {batch, uk, kvh, d, kPage * key_bits / 8}) || !shape_is(*k_scale, {batch, uk, kvh, 4, d}) ||
      !shape_is(*k_min, {batch, uk, kvh, 4, d}))
    return bad("KIVI key blocks must be codes [B, U, KVH, D, 128 bits / 8], scale and min [B, U, KVH, 4, D]");
  if (!shape_is(*v_codes, {batch, uv, kvh, 1, d * value_bits / 8}) ||
      !shape_is(*v_scale, {batch, uv, kvh, 1, d / kGroup}) || !shape_is(*v_min, {batch, uv, kvh, 1, d / kGroup}))
    return bad("KIVI value tokens must be codes [B, T, KVH, 1, D bits / 8], scale and min [B, T, KVH, 1, D/32]");
  p.s[0].units = static_cast<int>(uk);
  p.s[1].units = static_cast<int>(uv);
  p.k_low = k_codes->typed_data();
  p.k_high = p.k_boost = nullptr;
  p.k_scale = f16(k_scale);
  p.k_min = f16(k_min);
  p.v_codes = v_codes->typed_data();
  p.v_scale = f16(v_scale);
  p.v_min = f16(v_min);
  if (key_bits == 2)
    return value_bits == 2 ? launch<kKivi, 2, 2>(stream, p, batch, kvh) : launch<kKivi, 2, 4>(stream, p, batch, kvh);
  return value_bits == 2 ? launch<kKivi, 4, 2>(stream, p, batch, kvh) : launch<kKivi, 4, 4>(stream, p, batch, kvh);
}

using F8Out = ffi::Result<ffi::AnyBuffer>;  // E4M3 (a dtype the typed buffers do not name)

ffi::Error StoreInt4Impl(cudaStream_t stream, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> new_k,
                         ffi::Buffer<ffi::F32> new_v, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                         U8Out k_codes, F8Out k_scale, U8Out v_codes, F8Out v_scale, int64_t max_len) {
  auto nd = new_k.dimensions();
  if (nd.size() != 3) return bad("new keys must be float32 [B, KVH, D]");
  const int64_t batch = nd[0], kvh = nd[1], d = nd[2];
  if (d != 64 && d != 128 && d != 256) return bad("head_dim must be 64, 128 or 256, got " + std::to_string(d));
  if (!shape_is(new_v, {batch, kvh, d})) return bad("new values must be float32 [B, KVH, D] as the keys");
  if (!shape_is(positions, {batch})) return bad("positions must be int32 [B]");
  if (batch > 65535) return bad("at most 65535 rows (the grid's y), got " + std::to_string(batch));
  const int64_t tokens = dim(*k_codes, 5, 1);
  if (!shape_is(*k_codes, {batch, tokens, kvh, 1, d / 2}) || !shape_is(*v_codes, {batch, tokens, kvh, 1, d / 2}) ||
      !shape_is(*k_scale, {batch, tokens, kvh, 1}) || !shape_is(*v_scale, {batch, tokens, kvh, 1}))
    return bad("INT4 tokens must be codes [B, T, KVH, 1, D/2] and E4M3 scales [B, T, KVH, 1], keys as values");
  if (k_scale->element_type() != ffi::DataType::F8E4M3FN || v_scale->element_type() != ffi::DataType::F8E4M3FN)
    return bad("INT4 token scales must be float8_e4m3fn");
  if (max_len < 1) return bad("max_len must be >= 1");
  if (batch == 0 || kvh == 0 || tokens == 0) return ffi::Error::Success();
  Int4Params p;
  p.positions = positions.typed_data();
  p.x[0] = new_k.typed_data();
  p.x[1] = new_v.typed_data();
  p.codes[0] = k_codes->typed_data();
  p.codes[1] = v_codes->typed_data();
  p.scale[0] = reinterpret_cast<uint8_t*>(k_scale->untyped_data());
  p.scale[1] = reinterpret_cast<uint8_t*>(v_scale->untyped_data());
  p.kvh = static_cast<int>(kvh);
  p.d = static_cast<int>(d);
  p.tokens = static_cast<int>(tokens);
  p.max_len = static_cast<int>(max_len);
  int4_store_kernel<<<dim3(static_cast<unsigned>(kvh), static_cast<unsigned>(batch), 2), 32, 0, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxlp int4 cache store launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace jaxlp_cache_store

// Arguments: positions, new keys, new values, then the 14 state buffers (each aliased to the
// result of the same name, which the handler reads and writes in place).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpQuantizedCacheStore, jaxlp_cache_store::StoreImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [B]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // new keys [B, KVH, D]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // new values
                                  .Arg<ffi::AnyBuffer>()         // sink keys (aliased to result 0)
                                  .Arg<ffi::AnyBuffer>()         // sink values
                                  .Arg<ffi::AnyBuffer>()         // key ring
                                  .Arg<ffi::AnyBuffer>()         // key ring positions
                                  .Arg<ffi::AnyBuffer>()         // value ring
                                  .Arg<ffi::AnyBuffer>()         // value ring positions
                                  .Arg<ffi::AnyBuffer>()         // key low codes
                                  .Arg<ffi::AnyBuffer>()         // key high codes
                                  .Arg<ffi::AnyBuffer>()         // key boost index
                                  .Arg<ffi::AnyBuffer>()         // key scale
                                  .Arg<ffi::AnyBuffer>()         // key min
                                  .Arg<ffi::AnyBuffer>()         // value codes
                                  .Arg<ffi::AnyBuffer>()         // value scale
                                  .Arg<ffi::AnyBuffer>()         // value min
                                  .Ret<ffi::Buffer<ffi::F16>>()  // sink keys [B, OFF, KVH, D]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // sink values
                                  .Ret<ffi::Buffer<ffi::F16>>()  // key ring [B, RK, KVH, D]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // key ring positions [B, RK]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // value ring [B, RV, KVH, D]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // value ring positions [B, RV]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // key low codes [B, Uk, KVH, D, 32]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // key high codes [B, Uk, KVH, NB, 32]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // key boost index [B, Uk, KVH, D]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // key scale [B, Uk, KVH, D]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // key min
                                  .Ret<ffi::Buffer<ffi::U8>>()   // value codes [B, Uv, KVH, 128, D/4]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // value scale [B, Uv, KVH, 128]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // value min
                                  .Attr<int64_t>("max_len")
                                  .Attr<int64_t>("k_lag")
                                  .Attr<int64_t>("v_lag"),
                              {ffi::Traits::kCmdBufferCompatible});

// KIVI (2- or 4-bit keys and values, attributes key_bits and value_bits): positions, new keys, new
// values, then the 12 state buffers (aliased likewise).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpQuantizedCacheStoreKivi, jaxlp_cache_store::StoreKiviImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [B]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // new keys [B, KVH, D]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // new values
                                  .Arg<ffi::AnyBuffer>()         // sink keys (aliased to result 0)
                                  .Arg<ffi::AnyBuffer>()         // sink values
                                  .Arg<ffi::AnyBuffer>()         // key ring
                                  .Arg<ffi::AnyBuffer>()         // key ring positions
                                  .Arg<ffi::AnyBuffer>()         // value ring
                                  .Arg<ffi::AnyBuffer>()         // value ring positions
                                  .Arg<ffi::AnyBuffer>()         // key codes
                                  .Arg<ffi::AnyBuffer>()         // key scale
                                  .Arg<ffi::AnyBuffer>()         // key min
                                  .Arg<ffi::AnyBuffer>()         // value codes
                                  .Arg<ffi::AnyBuffer>()         // value scale
                                  .Arg<ffi::AnyBuffer>()         // value min
                                  .Ret<ffi::Buffer<ffi::F16>>()  // sink keys [B, OFF, KVH, D]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // sink values
                                  .Ret<ffi::Buffer<ffi::F16>>()  // key ring [B, RK, KVH, D]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // key ring positions [B, RK]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // value ring [B, RV, KVH, D]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // value ring positions [B, RV]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // key codes [B, Uk, KVH, D, 128 KB / 8]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // key scale [B, Uk, KVH, 4, D]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // key min
                                  .Ret<ffi::Buffer<ffi::U8>>()   // value codes [B, Uv, KVH, 1, D VB / 8]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // value scale [B, Uv, KVH, 1, D/32]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // value min
                                  .Attr<int64_t>("max_len")
                                  .Attr<int64_t>("k_lag")
                                  .Attr<int64_t>("v_lag")
                                  .Attr<int64_t>("key_bits")     // KB: 2 or 4
                                  .Attr<int64_t>("value_bits"),  // VB: 2 or 4
                              {ffi::Traits::kCmdBufferCompatible});

// FireQ's INT4 tokens: positions, new keys, new values, then the 4 unit buffers (aliased likewise).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpQuantizedCacheStoreInt4, jaxlp_cache_store::StoreInt4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()        // positions [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()        // new keys [B, KVH, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()        // new values
                                  .Arg<ffi::AnyBuffer>()               // key codes (aliased to result 0)
                                  .Arg<ffi::AnyBuffer>()               // key scales
                                  .Arg<ffi::AnyBuffer>()               // value codes
                                  .Arg<ffi::AnyBuffer>()               // value scales
                                  .Ret<ffi::Buffer<ffi::U8>>()         // key codes [B, T, KVH, 1, D/2]
                                  .Ret<ffi::AnyBuffer>()               // key scales [B, T, KVH, 1] (E4M3)
                                  .Ret<ffi::Buffer<ffi::U8>>()         // value codes
                                  .Ret<ffi::AnyBuffer>()               // value scales
                                  .Attr<int64_t>("max_len"),
                              {ffi::Traits::kCmdBufferCompatible});
