// amp::checkpoint (amp/train/activation_checkpoint.h) over whole trainings:
// a small pre-norm transformer with dropout, each block checkpointed or not,
// 100 steps; losses, parameters, the optimizer's state and every other entry
// of the saved state (scaler, random generators, Float8's amax histories and
// scales) bitwise equal. bf16-mixed; 16-mixed with an inf injected at three
// steps (the same steps skipped, the same scale trajectory; LibTorch 2.3+,
// CPU fp16 autocast); a precision map with the norms and the head in fp32;
// Float8 delayed scaling (a CPU _scaled_mm: LibTorch 2.8+); Fabric, the
// Stepper in a Region by hand, 2 micro-batches of accumulation, AdamW8bit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "amp/amp.h"

namespace activation_checkpoint_training_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;
using MP = amp::ModulePrecision;
constexpr int kSteps = 100;
constexpr int64_t kB = 4, kT = 8, kD = 32, kV = 16, kBlocks = 3;  // linear sizes multiples of 16 (Float8)

// One pre-norm block; x: [B*T, D] (2-D linear inputs: no N-D bias rounding).
struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})))),
        q(register_module("q", torch::nn::Linear(kD, kD))),
        k(register_module("k", torch::nn::Linear(kD, kD))),
        v(register_module("v", torch::nn::Linear(kD, kD))),
        proj(register_module("proj", torch::nn::Linear(kD, kD))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})))),
        fc1(register_module("fc1", torch::nn::Linear(kD, 4 * kD))),
        fc2(register_module("fc2", torch::nn::Linear(4 * kD, kD))),
        drop(register_module("drop", torch::nn::Dropout(0.1))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor a = ln1(x);
    const auto heads = [&](torch::nn::Linear& m) { return m(a).view({kB, kT, kD}); };
    const torch::Tensor att =
        drop(torch::softmax(torch::matmul(heads(q), heads(k).transpose(1, 2)) / std::sqrt(double(kD)), -1));
    const torch::Tensor h = x + drop(proj(torch::matmul(att, heads(v)).reshape({kB * kT, kD})));
    return h + drop(fc2(torch::gelu(fc1(ln2(h)))));
  }
  torch::nn::LayerNorm ln1;
  torch::nn::Linear q, k, v, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool checkpointed) : checkpointed(checkpointed) {
    for (int64_t i = 0; i < kBlocks; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block()));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})));
    head = register_module("head", torch::nn::Linear(kD, kV));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (Block& b : blocks) {
      const bool ckpt = checkpointed && torch::GradMode::is_enabled();
      x = ckpt ? amp::checkpoint(b, x) : b(x);
      if (ckpt && x.grad_fn()->name() == "amp::CheckpointBackward") ++checkpoints;  // it really went through it
    }
    return head(ln_f(x));
  }
  bool checkpointed;
  int64_t checkpoints = 0;
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

struct Data {  // every step's batch, drawn once
  torch::Tensor x, y;
  Data() {
    torch::manual_seed(1);
    x = torch::randn({kSteps, kB * kT, kD});
    y = torch::randint(0, kV, {kSteps, kB * kT}, torch::kLong);
  }
};
const Data& data() {
  static const Data d;
  return d;
}

Net make_net(bool checkpointed) {
  data();  // drawn before the runs seed dropout's generator
  torch::manual_seed(0);
  return Net(checkpointed);
}

torch::Tensor loss_of(Net& net, int i) {
  return torch::cross_entropy_loss(net->forward(data().x[i]).to(torch::kFloat), data().y[i]);
}

// What a run leaves behind, compared bit for bit.
struct Outcome {
  std::vector<double> losses, scales;
  int skipped = 0;
  std::vector<torch::Tensor> params;
  std::string state;                   // save_state: scaler, generators, Float8 state (the optimizer's: `moments`)
  std::vector<torch::Tensor> moments;  // AdamW's exp_avg, exp_avg_sq and step / SGD's momentum, parameter by parameter
  int64_t checkpoints = 0;
};

void finish(Outcome& o, Net& net, torch::optim::Optimizer& opt) {
  for (const auto& p : net->parameters()) {
    o.params.push_back(p.detach().clone());
    const auto it = opt.state().find(amp::detail::compat::optim_state_key(p.unsafeGetTensorImpl()));
    if (it == opt.state().end()) continue;
    if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(it->second.get()))
      o.moments.insert(o.moments.end(), {s->exp_avg(), s->exp_avg_sq(), torch::tensor(s->step())});
    if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(it->second.get()))
      o.moments.push_back(s->momentum_buffer());
  }
  o.checkpoints = net->checkpoints;
}

