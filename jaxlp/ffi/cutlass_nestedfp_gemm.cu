// NestedFP16 GEMM on Hopper tensor cores through CUTLASS 3, the FP16 weight rebuilt from its two
// byte planes inside the GEMM (XLA FFI custom call, sm_90a); Python side: jaxlp/ffi/cutlass_gemm.py.
//
//   y[m, n] = fp16(sum_k x[m, k] * merge(upper, lower)[n, k])      (float32 sums)
//
// x [M, K] float16, upper and lower [N, K] uint8 (jaxlp.formats.nestedfp's byte planes), y [M, N]
// float16. The NestedFP paper's kernel design, on CUTLASS's SM90 mixed-input mainloop (the
// register-sourced "RS" WGMMA): operands swapped so the weights are WGMMA's A operand (output
// features on its M, tokens on its N, y^T = W x^T, written column-major, i.e. y row-major), a
// producer warp's TMA loads three tiles per stage (upper bytes, lower bytes, activations), the
// consumer warpgroups copy each k-block's upper and lower bytes from shared memory to registers,
// rebuild the FP16 weights there (nestedfp_merge.cuh: one 32-bit merge and two byte permutes per
// four weights) while the previous k-block's WGMMA runs, and feed them to WGMMA as the register
// operand with the activations from shared memory.
//
// `NestedFp16Mainloop` is CUTLASS's mixed-input collective (uint8 A, FP16 B, direct conversion) with
// a second A-shaped tensor, the lower plane: its own shared-memory ring, TMA descriptor and loads,
// and the merge in place of the conversion. Everything else (pipeline, schedules, epilogue) is
// CUTLASS's.
//
// The other design, for many tokens (`Merge::kTransformWarp`, cutlass_transform_kernel.cuh): the producer
// warpgroup, whose warps CUTLASS's kernel leaves idle but for the TMA one, rebuilds each stage's weight
// tile (a quarter of its rows per warp) into an FP16 tile in the layout WGMMA reads, over the stage's
// own byte planes, and the consumer warpgroups run CUTLASS's plain SS k loop on it: no conversion on
// the WGMMA's critical path, and as many stages as plain FP16 tiles take (H100, 1024-4096 tokens:
// 0.82-0.87x XLA's FP16 dot, the register design 0.63-0.70x; docs/perf.md session 30).
//
// `JaxlpCutlassFp16Gemm`: the same GEMM on plain FP16 weights through CUTLASS's own mainloop (both
// operands from shared memory), the benchmarks' baseline for what the byte planes cost.
//
// Shape rules (TMA's 16-byte rows): K a multiple of 16 (the byte planes' rows), N a multiple of 8
// (the output's rows); M any >= 1 (tails of N, M and K inside a tile are zero-filled).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

// XLA's FFI headers first: CUTLASS turns -Wmissing-field-initializers into an error for what follows.
#include "xla/ffi/api/ffi.h"
//
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "cutlass_rs_loop.cuh"
#include "cutlass_run.cuh"
#include "cutlass_transform_kernel.cuh"
#include "nestedfp_merge.cuh"

namespace ffi = xla::ffi;

