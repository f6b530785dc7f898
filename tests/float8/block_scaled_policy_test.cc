// Tests for the block-scaled Float8 policies, Float8<MXFP8<Mode>> and
// Float8<NVFP4<SR>> (amp/float8/block_scaled.h, policy.h): a Trainer gives
// the bits of the recipe's GEMMs called by hand, a Fabric the Trainer's; the
// precision map's kNotFloat8 keeps a linear out; checkpoints resume bit for
// bit (NVFP4<true>'s generator included); amp::checkpoint recomputes the same
// gradients; coverage and names. Bit-for-bit agreement with torchao and
// Transformer Engine is tests/parity/block_scaled_parity_test. Needs the
// float8 dtypes (LibTorch 2.1+); before, the policies are a static rule.
//
//   bazel test //tests:float8_test
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>
#include <string>
#include <vector>

#include "amp/amp.h"
#include "../error_of.h"
#include "../tmp_path.h"

namespace float8_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

#if AMP_DETAIL_HAS_FLOAT8_DTYPE

namespace bsd = amp::float8::detail;
using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;
using Rceil = amp::Float8<amp::MXFP8<>>;
using Floor = amp::Float8<amp::MXFP8<amp::MxScaleMode::kFloor>>;
using Nvfp4 = amp::Float8<amp::NVFP4<>>;
using Nvfp4Sr = amp::Float8<amp::NVFP4<true>>;

