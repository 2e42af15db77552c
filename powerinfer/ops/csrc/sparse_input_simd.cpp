// The column kernel of SparseInputProjection for AVX2 (sparse_input.h): per block of outputs, the
// outputs are loaded once, every column of the batch adds to them, and they are stored once.
// Q4_0 and Q4_1 (split records) multiply 4-bit weights by int8 coefficients in int16: on AMD Zen
// every vector instruction shares four pipes, and the float32 path (a conversion and a
// multiply-add per weight, plus a scalar scale per block and column) ran at a third of the dense
// kernel's bytes per second in cache. Q8_0 and Q4_K take float32 multiply-adds on their own blocks;
// the other block types go through the neuron kernels' block decoder, one column at a time
// (neuron_kernels_simd.cpp).
#include "sparse_input.h"

#include "neuron_kernels.h"

#ifdef POWERINFER_X86
#include <immintrin.h>

POWERINFER_TARGET_AVX2
namespace powerinfer::avx2 {
namespace {

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// 8 bytes from p widened to 8 int32 lanes (zero- or sign-extended)
inline __m256i widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i widen_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// acc[0..3] += scale * 32 nibbles of 32 bytes, the low ones (shift 0) or the high ones (shift 4).
inline void add_nibble_run(const uint8_t* q, int shift, __m256 scale, __m256* acc) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  for (int part = 0; part < 4; ++part) {
    const __m256i v = _mm256_and_si256(_mm256_srli_epi32(widen_u8(q + 8 * part), shift), low);
    acc[part] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), scale, acc[part]);
  }
}

inline void load_block(const float* o, float offset, __m256* acc) {
  for (int part = 0; part < 4; ++part) acc[part] = _mm256_add_ps(_mm256_loadu_ps(o + 8 * part), _mm256_set1_ps(offset));
}

inline void store_block(float* o, const __m256* acc) {
  for (int part = 0; part < 4; ++part) _mm256_storeu_ps(o + 8 * part, acc[part]);
}

// Up to 8 float16 values from p as float32 lanes; lanes past `count` are 0 (a part's last scales may
// end its record, which a full 16-byte load would overrun).
inline __m256 halves(const uint8_t* p, int64_t count) {
  if (count == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint8_t tail[16] = {};
  std::memcpy(tail, p, 2 * count);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
}

// o[0..31] += scale * the int16 sums (lo: outputs 0-15, hi: 16-31) + offset
inline void add_sums(float* o, __m256i lo, __m256i hi, float scale, float offset) {
  const __m256 s = _mm256_set1_ps(scale), m = _mm256_set1_ps(offset);
  const __m128i halves16[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1), _mm256_castsi256_si128(hi),
                               _mm256_extracti128_si256(hi, 1)};
  for (int part = 0; part < 4; ++part) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(halves16[part]));
    _mm256_storeu_ps(o + 8 * part, _mm256_fmadd_ps(v, s, _mm256_add_ps(_mm256_loadu_ps(o + 8 * part), m)));
  }
}

// Q4_0 (w = d (q - 8)) and Q4_1 (w = d q + m) in split records. Per block, the batch's coefficients
// c_j d_j are rounded to k_j = round(127 c_j d_j / max_j |c_j d_j|); their products with q add up
// in int16 (|sum| <= COLUMN_BATCH * 15 * 127) and meet the scale max / 127 once. Both multiply
// q - 8, 8 sum_j k_j taken away in integers: the rounding errors then meet centred weights (Q4_1's
// q - 0 would add them up); Q4_1 adds sum_j c_j (m_j + 8 d_j) in float32. The scales of 8 blocks
// (a chunk's) are converted and rounded together. Columns go in pairs: their bytes interleaved, one maddubs
// multiplies both (an odd group's last column pairs with itself, the partner's k 0); each pair is
// unpacked once for up to ROW_CHUNK rows, each with its own k (0 where a row skips the channel).
constexpr int ROW_CHUNK = 4;  // rows sharing one unpacking of the weights (two int16 sums each in registers)

