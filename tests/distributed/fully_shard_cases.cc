// amp::FullyShard across processes, run through tools/launch by
// distributed_test.sh's "fully_shard" group (one case per launch). Each rank
// prints "PASS <case>" or "FAIL <case>: why" and exits 0 / 1.
//
//   memory      bytes per rank counted exactly (parameters, gradients, AdamW and
//               AdamW8bit states, against the formula) and the peak of
//               unsharded parameters: the root and one block, in the compute dtype
//   vs_dp       FullyShard (fp32) beside amp::DataParallel on the same model and
//               batches: every loss and each rank's shard of every parameter,
//               bitwise at 1 and 2 processes, within 1e-5 beyond (see there)
//   accumulate  two micro-batches per step, the first without sync: one
//               reduce-scatter per unit per step, and the same comparison with
//               DataParallel's accumulation (Stepper, accumulation_steps 2)
//   clip        FullyShard::clip_grad_norm beside the Stepper's clipping under
//               DataParallel (which clips whole gradients: LibTorch's order of
//               the norm, not FSDP2's): parameters within 1e-5, some steps clipped
//   scaler      a DynamicScaler under FullyShard (torch's ShardedGradScaler):
//               one rank's shard gradient poisoned (inf at step 2 on the last
//               rank, NaN at step 5 on rank 0): every rank skips those steps,
//               shards bitwise unchanged, the scale backs off and grows by
//               torch's rule, and the run matches DataParallel + the same
//               scaler (bitwise at 2 processes, within 1e-5 at 3); the fused
//               step's check (a second FullyShard) makes the same decisions
//   checkpoint  amp::checkpoint inside each unit (the block's body) and around
//               each unit's call, in fp32 and with param_dtype bf16: losses,
//               shard gradients and parameters bitwise those without
//               checkpointing; the recompute finds the unit gathered (inside)
//               or gathers it again (around): as many all-gathers as without,
//               and the peak of unsharded bytes still the root and one block
//   autocast    a Trainer<Mixed<bf16, NoScaler>> (autocast around the forward)
//               under FullyShard (fp32 shards) beside the same Trainer under
//               DataParallel, without and with a precision map (block 0's
//               fc1 in fp32): losses and shards bitwise at 2 processes,
//               within a bf16 tolerance at 3 (see there); each differs from the fp32 run, so the
//               autocast (and the map) took effect
//   prefetch    FullyShardOptions::prefetch beside the same run without, in fp32
//               and with param_dtype bf16, also with amp::checkpoint around
//               each unit's call: losses, shard gradients and shards bitwise; as many all-gathers, of which 2 per block
//               per step prefetched (in backward only at the first step, whose order forward prefetch learns); the peak
//               of unsharded bytes more than the root and one block, at most the root and two
//   errors      bad input: amp: errors, nothing changed
//   die HOW WHERE  the last of 3 processes killed (HOW kill) or stopped (stop) at step 2,
//               before its forward (WHERE gather: the others wait in an all-gather)
//               or before its backward (reduce: in a reduce-scatter), or with
//               prefetch on before block 1's forward (prefetch: the others wait
//               in a prefetched all-gather): the others get an amp: error
//               naming it within the timeout
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "amp/distributed.h"
#include "amp/optim/low_bit_adam.h"
#include "amp/optim/state_bytes.h"
#include "amp/precision/precision_map.h"
#include "amp/scaler/dynamic_scaler.h"
#include "amp/scaler/no_scaler.h"
#include "amp/train/stepper.h"
#include "amp/train/trainer.h"
#include "process_case.h"
#include "tests/parity/fsdp_model.h"

