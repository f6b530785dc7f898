// Tests for amp/precision/linear_routing.h: in a Mixed region LibTorch's C++ linear
// layers cast each weight once per region (as Python's nn.Linear does), with
// the bits of at::linear; nothing is routed outside Mixed regions, with
// LinearRouting::kOff, in full_precision islands or inside backward.
//
//   bazel test //tests:linear_routing_test
#include "amp/precision/linear_routing.h"

#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "amp/precision/region.h"
#include "amp/train/fabric.h"
#include "amp/train/trainer.h"
#include "../error_of.h"

namespace linear_routing_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

using amp::LinearRouting;
using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;
using Fp16 = amp::Mixed<amp::fp16, amp::DynamicScaler>;

bool key_included() { return c10::impl::tls_is_dispatch_key_included(amp::detail::kLinearRoutingKey); }

// Counts this thread's casts of one tensor's data (aten::_to_copy whose
// source shares its data pointer: the weight or its transpose), which is what
// autocast does to a weight at each call it does not cache.
class WeightCasts {
 public:
  explicit WeightCasts(const torch::Tensor& w) {
    data = w.data_ptr();
    count = 0;
    handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&start).needsInputs(true));
  }
  ~WeightCasts() { at::removeCallback(handle_); }
  WeightCasts(const WeightCasts&) = delete;
  WeightCasts& operator=(const WeightCasts&) = delete;
  static inline thread_local const void* data = nullptr;
  static inline thread_local int count = 0;

 private:
  static std::unique_ptr<at::ObserverContext> start(const at::RecordFunction& fn) {
    if (std::string(fn.name()) != "aten::_to_copy") return nullptr;
    const auto inputs = fn.inputs();
    if (!inputs.empty() && inputs[0].isTensor() && inputs[0].toTensor().data_ptr() == data) ++count;
    return nullptr;
  }
  at::CallbackHandle handle_;
};

// A layer's forward as a case runs it: 2-D input with a bias is addmm in
// LibTorch's F::linear, everything else matmul (+ bias).
struct Case {
  bool bias;
  int dims;  // of the input: 2 or 3
};
std::string name_of(const Case& c) { return std::to_string(c.dims) + "d" + (c.bias ? "_bias" : "_nobias"); }
const std::vector<Case> kCases = {{true, 2}, {false, 2}, {true, 3}, {false, 3}};

torch::Tensor input(const Case& c, torch::Device device = torch::kCPU) {
  return (c.dims == 2 ? torch::randn({6, 24}) : torch::randn({3, 5, 24})).to(device);
}

// How many times a weight is cast when the layer runs `calls` times in one region.
template <class Policy, class Device>
int casts_per_region(const Case& c, int calls, LinearRouting routing, torch::Device device = torch::kCPU) {
  torch::manual_seed(0);
  torch::nn::Linear lin(torch::nn::LinearOptions(24, 40).bias(c.bias));
  lin->to(device);
  const torch::Tensor x = input(c, device);
  WeightCasts casts(lin->weight);
  {
    amp::Region<Policy, Device> region(amp::RegionOptions().linear_routing(routing));
    for (int i = 0; i < calls; ++i) (void)lin(x);
  }
  return WeightCasts::count;
}

template <class Policy, class Device>
void expect_one_cast_per_region(torch::Device device = torch::kCPU) {
  for (const Case& c : kCases) {
    for (int calls : {1, 2, 5}) {
      EXPECT_EQ((casts_per_region<Policy, Device>(c, calls, LinearRouting::kOn, device)), 1)
          << name_of(c) << ", " << calls << " calls, routing on";
      // What LibTorch does by itself (and what routing undoes): a cast per call.
      EXPECT_EQ((casts_per_region<Policy, Device>(c, calls, LinearRouting::kOff, device)), calls)
          << name_of(c) << ", " << calls << " calls, routing off";
    }
  }
}

class LinearRoutingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(amp::detail::current_linear_routing(), LinearRouting::kOff);
    ASSERT_FALSE(key_included());
  }
  void TearDown() override {
    EXPECT_EQ(amp::detail::current_linear_routing(), LinearRouting::kOff);
    EXPECT_FALSE(key_included());
  }
};

