// amp/distributed.h in a world of one process (RANK=0, WORLD_SIZE=1, a free
// port on 127.0.0.1): the all-reduce of one rank is its own gradient and
// DataParallel divides it by 1, which is exact, so a Trainer with
// DataParallel must end bit for bit where the same Trainer ends without it.
//
//   * CPU over Gloo: every LibTorch line (bf16 gradients on LibTorch 1.13
//     travel as fp32 copies: exact too).
//   * CUDA over NCCL, Trainer<Mixed<fp16, DynamicScaler>, CUDA>: skips without
//     a GPU or without NCCL in the build (AMP_HAS_NCCL, detail/compat_c10d.h);
//     runs through CMake on a CUDA machine with the pip wheel's LibTorch
//     (tools/gpu/check.sh). Not run so far: no GPU.
//   * Fabric (two models, two optimizers) with one DataParallel over
//     all its models' parameters: the same, bit for bit.
//   * The backend choice's amp: errors that a machine can reach.
//
// The NCCL path compiles without a GPU; the syntax check, against LibTorch
// 2.6's CUDA headers T (Debian trixie's libtorch-cuda-dev) and CUDA's (one line):
//   g++ -std=c++17 -fsyntax-only -Wall -Wextra -Werror -DUSE_C10D_NCCL -DUSE_C10D_GLOO -Iinclude
//     -isystem $T -isystem $T/torch/csrc/api/include -isystem /usr/local/cuda/include
//     tests/distributed/distributed_world1_test.cc
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "amp/detail/compat_c10d.h"
#include "amp/distributed.h"
#include "amp/optim/low_bit_adam.h"
#include "amp/train/fabric.h"
#include "amp/scaler/dynamic_scaler.h"
#include "amp/train/trainer.h"

