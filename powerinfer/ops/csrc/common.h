// What every native operator shares: the activation numbering, block sizes, GGML type ids, the
// instruction-set dispatch, and small helpers.
//
// Instruction sets. The translation units are compiled for the baseline x86-64 (a wheel must run
// on any x86-64 CPU); kernels for newer CPUs sit in regions opened with POWERINFER_TARGET_AVX512 /
// POWERINFER_TARGET_AVX2 and closed with POWERINFER_TARGET_END, and are chosen once at run time
// from the CPU's features (`active_isa()`). Such a region comes after every #include, holds only
// our own code and intrinsics (library code instantiated inside would be compiled for that target
// and could be picked by the linker for every caller), and its functions live in the namespace of
// their instruction set.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace powerinfer {

// FFN activations, for every kernel and for Python (bindings.cpp exports them as `Activation`, by
// the names of powerinfer.config.FFNActivation). Gated ones compute act(gate) * up.
enum class Activation : int64_t { RELU_GATED = 0, SILU_GATED = 1, GELU_GATED = 2, DRELU = 3, RELU = 4, GELU = 5 };

inline bool is_gated(Activation a) { return a != Activation::RELU && a != Activation::GELU; }

// GGML's tensor type ids (ggml.h, as the gguf package numbers them).
enum class GgmlType : int64_t { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11,
                                Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr int64_t QK = 32;     // weights per block of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0; x is rounded to int8 per 32
constexpr int64_t QK_K = 256;  // weights per K-quant super-block
constexpr int64_t QK_SUB = 16; // the smallest K-quant sub-block (Q2_K, Q3_K, Q6_K; Q4_K and Q5_K use 32)
// x rounded to int8 per block of QK: scale = max |x| / INT8_X_MAX, values nearbyint(x / scale)
constexpr float INT8_X_MAX = 127.0f;

// Instruction sets, lowest first. AVX512 means F, BW, VL, DQ, VNNI and BF16 together (Cooper Lake,
// Sapphire Rapids, Zen 4 and later); AVX2 means AVX2, FMA and F16C (Haswell, Zen 1 and later).
enum class Isa : int { SCALAR = 0, AVX2 = 1, AVX512 = 2 };

Isa detected_isa();       // the best this CPU and OS run
Isa active_isa();         // the one kernels use: detected, or lower where POWERINFER_ISA says so
void set_isa(Isa isa);    // switch (tests run each path); refuses one the CPU lacks
const char* isa_name(Isa isa);
// AVX-VNNI (Alder Lake, Sapphire Rapids, Zen 5 and later): the AVX2 kernels of QuantLinear and of the
// Q8 channel runs sum 4 byte (or 2 int16) products per int32 lane in one instruction where the CPU
// has it, with the same integer results.
// On unless POWERINFER_AVX_VNNI=0 (or off, false, no: as a CPU without it runs).
bool avx_vnni_detected();
bool avx_vnni_active();
void set_avx_vnni(bool on);  // refuses on where the CPU lacks it
// QuantLinear on AVX-512: the bfloat16 dot product kernel (on), or the AVX2 integer kernels, x rounded
// to int8 (off). By default on for AMD's CPUs only (isa.cpp says why); POWERINFER_BF16_DOT=1 or 0 sets it.
bool bf16_dot_active();
void set_bf16_dot(bool on);  // refuses on where the CPU has no AVX-512
// The instruction set of QuantLinear's kernels (and of prefill's dense pass over channel runs):
// active_isa(), but AVX2 on AVX-512 with the bfloat16 dot product off.
Isa quant_kernel_isa();

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// float -> bfloat16 bits, rounded to nearest even (what torch's .to(torch.bfloat16) does).
inline uint16_t bf16_bits(float v) { return c10::BFloat16(v).x; }

inline float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &wide, 4);
  return v;
}

// The cache a prefetch fills.
enum class CacheLevel { L1, L2 };

// Reads the line at p into the cache ahead of use (for access the hardware prefetchers miss).
// L2 (prefetcht1) unless said: a burst of L1 prefetches outruns the few L1 miss buffers (measured
// on AMD EPYC Zen 4, one thread, from memory: sparse FFN records 9.7 -> 16.2 GB/s, QuantLinear
// Q4_0 11 -> 13.5 GB/s and Q6_K 8.5 -> 10 GB/s); the kernels' own loads then hit L2.
// L1 (prefetcht0) for kernels that fetch one line ahead per line they consume (no burst), a few
// hundred cycles before its use (SparseInputProjection's groups of runs: measured against L2 on an
// AMD EPYC, 2 threads, 50 % skipped, AVX2 runs of an 11008 -> 4096 Q4_0 linear 0.79x -> 0.97x the
// dense kernel's speed, AVX-512 0.99x -> 1.12x; none slower), where L1 holds 48 KB: with 32 KB
// they go to L2 (sparse_input_simd.cpp's FETCH_TO_L1).
template <CacheLevel LEVEL = CacheLevel::L2>
inline void prefetch_line(const uint8_t* p) {
  // An asm statement on x86, not __builtin_prefetch: GCC takes a function whose only effect is a
  // prefetch for one without effects and drops the calls to it (SparseInputProjection's kernel had
  // no prefetch instruction left).
#if defined(__x86_64__) || defined(_M_X64)
  if constexpr (LEVEL == CacheLevel::L1)
    asm volatile("prefetcht0 (%0)" : : "r"(p));
  else
    asm volatile("prefetcht1 (%0)" : : "r"(p));
#else
  __builtin_prefetch(p, 0, LEVEL == CacheLevel::L1 ? 3 : 2);
#endif
}

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) prefetch_line(p + at);
}

}  // namespace powerinfer

#if defined(__x86_64__) || defined(_M_X64)
#define POWERINFER_X86 1
#define POWERINFER_TARGET_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c,bmi,bmi2\")")
#define POWERINFER_TARGET_AVX512 \
  _Pragma("GCC push_options")    \
      _Pragma("GCC target(\"avx2,fma,f16c,bmi,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16\")")
#define POWERINFER_TARGET_END _Pragma("GCC pop_options")
#endif
