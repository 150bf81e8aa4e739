// decode_block_fp4_kernel: MXFP4 / DialectFP4 weights decoded to BF16 [N, K] (exact), for the
// dequantize-then-dot path of many tokens (jaxlp.quantization.block_fp4_dispatch.dequantize_dot).
// Four threads per 32-element block, one 8-code word each (a warp reads 128 and writes 512 contiguous
// bytes per access): the block's scale byte (E8M0 / exponent code) and, for DialectFP4, its dialect id
// select the table that decode_word_lut looks the codes up in, as the GEMV and GEMM do. Handler
// JaxlpBlockFp4Decode (nvfp4_ffi.cu).

#include <algorithm>

#include "nvfp4_common.cuh"

namespace jaxlp_nvfp4 {

template <int FMT>
__global__ void __launch_bounds__(256) decode_block_fp4_kernel(const uint8_t* __restrict__ codes,
                                                               const uint8_t* __restrict__ scales,
                                                               const uint8_t* __restrict__ dialects,
                                                               const uint8_t* __restrict__ tables,
                                                               __nv_bfloat16* __restrict__ out, int64_t blocks,
                                                               int row_blocks) {
  __shared__ uint4 tab_smem[16];
  if (FMT == kFmtDialect && threadIdx.x < 16)
    tab_smem[threadIdx.x] = reinterpret_cast<const uint4*>(tables)[threadIdx.x];
  __syncthreads();
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < 4 * blocks;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = u >> 2;  // the block; word u & 3 of it
    const uint32_t w = reinterpret_cast<const uint32_t*>(codes)[u];
    const uint32_t e = scales[b];
    uint32_t tab[4], scale2;
    if constexpr (FMT == kFmtMxfp4) {
      e2m1_table(tab);
      scale2 = mxfp4_scale2(e);
    } else {
      const int64_t row = b / row_blocks, col = b - row * row_blocks;
      const uint32_t id = (dialects[row * ((row_blocks + 1) / 2) + col / 2] >> (4 * (col & 1))) & 0xFu;
      const uint4 tv = tab_smem[id];
      tab[0] = tv.x;
      tab[1] = tv.y;
      tab[2] = tv.z;
      tab[3] = tv.w;
      scale2 = dialect_scale2(e);
    }
    uint32_t pair[4];
    decode_word_lut(w, tab, scale2, pair);
    reinterpret_cast<uint4*>(out)[u] = make_uint4(pair[0], pair[1], pair[2], pair[3]);
  }
}

cudaError_t decode_block_fp4(cudaStream_t stream, int fmt, const uint8_t* codes, const uint8_t* scales,
                             const uint8_t* dialects, const uint8_t* tables, __nv_bfloat16* out, int64_t n, int64_t k) {
  const int threads = 256;
  const int64_t blocks = n * (k / 32);
  int sms = 0, dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return e;
  const int64_t grid = std::min<int64_t>((4 * blocks + threads - 1) / threads, int64_t(sms) * 16);
  if (fmt == kFmtMxfp4) {
    decode_block_fp4_kernel<kFmtMxfp4><<<static_cast<unsigned>(grid), threads, 0, stream>>>(
        codes, scales, dialects, tables, out, blocks, static_cast<int>(k / 32));
  } else {
    decode_block_fp4_kernel<kFmtDialect><<<static_cast<unsigned>(grid), threads, 0, stream>>>(
        codes, scales, dialects, tables, out, blocks, static_cast<int>(k / 32));
  }
  return cudaGetLastError();
}

}  // namespace jaxlp_nvfp4
