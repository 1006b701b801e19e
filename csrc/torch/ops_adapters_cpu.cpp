// CPU ops behind the engine adapters (specdec_kernels/adapters/): each does in one pass what
// the adapter's torch code does in a few dozen small ops (the host time of issue 46), with the
// same result for every input the torch code takes, malformed ones included (the tests compare
// them: python_tests/test_cpu_adapter_ops.py) -- but for FlashInfer's row sums, taken in
// sequence here and in torch's own order there (see cpu_flashinfer_counts). The Python layer checks shapes and dtypes first;
// the checks here guard memory safety. Wrappers: specdec_kernels/_cpu.py.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_tensors.h"
#include "sampling_cpu.h"

namespace specdec {
namespace torch_ops {
namespace {

using cpu_tensors::as_type;
using cpu_tensors::check_cpu;

// Elements [start, start + count) of a float tensor (float32/64, bf16, fp16) as doubles:
// their sum in sequence (sum = true) or the first one.
template <typename T>
double read(const at::Tensor& t, int64_t start, int64_t count, bool sum) {
  const T* x = t.data_ptr<T>() + start;
  if (!sum) return static_cast<double>(static_cast<float>(x[0]));
  double total = 0.0;
  for (int64_t v = 0; v < count; ++v) total += static_cast<double>(static_cast<float>(x[v]));
  return total;
}

template <>
double read<double>(const at::Tensor& t, int64_t start, int64_t count, bool sum) {
  const double* x = t.data_ptr<double>() + start;
  if (!sum) return x[0];
  double total = 0.0;
  for (int64_t v = 0; v < count; ++v) total += x[v];
  return total;
}

double values(const at::Tensor& t, int64_t start, int64_t count, bool sum) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return read<float>(t, start, count, sum);
    case at::kDouble:
      return read<double>(t, start, count, sum);
    case at::kBFloat16:
      return read<at::BFloat16>(t, start, count, sum);
    case at::kHalf:
      return read<at::Half>(t, start, count, sum);
    default:
      TORCH_CHECK(false, "a float tensor expected, got ", t.scalar_type());
  }
}

// Adds `amount[b]` to an int32 or int64 counter in place, wrapping as torch's add_ does
// (unsigned arithmetic: no signed overflow whatever the caller's running counts are).
template <typename T, typename U>
void wrapping_add(T* c, const std::vector<int64_t>& amount) {
  for (size_t b = 0; b < amount.size(); ++b) {
    c[b] = static_cast<T>(static_cast<U>(c[b]) + static_cast<U>(amount[b]));
  }
}

void add_to(at::Tensor& counter, const std::vector<int64_t>& amount) {
  if (counter.scalar_type() == at::kInt) {
    wrapping_add<int32_t, uint32_t>(counter.data_ptr<int32_t>(), amount);
  } else {
    wrapping_add<int64_t, uint64_t>(counter.data_ptr<int64_t>(), amount);
  }
}

// FlashInfer's two counters (adapters/flashinfer.py: _independently_accepted, then the two
// add_), in place: `emitted[b] += num_accepted[b]`; `accepted[b] += num_accepted[b]` plus the
// drafts j after the first rejected one whose id is in [0, V) and that pass
// u_j * q_j(d_j) < p_j(d_j), with u_j the acceptance uniform of (seed[b], offset[b], j + 1)
// and p_j = target_probs[b, j, d_j] / sum(target_probs[b, j]), all in float64 (the row sum in
// sequence: torch's order can differ in the last bit, which changes a count only where
// u * q lies within an ulp of p).
void cpu_flashinfer_counts(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                           const at::Tensor& draft_token_ids, const at::Tensor& num_accepted,
                           const at::Tensor& seed, const at::Tensor& offset, at::Tensor accepted,
                           at::Tensor emitted) {
  TORCH_CHECK(draft_probs.dim() == 3, "draft_probs [B, K, V] expected");
  const int64_t batch = draft_probs.size(0), drafts = draft_probs.size(1),
                vocab = draft_probs.size(2);
  check_cpu(target_probs, "target_probs", {batch, drafts + 1, vocab});
  check_cpu(draft_probs, "draft_probs", {batch, drafts, vocab});
  check_cpu(draft_token_ids, "draft_token_ids", {batch, drafts});
  check_cpu(num_accepted, "num_accepted", {batch});
  check_cpu(seed, "seed", {batch});
  TORCH_CHECK(offset.device().is_cpu() && (offset.numel() == 1 || offset.numel() == batch),
              "offset: 1 or B values on the CPU expected");
  for (const at::Tensor* counter : {&accepted, &emitted}) {
    check_cpu(*counter, "counter", {batch});
    TORCH_CHECK(counter->is_contiguous() && (counter->scalar_type() == at::kInt ||
                                             counter->scalar_type() == at::kLong),
                "counters: contiguous int32/int64 expected");
  }
  const at::Tensor p = target_probs.contiguous(), q = draft_probs.contiguous();
  const at::Tensor ids = as_type(draft_token_ids, at::kLong), n = as_type(num_accepted, at::kLong);
  const at::Tensor s = as_type(seed, at::kLong), o = as_type(offset.reshape(-1), at::kLong);
  const int64_t *id = ids.data_ptr<int64_t>(), *np = n.data_ptr<int64_t>(),
                *sp = s.data_ptr<int64_t>(), *op = o.data_ptr<int64_t>();
  std::vector<int64_t> independent(batch), kept(batch);
  for (int64_t b = 0; b < batch; ++b) {
    int64_t count = np[b];
    for (int64_t j = std::max<int64_t>(np[b] + 1, 0); j < drafts; ++j) {
      const int64_t d = id[b * drafts + j];
      if (d < 0 || d >= vocab) continue;
      const int64_t row = (b * (drafts + 1) + j) * vocab;
      const double target = values(p, row + d, 1, false) / values(p, row, vocab, true);
      const double draft = values(q, (b * drafts + j) * vocab + d, 1, false);
      const int64_t off = op[o.numel() == 1 ? 0 : b];
      const float u = cpu::word_uniform(cpu::random_word(
          sp[b], off, static_cast<uint32_t>(j + 1), cpu::kPurposeAccept, 0));
      if (static_cast<double>(u) * draft < target) ++count;
    }
    independent[b] = count;
    kept[b] = np[b];
  }
  add_to(accepted, independent);
  add_to(emitted, kept);
}

// SGLang's first-child / next-sibling lists as parents (adapters/_sglang_trees.py:
// tree_from_sglang, the same pointer jumping and, for lists that are not one tree, the same
// result: a link outside [0, N) goes nowhere, the last of several links to a node wins), and
// whether the lists are one tree (_check_links: links in [-1, N), every node but the root
// reached by exactly one link and the root by none, parents before children).
std::tuple<at::Tensor, bool> cpu_sglang_parents(const at::Tensor& next_token,
                                                const at::Tensor& next_sibling) {
  TORCH_CHECK(next_token.dim() == 2 && next_token.size(1) >= 1,
              "retrive_next_token [bs, N >= 1] expected");
  const int64_t batch = next_token.size(0), nodes = next_token.size(1);
  check_cpu(next_token, "retrive_next_token", {batch, nodes});
  check_cpu(next_sibling, "retrive_next_sibling", {batch, nodes});
  const at::Tensor first = as_type(next_token, at::kLong), next = as_type(next_sibling, at::kLong);
  const int64_t *fp = first.data_ptr<int64_t>(), *sp = next.data_ptr<int64_t>();
  at::Tensor parents = at::empty({batch, nodes}, first.options());
  int64_t* out = parents.data_ptr<int64_t>();
  int steps = 0;  // max(1, bit_length(N - 1)), as the torch code
  for (int64_t m = nodes - 1; m > 0; m >>= 1) ++steps;
  steps = std::max(steps, 1);
  bool ok = true;
  std::vector<int64_t> parent_of_head(nodes), previous(nodes), head(nodes), jumped(nodes),
      incoming(nodes);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* f = fp + b * nodes;
    const int64_t* s = sp + b * nodes;
    std::fill(parent_of_head.begin(), parent_of_head.end(), -1);
    std::fill(previous.begin(), previous.end(), -1);
    std::fill(incoming.begin(), incoming.end(), 0);
    for (int64_t i = 0; i < nodes; ++i) {
      if (f[i] < -1 || f[i] >= nodes || s[i] < -1 || s[i] >= nodes) ok = false;
      if (f[i] >= 0 && f[i] < nodes) parent_of_head[f[i]] = i, ++incoming[f[i]];
      if (s[i] >= 0 && s[i] < nodes) previous[s[i]] = i, ++incoming[s[i]];
    }
    for (int64_t i = 0; i < nodes; ++i) head[i] = previous[i] >= 0 ? previous[i] : i;
    for (int step = 0; step < steps; ++step) {
      for (int64_t i = 0; i < nodes; ++i) jumped[i] = head[head[i]];
      head.swap(jumped);
    }
    int64_t* row = out + b * nodes;
    for (int64_t i = 0; i < nodes; ++i) row[i] = parent_of_head[head[i]];
    row[0] = -1;
    for (int64_t i = 0; i < nodes; ++i) {
      if (incoming[i] != (i > 0 ? 1 : 0)) ok = false;
      if (i > 0 && (row[i] < 0 || row[i] >= i)) ok = false;
    }
  }
  return {parents, ok};
}

