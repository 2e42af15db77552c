// QuantLinear's AVX-512 kernel (arithmetic and layout: quant_matmul.h): bfloat16 dot products of
// 32 activation-weight pairs per instruction, up to 8 rows sharing each unpacking of the weights.
#include "quant_matmul.h"

#ifdef POWERINFER_X86
#include <immintrin.h>

POWERINFER_TARGET_AVX512
namespace powerinfer::avx512 {
namespace {

template <int64_t TYPE>
constexpr int64_t SUB_STEPS = find_format(TYPE)->sub / STEP;  // steps of a sub-block

// Formats in the step layout hold their outputs in slot order (quant_matmul.h); Q8_0 in output order.
template <int64_t TYPE>
constexpr bool SLOTS = packed_layout(*find_format(TYPE)).low_bits != 8;

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// High-bit plane t of the group holding step s0 (a sub-block's first), byte 2 slot + i in 16-bit lane
// 2 slot + i (pair_weights' lanes), shifted so that step s0's field starts at bit 0 (only Q3_K's odd
// sub-blocks start inside a group).
template <int64_t TYPE>
inline __m512i high_lanes(const uint8_t* chunk, int64_t s0, int t) {
  constexpr PackedLayout L = packed_layout(*find_format(TYPE));
  if constexpr (L.high_bits == 0) {
    return _mm512_setzero_si512();
  } else {
    const __m512i lanes = _mm512_cvtepu8_epi16(load32(chunk + high_plane(L, s0, t)));
    const int phase = high_field_bit(L, s0);
    return phase ? _mm512_srli_epi16(lanes, phase) : lanes;
  }
}

// Bfloat16 weights of pair T of step s of a chunk, 16 outputs x 2 inputs: 32-bit lane m holds the
// weights of inputs 4s + 2T (low half) and 4s + 2T + 1 of the output in slot m, as 128 + q (Q8_0: of
// output m, as q itself). U: step s's place in its sub-block, `high`: the sub-block's high_lanes of
// plane T.
template <int64_t TYPE, int U, int T>
inline __m512i pair_weights(const uint8_t* chunk, int64_t s, __m512i high) {
  constexpr PackedLayout L = packed_layout(*find_format(TYPE));
  if constexpr (L.low_bits == 8) {
    const __m256i bytes = load32(chunk + L.low + (2 * s + T) * 2 * COLS);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // exact: |q| <= 128
  } else {
    // the step's bytes (2 bits: two steps') widened: 32-bit lane m holds slot m's bytes of pairs 0 and 1
    const __m512i both = _mm512_cvtepu8_epi16(load32(chunk + L.low + (L.low_bits == 4 ? s : s / 2) * 2 * COLS));
    __m512i own = T == 0 ? _mm512_and_si512(both, _mm512_set1_epi32(0xFF)) : _mm512_srli_epi32(both, 16);
    __m512i q;
    if constexpr (L.low_bits == 4) {  // nibbles -> 16-bit halves
      q = _mm512_ternarylogic_epi32(own, _mm512_slli_epi32(own, 12), _mm512_set1_epi32(0x000F000F), 0xA8);  // (a | b) & c
    } else {  // an odd step in the high nibble; its 2-bit fields -> 16-bit halves
      if constexpr (U % 2) own = _mm512_srli_epi32(own, 4);
      q = _mm512_ternarylogic_epi32(own, _mm512_slli_epi32(own, 14), _mm512_set1_epi32(0x00030003), 0xA8);
    }
    if constexpr (L.high_bits > 0) {  // the plane shifted so that step s's field lands at low_bits
      constexpr int shift = L.low_bits - high_field_bit(L, U);
      const __m512i fields = shift >= 0 ? _mm512_slli_epi16(high, shift) : _mm512_srli_epi16(high, -shift);
      const __m512i mask = _mm512_set1_epi16(static_cast<int16_t>(((1 << L.high_bits) - 1) << L.low_bits));
      q = _mm512_ternarylogic_epi32(q, fields, mask, 0xF8);  // a | (b & c)
    }
    return _mm512_or_si512(q, _mm512_set1_epi16(0x4300));  // bfloat16 bits of 128 + q
  }
}

// dot[r] += the products of steps s0 + K .. s0 + SUB_STEPS - 1 (one sub-block, whose high_lanes are
// `high`) with row r's inputs; `rows` points at step s0 + K's first pair.
template <int64_t TYPE, int ROWS, int K = 0>
inline void multiply_sub_block(const uint8_t* chunk, int64_t s0, const __m512i (&high)[2], const uint32_t* rows, int64_t G,
                               __m512 (&dot)[ROWS]) {
  if constexpr (K < SUB_STEPS<TYPE>) {
    const __m512bh w0 = reinterpret_cast<__m512bh>(pair_weights<TYPE, K, 0>(chunk, s0 + K, high[0]));
    const __m512bh w1 = reinterpret_cast<__m512bh>(pair_weights<TYPE, K, 1>(chunk, s0 + K, high[1]));
    const uint32_t* second = rows + G;  // the rows' inputs of pair 1 (one pointer per pair: a table of them spilled)
    for (int r = 0; r < ROWS; ++r) {
      dot[r] = _mm512_dpbf16_ps(dot[r], w0, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(rows[r]))));
      dot[r] = _mm512_dpbf16_ps(dot[r], w1, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(second[r]))));
    }
    multiply_sub_block<TYPE, ROWS, K + 1>(chunk, s0, high, second + G, G, dot);
  }
}

