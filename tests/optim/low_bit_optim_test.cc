// The low-bit Adams (amp/optim/low_bit_adam.h) and their quantized states
// (amp/optim/quantized_state.h): maps and codes against hand-computed values,
// block edges, zero blocks, the small-tensor rule, checkpoints (round trip,
// refusals that change nothing), state bytes per parameter, and the
// sync-free skip under a GradScaler inside the Trainer. Bitwise parity with
// torchao's algorithm in Python is tests/parity:low_bit_parity_test.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <amp/amp.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../error_of.h"
#include "../scalar_reads.h"

namespace low_bit_optim_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

using amp::StateFormat;
using amp::detail::QuantizedState;
using amp_test::error_of;

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         (a.numel() == 0 ||
          torch::equal(a.reshape({-1}).contiguous().view(at::kByte), b.reshape({-1}).contiguous().view(at::kByte)));
}

// --- maps -------------------------------------------------------------------

TEST(QuantizedStateMaps, FourBitSignedMapIsBitsandbytesDynamicMap) {
  // create_dynamic_map(True, 3, 4): means of linspace(0.1, 1, 2^i + 1) times 10^(i-2), both signs, 0 and 1.
  const at::Tensor m = amp::detail::lowbit::qmap(StateFormat::kInt4, true, at::kCPU);
  const std::vector<double> expected = {-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0,
                                        0.0055,  0.0325,  0.0775,  0.2125,  0.4375,  0.6625,  0.8875,  1.0};
  ASSERT_EQ(m.numel(), 16);
  for (int64_t k = 0; k < 16; ++k) EXPECT_NEAR(m[k].item<float>(), expected[k], 1e-6) << k;
}

TEST(QuantizedStateMaps, FourBitUnsignedMapIsLinearWithoutZero) {
  const at::Tensor m = amp::detail::lowbit::qmap(StateFormat::kInt4, false, at::kCPU);
  ASSERT_EQ(m.numel(), 16);
  for (int64_t k = 0; k < 16; ++k) EXPECT_FLOAT_EQ(m[k].item<float>(), static_cast<float>(k + 1) / 16.f) << k;
}

TEST(QuantizedStateMaps, EightBitMapsAreSortedWithZeroAndOne) {
  for (bool is_signed : {true, false}) {
    const at::Tensor m = amp::detail::lowbit::qmap(StateFormat::kInt8, is_signed, at::kCPU);
    ASSERT_EQ(m.numel(), 256);
    EXPECT_TRUE(torch::equal(std::get<0>(m.sort()), m)) << is_signed;
    EXPECT_EQ(m[255].item<float>(), 1.f);
    EXPECT_EQ((m == 0).sum().item<int64_t>(), 1) << is_signed;
    // The smallest magnitude is 10^-6 times a mean of the first interval: 1e-6 * 0.55 (signed) / 0.325 (unsigned).
    EXPECT_NEAR(m.abs().masked_select(m != 0).min().item<float>(), is_signed ? 0.55e-6 : 0.325e-6, 1e-12);
    if (is_signed) {
      EXPECT_LT(m[0].item<float>(), -0.99f);
    } else {
      EXPECT_EQ(m[0].item<float>(), 0.f);
    }
  }
}

// --- codes ------------------------------------------------------------------

