// verify_tree, method "traversal": the depth-first tour of reference traverse_tree.
// A part of the CPU sampling path's bodies: see sampling_cpu_body.h. Not a public header.
#ifndef SPECDEC_CPU_PART_TRAVERSAL
#define SPECDEC_CPU_PART_TRAVERSAL
#include "sampling_cpu_filters.h"
#include "sampling_cpu_race.h"
#include "sampling_cpu_buffers.h"

// Traversal verification (reference traverse_tree) of one sampled request with draft_probs:
// the depth-first tour of the reachable nodes (children in increasing index). Entering v
// sets w_v from its parent u's current state; leaving v tests it; a rejection updates u
// (P_u <- max(w_u P_u - Q_u, 0) when that has mass, w_u <- R / (R + 1 - w_u), without
// replacement x_v leaves Q_u). Only the nodes on the tour's stack have live state, so the
// rows of P and Q (written at a node's first child rejection) live in one slot per depth.
struct Traversal {
  std::vector<RowStats> stats;
  std::vector<char> has_stats, reach, p_written, q_written;
  std::vector<float> w, p_mass, q_mass;
  std::vector<int64_t> first_child, next_sibling, depth, stack, next_child;
  std::vector<std::vector<float>> p_slot, q_slot;
  std::vector<float> residual;

  void prepare(int64_t nodes, int64_t vocab) {  // buffers for N nodes of V tokens
    stats.resize(nodes);
    for (auto* v : {&has_stats, &reach, &p_written, &q_written}) v->resize(nodes);
    for (auto* v : {&w, &p_mass, &q_mass}) v->resize(nodes);
    for (auto* v : {&first_child, &next_sibling, &depth, &stack, &next_child}) v->resize(nodes);
    residual.resize(vocab);
  }
  float* slot(std::vector<std::vector<float>>& slots, int64_t d, int64_t vocab) {
    if (static_cast<int64_t>(slots.size()) <= d) slots.resize(d + 1);
    if (static_cast<int64_t>(slots[d].size()) < vocab) slots[d].resize(vocab);
    return slots[d].data();
  }

  // Returns the accepted node (0: none) and writes the path and the drafts' log-probabilities.
  template <class Real, class View>
  int64_t run(const TreeArgs& a, int64_t b, const Filters& filters, const Real& real,
              const View& target_view, Scratch& scratch, int32_t& final_token,
              RowStats& final_stats) {
    const int64_t nodes = a.num_nodes, vocab = a.vocab;
    const bool wor = a.draft_sampling == DraftSampling::kWithoutReplacement;
    const int64_t* ids = a.tree_token_ids + b * nodes;
    const int64_t* parent = a.parents + b * nodes;
    for (int64_t i = 0; i < nodes; ++i) {
      has_stats[i] = p_written[i] = q_written[i] = 0;
      first_child[i] = next_sibling[i] = -1;
      reach[i] = i == 0 || (real(i) && (parent[i] == 0 || reach[parent[i]]));
    }
    reach[0] = 1;
    for (int64_t i = nodes - 1; i >= 1; --i) {  // children lists in increasing index
      if (!reach[i] || i == 0) continue;
      next_sibling[i] = first_child[parent[i]];
      first_child[parent[i]] = i;
    }
    auto stats_of = [&](int64_t u) -> const RowStats& {
      if (!has_stats[u]) {
        stats[u] = view_stats(target_view(u), filters, scratch);
        has_stats[u] = 1;
      }
      return stats[u];
    };
    auto q_row = [&](int64_t u) {
      return row_pointer(a.draft_probs, a.draft_probs_dtype, b * nodes + u, vocab);
    };
    auto target_of = [&](int64_t u, int64_t token) {  // P_u(x) / mass
      const float p = p_written[u] ? p_slot[depth[u]][token]
                                   : view_prob(target_view(u), stats_of(u), token);
      return p / p_mass[u];
    };
    auto draft_of = [&](int64_t u, int64_t token) {  // the current Q_u(x)
      const float q = q_written[u] ? q_slot[depth[u]][token]
                                   : raw_element(q_row(u), a.draft_probs_dtype, token);
      return wor ? (q_mass[u] > 0.0f ? q / q_mass[u] : 0.0f) : q;
    };
    auto reset = [&](int64_t v, int64_t d) {
      depth[v] = d;
      p_mass[v] = q_mass[v] = 1.0f;
      next_child[v] = first_child[v];
    };
    w[0] = 1.0f;
    reset(0, 0);
    int64_t top = 0, accepted_node = 0;
    stack[0] = 0;
    while (top >= 0) {
      const int64_t u = stack[top];
      const int64_t child = next_child[u];
      if (child >= 0) {  // enter the next child
        next_child[u] = next_sibling[child];
        reset(child, depth[u] + 1);
        w[child] = sequence_weight(w[u], target_of(u, ids[child]), draft_of(u, ids[child]));
        stack[++top] = child;
        continue;
      }
      --top;  // leave u: every child rejected, or none
      if (u == 0) break;
      const int64_t up = parent[u], token = ids[u];
      const float target = target_of(up, token), draft = draft_of(up, token);
      const Stream stream(a.params.seed[b], a.params.offset[b], static_cast<uint32_t>(u),
                          kPurposeAccept);
      const float uniform = uniform_of(stream.word(0));
      const bool passed = first_child[u] >= 0 ? uniform < w[u] : uniform * draft < w[up] * target;
      if (passed) {
        accepted_node = u;
        break;
      }
      reject(a, up, token, wor, target_view, q_row, stats_of);
    }
    // The path, root first, by parent chasing; the drafts' log-probabilities at their parents.
    int32_t* path = a.accepted_nodes + b * nodes;
    const int64_t accepted = depth[accepted_node];
    for (int64_t v = accepted_node, m = accepted; m >= 0; v = parent[v], --m) {
      path[m] = static_cast<int32_t>(v);
      if (v == 0) break;
    }
    if (a.logprobs_kind != Logprobs::kNone) {
      for (int64_t m = 0; m < accepted; ++m) {
        a.logprobs[b * nodes + m] = emitted_logprob(a.logprobs_kind, target_view(path[m]),
                                                    stats_of(path[m]), ids[path[m + 1]]);
      }
    }
    final_stats = stats_of(accepted_node);
    const Stream stream(a.params.seed[b], a.params.offset[b],
                        static_cast<uint32_t>(accepted_node), kPurposeResample);
    final_token = !final_stats.has_finite ? -1  // no distribution: nothing to emit
                  : p_written[accepted_node]
                      ? race(FloatRow{p_slot[depth[accepted_node]].data()}, vocab, stream).token
                      : race_probs(target_view(accepted_node), final_stats, stream);
    return accepted;
  }

