// tests/parity/parity.cc: the C++ half of the parity check against Python's torch.amp.
//
//   parity OUT_DIR [cuda|cpu]      (default cuda)
//
// Trains one small MLP several ways, each 300 steps from the same seed, and
// writes per-step losses and loss scales (as float bits) plus the final
// parameters (torch::pickle_save) for parity_twin.py, which runs the same
// steps with Python's torch.amp and compares bit for bit.
// On every LibTorch, the optimizer's own step() (TrainerOptions().step(StepOptions().fused(false))):
//   trainer-bf16-mixed-sgd-clip-unfused  Trainer<Mixed<bf16, NoScaler>> + SGD (momentum, nesterov, weight
//                           decay), max_grad_norm 1, vs autocast + clip_grad_norm_ + SGD(foreach=False)
//   trainer-64-true-sgd-unfused  Trainer<True<fp64>> + SGD (momentum) vs model.to(float64) + SGD(foreach=False)
//   gan-d-bf16-mixed-sgd-unfused  a GAN discriminator of torch::nn::Linear layers called twice per step (real
//                           and fake half of the batch, hinge losses summed), Trainer<Mixed<bf16, NoScaler>>
//                           + SGD vs nn.Linear under torch.autocast: needs linear routing (one weight cast
//                           per region, as Python; amp/precision/linear_routing.h)
//   gan-d-bf16-autocast-sgd-unfused  the same loop under a bare amp::Autocast guard and
//                           LibTorch's SGD step (the existing-code recipe)
// Where the LibTorch has fused kernels for the device (CUDA; CPU from 2.4):
//   recipe-16-mixed         amp::GradScaler + amp::Autocast<fp16> + SGD (momentum), by hand
//                           vs torch.amp + SGD(foreach=False)
//   trainer-16-mixed        Trainer<Mixed<fp16, DynamicScaler>> + Adam (the fused path) vs Adam(fused=True)
//   trainer-bf16-mixed      Trainer<Mixed<bf16, NoScaler>> + Adam (fused) vs Adam(fused=True)
//   trainer-16-mixed-adamw-clip   + AdamW (weight decay, amsgrad), max_grad_norm 1
//                           vs AdamW(fused=True) after unscale_ + clip_grad_norm_(foreach=False)
//   trainer-16-mixed-sgd    + SGD (momentum, nesterov, weight decay) vs SGD(fused=True)
//   trainer-bf16-true       Trainer<True<bf16>> + Adam (fused) vs model.to(bfloat16) + Adam(fused=True)
//   trainer-64-true         Trainer<True<fp64>> + Adam (fused) vs model.to(float64) + Adam(fused=True)
//   gan-d-bf16-mixed        the discriminator run above with Adam (fused) vs Adam(fused=True)
// The GradScalers back off (fp16 overflow) and grow within the run.
// Two models and two optimizers under one policy (amp::Fabric; a small GAN,
// 300 iterations, each logged as two steps: 2i the discriminator's loss, 2i+1
// the generator's; the final parameters are G's then D's):
//   precision-bf16-mixed-gan-unfused   (every LibTorch) bf16-mixed, SGD for both, G clipped to norm 1,
//                           the optimizers' own step() vs autocast + SGD(foreach=False)
//   precision-16-mixed-gan  (fused) 16-mixed, fused Adam for D, fused AdamW for G (clipped), one
//                           GradScaler; inf injected into D's loss, and into G's, at chosen iterations
//                           vs one torch.amp.GradScaler stepping Adam(fused=True) and AdamW(fused=True)
//
// cuda: needs a CUDA device (exits 0 with "skipped" without one); run by
// tools/gpu/check.sh. cpu: run by tests/parity:parity_python_test.
#include <torch/torch.h>

#include <amp/amp.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int kSteps = 300;

