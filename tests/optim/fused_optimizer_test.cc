// amp/optim/fused.h: ATen's fused Adam/AdamW/SGD steps driven on LibTorch's own
// optimizer objects, checked against those optimizers' step(), against
// themselves with and without grad_scale/found_inf, for skipped steps, host
// syncs, and checkpoints in both directions. Every test runs on CPU and, where
// torch::cuda::is_available(), on CUDA. LibTorch < 2.4 has no CPU kernels:
// there fused_kind() must say kNone on CPU and the CPU cases skip.
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "amp/optim/fused.h"
#include "../scalar_reads.h"

namespace fused_optimizer_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

using amp::FusedKind;
using amp::FusedStep;
using amp::detail::fused_kind;
namespace compat = amp::detail::compat;

// --- parameters and gradients ------------------------------------------------

// Two param groups; odd sizes reach the kernels' scalar tails, a channels-last
// tensor checks that state and gradients follow the parameter's strides, a
// double one makes a second (device, dtype) call, and the last one never gets
// a gradient (no state, no step).
struct ParamSpec {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  bool channels_last;
  int group;
  bool gets_grad;
};
const std::vector<ParamSpec>& specs() {
  static const std::vector<ParamSpec> s = {
      {{17, 33}, at::kFloat, false, 0, true},    {{64}, at::kFloat, false, 0, true},
      {{2, 3, 4, 5}, at::kFloat, true, 0, true}, {{5, 3, 7}, at::kFloat, false, 1, true},
      {{1}, at::kFloat, false, 1, true},         {{9, 4}, at::kDouble, false, 1, true},
      {{3, 3}, at::kFloat, false, 1, false},
  };
  return s;
}

std::vector<at::Tensor> make_params(c10::DeviceType device) {
  torch::manual_seed(7);
  std::vector<at::Tensor> params;
  for (const auto& s : specs()) {
    at::Tensor p = torch::randn(s.sizes, torch::dtype(s.dtype)).to(device);
    if (s.channels_last) p = p.contiguous(at::MemoryFormat::ChannelsLast);
    params.push_back(p.requires_grad_(true));
  }
  return params;
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_(true));  // clone keeps strides
  return out;
}

// The gradients of step t, multiplied by `scale`, laid out as the parameters.
std::vector<at::Tensor> make_grads(const std::vector<at::Tensor>& params, int64_t t, double scale = 1.0) {
  torch::manual_seed(1000 + t);
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& s = specs()[i];
    at::Tensor g = torch::randn(s.sizes, torch::dtype(s.dtype));
    if (!s.gets_grad) {
      grads.emplace_back();
      continue;
    }
    if (scale != 1.0) g = g * scale;
    grads.push_back(at::empty_like(params[i]).copy_(g));
  }
  return grads;
}

void set_grads(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i].mutable_grad() = grads[i].defined() ? grads[i].clone() : at::Tensor();
}

// --- optimizer configurations ------------------------------------------------

using Groups = std::vector<torch::optim::OptimizerParamGroup>;

template <class Opt, class Options>
std::unique_ptr<torch::optim::Optimizer> make_opt(const std::vector<at::Tensor>& params, const Options& o0,
                                                  const Options& o1) {
  std::vector<at::Tensor> g0, g1;
  for (size_t i = 0; i < params.size(); ++i) (specs()[i].group == 0 ? g0 : g1).push_back(params[i]);
  Groups groups;
  groups.emplace_back(g0, std::make_unique<Options>(o0));
  groups.emplace_back(g1, std::make_unique<Options>(o1));
  return std::make_unique<Opt>(std::move(groups), o0);
}

struct Config {
  std::string name;
  FusedKind kind;
  std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<at::Tensor>&)> make;
};

