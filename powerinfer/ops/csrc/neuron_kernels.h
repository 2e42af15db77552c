// Neuron-aware sparse FFN operators on quantized neuron records: the shared pieces of the scalar
// (neuron_kernels.cpp) and SIMD (neuron_kernels_simd.cpp) dot products and row accumulations.
//
// Each FFN neuron i owns one contiguous record (a row of a uint8 tensor [n_ff, record_bytes]) that
// holds its gate row, up row and ffn_down_t row ("sections"), so computing an active neuron reads
// one contiguous stretch of memory. A section is described by six integers:
//   {q_off, d_off, m_off, bits, n_values, type}  (byte offsets within the record)
//   bits 4: n_values/32 blocks, w = d_b * q + m_b; q: 16 bytes per block, weight k in the low nibble
//           of byte k and weight k+16 in the high one; d, m float16 per block (m_off < 0: m_b = -8 d_b)
//   bits 8: w = d_b * q, q int8 (32 per block), d float16 per block
//   bits 32: float32 values (d_off, m_off unused)
//   bits 0: the row as the file's blocks of GGML type `type` (ggml_blocks.h), from q_off
//
// Dot products with quantized rows round x to int8 per block of 32 (as llama.cpp does) and multiply
// integers exactly; offsets and minimums multiply exact float32 sums of x; accumulation is float32.
// Plain-torch references: powerinfer/sparse/neurons.py.
#pragma once

#include "ggml_blocks.h"

#include <vector>

namespace powerinfer {

struct Section {
  int64_t q_off, d_off, m_off, bits, n_values;
  const BlockFormat* format;  // bits 0
  int64_t n_blocks() const { return n_values / QK; }
};

// x rounded to int8 per block of 32, in the orders the kernels consume.
struct QuantizedX {
  std::vector<int8_t> q4;   // 4-bit rows: per 4 blocks, 64 partners of the low nibbles then 64 of the high
  std::vector<int8_t> q8;   // in order
  std::vector<float> scale;  // per 32: the int8 scale (scale and sum: zeros up to a multiple of 8 blocks)
  std::vector<float> sum;    // per 32: exact float32 sum of x
  std::vector<float> sum16;  // per 16: exact float32 sum of x
  std::vector<float> qsum16;  // per 16: sum of the int8 values
  const float* x;
};

// out += sum_r c[r] * section row of recs[r], r < n_rows.
using DotKernel = float (*)(const uint8_t* rec, const Section& s, const QuantizedX& x);
using AxpyKernel = void (*)(const uint8_t* const* recs, const float* c, int n_rows, const Section& s, float* out);

// The per-16 factors of one block of a block-format row: w . x over the block is
//   sum_g factor[g] * (q . xq over group g - offset * qsum16[g]) + sum_g min[g] * sum16[g]
// with factor[g] = d sc * scale of x, min[g] = dmin mn (groups of 16 inputs).
struct GroupFactors {
  float factor[QK_K / QK_SUB], min[QK_K / QK_SUB];
};
void group_factors(const BlockFormat& f, const uint8_t* block, const float* x_scale, GroupFactors& out);

// axpy's per-16 coefficients for c times one block: out[k] += a[g] * q[k] + b[g].
void axpy_coefficients(const BlockFormat& f, const uint8_t* block, float c, float* a, float* b);

namespace scalar {
float dot(const uint8_t* rec, const Section& s, const QuantizedX& x);
void axpy_rows(const uint8_t* const* recs, const float* c, int n_rows, const Section& s, float* out);
}  // namespace scalar
namespace avx2 {
float dot(const uint8_t* rec, const Section& s, const QuantizedX& x);
void axpy_rows(const uint8_t* const* recs, const float* c, int n_rows, const Section& s, float* out);
}  // namespace avx2
namespace avx512 {
float dot(const uint8_t* rec, const Section& s, const QuantizedX& x);
void axpy_rows(const uint8_t* const* recs, const float* c, int n_rows, const Section& s, float* out);
}  // namespace avx512

}  // namespace powerinfer
