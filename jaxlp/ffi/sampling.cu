// Fused decode-step sampling kernels (XLA FFI custom calls, sm_90); Python side: jaxlp/ffi/sampling.py.
//
// Layout. One row of float32 logits [B, V] per cluster of C CTAs of kThreads threads: C <= 16
// where the device can schedule clusters of 16 (H100, H200), else <= 8; C depends on V and the
// device only, so a row's result never depends on the batch size. CTA r copies the elements
// [r * chunk, (r + 1) * chunk) of its row into shared memory with cp.async (16-byte copies when
// V % 4 == 0, all in flight at once), then works there (element j by thread j % kThreads); the
// row is read from global memory once.
//
// Reductions are deterministic: thread (sequential over its elements) -> warp (xor butterfly:
// commutative combines, so every lane ends with the same bits) -> CTA (warp 0 over the warps) ->
// cluster (warp 0 of every CTA reads the C CTA results from distributed shared memory and combines
// them with the same butterfly), so all CTAs of a cluster hold identical results and take
// identical branches. Inside a CTA only plain sums (all relative to one reference max per CTA)
// and (score, index) pairs travel; the cluster level merges sums with different reference maxima
// as an online softmax. Few fields per shuffle matter: reductions, not the passes over the row,
// are most of a kernel's time.
//
// entropy_max_kernel: H = log(s) - t / s with m = max x, s = sum exp(x - m), t = sum exp(x - m)(x - m)
//   (an element equal to m contributes exactly 1 and 0, so a row of -inf gives H = log V, as the
//   pure-JAX reference jaxlp.sampling.base.entropy_and_max does).
//
// sample_kernel<NT, ENTROPY>: per row a token at each of NT temperatures (NT = 1: sample; NT = 2
// with ENTROPY: entropy_sample, the two temperatures of an entropy-driven sampler, plus H and the
// max of the raw logits, so that ReSET reads each row once), each from softmax(y), y = x * inv_t,
// restricted by min-p and top-p, by Gumbel-max with the counter-based noise of
// jaxlp/sampling/noise.py (the same noise for every temperature):
//   1. The max of the raw logits and its first index (a greedy temperature, <= 1e-6, takes the
//      first argmax): over the row where needed (all temperatures greedy, min-p), else over the
//      CTA's share, which is enough to bound the noise of the CTA's tokens (see the kernel).
//   2. kept = (y - ymax >= log_min_p); S = sum over kept of e = exp(y - ymax); candidate c =
//      argmax over kept of y + g (ties to the smaller index). The exact g (two logarithms) is
//      computed only for tokens that can beat the max token's own score (see the kernel).
//   3. Top-p (p < 1): the nucleus is {i kept : mass of kept tokens with y > y_i is < p S}, an
//      upper set of y. Test c: A = mass of kept y > y_c. If A < p S, c is in the nucleus and,
//      being the argmax of y + g over a superset of it, is the argmax over the nucleus: done.
//      Otherwise c and everything at or below y_c is outside the nucleus: the next candidate is
//      the argmax over kept y > y_c (computed in the same pass); repeat. Each test passes with
//      probability >= p, so one or two passes are the rule; every failed test removes c, so the
//      loop ends. The result equals argmax over the nucleus of y + g: the same token as the
//      reference (jaxlp.sampling.base.sample_with_temperature on XLA), up to the order of float
//      sums at a mass exactly at p S.

#include <cooperative_groups.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "launch.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace cg = cooperative_groups;

