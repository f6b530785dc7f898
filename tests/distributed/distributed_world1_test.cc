// amp/distributed.h in a world of one process (RANK=0, WORLD_SIZE=1, a free
// port on 127.0.0.1): the all-reduce of one rank is its own gradient and
// DataParallel divides it by 1, which is exact, so a Trainer with
// DataParallel must end bit for bit where the same Trainer ends without it.
//
//   * CPU over Gloo: every LibTorch line (bf16 gradients on LibTorch 1.13
//     travel as fp32 copies: exact too).
//   * CUDA over NCCL, Trainer<Mixed<fp16, DynamicScaler>, CUDA>: skips without
//     a GPU or without NCCL in the build (AMP_DETAIL_HAS_NCCL, detail/compat_c10d.h);
//     runs through CMake on a CUDA machine with the pip wheel's LibTorch
//     (tools/gpu/check.sh). Not run so far: no GPU.
//   * Fabric (two models, two optimizers) with one DataParallel over
//     all its models' parameters: the same, bit for bit.
//   * The backend choice's amp: errors that a machine can reach.
//   * Checkpoints carry DataParallel's rebuilt bucket layout (Trainer and
//     Fabric); one without it brings back the first step's layout; one that
//     does not fit the model is an amp: error that changes nothing.
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
#include <sstream>
#include <string>
#include <vector>

#include "amp/detail/compat_c10d.h"
#include "amp/distributed.h"
#include "amp/optim/low_bit_adam.h"
#include "amp/train/fabric.h"
#include "amp/scaler/dynamic_scaler.h"
#include "amp/train/trainer.h"
#include "../tmp_path.h"

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
  amp::Fabric<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> fabric;
  fabric.setup(gen, opt_g);
  fabric.setup(disc, opt_d, amp::StepOptions().max_grad_norm(1.0));
  std::optional<amp::DataParallel> dp;
  if (pg != nullptr) {
    dp.emplace(*pg, fabric.parameters(), fabric.buffers(), amp::DataParallelOptions(), fabric.parameter_names());
    fabric.set_gradient_sync(&*dp);
  }
  for (int64_t i = 0; i < iterations; ++i) {
    torch::manual_seed(100 + static_cast<uint64_t>(i));
    const auto z = torch::randn({32, 8}), real = torch::randn({32, 4}) + 1;
    opt_d.zero_grad();
    fabric.backward(fabric.forward([&](auto&) {
      return torch::softplus(-disc->forward(real)).mean() +
             torch::softplus(disc->forward(gen->forward(z).detach())).mean();
    }));
    fabric.optimizer_step(opt_d);
    opt_g.zero_grad();
    fabric.backward(fabric.forward([&](auto&) { return torch::softplus(-disc->forward(gen->forward(z))).mean(); }));
    fabric.optimizer_step(opt_g);
    fabric.update();
  }
  if (dp) *allreduces = dp->allreduces();
  return fabric.parameters();
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

// --- the rebuilt bucket layout in checkpoints ---

using Layout = std::vector<std::vector<size_t>>;

// 16 -> 32 -> 4 under True<fp32> + SGD, with DataParallel over pg.
struct LayoutRig {
  explicit LayoutRig(const amp::ProcessGroup& pg, bool freeze_last_bias = false)
      : net(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4)),
        opt(net->parameters(), torch::optim::SGDOptions(0.05)),
        trainer(net, opt, amp::TrainerOptions().progress(false)) {
    if (freeze_last_bias) net->parameters().back().set_requires_grad(false);
    dp.emplace(pg, trainer);
  }
  void steps(int64_t n) {
    for (int64_t s = 0; s < n; ++s) {
      torch::manual_seed(100 + static_cast<uint64_t>(s));
      const torch::Tensor x = torch::randn({8, 16});
      trainer.step([&](auto&) { return (net->forward(x) - x.narrow(1, 0, 4)).pow(2).mean(); });
    }
  }
  std::string state() const {
    std::ostringstream out;
    trainer.save_state(out);
    return out.str();
  }
  void load(const std::string& state) {
    std::istringstream in(state);
    trainer.load_state(in);
  }
  torch::nn::Sequential net;
  torch::optim::SGD opt;
  amp::Trainer<amp::True<amp::fp32>, amp::CPU> trainer;
  std::optional<amp::DataParallel> dp;
};