namespace jaxlp_cutlass_nestedfp {

using namespace cute;

using jaxlp::ld_shared_v4;
using jaxlp::st_shared_v4;

// Where the FP16 weights are rebuilt (see NestedFp16Mainloop).
enum class Merge { kRegisters, kTransformWarp };

// CUTLASS's mixed-input mainloop (`Base`) with the lower byte plane beside A's upper one (file head).
// The weights are rebuilt (kMerge)
//   kRegisters: into WGMMA's register operand per k-block by the consumer warpgroups (the
//     mixed-input mainloop's design);
//   kTransformWarp: by the producer warpgroup's four warps (TransformKernel: warp 0 also issues the
//     TMA loads), a quarter of each k tile's rows each, into an FP16 tile over the stage's own byte
//     planes; the consumers run CUTLASS's plain SS k loop on it (cooperative schedule only).
template <class Base, Merge kMerge>
struct NestedFp16Mainloop : Base {
  static constexpr bool kTransform = kMerge == Merge::kTransformWarp;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  using typename Base::GmemTiledCopyA;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::TileShape;
  using typename Base::TmaElementA;
  using KernelSchedule = typename Base::DispatchPolicy::Schedule;
  static constexpr bool kPingpong = cute::is_base_of_v<cutlass::gemm::KernelTmaWarpSpecializedPingpong, KernelSchedule>;
  // kTransformWarp: the same MMA with both operands from shared memory (the same accumulator layout)
  using TiledMma = cute::conditional_t<
      kTransform,
      decltype(make_tiled_mma(GMMA::ss_op_selector<cutlass::half_t, cutlass::half_t, float, TileShape, GMMA::Major::K,
                                                   GMMA::Major::K>(),
                              Layout<Shape<_2, _1, _1>>{})),
      typename Base::TiledMma>;
  static_assert(!kTransform || !kPingpong, "the producer warpgroup's weights feed the cooperative schedule");
  // kTransformWarp: a stage's 16 KB hold its upper plane, then its lower one (SmemLayoutPlanes' tiles
  // 2 s and 2 s + 1, A's layout: 64-byte rows in the 64-byte swizzle), and the producer warps rebuild
  // the stage's FP16 tile over them (SmemLayoutRebuilt's tile s: 128-byte rows in the 128-byte
  // swizzle WGMMA reads), announced on named barrier kStageBarrier + s (user ids; CUTLASS's are
  // reserved below them): the producer warps arrive, the consumers sync. The rebuilt tile takes no
  // shared memory of its own, so the stages are as many as for plain FP16 tiles.
  static constexpr int kStages = Base::DispatchPolicy::Stages;
  static constexpr uint32_t kStageBarrier = 0, kProducerBarrier = 7;  // the latter: the producer warpgroup's
  static constexpr uint32_t kStageThreads = 3 * cutlass::NumThreadsPerWarpGroup;  // the CTA
  static_assert(!kTransform || kStages <= 7, "one named barrier per stage");
  static_assert(size<2>(TileShape{}) == 64 &&
                    cute::is_same_v<SmemLayoutA, decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<uint8_t>{},
                                                                        make_shape(size<0>(TileShape{}), _64{},
                                                                                   Int<kStages>{})))>,
                "the byte planes' shared-memory layout merge_stage assumes");
  using SmemLayoutPlanes = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<uint8_t>{},
                                                  make_shape(size<0>(TileShape{}), _64{}, Int<2 * kStages>{})));
  using SmemLayoutRebuilt = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::half_t>{},
                                                   make_shape(size<0>(TileShape{}), _64{}, Int<kStages>{})));
  static_assert(cute::is_same_v<typename Base::RealSwappedElementA, uint8_t> && !Base::SwapAB,
                "A must be the uint8 upper plane, not swapped");
  static_assert(Base::KernelConversionMode == cutlass::detail::ConversionMode::DirectConvert);

  struct SharedStorage {
    struct TensorStorage {
      // upper (kTransformWarp: both planes, then the FP16 tile over them)
      CUTE_ALIGNAS(1024)
      cute::ArrayEngine<uint8_t, cute::cosize_v<cute::conditional_t<kTransform, SmemLayoutPlanes, SmemLayoutA>>> smem_A;
      CUTE_ALIGNAS(Base::SmemAlignmentA)
      cute::ArrayEngine<uint8_t, kTransform ? 16 : cute::cosize_v<SmemLayoutA>> smem_L;  // lower
      CUTE_ALIGNAS(Base::SmemAlignmentB)
      cute::ArrayEngine<typename TiledMma::ValTypeB, cute::cosize_v<SmemLayoutB>> smem_B;
    } tensors;
    using PipelineStorage = typename MainloopPipeline::SharedStorage;
    PipelineStorage pipeline;
  };
  using TensorStorage = typename SharedStorage::TensorStorage;
  using PipelineStorage = typename SharedStorage::PipelineStorage;

  struct Arguments {
    uint8_t const* ptr_A = nullptr;  // upper plane [N_features, K]
    StrideA dA{};
    cutlass::half_t const* ptr_B = nullptr;  // activations
    StrideB dB{};
    uint8_t const* ptr_L = nullptr;  // lower plane, A's shape and strides
  };

  struct Params : Base::Params {
    typename Base::Params::TMA_A tma_load_l;
  };

  static typename Base::Arguments base_arguments(Arguments const& args) {
    typename Base::Arguments base{};
    base.ptr_A = args.ptr_A;
    base.dA = args.dA;
    base.ptr_B = args.ptr_B;
    base.dB = args.dB;
    return base;
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) =
        Base::to_underlying_arguments(problem_shape, base_arguments(args), workspace);
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    Tensor tensor_l = make_tensor(cutlass::gemm::collective::detail::get_logical_ptr(args.ptr_L),
                                  cutlass::gemm::collective::detail::get_gmem_layout(make_shape(M, K, L), args.dA));
    params.tma_load_l = make_tma_copy_A_sm90<TmaElementA>(GmemTiledCopyA{}, tensor_l, SmemLayoutA{}(_, _, Int<0>{}),
                                                          TileShape{}, ClusterShape{});
    params.tma_transaction_bytes += Base::TmaTransactionBytesMK;  // the lower tile, A's size
    return params;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    return args.ptr_L != nullptr && Base::can_implement(problem_shape, base_arguments(args));
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    cute::prefetch_tma_descriptor(params.tma_load_l.get_tma_descriptor());
  }

  // (gA_mkl, gB_nkl, gL_mkl): the base's tiled views and the lower plane's, A's tiling.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& params) const {
    auto [M, N, K, L] = problem_shape_MNKL;
    auto base = Base::load_init(problem_shape_MNKL, params);
    Tensor mL_mkl = params.tma_load_l.get_tma_tensor(
        shape(cutlass::gemm::collective::detail::get_gmem_layout(make_shape(M, K, L), params.dA)));
    Tensor gL_mkl = local_tile(mL_mkl, TileShape{}, make_coord(_, _, _), Step<_1, Underscore, _1>{});
    return cute::make_tuple(get<0>(base), get<1>(base), gL_mkl);
  }

  // Producer: the base's TMA loop with the lower tile issued beside the upper one (same stage,
  // same barrier, same multicast).
  template <class... Ts, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<Ts...> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using PlanesLayout = cute::conditional_t<kTransform, SmemLayoutPlanes, SmemLayoutA>;  // kTransformWarp: both
    Tensor sA = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(shared_tensors.smem_A.begin()), PlanesLayout{}));
    Tensor sL = as_position_independent_swizzle_tensor(make_tensor(
        make_smem_ptr(kTransform ? shared_tensors.smem_A.begin() : shared_tensors.smem_L.begin()), PlanesLayout{}));
    Tensor sB = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(shared_tensors.smem_B.begin()), SmemLayoutB{}));

    constexpr uint32_t cluster_shape_x = get<0>(ClusterShape());
    uint2 cluster_local_block_id = {block_rank_in_cluster % cluster_shape_x, block_rank_in_cluster / cluster_shape_x};
    auto block_tma_a = params.tma_load_a.get_slice(cluster_local_block_id.y);
    auto block_tma_l = params.tma_load_l.get_slice(cluster_local_block_id.y);
    auto block_tma_b = params.tma_load_b.get_slice(cluster_local_block_id.x);

    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor tAgA = block_tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tAsA = block_tma_a.partition_D(sA);
    Tensor tLgL = block_tma_l.partition_S(get<2>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tLsL = block_tma_l.partition_D(sL);
    Tensor tBgB = block_tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));
    Tensor tBsB = block_tma_b.partition_D(sB);

    uint16_t mcast_mask_a = 0, mcast_mask_b = 0;
    auto block_layout = Layout<ClusterShape>{};  // (m, n) -> block id
    if constexpr (cute::is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < size<1>(block_layout); ++n)
        mcast_mask_a |= (uint16_t(1) << block_layout(cluster_local_block_id.x, n, Int<0>{}));
    }
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(block_layout); ++m)
        mcast_mask_b |= (uint16_t(1) << block_layout(m, cluster_local_block_id.y, Int<0>{}));
    }

    // kTransformWarp: this warp also rebuilds part 0 of each k tile's rows (merge_stage), kLag k tiles
    // behind its loads (a stage is freed once its k tile's weights are rebuilt and used, so the
    // loads may run at most Stages - 2 k tiles ahead of this warp's own merges). `full` is the next k
    // tile to rebuild: its count trails smem_pipe_write's by the k tiles loaded but not yet rebuilt.
    constexpr uint32_t kLag = Base::DispatchPolicy::Stages - 2;
    PipelineState full(smem_pipe_write.index(), smem_pipe_write.phase() ^ 1, smem_pipe_write.count());
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      int stage = smem_pipe_write.index();
      if (cute::elect_one_sync()) {
        const int upper_at = kTransform ? 2 * stage : stage, lower_at = kTransform ? 2 * stage + 1 : stage;
        copy(params.tma_load_a.with(*tma_barrier, mcast_mask_a), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, upper_at));
        copy(params.tma_load_l.with(*tma_barrier, mcast_mask_a), tLgL(_, _, _, *k_tile_iter), tLsL(_, _, _, lower_at));
        copy(params.tma_load_b.with(*tma_barrier, mcast_mask_b), tBgB(_, _, _, *k_tile_iter), tBsB(_, _, _, stage));
      }
      ++k_tile_iter;
      ++smem_pipe_write;
      if constexpr (kTransform) {
        if (smem_pipe_write.count() - full.count() > kLag) {
          merge_stage(pipeline, full, 0, thread_idx, shared_tensors);
          ++full;
        }
      }
    }
    if constexpr (kTransform) {
      for (; full.count() != smem_pipe_write.count(); ++full)
        merge_stage(pipeline, full, 0, thread_idx, shared_tensors);
    }
  }

  // kTransformWarp, producer warp `part` = 1..3 (TransformKernel; warp 0 runs load): its quarter of
  // each k tile's rows rebuilt as the stages land. `smem_pipe_write`: the producer's pipeline state.
  CUTLASS_DEVICE void transform(MainloopPipeline pipeline, PipelineState smem_pipe_write, int k_tile_count, int part,
                                int lane, TensorStorage& shared_tensors) {
    if constexpr (kTransform) {
      // the stage's full barrier as a consumer sees it (a consumer's phase is the producer's flipped)
      PipelineState full(smem_pipe_write.index(), smem_pipe_write.phase() ^ 1, smem_pipe_write.count());
      CUTLASS_PRAGMA_NO_UNROLL
      for (; k_tile_count > 0; --k_tile_count) {
        merge_stage(pipeline, full, part, lane, shared_tensors);
        ++full;
      }
    }
  }

  // kTransformWarp: stage `full.index()`'s weights rebuilt over its own planes by the four producer
  // warps, rows [part kRows / 4, + kRows / 4) each: every warp loads its rows of both planes first (in
  // step i lane q: row 8 i + q / 4, K 16 (q % 4) .. + 15, one 16-byte load per plane; the swizzle terms
  // are the lane's own), the warpgroup syncs, then each writes its FP16 rows (over planes the others
  // have read; four merges, two 16-byte stores per step), fences them for WGMMA's async proxy and
  // announces the stage. Shared memory by 32-bit addresses: cute's tensors address it through 64-bit
  // generic pointers here (generic loads and stores, 1.7x the instructions).
  CUTLASS_DEVICE void merge_stage(MainloopPipeline& pipeline, PipelineState const& full, int part, int lane,
                                  TensorStorage& shared_tensors) {
    constexpr int kRows = size<0>(TileShape{}), kSteps = kRows / 4 / 8;
    pipeline.consumer_wait(full);
    const uint32_t stage = full.index();
    const uint32_t base = cute::cast_smem_ptr_to_uint(shared_tensors.smem_A.begin()) + stage * (kRows * 128);
    const int q = lane >> 2, c = lane & 3;
    const uint32_t plane = (q * 64 + 16 * c) ^ (((q >> 1) & 3) << 4);
    const uint32_t fp16 = (q * 128 + 32 * c) ^ ((q & 7) << 4);
    uint32_t u[kSteps][4], l[kSteps][4];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kSteps; ++i) {
      const uint32_t row = part * (kRows / 4) + 8 * i;
      ld_shared_v4(base + row * 64 + plane, u[i]);
      ld_shared_v4(base + kRows * 64 + row * 64 + plane, l[i]);
    }
    cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, kProducerBarrier);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kSteps; ++i) {
      uint32_t w[8];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 4; ++j) jaxlp::nestedfp_merge4(u[i][j], l[i][j], w[2 * j], w[2 * j + 1]);
      const uint32_t row = part * (kRows / 4) + 8 * i;
      st_shared_v4(base + row * 128 + fp16, w);
      st_shared_v4(base + row * 128 + (fp16 ^ 16), w + 4);
    }
    cutlass::arch::fence_view_async_shared();  // the generic-proxy stores, visible to WGMMA
    cutlass::arch::NamedBarrier::arrive(kStageThreads, kStageBarrier + stage);
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const& params) {
    if constexpr (kTransform)
      mma_transformed(pipeline, smem_pipe_read, accum, k_tile_count, thread_idx, shared_tensors);
    else
      mma_registers(pipeline, smem_pipe_read, accum, k_tile_count, thread_idx, shared_tensors);
  }

  // Consumer, kTransformWarp: CUTLASS's SS k loop (one k tile of WGMMAs in flight) on each stage's
  // FP16 tile once the producer warpgroup has rebuilt it; a stage freed once the next k tile's WGMMAs
  // are issued and its own are done (the last stage by mma_tail).
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma_transformed(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                                      int k_tile_count, int thread_idx, TensorStorage& shared_tensors) {
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.begin()), SmemLayoutB{});
    Tensor sW = make_tensor(make_smem_ptr(reinterpret_cast<cutlass::half_t*>(shared_tensors.smem_A.begin())),
                            SmemLayoutRebuilt{});
    constexpr int MmaWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_thread_layout = make_layout(Int<MmaWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    Tensor tCrW = thread_mma.make_fragment_A(thread_mma.partition_A(sW));  // (MMA,MMA_M,MMA_K,PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA,MMA_N,MMA_K,PIPE)

    jaxlp::transformed_k_loop(pipeline, smem_pipe_read, k_tile_count, tiled_mma, tCrW, tCrB, accum, kStageThreads,
                              kStageBarrier, [](bool) {});
  }

  // Consumer, registers: the base's RS k loop (cutlass_rs_loop.cuh: k-block b + 2's bytes copied to
  // registers and k-block b + 1 rebuilt while k-block b's WGMMA runs), with both planes copied and merged.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma_registers(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                                    int k_tile_count, int thread_idx, TensorStorage& shared_tensors) {
    int warp_group_thread_idx = thread_idx % 128;
    Tensor sA = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(shared_tensors.smem_A.begin()), SmemLayoutA{}));
    Tensor sL = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(shared_tensors.smem_L.begin()), SmemLayoutA{}));
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.begin()), SmemLayoutB{});

    constexpr int MmaWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_thread_layout = make_layout(Int<MmaWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);

    TiledMma tiled_mma;
    auto mma_thread_slice = tiled_mma.get_thread_slice(thread_idx);
    Tensor tCsA = mma_thread_slice.partition_A(sA);
    Tensor tCsL = mma_thread_slice.partition_A(sL);
    auto mma_warpgroup_slice = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    Tensor tCrA_mma = mma_thread_slice.partition_fragment_A(sA(_, _, Int<0>{}));  // FP16 weights (MMA,MMA_M,MMA_K)
    Tensor tCrA_load = make_fragment_like<uint8_t>(tCrA_mma);                     // upper bytes
    Tensor tCrL_load = make_fragment_like<uint8_t>(tCrA_mma);                     // lower bytes
    Tensor tCsB = mma_warpgroup_slice.partition_B(sB);
    Tensor tCrB = mma_warpgroup_slice.make_fragment_B(tCsB);

    auto smem_tiled_copy_A = make_tiled_copy_A(typename Base::SwappedSmemCopyAtomA{}, tiled_mma);
    auto smem_thr_copy_A = smem_tiled_copy_A.get_thread_slice(warp_group_thread_idx);
    Tensor tCrA_copy_view = smem_thr_copy_A.retile_D(tCrA_load);
    Tensor tCrL_copy_view = smem_thr_copy_A.retile_D(tCrL_load);

    auto copy_kblock = [&](int k_block, int stage) {
      copy(smem_tiled_copy_A, tCsA(_, _, k_block, stage), tCrA_copy_view(_, _, k_block));
      copy(smem_tiled_copy_A, tCsL(_, _, k_block, stage), tCrL_copy_view(_, _, k_block));
    };
    auto merge_kblock = [&](int k_block) {
      Tensor u = tCrA_load(_, _, k_block);
      Tensor l = tCrL_load(_, _, k_block);
      Tensor w = tCrA_mma(_, _, k_block);
      static_assert(decltype(size(u(_, 0)))::value % 4 == 0, "the fragment's first mode must hold whole words");
      Tensor u4 = group_modes<1, -1>(zipped_divide(u, Int<4>{}));
      Tensor l4 = group_modes<1, -1>(zipped_divide(l, Int<4>{}));
      Tensor w4 = group_modes<1, -1>(zipped_divide(w, Int<4>{}));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size<1>(w4); ++i) {
        auto&& ww = recast<uint32_t>(coalesce(w4(_, i)));
        jaxlp::nestedfp_merge4(recast<uint32_t>(coalesce(u4(_, i)))(0), recast<uint32_t>(coalesce(l4(_, i)))(0),
                               ww(0), ww(1));
      }
    };

    constexpr int K_BLOCK_MAX = size<2>(tCrA_load);
    jaxlp::rs_k_loop<K_BLOCK_MAX>(pipeline, smem_pipe_read, k_tile_count, tiled_mma, tCrA_mma, tCrB, accum,
                                  copy_kblock, merge_kblock, [](bool) {});
  }
};

