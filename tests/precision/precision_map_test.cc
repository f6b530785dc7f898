// amp/precision/precision_map.h: modules picked by path, regex or type run in
// their mapped precision, with the bits of the same forward written by hand
// with AutocastDisabled around exactly those modules (Python's
// `with torch.autocast(enabled=False): m(x.float())`), for member submodules
// of a TORCH_MODULE and Sequential children; the errors that name the fix.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "../error_of.h"
#include "amp/amp.h"

namespace precision_map_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

using ::amp_test::error_of;
using ::testing::AllOf;
using ::testing::HasSubstr;
using M = amp::Mixed<amp::bf16, amp::NoScaler>;
using P = amp::ModulePrecision;

// An MLP, a member of the model below.
struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(16, 32))),
        fc2(register_module("fc2", torch::nn::Linear(32, 16))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

// Members, as users write models: no Sequential to wrap anything in.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : embed(register_module("embed", torch::nn::Linear(8, 16))),
        block(register_module("block", Block())),
        head(register_module("head", torch::nn::Linear(16, 4))) {}
  torch::Tensor trunk(const torch::Tensor& x) {
    const torch::Tensor h = embed(x);
    return h + block(h);
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(trunk(x)); }
  torch::nn::Linear embed;
  Block block;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

Net make_net() {
  torch::manual_seed(7);
  return Net();
}

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (const auto& p : m.parameters()) g.push_back(p.grad().clone());
  for (const auto& p : m.parameters()) p.mutable_grad() = torch::Tensor();
  return g;
}

void expect_same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "gradient " << i;
}

amp::RegionOptions with(amp::PrecisionMap map) { return amp::RegionOptions().precision_map(std::move(map)); }

// The hand-written twins: AutocastDisabled and fp32 inputs around the module,
// as Python's `with torch.autocast("cpu", enabled=False): m(x.float())`.
torch::Tensor linear_fp32(const torch::nn::Linear& m, const torch::Tensor& x) {
  amp::AutocastDisabled<amp::CPU> off;
  return torch::linear(x.to(torch::kFloat), m->weight, m->bias);
}
torch::Tensor block_fp32(NetImpl& n, const torch::Tensor& x) {
  amp::AutocastDisabled<amp::CPU> off;
  return linear_fp32(n.block->fc2, torch::relu(linear_fp32(n.block->fc1, x)));
}

TEST(PrecisionMap, MemberSubmoduleByPathRunsInFp32WithTheHandWrittenBits) {
  Net net = make_net();
  const torch::Tensor x = torch::randn({32, 8});
  torch::Tensor mapped, twin, unmapped;
  {
    amp::Region<M, amp::CPU> region(with(amp::PrecisionMap().path("head", P::kFp32)), *net);
    mapped = net->forward(x);
    mapped.sum().backward();
  }
  const auto g_mapped = grads_of(*net);
  {
    amp::Region<M, amp::CPU> region;
    twin = linear_fp32(net->head, net->trunk(x));
    twin.sum().backward();
  }
  const auto g_twin = grads_of(*net);
  {
    amp::Region<M, amp::CPU> region;
    unmapped = net->forward(x);
  }
  EXPECT_EQ(mapped.scalar_type(), torch::kFloat);  // fp32 logits, as Keras advises
  EXPECT_EQ(unmapped.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(mapped, twin));
  expect_same(g_mapped, g_twin);
}

// N-D input with a bias, in fp32 (docs/regions.md, "Linear routing"): LibTorch's
// F::linear adds the bias after the matmul, so the output is linear(x, w) + b,
// where Python's aten::linear runs one addmm on the flattened input; they part
// where the BLAS splits the inner dimension (OpenBLAS: in past 320 here).
// Flattened to 2-D around the layer, it is Python's linear(x, w, b).
TEST(PrecisionMap, NDInputWithABiasIsTheMatmulThenTheBiasAndFlattenedIsPythonsLinear) {
  torch::manual_seed(3);
  torch::nn::Module net;
  torch::nn::Linear head = net.register_module("head", torch::nn::Linear(1024, 32));
  const torch::Tensor x = torch::randn({4, 16, 1024});
  torch::Tensor nd, flat;
  {
    amp::Region<M, amp::CPU> region(with(amp::PrecisionMap().path("head", P::kFp32)), net);
    nd = head(x);
    flat = head(x.reshape({-1, 1024})).reshape({4, 16, 32});
  }
  amp::AutocastDisabled<amp::CPU> off;
  EXPECT_EQ(nd.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(nd, torch::linear(x, head->weight) + head->bias));
  EXPECT_TRUE(torch::equal(flat, torch::linear(x, head->weight, head->bias)));
}

