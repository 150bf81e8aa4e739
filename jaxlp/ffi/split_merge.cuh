// Flash-decoding's split merge on the GPU, launched by the decode-attention handlers after their
// kernel (one launch instead of XLA's two or three fusions of jaxlp.attention.reference.merge_splits,
// the reference it is tested against). For each row r of the [R, S, G, D] partials (R = B x KVH)
// and query g: M = max_s m[r, s, g] (natural log units; an empty split has m = -inf, l = 0, o = 0),
// w_s = exp(m_s - M) (0 where m_s = -inf; M taken as 0 where every split is empty), den = sum_s
// l_s w_s, out[r, g, :] = sum_s w_s o[r, s, g, :] / den (0 where den = 0); m_all = M.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

namespace jaxlp {

constexpr int kMergeWarps = 8;
constexpr int kMergeMaxD = 256;  // head_dim: two float4 of channels per lane

// One split's partials of a (row, query), at offset `at` of m and l (rows of d channels of o): its
// weight w = exp(m - safe) (0 for an empty split), den += l w, and this lane's channels (float4 lane
// and lane + 32, where below d / 4) of acc += w o.
__device__ __forceinline__ void add_split(const float* __restrict__ o, const float* __restrict__ m,
                                          const float* __restrict__ l, size_t at, int d, float safe, int lane,
                                          float4 (&acc)[2], float& den) {
  const float ms = m[at];
  const float w = ms == -INFINITY ? 0.f : expf(ms - safe);
  den += l[at] * w;
  const float4* src = reinterpret_cast<const float4*>(o + at * d);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (lane + 32 * k < d / 4) {
      const float4 x = src[lane + 32 * k];
      acc[k].x += w * x.x;
      acc[k].y += w * x.y;
      acc[k].z += w * x.z;
      acc[k].w += w * x.w;
    }
  }
}

// One CTA of 8 warps per (row r, query g). The data is small and in L2 (the attention kernel just
// wrote it): the cost is latency, so every warp takes every 8th split and a lane 4 or 8 channels
// (float4 loads, all of a warp's splits in flight together), in two passes (the splits' maximum,
// then the weighted sums), each ending in a reduction over the warps through shared memory.
__global__ void __launch_bounds__(kMergeWarps * 32) split_merge_kernel(
    const float* __restrict__ o, const float* __restrict__ m, const float* __restrict__ l, float* __restrict__ out,
    float* __restrict__ m_all, float* __restrict__ den_all, int splits, int g, int d) {
  __shared__ float red[2][kMergeWarps];                  // per warp: the max, then the den part
  __shared__ __align__(16) float part[kMergeWarps][kMergeMaxD];  // per warp: its weighted sum of o
  const int r = blockIdx.x, gi = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n4 = d / 4;
  const size_t ml = static_cast<size_t>(r) * splits * g + gi;  // m, l of split s at ml + s g
  float mx = -INFINITY;
#pragma unroll 4
  for (int s = warp; s < splits; s += kMergeWarps) mx = fmaxf(mx, m[ml + static_cast<size_t>(s) * g]);
  if (lane == 0) red[0][warp] = mx;
  __syncthreads();
  mx = red[0][0];
#pragma unroll
  for (int w = 1; w < kMergeWarps; ++w) mx = fmaxf(mx, red[0][w]);
  const float safe = mx == -INFINITY ? 0.f : mx;
  float4 acc[2] = {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
  float den = 0.f;
#pragma unroll 4
  for (int s = warp; s < splits; s += kMergeWarps)
    add_split(o, m, l, ml + static_cast<size_t>(s) * g, d, safe, lane, acc, den);
#pragma unroll
  for (int k = 0; k < 2; ++k)
    if (lane + 32 * k < n4) reinterpret_cast<float4*>(part[warp])[lane + 32 * k] = acc[k];
  if (lane == 0) red[1][warp] = den;
  __syncthreads();
  den = 0.f;
#pragma unroll
  for (int w = 0; w < kMergeWarps; ++w) den += red[1][w];
  const int c = threadIdx.x;
  if (c < d) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kMergeWarps; ++w) sum += part[w][c];
    out[(static_cast<size_t>(r) * g + gi) * d + c] = den > 0.f ? sum / den : 0.f;
  }
  if (c == 0) {
    m_all[static_cast<size_t>(r) * g + gi] = mx;
    den_all[static_cast<size_t>(r) * g + gi] = den;
  }
}

