// A sparse FFN's decode step in one call: the predictor chooses the neurons, the neuron records
// compute them (predicted_ffn.cpp). Python's SparseFFN in mode "auto" is the reference.
#pragma once

#include <tuple>
#include <vector>

#include "common.h"
#include "projection.h"

namespace powerinfer {

class PredictedFFN {
 public:
  // fc1, fc2: the predictor (scores = fc2(relu(fc1(x))), a neuron fires when its score >= threshold);
  // records and sections: the neuron store (neuron_kernels.h; gate empty for activations without one).
  PredictedFFN(ProjectionPtr fc1, ProjectionPtr fc2, double threshold, torch::Tensor records, std::vector<int64_t> gate,
               std::vector<int64_t> up, std::vector<int64_t> down, Activation activation);

  // (FFN output [1, d] for the FFN input h [1, d], neurons computed), the neurons chosen from the
  // predictor's input x [1, d] (the block input before the FFN norm).
  std::tuple<torch::Tensor, int64_t> operator()(const torch::Tensor& h, const torch::Tensor& x) const;

 private:
  ProjectionPtr fc1_, fc2_;
  float threshold_;
  torch::Tensor records_;
  std::vector<int64_t> gate_, up_, down_;
  Activation activation_;
};

}  // namespace powerinfer
