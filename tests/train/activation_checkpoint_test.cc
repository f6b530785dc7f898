// amp/train/activation_checkpoint.h: amp::checkpoint recomputes a block in
// backward under the forward's precision and random state. Against the same
// step without checkpointing, bit for bit: a bf16 region with dropout; a
// precision map that keeps the block's second layer in fp32 (routing and the
// map switch themselves off inside backward, except in the recompute); the
// Trainer over several steps; a weight used inside a block and after it.
// Errors: a recompute that returns another shape, an input changed in place,
// an input that requires grad and that the function does not read.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "../error_of.h"
#include "amp/amp.h"

namespace activation_checkpoint_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

using ::amp_test::error_of;
using ::testing::HasSubstr;
using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(16, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 16))),
        drop(register_module("drop", torch::nn::Dropout(0.25))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(drop(torch::gelu(fc1(x)))); }
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() : block(register_module("block", Block())), head(register_module("head", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x, bool checkpointed) {
    torch::Tensor h = checkpointed ? amp::checkpoint(block, x) : block(x);
    return head(h);
  }
  Block block;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (const auto& p : m.parameters()) g.push_back(p.grad().clone());
  return g;
}

void expect_same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << what << " #" << i;
}

// One forward and backward of a fresh Net (seed 0) on x, checkpointed or not,
// in a bf16 region with `options`; returns the loss, x's gradient and the
// parameters' gradients.
std::vector<torch::Tensor> run(bool checkpointed, const amp::RegionOptions& options = {}) {
  torch::manual_seed(0);
  Net net;
  const torch::Tensor x = torch::randn({8, 5, 16}).requires_grad_();
  torch::manual_seed(1);  // dropout's masks
  torch::Tensor loss;
  {
    amp::Region<Bf16, amp::CPU> region(options, *net);
    loss = net->forward(x, checkpointed).to(torch::kFloat).pow(2).mean();
  }
  loss.backward();
  std::vector<torch::Tensor> out = {loss.detach(), x.grad()};
  for (const auto& g : grads_of(*net)) out.push_back(g);
  return out;
}

TEST(ActivationCheckpoint, ABf16BlockWithDropoutHasTheBitsOfTheUncheckpointedStep) {
  expect_same(run(true), run(false), "loss, input gradient, parameter gradients");
}

TEST(ActivationCheckpoint, WithoutTheRandomStateDropoutDrawsOtherMasks) {  // so the comparison above can fail
  auto input_grad = [](bool preserve) {
    torch::manual_seed(0);
    Block block;
    const torch::Tensor x = torch::randn({8, 16}).requires_grad_();
    {
      amp::Region<Bf16, amp::CPU> region;
      amp::checkpoint(block, x, amp::CheckpointOptions().preserve_rng_state(preserve))
          .to(torch::kFloat)
          .pow(2)
          .mean()
          .backward();
    }
    return x.grad();
  };
  EXPECT_FALSE(torch::equal(input_grad(false), input_grad(true)));
}

TEST(ActivationCheckpoint, TheRecomputeKeepsThePrecisionMap) {
  const auto options =
      amp::RegionOptions().precision_map(amp::PrecisionMap().path("block.fc2", amp::ModulePrecision::kFp32));
  const auto with = run(true, options), without = run(false, options);
  expect_same(with, without, "fp32-mapped fc2");
  EXPECT_FALSE(torch::equal(without[0], run(false)[0]));  // the map changes the loss: the comparison can fail
}

TEST(ActivationCheckpoint, NoIntermediatesAreSavedAndTheOutputHasOneBackwardNode) {
  torch::manual_seed(0);
  Block block;
  const torch::Tensor x = torch::randn({4, 16}).requires_grad_();
  amp::Region<Bf16, amp::CPU> region;
  const torch::Tensor y = amp::checkpoint(block, x);
  ASSERT_TRUE(y.grad_fn() != nullptr);
  EXPECT_EQ(y.grad_fn()->name(), "amp::CheckpointBackward");
  EXPECT_EQ(y.scalar_type(), torch::kFloat);  // x (fp32) + fc2's bf16 output
  EXPECT_EQ(y.grad_fn()->num_inputs(), 1u);
}

