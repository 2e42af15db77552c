// The neuron records' dot products and row accumulations for AVX2 (maddubs) and AVX-512 (VNNI).
// Block-format rows (bits 0) are unpacked into unsigned bytes in weight order by the AVX2 code,
// which the AVX-512 code reuses. Float32 rows use the scalar code.
#include "neuron_kernels.h"

#ifdef POWERINFER_X86
#include <immintrin.h>

#include <algorithm>

#include "avx2_lanes.h"

POWERINFER_TARGET_AVX2
namespace powerinfer::avx2 {

// ---------------------------------------------------------------- block formats: q in weight order

// q of one block (n / 32 vectors of 32 unsigned bytes, weight order), for the layouts of
// ggml_blocks.cpp. Byte shifts are 16-bit shifts whose spill into the neighbouring byte is masked off.
inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// bits [from, from + count) of each byte of v, moved to [to, to + count)
inline __m256i move_bits(__m256i v, int from, int to, int count) {
  const __m256i moved = from >= to ? _mm256_srl_epi16(v, _mm_cvtsi32_si128(from - to)) : _mm256_sll_epi16(v, _mm_cvtsi32_si128(to - from));
  return _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(((1 << count) - 1) << to)));
}

inline void unpack_block(const BlockFormat& f, const uint8_t* b, __m256i* q) {
  switch (f.type) {
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const bool five = f.type == GgmlType::Q5_K;
      const __m256i qh = five ? load32(b + 16) : _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i v = load32(b + (five ? 48 : 16) + 32 * c);
        q[2 * c] = low_nibbles(v);
        q[2 * c + 1] = high_nibbles(v);
        if (five) {
          q[2 * c] = _mm256_or_si256(q[2 * c], move_bits(qh, 2 * c, 4, 1));
          q[2 * c + 1] = _mm256_or_si256(q[2 * c + 1], move_bits(qh, 2 * c + 1, 4, 1));
        }
      }
      return;
    }
    case GgmlType::Q6_K:
      for (int h = 0; h < 2; ++h) {
        const __m256i a = load32(b + 64 * h), c = load32(b + 64 * h + 32), qh = load32(b + 128 + 32 * h);
        q[4 * h + 0] = _mm256_or_si256(low_nibbles(a), move_bits(qh, 0, 4, 2));
        q[4 * h + 1] = _mm256_or_si256(low_nibbles(c), move_bits(qh, 2, 4, 2));
        q[4 * h + 2] = _mm256_or_si256(high_nibbles(a), move_bits(qh, 4, 4, 2));
        q[4 * h + 3] = _mm256_or_si256(high_nibbles(c), move_bits(qh, 6, 4, 2));
      }
      return;
    case GgmlType::Q2_K:
    case GgmlType::Q3_K: {
      const bool three = f.type == GgmlType::Q3_K;
      const uint8_t* qs = b + (three ? 32 : 16);
      const __m256i hmask = three ? load32(b) : _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const __m256i v = load32(qs + 32 * h);
        for (int i = 0; i < 4; ++i) {
          q[4 * h + i] = move_bits(v, 2 * i, 0, 2);
          if (three) q[4 * h + i] = _mm256_or_si256(q[4 * h + i], move_bits(hmask, 4 * h + i, 2, 1));
        }
      }
      return;
    }
    default: {  // Q5_0, Q5_1: 16 bytes of nibbles (weights j, j + 16), bit j of qh is bit 4 of weight j
      const uint8_t* qs = b + (f.has_min ? 8 : 6);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)), _mm_and_si128(v, _mm_set1_epi8(0x0F)));
      uint32_t qh;
      std::memcpy(&qh, qs - 4, 4);
      // byte k <- byte k / 8 of qh, then its bit k % 8
      const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                                 _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
      const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
      q[0] = _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
  }
}

// sum over groups g of 16 of factor[g] * (-offset * qsum16[g]) + min[g] * sum16[g], for `groups` groups
inline float group_terms(const GroupFactors& g, int offset, const float* qsum16, const float* sum16, int64_t groups) {
  float acc = 0.0f;
  for (int64_t i = 0; i < groups; ++i) acc += g.factor[i] * (-static_cast<float>(offset) * qsum16[i]) + g.min[i] * sum16[i];
  return acc;
}