// Whether SGLang's outputs fit the tree (adapters/sglang.py: _check_outputs): every
// retrive_index in [0, flat_size), and every node's depth below num_spec_step. False too for
// parents that are not a tree (the caller has checked them; the torch checks then decide).
bool cpu_sglang_outputs_ok(const at::Tensor& retrive_index, int64_t flat_size,
                           const at::Tensor& parents, int64_t num_spec_step) {
  TORCH_CHECK(parents.dim() == 2, "parents [bs, N] expected");
  const int64_t batch = parents.size(0), nodes = parents.size(1);
  check_cpu(retrive_index, "retrive_index", {batch, nodes});
  check_cpu(parents, "parents", {batch, nodes});
  const at::Tensor index = as_type(retrive_index, at::kLong), parent = as_type(parents, at::kLong);
  const int64_t *ip = index.data_ptr<int64_t>(), *pp = parent.data_ptr<int64_t>();
  std::vector<int64_t> depth(nodes);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nodes; ++i) {
      const int64_t flat = ip[b * nodes + i], up = pp[b * nodes + i];
      if (flat < 0 || flat >= flat_size) return false;
      if (i == 0) {
        if (up != -1) return false;
        depth[0] = 0;
        continue;
      }
      if (up < 0 || up >= i) return false;
      depth[i] = depth[up] + 1;
      if (depth[i] >= num_spec_step) return false;
    }
  }
  return true;
}

