// tests/parity/fsdp_parity.cc: the C++ half of the fully sharded parity check
// against PyTorch's own FSDP2 (torch.distributed.fsdp.fully_shard) on Gloo
// (tests/parity/fsdp_twin.py; both driven by ddp_twin_test.sh).
//
//   tools/launch -n N -- fsdp_parity OUT_DIR [VARIANT]     (N = 2, 3 in the test)
//
// Every rank trains fsdp_model.h's Net (each block a unit, the root the
// rest) through amp::FullyShard and AdamW on the fused path (amp::Stepper),
// kSteps steps per run on its own batches, and writes
// OUT_DIR/cpp_w<N>_r<rank>_steps.txt (per step: run, step, the loss's and
// the clip norm's float bits) and OUT_DIR/cpp_w<N>_r<rank>_<run>.pt: its
// parameter shards after every step, then the final exp_avg, exp_avg_sq and
// step of each shard. The twin runs fully_shard with the same
// MixedPrecisionPolicy and compares all of it, bit for bit:
//   fp32       no policy
//   bf16       param_dtype bf16, reduce_dtype fp32
//   bf16-clip  the same, gradients clipped by their global norm (0.5) each step
// VARIANT (to show that the comparison catches a change; the test does not pass it):
//   local-clip  clip by this rank's shards' norm alone (FullyShard's
//               all-reduce left out: each rank clips by its own norm)
//   flat        AdamW steps one flat tensor per unit (the padded shards of
//               its parameters, concatenated) instead of one per parameter
// Timeouts: AMP_DP_TIMEOUT_MS (default 120000) bounds every collective.
#include <torch/torch.h>

#include <amp/amp.h>
#include <amp/distributed.h>

#include "fsdp_model.h"
#include "parity_io.h"

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr int64_t kSteps = 16;
constexpr double kMaxNorm = 0.5;  // the norms are 0.46-0.66 at 2 and 3 ranks: clipped at some steps

using amp_parity::bits;

struct Run {
  std::string name;
  std::optional<c10::ScalarType> param_dtype, reduce_dtype;
  bool clip = false;
};

// The "flat" variant's optimizer: one fp32 tensor per unit holding its
// shards back to back; each step copies the shards and their gradients in,
// steps the flat tensor, and copies the result back.
struct Flat {
  std::vector<std::vector<torch::Tensor>> groups;  // shards per unit
  std::vector<torch::Tensor> flat;
  std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<amp::Stepper<amp::NoScaler>> stepper;
  Flat(const std::vector<torch::Tensor>& shards, const std::vector<std::string>& names) {
    std::string unit;
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string u = names[i].rfind("blocks.", 0) == 0 ? names[i].substr(0, names[i].find('.', 7)) : "root";
      if (groups.empty() || u != unit) groups.emplace_back(), unit = u;
      groups.back().push_back(shards[i]);
    }
    for (const auto& g : groups) {
      std::vector<torch::Tensor> parts;
      for (const auto& t : g) parts.push_back(t.detach().reshape({-1}));
      flat.push_back(torch::cat(parts).requires_grad_(true));
    }
    opt = std::make_unique<torch::optim::AdamW>(flat, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    stepper = std::make_unique<amp::Stepper<amp::NoScaler>>(*opt, amp::StepOptions().fused(true));
  }
  void step(const torch::Tensor& loss) {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < groups.size(); ++k) {
      std::vector<torch::Tensor> grads;
      for (const auto& t : groups[k]) grads.push_back(t.grad().reshape({-1}));
      flat[k].mutable_grad() = torch::cat(grads);
    }
    stepper->finish_step(loss);
    for (size_t k = 0; k < groups.size(); ++k) {
      int64_t off = 0;
      for (auto& t : groups[k]) {
        t.view({-1}).copy_(flat[k].narrow(0, off, t.numel()));
        off += t.numel();
        t.mutable_grad() = torch::Tensor();
      }
    }
  }
};

// The "local-clip" variant: FullyShard::clip_grad_norm's arithmetic on this
// rank's shards alone (no all-reduce).
torch::Tensor local_clip(const std::vector<torch::Tensor>& shards) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> norms;
  for (const auto& s : shards) norms.push_back(at::linalg_vector_norm(s.grad(), 2.0));
  const auto total = at::linalg_vector_norm(at::pow(at::pow(at::stack(norms), 2.0), 0.5), 2.0);
  const auto coef = at::clamp(at::reciprocal(total + 1e-6) * kMaxNorm, c10::nullopt, 1.0);
  for (const auto& s : shards) s.grad().mul_(coef);
  return total;
}

