// amp/capture/captured_step.h on CPU: everything of the captured step that does not need a
// GPU. The batch's static buffers and their checks (shape, dtype, device and
// layout, named by place), the amp: reasons a step cannot be captured, the
// detection of optimizer option changes, the in-place zeroing step, and
// FusedStep::make_static, on which replaying a graph relies: static steps
// equal ordinary fused steps bit for bit (skips included) while every state
// tensor and counter stays the same object; with a recorder that replays
// eagerly, captured steps equal eager ones (Float8 trainers included, on
// LibTorch 2.8+). The CUDA graph itself runs in tests/capture/capture_cuda_test.cc;
// on amp::CPU trainer.capture() does not compile (tests/compile_fail/capture_on_cpu.cc).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <cstdio>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/amp.h"
#include "../error_of.h"
#include "optimizer_state.h"

namespace {

using amp::detail::StaticBatch;
using amp_test::error_of;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr bool kFusedCpu = amp::detail::compat::kCpuHasFusedOptimizers;
const c10::Device kCpu(c10::DeviceType::CPU);

// --- the batch's static buffers ------------------------------------------------

using Pair = std::pair<at::Tensor, at::Tensor>;

TEST(StaticBatch, BuffersAreCopiesOfTheExampleOnTheDevice) {
  const Pair example{torch::randn({4, 3}), torch::arange(4)};
  StaticBatch<Pair> inputs(example, kCpu);
  EXPECT_EQ(inputs.size(), 2u);
  EXPECT_TRUE(torch::equal(inputs.buffers().first, example.first));
  EXPECT_TRUE(torch::equal(inputs.buffers().second, example.second));
  EXPECT_NE(inputs.buffers().first.data_ptr(), example.first.data_ptr()) << "a buffer must not alias the example";
}

TEST(StaticBatch, CopyFromRefillsTheSameBuffers) {
  StaticBatch<Pair> inputs(Pair{torch::zeros({4, 3}), torch::zeros({4}, torch::kLong)}, kCpu);
  void* const first = inputs.buffers().first.data_ptr();
  const Pair batch{torch::randn({4, 3}), torch::arange(4)};
  inputs.copy_from(batch);
  EXPECT_EQ(inputs.buffers().first.data_ptr(), first) << "the graph reads fixed addresses";
  EXPECT_TRUE(torch::equal(inputs.buffers().first, batch.first));
  EXPECT_TRUE(torch::equal(inputs.buffers().second, batch.second));
}

TEST(StaticBatch, NamesTheTensorWhoseShapeDiffers) {
  StaticBatch<Pair> inputs(Pair{torch::zeros({64, 8}), torch::zeros({64, 8})}, kCpu);
  const std::string e = error_of([&] { inputs.copy_from(Pair{torch::zeros({64, 8}), torch::zeros({32, 8})}); });
  EXPECT_THAT(e, AllOf(HasSubstr("amp: the step was captured for batch.second of shape [64, 8]"),
                       HasSubstr("but got shape [32, 8]"), HasSubstr("recapture(batch)")));
  EXPECT_TRUE(torch::equal(inputs.buffers().first, torch::zeros({64, 8}))) << "nothing copied on error";
}

TEST(StaticBatch, NamesDtypeAndDeviceDifferences) {
  StaticBatch<Pair> inputs(Pair{torch::zeros({2}), torch::zeros({2})}, kCpu);
  EXPECT_THAT(error_of([&] {
                inputs.check(Pair{torch::zeros({2}, torch::kDouble), torch::zeros({2})});
              }),
              AllOf(HasSubstr("batch.first"), HasSubstr("Float"), HasSubstr("Double")));
  EXPECT_THAT(error_of([&] {
                inputs.check(Pair{torch::zeros({2}), torch::empty({2}, torch::kMeta)});
              }),
              AllOf(HasSubstr("batch.second"), HasSubstr("on cpu"), HasSubstr("on meta")));
  EXPECT_THAT(error_of([&] {
                inputs.check(Pair{torch::zeros({2}), at::Tensor()});
              }),
              HasSubstr("amp: batch.second is an undefined tensor"));
}

TEST(StaticBatch, VectorsTuplesArraysAndExamples) {
  using Nested = std::tuple<std::vector<at::Tensor>, std::array<at::Tensor, 2>, torch::data::Example<>>;
  const Nested example{{torch::zeros({3}), torch::zeros({3})},
                       {torch::zeros({1}), torch::zeros({1})},
                       torch::data::Example<>(torch::zeros({5, 2}), torch::zeros({5}))};
  StaticBatch<Nested> inputs(example, kCpu);
  EXPECT_EQ(inputs.size(), 6u);
  Nested longer = example;
  std::get<0>(longer).push_back(torch::zeros({3}));
  EXPECT_THAT(error_of([&] { inputs.check(longer); }),
              AllOf(HasSubstr("amp: the batch is laid out differently"), HasSubstr("std::get<1>(batch)[0]"),
                    HasSubstr("std::get<0>(batch)[2]")));
  Nested shorter = example;
  std::get<0>(shorter).pop_back();
  EXPECT_THAT(error_of([&] { inputs.check(shorter); }), HasSubstr("amp: the batch is laid out differently"));
  Nested target = example;
  std::get<2>(target).target = torch::zeros({6});
  EXPECT_THAT(error_of([&] { inputs.check(target); }), HasSubstr("std::get<2>(batch).target of shape [5]"));
  Nested same = example;
  EXPECT_EQ(error_of([&] { inputs.copy_from(same); }), "<no error>");

  using Unlabelled = torch::data::Example<at::Tensor, torch::data::example::NoTarget>;
  StaticBatch<Unlabelled> data_only(Unlabelled(torch::ones({2})), kCpu);
  EXPECT_EQ(data_only.size(), 1u);
  EXPECT_THAT(error_of([&] { data_only.check(Unlabelled(torch::ones({3}))); }), HasSubstr("batch.data of shape [2]"));
}

// --- why a step cannot be captured ------------------------------------------------

struct Net : torch::nn::Module {
  Net()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))), fc2(register_module("fc2", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};

struct CountingSync : amp::GradientSync {
  void begin_backward(bool) override {}
  void finish_backward() override {}
};

TEST(CaptureBlocker, TheFusedPathWithOneMicroBatchCanBeCaptured) {
  auto net = std::make_shared<Net>();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  amp::Stepper<amp::DynamicScaler> stepper(adam);
  if (kFusedCpu) {
    EXPECT_EQ(amp::detail::capture_blocker(stepper), "");
  } else {
    // LibTorch < 2.4 has no fused CPU kernels: the reason names the fused step.
    EXPECT_THAT(amp::detail::capture_blocker(stepper),
                HasSubstr("capture() needs the fused, sync-free optimizer step"));
  }
}

TEST(CaptureBlocker, SaysWhatToChange) {
  auto net = std::make_shared<Net>();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  amp::Stepper<amp::DynamicScaler> unfused(adam, amp::StepOptions().fused(false));
  EXPECT_THAT(amp::detail::capture_blocker(unfused),
              AllOf(HasSubstr("fused, sync-free optimizer step"), HasSubstr("unfused"),
                    HasSubstr("TrainerOptions().step(StepOptions().fused(true))")));
  torch::optim::RMSprop rmsprop(net->parameters(), torch::optim::RMSpropOptions(1e-3));
  amp::Stepper<amp::NoScaler> other(rmsprop);
  EXPECT_THAT(amp::detail::capture_blocker(other), HasSubstr("use torch::optim::Adam, AdamW or SGD"));
  if (!kFusedCpu) return;  // the next two reasons come after the fused one
  amp::Stepper<amp::DynamicScaler> accumulating(adam, amp::StepOptions().accumulation_steps(4));
  EXPECT_THAT(amp::detail::capture_blocker(accumulating),
              AllOf(HasSubstr("accumulation_steps is 4"), HasSubstr("set accumulation_steps(1)")));
  amp::Stepper<amp::DynamicScaler> synced(adam);
  CountingSync sync;
  synced.set_gradient_sync(&sync);
  EXPECT_THAT(amp::detail::capture_blocker(synced), HasSubstr("a GradientSync is installed"));
  synced.set_gradient_sync(nullptr);
  EXPECT_EQ(amp::detail::capture_blocker(synced), "");
}

TEST(CaptureBlocker, MakeStaticRefusesTheUnfusedPath) {
  auto net = std::make_shared<Net>();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  amp::Stepper<amp::NoScaler> unfused(adam, amp::StepOptions().fused(false));
  EXPECT_THAT(error_of([&] { unfused.make_static(); }), HasSubstr("amp: make_static() needs the fused step"));
}

// --- optimizer options baked into a graph ---------------------------------------

TEST(OptimizerOptionsSnapshot, SeesLrAndOtherHyperparameterChanges) {
  auto net = std::make_shared<Net>();
  torch::optim::AdamW adamw(net->fc1->parameters(), torch::optim::AdamWOptions(1e-3));
  amp::detail::OptimizerOptionsSnapshot captured(adamw);
  EXPECT_EQ(captured.changed(adamw), "");
  adamw.param_groups()[0].options().set_lr(5e-4);
  EXPECT_THAT(captured.changed(adamw),
              AllOf(HasSubstr("param group 0 changed"), HasSubstr("lr 0.001000 at capture, now 0.000500")));
  adamw.param_groups()[0].options().set_lr(1e-3);
  EXPECT_EQ(captured.changed(adamw), "");
  static_cast<torch::optim::AdamWOptions&>(adamw.param_groups()[0].options()).weight_decay(0.5);
  EXPECT_THAT(captured.changed(adamw), HasSubstr("or another hyperparameter"));
  static_cast<torch::optim::AdamWOptions&>(adamw.param_groups()[0].options()).weight_decay(1e-2);
  EXPECT_EQ(captured.changed(adamw), "");
  adamw.add_param_group(torch::optim::OptimizerParamGroup(net->fc2->parameters()));
  EXPECT_THAT(captured.changed(adamw), HasSubstr("the optimizer has 2 param groups, the step was captured with 1"));

  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  amp::detail::OptimizerOptionsSnapshot sgd_captured(sgd);
  static_cast<torch::optim::SGDOptions&>(sgd.param_groups()[0].options()).nesterov(true);
  EXPECT_THAT(sgd_captured.changed(sgd), HasSubstr("or another hyperparameter"));
}

// --- the captured kind of step, run eagerly ---------------------------------------

// A fixed state (Stepper::make_static): gradients zeroed in place, the same
// tensors every step, and the same bits as plain steps (zero_grad()).
TEST(StaticStepper, ZeroesGradientsInPlaceWithTheSameBits) {
  if (!kFusedCpu) GTEST_SKIP() << "LibTorch < 2.4 has no fused CPU kernels";
  torch::manual_seed(3);
  auto a = std::make_shared<Net>();
  auto b = std::make_shared<Net>();
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  torch::optim::Adam oa(a->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam ob(b->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Stepper<amp::DynamicScaler> sa(oa, amp::StepOptions().max_grad_norm(0.5),
                                      amp::DynamicScaler(amp::DynamicScalerOptions().init_scale(1024.)));
  amp::Stepper<amp::DynamicScaler> sb(ob, amp::StepOptions().max_grad_norm(0.5),
                                      amp::DynamicScaler(amp::DynamicScalerOptions().init_scale(1024.)));
  std::vector<at::Tensor> grads;  // held: a replaced gradient cannot reuse their memory
  for (int i = 0; i < 6; ++i) {
    const auto x = torch::randn({32, 8}), y = torch::randn({32, 4});
    if (i == 3) x[0][0] = std::numeric_limits<float>::infinity();
    sa.step(torch::mse_loss(a->forward(x), y));
    sb.step(torch::mse_loss(b->forward(x), y));
    if (i == 0) {
      sb.make_static();
      EXPECT_TRUE(sb.is_static());
      for (const auto& p : b->parameters()) grads.push_back(p.grad());
    }
  }
  for (size_t i = 0; i < a->parameters().size(); ++i) {
    EXPECT_TRUE(torch::equal(a->parameters()[i], b->parameters()[i])) << "parameter " << i;
    EXPECT_TRUE(b->parameters()[i].grad().is_same(grads[i])) << "gradient " << i << " was replaced";
  }
  EXPECT_EQ(sa.scaler().get_scale(), sb.scaler().get_scale());
  sb.reload_optimizer_state();
  EXPECT_FALSE(sb.is_static());
}

// --- FusedStep::make_static -------------------------------------------------

enum class Opt { kAdam, kAdamW, kSgd, kSgdDampened, kAdamW8bit };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o, const std::vector<at::Tensor>& params) {
  switch (o) {
    case Opt::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2).amsgrad(true));
    case Opt::kAdamW:
      return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2));
    case Opt::kSgd:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true));
    case Opt::kSgdDampened:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.5));
    case Opt::kAdamW8bit:  // amp's own sync-free step (optim/low_bit_adam.h)
      return std::make_unique<amp::AdamW8bit>(params, torch::optim::AdamWOptions(1e-2));
  }
  return nullptr;
}

