// The threshold search of top-k and top-p: a radix search over keys (histograms, no sort).
// A part of the CPU sampling path's bodies: see sampling_cpu_body.h. Not a public header.
#ifndef SPECDEC_CPU_PART_SEARCH
#define SPECDEC_CPU_PART_SEARCH
#include "sampling_cpu_rows.h"

// ---- the threshold search (radix over keys, no sort) ----
// Levels of the key: bits 31..21, 20..10, 9..0.
constexpr int kLevelShift[3] = {21, 10, 0};
constexpr uint32_t kLevelBins[3] = {2048, 2048, 1024};

// From the top bin down: the first non-empty bin where the running total reaches `target`;
// adds the bins above it to `above`. -1 when the total never reaches it. (Non-empty: a target
// of 0, a top_p that rounds to 0 in float32, finds the largest key, as the reference keeps
// the largest probability and its ties; for a positive target the first bin reaching it is
// never empty.)
SPECDEC_INLINE int walk_bins(const double* hist, uint32_t bins, double target, double& above) {
  for (int bin = static_cast<int>(bins) - 1; bin >= 0; --bin) {
    if (hist[bin] > 0.0 && above + hist[bin] >= target) return bin;
    above += hist[bin];
  }
  return -1;
}

// The sum of n weights in double: 16 per-lane sums in a fixed order (the same on every build).
SPECDEC_INLINE double double_sum(const float* weights, int64_t n) {
  double lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lane[l] += static_cast<double>(weights[i + l]);
  }
  double total = 0.0;
  for (; i < n; ++i) total += static_cast<double>(weights[i]);
  for (int l = 0; l < kLanes; ++l) total += lane[l];
  return total;
}

// The first level: the 2048 bins of key >> 21, token i (id index[i], or i when index is null)
// into the histogram of its id's parity (two histograms: no store-to-load chain on one bin),
// walked from the top to `target` (walk_bins: the bin, -1 when never reached; `above`, the
// mass of the bins over it).
SPECDEC_INLINE int first_level(Scratch& scratch, const uint32_t* keys, const float* weights,
                               int64_t n, const uint32_t* index, double target, double& above) {
  scratch.hist.assign(2 * 2048, 0.0);
  double* hist = scratch.hist.data();
  if (index == nullptr) {
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
      hist[keys[i] >> 21] += weights[i];
      hist[2048 + (keys[i + 1] >> 21)] += weights[i + 1];
    }
    if (i < n) hist[keys[i] >> 21] += weights[i];
  } else {
    for (int64_t i = 0; i < n; ++i) hist[(index[i] & 1u) << 11 | keys[i] >> 21] += weights[i];
  }
  for (uint32_t bin = 0; bin < 2048; ++bin) hist[bin] += hist[2048 + bin];
  above = 0.0;
  return walk_bins(hist, 2048, target, above);
}

#if defined(SPECDEC_AVX512) || defined(SPECDEC_AVX2)
#if !defined(SPECDEC_AVX512)
// Lane indices that move the lanes set in an 8-bit mask to the front, in order: AVX2's
// stand-in for AVX-512's register compress.
struct CompressTable {
  alignas(32) int32_t index[256][8];
  CompressTable() {
    for (int mask = 0; mask < 256; ++mask) {
      int n = 0;
      for (int lane = 0; lane < 8; ++lane) {
        if (mask >> lane & 1) index[mask][n++] = lane;
      }
      while (n < 8) index[mask][n++] = 0;
    }
  }
};
SPECDEC_INLINE const CompressTable& compress_table() {
  static const CompressTable table;
  return table;
}
#endif

// The tokens with key >= key_floor, in order, into out_keys / out_weights / out_index (their
// ids); the count. Whole-vector stores at the count (count <= j: in bounds; slots past the
// count are overwritten or never read).
SPECDEC_INLINE int64_t keep_from_key(const uint32_t* keys, const float* weights, int64_t n,
                                     uint32_t key_floor, uint32_t* out_keys,
                                     float* out_weights, uint32_t* out_index) {
  int64_t count = 0, j = 0;
#if defined(SPECDEC_AVX512)
  const __m512i floor16 = _mm512_set1_epi32(static_cast<int32_t>(key_floor));
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j + 16 <= n; j += 16) {
    const __m512i k = _mm512_loadu_si512(keys + j);
    const __mmask16 keep = _mm512_cmpge_epu32_mask(k, floor16);
    const __m512i ids = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(j)));
    _mm512_storeu_si512(out_keys + count, _mm512_maskz_compress_epi32(keep, k));
    _mm512_storeu_ps(out_weights + count,
                     _mm512_maskz_compress_ps(keep, _mm512_loadu_ps(weights + j)));
    _mm512_storeu_si512(out_index + count, _mm512_maskz_compress_epi32(keep, ids));
    count += __builtin_popcount(keep);
  }
