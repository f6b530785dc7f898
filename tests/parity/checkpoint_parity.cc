// tests/parity/checkpoint_parity.cc: the C++ half of the activation-checkpoint
// parity check (amp/train/activation_checkpoint.h against Python's
// torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) under
// torch.autocast, tests/parity/checkpoint_twin.py).
//
//   checkpoint_parity OUT_DIR
//
// 100 steps of a pre-norm transformer (two blocks with dropout, each block
// through amp::checkpoint) in amp::Trainer<Mixed<bf16, NoScaler>, CPU> with
// SGD and momentum (the unfused step); writes per-step losses (float bits)
// and the final parameters for the twin, which compares bit for bit.
// Linear inputs are 2-D (the N-D bias rounding of LibTorch's F::linear is
// another matter: docs/regions.md).
#include <amp/amp.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "checkpoint_block.h"
#include "parity_io.h"

namespace {

constexpr int kSteps = 100;
using namespace amp_parity::checkpoint_block;  // kB, kT, kD, kV, Block
constexpr int64_t kBlocks = 2;
using amp_parity::bits;
using amp_parity::init;
using amp_parity::save;

// x: [B*T, D] -> logits [B*T, V]; every block checkpointed.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    for (int64_t i = 0; i < kBlocks; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block()));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})));
    head = register_module("head", torch::nn::Linear(kD, kV));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (Block& b : blocks) x = amp::checkpoint(b, x);
    return head(ln_f(x));
  }
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: checkpoint_parity OUT_DIR\n";
    return 2;
  }
  const std::string out = argv[1];
  std::cout << "checkpoint_parity: LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << " on cpu\n";
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({kSteps, kB * kT, kD});
  const torch::Tensor y = torch::randint(0, kV, {kSteps, kB * kT}, torch::kLong);
  Net model;
  init(*model);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(
      model, opt, amp::TrainerOptions().progress(false).step(amp::StepOptions().fused(false)));
  torch::manual_seed(2);  // dropout's masks
  std::ofstream steps(out + "/cpp_steps.txt");
  const std::string name = "checkpoint-bf16-mixed";
  for (int i = 0; i < kSteps; ++i) {
    auto r =
        trainer.step([&](auto&) { return torch::cross_entropy_loss(model->forward(x[i]).to(torch::kFloat), y[i]); });
    steps << name << " " << i << " " << bits(static_cast<float>(r.loss_value())) << " " << bits(1.0f) << "\n";
  }
  save(out + "/" + name + ".params.pt", model->parameters());
  std::cout << "checkpoint_parity: wrote " << out << "\n";
  return 0;
}