// The GEMM: tile features x tokens x 64 K per CTA (pingpong: per consumer warpgroup), `Stages`
// shared-memory stages of three tiles each, the weights merged into registers or shared memory.
template <class KernelSchedule, class EpilogueSchedule, int kTileN, int kTileM, int kClusterN, int kClusterM,
          int kStages, class Scheduler, Merge kMerge>
struct NestedFp16Gemm {
  using TileShape = Shape<Int<kTileN>, Int<kTileM>, _64>;
  using ClusterShape = Shape<Int<kClusterN>, Int<kClusterM>, _1>;
  using LayoutA = cutlass::layout::RowMajor;     // upper / lower [N_features, K]
  using LayoutB = cutlass::layout::ColumnMajor;  // x [M_tokens, K]: B = x^T, K-major
  using LayoutD = cutlass::layout::ColumnMajor;  // y^T [N_features, M_tokens] column-major = y [M, N] row-major

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, 8, cutlass::half_t, LayoutD, 8,
      EpilogueSchedule>::CollectiveOp;
  // The builder's mixed-input mainloop for these tiles, re-instantiated with kStages stages (the
  // builder sizes its ring without the lower plane).
  using Built = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, uint8_t, LayoutA, 16, cutlass::half_t, LayoutB, 8, float,
      TileShape, ClusterShape, cutlass::gemm::collective::StageCountAutoCarveout<0>, KernelSchedule>::CollectiveOp;
  using BaseMainloop = cutlass::gemm::collective::CollectiveMma<
      cutlass::gemm::MainloopSm90TmaGmmaRmemAWarpSpecializedMixedInput<kStages, ClusterShape, KernelSchedule>,
      TileShape, cute::tuple<uint8_t>, typename Built::StrideA, cutlass::half_t, typename Built::StrideB,
      typename Built::TiledMma, typename Built::GmemTiledCopyA, typename Built::SmemLayoutAtomA,
      typename Built::SmemCopyAtomA, cute::identity, typename Built::GmemTiledCopyB, typename Built::SmemLayoutAtomB,
      typename Built::SmemCopyAtomB, cute::identity>;
  using Mainloop = NestedFp16Mainloop<BaseMainloop, kMerge>;
  using CutlassKernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, CollectiveEpilogue, Scheduler>;
  using Kernel = cute::conditional_t<kMerge != Merge::kRegisters, jaxlp::TransformKernel<CutlassKernel>, CutlassKernel>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(sizeof(typename Kernel::SharedStorage) <= 227 * 1024, "too many stages for shared memory");

