// The k loop of CUTLASS's SM90 mixed-input mainloop (the register-sourced "RS" WGMMA), shared by
// jaxlp's mainloops built on it (cutlass_nestedfp_gemm.cu, cutlass_fireq_gemm.cu): per k tile, the
// stage's WGMMAs issued k-block by k-block with A from registers and B from shared memory, k-block
// b + 2's A bytes copied from shared memory to registers and k-block b + 1 converted while k-block
// b's WGMMA runs, at most K_BLOCK_MAX - 1 WGMMAs in flight, each stage released once its WGMMAs
// are done (the last one by the base's mma_tail). The mainloop gives what varies:
//   copy_kblock(k_block, stage)  shared memory -> registers of k-block k_block's A operand;
//   convert_kblock(k_block)      its registers -> the MMA's A fragment tCrA_mma(_, _, k_block);
//   tile_done(last)              after each k tile's WGMMAs are issued (last: the final one), e.g.
//                                to promote FP8 sums; it may wait for the WGMMAs and reset
//                                tiled_mma.accumulate_.
// Every WGMMA accumulates into `accum` (the first with ScaleOut::Zero).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/pipeline/pipeline.hpp"

namespace jaxlp {

template <int K_BLOCK_MAX, class Pipeline, class PipelineState, class TiledMma, class FragA, class FragB, class Accum,
          class CopyKblock, class ConvertKblock, class TileDone>
CUTLASS_DEVICE void rs_k_loop(Pipeline& pipeline, PipelineState smem_pipe_read, int k_tile_count, TiledMma& tiled_mma,
                              FragA& tCrA_mma, FragB& tCrB, Accum& accum, CopyKblock&& copy_kblock,
                              ConvertKblock&& convert_kblock, TileDone&& tile_done) {
  using namespace cute;
  constexpr int K_WAIT_MAX = cute::min(K_BLOCK_MAX - 1, 7);
  static_assert(K_BLOCK_MAX >= 4, "Consider increasing TileShapeK");

  auto issue = [&](int k_block, int stage) {  // k-block k_block's WGMMA on stage `stage`
    warpgroup_arrive();
    cute::gemm(tiled_mma, tCrA_mma(_, _, k_block), tCrB(_, _, k_block, stage), accum);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    warpgroup_commit_batch();
  };
  PipelineState smem_pipe_release = smem_pipe_read;
  tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  warpgroup_fence_operand(accum);

  cutlass::ConsumerToken barrier_token = {cutlass::BarrierStatus::WaitAgain};
  {  // first k tile
    barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    pipeline.consumer_wait(smem_pipe_read, barrier_token);
    const int read_stage = smem_pipe_read.index();
    ++smem_pipe_read;
    barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    copy_kblock(0, read_stage);
    copy_kblock(1, read_stage);
    convert_kblock(0);
    CUTLASS_PRAGMA_UNROLL
    for (int k_block = 0; k_block < K_BLOCK_MAX; ++k_block) {
      issue(k_block, read_stage);
      if (k_block < K_BLOCK_MAX - 2) copy_kblock(k_block + 2, read_stage);
      if (k_block < K_BLOCK_MAX - 1) convert_kblock(k_block + 1);
    }
    --k_tile_count;
    if (k_tile_count > 0) {
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      copy_kblock(0, smem_pipe_read.index());
      copy_kblock(1, smem_pipe_read.index());
      warpgroup_wait<K_WAIT_MAX>();
      convert_kblock(0);
    }
    tile_done(k_tile_count == 0);
  }
  if (k_tile_count == 0) return;

  warpgroup_fence_operand(accum);
  CUTLASS_PRAGMA_NO_UNROLL
  for (; k_tile_count > 1; --k_tile_count) {
    const int read_stage = smem_pipe_read.index();
    ++smem_pipe_read;
    warpgroup_fence_operand(accum);
    CUTLASS_PRAGMA_UNROLL
    for (int k_block = 0; k_block < K_BLOCK_MAX; ++k_block) {
      issue(k_block, read_stage);
      warpgroup_wait<K_WAIT_MAX>();  // K_BLOCK_MAX - 1 WGMMAs pending: the previous stage is read
      if (k_block == K_BLOCK_MAX - 1) {
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
      if (k_block == 0) barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
      if (k_block == K_BLOCK_MAX - 1) {
        pipeline.consumer_wait(smem_pipe_read, barrier_token);
        copy_kblock(0, smem_pipe_read.index());
        copy_kblock(1, smem_pipe_read.index());
        convert_kblock(0);
      } else {
        if (k_block < K_BLOCK_MAX - 2) copy_kblock(k_block + 2, read_stage);
        convert_kblock(k_block + 1);
      }
    }
    warpgroup_fence_operand(accum);
    tile_done(false);
  }

  warpgroup_fence_operand(accum);
  {  // last k tile
    const int read_stage = smem_pipe_read.index();
    warpgroup_fence_operand(accum);
    CUTLASS_PRAGMA_UNROLL
    for (int k_block = 0; k_block < K_BLOCK_MAX; ++k_block) {
      issue(k_block, read_stage);
      warpgroup_wait<K_WAIT_MAX>();
      if (k_block == K_BLOCK_MAX - 1) {
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
      if (k_block < K_BLOCK_MAX - 2) copy_kblock(k_block + 2, read_stage);
      if (k_block < K_BLOCK_MAX - 1) convert_kblock(k_block + 1);
    }
    tile_done(true);
  }
  warpgroup_fence_operand(accum);
}

}  // namespace jaxlp
