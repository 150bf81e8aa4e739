// Device helpers shared by the NVFP4 kernels (nvfp4_gemv.cu, nvfp4_pipe.cu, nvfp4_gemm.cu,
// nvfp4_quantize.cu): PDL, activation loads, FP4 (E2M1) and E4M3 decoding to FP16 / BF16, mma.sync,
// cp.async and cluster primitives; and the host-side occupancy query of the persistent kernels.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "async_copy.cuh"
#include "nvfp4_kernels.cuh"

namespace jaxlp_nvfp4 {

// ---------------------------------------------------------------------------------------------
// Small device helpers

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}


// Activations: plain (coherent) loads that stay in L1; the next chunk is prefetched into L1.
__device__ __forceinline__ uint4 ld_act_v4(const void* p) {
  uint4 r;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// FP16x2 multiply, round to nearest, subnormals kept (no .ftz).
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Two E4M3 bytes (low byte first) -> FP16x2, exact.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
  uint32_t d;
  unsigned short s = static_cast<unsigned short>(two_bytes);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(s));
  return d;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// FP4 nibbles of a 32-bit word (n_j in bits 4j..4j+3) -> four FP16x2 pairs {n_i, n_{i+4}}, i = 0..3,
// each value e2m1(n) * 2^-14. The FP16 pattern of nibble n is ((n&8)<<12)|((n&7)<<9): a high byte
// (n&8)<<4 | (n&7)<<1 over a zero low byte. `even` holds that byte for the even nibbles (one per
// byte of w), `odd` for the odd ones; one PRMT per pair places two of them over zero low bytes.
__device__ __forceinline__ void decode_word(uint32_t w, uint32_t (&pair)[4]) {
  const uint32_t even = ((w << 4) & 0x80808080u) | ((w << 1) & 0x0E0E0E0Eu);
  const uint32_t odd = (w & 0x80808080u) | ((w >> 3) & 0x0E0E0E0Eu);
  pair[0] = prmt(even, 0u, 0x2404u);  // n0, n4
  pair[1] = prmt(odd, 0u, 0x2404u);   // n1, n5
  pair[2] = prmt(even, 0u, 0x3414u);  // n2, n6
  pair[3] = prmt(odd, 0u, 0x3414u);   // n3, n7
}

__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// The static NVFP4 tensor scale of activations from their calibrated amax, as
// jaxlp.quantization.nvfp4_dispatch.act_tensor_scale computes it: max(amax, 1e-12) / (6 * 448),
// correctly rounded, at least 2^-117. g_is_amax = 0: *g already is the tensor scale.
__device__ __forceinline__ float act_scale(const float* g, int g_is_amax) {
  if (!g_is_amax) return *g;
  return fmaxf(__fdiv_rn(fmaxf(*g, 1e-12f), 2688.0f), 0x1p-117f);
}

// ---------------------------------------------------------------------------------------------
// BF16 building blocks of pipe_kernel and gemm_kernel

// FP4 nibbles of a 32-bit word -> four BF16x2 pairs {n_i, n_{i+4}}, i = 0..3, each e2m1(n) * 2^-126:
// the BF16 pattern of nibble n is ((n&8)<<12)|((n&7)<<6) (sign; 2 exponent bits and 1 mantissa bit
// over exponent bias 127 instead of E2M1's 1; code 1 (0.5) becomes the subnormal 2^-127).
// Two shifts and two masks per pair.
__device__ __forceinline__ void decode_word_bf16(uint32_t w, uint32_t (&pair)[4]) {
  pair[0] = ((w << 12) & 0x80008000u) | ((w << 6) & 0x01C001C0u);
  pair[1] = ((w << 8) & 0x80008000u) | ((w << 2) & 0x01C001C0u);
  pair[2] = ((w << 4) & 0x80008000u) | ((w >> 2) & 0x01C001C0u);
  pair[3] = (w & 0x80008000u) | ((w >> 6) & 0x01C001C0u);
}

// BF16x2 multiply, round to nearest, subnormal inputs kept (BF16 arithmetic has no .ftz).
__device__ __forceinline__ uint32_t hmul2_bf16(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Two E4M3 bytes (low byte first) -> BF16x2 {e4m3(b0) * 2^119, e4m3(b1) * 2^119}, exact
// (448 * 2^119 < 2^128). Times a decoded nibble: e2m1 * e4m3 * 2^-7, in [2^-17, 21], exact.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2_scaled(uint32_t two_bytes) {
  const uint32_t h = e4m3x2_to_f16x2(two_bytes);
  const float lo = __half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xFFFFu))) * 0x1p119f;
  const float hi = __half2float(__ushort_as_half(static_cast<unsigned short>(h >> 16))) * 0x1p119f;
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

__device__ __forceinline__ void mma_16816_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Eight BF16 activations in natural order (one 16-byte load) -> the B pairs that meet decode_word_bf16's
// pairs: b[0] = (x0, x4), b[1] = (x1, x5), b[2] = (x2, x6), b[3] = (x3, x7).
__device__ __forceinline__ void act_pairs(const uint4& v, uint32_t (&b)[4]) {
  b[0] = prmt(v.x, v.z, 0x5410u);
  b[1] = prmt(v.x, v.z, 0x7632u);
  b[2] = prmt(v.y, v.w, 0x5410u);
  b[3] = prmt(v.y, v.w, 0x7632u);
}