const Layout kFirst{{0, 1, 2, 3}};  // DDP's first step: one bucket in parameter order

TEST(WorldOfOne, CheckpointCarriesTheRebuiltLayout) {
  set_world_of_one_env();
  amp::ProcessGroup pg = amp::init_process_group(options(amp::Backend::kAuto));
  LayoutRig a(pg);
  EXPECT_EQ(a.dp->bucket_layout(), kFirst);
  const std::string before_rebuild = a.state();  // no layout entries
  a.steps(2);
  const Layout rebuilt = a.dp->bucket_layout();
  ASSERT_NE(rebuilt, kFirst) << "the rebuilt layout is the first one: the test tells nothing";
  const std::string saved = a.state();

  LayoutRig b(pg);  // a fresh process: the first step's layout
  b.load(saved);
  EXPECT_EQ(b.dp->bucket_layout(), rebuilt);
  b.steps(1);
  EXPECT_EQ(b.dp->bucket_layout(), rebuilt);
  EXPECT_EQ(b.dp->allreduces(), 1);

  // Without the entries (before the first step; a checkpoint from before amp
  // wrote them reads the same): the first step's layout, rebuilt after the next step.
  b.load(before_rebuild);
  EXPECT_EQ(b.dp->bucket_layout(), kFirst);
  b.steps(1);
  EXPECT_EQ(b.dp->bucket_layout(), rebuilt);

  // Fabric's checkpoints carry it too.
  auto fabric_rig = [&](amp::Fabric<amp::True<amp::fp32>, amp::CPU>& fabric, torch::nn::Sequential net,
                        torch::optim::SGD& opt) {
    fabric.setup(net, opt);
    auto dp = std::make_unique<amp::DataParallel>(pg, fabric.parameters(), fabric.buffers(), amp::DataParallelOptions(),
                                                  fabric.parameter_names());
    fabric.set_gradient_sync(dp.get());
    return dp;
  };
  torch::nn::Sequential net_c(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  torch::optim::SGD opt_c(net_c->parameters(), torch::optim::SGDOptions(0.05));
  amp::Fabric<amp::True<amp::fp32>, amp::CPU> c;
  auto dp_c = fabric_rig(c, net_c, opt_c);
  const torch::Tensor x = torch::randn({8, 16});
  c.backward(c.forward([&](auto&) { return net_c->forward(x).pow(2).mean(); }));
  c.optimizer_step(opt_c);
  c.update();
  ASSERT_EQ(dp_c->bucket_layout(), rebuilt);
  const std::string path = amp_test::tmp_path("fabric_layout.pt");
  c.save(path);
  torch::nn::Sequential net_d(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  torch::optim::SGD opt_d(net_d->parameters(), torch::optim::SGDOptions(0.05));
  amp::Fabric<amp::True<amp::fp32>, amp::CPU> d;
  auto dp_d = fabric_rig(d, net_d, opt_d);
  EXPECT_EQ(dp_d->bucket_layout(), kFirst);
  d.load(path);
  EXPECT_EQ(dp_d->bucket_layout(), rebuilt);
}

// A layout of another model: an amp: error, and the trainer (parameters,
// counters, layout) as it was.
TEST(WorldOfOne, CheckpointLayoutOfAnotherModelIsAnAmpErrorThatChangesNothing) {
  set_world_of_one_env();
  amp::ProcessGroup pg = amp::init_process_group(options(amp::Backend::kAuto));
  LayoutRig frozen(pg, /*freeze_last_bias=*/true);  // its layout leaves '2.bias' out
  frozen.steps(2);
  const std::string other = frozen.state();
  LayoutRig rig(pg);
  rig.steps(3);
  const Layout layout = rig.dp->bucket_layout();
  std::vector<torch::Tensor> params;
  for (const auto& p : rig.net->parameters()) params.push_back(p.detach().clone());
  const std::string msg = error_of([&] { rig.load(other); });
  EXPECT_EQ(msg.rfind("amp: the state does not fit this model/optimizer (left unchanged): amp: the checkpoint's "
                      "DataParallel bucket layout ('amp/data_parallel/bucket_params') does not fit this model: "
                      "parameter '2.bias' is in no bucket; it was written for another model",
                      0),
            0u)
      << msg;
  EXPECT_EQ(rig.trainer.steps(), 3);
  EXPECT_EQ(rig.dp->bucket_layout(), layout);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], rig.net->parameters()[i]));
}

