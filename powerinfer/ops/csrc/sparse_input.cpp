// SparseInputProjection (sparse_input.h): the layout built from row blocks, the selection, the split
// of the blocks over threads, the prefill path, and the scalar kernel (CPUs without AVX2);
// sparse_input_simd.cpp holds the AVX2 one.
#include "sparse_input.h"

#include "quant_matmul.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>

#ifdef POWERINFER_X86
#include <emmintrin.h>
#endif

namespace powerinfer {

namespace {

// float -> float16 bits, rounded to nearest even (as torch rounds)
uint16_t half_bits(float v) { return c10::Half(v).x; }

// A nibble of a byte: the high one or the low one.
int nibble(uint8_t byte, bool high) { return high ? byte >> 4 : byte & 0x0F; }
void put_nibble(uint8_t& byte, bool high, int q) {
  byte = static_cast<uint8_t>(high ? (byte & 0x0F) | (q << 4) : (byte & 0xF0) | q);
}

// The weight of output o, channel c of a block, as the form's integer (4-bit: 0..15; Q6: 0..63; Q8:
// -128..127).
int q_at(const RunLayout& l, const uint8_t* block, int64_t c, int64_t o) {
  const uint8_t* run = block + l.run_at(c);
  if (l.form == RunForm::Q8) return static_cast<int8_t>(run[q8_slot(o)]);
  if (l.form == RunForm::Q6) {
    const Q6Slots at = q6_slots(o);
    return nibble(run[at.low_byte], at.high_nibble) | ((run[at.top_byte] >> at.top_shift) & 3) << 4;
  }
  const auto [byte, high] = q4_slot(o);
  return nibble(run[byte], high);
}

// Puts q (the form's integer, as q_at gives it) of output o, channel c.
void put_q(const RunLayout& l, uint8_t* block, int64_t c, int64_t o, int q) {
  uint8_t* run = block + l.run_at(c);
  if (l.form == RunForm::Q8) {
    run[q8_slot(o)] = static_cast<uint8_t>(q);
  } else if (l.form == RunForm::Q6) {
    const Q6Slots at = q6_slots(o);
    put_nibble(run[at.low_byte], at.high_nibble, q & 0x0F);
    run[at.top_byte] = static_cast<uint8_t>((run[at.top_byte] & ~(3 << at.top_shift)) | (q >> 4) << at.top_shift);
  } else {
    const auto [byte, high] = q4_slot(o);
    put_nibble(run[byte], high, q);
  }
}


// Q4 (Q4_0 rows): per output and super-block (QK_K inputs) the float16 D = largest |d| / 127 of its
// blocks, into the table of the runs at `base` (`rows` rows of raw Q4_0 blocks f, outputs from `first`).
void put_q4_table(const BlockFormat& f, const RunLayout& l, uint8_t* base, const uint8_t* src, int64_t row_bytes,
                  int64_t rows, int64_t first) {
  constexpr int64_t per_super = RunLayout::BLOCKS_PER_SUPER;
  at::parallel_for(0, l.super_blocks(), 1, [&](int64_t s0, int64_t s1) {
    BlockScales scales;
    for (int64_t sb = s0; sb < s1; ++sb)
      for (int64_t r = 0; r < rows; ++r) {
        float largest = 0.0f;
        for (int64_t b = sb * per_super; b < std::min((sb + 1) * per_super, l.blocks()); ++b) {
          decode_scales(f, src + r * row_bytes + b * f.bytes, scales);
          largest = std::max(largest, std::fabs(half_to_float(reinterpret_cast<const uint8_t*>(&scales.d))));
        }
        const uint16_t dh = half_bits(largest / 127.0f);
        std::memcpy(base + l.table_at(sb * per_super) + l.table_d_at(first + r), &dh, 2);
      }
  });
}

// A Q4_0 block's d as the Q4 form's signed byte on its table entry D (d rounded to a multiple of D:
// at most D / 2 off, D = the super-block's largest |d| / 127).
uint8_t q4_scale_byte(float d, const uint8_t* table_d) {
  const float step = half_to_float(table_d);
  const float units = step > 0.0f ? std::nearbyint(d / step) : 0.0f;
  // a file's NaN or infinite d gives 0 (no float-to-int of a NaN)
  return static_cast<uint8_t>(static_cast<int8_t>(std::isnan(units) ? 0.0f : std::clamp(units, -127.0f, 127.0f)));
}

}  // namespace

GgmlType packed_type(RunForm form) {
  switch (form) {
    case RunForm::Q4: return GgmlType::Q4_0;
    case RunForm::Q4_MIN: return GgmlType::Q4_1;
    case RunForm::Q4_K: return GgmlType::Q4_K;
    case RunForm::Q8: return GgmlType::Q8_0;
    case RunForm::Q6: return GgmlType::Q6_K;
  }
  throw std::invalid_argument("not a run form");
}

namespace {

// The form that rows of this type take.
RunForm form_of(const BlockFormat& f) {
  switch (f.type) {
    case GgmlType::Q4_0: return RunForm::Q4;
    case GgmlType::Q4_1: return RunForm::Q4_MIN;
    case GgmlType::Q4_K: return RunForm::Q4_K;
    case GgmlType::Q8_0: return RunForm::Q8;
    case GgmlType::Q6_K: return RunForm::Q6;
    default: throw std::invalid_argument("GGML type " + std::to_string(static_cast<int>(f.type)) + " has no channel-run form");
  }
}

}  // namespace

std::vector<RunPart> run_parts(const std::vector<int64_t>& types, const std::vector<int64_t>& outputs, int64_t in_features) {
  if (types.empty() || types.size() != outputs.size()) throw std::invalid_argument("one GGML type and output count per matrix");
  if (in_features <= 0 || in_features % QK) throw std::invalid_argument("input channels must be whole blocks of 32");
  std::vector<RunPart> parts;
  int64_t first = 0;
  for (size_t p = 0; p < types.size(); ++p) {
    const BlockFormat& f = block_format(types[p]);
    if (outputs[p] <= 0) throw std::invalid_argument("a matrix needs outputs");
    if (in_features % f.n) throw std::invalid_argument("input channels are not whole blocks of the type");
    const RunForm form = form_of(f);
    RunLayout* last = parts.empty() ? nullptr : &parts.back().layout;
    // the 4-bit types share a part: of two different 4-bit forms, Q4_MIN (d and m per block)
    const bool joins = last && (last->form == form || (last->four_bit() && four_bit_form(form)));
    if (joins) {
      if (last->form != form) last->form = RunForm::Q4_MIN;
      last->out_features += outputs[p];
    } else {
      parts.push_back({{form, in_features, outputs[p], 0}, 0, first, 0});
    }
    first += outputs[p];
  }
  int64_t offset = 0, first_padded = 0;
  for (RunPart& part : parts) {
    RunLayout& l = part.layout;
    l.padded = (l.out_features + RUN_GROUP - 1) / RUN_GROUP * RUN_GROUP;
    part.offset = offset, part.first_padded = first_padded;
    offset += l.bytes(), first_padded += l.padded;
  }
  return parts;
}

int64_t run_bytes(const std::vector<RunPart>& parts) {
  int64_t bytes = 0;
  for (const RunPart& part : parts) bytes += part.layout.bytes();
  return bytes;
}

namespace scalar {

// Output o of the runs over file block fb's inputs, as decode_block gives a block of packed_type(form).
void decode_runs(const RunLayout& l, const uint8_t* runs, const BlockFormat& f, int64_t fb, int64_t o, DecodedBlock& out) {
  const auto u16 = [](const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; };
  out.dmin = 0, out.sc[0] = 1, out.mn[0] = 1;
  const int64_t per_block = f.n / QK;  // run blocks per file block
  for (int64_t sub = 0; sub < per_block; ++sub) {
    const int64_t b = fb * per_block + sub;
    const uint8_t* block = runs + b * l.block_bytes();
    const uint8_t* table = table_of(l, runs, b);
    switch (l.form) {
      case RunForm::Q4:
        out.d = half_bits(half_to_float(table + l.table_d_at(o)) * static_cast<int8_t>(block[l.d_at(o)]));
        break;
      case RunForm::Q4_MIN: out.d = u16(block + l.d_at(o)), out.dmin = u16(block + l.m_at(o)); break;
      case RunForm::Q8: out.d = u16(block + l.d_at(o)); break;
      case RunForm::Q4_K:
        out.d = u16(table + l.table_d_at(o)), out.dmin = u16(table + l.table_m_at(o));
        out.sc[sub] = static_cast<int8_t>(block[l.d_at(o)]), out.mn[sub] = block[l.m_at(o)];
        break;
      case RunForm::Q6:
        out.d = u16(table + l.table_d_at(o));
        for (int64_t h = 0; h < l.sub_blocks(); ++h) out.sc[sub * l.sub_blocks() + h] = static_cast<int8_t>(block[l.d_at(o, h)]);
        break;
    }
    for (int64_t c = 0; c < QK; ++c) out.q[sub * QK + c] = static_cast<uint8_t>(q_at(l, block, c, o) + (l.form == RunForm::Q8 ? 128 : 0));
  }
}

void repack_runs(const RunLayout& l, const uint8_t* runs, int64_t g, uint8_t* chunks) {
  const BlockFormat& f = block_format(static_cast<int64_t>(packed_type(l.form)));
  const PackedLayout packed = packed_layout(f);
  const int64_t per_row = l.in_features / f.n;
  DecodedBlock blocks[COLS];
  for (int64_t nb = 0; nb < 4; ++nb) {
    const int64_t first = g + nb * COLS;
    const int n = static_cast<int>(std::clamp<int64_t>(l.out_features - first, 0, COLS));
    for (int64_t fb = 0; fb < per_row; ++fb) {
      for (int o = 0; o < n; ++o) decode_runs(l, runs, f, fb, first + o, blocks[o]);
      pack_decoded(f, packed, blocks, n, chunks + (nb * per_row + fb) * packed.bytes);
    }
  }
}

void add_runs(const RunLayout& l, const uint8_t* runs, const Selection& s, int64_t i0, int64_t i1, float* y) {
  std::vector<int32_t> acc(l.padded);
  for (int64_t i = i0; i < i1; ++i) {
    const uint8_t* block = runs + s.blocks[i] * l.block_bytes();
    for (int r = 0; r < s.rows; ++r) {
      const float scale = s.scale[i * s.rows + r];
      if (scale == 0.0f) continue;  // nothing of this row here
      for (int64_t sub = 0; sub < l.sub_blocks(); ++sub) {
        int32_t k_sum = 0;  // of the sub-block's channels (Q6: of a half; else the block's)
        for (int32_t j = s.start[i]; j < s.start[i + 1]; ++j) k_sum += l.sub_block(s.channel[j]) == sub ? s.k[j * s.rows + r] : 0;
        std::fill(acc.begin(), acc.end(), -l.q_offset() * k_sum);  // sums of k (q - q_offset), as the SIMD kernels'
        for (int32_t j = s.start[i]; j < s.start[i + 1]; ++j)
          if (l.sub_block(s.channel[j]) == sub)
            for (int64_t o = 0; o < l.padded; ++o) acc[o] += s.k[j * s.rows + r] * q_at(l, block, s.channel[j], o);
        const float rounded_sum = scale * static_cast<float>(k_sum);
        float* yr = y + r * l.padded;
        for (int64_t o = 0; o < l.padded; ++o) {
          const auto [d, m] = scales_at(l, runs, s.blocks[i], o, sub);
          yr[o] = std::fma(static_cast<float>(acc[o]), scale * d, yr[o]);
          if (l.has_min()) yr[o] = std::fma(rounded_sum, m + 8.0f * d, yr[o]);
        }
      }
    }
  }
}

}  // namespace scalar

namespace {

// The kernels of the active instruction set (AVX-512 CPUs take AVX2's repacker, which serves prefill
// only).
struct RunKernels {
  RunKernel add;
  RunRepacker repack;
  int group_rows;  // the most rows `add` takes in one selection
};

RunKernels run_kernels() {
  switch (active_isa()) {
#ifdef POWERINFER_X86
    case Isa::AVX512: return {avx512::add_runs, avx2::repack_runs, avx512::GROUP_ROWS};
    case Isa::AVX2: return {avx2::add_runs, avx2::repack_runs, avx2::GROUP_ROWS};
#endif
    default: return {scalar::add_runs, scalar::repack_runs, scalar::GROUP_ROWS};
  }
}

// Prefill (more than sparse_max_rows rows) reads every channel: the runs repacked 64 outputs at a time
// into the dense kernels' chunks (exactly their rows' chunks, Q4_0's d aside: D sc in float16), which
// then meet every row, as QuantProjection's do. Measured (AMD EPYC with AVX-512, 2 threads, nothing
// skipped, dense time / this time; before, in parentheses: groups of 4 rows through the runs for
// 4096 outputs or more, tiles of dequantized runs times torch's float product for fewer):
// 7B widths Q4_0 at 512 rows 0.93-0.99x (0.75-0.88x), at 64 rows 0.81-0.94x (0.74-0.88x), at 33
// rows 0.78-0.92x (0.85-0.94x); Q4_K at 512 rows 0.90-0.98x, at 64 0.79-0.87x (0.62-0.76x);
// SmolLM2's Q4_1 576 -> 3072 and 1536 -> 576 at 512 rows 0.95-0.97x and 0.85x (0.24x, 0.26x), its Q8_0
// head 0.95-0.96x (0.56x).
// Its tasks per thread at least this many (a narrow projection's rows go in ranges).
constexpr int64_t MIN_PREFILL_TASKS = 8;

// Blocks of 32 inputs per thread at least this many: fewer cost more in thread start than they save.
constexpr int64_t MIN_TASK_BLOCKS = 4;

}  // namespace

SparseInputProjection::SparseInputProjection(const std::vector<torch::Tensor>& rows, const std::vector<int64_t>& types,
                                             int64_t in_features, torch::Tensor thresholds_, int64_t sparse_max_rows_,
                                             torch::Tensor destination, const std::function<void()>& after_matrix)
    : thresholds(std::move(thresholds_)), sparse_max_rows(sparse_max_rows_) {
  std::vector<int64_t> outputs;
  for (const auto& r : rows) {
    TORCH_CHECK(r.dtype() == torch::kUInt8 && r.dim() == 2, "matrix rows must be uint8 [outputs, row bytes]");
    outputs.push_back(r.size(0));
  }
  try {
    parts = run_parts(types, outputs, in_features);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
  TORCH_CHECK(thresholds.dtype() == torch::kFloat32 && thresholds.dim() == 1 && thresholds.is_contiguous() &&
                  thresholds.size(0) == in_features,
              "thresholds must be contiguous float32 [", in_features, "]");
  const int64_t total = run_bytes(parts);
  TORCH_CHECK(destination.dtype() == torch::kUInt8 && destination.dim() == 1 && destination.is_contiguous() &&
                  destination.size(0) == total,
              "the destination of the runs must be contiguous uint8 [", total, "]");
  for (size_t p = 0; p < rows.size(); ++p) {
    const BlockFormat& f = block_format(types[p]);
    TORCH_CHECK(rows[p].size(1) == in_features / f.n * f.bytes, "matrix ", p, ": rows of ", rows[p].size(1),
                " bytes are not ", in_features, " values of its type");
  }
  runs = std::move(destination);
  runs.zero_();  // the padding outputs
  int64_t first = 0;
  for (size_t p = 0; p < rows.size(); ++p) {
    const RunPart& part = *std::find_if(parts.rbegin(), parts.rend(), [&](const RunPart& q) { return q.first <= first; });
    const RunLayout l = part.layout;
    uint8_t* base = runs.data_ptr<uint8_t>() + part.offset;
    const BlockFormat& f = block_format(types[p]);
    const auto source = rows[p].contiguous();
    const uint8_t* src = source.data_ptr<uint8_t>();
    const int64_t row_bytes = source.size(1), per_block = f.n / QK;
    if (l.form == RunForm::Q4) put_q4_table(f, l, base, src, row_bytes, source.size(0), first - part.first);
    // threads split the file's blocks along the inputs: two outputs may share a byte of a run
    at::parallel_for(0, in_features / f.n, 1, [&](int64_t fb0, int64_t fb1) {
      DecodedBlock q;
      for (int64_t fb = fb0; fb < fb1; ++fb) {
        for (int64_t r = 0; r < source.size(0); ++r) {
          const int64_t o = first - part.first + r;
          decode_block(f, src + r * row_bytes + fb * f.bytes, q);
          const float file_d = half_to_float(reinterpret_cast<const uint8_t*>(&q.d));
          const float file_m = half_to_float(reinterpret_cast<const uint8_t*>(&q.dmin));
          if (l.form == RunForm::Q4_K || l.form == RunForm::Q6) {  // the file's own D (and M) once per super-block (file block fb)
            std::memcpy(base + l.table_at(fb * per_block) + l.table_d_at(o), &q.d, 2);
            if (l.form == RunForm::Q4_K) std::memcpy(base + l.table_at(fb * per_block) + l.table_m_at(o), &q.dmin, 2);
          }
          for (int64_t sub = 0; sub < per_block; ++sub) {  // K-quants: a 32-value sub-block per block of runs
            uint8_t* block = base + (fb * per_block + sub) * l.block_bytes();
            if (l.form == RunForm::Q6) {  // the file's own sc per 16 inputs
              for (int64_t h = 0; h < l.sub_blocks(); ++h) block[l.d_at(o, h)] = static_cast<uint8_t>(q.sc[sub * l.sub_blocks() + h]);
            } else if (l.form == RunForm::Q4_K) {  // the file's own sc and mn per block
              block[l.d_at(o)] = static_cast<uint8_t>(q.sc[sub]);
              block[l.m_at(o)] = q.mn[sub];
            } else if (l.form == RunForm::Q4) {
              block[l.d_at(o)] = q4_scale_byte(file_d, base + l.table_at(fb) + l.table_d_at(o));
            } else {
              const float d = file_d * (f.sub_scales ? q.sc[sub] : 1);
              const float m = f.has_min ? file_m * (f.sub_scales ? q.mn[sub] : 1) : -8.0f * d;  // Q4_0 beside m: d q - 8 d
              const uint16_t dh = f.sub_scales ? half_bits(d) : q.d;  // the file's own bits where unscaled
              std::memcpy(block + l.d_at(o), &dh, 2);
              if (l.has_min()) {
                const uint16_t mh = f.has_min && !f.sub_scales ? q.dmin : half_bits(m);
                std::memcpy(block + l.m_at(o), &mh, 2);
              }
            }
            // Q8_0's q is int8 + 128; the 4-bit types' and Q6_K's q are the form's integers
            for (int64_t c = 0; c < QK; ++c) put_q(l, block, c, o, q.q[sub * QK + c] - (l.form == RunForm::Q8 ? 128 : 0));
          }
        }
      }
    });
    first += source.size(0);
    if (after_matrix) after_matrix();
  }
}

torch::Tensor SparseInputProjection::operator()(const torch::Tensor& x) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features(), "x must be [rows, ", in_features(), "]");
  const auto xf = x.to(torch::kFloat32).contiguous();
  if (xf.size(0) > sparse_max_rows) return dense_prefill(xf);
  auto y = torch::empty({xf.size(0), out_features()}, xf.options());
  const GroupRead read = sparse_rows(xf.data_ptr<float>(), xf.size(0), y.data_ptr<float>());
  selected_.store(read.selected, std::memory_order_relaxed);
  bytes_read_.store(read.bytes, std::memory_order_relaxed);
  return y;
}

