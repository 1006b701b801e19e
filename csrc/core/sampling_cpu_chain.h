// verify_chain (token rule and block verification), sample and processed_probs.
// A part of the CPU sampling path's bodies: see sampling_cpu_body.h. Not a public header.
#ifndef SPECDEC_CPU_PART_CHAIN
#define SPECDEC_CPU_PART_CHAIN
#include "sampling_cpu_filters.h"
#include "sampling_cpu_race.h"

// One request after another. Token rule: row j's statistics, p(d_j), q(d_j), the test; stop
// at the first rejection. Block verification (sampled requests): every live row is read (all
// tests are made); row j >= 1 also gives R_j = sum(max(w_j p_j - q_j, 0)).
struct ChainBuffers {
  Scratch scratch;
  std::vector<int64_t> id;        // grows with K only
  std::vector<float> p_drafts;    // p_j(d_j), for the log-probabilities
  std::vector<RowStats> block_stats, block_draft_stats;
};

SPECDEC_INLINE void verify_chain_body(const ChainArgs& a, int64_t begin, int64_t end) {
  forget_expanded_mask();
  const int64_t num_drafts = a.num_drafts, vocab = a.vocab, rows = num_drafts + 1;
  CallBuffers<ChainBuffers> buffers(rows * vocab);
  Scratch& scratch = buffers.get.scratch;
  std::vector<int64_t>& id = buffers.get.id;
  std::vector<float>& p_drafts = buffers.get.p_drafts;
  std::vector<RowStats>& block_stats = buffers.get.block_stats;
  std::vector<RowStats>& block_draft_stats = buffers.get.block_draft_stats;
  id.assign(num_drafts, 0);
  p_drafts.assign(num_drafts, 0.0f);
  if (a.method == ChainMethod::kBlock) {
    block_stats.assign(rows, RowStats{});
    block_draft_stats.assign(rows, RowStats{});
  }
  for (int64_t b = begin; b < end; ++b) {
    const Filters filters = a.params.filters(b);
    const bool greedy = filters.temperature == 0.0f;
    int64_t n = a.num_draft_tokens[b];
    n = n < 0 ? 0 : (n > num_drafts ? num_drafts : n);
    auto target_row = [&](int64_t j) {
      return a.target_rows ? a.target_rows[b * rows + j] : b * rows + j;
    };
    auto draft_row = [&](int64_t j) {  // j < n only
      return a.draft_rows ? a.draft_rows[b * num_drafts + j] : b * num_drafts + j;
    };
    auto draft_start = [&](int64_t j) {  // element offset of draft j's probs/logits row
      return a.draft_slots ? a.draft_slots[b] * a.draft_slot_stride + j * a.draft_position_stride
                           : draft_row(j) * vocab;
    };
    for (int64_t j = 0; j < n; ++j) id[j] = a.draft_ids[draft_row(j)];
    int64_t live = 0;  // the leading valid drafts
    while (live < n && id[live] >= 0 && id[live] < vocab) ++live;
    auto target_view = [&](int64_t j) {
      return logits_row(a.target, a.target_dtype, target_row(j), vocab, a.bitmask);
    };
    auto draft_view = [&](int64_t j) {
      return RowView{row_pointer(a.draft_logits, a.draft_logits_dtype, draft_start(j), 1),
                     a.draft_logits_dtype, vocab, nullptr};
    };
    const Filters draft_filters =
        a.draft_temperature ? Filters{a.draft_temperature[b], 0, 1.0f, 0.0f} : filters;
    auto draft_stats_of = [&](int64_t j) {  // j < live; only with draft_logits
      return view_stats(draft_view(j), draft_filters, scratch);
    };
    auto q_draft_of = [&](int64_t j, const RowStats& draft_stats) {
      if (a.draft_probs != nullptr) {
        return raw_element(a.draft_probs, a.draft_probs_dtype, draft_start(j) + id[j]);
      }
      if (a.draft_logits != nullptr) return view_prob(draft_view(j), draft_stats, id[j]);
      return 1.0f;
    };
    auto residual_of = [&](int64_t j, const RowStats& draft_stats) {  // q of row j < live
      Residual residual{Residual::kOneHot, id[j], nullptr, Dtype::kFloat32, RowView{},
                        RowStats{}};
      if (a.draft_probs != nullptr) {
        residual.kind = Residual::kProbs;
        residual.q = row_pointer(a.draft_probs, a.draft_probs_dtype, draft_start(j), 1);
        residual.q_dtype = a.draft_probs_dtype;
      } else if (a.draft_logits != nullptr) {
        residual.kind = Residual::kLogits;
        residual.draft_view = draft_view(j);
        residual.draft_stats = draft_stats;
      }
      return residual;
    };
    auto uniform_at = [&](int64_t position) {
      const Stream stream(a.params.seed[b], a.params.offset[b], static_cast<uint32_t>(position),
                          kPurposeAccept);
      return uniform_of(stream.word(0));
    };
    RowStats stats, draft_stats;  // of row `accepted` once the loop is done
    int64_t accepted = 0;
    float correction_weight = 1.0f;  // the residual's w (block: w_tau)
    if (a.method == ChainMethod::kBlock && !greedy) {
      float w = 1.0f;  // w_j at row j
      for (int64_t j = 0; j < live; ++j) {
        RowStats& row = block_stats[j];
        RowStats& draft = block_draft_stats[j];
        row = view_stats(target_view(j), filters, scratch);
        if (a.draft_logits != nullptr) draft = draft_stats_of(j);
        if (j >= 1) {  // test j < n: u_j < h_j
          const float mass = residual_mass(target_view(j), row, residual_of(j, draft), w);
          if (uniform_at(j) < rejection_weight(mass, w)) {
            accepted = j;
            correction_weight = w;
          }
        }
        const float p_draft = view_prob(target_view(j), row, id[j]);
        const float q_draft = q_draft_of(j, draft);
        p_drafts[j] = p_draft;
        if (j == live - 1 && uniform_at(live) * q_draft < w * p_draft) accepted = live;
        w = sequence_weight(w, p_draft, q_draft);
      }
      if (accepted < live) {
        stats = block_stats[accepted];
        draft_stats = block_draft_stats[accepted];
      } else {
        stats = view_stats(target_view(accepted), filters, scratch);
      }
    } else {
      int64_t stats_row = -1;
      for (; accepted < live; ++accepted) {
        const int64_t j = accepted;
        stats = view_stats(target_view(j), filters, scratch);
        stats_row = j;
        const float p_draft = view_prob(target_view(j), stats, id[j]);
        p_drafts[j] = p_draft;
        bool accept;
        if (greedy) {
          accept = p_draft > 0.0f;
        } else {
          if (a.draft_logits != nullptr) draft_stats = draft_stats_of(j);
          accept = uniform_at(j + 1) * q_draft_of(j, draft_stats) < p_draft;
        }
        if (!accept) break;
      }
      if (stats_row != accepted) stats = view_stats(target_view(accepted), filters, scratch);
    }
    const Stream stream(a.params.seed[b], a.params.offset[b], static_cast<uint32_t>(accepted),
                        kPurposeResample);
    int32_t final_token;
    if (!greedy && accepted < live) {  // rejected: the residual
      final_token = race_residual(target_view(accepted), stats,
                                  residual_of(accepted, draft_stats), stream, correction_weight);
    } else {
      final_token = race_probs(target_view(accepted), stats, stream);
    }
    int32_t* out = a.output_token_ids + b * rows;
    for (int64_t j = 0; j < rows; ++j) out[j] = j < accepted ? static_cast<int32_t>(id[j]) : -1;
    out[accepted] = final_token;
    a.num_accepted[b] = static_cast<int32_t>(accepted);
    if (a.logprobs_kind != Logprobs::kNone) {
      float* logprobs = a.logprobs + b * rows;
      for (int64_t j = 0; j < accepted; ++j) {
        logprobs[j] = a.logprobs_kind == Logprobs::kRaw ? raw_logprob(target_view(j), id[j])
                      : greedy                           ? 0.0f
                                                         : std::log(p_drafts[j]);
      }
      logprobs[accepted] =
          emitted_logprob(a.logprobs_kind, target_view(accepted), stats, final_token);
      for (int64_t j = accepted + 1; j < rows; ++j) logprobs[j] = kNaN;
    }
  }
}

