// Which instruction set the kernels use: detected once from the CPU (and whether the OS saves the
// wider registers, which the compiler's CPU-feature check includes), lowered by POWERINFER_ISA
// (avx512, avx2 or scalar; a set the CPU lacks, or an unknown name, leaves the detected one); and
// whether the AVX2 kernel uses AVX-VNNI (POWERINFER_AVX_VNNI=0: not); and whether QuantLinear's AVX-512
// kernel is the bfloat16 one (POWERINFER_BF16_DOT).
#include "common.h"

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

namespace powerinfer {
namespace {

Isa detect() {
#ifdef POWERINFER_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16");
  return avx512 ? Isa::AVX512 : avx2 ? Isa::AVX2 : Isa::SCALAR;
#else
  return Isa::SCALAR;
#endif
}

Isa from_environment(Isa detected) {
  const char* wanted = std::getenv("POWERINFER_ISA");
  if (wanted == nullptr) return detected;
  for (const Isa isa : {Isa::SCALAR, Isa::AVX2, Isa::AVX512})
    if (std::string(wanted) == isa_name(isa)) return isa < detected ? isa : detected;
  return detected;
}

std::atomic<int>& current() {
  static std::atomic<int> isa{static_cast<int>(from_environment(detected_isa()))};
  return isa;
}

}  // namespace

Isa detected_isa() {
  static const Isa isa = detect();
  return isa;
}

Isa active_isa() { return static_cast<Isa>(current().load(std::memory_order_relaxed)); }

void set_isa(Isa isa) {
  if (isa > detected_isa())
    throw std::invalid_argument(std::string("this CPU does not run ") + isa_name(isa) + " (best: " + isa_name(detected_isa()) + ")");
  current().store(static_cast<int>(isa), std::memory_order_relaxed);
}

bool avx_vnni_detected() {
#ifdef POWERINFER_X86
  static const bool has = detected_isa() >= Isa::AVX2 && __builtin_cpu_supports("avxvnni");
  return has;
#else
  return false;
#endif
}

namespace {
// A switch's environment variable: 1, on, true, yes -> on; 0, off, false, no -> off (any case); unset or
// anything else: nullopt (the default).
std::optional<bool> switched_by_environment(const char* name) {
  const char* wanted = std::getenv(name);
  if (wanted == nullptr) return std::nullopt;
  std::string value(wanted);
  for (char& c : value) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (value == "1" || value == "on" || value == "true" || value == "yes") return true;
  if (value == "0" || value == "off" || value == "false" || value == "no") return false;
  return std::nullopt;
}

std::atomic<bool>& vnni() {
  static std::atomic<bool> on{avx_vnni_detected() && switched_by_environment("POWERINFER_AVX_VNNI").value_or(true)};
  return on;
}

// On AMD's CPUs QuantLinear's bfloat16 kernel is the faster one at several rows (Zen 5, 2 threads:
// 1.4-1.9x the integer kernels at 8 rows, the same at 1: benchmarks/results/quant_kernels.md).
// Intel's cores run 512-bit vectors on two ports of their three: there the integer kernels
// (AVX-VNNI) were 1.2-2.5x faster at one row and 1.0-2.0x at eight (Emerald Rapids, 2 threads:
// benchmarks/results/quant_kernels_avx512_emerald_rapids.md).
bool bf16_dot_by_default() {
#ifdef POWERINFER_X86
  __builtin_cpu_init();
  return __builtin_cpu_is("amd");
#else
  return false;
#endif
}

std::atomic<bool>& bf16_dot() {
  static std::atomic<bool> on{detected_isa() == Isa::AVX512 &&
                              switched_by_environment("POWERINFER_BF16_DOT").value_or(bf16_dot_by_default())};
  return on;
}
}  // namespace

bool bf16_dot_active() { return bf16_dot().load(std::memory_order_relaxed); }

void set_bf16_dot(bool on) {
  if (on && detected_isa() < Isa::AVX512) throw std::invalid_argument("this CPU has no AVX-512 bfloat16 dot product");
  bf16_dot().store(on, std::memory_order_relaxed);
}

Isa quant_kernel_isa() {
  const Isa isa = active_isa();
  return isa == Isa::AVX512 && !bf16_dot_active() ? Isa::AVX2 : isa;
}

bool avx_vnni_active() { return vnni().load(std::memory_order_relaxed); }

void set_avx_vnni(bool on) {
  if (on && !avx_vnni_detected()) throw std::invalid_argument("this CPU has no AVX-VNNI");
  vnni().store(on, std::memory_order_relaxed);
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::AVX512: return "avx512";
    case Isa::AVX2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace powerinfer
