// Neuron-aware sparse FFN operators (record layout and arithmetic: neuron_kernels.h):
//
//   gather_matvec(rec, sec, x, idx)     y[m, j] = dot(sec(idx[j]), x[m])        row-gather matvec
//   accumulate_rows(rec, sec, a, idx)   y[m]    = sum_j a[m, j] * sec(idx[j])   accumulate rows
//   sparse_ffn(rec, gate, up, down, act, x, idx)  both, fused per neuron:
//       y[m] = sum_j act(gate_j . x[m], up_j . x[m]) * down_j
//
// This file: the operators, x's quantization, and the scalar dot products and accumulations (the
// kernels of CPUs without AVX2); neuron_kernels_simd.cpp holds the AVX2 and AVX-512 ones.
#include "neuron_kernels.h"

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <initializer_list>
#include <utility>

#include "ops.h"

namespace powerinfer {

namespace {

// Per group of 16 weights of one block: d sc and dmin mn (see ggml_blocks.h).
void group_scales(const BlockFormat& f, const uint8_t* block, float* dsc, float* min) {
  BlockScales s;
  decode_scales(f, block, s);
  const float d = half_to_float(reinterpret_cast<const uint8_t*>(&s.d));
  const float dmin = half_to_float(reinterpret_cast<const uint8_t*>(&s.dmin));
  for (int64_t g = 0; g < f.n / QK_SUB; ++g) {
    const int64_t j = g * QK_SUB / f.sub;
    dsc[g] = d * static_cast<float>(s.sc[j]);
    min[g] = f.has_min ? dmin * static_cast<float>(s.mn[j]) : 0.0f;
  }
}

}  // namespace

void group_factors(const BlockFormat& f, const uint8_t* block, const float* x_scale, GroupFactors& out) {
  group_scales(f, block, out.factor, out.min);
  for (int64_t g = 0; g < f.n / QK_SUB; ++g) out.factor[g] *= x_scale[g / 2];
}

void axpy_coefficients(const BlockFormat& f, const uint8_t* block, float c, float* a, float* b) {
  group_scales(f, block, a, b);
  for (int64_t g = 0; g < f.n / QK_SUB; ++g) {
    b[g] = c * (b[g] - static_cast<float>(f.offset) * a[g]);
    a[g] *= c;
  }
}

namespace scalar {

float dot(const uint8_t* rec, const Section& s, const QuantizedX& x) {
  float acc = 0.0f;
  if (s.bits == 32) {
    const float* w = reinterpret_cast<const float*>(rec + s.q_off);
    for (int64_t k = 0; k < s.n_values; ++k) acc += w[k] * x.x[k];
    return acc;
  }
  if (s.bits == 0) {
    const BlockFormat& f = *s.format;
    DecodedBlock b;
    GroupFactors g;
    for (int64_t i = 0; i < s.n_values / f.n; ++i) {
      const uint8_t* block = rec + s.q_off + i * f.bytes;
      decode_block(f, block, b);
      group_factors(f, block, x.scale.data() + i * f.n / QK, g);
      for (int64_t group = 0; group < f.n / QK_SUB; ++group) {
        const int64_t first = i * f.n + group * QK_SUB;
        int32_t dot = 0;
        for (int64_t k = 0; k < QK_SUB; ++k) dot += b.q[group * QK_SUB + k] * x.q8[first + k];
        const int64_t g16 = first / QK_SUB;
        acc += g.factor[group] * static_cast<float>(dot - f.offset * static_cast<int32_t>(x.qsum16[g16])) + g.min[group] * x.sum16[g16];
      }
    }
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
    const float d = half_to_float(rec + s.d_off + 2 * b);
    const float m = s.bits == 8 ? 0.0f : s.m_off >= 0 ? half_to_float(rec + s.m_off + 2 * b) : -8.0f * d;
    acc += d * x.scale[b] * dot + m * x.sum[b];
  }
  return acc;
}

namespace {

void axpy(const uint8_t* rec, const Section& s, float c, float* out) {
  if (s.bits == 32) {
    const float* w = reinterpret_cast<const float*>(rec + s.q_off);
    for (int64_t k = 0; k < s.n_values; ++k) out[k] += c * w[k];
    return;
  }
  if (s.bits == 0) {
    const BlockFormat& f = *s.format;
    DecodedBlock b;
    float a[QK_K / QK_SUB], bias[QK_K / QK_SUB];
    for (int64_t i = 0; i < s.n_values / f.n; ++i) {
      const uint8_t* block = rec + s.q_off + i * f.bytes;
      decode_block(f, block, b);
      axpy_coefficients(f, block, c, a, bias);
      for (int64_t k = 0; k < f.n; ++k) out[i * f.n + k] += a[k / QK_SUB] * b.q[k] + bias[k / QK_SUB];
    }
    return;
  }
  const uint8_t* q = rec + s.q_off;
  for (int64_t b = 0; b < s.n_blocks(); ++b) {
    const float d = half_to_float(rec + s.d_off + 2 * b);
    const float m = s.bits == 8 ? 0.0f : s.m_off >= 0 ? half_to_float(rec + s.m_off + 2 * b) : -8.0f * d;
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
}

}  // namespace

void axpy_rows(const uint8_t* const* recs, const float* c, int n_rows, const Section& s, float* out) {
  for (int r = 0; r < n_rows; ++r) axpy(recs[r], s, c[r], out);
}

}  // namespace scalar

namespace {

// Bytes of a section's values (from q_off).
int64_t q_bytes(const Section& s) {
  if (s.bits == 0) return s.n_values / s.format->n * s.format->bytes;
  return s.bits == 32 ? 4 * s.n_values : s.n_values * s.bits / 8;
}

Section make_section(const std::vector<int64_t>& v, int64_t record_bytes) {
  TORCH_CHECK(v.size() == 6, "a section is 6 integers");
  Section s{v[0], v[1], v[2], v[3], v[4], nullptr};
  TORCH_CHECK(s.bits == 0 || s.bits == 4 || s.bits == 8 || s.bits == 32, "section bits must be 0, 4, 8 or 32");
  TORCH_CHECK(s.n_values > 0 && s.n_values % QK == 0, "section length must be a multiple of 32");
  if (s.bits == 0) {
    s.format = &block_format(v[5]);
    TORCH_CHECK(s.n_values % s.format->n == 0, "section length must be a multiple of its type's block");
  }
  TORCH_CHECK(s.q_off >= 0 && s.q_off + q_bytes(s) <= record_bytes, "section values outside the record");
  if (s.bits == 4 || s.bits == 8) TORCH_CHECK(s.d_off >= 0 && s.d_off + 2 * s.n_blocks() <= record_bytes, "section scales outside the record");
  if (s.bits == 4 && s.m_off >= 0) TORCH_CHECK(s.m_off + 2 * s.n_blocks() <= record_bytes, "section offsets outside the record");
  return s;
}

// The bytes [begin, end) of a record that some sections occupy together (values, scales, offsets).
struct Span {
  int64_t begin = INT64_MAX, end = 0;