TEST_F(LinearRoutingTest, Bf16CpuCastsEachWeightOncePerRegion) { expect_one_cast_per_region<Bf16, amp::CPU>(); }

TEST_F(LinearRoutingTest, Fp16CpuCastsEachWeightOncePerRegion) {
  if constexpr (amp::detail::compat::kCpuHasFp16) {
    expect_one_cast_per_region<Fp16, amp::CPU>();
  } else {
    GTEST_SKIP() << "no fp16 CPU autocast before LibTorch 2.3";
  }
}

TEST_F(LinearRoutingTest, CudaCastsEachWeightOncePerRegion) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  expect_one_cast_per_region<Fp16, amp::CUDA>(torch::kCUDA);
  if (amp::detail::compat::cuda_supports_bf16()) expect_one_cast_per_region<Bf16, amp::CUDA>(torch::kCUDA);
}

// --- bits: a routed layer is at::linear, forward and gradients ---------------------

std::vector<torch::Tensor> grads(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> g;
  for (const auto& t : ts) g.push_back(t.grad().defined() ? t.grad().clone() : torch::Tensor());
  return g;
}

void expect_same_bits(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                      const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(a[i].defined() && b[i].defined()) << what << " #" << i;
    EXPECT_EQ(a[i].scalar_type(), b[i].scalar_type()) << what << " #" << i;
    EXPECT_TRUE(torch::equal(a[i], b[i])) << what << " #" << i << " differs";
  }
}

// The layer called twice in one region (a discriminator on real and fake)
// against at::linear on copies of its parameters. LibTorch's F::linear adds
// a bias to N-D input with a separate `+=`, which routing keeps (README).
TEST_F(LinearRoutingTest, RoutedLayerIsAtLinearBitForBit) {
  for (const Case& c : kCases) {
    torch::manual_seed(1);
    torch::nn::Linear lin(torch::nn::LinearOptions(24, 40).bias(c.bias));
    const torch::Tensor x1 = input(c).requires_grad_(), x2 = input(c).requires_grad_();
    const torch::Tensor w = lin->weight.detach().clone().requires_grad_();
    const torch::Tensor b = c.bias ? lin->bias.detach().clone().requires_grad_() : torch::Tensor();
    const torch::Tensor r1 = x1.detach().clone().requires_grad_(), r2 = x2.detach().clone().requires_grad_();
    torch::Tensor y, ref;
    {
      amp::Region<Bf16, amp::CPU> region;
      y = lin(x1) * 2 + lin(x2);
      auto linear = [&](const torch::Tensor& x) {
        if (c.dims == 2 || !c.bias) return torch::linear(x, w, b);
        torch::Tensor out = torch::linear(x, w);
        out += b;
        return out;
      };
      ref = linear(r1) * 2 + linear(r2);
    }
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16) << name_of(c);
    expect_same_bits({y}, {ref}, name_of(c) + " forward");
    y.to(torch::kFloat).pow(2).sum().backward();
    ref.to(torch::kFloat).pow(2).sum().backward();
    std::vector<torch::Tensor> got = grads({x1, x2, lin->weight}), want = grads({r1, r2, w});
    if (c.bias) got.push_back(lin->bias.grad()), want.push_back(b.grad());
    expect_same_bits(got, want, name_of(c) + " gradients");
  }
}

// Each layer of a Sequential and of a user module called twice per region:
// one cast per weight, and the bits of the same forward spelled with at::linear.
struct Twice : torch::nn::Module {
  Twice() : a(register_module("a", torch::nn::Linear(24, 32))), b(register_module("b", torch::nn::Linear(32, 8))) {}
  torch::Tensor forward(const torch::Tensor& x1, const torch::Tensor& x2) {
    return b(torch::relu(a(x1))) + b(torch::relu(a(x2)));
  }
  torch::nn::Linear a, b;
};

