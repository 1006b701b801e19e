// The CPU sampling path's entry points: the baseline build of the bodies
// (sampling_cpu_body.h), and the AVX-512 build (sampling_cpu_avx512.cpp) where the processor
// has it. Both give the same tokens: the bodies use no instruction-dependent arithmetic
// (no fused multiply-add contraction is relied on, the exp is the same polynomial).
#include "sampling_cpu.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace specdec {
namespace cpu {
namespace baseline {
#include "sampling_cpu_impl.h"
}  // namespace baseline

#if defined(__x86_64__) && defined(__GNUC__)
namespace avx512 {
void verify_chain_impl(const ChainArgs& args, int64_t begin, int64_t end);
void sample_impl(const SampleArgs& args, int64_t begin, int64_t end);
void verify_tree_impl(const TreeArgs& args, int64_t begin, int64_t end);
void processed_probs_impl(const ProbsArgs& args, int64_t begin, int64_t end);
}  // namespace avx512

namespace {
bool has_avx512() {
  static const bool value = __builtin_cpu_supports("avx512f") &&
                            __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") &&
                            __builtin_cpu_supports("avx512dq");
  return value;
}
}  // namespace
#define SPECDEC_DISPATCH(name, ...) \
  (has_avx512() ? avx512::name(__VA_ARGS__) : baseline::name(__VA_ARGS__))
#else
#define SPECDEC_DISPATCH(name, ...) baseline::name(__VA_ARGS__)
#endif

Words philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                    uint32_t k1) {
  return baseline::philox(c0, c1, c2, c3, k0, k1);
}
uint32_t random_word(int64_t seed, int64_t offset, uint32_t position, uint32_t purpose,
                     uint32_t index) {
  return baseline::Stream(seed, offset, position, purpose).word(index);
}
float word_uniform(uint32_t word) { return baseline::uniform_of(word); }
float uniform_noise(float u) { return baseline::noise_of(u); }

RowStats row_stats(const RowView& row, const Filters& filters, Scratch& scratch) {
  RowStats stats = baseline::view_stats(row, filters, scratch);
  stats.cache = nullptr;  // the scratch may not outlive the statistics
  return stats;
}
float row_prob(const RowView& row, const RowStats& stats, int64_t token) {
  return baseline::view_prob(row, stats, token);
}

Filters RequestParams::filters(int64_t b) const {
  Filters f;
  f.temperature = temperature[b];
  f.top_k = top_k[b];
  f.top_p = top_p[b];
  f.min_p = min_p != nullptr ? min_p[b] : 0.0f;
  return f;
}

void verify_chain(const ChainArgs& args, int64_t begin, int64_t end) {
  SPECDEC_DISPATCH(verify_chain_impl, args, begin, end);
}
void verify_tree(const TreeArgs& args, int64_t begin, int64_t end) {
  SPECDEC_DISPATCH(verify_tree_impl, args, begin, end);
}
void sample(const SampleArgs& args, int64_t begin, int64_t end) {
  SPECDEC_DISPATCH(sample_impl, args, begin, end);
}
void processed_probs(const ProbsArgs& args, int64_t begin, int64_t end) {
  SPECDEC_DISPATCH(processed_probs_impl, args, begin, end);
}

}  // namespace cpu
}  // namespace specdec
