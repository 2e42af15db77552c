// A linear layer as the C++ decode step calls it; one subclass per weight layout
// (powerinfer/ops/linear.py holds the Python side of each).
#pragma once

#include <torch/extension.h>

#include <memory>
#include <vector>

namespace powerinfer {

struct Projection {
  virtual ~Projection() = default;
  virtual torch::Tensor operator()(const torch::Tensor& x) const = 0;  // [rows, in] -> [rows, out]
};

using ProjectionPtr = std::shared_ptr<Projection>;

// Int4Linear: torch's int4 kernel, the input repeated `repeats` times along K (Q8_0 as two nibble
// matrices), outputs padded to a multiple of 64 and cut back to `out_features`.
struct Int4Projection : Projection {
  torch::Tensor packed, scale_zero;
  int64_t out_features, repeats;

  Int4Projection(torch::Tensor packed, torch::Tensor scale_zero, int64_t out_features, int64_t repeats);
  torch::Tensor operator()(const torch::Tensor& x) const override;
};

// QuantLinear: weight matrices in the packed layout of quant_matmul.h, side by side along the
// outputs (one per GGUF tensor: a fused projection may mix types, as Q4_K_M files do); float32 out.
struct QuantProjection : Projection {
  std::vector<torch::Tensor> chunks;  // quant_repack's output, one per matrix
  std::vector<int64_t> types, rows;
  int64_t in_features, out_features;

  QuantProjection(std::vector<torch::Tensor> chunks, std::vector<int64_t> types, std::vector<int64_t> rows);
  torch::Tensor operator()(const torch::Tensor& x) const override;
};

// raw uint8 [rows, bytes per row] of a GGML block type -> its packed layout (quant_matmul.h), written
// into `destination` (contiguous uint8 of the packed bytes: the caller's memory, e.g. on huge pages)
// and returned as [chunks of COLS rows, blocks, chunk bytes].
torch::Tensor quant_repack(const torch::Tensor& raw, int64_t type, const torch::Tensor& destination);

// Bytes of quant_repack's output for `rows` raw rows of `row_bytes` each of GGML `type`.
int64_t quant_packed_bytes(int64_t type, int64_t rows, int64_t row_bytes);

}  // namespace powerinfer
