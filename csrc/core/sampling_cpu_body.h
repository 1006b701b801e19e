// The bodies of the CPU sampling path (sampling_cpu.h), compiled once per instruction set:
// sampling_cpu.cpp (baseline x86-64 / any target) and sampling_cpu_avx512.cpp (AVX-512, chosen
// at run time). Included inside namespace SPECDEC_ISA; every helper is inline so that it is
// compiled with the including file's target. The streaming loops keep 16 accumulators (one
// per lane) so that the compiler vectorises them without reassociating a float sum.
//
// Not a public header: the including file has included <algorithm>, <cmath>, <cstdint>, <cstring>,
// <limits>, <type_traits>, <vector> and sampling_cpu.h.

#define SPECDEC_INLINE inline __attribute__((always_inline))
#define SPECDEC_INLINE_LAMBDA __attribute__((always_inline))

constexpr int kLanes = 16;
constexpr float kInf = std::numeric_limits<float>::infinity();

SPECDEC_INLINE float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}
SPECDEC_INLINE uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

// ---- randomness ----
SPECDEC_INLINE void philox_round(uint32_t c[4], uint32_t k0, uint32_t k1) {
  const uint64_t product0 = static_cast<uint64_t>(0xD2511F53u) * c[0];
  const uint64_t product1 = static_cast<uint64_t>(0xCD9E8D57u) * c[2];
  const uint32_t c1 = c[1], c3 = c[3];
  c[0] = static_cast<uint32_t>(product1 >> 32) ^ c1 ^ k0;
  c[1] = static_cast<uint32_t>(product1);
  c[2] = static_cast<uint32_t>(product0 >> 32) ^ c3 ^ k1;
  c[3] = static_cast<uint32_t>(product0);
}

SPECDEC_INLINE Words philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                            uint32_t k1) {
  uint32_t c[4] = {c0, c1, c2, c3};
  for (int round = 0; round < 10; ++round) {
    philox_round(c, k0, k1);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Words{{c[0], c[1], c[2], c[3]}};
}

// One request's stream: key = seed, counter = (index / 4, position | purpose << 16, offset).
struct Stream {
  uint32_t c1, c2, c3, k0, k1;
  Stream(int64_t seed, int64_t offset, uint32_t position, uint32_t purpose)
      : c1((position & 0xFFFFu) | (purpose << 16)),
        c2(static_cast<uint32_t>(static_cast<uint64_t>(offset))),
        c3(static_cast<uint32_t>(static_cast<uint64_t>(offset) >> 32)),
        k0(static_cast<uint32_t>(static_cast<uint64_t>(seed))),
        k1(static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32)) {}
  SPECDEC_INLINE Words counter(uint32_t c0) const { return philox(c0, c1, c2, c3, k0, k1); }
  SPECDEC_INLINE uint32_t word(uint32_t index) const { return counter(index >> 2).w[index & 3]; }
};

SPECDEC_INLINE float uniform_of(uint32_t word) {
  float value = static_cast<float>(word);  // IEEE round to nearest even
  value = value < 0.5f ? 0.5f : value;
  value = value > 4294967040.0f ? 4294967040.0f : value;  // 2**32 - 256
  return value * 2.3283064365386963e-10f;                  // 2**-32, exact
}

SPECDEC_INLINE float noise_of(float u) {
  const float y = 1.0f - u;
  if (y == 1.0f) return u;
  return -std::log(y) * (u / (1.0f - y));
}

// ---- element loads: NaN and +-inf read as -inf (never sampled) ----
SPECDEC_INLINE float sanitise(uint32_t bits) {
  return (bits & 0x7F800000u) == 0x7F800000u ? -kInf : bits_float(bits);
}
// IEEE half -> float for finite halves (normal and subnormal: one exact multiply by 2**112).
SPECDEC_INLINE float half_magnitude(uint32_t h) {
  return bits_float((h & 0x7FFFu) << 13) * 5.192296858534828e+33f;
}

