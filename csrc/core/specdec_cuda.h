// CUDA entry points of the core: same parameter structs as the CPU functions, with every
// pointer on the device except CompactParams::layers (a host array of device pointers,
// passed to the kernel by value). Work is enqueued on `stream`; nothing synchronises.
#pragma once

#include <cuda_runtime.h>

#include "specdec.h"

namespace specdec {

cudaError_t build_tree_attention_cuda(const TreeAttentionParams& params, cudaStream_t stream);

// Writes params.new_kv_lens too. One launch per 256 layer tensors.
cudaError_t compact_kv_cache_cuda(const CompactParams& params, cudaStream_t stream);

}  // namespace specdec