  Span(std::initializer_list<const Section*> sections) {
    for (const Section* s : sections) {
      const int64_t n_blocks = s->bits == 4 || s->bits == 8 ? s->n_blocks() : 0;
      for (const auto [at, bytes] : {std::pair{s->q_off, q_bytes(*s)}, std::pair{s->d_off, 2 * n_blocks}, std::pair{s->m_off, 2 * n_blocks}})
        if (at >= 0 && bytes > 0) begin = std::min(begin, at), end = std::max(end, at + bytes);
    }
  }
  void prefetch_in(const uint8_t* record) const { prefetch(record + begin, end - begin); }
};

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

// Rows are visited in data-dependent order, which hardware prefetchers cannot follow: they are
// fetched this many neurons ahead of use (measured, sparse_ffn from memory, one thread: 2 -> 4
// neurons 14.6 -> 16.2 GB/s; 6 and 8 alike).
constexpr int64_t PREFETCH_AHEAD = 4;

QuantizedX quantize_x(const float* x, int64_t n_values) {
  const int64_t n_blocks = n_values / QK, groups = (n_blocks + 3) / 4;
  const int64_t scale_blocks = (n_blocks + 7) / 8 * 8;  // the SIMD kernels read scales 8 blocks at a time
  QuantizedX out;
  out.x = x;
  out.q4.assign(groups * 4 * QK, 0);
  out.q8.assign(groups * 4 * QK, 0);
  out.scale.assign(scale_blocks, 0.0f);
  out.sum.assign(scale_blocks, 0.0f);
  out.sum16.assign(groups * 8, 0.0f);
  out.qsum16.assign(groups * 8, 0.0f);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.0f;
    for (int k = 0; k < QK; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float scale = amax / 127.0f, inv = scale > 0 ? 1.0f / scale : 0.0f;
    out.scale[b] = scale;
    for (int half = 0; half < 2; ++half) {
      float sum = 0.0f;
      int32_t qsum = 0;
      for (int k = 16 * half; k < 16 * half + 16; ++k) {
        const int8_t v = static_cast<int8_t>(std::nearbyint(xb[k] * inv));
        out.q8[b * QK + k] = v;
        // 4-bit rows: per 4 blocks, 64 partners of the low nibbles then 64 of the high nibbles
        out.q4[(b / 4) * 4 * QK + (k / 16) * 64 + (b % 4) * 16 + (k % 16)] = v;
        sum += xb[k];
        qsum += v;
      }
      out.sum16[2 * b + half] = sum;
      out.qsum16[2 * b + half] = static_cast<float>(qsum);
    }
    out.sum[b] = out.sum16[2 * b] + out.sum16[2 * b + 1];
  }
  return out;
}

std::vector<QuantizedX> quantize_rows(const torch::Tensor& x, int64_t n_values) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) == n_values,
              "x must be contiguous float32 [M, ", n_values, "]");
  std::vector<QuantizedX> out;
  for (int64_t m = 0; m < x.size(0); ++m) out.push_back(quantize_x(x.data_ptr<float>() + m * n_values, n_values));
  return out;
}