// SGLang's outputs from a verified path (adapters/sglang.py: _write_path), in place: for path
// step i <= m = clamp(num_accepted[b], 0, num_spec_step - 1) (i below num_spec_step and the
// path's width), accept_index[b, i] = f_i = retrive_index[b, path_i] (clamped into predicts)
// and predicts[f_i] = the token emitted after it (-1 as vocab - 1 when vocab >= 0); later steps
// write step 0's token at f_0 again, as the torch scatter does; accept_token_num[b] = m.
void cpu_sglang_write_path(at::Tensor predicts, at::Tensor accept_index,
                           at::Tensor accept_token_num, const at::Tensor& retrive_index,
                           const at::Tensor& accepted_nodes, const at::Tensor& output_token_ids,
                           const at::Tensor& num_accepted, int64_t vocab) {
  TORCH_CHECK(retrive_index.dim() == 2 && accept_index.dim() == 2 && accepted_nodes.dim() == 2,
              "retrive_index, accept_index, accepted_nodes: 2-D expected");
  const int64_t batch = retrive_index.size(0), nodes = retrive_index.size(1);
  const int64_t columns = accept_index.size(1), path_len = accepted_nodes.size(1);
  check_cpu(retrive_index, "retrive_index", {batch, nodes});
  check_cpu(accept_index, "accept_index", {batch, columns});
  check_cpu(accepted_nodes, "accepted_nodes", {batch, path_len});
  check_cpu(output_token_ids, "output_token_ids", {batch, path_len});
  check_cpu(num_accepted, "num_accepted", {batch});
  check_cpu(accept_token_num, "accept_token_num", {batch});
  TORCH_CHECK(predicts.device().is_cpu() && predicts.dim() == 1 && predicts.is_contiguous() &&
                  predicts.scalar_type() == at::kInt,
              "predicts: a contiguous 1-D int32 CPU tensor expected");
  TORCH_CHECK(accept_index.is_contiguous() && accept_index.scalar_type() == at::kInt &&
                  accept_token_num.is_contiguous() && accept_token_num.scalar_type() == at::kInt,
              "accept_index, accept_token_num: contiguous int32 expected");
  const int64_t flat_size = predicts.numel();
  TORCH_CHECK(columns >= 1 && (batch == 0 || (flat_size >= 1 && nodes >= 1)),
              "accept_index, predicts, retrive_index: at least one column / entry expected");
  const at::Tensor index = as_type(retrive_index, at::kLong),
                   path = as_type(accepted_nodes, at::kLong),
                   tokens = as_type(output_token_ids, at::kLong),
                   count = as_type(num_accepted, at::kLong);
  const int64_t *ip = index.data_ptr<int64_t>(), *pp = path.data_ptr<int64_t>(),
                *tp = tokens.data_ptr<int64_t>(), *cp = count.data_ptr<int64_t>();
  int32_t *out = predicts.data_ptr<int32_t>(), *ai = accept_index.data_ptr<int32_t>(),
          *an = accept_token_num.data_ptr<int32_t>();
  const int64_t width = std::min(columns, path_len);
  auto clamp = [](int64_t v, int64_t lo, int64_t hi) { return std::min(std::max(v, lo), hi); };
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t m = clamp(cp[b], 0, columns - 1);
    int64_t flat0 = 0, token0 = 0;
    for (int64_t i = 0; i < width; ++i) {
      const int64_t node = clamp(pp[b * path_len + i], 0, nodes - 1);
      const int64_t flat = clamp(ip[b * nodes + node], 0, flat_size - 1);
      int64_t token = static_cast<int32_t>(tp[b * path_len + i]);
      if (vocab >= 0 && token < 0) token = vocab - 1;
      if (i == 0) flat0 = flat, token0 = token;
      if (i <= m) {
        out[flat] = static_cast<int32_t>(token);
        ai[b * columns + i] = static_cast<int32_t>(flat);
      } else {
        out[flat0] = static_cast<int32_t>(token0);
      }
    }
    an[b] = static_cast<int32_t>(m);
  }
}