template <bool MIN, int ROWS>
void axpy_q4_rows(const uint8_t* const* recs, const float* c, int n, const ColumnPart& p, int64_t b0, int64_t b1,
                  float* out, int64_t ld) {
  constexpr int PAIRS = COLUMN_BATCH / 2;
  // per row: k of column 2p in the low byte of k_pair[.][p], of 2p + 1 in the high one
  alignas(32) int32_t k_pair[ROWS][PAIRS][SPLIT_CHUNK], k_sum[ROWS][SPLIT_CHUNK];
  alignas(32) float scale[ROWS][SPLIT_CHUNK], offset[ROWS][SPLIT_CHUNK];
  const int pairs = (n + 1) / 2;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t g = b0; g < b1;) {  // a chunk's blocks at a time (or the range's part of one)
    const int64_t count = std::min(SPLIT_CHUNK - g % SPLIT_CHUNK, b1 - g);
    const uint8_t* q[COLUMN_BATCH];
    for (int j = 0; j < 2 * pairs; ++j) q[j] = recs[std::min(j, n - 1)] + p.nibbles_at(g);
    if (g + SPLIT_PREFETCH_BLOCKS < b1)  // not past the range: the bytes beyond are another task's or column's
      for (int j = 0; j < n; ++j) prefetch(recs[j] + p.chunk_start(g + SPLIT_PREFETCH_BLOCKS), SPLIT_CHUNK * p.format->bytes);
    __m256 d[COLUMN_BATCH], m[COLUMN_BATCH];
    for (int j = 0; j < 2 * pairs; ++j) {
      d[j] = j < n ? halves(recs[j] + p.d_at(g), count) : _mm256_setzero_ps();
      if constexpr (MIN) m[j] = j < n ? halves(recs[j] + p.m_at(g), count) : _mm256_setzero_ps();
    }
    for (int r = 0; r < ROWS; ++r) {
      const float* cr = c + r * COLUMN_BATCH;
      __m256 cd[COLUMN_BATCH], amax = _mm256_setzero_ps(), minimums = _mm256_setzero_ps();
      for (int j = 0; j < 2 * pairs; ++j) {
        const __m256 cj = _mm256_set1_ps(j < n ? cr[j] : 0.0f);
        cd[j] = _mm256_mul_ps(cj, d[j]);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), cd[j]));
        if constexpr (MIN) minimums = _mm256_fmadd_ps(cj, m[j], _mm256_fmadd_ps(_mm256_set1_ps(8.0f), cd[j], minimums));
      }
      // blocks whose coefficients are all 0 get k = 0
      const __m256 inverse = _mm256_and_ps(_mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ),
                                           _mm256_div_ps(_mm256_set1_ps(INT8_X_MAX), amax));
      __m256i sum = _mm256_setzero_si256();
      for (int pair = 0; pair < pairs; ++pair) {
        const __m256i first = _mm256_cvtps_epi32(_mm256_mul_ps(cd[2 * pair], inverse));
        const __m256i second = _mm256_cvtps_epi32(_mm256_mul_ps(cd[2 * pair + 1], inverse));
        const __m256i bytes = _mm256_set1_epi32(0xFF);
        _mm256_store_si256(reinterpret_cast<__m256i*>(k_pair[r][pair]),
                           _mm256_or_si256(_mm256_and_si256(first, bytes), _mm256_slli_epi32(_mm256_and_si256(second, bytes), 8)));
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(first, second));
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(k_sum[r]), _mm256_slli_epi32(sum, 3));
      _mm256_store_ps(scale[r], _mm256_div_ps(amax, _mm256_set1_ps(INT8_X_MAX)));
      _mm256_store_ps(offset[r], minimums);
    }
    for (int64_t i = 0; i < count; ++i) {
      __m256i lo[ROWS], hi[ROWS];
      for (int r = 0; r < ROWS; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
      for (int pair = 0; pair < pairs; ++pair) {
        // byte t of a block: weight t in its low nibble, weight t + 16 in its high one; interleaved,
        // byte 2t is column 2p's and 2t + 1 column 2p + 1's
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[2 * pair] + 16 * i));
        const __m128i a2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[2 * pair + 1] + 16 * i));
        const __m256i v = _mm256_set_m128i(_mm_unpackhi_epi8(a, a2), _mm_unpacklo_epi8(a, a2));
        const __m256i v_low = _mm256_and_si256(v, low), v_high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < ROWS; ++r) {
          const __m256i kk = _mm256_set1_epi16(static_cast<int16_t>(k_pair[r][pair][i]));
          lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(v_low, kk));
          hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(v_high, kk));
        }
      }
      for (int r = 0; r < ROWS; ++r) {
        const __m256i eight_sum = _mm256_set1_epi16(static_cast<int16_t>(k_sum[r][i]));
        add_sums(out + r * ld + (g + i) * QK, _mm256_sub_epi16(lo[r], eight_sum), _mm256_sub_epi16(hi[r], eight_sum),
                 scale[r][i], MIN ? offset[r][i] : 0.0f);
      }
    }
    g += count;
  }
}

template <bool MIN>
void axpy_q4_split(const uint8_t* const* recs, const float* c, int n, int rows, const ColumnPart& p, int64_t b0,
                   int64_t b1, float* out, int64_t ld) {
  for (int r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
    const float* cr = c + r0 * COLUMN_BATCH;
    float* o = out + r0 * ld;
    switch (std::min(ROW_CHUNK, rows - r0)) {
      case 1: axpy_q4_rows<MIN, 1>(recs, cr, n, p, b0, b1, o, ld); break;
      case 2: axpy_q4_rows<MIN, 2>(recs, cr, n, p, b0, b1, o, ld); break;
      case 3: axpy_q4_rows<MIN, 3>(recs, cr, n, p, b0, b1, o, ld); break;
      default: axpy_q4_rows<MIN, 4>(recs, cr, n, p, b0, b1, o, ld);
    }
  }
}

