// The end of jaxlp's split-K GEMVs on mma.sync (nestedfp_gemv.cu, fireq.cu): a CTA's warps add
// their accumulator fragments through shared memory, then a row block's K splits -- one
// thread-block cluster of `splits` CTAs -- add theirs in rank 0's shared memory through
// distributed shared memory, in rank order (deterministic); the kernel then writes the product
// in the output's dtype. One kernel per product, nothing in global memory but the output. Host
// side: the output's checks and its element type as a C++ type.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace jaxlp {

constexpr int kMaxClusterSplits = 8;  // the portable cluster size

template <typename TOut>
__device__ __forceinline__ TOut to_out(float v) {
  if constexpr (std::is_same_v<TOut, __half>) {
    return __float2half_rn(v);
  } else if constexpr (std::is_same_v<TOut, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return v;
  }
}

// The shared memory of split_sums: the CTA's warps' fragments, and (rank 0's) the cluster's CTAs'.
template <int kWarps, int kN>
struct SplitSums {
  float warps[kWarps][32][kN];
  float ctas[kMaxClusterSplits][32][kN];
};

// c: this thread's kN accumulators (lane `lane` of warp `warp`), every thread of the CTA calling.
// Returns true where c then holds the row block's sums (warp 0 of the cluster's rank 0); the other
// threads are done. The grid's x is the split (cluster rank), `splits` CTAs per cluster.
template <int kWarps, int kN>
__device__ __forceinline__ bool split_sums(float (&c)[kN], SplitSums<kWarps, kN>& sm, int warp, int lane,
                                           int splits) {
#pragma unroll
  for (int i = 0; i < kN; ++i) sm.warps[warp][lane][i] = c[i];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      float acc = 0.f;
#pragma unroll
      for (int v = 0; v < kWarps; ++v) acc += sm.warps[v][lane][i];
      c[i] = acc;
    }
  }
  if (splits == 1) return warp == 0;
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const unsigned rank = cluster.block_rank();
  if (warp == 0) {
    float* slot = cluster.map_shared_rank(&sm.ctas[rank][lane][0], 0);
#pragma unroll
    for (int i = 0; i < kN; ++i) slot[i] = c[i];
  }
  cluster.sync();
  if (rank != 0 || warp != 0) return false;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    float acc = 0.f;
    for (int r = 0; r < splits; ++r) acc += sm.ctas[r][lane][i];
    c[i] = acc;
  }
  return true;
}

// Host side: why `out` ([M, N]) and `splits` do not suit these GEMVs, or nullptr.
inline const char* output_error(xla::ffi::Result<xla::ffi::AnyBuffer>& out, int64_t m, int64_t n, int32_t splits) {
  using xla::ffi::DataType;
  auto od = out->dimensions();
  const DataType t = out->element_type();
  if (od.size() != 2 || od[0] != m || od[1] != n || (t != DataType::F32 && t != DataType::F16 && t != DataType::BF16))
    return "out must be [M, N] in float32, float16 or bfloat16";
  if (splits < 1 || splits > kMaxClusterSplits) return "splits must be 1 to 8";
  if (n / 16 > 65535) return "N must be at most 16 * 65535";
  return nullptr;
}

// f(TOut{}) with TOut the C++ type of the output's dtype (float32, float16 or bfloat16).
template <typename F>
cudaError_t with_out_type(xla::ffi::DataType t, F&& f) {
  if (t == xla::ffi::DataType::F16) return f(__half{});
  if (t == xla::ffi::DataType::BF16) return f(__nv_bfloat16{});
  return f(float{});
}

}  // namespace jaxlp