// 8 int32 lanes, lane l = sum of unsigned u and signed s over bytes 4l .. 4l + 3 (|u s| <= 2^14)
inline __m256i dot_bytes(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

namespace {

float dot_blocks(const uint8_t* rec, const Section& s, const QuantizedX& x) {
  const BlockFormat& f = *s.format;
  __m256 acc = _mm256_setzero_ps();
  float terms = 0.0f;
  __m256i q[QK_K / 32];
  GroupFactors g;
  for (int64_t i = 0; i < s.n_values / f.n; ++i) {
    const uint8_t* block = rec + s.q_off + i * f.bytes;
    const int64_t first = i * f.n;
    group_factors(f, block, x.scale.data() + first / QK, g);
    unpack_block(f, block, q);
    for (int64_t c = 0; c < f.n / 32; ++c) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q8.data() + first + 32 * c));
      const __m256 factor = _mm256_set_m128(_mm_set1_ps(g.factor[2 * c + 1]), _mm_set1_ps(g.factor[2 * c]));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_bytes(q[c], xq)), factor, acc);
    }
    terms += group_terms(g, f.offset, x.qsum16.data() + first / QK_SUB, x.sum16.data() + first / QK_SUB, f.n / QK_SUB);
  }
  return horizontal_sum(acc) + terms;
}

// Up to 8 float16 values from p as float32 lanes; lanes past `count` are 0 (a row's last scales may
// end its record, which a full 16-byte load would overrun).
inline __m256 halves8(const uint16_t* p, int64_t count) {
  if (count == 8) return halves(p);
  alignas(16) uint16_t tail[8] = {};
  std::memcpy(tail, p, 2 * count);
  return halves(tail);
}

// The scales of one group of up to 8 blocks of a 4- or 8-bit row, as float32 lanes (lane i: block
// first + i), converted 8 at a time with F16C: one conversion per block in scalar code cost more
// than the integer products themselves.
struct GroupScales {
  __m256 d, m;  // m: the offsets (Q4_1), -8 d (Q4_0), 0 (8-bit rows)

  GroupScales(const uint8_t* rec, const Section& s, int64_t first, int64_t count) {
    d = halves8(reinterpret_cast<const uint16_t*>(rec + s.d_off) + first, count);
    m = s.bits == 8 ? _mm256_setzero_ps()
        : s.m_off >= 0 ? halves8(reinterpret_cast<const uint16_t*>(rec + s.m_off) + first, count)
                       : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
  }
};

constexpr int64_t GROUP = 8;  // blocks per GroupScales

// lanes 0-3 <- lane i of v, lanes 4-7 <- lane i + 1
inline __m256 pair_lanes(__m256 v, int64_t i) {
  const __m256i lanes = _mm256_add_epi32(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_set1_epi32(static_cast<int>(i)));
  return _mm256_permutevar8x32_ps(v, lanes);
}

// 4-bit blocks i and i + 1 (i even) of a group (bytes: their 32 bytes) against x's partners xg of
// the group's blocks: int32 lanes 0-3 hold block i's products, 4-7 block i + 1's. The nibbles
// multiply x unsigned x signed; the two int16 results add without overflow (2 * 2 * 15 * 127 < 2^15)
// before the one widening to int32.
inline __m256i q4_pair(__m256i bytes, const int8_t* xg, int64_t i) {
  const int8_t* partners = xg + (i / 4) * 4 * QK + (i % 4) * 16;  // QuantizedX::q4's order
  const __m256i low = _mm256_maddubs_epi16(low_nibbles(bytes), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(partners)));
  const __m256i high = _mm256_maddubs_epi16(high_nibbles(bytes), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(partners + 64)));
  return _mm256_madd_epi16(_mm256_add_epi16(low, high), _mm256_set1_epi16(1));
}

// 8-bit block b against x: 8 int32 lanes summing to its product (|w| times x with w's sign, as
// maddubs takes one unsigned operand).
inline __m256i q8_block(const uint8_t* q, const int8_t* xq, int64_t b) {
  const __m256i w = load32(q + b * QK);
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * QK));
  return dot_bytes(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
}

