// The column kernel of SparseInputProjection for AVX2 (sparse_input.h): per block of outputs, the
// outputs are loaded once, each column of the batch adds c_j times its dequantized weights with
// float32 multiply-adds, and they are stored once. Q4_0, Q4_1, Q8_0 and Q4_K are read straight from
// their blocks; the other block types go through the neuron kernels' block decoder, one column at a
// time (neuron_kernels_simd.cpp).
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

// acc[0..3] += scale * the 32 values of 16 bytes of nibbles whose low nibbles are values 0-15 and
// high nibbles values 16-31 (the byte order of Q4_0 and Q4_1 blocks, and of Q4_K after `shift`).
inline void add_nibbles(const uint8_t* q, __m256 scale, __m256* acc) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  const __m256i a = widen_u8(q), b = widen_u8(q + 8);
  acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, low)), scale, acc[0]);
  acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low)), scale, acc[1]);
  acc[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), scale, acc[2]);
  acc[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), scale, acc[3]);
}

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

// Q4_0 (d, 16 bytes of nibbles: w = d (q - 8)), Q4_1 (d, m, nibbles: w = d q + m), Q8_0 (d, 32 int8:
// w = d q). The offsets of a batch are summed in a scalar and added once per block.
template <GgmlType TYPE>
void axpy_legacy(const uint8_t* const* cols, const float* c, int n, int64_t b0, int64_t b1, float* out) {
  constexpr int64_t bytes = TYPE == GgmlType::Q4_0 ? 18 : TYPE == GgmlType::Q4_1 ? 20 : 34;
  constexpr int64_t q_at = TYPE == GgmlType::Q4_1 ? 4 : 2;
  for (int64_t b = b0; b < b1; ++b) {
    float cd[COLUMN_BATCH], offset = 0.0f;
    for (int j = 0; j < n; ++j) {
      const uint8_t* block = cols[j] + b * bytes;
      cd[j] = c[j] * half(block);
      if constexpr (TYPE == GgmlType::Q4_0) offset += -8.0f * cd[j];
      if constexpr (TYPE == GgmlType::Q4_1) offset += c[j] * half(block + 2);
    }
    float* o = out + b * QK;
    __m256 acc[4];
    load_block(o, offset, acc);
    for (int j = 0; j < n; ++j) {
      const uint8_t* q = cols[j] + b * bytes + q_at;
      const __m256 scale = _mm256_set1_ps(cd[j]);
      if constexpr (TYPE == GgmlType::Q8_0) {
        for (int part = 0; part < 4; ++part)
          acc[part] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen_i8(q + 8 * part)), scale, acc[part]);
      } else {
        add_nibbles(q, scale, acc);
      }
    }
    store_block(o, acc);
  }
}

// Q4_K: d, dmin, 12 bytes of 6-bit scales and minimums (ggml_blocks.cpp's scales_6bit_pairs), 128
// bytes of nibbles: bytes 32s .. 32s + 31 hold sub-blocks 2s (low nibbles) and 2s + 1 (high).
// w = d sc_j q - dmin mn_j per sub-block j of 32.
void axpy_q4_k(const uint8_t* const* cols, const float* c, int n, int64_t b0, int64_t b1, float* out) {
  constexpr int64_t bytes = 144, subs = 8;
  for (int64_t b = b0; b < b1; ++b) {
    float scale[COLUMN_BATCH][subs], offset[subs] = {};
    for (int j = 0; j < n; ++j) {
      const uint8_t* block = cols[j] + b * bytes;
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
        add_nibble_run(cols[j] + b * bytes + 16 + (sub / 2) * 32, 4 * (sub % 2), _mm256_set1_ps(scale[j][sub]), acc);
      store_block(o, acc);
    }
  }
}

}  // namespace

void axpy_columns(const uint8_t* const* cols, const float* c, int n, const BlockFormat& f, int64_t b0, int64_t b1, float* out) {
  switch (f.type) {
    case GgmlType::Q4_0: return axpy_legacy<GgmlType::Q4_0>(cols, c, n, b0, b1, out);
    case GgmlType::Q4_1: return axpy_legacy<GgmlType::Q4_1>(cols, c, n, b0, b1, out);
    case GgmlType::Q8_0: return axpy_legacy<GgmlType::Q8_0>(cols, c, n, b0, b1, out);
    case GgmlType::Q4_K: return axpy_q4_k(cols, c, n, b0, b1, out);
    default: {
      // the neuron kernels' block rows (bits 0): the blocks [b0, b1) as one section
      const Section s{b0 * f.bytes, -1, -1, 0, (b1 - b0) * f.n, &f};
      axpy_rows(cols, c, n, s, out + b0 * f.n);
    }
  }
}

}  // namespace powerinfer::avx2
POWERINFER_TARGET_END
#endif
