// The Python module powerinfer._native: every binding of the native operators.
#include <torch/extension.h>

#include <stdexcept>
#include <string>

#include "decode_step.h"
#include "ops.h"
#include "predicted_ffn.h"
#include "projection.h"
#include "quant_matmul.h"

namespace py = pybind11;
using namespace powerinfer;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels hold no Python objects: other Python threads (the server's event loop) run meanwhile.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();

  py::enum_<Activation>(m, "Activation", "FFN activations, by the names of powerinfer.config.FFNActivation")
      .value("RELU_GATED", Activation::RELU_GATED)
      .value("SILU_GATED", Activation::SILU_GATED)
      .value("GELU_GATED", Activation::GELU_GATED)
      .value("DRELU", Activation::DRELU)
      .value("RELU", Activation::RELU)
      .value("GELU", Activation::GELU);

  m.def("isa", [] { return std::string(isa_name(active_isa())); }, "the instruction set the kernels use");
  m.def("detected_isa", [] { return std::string(isa_name(detected_isa())); }, "the best instruction set this CPU runs");
  m.def(
      "set_isa",
      [](const std::string& name) {
        for (const Isa isa : {Isa::SCALAR, Isa::AVX2, Isa::AVX512})
          if (name == isa_name(isa)) return set_isa(isa);
        throw std::invalid_argument("unknown instruction set " + name + " (avx512, avx2 or scalar)");
      },
      "use the kernels of `name` (at most the detected one)");

  m.def("quant_types", [] {
    std::vector<int64_t> types;
    for (const BlockFormat& f : BLOCK_FORMATS) types.push_back(static_cast<int64_t>(f.type));
    return types;
  }, "GGML type ids kept in their blocks by QuantProjection and the neuron records");
  m.def("quant_chunk_bytes", &quant_chunk_bytes, "bytes per 16 outputs and block of a type in QuantProjection's layout");
  m.attr("QUANT_COLS") = COLS;
  m.def("quant_repack", &quant_repack, "raw GGML rows [rows, bytes] -> QuantProjection's layout", no_gil);

  py::class_<Projection, ProjectionPtr>(m, "Projection").def("__call__", &Projection::operator(), no_gil);
  py::class_<Int4Projection, Projection, std::shared_ptr<Int4Projection>>(m, "Int4Projection")
      .def(py::init<torch::Tensor, torch::Tensor, int64_t, int64_t>());
  py::class_<QuantProjection, Projection, std::shared_ptr<QuantProjection>>(m, "QuantProjection")
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<int64_t>>(),
           "packed matrices (quant_repack), their GGML types and row counts, side by side along the outputs")
      .def_readonly("chunks", &QuantProjection::chunks)
      .def_readonly("in_features", &QuantProjection::in_features)
      .def_readonly("out_features", &QuantProjection::out_features);

  py::class_<LlamaBlockStep>(m, "LlamaBlockStep")
      .def(py::init<torch::Tensor, torch::Tensor, ProjectionPtr, ProjectionPtr, int64_t, int64_t, torch::Tensor,
                    torch::Tensor, ProjectionPtr, ProjectionPtr, Activation>())
      .def("attention", &LlamaBlockStep::attention, no_gil)
      .def("attention_rows", &LlamaBlockStep::attention_rows, no_gil)
      .def("dense_ffn", &LlamaBlockStep::dense_ffn, no_gil)
      .def("ffn_input", &LlamaBlockStep::ffn_input, no_gil);

  m.def("decode_attention", &decode_attention, "one new token per row: RoPE, store k/v, attend over each row's cache slot", no_gil);
  m.def("gather_matvec", &gather_matvec, "y[m, j] = dot(section of record idx[j], x[m])", no_gil);
  m.def("accumulate_rows", &accumulate_rows, "y[m] = sum_j a[m, j] * section of record idx[j]", no_gil);
  py::class_<PredictedFFN>(m, "PredictedFFN")
      .def(py::init<ProjectionPtr, ProjectionPtr, double, torch::Tensor, std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<int64_t>, Activation>(),
           "predictor fc1, fc2, score threshold; neuron records, gate, up and down sections; activation")
      .def("__call__", &PredictedFFN::operator(), "(FFN output, neurons computed) for one token: h, the predictor's input x",
           no_gil);
  m.def("sparse_ffn", &sparse_ffn, "y[m] = sum_j act(gate_j . x[m], up_j . x[m]) * down_j over records idx", no_gil);
}
