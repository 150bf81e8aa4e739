// FP8 x FP8 GEMM with per-token and per-channel scales on Hopper tensor cores, through CUTLASS 3
// (XLA FFI custom call, sm_90a); Python side: jaxlp/ffi/cutlass_gemm.py.
//
//   y[m, n] = round_out((sum_k x8[m, k] * w8[n, k]) * token_scale[m] * channel_scale[n])
//
// x8 [M, K] and w8 [N, K] float8_e4m3fn (both K-major: the TN layout FP8 WGMMA needs), the scales
// float32, y [M, N] bfloat16 or float16, one rounding (round to nearest even) after both products,
// which are taken in float32 in that order (jaxlp.pallas.fp8_matmul.reference's math).
//
// The kernels are CUTLASS's SM90 warp-specialized TMA GEMMs (a producer warp issuing TMA loads
// into a ring of shared-memory stages, consumer warpgroups issuing WGMMA on both operands from
// shared memory, a persistent or stream-K tile scheduler) with the scales as an epilogue visitor
// tree: the token scale a column broadcast (one value per output row), the channel scale a row
// broadcast. Schedules (the `dispatch` table): "cooperative" (two consumer warpgroups split each
// output tile) and "pingpong" (each consumer warpgroup owns whole tiles and the two alternate
// between MMA and epilogue, which hides the epilogue). Promoted schedules add the FP8 WGMMA sums of
// each `promote_k` of K into float32 registers (CUTLASS's mma_promotion_interval, in WGMMAs of K
// 32), because the tensor cores' own FP8 accumulation keeps fewer bits than float32; the "Fast"
// schedules accumulate in the tensor cores over the whole K (FP8FastAccum), faster, less exact.
// Stream-K splits the K loop of tiles across CTAs where the tiles alone would not fill the GPU
// (its partial sums go through a workspace from XLA's scratch allocator).
//
// Shape rules (CUTLASS's TMA alignment, checked here and in Python): K a multiple of 16 (16-byte
// rows of FP8), N a multiple of 8 (16-byte rows of the 16-bit output); M any >= 1. K and M tails
// inside a tile are zero-filled by TMA.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

// XLA's FFI headers first: CUTLASS turns -Wmissing-field-initializers into an error for what follows.
#include "xla/ffi/api/ffi.h"
//
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "cutlass_run.cuh"

namespace ffi = xla::ffi;

namespace jaxlp_cutlass_fp8 {

using namespace cute;

// A schedule: the kernel's mainloop schedule with its epilogue's.
struct Pingpong {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};
struct PingpongFast {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};
struct Cooperative {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
struct CooperativeFast {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
using cutlass::gemm::PersistentScheduler;
using cutlass::gemm::StreamKScheduler;

template <class ElementOut, class Schedule, int kTileM, int kTileN, int kClusterM, int kClusterN, class Scheduler>
struct Fp8Gemm {
  using TileShape = Shape<Int<kTileM>, Int<kTileN>, _128>;
  using ClusterShape = Shape<Int<kClusterM>, Int<kClusterN>, _1>;
  using ElementIn = cutlass::float_e4m3_t;
  using LayoutA = cutlass::layout::RowMajor;     // x8 [M, K]
  using LayoutB = cutlass::layout::ColumnMajor;  // w8 [N, K]: B = w8^T, K-major
  using LayoutD = cutlass::layout::RowMajor;     // y [M, N]
  static constexpr int kAlignIn = 16;
  static constexpr int kAlignOut = 8;

  using Accum = cutlass::epilogue::fusion::Sm90AccFetch;
  // token_scale[m]: one value per output row (column broadcast); channel_scale[n]: per column.
  using TokenScale = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<_1, _0, _0>, 1>;
  using ChannelScale = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, _1, _0>, 4>;
  using TimesToken = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                                            cutlass::FloatRoundStyle::round_to_nearest>;
  using TimesChannel = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementOut, float,
                                                              cutlass::FloatRoundStyle::round_to_nearest>;
  using ScaledByToken = cutlass::epilogue::fusion::Sm90EVT<TimesToken, Accum, TokenScale>;
  using Epilogue = cutlass::epilogue::fusion::Sm90EVT<TimesChannel, ScaledByToken, ChannelScale>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, kAlignOut, ElementOut, LayoutD,
      kAlignOut, typename Schedule::Epilogue, Epilogue>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA, kAlignIn, ElementIn, LayoutB, kAlignIn,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static ffi::Error run(cudaStream_t stream, ffi::ScratchAllocator& scratch, const void* x8, const void* w8,
                        const float* token_scale, const float* channel_scale, void* y, int m, int n, int k,
                        int promote_k, int sm_count) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideD = typename Kernel::StrideD;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<const ElementIn*>(x8), cutlass::make_cute_packed_stride(StrideA{}, make_shape(m, k, 1)),
         static_cast<const ElementIn*>(w8), cutlass::make_cute_packed_stride(StrideB{}, make_shape(n, k, 1))},
        {{},
         nullptr,
         cutlass::make_cute_packed_stride(StrideD{}, make_shape(m, n, 1)),
         static_cast<ElementOut*>(y),
         cutlass::make_cute_packed_stride(StrideD{}, make_shape(m, n, 1))}};
    // K per promoted step sum, in WGMMAs of K 32 (unused by the fast schedules)
    args.mainloop.mma_promotion_interval = promote_k / 32;
    // Sm90EVT arguments: {first child, second child, the node's own}.
    args.epilogue.thread = {{{}, {token_scale}, {}}, {channel_scale}, {}};
    args.hw_info.sm_count = sm_count;

