// Random numbers: Philox-4x32-10 and the streams, uniforms and noise of _rng.py.
// A part of the CPU sampling path's bodies: see sampling_cpu_body.h. Not a public header.
#ifndef SPECDEC_CPU_PART_RANDOM
#define SPECDEC_CPU_PART_RANDOM
#include "sampling_cpu_base.h"

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

#endif  // SPECDEC_CPU_PART_RANDOM
