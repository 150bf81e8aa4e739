// FireQ W4A8 GEMM on Hopper tensor cores through CUTLASS 3 (XLA FFI custom call, sm_90a); Python
// side: jaxlp/ffi/cutlass_gemm.py (fireq_matmul, fireq_operands).
//
//   y[m, n] = round_out((sum_k x8[m, k] * e4m3(q[n, k] * s[n, k / 128])) * token_scale[m])
//
// x8 [M, K] float8_e4m3fn (FireQ's per-token FP8 activations), q the INT4 weight codes [N, K] two per
// byte (element 2i in the low nibble), s its E4M3 group scales (128 K per group), token_scale float32
// [M] (the activations' scale times PTS's 1/p), y [M, N] bfloat16 or float16, one rounding.
//
// CUTLASS's mixed-input mainloop (the register-sourced "RS" WGMMA) in its lookup-table mode: the
// weights are WGMMA's A operand (output features on its M, tokens on its N: y^T = W x^T, written
// column-major, i.e. y row-major), each k-block's INT4 codes copied from shared memory to registers
// and turned into E4M3 by byte permutes from a per-group table of the 8 negative multiples of the
// scale, e4m3(-8 s) .. e4m3(-s): exactly e4m3(q s), which is FireQ's dequantized weight
// (jaxlp.formats.int4_fp8). The tables are the scale operand, [K / 128, N] entries of 8 bytes
// (N-major; built from the weight's scales by jaxlp.ffi.fireq.tables, reference
// cutlass_gemm.fireq_tables). CUTLASS's conversion
// wants its codes in a "unified" encoding (a positive q stored as the bits of -q); this one reads
// FireQ's own two's-complement codes: a code c with bit 3 set (q = c - 16 < 0) is byte c & 7 of
// the negative table, as CUTLASS's, and one with bit 3 clear (q = c >= 0) is byte c of a positive
// table built from it once per k tile, +0, -T[7], -T[6], ..., -T[1] (fireq_positive_table).
//
// `FireqMainloop` is that mainloop with its FP8 sums promoted: the tensor cores' own FP8 accumulation
// keeps fewer bits than float32, so each kPromoteTiles k tiles (128 K each) of WGMMAs accumulate into
// a second register tile, added into the float32 accumulators once they are done (CUTLASS's FP8
// "promotion", which its mixed-input mainloop lacks). Everything else (TMA loads, pipeline, the
// table conversion, schedule, epilogue) is CUTLASS's. The token scale is an epilogue visitor tree.
//
// Shape rules: K a multiple of 128 (the groups; TMA's 16-byte rows of 4-bit codes need 32), N a
// multiple of 8 (16-byte rows of the 16-bit output), M any >= 1.
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
#include "cutlass_rs_loop.cuh"
#include "cutlass_run.cuh"

namespace ffi = xla::ffi;

