// tests/parity/checkpoint_block.h: what the two checkpointing parity programs
// (checkpoint_parity.cc, selective_checkpoint_parity.cc) build alike: the
// sizes and the pre-LN transformer block with dropout that they checkpoint
// (its weights: parity_io.h's init()).
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <string>

namespace amp_parity {
namespace checkpoint_block {

constexpr int64_t kB = 4, kT = 8, kD = 32, kV = 16;

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