// Group 1 always has other options than group 0: per-group options must be honoured.
const std::vector<Config>& configs() {
  using torch::optim::AdamOptions;
  using torch::optim::AdamWOptions;
  using torch::optim::SGDOptions;
  static const std::vector<Config> c = {
      {"adam", FusedKind::kAdam,
       [](const std::vector<at::Tensor>& p) {
         return make_opt<torch::optim::Adam>(p, AdamOptions(1e-2), AdamOptions(3e-3).betas({0.8, 0.99}));
       }},
      {"adam_l2", FusedKind::kAdam,
       [](const std::vector<at::Tensor>& p) {
         return make_opt<torch::optim::Adam>(p, AdamOptions(1e-2).weight_decay(0.1),
                                             AdamOptions(2e-2).weight_decay(0.01).eps(1e-6));
       }},
      {"adam_amsgrad", FusedKind::kAdam,
       [](const std::vector<at::Tensor>& p) {
         return make_opt<torch::optim::Adam>(p, AdamOptions(1e-2).amsgrad(true).weight_decay(0.01),
                                             AdamOptions(5e-3).amsgrad(true));
       }},
      {"adamw", FusedKind::kAdamW,
       [](const std::vector<at::Tensor>& p) {
         return make_opt<torch::optim::AdamW>(p, AdamWOptions(1e-2).weight_decay(0.05),
                                              AdamWOptions(3e-3).weight_decay(0.0));
       }},
      {"adamw_amsgrad", FusedKind::kAdamW,
       [](const std::vector<at::Tensor>& p) {
         return make_opt<torch::optim::AdamW>(p, AdamWOptions(1e-2).amsgrad(true),
                                              AdamWOptions(2e-3).amsgrad(true).weight_decay(0.1));
       }},
      {"sgd", FusedKind::kSgd,
       [](const std::vector<at::Tensor>& p) {
         return make_opt<torch::optim::SGD>(p, SGDOptions(0.1), SGDOptions(0.05));
       }},
      {"sgd_nesterov", FusedKind::kSgd,
       [](const std::vector<at::Tensor>& p) {
         return make_opt<torch::optim::SGD>(p, SGDOptions(0.05).momentum(0.9).nesterov(true),
                                            SGDOptions(0.02).momentum(0.5).nesterov(true).weight_decay(0.01));
       }},
      {"sgd_momentum_dampening", FusedKind::kSgd,
       [](const std::vector<at::Tensor>& p) {
         return make_opt<torch::optim::SGD>(p, SGDOptions(0.05).momentum(0.9).dampening(0.3),
                                            SGDOptions(0.1));  // group 1 without momentum
       }},
      {"sgd_weight_decay", FusedKind::kSgd,
       [](const std::vector<at::Tensor>& p) {
         return make_opt<torch::optim::SGD>(p, SGDOptions(0.1).weight_decay(0.05),
                                            SGDOptions(0.05).weight_decay(0.2).momentum(0.9));
       }},
  };
  return c;
}

// --- comparing runs ------------------------------------------------------------

struct StateView {
  bool present = false;
  int64_t step = 0;
  at::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer;
  std::vector<at::Tensor> tensors() const { return {exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer}; }
};

StateView state_of(torch::optim::Optimizer& opt, const at::Tensor& p) {
  StateView v;
  auto it = opt.state().find(compat::optim_state_key(p.unsafeGetTensorImpl()));
  if (it == opt.state().end()) return v;
  v.present = true;
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
    v.step = a->step();
    v.exp_avg = a->exp_avg();
    v.exp_avg_sq = a->exp_avg_sq();
    v.max_exp_avg_sq = a->max_exp_avg_sq();
  } else if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
    v.step = w->step();
    v.exp_avg = w->exp_avg();
    v.exp_avg_sq = w->exp_avg_sq();
    v.max_exp_avg_sq = w->max_exp_avg_sq();
  } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
    v.momentum_buffer = s->momentum_buffer();
  }
  return v;
}

// Same dtype, shape, strides and bits (NaN payloads and signed zeros included).
bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes() || a.strides() != b.strides()) return false;
  const at::ScalarType as_int = a.element_size() == 8 ? at::kLong : a.element_size() == 4 ? at::kInt : at::kShort;
  return torch::equal(a.view(as_int).cpu(), b.view(as_int).cpu());
}

// max |a - b| / max(1, max |b|), in double.
double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() && !b.defined()) return 0.0;
  if (a.defined() != b.defined() || a.sizes() != b.sizes()) return std::numeric_limits<double>::infinity();
  const at::Tensor x = a.detach().to(at::kCPU, at::kDouble), y = b.detach().to(at::kCPU, at::kDouble);
  if (x.numel() == 0) return 0.0;
  return (x - y).abs().max().item<double>() / std::max(1.0, y.abs().max().item<double>());
}

// One training run: parameters, the LibTorch optimizer, and (fused runs) its FusedStep.
struct Trial {
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::unique_ptr<FusedStep> fused;

  Trial(const Config& c, std::vector<at::Tensor> p, bool use_fused) : params(std::move(p)), opt(c.make(params)) {
    if (use_fused) fused = std::make_unique<FusedStep>(*opt);
  }
  // A step on the gradients of step t (times scale) through the fused path,
  // or the optimizer's own step() when this run is not fused.
  void step(int64_t t, double scale = 1.0, const at::Tensor& grad_scale = {}, const at::Tensor& found_inf = {}) {
    set_grads(params, make_grads(params, t, scale));
    if (fused) {
      fused->step(grad_scale, found_inf);
    } else {
      opt->step();
    }
  }
};

// Everything observable of a run, cloned: per parameter its value, its state
// entry (present, step(), tensors) and FusedStep's device counter.
struct Snapshot {
  struct Param {
    at::Tensor value, counter;
    bool present = false;
    int64_t step = 0;
    std::vector<at::Tensor> state;
  };
  std::vector<Param> params;
  size_t entries = 0;
};
at::Tensor clone_or_undefined(const at::Tensor& t) { return t.defined() ? t.clone() : t; }
Snapshot snapshot(Trial& r) {
  Snapshot s;
  s.entries = r.opt->state().size();
  for (const auto& p : r.params) {
    const StateView v = state_of(*r.opt, p);
    Snapshot::Param sp;
    sp.value = p.detach().clone();
    sp.counter = clone_or_undefined(r.fused ? r.fused->step_count(p) : at::Tensor());
    sp.present = v.present;
    sp.step = v.step;
    for (const auto& t : v.tensors()) sp.state.push_back(clone_or_undefined(t));
    s.params.push_back(std::move(sp));
  }
  return s;
}