namespace jaxlp_cutlass_fireq {

using namespace cute;

constexpr int kGroup = 128;  // K per FireQ scale group

// The positive half of a group's table from its negative half T = e4m3(-8 s) .. e4m3(-s) (two words,
// byte i = T[i]): byte q = e4m3(q s) = T[8 - q] with its sign flipped for q = 1..7, and +0 for q = 0.
__device__ __forceinline__ void fireq_positive_table(uint32_t neg0, uint32_t neg1, uint32_t& pos0, uint32_t& pos1) {
  pos0 = (__byte_perm(neg0, neg1, 0x5670) & 0xffffff00u) ^ 0x80808000u;  // +0, -T7, -T6, -T5
  pos1 = __byte_perm(neg0, neg1, 0x1234) ^ 0x80808080u;                   // -T4, -T3, -T2, -T1
}

// CUTLASS's MixedInputUtils::dequantize_A_kblock in its lookup-table mode for FireQ's two's-complement
// codes: the same lookup (lookup_table_convert: byte c & 7 of the negative table where bit 3 of c is
// set, else of the positive one), the positive tables built by fireq_positive_table at k block 0.
template <class Utils, class TensorIn, class TensorOut, class Extra>
CUTLASS_DEVICE void fireq_convert_kblock(TensorIn const& tCrA_load, TensorOut& tCrA_mma, Extra& extra, int k_block) {
  Tensor src = tCrA_load(_, _, k_block);
  Tensor dst = tCrA_mma(_, _, k_block);
  constexpr int kPerReg = cute::min(decltype(size(src(_, 0)))::value, 8);  // 8 codes per 32-bit register
  Tensor src_vm = cute::group_modes<1, -1>(cute::zipped_divide(src, Int<kPerReg>{}));
  Tensor dst_vm = cute::group_modes<1, -1>(cute::zipped_divide(dst, Int<kPerReg>{}));
  Tensor scales_neg = cute::get<1>(extra)(_, _, k_block);
  auto&& tCrS_pos = cute::get<2>(extra);
  Tensor scales_pos = tCrS_pos(_, _, k_block);
  Tensor scales_neg_vm = cute::group_modes<1, -1>(cute::zipped_divide(scales_neg, Int<kPerReg>{}));
  Tensor scales_pos_vm = cute::group_modes<1, -1>(cute::zipped_divide(scales_pos, Int<kPerReg>{}));
  if (k_block == 0) {
    Tensor neg = filter(scales_neg_vm);
    Tensor pos = filter(scales_pos_vm);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(neg.layout()); ++i) {
      auto&& n = reinterpret_cast<cutlass::Array<uint32_t, 2> const&>(neg(i));
      auto&& p = reinterpret_cast<cutlass::Array<uint32_t, 2>&>(pos(i));
      fireq_positive_table(n[0], n[1], p[0], p[1]);
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size<1>(dst_vm); ++i)
    Utils::lookup_table_convert(src_vm(_, i), dst_vm(_, i), scales_neg_vm(_, i), scales_pos_vm(_, i));
}

// CUTLASS's mixed-input mainloop (`Base`, lookup-table mode) with promoted FP8 sums (file head). The
// loop is the base's (cutlass_rs_loop.cuh), accumulating into `partial`; after every kPromoteTiles k
// tiles, and after the last, all WGMMAs are waited for and `partial` is added into `accum`.
template <class Base, int kPromoteTiles>
struct FireqMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  using Utils = cutlass::gemm::collective::detail::MixedInputUtils<Base>;

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const& params) {
    static_assert(Base::UseScaleLookupTable, "the FireQ mainloop is CUTLASS's lookup-table mode");
    const int warp_group_thread_idx = thread_idx % cutlass::NumThreadsPerWarpGroup;
    Tensor sA = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(shared_tensors.smem_A.begin()), SmemLayoutA{}));  // (BLK_N,BLK_K,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.begin()), SmemLayoutB{});

    constexpr int MmaWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_thread_layout = make_layout(Int<MmaWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);

    TiledMma tiled_mma;
    auto mma_thread_slice = tiled_mma.get_thread_slice(thread_idx);
    Tensor tCsA = mma_thread_slice.partition_A(sA);
    auto mma_warpgroup_slice = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    Tensor tCrA_mma = mma_thread_slice.partition_fragment_A(sA(_, _, Int<0>{}));  // E4M3 weights (MMA,MMA_M,MMA_K)
    Tensor tCrA_load = make_fragment_like<typename Base::RealSwappedElementA>(tCrA_mma);  // INT4 codes
    Tensor tCsB = mma_warpgroup_slice.partition_B(sB);
    Tensor tCrB = mma_warpgroup_slice.make_fragment_B(tCsB);

    auto smem_tiled_copy_A = make_tiled_copy_A(typename Base::SwappedSmemCopyAtomA{}, tiled_mma);
    auto smem_thr_copy_A = smem_tiled_copy_A.get_thread_slice(warp_group_thread_idx);
    Tensor tCrA_copy_view = smem_thr_copy_A.retile_D(tCrA_load);
    auto extra = Utils::partition_extra_mma_info(mma_thread_slice, shared_tensors);  // the tables
    auto extra_copy = Utils::retile_extra_mma_info(tiled_mma, extra, warp_group_thread_idx);
    auto copy_kblock = [&](int k_block, int stage) {
      Utils::copy_tensors_MK(smem_tiled_copy_A, tCsA, tCrA_copy_view, extra, extra_copy, k_block, stage);
    };
    auto convert_kblock = [&](int k_block) { fireq_convert_kblock<Utils>(tCrA_load, tCrA_mma, extra, k_block); };

    Tensor partial = make_fragment_like(accum);  // this window's FP8 sums
    clear(accum);
    int tile = 0;  // k tiles issued
    auto promote = [&](bool last) {  // rs_k_loop's tile_done: after a k tile's WGMMAs are issued
      ++tile;
      if (!last && tile % kPromoteTiles) return;
      warpgroup_wait<0>();
      warpgroup_fence_operand(partial);
      warpgroup_fence_operand(accum);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += partial(i);
      warpgroup_fence_operand(accum);
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;  // the next WGMMA starts the next window
    };

    constexpr int K_BLOCK_MAX = size<2>(tCrA_load);
    jaxlp::rs_k_loop<K_BLOCK_MAX>(pipeline, smem_pipe_read, k_tile_count, tiled_mma, tCrA_mma, tCrB, partial,
                                  copy_kblock, convert_kblock, promote);
  }
};

