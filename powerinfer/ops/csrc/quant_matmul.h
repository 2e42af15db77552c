// y = x @ W.T over quantized weights kept in their blocks, repacked for SIMD (QuantLinear).
//
// Arithmetic. AVX-512 and scalar: x is rounded to bfloat16. A weight's integer q (at most 7 bits)
// becomes the bfloat16 number 128 + q, whose bits are just 0x4300 | q; one `vdpbf16ps` (AVX-512
// BF16) then multiplies 32 activation-weight pairs exactly and adds them in float32, and per sub-block
//     sum_k x_k w_k = d sc * sum_k x_k (128 + q_k) + (dmin mn - (128 + offset) d sc) * sum_k x_k
// (the float32 sum of the sub-block's bfloat16 inputs is computed once per row). Q8_0's int8 values
// are exact in bfloat16 themselves. The scalar path computes the same sums directly.
// AVX2 (no bfloat16 dot product): x is rounded to int8 per block of 32 (INT8_X_MAX), as llama.cpp
// does, and per sub-block, with x = dx xq,
//     sum_k x_k w_k = dx * (d sc sum_k xq_k q_k + (dmin mn - offset d sc) sum_k xq_k)
// with integer sums (quant_matmul_avx2.cpp). The minimum multiplies the rounded x's sum, not x's own:
// the error of the rounding then meets the weights, centred, rather than d sc q, whose mean is far
// from zero (measured on SmolLM2 Q4_1: mean |logit error| 0.38 with exact sums).
// Each row's result depends on that row only, so a row gets the same bits whatever rows share the call.
//
// Layout: the weight rows are grouped in blocks of COLS = 16 outputs (zero rows pad the last);
// per output block and per block of the format (32 or 256 inputs) one chunk of bytes, which holds
// for the 16 outputs, in this order (offsets: PackedLayout):
//   d      float16 [16]
//   dmin   float16 [16]            formats with a minimum (signed as applied)
//   sc     int8 [n_sub][16]        K-quants: sub-block scales (Q2_K: scale | minimum << 4)
//   mn     uint8 [n_sub][16]       Q4_K, Q5_K: sub-block minimums
//   low    4-bit q: [n / 2][16] bytes, per input pair (2p, 2p+1): low nibble input 2p
//          2-bit q: [n / 4][16] bytes, per input quad 4p..4p+3: bits 2i, 2i+1 input 4p + i
//          8-bit (Q8_0): [n / 2][16][2] int8, inputs 2p, 2p+1
//   high   per input pair, one uint32 per high bit of q (Q5: bit 4; Q6_K: bits 4, 5; Q3_K: bit 2):
//          bit 2o + i is that bit of input 2p + i of output o
// That is the file's size per weight within a few percent (Q4_K 148 bytes per 256 weights against
// 144, Q6_K and the 32-weight formats exactly).
// Plain-torch reference: dequantization (gguf.quants) times x in bfloat16 (tests/test_quant_kernels.py).
#pragma once

#include "ggml_blocks.h"

#include <vector>

namespace powerinfer {

constexpr int64_t COLS = 16;       // outputs per block: one AVX-512 float32 vector
constexpr int64_t TASK_ROWS = 8;  // rows of x sharing one pass over an output block's weights (a kernel call)

struct PackedLayout {
  int64_t d = -1, dmin = -1, sc = -1, mn = -1, low = -1, high = -1, bytes = 0;  // offsets in a chunk (-1: absent)
  int low_bits = 0, high_bits = 0;
  bool nibble_scales = false;  // Q2_K: sc holds scale | minimum << 4 (4 bits each), no mn
};

constexpr PackedLayout packed_layout(const BlockFormat& f) {
  PackedLayout l;
  l.low_bits = f.q_bits == 8 ? 8 : f.q_bits >= 4 ? 4 : 2;
  l.high_bits = f.q_bits == 8 ? 0 : f.q_bits - l.low_bits;
  l.nibble_scales = f.type == GgmlType::Q2_K;
  int64_t at = 0;
  l.d = at, at += 2 * COLS;
  if (f.has_min) l.dmin = at, at += 2 * COLS;
  if (f.sub_scales) l.sc = at, at += f.n_sub() * COLS;
  if (f.sub_scales && f.has_min && !l.nibble_scales) l.mn = at, at += f.n_sub() * COLS;
  l.low = at, at += f.n * l.low_bits / 8 * COLS;
  if (l.high_bits > 0) l.high = at, at += f.n / 2 * l.high_bits * 4;
  l.bytes = at;
  return l;
}

// One weight matrix in the packed layout, its rows written to out[:, column:column + rows].
struct PackedMatrix {
  const BlockFormat* format;
  PackedLayout layout;
  const uint8_t* chunks;  // [ceil(rows / 16)][K / n][layout.bytes]
  int64_t rows, column;
};

// x prepared for the kernels of one instruction set.
// AVX-512 and scalar: the float32 sum of every 16 and every 32 of each row's inputs rounded to
// bfloat16, and the rounded inputs. For the AVX-512 kernel they are bfloat16 pairs (inputs 2k,
// 2k + 1 in one uint32, the even one low) with the rows of each group of G = min(M, TASK_ROWS)
// interleaved, pairs[((m / G) * K / 2 + k) * G + m % G]: the rows a kernel call broadcasts for one
// pair are adjacent, reached from one pointer (eight row pointers spilled registers in its inner
// loop); for the scalar one float32 rows.
// AVX2: per row the int8 values q8, per 32 inputs their scale, per 16 and 32 the sums of the int8
// values (qsum, as floats).
struct PreparedInput {
  int64_t M, K, G;
  std::vector<uint32_t> pairs;
  std::vector<float> f32, sum16, sum32;
  std::vector<int8_t> q8;
  std::vector<float> scale, qsum16, qsum32;
};

PreparedInput prepare_input(const float* x, int64_t M, int64_t K, Isa isa);

// out[m0 + r, column + 16 nb + o] for rows r < rows (<= TASK_ROWS), outputs o < cols of output block nb.
using OutputBlockKernel = void (*)(const PackedMatrix& w, int64_t nb, const PreparedInput& x, int64_t m0, int rows,
                                   float* out, int64_t ldc, int cols);

namespace scalar { void quant_output_block(const PackedMatrix&, int64_t, const PreparedInput&, int64_t, int, float*, int64_t, int); }
namespace avx2 {
void quant_output_block(const PackedMatrix&, int64_t, const PreparedInput&, int64_t, int, float*, int64_t, int);
void prepare_rows(const float* x, int64_t m_begin, int64_t m_end, PreparedInput& p);  // q8, scales and sums of these rows
}
namespace avx512 {
void quant_output_block(const PackedMatrix&, int64_t, const PreparedInput&, int64_t, int, float*, int64_t, int);
void prepare_rows(const float* x, int64_t m_begin, int64_t m_end, PreparedInput& p);  // pairs and sum16 of these rows
}

}  // namespace powerinfer
