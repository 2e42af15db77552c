// y = x @ W.T for Q4_0, Q4_1 and Q8_0 weights, on AVX-512 bfloat16 dot products.
//
// The quantized integers (0..15 nibbles, -128..127 bytes) are exact in bfloat16, so one
// `vdpbf16ps` multiplies a pair of bfloat16 activations by a pair of weights exactly and adds both
// products to a float32 lane: 32 multiply-adds per instruction, twice what float32 FMAs give (torch's
// int4 kernel dequantizes every weight to float32 and is bound by its FMAs once a few rows share a
// step). Per block of 32 inputs, with scale d and offset m (fp16, exact):
//     sum_k x_k (d n_k + m) = d * sum_k x_k n_k + m * sum_k x_k
// accumulated in float32, output float32. Each row's arithmetic depends on that row only, so a row
// gets the same bits whatever other rows share the call.
//
// Layout, per block of 16 outputs (zero rows pad the last block):
//   weight [N/16, K/2, 16 * bytes]: per input pair (2p, 2p+1), for each of the 16 outputs
//       4-bit: one byte, nibble of input 2p low, of input 2p+1 high
//       8-bit: two int8, inputs 2p and 2p+1
//   scales fp16 [N/16, K/32, parts, 16]: d of each output (and, 4-bit, m) per block of 32 inputs
// Plain-torch reference: QuantLinear.dequantized() in powerinfer/ops/linear.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define POWERINFER_QUANT_MATMUL 1
#endif

namespace {

constexpr int64_t GROUP = 32;    // inputs per scale
constexpr int64_t COLS = 16;     // outputs per block: one float32 vector
constexpr int64_t MAX_ROWS = 8;  // rows sharing one conversion of the weights

#ifdef POWERINFER_QUANT_MATMUL

// Rows [0, ROWS) of one block of 16 outputs. pairs: the rows' bfloat16 inputs as 32-bit pairs
// (row stride K/2); sums: per row and block of 32 inputs, the sum of the inputs (4-bit offsets).
template <int ROWS, bool EIGHT_BIT>
void output_block(const uint32_t* pairs, const float* sums, int64_t K, const uint8_t* weight,
                  const uint16_t* scales, float* out, int64_t ldc, __mmask16 store_mask) {
  // bfloat16 bits of 0..15, for the low and the high half of a 32-bit lane
  const __m512i low_lut = _mm512_setr_epi32(0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                            0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170);
  const __m512i high_lut = _mm512_slli_epi32(low_lut, 16);
  const int64_t groups = K / GROUP, pair_bytes = EIGHT_BIT ? 32 : 16, parts = EIGHT_BIT ? 1 : 2;
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 dot[ROWS];
    for (int r = 0; r < ROWS; ++r) dot[r] = _mm512_setzero_ps();
    const uint8_t* w = weight + g * (GROUP / 2) * pair_bytes;
    for (int64_t p = 0; p < GROUP / 2; ++p) {
      __m512i wv;
      if constexpr (EIGHT_BIT) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
        wv = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // exact: |q| <= 128
      } else {
        // permutexvar reads the low 4 bits of each index: the low nibble, then the shifted high one
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 16)));
        wv = _mm512_or_si512(_mm512_permutexvar_epi32(b, low_lut),
                             _mm512_permutexvar_epi32(_mm512_srli_epi32(b, 4), high_lut));
      }
      const int64_t k2 = g * (GROUP / 2) + p;
      for (int r = 0; r < ROWS; ++r) {
        const __m512i x = _mm512_set1_epi32(static_cast<int>(pairs[r * (K / 2) + k2]));
        dot[r] = _mm512_dpbf16_ps(dot[r], reinterpret_cast<__m512bh>(wv), reinterpret_cast<__m512bh>(x));
      }
    }
    const uint16_t* s = scales + g * parts * COLS;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(dot[r], d, acc[r]);
    if constexpr (!EIGHT_BIT) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + COLS)));
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * groups + g]), m, acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) _mm512_mask_storeu_ps(out + r * ldc, store_mask, acc[r]);
}

template <bool EIGHT_BIT>
void output_block_rows(int rows, const uint32_t* pairs, const float* sums, int64_t K, const uint8_t* weight,
                       const uint16_t* scales, float* out, int64_t ldc, __mmask16 mask) {
  switch (rows) {
    case 1: return output_block<1, EIGHT_BIT>(pairs, sums, K, weight, scales, out, ldc, mask);
    case 2: return output_block<2, EIGHT_BIT>(pairs, sums, K, weight, scales, out, ldc, mask);
    case 3: return output_block<3, EIGHT_BIT>(pairs, sums, K, weight, scales, out, ldc, mask);
    case 4: return output_block<4, EIGHT_BIT>(pairs, sums, K, weight, scales, out, ldc, mask);
    case 5: return output_block<5, EIGHT_BIT>(pairs, sums, K, weight, scales, out, ldc, mask);
    case 6: return output_block<6, EIGHT_BIT>(pairs, sums, K, weight, scales, out, ldc, mask);
    case 7: return output_block<7, EIGHT_BIT>(pairs, sums, K, weight, scales, out, ldc, mask);
    case 8: return output_block<8, EIGHT_BIT>(pairs, sums, K, weight, scales, out, ldc, mask);
    default: TORCH_CHECK(false, "at most ", MAX_ROWS, " rows per block");
  }
}

