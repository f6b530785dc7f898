// tests/scaler/static_scaler_test.cc: StaticScaler, a fixed loss scale that still skips inf/NaN steps.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>
#include <vector>

#include "amp/scaler/static_scaler.h"
#include "../error_of.h"

namespace static_scaler_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

using amp_test::error_of;

struct Harness {
  torch::Tensor param = torch::zeros({4}, torch::requires_grad());
  torch::optim::SGD optimizer{std::vector<torch::Tensor>{param}, torch::optim::SGDOptions(1.0)};

  void iterate(amp::StaticScaler& scaler, float grad) {
    scaler.scale(torch::ones({}));
    param.mutable_grad() = torch::full({4}, grad);
    scaler.step(optimizer);
    scaler.update();
  }
};

TEST(StaticScaler, IsAScaler) {
  static_assert(amp::is_scaler_v<amp::StaticScaler>);
  static_assert(amp::detail::uses_loss_scaling_v<amp::StaticScaler>);
  amp::StaticScaler scaler;
  EXPECT_TRUE(scaler.is_enabled());
  EXPECT_EQ(scaler.get_scale(), 65536.0);
}

TEST(StaticScaler, ScaleIsConstantAndOverflowsAreSkipped) {
  amp::StaticScaler scaler(amp::StaticScalerOptions().scale(8.0));
  Harness h;
  EXPECT_EQ(scaler.scale(torch::full({}, 3.0f)).item<float>(), 24.0f);
  float expected = 0.0f;
  const float grads[] = {16.0f, kInf, 8.0f, -kInf, std::numeric_limits<float>::quiet_NaN(), 32.0f};
  for (float grad : grads) {
    h.iterate(scaler, grad);
    if (std::isfinite(grad)) {
      expected -= grad / 8.0f;  // unscaled, then SGD(lr=1)
      EXPECT_EQ(scaler.found_inf().item<float>(), 0.0f);
    } else {
      EXPECT_EQ(scaler.found_inf().item<float>(), 1.0f);
    }
    EXPECT_EQ(scaler.get_scale(), 8.0) << "the scale never changes";
    EXPECT_TRUE(torch::equal(h.param.detach(), torch::full({4}, expected)));
  }
  // Thousands of clean steps do not grow it either.
  for (int i = 0; i < 2500; ++i) {
    h.iterate(scaler, 8.0f);
  }
  EXPECT_EQ(scaler.get_scale(), 8.0);
}

TEST(StaticScaler, StateMachineErrorsAreGradScalers) {
  amp::StaticScaler scaler;
  Harness h;
  EXPECT_EQ(error_of([&] { scaler.update(); }),
            "Attempted update but _scale is None.  This may indicate your script did not use "
            "scaler.scale(loss or outputs) earlier in the iteration.");
  scaler.scale(torch::ones({}));
  EXPECT_EQ(error_of([&] { scaler.update(); }), "No inf checks were recorded prior to update.");
  Harness no_grads;  // (a failed step leaves its optimizer UNSCALED, as torch's does)
  EXPECT_EQ(error_of([&] { scaler.step(no_grads.optimizer); }), "No inf checks were recorded for this optimizer.");
  h.param.mutable_grad() = torch::ones({4});
  scaler.unscale_(h.optimizer);
  EXPECT_EQ(error_of([&] { scaler.unscale_(h.optimizer); }),
            "unscale_() has already been called on this optimizer since the last update().");
  scaler.step(h.optimizer);
  EXPECT_EQ(error_of([&] { scaler.step(h.optimizer); }), "step() has already been called since the last update().");
  EXPECT_EQ(error_of([&] { scaler.unscale_(h.optimizer); }), "unscale_() is being called after step().");
  scaler.update();
}

TEST(StaticScaler, StateDict) {
  amp::StaticScaler scaler(amp::StaticScalerOptions().scale(128.0));
  amp::StateDict state = scaler.state_dict();
  ASSERT_EQ(state.size(), 1u);
  EXPECT_TRUE(state.at("scale").isDouble());
  EXPECT_EQ(state.at("scale").toDouble(), 128.0);

  // Round trip into a fresh scaler, with and without a scale tensor, through pickle.
  for (bool lazy : {true, false}) {
    amp::StaticScaler other(amp::StaticScalerOptions().scale(2.0));
    if (!lazy) {
      other.scale(torch::ones({}));
    }
    const c10::IValue loaded = torch::pickle_load(torch::pickle_save(state));
    other.load_state_dict(c10::impl::toTypedDict<std::string, c10::IValue>(loaded.toGenericDict()));
    EXPECT_EQ(other.get_scale(), 128.0);
    EXPECT_EQ(other.scale(torch::ones({})).item<float>(), 128.0f);
  }

  // A GradScaler checkpoint loads: its current scale becomes the fixed one.
  amp::StateDict dynamic = state;
  dynamic.insert("growth_factor", 2.0);
  dynamic.insert("_growth_tracker", int64_t{5});
  dynamic.insert_or_assign("scale", 512.0);
  scaler.load_state_dict(dynamic);
  EXPECT_EQ(scaler.get_scale(), 512.0);

  amp::StaticScaler disabled(amp::StaticScalerOptions().enabled(false));
  EXPECT_EQ(disabled.state_dict().size(), 0u);
  EXPECT_EQ(error_of([&] { scaler.load_state_dict(disabled.state_dict()); }),
            "The source state dict is empty, possibly because it was saved from a disabled instance of "
            "StaticScaler.");
}

TEST(StaticScaler, Disabled) {
  amp::StaticScaler scaler(amp::StaticScalerOptions().enabled(false).scale(-1.0));  // not validated
  const torch::Tensor loss = torch::full({}, 3.0f);
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  EXPECT_EQ(scaler.get_scale(), 1.0);
  Harness h;
  h.param.mutable_grad() = torch::full({4}, 2.0f);
  scaler.step(h.optimizer);
  scaler.update();
  EXPECT_TRUE(torch::equal(h.param.detach(), torch::full({4}, -2.0f)));
  EXPECT_FALSE(scaler.found_inf().defined());
}

TEST(StaticScaler, OptionsAreValidated) {
  auto message = [](double scale) {
    return error_of([&] { amp::StaticScaler s(amp::StaticScalerOptions().scale(scale)); });
  };
  EXPECT_EQ(message(0.0), "amp: StaticScalerOptions::scale must be finite and > 0, got 0");
  EXPECT_EQ(message(-2.0), "amp: StaticScalerOptions::scale must be finite and > 0, got -2");
  EXPECT_EQ(message(std::numeric_limits<double>::infinity()),
            "amp: StaticScalerOptions::scale must be finite and > 0, got inf");
  EXPECT_EQ(message(1.0), "<no error>");
}

}  // namespace
}  // namespace static_scaler_test
