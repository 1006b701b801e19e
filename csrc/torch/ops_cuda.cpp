// CUDA registrations of the specdec ops (compiled only when setup.py finds nvcc). The
// kernels are enqueued on the current stream of the tensors' device; nothing synchronises.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops.h"
#include "specdec_cuda.h"

namespace specdec {
namespace torch_ops {
namespace {

void check_launch(cudaError_t status, const char* op) {
  TORCH_CHECK(status == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(status));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> build_tree_attention_cuda_op(
    const at::Tensor& parents, const std::optional<at::Tensor>& num_nodes,
    const std::optional<at::Tensor>& prefix_lens) {
  const c10::cuda::CUDAGuard guard(parents.device());
  TreeAttentionOutputs out;
  const TreeAttentionParams p = prepare_tree_attention(parents, num_nodes, prefix_lens, out);
  check_launch(build_tree_attention_cuda(p, c10::cuda::getCurrentCUDAStream().stream()),
               "build_tree_attention");
  return {out.mask, out.packed_mask, out.depth, out.position_ids};
}

at::Tensor compact_cuda(at::TensorList caches, const at::Tensor* block_tables,
                        const at::Tensor& kv_lens, const at::Tensor& accepted_nodes,
                        const at::Tensor& num_accepted, const std::string& layout) {
  TORCH_CHECK(!caches.empty(), "caches must hold at least one tensor");
  const c10::cuda::CUDAGuard guard(caches[0].device());
  std::vector<void*> layers;
  at::Tensor new_kv_lens;
  const CompactParams p = prepare_compaction(caches, block_tables, kv_lens, accepted_nodes,
                                             num_accepted, layout, layers, new_kv_lens);
  check_launch(compact_kv_cache_cuda(p, c10::cuda::getCurrentCUDAStream().stream()),
               "compact_kv_cache");
  return new_kv_lens;
}

at::Tensor compact_kv_cache_cuda_op(at::TensorList caches, const at::Tensor& kv_lens,
                                    const at::Tensor& accepted_nodes,
                                    const at::Tensor& num_accepted, c10::string_view layout) {
  return compact_cuda(caches, nullptr, kv_lens, accepted_nodes, num_accepted,
                      std::string(layout));
}

at::Tensor compact_paged_kv_cache_cuda_op(at::TensorList caches, const at::Tensor& block_tables,
                                          const at::Tensor& kv_lens,
                                          const at::Tensor& accepted_nodes,
                                          const at::Tensor& num_accepted) {
  return compact_cuda(caches, &block_tables, kv_lens, accepted_nodes, num_accepted, "paged");
}

}  // namespace
}  // namespace torch_ops
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("build_tree_attention", &specdec::torch_ops::build_tree_attention_cuda_op);
  m.impl("compact_kv_cache", &specdec::torch_ops::compact_kv_cache_cuda_op);
  m.impl("compact_paged_kv_cache", &specdec::torch_ops::compact_paged_kv_cache_cuda_op);
}
