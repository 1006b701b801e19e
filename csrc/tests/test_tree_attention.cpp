// C++ tests of build_tree_attention_cpu: a hand-computed tree, random trees against an
// ancestor walk, int32/int64 indices, padding, split ranges, and bad parents (no crash, no
// out-of-bounds access: this binary also runs under AddressSanitizer).
#include <cstdint>
#include <random>
#include <vector>

#include "harness.h"
#include "specdec.h"

namespace {

// Keeps the optional arguments out of template deduction, so nullptr is accepted (C++17).
template <typename T>
struct Same {
  using type = T;
};

struct Outputs {
  std::vector<uint8_t> mask;
  std::vector<uint32_t> packed;
  std::vector<int32_t> depth;
  std::vector<int64_t> position_ids;
};

template <typename Index>
Outputs run(const std::vector<Index>& parents,
            const typename Same<std::vector<Index>>::type* num_nodes,
            const typename Same<std::vector<Index>>::type* prefix_lens, int64_t batch, int64_t n,
            int64_t splits = 1) {
  const int64_t words = specdec::packed_words(n);
  Outputs out{std::vector<uint8_t>(batch * n * n, 7), std::vector<uint32_t>(batch * n * words, 7),
              std::vector<int32_t>(batch * n, 7), std::vector<int64_t>(batch * n, 7)};
  specdec::TreeAttentionParams p;
  const bool is64 = sizeof(Index) == 8;
  p.parents = {parents.data(), is64};
  if (num_nodes) p.num_nodes = {num_nodes->data(), is64};
  if (prefix_lens) p.prefix_lens = {prefix_lens->data(), is64};
  p.batch_size = batch;
  p.num_nodes_max = n;
  p.mask = out.mask.data();
  p.packed_mask = out.packed.data();
  p.depth = out.depth.data();
  p.position_ids = out.position_ids.data();
  for (int64_t s = 0; s < splits; ++s) {
    specdec::build_tree_attention_cpu(p, batch * s / splits, batch * (s + 1) / splits);
  }
  return out;
}

// The definition: walk from each real node to the root.
void check_against_walk(const Outputs& out, const std::vector<int64_t>& parents,
                        const std::vector<int64_t>& num_nodes, const std::vector<int64_t>& prefix,
                        int64_t batch, int64_t n) {
  const int64_t words = specdec::packed_words(n);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      std::vector<uint8_t> expected(n, 0);
      int64_t depth = 0;
      expected[i] = 1;
      if (i < num_nodes[b]) {
        for (int64_t j = i; j != 0; ++depth) {
          j = parents[b * n + j];
          expected[j] = 1;
        }
      }
      CHECK_EQ(out.depth[b * n + i], depth);
      CHECK_EQ(out.position_ids[b * n + i], prefix[b] + depth);
      for (int64_t j = 0; j < n; ++j) {
        CHECK_EQ(out.mask[(b * n + i) * n + j], expected[j]);
        const uint32_t word = out.packed[(b * n + i) * words + j / 32];
        CHECK_EQ((word >> (j % 32)) & 1u, expected[j]);
      }
      for (int64_t w = 0; w < words; ++w) {  // bits past N are zero
        for (int64_t j = w * 32; j < (w + 1) * 32; ++j) {
          if (j >= n) CHECK_EQ((out.packed[(b * n + i) * words + w] >> (j % 32)) & 1u, 0);
        }
      }
    }
  }
}

void test_hand_computed() {
  // Tree: 0 -> {1, 2}, 1 -> 3, 3 -> 4; node 5 is padding.
  const std::vector<int32_t> parents = {-1, 0, 0, 1, 3, 99};
  const std::vector<int32_t> num_nodes = {5};
  const std::vector<int32_t> prefix = {10};
  const Outputs out = run(parents, &num_nodes, &prefix, 1, 6);
  const uint8_t expected[6][6] = {{1, 0, 0, 0, 0, 0}, {1, 1, 0, 0, 0, 0}, {1, 0, 1, 0, 0, 0},
                                  {1, 1, 0, 1, 0, 0}, {1, 1, 0, 1, 1, 0}, {0, 0, 0, 0, 0, 1}};
  const int32_t depth[6] = {0, 1, 1, 2, 3, 0};
  const uint32_t packed[6] = {0x1, 0x3, 0x5, 0xB, 0x1B, 0x20};
  for (int i = 0; i < 6; ++i) {
    for (int j = 0; j < 6; ++j) CHECK_EQ(out.mask[i * 6 + j], expected[i][j]);
    CHECK_EQ(out.depth[i], depth[i]);
    CHECK_EQ(out.position_ids[i], 10 + depth[i]);
    CHECK_EQ(out.packed[i], packed[i]);
  }
}

