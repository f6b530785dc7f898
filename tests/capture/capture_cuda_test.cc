// Trainer::capture on a GPU (amp/capture/captured_step.h): N replays of the captured step
// equal N eager fused steps bit for bit (parameters, optimizer state, scale,
// with injected inf/NaN: skips and back-offs inside the graph), with no host
// sync per replay; shape mismatches, option changes and load() give amp:
// errors and recapture() recovers; checkpoints move between captured and
// eager training. Every test skips without a CUDA device. Built by CMake
// (tools/gpu/check.sh on a CUDA machine); tools/dev compiles it against
// LibTorch 2.6's CUDA headers on machines without a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/amp.h"
#include "../error_of.h"
#include "optimizer_state.h"

#if AMP_DETAIL_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace {

using amp_test::error_of;
using ::testing::HasSubstr;
using Batch = std::pair<torch::Tensor, torch::Tensor>;

#define SKIP_WITHOUT_CUDA()                                         \
  do {                                                              \
    if (!AMP_DETAIL_WITH_CUDA || !torch::cuda::is_available())      \
      GTEST_SKIP() << "no CUDA device (or amp built without CUDA)"; \
  } while (0)

torch::nn::Sequential make_model(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential m(torch::nn::Linear(64, 128), torch::nn::ReLU(), torch::nn::Linear(128, 128), torch::nn::ReLU(),
                          torch::nn::Linear(128, 16));
  m->to(torch::kCUDA);
  return m;
}

enum class Opt { kAdam, kAdamW, kSgd };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o, const std::vector<torch::Tensor>& params) {
  switch (o) {
    case Opt::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3).weight_decay(1e-4));
    case Opt::kAdamW:
      return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-3));
    case Opt::kSgd:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.02).momentum(0.9).nesterov(true));
  }
  return nullptr;
}

// Step i's batch; with `inf`, every 7th has an inf (or NaN) in its input: a
// loss scaler skips that step (without one the parameters would become NaN).
Batch batch_at(int i, int64_t rows = 32, bool inf = true) {
  torch::manual_seed(1000 + i);
  Batch b{torch::randn({rows, 64}), torch::randn({rows, 16})};
  if (inf && i % 7 == 3)
    b.first[0][0] = (i % 2) ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  return {b.first.to(torch::kCUDA), b.second.to(torch::kCUDA)};
}

template <class P>
struct Training {
  torch::nn::Sequential model;
  std::unique_ptr<torch::optim::Optimizer> opt;
  amp::Trainer<P, amp::CUDA> trainer;
  Training(Opt o, amp::TrainerOptions options = amp::TrainerOptions())
      : model(make_model(1)),
        opt(make_optimizer(o, model->parameters())),
        trainer(model, *opt, options.progress(false), scaler()) {}
  static typename amp::Trainer<P, amp::CUDA>::scaler_type scaler() {
    if constexpr (amp::policy_traits<P>::uses_loss_scaling) {
      return amp::DynamicScaler(amp::DynamicScalerOptions().init_scale(1024.).growth_interval(10));
    } else {
      return {};
    }
  }
  auto fn() {
    return [m = model.ptr()](auto&, const Batch& b) { return torch::mse_loss(m->forward(b.first), b.second); };
  }
  amp::StepResult eager(const Batch& b) {
    return trainer.step([&](auto& region) { return fn()(region, b); });
  }
};

template <class P>
void expect_same(Training<P>& a, Training<P>& b) {
  const auto pa = a.model->parameters(), pb = b.model->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
  EXPECT_EQ(a.trainer.scaler().get_scale(), b.trainer.scaler().get_scale());
  EXPECT_EQ(a.trainer.steps(), b.trainer.steps());
  // The optimizer state; save() first brings the fused path's device step
  // counters into optimizer.state().
  const std::string fa = (std::filesystem::temp_directory_path() / "amp_capture_a.pt").string();
  a.trainer.save(fa);
  b.trainer.save(fa);
  std::remove(fa.c_str());
  for (size_t i = 0; i < pa.size(); ++i) {
    const auto sa = amp_test::state_of(*a.opt, pa[i]), sb = amp_test::state_of(*b.opt, pb[i]);
    ASSERT_EQ(sa.first.size(), sb.first.size()) << "parameter " << i;
    EXPECT_EQ(sa.second, sb.second) << "step count of parameter " << i;
    for (size_t k = 0; k < sa.first.size(); ++k)
      EXPECT_TRUE(amp_test::same_state_tensor(sa.first[k], sb.first[k]))
          << "state tensor " << k << " of parameter " << i;
  }
}

