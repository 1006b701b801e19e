// Tree attention metadata on the CPU.
//
// Per request: the packed row of node i is its parent's packed row plus bit i (parents come
// before children), so the whole packed mask costs N * W word operations; the dense mask is
// then expanded 8 columns at a time from a 256-entry table.
// Bytes written per request: N*N (mask) + 4*N*W (packed) + 12*N (depth, position_ids).
#include <cstring>

#include "specdec.h"

namespace specdec {
namespace {

// kByteToBools[v] holds, as 8 bytes, the bits of v least significant first: one table
// lookup writes 8 bool columns of the dense mask.
struct ByteToBools {
  uint64_t value[256];
  ByteToBools() {
    for (int v = 0; v < 256; ++v) {
      uint8_t bytes[8];
      for (int bit = 0; bit < 8; ++bit) bytes[bit] = static_cast<uint8_t>((v >> bit) & 1);
      std::memcpy(&value[v], bytes, 8);
    }
  }
};
const ByteToBools kByteToBools;

void expand_row(const uint32_t* packed_row, int64_t num_columns, uint8_t* mask_row) {
  int64_t column = 0;
  for (; column + 8 <= num_columns; column += 8) {
    const uint32_t byte = (packed_row[column >> 5] >> (column & 31)) & 0xFFu;
    std::memcpy(mask_row + column, &kByteToBools.value[byte], 8);
  }
  for (; column < num_columns; ++column) {
    mask_row[column] = static_cast<uint8_t>((packed_row[column >> 5] >> (column & 31)) & 1u);
  }
}

}  // namespace

void build_tree_attention_cpu(const TreeAttentionParams& params, int64_t request_begin,
                              int64_t request_end) {
  const int64_t num_nodes_max = params.num_nodes_max;
  const int64_t words = packed_words(num_nodes_max);
  for (int64_t b = request_begin; b < request_end; ++b) {
    int64_t num_real = params.num_nodes.present() ? params.num_nodes[b] : num_nodes_max;
    num_real = num_real < 0 ? 0 : (num_real > num_nodes_max ? num_nodes_max : num_real);
    const int64_t prefix = params.prefix_lens.present() ? params.prefix_lens[b] : 0;
    uint32_t* packed = params.packed_mask + b * num_nodes_max * words;
    int32_t* depth = params.depth + b * num_nodes_max;
    int64_t* position_ids = params.position_ids + b * num_nodes_max;

    for (int64_t node = 0; node < num_nodes_max; ++node) {
      uint32_t* row = packed + node * words;
      const int64_t parent = node < num_real ? params.parents[b * num_nodes_max + node] : -1;
      // A padding node, the root, or a node whose parent is not an earlier node is a tree
      // of its own: only its diagonal, depth 0 (validation rejects the last case first).
      if (node > 0 && parent >= 0 && parent < node) {
        std::memcpy(row, packed + parent * words, words * sizeof(uint32_t));
        depth[node] = depth[parent] + 1;
      } else {
        std::memset(row, 0, words * sizeof(uint32_t));
        depth[node] = 0;
      }
      row[node >> 5] |= 1u << (node & 31);
      position_ids[node] = position_id(prefix, depth[node]);
    }
    if (params.mask != nullptr) {
      uint8_t* mask = params.mask + b * num_nodes_max * num_nodes_max;
      for (int64_t node = 0; node < num_nodes_max; ++node) {
        expand_row(packed + node * words, num_nodes_max, mask + node * num_nodes_max);
      }
    }
  }
}

}  // namespace specdec
