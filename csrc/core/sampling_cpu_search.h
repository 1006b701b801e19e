// The threshold search of top-k and top-p: a radix search over keys (histograms, no sort).
// Part of the CPU sampling path's bodies (sampling_cpu_body.h includes the parts in order,
// inside namespace SPECDEC_ISA of each instruction-set build). Not a public header.

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

// scratch.keys / scratch.weights [0, V) hold every token's key and weight (0 outside the
// domain). The largest key t with sum(weight of key >= t) >= target, i.e. the value of the
// threshold token; false when the whole domain does not reach the target. With
// `target_fraction` > 0 the target is that fraction of the domain's total (top-p).
SPECDEC_INLINE bool search_threshold(Scratch& scratch, int64_t vocab, double target,
                                     double target_fraction, uint32_t& threshold_key) {
  uint32_t* keys = scratch.keys.data();
  float* weights = scratch.weights.data();
  scratch.hist.assign(2 * 2048, 0.0);
  double* hist[2] = {scratch.hist.data(), scratch.hist.data() + 2048};
  int64_t i = 0;
  for (; i + 2 <= vocab; i += 2) {  // two histograms: no store-to-load chain on one bin
    hist[0][keys[i] >> 21] += weights[i];
    hist[1][keys[i + 1] >> 21] += weights[i + 1];
  }
  if (i < vocab) hist[0][keys[i] >> 21] += weights[i];
  double total = 0.0;
  for (uint32_t bin = 0; bin < 2048; ++bin) {
    hist[0][bin] += hist[1][bin];
    total += hist[0][bin];
  }
  if (target_fraction > 0.0) target = target_fraction * total;
  double above = 0.0;
  const int top = walk_bins(hist[0], 2048, target, above);
  if (top < 0) return false;
  // The candidates: the tokens of that bin with a weight, in their own buffers (keys and
  // weights stay as they are: the caller sums the kept weights from them).
  if (scratch.candidate_keys.size() < static_cast<size_t>(vocab)) {
    scratch.candidate_keys.resize(vocab);
    scratch.candidate_weights.resize(vocab);
  }
  const uint32_t* all_keys = keys;
  const float* all_weights = weights;
  keys = scratch.candidate_keys.data();
  weights = scratch.candidate_weights.data();
  // Branch-free compaction (store always, advance on a match): a bin holds a few percent of
  // the tokens, scattered, and a branch on it mispredicts.
  int64_t count = 0;
  int64_t j = 0;
#if defined(SPECDEC_AVX512)
  // AVX-512: 16 tokens a step, the matches compressed in a register and stored whole (count
  // + 16 <= j + 16 <= vocab: in bounds; slots past count are overwritten or never read). A
  // register compress, not the compress-store, which is microcoded on some processors.
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
#endif
  for (; j < vocab; ++j) {
    keys[count] = all_keys[j];
    weights[count] = all_weights[j];
    count += ((all_keys[j] >> 21) == static_cast<uint32_t>(top)) & (all_weights[j] > 0.0f);
  }
  uint32_t key = static_cast<uint32_t>(top) << 21;
  for (int level = 1; level < 3; ++level) {
    const uint32_t bins = kLevelBins[level];
    const int shift = kLevelShift[level];
    for (uint32_t bin = 0; bin < bins; ++bin) hist[0][bin] = 0.0;
    for (int64_t j = 0; j < count; ++j) hist[0][(keys[j] >> shift) & (bins - 1)] += weights[j];
    int bin = walk_bins(hist[0], bins, target, above);
    const bool keep_all = bin < 0;  // the bin reached the target, its parts in another order
    if (keep_all) {                 // did not: keep it all
      bin = 0;
      while (hist[0][bin] == 0.0 && bin + 1 < static_cast<int>(bins)) ++bin;
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

// Fills scratch with keys and weights over the domain (finite, x / T >= z_lo): e, or 1 for a
// count.
template <bool Mass, bool Unit = false, bool Clean = false, class R>
SPECDEC_INLINE void fill_candidates(const R& row, const Keep& keep, Scratch& scratch) {
  uint32_t* keys = scratch.keys.data();
  float* weights = scratch.weights.data();
  for (int64_t i = 0; i < row.vocab; ++i) {
    const float x = row(i);
    keys[i] = sort_key(x);
    const float value = Mass ? keep.e_of<Unit, Clean>(x) : (x > -kInf ? 1.0f : 0.0f);  // e(-inf) = 0
    weights[i] = x >= keep.x_lo ? value : 0.0f;
  }
}
