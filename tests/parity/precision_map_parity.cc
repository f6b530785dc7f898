// tests/parity/precision_map_parity.cc: the C++ half of the precision-map
// parity check (amp/precision/precision_map.h against Python's
// `with torch.autocast("cpu", enabled=False): m(x.float())` around exactly
// the mapped modules, tests/parity/precision_map_twin.py).
//
//   precision_map_parity OUT_DIR
//
// 100 steps per run through amp::Trainer on CPU (SGD with momentum, the
// unfused step); writes per-step losses and scales (float bits) and the final
// parameters for the twin, which compares bit for bit:
//   block-bf16-mixed    a pre-LN transformer block (members, not Sequential):
//                       every LayerNorm by type and the "head" by path in fp32
//   member-bf16-mixed   a model whose member MLP "block" is mapped by path to fp32
//   block-16-mixed      (LibTorch 2.3+: CPU fp16 autocast) the block under
//   member-16-mixed     Mixed<fp16, DynamicScaler>, inf in the loss at steps 3, 4 and 40
// Linear inputs are 2-D (the N-D bias rounding of LibTorch's F::linear is
// another matter: docs/regions.md).
#include <amp/amp.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "parity_io.h"

namespace {

constexpr int kSteps = 100;
constexpr int64_t kB = 4, kT = 8, kD = 32, kV = 16;
using amp_parity::bits;
using amp_parity::init;
using amp_parity::save;
using MP = amp::ModulePrecision;

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
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})))),
        head(register_module("head", torch::nn::Linear(kD, kV))) {}
  // x: [B*T, D] -> logits [B*T, V]
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor a = ln1(x);
    const torch::Tensor qs = q(a).view({kB, kT, kD}), ks = k(a).view({kB, kT, kD}), vs = v(a).view({kB, kT, kD});
    const torch::Tensor att = torch::softmax(torch::matmul(qs, ks.transpose(1, 2)) / std::sqrt(double(kD)), -1);
    torch::Tensor h = x + proj(torch::matmul(att, vs).reshape({kB * kT, kD}));
    h = h + fc2(torch::gelu(fc1(ln2(h))));
    return head(ln_f(h));
  }
  torch::nn::LayerNorm ln1;
  torch::nn::Linear q, k, v, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
};
TORCH_MODULE(Block);

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kD, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, kD))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Mlp);

struct MemberNetImpl : torch::nn::Module {
  MemberNetImpl()
      : embed(register_module("embed", torch::nn::Linear(kD, kD))),
        block(register_module("block", Mlp())),
        head(register_module("head", torch::nn::Linear(kD, kV))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor h = torch::relu(embed(x));
    return head(h + block(h));
  }
  torch::nn::Linear embed;
  Mlp block;
  torch::nn::Linear head;
};
TORCH_MODULE(MemberNet);

struct Data {
  torch::Tensor x, y;
  Data() {
    torch::manual_seed(1);
    x = torch::randn({kSteps, kB * kT, kD});
    y = torch::randint(0, kV, {kSteps, kB * kT}, torch::kLong);
  }
};

template <class Policy, class Model>
void run(std::ofstream& steps, const std::string& out, const Data& data, const std::string& name, Model model,
         const amp::PrecisionMap& map) {
  init(*model);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto scaler = [] {
    if constexpr (amp::detail::uses_loss_scaling_v<typename Policy::scaler_type>) {
      return typename Policy::scaler_type(amp::DynamicScalerOptions().growth_interval(10));
    } else {
      return typename Policy::scaler_type();
    }
  }();
  amp::Trainer<Policy, amp::CPU> trainer(model, opt,
                                         amp::TrainerOptions()
                                             .progress(false)
                                             .step(amp::StepOptions().fused(false))
                                             .region(amp::RegionOptions().precision_map(map)),
                                         std::move(scaler));
  for (int i = 0; i < kSteps; ++i) {
    const bool poison = amp::detail::uses_loss_scaling_v<typename Policy::scaler_type> && (i == 3 || i == 4 || i == 40);
    auto r = trainer.step([&](auto&) {
      const auto loss = torch::cross_entropy_loss(model->forward(data.x[i]).to(torch::kFloat), data.y[i]);
      return poison ? loss * std::numeric_limits<double>::infinity() : loss;
    });
    double scale = 1.0;
    if constexpr (amp::detail::uses_loss_scaling_v<typename Policy::scaler_type>) scale = trainer.scaler().get_scale();
    steps << name << " " << i << " " << bits(static_cast<float>(r.loss_value())) << " "
          << bits(static_cast<float>(scale)) << "\n";
  }
  save(out + "/" + name + ".params.pt", model->parameters());
}

amp::PrecisionMap block_map() {
  return amp::PrecisionMap().type<torch::nn::LayerNormImpl>(MP::kFp32).path("head", MP::kFp32);
}
amp::PrecisionMap member_map() { return amp::PrecisionMap().path("block", MP::kFp32); }

template <bool kCpuFp16>
void run_fp16(std::ofstream& steps, const std::string& out, const Data& data) {
  if constexpr (kCpuFp16) {
    using P = amp::Mixed<amp::fp16, amp::DynamicScaler>;
    run<P>(steps, out, data, "block-16-mixed", Block(), block_map());
    run<P>(steps, out, data, "member-16-mixed", MemberNet(), member_map());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: precision_map_parity OUT_DIR\n";
    return 2;
  }
  const std::string out = argv[1];
  std::cout << "precision_map_parity: LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << " on cpu\n";
  std::ofstream steps(out + "/cpp_steps.txt");
  const Data data;
  using P = amp::Mixed<amp::bf16, amp::NoScaler>;
  run<P>(steps, out, data, "block-bf16-mixed", Block(), block_map());
  run<P>(steps, out, data, "member-bf16-mixed", MemberNet(), member_map());
  run_fp16<amp::detail::compat::kCpuHasFp16 && amp::detail::compat::kCpuHasAmpKernels>(steps, out, data);
  std::cout << "precision_map_parity: wrote " << out << "\n";
  return 0;
}