template <Dtype D>
struct Elem;
template <>
struct Elem<Dtype::kFloat32> {
  using T = uint32_t;
  static SPECDEC_INLINE float logit(T v) { return sanitise(v); }
  static SPECDEC_INLINE float raw(T v) { return bits_float(v); }
};
template <>
struct Elem<Dtype::kBFloat16> {
  using T = uint16_t;
  static SPECDEC_INLINE float logit(T v) { return sanitise(static_cast<uint32_t>(v) << 16); }
  static SPECDEC_INLINE float raw(T v) { return bits_float(static_cast<uint32_t>(v) << 16); }
};
template <>
struct Elem<Dtype::kFloat16> {
  using T = uint16_t;
  static SPECDEC_INLINE float logit(T v) {
    const float magnitude = half_magnitude(v);
    const float value = (v & 0x8000u) ? -magnitude : magnitude;
    return (v & 0x7C00u) == 0x7C00u ? -kInf : value;
  }
  static SPECDEC_INLINE float raw(T v) {  // inf and NaN kept (draft_probs are not sanitised)
    const uint32_t sign = static_cast<uint32_t>(v & 0x8000u) << 16;
    const uint32_t special = sign | 0x7F800000u | (static_cast<uint32_t>(v & 0x3FFu) << 13);
    const float magnitude = half_magnitude(v);
    const float value = (v & 0x8000u) ? -magnitude : magnitude;
    return (v & 0x7C00u) == 0x7C00u ? bits_float(special) : value;
  }
};

// A row of logits: element i sanitised, -inf where the bitmask clears it.
template <Dtype D, bool Masked>
struct Row {
  const typename Elem<D>::T* data;
  int64_t vocab;
  const int32_t* bitmask;
  SPECDEC_INLINE float operator()(int64_t i) const {
    const float x = Elem<D>::logit(data[i]);
    if (!Masked) return x;
    return (static_cast<uint32_t>(bitmask[i >> 5]) >> (i & 31)) & 1u ? x : -kInf;
  }
};

template <class F>
SPECDEC_INLINE void with_row(const RowView& view, F&& body) {
  switch (view.dtype) {
#define SPECDEC_ROW_CASE(D)                                                                 \
  case D: {                                                                                 \
    using T = Elem<D>::T;                                                                   \
    const T* data = static_cast<const T*>(view.data);                                       \
    if (view.bitmask != nullptr) {                                                          \
      body(Row<D, true>{data, view.vocab, view.bitmask});                                   \
    } else {                                                                                \
      body(Row<D, false>{data, view.vocab, nullptr});                                       \
    }                                                                                       \
    return;                                                                                 \
  }
    SPECDEC_ROW_CASE(Dtype::kFloat32)
    SPECDEC_ROW_CASE(Dtype::kBFloat16)
    SPECDEC_ROW_CASE(Dtype::kFloat16)
#undef SPECDEC_ROW_CASE
  }
}

// exp for x <= 88 (Cephes' single-precision polynomial, within 2 ulps): 0 below
// ln(FLT_MIN) = -87.34 (no subnormal results), and exp(-inf) = 0. Branch-free: vectorises.
SPECDEC_INLINE float fast_exp(float x) {
  const bool underflow = !(x >= -87.3365478515625f);  // also -inf (NaN never reaches here)
  x = x < -87.3365478515625f ? -87.3365478515625f : x;
  x = x > 88.0f ? 88.0f : x;
  float n = x * 1.44269504088896341f;
  n = (n + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2**23)
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const float y = poly * r * r + r + 1.0f;
  const int32_t exponent = static_cast<int32_t>(n) + 127;
  const float scale = bits_float(static_cast<uint32_t>(exponent) << 23);
  return underflow ? 0.0f : y * scale;
}

