// Tensor checks and conversions the CPU registrations share (ops_sampling_cpu.cpp,
// ops_adapters_cpu.cpp): memory safety for the plain pointers they hand to C++ loops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace specdec {
namespace torch_ops {
namespace cpu_tensors {

inline void check_cpu(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
}

// t itself when it already has the type and is contiguous (no dispatcher call), else a copy.
inline at::Tensor as_type(const at::Tensor& t, at::ScalarType type) {
  if (t.scalar_type() == type && t.is_contiguous()) return t;
  return t.to(type).contiguous();
}

}  // namespace cpu_tensors
}  // namespace torch_ops
}  // namespace specdec
