// CUDA kernels of specdec_kernels: tree-attention metadata and KV-cache compaction.
// One translation unit on purpose (CI builds on two cores). The per-thread bodies live in
// kernel_bodies.h, shared with the host emulation that ctest runs without a GPU.
//
// Bytes: tree attention reads parents (L1-resident, 8 * N * depth per request) and writes
// N*N + 4*N*ceil(N/32) + 12*N per request; compaction reads and writes every moved position
// once per layer tensor (2 * moved * position bytes) plus the index tensors.
#include <cstdint>

#include "kernel_bodies.h"
#include "specdec_cuda.h"

namespace specdec {
namespace {

constexpr int kTreeThreads = 128;

__global__ void __launch_bounds__(kTreeThreads) tree_attention_kernel(TreeAttentionParams p) {
  kernels::tree_rows(p, blockIdx.x, threadIdx.x, blockDim.x);
  if (p.mask == nullptr) return;  // uniform across the block
  __syncthreads();  // this request's packed rows are complete and visible to the block
  kernels::tree_dense(p, blockIdx.x, threadIdx.x, blockDim.x);
}

template <typename Vec>
__global__ void __launch_bounds__(kernels::kCompactThreads)
    compact_kernel(const __grid_constant__ kernels::CompactKernelArgs args) {
  kernels::compact_column<Vec>(args, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                               blockIdx.y, gridDim.y, blockIdx.z,
                               blockIdx.x == 0 && blockIdx.z == 0 && threadIdx.x == 0);
}

template <int kBytes>
cudaError_t launch_compact(const CompactParams& p, cudaStream_t stream) {
  using Vec = typename kernels::Vector<kBytes>::type;
  kernels::CompactLaunch launch = kernels::plan_compact(p, kBytes);
  if (launch.column_blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  // Several launches only past 256 layer tensors (128 layers of K and V); layers are
  // independent, so splitting them changes nothing.
  for (int64_t first = 0; first < p.num_layers; first += kernels::kMaxLayersPerLaunch) {
    const int64_t count = p.num_layers - first < kernels::kMaxLayersPerLaunch
                              ? p.num_layers - first
                              : kernels::kMaxLayersPerLaunch;
    kernels::set_launch_layers(launch, p, first, count);
    const dim3 grid(static_cast<unsigned>(launch.column_blocks),
                    static_cast<unsigned>(launch.request_blocks), static_cast<unsigned>(count));
    compact_kernel<Vec><<<grid, launch.threads, 0, stream>>>(launch.args);
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t build_tree_attention_cuda(const TreeAttentionParams& params, cudaStream_t stream) {
  if (params.batch_size == 0 || params.num_nodes_max == 0) return cudaSuccess;
  tree_attention_kernel<<<static_cast<unsigned>(params.batch_size), kTreeThreads, 0, stream>>>(
      params);
  return cudaGetLastError();
}

cudaError_t compact_kv_cache_cuda(const CompactParams& params, cudaStream_t stream) {
  if (params.num_layers <= 0) return cudaErrorInvalidValue;
  if (params.batch_size == 0) return cudaSuccess;
  switch (kernels::vector_bytes(params)) {
    case 16: return launch_compact<16>(params, stream);
    case 8: return launch_compact<8>(params, stream);
    case 4: return launch_compact<4>(params, stream);
    case 2: return launch_compact<2>(params, stream);
    default: return launch_compact<1>(params, stream);
  }
}

}  // namespace specdec
