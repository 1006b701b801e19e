// Tiny work on the CPU sampling path (issue 46: the op's fixed cost): rows of a few tokens take
// the threshold search without histograms (small_search), which must give histogram_search's
// threshold bit for bit; a warm call of tiny work allocates nothing (the thread keeps its
// buffers, CallBuffers); and those kept buffers change no output (a call after other calls
// gives what the same call gives on a fresh thread).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#include "harness.h"
#include "sampling_cpu.h"

// Every allocation of this program, counted (the core's buffers come from operator new; the
// replacements pair malloc with free).
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
namespace {
std::atomic<long> allocations{0};
}
void* operator new(std::size_t size) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size > 0 ? size : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

// One build's searches over a filled scratch: small_search (through search_threshold, the
// ops' entry) and histogram_search, with the ops' top-p hint (defined in the build's target
// region: its inline parts need its instructions).
#define SPECDEC_SEARCHES(ns)                                                                \
  void searches_##ns(const specdec::cpu::Scratch& filled, int64_t vocab, double target,   \
                     double fraction, float x_max, float temperature, bool found[2],         \
                     uint32_t key[2]) {                                                     \
    const auto hint = [x_max, temperature](float e) {                                      \
      const float x = x_max + temperature * std::log(e);                                   \
      return x > -std::numeric_limits<float>::infinity() && x <= x_max                     \
                 ? specdec::cpu::ns::sort_key(x)                                           \
                 : 0u;                                                                     \
    };                                                                                     \
    specdec::cpu::Scratch small = filled, full = filled;                                   \
    found[0] = specdec::cpu::ns::search_threshold(small, vocab, target, fraction, hint,    \
                                                  key[0]);                                 \
    found[1] = specdec::cpu::ns::histogram_search(full, vocab, target, fraction, hint,     \
                                                  key[1]);                                 \
  }

// The bodies, compiled here (this file's flags) to test their parts, as test_sampling_cpu does.
namespace specdec {
namespace cpu {
namespace parts {
#include "sampling_cpu_body.h"
}  // namespace parts
}  // namespace cpu
}  // namespace specdec
SPECDEC_SEARCHES(parts)
#if defined(__x86_64__) && defined(__GNUC__)
#define SPECDEC_TEST_VECTOR_BUILDS 1
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#pragma GCC optimize("fp-contract=off", "no-trapping-math")
namespace specdec {
namespace cpu {
namespace parts_avx2 {
#define SPECDEC_AVX2 1
#include "sampling_cpu_body.h"
#undef SPECDEC_AVX2
}  // namespace parts_avx2
}  // namespace cpu
}  // namespace specdec
SPECDEC_SEARCHES(parts_avx2)
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#pragma GCC optimize("fp-contract=off", "no-trapping-math")
namespace specdec {
namespace cpu {
namespace parts_avx512 {
#define SPECDEC_AVX512 1
#include "sampling_cpu_body.h"
#undef SPECDEC_AVX512
}  // namespace parts_avx512
}  // namespace cpu
}  // namespace specdec
SPECDEC_SEARCHES(parts_avx512)
#pragma GCC pop_options
#endif

using namespace specdec::cpu;

