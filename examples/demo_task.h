// examples/demo_task.h: the demo's embedded task and the memory ladder's
// model, shared by precision_sweep (one process) and sharded_ladder (one
// process per rank, tools/launch) so that both train the same thing.
//
//   Task task(n_train, n_test, seed);              // x ~ N(0, 1) in 256 dims, 16 classes
//   ResidualMlp model(1024);                       // 256 -> [1024 -> 256] x 2 blocks -> 16, no biases
//   model->checkpointed = true;                    // amp::checkpoint around each block
#pragma once

#include <torch/torch.h>

#include <amp/amp.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace demo {

// The synthetic task: inputs x ~ N(0, 1) in 256 dims, labels = argmax of a
// random 2-layer tanh teacher over 16 classes. Learnable, but only with enough
// matmul work that the compute dtype matters.
struct Task {
  static constexpr int64_t kIn = 256, kClasses = 16;
  torch::Tensor train_x, train_y, test_x, test_y;
  Task(int64_t n_train, int64_t n_test, uint64_t seed) {
    torch::manual_seed(seed);
    auto w1 = torch::randn({kIn, 128}) / std::sqrt(double(kIn));
    auto w2 = torch::randn({128, kClasses}) / std::sqrt(128.0);
    auto label = [&](const torch::Tensor& x) { return torch::tanh(x.matmul(w1)).matmul(w2).argmax(1); };
    train_x = torch::randn({n_train, kIn});
    train_y = label(train_x);
    test_x = torch::randn({n_test, kIn});
    test_y = label(test_x);
  }
};

// The memory ladder's model: kBlocks residual blocks x + W2 relu(W1 x) on the
// 256-wide input (W1: ffn x 256, W2: 256 x ffn), then a 16 x 256 head; no
// biases, so every tensor has at least 4096 elements, a multiple of 256: the
// low-bit optimizers quantize all of them, and the bytes per parameter are
// the formulas of docs/maintainers.md without a small-tensor term. With
// `checkpointed`, each block runs under amp::checkpoint: it keeps only its
// output for backward and runs again there.
struct ResidualMlpImpl : torch::nn::Module {
  static constexpr int64_t kBlocks = 2;
  explicit ResidualMlpImpl(int64_t ffn) {
    using torch::nn::Linear, torch::nn::LinearOptions;
    for (int64_t b = 0; b < kBlocks; ++b) {
      up.push_back(register_module("up" + std::to_string(b), Linear(LinearOptions(Task::kIn, ffn).bias(false))));
      down.push_back(register_module("down" + std::to_string(b), Linear(LinearOptions(ffn, Task::kIn).bias(false))));
    }
    head = register_module("head", Linear(LinearOptions(Task::kIn, Task::kClasses).bias(false)));
  }
  torch::Tensor block(size_t b, const torch::Tensor& x) { return x + linear(down[b], torch::relu(linear(up[b], x))); }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = x;
    for (size_t b = 0; b < up.size(); ++b) {
      if (checkpointed)
        y = amp::checkpoint([&, b](const std::vector<torch::Tensor>& in) { return block(b, in[0]); }, {y});
      else
        y = block(b, y);
    }
    return head(y);
  }
  bool checkpointed = false;
  // How a block calls its linears: directly, or through amp::FullyShard's
  // forward (each linear a unit; sharded_ladder.cc).
  std::function<torch::Tensor(torch::nn::Linear&, const torch::Tensor&)> linear =
      [](torch::nn::Linear& l, const torch::Tensor& in) { return l(in); };
  std::vector<torch::nn::Linear> up, down;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(ResidualMlp);

// Bytes of the tensors' storage: elements times element size.
inline int64_t tensor_bytes(const std::vector<torch::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors)
    if (t.defined()) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}
inline int64_t gradient_bytes(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) grads.push_back(p.grad());
  return tensor_bytes(grads);
}

}  // namespace demo
