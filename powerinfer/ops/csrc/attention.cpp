// Attention for one new token of each of several sequences (decoding), on raw cache pointers.
//
// torch's scaled_dot_product_attention costs 10-25 us per call on CPU however small the problem;
// a decode step called it for every row and layer. Here a step's rows go in one call: RoPE on the
// q and k heads, k and v stored in each row's cache slot, then softmax(q K^T * scale) V for each
// (row, q head) over the keys its window sees, spread over the threads (AttentionSpec, ops.h, says
// which RoPE pairing, window, scale and score soft-cap). Grouped KV heads: q head h reads KV head
// h / (n_head / n_kv).
// Each (row, head) is computed the same way whichever rows share the call, so a row gets the same
// bits alone or batched. The cache holds float16 (the default: half the memory, as llama.cpp's cache)
// or float32; its values are widened to float32 as they are read.
// Reference: Attention in powerinfer/models/layers.py (tests/test_models.py).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "ops.h"
#ifdef POWERINFER_X86
#include <immintrin.h>
#endif
#include "avx2_lanes.h"

namespace powerinfer {

// One head for one query: out[hd] = softmax(cap(q . K[j] * scale)) V over keys j < n, where
// cap(s) = softcap * tanh(s / softcap) (softcap 0: cap(s) = s); K, V: rows of hd cache values
// (Value: float or c10::Half); p: n floats of scratch.
template <typename Value>
using HeadKernel = void (*)(const float* q, const Value* K, const Value* V, int64_t n, int64_t hd, float scale,
                            float softcap, float* p, float* out);

// SIMD paths: q and the output accumulators of up to 8 vectors of a head stay in registers; a wider
// head (Gemma's 256) reads the rest of q from memory and accumulates its output in pieces.
constexpr int64_t MAX_CHUNKS = 8;

namespace {

// Soft-capped attention scores (Gemma 2's attn_logit_softcapping): tanh is not vectorized, a
// model without the cap never calls it.
inline float soft_capped(float score, float softcap) { return softcap * std::tanh(score / softcap); }

void soft_cap_all(float* p, int64_t n, float softcap) {
  for (int64_t j = 0; j < n; ++j) p[j] = soft_capped(p[j], softcap);
}

}  // namespace

namespace scalar {

template <typename Value>
void attend_head(const float* q, const Value* K, const Value* V, int64_t n, int64_t hd, float scale, float softcap,
                 float* p, float* out) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    float dot = 0.0f;
    for (int64_t d = 0; d < hd; ++d) dot += q[d] * static_cast<float>(K[j * hd + d]);
    p[j] = softcap ? soft_capped(dot * scale, softcap) : dot * scale;
    top = std::max(top, p[j]);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) sum += p[j] = std::exp(p[j] - top);
  std::fill(out, out + hd, 0.0f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < hd; ++d) out[d] += p[j] * static_cast<float>(V[j * hd + d]);
  for (int64_t d = 0; d < hd; ++d) out[d] *= 1.0f / sum;
}

}  // namespace scalar
}  // namespace powerinfer

#ifdef POWERINFER_X86
POWERINFER_TARGET_AVX512
namespace powerinfer::avx512 {
namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// exp(x) for x <= 0 (scores minus their maximum): 2^n * exp(r), |r| <= ln(2)/2, degree-7 Taylor
// polynomial (relative error below 1e-8 before float32 rounding).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // exp underflows to 0 below
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts (Cody-Waite)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
// p[j] = exp(p[j] - max) for j < n; returns their sum.
float softmax_numerators(float* p, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) top = std::max(top, p[j]);
  __m512 total = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(top);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = n - j >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, p + j), shift));
    _mm512_mask_storeu_ps(p + j, mask, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
  }
  return _mm512_reduce_add_ps(total);
}

// Lane i of the result: the sum of the lanes of v[i] (16 dot products finished at once).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
}