TEST_F(LinearRoutingTest, SequentialAndUserModuleMatchAtLinear) {
  torch::manual_seed(2);
  torch::nn::Sequential seq(torch::nn::Linear(24, 32), torch::nn::ReLU(), torch::nn::Linear(32, 8));
  auto twice = std::make_shared<Twice>();
  const torch::Tensor x1 = torch::randn({6, 24}), x2 = torch::randn({6, 24});
  for (const bool sequential : {true, false}) {
    const std::string what = sequential ? "Sequential" : "user module";
    std::vector<torch::Tensor> params = sequential ? seq->parameters() : twice->parameters();
    std::vector<torch::Tensor> copies;
    for (const auto& p : params) copies.push_back(p.detach().clone().requires_grad_());
    auto ref_forward = [&](const torch::Tensor& x) {
      const torch::Tensor h = torch::relu(torch::linear(x, copies[0], copies[1]));
      return torch::linear(h, copies[2], copies[3]);
    };
    WeightCasts casts(params[0]);
    torch::Tensor y, ref;
    {
      amp::Region<Bf16, amp::CPU> region;
      y = sequential ? seq->forward(x1) + seq->forward(x2) : twice->forward(x1, x2);
      EXPECT_EQ(WeightCasts::count, 1) << what << ": casts of the first layer's weight";
      ref = ref_forward(x1) + ref_forward(x2);
    }
    expect_same_bits({y}, {ref}, what + " forward");
    y.to(torch::kFloat).sum().backward();
    ref.to(torch::kFloat).sum().backward();
    expect_same_bits(grads(params), grads(copies), what + " gradients");
  }
}

// The README's list of other modules. RNN cells call aten::*_cell with the
// parameters themselves, as Python does: one cast without routing.
TEST_F(LinearRoutingTest, RnnCellsCastTheirWeightsOnceWithoutRouting) {
  torch::nn::RNNCell rnn(24, 16);
  torch::nn::LSTMCell lstm(24, 16);
  torch::nn::GRUCell gru(24, 16);
  const torch::Tensor x = torch::randn({6, 24});
  auto casts_of = [&](const torch::Tensor& w, auto&& cell) {
    WeightCasts casts(w);
    amp::Region<Bf16, amp::CPU> region(amp::RegionOptions().linear_routing(LinearRouting::kOff));
    cell();
    cell();
    return WeightCasts::count;
  };
  EXPECT_EQ(casts_of(rnn->weight_ih, [&] { (void)rnn(x); }), 1);
  EXPECT_EQ(casts_of(lstm->weight_ih, [&] { (void)lstm(x); }), 1);
  EXPECT_EQ(casts_of(gru->weight_hh, [&] { (void)gru(x); }), 1);
}

// MultiheadAttention's packed in-projection (self-attention) and its
// out-projection go through F::linear on the whole parameter: routed.
TEST_F(LinearRoutingTest, MultiheadAttentionProjectionsAreRouted) {
  torch::nn::MultiheadAttention mha(32, 4);
  const torch::Tensor q = torch::randn({5, 2, 32});
  for (const LinearRouting routing : {LinearRouting::kOn, LinearRouting::kOff}) {
    for (const torch::Tensor& w : {mha->in_proj_weight, mha->out_proj->weight}) {
      WeightCasts casts(w);
      {
        amp::Region<Bf16, amp::CPU> region(amp::RegionOptions().linear_routing(routing));
        (void)mha(q, q, q);
        (void)mha(q, q, q);
      }
      EXPECT_EQ(WeightCasts::count, routing == LinearRouting::kOn ? 1 : 2) << amp::detail::to_string(routing);
    }
  }
}

// --- where routing is off -----------------------------------------------------------

// Counts what reaches the LinearFn (the hook a later fp8 policy installs).
thread_local int routed_calls = 0;
at::Tensor counting_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  ++routed_calls;
  return at::linear(x, w, b);
}

class CountingLinearFn {
 public:
  CountingLinearFn() : prev_(amp::detail::set_linear_fn(&counting_linear)) { routed_calls = 0; }
  ~CountingLinearFn() { amp::detail::set_linear_fn(prev_); }
  CountingLinearFn(const CountingLinearFn&) = delete;
  CountingLinearFn& operator=(const CountingLinearFn&) = delete;

 private:
  amp::detail::LinearFn prev_;
};