// Order-preserving keys of floats (x < y <=> key(x) < key(y), -0 just below +0).
SPECDEC_INLINE uint32_t sort_key(float x) {
  const uint32_t bits = float_bits(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
SPECDEC_INLINE float key_value(uint32_t key) {
  return bits_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// The smallest x with x / T >= z_lo (T > 0; +inf when no finite x has it), by bisection over
// the keys: x / T is monotone in x (division rounds monotonically), so the cut x >= x_lo keeps
// exactly the tokens x / T >= z_lo does, and the passes over the row divide once less.
SPECDEC_INLINE float cut_of(float z_lo, float temperature) {
  if (!(z_lo > -kInf)) return -kInf;  // (z_lo is never NaN: a NaN cut would keep nothing)
  uint32_t lo = sort_key(-kInf), hi = sort_key(std::numeric_limits<float>::max()) + 1;
  while (lo < hi) {  // the first key in [lo, hi] whose value passes (hi: none)
    const uint32_t mid = lo + (hi - lo) / 2;
    if (key_value(mid) / temperature >= z_lo) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return key_value(lo);  // key_value(key(FLT_MAX) + 1) = +inf
}

// Which tokens a row keeps and their unnormalised weight e = exp((x - x_max) / T).
struct Keep {
  float x_max, temperature, x_lo, e_tau;
  SPECDEC_INLINE float e(float x) const { return fast_exp((x - x_max) / temperature); }
  SPECDEC_INLINE float weight(float x) const {
    // Two selects on values computed unconditionally (nested ones, or a bool &, let the
    // compiler sink the exp into a branch, and loops like the residual's stay scalar).
    const float value = e(x);
    const float kept = value >= e_tau ? value : 0.0f;
    return x >= x_lo ? kept : 0.0f;
  }
};
SPECDEC_INLINE Keep keep_of(const RowStats& s) { return Keep{s.x_max, s.temperature, s.x_lo, s.e_tau}; }

// The largest logit, as the largest key: an integer max reduction vectorises (a float one
// needs -ffast-math); -inf for a row with no finite logit.
template <class R>
SPECDEC_INLINE float row_max(const R& row) {
  uint32_t best = 0;
  for (int64_t i = 0; i < row.vocab; ++i) {
    const uint32_t key = sort_key(row(i));
    best = key > best ? key : best;
  }
  return key_value(best);
}

// Sum of weight(i) over [begin, end), and whether one is > 0. Blocks of weights go to a
// local buffer first (a plain store loop, which vectorises whatever weight() is), then into
// 16 per-lane sums (in a fixed order: the same sum on every build).
constexpr int64_t kBlock = 256;
struct BlockSum {
  float sum;
  bool any_positive;
};
// With `out`, the weights are also written to out[begin, end).
template <class W>
SPECDEC_INLINE BlockSum block_sum(const W& weight, int64_t begin, int64_t end,
                                  float* out = nullptr) {
  float lane[kLanes] = {}, positive[kLanes] = {};
  float local[kBlock];
  int64_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    float* buffer = out != nullptr ? out + i : local;
    for (int64_t j = 0; j < kBlock; ++j) buffer[j] = weight(i + j);
    for (int64_t j = 0; j < kBlock; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        lane[l] += buffer[j + l];
        positive[l] = buffer[j + l] > 0.0f ? 1.0f : positive[l];
      }
    }
  }
  float total = 0.0f;
  bool any_positive = false;
  for (; i < end; ++i) {
    const float w = weight(i);
    if (out != nullptr) out[i] = w;
    total += w;
    any_positive |= w > 0.0f;
  }
  for (int l = 0; l < kLanes; ++l) {
    total += lane[l];
    any_positive |= positive[l] != 0.0f;
  }
  return BlockSum{total, any_positive};
}

template <class W>
SPECDEC_INLINE float lane_sum(const W& weight, int64_t begin, int64_t end, float* out = nullptr) {
  return block_sum(weight, begin, end, out).sum;
}

// ---- the threshold search (radix over keys, no sort) ----
// Levels of the key: bits 31..21, 20..10, 9..0.
constexpr int kLevelShift[3] = {21, 10, 0};
constexpr uint32_t kLevelBins[3] = {2048, 2048, 1024};

// From the top bin down: the first bin where the running total reaches `target`; adds the
// bins above it to `above`. -1 when the total never reaches it.
SPECDEC_INLINE int walk_bins(const double* hist, uint32_t bins, double target, double& above) {
  for (int bin = static_cast<int>(bins) - 1; bin >= 0; --bin) {
    if (above + hist[bin] >= target) return bin;
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
  int64_t count = 0;
  for (int64_t j = 0; j < vocab; ++j) {
    if ((all_keys[j] >> 21) == static_cast<uint32_t>(top) && all_weights[j] > 0.0f) {
      keys[count] = all_keys[j];
      weights[count] = all_weights[j];
      ++count;
    }
  }
  uint32_t key = static_cast<uint32_t>(top) << 21;
  for (int level = 1; level < 3; ++level) {
    const uint32_t bins = kLevelBins[level];
    const int shift = kLevelShift[level];
    for (uint32_t bin = 0; bin < bins; ++bin) hist[0][bin] = 0.0;
    for (int64_t j = 0; j < count; ++j) hist[0][(keys[j] >> shift) & (bins - 1)] += weights[j];
    int bin = walk_bins(hist[0], bins, target, above);
    if (bin < 0) {  // the bin reached the target, its parts in another order did not: keep it all
      bin = 0;
      while (hist[0][bin] == 0.0 && bin + 1 < static_cast<int>(bins)) ++bin;
      target = 0.0;
      above = 0.0;
    }
    key |= static_cast<uint32_t>(bin) << shift;
    int64_t kept = 0;
    for (int64_t j = 0; j < count; ++j) {
      if (((keys[j] >> shift) & (bins - 1)) == static_cast<uint32_t>(bin)) {
        keys[kept] = keys[j];
        weights[kept] = weights[j];
        ++kept;
      }
    }
    count = kept;
    if (target == 0.0) {  // keep the whole bin: its lowest key
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
template <bool Mass, class R>
SPECDEC_INLINE void fill_candidates(const R& row, const Keep& keep, Scratch& scratch) {
  uint32_t* keys = scratch.keys.data();
  float* weights = scratch.weights.data();
  for (int64_t i = 0; i < row.vocab; ++i) {
    const float x = row(i);
    keys[i] = sort_key(x);
    const float value = Mass ? keep.e(x) : (x > -kInf ? 1.0f : 0.0f);  // e(-inf) = 0
    weights[i] = x >= keep.x_lo ? value : 0.0f;
  }
}

template <class R>
SPECDEC_INLINE RowStats stats_of(const R& row, const Filters& filters, Scratch& scratch) {
  RowStats s;
  const int64_t vocab = row.vocab;
  s.temperature = filters.temperature;
  s.greedy = filters.temperature == 0.0f;
  s.x_max = row_max(row);
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
    if (scratch.keys.size() < static_cast<size_t>(vocab)) {
      scratch.keys.resize(vocab);
      scratch.weights.resize(vocab);
    }
  }
  uint32_t key = 0;
  if (use_top_k) {  // the k-th largest logit, ties kept: z >= z(x_k)
    fill_candidates<false>(row, Keep{s.x_max, temperature, -kInf, 0.0f}, scratch);
    if (search_threshold(scratch, vocab, static_cast<double>(filters.top_k), 0.0, key)) {
      const float z_k = key_value(key) / temperature;
      s.z_lo = z_k > s.z_lo ? z_k : s.z_lo;
    }
  }
  s.x_lo = cut_of(s.z_lo, temperature);
  Keep keep = keep_of(s);
  // The next cache slot (two in turn: the race after a rejection needs the target row's and
  // the draft row's, the last two computed).
  CachedRow& slot = scratch.cached[scratch.generation & 1];
  slot.generation = ++scratch.generation;
  if (slot.weights.size() < static_cast<size_t>(vocab)) slot.weights.resize(vocab);
  s.cache = &slot;
  s.cache_generation = slot.generation;
  if (use_top_p) {  // the largest e whose kept mass reaches top_p of the top-k/min-p set
    fill_candidates<true>(row, keep, scratch);
    if (search_threshold(scratch, vocab, 0.0, static_cast<double>(filters.top_p), key)) {
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
  s.norm = lane_sum([keep, row](int64_t i) SPECDEC_INLINE_LAMBDA { return keep.weight(row(i)); }, 0,
                    vocab, slot.weights.data());
  return s;
}

template <class R>
SPECDEC_INLINE float prob_of(const R& row, const RowStats& s, int64_t token) {
  if (!s.has_finite) return 0.0f;
  if (s.greedy) return token == s.argmax ? 1.0f : 0.0f;
  return keep_of(s).weight(row(token)) / s.norm;
}

// p of a processed non-greedy row with finite logits, as a weight functor.
template <class R>
struct Probs {
  R row;
  Keep keep;
  float norm;
  SPECDEC_INLINE float operator()(int64_t i) const { return keep.weight(row(i)) / norm; }
};

// p from the kept e the norm pass cached: the same values as Probs, without the exp.
struct CachedProbs {
  const float* weights;
  float norm;
  SPECDEC_INLINE float operator()(int64_t i) const { return weights[i] / norm; }
};
SPECDEC_INLINE bool has_cache(const RowStats& s) {
  return s.cache != nullptr && s.cache->generation == s.cache_generation;
}

// body(p) for the processed non-greedy row (view, s) with finite logits: CachedProbs while
// the statistics' cache slot holds them, else Probs over the row.
template <class F>
SPECDEC_INLINE void with_probs(const RowView& view, const RowStats& s, F&& body) {
  if (has_cache(s)) {
    body(CachedProbs{s.cache->weights.data(), s.norm});
    return;
  }
  with_row(view, [&](const auto& row) {
    using R = std::decay_t<decltype(row)>;
    body(Probs<R>{row, keep_of(s), s.norm});
  });
}

// ---- the two-level race ----
struct RaceResult {
  int32_t token;      // -1: no positive weight, or a NaN
  bool any_positive;  // some weight > 0 (NaN aside)
};

template <class W>
SPECDEC_INLINE RaceResult race(const W& weight, int64_t vocab, const Stream& stream) {
  const int64_t num_groups = (vocab + kRaceGroup - 1) / kRaceGroup;
  float best_score = -1.0f;
  int64_t best_group = 0;
  bool any_positive = false, any_nan = false;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t begin = g * kRaceGroup;
    const int64_t end = begin + kRaceGroup < vocab ? begin + kRaceGroup : vocab;
    const BlockSum group = block_sum(weight, begin, end);
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

// ---- the ops ----
SPECDEC_INLINE size_t element_size(Dtype dtype) { return dtype == Dtype::kFloat32 ? 4 : 2; }

SPECDEC_INLINE const void* row_pointer(const void* base, Dtype dtype, int64_t row, int64_t vocab) {
  return static_cast<const char*>(base) + static_cast<size_t>(row * vocab) * element_size(dtype);
}

// Row `row` of [R, V] logits and of their [R, ceil(V/32)] bitmask (or none).
SPECDEC_INLINE RowView logits_row(const void* base, Dtype dtype, int64_t row, int64_t vocab,
                                  const int32_t* bitmask) {
  return RowView{row_pointer(base, dtype, row, vocab), dtype, vocab,
                 bitmask ? bitmask + row * ((vocab + 31) / 32) : nullptr};
}

SPECDEC_INLINE float raw_element(const void* base, Dtype dtype, int64_t index) {
  switch (dtype) {
    case Dtype::kFloat32:
      return Elem<Dtype::kFloat32>::raw(static_cast<const uint32_t*>(base)[index]);
    case Dtype::kBFloat16:
      return Elem<Dtype::kBFloat16>::raw(static_cast<const uint16_t*>(base)[index]);
    case Dtype::kFloat16:
      return Elem<Dtype::kFloat16>::raw(static_cast<const uint16_t*>(base)[index]);
  }
  return 0.0f;
}

SPECDEC_INLINE RowStats view_stats(const RowView& view, const Filters& filters, Scratch& scratch) {
  RowStats s;
  with_row(view, [&](const auto& row) { s = stats_of(row, filters, scratch); });
  return s;
}

SPECDEC_INLINE float view_prob(const RowView& view, const RowStats& s, int64_t token) {
  float p = 0.0f;
  with_row(view, [&](const auto& row) { p = prob_of(row, s, token); });
  return p;
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
      if (residual.draft_stats.greedy) {  // not reached: greedy requests race nothing
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

// ---- return_logprobs ----
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// log_softmax of the sanitised row (no bitmask, no filters) at `token`.
SPECDEC_INLINE float raw_logprob(const RowView& view, int64_t token) {
  RowView plain = view;
  plain.bitmask = nullptr;
  float value = kNaN;
  with_row(plain, [&](const auto& row) {
    const float x_max = row_max(row);
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

// One request after another. Token rule: row j's statistics, p(d_j), q(d_j), the test; stop
// at the first rejection. Block verification (sampled requests): every live row is read (all
// tests are made); row j >= 1 also gives R_j = sum(max(w_j p_j - q_j, 0)).
SPECDEC_INLINE void verify_chain_body(const ChainArgs& a, int64_t begin, int64_t end) {
  const int64_t num_drafts = a.num_drafts, vocab = a.vocab, rows = num_drafts + 1;
  Scratch scratch;
  std::vector<int64_t> id(num_drafts);          // grows with K only
  std::vector<float> p_drafts(num_drafts);       // p_j(d_j), for the log-probabilities
  std::vector<RowStats> block_stats, block_draft_stats;
  if (a.method == ChainMethod::kBlock) {
    block_stats.resize(rows);
    block_draft_stats.resize(rows);
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
    for (int64_t j = 0; j < n; ++j) id[j] = a.draft_ids[draft_row(j)];
    int64_t live = 0;  // the leading valid drafts
    while (live < n && id[live] >= 0 && id[live] < vocab) ++live;
    auto target_view = [&](int64_t j) {
      return logits_row(a.target, a.target_dtype, target_row(j), vocab, a.bitmask);
    };
    auto draft_view = [&](int64_t j) {
      return RowView{row_pointer(a.draft_logits, a.draft_logits_dtype, draft_row(j), vocab),
                     a.draft_logits_dtype, vocab, nullptr};
    };
    const Filters draft_filters = filters;
    auto draft_stats_of = [&](int64_t j) {  // j < live; only with draft_logits
      return view_stats(draft_view(j), draft_filters, scratch);
    };
    auto q_draft_of = [&](int64_t j, const RowStats& draft_stats) {
      if (a.draft_probs != nullptr) {
        return raw_element(a.draft_probs, a.draft_probs_dtype, draft_row(j) * vocab + id[j]);
      }
      if (a.draft_logits != nullptr) return view_prob(draft_view(j), draft_stats, id[j]);
      return 1.0f;
    };
    auto residual_of = [&](int64_t j, const RowStats& draft_stats) {  // q of row j < live
      Residual residual{Residual::kOneHot, id[j], nullptr, Dtype::kFloat32, RowView{},
                        RowStats{}};
      if (a.draft_probs != nullptr) {
        residual.kind = Residual::kProbs;
        residual.q = row_pointer(a.draft_probs, a.draft_probs_dtype, draft_row(j), vocab);
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

// ---- verify_tree (method "token") ----
struct FloatRow {
  const float* data;
  SPECDEC_INLINE float operator()(int64_t i) const { return data[i]; }
};
// A without-replacement draft row: q with the rejected tokens removed, over its mass.
struct ScaledRow {
  const float* data;
  float mass;
  SPECDEC_INLINE float operator()(int64_t i) const { return mass > 0.0f ? data[i] / mass : 0.0f; }
};
template <class P>
struct Unnormalised {  // p_raw / p_mass
  P p;
  float mass;
  SPECDEC_INLINE float operator()(int64_t i) const { return p(i) / mass; }
};

template <class P>
struct Weighted {  // w * p
  P p;
  float weight;
  SPECDEC_INLINE float operator()(int64_t i) const { return weight * p(i); }
};

// out = max(p - q, 0) (NaN kept); its sum and whether an entry is > 0.
template <class P, class Q>
SPECDEC_INLINE BlockSum write_residual(const P& p, const Q& q, float* out, int64_t vocab) {
  for (int64_t i = 0; i < vocab; ++i) {
    const float r = p(i) - q(i);
    out[i] = r < 0.0f ? 0.0f : r;
  }
  return block_sum(FloatRow{out}, 0, vocab);
}

// The processed row as floats (zeros for a row without finite logits).
SPECDEC_INLINE void write_probs(const RowView& view, const RowStats& s, float* out) {
  if (!s.has_finite || s.greedy) {
    for (int64_t i = 0; i < view.vocab; ++i) out[i] = 0.0f;
    if (s.has_finite) out[s.argmax] = 1.0f;
    return;
  }
  with_row(view, [&](const auto& row) {
    const Keep keep = keep_of(s);
    for (int64_t i = 0; i < view.vocab; ++i) out[i] = keep.weight(row(i)) / s.norm;
  });
}

SPECDEC_INLINE void write_draft(const void* q, Dtype dtype, int64_t vocab, float* out) {
  for (int64_t i = 0; i < vocab; ++i) out[i] = raw_element(q, dtype, i);
}

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

  void resize(int64_t nodes, int64_t vocab) {
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
    final_token = p_written[accepted_node]
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

// The walk of reference/tree.py, one request at a time. The current node's distribution is
// its processed row ("pristine": RowStats only) until a rejection there needs it as a row:
// deterministic candidates keep a list of removed tokens (the row is written only for the
// final race), i.i.d. / without-replacement drafts write the residual to a buffer (two, so
// that a residual without mass keeps the previous one) and the draft row to a third.
SPECDEC_INLINE void verify_tree_body(const TreeArgs& a, int64_t begin, int64_t end) {
  const int64_t nodes = a.num_nodes, vocab = a.vocab;
  const bool has_q = a.draft_probs != nullptr;
  const bool wor = has_q && a.draft_sampling == DraftSampling::kWithoutReplacement;
  Scratch scratch;
  std::vector<float> buffers((has_q ? 3 : 1) * static_cast<size_t>(vocab));  // grows with V only
  std::vector<int64_t> removed;
  const bool traversal = a.method == TreeMethod::kTraversal && has_q;
  Traversal tour;
  if (traversal) tour.resize(nodes, vocab);
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
    if (p_buf != nullptr) {
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

SPECDEC_INLINE void sample_body(const SampleArgs& a, int64_t begin, int64_t end) {
  Scratch scratch;
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
  Scratch scratch;
  for (int64_t r = begin; r < end; ++r) {
    const RowView view = logits_row(a.logits, a.dtype, r, a.vocab, a.bitmask);
    const RowStats s = view_stats(view, a.params.filters(r / a.rows_per_request), scratch);
    write_probs(view, s, a.probs + r * a.vocab);
  }
}
