// The CUDA kernels' per-thread bodies (kernel_bodies.h) run on the CPU, thread by thread,
// with the same launch plan as kernels.cu, and compared with the CPU core: random trees,
// contiguous and paged caches, every vector width (element sizes and base misalignment force
// 16/8/4/2/1-byte vectors), more than 256 layer tensors (several launches), and unvalidated
// bad entries. Concurrency is not emulated; the kernels do not rely on it (see the header).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "harness.h"
#include "kernel_bodies.h"
#include "specdec.h"

namespace {

using namespace specdec;

void emulate_tree(const TreeAttentionParams& p, int64_t threads) {
  for (int64_t b = 0; b < p.batch_size; ++b) {
    for (int64_t t = 0; t < threads; ++t) kernels::tree_rows(p, b, t, threads);
    // __syncthreads()
    for (int64_t t = 0; t < threads; ++t) kernels::tree_dense(p, b, t, threads);
  }
}

template <int kBytes>
void emulate_compact_width(const CompactParams& p) {
  using Vec = typename kernels::Vector<kBytes>::type;
  kernels::CompactLaunch launch = kernels::plan_compact(p, kBytes);
  for (int64_t first = 0; first < p.num_layers; first += kernels::kMaxLayersPerLaunch) {
    const int64_t count = std::min<int64_t>(p.num_layers - first, kernels::kMaxLayersPerLaunch);
    kernels::set_launch_layers(launch, p, first, count);
    for (int64_t z = 0; z < count; ++z) {
      for (int64_t y = 0; y < launch.request_blocks; ++y) {
        for (int64_t x = 0; x < launch.column_blocks; ++x) {
          for (int64_t t = 0; t < launch.threads; ++t) {
            kernels::compact_column<Vec>(launch.args, x * launch.threads + t, y,
                                         launch.request_blocks, z, x == 0 && z == 0 && t == 0);
          }
        }
      }
    }
  }
}

int emulate_compact(const CompactParams& p) {
  const int width = kernels::vector_bytes(p);
  switch (width) {
    case 16: emulate_compact_width<16>(p); break;
    case 8: emulate_compact_width<8>(p); break;
    case 4: emulate_compact_width<4>(p); break;
    case 2: emulate_compact_width<2>(p); break;
    default: emulate_compact_width<1>(p); break;
  }
  return width;
}

// ------------------------------------------------------------------------------------------

void test_tree(int64_t n, int64_t threads, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t batch = 6, words = packed_words(n);
  std::vector<int32_t> parents(batch * n), num_nodes(batch), prefix(batch);
  for (int64_t b = 0; b < batch; ++b) {
    num_nodes[b] = b == 0 ? static_cast<int32_t>(n) : 1 + static_cast<int32_t>(rng() % n);
    if (b == 5) num_nodes[b] = -2;  // unvalidated: clamped to 0, all padding
    prefix[b] = rng() % 100;
    for (int64_t i = 0; i < n; ++i) {
      parents[b * n + i] = i == 0 ? -1 : static_cast<int32_t>(rng() % i);
      if (b == 1 && i > 0) parents[b * n + i] = static_cast<int32_t>(i - 1);  // a chain
      if (b == 4 && i % 5 == 3) parents[b * n + i] = static_cast<int32_t>(i + 2);  // forward
      if (b == 4 && i % 5 == 1) parents[b * n + i] = static_cast<int32_t>(i);  // self
    }
  }
  struct Out {
    std::vector<uint8_t> mask;
    std::vector<uint32_t> packed;
    std::vector<int32_t> depth;
    std::vector<int64_t> position_ids;
  };
  auto make = [&](Out& out) {
    out = {std::vector<uint8_t>(batch * n * n, 9), std::vector<uint32_t>(batch * n * words, 9),
           std::vector<int32_t>(batch * n, 9), std::vector<int64_t>(batch * n, 9)};
    TreeAttentionParams p;
    p.parents = {parents.data(), false};
    p.num_nodes = {num_nodes.data(), false};
    p.prefix_lens = {prefix.data(), false};
    p.batch_size = batch;
    p.num_nodes_max = n;
    p.mask = out.mask.data();
    p.packed_mask = out.packed.data();
    p.depth = out.depth.data();
    p.position_ids = out.position_ids.data();
    return p;
  };
  Out cpu, gpu;
  build_tree_attention_cpu(make(cpu), 0, batch);
  emulate_tree(make(gpu), threads);
  CHECK(cpu.mask == gpu.mask);
  CHECK(cpu.packed == gpu.packed);
  CHECK(cpu.depth == gpu.depth);
  CHECK(cpu.position_ids == gpu.position_ids);
}

// ------------------------------------------------------------------------------------------

struct Buffer {  // bytes at a chosen offset from a 64-byte boundary
  std::vector<uint8_t> storage;
  uint8_t* data;
  Buffer(size_t size, size_t offset, std::mt19937& rng) : storage(size + 128) {
    for (uint8_t& v : storage) v = static_cast<uint8_t>(rng());
    const uintptr_t base = reinterpret_cast<uintptr_t>(storage.data());
    data = storage.data() + ((64 - base % 64) % 64) + offset;
  }
};

struct Case {
  bool paged = false, bhsd = false;
  int64_t n = 8, elem = 2, heads = 2, dim = 8, layers = 2, batch = 5;
  size_t offset = 0;
  bool bad_entries = false;
};

// Returns the vector width the emulated kernel used.
int test_compaction(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t n = c.n, batch = c.batch;
  CacheGeometry g;
  std::vector<int64_t> tables;
  size_t bytes;
  const int64_t position_bytes = c.heads * c.dim * c.elem;
  if (c.paged) {
    const int64_t block_size = 4, max_blocks = (n + 12) / block_size + 1;
    const int64_t num_blocks = batch * max_blocks + 2;
    std::vector<int64_t> pool(num_blocks);
    for (int64_t i = 0; i < num_blocks; ++i) pool[i] = i;
    std::shuffle(pool.begin(), pool.end(), rng);
    tables.assign(pool.begin(), pool.begin() + batch * max_blocks);
    g.paged = true;
    g.rows_per_position = 1;
    g.row_bytes = position_bytes;
    g.position_stride = position_bytes;
    g.block_stride = block_size * position_bytes;
    g.block_size = block_size;
    g.num_blocks = num_blocks;
    g.max_blocks_per_request = max_blocks;
    bytes = num_blocks * block_size * position_bytes;
  } else {
    const int64_t seq = n + 10;
    g.seq_len = seq;
    g.request_stride = seq * position_bytes;
    if (c.bhsd) {
      g.rows_per_position = c.heads;
      g.row_bytes = c.dim * c.elem;
      g.row_stride = seq * c.dim * c.elem;
      g.position_stride = c.dim * c.elem;
    } else {
      g.rows_per_position = 1;
      g.row_bytes = position_bytes;
      g.position_stride = position_bytes;
    }
    bytes = batch * seq * position_bytes;
  }
  std::vector<int64_t> kv_lens(batch), accepted(batch * n, -1), num_accepted(batch);
  for (int64_t b = 0; b < batch; ++b) {
    kv_lens[b] = rng() % 10;
    std::vector<int64_t> parents(n, -1);
    for (int64_t i = 1; i < n; ++i) parents[i] = rng() % i;
    std::vector<int64_t> path;
    for (int64_t node = rng() % n; node != -1; node = parents[node]) path.push_back(node);
    num_accepted[b] = static_cast<int64_t>(path.size()) - 1;
    for (size_t k = 0; k < path.size(); ++k) accepted[b * n + k] = path[path.size() - 1 - k];
  }
  if (c.bad_entries && batch >= 4) {
    kv_lens[0] = -1;
    num_accepted[1] = 1000;
    accepted[2 * n + std::min<int64_t>(1, n - 1)] = n + 3;
    kv_lens[3] = c.paged ? g.max_blocks_per_request * g.block_size - 1 : g.seq_len - 1;
    if (c.paged) tables[4 * g.max_blocks_per_request] = -7;
  }
  std::vector<Buffer> cpu_layers, gpu_layers;
  for (int64_t l = 0; l < c.layers; ++l) {
    cpu_layers.emplace_back(bytes, c.offset, rng);
    gpu_layers.push_back(cpu_layers.back());
    gpu_layers.back().data = gpu_layers.back().storage.data() +
                             (cpu_layers.back().data - cpu_layers.back().storage.data());
  }
  auto run = [&](std::vector<Buffer>& layers, bool emulate, std::vector<int32_t>& lengths) {
    std::vector<void*> bases;
    for (Buffer& layer : layers) bases.push_back(layer.data);
    CompactParams p;
    p.layers = bases.data();
    p.num_layers = c.layers;
    p.geometry = g;
    p.kv_lens = {kv_lens.data(), true};
    p.accepted_nodes = {accepted.data(), true};
    p.num_accepted = {num_accepted.data(), true};
    if (c.paged) p.block_tables = {tables.data(), true};
    p.batch_size = batch;
    p.num_nodes_max = n;
    p.new_kv_lens = lengths.data();
    p.new_kv_lens_int64 = false;
    if (emulate) return emulate_compact(p);
    compact_kv_cache_cpu(p, 0, batch * c.layers);
    compute_new_kv_lens_cpu(p, 0, batch);
    return 0;
  };
  std::vector<int32_t> cpu_lengths(batch, -5), gpu_lengths(batch, -5);
  run(cpu_layers, false, cpu_lengths);
  const int width = run(gpu_layers, true, gpu_lengths);
  CHECK(cpu_lengths == gpu_lengths);
  for (int64_t l = 0; l < c.layers; ++l) CHECK(cpu_layers[l].storage == gpu_layers[l].storage);
  return width;
}

}  // namespace