// The state tensors of every parameter, in a fixed order.
std::vector<at::Tensor> state_tensors(torch::optim::Optimizer& opt, const amp::FusedStep& fused) {
  std::vector<at::Tensor> out;
  for (const auto& p : opt.param_groups()[0].params()) {
    auto it = opt.state().find(amp::detail::compat::optim_state_key(p.unsafeGetTensorImpl()));
    if (it == opt.state().end()) continue;
    if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
      out.insert(out.end(), {s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq()});
    } else if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
      out.insert(out.end(), {w->exp_avg(), w->exp_avg_sq()});
    } else if (auto* m = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
      out.push_back(m->momentum_buffer());
    }
    const at::Tensor count = fused.step_count(p);
    if (count.defined()) out.push_back(count);
  }
  return out;
}

class FusedStepMakeStatic : public ::testing::TestWithParam<Opt> {};

// Static steps (all state made first, kept fixed) against ordinary fused
// steps, with inf/NaN on random steps: the same bits, and the same tensors
// (data pointers) from the first step to the last, syncs included.
TEST_P(FusedStepMakeStatic, EqualsOrdinaryFusedStepsOnTheSameTensors) {
  if (!kFusedCpu) GTEST_SKIP() << "LibTorch < 2.4 has no fused CPU kernels";
  torch::manual_seed(11);
  std::vector<at::Tensor> pa, pb;
  for (const auto& sizes : std::vector<std::vector<int64_t>>{{17, 5}, {33}, {4, 4, 3}}) {
    pa.push_back(torch::randn(sizes).requires_grad_());
    pb.push_back(pa.back().detach().clone().requires_grad_());
  }
  auto oa = make_optimizer(GetParam(), pa);
  auto ob = make_optimizer(GetParam(), pb);
  amp::FusedStep fa(*oa), fb(*ob);
  std::mt19937 rng(5);
  auto set_grads = [&](int step, bool poison) {
    torch::manual_seed(100 + step);
    for (size_t i = 0; i < pa.size(); ++i) {
      at::Tensor g = torch::randn(pa[i].sizes()) * 64.0;
      if (poison && i == static_cast<size_t>(step) % pa.size()) g.view(-1)[0] = (step % 2) ? NAN : INFINITY;
      pa[i].mutable_grad() = g.clone();
      pb[i].mutable_grad() = g.clone();
    }
  };
  set_grads(0, false);
  fb.make_static();
  EXPECT_TRUE(fb.is_static());
  const std::vector<at::Tensor> fixed = state_tensors(*ob, fb);
  ASSERT_FALSE(fixed.empty());
  std::vector<void*> addresses;
  for (const auto& t : fixed) addresses.push_back(t.data_ptr());
  const at::Tensor scale = torch::full({}, 64.0f);
  // The first two steps skipped: state made by skipped steps must still work.
  for (int step = 0; step < 40; ++step) {
    const bool poison = step < 2 || std::uniform_int_distribution<int>(0, 3)(rng) == 0;
    set_grads(step, poison);
    auto found = [&](const std::vector<at::Tensor>& params) {
      at::Tensor f = torch::zeros({});
      for (const auto& p : params) f = torch::maximum(f, (~torch::isfinite(p.grad())).any().to(torch::kFloat));
      return f;
    };
    fa.step(scale, found(pa));
    fb.step(scale, found(pb));
    if (step == 20) {
      fa.sync_optimizer_state();
      fb.sync_optimizer_state();
    }
  }
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
  const std::vector<at::Tensor> after = state_tensors(*ob, fb);
  ASSERT_EQ(after.size(), fixed.size());
  for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(after[i].data_ptr(), addresses[i]) << "state tensor " << i;
  const std::vector<at::Tensor> ordinary = state_tensors(*oa, fa);
  ASSERT_EQ(ordinary.size(), after.size());
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(torch::equal(ordinary[i], after[i])) << "state tensor " << i;
}