  // u's update after its child with `token` is rejected.
  template <class View, class QRow, class StatsOf>
  void reject(const TreeArgs& a, int64_t u, int64_t token, bool wor,
              const View& target_view, const QRow& q_row, const StatsOf& stats_of) {
    const int64_t vocab = a.vocab, d = depth[u];
    float* q = slot(q_slot, d, vocab);
    if (!q_written[u]) {
      write_draft(q_row(u), a.draft_probs_dtype, vocab, q);
      q_written[u] = 1;
    }
    const float weight = w[u];
    BlockSum mass{0.0f, false};
    auto with_p = [&](const auto& p) {
      if (wor) {
        mass = write_residual(Weighted<std::decay_t<decltype(p)>>{p, weight},
                              ScaledRow{q, q_mass[u]}, residual.data(), vocab);
      } else {
        mass = write_residual(Weighted<std::decay_t<decltype(p)>>{p, weight}, FloatRow{q},
                              residual.data(), vocab);
      }
    };
    if (p_written[u]) {
      with_p(Unnormalised<FloatRow>{FloatRow{p_slot[d].data()}, p_mass[u]});
    } else {
      const RowStats& s = stats_of(u);
      if (s.has_finite && !s.greedy) {
        with_row(target_view(u), [&](const auto& row) {
          using R = std::decay_t<decltype(row)>;
          with_p(Unnormalised<Probs<R>>{Probs<R>{row, keep_of(s), s.norm}, p_mass[u]});
        });
      } else {
        with_p(Unnormalised<Zero>{Zero{}, p_mass[u]});
      }
    }
    w[u] = rejection_weight(mass.sum, weight);
    if (mass.any_positive) {
      slot(p_slot, d, vocab);
      std::swap(p_slot[d], residual);
      if (static_cast<int64_t>(residual.size()) < vocab) residual.resize(vocab);
      p_written[u] = 1;
      p_mass[u] = mass.sum;
    }
    if (wor) {
      q_mass[u] = q_mass[u] - q[token];
      q[token] = 0.0f;
    }
  }
};

#endif  // SPECDEC_CPU_PART_TRAVERSAL