  static ffi::Error run(cudaStream_t stream, ffi::ScratchAllocator& scratch, const void* x, const void* upper,
                        const void* lower, void* y, int m, int n, int k, int sm_count) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideD = typename Kernel::StrideD;
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {n, m, k, 1};  // GEMM M = features, N = tokens
    args.mainloop.ptr_A = static_cast<const uint8_t*>(upper);
    args.mainloop.dA = cutlass::make_cute_packed_stride(StrideA{}, make_shape(n, k, 1));
    args.mainloop.ptr_B = static_cast<const cutlass::half_t*>(x);
    args.mainloop.dB = cutlass::make_cute_packed_stride(StrideB{}, make_shape(m, k, 1));
    args.mainloop.ptr_L = static_cast<const uint8_t*>(lower);
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = cutlass::make_cute_packed_stride(StrideD{}, make_shape(n, m, 1));
    args.epilogue.ptr_D = static_cast<cutlass::half_t*>(y);
    args.epilogue.dD = cutlass::make_cute_packed_stride(StrideD{}, make_shape(n, m, 1));
    args.hw_info.sm_count = sm_count;

    return jaxlp::run_cutlass<Gemm>("jaxlp cutlass nestedfp gemm", args, &scratch, stream);
  }
};

// Plain FP16 GEMM y = x @ w^T on CUTLASS's own SS mainloop with the NestedFP kernels' operand order
// and epilogue: the baseline that isolates what the byte planes and their merge cost.
template <int kTileN, int kTileM>
struct Fp16Gemm {
  using TileShape = Shape<Int<kTileN>, Int<kTileM>, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::ColumnMajor;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, 8, cutlass::half_t, LayoutD, 8,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::half_t, LayoutA, 8, cutlass::half_t, LayoutB, 8,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static ffi::Error run(cudaStream_t stream, const void* x, const void* w, void* y, int m, int n, int k, int sms) {
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {n, m, k, 1};
    args.mainloop.ptr_A = static_cast<const cutlass::half_t*>(w);
    args.mainloop.dA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(n, k, 1));
    args.mainloop.ptr_B = static_cast<const cutlass::half_t*>(x);
    args.mainloop.dB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(m, k, 1));
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.dC = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(n, m, 1));
    args.epilogue.ptr_D = static_cast<cutlass::half_t*>(y);
    args.epilogue.dD = args.epilogue.dC;
    args.hw_info.sm_count = sms;
    return jaxlp::run_cutlass<Gemm>("jaxlp cutlass fp16 gemm", args, nullptr, stream);
  }
};

