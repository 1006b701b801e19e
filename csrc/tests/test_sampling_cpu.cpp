// The CPU sampling core (csrc/core/sampling_cpu.h), torch-free: Philox-4x32-10 against
// Random123's known answers, the uniform and noise at their edges, the filters' kept sets
// against a sort-based definition in double, and small verify/sample cases with known answers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "sampling_cpu.h"

// The bodies, compiled here once more (this file's target and flags) to test their parts.
namespace specdec {
namespace cpu {
namespace parts {
#include "sampling_cpu_body.h"
}  // namespace parts
}  // namespace cpu
}  // namespace specdec
#if defined(__x86_64__) && defined(__GNUC__)
// The vector builds' parts, for their explicit paths (the kept first level).
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
#include "kept_level_checks.h"
}  // namespace parts_avx2
}  // namespace cpu
}  // namespace specdec
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
#include "kept_level_checks.h"
}  // namespace parts_avx512
}  // namespace cpu
}  // namespace specdec
#pragma GCC pop_options
#endif

using namespace specdec::cpu;

namespace {

void test_random123_known_answers() {
  const uint32_t m = 0xFFFFFFFFu;
  Words w = philox4x32_10(0, 0, 0, 0, 0, 0);
  CHECK(w.w[0] == 0x6627E8D5u && w.w[1] == 0xE169C58Du && w.w[2] == 0xBC57AC4Cu &&
        w.w[3] == 0x9B00DBD8u);
  w = philox4x32_10(m, m, m, m, m, m);
  CHECK(w.w[0] == 0x408F276Du && w.w[1] == 0x41C83B0Eu && w.w[2] == 0xA20BC7C6u &&
        w.w[3] == 0x6D5451FDu);
  w = philox4x32_10(0x243F6A88u, 0x85A308D3u, 0x13198A2Eu, 0x03707344u, 0xA4093822u,
                    0x299F31D0u);
  CHECK(w.w[0] == 0xD16CFE09u && w.w[1] == 0x94FDCCEBu && w.w[2] == 0x5001E420u &&
        w.w[3] == 0x24126EA1u);
  // The stream layout: counter (index / 4, position | purpose << 16, offset lo, hi), key seed.
  const int64_t seed = -3, offset = (int64_t{5} << 32) | 7;
  const Words direct = philox4x32_10(9, 0x10000u | 4u, 7, 5, 0xFFFFFFFDu, 0xFFFFFFFFu);
  for (uint32_t lane = 0; lane < 4; ++lane) {
    CHECK(random_word(seed, offset, 4, kPurposeResample, 36 + lane) == direct.w[lane]);
  }
  CHECK(random_word(seed, offset, 4 + 65536, kPurposeResample, 36) == direct.w[0]);  // position & 0xFFFF
}

void test_uniform_and_noise_edges() {
  CHECK(word_uniform(0) == std::ldexp(1.0f, -33));  // the middle of cell [0, 2**-32)
  CHECK(word_uniform(1) == std::ldexp(1.0f, -32));
  CHECK(word_uniform((1u << 24) - 1) == std::ldexp(float((1u << 24) - 1), -32));
  CHECK(word_uniform(0xFFFFFFFFu) == 1.0f - std::ldexp(1.0f, -24));  // < 1 always
  CHECK(word_uniform((1u << 25) + 1) == std::ldexp(1.0f, -7));  // round to nearest even
  CHECK(word_uniform((1u << 25) + 3) == std::ldexp(float((1u << 25) + 4), -32));
  CHECK(uniform_noise(word_uniform(0)) == std::ldexp(1.0f, -33));
  const float top = uniform_noise(word_uniform(0xFFFFFFFFu));
  CHECK(std::fabs(top - 24.0f * std::log(2.0f)) < 1e-5f);
  float previous = 0.0f;
  bool monotone = true, finite = true;
  for (uint64_t word = 0; word <= 0xFFFFFFFFull; word += 65521) {
    const float u = word_uniform(static_cast<uint32_t>(word));
    const float e = uniform_noise(u);
    finite &= std::isfinite(e) && e > 0.0f;
    monotone &= e >= previous;
    previous = e;
    const double exact = -std::log1p(-static_cast<double>(u));
    if (std::fabs(e - exact) > 4e-7 * exact) {
      CHECK(std::fabs(e - exact) <= 4e-7 * exact);
      break;
    }
  }
  CHECK(finite);
  CHECK(monotone);
}

uint32_t float_bits_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return bits;
}

