// Rows: element loads (NaN and +-inf as -inf, the bitmask), row views and pointers, the exp,
// order-preserving keys, the z-cut as an x-cut and the kept weight.
// A part of the CPU sampling path's bodies: see sampling_cpu_body.h. Not a public header.
#ifndef SPECDEC_CPU_PART_ROWS
#define SPECDEC_CPU_PART_ROWS
#include "sampling_cpu_base.h"

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

// A row of logits: element i sanitised, -inf where the bitmask clears it. The bitmask is read
// as one 32-bit lane mask per token (ExpandedMask: all ones where allowed), applied by an
// integer select: bitmask[i >> 5] >> (i & 31) is a gather to the vectoriser, and with one
// byte per token GCC took 64 tokens per AVX-512 step, spilling registers.
template <Dtype D, bool Masked>
struct Row {
  static constexpr Dtype kDtype = D;
  const typename Elem<D>::T* data;
  int64_t vocab;
  const uint32_t* allowed;  // ~0u: allowed, 0: masked (Masked only)
  SPECDEC_INLINE float operator()(int64_t i) const {
    const float x = Elem<D>::logit(data[i]);
    if (!Masked) return x;
    const uint32_t keep = allowed[i];
    return bits_float((float_bits(x) & keep) | (0xFF800000u & ~keep));  // else -inf
  }
};

// The bitmask words of the last masked row seen by this thread, one lane mask per token.
// Valid within one op's call (the caller's tensors do not change during it): every body
// starts with forget_expanded_mask(), so a later call never reads masks of other words.
struct ExpandedMask {
  const int32_t* words = nullptr;
  int64_t vocab = 0;
  std::vector<uint32_t> allowed;
};
SPECDEC_INLINE ExpandedMask& expanded_mask() {
  thread_local ExpandedMask mask;
  return mask;
}
SPECDEC_INLINE void forget_expanded_mask() { expanded_mask().words = nullptr; }
SPECDEC_INLINE const uint32_t* allowed_masks(const int32_t* words, int64_t vocab) {
  ExpandedMask& mask = expanded_mask();
  if (mask.words == words && mask.vocab == vocab) return mask.allowed.data();
  const int64_t count = (vocab + 31) / 32;
  uint32_t* out = grow(mask.allowed, count * 32);
  for (int64_t w = 0; w < count; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    for (int j = 0; j < 32; ++j) out[w * 32 + j] = 0u - ((word >> j) & 1u);
  }
  mask.words = words;
  mask.vocab = vocab;
  return out;
}

// A row with no NaN, no infinity and no masked token (RowRange::min > -inf): the same values
// as its Row, loaded without the sanitising selects.
template <Dtype D>
struct CleanRow {
  const typename Elem<D>::T* data;
  int64_t vocab;
  SPECDEC_INLINE float operator()(int64_t i) const { return Elem<D>::raw(data[i]); }
};
template <class R>
SPECDEC_INLINE CleanRow<R::kDtype> clean_row(const R& row) {
  return CleanRow<R::kDtype>{row.data, row.vocab};
}

template <class F>
SPECDEC_INLINE void with_row(const RowView& view, F&& body) {
  switch (view.dtype) {
#define SPECDEC_ROW_CASE(D)                                                                 \
  case D: {                                                                                 \
    using T = Elem<D>::T;                                                                   \
    const T* data = static_cast<const T*>(view.data);                                       \
    if (view.bitmask != nullptr) {                                                          \
      body(Row<D, true>{data, view.vocab, allowed_masks(view.bitmask, view.vocab)});        \
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

// exp(x) = y * 2**k for x in [-104, 88] (Cephes' single-precision polynomial, within 2 ulps).
struct ExpParts {
  float y;
  int32_t k;
};
SPECDEC_INLINE ExpParts exp_parts(float x) {
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
  return ExpParts{poly * r * r + r + 1.0f, static_cast<int32_t>(n)};
}

// exp for x <= 88, subnormal results included (the reference's probabilities go down to
// FLT_TRUE_MIN): 0 below -104 (where exp rounds to 0 anyway) and exp(-inf) = 0. Branch-free:
// vectorises.
SPECDEC_INLINE float fast_exp(float x) {
  const bool underflow = !(x >= -104.0f);  // also -inf (NaN never reaches here)
  // An underflowing lane computes exp(0) and returns 0: every lane is computed (the loops
  // vectorise), and clamping it to -104 instead would make subnormal products, which cost a
  // microcode assist per lane on x86 (masked tokens are -inf: half a masked row).
  x = underflow ? 0.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const ExpParts e = exp_parts(x);
  // y * 2**k for k in -150..127: below 2**-126 as (y * 2**(k + 64)) * 2**-64, an exact product
  // and one rounding to the subnormal result (for k >= -126 the second factor is 1: exact).
  const bool tiny = e.k < -126;
  const float scale = bits_float(static_cast<uint32_t>((tiny ? e.k + 64 : e.k) + 127) << 23);
  const float rescale = tiny ? 5.42101086242752217e-20f : 1.0f;  // 2**-64
  return underflow ? 0.0f : (e.y * scale) * rescale;
}

// fast_exp for x in [kNormalExpMin, 0], bit for bit: there k is in [-126, 0] (the result is
// normal), so the underflow, the clamp and the subnormal rescale are no-ops. The hot passes
// of a row whose every (x - x_max) / T lies there (a "clean" row: RowRange) use it.
constexpr float kNormalExpMin = -87.0f;
SPECDEC_INLINE float normal_exp(float x) {
  const ExpParts e = exp_parts(x);
  return e.y * bits_float(static_cast<uint32_t>(e.k + 127) << 23);
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
  // The hot passes' e: Unit for T = 1 rows (d / 1 == d exactly: no division), Clean for clean
  // rows (normal_exp: the same values).
  template <bool Unit, bool Clean = false>
  SPECDEC_INLINE float e_of(float x) const {
    const float d = Unit ? x - x_max : (x - x_max) / temperature;
    return Clean ? normal_exp(d) : fast_exp(d);
  }
  template <bool Unit = false, bool Clean = false>
  SPECDEC_INLINE float weight(float x) const {
    // Two selects on values computed unconditionally (nested ones, or a bool &, let the
    // compiler sink the exp into a branch, and loops like the residual's stay scalar).
    const float value = e_of<Unit, Clean>(x);
    const float kept = value >= e_tau ? value : 0.0f;
    return x >= x_lo ? kept : 0.0f;
  }
};
SPECDEC_INLINE Keep keep_of(const RowStats& s) { return Keep{s.x_max, s.temperature, s.x_lo, s.e_tau}; }

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

#endif  // SPECDEC_CPU_PART_ROWS
