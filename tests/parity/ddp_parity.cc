// tests/parity/ddp_parity.cc: the C++ half of the data-parallel parity check
// against Python's torch.nn.parallel.DistributedDataParallel on Gloo
// (tests/parity/ddp_twin.py; both driven by ddp_twin_test.sh).
//
//   tools/launch -n N -- ddp_parity OUT_DIR        (N processes; N = 2, 3, 4 in the test)
//
// Every rank trains the 64-128-128-10 MLP of parity_io.h (as Mlp below: its
// bucket layout changes after the first step, see there) through
// amp::Trainer + amp::DataParallel, kSteps steps per run on its own batches
// (seeded by its rank), and writes OUT_DIR/cpp_w<N>_r<rank>_steps.txt (per
// step: run, step, the loss's and the loss scale's float bits), the final
// parameters (OUT_DIR/cpp_w<N>_r<rank>_<run>.pt) and the bucket layouts of
// steps 0-2 (OUT_DIR/cpp_w<N>_r<rank>_layouts.txt: run, step, buckets as
// "w3,b3|w2"). The twin runs the same steps under DDP and compares every
// rank's layouts, losses, scales and parameters bit for bit.
//   sgd-bf16-mixed           Trainer<Mixed<bf16, NoScaler>> + SGD (momentum), the optimizer's own
//                            step() (fused(false)) vs DDP + autocast + SGD(foreach=False); every LibTorch
//   sgd-16-mixed-inf         Trainer<Mixed<fp16, DynamicScaler>> + SGD (momentum), fused(false), an inf
//                            in the last rank's loss at steps 3, 4 and 17 vs DDP + torch.amp.GradScaler
//                            (CPU fp16 autocast and GradScaler kernels: LibTorch 2.3+)
//   adamw-bf16-mixed         Trainer<Mixed<bf16, NoScaler>> + AdamW (the fused path) vs AdamW(fused=True)
//                            (ATen's CPU fused optimizers: LibTorch 2.4+)
//   adamw-16-mixed-inf       Trainer<Mixed<fp16, DynamicScaler>> + fused AdamW, the same infs (2.4+)
//   sgd-bf16-mixed-fp16hook  sgd-bf16-mixed with DataParallelOptions::compression(kFp16) vs DDP with
//                            fp16_compress_hook (where this Gloo takes fp16)
//   sgd-bf16-mixed-buckets   sgd-bf16-mixed with bucket_cap_mb(0.02) vs DDP(bucket_cap_mb=0.02): after the
//                            first step 3 buckets from LibTorch 2.6 (first cut at the cap), 1 on 1.13 (1 MiB)
// A run this LibTorch cannot do is skipped with its reason ("skip <run>: ...").
// Timeouts: AMP_DP_TIMEOUT_MS (default 120000) bounds every collective.
#include <torch/torch.h>

#include <amp/amp.h>
#include <amp/distributed.h>

#include "parity_io.h"

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int kSteps = 30;
constexpr int64_t kBatch = 32;  // per rank

using amp_parity::bits;

// parity_io.h's MLP (its weights), its parameters registered in its order
// [w1, b1, w2, b2, w3, b3], as the twin's. Gloo sums each element of a bucket
// in an order that depends on its offset in the bucket (measured: an
// all-reduce of a tensor and of its flip differ in ~20% of the elements at 3
// and 4 processes), so the bits are DDP's only with DDP's layout: its first
// step's bucket holds the parameters in their order, later ones in the order
// their gradients arrived (under autocast: w3, b3, w2, b2, w1, b1): two
// layouts, neither the parameters reversed (amp's before it followed DDP).
struct Mlp : torch::nn::Module {
  Mlp() {
    auto ref = amp_parity::make_mlp();
    const auto p = ref->parameters();  // w1, b1, w2, b2, w3, b3
    w1 = register_parameter("w1", p[0].detach().clone());
    b1 = register_parameter("b1", p[1].detach().clone());
    w2 = register_parameter("w2", p[2].detach().clone());
    b2 = register_parameter("b2", p[3].detach().clone());
    w3 = register_parameter("w3", p[4].detach().clone());
    b3 = register_parameter("b3", p[5].detach().clone());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::linear(torch::relu(torch::linear(torch::relu(torch::linear(x, w1, b1)), w2, b2)), w3, b3);
  }
  std::vector<torch::Tensor> canonical() const { return {w1, b1, w2, b2, w3, b3}; }
  torch::Tensor w1, b1, w2, b2, w3, b3;
};

