// Neuron-aware sparse FFN operators on quantized neuron records.
//
// Each FFN neuron i owns one contiguous record (a row of a uint8 tensor [n_ff, record_bytes]) that
// holds its gate row, up row and ffn_down_t row ("sections"), so computing an active neuron reads
// one contiguous stretch of memory. A section is described by six integers:
//   {q_off, d_off, m_off, bits, n_values, unused}  (byte offsets within the record)
//   bits 4: n_values/32 blocks, w = d_b * q + m_b; q: 16 bytes per block, weight k in the low nibble
//           of byte k and weight k+16 in the high one; d, m float16 per block (m_off < 0: m_b = -8 d_b)
//   bits 8: w = d_b * q, q int8 (32 per block), d float16 per block
//   bits 32: float32 values (d_off, m_off unused)
//
//   gather_matvec(rec, sec, x, idx)     y[m, j] = dot(sec(idx[j]), x[m])        row-gather matvec
//   accumulate_rows(rec, sec, a, idx)   y[m]    = sum_j a[m, j] * sec(idx[j])   accumulate rows
//   sparse_ffn(rec, gate, up, down, act, x, idx)  both, fused per neuron:
//       y[m] = sum_j act(gate_j . x[m], up_j . x[m]) * down_j
//
// Dot products with 4/8-bit rows quantize x to int8 per block of 32 (as llama.cpp does) and use
// AVX-512 VNNI, with exact float32 block sums for the offset terms; accumulation is float32.
// Plain-torch references: powerinfer/ops/neuron.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;

struct Section {
  int64_t q_off, d_off, m_off, bits, n_values;
  int64_t n_blocks() const { return n_values / QK; }
};

Section make_section(const std::vector<int64_t>& v, int64_t record_bytes) {
  TORCH_CHECK(v.size() == 6, "a section is 6 integers");
  Section s{v[0], v[1], v[2], v[3], v[4]};
  TORCH_CHECK(s.bits == 4 || s.bits == 8 || s.bits == 32, "section bits must be 4, 8 or 32");
  TORCH_CHECK(s.n_values > 0 && s.n_values % QK == 0, "section length must be a multiple of 32");
  const int64_t q_bytes = s.bits == 32 ? 4 * s.n_values : s.n_values * s.bits / 8;
  TORCH_CHECK(s.q_off >= 0 && s.q_off + q_bytes <= record_bytes, "section values outside the record");
  if (s.bits != 32) TORCH_CHECK(s.d_off >= 0 && s.d_off + 2 * s.n_blocks() <= record_bytes, "section scales outside the record");
  if (s.bits == 4 && s.m_off >= 0) TORCH_CHECK(s.m_off + 2 * s.n_blocks() <= record_bytes, "section offsets outside the record");
  return s;
}

struct Records {
  const uint8_t* base;
  int64_t n, stride;
  const uint8_t* row(int64_t i) const { return base + i * stride; }
};