::testing::AssertionResult same_bits(const Snapshot& a, const Snapshot& b) {
  if (a.entries != b.entries)
    return ::testing::AssertionFailure() << "state entries " << a.entries << " vs " << b.entries;
  for (size_t i = 0; i < a.params.size(); ++i) {
    const Snapshot::Param &x = a.params[i], &y = b.params[i];
    if (!bitwise_equal(x.value, y.value))
      return ::testing::AssertionFailure() << "param " << i << " differs (rel " << rel_diff(x.value, y.value) << ")";
    if (x.present != y.present || x.step != y.step)
      return ::testing::AssertionFailure() << "state entry or step() of param " << i << " differs";
    if (!bitwise_equal(x.counter, y.counter)) return ::testing::AssertionFailure() << "step counter of param " << i;
    for (size_t k = 0; k < x.state.size(); ++k)
      if (!bitwise_equal(x.state[k], y.state[k]))
        return ::testing::AssertionFailure() << "state tensor " << k << " of param " << i << " differs (rel "
                                             << rel_diff(x.state[k], y.state[k]) << ")";
  }
  return ::testing::AssertionSuccess();
}

// What a skipped step may do: nothing, except make the state entries that
// LibTorch's first step makes for parameters that had none (zero moments,
// step 0, counter 0; a zero momentum buffer), since whether the step ran is
// known only on the device; sync_optimizer_state() removes them again.
::testing::AssertionResult unchanged_by_skip(const Snapshot& before, const Snapshot& after) {
  Snapshot expected = before;
  for (size_t i = 0; i < before.params.size(); ++i) {
    const Snapshot::Param &b = before.params[i], &a = after.params[i];
    if (b.present || !a.present) continue;
    if (a.step != 0) return ::testing::AssertionFailure() << "new entry of param " << i << " has step " << a.step;
    if (a.counter.defined() && a.counter.item<float>() != 0.f)
      return ::testing::AssertionFailure() << "new counter of param " << i << " is not 0";
    for (const auto& t : a.state)
      if (t.defined() && t.count_nonzero().item<int64_t>() != 0)
        return ::testing::AssertionFailure() << "new state of param " << i << " is not zero";
    expected.params[i] = a;
    ++expected.entries;
  }
  return same_bits(expected, after);
}

// Parameters and state of two runs: the largest relative difference, and
// whether the state has the same entries, classes, defined tensors and strides.
double compare_close(Trial& a, Trial& b, std::string* structure_error) {
  double worst = 0.0;
  if (a.opt->state().size() != b.opt->state().size())
    *structure_error =
        "state sizes " + std::to_string(a.opt->state().size()) + " vs " + std::to_string(b.opt->state().size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    worst = std::max(worst, rel_diff(a.params[i], b.params[i]));
    const StateView x = state_of(*a.opt, a.params[i]), y = state_of(*b.opt, b.params[i]);
    if (x.present != y.present) *structure_error = "state presence of param " + std::to_string(i);
    const auto xs = x.tensors(), ys = y.tensors();
    for (size_t k = 0; k < xs.size(); ++k) {
      if (xs[k].defined() != ys[k].defined() ||
          (xs[k].defined() && (xs[k].strides() != ys[k].strides() || xs[k].strides() != a.params[i].strides())))
        *structure_error = "state tensor " + std::to_string(k) + " of param " + std::to_string(i);
      worst = std::max(worst, rel_diff(xs[k], ys[k]));
    }
  }
  return worst;
}

at::Tensor flag(double v, c10::DeviceType device) {
  return torch::scalar_tensor(v, torch::dtype(at::kFloat).device(device));
}

// Writes v into element `linear` (in logical row-major order) of g, whatever g's strides.
void poison(const at::Tensor& g, int64_t linear, double v) {
  at::Tensor e = g;
  std::vector<int64_t> index(static_cast<size_t>(g.dim()));
  for (int64_t d = g.dim() - 1; d >= 0; --d) {
    index[static_cast<size_t>(d)] = linear % g.size(d);
    linear /= g.size(d);
  }
  for (int64_t i : index) e = e.select(0, i);
  e.fill_(v);
}

// --- device fixture ------------------------------------------------------------

