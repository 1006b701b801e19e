// Tensor checks shared by the CPU and CUDA registrations of the specdec ops: they turn
// tensors into the core's pointer-and-size parameters. The Python layer validates values
// (and raises ValueError/TypeError) before calling; these TORCH_CHECKs guard the
// invariants the core relies on for memory safety (shapes, dtypes, devices, strides).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <string>
#include <vector>

#include "specdec.h"

namespace specdec {
namespace torch_ops {

// Allocates the four outputs and fills params; every tensor on parents' device.
struct TreeAttentionOutputs {
  at::Tensor mask, packed_mask, depth, position_ids;
};
TreeAttentionParams prepare_tree_attention(const at::Tensor& parents,
                                           const std::optional<at::Tensor>& num_nodes,
                                           const std::optional<at::Tensor>& prefix_lens,
                                           TreeAttentionOutputs& outputs);

// Checks the caches and index tensors, allocates new_kv_lens, fills params. `layers` keeps
// the base pointers alive for params.layers. block_tables is null for contiguous layouts.
CompactParams prepare_compaction(at::TensorList caches, const at::Tensor* block_tables,
                                 const at::Tensor& kv_lens, const at::Tensor& accepted_nodes,
                                 const at::Tensor& num_accepted, const std::string& layout,
                                 std::vector<void*>& layers, at::Tensor& new_kv_lens);

}  // namespace torch_ops
}  // namespace specdec