// p[j] = q . K[j] * scale for j < n, head_dim = 16 * chunks.
template <typename Value>
void scores(const float* q, const Value* K, int64_t n, int64_t chunks, float scale, float* p) {
  const int64_t hd = 16 * chunks, held = std::min(chunks, MAX_CHUNKS);
  __m512 qv[MAX_CHUNKS];
  for (int64_t c = 0; c < held; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  auto dot = [&](const Value* k) {
    __m512 acc = _mm512_mul_ps(qv[0], load16(k));
    for (int64_t c = 1; c < held; ++c) acc = _mm512_fmadd_ps(qv[c], load16(k + 16 * c), acc);
    for (int64_t c = held; c < chunks; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), load16(k + 16 * c), acc);
    return acc;
  };
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 v[16];
    for (int i = 0; i < 16; ++i) v[i] = dot(K + (j + i) * hd);
    _mm512_storeu_ps(p + j, _mm512_mul_ps(sum_lanes16(v), _mm512_set1_ps(scale)));
  }
  for (; j < n; ++j) p[j] = _mm512_reduce_add_ps(dot(K + j * hd)) * scale;
}

// out = sum_j p[j] V[j] * inverse, head_dim = 16 * chunks, in pieces of up to MAX_CHUNKS vectors.
template <typename Value>
void weighted_values(const float* p, const Value* V, int64_t n, int64_t chunks, float inverse, float* out) {
  for (int64_t first = 0; first < chunks; first += MAX_CHUNKS) {
    const int64_t piece = std::min(MAX_CHUNKS, chunks - first);
    const Value* column = V + 16 * first;
    __m512 acc[MAX_CHUNKS];
    for (int64_t c = 0; c < piece; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m512 w = _mm512_set1_ps(p[j]);
      for (int64_t c = 0; c < piece; ++c) acc[c] = _mm512_fmadd_ps(w, load16(column + j * 16 * chunks + 16 * c), acc[c]);
    }
    for (int64_t c = 0; c < piece; ++c)
      _mm512_storeu_ps(out + 16 * (first + c), _mm512_mul_ps(acc[c], _mm512_set1_ps(inverse)));
  }
}
}  // namespace

template <typename Value>
void attend_head(const float* q, const Value* K, const Value* V, int64_t n, int64_t hd, float scale, float softcap,
                 float* p, float* out) {
  if (hd % 16 != 0) return scalar::attend_head(q, K, V, n, hd, scale, softcap, p, out);
  scores(q, K, n, hd / 16, scale, p);
  if (softcap) soft_cap_all(p, n, softcap);
  weighted_values(p, V, n, hd / 16, 1.0f / softmax_numerators(p, n), out);
}

}  // namespace powerinfer::avx512
POWERINFER_TARGET_END

POWERINFER_TARGET_AVX2
namespace powerinfer::avx2 {
namespace {

// exp(x) for x <= 0, as the AVX-512 path: 2^n * exp(r), |r| <= ln(2)/2, degree-7 Taylor polynomial,
// 2^n built in the exponent bits. x is clamped at -87, where 2^n is still a normal number: such
// terms are far below the float32 precision of the sum, which holds exp(0) = 1.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // 2^n stays a normal number
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) { return halves(p); }

}  // namespace

