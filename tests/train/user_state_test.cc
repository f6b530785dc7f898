// amp/train/user_state.h: an LR scheduler, a tensor and an integer in the
// Trainer's checkpoint. A run with StepLR and dropout, saved at step 3 and
// resumed by a new model, optimizer, scheduler and Trainer, takes the same
// steps bit for bit as the uninterrupted run; the scheduler steps once per
// optimizer step (not per micro-batch); a checkpoint whose entries differ
// from the registered ones is refused and nothing changes. The same for a
// Fabric, whose update() steps the scheduler.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "../error_of.h"
#include "../tmp_path.h"
#include "amp/amp.h"

namespace user_state_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

namespace fs = std::filesystem;
using ::amp_test::error_of;
using ::amp_test::tmp_path;
using ::testing::HasSubstr;
using Policy = amp::Mixed<amp::bf16, amp::NoScaler>;

torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Dropout(0.3),
                               torch::nn::Linear(32, 4));
}

double lr_of(const torch::optim::Optimizer& opt) {
  return static_cast<const torch::optim::SGDOptions&>(opt.param_groups()[0].options()).lr();
}

// The run's state: model, optimizer, scheduler, Trainer and two user entries.
struct Training {
  torch::nn::Sequential model = make_model();
  torch::optim::SGD opt{model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)};
  torch::optim::StepLR lr{opt, /*step_size=*/2, /*gamma=*/0.5};
  torch::Tensor ema = torch::zeros({4});
  int64_t best = -1;
  amp::Trainer<Policy, amp::CPU> trainer;

  explicit Training(int64_t accumulation = 1)
      : trainer(model, opt,
                amp::TrainerOptions().progress(false).step(amp::StepOptions().accumulation_steps(accumulation))) {
    trainer.user_state().scheduler("lr", lr).tensor("ema", ema).integer("best", best);
  }
  void steps(int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i) {
      const torch::Tensor x = torch::randn({16, 8}), y = torch::randint(0, 4, {16});
      trainer.step([&](auto&) { return torch::cross_entropy_loss(model->forward(x), y); });
      ema.mul_(0.5).add_(model->parameters().back().detach());
      best = i;
    }
  }
};

TEST(UserState, AResumeWithStepLRAndDropoutIsBitwiseTheUninterruptedRun) {
  torch::manual_seed(0);
  Training whole;
  whole.steps(0, 6);

  torch::manual_seed(0);
  const std::string path = tmp_path("user_state_resume.pt");
  {
    Training first;
    first.steps(0, 3);
    first.trainer.save(path);
  }
  torch::manual_seed(123);  // the resumed run draws from the checkpoint's generator, not this one
  Training resumed;
  resumed.trainer.load(path);
  EXPECT_EQ(resumed.best, 2);
  resumed.steps(3, 6);
  fs::remove(path);

  EXPECT_EQ(lr_of(resumed.opt), lr_of(whole.opt));
  EXPECT_EQ(lr_of(whole.opt), 0.1 * 0.5 * 0.5);  // LibTorch's StepLR: halved at its steps 3 and 5
  EXPECT_TRUE(torch::equal(resumed.ema, whole.ema));
  EXPECT_EQ(resumed.best, whole.best);
  const auto a = whole.model->parameters(), b = resumed.model->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
}

TEST(UserState, TheSchedulerStepsOncePerOptimizerStepNotPerMicroBatch) {
  torch::manual_seed(0);
  Training run(/*accumulation=*/2);
  run.steps(0, 4);  // 4 micro-batches: 2 optimizer steps, not yet the third that halves the rate
  EXPECT_EQ(run.trainer.steps(), 2);
  EXPECT_EQ(lr_of(run.opt), 0.1);
  run.steps(4, 6);
  EXPECT_EQ(run.trainer.steps(), 3);
  EXPECT_EQ(lr_of(run.opt), 0.1 * 0.5);
}