// The float32 vector of 16 bytes of a chunk, one per output (in slot order with SLOTS): int8
// (sub-block scales) or, with NIBBLE >= 0, one nibble of them (Q2_K: 0 scale, 1 minimum).
template <bool SLOTS, bool SIGNED, int NIBBLE = -1>
inline __m512 byte_vector(const uint8_t* p) {
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (SLOTS) bytes = _mm_shuffle_epi32(bytes, SLOT_QUARTERS);  // outputs 0-3, 8-11, 4-7, 12-15
  __m512i v = SIGNED ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
  if constexpr (NIBBLE >= 0) v = _mm512_and_si512(_mm512_srli_epi32(v, 4 * NIBBLE), _mm512_set1_epi32(0x0F));
  return _mm512_cvtepi32_ps(v);
}

// 16 float16 values, one per output (in slot order with SLOTS)
template <bool SLOTS>
inline __m512 half_vector(const uint8_t* p) {
  __m256i halves = load32(p);
  if constexpr (SLOTS) halves = _mm256_permute4x64_epi64(halves, SLOT_QUARTERS);
  return _mm512_cvtph_ps(halves);
}

template <int64_t TYPE, int ROWS>
void output_block(const uint8_t* chunks, const PreparedInput& x, int64_t m0, float* out, int64_t ldc, __mmask16 store) {
  constexpr BlockFormat F = *find_format(TYPE);
  constexpr PackedLayout L = packed_layout(F);
  constexpr bool BIASED = L.low_bits != 8;  // weights are 128 + q
  constexpr float SUM_FACTOR = -((BIASED ? 128.0f : 0.0f) + (BIASED ? F.offset : 0));
  const int64_t K = x.K, n_blocks = K / F.n, n_sub = F.n_sub();
  const int64_t G = x.G;
  const uint32_t* pairs = x.pairs.data() + (m0 / G) * G * (K / 2) + m0 % G;
  const float* sums = (F.sub == QK_SUB ? x.sum16 : x.sum32).data() + m0 * (K / F.sub);
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < n_blocks; ++b) {
    const uint8_t* chunk = chunks + b * L.bytes;
    if (m0 < TASK_ROWS) prefetch(chunk + prefetch_chunks(L) * L.bytes, L.bytes);  // later row blocks find the weights in cache
    const __m512 d = half_vector<SLOTS<TYPE>>(chunk + L.d);
    const __m512 dmin = F.has_min ? half_vector<SLOTS<TYPE>>(chunk + L.dmin) : _mm512_setzero_ps();
    for (int64_t j = 0; j < n_sub; ++j) {
      __m512 dot[ROWS];
      for (int r = 0; r < ROWS; ++r) dot[r] = _mm512_setzero_ps();
      const int64_t s0 = j * SUB_STEPS<TYPE>;
      const __m512i high[2] = {high_lanes<TYPE>(chunk, s0, 0), high_lanes<TYPE>(chunk, s0, 1)};
      const uint32_t* rows = pairs + (b * F.n / 2 + 2 * s0) * G;
      multiply_sub_block<TYPE, ROWS>(chunk, s0, high, rows, G, dot);
      __m512 dsc = d, min = dmin;  // per output: d sc, and dmin mn
      if constexpr (F.sub_scales) {
        const uint8_t* sc = chunk + L.sc + j * COLS;
        if constexpr (L.nibble_scales) {
          dsc = _mm512_mul_ps(d, byte_vector<SLOTS<TYPE>, false, 0>(sc));
          min = _mm512_mul_ps(dmin, byte_vector<SLOTS<TYPE>, false, 1>(sc));
        } else {
          dsc = _mm512_mul_ps(d, byte_vector<SLOTS<TYPE>, true>(sc));
          if constexpr (F.has_min) min = _mm512_mul_ps(dmin, byte_vector<SLOTS<TYPE>, false>(chunk + L.mn + j * COLS));
        }
      }
      // the coefficient of the sub-block's input sum: dmin mn - (128 + offset) d sc
      const __m512 coefficient = F.has_min ? _mm512_fmadd_ps(dsc, _mm512_set1_ps(SUM_FACTOR), min)
                                           : _mm512_mul_ps(dsc, _mm512_set1_ps(SUM_FACTOR));
      const int64_t s = b * n_sub + j;
      for (int r = 0; r < ROWS; ++r) {
        acc[r] = _mm512_fmadd_ps(dot[r], dsc, acc[r]);
        if constexpr (F.has_min || SUM_FACTOR != 0.0f)
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * (K / F.sub) + s]), coefficient, acc[r]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)  // slot order -> output order: the same swap of the middle quarters
    _mm512_mask_storeu_ps(out + r * ldc, store, SLOTS<TYPE> ? _mm512_shuffle_f32x4(acc[r], acc[r], SLOT_QUARTERS) : acc[r]);
}