#else
  const CompressTable& table = compress_table();
  const __m256i floor8 = _mm256_set1_epi32(static_cast<int32_t>(key_floor));
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; j + 8 <= n; j += 8) {
    const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + j));
    const __m256i keep = _mm256_cmpeq_epi32(_mm256_max_epu32(k, floor8), k);  // k >= floor
    const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(keep));
    const __m256i move = _mm256_load_si256(reinterpret_cast<const __m256i*>(table.index[mask]));
    const __m256i ids = _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int32_t>(j)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_keys + count),
                        _mm256_permutevar8x32_epi32(k, move));
    _mm256_storeu_ps(out_weights + count,
                     _mm256_permutevar8x32_ps(_mm256_loadu_ps(weights + j), move));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_index + count),
                        _mm256_permutevar8x32_epi32(ids, move));
    count += __builtin_popcount(mask);
  }
#endif
  for (; j < n; ++j) {  // branch-free: store always, advance on a match
    out_keys[count] = keys[j];
    out_weights[count] = weights[j];
    out_index[count] = static_cast<uint32_t>(j);
    count += keys[j] >= key_floor;
  }
  return count;
}
#endif

// scratch.keys / scratch.weights [0, V) hold every token's key and weight (0 outside the
// domain). The largest key t with sum(weight of key >= t) >= target, i.e. the value of the
// threshold token; false when the whole domain does not reach the target. With
// `target_fraction` > 0 the target is that fraction of the domain's total (top-p), in double,
// and `floor_key(e)` is a key below which tokens have about that e at most (a hint).
// (search_threshold, below, takes this for rows of more than kSmallSearch tokens.)
template <class FloorKey>
SPECDEC_INLINE bool histogram_search(Scratch& scratch, int64_t vocab, double target,
                                     double target_fraction, const FloorKey& floor_key,
                                     uint32_t& threshold_key) {
  const uint32_t* all_keys = scratch.keys.data();
  const float* all_weights = scratch.weights.data();
  uint32_t* keys = grow(scratch.candidate_keys, vocab);
  float* weights = grow(scratch.candidate_weights, vocab);
  double above = 0.0;
  int top = -1;
  bool searched = false;
  if (target_fraction > 0.0) {
    const double total = double_sum(all_weights, vocab);
    target = target_fraction * total;
#if defined(SPECDEC_AVX512) || defined(SPECDEC_AVX2)
    // Top-p in the vector builds: the first level over the tokens of the bins from that of
    // the key of e = (1 - top_p) * total / (2 V) up, whose sums are the full level's (the
    // same tokens, each into its id's histogram). When the walk ends among them the answer
    // is the full search's (the bins above are the same); else the full level runs. The
    // other builds run the full level: the same answer.
    const uint32_t key_floor = floor_key(static_cast<float>(
        0.5 * (1.0 - target_fraction) * total / static_cast<double>(vocab))) & ~0x1FFFFFu;
    uint32_t* index = grow(scratch.candidate_index, vocab);
    const int64_t kept = keep_from_key(all_keys, all_weights, vocab, key_floor, keys, weights,
                                       index);
    top = first_level(scratch, keys, weights, kept, index, target, above);
    if (top >= 0) {
      all_keys = keys;  // the candidates below come from the kept tokens, in place
      all_weights = weights;
      vocab = kept;
      searched = true;
    }
#else
    (void)floor_key;
#endif
  }
  if (!searched) {
    top = first_level(scratch, all_keys, all_weights, vocab, nullptr, target, above);
  }
  if (top < 0) return false;
  // The candidates: the tokens of that bin with a weight, in their own buffers (keys and
  // weights stay as they are: the caller sums the kept weights from them).
  // Branch-free compaction (store always, advance on a match): a bin holds a few percent of
  // the tokens, scattered, and a branch on it mispredicts.
  int64_t count = 0;
  int64_t j = 0;
#if defined(SPECDEC_AVX512)
  // AVX-512: 16 tokens a step, the matches compressed in a register and stored whole (count
  // + 16 <= j + 16 <= vocab: in bounds; slots past count are overwritten or never read; in
  // place when the source is the kept tokens: the store is after the load). A register
  // compress, not the compress-store, which is microcoded on some processors.
  const __m512i top_bin = _mm512_set1_epi32(top);
  for (; j + 16 <= vocab; j += 16) {
    const __m512i k = _mm512_loadu_si512(all_keys + j);
    const __m512 w = _mm512_loadu_ps(all_weights + j);
    const __mmask16 match = _mm512_cmpeq_epi32_mask(_mm512_srli_epi32(k, 21), top_bin) &
                            _mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_GT_OQ);
    _mm512_storeu_si512(keys + count, _mm512_maskz_compress_epi32(match, k));
    _mm512_storeu_ps(weights + count, _mm512_maskz_compress_ps(match, w));
    count += __builtin_popcount(match);
  }
