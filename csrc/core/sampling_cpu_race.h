// The two-level race over p or a residual, residual masses, block verification's weights
// and log-probabilities.
// A part of the CPU sampling path's bodies: see sampling_cpu_body.h. Not a public header.
#ifndef SPECDEC_CPU_PART_RACE
#define SPECDEC_CPU_PART_RACE
#include "sampling_cpu_random.h"
#include "sampling_cpu_stats.h"

// ---- the two-level race ----
struct RaceResult {
  int32_t token;      // -1: no positive weight, or a NaN
  bool any_positive;  // some weight > 0 (NaN aside)
};

// One group's block_sum, not inlined into the race's group loop: there GCC kept the 16 lane
// accumulators in memory (a store-to-load chain per block); the same sums in the same order.
template <class W>
__attribute__((noinline)) BlockSum group_sum(const W& weight, int64_t begin, int64_t end) {
  return block_sum(weight, begin, end);
}

template <class W>
SPECDEC_INLINE RaceResult race(const W& weight, int64_t vocab, const Stream& stream) {
  const int64_t num_groups = (vocab + kRaceGroup - 1) / kRaceGroup;
  float best_score = -1.0f;
  int64_t best_group = 0;
  bool any_positive = false, any_nan = false;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t begin = g * kRaceGroup;
    const int64_t end = begin + kRaceGroup < vocab ? begin + kRaceGroup : vocab;
    const BlockSum group = group_sum(weight, begin, end);
    const float mass = group.sum;
    any_positive |= group.any_positive;
    any_nan |= mass != mass;
    if (mass > 0.0f) {
      const uint32_t index = kGroupIndexBase + static_cast<uint32_t>(g);
      const float score = mass / noise_of(uniform_of(stream.word(index)));
      if (score > best_score) {
        best_score = score;
        best_group = g;
      }
    }
  }
  if (any_nan || !any_positive) return RaceResult{-1, any_positive};
  const int64_t begin = best_group * kRaceGroup;
  const int64_t end = begin + kRaceGroup < vocab ? begin + kRaceGroup : vocab;
  float group_weights[kRaceGroup];  // one vectorised pass, then the scalar race over them
  for (int64_t i = begin; i < end; ++i) group_weights[i - begin] = weight(i);
  float best = -1.0f;
  int64_t winner = begin;
  for (int64_t i = begin; i < end; i += 4) {
    const Words words = stream.counter(static_cast<uint32_t>(i >> 2));
    for (int lane = 0; lane < 4 && i + lane < end; ++lane) {
      const float w = group_weights[i + lane - begin];
      if (!(w > 0.0f)) continue;
      const float score = w / noise_of(uniform_of(words.w[lane]));
      if (score > best) {
        best = score;
        winner = i + lane;
      }
    }
  }
  return RaceResult{static_cast<int32_t>(winner), true};
}
// The race over p of a processed row (greedy rows: the arg-max).
SPECDEC_INLINE int32_t race_probs(const RowView& view, const RowStats& s, const Stream& stream) {
  if (!s.has_finite) return -1;
  if (s.greedy) return static_cast<int32_t>(s.argmax);
  int32_t token = -1;
  with_probs(view, s, [&](const auto& p) { token = race(p, view.vocab, stream).token; });
  return token;
}

// Residual max(p - q, 0) (NaN kept, as torch's clamp) with q one-hot at `draft`, a row of
// draft_probs, or the processed draft row (draft_view, draft_stats).
struct Residual {
  enum Kind { kOneHot, kProbs, kLogits } kind;
  int64_t draft;
  const void* q;
  Dtype q_dtype;
  RowView draft_view;
  RowStats draft_stats;
};

// max(weight * p - q, 0): weight 1 for the token rule (exact: 1 * p == p), w_j for block
// verification.
template <class P, class Q>
struct ResidualWeight {
  P p;
  Q q;
  float weight;
  SPECDEC_INLINE float operator()(int64_t i) const {
    const float r = weight * p(i) - q(i);
    return r < 0.0f ? 0.0f : r;
  }
};
struct OneHot {
  int64_t draft;
  SPECDEC_INLINE float operator()(int64_t i) const { return i == draft ? 1.0f : 0.0f; }
};
template <Dtype D>
struct DraftProbs {
  const typename Elem<D>::T* data;
  SPECDEC_INLINE float operator()(int64_t i) const { return Elem<D>::raw(data[i]); }
};
struct Zero {
  SPECDEC_INLINE float operator()(int64_t) const { return 0.0f; }
};