// make_static keeps entries whose steps were all skipped (step 0, zero
// moments), where an ordinary fused step drops them at the sync.
TEST_P(FusedStepMakeStatic, KeepsTheStateOfSkippedStepsAtTheSync) {
  if (!kFusedCpu) GTEST_SKIP() << "LibTorch < 2.4 has no fused CPU kernels";
  at::Tensor p = torch::randn({6}).requires_grad_();
  p.mutable_grad() = torch::ones({6});
  auto opt = make_optimizer(GetParam(), {p});
  amp::FusedStep fused(*opt);
  fused.make_static();
  fused.step(at::Tensor(), torch::ones({}));  // skipped
  fused.sync_optimizer_state();
  ASSERT_EQ(opt->state().size(), 1u) << "the entry the graph writes must stay in optimizer.state()";
  amp::FusedStep ordinary(*opt);
  opt->state().clear();
  ordinary.step(at::Tensor(), torch::ones({}));
  ordinary.sync_optimizer_state();
  EXPECT_EQ(opt->state().size(), 0u) << "an ordinary skipped first step leaves no state";
}

std::string opt_name(const ::testing::TestParamInfo<Opt>& info) {
  static const std::array<const char*, 4> names = {"Adam", "AdamW", "Sgd", "SgdDampened"};
  return names[static_cast<size_t>(info.param)];
}
INSTANTIATE_TEST_SUITE_P(Optimizers, FusedStepMakeStatic,
                         ::testing::Values(Opt::kAdam, Opt::kAdamW, Opt::kSgd, Opt::kSgdDampened), opt_name);