// SGLang's verify_tree_greedy (adapters/sglang.py), in place, where its lists are one tree:
// from the root, at node u the first child in list order whose candidate equals
// target_predict at u's flat index (clamped into predicts, then into target_predict) is
// accepted, for at most min(num_spec_step, N) - 1 levels; then the writes of
// cpu_sglang_write_path (no vocab: a token is never -1 here). Returns false, and writes
// nothing, where the lists are not one tree (the caller's torch code then decides).
bool cpu_sglang_greedy(at::Tensor predicts, at::Tensor accept_index, at::Tensor accept_token_num,
                       const at::Tensor& candidates, const at::Tensor& retrive_index,
                       const at::Tensor& next_token, const at::Tensor& next_sibling,
                       const at::Tensor& target_predict) {
  const auto tree = cpu_sglang_parents(next_token, next_sibling);
  if (!std::get<1>(tree)) return false;
  const int64_t batch = next_token.size(0), nodes = next_token.size(1);
  TORCH_CHECK(accept_index.dim() == 2 && accept_index.size(1) >= 1,
              "accept_index [bs, num_spec_step >= 1] expected");
  check_cpu(candidates, "candidates", {batch, nodes});
  check_cpu(retrive_index, "retrive_index", {batch, nodes});
  check_cpu(target_predict, "target_predict", {batch, nodes});
  TORCH_CHECK(predicts.dim() == 1 && (batch == 0 || predicts.numel() >= 1),
              "predicts: a 1-D tensor with at least one entry expected");
  const int64_t width = std::min(accept_index.size(1), nodes), flat_size = predicts.numel();
  const at::Tensor cand = as_type(candidates, at::kLong), index = as_type(retrive_index, at::kLong),
                   target = as_type(target_predict, at::kLong),
                   first = as_type(next_token, at::kLong), next = as_type(next_sibling, at::kLong);
  const int64_t *cp = cand.data_ptr<int64_t>(), *ip = index.data_ptr<int64_t>(),
                *tp = target.data_ptr<int64_t>(), *fp = first.data_ptr<int64_t>(),
                *sp = next.data_ptr<int64_t>();
  at::Tensor path = at::empty({batch, width}, cand.options()),
             emitted = at::empty({batch, width}, cand.options()),
             count = at::empty({batch}, cand.options());
  int64_t *pp = path.data_ptr<int64_t>(), *ep = emitted.data_ptr<int64_t>(),
          *np = count.data_ptr<int64_t>();
  const int64_t target_size = batch * nodes;
  auto clamp = [](int64_t v, int64_t lo, int64_t hi) { return std::min(std::max(v, lo), hi); };
  // The target's choice after node u of request b.
  auto predicted = [&](int64_t b, int64_t u) {
    const int64_t flat = clamp(ip[b * nodes + u], 0, flat_size - 1);
    return tp[clamp(flat, 0, target_size - 1)];
  };
  for (int64_t b = 0; b < batch; ++b) {
    int64_t current = 0, accepted = 0;
    pp[b * width] = 0;
    for (int64_t step = 1; step < width; ++step) {
      int64_t child = -1;
      if (accepted == step - 1) {  // still walking: the first matching child in list order
        const int64_t want = predicted(b, current);
        int64_t c = fp[b * nodes + current];
        for (int64_t seen = 0; c >= 0 && c < nodes && seen < nodes; ++seen) {
          if (cp[b * nodes + c] == want) {
            child = c;
            break;
          }
          c = sp[b * nodes + c];
        }
      }
      if (child >= 0) current = child, ++accepted;
      pp[b * width + step] = child >= 0 ? child : -1;
      ep[b * width + step - 1] = cp[b * nodes + current];
    }
    np[b] = accepted;
    const int64_t last = predicted(b, current);
    for (int64_t i = 0; i < width; ++i) {
      ep[b * width + i] = i < accepted ? ep[b * width + i] : (i == accepted ? last : -1);
    }
  }
  cpu_sglang_write_path(predicts, accept_index, accept_token_num, retrive_index, path, emitted,
                        count, -1);
  return true;
}