using cutlass::gemm::PersistentScheduler;
using cutlass::gemm::StreamKScheduler;
using Cooperative = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CooperativeEpilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Pingpong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingpongEpilogue = cutlass::epilogue::TmaWarpSpecialized;

// The compiled kernels (index = the `config` attribute; jaxlp/ffi/cutlass_gemm.py's
// NESTEDFP_CONFIGS names them in this order): schedule, tile features x tokens (x 64 K), cluster
// features x tokens, stages, tile scheduler, merged into shared memory (else registers).
ffi::Error dispatch(int config, cudaStream_t stream, ffi::ScratchAllocator& scratch, const void* x, const void* upper,
                    const void* lower, void* y, int m, int n, int k, int sms) {
#define JAXLP_CASE(INDEX, ...) \
  case INDEX:                  \
    return NestedFp16Gemm<__VA_ARGS__>::run(stream, scratch, x, upper, lower, y, m, n, k, sms);
  switch (config) {
    JAXLP_CASE(0, Cooperative, CooperativeEpilogue, 128, 128, 1, 1, 5, PersistentScheduler, Merge::kRegisters)
    JAXLP_CASE(1, Pingpong, PingpongEpilogue, 64, 128, 1, 1, 6, PersistentScheduler, Merge::kRegisters)
    JAXLP_CASE(2, Cooperative, CooperativeEpilogue, 128, 64, 1, 1, 7, PersistentScheduler, Merge::kRegisters)
    JAXLP_CASE(3, Cooperative, CooperativeEpilogue, 128, 128, 1, 1, 5, StreamKScheduler, Merge::kRegisters)
    JAXLP_CASE(4, Cooperative, CooperativeEpilogue, 128, 256, 1, 1, 4, PersistentScheduler, Merge::kTransformWarp)
    JAXLP_CASE(5, Cooperative, CooperativeEpilogue, 128, 256, 1, 1, 4, StreamKScheduler, Merge::kTransformWarp)
    default:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "jaxlp cutlass nestedfp gemm: unknown config " + std::to_string(config));
  }