// --- CapturedStep on CPU, replaying by running the step eagerly ----------------

// 16-mixed; before LibTorch 2.3 (no fp16 on CPU) a type that compiles there:
// the tests that use it skip before 2.4 anyway.
using Scaled16 = std::conditional_t<amp::detail::compat::kCpuHasFp16, amp::Mixed<amp::fp16, amp::DynamicScaler>,
                                    amp::Mixed<amp::bf16, amp::NoScaler>>;

// A Recorder that replays by running the step again, eagerly: everything of
// CapturedStep but the CUDA graph (warm-up undone from the snapshot, static
// state, in-place zeroing, input buffers, the checks before a replay).
struct EagerRecorder {
  explicit EagerRecorder(c10::Device) {}
  void synchronize() const {}
  template <class G>
  void on_side_stream(G&& g) const {
    g();
  }
  at::Tensor rng_state() const {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    return gen.get_state();
  }
  void set_rng_state(const at::Tensor& state) const {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    gen.set_state(state);
  }
  template <class Body>
  amp::StepResult record(Body&&) {
    return {};
  }
  template <class Body>
  amp::StepResult replay(Body&& body, const amp::StepResult&) {
    return body();
  }
  void reset() {}
  int64_t pool_bytes() const { return 0; }
};

struct DropoutNet : torch::nn::Module {
  DropoutNet()
      : fc1(register_module("fc1", torch::nn::Linear(8, 32))),
        drop(register_module("drop", torch::nn::Dropout(0.25))),
        fc2(register_module("fc2", torch::nn::Linear(32, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(drop(torch::relu(fc1(x)))); }
  torch::nn::Linear fc1;
  torch::nn::Dropout drop;
  torch::nn::Linear fc2;
};

// Step i's batch; with `inf`, every 7th has an inf in its input (a loss
// scaler skips that step; without one the parameters would become NaN).
Pair batch_at(int i, int64_t rows = 16, bool inf = true) {
  torch::manual_seed(500 + i);
  Pair b{torch::randn({rows, 8}), torch::randn({rows, 4})};
  if (inf && i % 7 == 3) b.first[0][0] = std::numeric_limits<float>::infinity();
  return b;
}

template <class P>
struct Training {
  std::shared_ptr<DropoutNet> net;
  std::unique_ptr<torch::optim::Optimizer> opt;
  amp::Trainer<P, amp::CPU> trainer;
  explicit Training(Opt o, amp::TrainerOptions options = amp::TrainerOptions())
      : net(seeded()),
        opt(make_optimizer(o, net->parameters())),
        trainer(net, *opt, options.progress(false), scaler()) {}
  static std::shared_ptr<DropoutNet> seeded() {
    torch::manual_seed(1);
    return std::make_shared<DropoutNet>();
  }
  static typename amp::Trainer<P, amp::CPU>::scaler_type scaler() {
    if constexpr (amp::policy_traits<P>::uses_loss_scaling) {
      return amp::DynamicScaler(amp::DynamicScalerOptions().init_scale(256.).growth_interval(5));
    } else {
      return {};
    }
  }
  auto fn() {
    return [m = net](auto&, const Pair& b) { return torch::mse_loss(m->forward(b.first), b.second); };
  }
  amp::StepResult eager(const Pair& b) {
    return trainer.step([&](auto& region) { return fn()(region, b); });
  }
  auto capture(const Pair& example) {
    using Step = amp::CapturedStep<amp::Trainer<P, amp::CPU>, decltype(fn()), Pair, EagerRecorder>;
    return Step(trainer, fn(), example);
  }
};

template <class P>
void expect_same(Training<P>& a, Training<P>& b) {
  const auto pa = a.net->parameters(), pb = b.net->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
  EXPECT_EQ(a.trainer.scaler().get_scale(), b.trainer.scaler().get_scale());
  EXPECT_EQ(a.trainer.steps(), b.trainer.steps());
  a.trainer.stepper().sync_optimizer_state();
  b.trainer.stepper().sync_optimizer_state();
  for (size_t i = 0; i < pa.size(); ++i) {
    const auto sa = amp_test::state_of(*a.opt, pa[i]), sb = amp_test::state_of(*b.opt, pb[i]);
    EXPECT_EQ(sa.second, sb.second) << "step count of parameter " << i;
    ASSERT_EQ(sa.first.size(), sb.first.size()) << "parameter " << i;
    for (size_t k = 0; k < sa.first.size(); ++k)
      EXPECT_TRUE(amp_test::same_state_tensor(sa.first[k], sb.first[k]))
          << "state tensor " << k << " of parameter " << i;
  }
}

template <class P>
void replays_equal_eager(Opt o, amp::TrainerOptions options = amp::TrainerOptions()) {
  constexpr bool inf = amp::policy_traits<P>::uses_loss_scaling;
  Training<P> eager(o, options);
  torch::manual_seed(42);  // dropout's draws: the same sequence for both runs
  for (int i = 0; i < 60; ++i) eager.eager(batch_at(i, 16, inf));
  Training<P> captured(o, options);
  auto step = captured.capture(batch_at(0, 16, inf));  // 3 warm-up steps, undone (dropout's RNG included)
  torch::manual_seed(42);
  for (int i = 0; i < 60; ++i) step(batch_at(i, 16, inf));
  EXPECT_EQ(step.replays(), 60);
  expect_same(eager, captured);
}

class CapturedStepEmulated : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kFusedCpu) GTEST_SKIP() << "LibTorch < 2.4 has no fused CPU kernels, so nothing can be captured";
  }
};