TEST(QuantizedStateCodes, FourBitUnsignedHandComputedBlock) {
  // One block of 128: absmax 1, so the values are the normalized ones. Map
  // entry k is (k + 1) / 16; 0.52 rounds down to 8/16 (code 7), 0.54 up to
  // 9/16 (code 8); 0 is below the map and takes code 0 (1/16).
  at::Tensor x = at::full({128}, 0.25);  // code 3
  x[0] = 1.0;                            // code 15
  x[1] = 0.5;                            // code 7
  x[2] = 0.52;
  x[3] = 0.54;
  x[4] = 0.0;
  const QuantizedState s = QuantizedState::zeros(x, StateFormat::kInt4, /*is_signed=*/false, 128);
  auto q = s.quantize(x);
  ASSERT_EQ(q.first.numel(), 64);
  ASSERT_EQ(q.first.scalar_type(), at::kByte);
  EXPECT_EQ(q.second.item<float>(), 1.f);
  // Packed: first code in the high nibble.
  EXPECT_EQ(q.first[0].item<int>(), (15 << 4) | 7);
  EXPECT_EQ(q.first[1].item<int>(), (7 << 4) | 8);
  EXPECT_EQ(q.first[2].item<int>(), (0 << 4) | 3);
  EXPECT_EQ(q.first[3].item<int>(), (3 << 4) | 3);
  QuantizedState t = s;
  t.assign_(x);
  const at::Tensor back = t.dequantize();
  EXPECT_FLOAT_EQ(back[0].item<float>(), 1.f);
  EXPECT_FLOAT_EQ(back[2].item<float>(), 0.5f);
  EXPECT_FLOAT_EQ(back[3].item<float>(), 9.f / 16.f);
  EXPECT_FLOAT_EQ(back[4].item<float>(), 1.f / 16.f);
  EXPECT_FLOAT_EQ(back[10].item<float>(), 0.25f);
}

TEST(QuantizedStateCodes, EightBitCodesAreTheNearestMapEntry) {
  torch::manual_seed(3);
  const at::Tensor x = torch::randn({4096}) * torch::rand({4096}).pow(4);
  for (bool is_signed : {true, false}) {
    const at::Tensor v = is_signed ? x : x.abs();
    const QuantizedState s = QuantizedState::zeros(v, StateFormat::kInt8, is_signed, 256);
    auto q = s.quantize(v);
    const at::Tensor map = s.qmap();
    const at::Tensor normalized = (v.view({-1, 256}) / q.second.view({-1, 1})).view({-1});
    const at::Tensor chosen = map.index_select(0, q.first.to(at::kLong));
    const at::Tensor best = (normalized.unsqueeze(1) - map.unsqueeze(0)).abs().amin(1);
    EXPECT_TRUE(torch::equal((normalized - chosen).abs(), best)) << "signed " << is_signed;
  }
}

TEST(QuantizedStateCodes, BlocksScaleIndependentlyAndZeroBlocksStayZero) {
  at::Tensor x = at::zeros({3 * 256});
  x.slice(0, 0, 256).fill_(-3.0);
  x[5] = 6.0;                        // block 0: absmax 6
  x.slice(0, 256, 512).fill_(1e-3);  // block 1: absmax 1e-3
  // block 2: all zero: the scale is clipped to 1e-12 and the values stay 0
  QuantizedState s = QuantizedState::zeros(x, StateFormat::kInt8, true, 256);
  s.assign_(x);
  EXPECT_FLOAT_EQ(s.scale()[0].item<float>(), 6.f);
  EXPECT_FLOAT_EQ(s.scale()[1].item<float>(), 1e-3f);
  EXPECT_FLOAT_EQ(s.scale()[2].item<float>(), 1e-12f);
  const at::Tensor back = s.dequantize();
  EXPECT_FLOAT_EQ(back[5].item<float>(), 6.f);
  EXPECT_FLOAT_EQ(back[300].item<float>(), 1e-3f);
  EXPECT_EQ(back.slice(0, 512, 768).abs().max().item<float>(), 0.f);
  EXPECT_NEAR(back[0].item<float>(), -3.f, 3.f * 0.02f);
}