// Two saved states with the same entries, each bitwise equal, but for the
// optimizer's (keyed by address there: compared as `moments`).
void expect_same_state(torch::serialize::InputArchive& a, torch::serialize::InputArchive& b, const std::string& at) {
  std::vector<std::string> ka = a.keys(), kb = b.keys();
  std::sort(ka.begin(), ka.end());
  std::sort(kb.begin(), kb.end());
  ASSERT_EQ(ka, kb) << at;
  for (const std::string& k : ka) {
    if (at == "state " && k.rfind("optimizer", 0) == 0) continue;  // "optimizer" (Trainer), "optimizer_0" (Fabric)
    torch::Tensor ta, tb;
    torch::serialize::InputArchive sa, sb;
    c10::IValue va, vb;
    if (a.try_read(k, ta) || a.try_read(k, ta, /*is_buffer=*/true)) {
      ASSERT_TRUE(b.try_read(k, tb) || b.try_read(k, tb, /*is_buffer=*/true)) << at << k;
      EXPECT_TRUE(ta.scalar_type() == tb.scalar_type() && torch::equal(ta, tb)) << at << k;
    } else if (a.try_read(k, sa)) {
      ASSERT_TRUE(b.try_read(k, sb)) << at << k;
      expect_same_state(sa, sb, at + k + "/");
    } else {
      ASSERT_TRUE(a.try_read(k, va) && b.try_read(k, vb)) << at << k;
      EXPECT_EQ(c10::str(va), c10::str(vb)) << at << k;
    }
  }
}

void expect_same_state(const std::string& a, const std::string& b) {
  std::istringstream sa(a), sb(b);
  torch::serialize::InputArchive ia, ib;
  ia.load_from(sa);
  ib.load_from(sb);
  expect_same_state(ia, ib, "state ");
}

void expect_same(const Outcome& with, const Outcome& without, int64_t checkpoints) {
  EXPECT_EQ(with.checkpoints, checkpoints);  // not vacuous: the blocks were checkpointed
  EXPECT_EQ(without.checkpoints, 0);
  EXPECT_EQ(with.losses, without.losses);
  EXPECT_EQ(with.scales, without.scales);
  EXPECT_EQ(with.skipped, without.skipped);
  ASSERT_EQ(with.params.size(), without.params.size());
  for (size_t i = 0; i < with.params.size(); ++i)
    EXPECT_TRUE(torch::equal(with.params[i], without.params[i])) << "parameter " << i;
  ASSERT_EQ(with.moments.size(), without.moments.size());
  for (size_t i = 0; i < with.moments.size(); ++i)
    EXPECT_TRUE(torch::equal(with.moments[i], without.moments[i])) << "optimizer state " << i;
  if (!without.state.empty()) expect_same_state(with.state, without.state);
}

bool poisoned(int i) { return i == 3 || i == 4 || i == 40; }

// kSteps Trainer steps; the loss times inf at poisoned() steps where `poison`.
template <class Policy, class Opt = torch::optim::AdamW, class Options = torch::optim::AdamWOptions>
Outcome train(bool checkpointed, amp::TrainerOptions options = {}, bool poison = false,
              Options opt_options = Options(1e-2)) {
  Net net = make_net(checkpointed);
  Opt opt(net->parameters(), opt_options);
  auto scaler = [] {
    if constexpr (amp::detail::uses_loss_scaling_v<typename Policy::scaler_type>)
      return typename Policy::scaler_type(amp::DynamicScalerOptions().init_scale(1024.0).growth_interval(10));
    else
      return typename Policy::scaler_type();
  }();
  amp::Trainer<Policy, amp::CPU> trainer(net, opt, options.progress(false), std::move(scaler));
  torch::manual_seed(2);  // dropout's masks
  Outcome o;
  for (int i = 0; i < kSteps; ++i) {
    const auto r = trainer.step([&](auto&) {
      const torch::Tensor loss = loss_of(net, i);
      return poison && poisoned(i) ? loss * std::numeric_limits<double>::infinity() : loss;
    });
    o.losses.push_back(r.loss_value());
    o.skipped += r.skipped() ? 1 : 0;
    if constexpr (amp::detail::uses_loss_scaling_v<typename Policy::scaler_type>)
      o.scales.push_back(trainer.scaler().get_scale());
  }
  std::ostringstream state;
  trainer.save_state(state);
  o.state = state.str();
  finish(o, net, opt);
  return o;
}