// This rank's batches: seeded by the rank, as the twin's.
struct Data {
  torch::Tensor x, y;
  explicit Data(int rank) {
    torch::manual_seed(100 + static_cast<uint64_t>(rank));
    x = torch::randn({kSteps, kBatch, 64}) * 2;
    y = torch::randint(0, 10, {kSteps, kBatch}, torch::kLong);
  }
};

// The last rank's loss is multiplied by inf at these steps (runs named "-inf").
bool poisoned(int step, int rank, int world) { return rank == world - 1 && (step == 3 || step == 4 || step == 17); }

// The twin's torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=5).
template <class Scaler>
Scaler make_scaler() {
  if constexpr (amp::detail::uses_loss_scaling_v<Scaler>) {
    return Scaler(amp::DynamicScalerOptions().init_scale(1024.0).growth_interval(5));
  } else {
    return Scaler();
  }
}

struct Out {
  std::string prefix;  // OUT_DIR/cpp_w<N>_r<rank>
  std::ofstream steps, layouts;
  explicit Out(const std::string& p) : prefix(p), steps(p + "_steps.txt"), layouts(p + "_layouts.txt") {}
};

// "w3,b3,w2|b2,w1|b1": the buckets in launch order, each's parameters in its order.
std::string layout_names(const std::vector<std::vector<size_t>>& layout, const std::vector<std::string>& names) {
  std::string s;
  for (size_t b = 0; b < layout.size(); ++b)
    for (size_t k = 0; k < layout[b].size(); ++k) s += (k ? "," : b ? "|" : "") + names.at(layout[b][k]);
  return s;
}

template <class Policy, class Opt, class OptOptions>
void run(Out& out, const amp::ProcessGroup& pg, const Data& data, const std::string& name,
         const OptOptions& opt_options, bool fused, amp::GradCompression compression = amp::GradCompression::kNone,
         double bucket_cap_mb = 25.0) {
  auto model = std::make_shared<Mlp>();
  Opt opt(model->parameters(), opt_options);
  amp::Trainer<Policy, amp::CPU> trainer(model, opt,
                                         amp::TrainerOptions().progress(false).step(amp::StepOptions().fused(fused)),
                                         make_scaler<typename Policy::scaler_type>());
  if (trainer.fused() != fused)  // the twin runs fused=True or foreach=False to match
    throw std::runtime_error("amp: ddp_parity: " + name + " takes " + trainer.optimizer_path() + ", not the " +
                             (fused ? "fused" : "unfused") + " path its Python twin runs");
  amp::DataParallel dp(pg, trainer, amp::DataParallelOptions().compression(compression).bucket_cap_mb(bucket_cap_mb));
  std::vector<std::string> names;
  for (const auto& p : model->named_parameters()) names.push_back(p.key());
  // DDP's first step: one bucket in parameter order; then a rebuilt one (the twin compares both with DDP's).
  if (dp.bucket_layout() != std::vector<std::vector<size_t>>{{0, 1, 2, 3, 4, 5}})
    throw std::runtime_error("amp: ddp_parity: " + name + ": the first step's buckets are " +
                             layout_names(dp.bucket_layout(), names) + ", not w1,b1,w2,b2,w3,b3");
  const bool inf = name.size() > 4 && name.compare(name.size() - 4, 4, "-inf") == 0;
  for (int i = 0; i < kSteps; ++i) {
    if (i < 3) out.layouts << name << " " << i << " " << layout_names(dp.bucket_layout(), names) << "\n";
    if (i == 1 && dp.bucket_layout() == std::vector<std::vector<size_t>>{{0, 1, 2, 3, 4, 5}})
      throw std::runtime_error("amp: ddp_parity: " + name + ": the rebuilt layout is the first one; the test " +
                               "no longer tells them apart");
    const bool poison = inf && poisoned(i, pg.rank(), pg.world_size());
    auto r = trainer.step([&](auto&) {
      const auto loss = torch::cross_entropy_loss(model->forward(data.x[i]), data.y[i]);
      return poison ? loss * std::numeric_limits<double>::infinity() : loss;
    });
    double scale = 1.0;
    if constexpr (amp::detail::uses_loss_scaling_v<typename Policy::scaler_type>) scale = trainer.scaler().get_scale();
    out.steps << name << " " << i << " " << bits(static_cast<float>(r.loss_value())) << " "
              << bits(static_cast<float>(scale)) << "\n";
  }
  out.steps.flush();
  out.layouts.flush();
  amp_parity::save(out.prefix + "_" + name + ".pt", model->canonical());
}