// The CPU pass (one loop per block) gives the bits of torchao's tensor ops,
// on random blocks, exact map entries and midpoints, zeros, -0, inf and NaN.
TEST(QuantizedStateCodes, CpuPassEqualsTheTensorOps) {
  namespace lb = amp::detail::lowbit;
  torch::manual_seed(11);
  for (StateFormat f : {StateFormat::kInt8, StateFormat::kInt4}) {
    const bool four = f == StateFormat::kInt4;
    for (bool is_signed : {true, false}) {
      const at::Tensor map = lb::qmap(f, is_signed, at::kCPU);
      const int64_t bs = four ? 128 : 256;
      at::Tensor x = torch::randn({8 * bs}) * torch::rand({8 * bs}).pow(6) * 3;
      if (!is_signed) x = x.abs();
      x.slice(0, bs, 2 * bs).copy_(map.repeat(bs / map.numel()));  // exact entries
      const at::Tensor mid = (map.slice(0, 0, -1) + map.slice(0, 1)) * 0.5;
      x.slice(0, 2 * bs, 2 * bs + mid.numel()).copy_(mid);  // midpoints (the max of block 2 is below 1)
      x.slice(0, 3 * bs, 4 * bs).zero_();
      x[4 * bs] = -0.0;
      x[5 * bs + 1] = std::numeric_limits<float>::infinity();
      x[6 * bs + 2] = std::numeric_limits<float>::quiet_NaN();
      const auto fast = lb::quantize_cpu(x, map, bs, four);
      const auto ops = lb::quantize_ops(x, map, bs, four);
      EXPECT_TRUE(bitwise_equal(fast.first, ops.first)) << amp::detail::state_format_name(f) << " signed " << is_signed;
      EXPECT_TRUE(bitwise_equal(fast.second, ops.second))
          << amp::detail::state_format_name(f) << " signed " << is_signed;
      EXPECT_TRUE(bitwise_equal(lb::dequantize_cpu(ops.first, map, ops.second, x.numel(), four),
                                lb::dequantize_ops(ops.first, map, ops.second, four)))
          << amp::detail::state_format_name(f) << " signed " << is_signed;
    }
  }
}

#if AMP_DETAIL_HAS_FLOAT8_DTYPE
TEST(QuantizedStateCodes, Fp8ScaleIsAbsmaxOver448) {
  at::Tensor x = at::linspace(-2, 1, 512);
  QuantizedState s = QuantizedState::zeros(x, StateFormat::kFp8, true, 256);
  s.assign_(x);
  EXPECT_EQ(s.codes().scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_FLOAT_EQ(s.scale()[0].item<float>(), 2.f / 448.f);
  EXPECT_FLOAT_EQ(s.dequantize()[0].item<float>(), -2.f);
  EXPECT_LT((s.dequantize() - x).abs().max().item<float>(), 2.f * 0.07f);
}
#endif

// --- the optimizers ---------------------------------------------------------

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(64, 128));  // weight 8192: quantized; bias 128: plain
    fc2 = register_module("fc2", torch::nn::Linear(128, 64));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

std::shared_ptr<Net> make_net(uint64_t seed = 0) {
  torch::manual_seed(seed);
  return std::make_shared<Net>();
}

template <class Opt>
void train(Net& net, Opt& opt, int steps, int first = 0) {
  for (int i = first; i < first + steps; ++i) {
    torch::manual_seed(100 + i);
    const auto x = torch::randn({32, 64}), y = torch::randn({32, 64});
    opt.zero_grad();
    torch::mse_loss(net.forward(x), y).backward();
    opt.step();
  }
}

TEST(LowBitAdam, SmallTensorsKeepPlainStatesLargeOnesQuantize) {
  amp::AdamW8bit opt(std::vector<at::Tensor>{}, torch::optim::AdamWOptions(1e-3));
  EXPECT_EQ(opt.format_for(at::zeros({4095})), StateFormat::kFloat);
  EXPECT_EQ(opt.format_for(at::zeros({4096})), StateFormat::kInt8);
  EXPECT_EQ(opt.format_for(at::zeros({17, 256})), StateFormat::kInt8);
  EXPECT_EQ(opt.format_for(at::zeros({4100})), StateFormat::kFloat) << "not a multiple of the block size";
  amp::AdamW4bit four(std::vector<at::Tensor>{}, torch::optim::AdamWOptions(1e-3));
  EXPECT_EQ(four.block_size(), 128);
  EXPECT_EQ(four.format_for(at::zeros({4224})), StateFormat::kInt4);  // 33 * 128
  EXPECT_EQ(amp::AdamW8bit::name(), "AdamW8bit");
  EXPECT_EQ(amp::Adam4bit::name(), "Adam4bit");
}