#elif defined(SPECDEC_AVX2)
  // AVX2: the same, 8 tokens a step, by a permute from the compress table.
  const CompressTable& table = compress_table();
  const __m256i top_bin = _mm256_set1_epi32(top);
  for (; j + 8 <= vocab; j += 8) {
    const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(all_keys + j));
    const __m256 w = _mm256_loadu_ps(all_weights + j);
    const __m256 match = _mm256_and_ps(
        _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_srli_epi32(k, 21), top_bin)),
        _mm256_cmp_ps(w, _mm256_setzero_ps(), _CMP_GT_OQ));
    const int mask = _mm256_movemask_ps(match);
    const __m256i move = _mm256_load_si256(reinterpret_cast<const __m256i*>(table.index[mask]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(keys + count),
                        _mm256_permutevar8x32_epi32(k, move));
    _mm256_storeu_ps(weights + count, _mm256_permutevar8x32_ps(w, move));
    count += __builtin_popcount(mask);
  }
#endif
  for (; j < vocab; ++j) {
    const uint32_t k = all_keys[j];  // (read before the store: the source may be keys)
    const float w = all_weights[j];
    keys[count] = k;
    weights[count] = w;
    count += ((k >> 21) == static_cast<uint32_t>(top)) & (w > 0.0f);
  }
  double* hist = scratch.hist.data();
  uint32_t key = static_cast<uint32_t>(top) << 21;
  for (int level = 1; level < 3; ++level) {
    const uint32_t bins = kLevelBins[level];
    const int shift = kLevelShift[level];
    for (uint32_t bin = 0; bin < bins; ++bin) hist[bin] = 0.0;
    for (int64_t j = 0; j < count; ++j) hist[(keys[j] >> shift) & (bins - 1)] += weights[j];
    int bin = walk_bins(hist, bins, target, above);
    const bool keep_all = bin < 0;  // the bin reached the target, its parts in another order
    if (keep_all) {                 // did not: keep it all
      bin = 0;
      while (hist[bin] == 0.0 && bin + 1 < static_cast<int>(bins)) ++bin;
    }
    key |= static_cast<uint32_t>(bin) << shift;
    int64_t kept = 0;
    for (int64_t j = 0; j < count; ++j) {  // branch-free, as above (kept <= j)
      const uint32_t k = keys[j];
      const float w = weights[j];
      keys[kept] = k;
      weights[kept] = w;
      kept += ((k >> shift) & (bins - 1)) == static_cast<uint32_t>(bin);
    }
    count = kept;
    if (keep_all) {  // keep the whole bin: its lowest key
      uint32_t lowest = 0xFFFFFFFFu;
      for (int64_t j = 0; j < count; ++j) lowest = keys[j] < lowest ? keys[j] : lowest;
      threshold_key = lowest;
      return true;
    }
  }
  threshold_key = key;
  return true;
}

// ---- rows of a few tokens: the same search without the histograms ----
// Zeroing and walking the 2048-bin levels costs microseconds whatever the row, most of a
// small row's time. A bin's sum here is formed from its positive weights alone, in id order,
// and the bins are visited from the top: the histograms' sums in the histograms' order (a
// zero weight adds nothing; an empty bin moves neither the walk nor `above`), so the same
// threshold, bit for bit (test_sampling_cpu checks it against histogram_search).
constexpr int64_t kSmallSearch = 64;

// The largest bin (key >> shift & mask) below `below` among n keys; -1 when there is none.
SPECDEC_INLINE int64_t next_bin(const uint32_t* keys, int64_t n, int shift, uint32_t mask,
                                int64_t below) {
  int64_t best = -1;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t bin = (keys[j] >> shift) & mask;
    best = bin < below && bin > best ? bin : best;
  }
  return best;
}

