// The specdec op schemas, the CPU registrations, and the tensor checks both devices share.
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

namespace specdec {
namespace torch_ops {
namespace {

IndexView index_view(const at::Tensor& tensor, const char* name, at::Device device,
                     c10::IntArrayRef expected_shape) {
  TORCH_CHECK(tensor.scalar_type() == at::kInt || tensor.scalar_type() == at::kLong, name,
              " must be int32 or int64, got ", tensor.scalar_type());
  TORCH_CHECK(tensor.device() == device, name, " must be on ", device, ", got ", tensor.device());
  TORCH_CHECK(tensor.sizes() == expected_shape, name, " must have shape ", expected_shape,
              ", got ", tensor.sizes());
  TORCH_CHECK(tensor.is_contiguous(), name, " must be contiguous");
  return IndexView{tensor.data_ptr(), tensor.scalar_type() == at::kLong};
}

// Rows of a position: the dense trailing block of `cache` from dimension `first` on, or
// rows of the last dimension when the trailing dimensions are not dense.
void set_rows(CacheGeometry& g, const at::Tensor& cache, int64_t first, int64_t element) {
  int64_t expected = 1;
  bool dense = true;
  for (int64_t dim = cache.dim() - 1; dim >= first; --dim) {
    if (cache.size(dim) != 1 && cache.stride(dim) != expected) dense = false;
    expected *= cache.size(dim);
  }
  if (expected == 0) dense = true;  // an empty position holds no bytes, whatever its strides
  if (dense) {
    g.rows_per_position = 1;
    g.row_bytes = expected * element;
    g.row_stride = 0;
    return;
  }
  // A size-1 last dimension is contiguous whatever its stride (as in the Python check).
  TORCH_CHECK(cache.dim() - first == 2 && (cache.stride(-1) == 1 || cache.size(-1) == 1),
              "caches: the elements of one cache position must be contiguous, or rows of "
              "contiguous last-dimension elements; got strides ",
              cache.strides());
  g.rows_per_position = cache.size(first);
  g.row_bytes = cache.size(-1) * element;
  g.row_stride = cache.stride(first) * element;
}

}  // namespace

TreeAttentionParams prepare_tree_attention(const at::Tensor& parents,
                                           const std::optional<at::Tensor>& num_nodes,
                                           const std::optional<at::Tensor>& prefix_lens,
                                           TreeAttentionOutputs& outputs) {
  TORCH_CHECK(parents.dim() == 2, "parents must be [B, N], got ", parents.sizes());
  const int64_t batch = parents.size(0), nodes = parents.size(1);
  const at::Device device = parents.device();
  TreeAttentionParams p;
  p.parents = index_view(parents, "parents", device, {batch, nodes});
  if (num_nodes.has_value()) p.num_nodes = index_view(*num_nodes, "num_nodes", device, {batch});
  if (prefix_lens.has_value()) {
    p.prefix_lens = index_view(*prefix_lens, "prefix_lens", device, {batch});
  }
  p.batch_size = batch;
  p.num_nodes_max = nodes;
  const auto options = parents.options();
  outputs.mask = at::empty({batch, nodes, nodes}, options.dtype(at::kBool));
  outputs.packed_mask = at::empty({batch, nodes, packed_words(nodes)}, options.dtype(at::kInt));
  outputs.depth = at::empty({batch, nodes}, options.dtype(at::kInt));
  outputs.position_ids = at::empty({batch, nodes}, options.dtype(at::kLong));
  p.mask = static_cast<uint8_t*>(outputs.mask.data_ptr());
  p.packed_mask = static_cast<uint32_t*>(outputs.packed_mask.data_ptr());
  p.depth = outputs.depth.data_ptr<int32_t>();
  p.position_ids = outputs.position_ids.data_ptr<int64_t>();
  return p;
}

CompactParams prepare_compaction(at::TensorList caches, const at::Tensor* block_tables,
                                 const at::Tensor& kv_lens, const at::Tensor& accepted_nodes,
                                 const at::Tensor& num_accepted, const std::string& layout,
                                 std::vector<void*>& layers, at::Tensor& new_kv_lens) {
  TORCH_CHECK(!caches.empty(), "caches must hold at least one tensor");
  const at::Tensor& first = caches[0];
  const bool paged = block_tables != nullptr;
  TORCH_CHECK(paged || layout == "bshd" || layout == "bhsd",
              "layout must be \"bshd\" or \"bhsd\", got \"", layout, "\"");
  TORCH_CHECK(paged ? first.dim() >= 3 : first.dim() == 4, "caches must be ",
              paged ? "[num_blocks, block_size, ...]" : "4-D", ", got ", first.sizes());
  for (const at::Tensor& cache : caches) {
    TORCH_CHECK(cache.sizes() == first.sizes() && cache.strides() == first.strides() &&
                    cache.scalar_type() == first.scalar_type() &&
                    cache.device() == first.device(),
                "every tensor of caches must match caches[0] in shape, strides, dtype and "
                "device");
    layers.push_back(cache.data_ptr());
  }
  const at::Device device = first.device();
  TORCH_CHECK(accepted_nodes.dim() == 2, "accepted_nodes must be [B, N], got ",
              accepted_nodes.sizes());
  const int64_t batch = accepted_nodes.size(0), nodes = accepted_nodes.size(1);
  TORCH_CHECK(nodes >= 1, "accepted_nodes must hold at least the root, got ",
              accepted_nodes.sizes());
  const int64_t element = static_cast<int64_t>(first.element_size());

  CompactParams p;
  CacheGeometry& g = p.geometry;
  if (paged) {
    TORCH_CHECK(block_tables->dim() == 2, "block_tables must be [B, max_blocks], got ",
                block_tables->sizes());
    g.paged = true;
    g.num_blocks = first.size(0);
    g.block_size = first.size(1);
    g.block_stride = first.stride(0) * element;
    g.position_stride = first.stride(1) * element;
    g.max_blocks_per_request = block_tables->size(1);
    TORCH_CHECK(g.block_size >= 1, "caches: block_size must be positive");
    set_rows(g, first, 2, element);
    p.block_tables = index_view(*block_tables, "block_tables", device,
                                {batch, g.max_blocks_per_request});
  } else {
    TORCH_CHECK(first.size(0) == batch, "caches must have B = ", batch,
                " requests (accepted_nodes.shape[0]), got ", first.sizes());
    const bool bhsd = layout == "bhsd";
    const int64_t seq_dim = bhsd ? 2 : 1;
    g.seq_len = first.size(seq_dim);
    g.request_stride = first.stride(0) * element;
    g.position_stride = first.stride(seq_dim) * element;
    if (bhsd) {
      TORCH_CHECK(first.stride(3) == 1 || first.size(3) == 1,
                  "caches: the last dimension must be contiguous, got strides ", first.strides());
      g.rows_per_position = first.size(1);
      g.row_bytes = first.size(3) * element;
      g.row_stride = first.stride(1) * element;
    } else {
      set_rows(g, first, 2, element);
    }
  }
  p.layers = layers.data();
  p.num_layers = static_cast<int64_t>(layers.size());
  p.kv_lens = index_view(kv_lens, "kv_lens", device, {batch});
  p.accepted_nodes = index_view(accepted_nodes, "accepted_nodes", device, {batch, nodes});
  p.num_accepted = index_view(num_accepted, "num_accepted", device, {batch});
  p.batch_size = batch;
  p.num_nodes_max = nodes;
  new_kv_lens = at::empty({batch}, kv_lens.options());
  p.new_kv_lens = new_kv_lens.data_ptr();
  p.new_kv_lens_int64 = kv_lens.scalar_type() == at::kLong;
  return p;
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> build_tree_attention_cpu_op(
    const at::Tensor& parents, const std::optional<at::Tensor>& num_nodes,
    const std::optional<at::Tensor>& prefix_lens) {
  TreeAttentionOutputs out;
  const TreeAttentionParams p = prepare_tree_attention(parents, num_nodes, prefix_lens, out);
  // About 64 KiB of output per task before splitting the batch across threads.
  const int64_t bytes_per_request = std::max<int64_t>(1, p.num_nodes_max * (p.num_nodes_max + 16));
  at::parallel_for(0, p.batch_size, std::max<int64_t>(1, 65536 / bytes_per_request),
                   [&](int64_t begin, int64_t end) { build_tree_attention_cpu(p, begin, end); });
  return {out.mask, out.packed_mask, out.depth, out.position_ids};
}

at::Tensor compact_cpu(at::TensorList caches, const at::Tensor* block_tables,
                       const at::Tensor& kv_lens, const at::Tensor& accepted_nodes,
                       const at::Tensor& num_accepted, const std::string& layout) {
  std::vector<void*> layers;
  at::Tensor new_kv_lens;
  const CompactParams p = prepare_compaction(caches, block_tables, kv_lens, accepted_nodes,
                                             num_accepted, layout, layers, new_kv_lens);
  compute_new_kv_lens_cpu(p, 0, p.batch_size);
  // A work item is one (request, layer); split when a task would move >= 32 KiB per move.
  const int64_t position_bytes =
      std::max<int64_t>(1, p.geometry.rows_per_position * p.geometry.row_bytes);
  at::parallel_for(0, p.batch_size * p.num_layers, std::max<int64_t>(1, 32768 / position_bytes),
                   [&](int64_t begin, int64_t end) { compact_kv_cache_cpu(p, begin, end); });
  return new_kv_lens;
}

at::Tensor compact_kv_cache_cpu_op(at::TensorList caches, const at::Tensor& kv_lens,
                                   const at::Tensor& accepted_nodes,
                                   const at::Tensor& num_accepted, c10::string_view layout) {
  return compact_cpu(caches, nullptr, kv_lens, accepted_nodes, num_accepted, std::string(layout));
}

at::Tensor compact_paged_kv_cache_cpu_op(at::TensorList caches, const at::Tensor& block_tables,
                                         const at::Tensor& kv_lens,
                                         const at::Tensor& accepted_nodes,
                                         const at::Tensor& num_accepted) {
  return compact_cpu(caches, &block_tables, kv_lens, accepted_nodes, num_accepted, "paged");
}

}  // namespace
}  // namespace torch_ops
}  // namespace specdec

TORCH_LIBRARY(specdec, m) {
  m.def(
      "build_tree_attention(Tensor parents, Tensor? num_nodes, Tensor? prefix_lens) -> "
      "(Tensor mask, Tensor packed_mask, Tensor depth, Tensor position_ids)");
  m.def(
      "compact_kv_cache(Tensor(a!)[] caches, Tensor kv_lens, Tensor accepted_nodes, "
      "Tensor num_accepted, str layout) -> Tensor");
  m.def(
      "compact_paged_kv_cache(Tensor(a!)[] caches, Tensor block_tables, Tensor kv_lens, "
      "Tensor accepted_nodes, Tensor num_accepted) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("build_tree_attention", &specdec::torch_ops::build_tree_attention_cpu_op);
  m.impl("compact_kv_cache", &specdec::torch_ops::compact_kv_cache_cpu_op);
  m.impl("compact_paged_kv_cache", &specdec::torch_ops::compact_paged_kv_cache_cpu_op);
}