template <class P>
void replays_equal_eager_steps(Opt o, amp::TrainerOptions options) {
  constexpr bool inf = amp::policy_traits<P>::uses_loss_scaling;
  Training<P> eager(o, options), captured(o, options);
  auto step = captured.trainer.capture(captured.fn(), batch_at(0, 32, inf));
  EXPECT_GT(step.pool_bytes(), 0) << "the graph's private pool holds the step's activations";
  int skipped = 0;
  for (int i = 0; i < 200; ++i) {
    const Batch b = batch_at(i, 32, inf);
    const amp::StepResult e = eager.eager(b);
    const amp::StepResult r = step(b);
    EXPECT_TRUE(torch::equal(e.loss, r.loss) || (e.loss.isnan().item<bool>() && r.loss.isnan().item<bool>()))
        << "step " << i;
    if (e.found_inf.defined()) {
      ASSERT_TRUE(r.found_inf.defined());
      EXPECT_EQ(e.found_inf.item<float>() != 0, r.found_inf.item<float>() != 0) << "step " << i;
      skipped += e.found_inf.item<float>() != 0;
    }
  }
  EXPECT_EQ(step.replays(), 200);
  if (amp::policy_traits<P>::uses_loss_scaling) {
    EXPECT_GT(skipped, 20) << "the injected infs must skip steps";
  }
  expect_same(eager, captured);
}

TEST(CaptureCuda, AdamFp16MixedEqualsEagerFusedOver200StepsWithInf) {
  SKIP_WITHOUT_CUDA();
  replays_equal_eager_steps<amp::Mixed<amp::fp16, amp::DynamicScaler>>(Opt::kAdam, amp::TrainerOptions());
}

TEST(CaptureCuda, SgdMomentumWithClippingEqualsEagerFused) {
  SKIP_WITHOUT_CUDA();
  replays_equal_eager_steps<amp::Mixed<amp::fp16, amp::DynamicScaler>>(
      Opt::kSgd, amp::TrainerOptions().step(amp::StepOptions().max_grad_norm(1.0)));
}

TEST(CaptureCuda, AdamWBf16MixedEqualsEagerFused) {
  SKIP_WITHOUT_CUDA();
  if (!amp::detail::compat::cuda_supports_bf16()) GTEST_SKIP() << "no bf16 on this GPU";
  replays_equal_eager_steps<amp::Mixed<amp::bf16, amp::NoScaler>>(Opt::kAdamW, amp::TrainerOptions());
}

TEST(CaptureCuda, TrueFp32EqualsEagerFused) {
  SKIP_WITHOUT_CUDA();
  replays_equal_eager_steps<amp::True<amp::fp32>>(Opt::kAdam, amp::TrainerOptions());
}

#if AMP_DETAIL_WITH_CUDA
// Counts the warnings of LibTorch's CUDA sync debug mode (one per host sync).
struct SyncCounter : c10::WarningHandler {
  std::atomic<int64_t> syncs{0};
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchroniz") != std::string::npos) ++syncs;
  }
};
#endif

TEST(CaptureCuda, ReplaysMakeNoHostSync) {
  SKIP_WITHOUT_CUDA();
#if AMP_DETAIL_WITH_CUDA
  Training<amp::Mixed<amp::fp16, amp::DynamicScaler>> run(Opt::kAdam);
  auto step = run.trainer.capture(run.fn(), batch_at(0));
  std::vector<Batch> batches;
  for (int i = 0; i < 20; ++i) batches.push_back(batch_at(i));
  torch::cuda::synchronize();
  SyncCounter counter;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&counter);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
    for (const Batch& b : batches) step(b);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  }
  torch::cuda::synchronize();
  EXPECT_EQ(counter.syncs.load(), 0);
#endif
}

