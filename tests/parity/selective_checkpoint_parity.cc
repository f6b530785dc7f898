// tests/parity/selective_checkpoint_parity.cc: the C++ half of the
// activation-checkpointing parity check (amp/train/activation_checkpoint.h
// against Python's torch.utils.checkpoint.checkpoint(..., use_reentrant=False),
// with context_fn=partial(create_selective_checkpoint_contexts, [aten.mm,
// addmm, bmm, baddbmm]) for the selective runs; tests/parity/selective_checkpoint_twin.py).
//
//   selective_checkpoint_parity OUT_DIR
//
// 100 steps per run through amp::Trainer, Mixed<bf16, NoScaler> on CPU (SGD
// with momentum, the unfused step), of two pre-LN transformer blocks with
// dropout (attention probabilities, projections, MLP) under a final norm and
// head; writes per-step losses (float bits) and the final parameters for the
// twin, which compares bit for bit:
//   none        no checkpointing
//   full        each block amp::checkpoint'ed (every op recomputed)
//   selective   each block checkpointed with CheckpointOptions().save_matmuls(true)
// LibTorch 2.4+ (Python's create_selective_checkpoint_contexts); before, it
// prints "skipped". Linear inputs are 2-D (the N-D bias rounding of LibTorch's
// F::linear is another matter: docs/regions.md).
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
using amp_parity::bits;
using amp_parity::init;
using amp_parity::save;

enum class Mode { kNone, kFull, kSelective };

struct NetImpl : torch::nn::Module {
  explicit NetImpl(Mode mode)
      : mode(mode),
        block1(register_module("block1", Block())),
        block2(register_module("block2", Block())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})))),
        head(register_module("head", torch::nn::Linear(kD, kV))) {}
  torch::Tensor run(Block& block, const torch::Tensor& x) {
    if (mode == Mode::kNone) return block(x);
    return amp::checkpoint(block, x, amp::CheckpointOptions().save_matmuls(mode == Mode::kSelective));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(ln_f(run(block2, run(block1, x)))); }
  Mode mode;
  Block block1, block2;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

struct Data {
  torch::Tensor x, y;
  Data() {
    torch::manual_seed(1);
    x = torch::randn({kSteps, kB * kT, kD});
    y = torch::randint(0, kV, {kSteps, kB * kT}, torch::kLong);
  }
};

void run(std::ofstream& steps, const std::string& out, const Data& data, const std::string& name, Mode mode) {
  Net model(mode);
  init(*model);  // seeds 0: dropout's masks follow from there, as in the twin
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(
      model, opt, amp::TrainerOptions().progress(false).step(amp::StepOptions().fused(false)));
  for (int i = 0; i < kSteps; ++i) {
    auto r = trainer.step(
        [&](auto&) { return torch::cross_entropy_loss(model->forward(data.x[i]).to(torch::kFloat), data.y[i]); });
    steps << name << " " << i << " " << bits(static_cast<float>(r.loss_value())) << " " << bits(1.0f) << "\n";
  }
  save(out + "/" + name + ".params.pt", model->parameters());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: selective_checkpoint_parity OUT_DIR\n";
    return 2;
  }
  if (!amp::detail::libtorch_at_least(2, 4)) {
    std::cout << "skipped: Python's create_selective_checkpoint_contexts needs torch 2.4 or newer\n";
    return 0;
  }
  const std::string out = argv[1];
  std::cout << "selective_checkpoint_parity: LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR
            << " on cpu\n";
  std::ofstream steps(out + "/cpp_steps.txt");
  const Data data;
  run(steps, out, data, "none", Mode::kNone);
  run(steps, out, data, "full", Mode::kFull);
  run(steps, out, data, "selective", Mode::kSelective);
  std::cout << "selective_checkpoint_parity: wrote " << out << "\n";
  return 0;
}