template <class F>
SPECDEC_INLINE void with_q(const Residual& residual, F&& body) {
  switch (residual.kind) {
    case Residual::kOneHot:
      body(OneHot{residual.draft});
      return;
    case Residual::kProbs:
      switch (residual.q_dtype) {
        case Dtype::kFloat32:
          body(DraftProbs<Dtype::kFloat32>{static_cast<const uint32_t*>(residual.q)});
          return;
        case Dtype::kBFloat16:
          body(DraftProbs<Dtype::kBFloat16>{static_cast<const uint16_t*>(residual.q)});
          return;
        case Dtype::kFloat16:
          body(DraftProbs<Dtype::kFloat16>{static_cast<const uint16_t*>(residual.q)});
          return;
      }
      return;
    case Residual::kLogits:
      if (!residual.draft_stats.has_finite) {
        body(Zero{});
        return;
      }
      if (residual.draft_stats.greedy) {  // draft_temperature 0: q one-hot at its arg-max
        body(OneHot{residual.draft_stats.argmax});
      } else {
        with_probs(residual.draft_view, residual.draft_stats, body);
      }
      return;
  }
}

// body(max(weight * p - q, 0)) for the processed non-greedy row (view, s) with finite logits.
template <class F>
SPECDEC_INLINE void with_residual(const RowView& view, const RowStats& s,
                                  const Residual& residual, float weight, F&& body) {
  with_probs(view, s, [&](const auto& p) {
    using P = std::decay_t<decltype(p)>;
    with_q(residual, [&](const auto& q) {
      using Q = std::decay_t<decltype(q)>;
      body(ResidualWeight<P, Q>{p, q, weight});
    });
  });
}

// The correction token after a rejection: the race of max(weight * p - q, 0), or p's when
// that has no mass.
SPECDEC_INLINE int32_t race_residual(const RowView& view, const RowStats& s,
                                     const Residual& residual, const Stream& stream,
                                     float weight = 1.0f) {
  if (!s.has_finite) return -1;
  RaceResult result{-1, false};
  with_residual(view, s, residual, weight,
                [&](const auto& r) { result = race(r, view.vocab, stream); });
  if (result.any_positive) return result.token;
  return race_probs(view, s, stream);
}

// Block verification's R = sum(max(weight * p - q, 0)) (0 for a row without finite logits).
SPECDEC_INLINE float residual_mass(const RowView& view, const RowStats& s,
                                   const Residual& residual, float weight) {
  if (!s.has_finite) return 0.0f;
  float mass = 0.0f;
  with_residual(view, s, residual, weight,
                [&](const auto& r) { mass = lane_sum(r, 0, view.vocab); });
  return mass;
}

// ---- block verification's weights ----
// Block verification's w_j = min(1, w_{j-1} * p_j(d_j) / q_j(d_j)) (reference
// sequence_weight: 1 when the numerator reaches q, also for q = 0 with a positive numerator).
SPECDEC_INLINE float sequence_weight(float previous, float target, float draft) {
  const float numerator = previous * target;
  return numerator >= draft ? (numerator > 0.0f ? 1.0f : 0.0f) : numerator / draft;
}
// h = R / (R + (1 - w)), 1 when that denominator is 0 (reference rejection_weight).
SPECDEC_INLINE float rejection_weight(float mass, float weight) {
  const float denominator = mass + (1.0f - weight);
  return denominator > 0.0f ? mass / denominator : 1.0f;
}

// ---- return_logprobs ----
// log_softmax of the sanitised row (no bitmask, no filters) at `token`.
SPECDEC_INLINE float raw_logprob(const RowView& view, int64_t token) {
  RowView plain = view;
  plain.bitmask = nullptr;
  float value = kNaN;
  with_row(plain, [&](const auto& row) {
    const float x_max = row_range(row).max;
    if (!(x_max > -kInf)) return;
    const float sum = lane_sum(
        [row, x_max](int64_t i) SPECDEC_INLINE_LAMBDA { return fast_exp(row(i) - x_max); }, 0,
        row.vocab);
    value = (row(token) - x_max) - std::log(sum);
  });
  return value;
}

// The log-probability of `token` emitted at the row (view, stats); NaN for token -1.
SPECDEC_INLINE float emitted_logprob(Logprobs kind, const RowView& view, const RowStats& s,
                                     int64_t token) {
  if (token < 0) return kNaN;
  if (kind == Logprobs::kRaw) return raw_logprob(view, token);
  return s.greedy ? 0.0f : std::log(view_prob(view, s, token));
}

#endif  // SPECDEC_CPU_PART_RACE
