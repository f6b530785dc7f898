// Trainer<Policy, Device>: typed tests over every CPU-supported policy,
// checkpoints (round trip, bitwise resume, refusals, crash safety), errors.
// The loss-scaling path is covered in stepper_test.cc (Stepper<DynamicScaler>
// on fp32 gradients), since LibTorch < 2.3 has no fp16 autocast on CPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>

#include "amp/amp.h"
#include "amp/testing.h"
#include "../error_of.h"
#include "../tmp_path.h"

extern char** environ;

namespace trainer_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

namespace fs = std::filesystem;

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// A fixed synthetic classification task: labels from a random linear teacher.
struct Data {
  torch::Tensor x, y;
  explicit Data(int64_t n = 256, uint64_t seed = 7) {
    torch::manual_seed(seed);
    x = torch::randn({n, 16});
    auto teacher = torch::randn({16, 4});
    y = x.matmul(teacher).argmax(1);
  }
};

template <class Region>
torch::Tensor loss_of(Region& region, Net& net, const torch::Tensor& x, const torch::Tensor& y) {
  auto out = net.forward(x.to(Region::param_dtype));
  (void)region;
  return torch::cross_entropy_loss(out, y);
}

using ::amp_test::tmp_path;

bool same_parameters(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  if (pa.size() != pb.size()) return false;
  for (size_t i = 0; i < pa.size(); ++i)
    if (!torch::equal(pa[i], pb[i])) return false;
  return true;
}

template <class P>
class TrainerPolicies : public ::testing::Test {};
TYPED_TEST_SUITE(TrainerPolicies, amp::testing::PolicyTypes<decltype(amp::supported_policies<amp::CPU>)>,
                 amp::testing::PolicyNames);

TYPED_TEST(TrainerPolicies, LossFallsAndParametersHaveThePolicysDtype) {
  using P = TypeParam;
  using T = amp::Trainer<P, amp::CPU>;
  Data data;
  torch::manual_seed(1);
  auto net = std::make_shared<Net>();
  // In fp16 Adam's default eps (1e-8) is 0: 16-true needs a representable one
  // (the Trainer rejects 1e-8 there; see Fp16TrueRejectsAdamEpsThatRoundsToZero).
  constexpr bool fp16_params = std::is_same_v<typename amp::policy_traits<P>::param_type, amp::fp16>;
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2).eps(fp16_params ? 1e-4 : 1e-8));
  T trainer(net, opt, amp::TrainerOptions().progress(false));
  for (const auto& p : net->parameters())
    EXPECT_EQ(p.scalar_type(), amp::scalar_type_v<typename amp::policy_traits<P>::param_type>);
  double first = 0, last = 0;
  for (int i = 0; i < 60; ++i) {
    auto r = trainer.step([&](typename T::region_type& region) { return loss_of(region, *net, data.x, data.y); });
    ASSERT_TRUE(r.optimizer_step);
    EXPECT_FALSE(r.skipped());
    if (i == 0) first = r.loss_value();
    last = r.loss_value();
  }
  EXPECT_LT(last, 0.5 * first) << amp::policy_traits<P>::name;
  EXPECT_EQ(trainer.steps(), 60);
  for (const auto& p : net->parameters()) {
    EXPECT_EQ(p.scalar_type(), amp::scalar_type_v<typename amp::policy_traits<P>::param_type>);
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().scalar_type(), p.scalar_type());  // gradients in the parameters' dtype
  }
}

// A user-defined scaler (with a name) trains, saves and loads; the
// checkpoint carries its policy's derived name.
struct PlainScaler : amp::NoScaler {
  static constexpr const char* kName = "plain";
};

TEST(Trainer, CustomScalerSavesAndLoads) {
  using P = amp::Mixed<amp::bf16, PlainScaler>;
  Data data;
  torch::manual_seed(5);
  auto net = std::make_shared<Net>();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Trainer<P, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
  using T = amp::Trainer<P, amp::CPU>;
  EXPECT_STREQ(T::precision_name, "bf16-mixed-plain");
  for (int i = 0; i < 3; ++i) trainer.step([&](auto& r) { return loss_of(r, *net, data.x, data.y); });
  const std::string path = tmp_path("custom_scaler.pt");
  trainer.save(path);
  auto net2 = std::make_shared<Net>();
  torch::optim::Adam opt2(net2->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Trainer<P, amp::CPU> resumed(net2, opt2, amp::TrainerOptions().progress(false));
  resumed.load(path);
  EXPECT_TRUE(same_parameters(*net, *net2));
  EXPECT_EQ(resumed.steps(), 3);
}

// A template, so that the discarded branch is not instantiated on LibTorch < 2.3.
template <class P>
void expect_fp16_eps_rejected() {
  if constexpr (amp::is_supported_v<P, amp::CPU>) {
    // Measured on LibTorch 2.6: with eps=1e-8 the 16-true loss was NaN after
    // a few steps (eps is 0 in fp16; a zero gradient element gives 0/0).
    auto net = std::make_shared<Net>();
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
    try {
      amp::Trainer<P, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
      FAIL() << "expected an amp: error about eps";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr("amp: 16-true keeps Adam's state in fp16"));
      EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr(".eps(1e-4)"));
    }
  } else {
    GTEST_SKIP() << "True<fp16> on CPU needs LibTorch 2.3";
  }
}

