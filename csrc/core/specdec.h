// Torch-free core of specdec_kernels: tree-attention metadata and KV-cache compaction.
//
// Everything here works on raw pointers and sizes so that it can be built, tested and
// sanitised without PyTorch (CMakeLists.txt) and wrapped by csrc/torch/ for the Python
// extension. Semantics: ../../shared/CONTRACT.md sections 5 and 6 (docs/extension.md).
//
// Robustness: these functions never read or write out of bounds, whatever the index
// values. Bad entries (a parent that is not an earlier node, a path node outside the
// cache, a block id outside the pool) are skipped; the Python layer validates first.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define SPECDEC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SPECDEC_HOST_DEVICE inline
#endif

namespace specdec {

// A read-only int32 or int64 index tensor (row-major, contiguous). The verifier emits
// int32, engines often hold int64: one branch per load is cheaper than template
// instantiations for every combination of index dtypes.
struct IndexView {
  const void* data = nullptr;
  bool is_int64 = false;

  SPECDEC_HOST_DEVICE bool present() const { return data != nullptr; }
  SPECDEC_HOST_DEVICE int64_t operator[](int64_t i) const {
    return is_int64 ? static_cast<const int64_t*>(data)[i]
                    : static_cast<int64_t>(static_cast<const int32_t*>(data)[i]);
  }
};

// ---------------------------------------------------------------------------------------
// Tree attention metadata (contract section 5).
// ---------------------------------------------------------------------------------------
struct TreeAttentionParams {
  IndexView parents;      // [B, N]
  IndexView num_nodes;    // [B] or absent (every node real)
  IndexView prefix_lens;  // [B] or absent (0)
  int64_t batch_size = 0;
  int64_t num_nodes_max = 0;  // N
  // Outputs (contiguous).
  uint8_t* mask = nullptr;           // bool [B, N, N]
  uint32_t* packed_mask = nullptr;   // int32 [B, N, W], W = ceil(N / 32)
  int32_t* depth = nullptr;          // [B, N]
  int64_t* position_ids = nullptr;   // [B, N]
};

// prefix + depth, wrapping past int64 as torch does (validate=False only).
SPECDEC_HOST_DEVICE int64_t position_id(int64_t prefix, int64_t depth) {
  return static_cast<int64_t>(static_cast<uint64_t>(prefix) + static_cast<uint64_t>(depth));
}

SPECDEC_HOST_DEVICE int64_t packed_words(int64_t num_nodes) { return (num_nodes + 31) / 32; }

// Requests [request_begin, request_end) on the calling thread. Requests are independent,
// so callers split the batch across threads (at::parallel_for in the torch layer).
void build_tree_attention_cpu(const TreeAttentionParams& params, int64_t request_begin,
                              int64_t request_end);

// ---------------------------------------------------------------------------------------
// KV-cache compaction (contract section 6).
//
// A cache position is a set of `rows_per_position` rows of `row_bytes` contiguous bytes,
// `row_stride` bytes apart. Contiguous caches address position t of request b at
//   base + b * request_stride + t * position_stride;
// paged caches at
//   base + block * block_stride + (t % block_size) * position_stride,
// block = block_tables[b, t / block_size]. All strides are in bytes, so every element size
// (fp32, fp16, bf16, fp8) is the same code.
// ---------------------------------------------------------------------------------------
struct CacheGeometry {
  int64_t rows_per_position = 1;
  int64_t row_bytes = 0;
  int64_t row_stride = 0;
  int64_t position_stride = 0;
  // Contiguous layouts.
  int64_t request_stride = 0;
  int64_t seq_len = 0;  // S
  // Paged layout (paged == true).
  bool paged = false;
  int64_t block_stride = 0;
  int64_t block_size = 0;
  int64_t num_blocks = 0;
  int64_t max_blocks_per_request = 0;  // columns of block_tables
};

struct CompactParams {
  void* const* layers = nullptr;  // host array of num_layers base pointers
  int64_t num_layers = 0;
  CacheGeometry geometry;
  IndexView kv_lens;         // [B]
  IndexView accepted_nodes;  // [B, N], root first
  IndexView num_accepted;    // [B]
  IndexView block_tables;    // [B, max_blocks_per_request] (paged only)
  int64_t batch_size = 0;
  int64_t num_nodes_max = 0;  // N
  // Output [B], same integer type as kv_lens; may be null.
  void* new_kv_lens = nullptr;
  bool new_kv_lens_int64 = false;
};

// num_accepted clamped to what accepted_nodes can hold: [0, N - 1].
SPECDEC_HOST_DEVICE int64_t clamp_num_accepted(int64_t num_accepted, int64_t num_nodes_max) {
  if (num_accepted < 0) return 0;
  return num_accepted < num_nodes_max - 1 ? num_accepted : num_nodes_max - 1;
}

// Byte offset of position `t` of request `b` in a layer, or -1 when it lies outside the
// cache (past S, past the request's block table, or in a block outside the pool).
SPECDEC_HOST_DEVICE int64_t position_offset(const CacheGeometry& g, const IndexView& block_tables,
                                            int64_t b, int64_t t) {
  if (t < 0) return -1;
  if (!g.paged) {
    if (t >= g.seq_len) return -1;
    return b * g.request_stride + t * g.position_stride;
  }
  const int64_t column = t / g.block_size;
  if (column >= g.max_blocks_per_request) return -1;
  const int64_t block = block_tables[b * g.max_blocks_per_request + column];
  if (block < 0 || block >= g.num_blocks) return -1;
  return block * g.block_stride + (t % g.block_size) * g.position_stride;
}

// Byte offset of path position kv_len + index (kv_len >= 0, index >= 0), or -1 when it lies
// outside the cache; a sum past int64 (only reachable with validate=False) is outside too.
SPECDEC_HOST_DEVICE int64_t path_position_offset(const CacheGeometry& g,
                                                 const IndexView& block_tables, int64_t b,
                                                 int64_t kv_len, int64_t index) {
  if (kv_len > INT64_MAX - index) return -1;
  return position_offset(g, block_tables, b, kv_len + index);
}

// kv_len + num_accepted + 1, wrapping in two's complement past int64 as torch does (only
// reachable with validate=False; signed overflow would be undefined).
SPECDEC_HOST_DEVICE int64_t new_kv_len(int64_t kv_len, int64_t num_accepted) {
  return static_cast<int64_t>(static_cast<uint64_t>(kv_len) + static_cast<uint64_t>(num_accepted) +
                              1u);
}

// new_kv_lens[b] = kv_lens[b] + num_accepted[b] + 1 for requests [begin, end).
void compute_new_kv_lens_cpu(const CompactParams& params, int64_t request_begin,
                             int64_t request_end);

// Moves the accepted path of every (request, layer) work item in [item_begin, item_end);
// item = request * num_layers + layer. Moves of one item run in path order, which is what
// makes overlapping moves safe: a destination kv_len + k is only ever the source of a
// path entry k' < k (nodes are strictly increasing), already copied.
void compact_kv_cache_cpu(const CompactParams& params, int64_t item_begin, int64_t item_end);

}  // namespace specdec
