// verify_tree, method "token": the walk of reference/tree.py ("traversal" requests go to
// sampling_cpu_traversal.h), and the tree's outputs.
// A part of the CPU sampling path's bodies: see sampling_cpu_body.h. Not a public header.
#ifndef SPECDEC_CPU_PART_TREE
#define SPECDEC_CPU_PART_TREE
#include "sampling_cpu_filters.h"
#include "sampling_cpu_race.h"
#include "sampling_cpu_buffers.h"
#include "sampling_cpu_traversal.h"

// Request b's outputs from its path (accepted_nodes[0..accepted], written by the walk), the
// final token and the statistics of the row it came from (logprobs [0, accepted) are the
// walk's).
SPECDEC_INLINE void write_tree_outputs(const TreeArgs& a, int64_t b, int64_t accepted,
                                       int32_t final_token, const RowView& final_view,
                                       const RowStats& final_stats) {
  const int64_t nodes = a.num_nodes;
  const int64_t* ids = a.tree_token_ids + b * nodes;
  int32_t* path = a.accepted_nodes + b * nodes;
  int32_t* out = a.output_token_ids + b * nodes;
  for (int64_t m = 0; m < nodes; ++m) {
    out[m] = m < accepted ? static_cast<int32_t>(ids[path[m + 1]]) : -1;
    if (m > accepted) path[m] = -1;
  }
  out[accepted] = final_token;
  a.num_accepted[b] = static_cast<int32_t>(accepted);
  if (a.logprobs_kind != Logprobs::kNone) {
    float* logprobs = a.logprobs + b * nodes;
    logprobs[accepted] = emitted_logprob(a.logprobs_kind, final_view, final_stats, final_token);
    for (int64_t m = accepted + 1; m < nodes; ++m) logprobs[m] = kNaN;
  }
}

// The walk of reference/tree.py, one request at a time. The current node's distribution is
// its processed row ("pristine": RowStats only) until a rejection there needs it as a row:
// deterministic candidates keep a list of removed tokens (the row is written only for the
// final race), i.i.d. / without-replacement drafts write the residual to a buffer (two, so
// that a residual without mass keeps the previous one) and the draft row to a third.
struct TreeBuffers {
  Scratch scratch;
  std::vector<float> rows;  // the walk's residual and draft rows
  std::vector<int64_t> removed;
  Traversal tour;
};