namespace jaxlp_sampling {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kPortableCluster = 8;  // the largest vocabulary is 8 * kMaxChunk on every device
constexpr int kMaxCluster = 16;  // non-portable, used where the device can schedule it
constexpr int kMaxChunk = 48 * 1024;  // floats of a row per CTA (192 KiB of shared memory)
constexpr float kGreedyTemperature = 1e-6f;
constexpr float kGumbelMax = 16.6355f;  // largest noise value, -log(-log(1 - 2^-24)) (noise.GUMBEL_MAX)

// CTAs per row for a vocabulary of v: the fewest (a power of two <= max_cluster) giving each thread
// at most 8 elements, or max_cluster; each CTA's share `chunk` is a multiple of 4 (16-byte aligned
// copies); false if it exceeds kMaxChunk. Mirrored by sampling.py's layout().
inline bool layout(int64_t v, int max_cluster, int* cluster, int* chunk) {
  int c = 1;
  while (c < max_cluster && int64_t(c) * kThreads * 8 < v) c *= 2;
  const int64_t share = ((v + c - 1) / c + 3) / 4 * 4;
  *cluster = c;
  *chunk = static_cast<int>(share);
  return share <= kMaxChunk;
}

// Counter-based noise of jaxlp/sampling/noise.py (row keys from the step key's two words; per
// token u in (0, 1) from 23 hashed bits, g = -log(-log u).
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

__device__ __forceinline__ uint32_t noise_bits(uint32_t k0, uint32_t k1, uint32_t i) { return mix32(mix32(i + k0) ^ k1); }

__device__ __forceinline__ float gumbel_of_bits(uint32_t bits) {
  const float u = (static_cast<float>(bits >> 9) + 0.5f) * 1.1920928955078125e-07f;  // 2^-23
  return -logf(-logf(u));
}

__device__ __forceinline__ float gumbel(uint32_t k0, uint32_t k1, uint32_t i) { return gumbel_of_bits(noise_bits(k0, k1, i)); }

// A partial result: two sums a, b taken relative to a reference max m (a = sum exp(x - m),
// b = sum exp(x - m) (x - m): merged as an online softmax), and an argmax (score, index, y) with
// ties to the smaller index.
struct Partial {
  float m, a, b;
  float score;
  int idx;
  float y;
};

__device__ __forceinline__ Partial identity() { return {-INFINITY, 0.0f, 0.0f, -INFINITY, INT_MAX, 0.0f}; }

__device__ __forceinline__ void pick(Partial& p, float score, int idx, float y) {
  if (score > p.score || (score == p.score && idx < p.idx)) {
    p.score = score;
    p.idx = idx;
    p.y = y;
  }
}

// Rescale (a, b) from reference max m to M >= m; a part whose scale underflows contributes 0.
__device__ __forceinline__ void rescale(float& a, float& b, float m, float M) {
  const float f = expf(m - M);
  if (f > 0.0f) {
    b = f * (b + (m - M) * a);
    a = f * a;
  } else {
    a = b = 0.0f;
  }
}

// Commutative (both lanes of a shuffle pair compute the same bits), so reductions are deterministic.
__device__ __forceinline__ Partial combine(Partial p, const Partial& q) {
  if (p.m == q.m) {
    p.a += q.a;
    p.b += q.b;
  } else {
    const float M = fmaxf(p.m, q.m);
    float qa = q.a, qb = q.b;
    rescale(p.a, p.b, p.m, M);
    rescale(qa, qb, q.m, M);
    p.a += qa;
    p.b += qb;
    p.m = M;
  }
  pick(p, q.score, q.idx, q.y);
  return p;
}

__device__ __forceinline__ Partial warp_reduce(Partial p) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    Partial q;
    q.m = __shfl_xor_sync(0xffffffffu, p.m, off);
    q.a = __shfl_xor_sync(0xffffffffu, p.a, off);
    q.b = __shfl_xor_sync(0xffffffffu, p.b, off);
    q.score = __shfl_xor_sync(0xffffffffu, p.score, off);
    q.idx = __shfl_xor_sync(0xffffffffu, p.idx, off);
    q.y = __shfl_xor_sync(0xffffffffu, p.y, off);
    p = combine(p, q);
  }
  return p;
}

// N partials reduced together (one per sampling temperature, and the entropy's).
template <int N>
struct Group {
  Partial p[N];
};

template <int N>
__device__ __forceinline__ Group<N> identity_group() {
  Group<N> g;
#pragma unroll
  for (int k = 0; k < N; ++k) g.p[k] = identity();
  return g;
}

template <int N>
__device__ __forceinline__ Group<N> warp_reduce(Group<N> g) {
#pragma unroll
  for (int k = 0; k < N; ++k) g.p[k] = warp_reduce(g.p[k]);
  return g;
}