namespace {

// A port nobody listens on now (the kernel's pick for port 0).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 29500;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  int port = 29500;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

// torchrun's variables for a world of one, as a user's process would see them.
void set_world_of_one_env() {
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  ::setenv("LOCAL_RANK", "0", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(free_port()).c_str(), 1);
}

amp::ProcessGroupOptions options(amp::Backend backend) {
  return amp::ProcessGroupOptions().backend(backend).timeout(std::chrono::seconds(60)).threads(1);
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

struct TrainRun {
  std::vector<torch::Tensor> params;  // on CPU
  std::vector<double> losses, scales;
  std::vector<bool> skipped;
  int64_t allreduces = 0, buckets = 0;
};

// `steps` steps of a small MLP under Trainer<Policy, Device> on `device`,
// with DataParallel over `pg` when given.
template <class Policy, class Device, class Opt = torch::optim::Adam>
TrainRun train(torch::Device device, const amp::ProcessGroup* pg, int64_t steps) {
  torch::manual_seed(0);
  // 16 -> 256 -> 4: the first weight (4096 elements) is big enough for a low-bit optimizer to quantize.
  auto net = torch::nn::Sequential(torch::nn::Linear(16, 256), torch::nn::ReLU(), torch::nn::Linear(256, 4));
  net->to(device);
  Opt opt(net->parameters(), torch::optim::AdamOptions(1e-2).eps(1e-4));
  amp::Trainer<Policy, Device> trainer(net, opt, amp::TrainerOptions().progress(false));
  std::optional<amp::DataParallel> dp;
  if (pg != nullptr) dp.emplace(*pg, trainer);
  const torch::Tensor p0 = net->parameters().front();  // True<D>: batches in D
  TrainRun run;
  for (int64_t s = 0; s < steps; ++s) {
    torch::manual_seed(100 + static_cast<uint64_t>(s));
    torch::Tensor x = torch::randn({32, 16});
    torch::Tensor y = x.narrow(1, 0, 4) * 2 - x.narrow(1, 4, 4);
    x = x.to(device, p0.scalar_type()), y = y.to(device, p0.scalar_type());
    // (p - y)^2's mean: LibTorch 1.13 has no CPU mse_loss for bf16.
    auto r = trainer.step([&](auto&) { return (net->forward(x) - y).pow(2).mean(); });
    run.losses.push_back(r.loss_value());
    run.skipped.push_back(r.skipped());
    run.scales.push_back(trainer.scaler().get_scale());
  }
  trainer.stepper().sync_optimizer_state();
  for (const auto& p : net->parameters()) run.params.push_back(p.detach().to(torch::kCPU).clone());
  if (dp) run.allreduces = dp->allreduces(), run.buckets = dp->buckets();
  return run;
}

void expect_bitwise_equal(const TrainRun& dp, const TrainRun& plain, int64_t steps) {
  ASSERT_EQ(dp.params.size(), plain.params.size());
  for (size_t i = 0; i < dp.params.size(); ++i)
    EXPECT_TRUE(torch::equal(dp.params[i], plain.params[i])) << "parameter " << i << " differs";
  EXPECT_EQ(dp.losses, plain.losses);
  EXPECT_EQ(dp.scales, plain.scales);
  EXPECT_EQ(dp.skipped, plain.skipped);
  EXPECT_GT(dp.buckets, 0);
  EXPECT_EQ(dp.allreduces, steps * dp.buckets);
}

template <class Policy, class Opt = torch::optim::Adam>
void cpu_world_of_one() {
  set_world_of_one_env();
  amp::ProcessGroup pg = amp::init_process_group(options(amp::Backend::kAuto));
  EXPECT_EQ(pg.world_size(), 1);
  constexpr int64_t kSteps = 8;
  const TrainRun with = train<Policy, amp::CPU, Opt>(torch::kCPU, &pg, kSteps);
  const TrainRun without = train<Policy, amp::CPU, Opt>(torch::kCPU, nullptr, kSteps);
  expect_bitwise_equal(with, without, kSteps);
}

TEST(WorldOfOne, CpuMixedBf16EqualsPlainTrainerBitwise) { cpu_world_of_one<amp::Mixed<amp::bf16, amp::NoScaler>>(); }

// A low-bit optimizer (amp/optim/low_bit_adam.h) under DataParallel: its own sync-free step on the averaged gradients.
TEST(WorldOfOne, CpuLowBitAdamEqualsPlainTrainerBitwise) {
  cpu_world_of_one<amp::Mixed<amp::bf16, amp::NoScaler>, amp::Adam8bit>();
}

// bf16 gradients: on LibTorch 1.13 an fp32 copy travels (Gloo has no bf16).
TEST(WorldOfOne, CpuTrueBf16EqualsPlainTrainerBitwise) { cpu_world_of_one<amp::True<amp::bf16>>(); }

// A small GAN under Fabric<bf16-mixed>: D's loss, D's step, G's loss,
// G's step, one update; with DataParallel over both models when pg is given.
std::vector<torch::Tensor> train_gan(const amp::ProcessGroup* pg, int64_t iterations, int64_t* allreduces) {
  torch::manual_seed(0);
  auto gen = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
  auto disc = torch::nn::Sequential(torch::nn::Linear(4, 16), torch::nn::ReLU(), torch::nn::Linear(16, 1));
  torch::optim::Adam opt_g(gen->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::SGD opt_d(disc->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
  amp::Fabric<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> prec;
  prec.setup(gen, opt_g);
  prec.setup(disc, opt_d, amp::StepOptions().max_grad_norm(1.0));
  std::optional<amp::DataParallel> dp;
  if (pg != nullptr) {
    dp.emplace(*pg, prec.parameters(), prec.buffers(), amp::DataParallelOptions(), prec.parameter_names());
    prec.set_gradient_sync(&*dp);
  }
  for (int64_t i = 0; i < iterations; ++i) {
    torch::manual_seed(100 + static_cast<uint64_t>(i));
    const auto z = torch::randn({32, 8}), real = torch::randn({32, 4}) + 1;
    opt_d.zero_grad();
    prec.backward(prec.forward([&](auto&) {
      return torch::softplus(-disc->forward(real)).mean() +
             torch::softplus(disc->forward(gen->forward(z).detach())).mean();
    }));
    prec.step(opt_d);
    opt_g.zero_grad();
    prec.backward(prec.forward([&](auto&) { return torch::softplus(-disc->forward(gen->forward(z))).mean(); }));
    prec.step(opt_g);
    prec.update();
  }
  if (dp) *allreduces = dp->allreduces();
  return prec.parameters();
}

TEST(WorldOfOne, CpuPrecisionOfTwoModelsEqualsPlainPrecisionBitwise) {
  set_world_of_one_env();
  amp::ProcessGroup pg = amp::init_process_group(options(amp::Backend::kAuto));
  int64_t allreduces = 0;
  const auto with = train_gan(&pg, 6, &allreduces);
  const auto without = train_gan(nullptr, 6, nullptr);
  ASSERT_EQ(with.size(), without.size());
  for (size_t i = 0; i < with.size(); ++i) EXPECT_TRUE(torch::equal(with[i], without[i])) << "parameter " << i;
  EXPECT_GE(allreduces, 12);  // every backward: 2 per iteration, at least one bucket each
}

TEST(WorldOfOne, CpuKeepsTheDeviceOnCpuUnderGloo) {
  set_world_of_one_env();
  amp::ProcessGroup pg = amp::init_process_group(options(amp::Backend::kGloo));
  EXPECT_EQ(pg.device(), torch::Device(torch::kCPU));
  EXPECT_EQ(pg.backend(), amp::Backend::kGloo);
}

// pytorch/examples' MNIST shape: a `Net model;` on the stack (held by the
// Trainer without ownership) under DataParallel, equal to the Trainer alone.
struct StackNet : torch::nn::Module {
  StackNet() : conv1(torch::nn::Conv2dOptions(1, 4, 5)), fc1(64, 10) {
    register_module("conv1", conv1);
    register_module("fc1", fc1);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1->forward(x), 2));
    return torch::log_softmax(fc1->forward(x.view({-1, 64})), 1);
  }
  torch::nn::Conv2d conv1;
  torch::nn::Linear fc1;
};

std::vector<torch::Tensor> train_stack_net(const amp::ProcessGroup* pg) {
  torch::manual_seed(0);
  StackNet model;
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(model, opt,
                                                                       amp::TrainerOptions().progress(false));
  std::optional<amp::DataParallel> dp;
  if (pg != nullptr) dp.emplace(*pg, trainer);
  for (int s = 0; s < 3; ++s) {
    torch::manual_seed(10 + s);
    const torch::Tensor x = torch::randn({8, 1, 12, 12}), y = torch::randint(10, {8});
    trainer.step([&](auto&) { return torch::nll_loss(model.forward(x).to(torch::kFloat32), y); });
  }
  if (dp) {
    EXPECT_EQ(dp->allreduces(), 3 * dp->buckets());
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : model.parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(WorldOfOne, CpuStackModelUnderDataParallelEqualsPlainTrainerBitwise) {
  set_world_of_one_env();
  amp::ProcessGroup pg = amp::init_process_group(options(amp::Backend::kAuto));
  const auto with = train_stack_net(&pg), without = train_stack_net(nullptr);
  ASSERT_EQ(with.size(), without.size());
  for (size_t i = 0; i < with.size(); ++i) EXPECT_TRUE(torch::equal(with[i], without[i])) << "parameter " << i;
}

// kNccl where it cannot work: an amp: error before any rendezvous.
TEST(WorldOfOne, NcclBackendWithoutNcclOrGpuIsAnAmpError) {
  if (amp::detail::compat::kHasNccl && torch::cuda::is_available()) GTEST_SKIP() << "NCCL and a GPU are here";
  set_world_of_one_env();
  const std::string msg = error_of([] { amp::init_process_group(options(amp::Backend::kNccl)); });
  const std::string expect = amp::detail::compat::kHasNccl
                                 ? "amp: ProcessGroupOptions::backend is kNccl, but LibTorch sees no CUDA device; use "
                                   "Backend::kGloo"
                                 : "amp: ProcessGroupOptions::backend is kNccl, but this LibTorch build has no NCCL";
  EXPECT_EQ(msg.rfind(expect, 0), 0u) << msg;
}

// A CUDA model on a Gloo-only group: an amp: error naming the fix.
TEST(WorldOfOne, CudaModelOnGlooIsAnAmpError) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  set_world_of_one_env();
  amp::ProcessGroup pg = amp::init_process_group(options(amp::Backend::kGloo));
  torch::nn::Linear net(4, 4);
  net->to(torch::kCUDA);
  std::vector<torch::Tensor> params = net->parameters();
  const std::string msg = error_of([&] { amp::DataParallel dp(pg, params); });
  const std::string expect = amp::detail::compat::kHasNccl ? "ProcessGroupOptions::backend is kGloo (CPU tensors only)"
                                                           : "this LibTorch build has no NCCL";
  EXPECT_EQ(msg.rfind("amp: DataParallel's model (parameter #0) is on CUDA, but ", 0), 0u) << msg;
  EXPECT_NE(msg.find(expect), std::string::npos) << msg;
}

// The NCCL path: Trainer<Mixed<fp16, DynamicScaler>, CUDA> with DataParallel
// over NCCL on cuda:LOCAL_RANK, against the same Trainer alone.
TEST(WorldOfOne, CudaNcclMixedFp16EqualsPlainTrainerBitwise) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (!amp::detail::compat::kHasNccl) GTEST_SKIP() << "this LibTorch build has no NCCL (AMP_HAS_NCCL is 0)";
  set_world_of_one_env();
  amp::ProcessGroup pg = amp::init_process_group(options(amp::Backend::kNccl));
  ASSERT_EQ(pg.device(), torch::Device(torch::kCUDA, 0));
  using Policy = amp::Mixed<amp::fp16, amp::DynamicScaler>;
  constexpr int64_t kSteps = 12;
  const TrainRun with = train<Policy, amp::CUDA>(pg.device(), &pg, kSteps);
  const TrainRun without = train<Policy, amp::CUDA>(pg.device(), nullptr, kSteps);
  expect_bitwise_equal(with, without, kSteps);
  // fp16 with the initial scale 65536 skips its first steps, on both runs alike.
  std::cout << "skipped steps: " << std::count(with.skipped.begin(), with.skipped.end(), true) << " of " << kSteps
            << ", final scale " << with.scales.back() << ", final loss " << with.losses.back() << std::endl;
}

}  // namespace
