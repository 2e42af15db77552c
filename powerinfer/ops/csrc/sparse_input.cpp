// SparseInputProjection (sparse_input.h): the channel selection, the split of the outputs over
// threads, the prefill path, and the scalar column kernel (CPUs without AVX2);
// sparse_input_simd.cpp holds the AVX2 one.
#include "sparse_input.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "neuron_kernels.h"

namespace powerinfer {

namespace scalar {

namespace {

void axpy_row(const uint8_t* const* recs, const float* c, int n, const ColumnPart& p, int64_t b0, int64_t b1, float* out) {
  const BlockFormat& f = *p.format;
  DecodedBlock q;
  float a[QK_K / QK_SUB], b[QK_K / QK_SUB];
  for (int64_t blk = b0; blk < b1; ++blk) {
    float* o = out + blk * f.n;
    for (int j = 0; j < n; ++j) {
      if (p.split) {  // w = d q + m, m = -8 d for Q4_0
        const uint8_t* nibbles = recs[j] + p.nibbles_at(blk);
        const float d = half_to_float(recs[j] + p.d_at(blk));
        const float m = f.has_min ? half_to_float(recs[j] + p.m_at(blk)) : -8.0f * d;
        for (int k = 0; k < QK; ++k) o[k] += c[j] * (d * static_cast<float>(k < 16 ? nibbles[k] & 0x0F : nibbles[k - 16] >> 4) + m);
        continue;
      }
      const uint8_t* block = recs[j] + p.q_off + blk * f.bytes;
      decode_block(f, block, q);
      axpy_coefficients(f, block, c[j], a, b);
      for (int64_t k = 0; k < f.n; ++k) o[k] += a[k / QK_SUB] * q.q[k] + b[k / QK_SUB];
    }
  }
}

}  // namespace

void axpy_columns(const uint8_t* const* recs, const float* c, int n, int rows, const ColumnPart& p, int64_t b0,
                  int64_t b1, float* out, int64_t ld) {
  for (int r = 0; r < rows; ++r) axpy_row(recs, c + r * COLUMN_BATCH, n, p, b0, b1, out + r * ld);
}

}  // namespace scalar

namespace {

ColumnKernel column_kernel() {
  switch (active_isa()) {
#ifdef POWERINFER_X86
    case Isa::AVX512:  // the AVX2 kernel: column accumulation is bound by memory, not by vector width
    case Isa::AVX2: return avx2::axpy_columns;
#endif
    default: return scalar::axpy_columns;
  }
}

// Prefill: columns dequantized per tile of channels of at most this many float32 bytes, which stay
// in cache for the product (measured, 4096 x 4096 Q4_0, 9 rows, one thread: 16 MiB tiles 27 ms,
// 1 MiB 13 ms).
constexpr int64_t TILE_BYTES = 1 << 20;

// The outputs [begin, end) of one task, as a block range per part: blocks [block(begin), block(end)),
// rounding each bound up to a whole block, so neighbouring tasks share no block and miss none.
struct OutputRange {
  int64_t begin, end;