namespace {

// One row's choice in one block of 32 inputs: k (x rounded to int8 on the block's largest active |x|,
// 0 where |x| <= the threshold), its scale and sum, which k are not 0, and how many |x| were above.
struct BlockChoice {
  float scale;
  int32_t sum;
  uint32_t nonzero;  // bit c: k[c] != 0
  int above;
};

#ifdef POWERINFER_X86
// The sum of v's four int32 lanes.
inline int32_t lane_sum(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1)));
}

// SSE2, which every x86-64 CPU has: the selection runs once per row, site and block (scalar, and on one
// thread while the others waited, it was about 5 % of a 7B-width decode step). _mm_cvtps_epi32 rounds
// to nearest, ties to even, as std::nearbyint. No popcnt either: the channels above are counted in lanes.
BlockChoice choose_block(const float* x, const float* limit, int8_t* k) {
  const __m128 sign = _mm_set1_ps(-0.0f);
  __m128 on[QK / 4], largest = _mm_setzero_ps();
  __m128i above = _mm_setzero_si128();  // per lane, how many were above (a lane of `on` is 0 or -1)
  for (int v = 0; v < QK / 4; ++v) {
    const __m128 a = _mm_andnot_ps(sign, _mm_loadu_ps(x + 4 * v));
    on[v] = _mm_cmpgt_ps(a, _mm_loadu_ps(limit + 4 * v));
    largest = _mm_max_ps(largest, _mm_and_ps(on[v], a));
    above = _mm_sub_epi32(above, _mm_castps_si128(on[v]));
  }
  largest = _mm_max_ps(largest, _mm_movehl_ps(largest, largest));
  largest = _mm_max_ss(largest, _mm_shuffle_ps(largest, largest, 1));
  const float big = _mm_cvtss_f32(largest), scale = big / 127.0f;
  const __m128 inverse = _mm_set1_ps(big == 0.0f ? 0.0f : 1.0f / scale);
  __m128i q[QK / 4], total = _mm_setzero_si128();
  for (int v = 0; v < QK / 4; ++v) {
    q[v] = _mm_cvtps_epi32(_mm_and_ps(on[v], _mm_mul_ps(_mm_loadu_ps(x + 4 * v), inverse)));
    total = _mm_add_epi32(total, q[v]);
  }
  uint32_t zero = 0;
  for (int h = 0; h < 2; ++h) {  // 16 channels each
    const __m128i bytes = _mm_packs_epi16(_mm_packs_epi32(q[4 * h], q[4 * h + 1]), _mm_packs_epi32(q[4 * h + 2], q[4 * h + 3]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(k + 16 * h), bytes);
    zero |= static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(bytes, _mm_setzero_si128()))) << (16 * h);
  }
  return {scale, lane_sum(total), ~zero, lane_sum(above)};
}
#else
BlockChoice choose_block(const float* x, const float* limit, int8_t* k) {
  float largest = 0.0f;
  int above = 0;
  for (int c = 0; c < QK; ++c)
    if (std::fabs(x[c]) > limit[c]) largest = std::max(largest, std::fabs(x[c])), ++above;
  const float scale = largest / 127.0f, inverse = largest == 0.0f ? 0.0f : 1.0f / scale;
  int32_t sum = 0;
  uint32_t nonzero = 0;
  for (int c = 0; c < QK; ++c) {
    k[c] = std::fabs(x[c]) > limit[c] ? static_cast<int8_t>(std::nearbyint(x[c] * inverse)) : 0;
    sum += k[c];
    nonzero |= static_cast<uint32_t>(k[c] != 0) << c;
  }
  return {scale, sum, nonzero, above};
}
#endif

}  // namespace

