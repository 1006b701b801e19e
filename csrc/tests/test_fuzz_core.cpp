// Random driver for the torch-free core (tree attention and KV compaction), run by ctest in
// the plain and the AddressSanitizer builds. Every buffer is exactly the size its geometry
// says (std::vector), so ASan reports any read or write out of bounds; index values are
// garbage (int64 and int32 extremes included) as validate=False lets them through.
//
// Checked per case: tree attention against an ancestor walk (a node whose parent is not an
// earlier node is a root; padding nodes too); compaction writes only its slots (positions
// kv_len + 1 .. kv_len + num_accepted in blocks of the request's table) and, for strictly
// increasing paths over distinct blocks, equals "gather every source, then write".
//
// Count: argv[1] cases (default 4000), at most argv[2] seconds (default 20); seed argv[3].
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "harness.h"
#include "specdec.h"

namespace {

using Rng = std::mt19937_64;

int64_t garbage(Rng& rng, int64_t small_high) {
  static const int64_t kExtremes[] = {std::numeric_limits<int64_t>::min(),
                                      std::numeric_limits<int64_t>::max(),
                                      std::numeric_limits<int32_t>::min(),
                                      std::numeric_limits<int32_t>::max(),
                                      int64_t{1} << 62, -1};
  const int kind = static_cast<int>(rng() % 8);
  if (kind == 0) return kExtremes[rng() % 6];
  return static_cast<int64_t>(rng() % static_cast<uint64_t>(small_high + 4)) - 2;
}

// Stores int64 values as int32 or int64, as the torch layer may pass either.
struct Index {
  bool is_int64 = true;
  std::vector<int64_t> wide;
  std::vector<int32_t> narrow;
  void assign(const std::vector<int64_t>& values, bool as_int64) {
    is_int64 = as_int64;
    wide = values;
    narrow.assign(values.begin(), values.end());  // wraps, as a cast in the caller would
    if (!as_int64) {
      for (size_t i = 0; i < values.size(); ++i) wide[i] = narrow[i];
    }
  }
  specdec::IndexView view() const {
    return {is_int64 ? static_cast<const void*>(wide.data())
                     : static_cast<const void*>(narrow.data()),
            is_int64};
  }
  int64_t operator[](size_t i) const { return wide[i]; }
};

void fuzz_tree_attention(Rng& rng) {
  const int64_t batch = static_cast<int64_t>(rng() % 4);
  const int64_t n = 1 + static_cast<int64_t>(rng() % 70);
  std::vector<int64_t> parents(batch * n), num_nodes(batch), prefix(batch);
  const bool garbage_tree = rng() % 2;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      parents[b * n + i] = garbage_tree ? garbage(rng, n)
                                        : (i == 0 ? -1 : static_cast<int64_t>(rng() % i));
    }
    num_nodes[b] = garbage(rng, n);
    prefix[b] = garbage(rng, 1000);
  }
  Index parents_index, nodes_index, prefix_index;
  parents_index.assign(parents, rng() % 2);
  nodes_index.assign(num_nodes, rng() % 2);
  prefix_index.assign(prefix, rng() % 2);
  const int64_t words = specdec::packed_words(n);
  std::vector<uint8_t> mask(batch * n * n);
  std::vector<uint32_t> packed(batch * n * words);
  std::vector<int32_t> depth(batch * n);
  std::vector<int64_t> position_ids(batch * n);
  specdec::TreeAttentionParams p;
  p.parents = parents_index.view();
  if (rng() % 4) p.num_nodes = nodes_index.view();
  if (rng() % 4) p.prefix_lens = prefix_index.view();
  p.batch_size = batch;
  p.num_nodes_max = n;
  p.mask = mask.data();
  p.packed_mask = packed.data();
  p.depth = depth.data();
  p.position_ids = position_ids.data();
  specdec::build_tree_attention_cpu(p, 0, batch);

  for (int64_t b = 0; b < batch; ++b) {
    int64_t real = p.num_nodes.present() ? nodes_index[b] : n;
    real = real < 0 ? 0 : (real > n ? n : real);
    for (int64_t i = 0; i < n; ++i) {
      std::vector<uint8_t> ancestors(n, 0);
      int64_t node = i, steps = 0;
      ancestors[i] = 1;
      while (node < real && node > 0) {  // up the chain of earlier parents
        const int64_t parent = parents_index[b * n + node];
        if (parent < 0 || parent >= node) break;
        ancestors[parent] = 1;
        node = parent;
        ++steps;
      }
      CHECK_EQ(depth[b * n + i], i < real ? steps : 0);
      const int64_t base = p.prefix_lens.present() ? prefix_index[b] : 0;
      CHECK_EQ(position_ids[b * n + i],
               static_cast<int64_t>(static_cast<uint64_t>(base) + depth[b * n + i]));
      for (int64_t j = 0; j < n; ++j) {
        CHECK_EQ(mask[(b * n + i) * n + j], ancestors[j]);
        CHECK_EQ((packed[(b * n + i) * words + j / 32] >> (j % 32)) & 1u, ancestors[j]);
      }
    }
  }
}