  int64_t block(const ColumnPart& p, int64_t at) const {
    const int64_t n = p.format->n;
    return std::clamp<int64_t>((at - p.first_output + n - 1) / n, 0, p.n_blocks);
  }
  std::pair<int64_t, int64_t> blocks(const ColumnPart& p) const { return {block(p, begin), block(p, end)}; }
};

// Outputs per task at least this many: fewer would cost more in thread start than they save.
constexpr int64_t MIN_TASK_OUTPUTS = 512;

}  // namespace

SparseInputProjection::SparseInputProjection(const torch::Tensor& raw, std::vector<int64_t> types_,
                                             std::vector<int64_t> part_outputs_, torch::Tensor thresholds_,
                                             int64_t sparse_max_rows_, torch::Tensor destination)
    : thresholds(std::move(thresholds_)), types(std::move(types_)), part_outputs(std::move(part_outputs_)),
      out_features(0), sparse_max_rows(sparse_max_rows_) {
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.dim() == 2, "column records must be uint8 [in, record bytes]");
  TORCH_CHECK(!types.empty() && types.size() == part_outputs.size(), "one GGML type and output count per part");
  in_features = raw.size(0);
  TORCH_CHECK(thresholds.dtype() == torch::kFloat32 && thresholds.dim() == 1 && thresholds.is_contiguous() &&
                  thresholds.size(0) == in_features,
              "thresholds must be contiguous float32 [", in_features, "]");
  int64_t offset = 0;
  for (size_t p = 0; p < types.size(); ++p) {
    const BlockFormat& f = block_format(types[p]);
    TORCH_CHECK(part_outputs[p] > 0 && part_outputs[p] % f.n == 0, "part ", p, ": ", part_outputs[p],
                " outputs are not whole blocks of ", f.n);
    const int64_t n_blocks = part_outputs[p] / f.n;
    const bool split = f.type == GgmlType::Q4_0 || f.type == GgmlType::Q4_1;
    parts_.push_back({&f, split, offset, n_blocks, out_features});
    offset += n_blocks * f.bytes;
    out_features += part_outputs[p];
  }
  TORCH_CHECK(offset == raw.size(1), "these parts take ", offset, " bytes per channel, the records hold ", raw.size(1));
  TORCH_CHECK(destination.dtype() == torch::kUInt8 && destination.sizes() == raw.sizes() && destination.is_contiguous(),
              "the destination of the records must be contiguous uint8 of the records' shape");
  records = std::move(destination);
  const auto source = raw.contiguous();
  at::parallel_for(0, in_features, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* from = source.data_ptr<uint8_t>() + i * offset;
      uint8_t* to = records.data_ptr<uint8_t>() + i * offset;
      for (const ColumnPart& p : parts_) {
        const uint8_t* blocks = from + p.q_off;
        if (!p.split) {
          std::memcpy(to + p.q_off, blocks, p.bytes());
          continue;
        }
        const bool min = p.format->has_min;
        for (int64_t b = 0; b < p.n_blocks; ++b) {  // a block: d, (m,) 16 bytes of nibbles
          const uint8_t* block = blocks + b * p.format->bytes;
          std::memcpy(to + p.d_at(b), block, 2);
          if (min) std::memcpy(to + p.m_at(b), block + 2, 2);
          std::memcpy(to + p.nibbles_at(b), block + (min ? 4 : 2), 16);
        }
      }
    }
  });
}

torch::Tensor SparseInputProjection::operator()(const torch::Tensor& x) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features, "x must be [rows, ", in_features, "]");
  const auto xf = x.to(torch::kFloat32).contiguous();
  return xf.size(0) <= sparse_max_rows ? sparse_rows(xf) : all_channels(xf);
}