TEST(LowBitAdam, BadOptionsAreAmpErrors) {
  const std::vector<at::Tensor> none;
  EXPECT_EQ(error_of([&] { amp::AdamW8bit(none, torch::optim::AdamWOptions(-1.0)); }),
            "amp: AdamW8bit: invalid learning rate -1");
  EXPECT_EQ(error_of([&] { amp::AdamW4bit(none, torch::optim::AdamWOptions(), amp::LowBitOptions().block_size(5)); }),
            "amp: AdamW4bit: block_size must be positive and even, got 5 (0: the default, 128)");
  at::Tensor d = at::zeros({8}, at::kDouble).requires_grad_();
  d.mutable_grad() = at::ones({8}, at::kDouble);
  amp::AdamW8bit opt(std::vector<at::Tensor>{d});
  EXPECT_EQ(error_of([&] { opt.step(); }),
            "amp: AdamW8bit steps fp32, bf16 and fp16 parameters; parameter 0 of param group 0 is Double");
  EXPECT_TRUE(opt.state().empty()) << "a refused step makes no state";
}

TEST(LowBitAdam, TrainsAndKeepsQuantizedStates) {
  auto net = make_net();
  amp::AdamW8bit opt(net->parameters(), torch::optim::AdamWOptions(1e-3));
  train(*net, opt, 3);
  const auto& st = static_cast<const amp::detail::LowBitAdamParamState&>(
      *opt.state().at(amp::detail::compat::optim_state_key(net->fc1->weight.unsafeGetTensorImpl())));
  EXPECT_EQ(st.exp_avg().format(), StateFormat::kInt8);
  EXPECT_EQ(st.exp_avg().codes().numel(), 8192);
  EXPECT_EQ(st.exp_avg().scale().numel(), 32);
  EXPECT_EQ(st.step().item<float>(), 3.f);
  const auto& bias = static_cast<const amp::detail::LowBitAdamParamState&>(
      *opt.state().at(amp::detail::compat::optim_state_key(net->fc1->bias.unsafeGetTensorImpl())));
  EXPECT_EQ(bias.exp_avg().format(), StateFormat::kFloat);
}

// Bytes of optimizer state per parameter, counted from the state tensors:
// fp32 AdamW 8; 8-bit 2 + 2 * 4/256 (scales) + the small tensors' plain
// states and the 4-byte step counters; 4-bit 1 + 2 * 4/128 + ...; fp8 as 8-bit.
TEST(LowBitAdam, StateBytesPerParameter) {
  torch::manual_seed(0);
  // Two 1024x1024 layers: the biases (1024 each) stay plain.
  auto model = torch::nn::Sequential(torch::nn::Linear(1024, 1024), torch::nn::Linear(1024, 1024));
  const at::Tensor x = torch::randn({4, 1024});
  auto bytes_per_param = [&](torch::optim::Optimizer& opt) {
    opt.zero_grad();
    model->forward(x).sum().backward();
    opt.step();
    return static_cast<double>(amp::optimizer_state_bytes(opt)) / static_cast<double>(amp::parameter_count(opt));
  };
  const double n = static_cast<double>(2 * (1024 * 1024 + 1024));
  const double weights = 2.0 * 1024 * 1024, biases = 2.0 * 1024, counters = 4.0 * 4;
  torch::optim::AdamW fp32(model->parameters(), torch::optim::AdamWOptions(1e-4));
  EXPECT_EQ(bytes_per_param(fp32), 8.0);
  amp::AdamW8bit eight(model->parameters(), torch::optim::AdamWOptions(1e-4));
  const double b8 = bytes_per_param(eight);
  EXPECT_DOUBLE_EQ(b8, (weights * (2.0 + 8.0 / 256) + biases * 8.0 + counters) / n);
  EXPECT_LE(b8, 2.1);
  amp::AdamW4bit four(model->parameters(), torch::optim::AdamWOptions(1e-4));
  const double b4 = bytes_per_param(four);
  EXPECT_DOUBLE_EQ(b4, (weights * (1.0 + 8.0 / 128) + biases * 8.0 + counters) / n);
  EXPECT_LE(b4, 1.1);
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
  amp::AdamWFp8 fp8(model->parameters(), torch::optim::AdamWOptions(1e-4));
  const double b_fp8 = bytes_per_param(fp8);
  EXPECT_DOUBLE_EQ(b_fp8, b8);
  EXPECT_LE(b_fp8, 2.1);
#endif
}

