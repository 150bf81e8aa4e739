// Per-token FP8 (E4M3) activation quantizers of the FP8 GEMMs in one pass (XLA FFI custom calls,
// sm_90); Python side: jaxlp/ffi/fp8_activations.py.
//
//   token:   scale[m] = amax == 0 ? 1 : max(amax / 448, 2^-126)        (jaxlp.formats.fp8,
//            codes[m, k] = e4m3(clip(x[m, k] / scale[m], -448, 448))    granularity="token")
//   nested:  scale[m] = clip(313.6f / max(amax, 1e-5f), 0.1, 50)       (jaxlp.quantization.
//            codes[m, k] = e4m3(clip(x[m, k] * scale[m], -448, 448))    activations.nestedfp_fp8)
//   fireq:   scale[m] = amax / 448                                       (jaxlp.formats.int4_fp8.
//            codes[m, k] = e4m3(clip(x[m, k] / d[m], -448, 448))         quantize_activation_fp8,
//            d = scale where XLA:CPU sees it positive, else 1 (zero,     before its BF16 scale)
//            NaN, and float32-subnormal scales, which it flushes)
//
// with amax = max_k |x[m, k]| in float32, x bfloat16, float16 or float32, bit for bit what XLA:CPU
// computes for the references (their divisions are IEEE-correctly rounded there: exact_divide, and
// XLA:CPU's own division): __fdiv_rn / __fmul_rn, then cvt.rn.satfinite.e4m3x2.f32, whose
// saturation is the clip (|q| > 448 -> +-448, +-inf -> +-448, NaN -> NaN).
//
// XLA:CPU runs with denormals flushed (FTZ/DAZ), which the references' results show: a float32
// subnormal |x| counts as 0 in the amax (a row of zeros and subnormals gets scale 1), and
// exact_divide turns a subnormal x into a signed zero. The kernel flushes the same way (only
// bfloat16 and float32 inputs can be float32-subnormal; float16 subnormals are normal floats).
// The amax is an integer max over the float32 bits of |x|, which propagates NaN like XLA's max
// (a NaN row gets scale NaN, written as 0x7FC00000 as XLA:CPU writes it).
// NaN codes: the references give 0x7F or 0xFF depending on the host CPU's NaN propagation (x86:
// inf / inf is the negative default NaN); the kernel writes the NaN code cvt gives. Only the sign
// bit of NaN codes may differ.
//
// Layout: ROW_THREADS threads own one row (32: a warp, 8 rows per CTA of 256; more: one row per
// CTA). Each thread loads ITEMS vectors of 16 bytes (8 bfloat16/float16 or 4 float32; vector j of
// the row is held by thread j % ROW_THREADS), all loads issued before any use, and keeps them in
// registers as raw bits between the amax and the quantize step: the row is read from memory once.
// The amax is reduced with __vmaxu2 over packed 16-bit |x| bits, then redux.sync across the warp
// and through shared memory across warps. Codes go out as 8 (4 for float32) bytes per vector.
// Rows longer than 8 * 16 * 1024 bytes (K > 65536 for 16-bit inputs), or rows whose K is not a
// multiple of the vector (or misaligned buffers), use the streaming variant (ITEMS = 0): the
// amax pass and the quantize pass each read the row (the second read mostly hits L2).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "launch.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxlp_fp8act {

enum Mode : int { kToken = 0, kNested = 1, kFireq = 2 };

constexpr uint32_t kMinNormalBits = 0x00800000u;  // 2^-126: below it a float32 is subnormal (flushed)
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kNanBits = 0x7FC00000u;  // the NaN scale XLA:CPU writes
constexpr float kE4m3Max = 448.0f;
constexpr uint32_t kScaleMinBits = 0x00800000u;     // fp8.SCALE_MIN = 2^-126
constexpr uint32_t kNestedNumBits = 0x439CCCCDu;    // float32(0.7 * 448.0) = 313.6f
constexpr uint32_t kNestedFloorBits = 0x3727C5ACu;  // float32(1e-5)
constexpr uint32_t kNestedLoBits = 0x3DCCCCCDu;     // float32(0.1)
constexpr float kNestedHi = 50.0f;
constexpr int kWarpRowsPerCta = 8;  // rows per CTA when a warp owns a row (256 threads)

