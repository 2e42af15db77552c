// QuantLinear's AVX2 kernel (layout: quant_matmul.h). x comes rounded to int8 per block of 32
// (prepare_input); the weights' unsigned q stay bytes, and `vpmaddubsw` multiplies 32 weight-input
// pairs and adds them in pairs per instruction. The int16 sums are widened to int32 before they can
// overflow, and each sub-block's int32 sums meet their float scales once: the result is exactly the
// product of the rounded x and the weights, offsets and minimums included (as llama.cpp computes it).
// Q8_0 (signed weights) multiplies int16 pairs with `vpmaddwd` instead.
//
// What a step reads: 4 consecutive inputs 4s .. 4s + 3 of a chunk's 16 outputs. Its weights become
// two vectors (outputs 0-7, 8-15) whose 32-bit lane o holds q of that output's 4 inputs; x's 4 bytes
// repeat in every lane, and `vpmaddwd` by ones adds an output's two int16 sums when they are widened.
#include "quant_matmul.h"

#ifdef POWERINFER_X86
#include <immintrin.h>

#include "avx2_lanes.h"

POWERINFER_TARGET_AVX2
namespace powerinfer::avx2 {
namespace {

// Rows of x sharing one unpacking of the weights: each keeps two int16 sums in registers, and AVX2
// has 16 of them.
constexpr int ROW_GROUP = 4;

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Pairs of weights per int16 lane a sum can hold: |q x| <= q_max * 127 per weight.
constexpr int int16_steps(int q_bits) { return 32767 / (2 * ((1 << q_bits) - 1) * 127); }

// A step's 32 bytes of low bits -> its weights (a, b): outputs 0-7 and 8-15, byte 4o + 2t + i of
// output o's pair t, input i (the slot order of quant_matmul.h puts outputs 0-3 | 8-11 | 4-7 | 12-15 in
// the 8-byte quarters, which the in-lane byte interleaves turn into that order). Input i of a pair is
// at bits [i BITS, (i + 1) BITS) of its byte.
template <int BITS>
inline void split_pairs(__m256i v, __m256i& a, __m256i& b) {
  const __m256i mask = _mm256_set1_epi8((1 << BITS) - 1);
  const __m256i first = _mm256_and_si256(v, mask), second = _mm256_and_si256(_mm256_srli_epi16(v, BITS), mask);
  a = _mm256_unpacklo_epi8(first, second);
  b = _mm256_unpackhi_epi8(first, second);
}

// The high-bit planes of the group holding step s0 (a sub-block's first), as the halves that
// split_pairs gives: interleaving plane 0's and 1's 16-bit lanes puts each byte where the low bits of
// its input lie. Shifted so that step s0's field starts at bit 0 (only Q3_K's odd sub-blocks start
// inside a group; the bits the shift brings down from a neighbouring byte lie above every field read).
template <int64_t TYPE>
inline void sub_block_high(const uint8_t* chunk, int64_t s0, __m256i& a, __m256i& b) {
  constexpr PackedLayout L = packed_layout(*find_format(TYPE));
  const __m256i plane0 = load32(chunk + high_plane(L, s0, 0)), plane1 = load32(chunk + high_plane(L, s0, 1));
  a = _mm256_unpacklo_epi16(plane0, plane1);
  b = _mm256_unpackhi_epi16(plane0, plane1);
  if (const int phase = high_field_bit(L, s0)) a = _mm256_srli_epi16(a, phase), b = _mm256_srli_epi16(b, phase);
}

// Step s's weights of a chunk (the unsigned q, offset not taken away), as split_pairs gives them.
// With high bits: U is s's place in its sub-block, (high_a, high_b) the sub-block's sub_block_high.
template <int64_t TYPE>
inline void step_weights(const uint8_t* chunk, int64_t s, int U, __m256i high_a, __m256i high_b, __m256i& a, __m256i& b) {
  constexpr PackedLayout L = packed_layout(*find_format(TYPE));
  if constexpr (L.low_bits == 4) {
    split_pairs<4>(load32(chunk + L.low + s * 2 * COLS), a, b);
  } else {  // steps 2u and 2u + 1 share 32 bytes, the odd one in the high nibbles
    const __m256i both = load32(chunk + L.low + s / 2 * 2 * COLS);
    split_pairs<2>(s % 2 ? _mm256_srli_epi16(both, 4) : both, a, b);
  }
  if constexpr (L.high_bits > 0) {  // step U's field moved to bit low_bits (U is a constant once the step loops unroll)
    const int shift = L.low_bits - high_field_bit(L, U);
    const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << L.high_bits) - 1) << L.low_bits));
    const auto place = [&](__m256i h) {
      return _mm256_and_si256(shift >= 0 ? _mm256_slli_epi16(h, shift) : _mm256_srli_epi16(h, -shift), mask);
    };
    a = _mm256_or_si256(a, place(high_a));
    b = _mm256_or_si256(b, place(high_b));
  }
}