template <int64_t TYPE>
void output_block_rows(const uint8_t* chunks, const PreparedInput& x, int64_t m0, int rows, float* out, int64_t ldc,
                       __mmask16 store) {
  // Rows in groups of 8, 4, 2, 1: every row's arithmetic is the same in each.
  for (int r = 0; r < rows;) {
    const int left = rows - r;
    if (left >= 8) output_block<TYPE, 8>(chunks, x, m0 + r, out + r * ldc, ldc, store), r += 8;
    else if (left >= 4) output_block<TYPE, 4>(chunks, x, m0 + r, out + r * ldc, ldc, store), r += 4;
    else if (left >= 2) output_block<TYPE, 2>(chunks, x, m0 + r, out + r * ldc, ldc, store), r += 2;
    else output_block<TYPE, 1>(chunks, x, m0 + r, out + r * ldc, ldc, store), r += 1;
  }
}

}  // namespace

void prepare_rows(const float* x, int64_t m_begin, int64_t m_end, PreparedInput& p) {
  const int64_t K = p.K, G = p.G;
  for (int64_t m = m_begin; m < m_end; ++m) {
    uint32_t* lane = p.pairs.data() + (m / G) * G * (K / 2) + m % G;
    for (int64_t k = 0; k < K; k += QK_SUB) {
      const __m256i rounded = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + m * K + k)));
      alignas(32) uint32_t two[QK_SUB / 2];
      _mm256_store_si256(reinterpret_cast<__m256i*>(two), rounded);
      for (int64_t i = 0; i < QK_SUB / 2; ++i) lane[(k / 2 + i) * G] = two[i];
      const __m512 values = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
      p.sum16[(m * K + k) / QK_SUB] = _mm512_reduce_add_ps(values);
    }
  }
}

void quant_output_block(const PackedMatrix& w, int64_t nb, const PreparedInput& x, int64_t m0, int rows, float* out,
                        int64_t ldc, int cols) {
  const uint8_t* chunks = w.chunks + nb * (x.K / w.format->n) * w.layout.bytes;
  const auto store = static_cast<__mmask16>((1u << cols) - 1);
  switch (w.format->type) {
#define POWERINFER_CASE(T) \
  case GgmlType::T: return output_block_rows<static_cast<int64_t>(GgmlType::T)>(chunks, x, m0, rows, out, ldc, store);
    POWERINFER_CASE(Q4_0) POWERINFER_CASE(Q4_1) POWERINFER_CASE(Q5_0) POWERINFER_CASE(Q5_1) POWERINFER_CASE(Q8_0)
    POWERINFER_CASE(Q2_K) POWERINFER_CASE(Q3_K) POWERINFER_CASE(Q4_K) POWERINFER_CASE(Q5_K) POWERINFER_CASE(Q6_K)
#undef POWERINFER_CASE
    default: return;
  }
}

}  // namespace powerinfer::avx512
POWERINFER_TARGET_END
#endif