Records check_records(const torch::Tensor& rec, const torch::Tensor& idx) {
  TORCH_CHECK(rec.dtype() == torch::kUInt8 && rec.dim() == 2 && rec.is_contiguous(), "records must be contiguous uint8 [N, bytes]");
  TORCH_CHECK(idx.dtype() == torch::kInt64 && idx.dim() == 1 && idx.is_contiguous(), "idx must be contiguous int64 [n]");
  const int64_t* ids = idx.data_ptr<int64_t>();
  for (int64_t j = 0; j < idx.size(0); ++j) TORCH_CHECK(ids[j] >= 0 && ids[j] < rec.size(0), "neuron index out of range");
  return Records{rec.data_ptr<uint8_t>(), rec.size(0), rec.size(1)};
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

constexpr int64_t PREFETCH_AHEAD = 2;  // neurons fetched ahead of use (measured: 1..6 perform alike)

// Rows are visited in data-dependent order, which hardware prefetchers cannot follow.
inline void prefetch(const uint8_t* p, int64_t bytes) {
#if defined(__AVX512F__)
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
#endif
}

// ---------------------------------------------------------------- x, quantized per block

struct QuantizedX {
  std::vector<int8_t> q4, q8;   // int8 x in the order 4-bit (nibble pairs) / 8-bit rows consume it
  std::vector<float> scale, sum;  // per block: int8 scale, exact float32 sum
  const float* x;
};

QuantizedX quantize_x(const float* x, int64_t n_values) {
  const int64_t n_blocks = n_values / QK, groups = (n_blocks + 3) / 4;
  QuantizedX out;
  out.x = x;
  out.q4.assign(groups * 4 * QK, 0);
  out.q8.assign(groups * 4 * QK, 0);
  out.scale.assign(groups * 4, 0.0f);
  out.sum.assign(groups * 4, 0.0f);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.0f, sum = 0.0f;
    for (int k = 0; k < QK; ++k) {
      amax = std::max(amax, std::fabs(xb[k]));
      sum += xb[k];
    }
    const float scale = amax / 127.0f, inv = scale > 0 ? 1.0f / scale : 0.0f;
    out.scale[b] = scale;
    out.sum[b] = sum;
    for (int k = 0; k < QK; ++k) {
      const int8_t v = static_cast<int8_t>(std::nearbyint(xb[k] * inv));
      out.q8[b * QK + k] = v;
      // 4-bit rows: per 4 blocks, 64 partners of the low nibbles then 64 of the high nibbles
      out.q4[(b / 4) * 4 * QK + (k / 16) * 64 + (b % 4) * 16 + (k % 16)] = v;
    }
  }
  return out;
}

// ---------------------------------------------------------------- dot products

float dot_reference(const uint8_t* rec, const Section& s, const QuantizedX& x) {
  float acc = 0.0f;
  if (s.bits == 32) {
    const float* w = reinterpret_cast<const float*>(rec + s.q_off);
    for (int64_t k = 0; k < s.n_values; ++k) acc += w[k] * x.x[k];
    return acc;
  }
  for (int64_t b = 0; b < s.n_blocks(); ++b) {
    int32_t dot = 0;
    for (int k = 0; k < QK; ++k) {
      int w;
      if (s.bits == 4) {
        const uint8_t byte = rec[s.q_off + b * 16 + (k % 16)];
        w = k < 16 ? (byte & 0x0F) : (byte >> 4);
      } else {
        w = static_cast<int8_t>(rec[s.q_off + b * QK + k]);
      }
      dot += w * x.q8[b * QK + k];
    }
    const float d = half_at(rec + s.d_off + 2 * b);
    const float m = s.bits == 8 ? 0.0f : s.m_off >= 0 ? half_at(rec + s.m_off + 2 * b) : -8.0f * d;
    acc += d * x.scale[b] * dot + m * x.sum[b];
  }
  return acc;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
inline __m512i lanes_per_block(int64_t first, int shift) {  // lane l <- element first + (l >> shift)
  return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                          _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), shift));
}

float dot(const uint8_t* rec, const Section& s, const QuantizedX& x) {
  if (s.bits == 32) return dot_reference(rec, s, x);
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
#else
float dot(const uint8_t* rec, const Section& s, const QuantizedX& x) { return dot_reference(rec, s, x); }
#endif

// ---------------------------------------------------------------- out += c * row

void axpy(const uint8_t* rec, const Section& s, float c, float* out) {
  if (s.bits == 32) {
    const float* w = reinterpret_cast<const float*>(rec + s.q_off);
    for (int64_t k = 0; k < s.n_values; ++k) out[k] += c * w[k];
    return;
  }
  const int64_t n_blocks = s.n_blocks();
  const uint8_t* q = rec + s.q_off;
#if defined(__AVX512F__)
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
      if (s.bits == 4) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
        lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
        hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
      } else {
        const __m128i* v = reinterpret_cast<const __m128i*>(q + b * QK);
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v + 1)));
      }
      const __m512 vc = _mm512_set1_ps(cd[i]), vm = _mm512_set1_ps(cm[i]);
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_fmadd_ps(lo, vc, _mm512_loadu_ps(o)), vm));
      _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_fmadd_ps(hi, vc, _mm512_loadu_ps(o + 16)), vm));
    }
  }
