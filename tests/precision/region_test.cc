// Tests for amp/precision/region.h: what a forward sees inside Region<Policy, Device>.
//
//   bazel test //tests:region_test
//
// Op dtype lists are LibTorch's (aten/src/ATen/autocast_mode.cpp, CPU policy):
// measured on 1.13 CPU, lower-precision: linear, matmul, mm, bmm, conv;
// fp32: mse_loss, l1_loss, smooth_l1_loss, huber_loss, cross_entropy,
// nll_loss, binary_cross_entropy_with_logits, kl_div, prod, ...; everything
// else (softmax, log_softmax, layer_norm, relu, sum, ...) keeps its input's
// dtype. The same CPU fp32 loss list is in LibTorch 2.x.
#include "amp/precision/region.h"

#include "autocast_state.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <condition_variable>
#include <mutex>
#include <ostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

namespace region_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

namespace compat = amp::detail::compat;
using c10::DeviceType;
using c10::ScalarType;
using Bf16Region = amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>;
using Fp16CudaRegion = amp::Region<amp::Mixed<amp::fp16, amp::DynamicScaler>, amp::CUDA>;
using Fp64Region = amp::Region<amp::True<amp::fp64>, amp::CPU>;

using amp_test::kDefault;
using amp_test::nesting;
using amp_test::snapshot;
using amp_test::State;

class RegionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(snapshot(), kDefault);
    torch::manual_seed(0);
  }
  void TearDown() override { EXPECT_EQ(snapshot(), kDefault); }

  torch::Tensor x = torch::randn({4, 8});
  torch::Tensor w = torch::randn({3, 8});
  torch::Tensor img = torch::randn({1, 2, 6, 6});
  torch::Tensor kernel = torch::randn({3, 2, 3, 3});
};

// ---------------------------------------------------------------------------
// Compile-time members and rule traits.
// ---------------------------------------------------------------------------
static_assert(std::is_same_v<Bf16Region::policy, amp::Mixed<amp::bf16, amp::NoScaler>>);
static_assert(std::is_same_v<Bf16Region::device, amp::CPU>);
static_assert(std::is_same_v<Bf16Region::compute_type, amp::bf16>);
static_assert(std::is_same_v<Bf16Region::param_type, amp::fp32>);
static_assert(Bf16Region::compute_dtype == ScalarType::BFloat16);
static_assert(Bf16Region::param_dtype == ScalarType::Float);
static_assert(Bf16Region::device_type == DeviceType::CPU);
static_assert(Bf16Region::uses_autocast);
static_assert(Fp16CudaRegion::compute_dtype == ScalarType::Half && Fp16CudaRegion::device_type == DeviceType::CUDA);
static_assert(Fp64Region::compute_dtype == ScalarType::Double && Fp64Region::param_dtype == ScalarType::Double);
static_assert(!Fp64Region::uses_autocast);
static_assert(amp::Region<amp::True<amp::tf32>, amp::CUDA>::compute_dtype == ScalarType::Float);
static_assert(!std::is_copy_constructible_v<Bf16Region> && !std::is_move_constructible_v<Bf16Region>);
static_assert(!std::is_copy_assignable_v<Bf16Region> && !std::is_move_assignable_v<Bf16Region>);
static_assert(!std::is_copy_constructible_v<Fp64Region> && !std::is_move_constructible_v<Fp64Region>);

using BF = amp::Mixed<amp::bf16, amp::NoScaler>;
using HF = amp::Mixed<amp::fp16, amp::DynamicScaler>;
static_assert(amp::detail::region_cast_allowed_v<BF, amp::fp32> && amp::detail::region_cast_allowed_v<BF, amp::fp64>);
static_assert(!amp::detail::region_cast_allowed_v<BF, amp::bf16> && !amp::detail::region_cast_allowed_v<BF, amp::fp16>);
static_assert(!amp::detail::region_cast_allowed_v<HF, amp::fp16> && !amp::detail::region_cast_allowed_v<HF, amp::bf16>);
static_assert(amp::detail::region_cast_allowed_v<amp::True<amp::fp64>, amp::bf16>);  // True regions: any cast
static_assert(!amp::detail::region_cast_allowed_v<BF, int>);
static_assert(amp::detail::region_autocast_allowed_v<BF, amp::bf16> &&
              amp::detail::region_autocast_allowed_v<HF, amp::fp16>);