template <class Opt>
std::string save_to_string(const Opt& opt) {
  torch::serialize::OutputArchive archive;
  opt.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

template <class Opt>
void load_from_string(Opt& opt, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  opt.load(archive);
}

template <class Opt>
std::vector<at::Tensor> state_tensors(const Opt& opt, const Net& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net.parameters()) {
    const auto& s = static_cast<const amp::detail::LowBitAdamParamState&>(
        *opt.state().at(amp::detail::compat::optim_state_key(p.unsafeGetTensorImpl())));
    out.push_back(s.step());
    for (const QuantizedState* q : {&s.exp_avg(), &s.exp_avg_sq()}) {
      out.push_back(q->format() == StateFormat::kFloat ? q->values() : q->codes());
      if (q->format() != StateFormat::kFloat) out.push_back(q->scale());
    }
  }
  return out;
}

template <class Opt>
void resume_is_bitwise() {
  auto a = make_net();
  Opt opt_a(a->parameters(), typename Opt::Options(1e-2));
  train(*a, opt_a, 5);
  const std::string ckpt = save_to_string(opt_a);
  auto b = make_net(7);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  Opt opt_b(b->parameters(), typename Opt::Options(1e-2));
  load_from_string(opt_b, ckpt);
  const auto sa = state_tensors(opt_a, *a), sb = state_tensors(opt_b, *b);
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(bitwise_equal(sa[i], sb[i])) << Opt::name() << " state " << i;
  train(*a, opt_a, 5, 5);
  train(*b, opt_b, 5, 5);
  for (size_t i = 0; i < a->parameters().size(); ++i)
    EXPECT_TRUE(bitwise_equal(a->parameters()[i], b->parameters()[i])) << Opt::name() << " parameter " << i;
}

TEST(LowBitAdam, CheckpointRoundTripResumesBitwise) {
  resume_is_bitwise<amp::AdamW8bit>();
  resume_is_bitwise<amp::AdamW4bit>();
  resume_is_bitwise<amp::Adam8bit>();
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
  resume_is_bitwise<amp::AdamWFp8>();
#endif
}