#else
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float d = half_at(rec + s.d_off + 2 * b);
    const float m = s.bits == 8 ? 0.0f : s.m_off >= 0 ? half_at(rec + s.m_off + 2 * b) : -8.0f * d;
    for (int k = 0; k < QK; ++k) {
      int w;
      if (s.bits == 4) {
        const uint8_t byte = q[b * 16 + (k % 16)];
        w = k < 16 ? (byte & 0x0F) : (byte >> 4);
      } else {
        w = static_cast<int8_t>(q[b * QK + k]);
      }
      out[b * QK + k] += c * (d * w + m);
    }
  }
#endif
}

// out += sum_r c[r] * row r, for up to 4 rows with the same section: the output is loaded and
// stored once per block for all of them (the single-row loop is bound by those loads and stores).
void axpy_rows(const uint8_t* const* recs, const float* c, int n_rows, const Section& s, float* out) {
#if defined(__AVX512F__)
  if (s.bits != 32 && n_rows > 1) {
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
          const uint8_t* q = recs[r] + s.q_off;
          __m512 lo, hi;
          if (s.bits == 4) {
            const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
            lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
            hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
          } else {
            const __m128i* v = reinterpret_cast<const __m128i*>(q + b * QK);
            lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v)));
            hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v + 1)));
          }
          const __m512 vc = _mm512_set1_ps(cd[r][i]);
          lo_acc = _mm512_fmadd_ps(lo, vc, lo_acc);
          hi_acc = _mm512_fmadd_ps(hi, vc, hi_acc);
        }
        _mm512_storeu_ps(o, lo_acc);
        _mm512_storeu_ps(o + 16, hi_acc);
      }
    }
    return;
  }
#endif
  for (int r = 0; r < n_rows; ++r) axpy(recs[r], s, c[r], out);
}

// ---------------------------------------------------------------- activations

enum Activation : int64_t { RELU = 0, SILU = 1, GELU = 2, DRELU = 3 };

inline float activate(int64_t act, bool gated, float gate, float up) {
  auto f = [act](float v) {
    switch (act) {
      case SILU: return v / (1.0f + std::exp(-v));
      case GELU: return 0.5f * v * (1.0f + std::tanh(0.7978845608f * (v + 0.044715f * v * v * v)));
      default: return v > 0.0f ? v : 0.0f;
    }
  };
  if (!gated) return f(up);
  return act == DRELU ? f(gate) * (up > 0.0f ? up : 0.0f) : f(gate) * up;
}

std::vector<QuantizedX> quantize_rows(const torch::Tensor& x, int64_t n_values) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) == n_values,
              "x must be contiguous float32 [M, ", n_values, "]");
  std::vector<QuantizedX> out;
  for (int64_t m = 0; m < x.size(0); ++m) out.push_back(quantize_x(x.data_ptr<float>() + m * n_values, n_values));
  return out;
}

// Runs body(t, j0, j1) for n_tasks contiguous slices of [0, n); returns n_tasks.
template <typename F>
int64_t split(int64_t n, F body) {
  const int64_t n_tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (n + 31) / 32));
  at::parallel_for(0, n_tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) body(t, n * t / n_tasks, n * (t + 1) / n_tasks);
  });
  return n_tasks;
}

}  // namespace

torch::Tensor gather_matvec(torch::Tensor rec, std::vector<int64_t> section, torch::Tensor x, torch::Tensor idx) {
  const Records r = check_records(rec, idx);
  const Section s = make_section(section, r.stride);
  const auto xs = quantize_rows(x, s.n_values);
  const int64_t M = x.size(0), n = idx.size(0);
  auto y = torch::empty({M, n}, x.options());
  const int64_t* ids = idx.data_ptr<int64_t>();
  float* out = y.data_ptr<float>();
  split(n, [&](int64_t, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      if (j + 2 < j1) prefetch(r.row(ids[j + 2]) + s.q_off, std::min<int64_t>(r.stride - s.q_off, 4096));
      for (int64_t m = 0; m < M; ++m) out[m * n + j] = dot(r.row(ids[j]), s, xs[m]);
    }
  });
  return y;
}