void test_bit_31_sign() {
  // A chain of 33 nodes: row 32 sets bit 31 of word 0 (the int32 sign bit) and bit 0 of word 1.
  std::vector<int64_t> parents(33);
  for (int i = 0; i < 33; ++i) parents[i] = i - 1;
  const Outputs out = run(parents, nullptr, nullptr, 1, 33);
  CHECK_EQ(out.packed[32 * 2 + 0], 0xFFFFFFFFu);
  CHECK_EQ(out.packed[32 * 2 + 1], 0x1u);
  CHECK_EQ(out.packed[31 * 2 + 1], 0x0u);
  CHECK_EQ(out.depth[32], 32);
}

template <typename Index>
void test_random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t batch = 5;
  std::vector<int64_t> parents(batch * n), num_nodes(batch), prefix(batch);
  for (int64_t b = 0; b < batch; ++b) {
    num_nodes[b] = 1 + static_cast<int64_t>(rng() % n);
    if (b == 0) num_nodes[b] = n;
    prefix[b] = rng() % 1000;
    for (int64_t i = 0; i < n; ++i) {
      parents[b * n + i] = i == 0 ? -1 : (i < num_nodes[b] ? rng() % i : -1 - (rng() % 3));
      if (b == 1 && i > 0 && i < num_nodes[b]) parents[b * n + i] = i - 1;  // a chain
    }
  }
  const std::vector<Index> p(parents.begin(), parents.end());
  const std::vector<Index> nn(num_nodes.begin(), num_nodes.end());
  const std::vector<Index> pl(prefix.begin(), prefix.end());
  const Outputs out = run(p, &nn, &pl, batch, n);
  check_against_walk(out, parents, num_nodes, prefix, batch, n);
  const Outputs split = run(p, &nn, &pl, batch, n, 3);
  CHECK(split.mask == out.mask && split.packed == out.packed && split.depth == out.depth &&
        split.position_ids == out.position_ids);
}

void test_defaults() {
  const std::vector<int32_t> parents = {-1, 0, 1};
  const Outputs out = run(parents, nullptr, nullptr, 1, 3);
  CHECK_EQ(out.position_ids[2], 2);
  CHECK_EQ(out.mask[2 * 3 + 0], 1);
}

void test_bad_parents_are_contained() {
  // Forward parent, self parent, huge and negative parents, num_nodes out of range: each
  // such node becomes a root of its own; nothing outside the outputs is touched (ASan).
  const int64_t n = 6;
  const std::vector<int64_t> parents = {5, 4, 2, 1LL << 40, -7, 3, -1, 0, 1, 2, 3, 4};
  const std::vector<int64_t> num_nodes = {6, 1000};
  const Outputs out = run(parents, &num_nodes, nullptr, 2, n);
  const int32_t depth[6] = {0, 0, 0, 0, 0, 1};
  for (int i = 0; i < 6; ++i) CHECK_EQ(out.depth[i], depth[i]);
  CHECK_EQ(out.depth[n + 5], 5);  // num_nodes clamped to N
  const std::vector<int64_t> negative = {-3, 0};
  const Outputs empty = run(parents, &negative, nullptr, 2, n);
  for (int i = 0; i < 2 * n; ++i) CHECK_EQ(empty.depth[i], 0);
  CHECK_EQ(empty.mask[1 * n + 0], 0);
  CHECK_EQ(empty.mask[1 * n + 1], 1);
}

}  // namespace

int main() {
  test_hand_computed();
  test_bit_31_sign();
  test_defaults();
  const int64_t sizes[] = {1, 7, 32, 33, 64, 100};
  uint32_t seed = 1;
  for (int64_t n : sizes) {
    test_random<int32_t>(n, seed++);
    test_random<int64_t>(n, seed++);
  }
  test_bad_parents_are_contained();
  TEST_MAIN_RETURN();
}