// x's int8 inputs 4s .. 4s + 3 as step_weights arranges the weights: repeated in every 32-bit lane.
inline __m256i step_inputs(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, 4);
  return _mm256_set1_epi32(four);
}

// int16 sums of an output's pairs (adjacent lanes) -> the output's int32 sum
inline __m256i widen(__m256i v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }

template <bool SIGNED, int NIBBLE = -1>
inline __m256 byte_vector(const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  __m256i v = SIGNED ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  if constexpr (NIBBLE >= 0) v = _mm256_and_si256(_mm256_srli_epi32(v, 4 * NIBBLE), _mm256_set1_epi32(0x0F));
  return _mm256_cvtepi32_ps(v);
}

// Per output of half h of sub-block j: d sc, and the minimum dmin mn (zero without one).
template <int64_t TYPE>
inline void sub_block_scales(const uint8_t* chunk, int64_t j, int h, __m256& dsc, __m256& min) {
  constexpr BlockFormat F = *find_format(TYPE);
  constexpr PackedLayout L = packed_layout(F);
  const __m256 d = halves(chunk + L.d + 16 * h);
  min = F.has_min ? halves(chunk + L.dmin + 16 * h) : _mm256_setzero_ps();
  dsc = d;
  if constexpr (F.sub_scales) {
    const uint8_t* sc = chunk + L.sc + j * COLS + 8 * h;
    if constexpr (L.nibble_scales) {
      dsc = _mm256_mul_ps(d, byte_vector<false, 0>(sc));
      min = _mm256_mul_ps(min, byte_vector<false, 1>(sc));
    } else {
      dsc = _mm256_mul_ps(d, byte_vector<true>(sc));
      if constexpr (F.has_min) min = _mm256_mul_ps(min, byte_vector<false>(chunk + L.mn + j * COLS + 8 * h));
    }
  }
}