struct RecordKernels {
  DotKernel dot;
  AxpyKernel axpy_rows;
};

RecordKernels kernels() {
  switch (active_isa()) {
#ifdef POWERINFER_X86
    case Isa::AVX512: return {avx512::dot, avx512::axpy_rows};
    case Isa::AVX2: return {avx2::dot, avx2::axpy_rows};
#endif
    default: return {scalar::dot, scalar::axpy_rows};
  }
}

inline float activate(Activation act, float gate, float up) {
  auto f = [act](float v) {
    switch (act) {
      case Activation::SILU_GATED: return v / (1.0f + std::exp(-v));
      case Activation::GELU_GATED:
      case Activation::GELU: return 0.5f * v * (1.0f + std::tanh(0.7978845608f * (v + 0.044715f * v * v * v)));
      default: return v > 0.0f ? v : 0.0f;
    }
  };
  if (!is_gated(act)) return f(up);
  return act == Activation::DRELU ? f(gate) * (up > 0.0f ? up : 0.0f) : f(gate) * up;
}

// [0, n) in `tasks` contiguous slices (at most one per thread, at least 32 items each); callers
// size per-task buffers by `tasks`.
struct Split {
  int64_t n, tasks;

  explicit Split(int64_t n) : n(n), tasks(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (n + 31) / 32))) {}

  template <typename F>
  void run(F body) const {  // body(task, first, end)
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) body(t, n * t / tasks, n * (t + 1) / tasks);
    });
  }
};

}  // namespace

