// C++ tests of compact_kv_cache_cpu: the overlap case by hand, random paths against a
// "read every source, then write" definition for contiguous (both layouts) and paged
// geometries and element sizes 1, 2, 4, chain-shaped paths, and bad entries (skipped, never
// out of bounds: this binary also runs under AddressSanitizer).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "harness.h"
#include "specdec.h"

namespace {

using Bytes = std::vector<uint8_t>;

struct Batch {
  int64_t batch = 0, n = 0;
  std::vector<int64_t> kv_lens, accepted, num_accepted, block_tables;
};

specdec::CompactParams make_params(const Batch& in, const specdec::CacheGeometry& g,
                                   std::vector<void*>& layers, void* new_lens, bool lens64) {
  specdec::CompactParams p;
  p.layers = layers.data();
  p.num_layers = static_cast<int64_t>(layers.size());
  p.geometry = g;
  p.kv_lens = {in.kv_lens.data(), true};
  p.accepted_nodes = {in.accepted.data(), true};
  p.num_accepted = {in.num_accepted.data(), true};
  if (g.paged) p.block_tables = {in.block_tables.data(), true};
  p.batch_size = in.batch;
  p.num_nodes_max = in.n;
  p.new_kv_lens = new_lens;
  p.new_kv_lens_int64 = lens64;
  return p;
}

void run(const Batch& in, const specdec::CacheGeometry& g, std::vector<Bytes>& caches,
         int64_t splits = 1) {
  std::vector<void*> layers;
  for (Bytes& c : caches) layers.push_back(c.data());
  std::vector<int64_t> new_lens(in.batch, -99);
  const specdec::CompactParams p = make_params(in, g, layers, new_lens.data(), true);
  const int64_t items = in.batch * p.num_layers;
  for (int64_t s = 0; s < splits; ++s) {
    specdec::compact_kv_cache_cpu(p, items * s / splits, items * (s + 1) / splits);
  }
  specdec::compute_new_kv_lens_cpu(p, 0, in.batch);
  for (int64_t b = 0; b < in.batch; ++b) {
    CHECK_EQ(new_lens[b], in.kv_lens[b] + in.num_accepted[b] + 1);
  }
}

// The definition (contract section 6) for valid input: gather every source of a request,
// then write the destinations.
void expected_compaction(const Batch& in, const specdec::CacheGeometry& g, Bytes& cache) {
  for (int64_t b = 0; b < in.batch; ++b) {
    std::vector<Bytes> staged;
    for (int64_t k = 0; k <= in.num_accepted[b]; ++k) {
      const int64_t src = specdec::position_offset(
          g, {in.block_tables.data(), true}, b, in.kv_lens[b] + in.accepted[b * in.n + k]);
      Bytes rows;
      for (int64_t r = 0; r < g.rows_per_position; ++r) {
        const uint8_t* from = cache.data() + src + r * g.row_stride;
        rows.insert(rows.end(), from, from + g.row_bytes);
      }
      staged.push_back(rows);
    }
    for (int64_t k = 0; k <= in.num_accepted[b]; ++k) {
      const int64_t dst =
          specdec::position_offset(g, {in.block_tables.data(), true}, b, in.kv_lens[b] + k);
      for (int64_t r = 0; r < g.rows_per_position; ++r) {
        std::memcpy(cache.data() + dst + r * g.row_stride, staged[k].data() + r * g.row_bytes,
                    g.row_bytes);
      }
    }
  }
}

Bytes random_bytes(std::mt19937& rng, size_t size) {
  Bytes bytes(size);
  for (uint8_t& v : bytes) v = static_cast<uint8_t>(rng());
  return bytes;
}

// [B, S, H, D] ("bshd", one row of H*D elements per position) or [B, H, S, D] ("bhsd", H rows).
specdec::CacheGeometry contiguous(bool bhsd, int64_t batch, int64_t seq, int64_t heads,
                                  int64_t dim, int64_t elem) {
  (void)batch;
  specdec::CacheGeometry g;
  g.seq_len = seq;
  if (!bhsd) {
    g.rows_per_position = 1;
    g.row_bytes = heads * dim * elem;
    g.position_stride = heads * dim * elem;
    g.request_stride = seq * heads * dim * elem;
  } else {
    g.rows_per_position = heads;
    g.row_bytes = dim * elem;
    g.row_stride = seq * dim * elem;
    g.position_stride = dim * elem;
    g.request_stride = heads * seq * dim * elem;
  }
  return g;
}

// [num_blocks, block_size, H, D].
specdec::CacheGeometry paged(int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                             int64_t row_elems, int64_t elem) {
  specdec::CacheGeometry g;
  g.paged = true;
  g.rows_per_position = 1;
  g.row_bytes = row_elems * elem;
  g.position_stride = row_elems * elem;
  g.block_stride = block_size * row_elems * elem;
  g.block_size = block_size;
  g.num_blocks = num_blocks;
  g.max_blocks_per_request = max_blocks;
  return g;
}

// A random root-first path through a random tree of n nodes, with -1 padding.
void random_path(std::mt19937& rng, int64_t n, int64_t* path, int64_t& num_accepted) {
  std::vector<int64_t> parents(n, -1);
  for (int64_t i = 1; i < n; ++i) parents[i] = rng() % i;
  int64_t node = rng() % n;
  std::vector<int64_t> reversed;
  for (; node != -1; node = parents[node]) reversed.push_back(node);
  num_accepted = static_cast<int64_t>(reversed.size()) - 1;
  for (int64_t k = 0; k < n; ++k) {
    path[k] = k < static_cast<int64_t>(reversed.size()) ? reversed[reversed.size() - 1 - k] : -1;
  }
}

void test_overlap_by_hand() {
  // One request, kv_len 2, path [0, 2, 3]: node 2 to offset 1 while node 3 lands on node 2's
  // old place. Positions hold their own index; one byte per position.
  Batch in{1, 4, {2}, {0, 2, 3, -1}, {2}, {}};
  const specdec::CacheGeometry g = contiguous(false, 1, 8, 1, 1, 1);
  std::vector<Bytes> caches = {{0, 1, 2, 3, 4, 5, 6, 7}};
  run(in, g, caches);
  const Bytes expected = {0, 1, 2, 4, 5, 5, 6, 7};
  CHECK(caches[0] == expected);
}

void test_random_contiguous(bool bhsd, int64_t n, int64_t elem, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t batch = 6, heads = 3, dim = 5, seq = n + 9, layers = 3;
  const specdec::CacheGeometry g = contiguous(bhsd, batch, seq, heads, dim, elem);
  Batch in{batch, n, {}, std::vector<int64_t>(batch * n), {}, {}};
  for (int64_t b = 0; b < batch; ++b) {
    in.kv_lens.push_back(rng() % (seq - n + 1));
    int64_t accepted = 0;
    random_path(rng, n, in.accepted.data() + b * n, accepted);
    in.num_accepted.push_back(accepted);
  }
  std::vector<Bytes> caches, expected;
  for (int64_t l = 0; l < layers; ++l) {
    caches.push_back(random_bytes(rng, batch * seq * heads * dim * elem));
    expected.push_back(caches.back());
    expected_compaction(in, g, expected.back());
  }
  std::vector<Bytes> split = caches;
  run(in, g, caches);
  run(in, g, split, 4);
  CHECK(caches == expected);
  CHECK(split == expected);
}

void test_random_paged(int64_t n, int64_t block_size, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t batch = 5, row = 12, elem = 2, layers = 2;
  const int64_t max_blocks = (n + 20 + block_size - 1) / block_size + 1;
  const int64_t num_blocks = batch * max_blocks + 3;
  const specdec::CacheGeometry g = paged(num_blocks, block_size, max_blocks, row, elem);
  std::vector<int64_t> pool(num_blocks);
  for (int64_t i = 0; i < num_blocks; ++i) pool[i] = i;
  std::shuffle(pool.begin(), pool.end(), rng);
  Batch in{batch, n, {}, std::vector<int64_t>(batch * n), {}, {}};
  in.block_tables.assign(pool.begin(), pool.begin() + batch * max_blocks);
  for (int64_t b = 0; b < batch; ++b) {
    in.kv_lens.push_back(rng() % 21);
    int64_t accepted = 0;
    random_path(rng, n, in.accepted.data() + b * n, accepted);
    in.num_accepted.push_back(accepted);
  }
  std::vector<Bytes> caches, expected;
  for (int64_t l = 0; l < layers; ++l) {
    caches.push_back(random_bytes(rng, num_blocks * block_size * row * elem));
    expected.push_back(caches.back());
    expected_compaction(in, g, expected.back());
  }
  run(in, g, caches, 3);
  CHECK(caches == expected);
}

void test_chain_moves_nothing() {
  std::mt19937 rng(7);
  const int64_t n = 8;
  Batch in{2, n, {0, 3}, {}, {7, 4}, {}};
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t k = 0; k < n; ++k) in.accepted.push_back(k <= in.num_accepted[b] ? k : -1);
  }
  const specdec::CacheGeometry g = contiguous(false, 2, 16, 2, 4, 2);
  std::vector<Bytes> caches = {random_bytes(rng, 2 * 16 * 2 * 4 * 2)};
  const Bytes before = caches[0];
  run(in, g, caches);
  CHECK(caches[0] == before);
}