// head_dim = 8 * chunks; q and the accumulators of up to 2 * MAX_CHUNKS vectors in registers
template <typename Value>
void attend_head(const float* q, const Value* K, const Value* V, int64_t n, int64_t hd, float scale, float softcap,
                 float* p, float* out) {
  constexpr int64_t registers = 2 * MAX_CHUNKS;
  if (hd % 8 != 0) return scalar::attend_head(q, K, V, n, hd, scale, softcap, p, out);
  const int64_t chunks = hd / 8, held = std::min(chunks, registers);
  __m256 qv[registers];
  for (int64_t c = 0; c < held; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    __m256 acc = _mm256_mul_ps(qv[0], load8(K + j * hd));
    for (int64_t c = 1; c < held; ++c) acc = _mm256_fmadd_ps(qv[c], load8(K + j * hd + 8 * c), acc);
    for (int64_t c = held; c < chunks; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), load8(K + j * hd + 8 * c), acc);
    p[j] = softcap ? soft_capped(horizontal_sum(acc) * scale, softcap) : horizontal_sum(acc) * scale;
    top = std::max(top, p[j]);
  }
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(top)));
    _mm256_storeu_ps(p + j, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = horizontal_sum(total);
  if (j < n) {
    alignas(32) float rest[8];
    std::fill(rest, rest + 8, -std::numeric_limits<float>::infinity());
    std::copy(p + j, p + n, rest);
    _mm256_store_ps(rest, exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(rest), _mm256_set1_ps(top))));
    for (int64_t i = 0; j + i < n; ++i) sum += p[j + i] = rest[i];
  }
  const __m256 inverse = _mm256_set1_ps(1.0f / sum);
  for (int64_t first = 0; first < chunks; first += registers) {  // the output in pieces of `registers` vectors
    const int64_t piece = std::min(registers, chunks - first);
    __m256 acc[registers];
    for (int64_t c = 0; c < piece; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; ++k) {
      const __m256 w = _mm256_set1_ps(p[k]);
      for (int64_t c = 0; c < piece; ++c) acc[c] = _mm256_fmadd_ps(w, load8(V + k * hd + 8 * (first + c)), acc[c]);
    }
    for (int64_t c = 0; c < piece; ++c) _mm256_storeu_ps(out + 8 * (first + c), _mm256_mul_ps(acc[c], inverse));
  }
}

}  // namespace powerinfer::avx2
POWERINFER_TARGET_END
#endif

namespace powerinfer {
namespace {

constexpr int64_t SERIAL_KEYS = 2048;  // below this many (head, key) pairs a call stays on one thread

template <typename Value>
HeadKernel<Value> head_kernel() {
  switch (active_isa()) {
#ifdef POWERINFER_X86
    case Isa::AVX512: return avx512::attend_head<Value>;
    case Isa::AVX2: return avx2::attend_head<Value>;
#endif
    default: return scalar::attend_head<Value>;
  }
}

// RoPE on one head: pair i of its first rope_dim values (2i and 2i + 1, or with NeoX i and
// i + rope_dim / 2) *= rotation i (cos, sin), as complex numbers.
void rotate(float* x, const float* rotation, int64_t rope_dim, bool neox) {
  const int64_t pairs = rope_dim / 2, step = neox ? 1 : 2, other = neox ? pairs : 1;
  for (int64_t i = 0; i < pairs; ++i) {
    float& re = x[i * step];
    float& im = x[i * step + other];
    const float a = re, b = im, c = rotation[2 * i], s = rotation[2 * i + 1];
    re = a * c - b * s;
    im = a * s + b * c;
  }
}

// The first position a query at `pos` sees: fewer than `window` positions back (window 0: all).
int64_t first_key(int64_t pos, int64_t window) { return window ? std::max<int64_t>(0, pos - window + 1) : 0; }

}  // namespace

namespace {

// Rotates q and k of each row in place, stores each row's k and v at its position of its slot,
// then attends each (row, q head) over the keys it sees, into out [rows, n_head * hd].
template <typename Value>
void store_and_attend(float* q, int64_t width, torch::Tensor keys, torch::Tensor values,
                      const std::vector<int64_t>& slots, const std::vector<int64_t>& positions, const float* rp,
                      const AttentionSpec& spec, float* o) {
  const int64_t n_head = spec.n_head, n_kv = spec.n_kv, rope_dim = spec.rope_dim;
  const int64_t rows = static_cast<int64_t>(slots.size()), hd = keys.size(3), n_ctx = keys.size(2);
  Value* kc = keys.data_ptr<Value>();
  Value* vc = values.data_ptr<Value>();
  const int64_t group = n_head / n_kv;
  int64_t work = 0;
  for (int64_t b = 0; b < rows; ++b) {
    float* row = q + b * width;
    for (int64_t h = 0; h < n_head + n_kv; ++h) rotate(row + h * hd, rp + b * rope_dim, rope_dim, spec.neox);
    for (int64_t g = 0; g < n_kv; ++g) {
      const int64_t at = g * n_ctx * hd + positions[b] * hd;
      // float -> Value rounds to nearest even, as torch's conversion does (the prefill's stores)
      std::copy_n(row + (n_head + g) * hd, hd, kc + slots[b] * keys.stride(0) + at);
      std::copy_n(row + (n_head + n_kv + g) * hd, hd, vc + slots[b] * values.stride(0) + at);
    }
    work += n_head * (positions[b] + 1 - first_key(positions[b], spec.window));
  }
  const float scale = spec.scale ? spec.scale : 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t tasks = rows * n_head;
  const HeadKernel<Value> attend_head = head_kernel<Value>();
  at::parallel_for(0, tasks, work < SERIAL_KEYS ? tasks : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / n_head, h = t % n_head, first = first_key(positions[b], spec.window);
      const int64_t n = positions[b] + 1 - first, kv = (h / group) * n_ctx * hd + first * hd;
      p.resize(n);
      attend_head(q + b * width + h * hd, kc + slots[b] * keys.stride(0) + kv, vc + slots[b] * values.stride(0) + kv, n, hd,
                  scale, spec.softcap, p.data(), o + b * n_head * hd + h * hd);
    }
  });
}

}  // namespace