class Fused : public ::testing::TestWithParam<c10::DeviceType> {
 protected:
  void SetUp() override {
    device_ = GetParam();
    if (device_ == c10::DeviceType::CUDA && !torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
    if (device_ == c10::DeviceType::CPU && !compat::kCpuHasFusedOptimizers) {
      // What this LibTorch must say instead (FusedKind checks the details).
      auto params = make_params(device_);
      for (const auto& c : configs()) EXPECT_EQ(fused_kind(*c.make(params), device_), FusedKind::kNone) << c.name;
      GTEST_SKIP() << "LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR
                   << " has no CPU fused optimizer kernels (they come with 2.4); fused_kind() says kNone on CPU";
    }
  }
  // The configurations this LibTorch has kernels for on the device (1.13 CUDA: Adam only).
  std::vector<Config> supported() {
    std::vector<Config> out;
    auto params = make_params(device_);
    for (const auto& c : configs()) {
      const FusedKind k = fused_kind(*c.make(params), device_);
      if (k == FusedKind::kNone) {
        std::printf("[ info ] %s: no fused kernel on %s in this LibTorch\n", c.name.c_str(),
                    c10::DeviceTypeName(device_).c_str());
        continue;
      }
      EXPECT_EQ(k, c.kind) << c.name;
      out.push_back(c);
    }
    return out;
  }
  c10::DeviceType device_ = c10::DeviceType::CPU;
};

// --- what fused_kind says -------------------------------------------------------

// compat::optim_state_key finds the entries LibTorch's own step makes (std::string
// keys in 1.13, void* from 2.0): checked here on every LibTorch, kernels or not.
TEST(FusedKind, StateKeyFindsLibTorchsOwnEntries) {
  auto params = make_params(c10::DeviceType::CPU);
  auto opt = configs()[0].make(params);
  set_grads(params, make_grads(params, 0));
  opt->step();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(state_of(*opt, params[i]).present, specs()[i].gets_grad) << i;
}

// ATen's CPU fused SGD skips the vectorized blocks of fp16/bf16 parameters
// before pytorch#192545 (pytorch#191763; compat::kCpuFusedSgdUpdatesHalfTypes):
// amp must not take it there, and takes it where the kernel has the fix.
TEST(FusedKind, CpuFusedSgdForHalfTypesOnlyWithTheKernelFix) {
  if (!compat::has_fused_op(compat::FusedOp::kSgd, c10::DeviceType::CPU)) GTEST_SKIP() << "no CPU fused SGD";
  if (compat::kCpuFusedSgdUpdatesHalfTypes) {
    for (const auto dtype : {at::kBFloat16, at::kHalf}) {
      at::Tensor p = torch::ones({64}, dtype).requires_grad_();
      torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1).momentum(0.9));
      EXPECT_EQ(fused_kind(sgd, c10::DeviceType::CPU), FusedKind::kSgd) << dtype;
      FusedStep fused(sgd);
      p.mutable_grad() = torch::ones({64}, dtype);
      fused.step();
      // 1 - 0.1 * 1 in every element, the vectorized blocks included.
      EXPECT_TRUE(torch::equal(p, torch::full({64}, 0.9, dtype))) << dtype << ": " << p;
    }
    return;
  }
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    at::Tensor p = torch::ones({64}, dtype).requires_grad_();
    torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1).momentum(0.9));
    EXPECT_EQ(fused_kind(sgd, c10::DeviceType::CPU), FusedKind::kNone) << dtype;
    p.mutable_grad() = torch::ones({64}, dtype);
    // A FusedStep made while the parameters were fp32 refuses them later.
    at::Tensor q = torch::ones({64}).requires_grad_();
    torch::optim::SGD later({q}, torch::optim::SGDOptions(0.1));
    FusedStep fused(later);
    {
      torch::NoGradGuard no_grad;
      q.set_data(q.to(dtype));
    }
    q.mutable_grad() = torch::ones({64}, dtype);
    try {
      fused.step();
      ADD_FAILURE() << "stepped " << dtype;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("pytorch#191763"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(torch::equal(q, torch::ones({64}, dtype))) << "nothing stepped";
  }
  // The kernel itself, so that this test says when a LibTorch has the fix.
  at::Tensor p = torch::ones({64}, at::kBFloat16), g = torch::full({64}, 0.5, at::kBFloat16);
  amp::detail::fused::sgd_({p}, {g}, {}, 0.0, 0.0, 0.1, 0.0, false, false, false, c10::nullopt, c10::nullopt);
  EXPECT_TRUE(torch::equal(p, torch::ones({64}, at::kBFloat16)))
      << "this LibTorch's CPU fused SGD updates bf16 parameters: pytorch#191763 is fixed in it; lower "
         "compat::kCpuFusedSgdUpdatesHalfTypes's version threshold to this release";
}

