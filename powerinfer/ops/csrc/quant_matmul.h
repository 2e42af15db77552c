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
//   low    4-bit and 2-bit q, in steps of 4 inputs: step s holds inputs 4s + 2t + i of pairs t = 0, 1,
//          output o's pair t at byte 2 slot(o) + t of 32 bytes (slot(o): o with bits 2 and 3 swapped);
//          4-bit: 32 bytes per step, input i of the pair in nibble i; 2-bit: steps 2u, 2u + 1 share 32
//          bytes, input i of the pair at bits 4 (s % 2) + 2i
//          8-bit (Q8_0): [n / 2][16][2] int8, inputs 2p, 2p+1
//   high   the high bits of q (Q5: bit 4; Q3_K: bit 2; Q6_K: bits 4, 5) in groups of 8 / high_bits
//          steps, per group two planes of 32 bytes, one per pair t: byte 2 slot(o) + i of plane t
//          holds the high bits of input 4s + 2t + i of output o for every step s of the group, step
//          u of the group at bits high_bits u
// (low_place, high_place.) Why: AVX2 splits a step's 32 bytes with in-lane byte interleaves into
// outputs 0-7 and 8-15 with each output's 4 inputs adjacent, so that one vpmaddubsw + vpmaddwd sums
// them per output and x needs no shuffle, and interleaves the two planes with 16-bit unpacks to
// match; AVX-512 reads a pair's 16 outputs as one vector of 32-bit lanes in slot order (and permutes
// its per-output scales and results to match).
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

// Chunks are read front to back, but the hardware prefetchers fall behind: the row kernels fetch the
// chunk about PREFETCH_BYTES ahead of the one they compute. Measured from memory, one thread, two chunks
// ahead: Q5_K 6.5 -> 13.9 GB/s, Q6_K 6.0 -> 12.5 (16 in cache). Two chunks of the 32-weight types are
// only 0.6-1.1 KB: 8 KB ahead, a 7B-width Q4_0 model decoded 1.4x faster on an Emerald Rapids Xeon
// (AVX2 kernels, 2 threads; 4 KB ahead: 1.2x). The K-quants' chunks are 1.3-3.4 KB: a Q4_K_M model, now 3-7
// chunks ahead, did not change clearly.
constexpr int64_t PREFETCH_BYTES = 8192;
constexpr int64_t prefetch_chunks(const PackedLayout& l) { return (PREFETCH_BYTES + l.bytes - 1) / l.bytes; }

constexpr int64_t STEP = 4;  // inputs per step of the 2- and 4-bit layouts: two pairs

// Output o's slot in a step's bytes: o with bits 2 and 3 swapped (an involution).
constexpr int slot_of(int o) { return (o & 3) | (o & 4) << 1 | (o & 8) >> 1; }
// The same order as a shuffle immediate over 4 quarters of 4 outputs: quarters 0, 2, 1, 3.
constexpr int SLOT_QUARTERS = 0xD8;
static_assert(slot_of(4) == 8 && slot_of(8) == 4 && (SLOT_QUARTERS >> 2 & 3) == 2 && (SLOT_QUARTERS >> 4 & 3) == 1,
              "SLOT_QUARTERS swaps the quarters that slot_of swaps");

// Where a bit field of weight (output o, input k) lies in a chunk.
struct BitPlace {
  int64_t byte;
  int shift;
};

// The low bits of q (8-bit: the whole int8, shift 0).
constexpr BitPlace low_place(const PackedLayout& l, int o, int64_t k) {
  const int64_t s = k / STEP, t = k % STEP / 2, i = k % 2;
  if (l.low_bits == 8) return {l.low + k / 2 * 2 * COLS + 2 * o + i, 0};
  if (l.low_bits == 4) return {l.low + s * 2 * COLS + 2 * slot_of(o) + t, static_cast<int>(4 * i)};
  return {l.low + s / 2 * 2 * COLS + 2 * slot_of(o) + t, static_cast<int>(4 * (s % 2) + 2 * i)};
}

constexpr int64_t high_group_steps(const PackedLayout& l) { return 8 / l.high_bits; }

// Plane t of step s's group, and where step s's field lies in its bytes.
constexpr int64_t high_plane(const PackedLayout& l, int64_t s, int64_t t) { return l.high + s / high_group_steps(l) * 4 * COLS + t * 2 * COLS; }
constexpr int high_field_bit(const PackedLayout& l, int64_t s) { return static_cast<int>(l.high_bits * (s % high_group_steps(l))); }

// The high bits of q (formats with high_bits > 0).
constexpr BitPlace high_place(const PackedLayout& l, int o, int64_t k) {
  const int64_t s = k / STEP;
  return {high_plane(l, s, k % STEP / 2) + 2 * slot_of(o) + k % 2, high_field_bit(l, s)};
}

// One weight matrix in the packed layout, its rows written to out[:, column:column + rows].
struct PackedMatrix {
  const BlockFormat* format;
  PackedLayout layout;
  const uint8_t* chunks;  // [ceil(rows / 16)][K / n][layout.bytes]
  int64_t rows, column;
};

// Chunk of n_rows outputs (COLS at most; the rest zero) of one block of format f, from their decoded
// blocks (ggml_blocks.h): quant_repack's rows, and prefill's channel runs (sparse_input.h).
void pack_decoded(const BlockFormat& f, const PackedLayout& l, const DecodedBlock* blocks, int n_rows, uint8_t* chunk);
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

OutputBlockKernel output_block_kernel(Isa isa);  // the instruction set's kernel
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