TEST_F(CapturedStepEmulated, ReplaysEqualEagerFusedStepsBf16Adam) {
  replays_equal_eager<amp::Mixed<amp::bf16, amp::NoScaler>>(Opt::kAdam);
}
TEST_F(CapturedStepEmulated, ReplaysEqualEagerFusedStepsFp16SgdWithInfAndClipping) {
  replays_equal_eager<Scaled16>(Opt::kSgdDampened, amp::TrainerOptions().step(amp::StepOptions().max_grad_norm(0.5)));
}
TEST_F(CapturedStepEmulated, ReplaysEqualEagerFusedStepsFp16AdamWWithInf) {
  replays_equal_eager<Scaled16>(Opt::kAdamW);
}
TEST_F(CapturedStepEmulated, ReplaysEqualEagerFusedStepsTrueFp32Sgd) {
  replays_equal_eager<amp::True<amp::fp32>>(Opt::kSgd);
}
// A low-bit optimizer's own step_scaled() (FusedKind::kOptimizer), skips and clipping included.
TEST_F(CapturedStepEmulated, ReplaysEqualEagerLowBitStepsFp16AdamW8bitWithInfAndClipping) {
  replays_equal_eager<Scaled16>(Opt::kAdamW8bit, amp::TrainerOptions().step(amp::StepOptions().max_grad_norm(0.5)));
}