TEST(Trainer, Fp16TrueRejectsAdamEpsThatRoundsToZero) { expect_fp16_eps_rejected<amp::True<amp::fp16>>(); }

template <class P>
double final_loss(int steps) {
  using T = amp::Trainer<P, amp::CPU>;
  Data data;
  torch::manual_seed(3);
  auto net = std::make_shared<Net>();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  T trainer(net, opt, amp::TrainerOptions().progress(false));
  double last = 0;
  for (int i = 0; i < steps; ++i)
    last = trainer.step([&](typename T::region_type& r) { return loss_of(r, *net, data.x, data.y); }).loss_value();
  return last;
}

TEST(Trainer, Bf16MixedFinalLossWithin5PercentOfFp32) {
  const double fp32 = final_loss<amp::True<amp::fp32>>(80);
  const double bf16 = final_loss<amp::Mixed<amp::bf16, amp::NoScaler>>(80);
  EXPECT_LT(fp32, 0.3);  // it learned
  EXPECT_NEAR(bf16, fp32, 0.05 * fp32 + 1e-3) << "fp32 " << fp32 << " bf16-mixed " << bf16;
}

TEST(Trainer, MixedRegionRunsLinearInBf16AndKeepsWeightsFp32) {
  using T = amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>;
  Data data;
  auto net = std::make_shared<Net>();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  T trainer(net, opt, amp::TrainerOptions().progress(false));
  c10::ScalarType hidden = c10::ScalarType::Undefined, loss_dtype = c10::ScalarType::Undefined;
  trainer.step([&](T::region_type&) {
    auto h = net->fc1(data.x);
    hidden = h.scalar_type();
    auto loss = torch::cross_entropy_loss(net->fc2(torch::relu(h)), data.y);
    loss_dtype = loss.scalar_type();
    return loss;
  });
  EXPECT_EQ(hidden, torch::kBFloat16);
  EXPECT_EQ(loss_dtype, torch::kFloat);
  for (const auto& p : net->parameters()) {
    EXPECT_EQ(p.scalar_type(), torch::kFloat);
    EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
  }
  // Outside the step autocast is off again.
  EXPECT_EQ(net->fc1(data.x).scalar_type(), torch::kFloat);
}

// TrainerOptions::region is honoured by every region the Trainer makes.
TEST(Trainer, RegionOptionsReachStepAndEvaluate) {
  using T = amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>;
  Data data;
  auto net = std::make_shared<Net>();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  for (const amp::LinearRouting mode : {amp::LinearRouting::kOn, amp::LinearRouting::kOff}) {
    T trainer(net, opt, amp::TrainerOptions().progress(false).region(amp::RegionOptions().linear_routing(mode)));
    amp::LinearRouting in_step = amp::LinearRouting::kOff, in_eval = amp::LinearRouting::kOff;
    trainer.step([&](auto&) {
      in_step = amp::detail::current_linear_routing();
      return torch::cross_entropy_loss(net->forward(data.x), data.y);
    });
    trainer.evaluate([&](auto&) {
      in_eval = amp::detail::current_linear_routing();
      return 0;
    });
    EXPECT_EQ(in_step, mode);
    EXPECT_EQ(in_eval, mode);
  }
}

TEST(Trainer, AccumulationMatchesOneLargeBatch) {
  Data data(64);
  auto run = [&](int64_t micro) {
    torch::manual_seed(5);
    auto net = std::make_shared<Net>();
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.5));
    amp::Trainer<amp::True<amp::fp64>, amp::CPU> trainer(
        net, opt, amp::TrainerOptions().step(amp::StepOptions().accumulation_steps(micro)).progress(false));
    const int64_t b = 64 / micro;
    for (int step = 0; step < 3; ++step)
      for (int64_t m = 0; m < micro; ++m) {
        auto r = trainer.step([&](auto& region) {
          return loss_of(region, *net, data.x.narrow(0, m * b, b), data.y.narrow(0, m * b, b));
        });
        EXPECT_EQ(r.optimizer_step, m == micro - 1);
      }
    EXPECT_EQ(trainer.steps(), 3);
    return net;
  };
  auto one = run(1), four = run(4);
  auto p1 = one->parameters(), p4 = four->parameters();
  for (size_t i = 0; i < p1.size(); ++i) EXPECT_TRUE(torch::allclose(p1[i], p4[i], 1e-12, 1e-12)) << i;
}