TEST(CaptureCuda, AnotherShapeIsAnErrorUntilRecapture) {
  SKIP_WITHOUT_CUDA();
  Training<amp::Mixed<amp::fp16, amp::DynamicScaler>> run(Opt::kAdam);
  auto step = run.trainer.capture(run.fn(), batch_at(0));
  step(batch_at(1));
  const int64_t steps = run.trainer.steps();
  EXPECT_THAT(error_of([&] { step(batch_at(2, 16)); }),
              HasSubstr("amp: the step was captured for batch.first of shape [32, 64]"));
  EXPECT_EQ(run.trainer.steps(), steps) << "a refused batch trains nothing";
  step.recapture(batch_at(2, 16));
  step(batch_at(2, 16));
  EXPECT_EQ(run.trainer.steps(), steps + 1);
  EXPECT_THAT(error_of([&] { step(batch_at(3)); }), HasSubstr("of shape [16, 64]"));
}

TEST(CaptureCuda, AnOptionChangeIsAnErrorUntilRecapture) {
  SKIP_WITHOUT_CUDA();
  Training<amp::Mixed<amp::fp16, amp::DynamicScaler>> run(Opt::kAdam);
  auto step = run.trainer.capture(run.fn(), batch_at(0));
  step(batch_at(1));
  run.opt->param_groups()[0].options().set_lr(1e-4);
  EXPECT_THAT(error_of([&] { step(batch_at(2)); }), HasSubstr("lr 0.001000 at capture, now 0.000100"));
  step.recapture();
  EXPECT_EQ(error_of([&] { step(batch_at(2)); }), "<no error>");
}

TEST(CaptureCuda, UnsupportedConfigurationsSayWhy) {
  SKIP_WITHOUT_CUDA();
  Training<amp::Mixed<amp::fp16, amp::DynamicScaler>> unfused(
      Opt::kAdam, amp::TrainerOptions().step(amp::StepOptions().fused(false)));
  EXPECT_THAT(error_of([&] { unfused.trainer.capture(unfused.fn(), batch_at(0)); }),
              HasSubstr("amp: capture() needs the fused, sync-free optimizer step"));
  Training<amp::Mixed<amp::fp16, amp::DynamicScaler>> accumulating(
      Opt::kAdam, amp::TrainerOptions().step(amp::StepOptions().accumulation_steps(2)));
  EXPECT_THAT(error_of([&] { accumulating.trainer.capture(accumulating.fn(), batch_at(0)); }),
              HasSubstr("accumulation_steps is 2"));
}

// A forward that reads a value back to the host cannot be captured: the
// error says so, and the trainer is as it was.
TEST(CaptureCuda, AFailedCaptureLeavesTheTrainerAsItWas) {
  SKIP_WITHOUT_CUDA();
  Training<amp::Mixed<amp::fp16, amp::DynamicScaler>> run(Opt::kAdam);
  run.eager(batch_at(0));
  const auto before = run.model->parameters()[0].clone();
  const int64_t steps = run.trainer.steps();
  auto reads = [m = run.model.ptr()](auto&, const Batch& b) {
    auto out = m->forward(b.first);
    if (out.sum().item<float>() > 1e30f) out = out * 2;  // a host read: not capturable
    return torch::mse_loss(out, b.second);
  };
  EXPECT_THAT(error_of([&] { run.trainer.capture(reads, batch_at(1)); }), HasSubstr("amp: capturing the step failed"));
  EXPECT_TRUE(torch::equal(run.model->parameters()[0], before));
  EXPECT_EQ(run.trainer.steps(), steps);
  EXPECT_EQ(error_of([&] { run.eager(batch_at(1)); }), "<no error>") << "eager training goes on";
}