uint16_t half_bits(float x) {  // exact halves only (test inputs)
  if (x == 0.0f) return 0;
  uint16_t sign = x < 0 ? 0x8000 : 0;
  float a = std::fabs(x);
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2**e, m in [0.5, 1)
  const int exponent = e - 1 + 15;
  const uint16_t mantissa = static_cast<uint16_t>((m * 2.0f - 1.0f) * 1024.0f);
  return static_cast<uint16_t>(sign | (exponent << 10) | mantissa);
}

void test_dtypes_read_the_same_values() {
  const std::vector<float> values = {-3.0f, 0.5f, 2.0f, 2.0f, -0.25f, 1.5f, 7.0f};
  std::vector<uint16_t> bf16, f16;
  for (float v : values) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    bf16.push_back(static_cast<uint16_t>(bits >> 16));
    f16.push_back(half_bits(v));
  }
  f16.push_back(0x7C00);  // +inf: never sampled
  bf16.push_back(0x7FC0);  // NaN
  std::vector<float> f32 = values;
  f32.push_back(-std::numeric_limits<float>::infinity());
  Scratch scratch;
  Filters filters;
  filters.top_k = 3;
  const int64_t vocab = static_cast<int64_t>(f32.size());
  const RowStats s32 = row_stats(RowView{f32.data(), Dtype::kFloat32, vocab, nullptr}, filters, scratch);
  const RowStats sbf = row_stats(RowView{bf16.data(), Dtype::kBFloat16, vocab, nullptr}, filters, scratch);
  const RowStats sf16 = row_stats(RowView{f16.data(), Dtype::kFloat16, vocab, nullptr}, filters, scratch);
  for (int64_t i = 0; i < vocab; ++i) {
    const float p = row_prob(RowView{f32.data(), Dtype::kFloat32, vocab, nullptr}, s32, i);
    CHECK(p == row_prob(RowView{bf16.data(), Dtype::kBFloat16, vocab, nullptr}, sbf, i));
    CHECK(p == row_prob(RowView{f16.data(), Dtype::kFloat16, vocab, nullptr}, sf16, i));
    CHECK((p > 0.0f) == (i == 2 || i == 3 || i == 6));  // top-3 with the tie at 2.0 kept
  }
  CHECK(s32.x_max == 7.0f);
}

// The kept set of top-k then top-p by sorting, in double (the definition's shape).
std::vector<bool> kept_by_sorting(const std::vector<float>& x, float temperature, int top_k,
                                  float top_p) {
  const int64_t vocab = static_cast<int64_t>(x.size());
  std::vector<int64_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x[a] > x[b]; });
  const float x_max = x[order[0]];
  std::vector<bool> kept(vocab, true);
  if (top_k > 0 && top_k < vocab) {
    const float kth = x[order[top_k - 1]] / temperature;
    for (int64_t i = 0; i < vocab; ++i) kept[i] = x[i] / temperature >= kth;
  }
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (kept[i]) total += std::exp((static_cast<double>(x[i]) - x_max) / temperature);
  }
  if (top_p < 1.0f) {
    double mass = 0.0;
    float tau_x = x[order[vocab - 1]];
    for (int64_t r = 0; r < vocab; ++r) {
      const int64_t i = order[r];
      if (!kept[i]) continue;
      mass += std::exp((static_cast<double>(x[i]) - x_max) / temperature);
      if (mass >= top_p * total) {
        tau_x = x[i];
        break;
      }
    }
    for (int64_t i = 0; i < vocab; ++i) kept[i] = kept[i] && x[i] >= tau_x;
  }
  return kept;
}

