// CPU registrations of the sampling path (csrc/core/sampling_cpu.h): torch.ops.specdec.
// cpu_verify_chain(_packed) / cpu_verify_tree / cpu_sample / cpu_processed_probs /
// cpu_random_words, and cpu_packed_layout_ok / cpu_tree_ok (a validated call's checks in one
// pass).
// The Python layer (specdec_kernels/_cpu.py) validates values first; these checks guard memory
// safety. The per-request parameters are small [B] tensors converted here; the [.., V] tensors
// are read in place (contiguous, in their own dtype).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_tensors.h"
#include "sampling_cpu.h"

namespace specdec {
namespace torch_ops {
namespace {

cpu::Dtype dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return cpu::Dtype::kFloat32;
    case at::kBFloat16:
      return cpu::Dtype::kBFloat16;
    case at::kHalf:
      return cpu::Dtype::kFloat16;
    default:
      TORCH_CHECK(false, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

using cpu_tensors::as_type;
using cpu_tensors::check_cpu;

// The [B] parameters as contiguous tensors of the core's types (kept alive by `owned`).
struct Params {
  at::Tensor temperature, top_k, top_p, min_p, seed, offset;
  cpu::RequestParams view() const {
    return cpu::RequestParams{temperature.data_ptr<float>(), top_k.data_ptr<int32_t>(),
                              top_p.data_ptr<float>(),
                              min_p.defined() ? min_p.data_ptr<float>() : nullptr,
                              seed.data_ptr<int64_t>(), offset.data_ptr<int64_t>()};
  }
};

at::Tensor small(const at::Tensor& t, const char* name, int64_t batch, at::ScalarType type) {
  check_cpu(t, name, {batch});
  return as_type(t, type);
}

Params params_of(int64_t batch, const at::Tensor& temperature, const at::Tensor& top_k,
                 const at::Tensor& top_p, const std::optional<at::Tensor>& min_p,
                 const at::Tensor& seed, const at::Tensor& offset) {
  Params p;
  p.temperature = small(temperature, "temperature", batch, at::kFloat);
  p.top_k = small(top_k, "top_k", batch, at::kInt);
  p.top_p = small(top_p, "top_p", batch, at::kFloat);
  if (min_p.has_value()) p.min_p = small(*min_p, "min_p", batch, at::kFloat);
  p.seed = small(seed, "seed", batch, at::kLong);
  p.offset = small(offset, "offset", batch, at::kLong);
  return p;
}

const int32_t* bitmask_of(const std::optional<at::Tensor>& bitmask, at::IntArrayRef lead,
                          int64_t vocab, at::Tensor& owned) {
  if (!bitmask.has_value()) return nullptr;
  std::vector<int64_t> shape(lead.begin(), lead.end());
  shape.push_back((vocab + 31) / 32);
  check_cpu(*bitmask, "token_bitmask", shape);
  TORCH_CHECK(bitmask->scalar_type() == at::kInt, "token_bitmask must be int32");
  owned = bitmask->contiguous();
  return owned.data_ptr<int32_t>();
}

// The fields SampleArgs and ProbsArgs share: [rows, V] logits, their bitmask, parameters.
template <class Args>
void set_logits(Args& args, const at::Tensor& x, int64_t vocab, const int32_t* bitmask,
                const Params& params) {
  args.vocab = vocab;
  args.logits = x.data_ptr();
  args.dtype = dtype_of(x, "logits");
  args.bitmask = bitmask;
  args.params = params.view();
}

// Requests per task: enough work per task to amortise the thread hand-off.
int64_t grain(int64_t rows_per_request, int64_t vocab) {
  const int64_t work = rows_per_request * vocab;
  return work >= 16384 ? 1 : 16384 / (work > 0 ? work : 1);
}

// body(begin, end) over requests [0, count): in tasks of `grain` requests (at::parallel_for),
// or on this thread when the call is one task (as parallel_for would, without its
// bookkeeping: a tiny call opens no OpenMP region and costs about its work).
template <class F>
void for_requests(int64_t count, int64_t grain_size, const F& body) {
  if (count <= 0) return;
  if (count <= grain_size) {
    body(int64_t{0}, count);
    return;
  }
  at::parallel_for(0, count, grain_size, body);
}

// Both layouts: target [R, V] rows, drafts [D] / [D, V]; the packed rows (PackedRows) or null.
// return_logprobs as an int (0 none, 1 processed, 2 raw); the result's tensor is empty for 0.
cpu::Logprobs logprobs_of(int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "logprobs must be 0 (none), 1 (processed) or 2 (raw)");
  return static_cast<cpu::Logprobs>(kind);
}

at::Tensor logprobs_tensor(cpu::Logprobs kind, at::IntArrayRef shape, const at::Tensor& like) {
  return at::empty(kind == cpu::Logprobs::kNone ? at::IntArrayRef{0} : shape,
                   like.options().dtype(at::kFloat));
}

// The packed layout's rows (the reference's packed_layout, in one pass over the offsets cu
// [B+1] instead of a dozen small torch ops): request b starts at s = clamp(cu[b], 0, T) with
// n_b = min(clamp(cu[b+1] - cu[b], 0, K), T - s) live drafts; its target row j is
// s + b + min(j, n_b), its draft row j is s + j (T, the padding row, past n_b). Garbage
// offsets (validate=False) give rows in range all the same.
struct PackedRows {
  std::vector<int64_t> target, draft;
  at::Tensor counts;  // int32 [B]
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_chain(
    const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
    const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& draft_logits,
    const PackedRows* packed, int64_t batch,
    int64_t num_drafts, const at::Tensor& num_draft_tokens, const at::Tensor& temperature,
    const at::Tensor& top_k, const at::Tensor& top_p, const std::optional<at::Tensor>& min_p,
    const std::optional<at::Tensor>& token_bitmask, const at::Tensor& seed,
    const at::Tensor& offset, int64_t method, int64_t logprobs_kind,
    const std::optional<at::Tensor>& draft_slots,
    const std::optional<at::Tensor>& draft_temperature) {
  const int64_t vocab = target_logits.size(-1), rows = num_drafts + 1;
  TORCH_CHECK(vocab >= 1, "target_logits must have V >= 1");
  const int64_t target_count = target_logits.numel() / vocab;
  const int64_t draft_count = draft_token_ids.numel();
  check_cpu(target_logits, "target_logits", target_logits.sizes());
  check_cpu(draft_token_ids, "draft_token_ids", draft_token_ids.sizes());
  const at::Tensor target = target_logits.contiguous();
  const at::Tensor ids = as_type(draft_token_ids, at::kLong);
  const at::Tensor n = small(num_draft_tokens, "num_draft_tokens", batch, at::kInt);
  const Params params = params_of(batch, temperature, top_k, top_p, min_p, seed, offset);
  cpu::ChainArgs args;
  args.batch = batch;
  args.num_drafts = num_drafts;
  args.vocab = vocab;
  args.target = target.data_ptr();
  args.target_dtype = dtype_of(target, "target_logits");
  at::Tensor bitmask;
  args.bitmask = bitmask_of(token_bitmask, target_logits.sizes().slice(0, target_logits.dim() - 1),
                            vocab, bitmask);
  if (packed != nullptr) {  // rows from packed_rows, in range by construction
    TORCH_CHECK(target_count == draft_count + batch,
                "packed: target_logits [T+B, V] and draft_token_ids [T] disagree");
    args.target_rows = packed->target.data();
    args.draft_rows = packed->draft.data();
  } else {
    TORCH_CHECK(target_count == batch * rows && draft_count == batch * num_drafts,
                "target_logits [B, K+1, V] and draft_token_ids [B, K] disagree");
  }
  args.draft_ids = ids.data_ptr<int64_t>();
  args.num_draft_tokens = n.data_ptr<int32_t>();
  at::Tensor probs, logits;
  TORCH_CHECK(!(draft_probs.has_value() && draft_logits.has_value()),
              "draft_probs and draft_logits are exclusive");
  std::vector<int64_t> draft_shape(draft_token_ids.sizes().begin(), draft_token_ids.sizes().end());
  draft_shape.push_back(vocab);
  at::Tensor draft_temp;
  std::vector<int64_t> slot_rows;  // draft_slots, clamped
  // Per-slot draft rows [S, K', V'] (draft_slots): read in place through the slots, any
  // strides with a unit vocabulary stride (else one contiguous copy, as for every input).
  auto draft_tensor = [&](const at::Tensor& draft, const char* name) {
    if (!draft_slots.has_value()) {
      check_cpu(draft, name, draft_shape);
      return draft.contiguous();
    }
    TORCH_CHECK(draft.device().is_cpu(), name, " must be a CPU tensor, got ", draft.device());
    TORCH_CHECK(draft.dim() == 3 && draft.size(1) >= num_drafts && draft.size(2) >= vocab &&
                    (batch == 0 || draft.size(0) >= 1),
                name, " with draft_slots must be [S >= 1, K' >= K, V' >= V], got ",
                draft.sizes());
    const at::Tensor rows = draft.stride(2) == 1 ? draft : draft.contiguous();
    // Clamped into [0, S - 1] here, in a plain loop (an ATen clamp costs more than the work).
    const at::Tensor given = small(*draft_slots, "draft_slots", batch, at::kLong);
    const int64_t* g = given.data_ptr<int64_t>();
    slot_rows.resize(static_cast<size_t>(batch));
    for (int64_t b = 0; b < batch; ++b) {
      slot_rows[b] = std::clamp<int64_t>(g[b], 0, std::max<int64_t>(rows.size(0) - 1, 0));
    }
    args.draft_slots = slot_rows.data();
    args.draft_slot_stride = rows.stride(0);
    args.draft_position_stride = rows.stride(1);
    return rows;
  };
  if (draft_probs.has_value()) {
    probs = draft_tensor(*draft_probs, "draft_probs");
    args.draft_probs = probs.data_ptr();
    args.draft_probs_dtype = dtype_of(probs, "draft_probs");
  }
  if (draft_logits.has_value()) {
    logits = draft_tensor(*draft_logits, "draft_logits");
    args.draft_logits = logits.data_ptr();
    args.draft_logits_dtype = dtype_of(logits, "draft_logits");
  }
  TORCH_CHECK(!draft_slots.has_value() || draft_probs.has_value() || draft_logits.has_value(),
              "draft_slots needs draft_probs or draft_logits");
  if (draft_temperature.has_value()) {
    TORCH_CHECK(draft_logits.has_value(), "draft_temperature needs draft_logits");
    draft_temp = small(*draft_temperature, "draft_temperature", batch, at::kFloat);
    args.draft_temperature = draft_temp.data_ptr<float>();
  }
  args.params = params.view();
  TORCH_CHECK(method == 0 || method == 1, "method must be 0 (token) or 1 (block)");
  args.method = static_cast<cpu::ChainMethod>(method);
  args.logprobs_kind = logprobs_of(logprobs_kind);
  at::Tensor out = at::empty({batch, rows}, target.options().dtype(at::kInt));
  at::Tensor accepted = at::empty({batch}, target.options().dtype(at::kInt));
  at::Tensor logprobs = logprobs_tensor(args.logprobs_kind, {batch, rows}, target);
  args.output_token_ids = out.data_ptr<int32_t>();
  args.num_accepted = accepted.data_ptr<int32_t>();
  args.logprobs = logprobs.numel() ? logprobs.data_ptr<float>() : nullptr;
  for_requests(batch, grain(rows, vocab),
                   [&](int64_t begin, int64_t end) { cpu::verify_chain(args, begin, end); });
  return {out, accepted, logprobs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_verify_chain(
    const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
    const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& draft_logits,
    const at::Tensor& num_draft_tokens, const at::Tensor& temperature, const at::Tensor& top_k,
    const at::Tensor& top_p, const std::optional<at::Tensor>& min_p,
    const std::optional<at::Tensor>& token_bitmask, const at::Tensor& seed,
    const at::Tensor& offset, int64_t method, int64_t logprobs,
    const std::optional<at::Tensor>& draft_slots,
    const std::optional<at::Tensor>& draft_temperature) {
  TORCH_CHECK(target_logits.dim() == 3 && target_logits.size(1) >= 1,
              "target_logits must be [B, K+1, V], got ", target_logits.sizes());
  const int64_t batch = target_logits.size(0), num_drafts = target_logits.size(1) - 1;
  check_cpu(draft_token_ids, "draft_token_ids", {batch, num_drafts});
  return run_chain(target_logits, draft_token_ids, draft_probs, draft_logits, nullptr,
                   batch, num_drafts, num_draft_tokens, temperature, top_k, top_p, min_p,
                   token_bitmask, seed, offset, method, logprobs, draft_slots,
                   draft_temperature);
}

PackedRows packed_rows(const at::Tensor& cu_num_draft_tokens, int64_t num_packed,
                       int64_t num_drafts, const at::Tensor& like) {
  TORCH_CHECK(cu_num_draft_tokens.dim() == 1 && cu_num_draft_tokens.size(0) >= 1,
              "cu_num_draft_tokens must be [B+1], got ", cu_num_draft_tokens.sizes());
  check_cpu(cu_num_draft_tokens, "cu_num_draft_tokens", cu_num_draft_tokens.sizes());
  // (The public layer allows K < 2^16, MAX_POSITION; the sizes below cannot overflow then.)
  TORCH_CHECK(num_drafts >= 0 && num_drafts < (int64_t{1} << 16),
              "max_draft_tokens must be in [0, 65536), got ", num_drafts);
  const int64_t batch = cu_num_draft_tokens.size(0) - 1, rows = num_drafts + 1;
  TORCH_CHECK(batch <= (int64_t{1} << 40), "cu_num_draft_tokens: too many requests, ", batch);
  const at::Tensor cu = as_type(cu_num_draft_tokens, at::kLong);
  const int64_t* c = cu.data_ptr<int64_t>();
  PackedRows out;
  out.target.resize(static_cast<size_t>(batch * rows));
  out.draft.resize(static_cast<size_t>(batch * num_drafts));
  out.counts = at::empty({batch}, like.options().dtype(at::kInt));
  int32_t* counts = out.counts.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t start = std::clamp<int64_t>(c[b], 0, num_packed);
    // cu[b+1] - cu[b] wrapping as torch's int64 subtraction does (garbage offsets alike).
    const int64_t difference =
        static_cast<int64_t>(static_cast<uint64_t>(c[b + 1]) - static_cast<uint64_t>(c[b]));
    const int64_t live =
        std::min<int64_t>(std::clamp<int64_t>(difference, 0, num_drafts), num_packed - start);
    counts[b] = static_cast<int32_t>(live);
    for (int64_t j = 0; j < rows; ++j) out.target[b * rows + j] = start + b + std::min(j, live);
    for (int64_t j = 0; j < num_drafts; ++j) {
      out.draft[b * num_drafts + j] = j < live ? start + j : num_packed;
    }
  }
  return out;
}

// Whether a packed call's offsets and ids pass contract section 10's checks (cu[0] = 0,
// 0 <= cu[b+1] - cu[b] <= K, cu[B] = T, ids in [0, V)): a validated CPU call's one pass over
// them, in place of a dozen small torch ops; the Python layer builds the message from its own
// checks where this says no.
bool cpu_packed_layout_ok(const at::Tensor& cu_num_draft_tokens,
                          const at::Tensor& draft_token_ids, int64_t max_draft_tokens,
                          int64_t vocab) {
  TORCH_CHECK(cu_num_draft_tokens.dim() == 1 && cu_num_draft_tokens.size(0) >= 1 &&
                  draft_token_ids.dim() == 1,
              "cu_num_draft_tokens [B+1] and draft_token_ids [T] expected");
  check_cpu(cu_num_draft_tokens, "cu_num_draft_tokens", cu_num_draft_tokens.sizes());
  check_cpu(draft_token_ids, "draft_token_ids", draft_token_ids.sizes());
  const at::Tensor cu = as_type(cu_num_draft_tokens, at::kLong);
  const at::Tensor ids = as_type(draft_token_ids, at::kLong);
  const int64_t* c = cu.data_ptr<int64_t>();
  const int64_t batch = cu.size(0) - 1, num_packed = ids.size(0);
  if (c[0] != 0 || c[batch] != num_packed) return false;
  for (int64_t b = 0; b < batch; ++b) {  // c[b] >= 0 here: no overflow in the difference
    if (c[b + 1] < c[b] || c[b + 1] - c[b] > max_draft_tokens) return false;
  }
  const int64_t* d = ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < num_packed; ++j) {
    if (d[j] < 0 || d[j] >= vocab) return false;
  }
  return true;
}

// Whether a tree call's trees and ids pass its value checks (num_nodes in [1, N],
// parents[b, 0] = -1, 0 <= parents[b, i] < i and ids in [0, V) for the real nodes i >= 1):
// as cpu_packed_layout_ok, one pass for a validated CPU call, the message from Python's checks.
bool cpu_tree_ok(const at::Tensor& parents, const std::optional<at::Tensor>& num_nodes,
                 const at::Tensor& tree_token_ids, int64_t vocab) {
  TORCH_CHECK(parents.dim() == 2 && parents.size(1) >= 1, "parents [B, N >= 1] expected");
  const int64_t batch = parents.size(0), nodes = parents.size(1);
  check_cpu(parents, "parents", {batch, nodes});
  check_cpu(tree_token_ids, "tree_token_ids", {batch, nodes});
  const at::Tensor parent = as_type(parents, at::kLong), ids = as_type(tree_token_ids, at::kLong);
  at::Tensor count;
  if (num_nodes.has_value()) count = small(*num_nodes, "num_nodes", batch, at::kLong);
  const int64_t* counts = count.defined() ? count.data_ptr<int64_t>() : nullptr;
  const int64_t* p = parent.data_ptr<int64_t>();
  const int64_t* d = ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t real = counts != nullptr ? counts[b] : nodes;
    if (real < 1 || real > nodes || p[b * nodes] != -1) return false;
    for (int64_t i = 1; i < real; ++i) {
      const int64_t up = p[b * nodes + i], id = d[b * nodes + i];
      if (up < 0 || up >= i || id < 0 || id >= vocab) return false;
    }
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_verify_chain_packed(
    const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
    const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& draft_logits,
    const at::Tensor& cu_num_draft_tokens, int64_t max_draft_tokens,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const std::optional<at::Tensor>& min_p, const std::optional<at::Tensor>& token_bitmask,
    const at::Tensor& seed, const at::Tensor& offset, int64_t method, int64_t logprobs,
    const std::optional<at::Tensor>& draft_slots,
    const std::optional<at::Tensor>& draft_temperature) {
  TORCH_CHECK(target_logits.dim() == 2 && draft_token_ids.dim() == 1,
              "packed: target_logits [T+B, V], draft_token_ids [T]");
  const PackedRows layout = packed_rows(cu_num_draft_tokens, draft_token_ids.size(0),
                                        max_draft_tokens, target_logits);
  const int64_t batch = cu_num_draft_tokens.size(0) - 1;
  return run_chain(target_logits, draft_token_ids, draft_probs, draft_logits, &layout, batch,
                   max_draft_tokens, layout.counts, temperature, top_k, top_p, min_p,
                   token_bitmask, seed, offset, method, logprobs, draft_slots, draft_temperature);
}

std::tuple<at::Tensor, at::Tensor> cpu_sample(
    const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
    const at::Tensor& top_p, const std::optional<at::Tensor>& min_p,
    const std::optional<at::Tensor>& token_bitmask, const at::Tensor& seed,
    const at::Tensor& offset, int64_t logprobs_kind) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1, "logits must be [B, V], got ",
              logits.sizes());
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  check_cpu(logits, "logits", {batch, vocab});
  const at::Tensor x = logits.contiguous();
  const Params params = params_of(batch, temperature, top_k, top_p, min_p, seed, offset);
  cpu::SampleArgs args;
  args.batch = batch;
  at::Tensor bitmask;
  set_logits(args, x, vocab, bitmask_of(token_bitmask, {batch}, vocab, bitmask), params);
  args.logprobs_kind = logprobs_of(logprobs_kind);
  at::Tensor tokens = at::empty({batch}, x.options().dtype(at::kInt));
  at::Tensor logprobs = logprobs_tensor(args.logprobs_kind, {batch}, x);
  args.tokens = tokens.data_ptr<int32_t>();
  args.logprobs = logprobs.numel() ? logprobs.data_ptr<float>() : nullptr;
  for_requests(batch, grain(1, vocab),
                   [&](int64_t begin, int64_t end) { cpu::sample(args, begin, end); });
  return {tokens, logprobs};
}

// verify_tree (method 0 token, 1 traversal): target [B, N, V], ids / parents [B, N] (any values: nodes that
// are not part of a tree are skipped, never read past), draft_probs [B, N, V] or none.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cpu_verify_tree(
    const at::Tensor& target_logits, const at::Tensor& tree_token_ids, const at::Tensor& parents,
    const std::optional<at::Tensor>& draft_probs, int64_t without_replacement,
    const at::Tensor& num_nodes, const at::Tensor& temperature, const at::Tensor& top_k,
    const at::Tensor& top_p, const std::optional<at::Tensor>& min_p,
    const std::optional<at::Tensor>& token_bitmask, const at::Tensor& seed,
    const at::Tensor& offset, int64_t method, int64_t logprobs_kind) {
  TORCH_CHECK(target_logits.dim() == 3 && target_logits.size(1) >= 1 &&
                  target_logits.size(2) >= 1,
              "target_logits must be [B, N, V], got ", target_logits.sizes());
  const int64_t batch = target_logits.size(0), nodes = target_logits.size(1),
                vocab = target_logits.size(2);
  check_cpu(target_logits, "target_logits", target_logits.sizes());
  check_cpu(tree_token_ids, "tree_token_ids", {batch, nodes});
  check_cpu(parents, "parents", {batch, nodes});
  const at::Tensor target = target_logits.contiguous();
  const at::Tensor ids = as_type(tree_token_ids, at::kLong);
  const at::Tensor par = as_type(parents, at::kLong);
  const at::Tensor live = small(num_nodes, "num_nodes", batch, at::kInt);
  const Params params = params_of(batch, temperature, top_k, top_p, min_p, seed, offset);
  cpu::TreeArgs args;
  args.batch = batch;
  args.num_nodes = nodes;
  args.vocab = vocab;
  args.target = target.data_ptr();
  args.target_dtype = dtype_of(target, "target_logits");
  at::Tensor bitmask, probs;
  args.bitmask = bitmask_of(token_bitmask, {batch, nodes}, vocab, bitmask);
  args.tree_token_ids = ids.data_ptr<int64_t>();
  args.parents = par.data_ptr<int64_t>();
  args.live_nodes = live.data_ptr<int32_t>();
  if (draft_probs.has_value()) {
    check_cpu(*draft_probs, "draft_probs", {batch, nodes, vocab});
    probs = draft_probs->contiguous();
    args.draft_probs = probs.data_ptr();
    args.draft_probs_dtype = dtype_of(probs, "draft_probs");
  }
  args.draft_sampling = without_replacement ? cpu::DraftSampling::kWithoutReplacement
                                            : cpu::DraftSampling::kIid;
  TORCH_CHECK(method == 0 || (method == 1 && draft_probs.has_value()),
              "method must be 0 (token) or 1 (traversal, with draft_probs)");
  args.method = static_cast<cpu::TreeMethod>(method);
  args.params = params.view();
  args.logprobs_kind = logprobs_of(logprobs_kind);
  at::Tensor out = at::empty({batch, nodes}, target.options().dtype(at::kInt));
  at::Tensor path = at::empty({batch, nodes}, target.options().dtype(at::kInt));
  at::Tensor accepted = at::empty({batch}, target.options().dtype(at::kInt));
  at::Tensor logprobs = logprobs_tensor(args.logprobs_kind, {batch, nodes}, target);
  args.output_token_ids = out.data_ptr<int32_t>();
  args.accepted_nodes = path.data_ptr<int32_t>();
  args.num_accepted = accepted.data_ptr<int32_t>();
  args.logprobs = logprobs.numel() ? logprobs.data_ptr<float>() : nullptr;
  for_requests(batch, grain(nodes, vocab),
                   [&](int64_t begin, int64_t end) { cpu::verify_tree(args, begin, end); });
  return {out, path, accepted, logprobs};
}

// logits [R, V] with R = B * rows_per_request (the caller flattens [B, ..., V]).
at::Tensor cpu_processed_probs(const at::Tensor& logits, const at::Tensor& temperature,
                               const at::Tensor& top_k, const at::Tensor& top_p,
                               const std::optional<at::Tensor>& min_p,
                               const std::optional<at::Tensor>& token_bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1, "logits must be [R, V], got ",
              logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1), batch = temperature.numel();
  TORCH_CHECK(batch >= 1 && rows % batch == 0, "logits rows must be a multiple of B");
  check_cpu(logits, "logits", {rows, vocab});
  const at::Tensor x = logits.contiguous();
  const at::Tensor zeros = at::zeros({batch}, x.options().dtype(at::kLong));
  const Params params = params_of(batch, temperature, top_k, top_p, min_p, zeros, zeros);
  cpu::ProbsArgs args;
  args.rows = rows;
  args.rows_per_request = rows / batch;
  at::Tensor bitmask;
  set_logits(args, x, vocab, bitmask_of(token_bitmask, {rows}, vocab, bitmask), params);
  at::Tensor probs = at::empty({rows, vocab}, x.options().dtype(at::kFloat));
  args.probs = probs.data_ptr<float>();
  for_requests(rows, grain(1, vocab),
                   [&](int64_t begin, int64_t end) { cpu::processed_probs(args, begin, end); });
  return probs;
}

// Word index % 4 of counter index / 4 of each element's stream, its uniform and its noise
// (int64 words, float32 uniforms and noise): the tests' hook and the FlashInfer adapter's
// acceptance uniforms on CPU (_cpu.uniform).
std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_random_words(
    const at::Tensor& seed, const at::Tensor& offset, const at::Tensor& position,
    int64_t purpose, const at::Tensor& index) {
  const int64_t count = seed.numel();
  const at::Tensor s = small(seed, "seed", count, at::kLong);
  const at::Tensor o = small(offset, "offset", count, at::kLong);
  const at::Tensor p = small(position, "position", count, at::kLong);
  const at::Tensor i = small(index, "index", count, at::kLong);
  at::Tensor words = at::empty({count}, s.options());
  at::Tensor uniform = at::empty({count}, s.options().dtype(at::kFloat));
  at::Tensor noise = at::empty({count}, s.options().dtype(at::kFloat));
  const int64_t *sp = s.data_ptr<int64_t>(), *op = o.data_ptr<int64_t>(),
                *pp = p.data_ptr<int64_t>(), *ip = i.data_ptr<int64_t>();
  int64_t* wp = words.data_ptr<int64_t>();
  float *up = uniform.data_ptr<float>(), *np = noise.data_ptr<float>();
  for (int64_t e = 0; e < count; ++e) {
    const uint32_t word = cpu::random_word(sp[e], op[e], static_cast<uint32_t>(pp[e]),
                                           static_cast<uint32_t>(purpose),
                                           static_cast<uint32_t>(ip[e]));
    wp[e] = word;
    up[e] = cpu::word_uniform(word);
    np[e] = cpu::uniform_noise(up[e]);
  }
  return {words, uniform, noise};
}

// The instruction-set build the CPU ops run (""), or switch to `isa` first ("baseline",
// "avx2", "avx512"; an error for one this processor cannot run). Returns the build in effect.
std::string cpu_isa(c10::string_view isa) {
  if (!isa.empty()) {
    const std::string name(isa);
    TORCH_CHECK(cpu::set_isa(name.c_str()), "SPECDEC_CPU_ISA / cpu_isa: '", name,
                "' is not a build this processor runs (baseline, avx2, avx512)");
  }
  return cpu::isa();
}

// Whether this processor runs the build `isa` (nothing changes).
bool cpu_isa_supported(c10::string_view isa) {
  return cpu::isa_supported(std::string(isa).c_str());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def(
      "cpu_verify_chain(Tensor target_logits, Tensor draft_token_ids, Tensor? draft_probs, "
      "Tensor? draft_logits, Tensor num_draft_tokens, Tensor temperature, Tensor top_k, "
      "Tensor top_p, Tensor? min_p, Tensor? token_bitmask, Tensor seed, Tensor offset, "
      "int method, int logprobs, Tensor? draft_slots=None, Tensor? draft_temperature=None) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "cpu_verify_chain_packed(Tensor target_logits, Tensor draft_token_ids, Tensor? draft_probs, "
      "Tensor? draft_logits, Tensor cu_num_draft_tokens, int max_draft_tokens, "
      "Tensor temperature, Tensor top_k, Tensor top_p, Tensor? min_p, Tensor? token_bitmask, "
      "Tensor seed, Tensor offset, int method, int logprobs, Tensor? draft_slots=None, "
      "Tensor? draft_temperature=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "cpu_packed_layout_ok(Tensor cu_num_draft_tokens, Tensor draft_token_ids, "
      "int max_draft_tokens, int vocab) -> bool");
  m.def(
      "cpu_tree_ok(Tensor parents, Tensor? num_nodes, Tensor tree_token_ids, int vocab) -> bool");
  m.def(
      "cpu_sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor? min_p, "
      "Tensor? token_bitmask, Tensor seed, Tensor offset, int logprobs) -> (Tensor, Tensor)");
  m.def(
      "cpu_verify_tree(Tensor target_logits, Tensor tree_token_ids, Tensor parents, "
      "Tensor? draft_probs, int without_replacement, Tensor num_nodes, Tensor temperature, "
      "Tensor top_k, Tensor top_p, Tensor? min_p, Tensor? token_bitmask, Tensor seed, "
      "Tensor offset, int method, int logprobs) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "cpu_processed_probs(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
      "Tensor? min_p, Tensor? token_bitmask) -> Tensor");
  m.def(
      "cpu_random_words(Tensor seed, Tensor offset, Tensor position, int purpose, Tensor index) "
      "-> (Tensor, Tensor, Tensor)");
  m.def("cpu_isa(str isa) -> str", &cpu_isa);  // no tensor argument: catch-all kernels
  m.def("cpu_isa_supported(str isa) -> bool", &cpu_isa_supported);
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("cpu_verify_chain", &cpu_verify_chain);
  m.impl("cpu_verify_chain_packed", &cpu_verify_chain_packed);
  m.impl("cpu_packed_layout_ok", &cpu_packed_layout_ok);
  m.impl("cpu_tree_ok", &cpu_tree_ok);
  m.impl("cpu_sample", &cpu_sample);
  m.impl("cpu_verify_tree", &cpu_verify_tree);
  m.impl("cpu_processed_probs", &cpu_processed_probs);
  m.impl("cpu_random_words", &cpu_random_words);
}

}  // namespace torch_ops
}  // namespace specdec