// VEC consecutive elements of a row as raw bits: 16 bytes (VEC = 16 / sizeof(T)) or one element.
template <typename T, int VEC>
struct Chunk {
  static constexpr int kBytes = VEC * static_cast<int>(sizeof(T));
  static_assert(kBytes == 16 || VEC == 1, "a chunk is 16 bytes or one element");
  static constexpr int kWords = kBytes >= 4 ? kBytes / 4 : 1;
  uint32_t w[kWords];
};

template <typename T, int VEC>
__device__ __forceinline__ Chunk<T, VEC> load_chunk(const T* p) {
  Chunk<T, VEC> c;
  if constexpr (Chunk<T, VEC>::kBytes == 16) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    c.w[0] = u.x; c.w[1] = u.y; c.w[2] = u.z; c.w[3] = u.w;
  } else if constexpr (sizeof(T) == 4) {
    c.w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  } else {
    c.w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));  // in the low half
  }
  return c;
}

// Element i of a chunk as a float (exact).
template <typename T, int VEC>
__device__ __forceinline__ float element(const Chunk<T, VEC>& c, int i) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(c.w[i]);
  } else {
    const uint32_t word = c.w[i / 2];
    const uint32_t half = (i & 1) ? (word >> 16) : (word & 0xFFFFu);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return __uint_as_float(half << 16);
    } else {
      return __half2float(__ushort_as_half(static_cast<unsigned short>(half)));
    }
  }
}

// Running max of |x| over a chunk in the type's own bits: for 16-bit types two packed halves
// (the ordering of |x|'s bits is that of the values, NaN above inf), for float32 one word.
template <typename T, int VEC>
__device__ __forceinline__ uint32_t abs_max(uint32_t acc, const Chunk<T, VEC>& c) {
#pragma unroll
  for (int i = 0; i < Chunk<T, VEC>::kWords; ++i) {
    if constexpr (sizeof(T) == 4) {
      acc = max(acc, c.w[i] & 0x7FFFFFFFu);
    } else {
      acc = __vmaxu2(acc, c.w[i] & 0x7FFF7FFFu);
    }
  }
  return acc;
}

// A thread's running max as the float32 bits of |x|, subnormals flushed to 0.
template <typename T>
__device__ __forceinline__ uint32_t finish_abs_max(uint32_t acc) {
  uint32_t bits;
  if constexpr (sizeof(T) == 4) {
    bits = acc;
  } else {
    const uint32_t h = max(acc & 0xFFFFu, acc >> 16);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      bits = h << 16;
    } else {
      bits = __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
    }
  }
  return bits < kMinNormalBits ? 0u : bits;
}

// The row's scale from the float32 bits of its amax (subnormals flushed); NaN as 0x7FC00000.
template <int MODE>
__device__ __forceinline__ float row_scale(uint32_t amax_bits) {
  if constexpr (MODE == kFireq) {  // the divisor: where(scale > 0, scale, 1) with subnormals flushed
    const float s = __fdiv_rn(__uint_as_float(amax_bits), kE4m3Max);
    return amax_bits > kInfBits || s < __uint_as_float(kScaleMinBits) ? 1.0f : s;
  }
  if (amax_bits > kInfBits) return __uint_as_float(kNanBits);
  const float amax = __uint_as_float(amax_bits);
  if constexpr (MODE == kToken) {
    if (amax_bits == 0) return 1.0f;
    const float s = __fdiv_rn(amax, kE4m3Max);  // inf stays inf
    const float lo = __uint_as_float(kScaleMinBits);
    return s < lo ? lo : s;
  } else {
    const float floor = __uint_as_float(kNestedFloorBits);
    const float s = __fdiv_rn(__uint_as_float(kNestedNumBits), amax < floor ? floor : amax);
    const float lo = __uint_as_float(kNestedLoBits);
    return s < lo ? lo : (s > kNestedHi ? kNestedHi : s);
  }
}