void test_filters_match_sorting() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  Scratch scratch;
  int compared = 0, differing = 0;
  for (int trial = 0; trial < 120; ++trial) {
    const int64_t vocab = 1 + static_cast<int64_t>(rng() % 5000);
    std::vector<float> x(vocab);
    const bool integers = trial % 3 == 0;  // full of ties
    for (auto& v : x) v = integers ? std::round(normal(rng)) : normal(rng);
    Filters f;
    f.temperature = 0.5f + static_cast<float>(trial % 4) * 0.5f;
    f.top_k = static_cast<int32_t>(trial % 5 == 0 ? 0 : rng() % (vocab + 2));
    f.top_p = trial % 2 == 0 ? 1.0f : 0.05f + 0.9f * static_cast<float>(rng() % 1000) / 1000.0f;
    const RowView view{x.data(), Dtype::kFloat32, vocab, nullptr};
    const RowStats s = row_stats(view, f, scratch);
    const std::vector<bool> expected = kept_by_sorting(x, f.temperature, f.top_k, f.top_p);
    double sum = 0.0;
    bool same = true;
    for (int64_t i = 0; i < vocab; ++i) {
      const float p = row_prob(view, s, i);
      sum += p;
      same &= (p > 0.0f) == expected[i];
    }
    ++compared;
    differing += !same;
    CHECK(std::fabs(sum - 1.0) < 1e-4);
  }
  // Only decisions within float rounding of the top-p boundary may differ.
  CHECK(differing * 50 <= compared);
}

void test_verify_and_sample_known_answers() {
  // The verify_chain docstring: greedy, drafts [1, 2] on arg-maxes [1, 0, 2] -> [1, 0, -1].
  const float target[9] = {0, 9, 0, 9, 0, 0, 0, 0, 9};
  const int64_t ids[2] = {1, 2};
  const int32_t n[1] = {2};
  const float temperature[1] = {0.0f}, top_p[1] = {1.0f};
  const int32_t top_k[1] = {0};
  const int64_t seed[1] = {1}, offset[1] = {0};
  ChainArgs a;
  a.batch = 1;
  a.num_drafts = 2;
  a.vocab = 3;
  a.target = target;
  a.draft_ids = ids;
  a.num_draft_tokens = n;
  a.params = RequestParams{temperature, top_k, top_p, nullptr, seed, offset};
  int32_t out[3] = {7, 7, 7}, accepted[1] = {7};
  a.output_token_ids = out;
  a.num_accepted = accepted;
  verify_chain(a, 0, 1);
  CHECK_EQ(out[0], 1);
  CHECK_EQ(out[1], 0);
  CHECK_EQ(out[2], -1);
  CHECK_EQ(accepted[0], 1);
  // A row with no finite logit samples -1; a sampled near-one-hot row its arg-max.
  const float inf = std::numeric_limits<float>::infinity();
  const float rows[6] = {-inf, NAN, inf, 0.0f, 80.0f, 0.0f};
  const float t1[2] = {1.0f, 1.0f}, p1[2] = {1.0f, 1.0f};
  const int32_t k1[2] = {0, 0};
  const int64_t s1[2] = {3, 4}, o1[2] = {0, 0};
  SampleArgs sa;
  sa.batch = 2;
  sa.vocab = 3;
  sa.logits = rows;
  sa.params = RequestParams{t1, k1, p1, nullptr, s1, o1};
  int32_t tokens[2] = {7, 7};
  sa.tokens = tokens;
  sample(sa, 0, 2);
  CHECK_EQ(tokens[0], -1);
  CHECK_EQ(tokens[1], 1);
}