int main() {
  uint32_t seed = 1;
  for (int64_t n : {1, 7, 32, 33, 64, 100}) {
    for (int64_t threads : {32, 128}) test_tree(n, threads, seed++);
  }
  test_tree(300, 128, seed++);

  for (int64_t n : {1, 7, 33, 64, 100}) {
    for (bool paged : {false, true}) {
      for (bool bhsd : {false, true}) {
        if (paged && bhsd) continue;
        Case c;
        c.n = n;
        c.paged = paged;
        c.bhsd = bhsd;
        CHECK_EQ(test_compaction(c, seed++), 16);  // 16-byte rows, aligned bases
        c.bad_entries = true;
        test_compaction(c, seed++);
      }
    }
  }
  // Each vector width: (element size, head size, base offset) -> expected width.
  struct Width {
    int64_t elem, dim;
    size_t offset;
    int expected;
  };
  for (const Width& w : {Width{2, 8, 0, 16}, Width{2, 4, 0, 8}, Width{4, 1, 0, 4},
                         Width{2, 8, 2, 2}, Width{1, 8, 1, 1}, Width{1, 7, 0, 1},
                         Width{8, 2, 8, 8}, Width{2, 3, 4, 2}}) {
    for (bool bhsd : {false, true}) {
      Case c;
      c.elem = w.elem;
      c.dim = w.dim;
      c.offset = w.offset;
      c.bhsd = bhsd;
      c.n = 20;
      c.heads = bhsd ? 3 : 1;  // bshd: a position is one head, dim * elem bytes
      const int width = test_compaction(c, seed++);
      // bhsd rows are dim * elem bytes apart by head: a narrower width is allowed there.
      if (!bhsd) CHECK_EQ(width, w.expected);
    }
  }
  Case many;  // 300 layer tensors: two launches
  many.layers = 300;
  many.heads = 1;
  many.dim = 8;
  many.batch = 3;
  test_compaction(many, seed++);
  many.paged = true;
  test_compaction(many, seed++);
  Case wide;  // 2 * 128 * 2 bytes per position: several column blocks
  wide.heads = 8;
  wide.dim = 128;
  wide.n = 12;
  test_compaction(wide, seed++);
  TEST_MAIN_RETURN();
}