// The GEMM: tile features x tokens x 128 K per CTA, two consumer warpgroups (cooperative), the FP8
// sums promoted every kPromoteTiles k tiles, the token scale in the epilogue.
template <class ElementOut, int kTileN, int kTileM, int kPromoteTiles, class Scheduler>
struct FireqGemm {
  using TileShape = Shape<Int<kTileN>, Int<kTileM>, Int<kGroup>>;
  using ClusterShape = Shape<_1, _1, _1>;
  using Codes = cutlass::int4b_t;
  using Table = cutlass::Array<cutlass::float_e4m3_t, 8>;  // e4m3(-8 s) .. e4m3(-s) of a group
  using LayoutA = cutlass::layout::RowMajor;     // codes [N_features, K]
  using LayoutB = cutlass::layout::ColumnMajor;  // x8 [M_tokens, K]: B = x8^T, K-major
  using LayoutD = cutlass::layout::ColumnMajor;  // y^T [N_features, M_tokens] column-major = y [M, N] row-major

  using Accum = cutlass::epilogue::fusion::Sm90AccFetch;
  // token_scale[m]: the tokens are the GEMM's N, one value per output column of y^T.
  using TokenScale = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, _1, _0>, 4>;
  using TimesToken = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementOut, float,
                                                            cutlass::FloatRoundStyle::round_to_nearest>;
  using Epilogue = cutlass::epilogue::fusion::Sm90EVT<TimesToken, Accum, TokenScale>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, 8, ElementOut, LayoutD, 8,
      cutlass::epilogue::TmaWarpSpecializedCooperative, Epilogue>::CollectiveOp;

  using Built = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cute::tuple<Codes, Table>, LayoutA, 32,
      cutlass::float_e4m3_t, LayoutB, 16, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = FireqMainloop<Built, kPromoteTiles>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, CollectiveEpilogue,
                                                      Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static ffi::Error run(cudaStream_t stream, ffi::ScratchAllocator& scratch, const void* x8, const void* codes,
                        const void* tables, const float* token_scale, void* y, int m, int n, int k, int sm_count) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideD = typename Kernel::StrideD;
    using StrideScale = typename Built::StrideScale;
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {n, m, k, 1};  // GEMM M = features, N = tokens
    args.mainloop.ptr_A = static_cast<const Codes*>(codes);
    args.mainloop.dA = cutlass::make_cute_packed_stride(StrideA{}, make_shape(n, k, 1));
    args.mainloop.ptr_B = static_cast<const cutlass::float_e4m3_t*>(x8);
    args.mainloop.dB = cutlass::make_cute_packed_stride(StrideB{}, make_shape(m, k, 1));
    args.mainloop.ptr_S = static_cast<const Table*>(tables);
    args.mainloop.dS = cutlass::make_cute_packed_stride(StrideScale{}, make_shape(n, k / kGroup, 1));
    args.mainloop.group_size = kGroup;
    // Sm90EVT arguments: {first child, second child, the node's own}.
    args.epilogue.thread = {{}, {token_scale}, {}};
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = cutlass::make_cute_packed_stride(StrideD{}, make_shape(n, m, 1));
    args.epilogue.ptr_D = static_cast<ElementOut*>(y);
    args.epilogue.dD = cutlass::make_cute_packed_stride(StrideD{}, make_shape(n, m, 1));
    args.hw_info.sm_count = sm_count;
    return jaxlp::run_cutlass<Gemm>("jaxlp cutlass fireq gemm", args, &scratch, stream);
  }
};

