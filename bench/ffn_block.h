// bench/ffn_block.h: a transformer FFN block (LayerNorm, d -> 4d -> d, GELU,
// residual), the compute-bound model of the CUDA benchmarks.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace amp_bench {

struct FfnBlockImpl : torch::nn::Module {
  explicit FfnBlockImpl(int64_t d)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        up(register_module("up", torch::nn::Linear(d, 4 * d))),
        down(register_module("down", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + down(torch::gelu(up(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(FfnBlock);

}  // namespace amp_bench
