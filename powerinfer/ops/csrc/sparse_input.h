// Input-sparse linear layers (TEAL-style activation sparsity): y = x @ W.T where, per row of x,
// the input channels with |x_i| <= threshold_i are skipped and their weights never read.
//
// Layout. W [out, in] is kept by columns: record i (row i of a uint8 tensor [in, record_bytes]) holds
// column W[:, i] as the raw GGML blocks of the transposed weight (a GGUF tensor whose row i is
// column i of W). A fused projection (q, k and v) puts several such rows side by side in a record,
// one "part" per matrix, each in its own block type (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, ...), its
// outputs following the previous part's.
//
// Arithmetic (sparse path, a few rows): y[o] = sum over the row's active channels i of x_i w[o, i],
// with the float32 x_i itself (no rounding of x) times the dequantized weight in float32. A row's
// active channels are taken in order, COLUMN_BATCH at a time: each batch adds to y once, its
// columns' products in order. That grouping depends on the row's own selection only, and threads
// split the outputs (never the channels), so a row's result is the same bits whatever rows, threads
// or selections share the call.
// Many rows (prefill): every channel, columns dequantized a tile at a time to float32 and
// multiplied by torch's matrix product (the records stay the only copy of the weights).
// Plain-torch reference: powerinfer/sparse/columns.py.
#pragma once

#include <atomic>
#include <vector>

#include "ggml_blocks.h"
#include "projection.h"

namespace powerinfer {

constexpr int COLUMN_BATCH = 4;  // columns added to the outputs in one pass (loads and stores of y shared)

// One matrix of a record: its outputs' blocks of `format` from byte `offset`.
struct ColumnPart {
  const BlockFormat* format;
  int64_t offset, n_blocks, first_output;
};

// out[b * n + k] += sum_j c[j] * value k of block b of column j, for blocks b in [b0, b1) of the part
// (cols[j]: the part's first block in record j; out: the part's first output), n <= COLUMN_BATCH.
using ColumnKernel = void (*)(const uint8_t* const* cols, const float* c, int n, const BlockFormat& f, int64_t b0,
                              int64_t b1, float* out);

namespace scalar {
void axpy_columns(const uint8_t* const* cols, const float* c, int n, const BlockFormat& f, int64_t b0, int64_t b1, float* out);
}
namespace avx2 {
void axpy_columns(const uint8_t* const* cols, const float* c, int n, const BlockFormat& f, int64_t b0, int64_t b1, float* out);
}

struct SparseInputProjection : Projection {
  torch::Tensor records;     // uint8 [in, record_bytes]
  torch::Tensor thresholds;  // float32 [in]: channel i is active in a row where |x_i| > thresholds[i]
  std::vector<int64_t> types, part_outputs;
  int64_t in_features, out_features;
  int64_t sparse_max_rows;  // calls with more rows take the prefill path (all channels)

  // types, part_outputs: per part, its GGML type and its number of outputs (a multiple of the type's block).
  SparseInputProjection(torch::Tensor records, std::vector<int64_t> types, std::vector<int64_t> part_outputs,
                        torch::Tensor thresholds, int64_t sparse_max_rows);
  torch::Tensor operator()(const torch::Tensor& x) const override;

  // (row, channel) pairs computed by the last call (rows times in_features on the prefill path).
  int64_t last_selected() const { return selected_.load(std::memory_order_relaxed); }

 private:
  std::vector<ColumnPart> parts_;
  mutable std::atomic<int64_t> selected_{0};

  torch::Tensor sparse_rows(const torch::Tensor& x) const;
  torch::Tensor all_channels(const torch::Tensor& x) const;
};

}  // namespace powerinfer
