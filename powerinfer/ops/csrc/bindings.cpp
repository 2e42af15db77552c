// The Python module powerinfer._native: every binding of the native operators.
#include <torch/extension.h>
#include <pybind11/functional.h>

#include <stdexcept>
#include <string>

#include "decode_step.h"
#include "ops.h"
#include "predicted_ffn.h"
#include "projection.h"
#include "quant_matmul.h"
#include "sparse_input.h"

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

  m.def("avx_vnni_detected", &avx_vnni_detected, "whether this CPU has AVX-VNNI");
  m.def("avx_vnni", &avx_vnni_active, "whether the AVX2 kernels use AVX-VNNI");
  m.def("set_avx_vnni", &set_avx_vnni, "use AVX-VNNI in the AVX2 kernels or not (on: the CPU must have it)");
  m.def("bf16_dot", &bf16_dot_active, "whether QuantLinear's AVX-512 kernel is the bfloat16 one (off: the integer AVX2 kernels)");
  m.def("set_bf16_dot", &set_bf16_dot, "QuantLinear on AVX-512: the bfloat16 kernel (on: the CPU must have AVX-512) or the integer ones");
  m.def("quant_kernel_isa", [] { return std::string(isa_name(quant_kernel_isa())); },
        "the instruction set of QuantLinear's kernels (avx2 on AVX-512 with the bfloat16 dot product off)");

  m.def("quant_types", [] {
    std::vector<int64_t> types;
    for (const BlockFormat& f : BLOCK_FORMATS) types.push_back(static_cast<int64_t>(f.type));
    return types;
  }, "GGML type ids kept in their blocks by QuantProjection and the neuron records");
  m.def("quant_packed_bytes", &quant_packed_bytes, "bytes of quant_repack's output for (type, rows, bytes per row)");
  m.attr("QUANT_COLS") = COLS;
  m.def("quant_repack", &quant_repack,
        "raw GGML rows [rows, bytes] -> QuantProjection's layout, written into the destination (uint8 of its bytes)", no_gil);

  py::class_<Projection, ProjectionPtr>(m, "Projection").def("__call__", &Projection::operator(), no_gil);
  py::class_<Int4Projection, Projection, std::shared_ptr<Int4Projection>>(m, "Int4Projection")
      .def(py::init<torch::Tensor, torch::Tensor, int64_t, int64_t>());
  py::class_<QuantProjection, Projection, std::shared_ptr<QuantProjection>>(m, "QuantProjection")
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<int64_t>>(),
           "packed matrices (quant_repack), their GGML types and row counts, side by side along the outputs")
      .def_readonly("chunks", &QuantProjection::chunks)
      .def_readonly("in_features", &QuantProjection::in_features)
      .def_readonly("out_features", &QuantProjection::out_features);
  py::class_<SparseInputProjection, Projection, std::shared_ptr<SparseInputProjection>>(m, "SparseInputProjection")
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, int64_t, torch::Tensor, int64_t, torch::Tensor,
                    std::function<void()>>(),
           "per matrix its raw GGML rows uint8 [outputs, row bytes], their GGML types, the input channels, float32 "
           "thresholds [in] (a row skips channel i where |x_i| <= thresholds[i]), the most rows computed sparsely "
           "(more: all channels read), the contiguous uint8 tensor of channel_run_bytes(...) that receives the runs, "
           "and a callable run after each matrix is regrouped (or None)",
           py::arg("rows"), py::arg("types"), py::arg("in_features"), py::arg("thresholds"), py::arg("sparse_max_rows"),
           py::arg("destination"), py::arg("after_matrix") = py::none())
      .def_readonly("runs", &SparseInputProjection::runs)
      .def_readonly("thresholds", &SparseInputProjection::thresholds)
      .def_property_readonly("in_features", &SparseInputProjection::in_features)
      .def_property_readonly("out_features", &SparseInputProjection::out_features)
      .def_property_readonly("last_selected", &SparseInputProjection::last_selected,
                             "(row, channel) pairs the last call computed")
      .def_property_readonly("last_bytes_read", &SparseInputProjection::last_bytes_read,
                             "bytes of the runs the last call read (its active blocks' scales and channels' runs)");
  m.def(
      "channel_run_bytes",
      [](const std::vector<int64_t>& types, const std::vector<int64_t>& outputs, int64_t in_features) -> int64_t {
        try {
          return run_bytes(run_parts(types, outputs, in_features));
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      "bytes of the channel runs of these row matrices (GGML types, outputs) side by side; ValueError where a type "
      "has no channel-run form",
      py::arg("types"), py::arg("outputs"), py::arg("in_features"));

  py::class_<AttentionSpec>(m, "AttentionSpec", "what decode_attention computes besides plain attention (ops.h)")
      .def(py::init([](int64_t n_head, int64_t n_kv, int64_t rope_dim, bool neox, int64_t window, float scale, float softcap) {
             return AttentionSpec{n_head, n_kv, rope_dim, neox, window, scale, softcap};
           }),
           py::arg("n_head"), py::arg("n_kv"), py::arg("rope_dim"), py::kw_only(), py::arg("neox") = false,
           py::arg("window") = 0, py::arg("scale") = 0.0f, py::arg("softcap") = 0.0f);

  py::class_<RMSNorm>(m, "RMSNorm", "Python's RMSNorm (its scaled_weight and eps_term) as the decode step applies it")
      .def(py::init<torch::Tensor, torch::Tensor>())
      .def("__call__", &RMSNorm::operator(), no_gil);

  py::class_<BlockExtras>(m, "BlockExtras", "what a block has besides llama's (decode_step.h)")
      .def(py::init([](std::optional<torch::Tensor> qkv_bias, std::optional<RMSNorm> qk_norm,
                       std::optional<RMSNorm> post_attention_norm, std::optional<RMSNorm> post_ffw_norm) {
             return BlockExtras{std::move(qkv_bias), std::move(qk_norm), std::move(post_attention_norm), std::move(post_ffw_norm)};
           }),
           py::kw_only(), py::arg("qkv_bias") = py::none(), py::arg("qk_norm") = py::none(),
           py::arg("post_attention_norm") = py::none(), py::arg("post_ffw_norm") = py::none());

  py::class_<BlockStep>(m, "BlockStep")
      .def(py::init<RMSNorm, ProjectionPtr, ProjectionPtr, AttentionSpec, RMSNorm, ProjectionPtr, ProjectionPtr, Activation,
                    BlockExtras>(),
           py::arg("attn_norm"), py::arg("qkv"), py::arg("output"), py::arg("spec"), py::arg("ffn_norm"), py::arg("up"),
           py::arg("down"), py::arg("activation"), py::arg("extras"))
      .def("attention", &BlockStep::attention, no_gil)
      .def("attention_rows", &BlockStep::attention_rows, no_gil)
      .def("dense_ffn", &BlockStep::dense_ffn, no_gil)
      .def("ffn_input", &BlockStep::ffn_input, no_gil)
      .def("add_ffn_output", &BlockStep::add_ffn_output, no_gil);

  m.def("exit_on_bus_error", &exit_on_bus_error, "on SIGBUS (a mapped file truncated), write the message and exit",
        py::arg("message"), py::arg("status"));
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
