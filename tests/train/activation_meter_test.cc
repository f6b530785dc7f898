// amp/train/activation_meter.h: amp::ActivationMeter counts, exactly, the
// bytes a forward leaves alive for backward. Every expected count is computed
// from shapes: a closed form (what y = (x * w).exp() keeps, and a bf16 matmul
// under autocast); a stack of L pre-norm transformer blocks in a bf16 Region,
// where each block adds its activations without checkpointing but only its
// input (and the generator state it redraws dropout with) with amp::checkpoint; a no_grad forward keeps its output
// only. Allocations made before the meter began never count, nor do their frees; frees on other threads do.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "../error_of.h"
#include "amp/amp.h"

namespace activation_meter_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

using ::amp_test::error_of;
using ::testing::HasSubstr;
using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;

constexpr int64_t kBatch = 4, kSeq = 8, kWidth = 32;

// A pre-norm transformer block: x + proj(attention(norm1(x))), then
// x + dropout(fc2(gelu(fc1(norm2(x))))). x: [batch, seq, width], fp32.
struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : norm1(register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        qkv(register_module("qkv", torch::nn::Linear(kWidth, 3 * kWidth))),
        proj(register_module("proj", torch::nn::Linear(kWidth, kWidth))),
        norm2(register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        fc1(register_module("fc1", torch::nn::Linear(kWidth, 4 * kWidth))),
        fc2(register_module("fc2", torch::nn::Linear(4 * kWidth, kWidth))),
        drop(register_module("drop", torch::nn::Dropout(0.1))) {}
  torch::Tensor forward(torch::Tensor x) {
    const auto parts = qkv(norm1(x)).chunk(3, -1);
    const auto scores = torch::matmul(parts[0], parts[1].transpose(-2, -1)) / std::sqrt(double(kWidth));
    x = x + proj(torch::matmul(torch::softmax(scores, -1), parts[2]));
    return x + drop(fc2(torch::gelu(fc1(norm2(x)))));
  }
  torch::nn::LayerNorm norm1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm norm2;
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  explicit StackImpl(int blocks) {
    for (int i = 0; i < blocks; ++i) this->blocks.push_back(register_module("block" + std::to_string(i), Block()));
  }
  torch::Tensor forward(torch::Tensor x, bool checkpointed) {
    for (auto& block : blocks) x = checkpointed ? amp::checkpoint(block, x) : block(x);
    return x;
  }
  std::vector<Block> blocks;
};
TORCH_MODULE(Stack);

const int64_t kBlockInputBytes = kBatch * kSeq * kWidth * 4;  // fp32: x + bf16 is fp32

// The bytes a training forward of an L-block stack keeps, in a bf16 region
// (its output included), counted by a meter begun just before it. Autocast's
// bf16 copies of the weights, which it caches while the region lives, are
// made by a no_grad forward before the meter begins: the count is of
// activations only.
int64_t kept(int blocks, bool checkpointed) {
  torch::manual_seed(0);
  Stack stack(blocks);
  const torch::Tensor x = torch::randn({kBatch, kSeq, kWidth}).requires_grad_();
  {  // once untimed, so that nothing the first call of an op allocates for good counts below
    amp::Region<Bf16, amp::CPU> region;
    stack->forward(x, checkpointed).sum().backward();
  }
  amp::Region<Bf16, amp::CPU> region;
  {
    torch::NoGradGuard no_grad;
    stack->forward(x, false);
  }
  amp::ActivationMeter meter;
  const torch::Tensor y = stack->forward(x, checkpointed);
  return meter.bytes();
}

TEST(ActivationMeter, TheClosedFormCountsWhatAutogradKeeps) {
  const int64_t n = 1000;
  const torch::Tensor x = torch::randn({n}).requires_grad_(), w = torch::randn({n}).requires_grad_();
  amp::ActivationMeter meter;
  EXPECT_EQ(meter.bytes(), 0);
  // mul keeps x and w (older than the meter: not counted); x * w is exp's
  // input only and freed at the end of the statement; exp keeps its result.
  const torch::Tensor y = (x * w).exp();
  EXPECT_EQ(meter.bytes(), n * 4);
  EXPECT_EQ(meter.peak_bytes(), 2 * n * 4);  // x * w and exp's result, together for a moment
  const torch::Tensor view = y.narrow(0, 10, 100).t();
  EXPECT_EQ(meter.bytes(), n * 4);  // a view allocates nothing
}

TEST(ActivationMeter, ABf16MatmulKeepsItsCastsAndTheResult) {
  const int64_t n = 16, c = 32, h = 48;
  const torch::Tensor x = torch::randn({n, c}).requires_grad_(), w = torch::randn({c, h}).requires_grad_();
  amp::Region<Bf16, amp::CPU> region;
  amp::ActivationMeter meter;
  // autocast casts both fp32 leaves to bf16 and caches the casts (the
  // region's life); mm keeps them for backward; relu keeps its result; mm's
  // result is relu's input only.
  const torch::Tensor y = torch::mm(x, w).relu();
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(meter.bytes(), (n * c + c * h) * 2 + n * h * 2);
}

TEST(ActivationMeter, EachBlockKeepsItsActivationsWithoutCheckpointing) {
  const int64_t one = kept(1, false), two = kept(2, false), three = kept(3, false);
  EXPECT_EQ(three - two, two - one);  // a constant per block: one block's activations
  EXPECT_GT(two - one, 5 * kBlockInputBytes) << "one block keeps " << two - one;
}

TEST(ActivationMeter, EachCheckpointedBlockKeepsItsInputOnly) {
  // Per block: its output (the next block's input, or the stack's output) and
  // the CPU generator's state, which amp::checkpoint keeps to redraw the
  // dropout mask in the recompute.
  const int64_t rng_state_bytes = at::detail::getDefaultCPUGenerator().get_state().nbytes();
  const int64_t per_block = kBlockInputBytes + rng_state_bytes;
  const int64_t one = kept(1, true), two = kept(2, true), three = kept(3, true);
  EXPECT_EQ(two - one, per_block);
  EXPECT_EQ(three - two, per_block);
  EXPECT_EQ(one, per_block);  // nothing else: the stack's input is older than the meter
}

TEST(ActivationMeter, ANoGradForwardKeepsItsOutputOnly) {
  torch::manual_seed(0);
  Stack stack(3);
  const torch::Tensor x = torch::randn({kBatch, kSeq, kWidth});
  stack->eval();
  {
    torch::NoGradGuard no_grad;
    stack->forward(x, false);
  }  // untimed first call
  torch::NoGradGuard no_grad;
  amp::ActivationMeter meter;
  const torch::Tensor y = stack->forward(x, false);
  EXPECT_EQ(meter.bytes(), y.nbytes());
  EXPECT_EQ(meter.bytes(), kBlockInputBytes);
  EXPECT_GT(meter.peak_bytes(), meter.bytes());  // the intermediates existed, and went
}

TEST(ActivationMeter, OlderAllocationsAndTheirFreesNeverCount) {
  { amp::ActivationMeter install; }  // the counting allocator is in force from here on
  torch::Tensor old = torch::ones({1000});
  c10::Allocator* cpu = c10::GetAllocator(c10::DeviceType::CPU);
  void* raw_old = cpu->raw_allocate(256);  // as ideep allocates; freed through whatever allocator is in force
  amp::ActivationMeter meter;
  old.reset();
  cpu->raw_deallocate(raw_old);
  EXPECT_EQ(meter.bytes(), 0);
  EXPECT_EQ(meter.peak_bytes(), 0);
  torch::Tensor empty = torch::empty({0});  // zero bytes
  EXPECT_EQ(meter.bytes(), 0);
  torch::Tensor t = torch::ones({10});
  void* raw = cpu->raw_allocate(128);
  EXPECT_EQ(meter.bytes(), 40 + 128);
  cpu->raw_deallocate(raw);
  EXPECT_EQ(meter.bytes(), 40);
  {
    amp::ActivationMeter inner;  // meters nest: each counts from its own beginning
    torch::Tensor u = torch::ones({5});
    EXPECT_EQ(inner.bytes(), 20);
    EXPECT_EQ(meter.bytes(), 60);
  }
  EXPECT_EQ(meter.bytes(), 40);
  EXPECT_EQ(meter.peak_bytes(), 40 + 128);
}

TEST(ActivationMeter, FreesAndAllocationsOnOtherThreadsCount) {
  amp::ActivationMeter meter;
  torch::Tensor t = torch::ones({256});
  torch::Tensor made_there;
  std::thread([&made_there, moved = std::move(t)]() mutable {
    moved.reset();                                    // freed on this thread
    made_there = torch::zeros({64}, torch::kDouble);  // allocated on this one
  }).join();
  EXPECT_EQ(meter.bytes(), 64 * 8);
  made_there.reset();
  EXPECT_EQ(meter.bytes(), 0);
  EXPECT_EQ(meter.peak_bytes(), 256 * 4);  // the free came first
}

TEST(ActivationMeter, OtherDevicesAreErrorsOrCounted) {
#if AMP_DETAIL_WITH_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  amp::ActivationMeter meter(torch::kCUDA);
  const torch::Tensor t = torch::ones({1 << 18}, torch::kCUDA);  // 1 MiB: whole 512-byte blocks
  EXPECT_EQ(meter.bytes(), int64_t{1} << 20);
  EXPECT_GE(meter.peak_bytes(), meter.bytes());
#else
  EXPECT_THAT(error_of([] { amp::ActivationMeter meter(torch::kCUDA); }),
              HasSubstr("amp: ActivationMeter counts CPU memory, not cuda (this build has no CUDA)"));
#endif
  EXPECT_THAT(error_of([] { amp::ActivationMeter meter(torch::kMeta); }), HasSubstr("not meta"));
}

}  // namespace
}  // namespace activation_meter_test
