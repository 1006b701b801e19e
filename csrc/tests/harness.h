// A minimal test harness: CHECK records a failure and continues; main() returns non-zero
// when any check failed, which is what ctest reads.
#pragma once

#include <cstdio>
#include <cstdlib>

namespace specdec_test {
inline int& failures() {
  static int count = 0;
  return count;
}
}  // namespace specdec_test

#define CHECK(condition)                                                                 \
  do {                                                                                   \
    if (!(condition)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #condition); \
      ++specdec_test::failures();                                                        \
    }                                                                                    \
  } while (0)

#define CHECK_EQ(a, b)                                                                     \
  do {                                                                                     \
    const long long va_ = static_cast<long long>(a), vb_ = static_cast<long long>(b);      \
    if (va_ != vb_) {                                                                      \
      std::fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %s (%lld vs %lld)\n", __FILE__, \
                   __LINE__, #a, #b, va_, vb_);                                            \
      ++specdec_test::failures();                                                          \
    }                                                                                      \
  } while (0)

#define TEST_MAIN_RETURN()                                                    \
  do {                                                                        \
    if (specdec_test::failures() == 0) std::printf("all checks passed\n");   \
    return specdec_test::failures() == 0 ? EXIT_SUCCESS : EXIT_FAILURE;       \
  } while (0)