TEST(FusedKind, ReportsWhatThisLibTorchHas) {
  auto params = make_params(c10::DeviceType::CPU);
  for (const auto& c : configs()) {
    auto opt = c.make(params);
    const compat::FusedOp op = c.kind == FusedKind::kAdam    ? compat::FusedOp::kAdam
                               : c.kind == FusedKind::kAdamW ? compat::FusedOp::kAdamW
                                                             : compat::FusedOp::kSgd;
    const FusedKind on_cpu = fused_kind(*opt, c10::DeviceType::CPU);
    EXPECT_EQ(on_cpu, compat::has_fused_op(op, c10::DeviceType::CPU) ? c.kind : FusedKind::kNone) << c.name;
    EXPECT_EQ(fused_kind(*opt, c10::DeviceType::MPS), FusedKind::kNone) << c.name;
    if (torch::cuda::is_available()) {
      EXPECT_EQ(fused_kind(*opt, c10::DeviceType::CUDA),
                compat::has_fused_op(op, c10::DeviceType::CUDA) ? c.kind : FusedKind::kNone)
          << c.name;
    }
    if (on_cpu == FusedKind::kNone) {
      try {
        FusedStep fused(*opt);
        ADD_FAILURE() << c.name << ": FusedStep accepted CPU parameters without a CPU kernel";
      } catch (const c10::Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("amp: FusedStep"), std::string::npos) << what;
        EXPECT_NE(what.find("has no CPU kernel"), std::string::npos) << what;
      }
    }
  }
  // Other optimizer classes have no fused kernel.
  torch::optim::RMSprop rmsprop(params, torch::optim::RMSpropOptions(1e-2));
  EXPECT_EQ(fused_kind(rmsprop, c10::DeviceType::CPU), FusedKind::kNone);
  EXPECT_EQ(fused_kind(rmsprop, c10::DeviceType::CUDA), FusedKind::kNone);
  try {
    FusedStep fused(rmsprop);
    ADD_FAILURE() << "FusedStep accepted an RMSprop";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Adam, AdamW and SGD only"), std::string::npos) << e.what();
  }
  if (!compat::kCpuHasFusedOptimizers) return;
  // Dtypes: the kernels take floating types; an int or complex parameter means kNone.
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16, at::kDouble}) {
    torch::optim::Adam adam({torch::zeros({3}, torch::dtype(dtype))});
    EXPECT_EQ(fused_kind(adam, c10::DeviceType::CPU), FusedKind::kAdam) << dtype;
  }
  for (at::ScalarType dtype : {at::kInt, at::kComplexFloat}) {
    torch::optim::SGD sgd({torch::zeros({3}, torch::dtype(at::kFloat)), torch::zeros({3}, torch::dtype(dtype))},
                          torch::optim::SGDOptions(0.1));
    EXPECT_EQ(fused_kind(sgd, c10::DeviceType::CPU), FusedKind::kNone) << dtype;
    try {
      FusedStep fused(sgd);
      ADD_FAILURE() << "FusedStep accepted a " << dtype << " parameter";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("parameter 1 of param group 0 has dtype"), std::string::npos) << e.what();
    }
  }
}