// acc[0], acc[1] += the products of `count` blocks of a group (q: its values, factor: lane i holds
// block i's d times x's scale). `count` is a constant GROUP in the main loop, so that the compiler
// unrolls it; the last group of a row may be shorter. Two accumulators: two independent FMA chains.
template <int64_t bits>
inline void group_products(const uint8_t* q, const int8_t* xq, __m256 factor, int64_t count, __m256* acc) {
  if constexpr (bits == 4) {
    for (int64_t i = 0; i < count; i += 2) {
      const __m256i bytes = i + 1 < count ? load32(q + i * 16) : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * 16)));
      acc[i / 2 % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_pair(bytes, xq, i)), pair_lanes(factor, i), acc[i / 2 % 2]);
    }
  } else {
    alignas(32) float f[GROUP];
    _mm256_store_ps(f, factor);
    for (int64_t i = 0; i < count; ++i)
      acc[i % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_block(q, xq, i)), _mm256_set1_ps(f[i]), acc[i % 2]);
  }
}

// 4- and 8-bit rows: a group of 8 blocks per step; x's scales and sums are padded to whole groups.
template <int64_t bits>
float dot_split(const uint8_t* rec, const Section& s, const QuantizedX& x) {
  const int64_t n_blocks = s.n_blocks();
  const uint8_t* q = rec + s.q_off;
  const int8_t* xq = bits == 4 ? x.q4.data() : x.q8.data();  // both: 32 bytes per block, in groups of 4 blocks
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, offsets = _mm256_setzero_ps();
  for (int64_t first = 0; first < n_blocks; first += GROUP) {
    const int64_t count = std::min(GROUP, n_blocks - first);
    const GroupScales g(rec, s, first, count);
    const __m256 factor = _mm256_mul_ps(g.d, _mm256_loadu_ps(x.scale.data() + first));
    offsets = _mm256_fmadd_ps(g.m, _mm256_loadu_ps(x.sum.data() + first), offsets);
    const uint8_t* qg = q + first * QK * bits / 8;
    if (count == GROUP) group_products<bits>(qg, xq + first * QK, factor, GROUP, acc);
    else group_products<bits>(qg, xq + first * QK, factor, count, acc);
  }
  return horizontal_sum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), offsets));
}

}  // namespace

float dot(const uint8_t* rec, const Section& s, const QuantizedX& x) {
  if (s.bits == 32) return scalar::dot(rec, s, x);
  if (s.bits == 0) return dot_blocks(rec, s, x);
  return s.bits == 4 ? dot_split<4>(rec, s, x) : dot_split<8>(rec, s, x);
}

namespace {

void axpy_blocks(const uint8_t* rec, const Section& s, float c, float* out) {
  const BlockFormat& f = *s.format;
  __m256i q[QK_K / 32];
  float a[QK_K / QK_SUB], b[QK_K / QK_SUB];
  for (int64_t i = 0; i < s.n_values / f.n; ++i) {
    const uint8_t* block = rec + s.q_off + i * f.bytes;
    axpy_coefficients(f, block, c, a, b);
    unpack_block(f, block, q);
    for (int64_t e = 0; e < f.n; e += 8) {  // 8 weights: half of a group of 16
      const __m128i part = e % 32 < 16 ? _mm256_castsi256_si128(q[e / 32]) : _mm256_extracti128_si256(q[e / 32], 1);
      const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e % 16 ? _mm_srli_si128(part, 8) : part));
      float* o = out + i * f.n + e;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(w, _mm256_set1_ps(a[e / QK_SUB]), _mm256_add_ps(_mm256_loadu_ps(o), _mm256_set1_ps(b[e / QK_SUB]))));
    }
  }
}

// The 32 weights of block b of a 4- or 8-bit row as float32 integers, 8 per vector (before scale
// and offset).
inline void block_values(const uint8_t* q, int64_t bits, int64_t b, __m256* w) {
  if (bits == 4) {
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + b * 16)));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + b * 16 + 8)));
    const __m256i low = _mm256_set1_epi32(0x0F);
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo, low));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi, low));
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4));
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));
    return;
  }
  for (int part = 0; part < 4; ++part)
    w[part] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + b * QK + 8 * part))));
}

constexpr int MAX_ROWS = 4;  // rows accumulated together (sparse_ffn hands over 4 at a time)

