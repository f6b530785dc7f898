// tests/parity/float8_parity.cc: the C++ half of the float8 parity check.
//
//   float8_parity OUT_DIR
//
// Trains an MLP of torch::nn::Linear layers (64-128-128-10, batch 24) for 100
// steps with its linears in float8 (amp/float8/linear.h: tensorwise scaling,
// e4m3 forward, e5m2 output gradients) and everything else under bf16
// autocast, SGD with momentum; the last layer (10 outputs) does not fit
// _scaled_mm and stays bf16; the batch of 24 takes dW's padding path.
// Writes per-step losses (float bits) to OUT_DIR/cpp_steps.txt and the final
// parameters to OUT_DIR/cpp_<run>.pt for float8_twin.py, which trains the same
// recipe written in plain Python torch (torch._scaled_mm in a
// torch.autograd.Function, autocast excluded as in torchao) and compares bit
// for bit, oneDNN off on both sides.
//   fp8-tensorwise-mlp   the model's own forward (the C++ modules routed to
//                        float8::linear by a region with float8::LinearGuard)
//   fp8-delayed-mlp      the same with delayed scaling (amp/float8/delayed.h,
//                        history 16, so it rolls past its length): also the
//                        final amax histories and scales (cpp_<run>_fp8.pt)
//   fp8-tensorwise-block a small transformer block (LayerNorm, 4-head
//   fp8-delayed-block    attention, GELU FFN, a 10-class head; d 64, 8
//                        tokens, batch 5: 40 rows, dW's padding path)
//                        trained by amp::Trainer<amp::Float8<...>>, the
//                        policy itself: qkv, proj, fc1, fc2 in float8, the
//                        head, attention's matmuls and the rest in bf16
//   fp8-tensorwise-block-head-not-fp8, fp8-tensorwise-block-head-fp32
//                        the block with a 16-class head, which fits float8,
//                        kept out of it by a precision map (bf16; fp32)
//   fp8-rowwise-{mlp,block}, fp8-rowwise-gw-hp-{mlp,block}
//                        torchao's ROWWISE and ROWWISE_WITH_GW_HP
//                        (amp/float8/rowwise.h), from LibTorch 2.14 (a CPU
//                        _scaled_mm with rowwise scales)
// Needs a CPU _scaled_mm (LibTorch 2.8+): before, it writes nothing and says so.
#include <torch/torch.h>

#include <amp/amp.h>

#include "parity_io.h"
#include <amp/float8/delayed.h>
#include <amp/float8/linear.h>
#include <amp/float8/policy.h>
#include <amp/float8/rowwise.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace {

#if AMP_DETAIL_HAS_FLOAT8_MATMUL
constexpr int kSteps = 100;

using amp_parity::bits;
using amp_parity::make_mlp;
using amp_parity::save;

// The recipes an MLP run can take (amp/float8/linear.h, delayed.h, rowwise.h).
enum class Recipe { kTensorwise, kDelayed, kRowwise, kRowwiseGwHp };

void run_mlp(std::ofstream& steps, const std::string& out, const std::string& run, Recipe recipe) {
  const bool delayed = recipe == Recipe::kDelayed;
  auto model = make_mlp();
  torch::manual_seed(1);
  const auto x = torch::randn({kSteps, 24, 64}) * 4;
  const auto y = torch::randint(0, 10, {kSteps, 24}, torch::kLong);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  std::optional<amp::float8::DelayedScaling> fp8;
  if (delayed) {
    fp8.emplace(amp::float8::DelayedOptions().history_length(16));
    fp8->track(*model);
  }
  auto loss_of = [&](int i) { return torch::nn::functional::cross_entropy(model->forward(x[i]), y[i]); };
  for (int i = 0; i < kSteps; ++i) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> region;
      if (delayed) {
        amp::float8::DelayedLinearGuard guard(*fp8);
        loss = loss_of(i);
      } else if (recipe == Recipe::kRowwise) {
        amp::float8::LinearGuard<amp::Rowwise> guard;
        loss = loss_of(i);
      } else if (recipe == Recipe::kRowwiseGwHp) {
        amp::float8::LinearGuard<amp::RowwiseWithGwHp> guard;
        loss = loss_of(i);
      } else {
        amp::float8::LinearGuard<> guard;
        loss = loss_of(i);
      }
    }
    loss.backward();
    opt.step();
    if (delayed) fp8->update();
    steps << run << " " << i << " " << bits(loss.item<float>()) << "\n";
  }
  save(out + "/cpp_" + run + ".pt", model->parameters());
  if (delayed) {
    std::vector<torch::Tensor> state;
    for (const auto& item : fp8->state_dict()) state.push_back(item.value());
    save(out + "/cpp_" + run + "_fp8.pt", state);
  }
  std::cout << run << ": " << kSteps << " steps written\n";
}
#endif

