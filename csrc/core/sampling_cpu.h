// The CPU path of sample / verify_chain / processed_probs (torch-free): the reference's
// definition (specdec_kernels/reference/) computed row by row, in the logits' own dtype.
//
// A processed row is described by a few numbers (RowStats): x_max, argmax, the z-threshold
// z_lo of top-k and min-p (z = x / T), the e-threshold e_tau of top-p (e = exp((x - x_max)/T))
// and norm = sum of the kept e; p_i = e_i / norm on kept tokens. The thresholds are values of
// the row found by a radix search over order-preserving keys (histograms, no sort). The race is
// the two-level exponential race of _rng.py on the same Philox-4x32-10 words.
#pragma once

#include <cstdint>
#include <vector>

namespace specdec {
namespace cpu {

// ---- randomness (specdec_kernels/_rng.py) ----
constexpr uint32_t kPurposeAccept = 0, kPurposeResample = 1, kPurposeSample = 2;
constexpr uint32_t kRaceGroup = 2048;
constexpr uint32_t kGroupIndexBase = 1u << 31;

struct Words {
  uint32_t w[4];
};
// Philox-4x32-10 of counter (c0..c3) and key (k0, k1).
Words philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1);
// Word index % 4 of counter index / 4 of the stream (seed, offset, position, purpose).
uint32_t random_word(int64_t seed, int64_t offset, uint32_t position, uint32_t purpose,
                     uint32_t index);
// float32 min(max(rn(word), 1/2), 2**32 - 256) * 2**-32.
float word_uniform(uint32_t word);
// -log1p(-u) by Goldberg's formula (u itself where 1 - u rounds to 1).
float uniform_noise(float u);

// ---- instruction-set builds ----
// The build the ops run: "baseline" (any processor; vectorised for what the compiler targets:
// SSE2 on x86-64, NEON on aarch64), "avx2" (AVX2 + FMA + BMI2 + F16C) or "avx512" (+ AVX-512
// F/BW/VL/DQ): at first use the best the processor has, or SPECDEC_CPU_ISA's value when the
// processor runs it. Every build gives the same tokens (the same float operations).
const char* isa();
bool isa_supported(const char* name);
// Switches every later call to that build (for tests and benchmarks); false, and no change,
// for a name that is unknown or that the processor cannot run.
bool set_isa(const char* name);

// ---- rows ----
enum class Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct Filters {
  float temperature = 1.0f;  // 0: greedy
  int32_t top_k = 0;         // 0 or >= V: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off
};

struct CachedRow;

struct RowStats {
  bool has_finite = false;
  bool greedy = false;
  float x_max = 0.0f;
  int64_t argmax = -1;  // lowest id among the largest logits
  float temperature = 1.0f;
  float z_lo = 0.0f;   // keep x / T >= z_lo (top-k, min-p; -inf: no cut)
  float x_lo = 0.0f;   // the same cut on x (x >= x_lo <=> x / T >= z_lo): no division per token
  float e_tau = 0.0f;  // keep e >= e_tau (top-p; 0: no cut)
  float norm = 1.0f;   // sum of the kept e
  // The kept e of every token as the norm pass wrote them (a slot of the worker's Scratch),
  // valid while the slot's generation is this one: the race reads them instead of a second
  // exp pass. Null from row_stats().
  const CachedRow* cache = nullptr;
  uint64_t cache_generation = 0;
};

// A row of V logits in its own dtype; bitmask (int32 words, bit v % 32 of word v / 32) or null.
struct RowView {
  const void* data = nullptr;
  Dtype dtype = Dtype::kFloat32;
  int64_t vocab = 0;
  const int32_t* bitmask = nullptr;
};

// A row of kept e written by the norm pass (generation: which statistics it belongs to).
struct CachedRow {
  std::vector<float> weights;
  uint64_t generation = 0;
};

// Scratch of one worker: the search's candidate list and two cached rows (a target and a
// draft row for the residual race); grows with V only.
struct Scratch {
  CachedRow cached[2];
  uint64_t generation = 0;
  std::vector<uint32_t> keys;
  std::vector<float> weights;
  std::vector<uint32_t> candidate_keys;  // the tokens of the search's bin
  std::vector<float> candidate_weights;
  std::vector<uint32_t> candidate_index;  // top-p's kept tokens' ids (vector builds)
  std::vector<double> hist;
};

RowStats row_stats(const RowView& row, const Filters& filters, Scratch& scratch);


// p_i of one token.
float row_prob(const RowView& row, const RowStats& stats, int64_t token);

// ---- ops: one call handles requests [begin, end) ----
struct RequestParams {
  const float* temperature;  // [B]
  const int32_t* top_k;      // [B]
  const float* top_p;        // [B]
  const float* min_p;        // [B] or null
  const int64_t* seed;       // [B]
  const int64_t* offset;     // [B]
  Filters filters(int64_t b) const {  // request b's filters
    return Filters{temperature[b], top_k[b], top_p[b], min_p != nullptr ? min_p[b] : 0.0f};
  }
};

// return_logprobs (contract section 9): float32 log p of each emitted token at its row, NaN
// where the token is -1. kProcessed: log processed_probs (0 on greedy rows), from the row's
// statistics; kRaw: log_softmax of the sanitised row (no bitmask, no filters).
enum class Logprobs : int { kNone = 0, kProcessed = 1, kRaw = 2 };

// How the accepted drafts are tested (contract sections 3 and 12).
enum class ChainMethod : int { kToken = 0, kBlock = 1 };

struct ChainArgs {
  int64_t batch = 0, num_drafts = 0, vocab = 0;  // target [B, K+1, V]
  const void* target = nullptr;
  Dtype target_dtype = Dtype::kFloat32;
  const int32_t* bitmask = nullptr;  // [B, K+1, W] or null
  const int64_t* draft_ids = nullptr;  // [B, K] (packed: [T])
  const int32_t* num_draft_tokens = nullptr;  // [B], clamped to 0..K
  const void* draft_probs = nullptr;  // [B, K, V] or null
  Dtype draft_probs_dtype = Dtype::kFloat32;
  const void* draft_logits = nullptr;  // [B, K, V] or null
  Dtype draft_logits_dtype = Dtype::kFloat32;
  RequestParams params{};
  // Packed layout (verify_chain_packed): the row of target position j of request b is
  // target_rows[b * (K+1) + j] (also the bitmask's row), its draft (id, probs/logits row)
  // draft_rows[b * K + j], read only for j < num_draft_tokens[b]. Null: the padded layout.
  const int64_t* target_rows = nullptr;
  const int64_t* draft_rows = nullptr;
  // Per-slot draft rows (draft_slots): the draft probs/logits row of draft j of request b
  // starts at element draft_slots[b] * draft_slot_stride + j * draft_position_stride (slots
  // in range, unit vocabulary stride); null: row draft_rows[b * K + j] (or b * K + j) of V.
  const int64_t* draft_slots = nullptr;
  int64_t draft_slot_stride = 0, draft_position_stride = 0;
  // draft_temperature [B] or null: the draft logits at that temperature with no filter
  // (0: one-hot at the row's arg-max) instead of the target's filters.
  const float* draft_temperature = nullptr;
  ChainMethod method = ChainMethod::kToken;
  Logprobs logprobs_kind = Logprobs::kNone;
  int32_t* output_token_ids = nullptr;  // [B, K+1]
  int32_t* num_accepted = nullptr;      // [B]
  float* logprobs = nullptr;            // [B, K+1] when logprobs_kind is set
};
void verify_chain(const ChainArgs& args, int64_t begin, int64_t end);

struct SampleArgs {
  int64_t batch = 0, vocab = 0;
  const void* logits = nullptr;
  Dtype dtype = Dtype::kFloat32;
  const int32_t* bitmask = nullptr;  // [B, W] or null
  RequestParams params{};
  Logprobs logprobs_kind = Logprobs::kNone;
  int32_t* tokens = nullptr;  // [B]
  float* logprobs = nullptr;  // [B] when logprobs_kind is set
};
void sample(const SampleArgs& args, int64_t begin, int64_t end);

// verify_tree, method "token" (contract section 4) or "traversal" (section 12). Node i of request b: target row
// b * N + i (and its bitmask row), draft_probs row b * N + i, token tree_token_ids[b * N + i],
// parent parents[b * N + i]. A node takes part when i < num_nodes[b] (clamped to 1..N),
// 0 <= parent < i and its id is in [0, V); others are ignored like padding (validate=False).
enum class DraftSampling : int { kIid = 0, kWithoutReplacement = 1 };
// kTraversal (contract section 12) needs draft_probs; its greedy requests take the token walk.
enum class TreeMethod : int { kToken = 0, kTraversal = 1 };
struct TreeArgs {
  int64_t batch = 0, num_nodes = 0, vocab = 0;  // target [B, N, V]
  const void* target = nullptr;
  Dtype target_dtype = Dtype::kFloat32;
  const int32_t* bitmask = nullptr;        // [B, N, W] or null
  const int64_t* tree_token_ids = nullptr;  // [B, N]
  const int64_t* parents = nullptr;         // [B, N]
  const int32_t* live_nodes = nullptr;      // [B]
  const void* draft_probs = nullptr;        // [B, N, V] or null: deterministic candidates
  Dtype draft_probs_dtype = Dtype::kFloat32;
  DraftSampling draft_sampling = DraftSampling::kIid;
  TreeMethod method = TreeMethod::kToken;
  RequestParams params{};
  Logprobs logprobs_kind = Logprobs::kNone;
  int32_t* output_token_ids = nullptr;  // [B, N]
  int32_t* accepted_nodes = nullptr;    // [B, N]
  int32_t* num_accepted = nullptr;      // [B]
  float* logprobs = nullptr;            // [B, N] when logprobs_kind is set
};
void verify_tree(const TreeArgs& args, int64_t begin, int64_t end);

// processed_probs of rows [begin, end) of logits [R, V]; row r uses request r / rows_per_request.
struct ProbsArgs {
  int64_t rows = 0, rows_per_request = 1, vocab = 0;
  const void* logits = nullptr;
  Dtype dtype = Dtype::kFloat32;
  const int32_t* bitmask = nullptr;  // [R, W] or null
  RequestParams params{};
  float* probs = nullptr;  // [R, V]
};
void processed_probs(const ProbsArgs& args, int64_t begin, int64_t end);

}  // namespace cpu
}  // namespace specdec
