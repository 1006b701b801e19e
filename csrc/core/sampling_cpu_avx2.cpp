// The CPU sampling path compiled for AVX2 + FMA (8 floats per instruction); sampling_cpu.cpp
// calls it when the processor has AVX2, FMA and BMI2 but not AVX-512 (checked at run time),
// or when SPECDEC_CPU_ISA=avx2 asks for it. FMA is allowed as an instruction but never
// contracted from a * b + c: the bodies round every product and sum as the baseline does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "sampling_cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>  // outside the target region: GCC's intrinsics carry their own targets
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#pragma GCC optimize("fp-contract=off", "no-trapping-math")  // as the baseline build (setup.py)
namespace specdec {
namespace cpu {
namespace avx2 {
#define SPECDEC_AVX2 1  // the bodies' few explicit AVX2 paths (the search's compaction)
#include "sampling_cpu_impl.h"
#undef SPECDEC_AVX2
}  // namespace avx2
}  // namespace cpu
}  // namespace specdec
#pragma GCC pop_options
#endif