TEST(Trainer, ClipsToMaxGradNorm) {
  Data data(32);
  torch::manual_seed(2);
  auto net = std::make_shared<Net>();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.0));
  amp::Trainer<amp::True<amp::fp32>, amp::CPU> trainer(
      net, opt, amp::TrainerOptions().step(amp::StepOptions().max_grad_norm(1e-3)).progress(false));
  trainer.step([&](auto& region) { return loss_of(region, *net, data.x, data.y); });
  double sq = 0;
  for (const auto& p : net->parameters()) sq += p.grad().pow(2).sum().item<double>();
  EXPECT_NEAR(std::sqrt(sq), 1e-3, 1e-5);
}

// --- checkpoints ------------------------------------------------------------

template <class P>
struct TrainRun {
  using T = amp::Trainer<P, amp::CPU>;
  std::shared_ptr<Net> net;
  std::unique_ptr<torch::optim::Adam> opt;
  std::unique_ptr<T> trainer;
  Data data{128};
  explicit TrainRun(uint64_t seed = 11) {
    torch::manual_seed(seed);
    net = std::make_shared<Net>();
    opt = std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-2));
    trainer = std::make_unique<T>(net, *opt, amp::TrainerOptions().progress(false));
  }
  void train(int steps) {
    for (int i = 0; i < steps; ++i)
      trainer->step([&](auto& region) {
        const int64_t k = trainer->steps() % 4;
        return loss_of(region, *net, data.x.narrow(0, k * 32, 32), data.y.narrow(0, k * 32, 32));
      });
  }
};

template <class P>
class CheckpointPolicies : public ::testing::Test {};
using CheckpointTypes =
    ::testing::Types<amp::True<amp::fp32>, amp::Mixed<amp::bf16, amp::NoScaler>, amp::True<amp::fp64>>;
TYPED_TEST_SUITE(CheckpointPolicies, CheckpointTypes, amp::testing::PolicyNames);

TYPED_TEST(CheckpointPolicies, ResumeIsBitwiseIdentical) {
  const std::string path = tmp_path(std::string("resume_") + amp::policy_traits<TypeParam>::name + ".pt");
  TrainRun<TypeParam> straight;
  straight.train(20);

  TrainRun<TypeParam> first;
  first.train(10);
  first.trainer->save(path);
  TrainRun<TypeParam> resumed(/*seed=*/999);  // different initial weights, overwritten by load
  resumed.trainer->load(path);
  EXPECT_EQ(resumed.trainer->steps(), 10);
  resumed.train(10);
  EXPECT_TRUE(same_parameters(*straight.net, *resumed.net));
  EXPECT_EQ(resumed.trainer->steps(), 20);
}

TEST(Checkpoint, RefusesAnotherPolicysCheckpointAndLeavesTheTrainerUnchanged) {
  const std::string path = tmp_path("fp32.pt");
  TrainRun<amp::True<amp::fp32>> fp32;
  fp32.train(3);
  fp32.trainer->save(path);
  TrainRun<amp::Mixed<amp::bf16, amp::NoScaler>> bf16(21);
  bf16.train(2);
  TrainRun<amp::Mixed<amp::bf16, amp::NoScaler>> reference(21);
  reference.train(2);
  try {
    bf16.trainer->load(path);
    FAIL() << "loaded a 32-true checkpoint into a bf16-mixed trainer";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("amp: checkpoint"), std::string::npos) << msg;
    EXPECT_NE(msg.find("\"32-true\""), std::string::npos) << msg;
    EXPECT_NE(msg.find("\"bf16-mixed\""), std::string::npos) << msg;
  }
  EXPECT_TRUE(same_parameters(*bf16.net, *reference.net));
  EXPECT_EQ(bf16.trainer->steps(), 2);
}