// Up to ROW_GROUP rows of one output block, formats with unsigned q (all but Q8_0). VNNI: the int32
// sums come from dpbusd (avx2_lanes.h) directly (no int16 runs to widen).
template <int64_t TYPE, int ROWS, bool VNNI>
void output_block(const uint8_t* chunks, const PreparedInput& x, int64_t m0, float* out, int64_t ldc, int cols) {
  constexpr BlockFormat F = *find_format(TYPE);
  constexpr PackedLayout L = packed_layout(F);
  constexpr int64_t STEPS = F.sub / STEP;  // steps per sub-block
  constexpr int64_t FLUSH = VNNI || int16_steps(F.q_bits) >= STEPS ? STEPS : int16_steps(F.q_bits);
  static_assert(STEPS % FLUSH == 0, "a sub-block is a whole number of int16 runs");
  const int64_t K = x.K, n_blocks = K / F.n, n_sub = F.n_sub(), per_sub = K / F.sub;
  const int8_t* xq = x.q8.data() + m0 * K;
  const float* qsums = (F.sub == QK_SUB ? x.qsum16 : x.qsum32).data() + m0 * per_sub;
  const float* scales = x.scale.data() + m0 * (K / QK);
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < n_blocks; ++b) {
    const uint8_t* chunk = chunks + b * L.bytes;
    if (m0 < TASK_ROWS) prefetch(chunk + prefetch_chunks(L) * L.bytes, L.bytes);  // later row blocks find the weights in cache
    for (int64_t j = 0; j < n_sub; ++j) {
      const int64_t k = b * F.n + j * F.sub, s = b * n_sub + j;
      __m256i high_a = _mm256_setzero_si256(), high_b = high_a;
      if constexpr (L.high_bits > 0) sub_block_high<TYPE>(chunk, j * STEPS, high_a, high_b);
      __m256i dot[ROWS][2];
      for (int64_t run = 0; run < STEPS; run += FLUSH) {
        __m256i part[ROWS][2];
        for (int r = 0; r < ROWS; ++r) part[r][0] = part[r][1] = _mm256_setzero_si256();
        for (int64_t step = run; step < run + FLUSH; ++step) {
          __m256i a, bb;
          step_weights<TYPE>(chunk, j * STEPS + step, static_cast<int>(step), high_a, high_b, a, bb);
          for (int r = 0; r < ROWS; ++r) {
            const __m256i xs = step_inputs(xq + r * K + k + 4 * step);
            if constexpr (VNNI) {
              part[r][0] = dpbusd(part[r][0], a, xs);
              part[r][1] = dpbusd(part[r][1], bb, xs);
            } else {
              part[r][0] = _mm256_add_epi16(part[r][0], _mm256_maddubs_epi16(a, xs));
              part[r][1] = _mm256_add_epi16(part[r][1], _mm256_maddubs_epi16(bb, xs));
            }
          }
        }
        for (int r = 0; r < ROWS; ++r)
          for (int h = 0; h < 2; ++h)
            if constexpr (VNNI) dot[r][h] = part[r][h];
            else dot[r][h] = run == 0 ? widen(part[r][h]) : _mm256_add_epi32(dot[r][h], widen(part[r][h]));
      }
      for (int h = 0; h < 2; ++h) {
        __m256 dsc, min;
        sub_block_scales<TYPE>(chunk, j, h, dsc, min);
        // the coefficient of the sub-block's sum of xq: dmin mn - offset d sc
        const __m256 coefficient = _mm256_fmadd_ps(dsc, _mm256_set1_ps(-static_cast<float>(F.offset)), min);
        for (int r = 0; r < ROWS; ++r) {
          // dx (d sc q . xq + (dmin mn - offset d sc) sum xq)
          const __m256 sum_term = _mm256_mul_ps(coefficient, _mm256_set1_ps(qsums[r * per_sub + s]));
          const __m256 block = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), dsc, sum_term);
          acc[r][h] = _mm256_fmadd_ps(block, _mm256_set1_ps(scales[r * (K / QK) + k / QK]), acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    alignas(32) float row[COLS];
    _mm256_store_ps(row, acc[r][0]);
    _mm256_store_ps(row + 8, acc[r][1]);
    std::memcpy(out + r * ldc, row, cols * sizeof(float));
  }
}

// Q8_0: per input pair, 16 outputs' two int8 weights widened to int16 and multiplied by x's pair
// (VNNI: vpdpwssd multiplies and adds in one instruction, the same int32 sums).
template <int ROWS, bool VNNI>
void output_block_q8(const uint8_t* chunks, const PreparedInput& x, int64_t m0, float* out, int64_t ldc, int cols) {
  constexpr PackedLayout L = packed_layout(*find_format(static_cast<int64_t>(GgmlType::Q8_0)));
  const int64_t K = x.K, n_blocks = K / QK;
  const int8_t* xq = x.q8.data() + m0 * K;
  const float* scales = x.scale.data() + m0 * n_blocks;
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < n_blocks; ++b) {
    const uint8_t* chunk = chunks + b * L.bytes;
    if (m0 < TASK_ROWS) prefetch(chunk + prefetch_chunks(L) * L.bytes, L.bytes);
    __m256i dot[ROWS][2];
    for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int64_t p = 0; p < QK / 2; ++p) {
      const uint8_t* pair = chunk + L.low + p * 2 * COLS;  // [16 outputs][2 inputs] int8
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + COLS)));
      for (int r = 0; r < ROWS; ++r) {
        int16_t two;
        std::memcpy(&two, xq + r * K + b * QK + 2 * p, 2);
        const __m256i xs = _mm256_cvtepi8_epi16(_mm_set1_epi16(two));
        dot[r][0] = add_pair_products<VNNI>(dot[r][0], w0, xs);
        dot[r][1] = add_pair_products<VNNI>(dot[r][1], w1, xs);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = halves(chunk + L.d + 16 * h);
      for (int r = 0; r < ROWS; ++r)
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(d, _mm256_set1_ps(scales[r * n_blocks + b])), acc[r][h]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    alignas(32) float row[COLS];
    _mm256_store_ps(row, acc[r][0]);
    _mm256_store_ps(row + 8, acc[r][1]);
    std::memcpy(out + r * ldc, row, cols * sizeof(float));
  }
}