torch::nn::Sequential make_model(torch::Device device) {
  torch::manual_seed(0);
  auto m = torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::ReLU(), torch::nn::Linear(256, 256),
                                 torch::nn::ReLU(), torch::nn::Linear(256, 10));
  // Weights drawn explicitly with randn, which gives the same numbers in C++
  // and Python from the same seed (the modules' own init does not: measured,
  // torch 2.11, w[0,0] 0.121 in C++ vs -0.00094 in Python).
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.copy_(torch::randn(p.sizes()) * 0.05);
  m->to(device);
  return m;
}

// A discriminator: called on the real and on the fake half of a batch in one
// step, so each weight is used twice per autocast region.
torch::nn::Sequential make_discriminator(torch::Device device) {
  torch::manual_seed(2);
  auto d = torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::ReLU(), torch::nn::Linear(256, 256),
                                 torch::nn::ReLU(), torch::nn::Linear(256, 1));
  torch::NoGradGuard no_grad;
  for (auto& p : d->parameters()) p.copy_(torch::randn(p.sizes()) * 0.05);
  d->to(device);
  return d;
}

struct Data {
  torch::Device device;
  torch::Tensor x, y;
  explicit Data(torch::Device d) : device(d) {
    torch::manual_seed(1);
    x = (torch::randn({kSteps, 128, 64}) * 4).to(d);               // large inputs: fp16 overflows at high scales
    y = torch::randint(0, 10, {kSteps, 128}, torch::kLong).to(d);  // C++ randint defaults to float
  }
};

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// What a run leaves for the twin: one line per step in DIR/cpp_steps.txt, the
// final parameters in DIR/cpp_<run>.pt.
struct Log {
  explicit Log(std::string d) : dir(std::move(d)), out(dir + "/cpp_steps.txt") {}
  std::string dir;
  std::ofstream out;
  std::string run;
  void step(int i, const torch::Tensor& loss, double scale) {
    out << run << " " << i << " " << bits(loss.item<float>()) << " " << bits(static_cast<float>(scale)) << "\n";
  }
  void save(torch::nn::Module& m) const { save(std::vector<torch::nn::Module*>{&m}); }
  void save(const std::vector<torch::nn::Module*>& modules) const {
    c10::List<torch::Tensor> list;
    for (torch::nn::Module* m : modules)
      for (const auto& p : m->parameters()) list.push_back(p.detach().cpu());
    const std::vector<char> bytes = torch::pickle_save(c10::IValue(list));
    std::ofstream(dir + "/cpp_" + run + ".pt", std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
};

// The SGD run starts lower, so that its first step is not skipped: an SGD
// momentum buffer whose first step was skipped differs from Python's on
// purpose (README, "The fused, sync-free step").
amp::DynamicScalerOptions scaler_options(double init_scale = 65536.0) {
  return amp::DynamicScalerOptions().init_scale(init_scale).growth_interval(20);
}

// The hand-written recipe.
template <class Dev>
void recipe(Log& log, const Data& data) {
  log.run = "recipe-16-mixed";
  auto model = make_model(data.device);
  // SGD: LibTorch's C++ Adam computes exp_avg with mul_+add_ where Python's
  // uses lerp_ (1-ulp differences); SGD is the same ops in both.
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::GradScaler scaler(scaler_options());
  for (int i = 0; i < kSteps; ++i) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      amp::Autocast<amp::fp16, Dev> autocast;
      loss = torch::cross_entropy_loss(model->forward(data.x[i]), data.y[i]);
    }
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
    log.step(i, loss, scaler.get_scale());
  }
  log.save(*model);
}