SPECDEC_INLINE void sample_body(const SampleArgs& a, int64_t begin, int64_t end) {
  forget_expanded_mask();
  CallBuffers<Scratch> buffers(a.vocab);
  Scratch& scratch = buffers.get;
  for (int64_t b = begin; b < end; ++b) {
    const RowView view = logits_row(a.logits, a.dtype, b, a.vocab, a.bitmask);
    const RowStats stats = view_stats(view, a.params.filters(b), scratch);
    const Stream stream(a.params.seed[b], a.params.offset[b], 0, kPurposeSample);
    a.tokens[b] = race_probs(view, stats, stream);
    if (a.logprobs_kind != Logprobs::kNone) {
      a.logprobs[b] = emitted_logprob(a.logprobs_kind, view, stats, a.tokens[b]);
    }
  }
}

SPECDEC_INLINE void processed_probs_body(const ProbsArgs& a, int64_t begin, int64_t end) {
  forget_expanded_mask();
  CallBuffers<Scratch> buffers(a.vocab);
  Scratch& scratch = buffers.get;
  for (int64_t r = begin; r < end; ++r) {
    const RowView view = logits_row(a.logits, a.dtype, r, a.vocab, a.bitmask);
    const RowStats s = view_stats(view, a.params.filters(r / a.rows_per_request), scratch);
    write_probs(view, s, a.probs + r * a.vocab);
  }
}

#endif  // SPECDEC_CPU_PART_CHAIN