void test_verify_tree_known_answers_and_garbage() {
  // The verify_tree docstring: greedy, arg-maxes [1, 0, 2, 0], nodes 1 (token 0) and 2
  // (token 1) under the root, node 3 (token 2) under node 2 -> [1, 2, 0, -1], path [0, 2, 3].
  const float target[12] = {0, 9, 0, 9, 0, 0, 0, 0, 9, 9, 0, 0};
  const int64_t ids[4] = {-1, 0, 1, 2}, parents[4] = {-1, 0, 0, 2};
  const int32_t live[1] = {4};
  const float temperature[1] = {0.0f}, top_p[1] = {1.0f};
  const int32_t top_k[1] = {0};
  const int64_t seed[1] = {1}, offset[1] = {0};
  TreeArgs a;
  a.batch = 1;
  a.num_nodes = 4;
  a.vocab = 3;
  a.target = target;
  a.tree_token_ids = ids;
  a.parents = parents;
  a.live_nodes = live;
  a.params = RequestParams{temperature, top_k, top_p, nullptr, seed, offset};
  a.logprobs_kind = Logprobs::kProcessed;
  int32_t out[4], path[4], accepted[1];
  float logprobs[4];
  a.output_token_ids = out;
  a.accepted_nodes = path;
  a.num_accepted = accepted;
  a.logprobs = logprobs;
  verify_tree(a, 0, 1);
  CHECK_EQ(out[0], 1);
  CHECK_EQ(out[1], 2);
  CHECK_EQ(out[2], 0);
  CHECK_EQ(out[3], -1);
  CHECK_EQ(path[0], 0);
  CHECK_EQ(path[1], 2);
  CHECK_EQ(path[2], 3);
  CHECK_EQ(path[3], -1);
  CHECK_EQ(accepted[0], 2);
  CHECK(logprobs[0] == 0.0f && logprobs[2] == 0.0f && std::isnan(logprobs[3]));
  // Garbage trees (parents and ids anywhere, num_nodes outside 1..N) with i.i.d. and
  // without-replacement drafts (NaN and negative probabilities), token walk and traversal:
  // ids stay in [-1, V), nodes in [-1, N) (ASan checks the reads).
  std::mt19937_64 rng(11);
  const int64_t batch = 16, nodes = 6, vocab = 37;
  std::vector<float> logits(batch * nodes * vocab), q(batch * nodes * vocab);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (auto& x : logits) x = normal(rng);
  for (auto& x : q) x = std::fabs(normal(rng)) / vocab;
  q[5] = NAN;
  q[vocab * 7] = -1.0f;
  std::vector<int64_t> garbage_ids(batch * nodes), garbage_parents(batch * nodes);
  const int64_t choices[6] = {-3, 0, 1, 5, 40, int64_t{1} << 40};
  for (int64_t i = 0; i < batch * nodes; ++i) {
    garbage_ids[i] = rng() % 3 == 0 ? choices[rng() % 6] : static_cast<int64_t>(rng() % vocab);
    garbage_parents[i] = rng() % 3 == 0 ? choices[rng() % 6] : static_cast<int64_t>(rng() % (i % nodes + 1)) - 1;
  }
  std::vector<int32_t> lives(batch), ks(batch, 3);
  std::vector<float> temps(batch, 0.8f), ps(batch, 0.9f);
  std::vector<int64_t> seeds(batch), offsets(batch, 0);
  for (int64_t b = 0; b < batch; ++b) {
    lives[b] = static_cast<int32_t>(b % 9) - 1;
    seeds[b] = static_cast<int64_t>(rng());
    temps[b] = b % 4 == 0 ? 0.0f : 0.8f;
  }
  std::vector<int32_t> o(batch * nodes), pa(batch * nodes), acc(batch);
  std::vector<float> lp(batch * nodes);
  for (int kind = 0; kind < 5; ++kind) {  // deterministic, iid, wor; traversal iid, wor
    TreeArgs g;
    g.batch = batch;
    g.num_nodes = nodes;
    g.vocab = vocab;
    g.target = logits.data();
    g.tree_token_ids = garbage_ids.data();
    g.parents = garbage_parents.data();
    g.live_nodes = lives.data();
    g.draft_probs = kind == 0 ? nullptr : q.data();
    g.draft_sampling = kind % 2 == 0 ? DraftSampling::kWithoutReplacement : DraftSampling::kIid;
    g.method = kind >= 3 ? TreeMethod::kTraversal : TreeMethod::kToken;
    g.params = RequestParams{temps.data(), ks.data(), ps.data(), nullptr, seeds.data(),
                             offsets.data()};
    g.logprobs_kind = Logprobs::kRaw;
    g.output_token_ids = o.data();
    g.accepted_nodes = pa.data();
    g.num_accepted = acc.data();
    g.logprobs = lp.data();
    verify_tree(g, 0, batch);
    for (int64_t i = 0; i < batch * nodes; ++i) {
      CHECK(o[i] >= -1 && o[i] < vocab);
      CHECK(pa[i] >= -1 && pa[i] < nodes);
    }
    for (int64_t b = 0; b < batch; ++b) CHECK(acc[b] >= 0 && acc[b] < nodes);
  }
}