// Two linears that fit both recipes and a head that fits neither (10 outputs).
struct BsNetImpl : torch::nn::Module {
  BsNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(64, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 32))),
        head(register_module("head", torch::nn::Linear(32, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1, fc2, head;
};
TORCH_MODULE(BsNet);

BsNet make_net() {
  torch::manual_seed(1);
  return BsNet();
}

struct Batch {
  torch::Tensor x, y;
};
Batch batch(int64_t i, int64_t rows = 32) {
  torch::manual_seed(100 + i);
  return {torch::randn({rows, 64}) * 3, torch::randint(0, 10, {rows})};
}

torch::Tensor loss_of(BsNet& net, const Batch& b) {
  return torch::cross_entropy_loss(net->forward(b.x).to(torch::kFloat), b.y);
}

// The recipe's GEMMs called by hand (bf16 operands, as block_scaled.h casts them).
torch::Tensor by_hand(const torch::Tensor& x, const torch::nn::Linear& fc, int recipe) {
  c10::impl::ExcludeDispatchKeyGuard not_user_code(amp::detail::kStrictCastsKey);  // the recipe's own casts
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);   // the GEMMs as written
  const auto xb = x.to(torch::kBFloat16), wb = fc->weight.to(torch::kBFloat16);
  torch::Tensor y;
  if (recipe == 0) {
    y = bsd::Mxfp8Matmul::apply(xb, wb, static_cast<int64_t>(bsd::MxScale::kRceil), false);
  } else {
    y = bsd::Nvfp4Matmul::apply(xb, wb, false);
  }
  return y + fc->bias.to(torch::kBFloat16);
}

torch::Tensor loss_by_hand(BsNet& net, const Batch& b, int recipe) {
  auto h = torch::relu(by_hand(b.x, net->fc1, recipe));
  h = torch::relu(by_hand(h, net->fc2, recipe));
  return torch::cross_entropy_loss(net->head(h).to(torch::kFloat), b.y);
}

void expect_same(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
}

template <class P>
void trainer_is_the_recipe_by_hand(int recipe) {
  BsNet a = make_net(), b = make_net();
  torch::optim::Adam opt_a(a->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam opt_b(b->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Trainer<P, amp::CPU> trainer(a, opt_a,
                                    amp::TrainerOptions().progress(false).step(amp::StepOptions().fused(false)));
  for (int64_t i = 0; i < 4; ++i) {
    const Batch data = batch(i);
    const double got = trainer.step([&](auto&) { return loss_of(a, data); }).loss_value();
    torch::Tensor loss;
    {
      amp::Region<Bf16, amp::CPU> region(amp::RegionOptions().linear_routing(amp::LinearRouting::kOff));
      loss = loss_by_hand(b, data, recipe);
    }
    opt_b.zero_grad();
    loss.backward();
    opt_b.step();
    EXPECT_EQ(got, loss.item<double>()) << "step " << i;
  }
  expect_same(*a, *b);
}

TEST(BlockScaledPolicy, Mxfp8TrainerIsTheRecipeByHand) { trainer_is_the_recipe_by_hand<Rceil>(0); }
TEST(BlockScaledPolicy, Nvfp4TrainerIsTheRecipeByHand) { trainer_is_the_recipe_by_hand<Nvfp4>(1); }

// The recipes change the bits (not bf16 in disguise), FLOOR is not RCEIL, and
// a batch that is no multiple of the block gives the rows of a zero-padded one.
TEST(BlockScaledPolicy, TheRegionRunsTheRecipeAndPadsTheRows) {
  BsNet net = make_net();
  const auto x = batch(0).x;
  auto run = [&](auto tag, const torch::Tensor& in) {
    amp::Region<typename decltype(tag)::type, amp::CPU> region;
    return net->fc1(in);
  };
  const auto bf16 = run(boost::hana::type_c<Bf16>, x), rceil = run(boost::hana::type_c<Rceil>, x);
  const auto floor = run(boost::hana::type_c<Floor>, x), nv = run(boost::hana::type_c<Nvfp4>, x);
  EXPECT_EQ(rceil.scalar_type(), torch::kBFloat16);
  EXPECT_FALSE(torch::equal(rceil, bf16));
  EXPECT_FALSE(torch::equal(rceil, floor));
  EXPECT_FALSE(torch::equal(nv, rceil));
  EXPECT_LT((nv.to(torch::kFloat) - bf16.to(torch::kFloat)).abs().max().item<float>(), 2.0f);
  auto padded = x.clone();
  padded.narrow(0, 24, 8).zero_();
  for (auto tag : {0, 1}) {
    const auto part = tag == 0 ? run(boost::hana::type_c<Rceil>, x.narrow(0, 0, 24))
                               : run(boost::hana::type_c<Nvfp4>, x.narrow(0, 0, 24));
    const auto full = tag == 0 ? run(boost::hana::type_c<Rceil>, padded) : run(boost::hana::type_c<Nvfp4>, padded);
    EXPECT_TRUE(torch::equal(part, full.narrow(0, 0, 24))) << tag;
  }
}

#if AMP_DETAIL_HAS_FLOAT8_MATMUL
// A float8 guard (delayed or tensorwise) opened inside a block-scaled region
// would run every linear in its recipe instead: an amp: error that names
// both, and the region's recipe still runs. The innermost Float8 region
// decides: inside a tensorwise region nested in it, and in a bf16 region
// (the passing twin), the guards open.
TEST(BlockScaledPolicy, AFloat8GuardInsideABlockScaledRegionIsAnError) {
  using amp_test::error_of;
  BsNet net = make_net();
  const auto x = batch(0).x;
  amp::float8::DelayedScaling fp8;
  fp8.track(*net);
  const auto opens = [&] {
    return error_of([&] { amp::float8::DelayedLinearGuard guard(fp8); }) == "<no error>" &&
           error_of([] { amp::float8::LinearGuard<> guard; }) == "<no error>";
  };
  {
    amp::Region<Rceil, amp::CPU> region;
    const auto before = net->fc1(x);
    const std::string delayed = error_of([&] { amp::float8::DelayedLinearGuard guard(fp8); });
    EXPECT_EQ(delayed.rfind("amp: amp::float8::DelayedLinearGuard opened inside a Region<Float8<amp::MXFP8<...>>> "
                            "(a Trainer's or Fabric's too) would run its linears in amp::Delayed<...> instead of "
                            "amp::MXFP8",
                            0),
              0u)
        << delayed;
    EXPECT_NE(delayed.find("a Region, Trainer or Fabric of amp::Float8<amp::Delayed<...>>"), std::string::npos)
        << delayed;
    const std::string tensorwise = error_of([] { amp::float8::LinearGuard<> guard; });
    EXPECT_EQ(tensorwise.rfind("amp: amp::float8::LinearGuard opened inside a Region<Float8<amp::MXFP8<...>>>", 0), 0u)
        << tensorwise;
    EXPECT_NE(tensorwise.find("amp::Float8<amp::Tensorwise>"), std::string::npos) << tensorwise;
    EXPECT_TRUE(torch::equal(net->fc1(x), before));  // still MXFP8, bit for bit
#if AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL
    {
      amp::Region<amp::Float8<amp::Tensorwise>, amp::CPU> inner;
      EXPECT_TRUE(opens());
    }
#endif
    EXPECT_FALSE(opens());
  }
  {
    amp::Region<Nvfp4Sr, amp::CPU> region;
    const std::string rowwise = error_of([] { amp::float8::LinearGuard<amp::Rowwise> guard; });
    EXPECT_EQ(rowwise.rfind("amp: amp::float8::LinearGuard opened inside a Region<Float8<amp::NVFP4<...>>> (a "
                            "Trainer's or Fabric's too) would run its linears in amp::Rowwise instead of amp::NVFP4",
                            0),
              0u)
        << rowwise;
  }
  EXPECT_TRUE(opens());
  amp::Region<Bf16, amp::CPU> region;
  EXPECT_TRUE(opens());
}
#endif  // AMP_DETAIL_HAS_FLOAT8_MATMUL

template <class P>
void fabric_is_the_trainer() {
  BsNet a = make_net(), b = make_net();
  torch::optim::SGD opt_a(a->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD opt_b(b->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::Trainer<P, amp::CPU> trainer(a, opt_a,
                                    amp::TrainerOptions().progress(false).step(amp::StepOptions().fused(false)));
  amp::Fabric<P, amp::CPU> fabric;
  fabric.setup(b, opt_b, amp::StepOptions().fused(false));
  for (int64_t i = 0; i < 3; ++i) {
    const Batch data = batch(i);
    const double got = trainer.step([&](auto&) { return loss_of(a, data); }).loss_value();
    opt_b.zero_grad();
    const at::Tensor loss = fabric.forward([&](auto&) { return loss_of(b, data); });
    fabric.backward(loss);
    fabric.optimizer_step(opt_b);
    fabric.update();
    EXPECT_EQ(got, loss.item<double>()) << "step " << i;
  }
  expect_same(*a, *b);
}
TEST(BlockScaledPolicy, FabricIsTheTrainer) { fabric_is_the_trainer<Nvfp4>(); }
TEST(BlockScaledPolicy, FabricIsTheTrainerStochasticRoundingIncluded) { fabric_is_the_trainer<Nvfp4Sr>(); }

TEST(BlockScaledPolicy, ThePrecisionMapKeepsALinearOut) {
  BsNet net = make_net();
  const auto x = batch(0).x;
  const auto opts =
      amp::RegionOptions().precision_map(amp::PrecisionMap().path("fc1", amp::ModulePrecision::kNotFloat8));
  torch::Tensor mapped, fp4, bf16;
  {
    amp::Region<Nvfp4, amp::CPU> region(opts, *net);
    mapped = net->fc1(x);
  }
  {
    amp::Region<Nvfp4, amp::CPU> region;
    fp4 = net->fc1(x);
  }
  {
    amp::Region<Bf16, amp::CPU> region;
    bf16 = net->fc1(x);
  }
  EXPECT_TRUE(torch::equal(mapped, bf16));
  EXPECT_FALSE(torch::equal(fp4, bf16));
}

// NVFP4<true>'s generator is in the checkpoint: the resumed run draws the same roundings.
TEST(BlockScaledPolicy, ACheckpointResumesBitForBitStochasticRoundingIncluded) {
  const std::string path = amp_test::tmp_path("nvfp4_sr.pt");
  BsNet a = make_net();
  torch::optim::Adam opt_a(a->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Trainer<Nvfp4Sr, amp::CPU> trainer(a, opt_a, amp::TrainerOptions().progress(false));
  for (int64_t i = 0; i < 2; ++i) trainer.step([&](auto&) { return loss_of(a, batch(i)); });
  trainer.save(path);
  std::vector<double> losses;
  for (int64_t i = 2; i < 5; ++i)
    losses.push_back(trainer.step([&](auto&) { return loss_of(a, batch(i)); }).loss_value());

  torch::manual_seed(9);
  BsNet b;
  torch::optim::Adam opt_b(b->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Trainer<Nvfp4Sr, amp::CPU> resumed(b, opt_b, amp::TrainerOptions().progress(false));
  resumed.step([&](auto&) { return loss_of(b, batch(7)); });  // draws: the checkpoint must bring the state back
  resumed.load(path);
  for (int64_t i = 2; i < 5; ++i)
    EXPECT_EQ(resumed.step([&](auto&) { return loss_of(b, batch(i)); }).loss_value(),
              losses[static_cast<size_t>(i - 2)]);
  expect_same(*a, *b);
}

// Stochastic rounding changes the gradients, reproducibly.
TEST(BlockScaledPolicy, StochasticRoundingIsSeededAndChangesTheGradients) {
  auto grads = [](auto tag) {
    BsNet net = make_net();
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.0));
    amp::Trainer<typename decltype(tag)::type, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
    trainer.step([&](auto&) { return loss_of(net, batch(0)); });
    return net->fc1->weight.grad().clone();
  };
  const auto sr1 = grads(boost::hana::type_c<Nvfp4Sr>), sr2 = grads(boost::hana::type_c<Nvfp4Sr>);
  const auto rn = grads(boost::hana::type_c<Nvfp4>);
  EXPECT_TRUE(torch::equal(sr1, sr2));
  EXPECT_FALSE(torch::equal(sr1, rn));
}

// Each step draws fresh numbers: the same batch through the same weights
// gives other gradients on the next step (a generator reseeded or restored
// every step would round every step alike, a bias across steps), and a Trainer
// of its own starts from the same seed.
TEST(BlockScaledPolicy, StochasticRoundingDrawsFreshNumbersEveryStep) {
  auto two_steps = [] {
    BsNet net = make_net();
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.0));  // the weights stay
    amp::Trainer<Nvfp4Sr, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
    std::vector<torch::Tensor> grads;
    for (int step = 0; step < 2; ++step) {
      trainer.step([&](auto&) { return loss_of(net, batch(0)); });
      grads.push_back(net->fc1->weight.grad().clone());
      grads.push_back(net->fc2->weight.grad().clone());
    }
    return grads;
  };
  const std::vector<torch::Tensor> a = two_steps(), b = two_steps();
  EXPECT_FALSE(torch::equal(a[0], a[2]));  // fc1's gradient, step 1 against step 2
  EXPECT_FALSE(torch::equal(a[1], a[3]));  // fc2's
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << i;
}

TEST(BlockScaledPolicy, ActivationCheckpointRecomputesTheSameGradients) {
  for (int recipe : {0, 1}) {
    std::vector<torch::Tensor> got[2];
    for (int ckpt : {0, 1}) {
      BsNet net = make_net();
      const Batch data = batch(0);
      auto body = [&] {
        auto h = ckpt ? amp::checkpoint([&](const std::vector<torch::Tensor>& in) { return net->fc1(in[0]); }, {data.x})
                      : net->fc1(data.x);
        return torch::cross_entropy_loss(net->head(torch::relu(net->fc2(torch::relu(h)))).to(torch::kFloat), data.y);
      };
      torch::Tensor loss;
      if (recipe == 0) {
        amp::Region<Rceil, amp::CPU> region;
        loss = body();
      } else {
        amp::Region<Nvfp4, amp::CPU> region;
        loss = body();
      }
      loss.backward();
      for (const auto& p : net->parameters()) got[ckpt].push_back(p.grad().clone());
    }
    for (size_t i = 0; i < got[0].size(); ++i) EXPECT_TRUE(torch::equal(got[0][i], got[1][i])) << recipe << " " << i;
  }
}

TEST(BlockScaledPolicy, CoverageTilesByTheRecipesBlock) {
  torch::nn::Sequential seq(torch::nn::Linear(64, 48), torch::nn::Linear(48, 10));
  const auto mx = amp::float8::coverage<amp::MXFP8<>>(*seq);
  EXPECT_EQ(mx.kept, (std::vector<std::string>{"0 [48, 64]", "1 [10, 48]"}));
  EXPECT_EQ(bsd::describe(mx, bsd::kLinearBlock<amp::MXFP8<>>),
            "float8: 0 linear(s), 2 kept in bf16 (dimensions not multiples of 32: 0 [48, 64] 1 [10, 48])");
  EXPECT_EQ(amp::float8::coverage<amp::NVFP4<>>(*seq).converted, std::vector<std::string>{"0"});
}

TEST(BlockScaledPolicy, Names) {
  EXPECT_STREQ(amp::policy_traits<Rceil>::name, "mxfp8-rceil");
  EXPECT_STREQ(amp::policy_traits<Floor>::name, "mxfp8-floor");
  EXPECT_STREQ(amp::policy_traits<Nvfp4>::name, "nvfp4");
  EXPECT_STREQ(amp::policy_traits<Nvfp4Sr>::name, "nvfp4-sr");
  static_assert(amp::is_supported_v<Rceil, amp::CPU> && amp::is_supported_v<Nvfp4Sr, amp::CUDA>);
  static_assert(!amp::is_valid_policy_v<amp::Float8<amp::MXFP8<>, amp::DynamicScaler>>);
  static_assert(!amp::is_valid_policy_v<amp::Mixed<amp::NVFP4<>, amp::NoScaler>>);
  static_assert(!amp::is_valid_policy_v<amp::Float8<amp::MXFP8<static_cast<amp::MxScaleMode>(7)>>>);
}

#else
TEST(BlockScaledPolicy, NeedsTheFloat8Dtypes) {
  static_assert(!amp::is_supported_v<amp::Float8<amp::MXFP8<>>, amp::CPU>);
  GTEST_SKIP() << "the block-scaled policies need LibTorch 2.1+ (a static rule before)";
}
#endif  // AMP_DETAIL_HAS_FLOAT8_DTYPE

}  // namespace
}  // namespace float8_test