namespace {

using test_case::check;
using test_case::fail;
using test_case::init;

std::string str(int64_t v) { return std::to_string(v); }

// This rank's rows of `whole` (FSDP2's dim-0 chunk), as FullyShard holds them.
torch::Tensor my_rows(const torch::Tensor& whole, int rank, int world) {
  const int64_t chunk = (whole.size(0) + world - 1) / world;
  const int64_t begin = std::min(whole.size(0), rank * chunk);
  return whole.narrow(0, begin, std::max<int64_t>(0, std::min(chunk, whole.size(0) - begin)));
}

// A model for the byte counts: two residual 256-wide blocks and a head. Its
// block weights' shards are multiples of 256 elements and >= 4096 at 1-4
// ranks (quantized 8-bit states); biases and the head are not (plain states).
struct WideBlockImpl : torch::nn::Module {
  WideBlockImpl() : fc(register_module("fc", torch::nn::Linear(256, 256))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::relu(torch::linear(x, fc->weight, fc->bias)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(WideBlock);
struct WideImpl : torch::nn::Module {
  WideImpl()
      : b0(register_module("b0", WideBlock())),
        b1(register_module("b1", WideBlock())),
        head(register_module("head", torch::nn::Linear(256, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::linear(fsdp->forward(b1, fsdp->forward(b0, x)), head->weight, head->bias);
  }
  WideBlock b0, b1;
  torch::nn::Linear head;
  amp::FullyShard* fsdp = nullptr;
};
TORCH_MODULE(Wide);

template <class Opt>
void memory_with(const amp::ProcessGroup& pg, std::optional<c10::ScalarType> param_dtype, const char* what) {
  const int rank = pg.rank(), world = pg.world_size();
  torch::manual_seed(3);
  Wide model;
  amp::FullyShard fsdp(pg, *model, {model->b0.ptr(), model->b1.ptr()},
                       amp::FullyShardOptions().param_dtype(param_dtype));
  model->fsdp = &fsdp;
  Opt opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-3));
  const int64_t elem = param_dtype ? 2 : 4;
  int64_t padded = 0, whole = 0, state = 0, quantized = 0, plain = 0, root_padded = 0;
  const std::vector<std::vector<int64_t>> shapes = {{256, 256}, {256}, {256, 256}, {256}, {8, 256}, {8}};
  for (const auto& s : shapes) {
    const int64_t inner = s.size() > 1 ? s[1] : 1, chunk = (s[0] + world - 1) / world;
    const int64_t rows = std::max<int64_t>(0, std::min(chunk, s[0] - rank * chunk));
    padded += chunk * inner, whole += s[0] * inner;
    if (&s >= &shapes[4]) root_padded += chunk * inner;
    const int64_t n = rows * inner;
    if (std::is_same_v<Opt, amp::AdamW8bit> && n >= 4096 && n % 256 == 0) {
      state += 2 * n + 2 * 4 * (n / 256) + 4, ++quantized;  // two int8 states, one fp32 scale per 256, fp32 step
    } else {
      state += 8 * n + (std::is_same_v<Opt, amp::AdamW8bit> ? 4 : 0), ++plain;  // two fp32 states (+ step)
    }
  }
  check(fsdp.parameter_bytes() == 4 * padded,
        std::string(what) + ": parameter bytes " + str(fsdp.parameter_bytes()) + ", expected " + str(4 * padded));
  check(fsdp.unsharded_bytes() == 0, std::string(what) + ": unsharded bytes at rest " + str(fsdp.unsharded_bytes()));
  for (int step = 0; step < 2; ++step) {
    torch::manual_seed(50 + static_cast<uint64_t>(rank));
    const auto x = torch::randn({4, 256});
    fsdp.reset_peak();
    const int64_t gathered = fsdp.allgathered_bytes(), scattered = fsdp.reduce_scattered_bytes();
    const auto loss = fsdp.forward(model, x).to(torch::kFloat).pow(2).mean();
    loss.backward();
    check(fsdp.unsharded_bytes() == 0,
          std::string(what) + ": unsharded bytes after backward " + str(fsdp.unsharded_bytes()));
    const auto units = fsdp.unit_bytes();  // b0, b1, root
    check(units.size() == 3 && units[0] == elem * (256 * 256 + 256) && units[2] == elem * (8 * 256 + 8),
          std::string(what) + ": unit bytes");
    check(fsdp.peak_unsharded_bytes() == units[2] + units[0],
          std::string(what) + ": peak unsharded " + str(fsdp.peak_unsharded_bytes()) + ", expected the root and one " +
              "block: " + str(units[2] + units[0]));
    // FSDP2's traffic: each block gathered twice (forward, backward), the
    // root once (kept from its forward to its backward), every gradient
    // reduce-scattered once; buffers of N padded shards, none at N = 1.
    const int64_t n = world > 1 ? world : 0;
    check(fsdp.allgathered_bytes() - gathered == n * elem * (2 * (padded - root_padded) + root_padded),
          std::string(what) + ": all-gathered bytes " + str(fsdp.allgathered_bytes() - gathered));
    check(fsdp.reduce_scattered_bytes() - scattered == n * elem * padded,
          std::string(what) + ": reduce-scattered bytes " + str(fsdp.reduce_scattered_bytes() - scattered));
    check(fsdp.gradient_bytes() == 4 * padded,
          std::string(what) + ": gradient bytes " + str(fsdp.gradient_bytes()) + ", expected " + str(4 * padded));
    opt.step();
    opt.zero_grad();
  }
  check(amp::optimizer_state_bytes(opt) == state, std::string(what) + ": optimizer state bytes " +
                                                      str(amp::optimizer_state_bytes(opt)) + ", expected " +
                                                      str(state));
  const int64_t total = 8 * padded + state;
  if (rank == 0)
    std::cout << "memory " << what << " world " << world << ": " << whole << " parameters; per rank at rest "
              << 4 * padded << " B parameters + " << 4 * padded << " B gradients + " << state << " B state = " << total
              << " B = " << static_cast<double>(total) / static_cast<double>(whole) << " B/parameter (" << quantized
              << " quantized, " << plain << " plain state shards); peak unsharded " << fsdp.peak_unsharded_bytes()
              << " B" << std::endl;
}

void memory() {
  auto pg = init();
  memory_with<torch::optim::AdamW>(pg, std::nullopt, "adamw-fp32");
  memory_with<torch::optim::AdamW>(pg, at::kBFloat16, "adamw-bf16");
  memory_with<amp::AdamW8bit>(pg, std::nullopt, "adamw8bit-fp32");
}

// FullyShard and DataParallel side by side. DataParallel multiplies each
// rank's gradient by 1/N and sums in its bucket's order; FullyShard sums in
// the reduce-scatter's order and divides (AVG). At 1 and 2 processes both
// are exact reorderings (a + b == b + a; x * 0.5 == x / 2), so the bits must
// agree; at 3 (1/3 is inexact) and 4 (the sum's order) they may differ in
// the last bit of a gradient, which AdamW carries on: within 1e-5.
void vs_dp(int64_t accumulation, bool clip) {
  auto pg = init();
  const int rank = pg.rank(), world = pg.world_size();
  const bool bitwise = world <= 2 && !clip;
  const int64_t steps = 6;
  fsdp_model::Net a, b;  // a: DataParallel; b: FullyShard
  torch::optim::AdamW opt_a(a->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  amp::Stepper<amp::NoScaler> stepper_a(
      opt_a, amp::StepOptions().fused(false).accumulation_steps(accumulation).max_grad_norm(clip ? 0.3 : 0.0));
  amp::DataParallel dp(pg, a->parameters());
  stepper_a.set_gradient_sync(&dp);
  amp::FullyShard fsdp(pg, *b, b->units);
  b->fsdp = &fsdp;
  torch::optim::AdamW opt_b(fsdp.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  amp::Stepper<amp::NoScaler> stepper_b(opt_b, amp::StepOptions().fused(false).accumulation_steps(accumulation));
  stepper_b.set_gradient_sync(&fsdp);
  const fsdp_model::Data data(rank, steps * accumulation);
  double worst = 0.0;
  int64_t clipped = 0;
  for (int64_t i = 0; i < steps * accumulation; ++i) {
    const int64_t before = fsdp.reduce_scatters();
    const auto la = stepper_a.step(fsdp_model::loss_of(a->forward(data.x[i]), data.y[i]));
    amp::StepResult lb;
    if (clip) {
      // The Stepper's own clipping would see this rank's shards only: clip in between.
      const auto loss = fsdp_model::loss_of(fsdp.forward(b, data.x[i]), data.y[i]);
      fsdp.begin_backward(true);
      loss.backward();
      clipped += fsdp.clip_grad_norm(0.3).item<double>() > 0.3;
      lb = stepper_b.finish_step(loss.detach());
      opt_b.zero_grad();
    } else {
      lb = stepper_b.step(fsdp_model::loss_of(fsdp.forward(b, data.x[i]), data.y[i]));
    }
    const int64_t expect = (i + 1) % accumulation == 0 ? 4 : 0;  // 3 blocks + the root, at the boundary only
    check(fsdp.reduce_scatters() - before == expect,
          "step " + str(i) + ": " + str(fsdp.reduce_scatters() - before) + " reduce-scatters, expected " + str(expect));
    check(bitwise ? torch::equal(la.loss, lb.loss) : torch::allclose(la.loss, lb.loss, 1e-5, 1e-6),
          "step " + str(i) + ": loss " + std::to_string(la.loss.item<double>()) + " vs " +
              std::to_string(lb.loss.item<double>()));
    const auto pa = a->parameters();
    const auto pb = fsdp.parameters();
    for (size_t k = 0; k < pa.size(); ++k) {
      const auto mine = my_rows(pa[k].detach(), rank, world);
      check(mine.sizes() == pb[k].sizes(), "parameter " + str(static_cast<int64_t>(k)) + ": shard shape");
      if (mine.numel() == 0) continue;
      worst = std::max(worst, (mine - pb[k].detach()).abs().max().item<double>());
      check(bitwise ? torch::equal(mine, pb[k].detach()) : torch::allclose(mine, pb[k].detach(), 1e-5, 1e-5),
            "step " + str(i) + ": parameter " + fsdp.names()[k] + " differs by " +
                std::to_string((mine - pb[k].detach()).abs().max().item<double>()));
    }
  }
  check(!clip || clipped > 0, "no step was clipped: the case does not test clipping");
  std::cout << "PASS " << test_case::name << " (" << (bitwise ? "bitwise" : "within 1e-5") << ", largest difference "
            << worst << ")" << std::endl;
}

// Which rank poisons its gradient at step i (-1: none), and with what.
int poisoner(int64_t i, int world) { return i == 2 ? world - 1 : i == 5 ? 0 : -1; }
double poison_value(int64_t i) { return i == 2 ? INFINITY : NAN; }

void scaler() {
  auto pg = init();
  const int rank = pg.rank(), world = pg.world_size();
  const bool bitwise = world <= 2;
  const int64_t steps = 8;
  const auto scaler_options = amp::DynamicScalerOptions().init_scale(1024.0).growth_interval(2);
  fsdp_model::Net a, b, c;  // a: DataParallel; b: FullyShard; c: FullyShard, the fused step where there is one
  torch::optim::AdamW opt_a(a->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  amp::Stepper<amp::DynamicScaler> stepper_a(opt_a, amp::StepOptions().fused(false),
                                             amp::DynamicScaler(scaler_options));
  amp::DataParallel dp(pg, a->parameters());
  stepper_a.set_gradient_sync(&dp);
  amp::FullyShard fsdp_b(pg, *b, b->units);
  b->fsdp = &fsdp_b;
  torch::optim::AdamW opt_b(fsdp_b.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  amp::Stepper<amp::DynamicScaler> stepper_b(opt_b, amp::StepOptions().fused(false),
                                             amp::DynamicScaler(scaler_options));
  stepper_b.set_gradient_sync(&fsdp_b);
  amp::FullyShard fsdp_c(pg, *c, c->units);
  c->fsdp = &fsdp_c;
  torch::optim::AdamW opt_c(fsdp_c.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  amp::Stepper<amp::DynamicScaler> stepper_c(opt_c, amp::StepOptions(), amp::DynamicScaler(scaler_options));
  stepper_c.set_gradient_sync(&fsdp_c);
  const fsdp_model::Data data(rank, steps);
  double expect_scale = 1024.0;
  int64_t tracker = 0, skipped = 0;
  double worst = 0.0;
  for (int64_t i = 0; i < steps; ++i) {
    const int who = poisoner(i, world);
    // DataParallel: the average carries one rank's inf/NaN to every rank, so
    // every rank's averaged gradient is poisoned (after the all-reduce).
    amp::StepResult ra;
    const auto la = fsdp_model::loss_of(a->forward(data.x[i]), data.y[i]);
    if (who < 0) {
      ra = stepper_a.step(la);
    } else {
      opt_a.zero_grad();
      dp.begin_backward(true);
      stepper_a.scaler().scale(la).backward();
      dp.finish_backward();
      torch::NoGradGuard no_grad;
      my_rows(a->parameters()[0].grad(), who, world)[0].fill_(poison_value(i));
      ra = stepper_a.finish_step(la.detach());
    }
    // FullyShard: only the poisoner's own shard holds it.
    auto fsdp_step = [&](amp::FullyShard& fsdp, fsdp_model::Net& net, torch::optim::AdamW& opt,
                         amp::Stepper<amp::DynamicScaler>& stepper, const std::string& what) {
      const auto loss = fsdp_model::loss_of(fsdp.forward(net, data.x[i]), data.y[i]);
      if (who < 0) return stepper.step(loss);
      opt.zero_grad();
      fsdp.begin_backward(true);
      stepper.scaler().scale(loss).backward();
      fsdp.finish_backward();
      std::vector<torch::Tensor> before;
      for (const auto& p : fsdp.parameters()) before.push_back(p.detach().clone());
      if (rank == who) {
        torch::NoGradGuard no_grad;
        fsdp.parameters()[0].grad()[0].fill_(poison_value(i));
      }
      const auto r = stepper.finish_step(loss.detach());
      const auto after = fsdp.parameters();
      for (size_t k = 0; k < after.size(); ++k)
        check(torch::equal(before[k], after[k].detach()),
              what + " step " + str(i) + ": shard " + fsdp.names()[k] + " changed on a skipped step");
      return r;
    };
    auto rb = fsdp_step(fsdp_b, b, opt_b, stepper_b, "FullyShard");
    auto rc = fsdp_step(fsdp_c, c, opt_c, stepper_c, "FullyShard (" + stepper_c.optimizer_path() + ")");
    // torch's rule (growth_interval 2, backoff 0.5, growth 2).
    if (who >= 0) {
      expect_scale *= 0.5, tracker = 0, ++skipped;
    } else if (++tracker == 2) {
      expect_scale *= 2.0, tracker = 0;
    }
    for (const auto* r : {&ra, &rb, &rc})
      check(r->skipped() == (who >= 0), "step " + str(i) + ": skipped " + str(r->skipped()) + " on rank " + str(rank) +
                                            ", expected " + str(who >= 0) + " (poisoned by rank " + str(who) + ")");
    for (const auto* s : {&stepper_a.scaler(), &stepper_b.scaler(), &stepper_c.scaler()})
      check(s->get_scale() == expect_scale, "step " + str(i) + ": scale " + std::to_string(s->get_scale()) +
                                                ", expected " + std::to_string(expect_scale));
    check(bitwise ? torch::equal(la.detach(), rb.loss) : torch::allclose(la.detach(), rb.loss, 1e-5, 1e-6),
          "step " + str(i) + ": loss differs from DataParallel's");
    const auto pa = a->parameters();
    const auto pb = fsdp_b.parameters();
    const auto pc = fsdp_c.parameters();
    for (size_t k = 0; k < pa.size(); ++k) {
      const auto mine = my_rows(pa[k].detach(), rank, world);
      if (mine.numel() == 0) continue;
      worst = std::max(worst, (mine - pb[k].detach()).abs().max().item<double>());
      check(bitwise ? torch::equal(mine, pb[k].detach()) : torch::allclose(mine, pb[k].detach(), 1e-5, 1e-5),
            "step " + str(i) + ": parameter " + fsdp_b.names()[k] + " differs from DataParallel's by " +
                std::to_string((mine - pb[k].detach()).abs().max().item<double>()));
      check(torch::allclose(pb[k].detach(), pc[k].detach(), 1e-5, 1e-5),
            "step " + str(i) + ": parameter " + fsdp_b.names()[k] + " of the fused step differs");
    }
  }
  check(skipped == 2, "the case skipped " + str(skipped) + " steps, expected 2");
  std::cout << "PASS scaler (" << (bitwise ? "bitwise" : "within 1e-5") << " with DataParallel, largest difference "
            << worst << "; final scale " << expect_scale << "; fused case: " << stepper_c.optimizer_path() << ")"
            << std::endl;
}

void checkpointed(const amp::ProcessGroup& pg, std::optional<c10::ScalarType> param_dtype, const std::string& what) {
  const int rank = pg.rank();
  const int64_t steps = 3;
  fsdp_model::Net a, b, c;  // a: no checkpoint; b: inside each unit; c: around each unit's call
  b->blocks->apply([](torch::nn::Module& m) {
    if (auto* block = dynamic_cast<fsdp_model::BlockImpl*>(&m)) block->checkpointed = true;
  });
  c->checkpoint_units = true;
  const auto options = amp::FullyShardOptions().param_dtype(param_dtype);
  amp::FullyShard fa(pg, *a, a->units, options), fb(pg, *b, b->units, options), fc(pg, *c, c->units, options);
  a->fsdp = &fa, b->fsdp = &fb, c->fsdp = &fc;
  torch::optim::AdamW oa(fa.parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ob(fb.parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW oc(fc.parameters(), torch::optim::AdamWOptions(1e-2));
  const fsdp_model::Data data(rank, steps);
  const auto units = fa.unit_bytes();
  for (int64_t i = 0; i < steps; ++i) {
    std::vector<torch::Tensor> losses;
    std::vector<int64_t> gathers;
    for (auto* run : {&a, &b, &c}) {
      amp::FullyShard& f = run == &a ? fa : run == &b ? fb : fc;
      const int64_t before = f.allgathers();
      f.reset_peak();
      const auto loss = fsdp_model::loss_of(f.forward(*run, data.x[i]), data.y[i]);
      loss.backward();
      losses.push_back(loss.detach());
      gathers.push_back(f.allgathers() - before);
      check(f.peak_unsharded_bytes() <= units.back() + units.front(),
            what + " step " + str(i) + ": peak unsharded " + str(f.peak_unsharded_bytes()) + " > the root and a block");
      check(f.unsharded_bytes() == 0, what + " step " + str(i) + ": a unit left gathered after backward");
    }
    check(gathers[1] == gathers[0] && gathers[2] == gathers[0], what + " step " + str(i) + ": all-gathers " +
                                                                    str(gathers[0]) + " / " + str(gathers[1]) + " / " +
                                                                    str(gathers[2]) + " without / inside / around");
    for (size_t k = 1; k < 3; ++k)
      check(torch::equal(losses[0], losses[k]), what + " step " + str(i) + ": loss " + str(int64_t(k)) + " differs");
    const auto pa = fa.parameters(), pb = fb.parameters(), pc = fc.parameters();
    for (size_t k = 0; k < pa.size(); ++k) {
      check(torch::equal(pa[k].grad(), pb[k].grad()) && torch::equal(pa[k].grad(), pc[k].grad()),
            what + " step " + str(i) + ": gradient of " + fa.names()[k] + " differs under checkpointing");
    }
    for (auto* o : {&oa, &ob, &oc}) o->step(), o->zero_grad();
    for (size_t k = 0; k < pa.size(); ++k)
      check(torch::equal(pa[k], pb[k]) && torch::equal(pa[k], pc[k]),
            what + " step " + str(i) + ": shard of " + fa.names()[k] + " differs under checkpointing");
  }
}

void prefetched(const amp::ProcessGroup& pg, std::optional<c10::ScalarType> param_dtype, const std::string& what) {
  const int rank = pg.rank();
  const int64_t steps = 3;
  fsdp_model::Net a, b, c;  // a: without prefetch; b: with; c: with, amp::checkpoint around each unit's call
  c->checkpoint_units = true;
  const auto options = amp::FullyShardOptions().param_dtype(param_dtype);
  const auto with = amp::FullyShardOptions(options).prefetch(true);
  amp::FullyShard fa(pg, *a, a->units, options), fb(pg, *b, b->units, with), fc(pg, *c, c->units, with);
  a->fsdp = &fa, b->fsdp = &fb, c->fsdp = &fc;
  torch::optim::AdamW oa(fa.parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ob(fb.parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW oc(fc.parameters(), torch::optim::AdamWOptions(1e-2));
  const fsdp_model::Data data(rank, steps);
  const auto units = fa.unit_bytes();  // three equal blocks, the root
  const int64_t blocks = fsdp_model::kBlocks;
  for (int64_t i = 0; i < steps; ++i) {
    std::vector<torch::Tensor> losses;
    std::vector<int64_t> gathers, early, peaks;
    for (auto* run : {&a, &b, &c}) {
      amp::FullyShard& f = run == &a ? fa : run == &b ? fb : fc;
      const int64_t before = f.allgathers(), before_early = f.prefetched_allgathers();
      f.reset_peak();
      const auto loss = fsdp_model::loss_of(f.forward(*run, data.x[i]), data.y[i]);
      loss.backward();
      losses.push_back(loss.detach());
      gathers.push_back(f.allgathers() - before);
      early.push_back(f.prefetched_allgathers() - before_early);
      peaks.push_back(f.peak_unsharded_bytes());
      check(f.unsharded_bytes() == 0, what + " step " + str(i) + ": a unit left gathered after backward");
    }
    check(gathers[1] == gathers[0] && gathers[2] == gathers[0],
          what + " step " + str(i) + ": all-gathers " + str(gathers[0]) + " without prefetch, " + str(gathers[1]) +
              " with, " + str(gathers[2]) + " with checkpointing");
    // Each block's backward gather prefetched (the root's backward begins
    // the chain); its forward gather too once the first step gave the order.
    const int64_t expect = pg.world_size() == 1 ? 0 : (i == 0 ? blocks : 2 * blocks);
    check(early[0] == 0 && early[1] == expect,
          what + " step " + str(i) + ": " + str(early[1]) + " prefetched all-gathers, expected " + str(expect));
    check(peaks[0] == units.back() + units.front(),
          what + " step " + str(i) + ": peak without prefetch " + str(peaks[0]));
    check(peaks[2] <= units.back() + 2 * units.front(),
          what + " step " + str(i) + ": peak with prefetch and checkpointing " + str(peaks[2]));
    check(peaks[1] <= units.back() + 2 * units.front() && (pg.world_size() == 1 || peaks[1] > peaks[0]),
          what + " step " + str(i) + ": peak with prefetch " + str(peaks[1]) + ", the root and one block " +
              str(peaks[0]) + ", two " + str(units.back() + 2 * units.front()));
    check(torch::equal(losses[0], losses[1]) && torch::equal(losses[0], losses[2]),
          what + " step " + str(i) + ": loss differs with prefetch");
    const auto pa = fa.parameters(), pb = fb.parameters(), pc = fc.parameters();
    for (size_t k = 0; k < pa.size(); ++k)
      check(torch::equal(pa[k].grad(), pb[k].grad()) && torch::equal(pa[k].grad(), pc[k].grad()),
            what + " step " + str(i) + ": gradient of " + fa.names()[k] + " differs with prefetch");
    for (auto* o : {&oa, &ob, &oc}) o->step(), o->zero_grad();
    for (size_t k = 0; k < pa.size(); ++k)
      check(torch::equal(pa[k], pb[k]) && torch::equal(pa[k], pc[k]),
            what + " step " + str(i) + ": shard of " + fa.names()[k] + " differs");
    if (rank == 0 && i == steps - 1)
      std::cout << "prefetch " << what << " world " << pg.world_size() << ": " << early[1] << " of " << gathers[1]
                << " all-gathers prefetched; peak unsharded " << peaks[1] << " B (without prefetch " << peaks[0]
                << " B)" << std::endl;
  }
}

// The fsdp_model::Net whose forward can stop before a block (die ... prefetch).
struct DyingNetImpl : fsdp_model::NetImpl {
  std::function<void(size_t)> before_block;
  torch::Tensor forward(torch::Tensor x) {
    for (size_t k = 0; k < units.size(); ++k) {
      if (before_block) before_block(k);
      fsdp_model::Block block(std::dynamic_pointer_cast<fsdp_model::BlockImpl>(units[k]));
      x = fsdp->forward(block, x);
    }
    x = torch::layer_norm(x, {fsdp_model::kWidth}, ln_f->weight, ln_f->bias, 1e-5);
    return torch::linear(x, head->weight, head->bias);
  }
};
TORCH_MODULE(DyingNet);

// Losses of `steps` steps of a Trainer<P> on `net` (under FullyShard when
// `fsdp`, else DataParallel), and this rank's rows of every parameter after each.
template <class P>
std::pair<std::vector<torch::Tensor>, std::vector<std::vector<torch::Tensor>>> trainer_run(const amp::ProcessGroup& pg,
                                                                                           bool sharded,
                                                                                           const amp::PrecisionMap& map,
                                                                                           int64_t steps) {
  const int rank = pg.rank(), world = pg.world_size();
  fsdp_model::Net net;
  std::optional<amp::FullyShard> fsdp;
  std::optional<amp::DataParallel> dp;
  std::vector<torch::Tensor> params = net->parameters();
  if (sharded) {
    fsdp.emplace(pg, *net, net->units);
    net->fsdp = &*fsdp;
    params = fsdp->parameters();
  }
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  amp::Trainer<P, amp::CPU> trainer(net, opt,
                                    amp::TrainerOptions()
                                        .progress(false)
                                        .step(amp::StepOptions().fused(false))
                                        .region(amp::RegionOptions().precision_map(map)));
  if (sharded) {
    trainer.stepper().set_gradient_sync(&*fsdp);
  } else {
    dp.emplace(pg, net->parameters());
    trainer.stepper().set_gradient_sync(&*dp);
  }
  const fsdp_model::Data data(rank, steps);
  std::vector<torch::Tensor> losses;
  std::vector<std::vector<torch::Tensor>> shards;
  for (int64_t i = 0; i < steps; ++i) {
    const auto r = trainer.step([&](auto&) {
      return fsdp_model::loss_of(sharded ? fsdp->forward(net, data.x[i]) : net->forward(data.x[i]), data.y[i]);
    });
    losses.push_back(r.loss);
    shards.emplace_back();
    for (const auto& p : sharded ? fsdp->parameters() : net->parameters())
      shards.back().push_back(sharded ? p.detach().clone() : my_rows(p.detach(), rank, world).clone());
  }
  return {losses, shards};
}

void autocast() {
  auto pg = init();
  // At 3 processes the fp32 gradient sums differ in the last bit (DataParallel
  // multiplies by 1/3 before summing, FullyShard divides the sum), and a
  // weight that then rounds to the other bf16 neighbour in the next forward
  // carries a bf16 ulp (2^-8 relative) on: a bf16 tolerance there.
  const bool bitwise = pg.world_size() <= 2;
  const double rtol = 1e-2, atol = 1e-3;
  const int64_t steps = 4;
  using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;
  const auto fp32 = trainer_run<amp::True<amp::fp32>>(pg, true, amp::PrecisionMap(), steps);
  double worst = 0.0;
  for (const bool mapped : {false, true}) {
    const std::string what = mapped ? "bf16 autocast + precision map" : "bf16 autocast";
    amp::PrecisionMap map;
    if (mapped) map.path("blocks.0.fc1", amp::ModulePrecision::kFp32);
    const auto dp = trainer_run<Bf16>(pg, false, map, steps);
    const auto fs = trainer_run<Bf16>(pg, true, map, steps);
    check(!torch::equal(fs.first[0], fp32.first[0]), what + ": the first loss equals fp32's: no autocast");
    for (int64_t i = 0; i < steps; ++i) {
      const auto& a = dp.first[static_cast<size_t>(i)];
      const auto& b = fs.first[static_cast<size_t>(i)];
      check(bitwise ? torch::equal(a, b) : torch::allclose(a, b, rtol, atol),
            what + " step " + str(i) + ": loss differs from DataParallel's");
      const auto& pa = dp.second[static_cast<size_t>(i)];
      const auto& pb = fs.second[static_cast<size_t>(i)];
      for (size_t k = 0; k < pa.size(); ++k) {
        if (pa[k].numel() == 0) continue;
        worst = std::max(worst, (pa[k] - pb[k]).abs().max().item<double>());
        check(bitwise ? torch::equal(pa[k], pb[k]) : torch::allclose(pa[k], pb[k], rtol, atol),
              what + " step " + str(i) + ": parameter " + str(static_cast<int64_t>(k)) +
                  " differs from DataParallel's by " + std::to_string((pa[k] - pb[k]).abs().max().item<double>()));
      }
    }
    if (mapped) {
      const auto plain = trainer_run<Bf16>(pg, true, amp::PrecisionMap(), 1);
      check(!torch::equal(fs.first[0], plain.first[0]), what + ": the first loss equals the unmapped one: no map");
    }
  }
  std::cout << "PASS autocast (" << (bitwise ? "bitwise" : "within rtol 1e-2, atol 1e-3")
            << " with DataParallel, largest difference " << worst << ")" << std::endl;
}

void expect_error(const std::function<void()>& f, const std::string& start, const std::string& what) {
  try {
    f();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    check(msg.rfind(start, 0) == 0, what + ": message " + msg);
    return;
  }
  fail(what + ": no error");
}

void errors() {
  auto pg = init();
  fsdp_model::Net net;
  fsdp_model::Net other;
  expect_error([&] { amp::FullyShard f(pg, *net, {other->units[0]}); },
               "amp: FullyShard: a unit's parameters are not among the root's", "a unit of another model");
  auto half = torch::nn::Linear(3, 3);
  half->to(torch::kBFloat16);
  expect_error([&] { amp::FullyShard f(pg, *half, {}); }, "amp: FullyShard: parameter 'weight' is BFloat16",
               "a 16-bit model");
  amp::FullyShard fsdp(pg, *net, net->units);
  net->fsdp = &fsdp;
  const fsdp_model::Data data(pg.rank(), 1);
  fsdp_model::Block block(std::dynamic_pointer_cast<fsdp_model::BlockImpl>(net->units[0]));
  expect_error([&] { fsdp.forward(block, data.x[0]); }, "amp: FullyShard::forward: a unit ran outside the root's",
               "a unit outside the root's forward");
  fsdp_model::Block stranger;
  expect_error([&] { fsdp.forward(stranger, data.x[0]); }, "amp: FullyShard::forward: this module is neither",
               "a module that is not a unit");
  expect_error([&] { fsdp.clip_grad_norm(-1.0); }, "amp: FullyShard::clip_grad_norm: max_norm must be >= 0",
               "a negative max_norm");
  // What would see one shard only is refused: the Stepper's clipping, a
  // Trainer's save() (a loss scaler is served: the "scaler" case).
  torch::optim::AdamW opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-2));
  amp::Stepper<amp::NoScaler> clipping(opt, amp::StepOptions().max_grad_norm(1.0));
  expect_error([&] { clipping.set_gradient_sync(&fsdp); },
               "amp: StepOptions::max_grad_norm would see only this process's shards under FullyShard",
               "the Stepper's own clipping");
  amp::Trainer<amp::True<amp::fp32>, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
  trainer.stepper().set_gradient_sync(&fsdp);
  expect_error([&] { trainer.save("/nonexistent-dir/never-written.pt"); },
               "amp: Trainer::save would see only this process's shards", "Trainer::save");
  // A Trainer<True<fp32>> converts FullyShard's bf16 unsharded parameters: an amp: error at the next gather.
  fsdp_model::Net converted;
  amp::FullyShard bf16(pg, *converted, converted->units, amp::FullyShardOptions().param_dtype(at::kBFloat16));
  converted->fsdp = &bf16;
  torch::optim::AdamW opt16(bf16.parameters(), torch::optim::AdamWOptions(1e-2));
  amp::Trainer<amp::True<amp::fp32>, amp::CPU> converting(converted, opt16, amp::TrainerOptions().progress(false));
  expect_error([&] { bf16.forward(converted, data.x[0]); }, "amp: FullyShard: parameter 'ln_f.weight' is Float",
               "a module converted after FullyShard");
  // Nothing changed: the model still trains.
  const auto loss = fsdp_model::loss_of(fsdp.forward(net, data.x[0]), data.y[0]);
  loss.backward();
  for (const auto& p : fsdp.parameters()) check(p.grad().defined(), "a shard without gradient after the errors");
  std::cout << "PASS errors" << std::endl;
}

void die(const std::string& how, const std::string& where) {
  auto pg = init();
  const bool last = pg.rank() == pg.world_size() - 1;
  DyingNet net;
  amp::FullyShard fsdp(pg, *net, net->units, amp::FullyShardOptions().prefetch(where == "prefetch"));
  net->fsdp = &fsdp;
  torch::optim::AdamW opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-2));
  const fsdp_model::Data data(pg.rank(), 4);
  auto t0 = std::chrono::steady_clock::now();
  auto die_here = [&](const char* here) {
    if (last && where == here) std::raise(how == "kill" ? SIGKILL : SIGSTOP);
  };
  int64_t step = 0;
  // Before block 1: the others have issued its prefetched all-gather (at
  // block 0's forward) and wait for it, or for block 2's.
  net->before_block = [&](size_t k) {
    if (step == 2 && k == 1) die_here("prefetch");
  };
  try {
    for (int64_t i = 0; i < 4; ++i) {
      step = i;
      t0 = std::chrono::steady_clock::now();
      if (i == 2) die_here("gather");
      const auto loss = fsdp_model::loss_of(fsdp.forward(net, data.x[i]), data.y[i]);
      if (i == 2) die_here("reduce");
      t0 = std::chrono::steady_clock::now();
      loss.backward();
      opt.step();
      opt.zero_grad();
    }
  } catch (const c10::Error& e) {
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string msg = e.what_without_backtrace();
    const std::string expect = where == "gather"     ? "amp: FullyShard all-gather on rank"
                               : where == "prefetch" ? "amp: FullyShard all-gather (prefetched) on rank"
                                                     : "amp: FullyShard reduce-scatter on rank";
    check(msg.find(expect) != std::string::npos, "message: " + msg);
    check(secs < test_case::timeout().count() / 1000.0 + 0.5, "took " + std::to_string(secs) + " s");
    std::cout << "PASS " << test_case::name << " after " << secs << " s: " << msg.substr(0, msg.find('\n'))
              << std::endl;
    std::exit(3);  // a failed rank: tools/launch ends the stopped one
  }
  fail("no error");
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  std::vector<std::string> a(argv + 1, argv + argc);
  if (a.empty()) fail("usage: fully_shard_cases CASE");
  test_case::name = a[0];
  try {
    if (test_case::name == "memory") {
      memory();
      std::cout << "PASS memory" << std::endl;
    } else if (test_case::name == "vs_dp") {
      vs_dp(1, false);
    } else if (test_case::name == "accumulate") {
      vs_dp(2, false);
    } else if (test_case::name == "clip") {
      vs_dp(1, true);
    } else if (test_case::name == "scaler") {
      scaler();
    } else if (test_case::name == "checkpoint") {
      auto pg = init();
      checkpointed(pg, std::nullopt, "fp32");
      checkpointed(pg, at::kBFloat16, "bf16");
      std::cout << "PASS checkpoint" << std::endl;
    } else if (test_case::name == "prefetch") {
      auto pg = init();
      prefetched(pg, std::nullopt, "fp32");
      prefetched(pg, at::kBFloat16, "bf16");
      std::cout << "PASS prefetch" << std::endl;
    } else if (test_case::name == "autocast") {
      autocast();
    } else if (test_case::name == "errors") {
      errors();
    } else if (test_case::name == "die" && a.size() == 3) {
      die(a[1], a[2]);
    } else {
      fail("unknown case");
    }
  } catch (const std::exception& e) {
    fail(std::string("exception: ") + e.what());
  }
  return 0;
}
