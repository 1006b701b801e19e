// The bodies of the CPU sampling path (sampling_cpu.h), compiled once per instruction set:
// sampling_cpu.cpp (baseline x86-64 / any target), sampling_cpu_avx2.cpp and
// sampling_cpu_avx512.cpp (chosen at run time). Included inside namespace SPECDEC_ISA; every
// helper is inline so that it is compiled with the including file's target. The streaming
// loops keep 16 accumulators (one per lane) so that the compiler vectorises them without
// reassociating a float sum.
//
// Not a public header: the including file has included <algorithm>, <cmath>, <cstdint>, <cstring>,
// <limits>, <type_traits>, <vector> and sampling_cpu.h (outside the namespace).
//
// The parts are layers, each including only those below it (docs/cpu.md has the table):
//   base; random, rows; stats, search; filters; race; buffers; chain, traversal; tree
// (bottom to top; the parts of one group do not include one another).
// Each part has an include guard; a file that compiles several builds (the C++ tests: one
// namespace each) includes this header once per build, so the guards are reset here first.
#undef SPECDEC_CPU_PART_BASE
#undef SPECDEC_CPU_PART_RANDOM
#undef SPECDEC_CPU_PART_ROWS
#undef SPECDEC_CPU_PART_STATS
#undef SPECDEC_CPU_PART_SEARCH
#undef SPECDEC_CPU_PART_FILTERS
#undef SPECDEC_CPU_PART_RACE
#undef SPECDEC_CPU_PART_BUFFERS
#undef SPECDEC_CPU_PART_TRAVERSAL
#undef SPECDEC_CPU_PART_CHAIN
#undef SPECDEC_CPU_PART_TREE

// The drivers (the top layer): the ops' bodies, and everything below them.
#include "sampling_cpu_chain.h"
#include "sampling_cpu_tree.h"