// walk_bins over the bins of n tokens (positive weights, in id order): the bin, or -1;
// `above` as walk_bins leaves it. With ids (the first level), a bin's sum is that of its
// even ids plus that of its odd ids, as first_level's two histograms give it.
SPECDEC_INLINE int64_t small_walk(const uint32_t* keys, const float* weights,
                                  const uint32_t* ids, int64_t n, int shift, uint32_t mask,
                                  double target, double& above) {
  for (int64_t bin = next_bin(keys, n, shift, mask, int64_t{mask} + 1); bin >= 0;
       bin = next_bin(keys, n, shift, mask, bin)) {
    double even = 0.0, odd = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      if (((keys[j] >> shift) & mask) != static_cast<uint32_t>(bin)) continue;
      if (ids != nullptr && (ids[j] & 1u)) {
        odd += weights[j];
      } else {
        even += weights[j];
      }
    }
    const double sum = ids != nullptr ? even + odd : even;
    if (sum > 0.0 && above + sum >= target) return bin;
    above += sum;
  }
  return -1;
}

// The lowest bin among n keys (mask, the last bin, when there is none: histogram_search's
// keep-all bin of an empty level).
SPECDEC_INLINE uint32_t lowest_bin(const uint32_t* keys, int64_t n, int shift, uint32_t mask) {
  uint32_t lowest = mask;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t bin = (keys[j] >> shift) & mask;
    lowest = bin < lowest ? bin : lowest;
  }
  return lowest;
}

// histogram_search's answer for a row of at most kSmallSearch tokens (the target final).
SPECDEC_INLINE bool small_search(const uint32_t* all_keys, const float* all_weights,
                                 int64_t vocab, double target, uint32_t& threshold_key) {
  uint32_t keys[kSmallSearch], ids[kSmallSearch];
  float weights[kSmallSearch];
  int64_t n = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!(all_weights[i] > 0.0f)) continue;
    keys[n] = all_keys[i];
    weights[n] = all_weights[i];
    ids[n++] = static_cast<uint32_t>(i);
  }
  double above = 0.0;
  uint32_t key = 0;
  for (int level = 0; level < 3; ++level) {
    const int shift = kLevelShift[level];
    const uint32_t mask = kLevelBins[level] - 1;
    const int64_t found = small_walk(keys, weights, level == 0 ? ids : nullptr, n, shift, mask,
                                     target, above);
    if (found < 0 && level == 0) return false;  // the domain does not reach the target
    const bool keep_all = found < 0;  // as histogram_search: the lowest bin, all of it
    const uint32_t bin = keep_all ? lowest_bin(keys, n, shift, mask) : static_cast<uint32_t>(found);
    key |= bin << shift;
    int64_t kept = 0;  // the bin's tokens, in order
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t k = keys[j];
      const float w = weights[j];
      keys[kept] = k;
      weights[kept] = w;
      kept += ((k >> shift) & mask) == bin;
    }
    n = kept;
    if (keep_all) {
      uint32_t lowest = 0xFFFFFFFFu;
      for (int64_t j = 0; j < n; ++j) lowest = keys[j] < lowest ? keys[j] : lowest;
      threshold_key = lowest;
      return true;
    }
  }
  threshold_key = key;
  return true;
}

// The threshold search: histogram_search, or small_search (the same answer) for a row of at
// most kSmallSearch tokens.
template <class FloorKey>
SPECDEC_INLINE bool search_threshold(Scratch& scratch, int64_t vocab, double target,
                                     double target_fraction, const FloorKey& floor_key,
                                     uint32_t& threshold_key) {
  if (vocab > kSmallSearch) {
    return histogram_search(scratch, vocab, target, target_fraction, floor_key, threshold_key);
  }
  const float* weights = scratch.weights.data();
  if (target_fraction > 0.0) target = target_fraction * double_sum(weights, vocab);
  return small_search(scratch.keys.data(), weights, vocab, target, threshold_key);
}

// Fills scratch with keys and weights over the domain (finite, x / T >= z_lo): e, or 1 for a
// count.
template <bool Mass, bool Unit = false, bool Clean = false, class R>
SPECDEC_INLINE void fill_candidates(const R& row, const Keep& keep, Scratch& scratch) {
  uint32_t* keys = scratch.keys.data();
  float* weights = scratch.weights.data();
  for (int64_t i = 0; i < row.vocab; ++i) {
    const float x = row(i);
    keys[i] = sort_key(x);
    // (e(-inf) = 0)
    const float value = Mass ? keep.e_of<Unit, Clean>(x) : (x > -kInf ? 1.0f : 0.0f);
    weights[i] = x >= keep.x_lo ? value : 0.0f;
  }
}

#endif  // SPECDEC_CPU_PART_SEARCH