// A gradient laid out otherwise than its parameter is refused before any kernel
// runs (the CPU kernels would read it in the parameter's order), and the state
// entries made for that step are taken back.
TEST_P(Fused, RefusesAGradientWithOtherStridesAndChangesNothing) {
  for (const auto& c : supported()) {
    SCOPED_TRACE(c.name);
    Trial r(c, make_params(device_), true);
    set_grads(r.params, make_grads(r.params, 0));
    // Parameter 3 (group 1): group 0's state entries are made before the error and must be taken back.
    r.params[3].mutable_grad() = r.params[3].grad().transpose(0, 2).contiguous().transpose(0, 2);
    const Snapshot before = snapshot(r);
    try {
      r.fused->step(at::Tensor(), at::Tensor());
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("is not laid out as the parameter"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(same_bits(before, snapshot(r)));
  }
}

// --- against LibTorch's own step ------------------------------------------------

// 25 steps of the fused path and of the optimizer's own step() on the same
// gradients: parameters and state agree to fp32 rounding, the state has the
// same entries, classes and layouts, and the step counts agree after a sync.
TEST_P(Fused, MatchesLibTorchsOwnStep) {
  constexpr int kSteps = 25;
  constexpr double kBound = 1e-6;
  for (const auto& c : supported()) {
    SCOPED_TRACE(c.name);
    const auto init = make_params(device_);
    Trial ref(c, clone_params(init), false), fused(c, clone_params(init), true);
    double worst = 0.0;
    for (int t = 0; t < kSteps; ++t) {
      ref.step(t);
      fused.step(t);
      std::string structure;
      worst = std::max(worst, compare_close(ref, fused, &structure));
      ASSERT_TRUE(structure.empty()) << "after step " << t << ": " << structure;
    }
    EXPECT_LE(worst, kBound);
    std::printf("[ info ] %s on %s: %d steps, largest relative difference to LibTorch's step(): %.3g\n", c.name.c_str(),
                c10::DeviceTypeName(device_).c_str(), kSteps, worst);
    fused.fused->sync_optimizer_state();
    for (size_t i = 0; i < init.size(); ++i) {
      const StateView x = state_of(*ref.opt, ref.params[i]), y = state_of(*fused.opt, fused.params[i]);
      EXPECT_EQ(x.present, y.present) << i;
      EXPECT_EQ(x.step, y.step) << i;
      if (c.kind != FusedKind::kSgd && specs()[i].gets_grad) {
        EXPECT_EQ(y.step, kSteps) << i;
      }
    }
    EXPECT_EQ(ref.opt->state().size(), fused.opt->state().size());
  }
}

// --- grad_scale ---------------------------------------------------------------------

// Gradients multiplied by S with grad_scale = S (and found_inf = 0) give what
// gradients without scaling and without grad_scale give: on CPU bit for bit
// when S is a power of two (g * S / S == g), to rounding otherwise. On CUDA
// to rounding only: there the Adam-with-L2 and SGD kernels round differently
// with a grad_scale than without even for S = 2**k (torch 2.11's Python
// Adam/SGD(fused=True) on an H100 show the same), the others are bit for bit.
// The gradients are left unscaled, as torch's kernels leave them.
TEST_P(Fused, GradScaleUnscalesInsideTheKernel) {
  constexpr int kSteps = 20;
  for (const auto& c : supported()) {
    for (double scale : {65536.0, 1000.5}) {
      SCOPED_TRACE(c.name + " scale " + std::to_string(scale));
      const bool exact = scale == 65536.0;
      const auto init = make_params(device_);
      Trial plain(c, clone_params(init), true), scaled(c, clone_params(init), true);
      double worst = 0.0;
      bool bitwise = true;
      for (int t = 0; t < kSteps; ++t) {
        plain.step(t);
        scaled.step(t, scale, flag(scale, device_), flag(0.0, device_));
        for (size_t i = 0; i < init.size(); ++i) {
          if (!specs()[i].gets_grad) continue;
          if (exact) {
            ASSERT_TRUE(bitwise_equal(plain.params[i].grad(), scaled.params[i].grad())) << "grad " << i;
          } else {
            worst = std::max(worst, rel_diff(scaled.params[i].grad(), plain.params[i].grad()));
          }
        }
        if (exact && device_ == c10::DeviceType::CPU) {
          ASSERT_TRUE(same_bits(snapshot(plain), snapshot(scaled))) << "after step " << t;
        } else {
          if (exact && bitwise && !same_bits(snapshot(plain), snapshot(scaled))) bitwise = false;
          std::string structure;
          worst = std::max(worst, compare_close(plain, scaled, &structure));
          ASSERT_TRUE(structure.empty()) << structure;
        }
      }
      if (!exact || device_ != c10::DeviceType::CPU) {
        EXPECT_LE(worst, 1e-6);
        std::printf("[ info ] %s on %s, grad_scale %g: largest relative difference %.3g%s\n", c.name.c_str(),
                    c10::DeviceTypeName(device_).c_str(), scale, worst,
                    exact ? (bitwise ? " (bitwise equal)" : " (not bitwise equal)") : "");
      }
    }
  }
}

// --- skipped steps -------------------------------------------------------------------

// SGD with momentum whose first steps were skipped keeps one pending flag per
// kernel call: with two param groups (two calls), the second group must still
// take its first-step update (buffer = gradient) when the first clean step
// comes, as a run that never saw the skipped steps does. (The flag was once
// one tensor shared by every call, updated in place by the first.)
TEST_P(Fused, SgdGroupsEachTakeTheirFirstStepAfterSkippedSteps) {
  const auto make = [](const std::vector<at::Tensor>& p) {
    using torch::optim::SGDOptions;
    return make_opt<torch::optim::SGD>(p, SGDOptions(0.05).momentum(0.9).dampening(0.3),
                                       SGDOptions(0.1).momentum(0.9).dampening(0.3));
  };
  const Config c{"sgd_two_groups_dampening", FusedKind::kSgd, make};
  const auto init = make_params(device_);
  Trial main(c, clone_params(init), true), ref(c, clone_params(init), true);
  for (int t = 0; t < 2; ++t) {  // skipped: inf in the gradients, found_inf = 1
    auto grads = make_grads(main.params, t, 8.0);
    poison(grads[0], 3, std::numeric_limits<double>::infinity());
    set_grads(main.params, grads);
    main.fused->step(flag(8.0, device_), flag(1.0, device_));
  }
  for (int t = 2; t < 5; ++t) {
    main.step(t, 8.0, flag(8.0, device_), flag(0.0, device_));
    ref.step(t, 8.0, flag(8.0, device_));
    EXPECT_TRUE(same_bits(snapshot(main), snapshot(ref))) << "step " << t;
  }
}

// found_inf = 1 (with inf or NaN in the gradients, and a grad_scale) changes no
// bit of the parameters, the state, the step counters or the gradients. On the
// very first step it leaves no state behind once synced.
TEST_P(Fused, ASkippedStepChangesNothing) {
  for (const auto& c : supported()) {
    for (double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
      SCOPED_TRACE(c.name + (std::isnan(bad) ? " nan" : " inf"));
      Trial r(c, make_params(device_), true);
      // First step skipped: nothing may change.
      {
        const Snapshot before = snapshot(r);
        auto grads = make_grads(r.params, 0, 1024.0);
        poison(grads[1], 5, bad);
        set_grads(r.params, grads);
        r.fused->step(flag(1024.0, device_), flag(1.0, device_));
        for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(bitwise_equal(r.params[i].grad(), grads[i])) << i;
        EXPECT_TRUE(unchanged_by_skip(before, snapshot(r)));
        r.fused->sync_optimizer_state();
        EXPECT_TRUE(same_bits(before, snapshot(r)));
        EXPECT_EQ(r.opt->state().size(), 0u);
      }
      for (int t = 1; t <= 3; ++t) r.step(t, 1024.0, flag(1024.0, device_), flag(0.0, device_));
      for (int t = 4; t <= 6; ++t) {
        const Snapshot before = snapshot(r);
        auto grads = make_grads(r.params, t, 1024.0);
        poison(grads[static_cast<size_t>(t) % 4], 7, bad);
        set_grads(r.params, grads);
        r.fused->step(flag(1024.0, device_), flag(1.0, device_));
        EXPECT_TRUE(same_bits(before, snapshot(r))) << "step " << t;
        for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(bitwise_equal(r.params[i].grad(), grads[i])) << i;
      }
      r.fused->sync_optimizer_state();
      for (size_t i = 0; i < r.params.size(); ++i) {
        const StateView v = state_of(*r.opt, r.params[i]);
        if (c.kind != FusedKind::kSgd && specs()[i].gets_grad) {
          EXPECT_EQ(v.step, 3) << i;
        }
      }
    }
  }
}

// ~3000 steps over all configurations with inf/NaN put into random gradients
// on random steps (the first steps of some runs included), gradients scaled by
// a random power of two with that grad_scale: each skipped step changes
// nothing, and the run ends bit for bit where a run that never saw the
// skipped steps ends (the same scaled gradients and grad_scale, no found_inf),
// synced or not in between; and within rounding of LibTorch's own step() on
// the unscaled gradients of the same clean steps.
TEST_P(Fused, RandomInfNanStepsMatchARunWithoutThem) {
  constexpr int kStepsPerConfig = 336;  // x 9 configurations
  std::mt19937 rng(2024);
  int total = 0, skipped = 0;
  double worst = 0.0;
  const auto cs = supported();
  for (size_t ci = 0; ci < cs.size(); ++ci) {
    const Config& c = cs[ci];
    SCOPED_TRACE(c.name);
    const auto init = make_params(device_);
    Trial main(c, clone_params(init), true), ref(c, clone_params(init), true), own(c, clone_params(init), false);
    const int skip_first = static_cast<int>(ci % 3);  // 0, 1 or 2 skipped steps at the start
    for (int t = 0; t < kStepsPerConfig; ++t, ++total) {
      const bool skip = t < skip_first || std::uniform_real_distribution<double>(0, 1)(rng) < 0.25;
      const double scale = std::ldexp(1.0, std::uniform_int_distribution<int>(0, 16)(rng));
      auto grads = make_grads(main.params, t, scale);
      if (skip) {
        ++skipped;
        size_t victim = std::uniform_int_distribution<size_t>(0, grads.size() - 2)(rng);  // the last has no grad
        const int64_t n = grads[victim].numel();
        const double bad = rng() % 2 ? std::numeric_limits<double>::quiet_NaN()
                                     : (rng() % 2 ? 1.0 : -1.0) * std::numeric_limits<double>::infinity();
        poison(grads[victim], std::uniform_int_distribution<int64_t>(0, n - 1)(rng), bad);
      }
      const Snapshot before = skip ? snapshot(main) : Snapshot{};
      set_grads(main.params, grads);
      main.fused->step(flag(scale, device_), flag(skip ? 1.0 : 0.0, device_));
      if (skip) {
        ASSERT_TRUE(unchanged_by_skip(before, snapshot(main))) << "skipped step " << t;
        continue;
      }
      ref.step(t, scale, flag(scale, device_));  // the same scaled gradients, no found_inf
      own.step(t);
      if (t % 37 == 0) {  // a sync now and then must not change the outcome
        main.fused->sync_optimizer_state();
        ref.fused->sync_optimizer_state();
        ASSERT_TRUE(same_bits(snapshot(main), snapshot(ref))) << "after sync at step " << t;
      }
    }
    ASSERT_TRUE(same_bits(snapshot(main), snapshot(ref))) << "end, unsynced";
    main.fused->sync_optimizer_state();
    ref.fused->sync_optimizer_state();
    ASSERT_TRUE(same_bits(snapshot(main), snapshot(ref))) << "end, synced";
    std::string structure;
    const double d = compare_close(own, main, &structure);
    EXPECT_TRUE(structure.empty()) << structure;
    EXPECT_LE(d, 1e-5);
    worst = std::max(worst, d);
    for (size_t i = 0; i < init.size(); ++i)
      EXPECT_EQ(state_of(*own.opt, own.params[i]).step, state_of(*main.opt, main.params[i]).step) << i;
  }
  std::printf("[ info ] %s: %d steps, %d skipped; largest relative difference to LibTorch's step(): %.3g\n",
              c10::DeviceTypeName(device_).c_str(), total, skipped, worst);
}

// --- no host sync -----------------------------------------------------------------------

TEST_P(Fused, TwentyStepsReadNothingBackToTheHost) {
  for (const auto& c : supported()) {
    SCOPED_TRACE(c.name);
    Trial r(c, make_params(device_), true);
    std::vector<std::vector<at::Tensor>> grads;
    for (int t = 0; t < 20; ++t) grads.push_back(make_grads(r.params, t, 256.0));
    const at::Tensor scale = flag(256.0, device_), clean = flag(0.0, device_), inf = flag(1.0, device_);
    {
      ScalarReads reads;
      (void)scale.item<float>();  // the counter works
      ASSERT_EQ(ScalarReads::outside, 2) << "RecordFunction callbacks did not see item()";
      ScalarReads::outside = 0;
      for (int t = 0; t < 20; ++t) {
        set_grads(r.params, grads[static_cast<size_t>(t)]);
        r.fused->step(scale, t % 7 == 3 ? inf : clean);
      }
      EXPECT_EQ(ScalarReads::outside, 0);
      std::printf("[ info ] %s on %s: 20 steps, %lld scalar reads outside the kernels, %lld inside them\n",
                  c.name.c_str(), c10::DeviceTypeName(device_).c_str(), static_cast<long long>(ScalarReads::outside),
                  static_cast<long long>(ScalarReads::inside));
    }
  }
}

// --- checkpoints ------------------------------------------------------------------------

std::string save(torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive archive;
  opt.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}
void load(torch::optim::Optimizer& opt, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  opt.load(archive);
}

// Fused -> save -> load into a fresh optimizer (a fresh FusedStep, or the old
// one after reload_optimizer_state()) -> fused: bit for bit the uninterrupted
// fused run. The same from a checkpoint of the optimizer's own steps into the
// fused path, and from the fused path into the optimizer's own steps.
TEST_P(Fused, CheckpointsRoundTripBetweenFusedAndUnfused) {
  constexpr int kBefore = 12, kAfter = 12;
  const at::Tensor scale = flag(4096.0, device_), clean = flag(0.0, device_), inf = flag(1.0, device_);
  auto fused_steps = [&](Trial& r, int from, int to) {
    for (int t = from; t < to; ++t) r.step(t, 4096.0, scale, t == 5 ? inf : clean);  // step 5 is skipped
  };
  for (const auto& c : supported()) {
    SCOPED_TRACE(c.name);
    const auto init = make_params(device_);
    // Fused -> fused.
    {
      Trial a(c, clone_params(init), true);
      fused_steps(a, 0, kBefore);
      a.fused->sync_optimizer_state();
      for (size_t i = 0; i < init.size(); ++i)
        if (c.kind != FusedKind::kSgd && specs()[i].gets_grad) {
          EXPECT_EQ(state_of(*a.opt, a.params[i]).step, kBefore - 1) << i;
        }
      const std::string bytes = save(*a.opt);
      Trial b(c, clone_params(a.params), false);
      load(*b.opt, bytes);
      b.fused = std::make_unique<FusedStep>(*b.opt);
      Trial d(c, clone_params(a.params), true);  // a FusedStep that existed before the load
      d.step(100);                               // ... and stepped, so it has device state to forget
      for (size_t i = 0; i < init.size(); ++i) d.params[i].detach().copy_(a.params[i]);
      load(*d.opt, bytes);
      d.fused->reload_optimizer_state();
      fused_steps(a, kBefore, kBefore + kAfter);
      fused_steps(b, kBefore, kBefore + kAfter);
      fused_steps(d, kBefore, kBefore + kAfter);
      EXPECT_TRUE(same_bits(snapshot(a), snapshot(b))) << "fresh FusedStep";
      a.fused->sync_optimizer_state();
      b.fused->sync_optimizer_state();
      d.fused->sync_optimizer_state();
      EXPECT_TRUE(same_bits(snapshot(a), snapshot(b))) << "fresh FusedStep, synced";
      EXPECT_TRUE(same_bits(snapshot(a), snapshot(d))) << "reload_optimizer_state, synced";
    }
    // Unfused -> fused.
    {
      Trial a(c, clone_params(init), false);
      for (int t = 0; t < kBefore; ++t) a.step(t);
      const std::string bytes = save(*a.opt);
      Trial b(c, clone_params(a.params), false);
      load(*b.opt, bytes);
      a.fused = std::make_unique<FusedStep>(*a.opt);  // the uninterrupted run goes on fused
      b.fused = std::make_unique<FusedStep>(*b.opt);
      fused_steps(a, kBefore, kBefore + kAfter);
      fused_steps(b, kBefore, kBefore + kAfter);
      a.fused->sync_optimizer_state();
      b.fused->sync_optimizer_state();
      EXPECT_TRUE(same_bits(snapshot(a), snapshot(b)));
      for (size_t i = 0; i < init.size(); ++i)
        if (c.kind != FusedKind::kSgd && specs()[i].gets_grad) {
          EXPECT_EQ(state_of(*b.opt, b.params[i]).step, kBefore + kAfter) << i;
        }
    }
    // Fused -> unfused.
    {
      Trial a(c, clone_params(init), true);
      fused_steps(a, 0, kBefore);
      a.fused->sync_optimizer_state();
      const std::string bytes = save(*a.opt);
      Trial b(c, clone_params(a.params), false);
      load(*b.opt, bytes);
      a.fused.reset();  // the uninterrupted run goes on with the optimizer's own step()
      for (int t = kBefore; t < kBefore + kAfter; ++t) {
        a.step(t);
        b.step(t);
      }
      EXPECT_TRUE(same_bits(snapshot(a), snapshot(b)));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, Fused, ::testing::Values(c10::DeviceType::CPU, c10::DeviceType::CUDA),
                         [](const ::testing::TestParamInfo<c10::DeviceType>& info) {
                           return info.param == c10::DeviceType::CUDA ? std::string("CUDA") : std::string("CPU");
                         });

}  // namespace
}  // namespace fused_optimizer_test
