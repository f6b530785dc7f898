// examples/dcgan.cc: a small DCGAN trained by amp::Fabric on CPU: a
// generator and a discriminator, each with its own Adam, one precision object
// (the shape of torch's "several models and optimizers" AMP recipe and of
// Lightning Fabric). The precision is the first argument, bf16-mixed by
// default; 16-mixed shares one GradScaler between both optimizers (CPU fp16
// needs LibTorch >= 2.3). The second argument is the iteration count (300).
//
//   bazel run //examples:dcgan [-- 16-mixed [ITERATIONS]]
//
// bf16-mixed takes about 10-30 s on 2 cores; 16-mixed is far slower on CPU
// (LibTorch 2.6: about 1.3 s per iteration, fp16 convolutions without fast
// CPU kernels), so its test runs 24 iterations.
//
// The data are synthetic 16x16 images: one bright square of random size and
// place on a dark background, in [-1, 1]. Six times in a run it prints both
// losses; at the end it evaluates the generator (eval mode, no autograd,
// under the policy) and saves a checkpoint that load() restores.
#include <amp/amp.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

constexpr int64_t kNoise = 32, kBatch = 64;

// Images [n, 1, 16, 16] in [-1, 1] with one square each.
torch::Tensor squares(int64_t n) {
  const auto size = torch::randint(4, 9, {n, 1, 1, 1}, torch::kLong);
  const auto top = torch::randint(0, 8, {n, 1, 1, 1}, torch::kLong);
  const auto left = torch::randint(0, 8, {n, 1, 1, 1}, torch::kLong);
  const auto rows = torch::arange(16).view({1, 1, 16, 1}), cols = torch::arange(16).view({1, 1, 1, 16});
  const auto inside = (rows >= top) & (rows < top + size) & (cols >= left) & (cols < left + size);
  return inside.to(torch::kFloat) * 2 - 1;
}

struct GeneratorImpl : torch::nn::Module {
  GeneratorImpl() {
    using namespace torch::nn;
    project = register_module("project", Linear(kNoise, 64 * 4 * 4));
    body = register_module(
        "body", Sequential(BatchNorm2d(64), ReLU(),
                           ConvTranspose2d(ConvTranspose2dOptions(64, 32, 4).stride(2).padding(1)), BatchNorm2d(32),
                           ReLU(), ConvTranspose2d(ConvTranspose2dOptions(32, 1, 4).stride(2).padding(1)), Tanh()));
  }
  torch::Tensor forward(const torch::Tensor& z) { return body->forward(project->forward(z).view({-1, 64, 4, 4})); }
  torch::nn::Linear project{nullptr};
  torch::nn::Sequential body{nullptr};
};
TORCH_MODULE(Generator);