TEST(UserState, OtherEntriesAreRefusedAndNothingChanges) {
  torch::manual_seed(0);
  const std::string path = tmp_path("user_state_refused.pt");
  Training saved;
  saved.steps(0, 3);
  saved.trainer.save(path);

  auto expect_refused = [&](amp::Trainer<Policy, amp::CPU>& trainer, Training& run, const std::string& why) {
    std::vector<torch::Tensor> before;
    for (const auto& p : run.model->parameters()) before.push_back(p.detach().clone());
    const torch::Tensor ema = run.ema.clone();
    const int64_t best = run.best;
    const double lr = lr_of(run.opt);
    EXPECT_THAT(error_of([&] { trainer.load(path); }), HasSubstr(why));
    const auto after = run.model->parameters();
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i])) << "parameter " << i;
    EXPECT_TRUE(torch::equal(run.ema, ema));
    EXPECT_EQ(run.best, best);
    EXPECT_EQ(lr_of(run.opt), lr);
    EXPECT_EQ(trainer.steps(), 0);
  };
  {  // one entry fewer
    Training other;
    amp::Trainer<Policy, amp::CPU> trainer(other.model, other.opt, amp::TrainerOptions().progress(false));
    trainer.user_state().scheduler("lr", other.lr).tensor("ema", other.ema);
    expect_refused(trainer, other, "register the same entries");
  }
  {  // a tensor of another shape
    Training other;
    torch::Tensor wide = torch::zeros({5});
    amp::Trainer<Policy, amp::CPU> trainer(other.model, other.opt, amp::TrainerOptions().progress(false));
    trainer.user_state().scheduler("lr", other.lr).tensor("ema", wide).integer("best", other.best);
    expect_refused(trainer, other, "but the registered tensor is");
  }
  {  // none registered
    Training other;
    amp::Trainer<Policy, amp::CPU> trainer(other.model, other.opt, amp::TrainerOptions().progress(false));
    expect_refused(trainer, other, "the checkpoint's user state is [integer:best;tensor:ema;scheduler:lr]");
  }
  fs::remove(path);
  Training run;
  EXPECT_THAT(error_of([&] { run.trainer.user_state().integer("best", run.best); }),
              HasSubstr("amp: UserState already has an entry \"best\""));
  EXPECT_THAT(error_of([&] { run.trainer.user_state().tensor("a/b", run.ema); }), HasSubstr("without '/'"));
}

// A Fabric's run: two models (a GAN's shape), one scheduler per optimizer.
struct FabricTraining {
  torch::nn::Sequential g = make_model(), d = make_model();
  torch::optim::SGD opt_g{g->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)};
  torch::optim::SGD opt_d{d->parameters(), torch::optim::SGDOptions(0.05)};
  torch::optim::StepLR lr_g{opt_g, /*step_size=*/2, /*gamma=*/0.5};
  torch::optim::StepLR lr_d{opt_d, /*step_size=*/3, /*gamma=*/0.1};
  int64_t best = -1;
  amp::Fabric<Policy, amp::CPU> fabric;

  explicit FabricTraining(bool register_all = true) {
    fabric.setup(g, opt_g);
    fabric.setup(d, opt_d);
    fabric.user_state().scheduler("lr_g", lr_g);
    if (register_all) fabric.user_state().scheduler("lr_d", lr_d).integer("best", best);
  }
  void steps(int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i) {
      const torch::Tensor x = torch::randn({16, 8}), y = torch::randint(0, 4, {16});
      opt_d.zero_grad();
      fabric.backward(fabric.forward([&](auto&) { return torch::cross_entropy_loss(d->forward(x), y); }));
      fabric.optimizer_step(opt_d);
      opt_g.zero_grad();
      fabric.backward(fabric.forward([&](auto&) { return torch::cross_entropy_loss(g->forward(x), y); }));
      fabric.optimizer_step(opt_g);
      fabric.update();
      best = i;
    }
  }
};

TEST(UserState, AFabricResumeWithStepLRAndDropoutIsBitwiseTheUninterruptedRun) {
  torch::manual_seed(0);
  FabricTraining whole;
  whole.steps(0, 7);

  torch::manual_seed(0);
  const std::string path = tmp_path("user_state_fabric.pt");
  {
    FabricTraining first;
    first.steps(0, 4);
    first.fabric.save(path);
  }
  torch::manual_seed(123);
  FabricTraining resumed;
  resumed.fabric.load(path);
  EXPECT_EQ(resumed.fabric.steps(), 4);
  EXPECT_EQ(resumed.best, 3);
  resumed.steps(4, 7);

  EXPECT_EQ(whole.fabric.steps(), 7);
  EXPECT_EQ(lr_of(whole.opt_g), 0.1 * 0.5 * 0.5 * 0.5);  // update() stepped it 7 times: halved at 2, 4, 6
  EXPECT_EQ(lr_of(whole.opt_d), 0.05 * 0.1 * 0.1);       // at 3 and 6
  EXPECT_EQ(lr_of(resumed.opt_g), lr_of(whole.opt_g));
  EXPECT_EQ(lr_of(resumed.opt_d), lr_of(whole.opt_d));
  EXPECT_EQ(resumed.best, whole.best);
  for (auto models : {std::make_pair(whole.g, resumed.g), std::make_pair(whole.d, resumed.d)}) {
    const auto a = models.first->parameters(), b = models.second->parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
  }

  // Other entries: refused, and nothing changes.
  FabricTraining other(/*register_all=*/false);
  other.steps(0, 1);
  std::vector<torch::Tensor> before;
  for (const auto& p : other.g->parameters()) before.push_back(p.detach().clone());
  const double lr = lr_of(other.opt_g);
  EXPECT_THAT(error_of([&] { other.fabric.load(path); }),
              HasSubstr("the checkpoint's user state is [integer:best;scheduler:lr_d;scheduler:lr_g] but user_state() "
                        "here is [scheduler:lr_g]"));
  EXPECT_EQ(other.fabric.steps(), 1);
  EXPECT_EQ(lr_of(other.opt_g), lr);
  const auto after = other.g->parameters();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i])) << "parameter " << i;
  fs::remove(path);
}

}  // namespace
}  // namespace user_state_test