template <int64_t TYPE, int ROWS, bool VNNI>
void output_block_any(const uint8_t* chunks, const PreparedInput& x, int64_t m0, float* out, int64_t ldc, int cols) {
  if constexpr (TYPE == static_cast<int64_t>(GgmlType::Q8_0)) output_block_q8<ROWS, VNNI>(chunks, x, m0, out, ldc, cols);
  else output_block<TYPE, ROWS, VNNI>(chunks, x, m0, out, ldc, cols);
}

template <int64_t TYPE, bool VNNI>
void output_block_rows(const uint8_t* chunks, const PreparedInput& x, int64_t m0, int rows, float* out, int64_t ldc, int cols) {
  // Rows in groups of ROW_GROUP, 2, 1: every row's arithmetic is the same in each.
  for (int r = 0; r < rows;) {
    const int left = rows - r;
    if (left >= ROW_GROUP) output_block_any<TYPE, ROW_GROUP, VNNI>(chunks, x, m0 + r, out + r * ldc, ldc, cols), r += ROW_GROUP;
    else if (left >= 2) output_block_any<TYPE, 2, VNNI>(chunks, x, m0 + r, out + r * ldc, ldc, cols), r += 2;
    else output_block_any<TYPE, 1, VNNI>(chunks, x, m0 + r, out + r * ldc, ldc, cols), r += 1;
  }
}

}  // namespace

void prepare_rows(const float* x, int64_t m_begin, int64_t m_end, PreparedInput& p) {
  const int64_t K = p.K;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = m_begin * K / QK; g < m_end * K / QK; ++g) {
    const float* xb = x + g * QK;
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float scale = _mm_cvtss_f32(m4) / INT8_X_MAX, inverse = scale > 0 ? 1.0f / scale : 0.0f;
    p.scale[g] = scale;
    __m256i q[4];  // rounded to nearest even, as nearbyint under the default rounding mode
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
    // int32 -> int8 in input order (packs interleave the 128-bit lanes; the permute puts them back)
    const __m256i words = _mm256_packs_epi32(q[0], q[1]), words2 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.q8.data() + g * QK), bytes);
    for (int half = 0; half < 2; ++half) {
      int32_t qsum = 0;
      for (int k = 16 * half; k < 16 * half + 16; ++k) qsum += p.q8[g * QK + k];
      p.qsum16[2 * g + half] = static_cast<float>(qsum);
    }
    p.qsum32[g] = p.qsum16[2 * g] + p.qsum16[2 * g + 1];
  }
}

void quant_output_block(const PackedMatrix& w, int64_t nb, const PreparedInput& x, int64_t m0, int rows, float* out,
                        int64_t ldc, int cols) {
  const uint8_t* chunks = w.chunks + nb * (x.K / w.format->n) * w.layout.bytes;
  const bool vnni = avx_vnni_active();
  switch (w.format->type) {
#define POWERINFER_CASE(T) \
  case GgmlType::T:                                                                                                  \
    return vnni ? output_block_rows<static_cast<int64_t>(GgmlType::T), true>(chunks, x, m0, rows, out, ldc, cols)     \
                : output_block_rows<static_cast<int64_t>(GgmlType::T), false>(chunks, x, m0, rows, out, ldc, cols);
    POWERINFER_CASE(Q4_0) POWERINFER_CASE(Q4_1) POWERINFER_CASE(Q5_0) POWERINFER_CASE(Q5_1) POWERINFER_CASE(Q8_0)
    POWERINFER_CASE(Q2_K) POWERINFER_CASE(Q3_K) POWERINFER_CASE(Q4_K) POWERINFER_CASE(Q5_K) POWERINFER_CASE(Q6_K)
#undef POWERINFER_CASE
    default: return;
  }
}

}  // namespace powerinfer::avx2
POWERINFER_TARGET_END
#endif
