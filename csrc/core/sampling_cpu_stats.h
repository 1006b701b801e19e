// Row statistics as the passes read them: a row's range, its per-lane sums, and p of a
// processed row from its RowStats (one token, a weight functor, the written row).
// A part of the CPU sampling path's bodies: see sampling_cpu_body.h. Not a public header.
#ifndef SPECDEC_CPU_PART_STATS
#define SPECDEC_CPU_PART_STATS
#include "sampling_cpu_rows.h"

// The largest and the smallest logit, as keys: an integer max reduction vectorises (a float
// one needs -ffast-math); max -inf for a row with no finite logit, min -inf for a row with a
// NaN, an infinity or a masked token.
struct RowRange {
  float max, min;
};
template <class R>
SPECDEC_INLINE RowRange row_range(const R& row) {
  uint32_t best = 0, least = 0xFFFFFFFFu;
  for (int64_t i = 0; i < row.vocab; ++i) {
    const uint32_t key = sort_key(row(i));
    best = key > best ? key : best;
    least = key < least ? key : least;
  }
  return RowRange{key_value(best), key_value(least)};
}

// Sum of weight(i) over [begin, end), and whether one is > 0. Blocks of weights go to a
// local buffer first (a plain store loop, which vectorises whatever weight() is), then into
// 16 per-lane sums (in a fixed order: the same sum on every build).
constexpr int64_t kBlock = 256;
struct BlockSum {
  float sum;
  bool any_positive;
};
// With `out`, the weights are also written to out[begin, end).
template <class W>
SPECDEC_INLINE BlockSum block_sum(const W& weight, int64_t begin, int64_t end,
                                  float* out = nullptr) {
  float lane[kLanes] = {}, positive[kLanes] = {};
  float local[kBlock];
  int64_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    float* buffer = out != nullptr ? out + i : local;
    for (int64_t j = 0; j < kBlock; ++j) buffer[j] = weight(i + j);
    for (int64_t j = 0; j < kBlock; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        lane[l] += buffer[j + l];
        positive[l] = buffer[j + l] > 0.0f ? 1.0f : positive[l];
      }
    }
  }
  float total = 0.0f;
  bool any_positive = false;
  for (; i < end; ++i) {
    const float w = weight(i);
    if (out != nullptr) out[i] = w;
    total += w;
    any_positive |= w > 0.0f;
  }
  for (int l = 0; l < kLanes; ++l) {
    total += lane[l];
    any_positive |= positive[l] != 0.0f;
  }
  return BlockSum{total, any_positive};
}

template <class W>
SPECDEC_INLINE float lane_sum(const W& weight, int64_t begin, int64_t end, float* out = nullptr) {
  return block_sum(weight, begin, end, out).sum;
}

template <class R>
SPECDEC_INLINE float prob_of(const R& row, const RowStats& s, int64_t token) {
  if (!s.has_finite) return 0.0f;
  if (s.greedy) return token == s.argmax ? 1.0f : 0.0f;
  return keep_of(s).weight(row(token)) / s.norm;
}

// p of a processed non-greedy row with finite logits, as a weight functor.
template <class R>
struct Probs {
  R row;
  Keep keep;
  float norm;
  SPECDEC_INLINE float operator()(int64_t i) const { return keep.weight(row(i)) / norm; }
};

// p from the kept e the norm pass cached: the same values as Probs, without the exp.
struct CachedProbs {
  const float* weights;
  float norm;
  SPECDEC_INLINE float operator()(int64_t i) const { return weights[i] / norm; }
};
SPECDEC_INLINE bool has_cache(const RowStats& s) {
  return s.cache != nullptr && s.cache->generation == s.cache_generation;
}

// body(p) for the processed non-greedy row (view, s) with finite logits: CachedProbs while
// the statistics' cache slot holds them, else Probs over the row.
template <class F>
SPECDEC_INLINE void with_probs(const RowView& view, const RowStats& s, F&& body) {
  if (has_cache(s)) {
    body(CachedProbs{s.cache->weights.data(), s.norm});
    return;
  }
  with_row(view, [&](const auto& row) {
    using R = std::decay_t<decltype(row)>;
    body(Probs<R>{row, keep_of(s), s.norm});
  });
}

SPECDEC_INLINE float view_prob(const RowView& view, const RowStats& s, int64_t token) {
  float p = 0.0f;
  with_row(view, [&](const auto& row) { p = prob_of(row, s, token); });
  return p;
}

// The processed row as floats (zeros for a row without finite logits).
SPECDEC_INLINE void write_probs(const RowView& view, const RowStats& s, float* out) {
  if (!s.has_finite || s.greedy) {
    for (int64_t i = 0; i < view.vocab; ++i) out[i] = 0.0f;
    if (s.has_finite) out[s.argmax] = 1.0f;
    return;
  }
  with_row(view, [&](const auto& row) {
    const Keep keep = keep_of(s);
    for (int64_t i = 0; i < view.vocab; ++i) out[i] = keep.weight(row(i)) / s.norm;
  });
}

#endif  // SPECDEC_CPU_PART_STATS