// vLLM MRV2's step in our packed layout (adapters/vllm/mrv2_0_33.py: packed_layout, the
// same values for every input its torch code takes): request i's rows cu[i] .. cu[i+1] - 1 of
// num_logits, its bonus row last; draft_sampled[r] the draft that row r - 1 verifies. Returns
// cu_drafts [B+1] = cu[i] - i; draft_ids [T = num_logits - B] int64 (draft j of request
// upper_bound(cu_drafts[1:], j), clamped, read at row j + request + 1; -1 where a sharded
// cache has no row for its request); draft_rows [B] (the request's slot, or its row of a
// sharded cache, clamped into [0, num_rows)); temperature [B] float32 and verify_temperature
// (0 greedy, else 1); seeds [B] int64; first_pos [B] = pos[cu[i]] (a negative index counts
// from the end, as torch indexing; then clamped).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
cpu_mrv2_layout(const at::Tensor& cu_num_logits, const at::Tensor& draft_sampled,
                const at::Tensor& pos, const at::Tensor& idx_mapping, const at::Tensor& temperature,
                const at::Tensor& seed, const std::optional<at::Tensor>& row_mapping,
                int64_t num_slots, int64_t num_rows) {
  TORCH_CHECK(cu_num_logits.dim() == 1 && cu_num_logits.size(0) >= 1 && draft_sampled.dim() == 1,
              "cu_num_logits [B+1] and draft_sampled [num_logits] expected");
  const int64_t batch = cu_num_logits.size(0) - 1, num_logits = draft_sampled.size(0);
  TORCH_CHECK(num_logits >= batch, "draft_sampled: at least one row per request expected");
  check_cpu(cu_num_logits, "cu_num_logits", {batch + 1});
  check_cpu(draft_sampled, "draft_sampled", {num_logits});
  check_cpu(pos, "pos", {num_logits});
  check_cpu(idx_mapping, "idx_mapping", {batch});
  TORCH_CHECK(temperature.device().is_cpu() && seed.device().is_cpu() && temperature.dim() == 1 &&
                  seed.dim() == 1 && (batch == 0 || (num_slots >= 1 &&
                  temperature.size(0) >= num_slots && seed.size(0) >= num_slots)),
              "temperature, seed: [>= num_slots] CPU tensors expected");
  const at::Tensor cu = as_type(cu_num_logits, at::kLong), ids = as_type(draft_sampled, at::kLong),
                   positions = as_type(pos, at::kLong), slots_in = as_type(idx_mapping, at::kLong),
                   temps = as_type(temperature, at::kFloat), seeds_in = as_type(seed, at::kLong);
  at::Tensor rows_in;
  if (row_mapping.has_value()) {
    TORCH_CHECK(row_mapping->device().is_cpu() && row_mapping->dim() == 1 &&
                    (batch == 0 || (row_mapping->size(0) >= num_slots && num_rows >= 1)),
                "row_mapping: a [>= num_slots] CPU tensor and num_rows >= 1 expected");
    rows_in = as_type(*row_mapping, at::kLong);
  }
  const int64_t num_packed = num_logits - batch;
  const auto longs = cu.options();
  at::Tensor cu_drafts = at::empty({batch + 1}, longs), draft_ids = at::empty({num_packed}, longs),
             draft_rows = at::empty({batch}, longs), temp = at::empty({batch}, temps.options()),
             verify_temp = at::empty({batch}, temps.options()), seeds = at::empty({batch}, longs),
             first_pos = at::empty({batch}, longs);
  const int64_t *c = cu.data_ptr<int64_t>(), *d = ids.data_ptr<int64_t>(),
                *p = positions.data_ptr<int64_t>(), *m = slots_in.data_ptr<int64_t>(),
                *s = seeds_in.data_ptr<int64_t>();
  const int64_t* r = rows_in.defined() ? rows_in.data_ptr<int64_t>() : nullptr;
  const float* t = temps.data_ptr<float>();
  int64_t *cd = cu_drafts.data_ptr<int64_t>(), *di = draft_ids.data_ptr<int64_t>(),
          *dr = draft_rows.data_ptr<int64_t>(), *sd = seeds.data_ptr<int64_t>(),
          *fp = first_pos.data_ptr<int64_t>();
  float *tp = temp.data_ptr<float>(), *vt = verify_temp.data_ptr<float>();
  auto clamp = [](int64_t v, int64_t lo, int64_t hi) { return std::min(std::max(v, lo), hi); };
  std::vector<int64_t> row(batch);  // each request's cache row before the clamp to >= 0
  for (int64_t i = 0; i <= batch; ++i) cd[i] = c[i] - i;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t slot = clamp(m[i], 0, std::max<int64_t>(num_slots - 1, 0));
    row[i] = r == nullptr ? slot : std::min(r[slot], num_rows - 1);
    dr[i] = std::max<int64_t>(row[i], 0);
    tp[i] = t[slot];
    vt[i] = tp[i] != 0.0f ? 1.0f : 0.0f;
    sd[i] = s[slot];
    int64_t first = std::min(c[i], std::max<int64_t>(num_logits - 1, 0));
    if (first < 0) first += num_logits;
    fp[i] = p[clamp(first, 0, num_logits - 1)];
  }
  for (int64_t j = 0; j < num_packed; ++j) {
    int64_t lo = 0, hi = batch;  // upper_bound(cu_drafts[1:], j), as torch.searchsorted
    while (lo < hi) {
      const int64_t mid = lo + ((hi - lo) >> 1);
      if (!(j < cd[mid + 1])) lo = mid + 1; else hi = mid;
    }
    const int64_t request = std::min(lo, std::max<int64_t>(batch - 1, 0));
    di[j] = d[std::min(j + request + 1, num_logits - 1)];
    if (r != nullptr && batch > 0 && row[request] < 0) di[j] = -1;  // no row on this rank
  }
  return {cu_drafts, draft_ids, draft_rows, temp, verify_temp, seeds, first_pos};
}