// Issue 28: subnormal probabilities are kept, a top_p of 0 (a tiny top_p rounded to float32)
// keeps the arg-max and its ties, and every instruction-set build gives the same numbers.
void test_one_law_edges_and_builds() {
  Scratch scratch;
  const std::vector<float> x = {0.0f, -90.0f, -100.0f, -103.0f, -110.0f};
  const RowView row{x.data(), Dtype::kFloat32, static_cast<int64_t>(x.size()), nullptr};
  Filters plain;
  const RowStats s = row_stats(row, plain, scratch);
  for (int64_t i = 0; i < 5; ++i) {
    const double exact = std::exp(static_cast<double>(x[i])) / s.norm;
    const float p = row_prob(row, s, i);
    CHECK((p > 0.0f) == (i != 4));  // exp(-110) rounds to 0 in float32, exp(-103) does not
    if (i != 4) CHECK(std::fabs(p - exact) <= 1e-6 * exact + 1.5e-45);
  }
  const std::vector<float> y = {0.0f, -1.0f, 0.0f, -2.0f};
  const RowView tied{y.data(), Dtype::kFloat32, 4, nullptr};
  Filters tiny_top_p;
  tiny_top_p.top_p = 0.0f;  // 1e-50 in float32
  const RowStats t = row_stats(tied, tiny_top_p, scratch);
  for (int64_t i = 0; i < 4; ++i) {
    CHECK((row_prob(tied, t, i) > 0.0f) == (i == 0 || i == 2));  // the arg-max and its tie
  }
  CHECK(row_prob(tied, t, 0) == 0.5f);
  // The builds: the same tokens from sample on a row mixing filters, for each build here.
  CHECK(isa_supported("baseline") && !isa_supported("sse9") && !set_isa("sse9"));
  const std::string chosen = isa();
  const int64_t batch = 8, vocab = 3001;
  std::mt19937 rng(28);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> logits(batch * vocab);
  for (auto& v : logits) v = normal(rng);
  const float temperature[batch] = {1.0f, 0.7f, 1.0f, 2.0f, 1e8f, 1.0f, 0.3f, 1.0f};
  const int32_t top_k[batch] = {0, 50, 0, 7, 0, 0, 3, 0};
  const float top_p[batch] = {1.0f, 1.0f, 0.9f, 0.5f, 0.3f, 0.0f, 1.0f, 0.999f};
  const float min_p[batch] = {0.0f, 0.0f, 0.1f, 0.0f, 0.0f, 0.0f, 0.0f, 0.05f};
  const int64_t seed[batch] = {1, 2, 3, 4, 5, 6, 7, 8}, offset[batch] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::vector<int32_t> first;
  for (const char* name : {"baseline", "avx2", "avx512"}) {
    if (!set_isa(name)) continue;
    std::vector<int32_t> tokens(batch);
    std::vector<float> logprobs(batch);
    SampleArgs a;
    a.batch = batch;
    a.vocab = vocab;
    a.logits = logits.data();
    a.params = RequestParams{temperature, top_k, top_p, min_p, seed, offset};
    a.logprobs_kind = Logprobs::kProcessed;
    a.tokens = tokens.data();
    a.logprobs = logprobs.data();
    sample(a, 0, batch);
    for (float& lp : logprobs) tokens.push_back(static_cast<int32_t>(float_bits_of(lp)));
    if (first.empty()) first = tokens;
    CHECK(tokens == first);
  }
  CHECK(set_isa(chosen.c_str()));
}