Selection SparseInputProjection::select(const float* x, int rows, int64_t b0, int64_t b1) const {
  const float* limit = thresholds.data_ptr<float>();
  Selection s;
  s.rows = rows;
  s.start.push_back(0);
  s.channel.reserve((b1 - b0) * QK);
  s.k.reserve((b1 - b0) * QK * rows);
  int8_t k[MAX_GROUP_ROWS][QK];
  float scale[MAX_GROUP_ROWS];
  int32_t sum[MAX_GROUP_ROWS];
  for (int64_t b = b0; b < b1; ++b) {
    uint32_t any = 0;  // bit c: channel c is active in some row
    for (int r = 0; r < rows; ++r) {
      const BlockChoice choice = choose_block(x + r * in_features() + b * QK, limit + b * QK, k[r]);
      s.above += choice.above;
      // a channel whose x rounds to 0 would add 0: the row leaves it out
      scale[r] = choice.nonzero ? choice.scale : 0.0f;  // 0: nothing of this row in the block
      sum[r] = choice.sum;
      any |= choice.nonzero;
    }
    if (any == 0) continue;
    for (uint32_t left = any; left; left &= left - 1) {
      const int c = __builtin_ctz(left);
      s.channel.push_back(static_cast<uint8_t>(c));
      for (int r = 0; r < rows; ++r) s.k.push_back(k[r][c]);
    }
    s.blocks.push_back(static_cast<int32_t>(b));
    s.start.push_back(static_cast<int32_t>(s.active()));
    s.scale.insert(s.scale.end(), scale, scale + rows);
    s.k_sum.insert(s.k_sum.end(), sum, sum + rows);
  }
  return s;
}

