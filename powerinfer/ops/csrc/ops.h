// The operators Python calls (bindings.cpp), as the files that define them export them.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "common.h"

namespace powerinfer {

// neuron_kernels.cpp
torch::Tensor gather_matvec(torch::Tensor rec, std::vector<int64_t> section, torch::Tensor x, torch::Tensor idx);
torch::Tensor accumulate_rows(torch::Tensor rec, std::vector<int64_t> section, torch::Tensor a, torch::Tensor idx);
torch::Tensor sparse_ffn(torch::Tensor rec, std::vector<int64_t> gate_section, std::vector<int64_t> up_section,
                         std::vector<int64_t> down_section, Activation activation, torch::Tensor x, torch::Tensor idx);

// attention.cpp
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values,
                               const std::vector<int64_t>& slots, const std::vector<int64_t>& positions,
                               torch::Tensor rotations, int64_t n_head, int64_t n_kv);

}  // namespace powerinfer