torch::Tensor gather_matvec(torch::Tensor rec, std::vector<int64_t> section, torch::Tensor x, torch::Tensor idx) {
  const Records r = check_records(rec, idx);
  const Section s = make_section(section, r.stride);
  const auto xs = quantize_rows(x, s.n_values);
  const int64_t M = x.size(0), n = idx.size(0);
  auto y = torch::empty({M, n}, x.options());
  const int64_t* ids = idx.data_ptr<int64_t>();
  float* out = y.data_ptr<float>();
  const DotKernel dot = kernels().dot;
  Split(n).run([&](int64_t, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      if (j + PREFETCH_AHEAD < j1) prefetch(r.row(ids[j + PREFETCH_AHEAD]) + s.q_off, std::min<int64_t>(r.stride - s.q_off, 4096));
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
  const Split split(n);
  auto partial = torch::zeros({split.tasks, M, dim}, a.options());  // one private accumulator per task
  const int64_t* ids = idx.data_ptr<int64_t>();
  const float* as = a.data_ptr<float>();
  float* parts = partial.data_ptr<float>();
  const AxpyKernel axpy_rows = kernels().axpy_rows;
  split.run([&](int64_t t, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      if (j + PREFETCH_AHEAD < j1) prefetch(r.row(ids[j + PREFETCH_AHEAD]) + s.q_off, std::min<int64_t>(r.stride - s.q_off, 4096));
      const uint8_t* row = r.row(ids[j]);
      for (int64_t m = 0; m < M; ++m) axpy_rows(&row, as + m * n + j, 1, s, parts + (t * M + m) * dim);
    }
  });
  return split.tasks == 1 ? partial[0] : partial.sum(0);
}

torch::Tensor sparse_ffn(torch::Tensor rec, std::vector<int64_t> gate_section, std::vector<int64_t> up_section,
                         std::vector<int64_t> down_section, Activation activation, torch::Tensor x, torch::Tensor idx) {
  const Records r = check_records(rec, idx);
  const Activation act = activation;
  const bool gated = is_gated(act);
  TORCH_CHECK(gated != gate_section.empty(), gated ? "a gated activation needs a gate section" : "this activation takes no gate");
  const Section up = make_section(up_section, r.stride), down = make_section(down_section, r.stride);
  const Section gate = gated ? make_section(gate_section, r.stride) : up;
  TORCH_CHECK(gate.n_values == up.n_values, "gate and up rows differ in length");
  const bool relu_gate = act == Activation::RELU_GATED || act == Activation::DRELU;
  // ReLU-family FFNs: a neuron whose first product (the gate's, or up's without a gate) is not
  // positive adds nothing, whatever the predictor said (about half of the predicted ones on a model
  // with random weights). Those are found in a first pass that reads only that row; the second reads
  // the rest of the record of the neurons left. Other activations read whole records in one pass.
  const bool two_pass = relu_gate || act == Activation::RELU;
  const Span whole{&gate, &up, &down}, first{&gate}, rest = gated ? Span{&up, &down} : Span{&down};  // gate: up without one
  const auto xs = quantize_rows(x, up.n_values);
  const int64_t M = x.size(0), n = idx.size(0), dim = down.n_values;
  const Split split(n);
  auto partial = torch::zeros({split.tasks, M, dim}, x.options());
  const int64_t* ids = idx.data_ptr<int64_t>();
  float* parts = partial.data_ptr<float>();
  const RecordKernels k = kernels();
  split.run([&](int64_t t, int64_t j0, int64_t j1) {
    std::vector<std::pair<const uint8_t*, float>> on;  // two passes: neurons whose first product is positive
    for (int64_t m = 0; m < M; ++m) {
      float* out = parts + (t * M + m) * dim;
      const uint8_t* pending[4];  // neurons with a non-zero activation, accumulated 4 at a time
      float coefficient[4];
      int n_pending = 0;
      const auto add = [&](const uint8_t* neuron, float a) {
        if (a == 0.0f) return;
        pending[n_pending] = neuron;
        coefficient[n_pending++] = a;
        if (n_pending == 4) {
          k.axpy_rows(pending, coefficient, 4, down, out);
          n_pending = 0;
        }
      };
      if (two_pass) {
        on.clear();
        for (int64_t j = j0; j < j1; ++j) {
          if (m == 0 && j + PREFETCH_AHEAD < j1) first.prefetch_in(r.row(ids[j + PREFETCH_AHEAD]));
          const uint8_t* neuron = r.row(ids[j]);
          const float v = k.dot(neuron, gate, xs[m]);
          if (v > 0.0f) on.emplace_back(neuron, v);
        }
        for (size_t i = 0; i < on.size(); ++i) {
          if (m == 0 && i + PREFETCH_AHEAD < on.size()) rest.prefetch_in(on[i + PREFETCH_AHEAD].first);
          const auto [neuron, v] = on[i];
          add(neuron, gated ? activate(act, v, k.dot(neuron, up, xs[m])) : activate(act, 0.0f, v));
        }
      } else {
        for (int64_t j = j0; j < j1; ++j) {
          if (m == 0 && j + PREFETCH_AHEAD < j1) whole.prefetch_in(r.row(ids[j + PREFETCH_AHEAD]));
          const uint8_t* neuron = r.row(ids[j]);
          add(neuron, activate(act, gated ? k.dot(neuron, gate, xs[m]) : 0.0f, k.dot(neuron, up, xs[m])));
        }
      }
      k.axpy_rows(pending, coefficient, n_pending, down, out);
    }
  });
  return split.tasks == 1 ? partial[0] : partial.sum(0);
}

}  // namespace powerinfer
