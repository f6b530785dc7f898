// tests/gpu/parity.cc: the C++ half of the GPU parity check (tools/gpu/check.sh).
//
//   parity OUT_DIR        (needs a CUDA device; exits 0 with "skipped" without one)
//
// Trains one small MLP on CUDA three ways, each 300 steps from the same seed,
// and writes per-step losses and loss scales (as float bits) plus the final
// parameters (torch::pickle_save) for tests/gpu/parity_twin.py, which runs the
// same steps with Python's torch.amp and compares bit for bit:
//   recipe-16-mixed    amp::GradScaler + amp::Autocast<fp16, CUDA> + SGD (momentum), by hand
//                      vs torch.amp + SGD(foreach=False)
//   trainer-16-mixed   amp::Trainer<Mixed<fp16, DynamicScaler>, CUDA> + Adam (its fused path)
//                      vs torch.amp + Adam(fused=True)
//   trainer-bf16-mixed amp::Trainer<Mixed<bf16, NoScaler>, CUDA> + Adam (fused) vs Adam(fused=True)
// The GradScaler uses init_scale 2^16 and growth_interval 20, so that the
// scale both backs off (fp16 overflow) and grows within the run.
#include <torch/torch.h>

#include <amp/amp.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr int kSteps = 300;

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  auto m = torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::ReLU(), torch::nn::Linear(256, 256),
                                 torch::nn::ReLU(), torch::nn::Linear(256, 10));
  // Weights drawn explicitly with randn, which gives the same numbers in C++
  // and Python from the same seed (the modules' own init does not: measured,
  // torch 2.11, w[0,0] 0.121 in C++ vs -0.00094 in Python).
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.copy_(torch::randn(p.sizes()) * 0.05);
  m->to(torch::kCUDA);
  return m;
}

struct Data {
  torch::Tensor x, y;
  Data() {
    torch::manual_seed(1);
    x = (torch::randn({kSteps, 128, 64}) * 4).to(torch::kCUDA);  // large inputs: fp16 overflows at high scales
    y = torch::randint(0, 10, {kSteps, 128}, torch::kLong).to(torch::kCUDA);  // C++ randint defaults to float
  }
};

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

struct Log {
  std::ofstream out;
  std::string run;
  void step(int i, const torch::Tensor& loss, double scale) {
    out << run << " " << i << " " << bits(loss.item<float>()) << " " << bits(static_cast<float>(scale)) << "\n";
  }
};

void save_params(const std::string& path, torch::nn::Module& m) {
  c10::List<torch::Tensor> list;
  for (const auto& p : m.parameters()) list.push_back(p.detach().cpu());
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(list));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

amp::DynamicScalerOptions scaler_options() { return amp::DynamicScalerOptions().init_scale(65536.0).growth_interval(20); }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: parity OUT_DIR\n";
    return 2;
  }
  if (!torch::cuda::is_available()) {
    std::cout << "parity: skipped (no CUDA device)\n";
    return 0;
  }
  const std::string dir = argv[1];
  Data data;
  {  // Inputs and initial weights, for telling a data/init difference from a numerics one.
    auto m = make_model();
    std::cout << "parity: inputs x.sum " << data.x.sum().item<double>() << " y.sum " << data.y.sum().item<int64_t>()
              << " w0[0,0] " << m->parameters()[0].view({-1})[0].item<double>() << " w.sum "
              << m->parameters()[0].sum().item<double>() << "\n";
  }
  Log log{std::ofstream(dir + "/cpp_steps.txt"), ""};

  {  // The hand-written recipe.
    log.run = "recipe-16-mixed";
    auto model = make_model();
    // SGD: LibTorch's C++ Adam computes exp_avg with mul_+add_ where Python's
    // uses lerp_ (1-ulp differences); SGD is the same ops in both.
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    amp::GradScaler scaler(scaler_options());
    for (int i = 0; i < kSteps; ++i) {
      opt.zero_grad();
      torch::Tensor loss;
      {
        amp::Autocast<amp::fp16, amp::CUDA> autocast;
        loss = torch::cross_entropy_loss(model->forward(data.x[i]), data.y[i]);
      }
      scaler.scale(loss).backward();
      scaler.step(opt);
      scaler.update();
      log.step(i, loss, scaler.get_scale());
    }
    save_params(dir + "/cpp_recipe-16-mixed.pt", *model);
  }
  {
    log.run = "trainer-16-mixed";
    auto model = make_model();
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
    amp::Trainer<amp::Mixed<amp::fp16, amp::DynamicScaler>, amp::CUDA> trainer(
        model, opt, amp::TrainerOptions().progress(false), amp::DynamicScaler(scaler_options()));
    for (int i = 0; i < kSteps; ++i) {
      auto r = trainer.step([&](auto&) { return torch::cross_entropy_loss(model->forward(data.x[i]), data.y[i]); });
      log.step(i, r.loss, trainer.scaler().get_scale());
    }
    save_params(dir + "/cpp_trainer-16-mixed.pt", *model);
  }
  {
    log.run = "trainer-bf16-mixed";
    auto model = make_model();
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
    amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CUDA> trainer(model, opt,
                                                                         amp::TrainerOptions().progress(false));
    for (int i = 0; i < kSteps; ++i) {
      auto r = trainer.step([&](auto&) { return torch::cross_entropy_loss(model->forward(data.x[i]), data.y[i]); });
      log.step(i, r.loss, 1.0);
    }
    save_params(dir + "/cpp_trainer-bf16-mixed.pt", *model);
  }
  std::cout << "parity: wrote " << dir << "/cpp_steps.txt\n";
  return 0;
}
