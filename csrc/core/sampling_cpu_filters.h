// The filters: a row's RowStats (x_max, the top-k / min-p cut, the top-p threshold, norm)
// from its temperature, top_k, top_p and min_p, with the threshold search.
// A part of the CPU sampling path's bodies: see sampling_cpu_body.h. Not a public header.
#ifndef SPECDEC_CPU_PART_FILTERS
#define SPECDEC_CPU_PART_FILTERS
#include "sampling_cpu_stats.h"
#include "sampling_cpu_search.h"

// The norm pass: the sum of the kept e, written to out. Without a cut (no top-k, min-p or
// top-p) keep.weight's two selects keep every e (e >= 0 and x >= -inf: x is never NaN), so
// they are left out: the same values.
template <bool Unit, bool Clean, bool Cut, class R>
SPECDEC_INLINE float kept_sum(const R& row, const Keep& keep, float* out) {
  return lane_sum(
      [keep, row](int64_t i) SPECDEC_INLINE_LAMBDA {
        const float x = row(i);
        return Cut ? keep.weight<Unit, Clean>(x) : keep.e_of<Unit, Clean>(x);
      },
      0, row.vocab, out);
}

template <class R>
SPECDEC_INLINE RowStats stats_of(const R& row, const Filters& filters, Scratch& scratch) {
  RowStats s;
  const int64_t vocab = row.vocab;
  s.temperature = filters.temperature;
  s.greedy = filters.temperature == 0.0f;
  const RowRange range = row_range(row);
  s.x_max = range.max;
  s.has_finite = s.x_max > -kInf;
  s.z_lo = -kInf;
  s.x_lo = -kInf;  // no cut until the filters set one (also on the early returns)
  s.e_tau = 0.0f;
  s.norm = 1.0f;
  if (!s.has_finite) return s;
  if (s.greedy) {
    for (int64_t i = 0; i < vocab; ++i) {
      if (row(i) == s.x_max) {
        s.argmax = i;
        break;
      }
    }
    return s;
  }
  const float temperature = s.temperature;
  const bool use_top_k = filters.top_k > 0 && filters.top_k < vocab;
  const bool use_top_p = filters.top_p < 1.0f;
  if (filters.min_p > 0.0f) {  // z >= max(z) + log(min_p), min_p above 1 counting as 1
    const float log_min_p = std::log(filters.min_p < 1.0f ? filters.min_p : 1.0f);
    s.z_lo = s.x_max / temperature + log_min_p;
  }
  if (use_top_k || use_top_p) {
    grow(scratch.keys, vocab);
    grow(scratch.weights, vocab);
  }
  uint32_t key = 0;
  const auto no_floor = [](float) SPECDEC_INLINE_LAMBDA { return 0u; };
  if (use_top_k) {  // the k-th largest logit, ties kept: z >= z(x_k)
    fill_candidates<false>(row, Keep{s.x_max, temperature, -kInf, 0.0f}, scratch);
    if (search_threshold(scratch, vocab, static_cast<double>(filters.top_k), 0.0, no_floor,
                         key)) {
      const float z_k = key_value(key) / temperature;
      s.z_lo = z_k > s.z_lo ? z_k : s.z_lo;
    }
  }
  s.x_lo = cut_of(s.z_lo, temperature);
  Keep keep = keep_of(s);
  const bool unit = temperature == 1.0f;
  // Clean: every (x - x_max) / T in [kNormalExpMin, 0] (division and subtraction round
  // monotonically, so the smallest x bounds them all; T > 0, which an unvalidated temperature
  // tensor may not be): the exp passes take normal_exp.
  const bool clean =
      range.min > -kInf && temperature > 0.0f &&
      (unit ? range.min - s.x_max : (range.min - s.x_max) / temperature) >= kNormalExpMin;
  // The next cache slot (two in turn: the race after a rejection needs the target row's and
  // the draft row's, the last two computed).
  CachedRow& slot = scratch.cached[scratch.generation & 1];
  slot.generation = ++scratch.generation;
  grow(slot.weights, vocab);
  s.cache = &slot;
  s.cache_generation = slot.generation;
  if (use_top_p) {  // the largest e whose kept mass reaches top_p of the top-k/min-p set
    with_flag(unit, [&](auto unit_flag) {
      constexpr bool kUnit = decltype(unit_flag)::value;
      if (clean) {
        fill_candidates<true, kUnit, true>(clean_row(row), keep, scratch);
      } else {
        fill_candidates<true, kUnit, false>(row, keep, scratch);
      }
    });
    // A hint for the search: the key of x with e(x) = e (0, no hint, where that is not finite).
    const float x_max = s.x_max;
    const auto floor_key = [x_max, temperature](float e) SPECDEC_INLINE_LAMBDA {
      const float x = x_max + temperature * std::log(e);
      return x > -kInf && x <= x_max ? sort_key(x) : 0u;
    };
    if (search_threshold(scratch, vocab, 0.0, static_cast<double>(filters.top_p), floor_key,
                         key)) {
      s.e_tau = keep.e(key_value(key));
    }
    // norm from the weights the search left (e where x >= x_lo, else 0): keep.weight's values
    // in the same order, without a second exp pass.
    const float* weights = scratch.weights.data();
    const float e_tau = s.e_tau;
    s.norm = lane_sum(
        [weights, e_tau](int64_t i) SPECDEC_INLINE_LAMBDA {
          return weights[i] >= e_tau ? weights[i] : 0.0f;
        },
        0, vocab, slot.weights.data());
    return s;
  }
  float* out = slot.weights.data();
  with_flag(unit, [&](auto unit_flag) {
    with_flag(s.x_lo > -kInf, [&](auto cut_flag) {
      constexpr bool kUnit = decltype(unit_flag)::value, kCut = decltype(cut_flag)::value;
      s.norm = clean ? kept_sum<kUnit, true, kCut>(clean_row(row), keep, out)
                     : kept_sum<kUnit, false, kCut>(row, keep, out);
    });
  });
  return s;
}

SPECDEC_INLINE RowStats view_stats(const RowView& view, const Filters& filters, Scratch& scratch) {
  RowStats s;
  with_row(view, [&](const auto& row) { s = stats_of(row, filters, scratch); });
  return s;
}

#endif  // SPECDEC_CPU_PART_FILTERS