// Whether a validated MRV2 step passes its index checks (adapters/vllm/mrv2_0_33.py:
// _check_indices, and vLLM 0.34's _check_rows): idx_mapping in [0, num_slots) (the smallest of
// its slot tensors), cu_num_logits from 0 to num_logits with 1 .. max_drafts + 1 rows per
// request, and, for a sharded cache, each request's row_mapping entry in [-1, num_rows). One
// pass for a CPU call; where it says no, the torch checks name the fault.
bool cpu_mrv2_indices_ok(const at::Tensor& cu_num_logits, const at::Tensor& idx_mapping,
                         int64_t num_slots, int64_t num_logits, int64_t max_drafts,
                         const std::optional<at::Tensor>& row_mapping, int64_t num_rows) {
  TORCH_CHECK(cu_num_logits.dim() == 1 && cu_num_logits.size(0) >= 1 && idx_mapping.dim() == 1,
              "cu_num_logits [B+1] and idx_mapping [B] expected");
  const int64_t batch = cu_num_logits.size(0) - 1;
  check_cpu(cu_num_logits, "cu_num_logits", {batch + 1});
  check_cpu(idx_mapping, "idx_mapping", {batch});
  const at::Tensor cu = as_type(cu_num_logits, at::kLong), slots = as_type(idx_mapping, at::kLong);
  const int64_t *c = cu.data_ptr<int64_t>(), *m = slots.data_ptr<int64_t>();
  if (c[0] != 0 || c[batch] != num_logits) return false;
  for (int64_t i = 0; i < batch; ++i) {
    if (m[i] < 0 || m[i] >= num_slots) return false;
    // (c[i] >= 0 by induction: no overflow in the difference)
    if (c[i + 1] < c[i] + 1 || c[i + 1] - c[i] > max_drafts + 1) return false;
  }
  if (!row_mapping.has_value()) return true;
  TORCH_CHECK(row_mapping->device().is_cpu() && row_mapping->dim() == 1,
              "row_mapping: a 1-D CPU tensor expected");
  const at::Tensor rows = as_type(*row_mapping, at::kLong);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch; ++i) {
    if (m[i] >= rows.size(0)) return false;  // (the torch check would raise IndexError)
    if (r[m[i]] < -1 || r[m[i]] >= num_rows) return false;
  }
  return true;
}