// The scale written for the row: row_scale's, except FireQ's, amax / 448 (0 for a zero row, NaN
// for a NaN row), whose codes were divided by 1 where it is not positive as XLA:CPU sees it (zero,
// NaN, or float32-subnormal: flushed).
template <int MODE>
__device__ __forceinline__ float stored_scale(float s, uint32_t amax_bits) {
  if constexpr (MODE == kFireq) {
    return amax_bits > kInfBits ? __uint_as_float(kNanBits) : __fdiv_rn(__uint_as_float(amax_bits), kE4m3Max);
  }
  return s;
}

// The float that the cast rounds: x / s (x flushed to a signed zero when subnormal, as
// exact_divide does) or x * s.
template <typename T, int MODE>
__device__ __forceinline__ float scaled(float x, float s) {
  if constexpr (MODE != kNested) {
    if constexpr (!std::is_same_v<T, __half>) {  // float16 values are never float32-subnormal
      const uint32_t b = __float_as_uint(x);
      if ((b & 0x7FFFFFFFu) < kMinNormalBits) x = __uint_as_float(b & 0x80000000u);
    }
    return __fdiv_rn(x, s);
  } else {
    return __fmul_rn(x, s);
  }
}

// Two E4M3 codes (lo in the low byte): round to nearest even, |q| > 448 and +-inf saturate to
// +-448, NaN -> NaN.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

template <typename T, int VEC, int MODE>
__device__ __forceinline__ void quantize_store(const Chunk<T, VEC>& c, float s, uint8_t* dst) {
  if constexpr (VEC == 1) {
    *dst = static_cast<uint8_t>(e4m3x2(scaled<T, MODE>(element(c, 0), s), 0.0f));
  } else {
    uint32_t word[VEC / 4];
#pragma unroll
    for (int i = 0; i < VEC / 4; ++i) {
      const uint32_t a = e4m3x2(scaled<T, MODE>(element(c, 4 * i), s), scaled<T, MODE>(element(c, 4 * i + 1), s));
      const uint32_t b =
          e4m3x2(scaled<T, MODE>(element(c, 4 * i + 2), s), scaled<T, MODE>(element(c, 4 * i + 3), s));
      word[i] = a | (b << 16);
    }
    if constexpr (VEC == 8) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(word[0], word[1]);
    } else {
      *reinterpret_cast<uint32_t*>(dst) = word[0];
    }
  }
}

// Max of the row's ROW_THREADS threads' values (all of them call it; one row per CTA when
// ROW_THREADS > 32).
template <int ROW_THREADS>
__device__ __forceinline__ uint32_t row_max(uint32_t v) {
  v = __reduce_max_sync(0xFFFFFFFFu, v);
  if constexpr (ROW_THREADS > 32) {
    constexpr int kWarps = ROW_THREADS / 32;
    __shared__ uint32_t warp_max[kWarps];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_max[warp] = v;
    __syncthreads();
    v = __reduce_max_sync(0xFFFFFFFFu, lane < kWarps ? warp_max[lane] : 0u);
  }
  return v;
}