TEST(CheckpointTraining, Bf16MixedTrainerIsBitwise) {
  expect_same(train<Bf16>(true), train<Bf16>(false), kSteps * kBlocks);
}

TEST(CheckpointTraining, Fp16MixedWithInjectedInfSkipsTheSameSteps) {
  using P = amp::Mixed<amp::fp16, amp::DynamicScaler>;
  if constexpr (amp::is_supported_v<P, amp::CPU>) {
    const Outcome with = train<P>(true, {}, true), without = train<P>(false, {}, true);
    expect_same(with, without, kSteps * kBlocks);
    EXPECT_GE(without.skipped, 3);  // the injected infs were skipped, and the scale moved both ways
    EXPECT_NE(*std::min_element(without.scales.begin(), without.scales.end()),
              *std::max_element(without.scales.begin(), without.scales.end()));
  } else {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << " has no fp16 autocast on CPU";
  }
}

TEST(CheckpointTraining, APrecisionMapWithNormsAndHeadInFp32IsBitwise) {
  const auto map = amp::PrecisionMap().type<torch::nn::LayerNormImpl>(MP::kFp32).path("head", MP::kFp32);
  const auto options = amp::TrainerOptions().region(amp::RegionOptions().precision_map(map));
  const Outcome with = train<Bf16>(true, options), without = train<Bf16>(false, options);
  expect_same(with, without, kSteps * kBlocks);
  EXPECT_NE(without.losses, train<Bf16>(false).losses);  // the map changes the numbers: the comparison can fail
}

TEST(CheckpointTraining, Float8DelayedScalingIsBitwiseStateIncluded) {
#if AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL
  using P = amp::Float8<amp::Delayed<4, 1>>;
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  const Outcome with =
      train<P, torch::optim::SGD>(true, amp::TrainerOptions().step(amp::StepOptions().fused(false)), false, sgd);
  const Outcome without =
      train<P, torch::optim::SGD>(false, amp::TrainerOptions().step(amp::StepOptions().fused(false)), false, sgd);
  expect_same(with, without, kSteps * kBlocks);  // save_state holds the amax histories and the scales
#else
  GTEST_SKIP() << "Float8 trains on CPU with a CPU _scaled_mm (LibTorch 2.8+)";
#endif
}

TEST(CheckpointTraining, AccumulationOverTwoMicroBatchesIsBitwise) {
  const auto options = amp::TrainerOptions().step(amp::StepOptions().accumulation_steps(2));
  const Outcome with = train<Bf16>(true, options), without = train<Bf16>(false, options);
  expect_same(with, without, kSteps * kBlocks);
}

TEST(CheckpointTraining, AdamW8bitIsBitwise) {
  const auto adamw = torch::optim::AdamWOptions(1e-2);
  expect_same(train<Bf16, amp::AdamW8bit>(true, {}, false, adamw), train<Bf16, amp::AdamW8bit>(false, {}, false, adamw),
              kSteps * kBlocks);
}

TEST(CheckpointTraining, FabricIsBitwise) {
  auto run = [](bool checkpointed) {
    Net net = make_net(checkpointed);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    amp::Fabric<Bf16, amp::CPU> fabric;
    fabric.setup(net, opt);
    torch::manual_seed(2);
    Outcome o;
    for (int i = 0; i < kSteps; ++i) {
      opt.zero_grad();
      const torch::Tensor loss = fabric.forward([&](auto&) { return loss_of(net, i); });
      fabric.backward(loss);
      fabric.optimizer_step(opt);
      fabric.update();
      o.losses.push_back(loss.item<double>());
    }
    std::ostringstream state;
    fabric.save_state(state);
    o.state = state.str();
    finish(o, net, opt);
    return o;
  };
  expect_same(run(true), run(false), kSteps * kBlocks);
}

TEST(CheckpointTraining, StepperInARegionByHandIsBitwise) {
  auto run = [](bool checkpointed) {
    Net net = make_net(checkpointed);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    amp::Stepper<amp::NoScaler> stepper(opt);
    torch::manual_seed(2);
    Outcome o;
    for (int i = 0; i < kSteps; ++i) {
      torch::Tensor loss;
      {
        amp::Region<Bf16, amp::CPU> region;
        loss = loss_of(net, i);
      }
      o.losses.push_back(stepper.step(loss).loss_value());
    }
    finish(o, net, opt);
    return o;
  };
  expect_same(run(true), run(false), kSteps * kBlocks);
}

}  // namespace
}  // namespace activation_checkpoint_training_test