#undef JAXLP_CASE
}


ffi::Error Impl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<ffi::F16> x, ffi::Buffer<ffi::U8> upper,
                ffi::Buffer<ffi::U8> lower, ffi::Result<ffi::Buffer<ffi::F16>> y, int64_t config) {
  auto xd = x.dimensions(), ud = upper.dimensions(), ld = lower.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || ud.size() != 2 || ld.size() != 2 || xd[1] != ud[1] || ud[0] != ld[0] || ud[1] != ld[1])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxlp cutlass nestedfp gemm: x must be [M, K], upper and lower [N, K]");
  int64_t m = xd[0], k = xd[1], n = ud[0];
  if (yd.size() != 2 || yd[0] != m || yd[1] != n)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp cutlass nestedfp gemm: y must be [M, N]");
  if (k % 16 || n % 8 || k <= 0 || n <= 0 || m >= (1ll << 31) || n >= (1ll << 31) || k >= (1ll << 31))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxlp cutlass nestedfp gemm: needs K a multiple of 16 and N of 8, got M=" + std::to_string(m) +
                          " N=" + std::to_string(n) + " K=" + std::to_string(k));
  if (m == 0) return ffi::Error::Success();
  return dispatch(static_cast<int>(config), stream, scratch, x.untyped_data(), upper.untyped_data(),
                  lower.untyped_data(), y->untyped_data(), m, n, k, jaxlp::cutlass_sm_count());
}