TEST(LowBitAdam, MismatchedCheckpointsAreRefusedAndNothingChanges) {
  auto net = make_net();
  amp::AdamW8bit opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  train(*net, opt, 2);
  const auto before = state_tensors(opt, *net);
  auto expect_unchanged = [&](const char* what) {
    const auto after = state_tensors(opt, *net);
    ASSERT_EQ(after.size(), before.size()) << what;
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(bitwise_equal(after[i], before[i])) << what << " " << i;
  };
  // Another optimizer's state: 4-bit codes where 8-bit ones belong.
  auto other = make_net();
  amp::AdamW4bit four(other->parameters(), torch::optim::AdamWOptions(1e-2));
  train(*other, four, 1);
  const std::string msg4 = error_of([&] { load_from_string(opt, save_to_string(four)); });
  EXPECT_EQ(msg4.rfind("amp: exp_avg of parameter 0 of param group 0 has 4096 codes of type Byte in the checkpoint; "
                       "a 8-bit state of this parameter has 8192 codes of type Byte",
                       0),
            0u)
      << msg4;
  expect_unchanged("4-bit checkpoint");
  // Another block size.
  amp::AdamW8bit wide(other->parameters(), torch::optim::AdamWOptions(1e-2), amp::LowBitOptions().block_size(512));
  train(*other, wide, 1);
  const std::string msg_bs = error_of([&] { load_from_string(opt, save_to_string(wide)); });
  EXPECT_NE(msg_bs.find("(a checkpoint of another block size?)"), std::string::npos) << msg_bs;
  expect_unchanged("block size 512");
  // Another model: shapes differ.
  struct Small : torch::nn::Module {
    Small() {
      fc1 = register_module("fc1", torch::nn::Linear(32, 128));
      fc2 = register_module("fc2", torch::nn::Linear(128, 64));
    }
    torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  };
  auto small = std::make_shared<Small>();
  amp::AdamW8bit small_opt(small->parameters(), torch::optim::AdamWOptions(1e-2));
  for (auto& p : small->parameters()) p.mutable_grad() = torch::ones_like(p);
  small_opt.step();
  const std::string msg_shape = error_of([&] { load_from_string(opt, save_to_string(small_opt)); });
  EXPECT_EQ(msg_shape.rfind("amp: exp_avg of parameter 0 of param group 0 has 4096 codes", 0), 0u) << msg_shape;
  expect_unchanged("other shapes");
  // LibTorch's own AdamW.
  torch::optim::AdamW plain(other->parameters(), torch::optim::AdamWOptions(1e-2));
  train(*other, plain, 1);
  const std::string msg_torch = error_of([&] { load_from_string(opt, save_to_string(plain)); });
  EXPECT_EQ(msg_torch.rfind("amp: ", 0), 0u) << msg_torch;
  expect_unchanged("torch::optim::AdamW checkpoint");
}

// Under a GradScaler, the Trainer takes the optimizer's own sync-free step:
// an inf gradient leaves parameters and quantized states bitwise as they
// were, the scale backs off, and (with the CPU GradScaler kernels, 2.3+)
// nothing is read back to the host.
TEST(LowBitAdam, TrainerSkipsInfStepsWithoutAHostSync) {
  auto net = make_net();
  amp::AdamW8bit opt(net->parameters(), torch::optim::AdamWOptions(1e-3));
  // fp32 compute with a loss scaler: how the scaling path runs on every CPU LibTorch.
  amp::Stepper<amp::DynamicScaler> stepper(opt, amp::StepOptions(), amp::DynamicScaler());
  ASSERT_TRUE(stepper.fused()) << stepper.optimizer_path();
  EXPECT_EQ(stepper.optimizer_path(), "sync-free (AdamW8bit's fused CPU step, one pass per block, no host sync)");
  torch::manual_seed(5);
  const auto x = torch::randn({32, 64}), y = torch::randn({32, 64});
  auto loss = [&](double poison) { return torch::mse_loss(net->forward(x), y) * poison; };
  stepper.step(loss(1.0));  // states made
  const auto params_before = net->parameters();
  std::vector<at::Tensor> saved;
  for (const auto& p : params_before) saved.push_back(p.detach().clone());
  const auto states_before = state_tensors(opt, *net);
  std::vector<at::Tensor> states_saved;
  for (const auto& t : states_before) states_saved.push_back(t.clone());
  const double scale_before = stepper.scaler().get_scale();
  int64_t reads = 0;
  {
    ScalarReads counter;
    auto r = stepper.step(loss(std::numeric_limits<double>::infinity()));
    reads = ScalarReads::outside;
    EXPECT_TRUE(r.skipped());
  }
  for (size_t i = 0; i < saved.size(); ++i) EXPECT_TRUE(bitwise_equal(net->parameters()[i], saved[i])) << i;
  const auto states_after = state_tensors(opt, *net);
  for (size_t i = 0; i < states_after.size(); ++i) EXPECT_TRUE(bitwise_equal(states_after[i], states_saved[i])) << i;
  EXPECT_EQ(stepper.scaler().get_scale(), scale_before * 0.5);
  if (amp::detail::compat::kCpuHasAmpKernels) {
    EXPECT_EQ(reads, 0) << "host reads in a skipped step";
    ScalarReads counter;
    for (int i = 0; i < 5; ++i) stepper.step(loss(1.0));
    EXPECT_EQ(ScalarReads::outside, 0) << "host reads in 5 finite steps";
  }
  // And a finite step moves everything again.
  stepper.step(loss(1.0));
  EXPECT_FALSE(bitwise_equal(net->fc1->weight, saved[0]));
}

