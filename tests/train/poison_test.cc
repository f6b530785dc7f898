// Random inf/NaN at scale: thousands of steps whose gradients are poisoned at
// random (inf or NaN; the loss, one gradient element, or several parameters'),
// under each scaler, the fused and unfused optimizer paths and the low-bit
// states. After every skipped step the parameters and the optimizer state are
// bitwise what they were before it; a clean step moves them; the scale follows
// torch's rule (GradScaler.update: a found inf multiplies the scale by
// backoff_factor and zeroes the tracker; growth_interval clean steps in a row
// multiply it by growth_factor), computed here on the side in double, where
// powers of two are exact.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../capture/optimizer_state.h"
#include "amp/detail/compat.h"
#include "amp/detail/compat_float8.h"
#include "amp/optim/low_bit_adam.h"
#include "amp/scaler/dynamic_scaler.h"
#include "amp/scaler/static_scaler.h"
#include "amp/train/stepper.h"

namespace poison_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

// Steps per configuration: 5,760 in all (5,040 on LibTorch < 2.1, without fp8 states).
constexpr int kSteps = 720;

struct Net {
  torch::nn::Sequential net;
  torch::Tensor x, y;
  explicit Net(uint64_t seed) {
    torch::manual_seed(seed);
    // Widths past the low-bit states' 256-element block, so blocks and tails both show.
    net = torch::nn::Sequential(torch::nn::Linear(24, 40), torch::nn::Tanh(), torch::nn::Linear(40, 3));
    x = torch::randn({32, 24});
    y = torch::randn({32, 3});
  }
};

struct Snapshot {
  std::vector<torch::Tensor> params;
  std::vector<std::vector<torch::Tensor>> state;
  std::vector<int64_t> counts;
};

Snapshot snapshot(torch::nn::Module& net, torch::optim::Optimizer& opt) {
  Snapshot s;
  for (const auto& p : net.parameters()) {
    s.params.push_back(p.detach().clone());
    auto [tensors, count] = amp_test::state_of(opt, p);
    std::vector<torch::Tensor> copies;
    for (const auto& t : tensors) copies.push_back(t.defined() ? t.clone() : t);
    s.state.push_back(std::move(copies));
    s.counts.push_back(count);
  }
  return s;
}

// "" when a and b are the same bits; else what differs.
std::string difference(const Snapshot& a, const Snapshot& b) {
  for (size_t i = 0; i < a.params.size(); ++i) {
    if (!a.params[i].equal(b.params[i])) return "parameter " + std::to_string(i);
    if (a.counts[i] != b.counts[i]) return "step count of parameter " + std::to_string(i);
    if (a.state[i].size() != b.state[i].size()) return "state entries of parameter " + std::to_string(i);
    for (size_t j = 0; j < a.state[i].size(); ++j)
      if (!amp_test::same_state_tensor(a.state[i][j], b.state[i][j]))
        return "state tensor " + std::to_string(j) + " of parameter " + std::to_string(i);
  }
  return "";
}

// torch's GradScaler.update, on the side.
struct ScaleRule {
  double scale, growth, backoff;
  int64_t interval, tracker = 0;
  void update(bool found_inf) {
    if (found_inf) {
      scale *= backoff;
      tracker = 0;
    } else if (++tracker == interval) {
      if (std::isfinite(scale * growth)) scale *= growth;
      tracker = 0;
    }
  }
};

// One poisoned-or-clean step's plan, drawn from a seeded engine.
struct Poison {
  bool on = false;
  double value = 0;  // inf, -inf or NaN
  int where = 0;     // 0: the loss; 1: one element of one gradient; 2: several parameters' gradients
  size_t param = 0;  // where == 1
  int64_t element = 0;
};

