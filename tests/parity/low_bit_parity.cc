// tests/parity/low_bit_parity.cc: the C++ half of the low-bit optimizer
// parity check (amp/optim/low_bit_adam.h against torchao's algorithm written
// in plain Python torch, tests/parity/low_bit_twin.py).
//
//   low_bit_parity OUT_DIR
//
// Trains one small MLP (64-128-128-10: two quantized weights, one plain, plain
// biases) for 100 steps per run through amp::Trainer on CPU and writes the
// per-step losses and loss scales (float bits), the final parameters, and
// every final optimizer state (step, codes and scales, or plain values) for
// the twin, which runs the same steps and compares bit for bit:
//   adamw8bit-32-true          Trainer<True<fp32>> + AdamW8bit
//   adam8bit-amsgrad-32-true   Trainer<True<fp32>> + Adam8bit (L2 weight decay, amsgrad)
//   adamw4bit-bf16-mixed       Trainer<Mixed<bf16, NoScaler>> + AdamW4bit
//   adamw8bit-bf16-true-sr     Trainer<True<bf16>> + AdamW8bit with bf16 stochastic rounding
//   adamwfp8-bf16-mixed        (LibTorch 2.1+) Trainer<Mixed<bf16, NoScaler>> + AdamWFp8
//   adamw8bit-16-mixed-inf     (LibTorch 2.3+: CPU fp16 autocast and GradScaler kernels)
//                              Trainer<Mixed<fp16, DynamicScaler>> + AdamW8bit, inf injected
//                              into the loss at steps 3, 4 and 40: skipped on the device
#include <torch/torch.h>

#include <amp/amp.h>

#include "parity_io.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr int kSteps = 100;

using amp_parity::bits;
using amp_parity::make_mlp;
using amp_parity::save;

// Per parameter: step, then per moment either [values] or [codes (uint8 bytes), scale].
std::vector<torch::Tensor> states_of(const torch::optim::Optimizer& opt, const torch::nn::Module& model) {
  std::vector<torch::Tensor> out;
  for (const auto& p : model.parameters()) {
    const auto& s = static_cast<const amp::detail::LowBitAdamParamState&>(
        *opt.state().at(amp::detail::compat::optim_state_key(p.unsafeGetTensorImpl())));
    out.push_back(s.step());
    for (const amp::detail::QuantizedState* q : {&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq()}) {
      if (!q->defined()) continue;
      if (q->format() == amp::StateFormat::kFloat) {
        out.push_back(q->values());
      } else {
        out.push_back(q->format() == amp::StateFormat::kFp8 ? q->codes().view(torch::kByte) : q->codes());
        out.push_back(q->scale());
      }
    }
  }
  return out;
}

struct Data {
  torch::Tensor x, y;
  Data() {
    torch::manual_seed(1);
    x = torch::randn({kSteps, 64, 64}) * 2;
    y = torch::randint(0, 10, {kSteps, 64}, torch::kLong);
  }
};

template <class Policy, class Opt>
void run(std::ofstream& steps, const std::string& out, const Data& data, const std::string& name,
         const typename Opt::Options& options, amp::LowBitOptions low_bit = {},
         typename Policy::scaler_type scaler = typename Policy::scaler_type()) {
  auto model = make_mlp();
  Opt opt(model->parameters(), options, low_bit);
  amp::Trainer<Policy, amp::CPU> trainer(model, opt, amp::TrainerOptions().progress(false), std::move(scaler));
  if (!trainer.fused()) throw std::runtime_error("amp: low_bit_parity: " + name + " takes " + trainer.optimizer_path());
  const auto dtype = model->parameters()[0].scalar_type();  // a True<bf16> model is bf16
  torch::manual_seed(7);                                    // stochastic rounding draws from here on, as the twin's
  for (int i = 0; i < kSteps; ++i) {
    const bool poison = name.find("-inf") != std::string::npos && (i == 3 || i == 4 || i == 40);
    auto r = trainer.step([&](auto&) {
      const auto loss = torch::cross_entropy_loss(model->forward(data.x[i].to(dtype)).to(torch::kFloat), data.y[i]);
      return poison ? loss * std::numeric_limits<double>::infinity() : loss;
    });
    double scale = 1.0;
    if constexpr (amp::detail::uses_loss_scaling_v<typename Policy::scaler_type>) scale = trainer.scaler().get_scale();
    steps << name << " " << i << " " << bits(static_cast<float>(r.loss_value())) << " "
          << bits(static_cast<float>(scale)) << "\n";
  }
  save(out + "/" + name + ".params.pt", model->parameters());
  save(out + "/" + name + ".states.pt", states_of(opt, *model));
}

// Only where CPU fp16 autocast exists (a template, so that the Trainer is
// not instantiated for a LibTorch that rejects it).
template <bool kCpuFp16>
void run_fp16(std::ofstream& steps, const std::string& out, const Data& data) {
  if constexpr (kCpuFp16) {
    run<amp::Mixed<amp::fp16, amp::DynamicScaler>, amp::AdamW8bit>(
        steps, out, data, "adamw8bit-16-mixed-inf", torch::optim::AdamWOptions(2e-3), {},
        amp::DynamicScaler(amp::DynamicScalerOptions().growth_interval(10)));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: low_bit_parity OUT_DIR\n";
    return 2;
  }
  const std::string out = argv[1];
  std::cout << "low_bit_parity: LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << " on cpu\n";
  std::ofstream steps(out + "/cpp_steps.txt");
  const Data data;
  using torch::optim::AdamOptions;
  using torch::optim::AdamWOptions;
  run<amp::True<amp::fp32>, amp::AdamW8bit>(steps, out, data, "adamw8bit-32-true", AdamWOptions(2e-3));
  run<amp::True<amp::fp32>, amp::Adam8bit>(steps, out, data, "adam8bit-amsgrad-32-true",
                                           AdamOptions(2e-3).weight_decay(1e-2).amsgrad(true));
  run<amp::Mixed<amp::bf16, amp::NoScaler>, amp::AdamW4bit>(steps, out, data, "adamw4bit-bf16-mixed",
                                                            AdamWOptions(2e-3));
  run<amp::True<amp::bf16>, amp::AdamW8bit>(steps, out, data, "adamw8bit-bf16-true-sr", AdamWOptions(2e-3),
                                            amp::LowBitOptions().bf16_stochastic_round(true));
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
  run<amp::Mixed<amp::bf16, amp::NoScaler>, amp::AdamWFp8>(steps, out, data, "adamwfp8-bf16-mixed", AdamWOptions(2e-3));
#endif
  run_fp16<amp::detail::compat::kCpuHasFp16 && amp::detail::compat::kCpuHasAmpKernels>(steps, out, data);
  std::cout << "low_bit_parity: wrote " << out << "\n";
  return 0;
}