// Trainer checkpoints carry the quantized states: a resumed run is bitwise
// the uninterrupted one.
TEST(LowBitAdam, TrainerResumeIsBitwise) {
  using T = amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>;
  const std::string path = ::testing::TempDir() + "/low_bit_trainer.pt";
  auto step_fn = [](Net& net, int i) {
    return [&net, i](auto&) {
      torch::manual_seed(200 + i);
      const auto x = torch::randn({32, 64}), y = torch::randn({32, 64});
      return torch::mse_loss(net.forward(x).to(torch::kFloat), y);
    };
  };
  auto a = make_net();
  amp::AdamW4bit opt_a(a->parameters(), torch::optim::AdamWOptions(1e-2));
  T ta(a, opt_a, amp::TrainerOptions().progress(false));
  for (int i = 0; i < 4; ++i) ta.step(step_fn(*a, i));
  ta.save(path);
  for (int i = 4; i < 8; ++i) ta.step(step_fn(*a, i));
  auto b = make_net(9);
  amp::AdamW4bit opt_b(b->parameters(), torch::optim::AdamWOptions(1e-2));
  T tb(b, opt_b, amp::TrainerOptions().progress(false));
  tb.load(path);
  for (int i = 4; i < 8; ++i) tb.step(step_fn(*b, i));
  for (size_t i = 0; i < a->parameters().size(); ++i)
    EXPECT_TRUE(bitwise_equal(a->parameters()[i], b->parameters()[i])) << i;
  std::remove(path.c_str());
}

// Several models under one policy (amp::Fabric): each low-bit optimizer
// takes its own sync-free step, and a checkpoint resumes bitwise.
TEST(LowBitAdam, PrecisionOfTwoModelsStepsAndResumesBitwise) {
  using P = amp::Fabric<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>;
  const std::string path = ::testing::TempDir() + "/low_bit_precision.pt";
  struct Run {
    std::shared_ptr<Net> a = make_net(1), b = make_net(2);
    amp::AdamW8bit opt_a{a->parameters(), torch::optim::AdamWOptions(1e-2)};
    amp::AdamW4bit opt_b{b->parameters(), torch::optim::AdamWOptions(1e-2)};
    P fabric;
    Run() {
      fabric.setup(a, opt_a);
      fabric.setup(b, opt_b, amp::StepOptions().max_grad_norm(1.0));
    }
    void iteration(int i) {
      torch::manual_seed(300 + i);
      const auto x = torch::randn({16, 64}), y = torch::randn({16, 64});
      opt_a.zero_grad();
      fabric.backward(fabric.forward([&](auto&) { return torch::mse_loss(a->forward(x).to(torch::kFloat), y); }));
      fabric.optimizer_step(opt_a);
      opt_b.zero_grad();
      fabric.backward(fabric.forward([&](auto&) { return torch::mse_loss(b->forward(x).to(torch::kFloat), y); }));
      fabric.optimizer_step(opt_b);
      fabric.update();
    }
  };
  Run first;
  EXPECT_EQ(first.fabric.optimizer_path(first.opt_a),
            "sync-free (AdamW8bit's fused CPU step, one pass per block, no host sync)");
  EXPECT_EQ(first.fabric.optimizer_path(first.opt_b),
            "sync-free (AdamW4bit's fused CPU step, one pass per block, no host sync)");
  for (int i = 0; i < 3; ++i) first.iteration(i);
  first.fabric.save(path);
  for (int i = 3; i < 6; ++i) first.iteration(i);
  Run second;
  second.fabric.load(path);
  for (int i = 3; i < 6; ++i) second.iteration(i);
  for (size_t i = 0; i < first.a->parameters().size(); ++i) {
    EXPECT_TRUE(bitwise_equal(first.a->parameters()[i], second.a->parameters()[i])) << "a " << i;
    EXPECT_TRUE(bitwise_equal(first.b->parameters()[i], second.b->parameters()[i])) << "b " << i;
  }
  const auto& st = static_cast<const amp::detail::LowBitAdamParamState&>(
      *first.opt_b.state().at(amp::detail::compat::optim_state_key(first.b->fc1->weight.unsafeGetTensorImpl())));
  EXPECT_EQ(st.exp_avg().format(), StateFormat::kInt4);
  EXPECT_EQ(st.step().item<float>(), 6.f);
  std::remove(path.c_str());
}

