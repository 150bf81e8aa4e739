// Host-side helpers shared by jaxlp's CUDA kernels (XLA FFI custom calls).
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace jaxlp {

// cudaLaunchKernelEx with the attributes jaxlp's kernels use: a cluster of `cluster` CTAs along x
// (when > 1; grid.x must be a multiple of it) and programmatic dependent launch (`pdl`: the kernel
// may start while the previous kernel on the stream finishes; it must wait with
// cudaGridDependencySynchronize before reading that kernel's output).
template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                          cudaStream_t stream, int cluster, bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace jaxlp