// The same merge with one warp per (row r, query g), 8 per CTA, for a few splits (the grid's rows x
// queries CTAs of split_merge_kernel then mostly idle warps: 2 splits at 64 rows x 8 KV heads, 2,048
// CTAs of 256 threads). A lane takes 4 or 8 channels (float4) and every split in order; the maximum
// over the splits by shuffles (lane s holds split s's m, s < 32: the caller keeps splits <= 32).
__global__ void __launch_bounds__(kMergeWarps * 32) split_merge_queries_kernel(
    const float* __restrict__ o, const float* __restrict__ m, const float* __restrict__ l, float* __restrict__ out,
    float* __restrict__ m_all, float* __restrict__ den_all, int pairs, int splits, int g, int d) {
  const int pair = blockIdx.x * kMergeWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31, n4 = d / 4;
  if (pair >= pairs) return;
  const int r = pair / g, gi = pair % g;
  const size_t ml = static_cast<size_t>(r) * splits * g + gi;  // m, l of split s at ml + s g
  float mx = lane < splits ? m[ml + static_cast<size_t>(lane) * g] : -INFINITY;
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
  const float safe = mx == -INFINITY ? 0.f : mx;
  float4 acc[2] = {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
  float den = 0.f;
#pragma unroll 4
  for (int s = 0; s < splits; ++s) add_split(o, m, l, ml + static_cast<size_t>(s) * g, d, safe, lane, acc, den);
  float4* dst = reinterpret_cast<float4*>(out + (static_cast<size_t>(r) * g + gi) * d);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (lane + 32 * k < n4) {
      const float4 a = acc[k];
      dst[lane + 32 * k] = den > 0.f ? make_float4(a.x / den, a.y / den, a.z / den, a.w / den)
                                     : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  if (lane == 0) {
    m_all[static_cast<size_t>(r) * g + gi] = mx;
    den_all[static_cast<size_t>(r) * g + gi] = den;
  }
}

// Null if the merged outputs a handler was given hold out [rows, g, d] and m_all, den [rows, g]
// (their element counts), else the error message.
inline const char* merged_outputs_error(long out_count, long m_count, long den_count, long rows, long g, long d) {
  if (out_count != rows * g * d || m_count != rows * g || den_count != rows * g)
    return "merged outputs must be out [B, KVH, G, D], m and l [B, KVH, G]";
  return nullptr;
}

// The merge of `rows` rows' partials o [rows, splits, g, d], m, l [rows, splits, g] into out
// [rows, g, d], m_all, den [rows, g]: split_merge_queries_kernel where splits <= few_splits (at most
// 32), else split_merge_kernel. The caller checks the bounds: d a multiple of 4 up to kMergeMaxD,
// g < 65536.
inline cudaError_t split_merge(cudaStream_t stream, const float* o, const float* m, const float* l, float* out,
                               float* m_all, float* den, int rows, int splits, int g, int d, int few_splits = 0) {
  if (rows == 0 || g == 0) return cudaSuccess;
  if (splits <= few_splits && splits <= 32) {
    const int pairs = rows * g;
    split_merge_queries_kernel<<<(pairs + kMergeWarps - 1) / kMergeWarps, kMergeWarps * 32, 0, stream>>>(
        o, m, l, out, m_all, den, pairs, splits, g, d);
  } else {
    split_merge_kernel<<<dim3(rows, g), kMergeWarps * 32, 0, stream>>>(o, m, l, out, m_all, den, splits, g, d);
  }
  return cudaGetLastError();
}

}  // namespace jaxlp