    return jaxlp::run_cutlass<Gemm>("jaxlp cutlass fp8 gemm", args, &scratch, stream);
  }
};

// The compiled kernels (index = the `config` attribute; jaxlp/ffi/cutlass_gemm.py's CONFIGS names
// them in this order): schedule, tile M x N (x 128 K) per CTA (pingpong: per consumer warpgroup),
// cluster M x N, tile scheduler.
template <class Out>
ffi::Error dispatch(int config, cudaStream_t stream, ffi::ScratchAllocator& scratch, const void* x8, const void* w8,
                    const float* ts, const float* cs, void* y, int m, int n, int k, int promote_k, int sms) {
#define JAXLP_CASE(INDEX, ...) \
  case INDEX:                  \
    return Fp8Gemm<Out, __VA_ARGS__>::run(stream, scratch, x8, w8, ts, cs, y, m, n, k, promote_k, sms);
  switch (config) {
    JAXLP_CASE(0, Pingpong, 64, 128, 1, 1, PersistentScheduler)
    JAXLP_CASE(1, Cooperative, 128, 128, 1, 2, PersistentScheduler)
    JAXLP_CASE(2, Cooperative, 128, 128, 2, 1, PersistentScheduler)
    JAXLP_CASE(3, Cooperative, 128, 128, 1, 1, StreamKScheduler)
    JAXLP_CASE(4, PingpongFast, 128, 128, 2, 1, PersistentScheduler)
    JAXLP_CASE(5, PingpongFast, 64, 128, 1, 1, PersistentScheduler)
    JAXLP_CASE(6, CooperativeFast, 128, 256, 1, 2, PersistentScheduler)
    JAXLP_CASE(7, CooperativeFast, 256, 128, 2, 1, PersistentScheduler)
    JAXLP_CASE(8, CooperativeFast, 128, 128, 1, 1, StreamKScheduler)
    default:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "jaxlp cutlass fp8 gemm: unknown config " + std::to_string(config));
  }
#undef JAXLP_CASE
}


ffi::Error Impl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x8, ffi::AnyBuffer w8,
                ffi::Buffer<ffi::F32> token_scale,
                ffi::Buffer<ffi::F32> channel_scale, ffi::Result<ffi::AnyBuffer> y, int64_t config,
                int64_t promote_k) {
  auto xd = x8.dimensions(), wd = w8.dimensions(), yd = y->dimensions();
  if (x8.element_type() != ffi::DataType::F8E4M3FN || w8.element_type() != ffi::DataType::F8E4M3FN)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp cutlass fp8 gemm: x8 and w8 must be float8_e4m3fn");
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp cutlass fp8 gemm: x8 must be [M, K] and w8 [N, K]");
  int64_t m = xd[0], k = xd[1], n = wd[0];
  if (token_scale.element_count() != m || channel_scale.element_count() != n)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxlp cutlass fp8 gemm: token_scale must be [M] and channel_scale [N]");
  if (yd.size() != 2 || yd[0] != m || yd[1] != n)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp cutlass fp8 gemm: y must be [M, N]");
  if (k % 16 || n % 8 || k <= 0 || n <= 0 || m >= (1ll << 31) || n >= (1ll << 31) || k >= (1ll << 31))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxlp cutlass fp8 gemm: needs K a multiple of 16 and N a multiple of 8, got M=" +
                          std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k));
  if (promote_k < 128 || promote_k % 128 || promote_k > 4096)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxlp cutlass fp8 gemm: promote_k must be a multiple of 128 in [128, 4096], got " +
                          std::to_string(promote_k));
  if (m == 0) return ffi::Error::Success();
  const void* xp = x8.untyped_data();
  const void* wp = w8.untyped_data();
  const float* ts = token_scale.typed_data();
  const float* cs = channel_scale.typed_data();
  int c = static_cast<int>(config), pk = static_cast<int>(promote_k), sms = jaxlp::cutlass_sm_count();
  switch (y->element_type()) {
    case ffi::DataType::BF16:
      return dispatch<cutlass::bfloat16_t>(c, stream, scratch, xp, wp, ts, cs, y->untyped_data(), m, n, k, pk, sms);
    case ffi::DataType::F16:
      return dispatch<cutlass::half_t>(c, stream, scratch, xp, wp, ts, cs, y->untyped_data(), m, n, k, pk, sms);
    default:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp cutlass fp8 gemm: y must be bfloat16 or float16");
  }
}

}  // namespace jaxlp_cutlass_fp8

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpCutlassFp8Gemm, jaxlp_cutlass_fp8::Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()              // x8 [M, K] float8_e4m3fn
                                  .Arg<ffi::AnyBuffer>()              // w8 [N, K] float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()       // token_scale [M]
                                  .Arg<ffi::Buffer<ffi::F32>>()       // channel_scale [N]
                                  .Ret<ffi::AnyBuffer>()              // y [M, N] bfloat16 or float16
                                  .Attr<int64_t>("config")
                                  .Attr<int64_t>("promote_k"),  // K per promoted step sum
                              {ffi::Traits::kCmdBufferCompatible});