// Inside a CTA a thread contributes NS sums, all taken relative to reference maxima the whole CTA
// shares (so they add plainly), and NA argmax arguments (score, index; ties to the smaller index):
// a few shuffles per butterfly step. The CTA's result becomes a Group (with its reference maxima
// and the arguments' y) for the cluster-level combine.
template <int NS, int NA>
struct Light {
  float sum[NS > 0 ? NS : 1];
  float score[NA > 0 ? NA : 1];
  int idx[NA > 0 ? NA : 1];
};

template <int NS, int NA>
__device__ __forceinline__ Light<NS, NA> light_identity() {
  Light<NS, NA> l;
#pragma unroll
  for (int k = 0; k < NS; ++k) l.sum[k] = 0.0f;
#pragma unroll
  for (int k = 0; k < NA; ++k) {
    l.score[k] = -INFINITY;
    l.idx[k] = INT_MAX;
  }
  return l;
}

template <int NS, int NA>
__device__ __forceinline__ void light_pick(Light<NS, NA>& l, int k, float score, int idx) {
  if (score > l.score[k] || (score == l.score[k] && idx < l.idx[k])) {
    l.score[k] = score;
    l.idx[k] = idx;
  }
}

template <int NS, int NA>
__device__ __forceinline__ Light<NS, NA> warp_reduce(Light<NS, NA> l) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
    for (int k = 0; k < NS; ++k) l.sum[k] += __shfl_xor_sync(0xffffffffu, l.sum[k], off);
#pragma unroll
    for (int k = 0; k < NA; ++k) {
      const float score = __shfl_xor_sync(0xffffffffu, l.score[k], off);
      const int idx = __shfl_xor_sync(0xffffffffu, l.idx[k], off);
      light_pick(l, k, score, idx);
    }
  }
  return l;
}

template <int N, int NS, int NA>
struct Shared {
  Light<NS, NA> warps[kWarps];
  Group<N> slot[2];  // this CTA's result, double-buffered across cluster reductions
  Group<N> result;
};

// Reduce l over the CTA, turn the CTA's result into a Group with to_group, then (cluster_size > 1)
// combine the Groups of the cluster. All threads of all CTAs must make the same sequence of
// cluster reductions; `round` counts them. Consecutive cluster reductions use different slots
// (another Shared, or the other parity), and the readers of a slot are done before the next-but-one
// reduction writes it (they read it before arriving at the barrier in between).
template <int N, int NS, int NA, typename ToGroup>
__device__ Group<N> reduce(Light<NS, NA> l, Shared<N, NS, NA>& sh, int& round, int cluster_size, ToGroup to_group) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  l = warp_reduce(l);
  if (lane == 0) sh.warps[warp] = l;
  __syncthreads();
  Group<N>* slot = &sh.slot[round & 1];
  if (cluster_size > 1) ++round;
  if (warp == 0) {
    const Light<NS, NA> q =
        warp_reduce(lane < static_cast<int>(blockDim.x >> 5) ? sh.warps[lane] : light_identity<NS, NA>());
    if (lane == 0) *(cluster_size == 1 ? &sh.result : slot) = to_group(q);
  }
  if (cluster_size > 1) {
    cg::this_cluster().sync();
    if (warp == 0) {
      Group<N> q = identity_group<N>();
      if (lane < cluster_size) q = *cg::this_cluster().map_shared_rank(slot, lane);
      q = warp_reduce(q);
      if (lane == 0) sh.result = q;
    }
  }
  __syncthreads();
  return sh.result;
}

// Keep this CTA's shared memory alive until every CTA of the cluster has read it.
__device__ __forceinline__ void finish(int cluster_size) {
  if (cluster_size > 1) cg::this_cluster().sync();
}

// This CTA's share of a row: elements [base, base + n) of the row, n <= chunk.
struct RowSlice {
  int base, n;
};

__device__ __forceinline__ RowSlice row_slice(int v, int chunk, int cluster_size) {
  const int rank = cluster_size > 1 ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
  const int base = rank * chunk;
  return {base, max(0, min(chunk, v - base))};
}

extern __shared__ float4 row_smem[];  // the CTA's share of the row, [chunk / 4]