// One Trainer run; `Opt` made from `opt_options`, the Trainer from `options`.
template <class Policy, class Dev, class Opt, class OptOptions, class... Scaler>
void trainer_run(Log& log, const Data& data, const std::string& name, const OptOptions& opt_options,
                 amp::TrainerOptions options, Scaler&&... scaler) {
  log.run = name;
  auto model = make_model(data.device);
  Opt opt(model->parameters(), opt_options);
  amp::Trainer<Policy, Dev> trainer(model, opt, options.progress(false), std::forward<Scaler>(scaler)...);
  if (trainer.fused() != options.step().fused())  // the twin runs fused=True or foreach=False to match
    throw std::runtime_error("amp: parity: " + name + " takes " + trainer.optimizer_path() + ", not the " +
                             (options.step().fused() ? "fused" : "unfused") + " path its Python twin runs");
  constexpr bool scaled = !std::is_same_v<typename Policy::scaler_type, amp::NoScaler>;
  const auto dtype = model->parameters()[0].scalar_type();  // fp32 for Mixed (autocast picks per op)
  for (int i = 0; i < kSteps; ++i) {
    auto r = trainer.step([&](auto&) {  // a True<D> model is in D: its inputs are the caller's to cast
      return torch::cross_entropy_loss(model->forward(data.x[i].to(dtype)), data.y[i]);
    });
    double scale = 1.0;
    if constexpr (scaled) scale = trainer.scaler().get_scale();
    log.step(i, r.loss, scale);
  }
  log.save(*model);
}

// The discriminator's step: hinge losses on the real and fake halves, summed.
template <class Dev, class Opt, class OptOptions>
void gan_run(Log& log, const Data& data, const std::string& name, const OptOptions& opt_options,
             amp::TrainerOptions options) {
  log.run = name;
  auto d = make_discriminator(data.device);
  Opt opt(d->parameters(), opt_options);
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, Dev> trainer(d, opt, options.progress(false));
  if (trainer.fused() != options.step().fused())
    throw std::runtime_error("amp: parity: " + name + " takes " + trainer.optimizer_path() + ", not the " +
                             (options.step().fused() ? "fused" : "unfused") + " path its Python twin runs");
  for (int i = 0; i < kSteps; ++i) {
    const torch::Tensor real = data.x[i].narrow(0, 0, 64), fake = data.x[i].narrow(0, 64, 64);
    auto r = trainer.step([&](auto&) {
      return torch::relu(torch::rsub(d->forward(real), 1)).mean() + torch::relu(torch::add(d->forward(fake), 1)).mean();
    });
    log.step(i, r.loss, 1.0);
  }
  log.save(*d);
}

