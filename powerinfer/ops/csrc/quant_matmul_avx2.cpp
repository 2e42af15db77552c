// QuantLinear's AVX2 kernel (arithmetic and layout: quant_matmul.h): the weights unpacked as in
// the AVX-512 kernel, then float32 FMAs with the bfloat16-rounded inputs, 8 outputs per vector.
#include "quant_matmul.h"

#ifdef POWERINFER_X86
#include <immintrin.h>

POWERINFER_TARGET_AVX2
namespace powerinfer::avx2 {
namespace {

// Chunks are read front to back, but the hardware prefetchers fall behind on the larger ones
// (measured from memory, one thread: Q5_K 6.5 -> 13.9 GB/s, Q6_K 6.0 -> 12.5 with this; 16 in cache).
constexpr int64_t PREFETCH_CHUNKS = 2;  // how far ahead

constexpr int HALVES = 2;  // 16 outputs: two vectors of 8

// Float32 weights of input pair p of a chunk: w[h][i] holds input 2p + i of outputs 8h .. 8h + 7,
// as 128 + q (Q8_0: q itself).
template <int64_t TYPE>
inline void pair_weights(const uint8_t* chunk, int64_t p, __m256 w[HALVES][2]) {
  constexpr PackedLayout L = packed_layout(*find_format(TYPE));
  for (int h = 0; h < HALVES; ++h) {
    if constexpr (L.low_bits == 8) {
      // 16-bit lanes (output, input): low half of each 32-bit lane input 2p, high half 2p + 1
      const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + L.low + p * 2 * COLS + 16 * h)));
      w[h][0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16));
      w[h][1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16));
    } else {
      __m256i q;
      if constexpr (L.low_bits == 4) {
        const __m256i t = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(chunk + L.low + p * COLS + 8 * h)));
        q = _mm256_and_si256(_mm256_or_si256(t, _mm256_slli_epi32(t, 12)), _mm256_set1_epi32(0x000F000F));
      } else {
        const __m256i t = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(chunk + L.low + (p / 2) * COLS + 8 * h)));
        __m256i u = _mm256_or_si256(t, _mm256_slli_epi32(t, 14));
        if (p % 2) u = _mm256_srli_epi32(u, 4);
        q = _mm256_and_si256(u, _mm256_set1_epi32(0x00030003));
      }
      // high bits: bit 16h + lane of the pair's mask, for each 16-bit lane
      const __m256i lane_bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                                 static_cast<int16_t>(-32768));
      for (int b = 0; b < L.high_bits; ++b) {
        uint32_t mask;
        std::memcpy(&mask, chunk + L.high + (p * L.high_bits + b) * 4, 4);
        const __m256i bits = _mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(mask >> (16 * h))), lane_bit);
        const __m256i set = _mm256_cmpeq_epi16(bits, lane_bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi16(static_cast<int16_t>(1 << (L.low_bits + b)))));
      }
      q = _mm256_or_si256(q, _mm256_set1_epi16(0x4300));  // bfloat16 bits of 128 + q
      w[h][0] = _mm256_castsi256_ps(_mm256_slli_epi32(q, 16));
      w[h][1] = _mm256_castsi256_ps(_mm256_and_si256(q, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
  }
}


template <bool SIGNED, int NIBBLE = -1>
inline __m256 byte_vector(const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  __m256i v = SIGNED ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  if constexpr (NIBBLE >= 0) v = _mm256_and_si256(_mm256_srli_epi32(v, 4 * NIBBLE), _mm256_set1_epi32(0x0F));
  return _mm256_cvtepi32_ps(v);
}

inline __m256 half_vector(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Rows r < ROWS of x (row stride K) against a sub-block's unpacked weights w[p][half][input].
template <int ROWS>
inline void sub_block_dots(const __m256 (*w)[HALVES][2], int64_t pairs, const float* x, int64_t K, __m256 dot[][HALVES]) {
  for (int r = 0; r < ROWS; ++r)
    for (int h = 0; h < HALVES; ++h) dot[r][h] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p)
    for (int r = 0; r < ROWS; ++r) {
      const __m256 x0 = _mm256_broadcast_ss(x + r * K + 2 * p), x1 = _mm256_broadcast_ss(x + r * K + 2 * p + 1);
      for (int h = 0; h < HALVES; ++h) dot[r][h] = _mm256_fmadd_ps(w[p][h][1], x1, _mm256_fmadd_ps(w[p][h][0], x0, dot[r][h]));
    }
}

