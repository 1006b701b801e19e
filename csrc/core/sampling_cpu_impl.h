// Defines the entry points of sampling_cpu.h's ops in namespace SPECDEC_ISA from the bodies,
// for sampling_cpu.cpp, sampling_cpu_avx2.cpp and sampling_cpu_avx512.cpp (see
// sampling_cpu_body.h).
#include "sampling_cpu_body.h"

void verify_chain_impl(const ChainArgs& args, int64_t begin, int64_t end) {
  verify_chain_body(args, begin, end);
}
void sample_impl(const SampleArgs& args, int64_t begin, int64_t end) {
  sample_body(args, begin, end);
}
void processed_probs_impl(const ProbsArgs& args, int64_t begin, int64_t end) {
  processed_probs_body(args, begin, end);
}
void verify_tree_impl(const TreeArgs& args, int64_t begin, int64_t end) {
  verify_tree_body(args, begin, end);
}
