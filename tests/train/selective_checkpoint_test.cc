// amp/train/activation_checkpoint.h with CheckpointOptions::save_matmuls:
// selective checkpointing keeps the matmuls' outputs from the forward and
// recomputes the rest. Bit for bit against no checkpointing and against full
// checkpointing: a bf16 region with dropout on 3-D input (F::linear adds its
// bias in place to the matmul's output there), a precision map with fc2 in
// fp32, Trainer steps. The matmuls are not run again in backward while gelu
// is; the saved outputs are freed by backward; a recompute that calls other
// matmuls is an amp: error that names the op.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "../error_of.h"
#include "amp/amp.h"

namespace selective_checkpoint_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

using ::amp_test::error_of;
using ::testing::HasSubstr;
using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;

enum class Mode { kNone, kFull, kMatmuls };

amp::CheckpointOptions selective() { return amp::CheckpointOptions().save_matmuls(true); }

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
  NetImpl()
      : block1(register_module("block1", Block())),
        block2(register_module("block2", Block())),
        head(register_module("head", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x, Mode mode) {
    auto run = [&](Block& b, const torch::Tensor& h) {
      if (mode == Mode::kNone) return b(h);
      return amp::checkpoint(b, h, amp::CheckpointOptions().save_matmuls(mode == Mode::kMatmuls));
    };
    return head(run(block2, run(block1, x)));
  }
  Block block1, block2;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

void expect_same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << what << " #" << i;
}

// One forward and backward of a fresh Net (seed 0) on x ([8, 5, 16]: 3-D, so
// F::linear runs matmul then `output += bias`), in a bf16 region with
// `options`; returns the loss, x's gradient and the parameters' gradients.
std::vector<torch::Tensor> run(Mode mode, const amp::RegionOptions& options = {}) {
  torch::manual_seed(0);
  Net net;
  const torch::Tensor x = torch::randn({8, 5, 16}).requires_grad_();
  torch::manual_seed(1);  // dropout's masks
  torch::Tensor loss;
  {
    amp::Region<Bf16, amp::CPU> region(options, *net);
    loss = net->forward(x, mode).to(torch::kFloat).pow(2).mean();
  }
  loss.backward();
  std::vector<torch::Tensor> out = {loss.detach(), x.grad()};
  for (const auto& p : net->parameters()) out.push_back(p.grad().clone());
  return out;
}

TEST(SelectiveCheckpoint, ABf16StackWithDropoutHasTheBitsOfNoAndOfFullCheckpointing) {
  const auto selective_run = run(Mode::kMatmuls);
  expect_same(selective_run, run(Mode::kNone), "against no checkpointing");
  expect_same(selective_run, run(Mode::kFull), "against full checkpointing");
  amp::RegionOptions unrouted;
  unrouted.linear_routing(amp::LinearRouting::kOff);  // LibTorch's own F::linear: matmul, then the bias in place
  expect_same(run(Mode::kMatmuls, unrouted), run(Mode::kNone, unrouted), "routing off");
}

TEST(SelectiveCheckpoint, TheRecomputeKeepsThePrecisionMap) {
  const auto options = amp::RegionOptions().precision_map(
      amp::PrecisionMap().path("block1.fc2", amp::ModulePrecision::kFp32).path("head", amp::ModulePrecision::kFp32));
  const auto with = run(Mode::kMatmuls, options);
  expect_same(with, run(Mode::kNone, options), "fp32-mapped fc2 and head, against no checkpointing");
  expect_same(with, run(Mode::kFull, options), "against full checkpointing");
  EXPECT_FALSE(torch::equal(with[0], run(Mode::kNone)[0]));  // the map changes the loss: the comparison can fail
}

TEST(SelectiveCheckpoint, TrainerStepsEqualTheUncheckpointedOnes) {
  auto train = [](Mode mode) {
    torch::manual_seed(0);
    Net net;
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    amp::Trainer<Bf16, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
    torch::manual_seed(1);
    for (int i = 0; i < 3; ++i) {
      const torch::Tensor x = torch::randn({8, 16}), y = torch::randint(0, 4, {8});
      trainer.step([&](auto&) { return torch::cross_entropy_loss(net->forward(x, mode), y); });
    }
    std::vector<torch::Tensor> p;
    for (const auto& t : net->parameters()) p.push_back(t.detach().clone());
    return p;
  };
  expect_same(train(Mode::kMatmuls), train(Mode::kNone), "parameters after 3 steps");
}

// aten::gelu calls, counted through RecordFunction (which sees each call at the top).
struct GeluCounter {
  GeluCounter()
      : handle(at::addThreadLocalCallback(
            at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
              if (std::string(fn.name()) == "aten::gelu") ++count();
              return nullptr;
            }))) {}
  ~GeluCounter() { at::removeCallback(handle); }
  static int& count() {
    static thread_local int n = 0;
    return n;
  }
  at::CallbackHandle handle;
};