TEST(PrecisionMap, ANestedMemberAndEverythingUnderItByPath) {
  Net net = make_net();
  const torch::Tensor x = torch::randn({32, 8});
  torch::Tensor mapped, twin;
  {
    amp::Region<M, amp::CPU> region(with(amp::PrecisionMap().path("block", P::kFp32)), *net);
    mapped = net->forward(x);
    mapped.sum().backward();
  }
  const auto g_mapped = grads_of(*net);
  {
    amp::Region<M, amp::CPU> region;
    const torch::Tensor h = net->embed(x);
    twin = net->head(h + block_fp32(*net, h));
    twin.sum().backward();
  }
  const auto g_twin = grads_of(*net);
  EXPECT_EQ(mapped.scalar_type(), torch::kBFloat16);  // the head is not mapped
  EXPECT_TRUE(torch::equal(mapped, twin));
  expect_same(g_mapped, g_twin);
}

TEST(PrecisionMap, ByTypeAndByRegexPickTheSameModules) {
  Net net = make_net();
  const torch::Tensor x = torch::randn({32, 8});
  torch::Tensor by_type, by_regex, twin;
  {
    amp::Region<M, amp::CPU> region(with(amp::PrecisionMap().type<BlockImpl>(P::kFp32)), *net);
    by_type = net->forward(x);
  }
  {
    amp::Region<M, amp::CPU> region(with(amp::PrecisionMap().regex("bl.ck\\.fc[0-9]", P::kFp32)), *net);
    by_regex = net->forward(x);
  }
  {
    amp::Region<M, amp::CPU> region;
    const torch::Tensor h = net->embed(x);
    twin = net->head(h + block_fp32(*net, h));
  }
  EXPECT_TRUE(torch::equal(by_type, twin));
  EXPECT_TRUE(torch::equal(by_regex, twin));
}

// Norms in fp32 (LibTorch 1.13's CPU layer_norm takes no bf16 input with fp32 weights at all).
TEST(PrecisionMap, EveryLayerNormByType) {
  torch::manual_seed(3);
  torch::nn::Sequential seq(torch::nn::Linear(8, 16), torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})),
                            torch::nn::Linear(16, 4));
  const torch::Tensor x = torch::randn({16, 8});
  torch::Tensor mapped, twin;
  {
    amp::Region<M, amp::CPU> region(with(amp::PrecisionMap().type<torch::nn::LayerNormImpl>(P::kFp32)), *seq);
    mapped = seq->forward(x);
    mapped.sum().backward();
  }
  const auto g_mapped = grads_of(*seq);
  {
    amp::Region<M, amp::CPU> region;
    const torch::Tensor h = seq[0]->as<torch::nn::Linear>()->forward(x);
    auto* ln = seq[1]->as<torch::nn::LayerNorm>();
    torch::Tensor n;
    {
      amp::AutocastDisabled<amp::CPU> off;
      n = torch::layer_norm(h.to(torch::kFloat), {16}, ln->weight, ln->bias, 1e-5);
    }
    twin = seq[2]->as<torch::nn::Linear>()->forward(n);
    twin.sum().backward();
  }
  const auto g_twin = grads_of(*seq);
  EXPECT_TRUE(torch::equal(mapped, twin));
  expect_same(g_mapped, g_twin);
}

