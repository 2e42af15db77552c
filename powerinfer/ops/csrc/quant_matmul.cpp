// QuantLinear: repacking GGML blocks into the layout of quant_matmul.h, the scalar kernel, and
// the call that spreads output blocks over threads with the kernel of the active instruction set.
#include "quant_matmul.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "projection.h"

namespace powerinfer {

int64_t quant_packed_bytes(int64_t type, int64_t rows, int64_t row_bytes) {
  const BlockFormat& f = block_format(type);
  TORCH_CHECK(rows >= 0 && row_bytes % f.bytes == 0, "raw rows must be whole blocks of ", f.bytes, " bytes");
  return (rows + COLS - 1) / COLS * (row_bytes / f.bytes) * packed_layout(f).bytes;
}

void pack_decoded(const BlockFormat& f, const PackedLayout& l, const DecodedBlock* blocks, int n_rows, uint8_t* chunk) {
  std::memset(chunk, 0, l.bytes);
  for (int o = 0; o < n_rows; ++o) {
    const DecodedBlock& b = blocks[o];
    std::memcpy(chunk + l.d + 2 * o, &b.d, 2);
    if (l.dmin >= 0) std::memcpy(chunk + l.dmin + 2 * o, &b.dmin, 2);
    for (int64_t j = 0; f.sub_scales && j < f.n_sub(); ++j) {
      chunk[l.sc + j * COLS + o] = l.nibble_scales ? static_cast<uint8_t>(b.sc[j] | (b.mn[j] << 4)) : static_cast<uint8_t>(b.sc[j]);
      if (l.mn >= 0) chunk[l.mn + j * COLS + o] = b.mn[j];
    }
    for (int64_t k = 0; k < f.n; ++k) {
      const int q = b.q[k];
      const BitPlace low = low_place(l, o, k);
      if (l.low_bits == 8) chunk[low.byte] = static_cast<uint8_t>(q ^ 0x80);  // back to int8
      else chunk[low.byte] |= (q & ((1 << l.low_bits) - 1)) << low.shift;
      if (l.high_bits > 0) {
        const BitPlace high = high_place(l, o, k);
        chunk[high.byte] |= (q >> l.low_bits) << high.shift;
      }
    }
  }
}

torch::Tensor quant_repack(const torch::Tensor& raw, int64_t type, const torch::Tensor& destination) {
  const BlockFormat& f = block_format(type);
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.dim() == 2 && raw.size(1) % f.bytes == 0, "raw rows must be uint8 [rows, k * ", f.bytes, "]");
  const auto rows = raw.contiguous();
  const PackedLayout l = packed_layout(f);
  const int64_t n_rows = rows.size(0), n_blocks = rows.size(1) / f.bytes, row_bytes = rows.size(1);
  const int64_t bytes = quant_packed_bytes(type, n_rows, row_bytes);
  TORCH_CHECK(destination.dtype() == torch::kUInt8 && destination.is_contiguous() && destination.numel() == bytes,
              "the destination must be contiguous uint8 of the packed matrix's bytes (", bytes, ")");
  auto out = destination.view({(n_rows + COLS - 1) / COLS, n_blocks, l.bytes});
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, out.size(0), 1, [&](int64_t begin, int64_t end) {
    DecodedBlock blocks[COLS];
    for (int64_t nb = begin; nb < end; ++nb) {
      const int n = static_cast<int>(std::min(COLS, n_rows - nb * COLS));
      for (int64_t sb = 0; sb < n_blocks; ++sb) {
        for (int o = 0; o < n; ++o) decode_block(f, src + (nb * COLS + o) * row_bytes + sb * f.bytes, blocks[o]);
        pack_decoded(f, l, blocks, n, dst + (nb * n_blocks + sb) * l.bytes);
      }
    }
  });
  return out;
}