namespace {


bool has_avx2() {
#if defined(SPECDEC_TEST_VECTOR_BUILDS)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}
bool has_avx512() {
#if defined(SPECDEC_TEST_VECTOR_BUILDS)
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

// small_search == histogram_search (found and key) on rows of 1..kSmallSearch tokens: e weights
// and counts, with and without a cut, ties, -inf tokens, spreads that underflow, top-k targets
// 0..V+1 and top-p fractions from 1e-9 to 1; in every build this processor runs.
void test_small_search_is_the_histograms() {
  std::mt19937 rng(46);
  int64_t compared = 0, found_any = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int64_t vocab = 1 + static_cast<int64_t>(rng() % parts::kSmallSearch);
    const float scale = trial % 4 == 0 ? 40.0f : trial % 4 == 1 ? 0.01f : 3.0f;
    std::normal_distribution<float> normal(0.0f, scale);
    std::vector<float> x(vocab);
    for (auto& v : x) v = trial % 5 == 0 ? std::round(normal(rng)) : normal(rng);  // ties
    if (vocab > 3 && trial % 3 == 0) x[rng() % vocab] = -std::numeric_limits<float>::infinity();
    const float temperature = trial % 3 == 0 ? 0.5f : trial % 3 == 1 ? 1.0f : 2.0f;
    const parts::Row<Dtype::kFloat32, false> row{reinterpret_cast<const uint32_t*>(x.data()),
                                                 vocab, nullptr};
    const float x_max = parts::row_range(row).max;
    const float x_lo = trial % 2 == 0 ? -std::numeric_limits<float>::infinity()
                                      : x_max - scale * static_cast<float>(rng() % 3);
    Scratch filled;
    filled.keys.resize(vocab);
    filled.weights.resize(vocab);
    const bool mass = trial % 7 != 0;  // else counts (top-k's weights)
    const parts::Keep keep{x_max, temperature, x_lo, 0.0f};
    if (mass) {
      parts::fill_candidates<true>(row, keep, filled);
    } else {
      parts::fill_candidates<false>(row, keep, filled);
    }
    const double fractions[] = {0.0, 1e-9, 0.3, 0.5, 0.9, 0.999, 1.0};
    for (int t = 0; t < 9; ++t) {
      const bool top_k = t < 2;
      const double target = top_k ? static_cast<double>(rng() % (vocab + 2)) : 0.0;
      const double fraction = top_k ? 0.0 : fractions[t - 2];
      for (int build = 0; build < 3; ++build) {
        bool found[2] = {false, true};
        uint32_t key[2] = {1, 2};
        if (build == 0) {
          searches_parts(filled, vocab, target, fraction, x_max, temperature, found, key);
#if defined(SPECDEC_TEST_VECTOR_BUILDS)
        } else if (build == 1 && has_avx2()) {
          searches_parts_avx2(filled, vocab, target, fraction, x_max, temperature, found, key);
        } else if (build == 2 && has_avx512()) {
          searches_parts_avx512(filled, vocab, target, fraction, x_max, temperature, found, key);
#endif
        } else {
          continue;
        }
        CHECK(found[0] == found[1]);
        CHECK(!found[0] || key[0] == key[1]);
        ++compared;
        found_any += found[0];
      }
    }
  }
  CHECK(compared >= 3000 * 9 && found_any > compared / 2);
}

// Tiny calls of every op, with their own inputs and outputs (B requests, K drafts, V tokens).
struct Calls {
  int64_t batch, drafts, vocab;
  std::vector<float> target, draft_probs, draft_logits, temperature, top_p, min_p;
  std::vector<int64_t> ids, seed, offset, tree_ids, parents;
  std::vector<int32_t> top_k, counts, live;
  std::vector<int32_t> out, accepted, path, tokens;
  std::vector<float> logprobs, probs;

  Calls(int64_t b, int64_t k, int64_t v, uint32_t salt) : batch(b), drafts(k), vocab(v) {
    std::mt19937 rng(salt);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    const int64_t rows = k + 1;
    target.resize(b * rows * v);
    for (auto& x : target) x = normal(rng);
    draft_logits.resize(b * rows * v);
    for (auto& x : draft_logits) x = normal(rng);
    draft_probs.resize(b * rows * v);
    for (int64_t r = 0; r < b * rows; ++r) {
      float sum = 0.0f;
      for (int64_t i = 0; i < v; ++i) sum += draft_probs[r * v + i] = std::exp(draft_logits[r * v + i]);
      for (int64_t i = 0; i < v; ++i) draft_probs[r * v + i] /= sum;
    }
    for (int64_t r = 0; r < b; ++r) {
      temperature.push_back(r % 3 == 2 ? 0.0f : 0.7f + 0.3f * static_cast<float>(r % 2));
      top_p.push_back(r % 2 == 0 ? 0.9f : 1.0f);
      min_p.push_back(r % 4 == 1 ? 0.05f : 0.0f);
      top_k.push_back(r % 3 == 1 ? static_cast<int32_t>(v / 2) : 0);
      seed.push_back(1000 + salt + r);
      offset.push_back(r);
      counts.push_back(static_cast<int32_t>(k - r % 2));
      live.push_back(static_cast<int32_t>(rows));
      for (int64_t j = 0; j < k; ++j) ids.push_back(static_cast<int64_t>(rng() % v));
      for (int64_t i = 0; i < rows; ++i) {  // a tree: node i under node (i - 1) / 2
        tree_ids.push_back(i == 0 ? -1 : static_cast<int64_t>(rng() % v));
        parents.push_back(i == 0 ? -1 : (i - 1) / 2);
      }
    }
  }
  RequestParams params() const {
    return RequestParams{temperature.data(), top_k.data(), top_p.data(), min_p.data(),
                         seed.data(),        offset.data()};
  }
  // Every op once; the outputs of all of them, in order.
  std::vector<float> run() {
    std::vector<float> all;
    const int64_t rows = drafts + 1;
    for (int mode = 0; mode < 4; ++mode) {  // one-hot, probs, logits, block with logits
      ChainArgs a;
      a.batch = batch;
      a.num_drafts = drafts;
      a.vocab = vocab;
      a.target = target.data();
      a.draft_ids = ids.data();
      a.num_draft_tokens = counts.data();
      a.draft_probs = mode == 1 ? draft_probs.data() : nullptr;
      a.draft_logits = mode >= 2 ? draft_logits.data() : nullptr;
      a.method = mode == 3 ? ChainMethod::kBlock : ChainMethod::kToken;
      a.params = params();
      a.logprobs_kind = Logprobs::kProcessed;
      out.assign(batch * rows, 7);
      accepted.assign(batch, 7);
      logprobs.assign(batch * rows, 7.0f);
      a.output_token_ids = out.data();
      a.num_accepted = accepted.data();
      a.logprobs = logprobs.data();
      verify_chain(a, 0, batch);
      all.insert(all.end(), out.begin(), out.end());
      all.insert(all.end(), accepted.begin(), accepted.end());
      all.insert(all.end(), logprobs.begin(), logprobs.end());
    }
    for (int mode = 0; mode < 3; ++mode) {  // deterministic, i.i.d. token walk, traversal
      TreeArgs t;
      t.batch = batch;
      t.num_nodes = rows;
      t.vocab = vocab;
      t.target = target.data();
      t.tree_token_ids = tree_ids.data();
      t.parents = parents.data();
      t.live_nodes = live.data();
      t.draft_probs = mode >= 1 ? draft_probs.data() : nullptr;
      t.method = mode == 2 ? TreeMethod::kTraversal : TreeMethod::kToken;
      t.params = params();
      out.assign(batch * rows, 7);
      path.assign(batch * rows, 7);
      accepted.assign(batch, 7);
      t.output_token_ids = out.data();
      t.accepted_nodes = path.data();
      t.num_accepted = accepted.data();
      verify_tree(t, 0, batch);
      all.insert(all.end(), out.begin(), out.end());
      all.insert(all.end(), path.begin(), path.end());
      all.insert(all.end(), accepted.begin(), accepted.end());
    }
    SampleArgs s;
    s.batch = batch;
    s.vocab = vocab;
    s.logits = target.data();
    s.params = params();
    tokens.assign(batch, 7);
    s.tokens = tokens.data();
    sample(s, 0, batch);
    all.insert(all.end(), tokens.begin(), tokens.end());
    ProbsArgs p;
    p.rows = batch;
    p.vocab = vocab;
    p.logits = target.data();
    p.params = params();
    probs.assign(batch * vocab, 7.0f);
    p.probs = probs.data();
    processed_probs(p, 0, batch);
    all.insert(all.end(), probs.begin(), probs.end());
    return all;
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// A warm call of tiny work allocates nothing: every op, once to warm the thread's buffers,
// then again with the allocation count read around it (the outputs are preallocated).
void test_warm_tiny_calls_allocate_nothing() {
  for (const char* build : {"baseline", "avx2", "avx512"}) {
    if (!set_isa(build)) continue;
    Calls calls(2, 4, 16, 3);
    calls.run();
    ChainArgs a;  // the outputs stay in calls' buffers: no allocation of the test's own
    a.batch = calls.batch;
    a.num_drafts = calls.drafts;
    a.vocab = calls.vocab;
    a.target = calls.target.data();
    a.draft_ids = calls.ids.data();
    a.num_draft_tokens = calls.counts.data();
    a.draft_logits = calls.draft_logits.data();
    a.params = calls.params();
    a.output_token_ids = calls.out.data();
    a.num_accepted = calls.accepted.data();
    for (int method = 0; method < 2; ++method) {
      a.method = static_cast<ChainMethod>(method);
      verify_chain(a, 0, a.batch);
      const long warm = allocations.load();
      verify_chain(a, 0, a.batch);
      CHECK_EQ(allocations.load() - warm, 0);
    }
    SampleArgs s;
    s.batch = calls.batch;
    s.vocab = calls.vocab;
    s.logits = calls.target.data();
    s.params = calls.params();
    s.tokens = calls.tokens.data();
    sample(s, 0, s.batch);
    const long sample_warm = allocations.load();
    sample(s, 0, s.batch);
    CHECK_EQ(allocations.load() - sample_warm, 0);
    TreeArgs t;
    t.batch = calls.batch;
    t.num_nodes = calls.drafts + 1;
    t.vocab = calls.vocab;
    t.target = calls.target.data();
    t.tree_token_ids = calls.tree_ids.data();
    t.parents = calls.parents.data();
    t.live_nodes = calls.live.data();
    t.draft_probs = calls.draft_probs.data();
    t.method = TreeMethod::kTraversal;
    t.params = calls.params();
    calls.path.assign(t.batch * t.num_nodes, 0);
    t.output_token_ids = calls.out.data();
    t.accepted_nodes = calls.path.data();
    t.num_accepted = calls.accepted.data();
    verify_tree(t, 0, t.batch);
    const long tree_warm = allocations.load();
    verify_tree(t, 0, t.batch);
    CHECK_EQ(allocations.load() - tree_warm, 0);
  }
  set_isa("baseline");
}

// The thread's kept buffers change no output: each call after a run of other calls (other
// sizes, every op) gives, bit for bit, what it gives as the first call of a fresh thread.
void test_kept_buffers_change_nothing() {
  for (const char* build : {"baseline", "avx2", "avx512"}) {
    if (!set_isa(build)) continue;
    const int64_t sizes[][3] = {{1, 4, 16}, {3, 7, 60}, {2, 1, 1}, {1, 2, 3001}, {4, 3, 33},
                                 {1, 4, 16}};
    for (uint32_t salt = 0; salt < 6; ++salt) {
      const int64_t* size = sizes[salt];
      std::vector<float> here = Calls(size[0], size[1], size[2], salt).run();
      std::vector<float> fresh;
      std::thread([&] {
        set_isa(build);
        fresh = Calls(size[0], size[1], size[2], salt).run();
      }).join();
      CHECK(same_bits(here, fresh));
    }
  }
  set_isa("baseline");
}

}  // namespace

int main() {
  test_small_search_is_the_histograms();
  test_warm_tiny_calls_allocate_nothing();
  test_kept_buffers_change_nothing();
  TEST_MAIN_RETURN();
}