// Gradient accumulation: two micro-batches through the Trainer are the
// hand-written loop (loss / 2 twice, then the optimizer's own step()) bit for bit.
TEST(LowBitAdam, AccumulationEqualsTheHandWrittenLoop) {
  auto batch = [](int i) {
    torch::manual_seed(400 + i);
    return std::make_pair(torch::randn({16, 64}), torch::randn({16, 64}));
  };
  auto a = make_net();
  amp::AdamW8bit opt_a(a->parameters(), torch::optim::AdamWOptions(1e-2));
  amp::Trainer<amp::True<amp::fp32>, amp::CPU> trainer(
      a, opt_a, amp::TrainerOptions().progress(false).step(amp::StepOptions().accumulation_steps(2)));
  auto b = make_net();
  amp::AdamW8bit opt_b(b->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int i = 0; i < 8; ++i) {
    const auto xy = batch(i);
    trainer.step([&](auto&) { return torch::mse_loss(a->forward(xy.first), xy.second); });
    if (i % 2 == 0) opt_b.zero_grad();
    (torch::mse_loss(b->forward(xy.first), xy.second) / 2.0).backward();
    if (i % 2 == 1) opt_b.step();
  }
  for (size_t i = 0; i < a->parameters().size(); ++i)
    EXPECT_TRUE(bitwise_equal(a->parameters()[i], b->parameters()[i])) << i;
}

#if AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL
// A Float8 policy: the float8 linears' weights are stepped by a low-bit optimizer like any other.
TEST(LowBitAdam, TrainsUnderAFloat8Policy) {
  auto net = make_net();  // 64 -> 128 -> 64: every linear fits float8
  amp::AdamW8bit opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  amp::Trainer<amp::Float8<amp::Tensorwise>, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
  EXPECT_TRUE(trainer.fused()) << trainer.optimizer_path();
  const auto before = net->fc1->weight.detach().clone();
  double first = 0, last = 0;
  for (int i = 0; i < 6; ++i) {
    torch::manual_seed(500);
    const auto x = torch::randn({32, 64}), y = torch::randn({32, 64});
    const double loss =
        trainer.step([&](auto&) { return torch::mse_loss(net->forward(x).to(torch::kFloat), y); }).loss_value();
    (i == 0 ? first : last) = loss;
  }
  EXPECT_LT(last, first) << "the same batch six times: the loss falls";
  EXPECT_FALSE(bitwise_equal(net->fc1->weight, before));
  const auto& st = static_cast<const amp::detail::LowBitAdamParamState&>(
      *opt.state().at(amp::detail::compat::optim_state_key(net->fc1->weight.unsafeGetTensorImpl())));
  EXPECT_EQ(st.exp_avg().format(), StateFormat::kInt8);
  EXPECT_EQ(st.step().item<float>(), 6.f);
}
#endif

}  // namespace
}  // namespace low_bit_optim_test