TEST(Checkpoint, TruncatedOrCorruptFileIsRefusedAndNothingChanges) {
  const std::string good = tmp_path("good.pt"), bad = tmp_path("truncated.pt"), junk = tmp_path("junk.pt");
  TrainRun<amp::True<amp::fp32>> a;
  a.train(4);
  a.trainer->save(good);
  const auto size = fs::file_size(good);
  fs::copy_file(good, bad, fs::copy_options::overwrite_existing);
  fs::resize_file(bad, size / 2);
  std::ofstream(junk) << "not a checkpoint";

  TrainRun<amp::True<amp::fp32>> b(5), reference(5);
  b.train(1);
  reference.train(1);
  for (const auto& path : {bad, junk, tmp_path("missing.pt")}) {
    SCOPED_TRACE(path);
    try {
      b.trainer->load(path);
      FAIL() << "loaded " << path;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("amp: could not read checkpoint"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(same_parameters(*b.net, *reference.net));
    EXPECT_EQ(b.trainer->steps(), 1);
  }
  // The trainer still trains exactly like an untouched one.
  b.train(2);
  reference.train(2);
  EXPECT_TRUE(same_parameters(*b.net, *reference.net));
}

TEST(Checkpoint, ACheckpointOfAnotherModelShapeRollsBack) {
  const std::string path = tmp_path("other_shape.pt");
  {
    torch::manual_seed(0);
    auto lin = torch::nn::Linear(16, 4);
    torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
    amp::Trainer<amp::True<amp::fp32>, amp::CPU> t(lin, opt, amp::TrainerOptions().progress(false));
    t.save(path);
  }
  TrainRun<amp::True<amp::fp32>> b(6), reference(6);
  EXPECT_THAT(amp_test::error_of([&] { b.trainer->load(path); }),
              ::testing::HasSubstr("' does not fit this model/optimizer (left unchanged): "));
  EXPECT_TRUE(same_parameters(*b.net, *reference.net));
  b.train(2);
  reference.train(2);
  EXPECT_TRUE(same_parameters(*b.net, *reference.net));
}

// A checkpoint saved before any step has no optimizer state; loading it into
// a trainer that has stepped must drop the state it has (LibTorch's own
// optimizer.load() keeps entries the archive lacks), so that training goes on
// exactly as from the checkpoint.
TEST(Checkpoint, LoadDropsOptimizerStateTheCheckpointLacks) {
  const std::string path = tmp_path("no_state_yet.pt");
  TrainRun<amp::True<amp::fp32>> fresh, stepped, reference;
  fresh.trainer->save(path);
  stepped.train(3);
  ASSERT_FALSE(stepped.opt->state().empty());
  stepped.trainer->load(path);
  EXPECT_TRUE(stepped.opt->state().empty());
  stepped.train(3);
  reference.train(3);
  EXPECT_TRUE(same_parameters(*stepped.net, *reference.net));
}

// KillDuringSaveLeavesALoadableFile's child (this binary started again with
// AMP_TEST_SAVE_FOREVER set, seen before any test runs): saves forever,
// writing one byte to the pipe AMP_TEST_SAVE_PROGRESS_FD after each save.
const bool kSaveForeverChild = [] {
  const char* path = std::getenv("AMP_TEST_SAVE_FOREVER");
  const char* fd = std::getenv("AMP_TEST_SAVE_PROGRESS_FD");
  if (!path || !fd) return false;
  const int progress = std::atoi(fd);
  TrainRun<amp::True<amp::fp32>> a;
  for (;;) {
    a.train(1);
    a.trainer->save(path);
    const char saved = 's';
    if (write(progress, &saved, 1) != 1) std::exit(0);
  }
}();

// The child is killed after it reported 2 + trial finished saves, plus a
// delay that varies by trial so that some kills land inside a save. It waits
// on the child's progress, not on a clock: a busy machine only makes it slower.
TEST(Checkpoint, KillDuringSaveLeavesALoadableFile) {
  const std::string path = tmp_path("killed.pt");
  {
    TrainRun<amp::True<amp::fp32>> a;
    a.train(1);
    a.trainer->save(path);
  }
  std::string self = fs::read_symlink("/proc/self/exe").string();
  for (int trial = 0; trial < 6; ++trial) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    std::string env_path = "AMP_TEST_SAVE_FOREVER=" + path;
    std::string env_fd = "AMP_TEST_SAVE_PROGRESS_FD=" + std::to_string(fds[1]);
    std::vector<char*> envp;
    for (char** e = environ; *e; ++e) envp.push_back(*e);
    envp.push_back(env_path.data());
    envp.push_back(env_fd.data());
    envp.push_back(nullptr);
    char* argv[] = {self.data(), nullptr};
    pid_t pid;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    const int spawned = posix_spawn(&pid, self.c_str(), &actions, nullptr, argv, envp.data());
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    ASSERT_EQ(spawned, 0);
    int saves = 0;
    char byte;
    while (saves < 2 + trial && read(fds[0], &byte, 1) == 1) ++saves;
    std::this_thread::sleep_for(std::chrono::milliseconds(37 * trial));
    kill(pid, SIGKILL);
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_EQ(saves, 2 + trial) << "the child ended before it saved " << 2 + trial << " times";
    ASSERT_TRUE(WIFSIGNALED(status));
    TrainRun<amp::True<amp::fp32>> b(8);
    EXPECT_NO_THROW(b.trainer->load(path)) << "trial " << trial;
    // Whatever the kill hit, the file holds at least the child's second save (2 steps).
    EXPECT_GE(b.trainer->steps(), 2) << "trial " << trial;
  }
}

TEST(Checkpoint, SaveMidAccumulationIsRefused) {
  Data data(32);
  auto net = std::make_shared<Net>();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  amp::Trainer<amp::True<amp::fp32>, amp::CPU> t(
      net, opt, amp::TrainerOptions().step(amp::StepOptions().accumulation_steps(2)).progress(false));
  t.step([&](auto& r) { return loss_of(r, *net, data.x, data.y); });
  EXPECT_THAT(
      amp_test::error_of([&] { t.save(tmp_path("mid.pt")); }),
      ::testing::StartsWith("amp: save() was called in the middle of gradient accumulation (micro-batch 1 of 2)"));
}

// --- fit ------------------------------------------------------------------

struct Pairs : torch::data::datasets::Dataset<Pairs> {
  Pairs(torch::Tensor x, torch::Tensor y) : x_(std::move(x)), y_(std::move(y)) {}
  torch::data::Example<> get(size_t i) override { return {x_[i], y_[i]}; }
  c10::optional<size_t> size() const override { return x_.size(0); }
  torch::Tensor x_, y_;
};

TEST(Fit, TrainsOverALoaderRecordsHistoryAndResumesMidEpochBitwise) {
  Data data(256);
  auto dataset = Pairs(data.x, data.y).map(torch::data::transforms::Stack<>());
  auto make = [&](uint64_t seed) {
    torch::manual_seed(seed);
    return std::make_shared<Net>();
  };
  using T = amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>;
  auto fn = [](std::shared_ptr<Net> net) {
    return [net](T::region_type&, auto& batch) {
      return torch::cross_entropy_loss(net->forward(batch.data), batch.target);
    };
  };
  auto loader_options = torch::data::DataLoaderOptions().batch_size(32);

  auto net_a = make(4);
  torch::optim::Adam opt_a(net_a->parameters(), torch::optim::AdamOptions(1e-2));
  T a(net_a, opt_a, amp::TrainerOptions().progress(false));
  auto loader_a = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(dataset, loader_options);
  amp::History h = a.fit(loader_a, fn(net_a), amp::FitOptions().max_epochs(3));
  ASSERT_EQ(h.steps.size(), 24u);
  EXPECT_EQ(a.epoch(), 3);
  EXPECT_LT(h.steps.back().loss, h.steps.front().loss);
  EXPECT_EQ(h.skipped(), 0);
  EXPECT_EQ(h.steps[9].epoch, 1);

  // Epochs count in total (Lightning's max_epochs): a fit() with none left says so.
  ::testing::internal::CaptureStderr();
  amp::History none = a.fit(loader_a, fn(net_a), amp::FitOptions().max_epochs(3));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(none.steps.empty());
  EXPECT_NE(err.find("amp: fit() has nothing to do: the trainer has done 3 epoch(s) and 24 step(s)"), std::string::npos)
      << err;

  // Stop after 13 steps (mid-epoch 2) with a checkpoint, resume in a new trainer.
  const std::string path = tmp_path("fit.pt");
  auto net_b = make(4);
  torch::optim::Adam opt_b(net_b->parameters(), torch::optim::AdamOptions(1e-2));
  T b(net_b, opt_b, amp::TrainerOptions().progress(false));
  auto loader_b = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(dataset, loader_options);
  b.fit(loader_b, fn(net_b), amp::FitOptions().max_epochs(3).max_steps(13).checkpoint_every(13).checkpoint_path(path));
  ASSERT_TRUE(fs::exists(path));
  auto net_c = make(77);
  torch::optim::Adam opt_c(net_c->parameters(), torch::optim::AdamOptions(1e-2));
  T c(net_c, opt_c, amp::TrainerOptions().progress(false));
  c.load(path);
  EXPECT_EQ(c.steps(), 13);
  EXPECT_EQ(c.epoch(), 1);
  amp::History rest = c.fit(loader_b, fn(net_c), amp::FitOptions().max_epochs(3));
  EXPECT_EQ(rest.steps.size(), 11u);
  EXPECT_TRUE(same_parameters(*net_a, *net_c));
}

// --- errors ---------------------------------------------------------------

TEST(TrainerModel, SharesAModuleReferenceThatLivesInASharedPtr) {
  auto lin = std::make_shared<torch::nn::LinearImpl>(4, 4);
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> t(*lin, opt);
  EXPECT_EQ(&t.module(), lin.get());
  EXPECT_EQ(t.module_ptr(), lin);  // shares ownership with the caller
}

// pytorch/examples' C++ MNIST: `Net model;` on the stack, held without ownership.
struct MnistNet : torch::nn::Module {
  MnistNet() : conv1(torch::nn::Conv2dOptions(1, 4, 5)), fc1(64, 16), fc2(16, 10) {
    register_module("conv1", conv1);
    register_module("conv2_drop", conv2_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv2_drop(conv1->forward(x)), 2));  // [N, 4, 4, 4]
    x = torch::relu(fc1->forward(x.view({-1, 64})));
    x = torch::dropout(x, 0.5, is_training());
    return torch::log_softmax(fc2->forward(x), 1);
  }
  torch::nn::Conv2d conv1;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1, fc2;
};

