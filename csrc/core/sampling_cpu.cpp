// The CPU sampling path's entry points: the baseline build of the bodies
// (sampling_cpu_body.h: x86-64's SSE2, or whatever the target is, e.g. NEON on aarch64), and on
// x86-64 the AVX2 + FMA (sampling_cpu_avx2.cpp) and AVX-512 (sampling_cpu_avx512.cpp) builds,
// the best the processor has chosen at run time (SPECDEC_CPU_ISA or set_isa() force one). All
// give the same tokens: the bodies use no instruction-dependent arithmetic (no fused
// multiply-add contraction, the exp is the same polynomial, sums in a fixed order).
#include "sampling_cpu.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstdlib>
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
#define SPECDEC_X86_BUILDS 1
#define SPECDEC_DECLARE_BUILD(isa)                                                      \
  namespace isa {                                                                       \
  void verify_chain_impl(const ChainArgs& args, int64_t begin, int64_t end);            \
  void sample_impl(const SampleArgs& args, int64_t begin, int64_t end);                 \
  void verify_tree_impl(const TreeArgs& args, int64_t begin, int64_t end);              \
  void processed_probs_impl(const ProbsArgs& args, int64_t begin, int64_t end);         \
  }
SPECDEC_DECLARE_BUILD(avx2)
SPECDEC_DECLARE_BUILD(avx512)
#undef SPECDEC_DECLARE_BUILD
#endif

namespace {
// The builds, in order of preference (their index is the value of `chosen`).
constexpr const char* kIsaNames[] = {"baseline", "avx2", "avx512"};
constexpr int kIsaCount = 3;

bool supported(int isa) {
#ifdef SPECDEC_X86_BUILDS
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("avx512dq");
  return isa == 0 || (isa == 1 && avx2) || (isa == 2 && avx512);
#else
  return isa == 0;
#endif
}

int isa_index(const char* name) {
  for (int i = 0; i < kIsaCount; ++i) {
    if (name != nullptr && std::strcmp(name, kIsaNames[i]) == 0) return i;
  }
  return -1;
}

// The best build the processor runs, or SPECDEC_CPU_ISA's when it names one it runs (the
// Python layer rejects other values with an error; the core falls back to the best).
int initial_isa() {
  const int requested = isa_index(std::getenv("SPECDEC_CPU_ISA"));
  if (requested >= 0 && supported(requested)) return requested;
  int best = 0;
  for (int i = 0; i < kIsaCount; ++i) best = supported(i) ? i : best;
  return best;
}

std::atomic<int>& chosen() {
  static std::atomic<int> value{initial_isa()};
  return value;
}
}  // namespace

const char* isa() { return kIsaNames[chosen().load(std::memory_order_relaxed)]; }
bool isa_supported(const char* name) {
  const int index = isa_index(name);
  return index >= 0 && supported(index);
}
bool set_isa(const char* name) {
  if (!isa_supported(name)) return false;
  chosen().store(isa_index(name), std::memory_order_relaxed);
  return true;
}

#ifdef SPECDEC_X86_BUILDS
#define SPECDEC_DISPATCH(name, ...)                                 \
  switch (chosen().load(std::memory_order_relaxed)) {               \
    case 2:                                                         \
      return avx512::name(__VA_ARGS__);                             \
    case 1:                                                         \
      return avx2::name(__VA_ARGS__);                               \
    default:                                                        \
      return baseline::name(__VA_ARGS__);                           \
  }
#else
#define SPECDEC_DISPATCH(name, ...) return baseline::name(__VA_ARGS__)
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