TEST(SelectiveCheckpoint, TheMatmulsAreNotRecomputedAndTheRestIs) {
  for (const bool save : {true, false}) {
    torch::manual_seed(0);
    Block block;
    const torch::Tensor x = torch::randn({8, 5, 16}).requires_grad_();
    amp::Region<Bf16, amp::CPU> region;
    const amp::detail::SavedOpsCounts start = amp::detail::saved_ops_counts();
    const torch::Tensor y = amp::checkpoint(block, x, amp::CheckpointOptions().save_matmuls(save));
    EXPECT_EQ(amp::detail::saved_ops_counts().computed - start.computed, save ? 2u : 0u) << "the forward's matmuls";
    const auto* node = dynamic_cast<const amp::detail::CheckpointNode*>(y.grad_fn().get());
    ASSERT_NE(node, nullptr);
    ASSERT_EQ(node->saved_ops() != nullptr, save);
    if (save) {  // fc1's and fc2's matmul (the routed linear on 3-D input: mm on [40, 16] and [40, 64])
      ASSERT_EQ(node->saved_ops()->size(), 2u);
      EXPECT_STREQ(node->saved_ops()->entry(0).op, "aten::mm");
      EXPECT_STREQ(node->saved_ops()->entry(1).op, "aten::mm");
    }
    const amp::detail::SavedOpsCounts before = amp::detail::saved_ops_counts();
    GeluCounter gelu;
    GeluCounter::count() = 0;
    y.to(torch::kFloat).pow(2).mean().backward();
    const amp::detail::SavedOpsCounts after = amp::detail::saved_ops_counts();
    EXPECT_EQ(after.replayed - before.replayed, save ? 2u : 0u) << "save_matmuls " << save;
    EXPECT_EQ(after.computed - before.computed, 0u) << "no matmul run below the cache in backward";
    EXPECT_EQ(GeluCounter::count(), 1) << "gelu recomputed once, save_matmuls " << save;
  }
}

TEST(SelectiveCheckpoint, SavedOutputsAreFreedByBackward) {
  torch::manual_seed(0);
  Block block;
  const torch::Tensor x = torch::randn({8, 5, 16}).requires_grad_();
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;
  {
    amp::Region<Bf16, amp::CPU> region;
    torch::Tensor y = amp::checkpoint(block, x, selective());
    const auto* saved = dynamic_cast<const amp::detail::CheckpointNode*>(y.grad_fn().get())->saved_ops();
    ASSERT_EQ(saved->size(), 2u);
    EXPECT_EQ(saved->bytes(), (40 * 64 + 40 * 16) * 2);  // two bf16 outputs
    for (size_t i = 0; i < saved->size(); ++i) storages.push_back(saved->entry(i).out.storage().getWeakStorageImpl());
    for (const auto& s : storages) EXPECT_FALSE(s.expired());
    y.to(torch::kFloat).sum().backward();
  }
  for (const auto& s : storages) EXPECT_TRUE(s.expired());
}

TEST(SelectiveCheckpoint, ARecomputeThatCallsOtherMatmulsIsAnErrorNamingTheOp) {
  torch::manual_seed(0);
  Block block;
  torch::nn::Linear other(16, 16);
  auto checkpointed = [&](auto body) {
    int calls = 0;
    const torch::Tensor x = torch::randn({4, 16}).requires_grad_();
    const torch::Tensor y =
        amp::checkpoint([&](const std::vector<torch::Tensor>& in) { return body(++calls, in[0]); }, {x}, selective());
    return error_of([&] { y.sum().backward(); });
  };
  // another matmul in the recompute (a matmul where the forward ran addmm)
  EXPECT_THAT(checkpointed([&](int calls, const torch::Tensor& x) {
                return calls == 1 ? block(x) : block(torch::matmul(x, other->weight.t()));
              }),
              HasSubstr("amp: checkpoint's recompute called aten::mm (Float[4, 16], Float[16, 16]) where the "
                        "forward's saved call #0 was aten::addmm"));
  // fewer matmuls in the recompute
  EXPECT_THAT(checkpointed([&](int calls, const torch::Tensor& x) { return calls == 1 ? other(block(x)) : block(x); }),
              HasSubstr("amp: checkpoint's recompute used 2 of the forward's 3 saved matmul outputs"));
  // more matmuls in the recompute
  EXPECT_THAT(checkpointed([&](int calls, const torch::Tensor& x) { return calls == 1 ? block(x) : other(block(x)); }),
              HasSubstr("after the 2 saved matmul outputs of the forward were used up"));
}