ffi::Error Fp16Impl(cudaStream_t stream, ffi::Buffer<ffi::F16> x, ffi::Buffer<ffi::F16> w,
                    ffi::Result<ffi::Buffer<ffi::F16>> y, int64_t config) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || xd[1] % 8 || wd[0] % 8)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxlp cutlass fp16 gemm: x [M, K] and w [N, K] with K and N multiples of 8");
  int m = static_cast<int>(xd[0]), k = static_cast<int>(xd[1]), n = static_cast<int>(wd[0]);
  if (m == 0) return ffi::Error::Success();
  const void *xp = x.untyped_data(), *wp = w.untyped_data();
  int sms = jaxlp::cutlass_sm_count();
  if (config == 0) return Fp16Gemm<128, 256>::run(stream, xp, wp, y->untyped_data(), m, n, k, sms);
  if (config == 1) return Fp16Gemm<128, 128>::run(stream, xp, wp, y->untyped_data(), m, n, k, sms);
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp cutlass fp16 gemm: unknown config");
}

}  // namespace jaxlp_cutlass_nestedfp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpCutlassFp16Gemm, jaxlp_cutlass_nestedfp::Fp16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // w [N, K]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // y [M, N]
                                  .Attr<int64_t>("config"),      // 0: 128 x 256 tiles, 1: 128 x 128
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpCutlassNestedFp16Gemm, jaxlp_cutlass_nestedfp::Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::Buffer<ffi::F16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // upper [N, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // lower [N, K]
                                  .Ret<ffi::Buffer<ffi::F16>>()  // y [M, N]
                                  .Attr<int64_t>("config"),
                              {ffi::Traits::kCmdBufferCompatible});
