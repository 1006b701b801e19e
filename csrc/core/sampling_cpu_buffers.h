// Rows written to buffers, for the tree walks: a draft row, a residual max(p - q, 0) and
// the weight functors that read them back.
// A part of the CPU sampling path's bodies: see sampling_cpu_body.h. Not a public header.
#ifndef SPECDEC_CPU_PART_BUFFERS
#define SPECDEC_CPU_PART_BUFFERS
#include "sampling_cpu_stats.h"

struct FloatRow {
  const float* data;
  SPECDEC_INLINE float operator()(int64_t i) const { return data[i]; }
};
// A without-replacement draft row: q with the rejected tokens removed, over its mass.
struct ScaledRow {
  const float* data;
  float mass;
  SPECDEC_INLINE float operator()(int64_t i) const { return mass > 0.0f ? data[i] / mass : 0.0f; }
};
template <class P>
struct Unnormalised {  // p_raw / p_mass
  P p;
  float mass;
  SPECDEC_INLINE float operator()(int64_t i) const { return p(i) / mass; }
};

template <class P>
struct Weighted {  // w * p
  P p;
  float weight;
  SPECDEC_INLINE float operator()(int64_t i) const { return weight * p(i); }
};

// out = max(p - q, 0) (NaN kept); its sum and whether an entry is > 0.
template <class P, class Q>
SPECDEC_INLINE BlockSum write_residual(const P& p, const Q& q, float* out, int64_t vocab) {
  for (int64_t i = 0; i < vocab; ++i) {
    const float r = p(i) - q(i);
    out[i] = r < 0.0f ? 0.0f : r;
  }
  return block_sum(FloatRow{out}, 0, vocab);
}

SPECDEC_INLINE void write_draft(const void* q, Dtype dtype, int64_t vocab, float* out) {
  for (int64_t i = 0; i < vocab; ++i) out[i] = raw_element(q, dtype, i);
}

#endif  // SPECDEC_CPU_PART_BUFFERS