// A clean row's passes (normal_exp, loads without sanitising, no selects without a cut) give
// the general passes' values bit for bit: the exp over a sweep of [kNormalExpMin, 0]; the
// norm pass's weights and sum and top-p's candidate weights on fp32, bf16 and fp16 rows; and
// stats_of's own choice on rows at and past the -87 boundary, with a NaN, an infinity, a
// masked token or a negative (unvalidated) temperature, against the general passes.
template <class R>
void check_clean_row(const R& row, std::vector<float>& general, std::vector<float>& clean) {
  using namespace parts;
  const int64_t vocab = row.vocab;
  for (const float temperature : {1.0f, 0.5f, 3.0f}) {
    for (const float x_lo : {-kInf, -2.0f}) {
      const Keep keep{row_range(row).max, temperature, x_lo, 0.0f};
      CHECK((row_range(row).min - keep.x_max) / temperature >= kNormalExpMin);
      const uint32_t sum = float_bits(kept_sum<false, false, true>(row, keep, general.data()));
      if (x_lo == -kInf) {  // no cut: the selects left out
        CHECK(float_bits(kept_sum<false, true, false>(clean_row(row), keep, clean.data())) == sum);
        CHECK(std::memcmp(general.data(), clean.data(), vocab * 4) == 0);
        CHECK(float_bits(kept_sum<false, false, false>(row, keep, clean.data())) == sum);
        CHECK(std::memcmp(general.data(), clean.data(), vocab * 4) == 0);
      }
      CHECK(float_bits(kept_sum<false, true, true>(clean_row(row), keep, clean.data())) == sum);
      CHECK(std::memcmp(general.data(), clean.data(), vocab * 4) == 0);
      if (temperature == 1.0f) {
        CHECK(float_bits(kept_sum<true, true, true>(clean_row(row), keep, clean.data())) == sum);
      }
      Scratch scratch;
      scratch.keys.resize(vocab);
      scratch.weights.resize(vocab);
      fill_candidates<true, false, false>(row, keep, scratch);
      const std::vector<float> candidates(scratch.weights.begin(), scratch.weights.end());
      fill_candidates<true, false, true>(clean_row(row), keep, scratch);
      CHECK(std::memcmp(candidates.data(), scratch.weights.data(), vocab * 4) == 0);
    }
  }
}

// stats_of (which picks the clean passes or not) against the general norm pass.
template <class R>
void check_stats_of(const R& row, float temperature) {
  using namespace parts;
  Scratch scratch;
  Filters filters;
  filters.temperature = temperature;
  const RowStats s = stats_of(row, filters, scratch);
  CHECK(s.has_finite && s.cache != nullptr);
  std::vector<float> general(row.vocab);
  const Keep keep{s.x_max, temperature, -kInf, 0.0f};
  CHECK(float_bits(kept_sum<false, false, true>(row, keep, general.data())) ==
        float_bits(s.norm));
  CHECK(std::memcmp(general.data(), s.cache->weights.data(), row.vocab * 4) == 0);
}

void test_clean_rows_take_the_general_values() {
  using namespace parts;
  int64_t swept = 0;
  for (uint32_t bits = 0x80000000u; bits <= float_bits(kNormalExpMin); bits += 991) {
    CHECK(float_bits(normal_exp(bits_float(bits))) == float_bits(fast_exp(bits_float(bits))));
    ++swept;
  }
  CHECK(swept > 1000000);
  CHECK(normal_exp(kNormalExpMin) == fast_exp(kNormalExpMin) && normal_exp(-0.0f) == 1.0f);
  std::mt19937 rng(16);
  std::normal_distribution<float> normal(0.0f, 6.0f);
  const int64_t vocab = 1000;  // tails shorter than a block and than a vector
  std::vector<float> x(vocab);
  std::vector<uint16_t> bf16(vocab), fp16(vocab);
  for (int64_t i = 0; i < vocab; ++i) {
    x[i] = normal(rng);
    bf16[i] = static_cast<uint16_t>(float_bits(x[i]) >> 16);
    // A half of exponent 0..18 (|x| < 16, subnormal halves included), random sign.
    fp16[i] = static_cast<uint16_t>((rng() & 0x8000u) | (rng() % 19) << 10 | (rng() & 0x3FFu));
  }
  const auto* bits = reinterpret_cast<const uint32_t*>(x.data());
  std::vector<float> general(vocab), clean(vocab);
  check_clean_row(Row<Dtype::kFloat32, false>{bits, vocab, nullptr}, general, clean);
  check_clean_row(Row<Dtype::kBFloat16, false>{bf16.data(), vocab, nullptr}, general, clean);
  check_clean_row(Row<Dtype::kFloat16, false>{fp16.data(), vocab, nullptr}, general, clean);
  // stats_of's choice: at the boundary (clean), past it (subnormal e: the general passes),
  // and negative temperatures (never clean).
  for (const float low : {-87.0f, -87.5f, -100.0f, -149.0f}) {
    x[3] = 0.0f;
    for (int64_t i = 0; i < vocab; ++i) x[i] = std::min(std::max(x[i], low + 1.0f), 0.0f);
    x[5] = low;
    for (const float temperature : {1.0f, 0.999f, 2.0f, -1.0f, -0.5f}) {
      check_stats_of(Row<Dtype::kFloat32, false>{bits, vocab, nullptr}, temperature);
    }
  }
  // A NaN, an infinity or a masked token makes a row unclean (its min is -inf).
  const Row<Dtype::kFloat32, false> row{bits, vocab, nullptr};
  for (const float special : {std::numeric_limits<float>::quiet_NaN(), kInf, -kInf}) {
    x[7] = special;
    CHECK(row_range(row).min == -kInf);
    check_stats_of(row, 1.0f);
  }
  x[7] = 0.0f;
  std::vector<uint32_t> allowed(vocab, ~0u);
  CHECK(row_range(Row<Dtype::kFloat32, true>{bits, vocab, allowed.data()}).min > -kInf);
  allowed[9] = 0u;
  const Row<Dtype::kFloat32, true> masked{bits, vocab, allowed.data()};
  CHECK(row_range(masked).min == -kInf);
  check_stats_of(masked, 1.0f);
}