// Every linear on a parameter reaches the LinearFn once: both of F::linear's
// paths (addmm, matmul) and torch::linear itself.
TEST_F(LinearRoutingTest, LinearFnSeesEveryLinearOnAParameter) {
  torch::nn::Linear with_bias(24, 40), no_bias(torch::nn::LinearOptions(24, 40).bias(false));
  const torch::Tensor x2 = torch::randn({6, 24}), x3 = torch::randn({3, 5, 24});
  CountingLinearFn fn;
  amp::Region<Bf16, amp::CPU> region;
  (void)with_bias(x2);                                          // addmm(b, x, w.t())
  (void)no_bias(x2);                                            // matmul(x, w.t())
  (void)with_bias(x3);                                          // matmul(x, w.t()) += b
  (void)torch::linear(x2, with_bias->weight, with_bias->bias);  // linear itself
  EXPECT_EQ(routed_calls, 4);
}

// The op is left alone unless it is exactly a linear on a parameter.
TEST_F(LinearRoutingTest, OtherMatrixProductsAreNotRouted) {
  torch::nn::Linear lin(24, 40);
  const torch::Tensor x = torch::randn({6, 24});
  const torch::Tensor w = lin->weight, b = lin->bias;
  CountingLinearFn fn;
  amp::Region<Bf16, amp::CPU> region;
  (void)torch::addmm(b, x, w.t(), /*beta=*/2);  // not a linear
  (void)torch::addmm(b, x, w.t(), 1, /*alpha=*/0.5);
  (void)torch::addmm(b, x, w.t().contiguous());  // a copy, not a view of the parameter
  (void)x.matmul((w * 1).t());                   // the transpose of a non-leaf
  (void)x.matmul(w.narrow(0, 0, 24).t());        // a view of a view
  (void)torch::mm(x, w.t());                     // mm is not on F::linear's path
  const torch::Tensor plain = torch::randn({40, 24});
  (void)x.matmul(plain.t());  // no grad: autocast would not cache it either
  EXPECT_EQ(routed_calls, 0);
}

// A Function whose backward runs a Linear: nothing is routed while backward runs.
struct LinearInBackward : torch::autograd::Function<LinearInBackward> {
  static inline torch::nn::Linear* layer = nullptr;
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x * 1; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    return {(*layer)(g[0].narrow(1, 0, 24)).narrow(1, 0, 24).to(g[0].scalar_type())};
  }
};

TEST_F(LinearRoutingTest, NothingIsRoutedOutsideMixedRegionsIslandsOrBackward) {
  torch::nn::Linear lin(24, 40);
  const torch::Tensor x = torch::randn({6, 24});
  CountingLinearFn fn;
  (void)lin(x);
  EXPECT_EQ(routed_calls, 0) << "outside any region";
  {
    amp::Region<amp::True<amp::fp32>, amp::CPU> region;
    EXPECT_EQ(region.linear_routing(), LinearRouting::kOff);
    EXPECT_EQ(amp::detail::current_linear_routing(), LinearRouting::kOff);
    (void)lin(x);
    EXPECT_EQ(routed_calls, 0) << "in a True<fp32> region";
  }
  {
    amp::Region<Bf16, amp::CPU> region(amp::RegionOptions().linear_routing(LinearRouting::kOff));
    EXPECT_EQ(region.linear_routing(), LinearRouting::kOff);
    EXPECT_FALSE(key_included());
    (void)lin(x);
    EXPECT_EQ(routed_calls, 0) << "in a Mixed region with LinearRouting::kOff";
  }
  {
    amp::Region<Bf16, amp::CPU> region;
    EXPECT_EQ(region.linear_routing(), LinearRouting::kOn);
    EXPECT_EQ(amp::detail::current_linear_routing(), LinearRouting::kOn);
    EXPECT_TRUE(key_included());
    const torch::Tensor y = region.full_precision([&](const torch::Tensor& in) { return lin(in); }, x);
    EXPECT_EQ(y.scalar_type(), torch::kFloat);
    EXPECT_EQ(routed_calls, 0) << "in a full_precision island";

    LinearInBackward::layer = &lin;
    const torch::Tensor leaf = torch::randn({6, 24}).requires_grad_();
    const torch::Tensor out = LinearInBackward::apply(leaf);
    EXPECT_EQ(routed_calls, 0);
    out.sum().backward();
    EXPECT_TRUE(leaf.grad().defined());
    EXPECT_EQ(routed_calls, 0) << "inside backward";
    LinearInBackward::layer = nullptr;

    (void)lin(x);
    EXPECT_EQ(routed_calls, 1) << "in the Mixed region itself";
  }
}