static_assert(!amp::detail::region_autocast_allowed_v<BF, amp::fp16> &&
              !amp::detail::region_autocast_allowed_v<BF, amp::fp32>);
static_assert(!amp::detail::region_autocast_allowed_v<amp::True<amp::fp64>, amp::fp64>);

// A generic forward can branch on the region at compile time.
template <class R>
torch::Tensor forward_generic(R& region, const torch::Tensor& x, const torch::Tensor& w) {
  if constexpr (R::uses_autocast) {
    return region.template autocast<typename R::compute_type>([&] { return torch::matmul(x, w.t()); });
  } else {
    return torch::matmul(region.template cast<typename R::param_type>(x),
                         region.template cast<typename R::param_type>(w).t());
  }
}

TEST_F(RegionTest, CompileTimeBranching) {
  {
    Bf16Region region;
    EXPECT_EQ(forward_generic(region, x, w).scalar_type(), ScalarType::BFloat16);
  }
  Fp64Region region;
  EXPECT_EQ(forward_generic(region, x, w).scalar_type(), ScalarType::Double);
}

// ---------------------------------------------------------------------------
// Mixed<bf16, NoScaler> on CPU.
// ---------------------------------------------------------------------------
TEST_F(RegionTest, Bf16EligibleOpsRunInBf16) {
  Bf16Region region;
  EXPECT_EQ(torch::nn::functional::linear(x, w).scalar_type(), ScalarType::BFloat16);
  EXPECT_EQ(torch::matmul(x, w.t()).scalar_type(), ScalarType::BFloat16);
  EXPECT_EQ(torch::mm(x, w.t()).scalar_type(), ScalarType::BFloat16);
  EXPECT_EQ(torch::bmm(x.unsqueeze(0), w.t().unsqueeze(0)).scalar_type(), ScalarType::BFloat16);
  EXPECT_EQ(torch::conv2d(img, kernel).scalar_type(), ScalarType::BFloat16);
  torch::nn::Linear lin(8, 3);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(2, 3, 3));
  EXPECT_EQ(lin(x).scalar_type(), ScalarType::BFloat16);
  EXPECT_EQ(conv(img).scalar_type(), ScalarType::BFloat16);
}

TEST_F(RegionTest, Bf16LossesRunInFp32) {
  Bf16Region region;
  const torch::Tensor logits = torch::nn::functional::linear(x, w);  // bf16
  ASSERT_EQ(logits.scalar_type(), ScalarType::BFloat16);
  const torch::Tensor target = torch::randn({4, 3});
  const torch::Tensor labels = torch::tensor({0, 1, 2, 0});
  EXPECT_EQ(torch::mse_loss(logits, target).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::l1_loss(logits, target).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::smooth_l1_loss(logits, target).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::huber_loss(logits, target).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::kl_div(logits, target).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::nn::functional::cross_entropy(logits, labels).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::nll_loss(logits, labels).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::binary_cross_entropy_with_logits(logits, target.sigmoid()).scalar_type(), ScalarType::Float);
  EXPECT_EQ(logits.prod().scalar_type(), ScalarType::Float);
}

TEST_F(RegionTest, Bf16OpsOffTheListsKeepTheirInputDtype) {
  Bf16Region region;
  // fp32 in, fp32 out: autocast never narrows these.
  const torch::Tensor y = torch::randn({4, 3});
  EXPECT_EQ(torch::softmax(y, 1).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::log_softmax(y, 1).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::layer_norm(y, {3}).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::relu(y).scalar_type(), ScalarType::Float);
  EXPECT_EQ(y.sum().scalar_type(), ScalarType::Float);
  // Mixed bf16/fp32 elementwise ops follow type promotion.
  EXPECT_EQ((torch::matmul(x, w.t()) + y).scalar_type(), ScalarType::Float);
#if TORCH_VERSION_MAJOR < 2
  // Measured on 1.13: softmax/log_softmax/layer_norm are on neither CPU list,
  // so a bf16 input stays bf16 (on CUDA softmax is on the fp32 list). Use
  // region.full_precision for a softmax that must run in fp32.
  const torch::Tensor logits = torch::matmul(x, w.t());
  EXPECT_EQ(torch::softmax(logits, 1).scalar_type(), ScalarType::BFloat16);
  EXPECT_EQ(torch::log_softmax(logits, 1).scalar_type(), ScalarType::BFloat16);
  EXPECT_EQ(torch::layer_norm(logits, {3}).scalar_type(), ScalarType::BFloat16);
#endif
}