// Copy row[base + j] into x[j] (all copies in flight at once) and return the argmax (first index)
// of this thread's elements.
__device__ __forceinline__ Light<0, 1> load_row(float* x, const float* row, const RowSlice& s) {
  const float* src = row + s.base;
  if ((reinterpret_cast<uintptr_t>(src) & 15) == 0 && (s.n & 3) == 0) {
    for (int j = threadIdx.x; j < s.n / 4; j += blockDim.x) __pipeline_memcpy_async(x + 4 * j, src + 4 * j, 16);
  } else {
    for (int j = threadIdx.x; j < s.n; j += blockDim.x) __pipeline_memcpy_async(x + j, src + j, 4);
  }
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();
  Light<0, 1> l = light_identity<0, 1>();
  for (int j = threadIdx.x; j < s.n; j += blockDim.x) light_pick(l, 0, x[j], s.base + j);
  return l;
}

// The Group of a CTA's argmax of the raw logits x (y = x).
__device__ __forceinline__ auto argmax_group(const float* x, const RowSlice& s) {
  return [x, s](const Light<0, 1>& q) {
    Group<1> g = identity_group<1>();
    g.p[0].score = q.score[0];
    g.p[0].idx = q.idx[0];
    g.p[0].y = q.idx[0] == INT_MAX ? 0.0f : x[q.idx[0] - s.base];
    return g;
  };
}

// x's terms of the entropy sums relative to the reference max m: s += e, t += e (x - m) with
// e = exp(x - m); an element equal to m adds exactly 1 and 0 (so a row of -inf gives H = log V).
__device__ __forceinline__ void add_entropy_terms(float x, float m, float& s, float& t) {
  const float d = x == m ? 0.0f : x - m;
  const float e = expf(d);
  if (e > 0.0f) {
    s += e;
    t += e * d;
  }
}

__global__ void __launch_bounds__(kThreads) entropy_max_kernel(const float* logits, float* entropy, float* maximum,
                                                               int v, int chunk, int cluster_size) {
  __shared__ Shared<1, 0, 1> sh_max;
  __shared__ Shared<1, 2, 0> sh_sums;
  int round = 0;
  const int row = blockIdx.y;
  const RowSlice s = row_slice(v, chunk, cluster_size);
  float* x = reinterpret_cast<float*>(row_smem);
  // The CTA's max m, then (s, t) relative to it, then one online-softmax combine over the cluster.
  const float m = reduce(load_row(x, logits + static_cast<size_t>(row) * v, s), sh_max, round, 1,
                         argmax_group(x, s)).p[0].score;
  Light<2, 0> l = light_identity<2, 0>();
  for (int j = threadIdx.x; j < s.n; j += blockDim.x) add_entropy_terms(x[j], m, l.sum[0], l.sum[1]);
  const Partial r = reduce(l, sh_sums, round, cluster_size, [m](const Light<2, 0>& q) {
    Group<1> g = identity_group<1>();
    g.p[0].m = m;
    g.p[0].a = q.sum[0];
    g.p[0].b = q.sum[1];
    return g;
  }).p[0];
  if (s.base == 0 && threadIdx.x == 0) {
    entropy[row] = logf(r.a) - r.b / r.a;
    maximum[row] = r.m;
  }
  finish(cluster_size);
}

struct SampleParams {
  const float* logits;       // [B, V]
  const float* temperature;  // [B, NT]: <= 1e-6 means the argmax of the logits
  const float* inv_t;        // [B, NT]: the scale of y (1 for greedy)
  const float* top_p;        // [B]: >= 1 keeps everything
  const float* log_min_p;    // [B] (-inf: no min-p), or null: no min-p
  const uint32_t* words;     // [2]: the step key's words (noise.key_words)
  int32_t* tokens;           // [B, NT]
  float* entropy;            // [B] (ENTROPY)
  float* maximum;            // [B] (ENTROPY)
  int v, chunk, cluster_size;
};