// One row per ROW_THREADS threads. ITEMS > 0: the row (at most ROW_THREADS * ITEMS chunks) is
// held in registers; ITEMS == 0: streamed twice. K is a multiple of VEC.
template <typename T, int VEC, int ROW_THREADS, int ITEMS, int MODE>
__global__ void __launch_bounds__(ROW_THREADS > 32 ? ROW_THREADS : 32 * kWarpRowsPerCta)
    quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ codes, float* __restrict__ scale, int M, int K) {
  static_assert(ROW_THREADS % 32 == 0 && ROW_THREADS <= 1024, "whole warps per row");
  constexpr int kRowsPerCta = ROW_THREADS == 32 ? kWarpRowsPerCta : 1;
  const int t = ROW_THREADS == 32 ? (threadIdx.x & 31) : threadIdx.x;
  const int row = blockIdx.x * kRowsPerCta + (ROW_THREADS == 32 ? (threadIdx.x >> 5) : 0);
  if (row >= M) return;  // a whole warp (kRowsPerCta > 1) or the whole CTA leaves
  const int chunks = K / VEC;
  const T* xr = x + static_cast<int64_t>(row) * K;
  uint8_t* cr = codes + static_cast<int64_t>(row) * K;
  uint32_t acc = 0;
  if constexpr (ITEMS > 0) {
    Chunk<T, VEC> c[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int j = i * ROW_THREADS + t;
      if (j < chunks) {
        c[i] = load_chunk<T, VEC>(xr + j * VEC);
      } else {
#pragma unroll
        for (int w = 0; w < Chunk<T, VEC>::kWords; ++w) c[i].w[w] = 0u;
      }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) acc = abs_max<T, VEC>(acc, c[i]);
    const uint32_t amax = row_max<ROW_THREADS>(finish_abs_max<T>(acc));
    const float s = row_scale<MODE>(amax);
    if (t == 0) scale[row] = stored_scale<MODE>(s, amax);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int j = i * ROW_THREADS + t;
      if (j < chunks) quantize_store<T, VEC, MODE>(c[i], s, cr + j * VEC);
    }
  } else {
#pragma unroll 4
    for (int j = t; j < chunks; j += ROW_THREADS) acc = abs_max<T, VEC>(acc, load_chunk<T, VEC>(xr + j * VEC));
    const uint32_t amax = row_max<ROW_THREADS>(finish_abs_max<T>(acc));
    const float s = row_scale<MODE>(amax);
    if (t == 0) scale[row] = stored_scale<MODE>(s, amax);
#pragma unroll 4
    for (int j = t; j < chunks; j += ROW_THREADS)
      quantize_store<T, VEC, MODE>(load_chunk<T, VEC>(xr + j * VEC), s, cr + j * VEC);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

template <typename T, int VEC, int ROW_THREADS, int ITEMS, int MODE>
cudaError_t launch(cudaStream_t stream, const T* x, uint8_t* codes, float* scale, int M, int K) {
  constexpr int kRowsPerCta = ROW_THREADS == 32 ? kWarpRowsPerCta : 1;
  const dim3 grid((M + kRowsPerCta - 1) / kRowsPerCta);
  const dim3 block(ROW_THREADS * kRowsPerCta);
  return jaxlp::launch_kernel(quantize_kernel<T, VEC, ROW_THREADS, ITEMS, MODE>, grid, block, 0, stream, 1, false,
                              x, codes, scale, M, K);
}

// Threads per row and chunks per thread for a row of `chunks` 16-byte chunks (the table
// jaxlp/ffi/fp8_activations.py's LAYOUTS mirrors).
template <typename T, int MODE>
cudaError_t dispatch(cudaStream_t stream, const T* x, uint8_t* codes, float* scale, int M, int K) {
  constexpr int V = 16 / sizeof(T);
  const bool vector = K % V == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(codes) % V == 0;
  if (!vector) return launch<T, 1, 256, 0, MODE>(stream, x, codes, scale, M, K);
  const int c = K / V;
  if (c <= 32) return launch<T, V, 32, 1, MODE>(stream, x, codes, scale, M, K);
  if (c <= 64) return launch<T, V, 32, 2, MODE>(stream, x, codes, scale, M, K);
  if (c <= 128) return launch<T, V, 32, 4, MODE>(stream, x, codes, scale, M, K);
  if (c <= 256) return launch<T, V, 64, 4, MODE>(stream, x, codes, scale, M, K);
  if (c <= 512) return launch<T, V, 128, 4, MODE>(stream, x, codes, scale, M, K);
  if (c <= 1024) return launch<T, V, 256, 4, MODE>(stream, x, codes, scale, M, K);
  if (c <= 2048) return launch<T, V, 512, 4, MODE>(stream, x, codes, scale, M, K);
  if (c <= 4096) return launch<T, V, 512, 8, MODE>(stream, x, codes, scale, M, K);
  if (c <= 8192) return launch<T, V, 1024, 8, MODE>(stream, x, codes, scale, M, K);
  return launch<T, V, 1024, 0, MODE>(stream, x, codes, scale, M, K);
}

inline ffi::Error bad(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxlp fp8 activations: " + msg);
}

template <int MODE>
ffi::Error Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> codes,
                ffi::Result<ffi::Buffer<ffi::F32>> scale) {
  const auto xd = x.dimensions(), cd = codes->dimensions(), sd = scale->dimensions();
  if (xd.size() != 2) return bad("expected x [M, K]");
  const int64_t m = xd[0], k = xd[1];
  const auto type = x.element_type();
  if (type != ffi::DataType::BF16 && type != ffi::DataType::F16 && type != ffi::DataType::F32)
    return bad("x must be bfloat16, float16 or float32");
  if (codes->element_type() != ffi::DataType::F8E4M3FN || cd.size() != 2 || cd[0] != m || cd[1] != k)
    return bad("codes must be float8_e4m3fn [M, K] like x");
  const bool scale_ok = MODE != kNested ? (sd.size() == 1 && sd[0] == m)
                                        : (sd.size() == 2 && sd[0] == m && sd[1] == 1);
  if (!scale_ok) return bad(MODE != kNested ? "scale must be float32 [M]" : "scale must be float32 [M, 1]");
  if (k < 1 || k > (int64_t{1} << 30) || m > (int64_t{1} << 31) - 1)
    return bad("K must be in [1, 2^30] and M below 2^31, got M=" + std::to_string(m) + ", K=" + std::to_string(k));
  if (m == 0) return ffi::Error::Success();
  uint8_t* c = static_cast<uint8_t*>(codes->untyped_data());
  float* s = scale->typed_data();
  const int M = static_cast<int>(m), K = static_cast<int>(k);
  cudaError_t e;
  if (type == ffi::DataType::BF16) {
    e = dispatch<__nv_bfloat16, MODE>(stream, static_cast<const __nv_bfloat16*>(x.untyped_data()), c, s, M, K);
  } else if (type == ffi::DataType::F16) {
    e = dispatch<__half, MODE>(stream, static_cast<const __half*>(x.untyped_data()), c, s, M, K);
  } else {
    e = dispatch<float, MODE>(stream, static_cast<const float*>(x.untyped_data()), c, s, M, K);
  }
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxlp fp8 activations launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace jaxlp_fp8act

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpFp8TokenQuantize, jaxlp_fp8act::Impl<jaxlp_fp8act::kToken>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x [M, K] bfloat16, float16 or float32
                                  .Ret<ffi::AnyBuffer>()          // codes [M, K] float8_e4m3fn
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // scale [M]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpNestedFp8Quantize, jaxlp_fp8act::Impl<jaxlp_fp8act::kNested>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x [M, K] bfloat16, float16 or float32
                                  .Ret<ffi::AnyBuffer>()          // codes [M, K] float8_e4m3fn
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // scale [M, 1]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlpFireqFp8Quantize, jaxlp_fp8act::Impl<jaxlp_fp8act::kFireq>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x [M, K] bfloat16, float16 or float32
                                  .Ret<ffi::AnyBuffer>()          // codes [M, K] float8_e4m3fn
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // scale [M] (float32, before BF16)
                              {ffi::Traits::kCmdBufferCompatible});