struct DiscriminatorImpl : torch::nn::Module {
  DiscriminatorImpl() {
    using namespace torch::nn;
    body = register_module(
        "body", Sequential(Conv2d(Conv2dOptions(1, 32, 4).stride(2).padding(1)),
                           LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
                           Conv2d(Conv2dOptions(32, 64, 4).stride(2).padding(1)),
                           LeakyReLU(LeakyReLUOptions().negative_slope(0.2)), Flatten(), Linear(64 * 4 * 4, 1)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return body->forward(x); }
  torch::nn::Sequential body{nullptr};
};
TORCH_MODULE(Discriminator);

double mean_of(const torch::Tensor& t) { return t.to(torch::kFloat).mean().item<double>(); }

torch::Tensor bce(const torch::Tensor& logits, double target) {
  return torch::binary_cross_entropy_with_logits(logits, torch::full_like(logits, target));
}

}  // namespace

template <class Policy>
void train(int64_t iterations) {
  torch::manual_seed(0);
  Generator gen;
  Discriminator disc;
  torch::optim::Adam opt_g(gen->parameters(), torch::optim::AdamOptions(2e-3).betas({0.5, 0.999}));
  torch::optim::Adam opt_d(disc->parameters(), torch::optim::AdamOptions(2e-3).betas({0.5, 0.999}));

  // One policy for both models (and under 16-mixed one GradScaler for both optimizers).
  amp::Fabric<Policy, amp::CPU> fabric;
  fabric.setup(gen, opt_g);
  fabric.setup(disc, opt_d);
  std::printf("dcgan: %s, generator %s, discriminator %s\n", fabric.precision_name,
              fabric.optimizer_path(opt_g).c_str(), fabric.optimizer_path(opt_d).c_str());

  const int64_t print_every = std::max<int64_t>(1, iterations / 6);
  for (int64_t it = 1; it <= iterations; ++it) {
    const auto real = squares(kBatch);
    const auto z = torch::randn({kBatch, kNoise});
    // The discriminator: real images -> 1, generated ones -> 0.
    opt_d.zero_grad();
    const auto loss_d = fabric.forward([&](auto&) { return bce(disc(real), 1.0) + bce(disc(gen(z).detach()), 0.0); });
    fabric.backward(loss_d);
    fabric.optimizer_step(opt_d);
    // The generator: make the discriminator say 1.
    opt_g.zero_grad();
    const auto loss_g = fabric.forward([&](auto&) { return bce(disc(gen(z)), 1.0); });
    fabric.backward(loss_g);
    fabric.optimizer_step(opt_g);
    fabric.update();  // under 16-mixed: the scale backs off at most once per iteration
    if (it % print_every == 0)
      std::printf("iteration %3lld  loss_d %.4f  loss_g %.4f\n", static_cast<long long>(it), mean_of(loss_d),
                  mean_of(loss_g));
  }

  // Evaluation: BatchNorm on its running statistics, no autograd, bf16 autocast.
  const torch::Tensor fake = fabric.evaluate([&](auto&) { return gen(torch::randn({256, kNoise})).to(torch::kFloat); });
  const auto real = squares(256);
  std::printf("generated: mean pixel %.3f (real %.3f), bright pixels %.1f%% (real %.1f%%)\n", mean_of(fake),
              mean_of(real), 100 * mean_of(fake > 0), 100 * mean_of(real > 0));

  fabric.save("dcgan.pt");  // both models, both optimizers, the scaler, the iteration count; atomic
  fabric.load("dcgan.pt");
  std::printf("checkpoint dcgan.pt: %lld iterations\n", static_cast<long long>(fabric.steps()));
  if constexpr (amp::policy_traits<Policy>::uses_loss_scaling)
    std::printf("loss scale %g\n", fabric.scaler().get_scale());
}

// Trains under Policy where this LibTorch's CPU supports it.
template <class Policy>
int run(int64_t iterations) {
  if constexpr (amp::is_supported_v<Policy, amp::CPU>) {
    train<Policy>(iterations);
    return 0;
  } else {
    std::fprintf(stderr, "amp: %s on CPU needs LibTorch >= 2.3 (this is %d.%d); use bf16-mixed\n",
                 amp::policy_traits<Policy>::name, TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR);
    return 2;
  }
}

int main(int argc, char** argv) {
  const std::string precision = argc > 1 ? argv[1] : "bf16-mixed";
  const int64_t iterations = argc > 2 ? std::atoll(argv[2]) : 300;
  if (iterations < 1) {
    std::fprintf(stderr, "amp: dcgan's iterations must be >= 1, got \"%s\"\n", argv[2]);
    return 1;
  }
  if (precision == "bf16-mixed") return run<amp::Mixed<amp::bf16, amp::NoScaler>>(iterations);
  if (precision == "16-mixed") return run<amp::Mixed<amp::fp16, amp::DynamicScaler>>(iterations);
  std::fprintf(stderr, "amp: dcgan trains under bf16-mixed or 16-mixed, not \"%s\"\n", precision.c_str());
  return 1;
}
