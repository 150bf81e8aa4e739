// Host side shared by jaxlp's CUTLASS kernels (cutlass_fp8_gemm.cu, cutlass_nestedfp_gemm.cu): one
// CUTLASS device GEMM run on XLA's stream, its workspace (stream-K's partial tiles) from XLA's
// scratch allocator, CUTLASS's statuses as FFI errors naming the kernel.
#pragma once

#include <cuda_runtime.h>

#include <string>

// XLA's FFI headers before CUTLASS's (CUTLASS turns -Wmissing-field-initializers into an error).
#include "xla/ffi/api/ffi.h"
//
#include "cutlass/cutlass.h"

namespace jaxlp {

// The current device's SM count, asked once (CUTLASS's persistent schedulers size their grids by it).
inline int cutlass_sm_count() {
  static int count = [] {
    int device = 0, value = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device);
    return value;
  }();
  return count;
}

// Checks, initializes and launches `Gemm` (a cutlass::gemm::device::GemmUniversalAdapter) on `args`;
// `scratch` may be null for kernels that need no workspace.
template <class Gemm>
xla::ffi::Error run_cutlass(const std::string& name, typename Gemm::Arguments const& args,
                            xla::ffi::ScratchAllocator* scratch, cudaStream_t stream) {
  namespace ffi = xla::ffi;
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      name + ": CUTLASS cannot run this shape: " + cutlassGetStatusString(status));
  size_t workspace_bytes = Gemm::get_workspace_size(args);
  void* workspace = nullptr;
  if (workspace_bytes > 0) {
    auto buffer = scratch ? scratch->Allocate(workspace_bytes) : std::nullopt;
    if (!buffer.has_value()) return ffi::Error(ffi::ErrorCode::kResourceExhausted, name + ": no workspace");
    workspace = buffer.value();
  }
  status = gemm.initialize(args, workspace, stream);
  if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      name + ": " + cutlassGetStatusString(status) + ": " + cudaGetErrorString(cudaGetLastError()));
  return ffi::Error::Success();
}

}  // namespace jaxlp