int64_t SparseInputProjection::bytes_read(const Selection& s) const {
  const RunLayout& first = parts.front().layout;  // all parts share the blocks
  int64_t bytes = 0, super_blocks = 0;
  for (size_t i = 0; i < s.blocks.size(); ++i)  // the blocks are in order: count each super-block once
    super_blocks += i == 0 || first.super_block(s.blocks[i]) != first.super_block(s.blocks[i - 1]);
  for (const RunPart& part : parts) {
    const RunLayout& l = part.layout;
    bytes += static_cast<int64_t>(s.blocks.size()) * l.scale_bytes() + s.active() * l.run_bytes() +
             super_blocks * l.table_entry_bytes() * l.padded;
  }
  return bytes;
}

SparseInputProjection::GroupRead SparseInputProjection::sparse_rows(const float* x, int64_t rows, float* y) const {
  // Threads take fixed ranges of blocks (not of active channels): a row's sums then do not depend
  // on the other rows of its call. (Splitting the outputs instead, every thread reading half of each
  // run, decoded the 7B-width Q4_0 file at 50 % 1.45x dense against 1.67x: AMD EPYC, AVX-512, 2 threads.)
  // Each selects in its own blocks: none waits while one selects for all.
  const int64_t tasks = std::clamp<int64_t>(blocks() / MIN_TASK_BLOCKS, 1, at::get_num_threads());
  const RunKernels kernels = run_kernels();
  const int per_group = kernels.group_rows;
  const int64_t groups = (rows + per_group - 1) / per_group;
  const auto group_rows = [&](int64_t g) { return static_cast<int>(std::min<int64_t>(per_group, rows - g * per_group)); };
  const int64_t stride = rows * padded();  // a task's sums: per group, per part, its rows' padded outputs
  // where group g's sums of a part start within a task's
  const auto part_sums = [&](int64_t g, const RunPart& part) { return g * per_group * padded() + group_rows(g) * part.first_padded; };
  // per task its sums, in a buffer kept between calls: a fresh one per call (hundreds of KB) cost
  // page faults and the kernel's zeroing of new pages, about a tenth of a 7B-width decode step
  thread_local std::vector<float> partial;
  if (partial.size() < static_cast<size_t>(tasks * stride)) partial.resize(tasks * stride);
  float* sums = partial.data();
  std::vector<int64_t> above(tasks, 0), bytes(tasks, 0);
  const uint8_t* base = runs.data_ptr<uint8_t>();
  const RunKernel kernel = kernels.add;
  const RunLayout& first = parts.front().layout;  // all parts share the blocks
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = blocks() * t / tasks, b1 = blocks() * (t + 1) / tasks;
      std::vector<Selection> s;
      for (int64_t g = 0; g < groups; ++g) {
        s.push_back(select(x + g * per_group * in_features(), group_rows(g), b0, b1));
        above[t] += s.back().above, bytes[t] += bytes_read(s.back());
      }
      std::fill(sums + t * stride, sums + (t + 1) * stride, 0.0f);
      // Several groups take turns super-block by super-block, so that a group reads the runs that the
      // group before it brought into the cache, not memory (eight rows of a 7B-width Q4_K_M file at 50 %,
      // each group reading its union of the runs whole: 0.80x dense; taking turns: 0.89x; Intel Xeon,
      // AVX-512, 2 threads). A super-block is the kernels' unit of sums: the results are the same. One
      // group stays one call (its kernels fetch ahead across super-blocks).
      std::vector<int64_t> next(groups, 0);  // per group, its first selected block not yet added
      for (int64_t tb = b0, end; tb < b1; tb = end) {
        end = groups == 1 ? b1 : std::min(b1, (first.super_block(tb) + 1) * RunLayout::BLOCKS_PER_SUPER);
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t i0 = next[g], n = static_cast<int64_t>(s[g].blocks.size());
          int64_t i1 = i0;
          while (i1 < n && s[g].blocks[i1] < end) ++i1;
          next[g] = i1;
          if (i1 == i0) continue;
          for (const RunPart& part : parts)
            kernel(part.layout, base + part.offset, s[g], i0, i1, sums + t * stride + part_sums(g, part));
        }
      }
    }
  });
  for (const RunPart& part : parts)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t n = part.layout.out_features, at = part_sums(g, part);
      for (int r = 0; r < group_rows(g); ++r) {  // the tasks' sums in task order (a loop the compiler vectorizes)
        float* yr = y + (g * per_group + r) * out_features() + part.first;
        std::copy_n(sums + at + r * part.layout.padded, n, yr);
        for (int64_t t = 1; t < tasks; ++t) {
          const float* st = sums + t * stride + at + r * part.layout.padded;
          for (int64_t o = 0; o < n; ++o) yr[o] += st[o];
        }
      }
    }
  return {std::accumulate(above.begin(), above.end(), int64_t{0}), std::accumulate(bytes.begin(), bytes.end(), int64_t{0})};
}