TEST(TrainerModel, TrainsAStackModelHeldWithoutOwnership) {
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({8, 1, 12, 12}), y = torch::randint(10, {8});
  auto nll = [&](MnistNet& m) { return torch::nll_loss(m.forward(x).to(torch::kFloat32), y); };
  using P = amp::Mixed<amp::bf16, amp::NoScaler>;
  MnistNet model;
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
  amp::Trainer<P, amp::CPU> t(model, opt, amp::TrainerOptions().progress(false));
  EXPECT_EQ(&t.module(), &model);
  EXPECT_EQ(t.module_ptr().use_count(), 0);  // not owned: `model` outlives `t`
  const torch::Tensor before = model.fc2->weight.detach().clone();
  for (int i = 0; i < 3; ++i) t.step([&](auto&) { return nll(model); });
  EXPECT_FALSE(torch::equal(before, model.fc2->weight));
  EXPECT_TRUE(model.is_training());
  t.evaluate([&](auto&) {
    EXPECT_FALSE(model.is_training());
    EXPECT_FALSE(model.conv2_drop->is_training());
    return 0;
  });
  EXPECT_TRUE(model.is_training() && model.conv2_drop->is_training());  // modes back
  const std::string path = tmp_path("stack_model.pt");
  t.save(path);
  MnistNet other;
  torch::optim::SGD opt2(other.parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
  amp::Trainer<P, amp::CPU> u(other, opt2, amp::TrainerOptions().progress(false));
  u.load(path);
  EXPECT_TRUE(same_parameters(model, other));

  // Fabric (several models) takes it the same way.
  MnistNet second;
  torch::optim::SGD opt3(second.parameters(), torch::optim::SGDOptions(0.01));
  amp::Fabric<P, amp::CPU> fabric;
  fabric.setup(second, opt3);
  const torch::Tensor w = second.fc1->weight.detach().clone();
  opt3.zero_grad();
  fabric.backward(fabric.forward([&](auto&) { return nll(second); }));
  fabric.optimizer_step(opt3);
  fabric.update();
  EXPECT_FALSE(torch::equal(w, second.fc1->weight));
}

// A loop of step() calls gets fit()'s progress line, every progress_every steps.
TEST(Trainer, StepLoopPrintsProgressEveryNSteps) {
  Data data(32);
  auto net = std::make_shared<Net>();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  ::testing::internal::CaptureStderr();
  {
    amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> t(net, opt, amp::TrainerOptions().progress_every(2));
    for (int i = 0; i < 5; ++i) t.step([&](auto& r) { return loss_of(r, *net, data.x, data.y); });
  }
  const std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(out, ::testing::HasSubstr("bf16-mixed: optimizer path: "));
  EXPECT_THAT(out, ::testing::ContainsRegex("bf16-mixed 2 loss [0-9.]+ scale 1 skipped 0"));
  EXPECT_THAT(out, ::testing::ContainsRegex("bf16-mixed 4 loss [0-9.]+ scale 1 skipped 0"));
  EXPECT_THAT(out, ::testing::Not(::testing::HasSubstr("bf16-mixed 5 loss")));  // only whole groups of 2

  ::testing::internal::CaptureStderr();
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> quiet(net, opt, amp::TrainerOptions().progress(false));
  for (int i = 0; i < 3; ++i) quiet.step([&](auto& r) { return loss_of(r, *net, data.x, data.y); });
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

// --- fp16 pitfalls (issue 38): a warning on CPU, and masked_fill(-1e9) explained ---

template <class P>
void expect_fp16_pitfalls_explained(const std::string& name) {
  torch::manual_seed(0);
  auto lin = torch::nn::Linear(8, 8);
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
  ::testing::internal::CaptureStderr();
  amp::Trainer<P, amp::CPU> t(lin, opt, amp::TrainerOptions().progress(false));
  const std::string warned = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(warned, ::testing::HasSubstr("amp: Trainer<" + name +
                                           ", amp::CPU>: most CPUs have no fp16 arithmetic, so LibTorch emulates it"));
  EXPECT_THAT(warned, ::testing::HasSubstr("amp::Mixed<amp::bf16, amp::NoScaler> (\"bf16-mixed\")"));
  const torch::Tensor x = torch::randn({4, 8}).to(lin->weight.scalar_type());
  const torch::Tensor mask = torch::ones({4, 8}, torch::kBool).triu(1);
  auto masked = [&](double fill) {
    return [&, fill](auto&) { return torch::softmax(lin(x).masked_fill(mask, fill), 1).to(torch::kFloat32).sum(); };
  };
  const std::string msg = amp_test::error_of([&] { t.step(masked(-1e9)); });
  EXPECT_THAT(msg,
              ::testing::HasSubstr("amp: a scalar does not fit fp16 (largest finite value 65504) inside the "
                                   "forward of a " +
                                   name + " region; a common cause is attention's `scores.masked_fill(mask, -1e9)`"));
  EXPECT_THAT(msg, ::testing::HasSubstr("-std::numeric_limits<float>::infinity()"));
  EXPECT_THAT(msg, ::testing::HasSubstr("LibTorch says: value cannot be converted to type "));  // at::Half or c10::Half
  EXPECT_THAT(msg, ::testing::HasSubstr("Half without overflow"));
  // evaluate() explains it the same way (a first forward is often an evaluation).
  const std::string eval_msg = amp_test::error_of([&] { t.evaluate(masked(-1e9)); });
  EXPECT_THAT(eval_msg, ::testing::HasSubstr("amp: a scalar does not fit fp16 (largest finite value 65504) inside "
                                             "the forward of a " +
                                             name + " region"));
  EXPECT_THAT(eval_msg, ::testing::HasSubstr("Half without overflow"));
  // The fix the message names trains.
  EXPECT_TRUE(std::isfinite(t.step(masked(-std::numeric_limits<float>::infinity())).loss_value()));
}

// Trainers of fp16 policies on CPU exist from LibTorch 2.3 (before it, their static rule).
template <class P>
void expect_explained_where_supported() {
  if constexpr (amp::is_supported_v<P, amp::CPU>) expect_fp16_pitfalls_explained<P>(amp::policy_traits<P>::name);
}

TEST(Fp16Pitfalls, Fp16TrainersOnCpuWarnAndExplainMaskedFillOverflow) {
  // The translation itself, on every line: a Half tensor's masked_fill(-1e9).
  const torch::Tensor scores = torch::zeros({2, 2}, torch::kHalf), mask = torch::eye(2).to(torch::kBool);
  const std::string msg = amp_test::error_of([&] {
    amp::detail::explain_fp16_errors<amp::Mixed<amp::fp16, amp::DynamicScaler>>(
        [&] { return scores.masked_fill(mask, -1e9); });
  });
  EXPECT_THAT(msg, ::testing::HasSubstr("amp: a scalar does not fit fp16 (largest finite value 65504) inside the "
                                        "forward of a 16-mixed region"));
  EXPECT_THAT(msg, ::testing::HasSubstr("LibTorch says: value cannot be converted to type "));  // at::Half or c10::Half
  EXPECT_THAT(msg, ::testing::HasSubstr("Half without overflow"));
  // Other errors pass through unchanged.
  EXPECT_THAT(amp_test::error_of(
                  [&] { amp::detail::explain_fp16_errors<amp::True<amp::fp16>>([&] { return scores.view({3}); }); }),
              ::testing::HasSubstr("shape '[3]' is invalid for input of size 4"));
  expect_explained_where_supported<amp::True<amp::fp16>>();
  expect_explained_where_supported<amp::Mixed<amp::fp16, amp::DynamicScaler>>();
}

TEST(Fp16Pitfalls, Bf16OnCpuDoesNotWarn) {
  auto lin = torch::nn::Linear(8, 8);
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
  ::testing::internal::CaptureStderr();
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> t(lin, opt, amp::TrainerOptions().progress(false));
  EXPECT_EQ(::testing::internal::GetCapturedStderr().find("amp:"), std::string::npos);
}

TEST(TrainerErrors, MixedRejectsNonFp32Parameters) {
  auto lin = torch::nn::Linear(4, 4);
  lin->to(torch::kBFloat16);
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
  try {
    amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> t(lin, opt);
    FAIL();
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("amp: bf16-mixed keeps parameters in fp32, but parameter 'weight' is BFloat16"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("model->to(torch::kFloat32)"), std::string::npos) << msg;
  }
}

TEST(TrainerErrors, TruePolicyConvertsTheModel) {
  auto lin = torch::nn::Linear(4, 4);
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
  amp::Trainer<amp::True<amp::fp64>, amp::CPU> t(lin, opt);
  EXPECT_EQ(lin->weight.scalar_type(), torch::kDouble);
  // The optimizer still updates the same (converted) tensors.
  EXPECT_TRUE(opt.param_groups()[0].params()[0].is_same(lin->weight));
}

TEST(TrainerErrors, CudaTrainerWithoutCudaFailsClearly) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is present";
  auto lin = torch::nn::Linear(4, 4);
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
  try {
    amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CUDA> t(lin, opt);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("amp: Trainer<bf16-mixed, amp::CUDA> needs a cuda device"), std::string::npos)
        << e.what();
  }
}