// Top-p's first level over the kept bins only (the vector builds): keep_from_key and the
// kept level's sums against the definitions, and the threshold against the full search's
// (the baseline's) whatever the hint: a good one, none, and one that keeps too little (the
// full level runs then); rows with a cut and -inf tokens.
void test_kept_first_level_matches_the_full_one() {
#if defined(SPECDEC_TEST_VECTOR_BUILDS)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("bmi2");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  std::mt19937 rng(28);
  int64_t searches = 0;
  for (const float scale : {3.0f, 12.0f, 0.01f}) {
    std::normal_distribution<float> normal(0.0f, scale);
    for (const int64_t vocab : {int64_t{1}, int64_t{7}, int64_t{37}, int64_t{3001},
                                int64_t{49152}}) {
      std::vector<float> x(vocab);
      for (auto& v : x) v = normal(rng);
      if (vocab > 1) x[vocab / 2] = x[0];  // a tie
      if (vocab > 7) x[3] = -std::numeric_limits<float>::infinity();
      const parts::Row<Dtype::kFloat32, false> row{reinterpret_cast<const uint32_t*>(x.data()),
                                                   vocab, nullptr};
      const float x_max = parts::row_range(row).max;
      for (const float x_lo : {-std::numeric_limits<float>::infinity(), x_max - scale}) {
        Scratch full;
        full.keys.resize(vocab);
        full.weights.resize(vocab);
        parts::fill_candidates<true, true>(row, parts::Keep{x_max, 1.0f, x_lo, 0.0f}, full);
        for (const uint32_t key_floor :
             {0u, parts::sort_key(x_max - 2 * scale) & ~0x1FFFFFu,
              parts::sort_key(x_max) & ~0x1FFFFFu, 0xFFE00000u}) {
          CHECK(!avx2 || parts_avx2::kept_level_is_the_full_levels(full, vocab, key_floor));
          CHECK(!avx512 || parts_avx512::kept_level_is_the_full_levels(full, vocab, key_floor));
        }
        for (const float top_p : {0.5f, 0.9f, 0.999f}) {
          Scratch baseline = full;
          uint32_t want = 0;
          const auto none = [](float) { return 0u; };
          CHECK(parts::search_threshold(baseline, vocab, 0.0, top_p, none, want));
          for (int hint = 0; hint < 3; ++hint) {
            for (int build = 0; build < 2; ++build) {
              if (!(build == 0 ? avx2 : avx512)) continue;
              Scratch scratch = full;
              uint32_t got = 1;
              const bool found =
                  build == 0
                      ? parts_avx2::search_with_hint(scratch, vocab, top_p, x_max, hint, got)
                      : parts_avx512::search_with_hint(scratch, vocab, top_p, x_max, hint, got);
              CHECK(found && got == want);
              ++searches;
            }
          }
        }
      }
    }
  }
  CHECK(!avx2 || searches > 0);
#endif
}

}  // namespace

int main() {
  test_random123_known_answers();
  test_uniform_and_noise_edges();
  test_dtypes_read_the_same_values();
  test_filters_match_sorting();
  test_verify_and_sample_known_answers();
  test_verify_tree_known_answers_and_garbage();
  test_one_law_edges_and_builds();
  test_clean_rows_take_the_general_values();
  test_kept_first_level_matches_the_full_one();
  TEST_MAIN_RETURN();
}