// One row per cluster: a token for each of NT temperatures (same noise), and with ENTROPY the
// entropy and max of the raw logits, from one read of the row (steps in the file header).
template <int NT, bool ENTROPY>
__global__ void __launch_bounds__(kThreads) sample_kernel(SampleParams p) {
  constexpr int N = NT + (ENTROPY ? 1 : 0);    // partials: the temperatures', then the entropy's
  constexpr int NS = NT + (ENTROPY ? 2 : 0);   // sums: each temperature's kept mass, then s and t
  __shared__ Shared<1, 0, 1> sh_top;
  __shared__ Shared<N, NS, NT> sh_sample;
  __shared__ Shared<NT, NT, NT> sh_above;
  int round = 0;
  const int row = blockIdx.y;
  const RowSlice s = row_slice(p.v, p.chunk, p.cluster_size);
  const bool write = s.base == 0 && threadIdx.x == 0;
  float* x = reinterpret_cast<float*>(row_smem);

  // 1. This thread's max of the raw logits and its first index.
  const Light<0, 1> mine = load_row(x, p.logits + static_cast<size_t>(row) * p.v, s);
  bool greedy[NT];
  float inv[NT];
  bool all_greedy = true;
#pragma unroll
  for (int k = 0; k < NT; ++k) {
    greedy[k] = p.temperature[row * NT + k] <= kGreedyTemperature;
    inv[k] = p.inv_t[row * NT + k];
    all_greedy &= greedy[k];
  }
  if (all_greedy && !ENTROPY) {
    const Partial top = reduce(mine, sh_top, round, p.cluster_size, argmax_group(x, s)).p[0];
    if (write)
      for (int k = 0; k < NT; ++k) p.tokens[row * NT + k] = top.idx;
    return finish(p.cluster_size);
  }
  // Without min-p every token is kept and the max of this CTA's share is enough (one cluster
  // reduction less); min-p needs the row's max to decide what it keeps.
  const float log_min_p = p.log_min_p ? p.log_min_p[row] : -INFINITY;
  const bool min_p = log_min_p > -INFINITY;
  const Partial top = reduce(mine, sh_top, round, min_p ? p.cluster_size : 1, argmax_group(x, s)).p[0];
  const uint32_t k0 = mix32(p.words[0] ^ mix32(static_cast<uint32_t>(row) * 0x9e3779b9u + 0x7f4a7c15u));
  const uint32_t k1 = mix32(p.words[1] + mix32(static_cast<uint32_t>(row) ^ 0x85ebca6bu));  // noise.row_keys
  const float g_top = gumbel(k0, k1, top.idx);

  // Per temperature: y = x * inv, the top token's y (the max of y: scaling is monotone), the
  // reference max m of the sums (an infinite max is replaced so that exp stays meaningful), and
  // the noise filter. The top token is kept, so the winner's score (and that of the winner among
  // this CTA's tokens, when top is this CTA's max) is at least top's score B. A token can only
  // reach B if g > B - y: since g <= kGumbelMax, not if y < B - kGumbelMax; and since
  // -log u >= 1 - u, not if 1 - u >= exp(y - B) (g > d needs -log u < exp(-d)). Both tests are
  // loosened by a margin far above float rounding, so no possible winner is skipped; the exact g
  // (two logarithms) is computed for the few tokens that pass. Greedy temperatures take the
  // first argmax: no noise, no filter beyond y >= the max.
  float ytop[NT], m[NT], bound[NT], band[NT], margin[NT];
  bool filter[NT];
#pragma unroll
  for (int k = 0; k < NT; ++k) {
    ytop[k] = top.score * inv[k];
    m[k] = isfinite(ytop[k]) ? ytop[k] : (ytop[k] > 0.0f ? FLT_MAX : 0.0f);
    const bool top_kept = !min_p || ytop[k] - ytop[k] >= log_min_p;
    bound[k] = greedy[k] ? ytop[k] : (top_kept ? ytop[k] + g_top : -INFINITY);
    filter[k] = !greedy[k] && isfinite(bound[k]);
    margin[k] = 1e-3f + 1e-6f * fabsf(ytop[k]);
    band[k] = bound[k] - kGumbelMax - margin[k];
  }
  const auto kept = [&](int k, float yj) { return !min_p || yj - ytop[k] >= log_min_p; };
  const auto consider = [&](int k, auto& q, float yj, int i) {
    if (greedy[k]) {
      if (yj >= bound[k]) light_pick(q, k, yj, i);
      return;
    }
    if (filter[k] && !(yj >= band[k])) return;
    const uint32_t bits = noise_bits(k0, k1, static_cast<uint32_t>(i));
    const float one_minus_u = (static_cast<float>((1u << 23) - (bits >> 9)) - 0.5f) * 1.1920928955078125e-07f;
    if (filter[k] && !(one_minus_u < __expf(yj - bound[k] + margin[k]))) return;
    light_pick(q, k, yj + gumbel_of_bits(bits), i);
  };
  // The Group of a CTA's result: sums with their reference maxima, arguments with their y.
  const auto group = [&](const auto& q, const float* ref) {
    Group<N> g = identity_group<N>();
#pragma unroll
    for (int k = 0; k < NT; ++k) {
      g.p[k].m = ref[k];
      g.p[k].a = q.sum[k];
      g.p[k].score = q.score[k];
      g.p[k].idx = q.idx[k];
      g.p[k].y = q.idx[k] == INT_MAX ? 0.0f : x[q.idx[k] - s.base] * inv[k];
    }
    return g;
  };

  // 2. Per temperature the kept mass (relative to m) and the Gumbel-max candidate over every kept
  // token; with ENTROPY the raw logits' (m, s, t).
  Light<NS, NT> part = light_identity<NS, NT>();
  for (int j = threadIdx.x; j < s.n; j += blockDim.x) {
    const float xj = x[j];
    const int i = s.base + j;
    if constexpr (ENTROPY) add_entropy_terms(xj, top.score, part.sum[NT], part.sum[NT + 1]);
#pragma unroll
    for (int k = 0; k < NT; ++k) {
      const float yj = xj * inv[k];
      if (!kept(k, yj)) continue;
      if (!greedy[k]) part.sum[k] += __expf(yj - m[k]);
      consider(k, part, yj, i);
    }
  }
  // r.p[k].m: the row's reference max
  const Group<N> r = reduce(part, sh_sample, round, p.cluster_size, [&](const Light<NS, NT>& q) {
    Group<N> g = group(q, m);
    if constexpr (ENTROPY) {
      g.p[NT].m = top.score;
      g.p[NT].a = q.sum[NT];
      g.p[NT].b = q.sum[NT + 1];
    }
    return g;
  });

  // 3. Top-p: test each candidate; find the next one above it in the same pass (B still bounds
  // it: top is above any candidate that can fail the test, or the CTA holds no token above it).
  Partial cand[NT];
  float target[NT];
  bool done[NT];
  bool all_done = true;
  const float top_p = p.top_p[row];
#pragma unroll
  for (int k = 0; k < NT; ++k) {
    cand[k] = r.p[k];
    target[k] = top_p * cand[k].a;
    const float row_max = min_p ? ytop[k] : cand[k].m;  // equal to the row's max of y when finite
    // A candidate at the max has no mass above it; nothing kept (min-p with a row of -inf or NaN)
    // falls back to the argmax.
    if (cand[k].idx == INT_MAX) cand[k].idx = top.idx;
    done[k] = greedy[k] || r.p[k].idx == INT_MAX || top_p >= 1.0f || !(cand[k].y < row_max);
    all_done &= done[k];
  }
  while (!all_done) {
    Light<NT, NT> part_above = light_identity<NT, NT>();
    float ref[NT];
#pragma unroll
    for (int k = 0; k < NT; ++k) ref[k] = cand[k].m;
    for (int j = threadIdx.x; j < s.n; j += blockDim.x) {
      const float xj = x[j];
#pragma unroll
      for (int k = 0; k < NT; ++k) {
        const float yj = xj * inv[k];
        if (done[k] || !(yj > cand[k].y) || !kept(k, yj)) continue;
        part_above.sum[k] += __expf(yj - ref[k]);
        consider(k, part_above, yj, s.base + j);
      }
    }
    const Group<NT> above = reduce(part_above, sh_above, round, p.cluster_size, [&](const Light<NT, NT>& q) {
      const Group<N> g = group(q, ref);
      Group<NT> h;
#pragma unroll
      for (int k = 0; k < NT; ++k) h.p[k] = g.p[k];
      return h;
    });
    all_done = true;
#pragma unroll
    for (int k = 0; k < NT; ++k) {
      if (done[k]) continue;
      if (above.p[k].a < target[k] || above.p[k].idx == INT_MAX) {
        done[k] = true;
      } else {
        cand[k].score = above.p[k].score;
        cand[k].idx = above.p[k].idx;
        cand[k].y = above.p[k].y;
        all_done = false;
      }
    }
  }
  if (write) {
#pragma unroll
    for (int k = 0; k < NT; ++k) p.tokens[row * NT + k] = cand[k].idx;
    if constexpr (ENTROPY) {
      const Partial& h = r.p[NT];
      p.entropy[row] = logf(h.a) - h.b / h.a;
      p.maximum[row] = h.m;
    }
  }
  finish(p.cluster_size);
}