// ---------------------------------------------------------------------------------------------
// Table decode of MXFP4 and DialectFP4 (WeightFormat kFmtMxfp4, kFmtDialect)

// A block's magnitude table: the BF16 patterns of its 8 magnitudes in half units (integers 0..15,
// exact in BF16), split into bytes: tab[0] = low bytes of entries 0..3 (entry i in byte i), tab[1]
// = low bytes of entries 4..7, tab[2] / tab[3] = the high bytes. MXFP4's is E2M1's {0, 0.5, 1, 1.5,
// 2, 3, 4, 6} = {0, 1, 2, 3, 4, 6, 8, 12} half units.
__device__ __forceinline__ void e2m1_table(uint32_t (&tab)[4]) {
  tab[0] = 0x40008000u;  // low bytes of 0, 1.0, 2.0, 3.0 (BF16 0x0000, 0x3F80, 0x4000, 0x4040)
  tab[1] = 0x4000C080u;  // low bytes of 4.0, 6.0, 8.0, 12.0 (0x4080, 0x40C0, 0x4100, 0x4140)
  tab[2] = 0x40403F00u;
  tab[3] = 0x41414040u;
}

// Eight codes of a 32-bit word (code j = sign << 3 | index in bits 4j..4j+3) -> four BF16x2 pairs in
// natural order {c0, c1}, {c2, c3}, {c4, c5}, {c6, c7}: each table[index] * scale with the code's sign.
// PRMT looks up four bytes at once (its selector nibbles are the indices, sign bits masked off); the
// signs go to bit 7 of the high bytes; two more PRMTs interleave low and high bytes into pairs.
__device__ __forceinline__ void decode_word_lut(uint32_t w, const uint32_t (&tab)[4], uint32_t scale2,
                                                uint32_t (&pair)[4]) {
  const uint32_t sel_a = w & 0x7777u, sel_b = (w >> 16) & 0x7777u;
  const uint32_t lo_a = prmt(tab[0], tab[1], sel_a), lo_b = prmt(tab[0], tab[1], sel_b);
  uint32_t hi_a = prmt(tab[2], tab[3], sel_a), hi_b = prmt(tab[2], tab[3], sel_b);
  // Bytes {b0, b0, b1, b1} of w (resp. {b2, b2, b3, b3}): the sign of code 2i is bit 3 of byte 2i
  // shifted to bit 7, the sign of code 2i+1 is already bit 7 of byte 2i+1.
  const uint32_t ya = prmt(w, 0u, 0x1100u), yb = prmt(w, 0u, 0x3322u);
  hi_a |= (((ya << 4) & 0x00800080u) | (ya & 0x80008000u));
  hi_b |= (((yb << 4) & 0x00800080u) | (yb & 0x80008000u));
  pair[0] = hmul2_bf16(prmt(lo_a, hi_a, 0x5140u), scale2);
  pair[1] = hmul2_bf16(prmt(lo_a, hi_a, 0x7362u), scale2);
  pair[2] = hmul2_bf16(prmt(lo_b, hi_b, 0x5140u), scale2);
  pair[3] = hmul2_bf16(prmt(lo_b, hi_b, 0x7362u), scale2);
}

// The BF16x2 {s, s} of an MXFP4 block's E8M0 byte b: s = 2^(b - 127) / 2 (the table is in half
// units), subnormal for b < 2 (BF16 keeps them).
__device__ __forceinline__ uint32_t mxfp4_scale2(uint32_t b) {
  const uint32_t s = b >= 2u ? (b - 1u) << 7 : 0x40u >> (1u - b);
  return s | (s << 16);
}

// The BF16x2 {s, s} of a DialectFP4 block's exponent code c (0..31): s = 2^(c - 18) / 2, normal.
__device__ __forceinline__ uint32_t dialect_scale2(uint32_t c) {
  const uint32_t s = (c + 108u) << 7;
  return s | (s << 16);
}

using jaxlp::cp_async16;  // shared-memory copies: async_copy.cuh
using jaxlp::cp_async4;
using jaxlp::cp_async_commit;
using jaxlp::cp_async_wait;
using jaxlp::smem_addr;

__device__ __forceinline__ uint4 ld_act_nc_v4(const void* p) {  // activations: read-only, kept in L1
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync_all() {  // every thread of every CTA of the cluster
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float ld_dsmem_f32(uint32_t local_addr, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_addr), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// ---------------------------------------------------------------------------------------------
// Host side of pipe_kernel and gemm_kernel

// Largest useful grid (resident CTAs, a multiple of the cluster size) of a kernel on the current
// device; also raises its dynamic shared-memory limit. Cached per (kernel, device).
inline cudaError_t resident_ctas(const void* kernel, int smem, int cluster, int* out) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int>, int> cache;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const auto key = std::make_tuple(kernel, dev, cluster);
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = cache.find(key);
    if (it != cache.end()) {
      *out = it->second;
      return cudaSuccess;
    }
  }
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  int n = 0;
  if (cluster == 1) {
    int per_sm = 0, sms = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, smem);
    if (e != cudaSuccess) return e;
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return e;
    n = per_sm * sms;
  } else {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(cluster * 64);
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
    if (e != cudaSuccess) return e;
    n = clusters * cluster;
  }
  if (n < cluster) return cudaErrorInvalidConfiguration;
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = n;
  *out = n;
  return cudaSuccess;
}

}  // namespace jaxlp_nvfp4