TEST(ActivationCheckpoint, TrainerStepsEqualTheUncheckpointedOnes) {
  auto train = [](bool checkpointed) {
    torch::manual_seed(0);
    Net net;
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    amp::Trainer<Bf16, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
    torch::manual_seed(1);
    for (int i = 0; i < 3; ++i) {
      const torch::Tensor x = torch::randn({8, 16}), y = torch::randint(0, 4, {8});
      trainer.step([&](auto&) { return torch::cross_entropy_loss(net->forward(x, checkpointed), y); });
    }
    std::vector<torch::Tensor> p;
    for (const auto& t : net->parameters()) p.push_back(t.detach().clone());
    return p;
  };
  expect_same(train(true), train(false), "parameters after 3 steps");
}

TEST(ActivationCheckpoint, ErrorsNameTheFix) {
  torch::manual_seed(0);
  Block block;
  {  // a function whose recompute returns another shape
    int calls = 0;
    const torch::Tensor x = torch::randn({4, 16}).requires_grad_();
    const torch::Tensor y = amp::checkpoint(
        [&](const std::vector<torch::Tensor>& in) {
          return ++calls == 1 ? block(in[0]) : block(in[0]).narrow(0, 0, 2);
        },
        {x});
    EXPECT_THAT(error_of([&] { y.sum().backward(); }), HasSubstr("amp: checkpoint's recompute returned"));
  }
  {  // an input changed in place between forward and backward
    torch::Tensor x = torch::randn({4, 16});
    const torch::Tensor y = amp::checkpoint(block, x);
    x.add_(1);
    EXPECT_THAT(error_of([&] { y.sum().backward(); }), HasSubstr("was modified in place after the forward"));
  }
}

// An input that requires grad but that fn does not read (it reads a tensor
// it captured instead) would get no gradient: an error. What cannot be
// detected: a captured tensor with history (another layer's output) gets its
// gradient through the recompute, as in torch's reentrant variant; a
// captured leaf, a parameter or not, gets its gradient as a parameter does.
TEST(ActivationCheckpoint, AnInputTheFunctionDoesNotReadIsAnError) {
  torch::manual_seed(0);
  torch::nn::Linear a(8, 8), b(8, 8);
  const torch::Tensor x = torch::randn({4, 8});
  const torch::Tensor h = a(x);  // requires grad, has history
  const torch::Tensor y = amp::checkpoint([&](const std::vector<torch::Tensor>&) { return b(h); }, {h});
  EXPECT_THAT(error_of([&] { y.sum().backward(); }),
              HasSubstr("amp: checkpoint's input 0 requires grad but the function's output does not depend on it"));
  const torch::Tensor leaf = torch::randn({4, 8}).requires_grad_();  // a captured leaf: as a parameter
  amp::checkpoint([&](const std::vector<torch::Tensor>& in) { return b(in[0]) * leaf; }, {x}).sum().backward();
  EXPECT_TRUE(torch::equal(leaf.grad(), b(x).detach()));
}

// A weight used inside a checkpointed block and again after it in the same
// region gets both gradient parts (summed in fp32 rather than bf16: close,
// not bitwise). The checkpoint's forward, without autograd, must not leave a
// cast without history in autocast's cache for the second use (1.13 and 2.6
// gave 215 instead of 299 here: the second use's part was lost).
TEST(ActivationCheckpoint, AWeightUsedInsideAndAfterABlockGetsBothGradientParts) {
  auto grad = [](bool checkpointed) {
    torch::manual_seed(0);
    torch::nn::Linear lin(16, 16);
    const torch::Tensor x = torch::randn({4, 16});
    torch::Tensor loss;
    {
      amp::Region<Bf16, amp::CPU> region;
      const torch::Tensor h = checkpointed ? amp::checkpoint(lin, x) : lin(x).to(torch::kFloat);
      loss = lin(h).to(torch::kFloat).pow(2).sum();
    }
    loss.backward();
    return lin->weight.grad();
  };
  const torch::Tensor with = grad(true), without = grad(false);
  EXPECT_TRUE(torch::allclose(with, without, 1e-2, 1e-3)) << (with - without).abs().max().item<double>();
}

}  // namespace
}  // namespace activation_checkpoint_test
