// NestedFP's lossless FP16 reconstruction in registers, shared by the NestedFP GEMV
// (nestedfp_gemv.cu) and the CUTLASS NestedFP16 GEMM (cutlass_nestedfp_gemm.cu); the format is
// jaxlp.formats.nestedfp's. Four FP16 weights from their four upper and four lower bytes (byte i
// of each word is weight i) with one 32-bit merge and two byte permutes:
//   t = (((U - ((L & 0x80808080) >> 7)) >> 1) & 0x3F3F3F3F) | (U & 0x80808080),
//   (w0, w1) = prmt(L, t, 0x5140), (w2, w3) = prmt(L, t, 0x7362),
// each result word two FP16 values, weight 2i in its low half.
#pragma once

#include <cstdint>

namespace jaxlp {

__device__ __forceinline__ void nestedfp_merge4(uint32_t u, uint32_t l, uint32_t& w01, uint32_t& w23) {
  const uint32_t t = (((u - ((l & 0x80808080u) >> 7)) >> 1) & 0x3F3F3F3Fu) | (u & 0x80808080u);
  w01 = __byte_perm(l, t, 0x5140);
  w23 = __byte_perm(l, t, 0x7362);
}

}  // namespace jaxlp
