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

#include "parity_io.h"

namespace {

constexpr int kSteps = 100;
constexpr int64_t kB = 4, kT = 8, kD = 32, kV = 16, kBlocks = 2;
using amp_parity::bits;
using amp_parity::save;

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

// x: [B*T, D] -> [B*T, D]
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
      model, opt, amp::TrainerOptions().progress(false).fused(false));
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