void run(const std::string& prefix, std::ofstream& steps, const amp::ProcessGroup& pg, const fsdp_model::Data& data,
         const Run& r, const std::string& variant) {
  fsdp_model::Net model;
  amp::FullyShard fsdp(pg, *model, model->units,
                       amp::FullyShardOptions().param_dtype(r.param_dtype).reduce_dtype(r.reduce_dtype));
  model->fsdp = &fsdp;
  const std::vector<torch::Tensor> shards = fsdp.parameters();
  torch::optim::AdamW opt(shards, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  amp::Stepper<amp::NoScaler> stepper(opt, amp::StepOptions().fused(true));
  if (!stepper.fused()) throw std::runtime_error("amp: fsdp_parity: AdamW does not take the fused path here");
  std::unique_ptr<Flat> flat;
  if (variant == "flat") flat = std::make_unique<Flat>(shards, fsdp.names());
  std::vector<torch::Tensor> saved;
  for (int64_t i = 0; i < kSteps; ++i) {
    const torch::Tensor loss = fsdp_model::loss_of(fsdp.forward(model, data.x[i]), data.y[i]);
    loss.backward();
    float norm = 0.0f;
    if (r.clip) {
      norm = (variant == "local-clip" ? local_clip(shards) : fsdp.clip_grad_norm(kMaxNorm)).item<float>();
    }
    if (flat) {
      flat->step(loss.detach());
    } else {
      stepper.finish_step(loss.detach());
      opt.zero_grad();
    }
    steps << r.name << " " << i << " " << bits(loss.item<float>()) << " " << bits(norm) << "\n";
    for (const auto& s : shards) saved.push_back(s.detach().clone());
  }
  auto state_of = [](torch::optim::AdamW& o, const torch::Tensor& p) -> torch::optim::AdamWParamState& {
    return static_cast<torch::optim::AdamWParamState&>(*o.state().at(p.unsafeGetTensorImpl()));
  };
  auto save_state = [&](const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq, int64_t step) {
    saved.push_back(exp_avg);
    saved.push_back(exp_avg_sq);
    saved.push_back(torch::full({}, static_cast<double>(step), torch::kFloat));
  };
  if (flat) {  // each shard's part of its unit's flat state
    flat->stepper->sync_optimizer_state();
    for (size_t k = 0; k < flat->groups.size(); ++k) {
      auto& st = state_of(*flat->opt, flat->flat[k]);
      int64_t off = 0;
      for (const auto& t : flat->groups[k]) {
        save_state(st.exp_avg().narrow(0, off, t.numel()).view(t.sizes()),
                   st.exp_avg_sq().narrow(0, off, t.numel()).view(t.sizes()), st.step());
        off += t.numel();
      }
    }
  } else {
    stepper.sync_optimizer_state();
    for (const auto& p : shards)
      save_state(state_of(opt, p).exp_avg(), state_of(opt, p).exp_avg_sq(), state_of(opt, p).step());
  }
  amp_parity::save(prefix + "_" + r.name + ".pt", saved);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::cerr << "usage: tools/launch -n N -- fsdp_parity OUT_DIR [local-clip|flat]\n";
    return 2;
  }
  const std::string variant = argc == 3 ? argv[2] : "";
  torch::set_num_threads(1);
  const char* t = std::getenv("AMP_DP_TIMEOUT_MS");
  const std::chrono::milliseconds timeout(t ? std::atol(t) : 120000);
  amp::ProcessGroup pg = amp::init_process_group(amp::ProcessGroupOptions().timeout(timeout).threads(1));
  const int rank = pg.rank(), world = pg.world_size();
  if (rank == 0)
    std::cout << "fsdp_parity: LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << " on cpu, world "
              << world << (variant.empty() ? "" : ", variant " + variant) << std::endl;
  const std::string prefix = std::string(argv[1]) + "/cpp_w" + std::to_string(world) + "_r" + std::to_string(rank);
  std::ofstream steps(prefix + "_steps.txt");
  const fsdp_model::Data data(rank, kSteps);
  const std::vector<Run> runs = {
      {"fp32", std::nullopt, std::nullopt, false},
      {"bf16", at::kBFloat16, at::kFloat, false},
      {"bf16-clip", at::kBFloat16, at::kFloat, true},
  };
  for (const auto& r : runs) run(prefix, steps, pg, data, r, variant);
  steps.flush();
  if (rank == 0) std::cout << "fsdp_parity: world " << world << " wrote " << prefix << "_*" << std::endl;
  pg.barrier();
  return 0;
}
