// Lane helpers that every AVX2 kernel shares (float16 loads, horizontal sums, AVX-VNNI's sums). A target region, so
// each file includes this header after all of its other #includes (common.h says why).
#pragma once

#include "common.h"

#ifdef POWERINFER_X86
#include <immintrin.h>

POWERINFER_TARGET_AVX2
namespace powerinfer::avx2 {

// 8 float16 values at p as float32 lanes (F16C).
inline __m256 halves(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))); }

// The sum of v's 8 lanes.
inline float horizontal_sum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// AVX-VNNI (VEX forms), for kernels chosen only where the CPU has it (avx_vnni_active()). In assembly so
// that the region stays AVX2 for the compiler, which could otherwise place the instructions in code
// that runs on CPUs without them.
// sums + the 4 products of unsigned bytes u8 and signed bytes s8 per int32 lane (vpdpbusd)
inline __m256i dpbusd(__m256i sums, __m256i u8, __m256i s8) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(sums) : "x"(u8), "x"(s8));
  return sums;
}
// sums + the 2 products of int16 a and b per int32 lane (vpdpwssd: _mm256_madd_epi16 and an add)
inline __m256i dpwssd(__m256i sums, __m256i a, __m256i b) {
  asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(sums) : "x"(a), "x"(b));
  return sums;
}

// sums + the 2 products of int16 a and b per int32 lane: vpdpwssd with VNNI, else madd and an add
// (the same int32 sums).
template <bool VNNI>
inline __m256i add_pair_products(__m256i sums, __m256i a, __m256i b) {
  if constexpr (VNNI) return dpwssd(sums, a, b);
  else return _mm256_add_epi32(sums, _mm256_madd_epi16(a, b));
}

}  // namespace powerinfer::avx2
POWERINFER_TARGET_END
#endif