void fuzz_compaction(Rng& rng) {
  const int64_t batch = static_cast<int64_t>(rng() % 4);
  const int64_t n = 1 + static_cast<int64_t>(rng() % 6);
  const bool paged = rng() % 2;
  const bool clean = rng() % 2;  // increasing paths over distinct blocks: compare exactly
  specdec::CacheGeometry g;
  const int64_t element = int64_t{1} << (rng() % 3);
  const int64_t rows = 1 + static_cast<int64_t>(rng() % 3);
  const int64_t row_elements = 1 + static_cast<int64_t>(rng() % 3);
  g.row_bytes = row_elements * element;
  g.rows_per_position = rows;
  g.row_stride = g.row_bytes;  // rows of one position side by side
  g.position_stride = rows * g.row_bytes;
  int64_t layer_bytes = 0;
  if (paged) {
    g.paged = true;
    g.block_size = 1 + static_cast<int64_t>(rng() % 4);
    g.max_blocks_per_request = 1 + static_cast<int64_t>(rng() % 4);
    g.num_blocks = batch * g.max_blocks_per_request + static_cast<int64_t>(rng() % 3);
    g.block_stride = g.block_size * g.position_stride;
    layer_bytes = g.num_blocks * g.block_stride;
  } else {
    g.seq_len = 1 + static_cast<int64_t>(rng() % 12);
    g.request_stride = g.seq_len * g.position_stride;
    layer_bytes = batch * g.request_stride;
  }
  std::vector<int64_t> kv_lens(batch), num_accepted(batch), accepted(batch * n),
      tables(paged ? batch * g.max_blocks_per_request : 0);
  std::vector<int64_t> pool(g.num_blocks);
  for (int64_t i = 0; i < g.num_blocks; ++i) pool[i] = i;
  std::shuffle(pool.begin(), pool.end(), rng);
  for (size_t i = 0; i < tables.size(); ++i) {
    tables[i] = clean && rng() % 4 ? pool[i] : garbage(rng, g.num_blocks);
    if (clean && tables[i] >= 0 && tables[i] < g.num_blocks && tables[i] != pool[i]) {
      tables[i] = -1;  // outside the pool, never a second column on one block
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    kv_lens[b] = rng() % 3 ? static_cast<int64_t>(rng() % 8) : garbage(rng, 8);
    num_accepted[b] = rng() % 4 ? static_cast<int64_t>(rng() % n) : garbage(rng, n);
    int64_t node = 0;
    for (int64_t k = 0; k < n; ++k) {
      if (clean) {
        accepted[b * n + k] = node;
        node += 1 + static_cast<int64_t>(rng() % 2);
      } else {
        accepted[b * n + k] = k == 0 ? 0 : garbage(rng, n);
      }
    }
  }
  Index lens_index, count_index, path_index, table_index;
  lens_index.assign(kv_lens, rng() % 2);
  count_index.assign(num_accepted, rng() % 2);
  path_index.assign(accepted, rng() % 2);
  table_index.assign(tables, rng() % 2);

  const int64_t layers = 1 + static_cast<int64_t>(rng() % 2);
  std::vector<std::vector<uint8_t>> caches(layers, std::vector<uint8_t>(layer_bytes));
  for (auto& cache : caches) {
    for (auto& byte : cache) byte = static_cast<uint8_t>(rng());
  }
  const std::vector<std::vector<uint8_t>> before = caches;
  std::vector<void*> bases;
  for (auto& cache : caches) bases.push_back(cache.data());
  std::vector<int64_t> new_lens(batch);
  specdec::CompactParams p;
  p.layers = bases.data();
  p.num_layers = layers;
  p.geometry = g;
  p.kv_lens = lens_index.view();
  p.accepted_nodes = path_index.view();
  p.num_accepted = count_index.view();
  if (paged) p.block_tables = table_index.view();
  p.batch_size = batch;
  p.num_nodes_max = n;
  p.new_kv_lens = new_lens.data();
  p.new_kv_lens_int64 = true;
  specdec::compute_new_kv_lens_cpu(p, 0, batch);
  specdec::compact_kv_cache_cpu(p, 0, batch * layers);

  // The definition: gather every source, then write; and the bytes each may write.
  std::vector<std::vector<uint8_t>> expected = before;
  std::vector<uint8_t> writable(layer_bytes, 0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t count = specdec::clamp_num_accepted(count_index[b], n);
    CHECK_EQ(new_lens[b], static_cast<int64_t>(static_cast<uint64_t>(lens_index[b]) +
                                               static_cast<uint64_t>(count) + 1u));
    if (lens_index[b] < 0) continue;
    for (int64_t k = 1; k <= count; ++k) {
      const int64_t dst = specdec::path_position_offset(g, p.block_tables, b, lens_index[b], k);
      if (dst < 0) continue;
      for (int64_t row = 0; row < rows; ++row) {
        std::memset(writable.data() + dst + row * g.row_stride, 1, g.row_bytes);
      }
      const int64_t node = path_index[b * n + k];
      if (node == k || node < 0 || node >= n) continue;
      const int64_t src = specdec::path_position_offset(g, p.block_tables, b, lens_index[b], node);
      if (src < 0) continue;
      for (int64_t layer = 0; layer < layers; ++layer) {
        for (int64_t row = 0; row < rows; ++row) {
          std::memcpy(expected[layer].data() + dst + row * g.row_stride,
                      before[layer].data() + src + row * g.row_stride, g.row_bytes);
        }
      }
    }
  }
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (int64_t i = 0; i < layer_bytes; ++i) {
      if (!writable[i]) CHECK_EQ(caches[layer][i], before[layer][i]);
      if (clean) CHECK_EQ(caches[layer][i], expected[layer][i]);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const long cases = argc > 1 ? std::atol(argv[1]) : 4000;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 20.0;
  const unsigned long long seed = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 17;
  Rng rng(seed);
  const auto start = std::chrono::steady_clock::now();
  long done = 0;
  for (; done < cases && specdec_test::failures() == 0; ++done) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >
        seconds) {
      break;
    }
    fuzz_tree_attention(rng);
    fuzz_compaction(rng);
  }
  std::printf("%ld random cases (seed %llu)\n", done, seed);
  TEST_MAIN_RETURN();
}