// Output block of up to TASK_ROWS rows: each sub-block's weights are unpacked once into a buffer (L1)
// that the rows then read two at a time (AVX2 has too few registers to keep 8 rows' sums).
template <int64_t TYPE>
void output_block(const uint8_t* chunks, const PreparedInput& x, int64_t m0, int rows, float* out, int64_t ldc, int cols) {
  constexpr BlockFormat F = *find_format(TYPE);
  constexpr PackedLayout L = packed_layout(F);
  constexpr bool BIASED = L.low_bits != 8;
  constexpr float SUM_FACTOR = -((BIASED ? 128.0f : 0.0f) + (BIASED ? F.offset : 0));
  constexpr int64_t PAIRS = F.sub / 2;
  const int64_t K = x.K, n_blocks = K / F.n, n_sub = F.n_sub();
  const float* xs = x.f32.data() + m0 * K;
  const float* sums = (F.sub == QK_SUB ? x.sum16 : x.sum32).data() + m0 * (K / F.sub);
  __m256 acc[TASK_ROWS][HALVES];
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < HALVES; ++h) acc[r][h] = _mm256_setzero_ps();
  __m256 w[PAIRS][HALVES][2];
  for (int64_t b = 0; b < n_blocks; ++b) {
    const uint8_t* chunk = chunks + b * L.bytes;
    if (m0 < TASK_ROWS) prefetch(chunk + PREFETCH_CHUNKS * L.bytes, L.bytes);  // later row blocks find the weights in cache
    for (int64_t j = 0; j < n_sub; ++j) {
      for (int64_t p = 0; p < PAIRS; ++p) pair_weights<TYPE>(chunk, j * PAIRS + p, w[p]);
      const int64_t s = b * n_sub + j, k = b * F.n + j * F.sub;
      __m256 dsc[HALVES], coefficient[HALVES];
      for (int h = 0; h < HALVES; ++h) {
        const __m256 d = half_vector(chunk + L.d + 16 * h);
        __m256 min = F.has_min ? half_vector(chunk + L.dmin + 16 * h) : _mm256_setzero_ps();
        dsc[h] = d;
        if constexpr (F.sub_scales) {
          const uint8_t* sc = chunk + L.sc + j * COLS + 8 * h;
          if constexpr (L.nibble_scales) {
            dsc[h] = _mm256_mul_ps(d, byte_vector<false, 0>(sc));
            min = _mm256_mul_ps(min, byte_vector<false, 1>(sc));
          } else {
            dsc[h] = _mm256_mul_ps(d, byte_vector<true>(sc));
            if constexpr (F.has_min) min = _mm256_mul_ps(min, byte_vector<false>(chunk + L.mn + j * COLS + 8 * h));
          }
        }
        coefficient[h] = _mm256_fmadd_ps(dsc[h], _mm256_set1_ps(SUM_FACTOR), min);
      }
      for (int r = 0; r < rows; r += 2) {
        __m256 dot[2][HALVES];
        const int n = rows - r >= 2 ? 2 : 1;
        if (n == 2) sub_block_dots<2>(w, PAIRS, xs + r * K + k, K, dot);
        else sub_block_dots<1>(w, PAIRS, xs + r * K + k, K, dot);
        for (int i = 0; i < n; ++i)
          for (int h = 0; h < HALVES; ++h) {
            acc[r + i][h] = _mm256_fmadd_ps(dot[i][h], dsc[h], acc[r + i][h]);
            if constexpr (F.has_min || SUM_FACTOR != 0.0f)
              acc[r + i][h] = _mm256_fmadd_ps(_mm256_set1_ps(sums[(r + i) * (K / F.sub) + s]), coefficient[h], acc[r + i][h]);
          }
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    alignas(32) float row[COLS];
    for (int h = 0; h < HALVES; ++h) _mm256_store_ps(row + 8 * h, acc[r][h]);
    std::memcpy(out + r * ldc, row, cols * sizeof(float));
  }
}

}  // namespace

void quant_output_block(const PackedMatrix& w, int64_t nb, const PreparedInput& x, int64_t m0, int rows, float* out,
                        int64_t ldc, int cols) {
  const uint8_t* chunks = w.chunks + nb * (x.K / w.format->n) * w.layout.bytes;
  switch (w.format->type) {
#define POWERINFER_CASE(T) \
  case GgmlType::T: return output_block<static_cast<int64_t>(GgmlType::T)>(chunks, x, m0, rows, out, ldc, cols);
    POWERINFER_CASE(Q4_0) POWERINFER_CASE(Q4_1) POWERINFER_CASE(Q5_0) POWERINFER_CASE(Q5_1) POWERINFER_CASE(Q8_0)
    POWERINFER_CASE(Q2_K) POWERINFER_CASE(Q3_K) POWERINFER_CASE(Q4_K) POWERINFER_CASE(Q5_K) POWERINFER_CASE(Q6_K)
#undef POWERINFER_CASE
    default: return;
  }
}

}  // namespace powerinfer::avx2
POWERINFER_TARGET_END
#endif