TEST_F(CapturedStepEmulated, AnotherShapeOrAnOptionChangeIsAnErrorUntilRecapture) {
  using P = Scaled16;
  Training<P> t(Opt::kAdam);
  auto step = t.capture(batch_at(0));
  step(batch_at(1));
  EXPECT_EQ(t.trainer.steps(), 1);
  EXPECT_THAT(
      error_of([&] { step(batch_at(2, 8)); }),
      HasSubstr("amp: the step was captured for batch.first of shape [16, 8], Float on cpu, but got shape [8, 8]"));
  EXPECT_EQ(t.trainer.steps(), 1) << "a refused batch trains nothing";
  step.recapture(batch_at(2, 8));
  step(batch_at(2, 8));
  EXPECT_EQ(t.trainer.steps(), 2);
  t.opt->param_groups()[0].options().set_lr(1e-4);
  EXPECT_THAT(error_of([&] { step(batch_at(3, 8)); }),
              AllOf(HasSubstr("amp: the options of param group 0 changed"), HasSubstr("call recapture()")));
  step.recapture();
  EXPECT_EQ(error_of([&] { step(batch_at(3, 8)); }), "<no error>");
}

TEST_F(CapturedStepEmulated, UnsupportedConfigurationsSayWhy) {
  using P = amp::Mixed<amp::bf16, amp::NoScaler>;
  Training<P> unfused(Opt::kAdam, amp::TrainerOptions().step(amp::StepOptions().fused(false)));
  EXPECT_THAT(error_of([&] { unfused.capture(batch_at(0)); }),
              HasSubstr("amp: capture() needs the fused, sync-free optimizer step"));
  Training<P> accumulating(Opt::kAdam, amp::TrainerOptions().step(amp::StepOptions().accumulation_steps(2)));
  EXPECT_THAT(error_of([&] { accumulating.capture(batch_at(0)); }), HasSubstr("amp: capture() records one whole"));
  EXPECT_EQ(accumulating.trainer.steps(), 0);
}