// Q8_0 (d, 32 int8: w = d q), float32: per block, c_j d_j times each weight, in order.
void axpy_q8_0(const uint8_t* const* recs, const float* c, int n, const ColumnPart& p, int64_t b0, int64_t b1, float* out) {
  constexpr int64_t bytes = 34;
  for (int64_t b = b0; b < b1; ++b) {
    float* o = out + b * QK;
    __m256 acc[4];
    load_block(o, 0.0f, acc);
    for (int j = 0; j < n; ++j) {
      const uint8_t* block = recs[j] + p.q_off + b * bytes;
      const __m256 scale = _mm256_set1_ps(c[j] * half(block));
      for (int part = 0; part < 4; ++part)
        acc[part] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen_i8(block + 2 + 8 * part)), scale, acc[part]);
    }
    store_block(o, acc);
  }
}

// Q4_K: d, dmin, 12 bytes of 6-bit scales and minimums (ggml_blocks.cpp's scales_6bit_pairs), 128
// bytes of nibbles: bytes 32s .. 32s + 31 hold sub-blocks 2s (low nibbles) and 2s + 1 (high).
// w = d sc_j q - dmin mn_j per sub-block j of 32.
void axpy_q4_k(const uint8_t* const* recs, const float* c, int n, const ColumnPart& p, int64_t b0, int64_t b1, float* out) {
  constexpr int64_t bytes = 144, subs = 8;
  for (int64_t b = b0; b < b1; ++b) {
    float scale[COLUMN_BATCH][subs], offset[subs] = {};
    for (int j = 0; j < n; ++j) {
      const uint8_t* block = recs[j] + p.q_off + b * bytes;
      const float d = c[j] * half(block), dmin = c[j] * half(block + 2);
      const uint8_t* s = block + 4;
      for (int k = 0; k < 4; ++k) {
        scale[j][k] = d * static_cast<float>(s[k] & 63);
        scale[j][k + 4] = d * static_cast<float>((s[k + 8] & 0x0F) | ((s[k] >> 6) << 4));
        offset[k] -= dmin * static_cast<float>(s[k + 4] & 63);
        offset[k + 4] -= dmin * static_cast<float>((s[k + 8] >> 4) | ((s[k + 4] >> 6) << 4));
      }
    }
    for (int sub = 0; sub < subs; ++sub) {
      float* o = out + b * QK_K + sub * QK;
      __m256 acc[4];
      load_block(o, offset[sub], acc);
      for (int j = 0; j < n; ++j)
        add_nibble_run(recs[j] + p.q_off + b * bytes + 16 + (sub / 2) * 32, 4 * (sub % 2), _mm256_set1_ps(scale[j][sub]), acc);
      store_block(o, acc);
    }
  }
}

}  // namespace

void dequantize_split(const uint8_t* rec, const ColumnPart& p, float* out) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  for (int64_t b = 0; b < p.n_blocks; ++b) {
    const float d = half(rec + p.d_at(b)), m = p.format->has_min ? half(rec + p.m_at(b)) : -8.0f * d;
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const uint8_t* q = rec + p.nibbles_at(b);
    const __m256i first = widen_u8(q), second = widen_u8(q + 8);  // bytes 0-7, 8-15: weights t and t + 16
    const __m256i parts[4] = {_mm256_and_si256(first, low), _mm256_and_si256(second, low), _mm256_srli_epi32(first, 4),
                              _mm256_srli_epi32(second, 4)};
    for (int part = 0; part < 4; ++part)
      _mm256_storeu_ps(out + b * QK + 8 * part, _mm256_fmadd_ps(_mm256_cvtepi32_ps(parts[part]), vd, vm));
  }
}

void axpy_columns(const uint8_t* const* recs, const float* c, int n, int rows, const ColumnPart& p, int64_t b0,
                  int64_t b1, float* out, int64_t ld) {
  const BlockFormat& f = *p.format;
  if (p.split) {
    if (p.format->has_min) return axpy_q4_split<true>(recs, c, n, rows, p, b0, b1, out, ld);
    return axpy_q4_split<false>(recs, c, n, rows, p, b0, b1, out, ld);
  }
  for (int r = 0; r < rows; ++r) {  // float32: each row on its own
    const float* cr = c + r * COLUMN_BATCH;
    float* o = out + r * ld;
    switch (f.type) {
      case GgmlType::Q8_0: axpy_q8_0(recs, cr, n, p, b0, b1, o); break;
      case GgmlType::Q4_K: axpy_q4_k(recs, cr, n, p, b0, b1, o); break;
      default: {
        // the neuron kernels' block rows (bits 0): the blocks [b0, b1) as one section
        const Section s{p.q_off + b0 * f.bytes, -1, -1, 0, (b1 - b0) * f.n, &f};
        axpy_rows(recs, cr, n, s, o + b0 * f.n);
      }
    }
  }
}

}  // namespace powerinfer::avx2
POWERINFER_TARGET_END
#endif