// read_state's checks, entry by entry: an amp: error before anything changes.
TEST(WorldOfOne, DamagedCheckpointLayoutIsAnAmpError) {
  set_world_of_one_env();
  amp::ProcessGroup pg = amp::init_process_group(options(amp::Backend::kAuto));
  // Parameters 0 and 1 fp32, 2 bf16, 3 frozen.
  std::vector<torch::Tensor> params{
      torch::zeros({3}, torch::requires_grad()), torch::zeros({2}, torch::requires_grad()),
      torch::zeros({2}, torch::dtype(torch::kBFloat16).requires_grad(true)), torch::zeros({2})};
  amp::DataParallel dp(pg, params);
  const Layout first = dp.bucket_layout();
  auto read = [&](const torch::Tensor& sizes, const torch::Tensor& indices) {
    torch::serialize::OutputArchive out;
    if (sizes.defined()) out.write("amp/data_parallel/bucket_sizes", sizes, /*is_buffer=*/true);
    if (indices.defined()) out.write("amp/data_parallel/bucket_params", indices, /*is_buffer=*/true);
    std::stringstream bytes;
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    return error_of([&] { dp.read_state(in)(); });
  };
  auto longs = [](std::vector<int64_t> v) { return torch::tensor(v, torch::kLong); };
  const std::string fit =
      "amp: the checkpoint's DataParallel bucket layout ('amp/data_parallel/bucket_params') "
      "does not fit this model: ";
  const std::string other = "; it was written for another model";
  EXPECT_EQ(read(longs({2, 1}), longs({1, 0, 2})), "");  // fits: installed
  EXPECT_EQ(dp.bucket_layout(), (Layout{{1, 0}, {2}}));
  EXPECT_EQ(read(longs({2}), torch::Tensor())
                .rfind("amp: the checkpoint has only one of DataParallel's bucket "
                       "layout entries",
                       0),
            0u);
  EXPECT_NE(read(longs({2}), torch::tensor({1.0f, 0.0f})).find("not lists of Long; a damaged checkpoint"),
            std::string::npos);
  EXPECT_NE(read(longs({2, 0, 1}), longs({0, 1, 2})).find("gives bucket 1 0 parameters"), std::string::npos);
  EXPECT_NE(read(longs({2, 2}), longs({0, 1, 2})).find("adds up to 4 parameters but"), std::string::npos);
  EXPECT_NE(read(longs({2, 1}), longs({0, -1, 2})).find("holds the index -1"), std::string::npos);
  EXPECT_EQ(read(longs({2, 1}), longs({0, 7, 2})), fit + "it names parameter #7, but there are 4" + other);
  EXPECT_EQ(read(longs({2, 1}), longs({0, 0, 2})), fit + "it holds parameter #0 twice" + other);
  EXPECT_EQ(read(longs({2, 1, 1}), longs({0, 1, 2, 3})),
            fit + "it holds parameter #3, which does not require grad here" + other);
  EXPECT_EQ(
      read(longs({1, 2}), longs({0, 1, 2})),
      fit + "bucket 1 holds #1 (Float on cpu) and #2 (BFloat16 on cpu), but a bucket has one dtype and device" + other);
  EXPECT_EQ(read(longs({2}), longs({0, 1})), fit + "parameter #2 is in no bucket" + other);
  EXPECT_EQ(dp.bucket_layout(), (Layout{{1, 0}, {2}}));  // none of them changed it
  EXPECT_NE(first, dp.bucket_layout());
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
  if (!amp::detail::compat::kHasNccl) GTEST_SKIP() << "this LibTorch build has no NCCL (AMP_DETAIL_HAS_NCCL is 0)";
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