TEST_F(RegionTest, Bf16WeightsAndGradientsStayFp32) {
  torch::nn::Linear lin(8, 3);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(2, 3, 3));
  torch::Tensor loss;
  {
    Bf16Region region;
    const torch::Tensor out = lin(x);
    ASSERT_EQ(out.scalar_type(), ScalarType::BFloat16);
    loss = torch::mse_loss(out, torch::zeros({4, 3})) + conv(img).pow(2).mean();
  }
  // backward outside the region, as torch recommends
  loss.backward();
  for (const auto& p : lin->parameters()) {
    EXPECT_EQ(p.scalar_type(), ScalarType::Float);
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().scalar_type(), ScalarType::Float);
  }
  for (const auto& p : conv->parameters()) {
    EXPECT_EQ(p.scalar_type(), ScalarType::Float);
    EXPECT_EQ(p.grad().scalar_type(), ScalarType::Float);
  }
}

TEST_F(RegionTest, Bf16OpsAreFp32AgainAfterTheRegion) {
  {
    Bf16Region region;
    ASSERT_EQ(torch::matmul(x, w.t()).scalar_type(), ScalarType::BFloat16);
  }
  EXPECT_EQ(torch::nn::functional::linear(x, w).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::matmul(x, w.t()).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::conv2d(img, kernel).scalar_type(), ScalarType::Float);
}

// Regression: a weight updated in place between two regions (an optimizer
// step) must be seen by the next region's forward. autocast caches the bf16
// copy of every fp32 leaf that requires grad, keyed by the tensor, until the
// cache is cleared; the Region must clear it when the outermost one ends.
TEST_F(RegionTest, Bf16NextRegionSeesInPlaceWeightUpdate) {
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(2, 3, 3).bias(false));
  auto update = [&] {
    torch::NoGradGuard no_grad;
    conv->weight.mul_(2);  // exact in bf16: bf16(2w) == 2 bf16(w)
  };
  torch::Tensor first;
  {
    Bf16Region region;
    first = conv(img);
  }
  update();
  {
    Bf16Region region;
    const torch::Tensor second = conv(img);
    EXPECT_TRUE(torch::equal(second, first * 2));
  }
  // Control: the same sequence with autocast switched on and off by hand,
  // without clearing the cache, reuses the stale cast; this is what the
  // assertion above would catch.
  compat::set_autocast_enabled(DeviceType::CPU, true);
  const torch::Tensor before = conv(img);
  compat::set_autocast_enabled(DeviceType::CPU, false);
  update();
  compat::set_autocast_enabled(DeviceType::CPU, true);
  const torch::Tensor stale = conv(img);
  compat::set_autocast_enabled(DeviceType::CPU, false);
  compat::clear_autocast_cache();
  EXPECT_TRUE(torch::equal(stale, before));
}

// Inside ONE region, LibTorch's cache is not invalidated by an in-place
// update (measured on 1.13; the cache has no version check): a conv keeps
// using the cached cast of its old weight. Update weights outside regions.
TEST_F(RegionTest, Bf16SameRegionInPlaceUpdateIsNotSeenByCachedCasts) {
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(2, 3, 3).bias(false));
  torch::nn::Linear lin(torch::nn::LinearOptions(8, 3).bias(false));
  Bf16Region region;
  const torch::Tensor c1 = conv(img);
  const torch::Tensor l1 = lin(x);
  {
    torch::NoGradGuard no_grad;
    conv->weight.mul_(2);
    lin->weight.mul_(2);
  }
  EXPECT_TRUE(torch::equal(conv(img), c1));  // stale: the cached bf16 weight
  // Linear too: linear routing (amp/precision/linear_routing.h) makes it cast its weight
  // once per region, as Python does.
  EXPECT_TRUE(torch::equal(lin(x), l1));
}