torch::Tensor SparseInputProjection::dense_prefill(const torch::Tensor& x_all) const {
  const int64_t M = x_all.size(0), K = in_features(), out = out_features();
  // each row's own selection, its skipped channels as zeros (NaN or not)
  auto x = torch::empty_like(x_all);
  std::atomic<int64_t> selected{0};
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    const float* th = thresholds.data_ptr<float>();
    int64_t count = 0;
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = x_all.data_ptr<float>() + r * K;
      float* dst = x.data_ptr<float>() + r * K;
      for (int64_t i = 0; i < K; ++i) {
        const bool active = std::fabs(src[i]) > th[i];
        dst[i] = active ? src[i] : 0.0f;
        count += active;
      }
    }
    selected += count;
  });
  selected_.store(selected.load(), std::memory_order_relaxed);
  bytes_read_.store(run_bytes(parts), std::memory_order_relaxed);
  const Isa isa = quant_kernel_isa();
  const PreparedInput input = prepare_input(x.data_ptr<float>(), M, K, isa);
  const OutputBlockKernel kernel = output_block_kernel(isa);
  const RunRepacker repack = run_kernels().repack;
  // Tasks: a part's 64 outputs (one repack) and a range of rows. Few outputs (a narrow projection) get
  // ranges of rows, so that every thread has work; a thread's tasks are consecutive, so it repacks each
  // group once.
  constexpr int64_t GROUP = 4 * COLS;
  std::vector<int64_t> first_group;
  int64_t groups = 0;
  for (const RunPart& part : parts) first_group.push_back(groups), groups += (part.layout.out_features + GROUP - 1) / GROUP;
  const int64_t row_blocks = (M + TASK_ROWS - 1) / TASK_ROWS;
  const int64_t ranges = std::clamp<int64_t>(MIN_PREFILL_TASKS * at::get_num_threads() / groups, 1, row_blocks);
  const int64_t range_rows = (row_blocks + ranges - 1) / ranges * TASK_ROWS;
  auto y = torch::empty({M, out}, x.options());
  const uint8_t* base = runs.data_ptr<uint8_t>();
  at::parallel_for(0, groups * ranges, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> chunks;
    int64_t repacked = -1;  // the group in `chunks`
    for (int64_t t = begin; t < end; ++t) {
      const int64_t group = t / ranges, m_begin = t % ranges * range_rows, m_end = std::min(M, m_begin + range_rows);
      const size_t p = std::upper_bound(first_group.begin(), first_group.end(), group) - first_group.begin() - 1;
      const RunPart& part = parts[p];
      const RunLayout& l = part.layout;
      const int64_t g = (group - first_group[p]) * GROUP;
      const BlockFormat& f = block_format(static_cast<int64_t>(packed_type(l.form)));
      const PackedLayout layout = packed_layout(f);
      if (group != repacked) {
        chunks.resize(GROUP / COLS * (K / f.n) * layout.bytes);
        repack(l, base + part.offset, g, chunks.data());
        repacked = group;
      }
      const PackedMatrix w{&f, layout, chunks.data(), std::min(GROUP, l.out_features - g), part.first + g};
      for (int64_t nb = 0; nb * COLS < w.rows; ++nb)  // as QuantProjection: an output block's chunks meet every row in cache
        for (int64_t m0 = m_begin; m0 < m_end; m0 += TASK_ROWS)
          kernel(w, nb, input, m0, static_cast<int>(std::min(TASK_ROWS, m_end - m0)), y.data_ptr<float>() + m0 * out + w.column + nb * COLS,
                 out, static_cast<int>(std::min(COLS, w.rows - nb * COLS)));
    }
  });
  return y;
}

}  // namespace powerinfer
