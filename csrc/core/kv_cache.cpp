// KV-cache compaction on the CPU.
//
// Per (request, layer): for k = 1..num_accepted with accepted_nodes[k] != k, copy position
// kv_len + accepted_nodes[k] to kv_len + k (rows_per_position rows of row_bytes each).
// memmove, not memcpy: with validate=False a block table may map two columns to one block.
// Bytes moved: 2 * moved positions * rows_per_position * row_bytes per layer (read + write).
#include <cstring>

#include "specdec.h"

namespace specdec {

void compute_new_kv_lens_cpu(const CompactParams& params, int64_t request_begin,
                             int64_t request_end) {
  if (params.new_kv_lens == nullptr) return;
  for (int64_t b = request_begin; b < request_end; ++b) {
    const int64_t length = new_kv_len(
        params.kv_lens[b], clamp_num_accepted(params.num_accepted[b], params.num_nodes_max));
    if (params.new_kv_lens_int64) {
      static_cast<int64_t*>(params.new_kv_lens)[b] = length;
    } else {
      static_cast<int32_t*>(params.new_kv_lens)[b] = static_cast<int32_t>(length);
    }
  }
}

void compact_kv_cache_cpu(const CompactParams& params, int64_t item_begin, int64_t item_end) {
  const CacheGeometry& g = params.geometry;
  const int64_t num_nodes_max = params.num_nodes_max;
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t b = item / params.num_layers;
    auto* base = static_cast<uint8_t*>(params.layers[item % params.num_layers]);
    const int64_t kv_len = params.kv_lens[b];
    if (kv_len < 0) continue;
    const int64_t num_accepted = clamp_num_accepted(params.num_accepted[b], num_nodes_max);
    // Path order per row: every source equal to a later destination has been read by then.
    // Rows outer: for "bhsd" the moves of one head touch neighbouring rows of one plane.
    for (int64_t row = 0; row < g.rows_per_position; ++row) {
      uint8_t* row_base = base + row * g.row_stride;
      for (int64_t k = 1; k <= num_accepted; ++k) {
        const int64_t node = params.accepted_nodes[b * num_nodes_max + k];
        if (node == k || node < 0 || node >= num_nodes_max) continue;
        const int64_t src = path_position_offset(g, params.block_tables, b, kv_len, node);
        const int64_t dst = path_position_offset(g, params.block_tables, b, kv_len, k);
        if (src < 0 || dst < 0) continue;
        std::memmove(row_base + dst, row_base + src, static_cast<size_t>(g.row_bytes));
      }
    }
  }
}

}  // namespace specdec