// ---------------------------------------------------------------------------------------------
// Host side

inline ffi::Error bad(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp sampling: " + msg);
}

// Rows and vocabulary of logits [B, V], with the layout for V on this device.
inline ffi::Error row_shape(const ffi::Buffer<ffi::F32>& logits, int max_cluster, int64_t* b, int64_t* v,
                            int* cluster, int* chunk) {
  const auto d = logits.dimensions();
  if (d.size() != 2) return bad("logits must be 2-D [B, V]");
  *b = d[0];
  *v = d[1];
  if (*b < 1 || *b > 65535) return bad("batch size must be in [1, 65535], got " + std::to_string(*b));
  const int64_t max_vocab = int64_t(kPortableCluster) * kMaxChunk;
  if (*v < 1 || *v > max_vocab || !layout(*v, max_cluster, cluster, chunk))
    return bad("vocabulary size must be in [1, " + std::to_string(max_vocab) + "], got " + std::to_string(*v));
  return ffi::Error::Success();
}

// Per kernel and device, once: raise the dynamic shared memory limit to kMaxChunk floats and find
// the largest cluster size the device can schedule (16 where it can, else 8).
inline cudaError_t prepare(const void* kernel, int* max_cluster) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> prepared;
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = prepared.find({kernel, device}); it != prepared.end()) {
    *max_cluster = it->second;
    return cudaSuccess;
  }
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(sizeof(float) * kMaxChunk));
  if (e != cudaSuccess) return e;
  int clusters = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(kMaxCluster);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = sizeof(float) * (int64_t(kPortableCluster) * kMaxChunk / kMaxCluster);
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = kMaxCluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) clusters = 0;
  }
  cudaGetLastError();  // a refused query leaves no error behind
  *max_cluster = clusters > 0 ? kMaxCluster : kPortableCluster;
  prepared[{kernel, device}] = *max_cluster;
  return cudaSuccess;
}