// Save between replays, load into fresh trainers, continue eager or
// captured: both equal an uninterrupted eager run. load() into the capturing
// trainer makes its replays refuse until recapture().
TEST_F(CapturedStepEmulated, CheckpointsMoveBetweenCapturedAndEager) {
  using P = Scaled16;
  const std::string path = ::testing::TempDir() + "amp_capture_ckpt.pt";
  Training<P> reference(Opt::kAdam);
  reference.net->eval();  // no dropout: the runs below draw in other orders
  for (int i = 0; i < 40; ++i) reference.eager(batch_at(i));

  Training<P> first(Opt::kAdam);
  first.net->eval();
  auto step = first.capture(batch_at(0));
  for (int i = 0; i < 20; ++i) step(batch_at(i));
  first.trainer.save(path);

  Training<P> eager_after(Opt::kAdam);
  eager_after.net->eval();
  eager_after.trainer.load(path);
  for (int i = 20; i < 40; ++i) eager_after.eager(batch_at(i));
  expect_same(reference, eager_after);

  Training<P> captured_after(Opt::kAdam);
  captured_after.net->eval();
  captured_after.trainer.load(path);
  auto resumed = captured_after.capture(batch_at(20));
  for (int i = 20; i < 40; ++i) resumed(batch_at(i));
  expect_same(reference, captured_after);

  first.trainer.load(path);
  EXPECT_THAT(error_of([&] { step(batch_at(20)); }),
              HasSubstr("amp: the tensors this step was captured with were replaced (by trainer.load()"));
  step.recapture();
  for (int i = 20; i < 40; ++i) step(batch_at(i));
  expect_same(reference, first);
  std::remove(path.c_str());
}

// A second capture() on the trainer undoes its warm-up from a snapshot, which
// replaces the tensors the first one recorded: the first refuses to replay.
TEST_F(CapturedStepEmulated, ASecondCaptureMakesTheFirstRecapture) {
  Training<Scaled16> t(Opt::kAdam);
  auto first = t.capture(batch_at(0));
  first(batch_at(0));
  auto second = t.capture(batch_at(1));
  EXPECT_THAT(error_of([&] { first(batch_at(1)); }), HasSubstr("or by another capture() on this trainer"));
  EXPECT_EQ(error_of([&] { second(batch_at(1)); }), "<no error>");
  EXPECT_EQ(t.trainer.steps(), 2);
}