void test_bad_entries_are_skipped() {
  // validate=False input: every move that would leave the request's cache is skipped,
  // positions below kv_len and other requests are untouched, nothing is out of bounds.
  std::mt19937 rng(11);
  const int64_t n = 4, seq = 8;
  const specdec::CacheGeometry g = contiguous(false, 3, seq, 1, 3, 1);
  // Request 0: node past N and a source past S. Request 1: negative kv_len.
  // Request 2: num_accepted past N - 1 (clamped to 3), negative node.
  Batch in{3, n, {5, -4, 1}, {0, 9, 3, -1, 0, 1, 2, 3, 0, -5, 3, 2}, {2, 3, 100}, {}};
  std::vector<Bytes> caches = {random_bytes(rng, 3 * seq * 3)};
  Bytes expected = caches[0];
  // Request 0: k=1 reads node 9 >= N, skipped; k=2 reads position 8 = S, skipped.
  // Request 2: k=1 node -5 skipped; k=2 node 3 -> position 4 copied to position 3;
  // k=3 node 2 -> position 3 (already overwritten) to position 4.
  std::memcpy(&expected[(2 * seq + 3) * 3], &caches[0][(2 * seq + 4) * 3], 3);
  std::memcpy(&expected[(2 * seq + 4) * 3], &caches[0][(2 * seq + 4) * 3], 3);
  std::vector<void*> layers = {caches[0].data()};
  std::vector<int32_t> new_lens(3);
  const specdec::CompactParams p = make_params(in, g, layers, new_lens.data(), false);
  specdec::compact_kv_cache_cpu(p, 0, 3);
  specdec::compute_new_kv_lens_cpu(p, 0, 3);
  CHECK(caches[0] == expected);
  CHECK_EQ(new_lens[0], 5 + 2 + 1);
  CHECK_EQ(new_lens[2], 1 + 3 + 1);  // num_accepted clamped to N - 1

  // Paged: a block id outside the pool, a column past the table, a shared block.
  const specdec::CacheGeometry pg = paged(3, 2, 2, 4, 1);
  Batch pin{2, n, {0, 1}, {0, 3, -1, -1, 0, 1, 2, 3}, {1, 3}, {7, -1, 0, 0}};
  std::vector<Bytes> pcaches = {random_bytes(rng, 3 * 2 * 4)};
  const Bytes pbefore = pcaches[0];
  std::vector<void*> players = {pcaches[0].data()};
  specdec::CompactParams pp = make_params(pin, pg, players, nullptr, false);
  specdec::compact_kv_cache_cpu(pp, 0, 2);
  CHECK(pcaches[0] == pbefore);  // request 0: block 7 outside the pool; request 1: a chain
  pin.accepted = {0, 1, -1, -1, 0, 2, -1, -1};
  pin.num_accepted = {1, 1};
  pin.kv_lens = {0, 2};
  pp = make_params(pin, pg, players, nullptr, false);
  specdec::compact_kv_cache_cpu(pp, 0, 2);  // request 1: position 4 is past its 2-block table
  CHECK(pcaches[0] == pbefore);
}

}  // namespace

int main() {
  test_overlap_by_hand();
  uint32_t seed = 100;
  for (int64_t n : {1, 7, 32, 33, 64, 100}) {
    for (int64_t elem : {1, 2, 4}) {
      test_random_contiguous(false, n, elem, seed++);
      test_random_contiguous(true, n, elem, seed++);
    }
    test_random_paged(n, 16, seed++);
    test_random_paged(n, 5, seed++);
  }
  test_chain_moves_nothing();
  test_bad_entries_are_skipped();
  TEST_MAIN_RETURN();
}