// Without linear routing, LibTorch's C++ Linear reaches autocast through
// weight.t(), a view, which autocast never caches: it re-casts every call and
// sees the update.
TEST_F(RegionTest, Bf16WithoutLinearRoutingLinearRecastsItsWeight) {
  torch::nn::Linear lin(torch::nn::LinearOptions(8, 3).bias(false));
  Bf16Region region(amp::RegionOptions().linear_routing(amp::LinearRouting::kOff));
  const torch::Tensor l1 = lin(x);
  {
    torch::NoGradGuard no_grad;
    lin->weight.mul_(2);
  }
  EXPECT_TRUE(torch::equal(lin(x), l1 * 2));
}

TEST_F(RegionTest, Bf16ExceptionRestoresState) {
  try {
    Bf16Region region;
    ASSERT_TRUE(compat::autocast_enabled(DeviceType::CPU));
    throw std::runtime_error("forward failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(snapshot(), kDefault);
  try {
    Bf16Region region;
    region.full_precision([] { throw std::runtime_error("in the island"); });
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(snapshot(), kDefault);
}

TEST_F(RegionTest, Bf16RegionDoesNotLeakIntoAnotherThread) {
  std::mutex mu;
  std::condition_variable cv;
  int phase = 0;  // 1: region entered; 2: other thread measured
  ScalarType other = ScalarType::Undefined, inside = ScalarType::Undefined;
  std::thread with_region([&] {
    Bf16Region region;
    std::unique_lock<std::mutex> lock(mu);
    phase = 1;
    cv.notify_all();
    cv.wait(lock, [&] { return phase == 2; });
    inside = torch::matmul(x, w.t()).scalar_type();  // region still active
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return phase == 1; });
    other = torch::matmul(x, w.t()).scalar_type();  // the other thread is inside its region
    phase = 2;
    cv.notify_all();
  }
  with_region.join();
  EXPECT_EQ(other, ScalarType::Float);
  EXPECT_EQ(inside, ScalarType::BFloat16);
}

TEST_F(RegionTest, Bf16FullPrecisionIsAnFp32Island) {
  Bf16Region region;
  const torch::Tensor a = torch::matmul(x, w.t());  // bf16
  ASSERT_EQ(a.scalar_type(), ScalarType::BFloat16);
  const torch::Tensor b = torch::randn({3, 3});
  const torch::Tensor ids = torch::tensor({1, 2});
  const torch::Tensor d = torch::randn({2}, torch::kDouble);
  std::vector<torch::Tensor> list{a, b};
  bool enabled_inside = true;
  std::vector<ScalarType> seen;
  auto result = region.full_precision(
      [&](const torch::Tensor& a32, const torch::Tensor& b32, const std::vector<torch::Tensor>& l,
          const torch::Tensor& i, const torch::Tensor& d64, double scale, const std::string& tag) {
        enabled_inside = compat::autocast_enabled(DeviceType::CPU);
        seen = {a32.scalar_type(),  b32.scalar_type(), l[0].scalar_type(),
                l[1].scalar_type(), i.scalar_type(),   d64.scalar_type()};
        EXPECT_EQ(scale, 2.0);
        EXPECT_EQ(tag, "loss");
        return std::make_tuple(torch::matmul(a32, b32) * scale, torch::softmax(a32, 1));
      },
      a, b, list, ids, d, 2.0, std::string("loss"));
  EXPECT_FALSE(enabled_inside);
  EXPECT_EQ(seen, (std::vector<ScalarType>{ScalarType::Float, ScalarType::Float, ScalarType::Float, ScalarType::Float,
                                           ScalarType::Long, ScalarType::Double}));
  EXPECT_EQ(std::get<0>(result).scalar_type(), ScalarType::Float);  // would be bf16 outside the island
  EXPECT_EQ(std::get<1>(result).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::matmul(a, b).scalar_type(), ScalarType::BFloat16);
  // Autocast is back after the island.
  EXPECT_TRUE(compat::autocast_enabled(DeviceType::CPU));
  EXPECT_EQ(nesting(), 1);
  EXPECT_EQ(torch::matmul(x, w.t()).scalar_type(), ScalarType::BFloat16);
  // Gradients flow back through the island's cast.
  // (The bf16 input is made in an island too: a raw cast in the region itself
  // is what strict casts reject.)
  torch::Tensor leaf = torch::randn({4, 3}, torch::requires_grad());
  const torch::Tensor narrow =
      region.full_precision([](const torch::Tensor& t) { return t.to(torch::kBFloat16); }, leaf);
  region.full_precision([](const torch::Tensor& t) { return t.pow(2).sum(); }, narrow).backward();
  EXPECT_EQ(leaf.grad().scalar_type(), ScalarType::Float);
}

TEST_F(RegionTest, Bf16AllowedCastsAndSameDtypeAutocast) {
  Bf16Region region;
  const torch::Tensor a = torch::matmul(x, w.t());
  EXPECT_EQ(region.cast<amp::fp32>(a).scalar_type(), ScalarType::Float);
  EXPECT_EQ(region.cast<amp::fp64>(a).scalar_type(), ScalarType::Double);
  const State before = snapshot();
  const auto out = region.autocast<amp::bf16>([&](const torch::Tensor& t) { return torch::matmul(t, w.t()); }, x);
  EXPECT_EQ(out.scalar_type(), ScalarType::BFloat16);
  EXPECT_EQ(snapshot(), before);  // a no-op: no second guard
  EXPECT_EQ(region.autocast<amp::bf16>([] { return 7; }), 7);
}

// ---------------------------------------------------------------------------
// True<fp64> on CPU: inert.
// ---------------------------------------------------------------------------
TEST_F(RegionTest, TrueFp64IsInert) {
  Fp64Region region;
  EXPECT_EQ(snapshot(), kDefault);  // autocast untouched
  const torch::Tensor x64 = region.cast<amp::fp64>(x);
  const torch::Tensor w64 = region.cast<amp::fp64>(w);
  EXPECT_EQ(torch::nn::functional::linear(x64, w64).scalar_type(), ScalarType::Double);
  EXPECT_EQ(torch::matmul(x, w.t()).scalar_type(), ScalarType::Float);       // no autocast
  EXPECT_EQ(region.cast<amp::bf16>(x).scalar_type(), ScalarType::BFloat16);  // any cast is allowed
  // full_precision never narrows fp64, and widens 16-bit tensors to fp32.
  EXPECT_EQ(region.full_precision([](const torch::Tensor& t) { return t * 2; }, x64).scalar_type(), ScalarType::Double);
  EXPECT_EQ(region.full_precision([](const torch::Tensor& t) { return t * 2; }, x.to(torch::kHalf)).scalar_type(),
            ScalarType::Float);
}

TEST_F(RegionTest, TrueFp64InsideAnOuterAutocastDoesNotChangeIt) {
  amp::Autocast<amp::bf16, amp::CPU> outer;
  {
    Fp64Region region;
    EXPECT_TRUE(compat::autocast_enabled(DeviceType::CPU));
    EXPECT_EQ(nesting(), 1);
  }
  EXPECT_TRUE(compat::autocast_enabled(DeviceType::CPU));
}

// ---------------------------------------------------------------------------
// Mixed<fp16, DynamicScaler> on CUDA.
// ---------------------------------------------------------------------------
TEST_F(RegionTest, Fp16CudaRegionSetsOnlyCudaState) {  // no GPU needed
  {
    Fp16CudaRegion region;
    EXPECT_TRUE(compat::autocast_enabled(DeviceType::CUDA));
    EXPECT_EQ(compat::autocast_dtype(DeviceType::CUDA), ScalarType::Half);
    EXPECT_FALSE(compat::autocast_enabled(DeviceType::CPU));
    EXPECT_EQ(torch::matmul(x, w.t()).scalar_type(), ScalarType::Float);  // CPU tensors
  }
  EXPECT_EQ(snapshot(), kDefault);
}

TEST_F(RegionTest, Fp16CudaOpsRunInFp16) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  Fp16CudaRegion region;
  const torch::Tensor xc = x.cuda(), wc = w.cuda();
  const torch::Tensor logits = torch::nn::functional::linear(xc, wc);
  EXPECT_EQ(logits.scalar_type(), ScalarType::Half);
  EXPECT_EQ(torch::mse_loss(logits, torch::zeros({4, 3}, torch::kCUDA)).scalar_type(), ScalarType::Float);
  EXPECT_EQ(torch::softmax(logits, 1).scalar_type(), ScalarType::Float);  // on CUDA's fp32 list
  EXPECT_EQ(region.full_precision([](const torch::Tensor& t) { return torch::matmul(t, t.t()); }, logits).scalar_type(),
            ScalarType::Float);
}

}  // namespace