#if AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL  // a Float8 Trainer on CPU
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t classes = 10)
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})))),
        qkv(register_module("qkv", torch::nn::Linear(64, 192))),
        proj(register_module("proj", torch::nn::Linear(64, 64))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})))),
        fc1(register_module("fc1", torch::nn::Linear(64, 256))),
        fc2(register_module("fc2", torch::nn::Linear(256, 64))),
        head(register_module("head", torch::nn::Linear(64, classes))) {}
  torch::Tensor forward(const torch::Tensor& x) {  // [B, T, 64] -> [B, classes]
    const int64_t b = x.size(0), t = x.size(1);
    const auto parts = qkv(ln1(x)).reshape({b, t, 3, 4, 16}).permute({2, 0, 3, 1, 4});  // [3, B, heads, T, 16]
    const auto q = parts[0], k = parts[1], v = parts[2];
    const auto att = torch::softmax(torch::matmul(q, k.transpose(-2, -1)) / 4.0, -1);
    const auto o = torch::matmul(att, v).permute({0, 2, 1, 3}).reshape({b, t, 64});
    auto h = x + proj(o);
    h = h + fc2(torch::gelu(fc1(ln2(h))));
    return head(h.mean(1));
  }
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2, head;
};
TORCH_MODULE(Block);

template <class R>
constexpr bool kIsDelayed = false;
template <int H, int M>
constexpr bool kIsDelayed<amp::Delayed<H, M>> = true;

template <class Policy>
void run_block(std::ofstream& steps, const std::string& out, const std::string& run, int64_t classes = 10,
               const amp::PrecisionMap& map = {}) {
  torch::manual_seed(0);
  Block model(classes);
  {
    torch::NoGradGuard no_grad;  // the linears' parameters from randn, in registration order; LayerNorms 1 and 0
    for (auto& item : model->named_parameters())
      if (item.key().rfind("ln", 0) != 0) item.value().copy_(torch::randn(item.value().sizes()) * 0.05);
  }
  torch::manual_seed(1);
  const auto x = torch::randn({kSteps, 5, 8, 64});
  const auto y = torch::randint(0, 10, {kSteps, 5}, torch::kLong);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::Trainer<Policy, amp::CPU> trainer(model, opt,
                                         amp::TrainerOptions()
                                             .progress(false)
                                             .step(amp::StepOptions().fused(false))
                                             .region(amp::RegionOptions().precision_map(map)));
  for (int i = 0; i < kSteps; ++i) {
    const amp::StepResult r =
        trainer.step([&](auto&) { return torch::nn::functional::cross_entropy(model->forward(x[i]), y[i]); });
    steps << run << " " << i << " " << bits(static_cast<float>(r.loss_value())) << "\n";
  }
  save(out + "/cpp_" + run + ".pt", model->parameters());
  if constexpr (kIsDelayed<typename Policy::recipe_type>) {
    std::vector<torch::Tensor> state;
    for (const auto& item : trainer.float8_state().scaling().state_dict()) state.push_back(item.value());
    save(out + "/cpp_" + run + "_fp8.pt", state);
  }
  std::cout << run << ": " << kSteps << " steps written\n";
}
#endif

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: float8_parity OUT_DIR\n";
    return 2;
  }
  const std::string out = argv[1];
  std::cout << "float8_parity: LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << " on cpu\n";
  // oneDNN off on both sides: every CPU takes _scaled_mm's emulated path (the
  // twin: torch.backends.mkldnn.enabled = False), whether or not it has AMX-INT8.
  at::globalContext().setUserEnabledMkldnn(false);
#if AMP_DETAIL_HAS_FLOAT8_MATMUL
  if constexpr (amp::detail::compat::kCpuHasScaledMm) {
    std::ofstream steps(out + "/cpp_steps.txt");
    run_mlp(steps, out, "fp8-tensorwise-mlp", Recipe::kTensorwise);
    run_mlp(steps, out, "fp8-delayed-mlp", Recipe::kDelayed);
#if AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL
    run_block<amp::Float8<amp::Tensorwise>>(steps, out, "fp8-tensorwise-block");
    run_block<amp::Float8<amp::Delayed<16, 0>>>(steps, out, "fp8-delayed-block");
    // A head that fits float8 (16 classes), kept out of it by the precision map: bf16, or fp32.
    using MP = amp::ModulePrecision;
    run_block<amp::Float8<amp::Tensorwise>>(steps, out, "fp8-tensorwise-block-head-not-fp8", 16,
                                            amp::PrecisionMap().path("head", MP::kNotFloat8));
    run_block<amp::Float8<amp::Tensorwise>>(steps, out, "fp8-tensorwise-block-head-fp32", 16,
                                            amp::PrecisionMap().path("head", MP::kFp32));
#endif
#if AMP_DETAIL_HAS_CPU_ROWWISE_FLOAT8
    run_mlp(steps, out, "fp8-rowwise-mlp", Recipe::kRowwise);
    run_mlp(steps, out, "fp8-rowwise-gw-hp-mlp", Recipe::kRowwiseGwHp);
    run_block<amp::Float8<amp::Rowwise>>(steps, out, "fp8-rowwise-block");
    run_block<amp::Float8<amp::RowwiseWithGwHp>>(steps, out, "fp8-rowwise-gw-hp-block");
#endif
    return 0;
  }
#endif
  std::cout << "skipped: float8 on CPU needs LibTorch 2.8+ (a CPU at::_scaled_mm)\n";
  return 0;
}