template <class Scaler>
void run(const std::string& what, torch::optim::Optimizer& opt, Net& n, Scaler scaler, bool fused,
         const ScaleRule* rule_in, uint32_t seed) {
  SCOPED_TRACE(what);
  amp::Stepper<Scaler> stepper(opt, amp::StepOptions().fused(fused), std::move(scaler));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double values[] = {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                           std::numeric_limits<double>::quiet_NaN()};
  const auto params = n.net->parameters();
  ScaleRule rule = rule_in ? *rule_in : ScaleRule{0, 0, 0, 0};
  int skipped = 0, clean = 0;
  for (int step = 0; step < kSteps; ++step) {
    Poison p;
    // The first steps are clean (the optimizer's state exists before any poison);
    // above 2^40 the poison rate rises, so the scale stays where fp32 gradients are finite.
    const double rate = rule_in && rule.scale > std::ldexp(1.0, 40) ? 0.9 : 0.3;
    p.on = step >= 3 && unit(rng) < rate;
    p.value = values[rng() % 3];
    p.where = static_cast<int>(rng() % 3);
    p.param = rng() % params.size();
    p.element = static_cast<int64_t>(rng() % static_cast<uint32_t>(params[p.param].numel()));
    std::vector<std::pair<torch::Tensor, unsigned>> hooks;
    if (p.on && p.where > 0) {
      for (size_t i = 0; i < params.size(); ++i) {
        if (p.where == 1 ? i != p.param : (rng() % 2 == 0 && i != p.param)) continue;
        const int64_t e = i == p.param ? p.element : 0;
        const double v = p.value;
        hooks.emplace_back(params[i], params[i].register_hook([e, v](torch::Tensor g) {
          g = g.clone();
          g.view(-1)[e] = v;
          return g;
        }));
      }
    }
    const Snapshot before = snapshot(*n.net, opt);
    torch::Tensor loss = torch::mse_loss(n.net->forward(n.x), n.y);
    if (p.on && p.where == 0) loss = loss * p.value;
    const amp::StepResult r = stepper.step(loss);
    for (auto& [t, h] : hooks) t.remove_hook(h);
    ASSERT_TRUE(r.optimizer_step);
    ASSERT_EQ(r.skipped(), p.on) << "step " << step << " poisoned " << p.on << " where " << p.where;
    const Snapshot after = snapshot(*n.net, opt);
    if (p.on) {
      ++skipped;
      ASSERT_EQ(difference(before, after), "") << "a skipped step changed state at step " << step;
    } else {
      ++clean;
      ASSERT_FALSE(before.params[0].equal(after.params[0])) << "a clean step left the weights at step " << step;
    }
    if (rule_in) {
      rule.update(p.on);
      ASSERT_EQ(stepper.scaler().get_scale(), rule.scale) << "step " << step;
    }
  }
  EXPECT_GT(skipped, kSteps / 5);
  EXPECT_GT(clean, kSteps / 3);
}

ScaleRule dynamic_rule() { return ScaleRule{1024.0, 2.0, 0.5, 3}; }
amp::DynamicScaler dynamic_scaler() {
  return amp::DynamicScaler(amp::DynamicScalerOptions().init_scale(1024.0).growth_interval(3));
}

TEST(Poison, DynamicScalerUnfusedAdam) {
  Net n(1);
  torch::optim::Adam opt(n.net->parameters(), torch::optim::AdamOptions(1e-3));
  const ScaleRule rule = dynamic_rule();
  run("Adam, unfused", opt, n, dynamic_scaler(), false, &rule, 11);
}

// Fused where the line has ATen's CPU fused kernels (2.4+); elsewhere this is
// the optimizer's own step under the same options, still to be skipped.
TEST(Poison, DynamicScalerFusedAdamW) {
  Net n(2);
  torch::optim::AdamW opt(n.net->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  const ScaleRule rule = dynamic_rule();
  run("AdamW, fused", opt, n, dynamic_scaler(), true, &rule, 12);
}

TEST(Poison, DynamicScalerFusedSgdMomentum) {
  Net n(3);
  torch::optim::SGD opt(n.net->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
  const ScaleRule rule = dynamic_rule();
  run("SGD momentum, fused", opt, n, dynamic_scaler(), true, &rule, 13);
}

TEST(Poison, StaticScalerAdam) {
  Net n(4);
  torch::optim::Adam opt(n.net->parameters(), torch::optim::AdamOptions(1e-3));
  run("Adam, static scale", opt, n, amp::StaticScaler(amp::StaticScalerOptions().scale(512.0)), false, nullptr, 14);
}

TEST(Poison, DynamicScalerAdamW8bit) {
  Net n(5);
  amp::AdamW8bit opt(n.net->parameters(), torch::optim::AdamWOptions(1e-3));
  const ScaleRule rule = dynamic_rule();
  run("AdamW8bit", opt, n, dynamic_scaler(), true, &rule, 15);
}

TEST(Poison, DynamicScalerAdamW4bitUnfusedLowBitPath) {
  Net n(6);
  amp::AdamW4bit opt(n.net->parameters(), torch::optim::AdamWOptions(1e-3), amp::LowBitOptions().fused(false));
  const ScaleRule rule = dynamic_rule();
  run("AdamW4bit, ATen ops", opt, n, dynamic_scaler(), true, &rule, 16);
}

TEST(Poison, StaticScalerAdamW8bitUnfusedStep) {
  Net n(7);
  amp::AdamW8bit opt(n.net->parameters(), torch::optim::AdamWOptions(1e-3));
  run("AdamW8bit, static scale, unfused", opt, n, amp::StaticScaler(amp::StaticScalerOptions().scale(256.0)), false,
      nullptr, 17);
}

#if AMP_DETAIL_HAS_FLOAT8_DTYPE  // fp8 optimizer states: LibTorch 2.1+
TEST(Poison, DynamicScalerAdamWFp8) {
  Net n(8);
  amp::AdamWFp8 opt(n.net->parameters(), torch::optim::AdamWOptions(1e-3));
  const ScaleRule rule = dynamic_rule();
  run("AdamWFp8", opt, n, dynamic_scaler(), true, &rule, 18);
}
#endif

}  // namespace
}  // namespace poison_test
