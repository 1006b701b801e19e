// The bottom layer of the CPU sampling path's bodies: the inline attributes, the lane count,
// the infinities, bit casts, a run-time flag as a type, and scratch buffers that grow.
// A part of the CPU sampling path's bodies: see sampling_cpu_body.h. Not a public header.
#ifndef SPECDEC_CPU_PART_BASE
#define SPECDEC_CPU_PART_BASE

#define SPECDEC_INLINE inline __attribute__((always_inline))
#define SPECDEC_INLINE_LAMBDA __attribute__((always_inline))

constexpr int kLanes = 16;  // per-lane sums: the loops vectorise without reassociating a sum
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

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

// body(std::true_type) or body(std::false_type): a run-time flag as a template argument.
template <class F>
SPECDEC_INLINE void with_flag(bool flag, F&& body) {
  if (flag) {
    body(std::true_type{});
  } else {
    body(std::false_type{});
  }
}

// The buffer with at least n elements, grown (never shrunk: scratch grows with V only).
template <class T>
SPECDEC_INLINE T* grow(std::vector<T>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// A call's buffers T (its Scratch and the like). For tiny work (a request's rows x V at most
// kTinyWork) they are the thread's own, kept from call to call: a warm call allocates nothing,
// and they never grow past the tiny size. Else a fresh set, freed when the call returns.
// Every buffer is written before it is read, so which set a call gets changes no value.
constexpr int64_t kTinyWork = 4096;
template <class T>
struct CallBuffers {
  explicit CallBuffers(int64_t work) : get(work <= kTinyWork ? kept() : fresh) {}
  T fresh;
  T& get;
  static T& kept() {
    thread_local T buffers;
    return buffers;
  }
};

#endif  // SPECDEC_CPU_PART_BASE
