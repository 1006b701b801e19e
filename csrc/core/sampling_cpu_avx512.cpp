// The CPU sampling path compiled for AVX-512 (16 floats per instruction); sampling_cpu.cpp
// calls it when the processor has AVX-512F/BW/VL/DQ (checked at run time), unless
// SPECDEC_CPU_ISA asks for another build.
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
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#pragma GCC optimize("fp-contract=off", "no-trapping-math")  // as the baseline build (setup.py)
namespace specdec {
namespace cpu {
namespace avx512 {
#define SPECDEC_AVX512 1  // the bodies' few explicit AVX-512 paths (the search's compaction)
#include "sampling_cpu_impl.h"
#undef SPECDEC_AVX512
}  // namespace avx512
}  // namespace cpu
}  // namespace specdec
#pragma GCC pop_options
#endif