// qkv: float32 [rows, (n_head + 2 n_kv) * hd], q heads then k heads then v heads (rotated in place);
// keys, values: float16 or float32 [slots, n_kv, n_ctx, hd]; rotations: complex64 with
// rows * rope_dim/2 elements (each row's position). Returns float32 [rows, n_head * hd].
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values,
                               const std::vector<int64_t>& slots, const std::vector<int64_t>& positions,
                               torch::Tensor rotations, const AttentionSpec& spec) {
  const int64_t n_head = spec.n_head, n_kv = spec.n_kv, rope_dim = spec.rope_dim;
  const int64_t rows = qkv.size(0), hd = keys.size(3), n_ctx = keys.size(2);
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (n_head + 2 * n_kv) * hd,
              "qkv must be contiguous float32 [rows, (n_head + 2 n_kv) * head_dim]");
  const bool half = keys.dtype() == torch::kFloat16;
  for (const auto& cache : {keys, values})
    TORCH_CHECK((cache.dtype() == torch::kFloat32 || half) && cache.dtype() == keys.dtype() && cache.dim() == 4 &&
                    cache.size(1) == n_kv && cache.stride(3) == 1 && cache.stride(2) == hd && cache.stride(1) == n_ctx * hd &&
                    cache.sizes() == keys.sizes(),
                "caches must be both float16 or both float32, [slots, n_kv, n_ctx, head_dim] with contiguous slots");
  TORCH_CHECK(n_kv > 0 && n_head % n_kv == 0, "n_head must be a multiple of n_kv");
  TORCH_CHECK(rope_dim >= 0 && rope_dim <= hd && rope_dim % 2 == 0 && spec.window >= 0, "rope_dim: even, at most head_dim");
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == rows && static_cast<int64_t>(positions.size()) == rows,
              "one slot and one position per row");
  TORCH_CHECK(rotations.dtype() == torch::kComplexFloat && rotations.numel() == rows * rope_dim / 2,
              "rotations: complex64, rope_dim/2 per row");
  for (int64_t b = 0; b < rows; ++b)
    TORCH_CHECK(slots[b] >= 0 && slots[b] < keys.size(0) && positions[b] >= 0 && positions[b] < n_ctx, "slot or position out of range");
  const auto rot = torch::view_as_real(rotations.contiguous()).contiguous();
  auto out = torch::empty({rows, n_head * hd}, qkv.options());
  const auto run = [&](auto value) {  // `value`: a Value, for its type
    store_and_attend<decltype(value)>(qkv.data_ptr<float>(), qkv.size(1), keys, values, slots, positions,
                                      rot.data_ptr<float>(), spec, out.data_ptr<float>());
  };
  half ? run(c10::Half{}) : run(0.0f);
  return out;
}

}  // namespace powerinfer