// out += sum_r c[r] * row r, 4- and 8-bit rows, n_rows <= MAX_ROWS: each block's 32 outputs are
// loaded and stored once for all rows (one row at a time, those loads and stores bound the loop),
// and their scales converted 8 blocks at a time.
void axpy_split(const uint8_t* const* recs, const float* c, int n_rows, const Section& s, float* out) {
  const int64_t n_blocks = s.n_blocks();
  alignas(32) float cd[MAX_ROWS][GROUP], offset[GROUP];
  for (int64_t first = 0; first < n_blocks; first += GROUP) {
    const int64_t count = std::min(GROUP, n_blocks - first);
    __m256 offsets = _mm256_setzero_ps();  // lane i: sum_r c[r] m_r of block first + i
    for (int r = 0; r < n_rows; ++r) {
      const GroupScales g(recs[r], s, first, count);
      const __m256 cr = _mm256_set1_ps(c[r]);
      _mm256_store_ps(cd[r], _mm256_mul_ps(g.d, cr));
      offsets = _mm256_fmadd_ps(g.m, cr, offsets);
    }
    _mm256_store_ps(offset, offsets);
    for (int64_t i = 0; i < count; ++i) {
      float* o = out + (first + i) * QK;
      __m256 acc[4];
      for (int part = 0; part < 4; ++part) acc[part] = _mm256_add_ps(_mm256_loadu_ps(o + 8 * part), _mm256_set1_ps(offset[i]));
      for (int r = 0; r < n_rows; ++r) {
        __m256 w[4];
        block_values(recs[r] + s.q_off, s.bits, first + i, w);
        const __m256 scale = _mm256_set1_ps(cd[r][i]);
        for (int part = 0; part < 4; ++part) acc[part] = _mm256_fmadd_ps(w[part], scale, acc[part]);
      }
      for (int part = 0; part < 4; ++part) _mm256_storeu_ps(o + 8 * part, acc[part]);
    }
  }
}

}  // namespace

void axpy_rows(const uint8_t* const* recs, const float* c, int n_rows, const Section& s, float* out) {
  if (s.bits == 32) return scalar::axpy_rows(recs, c, n_rows, s, out);
  if (s.bits == 0) {
    for (int r = 0; r < n_rows; ++r) axpy_blocks(recs[r], s, c[r], out);
    return;
  }
  for (int r = 0; r < n_rows; r += MAX_ROWS) axpy_split(recs + r, c + r, std::min(MAX_ROWS, n_rows - r), s, out);
}

}  // namespace powerinfer::avx2
POWERINFER_TARGET_END

POWERINFER_TARGET_AVX512
namespace powerinfer::avx512 {
namespace {

inline __m512i lanes_per_block(int64_t first, int shift) {  // lane l <- element first + (l >> shift)
  return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                          _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), shift));
}

float dot_blocks(const uint8_t* rec, const Section& s, const QuantizedX& x) {
  const BlockFormat& f = *s.format;
  if (f.n < QK_K) return avx2::dot(rec, s, x);  // Q5_0, Q5_1: 32 weights, one AVX2 vector
  __m512 acc = _mm512_setzero_ps(), terms = _mm512_setzero_ps();
  __m256i q[QK_K / 32];
  GroupFactors g;
  for (int64_t i = 0; i < s.n_values / QK_K; ++i) {
    const uint8_t* block = rec + s.q_off + i * f.bytes;
    const int64_t first = i * QK_K;
    group_factors(f, block, x.scale.data() + first / QK, g);
    avx2::unpack_block(f, block, q);
    const __m512 factors = _mm512_loadu_ps(g.factor);
    for (int64_t c = 0; c < QK_K / 64; ++c) {  // 64 weights: 4 groups of 16, 4 lanes each
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(q[2 * c]), q[2 * c + 1], 1);
      const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(x.q8.data() + first + 64 * c));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_permutexvar_ps(lanes_per_block(4 * c, 2), factors), acc);
    }
    const __m512 qsum = _mm512_loadu_ps(x.qsum16.data() + first / QK_SUB), sum = _mm512_loadu_ps(x.sum16.data() + first / QK_SUB);
    terms = _mm512_fmadd_ps(_mm512_mul_ps(factors, _mm512_set1_ps(-static_cast<float>(f.offset))), qsum, terms);
    terms = _mm512_fmadd_ps(_mm512_loadu_ps(g.min), sum, terms);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc, terms));
}