SPECDEC_INLINE void verify_tree_body(const TreeArgs& a, int64_t begin, int64_t end) {
  forget_expanded_mask();
  const int64_t nodes = a.num_nodes, vocab = a.vocab;
  const bool has_q = a.draft_probs != nullptr;
  const bool wor = has_q && a.draft_sampling == DraftSampling::kWithoutReplacement;
  CallBuffers<TreeBuffers> call(nodes * vocab);
  Scratch& scratch = call.get.scratch;
  std::vector<float>& buffers = call.get.rows;
  buffers.assign((has_q ? 3 : 1) * static_cast<size_t>(vocab), 0.0f);  // grows with V only
  std::vector<int64_t>& removed = call.get.removed;
  const bool traversal = a.method == TreeMethod::kTraversal && has_q;
  Traversal& tour = call.get.tour;
  if (traversal) tour.prepare(nodes, vocab);
  for (int64_t b = begin; b < end; ++b) {
    const Filters filters = a.params.filters(b);
    const bool greedy = filters.temperature == 0.0f;
    int64_t live = a.live_nodes[b];
    live = live < 1 ? 1 : (live > nodes ? nodes : live);
    const int64_t* ids = a.tree_token_ids + b * nodes;
    const int64_t* parent = a.parents + b * nodes;
    auto real = [&](int64_t i) {
      return i < live && parent[i] >= 0 && parent[i] < i && ids[i] >= 0 && ids[i] < vocab;
    };
    auto target_view = [&](int64_t node) {
      return logits_row(a.target, a.target_dtype, b * nodes + node, vocab, a.bitmask);
    };
    auto q_row = [&](int64_t node) {
      return row_pointer(a.draft_probs, a.draft_probs_dtype, b * nodes + node, vocab);
    };
    int32_t* path = a.accepted_nodes + b * nodes;
    if (traversal && !greedy) {  // greedy requests take the token walk
      int32_t final_token = -1;
      RowStats final_stats;
      const int64_t accepted =
          tour.run(a, b, filters, real, target_view, scratch, final_token, final_stats);
      write_tree_outputs(a, b, accepted, final_token, target_view(path[accepted]), final_stats);
      continue;
    }
    float* logprobs = a.logprobs_kind != Logprobs::kNone ? a.logprobs + b * nodes : nullptr;
    path[0] = 0;
    int64_t current = 0, accepted = 0;
    RowStats stats = view_stats(target_view(0), filters, scratch);
    float* p_buf = nullptr;  // null: the current row is pristine
    float* q_buf = nullptr;  // null: the draft row is draft_probs' row as it is
    float p_mass = 1.0f, q_mass = 1.0f;
    int64_t last_removed = -1;
    removed.clear();
    auto buffer = [&](int index) { return buffers.data() + index * vocab; };
    for (int64_t i = 1; i < nodes; ++i) {
      if (!real(i) || parent[i] != current) continue;
      const int64_t token = ids[i];
      float p_token;
      if (p_buf != nullptr) {
        p_token = p_buf[token];
      } else if (std::find(removed.begin(), removed.end(), token) != removed.end()) {
        p_token = 0.0f;
      } else {
        p_token = view_prob(target_view(current), stats, token);
      }
      const float target = p_mass > 0.0f ? p_token / p_mass : (p_token > 0.0f ? kInf : 0.0f);
      float draft = 1.0f;
      if (has_q) {
        draft = q_buf != nullptr ? q_buf[token]
                                 : raw_element(q_row(current), a.draft_probs_dtype, token);
        if (wor) draft = q_mass > 0.0f ? draft / q_mass : 0.0f;
      }
      bool accept;
      if (greedy) {  // greedy p is one-hot at the arg-max
        accept = p_token > 0.0f;
      } else {
        const Stream stream(a.params.seed[b], a.params.offset[b], static_cast<uint32_t>(i),
                            kPurposeAccept);
        accept = uniform_of(stream.word(0)) * draft < target;
      }
      if (accept) {
        if (logprobs != nullptr) {
          logprobs[accepted] = emitted_logprob(a.logprobs_kind, target_view(current), stats, token);
        }
        current = i;
        path[++accepted] = static_cast<int32_t>(i);
        stats = view_stats(target_view(i), filters, scratch);
        p_buf = q_buf = nullptr;
        p_mass = q_mass = 1.0f;
        last_removed = -1;
        removed.clear();
        continue;
      }
      if (greedy) continue;
      if (!has_q) {  // remove the token; its probability leaves the mass
        p_mass = p_mass - p_token;
        removed.push_back(token);
        if (p_token > 0.0f) last_removed = token;
        continue;
      }
      if (q_buf == nullptr) {
        q_buf = buffer(2);
        write_draft(q_row(current), a.draft_probs_dtype, vocab, q_buf);
      }
      float* next = p_buf == buffer(0) ? buffer(1) : buffer(0);
      BlockSum residual{0.0f, false};
      auto with_draft = [&](const auto& p) {
        if (wor) {
          residual = write_residual(p, ScaledRow{q_buf, q_mass}, next, vocab);
        } else {
          residual = write_residual(p, FloatRow{q_buf}, next, vocab);
        }
      };
      if (p_buf != nullptr) {
        with_draft(Unnormalised<FloatRow>{FloatRow{p_buf}, p_mass});
      } else if (stats.has_finite) {
        with_row(target_view(current), [&](const auto& row) {
          using R = std::decay_t<decltype(row)>;
          with_draft(Unnormalised<Probs<R>>{Probs<R>{row, keep_of(stats), stats.norm}, p_mass});
        });
      } else {
        with_draft(Unnormalised<Zero>{Zero{}, p_mass});
      }
      if (residual.any_positive) {  // else p stays (only through rounding, see reference)
        p_buf = next;
        p_mass = residual.sum;
      }
      if (wor) {
        q_mass = q_mass - q_buf[token];
        q_buf[token] = 0.0f;
      }
    }
    const Stream stream(a.params.seed[b], a.params.offset[b], static_cast<uint32_t>(current),
                        kPurposeResample);
    int32_t final_token;
    if (!stats.has_finite) {  // no distribution (a residual of negative unvalidated q aside)
      final_token = -1;
    } else if (p_buf != nullptr) {
      final_token = race(FloatRow{p_buf}, vocab, stream).token;
    } else if (removed.empty()) {
      final_token = race_probs(target_view(current), stats, stream);
    } else {  // deterministic candidates with removals
      float* row = buffer(0);
      write_probs(target_view(current), stats, row);
      for (const int64_t token : removed) row[token] = 0.0f;
      const RaceResult result = race(FloatRow{row}, vocab, stream);
      // Removals left no mass (rounding only): the last removed token was all that remained.
      final_token = !result.any_positive && last_removed >= 0
                        ? static_cast<int32_t>(last_removed)
                        : result.token;
    }
    write_tree_outputs(a, b, accepted, final_token, target_view(current), stats);
  }
}

#endif  // SPECDEC_CPU_PART_TREE
