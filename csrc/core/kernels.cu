// CUDA kernels of specdec_kernels: tree-attention metadata and KV-cache compaction.
// One translation unit on purpose: CI builds on two cores.
#include <cstdint>

#include "specdec_cuda.h"

namespace specdec {
namespace {

// ---------------------------------------------------------------------------------------
// Tree attention. One block per request; one thread per row walks the node's ancestors.
// Ancestors have strictly decreasing indices, so a row's words complete in decreasing
// order and each packed word is stored once, from a register. After a barrier the block
// expands its packed rows into the dense mask.
// Bytes per request: reads 8*N*depth (parents, L1-resident), writes N*N + 4*N*W + 12*N.
// ---------------------------------------------------------------------------------------
constexpr int kTreeThreads = 128;

__global__ void __launch_bounds__(kTreeThreads) tree_attention_kernel(TreeAttentionParams p) {
  const int64_t b = blockIdx.x;
  const int64_t num_nodes_max = p.num_nodes_max;
  const int64_t words = packed_words(num_nodes_max);
  int64_t num_real = p.num_nodes.present() ? p.num_nodes[b] : num_nodes_max;
  num_real = num_real < 0 ? 0 : (num_real > num_nodes_max ? num_nodes_max : num_real);
  const int64_t prefix = p.prefix_lens.present() ? p.prefix_lens[b] : 0;
  uint32_t* packed = p.packed_mask + b * num_nodes_max * words;

  for (int64_t node = threadIdx.x; node < num_nodes_max; node += blockDim.x) {
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
      // walk (the same trees the CPU code builds; validation rejects the last case).
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
    p.position_ids[b * num_nodes_max + node] = prefix + depth;
  }
  if (p.mask == nullptr) return;
  __syncthreads();  // the packed rows of this request are complete and visible
  uint8_t* mask = p.mask + b * num_nodes_max * num_nodes_max;
  const int64_t cells = num_nodes_max * num_nodes_max;
  for (int64_t cell = threadIdx.x; cell < cells; cell += blockDim.x) {
    const int64_t node = cell / num_nodes_max;
    const int64_t column = cell - node * num_nodes_max;
    mask[cell] = static_cast<uint8_t>((packed[node * words + (column >> 5)] >> (column & 31)) & 1u);
  }
}

// ---------------------------------------------------------------------------------------
// Compaction. Grid (column chunks, requests, layers): a thread owns one Vec-wide column of
// a cache position (row, offset within the row) in one layer of one request and performs
// that request's moves in path order, kStage at a time: it loads every source of a stage
// into registers before storing any destination. A destination kv_len + k is only ever the
// source of an earlier path entry (nodes strictly increase), read in this or an earlier
// stage, so overlapping moves are safe without a barrier. Threads of different columns
// touch disjoint bytes.
// Bytes moved: 2 * moved positions * rows_per_position * row_bytes per layer.
// ---------------------------------------------------------------------------------------
constexpr int kCompactThreads = 128;
constexpr int kStage = 8;
constexpr int kMaxLayersPerLaunch = 256;

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

template <typename Vec>
__global__ void __launch_bounds__(kCompactThreads)
    compact_kernel(const __grid_constant__ CompactKernelArgs args) {
  const CacheGeometry& g = args.geometry;
  const int64_t num_nodes_max = args.num_nodes_max;
  const int64_t column = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = column / args.vecs_per_row;
  const int64_t inner =
      row * g.row_stride + (column - row * args.vecs_per_row) * static_cast<int64_t>(sizeof(Vec));
  uint8_t* base = args.layers[blockIdx.z];

  for (int64_t b = blockIdx.y; b < args.batch_size; b += gridDim.y) {
    const int64_t kv_len = args.kv_lens[b];
    const int64_t num_accepted = clamp_num_accepted(args.num_accepted[b], num_nodes_max);
    if (args.new_kv_lens != nullptr && blockIdx.x == 0 && blockIdx.z == 0 && threadIdx.x == 0) {
      const int64_t length = kv_len + num_accepted + 1;
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
#pragma unroll
      for (int s = 0; s < kStage; ++s) {
        const int64_t k = first + s;
        destination[s] = -1;
        if (k > num_accepted) continue;
        const int64_t node = args.accepted_nodes[b * num_nodes_max + k];
        if (node == k || node < 0 || node >= num_nodes_max) continue;
        const int64_t src = position_offset(g, args.block_tables, b, kv_len + node);
        const int64_t dst = position_offset(g, args.block_tables, b, kv_len + k);
        if (src < 0 || dst < 0) continue;
        staged[s] = *reinterpret_cast<const Vec*>(base + src + inner);
        destination[s] = dst;
      }
#pragma unroll
      for (int s = 0; s < kStage; ++s) {
        if (destination[s] >= 0) *reinterpret_cast<Vec*>(base + destination[s] + inner) = staged[s];
      }
    }
  }
}

// The widest of 16, 8, 4, 2, 1 bytes dividing every base address, row size and stride.
int vector_bytes(const CompactParams& p) {
  const CacheGeometry& g = p.geometry;
  uint64_t bits = static_cast<uint64_t>(g.row_bytes) | static_cast<uint64_t>(g.position_stride) |
                  static_cast<uint64_t>(g.request_stride) | static_cast<uint64_t>(g.block_stride) |
                  (g.rows_per_position > 1 ? static_cast<uint64_t>(g.row_stride) : 0) | 16u;
  for (int64_t layer = 0; layer < p.num_layers; ++layer) {
    bits |= reinterpret_cast<uintptr_t>(p.layers[layer]);
  }
  return static_cast<int>(bits & (~bits + 1));  // lowest set bit
}

template <typename Vec>
cudaError_t launch_compact(const CompactParams& p, cudaStream_t stream) {
  CompactKernelArgs args;
  args.geometry = p.geometry;
  args.kv_lens = p.kv_lens;
  args.accepted_nodes = p.accepted_nodes;
  args.num_accepted = p.num_accepted;
  args.block_tables = p.block_tables;
  args.batch_size = p.batch_size;
  args.num_nodes_max = p.num_nodes_max;
  args.vecs_per_row = p.geometry.row_bytes / static_cast<int64_t>(sizeof(Vec));
  args.new_kv_lens_int64 = p.new_kv_lens_int64;
  const int64_t columns = p.geometry.rows_per_position * args.vecs_per_row;
  if (columns == 0) {  // empty rows: only new_kv_lens to write; avoid dividing by zero
    args.geometry.rows_per_position = 0;
    args.vecs_per_row = 1;
  }
  const int threads = columns >= kCompactThreads
                          ? kCompactThreads
                          : static_cast<int>(columns > 32 ? (columns + 31) / 32 * 32 : 32);
  const int64_t column_blocks = (columns + threads - 1) / threads;
  if (column_blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const unsigned request_blocks =
      static_cast<unsigned>(p.batch_size < 65535 ? p.batch_size : 65535);
  // Several launches only past 256 layer tensors (128 layers of K and V): the pointer table
  // travels in the kernel parameters, so nothing is allocated or copied (graph-capturable).
  // Layers are independent, so splitting them across launches changes nothing.
  for (int64_t first = 0; first < p.num_layers; first += kMaxLayersPerLaunch) {
    const int64_t count = p.num_layers - first < kMaxLayersPerLaunch ? p.num_layers - first
                                                                     : kMaxLayersPerLaunch;
    for (int64_t layer = 0; layer < count; ++layer) {
      args.layers[layer] = static_cast<uint8_t*>(p.layers[first + layer]);
    }
    args.new_kv_lens = first == 0 ? p.new_kv_lens : nullptr;
    // At least one column block, so that empty rows still get their new_kv_lens written.
    const dim3 grid(static_cast<unsigned>(column_blocks > 0 ? column_blocks : 1), request_blocks,
                    static_cast<unsigned>(count));
    compact_kernel<Vec><<<grid, threads, 0, stream>>>(args);
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
  switch (vector_bytes(params)) {
    case 16: return launch_compact<uint4>(params, stream);
    case 8: return launch_compact<uint2>(params, stream);
    case 4: return launch_compact<uint32_t>(params, stream);
    case 2: return launch_compact<uint16_t>(params, stream);
    default: return launch_compact<uint8_t>(params, stream);
  }
}

}  // namespace specdec