void axpy_blocks(const uint8_t* rec, const Section& s, float c, float* out) {
  const BlockFormat& f = *s.format;
  __m256i q[QK_K / 32];
  float a[QK_K / QK_SUB], b[QK_K / QK_SUB];
  for (int64_t i = 0; i < s.n_values / f.n; ++i) {
    const uint8_t* block = rec + s.q_off + i * f.bytes;
    axpy_coefficients(f, block, c, a, b);
    avx2::unpack_block(f, block, q);
    for (int64_t g = 0; g < f.n / QK_SUB; ++g) {
      const __m128i part = g % 2 ? _mm256_extracti128_si256(q[g / 2], 1) : _mm256_castsi256_si128(q[g / 2]);
      float* o = out + i * f.n + g * QK_SUB;
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part));
      _mm512_storeu_ps(o, _mm512_fmadd_ps(w, _mm512_set1_ps(a[g]), _mm512_add_ps(_mm512_loadu_ps(o), _mm512_set1_ps(b[g]))));
    }
  }
}

// The 32 weights of block b of a 4- or 8-bit row as float32 integers (before scale and offset).
inline void block_values(const uint8_t* q, int64_t bits, int64_t b, __m512& lo, __m512& hi) {
  if (bits == 4) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  } else {
    const __m128i* v = reinterpret_cast<const __m128i*>(q + b * QK);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v + 1)));
  }
}

// out += c * row, 4- and 8-bit rows.
void axpy(const uint8_t* rec, const Section& s, float c, float* out) {
  const int64_t n_blocks = s.n_blocks();
  const uint8_t* q = rec + s.q_off;
  const uint16_t* d = reinterpret_cast<const uint16_t*>(rec + s.d_off);
  const uint16_t* m = s.bits == 4 && s.m_off >= 0 ? reinterpret_cast<const uint16_t*>(rec + s.m_off) : nullptr;
  alignas(64) float cd[16], cm[16];
  for (int64_t b0 = 0; b0 < n_blocks; b0 += 16) {
    const int64_t nb = std::min<int64_t>(16, n_blocks - b0);
    const __mmask16 bm = static_cast<__mmask16>((1u << nb) - 1);
    const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, d + b0));
    const __m512 mv = s.bits == 8 ? _mm512_setzero_ps()
                      : m ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, m + b0)) : _mm512_mul_ps(dv, _mm512_set1_ps(-8.0f));
    _mm512_store_ps(cd, _mm512_mul_ps(dv, _mm512_set1_ps(c)));
    _mm512_store_ps(cm, _mm512_mul_ps(mv, _mm512_set1_ps(c)));
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t b = b0 + i;
      float* o = out + b * QK;
      __m512 lo, hi;
      block_values(q, s.bits, b, lo, hi);
      const __m512 vc = _mm512_set1_ps(cd[i]), vm = _mm512_set1_ps(cm[i]);
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_fmadd_ps(lo, vc, _mm512_loadu_ps(o)), vm));
      _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_fmadd_ps(hi, vc, _mm512_loadu_ps(o + 16)), vm));
    }
  }
}

}  // namespace

