// The interface between the NVFP4 kernel files (nvfp4_quantize.cu, nvfp4_gemv.cu, nvfp4_pipe.cu,
// nvfp4_gemm.cu) and the XLA FFI handlers of nvfp4_ffi.cu, which are compiled separately and linked
// into one library: constants, launch parameters, and the host-side launchers each kernel file
// defines (explicitly instantiated there for BF16 and FP32 activations, T = __nv_bfloat16, float).
// An overview of the kernels is at the top of nvfp4_ffi.cu.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>

#include <cstdint>

namespace jaxlp_nvfp4 {

constexpr int kChunkK = 256;   // k per warp step (4 threads x 64 k)
constexpr int kMaxKSplit = 8;  // warps per CTA at most
constexpr int kMaxM = 32;

enum ActMode : int { kA16 = 0, kA4 = 1, kProbe = 2 };  // kProbe: W4A16 staging, weights loaded, no math

// The weight formats of pipe_kernel's BF16 decode ("pipe"). Every one stores E2M1-like codes, two per
// byte (even k in the low nibble); they differ in the block decode:
// kNvfp4: E2M1 codes, E4M3 scales per 16 (wscale [N, K/16]) and the tensor scale g_w.
// kMxfp4: E2M1 codes, E8M0 scales per 32 (wscale [N, K/32]: 2^(byte - 127)).
// kDialect: DialectFP4 (BlockDialect): sign + 3-bit index per code into the 8 magnitudes (half units)
//   of the block's dialect (wdialect [N, K/64], two 4-bit ids per byte, block 2i in the low nibble),
//   times 2^(byte - 18) per 32 (wscale [N, K/32], the 5-bit exponent codes).
// MXFP4 and DialectFP4 decode by a table lookup (decode_word_lut), MXFP4's table being E2M1's.
enum WeightFormat : int { kFmtNvfp4 = 0, kFmtMxfp4 = 1, kFmtDialect = 2 };

// Parameters of gemv_kernel (nvfp4_gemv.cu); the FP16 staging kernels (nvfp4_quantize.cu) write its
// x_eff and xs.
struct GemvParams {
  const uint8_t* wdata;   // [N, K/2]
  const uint8_t* wscale;  // [N, K/16]
  const float* wg;        // g_w
  const float* xg;        // g_x (W4A4)
  const uint16_t* xeff;   // [M, Kp] FP16
  const float* xs;        // [M, Kp/256] (W4A16)
  void* y;                // [M, N]
  int M, N, K, Kp;
  int vec16;  // 1: rows 16-byte aligned (K % 32 == 0), 128-bit loads; 0: 64-bit loads (K % 32 == 16)
  int scale32;  // 1: scale rows 4-byte aligned (K % 64 == 0), one 32-bit load per 4 blocks
  int xg_amax;  // 1: xg holds the activations' calibrated amax (see act_scale)
};

// Parameters of pipe_kernel (nvfp4_pipe.cu) and gemm_kernel (nvfp4_gemm.cu).
struct PipeParams {
  const uint8_t* wdata;             // [N, K/2]
  const uint8_t* wscale;            // [N, K/16]
  const float* wg;                  // g_w
  const float* xg;                  // g_x (W4A4) or nullptr
  const __nv_bfloat16* x;           // [M, K] BF16: x (W4A16) or x_eff (W4A4); kDecBF16 only
  const uint16_t* xh;               // [M, Kp] FP16 x_eff of the regs staging kernels; kDecF16 / kDecProbe
  const float* xs;                  // [M, Kp/256] W4A16 chunk scales of xh, or nullptr (W4A4)
  void* y;                          // [M, N]
  int M, N, K, Kp, tiles, chunks;
  int xg_amax;  // 1: xg holds the activations' calibrated amax (see act_scale)
  const uint8_t* wdialect;  // kFmtDialect: dialect ids [N, K/64], two per byte
  const uint8_t* tables;    // kFmtDialect: [16][16] bytes, dialect_tables() of the formatbook
};

// Variants of the M <= 8 GEMVs (GemvConfig fields; 0 / 1 = the kernel's default):
// blocks: regs, CTAs per SM of its register budget (3: the "B3" variant, R = 1);
// acc: regs and pipe16, MMA chains per item (2: "A2"); stages: pipe16 ring stages (2: "S2").
struct GemvVariant {
  int blocks = 0, acc = 1, stages = 0;
  bool is_default() const { return blocks == 0 && acc == 1 && stages == 0; }
};

// nvfp4_quantize.cu: the activation staging kernels and the standalone quantizer.
// Stage x into the FP16 x_eff (and, W4A16 or the probe, the chunk scales xs) of p for the regs and
// pipe16 GEMVs: stage_a16_kernel (W4A16, probe) or stage_a4_kernel (W4A4). The launch's error.
template <typename T>
cudaError_t stage_f16(cudaStream_t stream, int mode, const T* x, const float* xg, const GemvParams& p);
// W4A4 of pipe_kernel and gemm_kernel: quantize x [M, K] into the BF16 x_eff workspace [M, K]. The
// launch's error.
template <typename T>
cudaError_t stage_bf16(cudaStream_t stream, const T* x, const float* xg, uint16_t* xeff, int M, int K, int xg_amax);
// The standalone quantizer: codes and scales only (no x_eff), `lanes` (1, 2, 4) threads per 16-element
// block.
template <typename T>
void launch_quantize(cudaStream_t stream, const T* x, const float* g, uint8_t* codes, uint8_t* scales, int M, int K,
                     int lanes);

// nvfp4_gemv.cu: gemv_kernel ("regs") on the staged x_eff, launched with PDL after the staging
// kernel when `pdl`.
template <typename T>
cudaError_t run_regs(cudaStream_t stream, int mode, const GemvParams& p, int rows_per_warp, int ksplit, bool pdl,
                     GemvVariant v);

// nvfp4_pipe.cu: pipe_kernel with BF16 decode ("pipe") on p.x, and with the FP16 decode ("pipe16") on
// the x_eff / xs workspaces of g that stage_f16 just wrote.
template <typename T>
cudaError_t run_pipe(cudaStream_t stream, const PipeParams& p, int rows, int split, bool pdl);
// The "pipe" kernel on MXFP4 (fmt = kFmtMxfp4) or DialectFP4 (kFmtDialect) weights and BF16 p.x
// (W4A16, or the x_eff of stage_block_fp4); no tensor scales. T: the output. pdl: launched after
// the staging kernel with programmatic dependent launch.
template <typename T>
cudaError_t run_pipe_block_fp4(cudaStream_t stream, const PipeParams& p, int fmt, int rows, int split, bool pdl);
template <typename T>
cudaError_t run_pipe16(cudaStream_t stream, int mode, const GemvParams& g, int rows, int split, bool pdl,
                       GemvVariant v);

// nvfp4_gemm.cu: gemm_kernel with block_n x block_m CTA tiles, split-K over `split` CTAs, on p.x.
template <typename T>
cudaError_t run_gemm(cudaStream_t stream, const PipeParams& p, int block_m, int block_n, int split, bool pdl);
// The same on MXFP4 / DialectFP4 weights (fmt), p.wscale holding the packed per-stage metadata.
template <typename T>
cudaError_t run_gemm_block_fp4(cudaStream_t stream, const PipeParams& p, int fmt, int block_m, int block_n,
                               int split, bool pdl);
// nvfp4_quantize.cu: W4A4 of the MXFP4 / DialectFP4 matmuls: x [M, K] quantized per 32-element block in
// the act_fmt format (kFmtMxfp4, kFmtDialect: two-stage selection with the tables `sel`) and written
// decoded to the BF16 x_eff [M, K]. The launch's error.
cudaError_t stage_block_fp4(cudaStream_t stream, int act_fmt, const __nv_bfloat16* x, const float* sel,
                            __nv_bfloat16* xeff, int M, int K);
// block_fp4_decode.cu: MXFP4 / DialectFP4 weights [n, k] (codes, scale bytes [n, k/32], dialect ids
// [n, k/64], tables) decoded to BF16 `out` [n, k], exact. The launch's error.
cudaError_t decode_block_fp4(cudaStream_t stream, int fmt, const uint8_t* codes, const uint8_t* scales,
                             const uint8_t* dialects, const uint8_t* tables, __nv_bfloat16* out, int64_t n, int64_t k);

}  // namespace jaxlp_nvfp4