// ---------------------------------------------------------------------------
// True<tf32> on CUDA: TF32 math while the region lives (flags readable and
// settable without a GPU; they are process-wide).
// ---------------------------------------------------------------------------
namespace tf32_test {
// What AllowTF32 saves: up to LibTorch 2.8 the fp32 matmul precision (so
// "medium" too), from 2.9 the cuBLAS/cuDNN booleans (compat.h).
struct Flags {
  bool cublas, cudnn;
#if !AMP_DETAIL_FP32_PRECISION_API
  at::Float32MatmulPrecision precision;
#endif
  bool operator==(const Flags& o) const {
#if !AMP_DETAIL_FP32_PRECISION_API
    if (precision != o.precision) return false;
#endif
    return cublas == o.cublas && cudnn == o.cudnn;
  }
};
Flags read_flags() {
  auto& ctx = at::globalContext();
#if AMP_DETAIL_FP32_PRECISION_API
  return {ctx.allowTF32CuBLAS(), ctx.allowTF32CuDNN()};
#else
  return {ctx.allowTF32CuBLAS(), ctx.allowTF32CuDNN(), ctx.float32MatmulPrecision()};
#endif
}
// The starting states: every matmul precision where it is saved, else both booleans.
void set_start(int which, bool cudnn) {
  auto& ctx = at::globalContext();
#if AMP_DETAIL_FP32_PRECISION_API
  ctx.setAllowTF32CuBLAS(which != 0);
#else
  const at::Float32MatmulPrecision p[] = {at::Float32MatmulPrecision::HIGHEST, at::Float32MatmulPrecision::HIGH,
                                          at::Float32MatmulPrecision::MEDIUM};
  ctx.setFloat32MatmulPrecision(amp::detail::compat::float32_matmul_precision_name(p[which]));
#endif
  ctx.setAllowTF32CuDNN(cudnn);
}
}  // namespace tf32_test