// The compiled kernels (index = the `config` attribute; jaxlp/ffi/cutlass_gemm.py's FIREQ_CONFIGS
// names them in this order): tile features x tokens (x 128 K), k tiles per promoted sum, the tile
// scheduler (stream-K splits K over the SMs where the output has fewer tiles than SMs).
template <class Out>
ffi::Error dispatch(int config, cudaStream_t stream, ffi::ScratchAllocator& scratch, const void* x8, const void* codes,
                    const void* tables, const float* ts, void* y, int m, int n, int k, int sms) {
#define JAXLP_CASE(INDEX, ...) \
  case INDEX:                  \
    return FireqGemm<Out, __VA_ARGS__>::run(stream, scratch, x8, codes, tables, ts, y, m, n, k, sms);
  switch (config) {
    JAXLP_CASE(0, 128, 128, 2, cutlass::gemm::PersistentScheduler)
    JAXLP_CASE(1, 128, 64, 2, cutlass::gemm::PersistentScheduler)
    JAXLP_CASE(2, 128, 128, 1, cutlass::gemm::PersistentScheduler)
    JAXLP_CASE(3, 128, 128, 2, cutlass::gemm::StreamKScheduler)
    JAXLP_CASE(4, 128, 64, 2, cutlass::gemm::StreamKScheduler)
    default:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "jaxlp cutlass fireq gemm: unknown config " + std::to_string(config));
  }
#undef JAXLP_CASE
}

ffi::Error Impl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x8, ffi::Buffer<ffi::U8> codes,
                ffi::Buffer<ffi::U8> tables, ffi::Buffer<ffi::F32> token_scale, ffi::Result<ffi::AnyBuffer> y,
                int64_t config) {
  auto xd = x8.dimensions(), cd = codes.dimensions(), td = tables.dimensions(), yd = y->dimensions();
  if (x8.element_type() != ffi::DataType::F8E4M3FN)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp cutlass fireq gemm: x8 must be float8_e4m3fn");
  if (xd.size() != 2 || cd.size() != 2 || cd[1] * 2 != xd[1])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxlp cutlass fireq gemm: x8 must be [M, K] and the codes uint8 [N, K / 2]");
  const int64_t m = xd[0], k = xd[1], n = cd[0];
  if (td.size() != 3 || td[0] != k / kGroup || td[1] != n || td[2] != 8)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxlp cutlass fireq gemm: the tables must be uint8 [K / 128, N, 8]");
  if (token_scale.element_count() != m)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp cutlass fireq gemm: token_scale must be [M]");
  if (yd.size() != 2 || yd[0] != m || yd[1] != n)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp cutlass fireq gemm: y must be [M, N]");
  if (k % kGroup || n % 8 || k <= 0 || n <= 0 || m >= (1ll << 31) || n >= (1ll << 31) || k >= (1ll << 31))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxlp cutlass fireq gemm: needs K a multiple of 128 and N of 8, got M=" + std::to_string(m) +
                          " N=" + std::to_string(n) + " K=" + std::to_string(k));
  if (m == 0) return ffi::Error::Success();
  const int c = static_cast<int>(config), sms = jaxlp::cutlass_sm_count();
  const void *xp = x8.untyped_data(), *cp = codes.untyped_data(), *tp = tables.untyped_data();
  const float* ts = token_scale.typed_data();
  switch (y->element_type()) {
    case ffi::DataType::BF16:
      return dispatch<cutlass::bfloat16_t>(c, stream, scratch, xp, cp, tp, ts, y->untyped_data(), m, n, k, sms);
    case ffi::DataType::F16:
      return dispatch<cutlass::half_t>(c, stream, scratch, xp, cp, tp, ts, y->untyped_data(), m, n, k, sms);
    default:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp cutlass fireq gemm: y must be bfloat16 or float16");
  }
}

}  // namespace jaxlp_cutlass_fireq

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpCutlassFireqGemm, jaxlp_cutlass_fireq::Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()         // x8 [M, K] float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes [N, K / 2], FireQ's
                                  .Arg<ffi::Buffer<ffi::U8>>()   // tables [K / 128, N, 8]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // token_scale [M]
                                  .Ret<ffi::AnyBuffer>()         // y [M, N] bfloat16 or float16
                                  .Attr<int64_t>("config"),
                              {ffi::Traits::kCmdBufferCompatible});