torch::Tensor accumulate_rows(torch::Tensor rec, std::vector<int64_t> section, torch::Tensor a, torch::Tensor idx) {
  const Records r = check_records(rec, idx);
  const Section s = make_section(section, r.stride);
  TORCH_CHECK(a.dtype() == torch::kFloat32 && a.dim() == 2 && a.is_contiguous() && a.size(1) == idx.size(0),
              "a must be contiguous float32 [M, len(idx)]");
  const int64_t M = a.size(0), n = idx.size(0), dim = s.n_values;
  const int64_t n_tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (n + 31) / 32));
  auto partial = torch::zeros({n_tasks, M, dim}, a.options());  // one private accumulator per task
  const int64_t* ids = idx.data_ptr<int64_t>();
  const float* as = a.data_ptr<float>();
  float* parts = partial.data_ptr<float>();
  split(n, [&](int64_t t, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      if (j + 2 < j1) prefetch(r.row(ids[j + 2]) + s.q_off, std::min<int64_t>(r.stride - s.q_off, 4096));
      for (int64_t m = 0; m < M; ++m) axpy(r.row(ids[j]), s, as[m * n + j], parts + (t * M + m) * dim);
    }
  });
  return n_tasks == 1 ? partial[0] : partial.sum(0);
}

torch::Tensor sparse_ffn(torch::Tensor rec, std::vector<int64_t> gate_section, std::vector<int64_t> up_section,
                         std::vector<int64_t> down_section, int64_t activation, torch::Tensor x, torch::Tensor idx) {
  const Records r = check_records(rec, idx);
  const bool gated = !gate_section.empty();
  const Section up = make_section(up_section, r.stride), down = make_section(down_section, r.stride);
  const Section gate = gated ? make_section(gate_section, r.stride) : up;
  TORCH_CHECK(gate.n_values == up.n_values, "gate and up rows differ in length");
  const bool relu_gate = gated && (activation == RELU || activation == DRELU);
  const auto xs = quantize_rows(x, up.n_values);
  const int64_t M = x.size(0), n = idx.size(0), dim = down.n_values;
  const int64_t n_tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (n + 31) / 32));
  auto partial = torch::zeros({n_tasks, M, dim}, x.options());
  const int64_t* ids = idx.data_ptr<int64_t>();
  float* parts = partial.data_ptr<float>();
  split(n, [&](int64_t t, int64_t j0, int64_t j1) {
    for (int64_t m = 0; m < M; ++m) {
      float* out = parts + (t * M + m) * dim;
      const uint8_t* pending[4];  // neurons with a non-zero activation, accumulated 4 at a time
      float coefficient[4];
      int n_pending = 0;
      for (int64_t j = j0; j < j1; ++j) {
        if (m == 0 && j + PREFETCH_AHEAD < j1) prefetch(r.row(ids[j + PREFETCH_AHEAD]), r.stride);  // a whole neuron
        const uint8_t* neuron = r.row(ids[j]);
        const float g = gated ? dot(neuron, gate, xs[m]) : 0.0f;
        if (relu_gate && !(g > 0.0f)) continue;  // relu(gate) = 0: off whatever up is; skip the up dot
        const float a = activate(activation, gated, g, dot(neuron, up, xs[m]));
        if (a == 0.0f) continue;
        pending[n_pending] = neuron;
        coefficient[n_pending++] = a;
        if (n_pending == 4) {
          axpy_rows(pending, coefficient, 4, down, out);
          n_pending = 0;
        }
      }
      axpy_rows(pending, coefficient, n_pending, down, out);
    }
  });
  return n_tasks == 1 ? partial[0] : partial.sum(0);
}

void register_decode_step(pybind11::module& m);   // decode_step.cpp
void register_quant_matmul(pybind11::module& m);  // quant_matmul.cpp
void register_attention(pybind11::module& m);     // attention.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  register_decode_step(mod);
  register_quant_matmul(mod);
  register_attention(mod);
  mod.def("gather_matvec", &gather_matvec, "y[m, j] = dot(section of record idx[j], x[m])");
  mod.def("accumulate_rows", &accumulate_rows, "y[m] = sum_j a[m, j] * section of record idx[j]");
  mod.def("sparse_ffn", &sparse_ffn, "y[m] = sum_j act(gate_j . x[m], up_j . x[m]) * down_j over records idx");
}