PreparedInput prepare_input(const float* x, int64_t M, int64_t K, Isa isa) {
  const int64_t G = std::min(M, TASK_ROWS), groups = (M + G - 1) / G;
  PreparedInput p{M, K, G};
  if (isa == Isa::AVX2) {
    p.q8.resize(M * K);
    p.scale.resize(M * K / QK);
    p.qsum16.resize(M * K / QK_SUB);
    p.qsum32.resize(M * K / QK);
  } else {
    if (isa == Isa::AVX512) p.pairs.resize(groups * G * K / 2);
    else p.f32.resize(M * K);
    p.sum16.resize(M * K / QK_SUB);
    p.sum32.resize(M * K / QK);
  }
  // Groups of rows in parallel: at prefill (hundreds of rows) a serial pass would cost a good part
  // of what the products do.
  at::parallel_for(0, groups, std::max<int64_t>(1, 16384 / (G * K)), [&](int64_t begin, int64_t end) {
    const int64_t m0 = begin * G, m1 = std::min(M, end * G);
    switch (isa) {
#ifdef POWERINFER_X86
      case Isa::AVX512: avx512::prepare_rows(x, m0, m1, p); break;
      case Isa::AVX2: avx2::prepare_rows(x, m0, m1, p); return;  // its own sums
#endif
      default:
        for (int64_t g = m0 * K / QK_SUB; g < m1 * K / QK_SUB; ++g) {
          float sum = 0.0f;
          for (int64_t i = g * QK_SUB; i < (g + 1) * QK_SUB; ++i) {
            p.f32[i] = bf16_value(bf16_bits(x[i]));
            sum += p.f32[i];
          }
          p.sum16[g] = sum;
        }
    }
    for (int64_t g = m0 * K / QK; g < m1 * K / QK; ++g) p.sum32[g] = p.sum16[2 * g] + p.sum16[2 * g + 1];
  });
  return p;
}