TEST(PrecisionMap, SequentialChildrenByTheirIndex) {
  torch::manual_seed(3);
  torch::nn::Sequential seq(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
  const torch::Tensor x = torch::randn({16, 8});
  torch::Tensor mapped, twin;
  {
    amp::Region<M, amp::CPU> region(with(amp::PrecisionMap().path("2", P::kFp32)), *seq);
    mapped = seq->forward(x);
  }
  {
    amp::Region<M, amp::CPU> region;
    const torch::Tensor h = torch::relu(seq[0]->as<torch::nn::Linear>()->forward(x));
    amp::AutocastDisabled<amp::CPU> off;
    auto* last = seq[2]->as<torch::nn::Linear>();
    twin = torch::linear(h.to(torch::kFloat), last->weight, last->bias);
  }
  EXPECT_EQ(mapped.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(mapped, twin));
}

TEST(PrecisionMap, TheLastEntryThatPicksAParameterWins) {
  Net net = make_net();
  const torch::Tensor x = torch::randn({4, 8});
  amp::PrecisionMap map = amp::PrecisionMap().path("", P::kFp32).path("head", P::kBf16);
  amp::Region<M, amp::CPU> region(with(map), *net);
  EXPECT_EQ(net->trunk(x).scalar_type(), torch::kFloat);
  EXPECT_EQ(net->forward(x).scalar_type(), torch::kBFloat16);
}

TEST(PrecisionMap, ConvolutionsAndEmbeddingsToo) {
  torch::manual_seed(5);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(3, 4, 3));
  torch::nn::Embedding embed(10, 8);
  const torch::Tensor img = torch::randn({2, 3, 8, 8}), img16 = img.to(torch::kBFloat16);
  const torch::Tensor ids = torch::randint(0, 10, {5});
  {
    amp::Region<M, amp::CPU> region(with(amp::PrecisionMap().type<torch::nn::Conv2dImpl>(P::kFp32)), *conv);
    EXPECT_EQ(conv(img).scalar_type(), torch::kFloat);
    EXPECT_EQ(conv(img16).scalar_type(), torch::kFloat);  // inputs cast to fp32
  }
  {
    amp::Region<M, amp::CPU> unmapped;
    EXPECT_EQ(conv(img).scalar_type(), torch::kBFloat16);
  }
  {  // an Embedding's op is seen too: its weight in bf16, through autocast to bf16 (no listed op: fp32)
    amp::Region<M, amp::CPU> region(with(amp::PrecisionMap().path("", P::kFp32)), *embed);
    const torch::Tensor out = embed(ids);
    EXPECT_EQ(out.scalar_type(), torch::kFloat);
    EXPECT_TRUE(torch::equal(out, embed->weight.index_select(0, ids)));
  }
}

