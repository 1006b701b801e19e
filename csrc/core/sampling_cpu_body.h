// The bodies of the CPU sampling path (sampling_cpu.h), compiled once per instruction set:
// sampling_cpu.cpp (baseline x86-64 / any target) and sampling_cpu_avx512.cpp (AVX-512, chosen
// at run time). Included inside namespace SPECDEC_ISA; every helper is inline so that it is
// compiled with the including file's target. The streaming loops keep 16 accumulators (one
// per lane) so that the compiler vectorises them without reassociating a float sum.
//
// Not a public header: the including file has included <algorithm>, <cmath>, <cstdint>, <cstring>,
// <limits>, <type_traits>, <vector> and sampling_cpu.h.

#define SPECDEC_INLINE inline __attribute__((always_inline))
#define SPECDEC_INLINE_LAMBDA __attribute__((always_inline))

constexpr int kLanes = 16;
constexpr float kInf = std::numeric_limits<float>::infinity();

SPECDEC_INLINE float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}
SPECDEC_INLINE uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

// The parts, in dependency order.
#include "sampling_cpu_random.h"
#include "sampling_cpu_rows.h"
#include "sampling_cpu_search.h"
#include "sampling_cpu_stats.h"
#include "sampling_cpu_race.h"
#include "sampling_cpu_chain.h"
#include "sampling_cpu_traversal.h"
#include "sampling_cpu_tree.h"