TEST(Tf32Region, TurnsTf32OnAndRestoresExactlyWhatItFound) {
  using tf32_test::read_flags;
  auto& ctx = at::globalContext();
  const bool cublas0 = ctx.allowTF32CuBLAS(), cudnn0 = ctx.allowTF32CuDNN();
  for (int which = 0; which < 3; ++which) {
    for (bool cudnn : {false, true}) {
      tf32_test::set_start(which, cudnn);
      const auto before = read_flags();
      {
        amp::Region<amp::True<amp::tf32>, amp::CUDA> region;
        EXPECT_TRUE(ctx.allowTF32CuBLAS());
        EXPECT_TRUE(ctx.allowTF32CuDNN());
        {
          amp::AllowTF32 nested;  // nesting restores in reverse order
          EXPECT_TRUE(ctx.allowTF32CuBLAS());
        }
        EXPECT_TRUE(ctx.allowTF32CuBLAS());
        EXPECT_TRUE(ctx.allowTF32CuDNN());
      }
      EXPECT_TRUE(read_flags() == before) << "start " << which << ", cudnn " << cudnn;
    }
  }
  ctx.setAllowTF32CuBLAS(cublas0);
  ctx.setAllowTF32CuDNN(cudnn0);
}

TEST(Tf32Region, Fp32RegionLeavesTf32Alone) {
  auto& ctx = at::globalContext();
  const bool cublas = ctx.allowTF32CuBLAS();
  {
    amp::Region<amp::True<amp::fp32>, amp::CUDA> region;
    EXPECT_EQ(ctx.allowTF32CuBLAS(), cublas);
  }
  EXPECT_EQ(ctx.allowTF32CuBLAS(), cublas);
}
}  // namespace region_test
