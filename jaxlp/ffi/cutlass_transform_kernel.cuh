// The transform design of jaxlp's CUTLASS GEMMs (cutlass_nestedfp_gemm.cu's co128x256t, co128x256skt):
// CUTLASS's cooperative kernel with the producer warpgroup's idle warps rebuilding weight tiles in
// shared memory (TransformKernel), and the consumers' k loop on them (transformed_k_loop).
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace jaxlp {

// 16-byte shared-memory load and store at a shared-state-space byte address (volatile: kept in
// order); cute's tensors address shared memory through 64-bit generic pointers (1.7x the
// instructions in the rebuilding warps, docs/perf.md session 30).
__device__ __forceinline__ void ld_shared_v4(uint32_t at, uint32_t (&v)[4]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(at));
}
__device__ __forceinline__ void st_shared_v4(uint32_t at, const uint32_t* v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
}

// The consumers' k loop on weight tiles the producer warpgroup rebuilt in shared memory: per k tile,
// the stage's TMA loads and its rebuilt tile (named barrier `stage_barrier + stage`, `stage_threads`
// threads: the rebuilding warps arrive, the consumers sync) awaited, the stage's WGMMAs (both
// operands from shared memory) issued into `accum` (the first with ScaleOut::Zero), one k tile in
// flight; a stage released once the next k tile's WGMMAs are issued and its own are done (the last
// by the mainloop's mma_tail). tile_done(last) runs after each k tile's WGMMAs (a hook, e.g. to promote
// FP8 sums: it may wait for them and reset tiled_mma.accumulate_).
template <class Pipeline, class PipelineState, class TiledMma, class FragW, class FragB, class Accum, class TileDone>
CUTLASS_DEVICE void transformed_k_loop(Pipeline& pipeline, PipelineState smem_pipe_read, int k_tile_count,
                                      TiledMma& tiled_mma, FragW& tCrW, FragB& tCrB, Accum& accum,
                                      uint32_t stage_threads, uint32_t stage_barrier, TileDone&& tile_done) {
  using namespace cute;
  PipelineState smem_pipe_release = smem_pipe_read;
  tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  warpgroup_fence_operand(accum);
  CUTLASS_PRAGMA_NO_UNROLL
  for (int k = 0; k < k_tile_count; ++k) {
    const int read_stage = smem_pipe_read.index();
    auto token = pipeline.consumer_try_wait(smem_pipe_read);
    pipeline.consumer_wait(smem_pipe_read, token);  // the stage's TMA loads
    cutlass::arch::NamedBarrier::sync(stage_threads, stage_barrier + read_stage);  // its rebuilt weights
    warpgroup_fence_operand(accum);
    warpgroup_arrive();
    CUTLASS_PRAGMA_UNROLL
    for (int k_block = 0; k_block < size<2>(tCrW); ++k_block) {
      cute::gemm(tiled_mma, tCrW(_, _, k_block, read_stage), tCrB(_, _, k_block, read_stage), accum);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // the previous k tile's WGMMAs are done: its stage is free
    warpgroup_fence_operand(accum);
    tile_done(k + 1 == k_tile_count);
    if (k > 0) {
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
    }
    ++smem_pipe_read;
  }
  warpgroup_fence_operand(accum);
}

// CUTLASS's cooperative warp-specialized kernel (`Base`: GemmUniversal, persistent or stream-K tile
// scheduler (the stream-K fixup as CUTLASS's kernel does it), no cluster, no C) with every warp of
// the producer warpgroup at work for a mainloop that rebuilds the weights into shared memory: warp 0
// issues the TMA loads (the mainloop's `load`, which may also rebuild a part), warps 1-3 run the
// mainloop's `transform(pipeline, state, k_tile_count, part, lane, tensors)` with part = 1..3;
// CUTLASS's kernel leaves warps 1 and 2 idle here and gives the producer warpgroup 40 registers a
// thread, this one 56 (the consumers 224 instead of 232). The consumer warpgroups and the epilogue
// are CUTLASS's, unchanged. Mainloop: cutlass_nestedfp_gemm.cu's NestedFp16Mainloop<., kTransformWarp>
// (the FP16 weights from their byte planes). (FireQ's INT4 codes decoded to E4M3 tiles this way
// measured 1.4-2.1x slower than its mixed-input kernels, docs/perf.md session 35; removed.)
template <class Base>
struct TransformKernel : Base {
  using typename Base::Params;
  using typename Base::SharedStorage;
  using typename Base::CollectiveMainloop;
  using typename Base::CollectiveEpilogue;
  using typename Base::TileScheduler;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  using typename Base::ClusterShape;
  using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
  using PipelineState = typename CollectiveMainloop::PipelineState;
  using EpiLoadPipeline = typename CollectiveEpilogue::LoadPipeline;
  using EpiStorePipeline = typename CollectiveEpilogue::StorePipeline;
  static constexpr uint32_t kLoadRegisters = 56, kMmaRegisters = 224;
  static_assert(Base::NumMMAThreads == 256 && size(ClusterShape{}) == 1 && !TileScheduler::IsDynamicPersistent);
  static_assert(std::is_void_v<typename CollectiveEpilogue::ElementC>, "no C: the epilogue loads nothing");

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
    using namespace cute;
    SharedStorage& shared_storage = *reinterpret_cast<SharedStorage*>(smem_buf);
    const int thread_idx = int(threadIdx.x), lane_idx = cutlass::canonical_lane_idx();
    const int warp_idx = cutlass::canonical_warp_idx_sync(), warp_group = cutlass::canonical_warp_group_idx();
    const int warp_in_group = warp_idx % cutlass::NumWarpsPerWarpGroup;
    const int mma_thread_idx = thread_idx % Base::NumMMAThreads;
    if (warp_idx == 0 && cute::elect_one_sync()) {
      CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);
      CollectiveEpilogue::prefetch_tma_descriptors(params.epilogue);
    }

    typename MainloopPipeline::Params mainloop_pipeline_params;
    if (warp_group == 0 && warp_in_group == 0)
      mainloop_pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    if (warp_group > 0) mainloop_pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    mainloop_pipeline_params.is_leader = thread_idx % cutlass::NumThreadsPerWarpGroup == 0;
    mainloop_pipeline_params.num_consumers = Base::NumMMAThreads;
    mainloop_pipeline_params.num_producers = CollectiveMainloop::NumProducerThreadEvents;
    mainloop_pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline mainloop_pipeline(shared_storage.pipelines.mainloop, mainloop_pipeline_params, ClusterShape{});

    typename EpiLoadPipeline::Params epi_load_pipeline_params;
    if (warp_group > 0) epi_load_pipeline_params.role = EpiLoadPipeline::ThreadCategory::Consumer;
    epi_load_pipeline_params.dst_blockid = cute::block_rank_in_cluster();
    epi_load_pipeline_params.producer_arv_count = cutlass::NumThreadsPerWarp;
    epi_load_pipeline_params.consumer_arv_count = Base::NumMMAThreads;
    if constexpr (CollectiveEpilogue::RequiresTransactionBytes)
      epi_load_pipeline_params.transaction_bytes = params.epilogue.tma_transaction_bytes;
    EpiLoadPipeline epi_load_pipeline(shared_storage.pipelines.epi_load, epi_load_pipeline_params);
    typename EpiStorePipeline::Params epi_store_pipeline_params;
    epi_store_pipeline_params.always_wait = true;
    EpiStorePipeline epi_store_pipeline(epi_store_pipeline_params);

    __syncthreads();  // the pipelines' barriers initialized, for every warp

    auto problem_shape_MNKL = append<4>(params.problem_shape, Int<1>{});
    TiledMma tiled_mma;
    auto blk_shape = TileShape{};
    TileScheduler scheduler{params.scheduler};
    CollectiveMainloop collective_mainloop;
    auto load_inputs = collective_mainloop.load_init(problem_shape_MNKL, params.mainloop);
    Tensor gA_mkl = get<0>(load_inputs);
    Tensor gB_nkl = get<1>(load_inputs);
    auto tile_coord = [&](auto const& work) {
      auto m_coord = idx2crd(work.M_idx, shape<2>(gA_mkl));
      auto n_coord = idx2crd(work.N_idx, shape<2>(gB_nkl));
      auto l_coord = idx2crd(work.L_idx, shape<4>(gB_nkl));
      return make_coord(m_coord, n_coord, _, l_coord);
    };
    auto work_tile_info = scheduler.initial_work_tile_info(ClusterShape{});

    if (warp_group == 0) {  // the producer warpgroup: loads (warp 0) and weights (all four)
      cutlass::arch::warpgroup_reg_dealloc<kLoadRegisters>();
      PipelineState state = cutlass::make_producer_start_state<MainloopPipeline>();
      while (work_tile_info.is_valid()) {
        if (!TileScheduler::valid_warpgroup_in_work_tile(work_tile_info)) {  // stream-K: no k tiles of its own
          work_tile_info = get<0>(scheduler.fetch_next_work(work_tile_info));
          continue;
        }
        auto k_tile_count = TileScheduler::get_work_k_tile_count(work_tile_info, problem_shape_MNKL, blk_shape);
        auto k_tile_start = TileScheduler::get_work_k_tile_start(work_tile_info);
        auto k_tile_iter = cute::make_coord_iterator(idx2crd(k_tile_start, shape<3>(gA_mkl)), shape<3>(gA_mkl));
        if (warp_in_group == 0)
          collective_mainloop.load(params.mainloop, mainloop_pipeline, state, load_inputs, tile_coord(work_tile_info),
                                   k_tile_iter, k_tile_count, lane_idx, 0, shared_storage.tensors.mainloop);
        else
          collective_mainloop.transform(mainloop_pipeline, state, k_tile_count, warp_in_group, lane_idx,
                                        shared_storage.tensors.mainloop);
        state.advance(k_tile_count);
        work_tile_info = get<0>(scheduler.fetch_next_work(work_tile_info));
      }
      if (warp_in_group == 0) collective_mainloop.load_tail(mainloop_pipeline, state);
    } else {  // the consumer warpgroups, as CUTLASS's cooperative kernel
      cutlass::arch::warpgroup_reg_alloc<kMmaRegisters>();
      CollectiveEpilogue collective_epilogue(params.epilogue, shared_storage.tensors.epilogue);
      PipelineState mainloop_pipe_consumer_state;
      typename CollectiveEpilogue::LoadPipelineState epi_load_pipe_consumer_state;
      auto epi_store_pipe_producer_state = cutlass::make_producer_start_state<EpiStorePipeline>();
      bool do_store_tail = false;
      while (work_tile_info.is_valid()) {
        auto blk_coord = tile_coord(work_tile_info);
        auto k_tile_count = TileScheduler::get_work_k_tile_count(work_tile_info, problem_shape_MNKL, blk_shape);
        auto accumulators = partition_fragment_C(tiled_mma, take<0, 2>(blk_shape));
        if (TileScheduler::valid_warpgroup_in_work_tile(work_tile_info)) {
          collective_mainloop.mma(mainloop_pipeline, mainloop_pipe_consumer_state, accumulators, k_tile_count,
                                  mma_thread_idx, shared_storage.tensors.mainloop, params.mainloop);
          collective_mainloop.mma_tail(mainloop_pipeline, mainloop_pipe_consumer_state, k_tile_count);
          mainloop_pipe_consumer_state.advance(k_tile_count);
        }
        // Stream-K: the partial tiles' sums reduced through the workspace (a no-op for persistent tiles).
        TileScheduler::fixup(params.scheduler, work_tile_info, accumulators, Base::NumMmaWarpGroups, warp_group - 1);
        if (TileScheduler::compute_epilogue(work_tile_info, params.scheduler)) {
          auto [epi_load_next, epi_store_next] = collective_epilogue.store(
              epi_load_pipeline, epi_load_pipe_consumer_state, epi_store_pipeline, epi_store_pipe_producer_state,
              problem_shape_MNKL, blk_shape, blk_coord, accumulators, tiled_mma, mma_thread_idx,
              shared_storage.tensors.epilogue, work_tile_info.reduction_subtile_idx());
          epi_load_pipe_consumer_state = epi_load_next;
          epi_store_pipe_producer_state = epi_store_next;
          do_store_tail = true;
        }
        work_tile_info = get<0>(scheduler.fetch_next_work(work_tile_info));
      }
      if (do_store_tail)
        collective_epilogue.store_tail(epi_load_pipeline, epi_load_pipe_consumer_state, epi_store_pipeline,
                                       epi_store_pipe_producer_state);
    }
  }
};

}  // namespace jaxlp
