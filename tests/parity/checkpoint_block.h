// tests/parity/checkpoint_block.h: what the two checkpointing parity programs
// (checkpoint_parity.cc, selective_checkpoint_parity.cc) build alike: the
// sizes, the initialization the twins repeat (init() in their .py files) and
// the pre-LN transformer block with dropout that they checkpoint.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <string>

namespace amp_parity {
namespace checkpoint_block {

constexpr int64_t kB = 4, kT = 8, kD = 32, kV = 16;

// Weights drawn after manual_seed(0) in parameter order: LayerNorm weights
// 1 + 0.05 randn, everything else 0.05 randn (as the twin's init()).
void init(torch::nn::Module& m) {
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
  for (auto& p : m.named_parameters()) {
    const bool norm = p.key().find("ln") != std::string::npos && p.key().size() > 6 &&
                      p.key().compare(p.key().size() - 6, 6, "weight") == 0;
    p.value().copy_(torch::randn(p.value().sizes()) * 0.05 + (norm ? 1.0 : 0.0));
  }
}

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})))),
        q(register_module("q", torch::nn::Linear(kD, kD))),
        k(register_module("k", torch::nn::Linear(kD, kD))),
        v(register_module("v", torch::nn::Linear(kD, kD))),
        proj(register_module("proj", torch::nn::Linear(kD, kD))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})))),
        fc1(register_module("fc1", torch::nn::Linear(kD, 4 * kD))),
        fc2(register_module("fc2", torch::nn::Linear(4 * kD, kD))),
        drop(register_module("drop", torch::nn::Dropout(0.1))) {}
  // x: [B*T, D] -> [B*T, D]
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor a = ln1(x);
    const torch::Tensor qs = q(a).view({kB, kT, kD}), ks = k(a).view({kB, kT, kD}), vs = v(a).view({kB, kT, kD});
    const torch::Tensor att = drop(torch::softmax(torch::matmul(qs, ks.transpose(1, 2)) / std::sqrt(double(kD)), -1));
    const torch::Tensor h = x + drop(proj(torch::matmul(att, vs).reshape({kB * kT, kD})));
    return h + drop(fc2(torch::gelu(fc1(ln2(h)))));
  }
  torch::nn::LayerNorm ln1;
  torch::nn::Linear q, k, v, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Block);

}  // namespace checkpoint_block
}  // namespace amp_parity