// Save between replays; load into fresh trainers; continue eager or captured;
// both equal an uninterrupted eager run. load() into the capturing trainer
// makes its replays refuse until recapture().
TEST(CaptureCuda, CheckpointsMoveBetweenCapturedAndEager) {
  SKIP_WITHOUT_CUDA();
  using P = amp::Mixed<amp::fp16, amp::DynamicScaler>;
  const std::string path = (std::filesystem::temp_directory_path() / "amp_capture_ckpt.pt").string();
  Training<P> reference(Opt::kAdam);
  for (int i = 0; i < 100; ++i) reference.eager(batch_at(i));

  Training<P> first(Opt::kAdam);
  auto step = first.trainer.capture(first.fn(), batch_at(0));
  for (int i = 0; i < 50; ++i) step(batch_at(i));
  first.trainer.save(path);

  Training<P> eager_after(Opt::kAdam);
  eager_after.trainer.load(path);
  for (int i = 50; i < 100; ++i) eager_after.eager(batch_at(i));
  expect_same(reference, eager_after);

  Training<P> captured_after(Opt::kAdam);
  captured_after.trainer.load(path);
  auto resumed = captured_after.trainer.capture(captured_after.fn(), batch_at(50));
  for (int i = 50; i < 100; ++i) resumed(batch_at(i));
  expect_same(reference, captured_after);

  first.trainer.load(path);
  EXPECT_THAT(error_of([&] { step(batch_at(50)); }),
              HasSubstr("amp: the tensors this step was captured with were replaced (by trainer.load()"));
  step.recapture();
  for (int i = 50; i < 100; ++i) step(batch_at(i));
  expect_same(reference, first);
  std::remove(path.c_str());
}

// Eager steps between replays train the same model: the mix equals all-eager.
TEST(CaptureCuda, EagerStepsBetweenReplays) {
  SKIP_WITHOUT_CUDA();
  using P = amp::Mixed<amp::fp16, amp::DynamicScaler>;
  Training<P> reference(Opt::kSgd), mixed(Opt::kSgd);
  auto step = mixed.trainer.capture(mixed.fn(), batch_at(0));
  for (int i = 0; i < 60; ++i) {
    reference.eager(batch_at(i));
    if ((i / 10) % 2 == 0) {
      step(batch_at(i));
    } else {
      mixed.eager(batch_at(i));
    }
  }
  expect_same(reference, mixed);
}

#if AMP_DETAIL_HAS_FLOAT8_MATMUL
// Float8 (compute capability 8.9+): the graph records the casts, the
// _scaled_mm calls and delayed scaling's update in place; replays equal
// eager steps, scales and amax histories included.
template <class Recipe>
void float8_replays_equal_eager_steps() {
  SKIP_WITHOUT_CUDA();
  if (error_of([] { amp::float8::detail::check_device<Recipe>(c10::Device(c10::kCUDA, 0)); }) != "<no error>")
    GTEST_SKIP() << "no float8 matmul for this recipe on this GPU (compute capability < 8.9)";
  using P = amp::Float8<Recipe>;
  Training<P> eager(Opt::kAdamW), captured(Opt::kAdamW);
  auto step = captured.trainer.capture(captured.fn(), batch_at(0, 32, false));
  for (int i = 0; i < 100; ++i) {
    const Batch b = batch_at(i, 32, false);
    EXPECT_TRUE(torch::equal(eager.eager(b).loss, step(b).loss)) << "step " << i;
  }
  expect_same(eager, captured);
  if constexpr (std::is_same_v<Recipe, amp::Delayed<16>>) {
    const auto sa = eager.trainer.float8_state().scaling().state_dict();
    const auto sb = captured.trainer.float8_state().scaling().state_dict();
    ASSERT_EQ(sa.size(), 12u) << "three linears, four tensors each";
    for (const auto& item : sa) EXPECT_TRUE(torch::equal(item.value(), sb[item.key()])) << item.key();
  }
}

TEST(CaptureCuda, Float8TensorwiseEqualsEager) { float8_replays_equal_eager_steps<amp::Tensorwise>(); }
TEST(CaptureCuda, Float8DelayedEqualsEagerStateIncluded) { float8_replays_equal_eager_steps<amp::Delayed<16>>(); }
TEST(CaptureCuda, Float8RowwiseEqualsEager) { float8_replays_equal_eager_steps<amp::Rowwise>(); }
TEST(CaptureCuda, Float8RowwiseWithGwHpEqualsEager) { float8_replays_equal_eager_steps<amp::RowwiseWithGwHp>(); }
#endif  // AMP_DETAIL_HAS_FLOAT8_MATMUL

}  // namespace