float dot(const uint8_t* rec, const Section& s, const QuantizedX& x) {
  if (s.bits == 32) return scalar::dot(rec, s, x);
  if (s.bits == 0) return dot_blocks(rec, s, x);
  const int64_t n_blocks = s.n_blocks();
  const uint8_t* q = rec + s.q_off;
  const uint16_t* d = reinterpret_cast<const uint16_t*>(rec + s.d_off);
  const uint16_t* m = s.bits == 4 && s.m_off >= 0 ? reinterpret_cast<const uint16_t*>(rec + s.m_off) : nullptr;
  const __m512i low = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc = _mm512_setzero_ps(), offsets = _mm512_setzero_ps();
  for (int64_t c = 0; c < n_blocks; c += 16) {  // 16 blocks share one load of scales
    const int64_t nb = std::min<int64_t>(16, n_blocks - c);
    const __mmask16 bm = static_cast<__mmask16>((1u << nb) - 1);
    const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, d + c));
    const __m512 sv = _mm512_mul_ps(dv, _mm512_maskz_loadu_ps(bm, x.scale.data() + c));
    if (s.bits == 4) {
      const __m512 xs = _mm512_maskz_loadu_ps(bm, x.sum.data() + c);
      const __m512 mv = m ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, m + c)) : _mm512_mul_ps(dv, _mm512_set1_ps(-8.0f));
      offsets = _mm512_fmadd_ps(mv, xs, offsets);
      for (int64_t g = 0; g < (nb + 3) / 4; ++g) {  // 4 blocks: 64 bytes, 128 weights
        const int64_t b = c + 4 * g, in_group = std::min<int64_t>(4, n_blocks - b);
        const __mmask64 mask = in_group == 4 ? ~0ull : ((1ull << (16 * in_group)) - 1);
        const __m512i bytes = _mm512_maskz_loadu_epi8(mask, q + b * 16);
        const int8_t* xg = x.q4.data() + (b / 4) * 4 * QK;
        __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(bytes, low), _mm512_loadu_si512(xg));
        sums = _mm512_dpbusd_epi32(sums, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low), _mm512_loadu_si512(xg + 64));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_permutexvar_ps(lanes_per_block(4 * g, 2), sv), acc);
      }
    } else {
      for (int64_t p = 0; p < (nb + 1) / 2; ++p) {  // 2 blocks: 64 int8 weights
        const int64_t b = c + 2 * p, in_pair = std::min<int64_t>(2, n_blocks - b);
        const __mmask64 mask = in_pair == 2 ? ~0ull : ((1ull << (QK * in_pair)) - 1);
        const __m512i xv = _mm512_maskz_loadu_epi8(mask, x.q8.data() + b * QK);
        // dpbusd multiplies unsigned by signed bytes: use q + 128, then take away 128 * sum(x).
        const __m512i w = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, q + b * QK), bias);
        __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
        sums = _mm512_sub_epi32(sums, _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, xv));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_permutexvar_ps(lanes_per_block(2 * p, 3), sv), acc);
      }
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc, offsets));
}

// out += sum_r c[r] * row r with the same section: for 4- and 8-bit rows the output is loaded and
// stored once per block for all of them (the single-row loop is bound by those loads and stores).
void axpy_rows(const uint8_t* const* recs, const float* c, int n_rows, const Section& s, float* out) {
  if (s.bits == 32) return scalar::axpy_rows(recs, c, n_rows, s, out);
  if (s.bits == 0) {
    for (int r = 0; r < n_rows; ++r) axpy_blocks(recs[r], s, c[r], out);
    return;
  }
  if (n_rows == 1) return axpy(recs[0], s, c[0], out);
  const int64_t n_blocks = s.n_blocks();
  alignas(64) float cd[4][16], offset_sum[16];
  for (int64_t b0 = 0; b0 < n_blocks; b0 += 16) {
    const int64_t nb = std::min<int64_t>(16, n_blocks - b0);
    const __mmask16 bm = static_cast<__mmask16>((1u << nb) - 1);
    __m512 offsets = _mm512_setzero_ps();
    for (int r = 0; r < n_rows; ++r) {
      const uint16_t* d = reinterpret_cast<const uint16_t*>(recs[r] + s.d_off);
      const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, d + b0));
      const __m512 cv = _mm512_set1_ps(c[r]);
      _mm512_store_ps(cd[r], _mm512_mul_ps(dv, cv));
      if (s.bits == 4) {
        const __m512 mv = s.m_off >= 0
            ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, reinterpret_cast<const uint16_t*>(recs[r] + s.m_off) + b0))
            : _mm512_mul_ps(dv, _mm512_set1_ps(-8.0f));
        offsets = _mm512_fmadd_ps(mv, cv, offsets);
      }
    }
    _mm512_store_ps(offset_sum, offsets);
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t b = b0 + i;
      float* o = out + b * QK;
      __m512 lo_acc = _mm512_add_ps(_mm512_loadu_ps(o), _mm512_set1_ps(offset_sum[i]));
      __m512 hi_acc = _mm512_add_ps(_mm512_loadu_ps(o + 16), _mm512_set1_ps(offset_sum[i]));
      for (int r = 0; r < n_rows; ++r) {
        __m512 lo, hi;
        block_values(recs[r] + s.q_off, s.bits, b, lo, hi);
        const __m512 vc = _mm512_set1_ps(cd[r][i]);
        lo_acc = _mm512_fmadd_ps(lo, vc, lo_acc);
        hi_acc = _mm512_fmadd_ps(hi, vc, hi_acc);
      }
      _mm512_storeu_ps(o, lo_acc);
      _mm512_storeu_ps(o + 16, hi_acc);
    }
  }
}

}  // namespace powerinfer::avx512
POWERINFER_TARGET_END
#endif