TEST(TrainerErrors, LbfgsWithALossScalingPolicyFailsClearly) {
  auto lin = torch::nn::Linear(4, 4);
  torch::optim::LBFGS opt(lin->parameters(), torch::optim::LBFGSOptions(0.1));
  try {
    amp::Trainer<amp::Mixed<amp::fp16, amp::DynamicScaler>, amp::CUDA> t(lin, opt);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "amp: a closure-based optimizer (LBFGS) cannot be used with the loss-scaling policy \"16-mixed\""),
              std::string::npos)
        << e.what();
  }
}

TEST(TrainerErrors, LbfgsWithoutScalingTrainsThroughTheClosure) {
  Data data(64);
  torch::manual_seed(9);
  auto net = std::make_shared<Net>();
  torch::optim::LBFGS opt(net->parameters(), torch::optim::LBFGSOptions(0.5).max_iter(5));
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> t(net, opt, amp::TrainerOptions().progress(false));
  double first = 0, last = 0;
  for (int i = 0; i < 8; ++i) {
    auto r = t.step([&](auto& region) { return loss_of(region, *net, data.x, data.y); });
    (i == 0 ? first : last) = r.loss_value();
  }
  EXPECT_LT(last, first);
  EXPECT_EQ(t.steps(), 8);
}

