// tests/parity/fsdp_model.h: the model of the fully sharded tests
// (tests/parity/fsdp_parity.cc with its twin fsdp_twin.py, and
// tests/distributed/fully_shard_cases.cc): pre-norm MLP blocks on 3-D input,
// then a final LayerNorm and a head. Width 21 (a shard's element count is not
// a multiple of 4 at 2 and 3 ranks, so the fused optimizer's vector body and
// scalar tail both show). Linear layers are called as torch::linear (aten::linear,
// one addmm on the flattened input, as Python's F.linear), not
// torch::nn::Linear::forward (a matmul, then the bias added apart).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "amp/distributed/fully_shard.h"
#include "amp/train/activation_checkpoint.h"
#include "parity_io.h"

namespace fsdp_model {

constexpr int64_t kWidth = 21, kHidden = 42, kVocab = 10, kBlocks = 3, kBatch = 4, kSeq = 6;

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        fc1(register_module("fc1", torch::nn::Linear(kWidth, kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kWidth))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (checkpointed) return amp::checkpoint([this](const std::vector<torch::Tensor>& in) { return body(in[0]); }, {x});
    return body(x);
  }
  torch::Tensor body(const torch::Tensor& x) {
    const auto h = torch::layer_norm(x, {kWidth}, ln->weight, ln->bias, 1e-5);
    return x + torch::linear(torch::gelu(torch::linear(h, fc1->weight, fc1->bias)), fc2->weight, fc2->bias);
  }
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc1, fc2;
  bool checkpointed = false;  // the body under amp::checkpoint (inside the unit)
};
TORCH_MODULE(Block);

// Each block a unit when `fsdp` is set (the root's forward then goes through it too).
struct NetImpl : torch::nn::Module {
  NetImpl()
      : blocks(register_module("blocks", torch::nn::ModuleList())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        head(register_module("head", torch::nn::Linear(kWidth, kVocab))) {
    for (int64_t i = 0; i < kBlocks; ++i) {
      blocks->push_back(Block());
      units.push_back(blocks[static_cast<size_t>(i)]);
    }
    amp_parity::init(*this);
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : units) {
      Block block(std::dynamic_pointer_cast<BlockImpl>(b));
      auto call = [this, block](const torch::Tensor& in) mutable {
        return fsdp != nullptr ? fsdp->forward(block, in) : block->forward(in);
      };
      x = checkpoint_units
              ? amp::checkpoint([call](const std::vector<torch::Tensor>& in) mutable { return call(in[0]); }, {x})
              : call(x);
    }
    x = torch::layer_norm(x, {kWidth}, ln_f->weight, ln_f->bias, 1e-5);
    return torch::linear(x, head->weight, head->bias);
  }
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
  std::vector<std::shared_ptr<torch::nn::Module>> units;  // the blocks
  amp::FullyShard* fsdp = nullptr;
  bool checkpoint_units = false;  // each unit's call under amp::checkpoint (around the unit)
};
TORCH_MODULE(Net);

// Rank r's inputs and targets of every step: seeded by the rank.
struct Data {
  torch::Tensor x, y;
  Data(int rank, int64_t steps) {
    torch::manual_seed(100 + static_cast<uint64_t>(rank));
    x = torch::randn({steps, kBatch, kSeq, kWidth});
    y = torch::randint(0, kVocab, {steps, kBatch, kSeq}, torch::kLong);
  }
};

inline torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& y) {
  return torch::cross_entropy_loss(logits.to(torch::kFloat).reshape({-1, kVocab}), y.reshape({-1}));
}

}  // namespace fsdp_model