// Eager steps and replays mixed on one trainer equal all-eager.
TEST_F(CapturedStepEmulated, EagerStepsBetweenReplays) {
  using P = Scaled16;
  Training<P> reference(Opt::kSgd), mixed(Opt::kSgd);
  reference.net->eval();
  mixed.net->eval();
  auto step = mixed.capture(batch_at(0));
  for (int i = 0; i < 40; ++i) {
    reference.eager(batch_at(i));
    if ((i / 5) % 2 == 0) {
      step(batch_at(i));
    } else {
      mixed.eager(batch_at(i));
    }
  }
  expect_same(reference, mixed);
}

#if AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL
// Float8 trainers: a captured step runs the policy's region with the recipe's
// scales bound and, after the fused step, the recipe's update in place (delayed
// scaling's new scales and rolled histories), so replays equal eager steps,
// the recipe's state included. (CPU's _scaled_mm, LibTorch 2.8+.)
template <class Recipe>
void float8_replays_equal_eager() {
  using T = amp::Trainer<amp::Float8<Recipe>, amp::CPU>;
  auto make = [] {
    torch::manual_seed(3);
    return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 16));
  };
  auto batch = [](int i) {
    torch::manual_seed(900 + i);
    return Pair{torch::randn({24, 16}), torch::randn({24, 16})};
  };
  auto fn_of = [](torch::nn::Sequential m) {
    return [p = m.ptr()](auto&, const Pair& b) {
      return torch::mse_loss(p->forward(b.first).to(torch::kFloat), b.second);
    };
  };
  torch::nn::Sequential ma = make(), mb = make();
  torch::optim::AdamW oa(ma->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ob(mb->parameters(), torch::optim::AdamWOptions(1e-2));
  T eager(ma, oa, amp::TrainerOptions().progress(false)), captured(mb, ob, amp::TrainerOptions().progress(false));
  ASSERT_TRUE(captured.fused());
  auto fa = fn_of(ma), fb = fn_of(mb);
  amp::CapturedStep<T, decltype(fb), Pair, EagerRecorder> step(captured, fb, batch(0));
  for (int i = 0; i < 12; ++i) {
    const Pair b = batch(i);
    const amp::StepResult e = eager.step([&](auto& region) { return fa(region, b); });
    const amp::StepResult r = step(b);
    EXPECT_TRUE(torch::equal(e.loss, r.loss)) << "step " << i;
  }
  EXPECT_EQ(captured.steps(), 12);
  const auto pa = ma->parameters(), pb = mb->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
  if constexpr (std::is_same_v<Recipe, amp::Delayed<4>>) {
    const auto sa = eager.float8_state().scaling().state_dict(), sb = captured.float8_state().scaling().state_dict();
    ASSERT_EQ(sa.size(), 8u) << "two linears, four tensors each";
    for (const auto& item : sa) EXPECT_TRUE(torch::equal(item.value(), sb[item.key()])) << item.key();
    EXPECT_FALSE(torch::equal(sb["0.fwd_scale"], torch::ones({2}))) << "the replays updated the scales";
  }
}

TEST_F(CapturedStepEmulated, Float8TensorwiseReplaysEqualEagerSteps) { float8_replays_equal_eager<amp::Tensorwise>(); }
TEST_F(CapturedStepEmulated, Float8DelayedReplaysEqualEagerStepsStateIncluded) {
  float8_replays_equal_eager<amp::Delayed<4>>();
}
#endif                                 // AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL
#if AMP_DETAIL_HAS_CPU_ROWWISE_FLOAT8  // rowwise scales in CPU's _scaled_mm: LibTorch 2.14
TEST_F(CapturedStepEmulated, Float8RowwiseReplaysEqualEagerSteps) { float8_replays_equal_eager<amp::Rowwise>(); }
TEST_F(CapturedStepEmulated, Float8RowwiseWithGwHpReplaysEqualEagerSteps) {
  float8_replays_equal_eager<amp::RowwiseWithGwHp>();
}
#endif

}  // namespace