// MRV2's outputs from ours (adapters/vllm/mrv2_0_3x.py): sampled = output_token_ids as int64
// (with zero_missing, vLLM 0.34: a -1 among the emitted tokens, a row with no finite logit,
// as token 0, what vLLM's kernels write), num_sampled = num_accepted + 1 in its own dtype.
std::tuple<at::Tensor, at::Tensor> cpu_mrv2_outputs(const at::Tensor& output_token_ids,
                                                    const at::Tensor& num_accepted,
                                                    bool zero_missing) {
  TORCH_CHECK(output_token_ids.dim() == 2, "output_token_ids [B, K+1] expected");
  const int64_t batch = output_token_ids.size(0), width = output_token_ids.size(1);
  check_cpu(output_token_ids, "output_token_ids", {batch, width});
  check_cpu(num_accepted, "num_accepted", {batch});
  TORCH_CHECK(num_accepted.scalar_type() == at::kInt, "num_accepted: int32 expected");
  const at::Tensor tokens = as_type(output_token_ids, at::kLong),
                   counts = as_type(num_accepted, at::kInt);
  at::Tensor sampled = tokens.is_same(output_token_ids) ? tokens.clone() : tokens;
  at::Tensor num_sampled = at::empty({batch}, counts.options());
  int64_t* out = sampled.data_ptr<int64_t>();
  const int32_t* n = counts.data_ptr<int32_t>();
  int32_t* ns = num_sampled.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    ns[b] = static_cast<int32_t>(static_cast<uint32_t>(n[b]) + 1u);  // (wraps as torch's)
    if (!zero_missing) continue;
    for (int64_t i = 0; i < std::min<int64_t>(ns[b], width); ++i) {
      if (out[b * width + i] < 0) out[b * width + i] = 0;
    }
  }
  return {sampled, num_sampled};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def(
      "cpu_flashinfer_counts(Tensor target_probs, Tensor draft_probs, Tensor draft_token_ids, "
      "Tensor num_accepted, Tensor seed, Tensor offset, Tensor(a!) accepted, "
      "Tensor(b!) emitted) -> ()");
  m.def("cpu_sglang_parents(Tensor next_token, Tensor next_sibling) -> (Tensor, bool)");
  m.def(
      "cpu_sglang_outputs_ok(Tensor retrive_index, int flat_size, Tensor parents, "
      "int num_spec_step) -> bool");
  m.def(
      "cpu_sglang_write_path(Tensor(a!) predicts, Tensor(b!) accept_index, "
      "Tensor(c!) accept_token_num, Tensor retrive_index, Tensor accepted_nodes, "
      "Tensor output_token_ids, Tensor num_accepted, int vocab) -> ()");
  m.def(
      "cpu_sglang_greedy(Tensor(a!) predicts, Tensor(b!) accept_index, "
      "Tensor(c!) accept_token_num, Tensor candidates, Tensor retrive_index, "
      "Tensor next_token, Tensor next_sibling, Tensor target_predict) -> bool");
  m.def(
      "cpu_mrv2_layout(Tensor cu_num_logits, Tensor draft_sampled, Tensor pos, Tensor idx_mapping, "
      "Tensor temperature, Tensor seed, Tensor? row_mapping, int num_slots, int num_rows) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "cpu_mrv2_indices_ok(Tensor cu_num_logits, Tensor idx_mapping, int num_slots, "
      "int num_logits, int max_drafts, Tensor? row_mapping, int num_rows) -> bool");
  m.def(
      "cpu_mrv2_outputs(Tensor output_token_ids, Tensor num_accepted, bool zero_missing) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("cpu_flashinfer_counts", &cpu_flashinfer_counts);
  m.impl("cpu_sglang_parents", &cpu_sglang_parents);
  m.impl("cpu_sglang_outputs_ok", &cpu_sglang_outputs_ok);
  m.impl("cpu_sglang_write_path", &cpu_sglang_write_path);
  m.impl("cpu_sglang_greedy", &cpu_sglang_greedy);
  m.impl("cpu_mrv2_layout", &cpu_mrv2_layout);
  m.impl("cpu_mrv2_indices_ok", &cpu_mrv2_indices_ok);
  m.impl("cpu_mrv2_outputs", &cpu_mrv2_outputs);
}

}  // namespace torch_ops
}  // namespace specdec