// The existing-code recipe: gan_run's discriminator and SGD under a bare
// amp::Autocast guard and LibTorch's own optimizer step, no Trainer. Autocast
// routes linears by default, so this is Python's torch.autocast loop.
template <class Dev>
void autocast_gan_run(Log& log, const Data& data, const std::string& name) {
  log.run = name;
  auto d = make_discriminator(data.device);
  torch::optim::SGD opt(d->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  for (int i = 0; i < kSteps; ++i) {
    const torch::Tensor real = data.x[i].narrow(0, 0, 64), fake = data.x[i].narrow(0, 64, 64);
    opt.zero_grad();
    torch::Tensor loss;
    {
      amp::Autocast<amp::bf16, Dev> autocast;
      loss = torch::relu(torch::rsub(d->forward(real), 1)).mean() + torch::relu(torch::add(d->forward(fake), 1)).mean();
    }
    loss.backward();
    opt.step();
    log.step(i, loss, 1.0);
  }
  log.save(*d);
}

// The GAN of the Fabric runs, with functional torch::linear (gan_run above
// checks nn::Linear modules called twice per step, through linear routing).
struct Mlp : torch::nn::Module {
  Mlp(int64_t in, int64_t hidden, int64_t out) {
    w1 = register_parameter("w1", torch::randn({hidden, in}) * 0.1);
    b1 = register_parameter("b1", torch::randn({hidden}) * 0.1);
    w2 = register_parameter("w2", torch::randn({out, hidden}) * 0.1);
    b2 = register_parameter("b2", torch::randn({out}) * 0.1);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::linear(torch::leaky_relu(torch::linear(x, w1, b1), 0.2), w2, b2);
  }
  torch::Tensor w1, b1, w2, b2;
};

// D's loss is multiplied by inf at iterations 10, 60, 110, ...; G's at 35, 85, ...
double d_poison(int i) { return i % 50 == 10 ? std::numeric_limits<double>::infinity() : 1.0; }
double g_poison(int i) { return i % 50 == 35 ? std::numeric_limits<double>::infinity() : 1.0; }

// One Fabric run: G (16 -> 64 -> 32) and D (32 -> 64 -> 1), each with its optimizer.
template <class Policy, class Dev, class OptG, class OptD, class OptionsG, class OptionsD, class... Scaler>
void precision_run(Log& log, torch::Device device, const std::string& name, const OptionsG& og, const OptionsD& od,
                   bool fused, bool poison, Scaler&&... scaler) {
  log.run = name;
  torch::manual_seed(2);
  auto gen = std::make_shared<Mlp>(16, 64, 32);
  auto disc = std::make_shared<Mlp>(32, 64, 1);
  gen->to(device);
  disc->to(device);
  torch::manual_seed(4);
  const auto z = torch::randn({kSteps, 64, 16}).to(device);
  const auto real = (torch::randn({kSteps, 64, 32}) * 0.5 + 1.0).to(device);
  OptG opt_g(gen->parameters(), og);
  OptD opt_d(disc->parameters(), od);
  amp::Fabric<Policy, Dev> fabric(amp::FabricOptions(), std::forward<Scaler>(scaler)...);
  fabric.setup(gen, opt_g, amp::StepOptions().max_grad_norm(1.0).fused(fused));
  fabric.setup(disc, opt_d, amp::StepOptions().fused(fused));
  if (fabric.fused(opt_g) != fused || fabric.fused(opt_d) != fused)
    throw std::runtime_error("amp: parity: " + name + " takes " + fabric.optimizer_path(opt_g) + " and " +
                             fabric.optimizer_path(opt_d) + ", not the path its Python twin runs");
  auto bce = [](const torch::Tensor& logits, double target) {
    return torch::binary_cross_entropy_with_logits(logits, torch::full_like(logits, target));
  };
  for (int i = 0; i < kSteps; ++i) {
    opt_d.zero_grad();
    const auto loss_d = fabric.forward(
        [&](auto&) { return bce(disc->forward(real[i]), 1.0) + bce(disc->forward(gen->forward(z[i]).detach()), 0.0); });
    fabric.backward(poison && d_poison(i) != 1.0 ? loss_d * d_poison(i) : loss_d);
    fabric.optimizer_step(opt_d);
    opt_g.zero_grad();
    const auto loss_g = fabric.forward([&](auto&) { return bce(disc->forward(gen->forward(z[i])), 1.0); });
    fabric.backward(poison && g_poison(i) != 1.0 ? loss_g * g_poison(i) : loss_g);
    fabric.optimizer_step(opt_g);
    fabric.update();
    const double scale = fabric.scaler().get_scale();
    log.step(2 * i, loss_d, scale);
    log.step(2 * i + 1, loss_g, scale);
  }
  log.save({gen.get(), disc.get()});
}

// The runs on the fused path, and the GradScaler recipe.
template <class Dev>
void fused_runs(Log& log, const Data& data) {
  using Fp16 = amp::Mixed<amp::fp16, amp::DynamicScaler>;
  using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;
  using torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamW, torch::optim::AdamWOptions;
  using torch::optim::SGD, torch::optim::SGDOptions;
  recipe<Dev>(log, data);
  trainer_run<Fp16, Dev, Adam>(log, data, "trainer-16-mixed", AdamOptions(1e-3), amp::TrainerOptions(),
                               amp::DynamicScaler(scaler_options()));
  trainer_run<Bf16, Dev, Adam>(log, data, "trainer-bf16-mixed", AdamOptions(1e-3), amp::TrainerOptions());
  trainer_run<Fp16, Dev, AdamW>(
      log, data, "trainer-16-mixed-adamw-clip", AdamWOptions(1e-3).weight_decay(0.01).amsgrad(true),
      amp::TrainerOptions().step(amp::StepOptions().max_grad_norm(1.0)), amp::DynamicScaler(scaler_options()));
  trainer_run<Fp16, Dev, SGD>(log, data, "trainer-16-mixed-sgd",
                              SGDOptions(0.01).momentum(0.9).nesterov(true).weight_decay(1e-4), amp::TrainerOptions(),
                              amp::DynamicScaler(scaler_options(1024.0)));
  trainer_run<amp::True<amp::bf16>, Dev, Adam>(log, data, "trainer-bf16-true", AdamOptions(1e-3),
                                               amp::TrainerOptions());
  trainer_run<amp::True<amp::fp64>, Dev, Adam>(log, data, "trainer-64-true", AdamOptions(1e-3), amp::TrainerOptions());
  gan_run<Dev, Adam>(log, data, "gan-d-bf16-mixed", AdamOptions(1e-3), amp::TrainerOptions());
  precision_run<Fp16, Dev, AdamW, Adam>(log, data.device, "precision-16-mixed-gan",
                                        AdamWOptions(1e-3).weight_decay(0.01), AdamOptions(2e-4).betas({0.5, 0.999}),
                                        /*fused=*/true, /*poison=*/true, amp::DynamicScaler(scaler_options(1024.0)));
}

// kFused: the runs on the fused path (and the GradScaler recipe), where the
// LibTorch has fused kernels for the device; the unfused runs always.
template <class Dev, bool kFused>
int run(const std::string& dir, torch::Device device) {
  std::cout << "parity: LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << " on " << device << "\n";
  Data data(device);
  {  // Inputs and initial weights, for telling a data/init difference from a numerics one.
    auto m = make_model(device);
    std::cout << "parity: inputs x.sum " << data.x.sum().item<double>() << " y.sum " << data.y.sum().item<int64_t>()
              << " w0[0,0] " << m->parameters()[0].view({-1})[0].item<double>() << " w.sum "
              << m->parameters()[0].sum().item<double>() << "\n";
  }
  Log log(dir);
  using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;
  using torch::optim::SGD, torch::optim::SGDOptions;
  // The optimizer's own step(): LibTorch's SGD is Python's SGD(foreach=False), op for op.
  trainer_run<Bf16, Dev, SGD>(log, data, "trainer-bf16-mixed-sgd-clip-unfused",
                              SGDOptions(0.01).momentum(0.9).nesterov(true).weight_decay(1e-4),
                              amp::TrainerOptions().step(amp::StepOptions().fused(false).max_grad_norm(1.0)));
  trainer_run<amp::True<amp::fp64>, Dev, SGD>(log, data, "trainer-64-true-sgd-unfused", SGDOptions(0.01).momentum(0.9),
                                              amp::TrainerOptions().step(amp::StepOptions().fused(false)));
  gan_run<Dev, SGD>(log, data, "gan-d-bf16-mixed-sgd-unfused", SGDOptions(0.01).momentum(0.9),
                    amp::TrainerOptions().step(amp::StepOptions().fused(false)));
  autocast_gan_run<Dev>(log, data, "gan-d-bf16-autocast-sgd-unfused");
  precision_run<Bf16, Dev, SGD, SGD>(log, device, "precision-bf16-mixed-gan-unfused", SGDOptions(0.02).momentum(0.5),
                                     SGDOptions(0.01).momentum(0.9).nesterov(true).weight_decay(1e-4),
                                     /*fused=*/false, /*poison=*/false);
  if constexpr (kFused) fused_runs<Dev>(log, data);
  std::cout << "parity: wrote " << dir << "/cpp_steps.txt\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string device = argc == 3 ? argv[2] : "cuda";
  if ((argc != 2 && argc != 3) || (device != "cuda" && device != "cpu")) {
    std::cerr << "usage: parity OUT_DIR [cuda|cpu]\n";
    return 2;
  }
  if (device == "cuda") {
    if (!torch::cuda::is_available()) {
      std::cout << "parity: skipped (no CUDA device)\n";
      return 0;
    }
    return run<amp::CUDA, true>(argv[1], torch::kCUDA);
  }
  // An older LibTorch has no CPU fused optimizers (2.4) and no CPU GradScaler kernels (2.3).
  return run<amp::CPU, amp::detail::libtorch_at_least(2, 4)>(argv[1], torch::kCPU);
}