torch::Tensor SparseInputProjection::sparse_rows(const torch::Tensor& x) const {
  const int64_t M = x.size(0), K = in_features, stride = records.size(1);
  const float* xs = x.data_ptr<float>();
  const float* limit = thresholds.data_ptr<float>();
  // per group of channels: those some row selects, and each row's coefficients for them (0: skipped)
  std::vector<int32_t> ids;
  std::vector<int64_t> group_end;  // ids[group_end[g - 1] .. group_end[g])
  std::vector<float> coefficients;  // per group: [M][COLUMN_BATCH]
  int64_t selected = 0;
  for (int64_t g0 = 0; g0 < K; g0 += COLUMN_BATCH) {
    const size_t first = ids.size(), c0 = coefficients.size();
    coefficients.resize(c0 + M * COLUMN_BATCH, 0.0f);
    for (int64_t i = g0; i < std::min(K, g0 + COLUMN_BATCH); ++i) {
      const int64_t j = static_cast<int64_t>(ids.size() - first);
      bool any = false;
      for (int64_t m = 0; m < M; ++m) {
        const float v = xs[m * K + i];
        if (std::fabs(v) <= limit[i]) continue;
        coefficients[c0 + m * COLUMN_BATCH + j] = v;
        any = true;
        ++selected;
      }
      if (any) ids.push_back(static_cast<int32_t>(i));
    }
    if (ids.size() == first) coefficients.resize(c0);
    else group_end.push_back(static_cast<int64_t>(ids.size()));
  }
  selected_.store(selected, std::memory_order_relaxed);

  auto y = torch::zeros({M, out_features}, x.options());
  float* out = y.data_ptr<float>();
  const uint8_t* base = records.data_ptr<uint8_t>();
  const ColumnKernel kernel = column_kernel();
  const int64_t groups = static_cast<int64_t>(group_end.size());
  const int64_t tasks = std::clamp<int64_t>(out_features / MIN_TASK_OUTPUTS, 1, at::get_num_threads());
  at::parallel_for(0, tasks, 1, [&](int64_t first_task, int64_t end_task) {
    for (int64_t t = first_task; t < end_task; ++t) {
      const OutputRange range{out_features * t / tasks, out_features * (t + 1) / tasks};
      // the first bytes of this task's part of column i, into L2 ahead of use (the order of the
      // columns is the data's, which hardware prefetchers cannot follow); split kernels fetch the
      // rest of a column ahead of themselves
      const auto prefetch_column = [&](int32_t i) {
        const uint8_t* record = base + i * stride;
        for (const ColumnPart& p : parts_) {
          const auto [b0, b1] = range.blocks(p);
          if (b0 >= b1) continue;
          const int64_t ahead = p.split ? std::min(b1 - b0, SPLIT_PREFETCH_BLOCKS) : b1 - b0;
          prefetch(record + (p.split ? p.chunk_start(b0) : p.q_off + b0 * p.format->bytes), ahead * p.format->bytes);
        }
      };
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t j0 = g ? group_end[g - 1] : 0, j1 = group_end[g];
        if (g + 1 < groups)
          for (int64_t j = j1; j < group_end[g + 1]; ++j) prefetch_column(ids[j]);
        const uint8_t* recs[COLUMN_BATCH];
        for (int64_t j = j0; j < j1; ++j) recs[j - j0] = base + ids[j] * stride;
        for (const ColumnPart& p : parts_) {
          const auto [b0, b1] = range.blocks(p);
          if (b0 < b1)
            kernel(recs, coefficients.data() + g * M * COLUMN_BATCH, static_cast<int>(j1 - j0), static_cast<int>(M), p, b0,
                   b1, out + p.first_output, out_features);
        }
      }
    }
  });
  return y;
}

torch::Tensor SparseInputProjection::all_channels(const torch::Tensor& x_all) const {
  // the rows' own selections, as zeros: a row's result does not depend on the size of its call
  const auto active = x_all.abs() > thresholds;
  selected_.store(active.sum().item<int64_t>(), std::memory_order_relaxed);
  const auto x = x_all * active;
  const int64_t stride = records.size(1);
  const int64_t tile_rows = std::clamp<int64_t>(TILE_BYTES / (4 * out_features), 1, in_features);
  auto y = torch::zeros({x.size(0), out_features}, x.options());
  auto tile = torch::empty({tile_rows, out_features}, x.options());
  const uint8_t* base = records.data_ptr<uint8_t>();
  float* columns = tile.data_ptr<float>();
  const ColumnKernel kernel = column_kernel();
  const float one = 1.0f;
  for (int64_t i0 = 0; i0 < in_features; i0 += tile_rows) {
    const int64_t n = std::min(tile_rows, in_features - i0);
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        float* row = columns + i * out_features;
        const uint8_t* record = base + (i0 + i) * stride;
        for (const ColumnPart& p : parts_) {
          float* values = row + p.first_output;
#ifdef POWERINFER_X86
          if (p.split && active_isa() != Isa::SCALAR) {  // the values themselves: no coefficients to round
            avx2::dequantize_split(record, p, values);
            continue;
          }
#endif
          std::fill(values, values + p.n_blocks * p.format->n, 0.0f);
          kernel(&record, &one, 1, 1, p, 0, p.n_blocks, values, 0);
        }
      }
    });
    y.addmm_(x.narrow(1, i0, n), tile.narrow(0, 0, n));
  }
  return y;
}

}  // namespace powerinfer