TEST(TrainerErrors, LbfgsWithAccumulationFailsBeforeTheModelChanges) {
  auto lin = torch::nn::Linear(4, 4);
  torch::optim::LBFGS opt(lin->parameters(), torch::optim::LBFGSOptions(0.1));
  try {
    amp::Trainer<amp::True<amp::fp64>, amp::CPU> t(
        lin, opt, amp::TrainerOptions().step(amp::StepOptions().accumulation_steps(2)));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("amp: gradient accumulation does not apply to a closure-based "
                                               "optimizer (LBFGS); set accumulation_steps(1)"));
  }
  EXPECT_EQ(lin->weight.scalar_type(), torch::kFloat);  // True<fp64> did not convert it
  EXPECT_THAT(amp_test::error_of([&] { amp::Stepper<amp::NoScaler>(opt, amp::StepOptions().accumulation_steps(3)); }),
              ::testing::StartsWith("amp: gradient accumulation does not apply to a closure-based optimizer (LBFGS)"));
}

TEST(TrainerErrors, BadOptionsAndBadLosses) {
  auto lin = torch::nn::Linear(4, 2);
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
  using T = amp::Trainer<amp::True<amp::fp32>, amp::CPU>;
  EXPECT_EQ(
      amp_test::error_of([&] { T(lin, opt, amp::TrainerOptions().step(amp::StepOptions().accumulation_steps(0))); }),
      "amp: accumulation_steps must be >= 1, got 0");
  EXPECT_EQ(amp_test::error_of([&] { T(lin, opt, amp::TrainerOptions().step(amp::StepOptions().max_grad_norm(-1))); }),
            "amp: max_grad_norm must be >= 0 (0 turns clipping off), got -1");
  T t(lin, opt, amp::TrainerOptions().progress(false));
  auto x = torch::randn({3, 4});
  EXPECT_THAT(amp_test::error_of([&] { t.step([&](auto&) { return lin(x); }); }),
              ::testing::StartsWith("amp: the loss must have one element, got shape [3, 2]"));
  EXPECT_EQ(amp_test::error_of([&] { t.step([&](auto&) { return torch::Tensor(); }); }),
            "amp: the loss is an undefined tensor; return the loss tensor");
  EXPECT_THAT(amp_test::error_of([&] { t.step([&](auto&) { return lin(x).sum().detach(); }); }),
              ::testing::StartsWith("amp: the loss does not require grad, so backward() cannot reach the parameters"));
}

}  // namespace
}  // namespace trainer_test
