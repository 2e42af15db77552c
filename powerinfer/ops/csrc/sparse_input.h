// Input-sparse linear layers (TEAL-style activation sparsity): y = x @ W.T where, per row of x,
// the input channels with |x_i| <= threshold_i are skipped and their weights never read.
//
// Layout. W [out, in] is kept by columns: record i (row i of a uint8 tensor [in, record_bytes]) holds
// column W[:, i], built from the raw GGML blocks of the transposed weight (a GGUF tensor whose row i
// is column i of W). A fused projection (q, k and v) puts several such rows side by side in a record,
// one "part" per matrix, each in its own block type, its outputs following the previous part's.
// Q4_0 and Q4_1 parts are repacked when the projection is built, without loss and at the same size,
// in chunks of SPLIT_CHUNK blocks: the chunk's float16 d, then (Q4_1) its m, then its nibbles. The
// kernel reads 8 blocks' scales with one load, and a column is one stream of bytes (scales kept
// apart, as first built, doubled the streams that the hardware prefetchers follow: 8 blocks per
// chunk measured +25 % on the 4096 -> 22016 linear at 50 %). Other types keep the file's blocks.
//
// Arithmetic (sparse path, a few rows): y[o] = sum over the row's active channels i of x_i w[o, i].
// The channels go in fixed groups of COLUMN_BATCH (i / COLUMN_BATCH), each adding to y once: the
// columns active in any row of the call are read once, and each row multiplies them by its own x_i,
// or by 0 where it skips channel i (which changes no bit of its sums).
//   AVX2, Q4_0 and Q4_1: per block of 32 outputs, the batch's coefficients x_i d_i are rounded to
//   int8 on one scale (their largest over 127, as the dense AVX2 kernel rounds x per 32 inputs),
//   the 4-bit weights less 8 multiply them in int16 (exact: 16 columns of 15 * 127 fit), and the sum
//   meets the scale once in float32; Q4_1 adds c_i (m_i + 8 d_i) in float32. Everything else, and the
//   scalar path: float32 x_i times the dequantized weight, in float32.
// A row's sums depend on its own selection only, and threads split the outputs (never the channels),
// so a row's result is the same bits whatever rows, threads or selections share the call.
// Many rows (prefill): each row's skipped channels set to 0, then every column dequantized a tile at a
// time to float32 and multiplied by torch's matrix product (the records stay the only copy of the
// weights): the same selection as the sparse path, so logits do not depend on how rows are batched.
// Plain-torch reference: powerinfer/sparse/columns.py.
#pragma once

#include <algorithm>
#include <atomic>
#include <vector>

#include "ggml_blocks.h"
#include "projection.h"

namespace powerinfer {

// Channels per group: columns added to the outputs in one pass (loads and stores of y shared; at
// 50 % skipped about 8 of them active).
constexpr int COLUMN_BATCH = 16;
static_assert(COLUMN_BATCH * 15 * 127 <= 32767, "int16 sums of 4-bit weights times int8 coefficients");

// Blocks per chunk of a split (Q4_0, Q4_1) part; the last chunk of a part may hold fewer.
constexpr int64_t SPLIT_CHUNK = 8;
// Blocks of a split column fetched ahead of use: the kernel this far ahead of itself, the caller the
// next group's first ones (2 and 4 chunks measured alike, 8 slower; a whole column's range at
// once was slower than none on the 11008 -> 4096 linear).
constexpr int64_t SPLIT_PREFETCH_BLOCKS = 4 * SPLIT_CHUNK;

// One matrix of a record: its outputs' blocks of `format`, from byte q_off. Split parts in chunks
// (above): chunk c starts at q_off + c * SPLIT_CHUNK * format->bytes (a block's bytes either way).
struct ColumnPart {
  const BlockFormat* format;
  bool split;
  int64_t q_off, n_blocks, first_output;
  int64_t bytes() const { return n_blocks * format->bytes; }

  // split parts: where block b's chunk starts, how many blocks it holds, and b's d, m and nibbles
  int64_t chunk_start(int64_t b) const { return q_off + b / SPLIT_CHUNK * SPLIT_CHUNK * format->bytes; }
  int64_t chunk_blocks(int64_t b) const { return std::min(SPLIT_CHUNK, n_blocks - b / SPLIT_CHUNK * SPLIT_CHUNK); }
  int64_t d_at(int64_t b) const { return chunk_start(b) + 2 * (b % SPLIT_CHUNK); }
  int64_t m_at(int64_t b) const { return d_at(b) + 2 * chunk_blocks(b); }
  int64_t nibbles_at(int64_t b) const {
    return chunk_start(b) + (format->has_min ? 4 : 2) * chunk_blocks(b) + 16 * (b % SPLIT_CHUNK);
  }
};

// For rows r: out[r * ld + b * N + k] += sum_j c[r * COLUMN_BATCH + j] * value k of block b of the
// part in record j, for blocks b in [b0, b1) (recs[j]: record j; out: the part's first output; N:
// the block's values), n <= COLUMN_BATCH.
using ColumnKernel = void (*)(const uint8_t* const* recs, const float* c, int n, int rows, const ColumnPart& p,
                              int64_t b0, int64_t b1, float* out, int64_t ld);

namespace scalar {
void axpy_columns(const uint8_t* const* recs, const float* c, int n, int rows, const ColumnPart& p, int64_t b0,
                  int64_t b1, float* out, int64_t ld);
}
namespace avx2 {
void axpy_columns(const uint8_t* const* recs, const float* c, int n, int rows, const ColumnPart& p, int64_t b0,
                  int64_t b1, float* out, int64_t ld);
// out[k] = value k of a split (Q4_0, Q4_1) part of record `rec`, float32 (the prefill path's tiles)
void dequantize_split(const uint8_t* rec, const ColumnPart& p, float* out);
}

struct SparseInputProjection : Projection {
  torch::Tensor records;     // uint8 [in, record_bytes], Q4_0 and Q4_1 parts in chunks (above)
  torch::Tensor thresholds;  // float32 [in]: channel i is active in a row where |x_i| > thresholds[i]
  std::vector<int64_t> types, part_outputs;
  int64_t in_features, out_features;
  int64_t sparse_max_rows;  // calls with more rows take the prefill path (all columns read)

  // raw_records: per channel, its column of each part as raw GGML blocks; types, part_outputs: per
  // part, its GGML type and its number of outputs (a multiple of the type's block); destination:
  // where the repacked records go (the caller's memory, e.g. on huge pages), the raw records' shape.
  SparseInputProjection(const torch::Tensor& raw_records, std::vector<int64_t> types, std::vector<int64_t> part_outputs,
                        torch::Tensor thresholds, int64_t sparse_max_rows, torch::Tensor destination);
  torch::Tensor operator()(const torch::Tensor& x) const override;

  // (row, channel) pairs the last call selected.
  int64_t last_selected() const { return selected_.load(std::memory_order_relaxed); }

 private:
  std::vector<ColumnPart> parts_;
  mutable std::atomic<int64_t> selected_{0};

  torch::Tensor sparse_rows(const torch::Tensor& x) const;
  torch::Tensor all_channels(const torch::Tensor& x) const;
};

}  // namespace powerinfer