// Backward inside the region, full and selective: the forward's casts (made
// without grad) stay out of autocast's cache, or the recompute would take the
// weights' casts from it and give the weights no gradient.
TEST(SelectiveCheckpoint, BackwardInsideTheRegionHasTheBits) {
  auto grads = [](Mode mode) {
    torch::manual_seed(0);
    Block block;
    const torch::Tensor x = torch::randn({8, 5, 16}).requires_grad_();
    torch::manual_seed(1);
    amp::Region<Bf16, amp::CPU> region;
    const torch::Tensor y =
        mode == Mode::kNone ? block(x)
                            : amp::checkpoint(block, x, amp::CheckpointOptions().save_matmuls(mode == Mode::kMatmuls));
    y.to(torch::kFloat).pow(2).mean().backward();
    std::vector<torch::Tensor> out = {x.grad()};
    for (const auto& p : block->parameters()) out.push_back(p.grad().defined() ? p.grad() : torch::full({1}, -1.0));
    return out;
  };
  const auto none = grads(Mode::kNone);
  expect_same(grads(Mode::kFull), none, "full");
  expect_same(grads(Mode::kMatmuls), none, "selective");
}

TEST(SelectiveCheckpoint, ANestedSelectiveCheckpointTakesItsOutputsFromTheEnclosingRecompute) {
  auto grads = [](bool nested) {
    torch::manual_seed(0);
    Block inner, outer_fc;
    const torch::Tensor x = torch::randn({8, 5, 16}).requires_grad_();
    torch::manual_seed(1);
    {
      amp::Region<Bf16, amp::CPU> region;
      auto body = [&](const std::vector<torch::Tensor>& in) {
        const torch::Tensor h = nested ? amp::checkpoint(inner, in[0], selective()) : inner(in[0]);
        return outer_fc(h);
      };
      const torch::Tensor y = nested ? amp::checkpoint(body, {x}, selective()) : body({x});
      y.to(torch::kFloat).pow(2).mean().backward();
    }
    std::vector<torch::Tensor> out = {x.grad()};
    for (const auto& p : inner->parameters()) out.push_back(p.grad());
    for (const auto& p : outer_fc->parameters()) out.push_back(p.grad());
    return out;
  };
  const uint64_t replayed = amp::detail::saved_ops_counts().replayed;
  expect_same(grads(true), grads(false), "a selective checkpoint inside another");
  // the outer recompute hands the inner forward its 2 outputs and outer_fc its 2; the inner recompute its 2
  EXPECT_EQ(amp::detail::saved_ops_counts().replayed - replayed, 6u);
}

#if AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL
// Float8's _scaled_mm never reaches the kernels (autograd's not-implemented
// kernel skips ADInplaceOrView): its linears are recomputed in full, with the
// forward's scales, and the bits hold.
TEST(SelectiveCheckpoint, Float8DelayedStepsKeepTheirBits) {
  using Delayed = amp::Float8<amp::Delayed<4, 1>>;
  auto train = [](Mode mode, std::vector<std::string>& saved) {
    torch::manual_seed(0);
    Net net;
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    amp::Trainer<Delayed, amp::CPU> trainer(
        net, opt, amp::TrainerOptions().progress(false).step(amp::StepOptions().fused(false)));
    torch::manual_seed(1);
    std::vector<torch::Tensor> out;
    for (int i = 0; i < 4; ++i) {
      const torch::Tensor x = torch::randn({16, 16}), y = torch::randint(0, 4, {16});
      out.push_back(
          trainer
              .step([&](auto&) {
                if (mode == Mode::kNone)
                  return torch::cross_entropy_loss(net->head(net->block2(net->block1(x))).to(torch::kFloat), y);
                const torch::Tensor h =
                    amp::checkpoint(net->block1, x, amp::CheckpointOptions().save_matmuls(mode == Mode::kMatmuls));
                const auto* ops = dynamic_cast<const amp::detail::CheckpointNode&>(*h.grad_fn()).saved_ops();
                for (size_t k = 0; ops != nullptr && k < ops->size() && i == 0; ++k) saved.push_back(ops->entry(k).op);
                return torch::cross_entropy_loss(net->head(net->block2(h)).to(torch::kFloat), y);
              })
              .loss);
    }
    for (const auto& t : net->parameters()) out.push_back(t.detach().clone());
    return out;
  };
  std::vector<std::string> saved, full, none;
  const auto selective_run = train(Mode::kMatmuls, saved);
  expect_same(selective_run, train(Mode::kFull, full), "losses and parameters after 4 steps, against full");
  expect_same(selective_run, train(Mode::kNone, none), "against no checkpointing");
  EXPECT_TRUE(saved.empty()) << saved.size() << " saved, the first " << saved.front();  // fc1, fc2: float8 linears
  EXPECT_TRUE(full.empty());
}
#endif

}  // namespace
}  // namespace selective_checkpoint_test
