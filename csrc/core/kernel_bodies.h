// The per-thread bodies of the CUDA kernels, written once for nvcc and the host compiler.
//
// kernels.cu wraps them in __global__ functions; csrc/tests/test_cuda_emulation.cpp runs them
// on the CPU thread by thread (block after block, with the barrier between the two tree
// phases), so the kernels' indexing, staging, vector-width and bounds logic is tested by
// ctest on machines without a GPU. What the emulation cannot test is concurrency; the
// kernels' safety argument does not rely on it (threads own disjoint bytes, and each
// thread's moves run in path order).
#pragma once

#include <cstdint>

#include "specdec.h"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif

namespace specdec {
namespace kernels {

// ---------------------------------------------------------------------------------------
// Tree attention: one block per request.
// ---------------------------------------------------------------------------------------

SPECDEC_HOST_DEVICE int64_t real_nodes(const TreeAttentionParams& p, int64_t b) {
  const int64_t n = p.num_nodes.present() ? p.num_nodes[b] : p.num_nodes_max;
  return n < 0 ? 0 : (n > p.num_nodes_max ? p.num_nodes_max : n);
}

// Phase 1: thread `thread` of `threads` builds the packed rows, depth and position ids of
// its nodes by walking each node's ancestors. Ancestor indices strictly decrease, so a row's
// words complete in decreasing order and each word is stored once, from a register.
SPECDEC_HOST_DEVICE void tree_rows(const TreeAttentionParams& p, int64_t b, int64_t thread,
                                   int64_t threads) {
  const int64_t num_nodes_max = p.num_nodes_max;
  const int64_t words = packed_words(num_nodes_max);
  const int64_t num_real = real_nodes(p, b);
  const int64_t prefix = p.prefix_lens.present() ? p.prefix_lens[b] : 0;
  uint32_t* packed = p.packed_mask + b * num_nodes_max * words;
  for (int64_t node = thread; node < num_nodes_max; node += threads) {
    uint32_t* row = packed + node * words;
    int64_t word = words - 1;
    uint32_t bits = 0;
    int32_t depth = -1;
    int64_t current = node;
    while (true) {
      const int64_t current_word = current >> 5;
      for (; word > current_word; --word) {
        row[word] = bits;
        bits = 0;
      }
      bits |= 1u << (current & 31);
      ++depth;
      // The root, a padding node, or a node whose parent is not an earlier node ends the
      // walk (the trees the CPU code builds; validation rejects the last case).
      if (current == 0 || current >= num_real) break;
      const int64_t parent = p.parents[b * num_nodes_max + current];
      if (parent < 0 || parent >= current) break;
      current = parent;
    }
    for (; word >= 0; --word) {
      row[word] = bits;
      bits = 0;
    }
    p.depth[b * num_nodes_max + node] = depth;
    p.position_ids[b * num_nodes_max + node] = position_id(prefix, depth);
  }
}

// Phase 2 (after a barrier): expand the request's packed rows into the dense mask, one
// byte per cell, consecutive threads on consecutive cells.
SPECDEC_HOST_DEVICE void tree_dense(const TreeAttentionParams& p, int64_t b, int64_t thread,
                                    int64_t threads) {
  const int64_t num_nodes_max = p.num_nodes_max;
  const int64_t words = packed_words(num_nodes_max);
  const uint32_t* packed = p.packed_mask + b * num_nodes_max * words;
  uint8_t* mask = p.mask + b * num_nodes_max * num_nodes_max;
  const int64_t cells = num_nodes_max * num_nodes_max;
  for (int64_t cell = thread; cell < cells; cell += threads) {
    const int64_t node = cell / num_nodes_max;
    const int64_t column = cell - node * num_nodes_max;
    mask[cell] = static_cast<uint8_t>((packed[node * words + (column >> 5)] >> (column & 31)) & 1u);
  }
}

// ---------------------------------------------------------------------------------------
// Compaction: grid (column chunks, requests, layer tensors).
// ---------------------------------------------------------------------------------------
constexpr int kCompactThreads = 128;
constexpr int kStage = 8;
constexpr int kMaxLayersPerLaunch = 256;

// Passed by value as the kernel's (__grid_constant__) parameter: about 2.3 KB of the 4 KB
// parameter space, so the layer table needs no device allocation or copy.
struct CompactKernelArgs {
  uint8_t* layers[kMaxLayersPerLaunch];
  CacheGeometry geometry;
  IndexView kv_lens;
  IndexView accepted_nodes;
  IndexView num_accepted;
  IndexView block_tables;
  int64_t batch_size;
  int64_t num_nodes_max;
  int64_t vecs_per_row;
  void* new_kv_lens;  // null except in the first launch
  bool new_kv_lens_int64;
};

// Vector types by width: CUDA's vector types on the device (one 16-byte load/store).
template <int kBytes>
struct Vector;
#if defined(__CUDACC__)
template <> struct Vector<16> { using type = uint4; };
template <> struct Vector<8> { using type = uint2; };
#else
template <> struct Vector<16> { struct alignas(16) type { uint64_t x, y; }; };
template <> struct Vector<8> { using type = uint64_t; };
#endif
template <> struct Vector<4> { using type = uint32_t; };
template <> struct Vector<2> { using type = uint16_t; };
template <> struct Vector<1> { using type = uint8_t; };

// The widest of 16, 8, 4, 2, 1 bytes dividing every base address, row size and stride.
inline int vector_bytes(const CompactParams& p) {
  const CacheGeometry& g = p.geometry;
  uint64_t bits = static_cast<uint64_t>(g.row_bytes) | static_cast<uint64_t>(g.position_stride) |
                  static_cast<uint64_t>(g.request_stride) | static_cast<uint64_t>(g.block_stride) |
                  (g.rows_per_position > 1 ? static_cast<uint64_t>(g.row_stride) : 0) | 16u;
  for (int64_t layer = 0; layer < p.num_layers; ++layer) {
    bits |= reinterpret_cast<uintptr_t>(p.layers[layer]);
  }
  return static_cast<int>(bits & (~bits + 1));  // lowest set bit
}

struct CompactLaunch {
  CompactKernelArgs args;  // layers and new_kv_lens filled per launch
  int threads;
  int64_t column_blocks;
  int64_t request_blocks;
};

// Grid and arguments shared by every launch of one call (host side).
inline CompactLaunch plan_compact(const CompactParams& p, int vector) {
  CompactLaunch launch{};  // zeroes the layer table
  CompactKernelArgs& args = launch.args;
  args.geometry = p.geometry;
  args.kv_lens = p.kv_lens;
  args.accepted_nodes = p.accepted_nodes;
  args.num_accepted = p.num_accepted;
  args.block_tables = p.block_tables;
  args.batch_size = p.batch_size;
  args.num_nodes_max = p.num_nodes_max;
  args.vecs_per_row = p.geometry.row_bytes / vector;
  args.new_kv_lens_int64 = p.new_kv_lens_int64;
  const int64_t columns = p.geometry.rows_per_position * args.vecs_per_row;
  if (columns == 0) {  // empty rows: only new_kv_lens to write; avoid dividing by zero
    args.geometry.rows_per_position = 0;
    args.vecs_per_row = 1;
  }
  launch.threads = columns >= kCompactThreads
                       ? kCompactThreads
                       : static_cast<int>(columns > 32 ? (columns + 31) / 32 * 32 : 32);
  // At least one column block, so that empty rows still get their new_kv_lens written.
  launch.column_blocks = columns > 0 ? (columns + launch.threads - 1) / launch.threads : 1;
  launch.request_blocks = p.batch_size < 65535 ? p.batch_size : 65535;
  return launch;
}

// Layers [first, first + count) of one launch; new_kv_lens only in the first.
inline void set_launch_layers(CompactLaunch& launch, const CompactParams& p, int64_t first,
                              int64_t count) {
  for (int64_t layer = 0; layer < count; ++layer) {
    launch.args.layers[layer] = static_cast<uint8_t*>(p.layers[first + layer]);
  }
  launch.args.new_kv_lens = first == 0 ? p.new_kv_lens : nullptr;
}

// A thread owns one Vec-wide column of a cache position (row, offset within the row) in one
// layer tensor and performs its request's moves in path order, kStage at a time: it loads
// every source of a stage into registers before storing any destination. A destination
// kv_len + k is only ever the source of an earlier path entry (nodes strictly increase), read
// in this or an earlier stage, so overlapping moves are safe without a barrier; threads of
// different columns touch disjoint bytes.
template <typename Vec>
SPECDEC_HOST_DEVICE void compact_column(const CompactKernelArgs& args, int64_t column,
                                        int64_t request_block, int64_t request_blocks,
                                        int64_t layer, bool writes_lengths) {
  const CacheGeometry& g = args.geometry;
  const int64_t num_nodes_max = args.num_nodes_max;
  const int64_t row = column / args.vecs_per_row;
  const int64_t inner =
      row * g.row_stride + (column - row * args.vecs_per_row) * static_cast<int64_t>(sizeof(Vec));
  uint8_t* base = args.layers[layer];
  for (int64_t b = request_block; b < args.batch_size; b += request_blocks) {
    const int64_t kv_len = args.kv_lens[b];
    const int64_t num_accepted = clamp_num_accepted(args.num_accepted[b], num_nodes_max);
    if (writes_lengths && args.new_kv_lens != nullptr) {
      const int64_t length = new_kv_len(kv_len, num_accepted);
      if (args.new_kv_lens_int64) {
        static_cast<int64_t*>(args.new_kv_lens)[b] = length;
      } else {
        static_cast<int32_t*>(args.new_kv_lens)[b] = static_cast<int32_t>(length);
      }
    }
    if (kv_len < 0 || row >= g.rows_per_position) continue;
    for (int64_t first = 1; first <= num_accepted; first += kStage) {
      Vec staged[kStage];
      int64_t destination[kStage];
#if defined(__CUDACC__)
#pragma unroll
#endif
      for (int s = 0; s < kStage; ++s) {
        const int64_t k = first + s;
        destination[s] = -1;
        if (k > num_accepted) continue;
        const int64_t node = args.accepted_nodes[b * num_nodes_max + k];
        if (node == k || node < 0 || node >= num_nodes_max) continue;
        const int64_t src = path_position_offset(g, args.block_tables, b, kv_len, node);
        const int64_t dst = path_position_offset(g, args.block_tables, b, kv_len, k);
        if (src < 0 || dst < 0) continue;
        staged[s] = *reinterpret_cast<const Vec*>(base + src + inner);
        destination[s] = dst;
      }
#if defined(__CUDACC__)
#pragma unroll
#endif
      for (int s = 0; s < kStage; ++s) {
        if (destination[s] >= 0) *reinterpret_cast<Vec*>(base + destination[s] + inner) = staged[s];
      }
    }
  }
}

}  // namespace kernels
}  // namespace specdec