// One cluster of `cluster` CTAs per row, `chunk` floats of dynamic shared memory each.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_rows(void (*kernel)(KernelArgs...), int rows, int cluster, int chunk, cudaStream_t stream,
                        Args&&... args) {
  return jaxlp::launch_kernel(kernel, dim3(cluster, rows), dim3(kThreads), sizeof(float) * static_cast<size_t>(chunk),
                              stream, cluster, false, std::forward<Args>(args)...);
}

inline ffi::Error launched(cudaError_t e, const char* what) {
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxlp sampling ") + what + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error EntropyMaxImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> logits, ffi::Result<ffi::Buffer<ffi::F32>> entropy,
                          ffi::Result<ffi::Buffer<ffi::F32>> maximum) {
  int64_t b = 0, v = 0;
  int max_cluster = 0, cluster = 0, chunk = 0;
  if (const cudaError_t e = prepare(reinterpret_cast<const void*>(entropy_max_kernel), &max_cluster); e != cudaSuccess)
    return launched(e, "entropy setup");
  if (auto err = row_shape(logits, max_cluster, &b, &v, &cluster, &chunk); err.failure()) return err;
  if (entropy->element_count() != b || maximum->element_count() != b) return bad("outputs must have B elements");
  return launched(launch_rows(entropy_max_kernel, static_cast<int>(b), cluster, chunk, stream, logits.typed_data(),
                              entropy->typed_data(), maximum->typed_data(), static_cast<int>(v), chunk, cluster),
                  "entropy launch");
}