namespace scalar {

namespace {

// q - offset of every weight of a chunk, per output: w[o][k] (the plane layouts of quant_matmul.h).
void unpack_chunk(const BlockFormat& f, const PackedLayout& l, const uint8_t* chunk, float (*w)[QK_K]) {
  const float offset = l.low_bits == 8 ? 0.0f : static_cast<float>(f.offset);
  for (int o = 0; o < COLS; ++o)
    for (int64_t k = 0; k < f.n; ++k) {
      const BitPlace low = low_place(l, o, k);
      int q = l.low_bits == 8 ? static_cast<int8_t>(chunk[low.byte]) : (chunk[low.byte] >> low.shift) & ((1 << l.low_bits) - 1);
      if (l.high_bits > 0) {
        const BitPlace high = high_place(l, o, k);
        q += ((chunk[high.byte] >> high.shift) & ((1 << l.high_bits) - 1)) << l.low_bits;
      }
      w[o][k] = static_cast<float>(q) - offset;
    }
}

}  // namespace

void quant_output_block(const PackedMatrix& w, int64_t nb, const PreparedInput& x, int64_t m0, int rows, float* out,
                        int64_t ldc, int cols) {
  const BlockFormat& f = *w.format;
  const PackedLayout& l = w.layout;
  const int64_t n_blocks = x.K / f.n;
  float values[COLS][QK_K];
  std::vector<float> acc(static_cast<size_t>(rows) * COLS, 0.0f);
  for (int64_t sb = 0; sb < n_blocks; ++sb) {
    const uint8_t* chunk = w.chunks + (nb * n_blocks + sb) * l.bytes;
    unpack_chunk(f, l, chunk, values);
    for (int o = 0; o < cols; ++o) {
      const float d = half_to_float(chunk + l.d + 2 * o);
      const float dmin = l.dmin >= 0 ? half_to_float(chunk + l.dmin + 2 * o) : 0.0f;
      for (int64_t j = 0; j < f.n_sub(); ++j) {
        int sc = 1, mn = 1;
        if (f.sub_scales) {
          const uint8_t s = chunk[l.sc + j * COLS + o];
          sc = l.nibble_scales ? s & 0x0F : static_cast<int8_t>(s);
          mn = l.nibble_scales ? s >> 4 : l.mn >= 0 ? chunk[l.mn + j * COLS + o] : 1;
        }
        const float* v = values[o] + j * f.sub;
        for (int r = 0; r < rows; ++r) {
          const float* xr = x.f32.data() + (m0 + r) * x.K + sb * f.n + j * f.sub;
          float dot = 0.0f;
          for (int64_t k = 0; k < f.sub; ++k) dot += xr[k] * v[k];
          const float sum = (f.sub == QK_SUB ? x.sum16 : x.sum32)[(m0 + r) * (x.K / f.sub) + sb * f.n_sub() + j];
          acc[r * COLS + o] += d * static_cast<float>(sc) * dot + (f.has_min ? dmin * static_cast<float>(mn) * sum : 0.0f);
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) std::memcpy(out + r * ldc, acc.data() + r * COLS, cols * sizeof(float));
}

}  // namespace scalar

OutputBlockKernel output_block_kernel(Isa isa) {
  switch (isa) {
#ifdef POWERINFER_X86
    case Isa::AVX512: return avx512::quant_output_block;
    case Isa::AVX2: return avx2::quant_output_block;
#endif
    default: return scalar::quant_output_block;
  }
}

QuantProjection::QuantProjection(std::vector<torch::Tensor> chunks_, std::vector<int64_t> types_, std::vector<int64_t> rows_)
    : chunks(std::move(chunks_)), types(std::move(types_)), rows(std::move(rows_)), out_features(0) {
  TORCH_CHECK(!chunks.empty() && chunks.size() == types.size() && chunks.size() == rows.size(), "one type and row count per matrix");
  in_features = -1;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const BlockFormat& f = block_format(types[i]);
    const torch::Tensor& c = chunks[i];
    TORCH_CHECK(c.dtype() == torch::kUInt8 && c.dim() == 3 && c.is_contiguous() && c.size(2) == packed_layout(f).bytes &&
                    c.size(0) == (rows[i] + COLS - 1) / COLS,
                "packed matrix ", i, " does not have the layout of its type (quant_repack's output)");
    const int64_t k = c.size(1) * f.n;
    TORCH_CHECK(in_features < 0 || in_features == k, "matrices of one projection differ in input size");
    in_features = k;
    out_features += rows[i];
  }
}

torch::Tensor QuantProjection::operator()(const torch::Tensor& x) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features, "x must be [rows, ", in_features, "]");
  const auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0);
  const Isa isa = quant_kernel_isa();
  const PreparedInput input = prepare_input(xf.data_ptr<float>(), M, in_features, isa);
  auto out = torch::empty({M, out_features}, xf.options());
  std::vector<PackedMatrix> matrices;
  std::vector<int64_t> first_task;  // per matrix: its first task; tasks: (output block, row block)
  const int64_t row_blocks = (M + TASK_ROWS - 1) / TASK_ROWS;
  int64_t tasks = 0, column = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const BlockFormat& f = block_format(types[i]);
    matrices.push_back({&f, packed_layout(f), chunks[i].data_ptr<uint8_t>(), rows[i], column});
    first_task.push_back(tasks);
    tasks += chunks[i].size(0) * row_blocks;
    column += rows[i];
  }
  const OutputBlockKernel kernel = output_block_kernel(isa);
  float* y = out.data_ptr<float>();
  at::parallel_for(0, tasks, 0, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const size_t i = std::upper_bound(first_task.begin(), first_task.end(), t) - first_task.begin() - 1;
      const PackedMatrix& w = matrices[i];
      const int64_t local = t - first_task[i], nb = local / row_blocks, m0 = (local % row_blocks) * TASK_ROWS;
      const int n_rows = static_cast<int>(std::min(TASK_ROWS, M - m0));
      const int cols = static_cast<int>(std::min(COLS, w.rows - nb * COLS));
      kernel(w, nb, input, m0, n_rows, y + m0 * out_features + w.column + nb * COLS, out_features, cols);
    }
  });
  return out;
}

Int4Projection::Int4Projection(torch::Tensor packed_, torch::Tensor scale_zero_, int64_t out_features_, int64_t repeats_)
    : packed(std::move(packed_)), scale_zero(std::move(scale_zero_)), out_features(out_features_), repeats(repeats_) {}

torch::Tensor Int4Projection::operator()(const torch::Tensor& x) const {
  torch::Tensor input = x.to(torch::kBFloat16);
  if (repeats > 1) input = torch::cat(std::vector<torch::Tensor>(repeats, input), 1);
  torch::Tensor y = at::_weight_int4pack_mm_for_cpu(input, packed, QK, scale_zero);
  return y.size(1) == out_features ? y : y.narrow(1, 0, out_features);
}

}  // namespace powerinfer