// Only where CPU fp16 autocast exists (a template, so that the Trainer is not
// instantiated for a LibTorch that rejects it).
template <bool kCpuFp16, bool kFused>
void run_fp16(Out& out, const amp::ProcessGroup& pg, const Data& data, std::vector<std::string>& skipped) {
  using torch::optim::SGD, torch::optim::SGDOptions, torch::optim::AdamW, torch::optim::AdamWOptions;
  if constexpr (kCpuFp16) {
    using Fp16 = amp::Mixed<amp::fp16, amp::DynamicScaler>;
    run<Fp16, SGD>(out, pg, data, "sgd-16-mixed-inf", SGDOptions(0.05).momentum(0.9), false);
    if constexpr (kFused) {
      run<Fp16, AdamW>(out, pg, data, "adamw-16-mixed-inf", AdamWOptions(1e-3).weight_decay(0.01), true);
    } else {
      skipped.push_back("adamw-16-mixed-inf: no CPU fused AdamW before LibTorch 2.4");
    }
  } else {
    skipped.push_back("sgd-16-mixed-inf: no CPU fp16 autocast / GradScaler kernels before LibTorch 2.3");
    skipped.push_back("adamw-16-mixed-inf: no CPU fp16 autocast / GradScaler kernels before LibTorch 2.3");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: tools/launch -n N -- ddp_parity OUT_DIR\n";
    return 2;
  }
  torch::set_num_threads(1);
  const char* t = std::getenv("AMP_DP_TIMEOUT_MS");
  const std::chrono::milliseconds timeout(t ? std::atol(t) : 120000);
  amp::ProcessGroup pg = amp::init_process_group(amp::ProcessGroupOptions().timeout(timeout).threads(1));
  const int rank = pg.rank(), world = pg.world_size();
  if (rank == 0)
    std::cout << "ddp_parity: LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << " on cpu, world "
              << world << std::endl;
  Out out(std::string(argv[1]) + "/cpp_w" + std::to_string(world) + "_r" + std::to_string(rank));
  const Data data(rank);
  using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;
  using torch::optim::SGD, torch::optim::SGDOptions, torch::optim::AdamW, torch::optim::AdamWOptions;
  std::vector<std::string> skipped;
  constexpr bool kFused = amp::detail::libtorch_at_least(2, 4);  // ATen's CPU fused AdamW
  run<Bf16, SGD>(out, pg, data, "sgd-bf16-mixed", SGDOptions(0.05).momentum(0.9), false);
  run_fp16<amp::detail::compat::kCpuHasFp16 && amp::detail::compat::kCpuHasAmpKernels, kFused>(out, pg, data, skipped);
  if constexpr (kFused) {
    run<Bf16, AdamW>(out, pg, data, "adamw-bf16-mixed", AdamWOptions(1e-3).weight_decay(0.01), true);
  } else {
    skipped.push_back("adamw-bf16-mixed: no CPU fused AdamW before LibTorch 2.4");
  }
  run<Bf16, SGD>(out, pg, data, "sgd-bf16-mixed-buckets", SGDOptions(0.05).momentum(0.9), false,
                 amp::GradCompression::kNone, 0.02);
  // Python's bf16_compress_hook refuses to run without CUDA and NCCL, so only
  // the fp16 hook has a twin on CPU (distributed_test's compress_bf16 checks kBf16).
  if (pg.gloo_takes(at::kHalf)) {
    run<Bf16, SGD>(out, pg, data, "sgd-bf16-mixed-fp16hook", SGDOptions(0.05).momentum(0.9), false,
                   amp::GradCompression::kFp16);
  } else {
    skipped.push_back("sgd-bf16-mixed-fp16hook: this LibTorch's Gloo does not take Half");
  }
  if (rank == 0) {
    for (const auto& s : skipped) std::cout << "ddp_parity: skip " << s << std::endl;
    std::cout << "ddp_parity: world " << world << " wrote " << out.prefix << "_*" << std::endl;
  }
  pg.barrier();
  return 0;
}