template <int NT, bool ENTROPY>
ffi::Error launch_sample(cudaStream_t stream, const ffi::Buffer<ffi::F32>& logits, SampleParams p, int64_t* rows) {
  const void* kernel = reinterpret_cast<const void*>(sample_kernel<NT, ENTROPY>);
  int64_t b = 0, v = 0;
  int max_cluster = 0;
  if (const cudaError_t e = prepare(kernel, &max_cluster); e != cudaSuccess) return launched(e, "sample setup");
  if (auto err = row_shape(logits, max_cluster, &b, &v, &p.cluster_size, &p.chunk); err.failure()) return err;
  p.v = static_cast<int>(v);
  *rows = b;
  return launched(launch_rows(sample_kernel<NT, ENTROPY>, static_cast<int>(b), p.cluster_size, p.chunk, stream, p),
                  "sample launch");
}

ffi::Error SampleImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                      ffi::Buffer<ffi::F32> inv_t, ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::F32> log_min_p,
                      ffi::Buffer<ffi::U32> words, ffi::Result<ffi::Buffer<ffi::S32>> tokens) {
  if (logits.dimensions().size() != 2) return bad("logits must be 2-D [B, V]");
  const int64_t b = logits.dimensions()[0];
  for (const auto* a : {&temperature, &inv_t, &top_p, &log_min_p})
    if (a->element_count() != b) return bad("temperature, inv_t, top_p and log_min_p must have B elements");
  if (words.element_count() != 2) return bad("key words must be [2]");
  if (tokens->element_count() != b) return bad("tokens must have B elements");
  const SampleParams p{logits.typed_data(), temperature.typed_data(), inv_t.typed_data(), top_p.typed_data(),
                       log_min_p.typed_data(), words.typed_data(), tokens->typed_data(), nullptr, nullptr, 0, 0, 0};
  int64_t rows = 0;
  return launch_sample<1, false>(stream, logits, p, &rows);
}

ffi::Error EntropySampleImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                             ffi::Buffer<ffi::F32> inv_t, ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::U32> words,
                             ffi::Result<ffi::Buffer<ffi::S32>> tokens, ffi::Result<ffi::Buffer<ffi::F32>> entropy,
                             ffi::Result<ffi::Buffer<ffi::F32>> maximum) {
  if (logits.dimensions().size() != 2) return bad("logits must be 2-D [B, V]");
  const int64_t b = logits.dimensions()[0];
  if (temperature.element_count() != 2 * b || inv_t.element_count() != 2 * b)
    return bad("temperature and inv_t must be [B, 2]");
  if (top_p.element_count() != b) return bad("top_p must have B elements");
  if (words.element_count() != 2) return bad("key words must be [2]");
  if (tokens->element_count() != 2 * b) return bad("tokens must be [B, 2]");
  if (entropy->element_count() != b || maximum->element_count() != b) return bad("entropy and max must have B elements");
  const SampleParams p{logits.typed_data(), temperature.typed_data(), inv_t.typed_data(), top_p.typed_data(),
                       nullptr, words.typed_data(), tokens->typed_data(), entropy->typed_data(),
                       maximum->typed_data(), 0, 0, 0};
  int64_t rows = 0;
  return launch_sample<2, true>(stream, logits, p, &rows);
}

}  // namespace jaxlp_sampling

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpEntropyMax, jaxlp_sampling::EntropyMaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [B, V]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // entropy [B]
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // max [B]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpSample, jaxlp_sampling::SampleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [B, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // temperature [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // inv_t [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // top_p [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // log_min_p [B]
                                  .Arg<ffi::Buffer<ffi::U32>>()   // key words [2]
                                  .Ret<ffi::Buffer<ffi::S32>>(),  // tokens [B]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpEntropySample, jaxlp_sampling::EntropySampleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [B, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // temperature [B, 2]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // inv_t [B, 2]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // top_p [B]
                                  .Arg<ffi::Buffer<ffi::U32>>()   // key words [2]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // tokens [B, 2]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // entropy [B]
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // max [B]
                              {ffi::Traits::kCmdBufferCompatible});