// Strict casts and linear routing in one region: each does its job.
TEST_F(LinearRoutingTest, StrictCastsStillCatchManualCasts) {
  torch::nn::Linear lin(24, 40);
  const torch::Tensor x = torch::randn({6, 24});
  WeightCasts casts(lin->weight);
  amp::Region<Bf16, amp::CPU> region(
      amp::RegionOptions().strict_casts(amp::StrictCasts::kThrow).linear_routing(LinearRouting::kOn));
  EXPECT_EQ(region.strict_casts(), amp::StrictCasts::kThrow);
  EXPECT_EQ(region.linear_routing(), LinearRouting::kOn);
  const torch::Tensor y = lin(x) + lin(x);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(WeightCasts::count, 1);
  const std::string error = amp_test::error_of([&] { (void)x.to(torch::kBFloat16); });
  EXPECT_EQ(error.rfind("amp: manual cast to BFloat16", 0), 0u) << error;
  EXPECT_EQ(amp_test::error_of([&] { (void)lin(x.to(torch::kBFloat16)); }).rfind("amp: manual cast", 0), 0u);
}

// Trainer's option reaches its region; on by default.
TEST_F(LinearRoutingTest, TrainerOptionTurnsRoutingOff) {
  EXPECT_EQ(amp::TrainerOptions().region().linear_routing(), LinearRouting::kOn);
  torch::nn::Linear lin(24, 40);
  torch::optim::SGD opt(lin->parameters(), 0.1);
  const torch::Tensor x = torch::randn({6, 24});
  for (const LinearRouting routing : {LinearRouting::kOn, LinearRouting::kOff}) {
    amp::Trainer<Bf16, amp::CPU> trainer(
        lin, opt, amp::TrainerOptions().progress(false).region(amp::RegionOptions().linear_routing(routing)));
    WeightCasts casts(lin->weight);
    trainer.step([&](auto& region) {
      EXPECT_EQ(region.linear_routing(), routing);
      EXPECT_EQ(amp::detail::current_linear_routing(), routing);
      return (lin(x) + lin(x)).to(torch::kFloat).pow(2).mean();
    });
    EXPECT_EQ(WeightCasts::count, routing == LinearRouting::kOn ? 1 : 2) << amp::detail::to_string(routing);
    // evaluate() runs in the same kind of region.
    EXPECT_TRUE(trainer.evaluate([&](auto& region) {
      EXPECT_EQ(region.linear_routing(), routing);
      return amp::detail::current_linear_routing() == routing;
    }));
  }
}

// Fabric takes the same option, for forward() and evaluate().
TEST_F(LinearRoutingTest, PrecisionOptionTurnsRoutingOff) {
  EXPECT_EQ(amp::FabricOptions().region().linear_routing(), LinearRouting::kOn);
  torch::nn::Linear lin(24, 40);
  torch::optim::SGD opt(lin->parameters(), 0.1);
  const torch::Tensor x = torch::randn({6, 24});
  for (const LinearRouting routing : {LinearRouting::kOn, LinearRouting::kOff}) {
    amp::Fabric<Bf16, amp::CPU> fabric(amp::FabricOptions().region(amp::RegionOptions().linear_routing(routing)));
    fabric.setup(lin, opt);
    WeightCasts casts(lin->weight);
    fabric.forward([&](auto& region) {
      EXPECT_EQ(region.linear_routing(), routing);
      return (lin(x) + lin(x)).to(torch::kFloat).pow(2).mean();
    });
    EXPECT_EQ(WeightCasts::count, routing == LinearRouting::kOn ? 1 : 2) << amp::detail::to_string(routing);
    EXPECT_TRUE(fabric.evaluate([&](auto&) { return amp::detail::current_linear_routing() == routing; }));
  }
}

}  // namespace
}  // namespace linear_routing_test