TEST(PrecisionMap, TrainerStepsEqualTheHandWrittenLoop) {
  Net a = make_net(), b = make_net();
  torch::optim::SGD opt_a(a->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD opt_b(b->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::Trainer<M, amp::CPU> trainer(
      a, opt_a,
      amp::TrainerOptions()
          .progress(false)
          .step(amp::StepOptions().fused(false))
          .region(with(amp::PrecisionMap().path("head", P::kFp32).path("block.fc2", P::kFp32))));
  for (int i = 0; i < 10; ++i) {
    const torch::Tensor x = torch::randn({16, 8}), y = torch::randn({16, 4});
    trainer.step([&](auto&) { return torch::mse_loss(a->forward(x), y); });
    opt_b.zero_grad();
    torch::Tensor loss;
    {
      amp::Region<M, amp::CPU> region;
      const torch::Tensor h = b->embed(x);
      const torch::Tensor t = h + linear_fp32(b->block->fc2, torch::relu(b->block->fc1(h)));
      loss = torch::mse_loss(linear_fp32(b->head, t), y);
    }
    loss.backward();
    opt_b.step();
  }
  for (size_t i = 0; i < a->parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(a->parameters()[i], b->parameters()[i])) << "parameter " << i;
  // evaluate() runs under the same map.
  EXPECT_EQ(trainer.evaluate([&](auto&) { return a->forward(torch::randn({2, 8})); }).scalar_type(), torch::kFloat);
}

// Fabric: model i's modules under "<i>.", resolved at the first forward after a setup().
TEST(PrecisionMap, FabricNamesModelIUnderI) {
  Net g = make_net(), d = make_net();
  torch::optim::SGD opt_g(g->parameters(), 0.1), opt_d(d->parameters(), 0.1);
  amp::Fabric<M, amp::CPU> fabric(amp::FabricOptions().region(with(amp::PrecisionMap().path("1.head", P::kFp32))));
  fabric.setup(g, opt_g);
  fabric.setup(d, opt_d);
  const torch::Tensor x = torch::randn({4, 8});
  fabric.forward([&](auto&) {
    EXPECT_EQ(g->forward(x).scalar_type(), torch::kBFloat16);
    EXPECT_EQ(d->forward(x).scalar_type(), torch::kFloat);
    return torch::Tensor();
  });
  amp::Fabric<M, amp::CPU> wrong(amp::FabricOptions().region(with(amp::PrecisionMap().path("head", P::kFp32))));
  wrong.setup(g, opt_g);
  EXPECT_THAT(error_of([&] { wrong.forward([&](auto&) { return g->forward(x); }); }),
              AllOf(HasSubstr("path \"head\" matches no module"), HasSubstr("\"0.head\"")));

  // Resolved once, and again after setup() adds a model: then "1.head" matches too.
  Net h = make_net();
  torch::optim::SGD opt_h(h->parameters(), 0.1);
  amp::Fabric<M, amp::CPU> late(amp::FabricOptions().region(with(amp::PrecisionMap().regex("[0-9]\\.head", P::kFp32))));
  late.setup(g, opt_g);
  late.forward([&](auto&) {
    EXPECT_EQ(g->forward(x).scalar_type(), torch::kFloat);
    EXPECT_EQ(h->forward(x).scalar_type(), torch::kBFloat16);  // not set up yet
    return torch::Tensor();
  });
  late.setup(h, opt_h);
  late.forward([&](auto&) {
    EXPECT_EQ(g->forward(x).scalar_type(), torch::kFloat);
    EXPECT_EQ(h->forward(x).scalar_type(), torch::kFloat);
    return torch::Tensor();
  });
}

// What fit() prints for a Float8 policy: the linears the map keeps out of float8.
TEST(PrecisionMap, Float8CoverageListsTheMappedLinears) {
  torch::nn::Sequential seq(torch::nn::Linear(64, 64), torch::nn::Linear(64, 16), torch::nn::Linear(16, 10));
  const auto table = amp::PrecisionMap().path("1", P::kNotFloat8).resolve({{"", seq.ptr().get()}});
  const amp::float8::Coverage c = amp::float8::coverage(*seq, table.get());
  EXPECT_EQ(c.converted, std::vector<std::string>{"0"});
  EXPECT_EQ(c.mapped, std::vector<std::string>{"1 (not float8)"});
  EXPECT_EQ(c.kept, std::vector<std::string>{"2 [10, 16]"});
  EXPECT_EQ(amp::float8::detail::describe(c),
            "float8: 1 linear(s), 1 kept in bf16 (dimensions not multiples of 16: 2 [10, 16]), 1 kept out by the "
            "precision map: 1 (not float8)");
}

TEST(PrecisionMap, MappedToTheOther16BitDtype) {
  if (!amp::detail::compat::kCpuHasFp16) {
    Net net = make_net();
    EXPECT_THAT(error_of([&] { amp::Region<M, amp::CPU> r(with(amp::PrecisionMap().path("head", P::kFp16)), *net); }),
                HasSubstr("amp: the precision map maps a module to fp16, but CPU autocast to fp16 needs LibTorch 2.3"));
    return;
  }
  Net net = make_net();
  amp::Region<M, amp::CPU> region(with(amp::PrecisionMap().path("head", P::kFp16)), *net);
  EXPECT_EQ(net->forward(torch::randn({4, 8})).scalar_type(), torch::kHalf);
}

// A model freed and a new one at its address: the map resolves the new one's
// parameters (a cache keyed by the model's address and parameter count once
// handed it the freed model's table, and its head ran in bf16).
TEST(PrecisionMap, ANewModelAtAFreedModelsAddressGetsItsOwnTable) {
#ifdef __SANITIZE_ADDRESS__
  GTEST_SKIP() << "AddressSanitizer holds freed memory back (its quarantine): no new model lands at a freed address";
#endif
  amp::PrecisionMap map;
  map.path("head", P::kFp32);
  const torch::nn::Module* freed = nullptr;
  Net b{nullptr};
  for (int i = 0; i < 1000 && (b.is_empty() || b.ptr().get() != freed); ++i) {
    {
      Net a = make_net();
      freed = a.ptr().get();
      map.resolve({{"", freed}});
    }
    b = Net();
  }
  ASSERT_EQ(b.ptr().get(), freed) << "no model landed at a freed one's address in 1000 tries";
  const auto table = map.resolve({{"", b.ptr().get()}});
  EXPECT_EQ(table->count(b->head->weight.unsafeGetTensorImpl()), 1u);
  amp::Region<M, amp::CPU> region(with(map), *b);
  EXPECT_EQ(b->forward(torch::randn({4, 8})).scalar_type(), torch::kFloat);
  // The same model again: the cached table, not a new one.
  EXPECT_EQ(map.resolve({{"", b.ptr().get()}}), table);
}

TEST(PrecisionMap, ErrorsNameTheFix) {
  Net net = make_net();
  EXPECT_THAT(error_of([&] { amp::Region<M, amp::CPU> r(with(amp::PrecisionMap().path("hed", P::kFp32)), *net); }),
              AllOf(HasSubstr("amp: the precision map's path \"hed\" matches no module of the model; its modules are: "
                              "\"\", \"embed\", \"block\", \"block.fc1\", \"block.fc2\", \"head\"")));
  EXPECT_THAT(error_of([] { amp::PrecisionMap().regex("block(", P::kFp32); }),
              HasSubstr("amp: the precision map's regex \"block(\" does not compile"));
  EXPECT_THAT(error_of([&] { amp::Region<M, amp::CPU> r(with(amp::PrecisionMap().regex("x.*", P::kFp32)), *net); }),
              HasSubstr("amp: the precision map's regex \"x.*\" matches no module"));
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::Softmax(1));
  EXPECT_THAT(error_of([&] { amp::Region<M, amp::CPU> r(with(amp::PrecisionMap().path("1", P::kFp32)), *seq); }),
              AllOf(HasSubstr("matches only modules without parameters"), HasSubstr("region.full_precision(f)")));
  EXPECT_THAT(error_of([&] { amp::Region<M, amp::CPU> r(with(amp::PrecisionMap().path("head", P::kFp32))); }),
              HasSubstr("amp: a Region with a precision map needs the model"));
  EXPECT_THAT(error_of([&] {
                amp::Region<M, amp::CPU> r(
                    with(amp::PrecisionMap().path("head", P::kFp32)).linear_routing(amp::LinearRouting::kOff), *net);
              }),
              HasSubstr("leave RegionOptions::linear_routing on"));
  EXPECT_THAT(
      error_of([&] { amp::Region<M, amp::CPU> r(with(amp::PrecisionMap().path("head", P::kNotFloat8)), *net); }),
      HasSubstr("but bf16-mixed runs no linear in float8"));
  EXPECT_THAT(error_of([&] {
                amp::Region<amp::True<amp::fp32>, amp::CPU> r(with(amp::PrecisionMap().path("head", P::kFp32)), *net);
              }),
              HasSubstr("amp: a precision map needs a policy that autocasts"));
  torch::optim::SGD opt(net->parameters(), 0.1);
  EXPECT_THAT(error_of([&] {
                amp::Trainer<M, amp::CPU> t(
                    net, opt, amp::TrainerOptions().region(with(amp::PrecisionMap().path("x", P::kFp32))));
              }),
              HasSubstr("amp: the precision map's path \"x\" matches no module"));
}

}  // namespace
}  // namespace precision_map_test