// x as bfloat16, row-major. float32 is rounded to nearest even here (denormals become 0), which
// spares a torch call and a tensor per projection.
std::vector<uint16_t> as_bf16(const torch::Tensor& x) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const auto xc = bf16 || x.scalar_type() == torch::kFloat32 ? x.contiguous() : x.to(torch::kFloat32).contiguous();
  std::vector<uint16_t> out(xc.numel());
  if (bf16) {
    std::memcpy(out.data(), xc.data_ptr(), out.size() * 2);
    return out;
  }
  const float* f = xc.data_ptr<float>();
  for (size_t i = 0; i < out.size(); i += 16)  // numel is a multiple of 32
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.data() + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(f + i))));
  return out;
}

// Per row and block of 32 inputs, the float32 sum of the bfloat16 inputs (a fixed order per row).
std::vector<float> block_sums(const uint16_t* x, int64_t M, int64_t K) {
  std::vector<float> sums(M * (K / GROUP));
  for (int64_t i = 0; i < M * (K / GROUP); ++i) {
    const __m512i raw = _mm512_loadu_si512(x + i * GROUP);
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
  return sums;
}

#endif

}  // namespace

bool quant_matmul_available() {
#ifdef POWERINFER_QUANT_MATMUL
  return true;
#else
  return false;
#endif
}

// x [M, K] (any float type; rounded to bfloat16), weight and scales as above -> float32 [M, out_features].
torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales,
                           int64_t out_features) {
  TORCH_CHECK(quant_matmul_available(), "quant_matmul needs AVX-512 with bfloat16 dot products");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, inputs]");
  TORCH_CHECK(weight.dtype() == torch::kUInt8 && weight.dim() == 3 && weight.is_contiguous() &&
                  (weight.size(2) == COLS || weight.size(2) == 2 * COLS),
              "weight must be contiguous uint8 [N/16, K/2, 16 or 32]");
  const bool eight_bit = weight.size(2) == 2 * COLS;
  const int64_t M = x.size(0), K = x.size(1), blocks = weight.size(0), groups = K / GROUP;
  TORCH_CHECK(K % GROUP == 0 && weight.size(1) * 2 == K, "x has ", K, " inputs, the weight ", weight.size(1) * 2);
  TORCH_CHECK(scales.dtype() == torch::kHalf && scales.is_contiguous() && scales.dim() == 4 && scales.size(0) == blocks &&
                  scales.size(1) == groups && scales.size(2) == (eight_bit ? 1 : 2) && scales.size(3) == COLS,
              "scales must be contiguous float16 [N/16, K/32, parts, 16]");
  TORCH_CHECK(out_features > (blocks - 1) * COLS && out_features <= blocks * COLS, "out_features does not match the weight");
  auto out = torch::empty({M, out_features}, x.options().dtype(torch::kFloat32));
#ifdef POWERINFER_QUANT_MATMUL
  const std::vector<uint16_t> xb = as_bf16(x);
  const uint16_t* xs = xb.data();
  const std::vector<float> sums = eight_bit ? std::vector<float>() : block_sums(xs, M, K);
  const auto* pairs = reinterpret_cast<const uint32_t*>(xs);
  const auto* w = weight.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  float* y = out.data_ptr<float>();
  const int64_t row_blocks = (M + MAX_ROWS - 1) / MAX_ROWS;
  const int64_t w_stride = weight.stride(0), s_stride = scales.stride(0);
  // Tasks: (output block, row block), row blocks innermost so that they reuse the weights in cache.
  at::parallel_for(0, blocks * row_blocks, 0, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t nb = t / row_blocks, m0 = (t % row_blocks) * MAX_ROWS;
      const int rows = static_cast<int>(std::min(MAX_ROWS, M - m0));
      const int64_t cols = std::min(COLS, out_features - nb * COLS);
      const auto mask = static_cast<__mmask16>((1u << cols) - 1);
      const uint32_t* p = pairs + m0 * (K / 2);
      float* o = y + m0 * out_features + nb * COLS;
      if (eight_bit) output_block_rows<true>(rows, p, nullptr, K, w + nb * w_stride, s + nb * s_stride, o, out_features, mask);
      else output_block_rows<false>(rows, p, sums.data() + m0 * groups, K, w + nb * w_stride, s + nb * s_stride, o, out_features, mask);
    }
  });
#endif
  return out;
}

void register_quant_matmul(pybind11::module& m) {
  m.def("quant_matmul_available", &quant_matmul_available, "whether this build has the AVX-512 bfloat16 kernel");
  m.def("quant_matmul", &quant_matmul, "x @ W.T for Q4_0/Q4_1/Q8_0 weights in the paired layout (float32 out)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
