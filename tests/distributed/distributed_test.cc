// amp/distributed.h across processes: run through tools/launch by
// distributed_test.sh (one "case" per launch). Each rank prints
// "PASS <case>" or "FAIL <case>: why" and exits 0 / 1. Timeouts come from
// AMP_DP_TIMEOUT_MS (default 20000).
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "amp/detail/compat.h"
#include "amp/detail/compat_c10d.h"
#include "amp/distributed.h"
#include "process_case.h"
#include "amp/train/fabric.h"
#include "amp/scaler/dynamic_scaler.h"
#include "amp/train/activation_checkpoint.h"
#include "amp/train/trainer.h"
#include "amp/version.h"

namespace {

using test_case::check;
using test_case::fail;
using test_case::init;
using test_case::timeout;

torch::nn::Sequential make_net(int64_t hidden = 32) {
  return torch::nn::Sequential(torch::nn::Linear(16, hidden), torch::nn::ReLU(), torch::nn::Linear(hidden, 4));
}

// This rank's batch of step `step`: a slice of the global batch of every rank.
std::pair<torch::Tensor, torch::Tensor> batch(int64_t step, int rank, int world, int64_t per_rank) {
  torch::manual_seed(1000 + static_cast<uint64_t>(step));
  torch::Tensor x = torch::randn({per_rank * world, 16});
  torch::Tensor y = x.narrow(1, 0, 4) * 2 - x.narrow(1, 4, 4);
  return {x.narrow(0, rank * per_rank, per_rank), y.narrow(0, rank * per_rank, per_rank)};
}

// Bits of params, Adam's moments and the scale, gathered: rank 0's == every rank's.
template <class T>
void check_identical(const amp::DataParallel& dp, T& trainer, const std::string& what) {
  trainer.stepper().sync_optimizer_state();
  std::vector<torch::Tensor> bits;
  auto add = [&](const torch::Tensor& t) {
    bits.push_back(t.detach().to(torch::kFloat).contiguous().view(torch::kInt).reshape({-1}).to(torch::kLong));
  };
  for (const auto& p : trainer.module().parameters()) {
    add(p);
    auto& state = trainer.optimizer().state();
    auto it = state.find(amp::detail::compat::optim_state_key(p.unsafeGetTensorImpl()));
    if (it != state.end())
      if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
        add(s->exp_avg());
        add(s->exp_avg_sq());
        bits.push_back(torch::full({1}, s->step(), torch::kLong));
      }
  }
  add(torch::full({1}, trainer.scaler().get_scale(), torch::kFloat));
  torch::Tensor mine = torch::cat(bits);
  auto all = dp.process_group().allgather(mine, "test gather");
  for (size_t r = 1; r < all.size(); ++r)
    check(torch::equal(all[0], all[r]), what + ": rank " + std::to_string(r) + " differs from rank 0 (bitwise)");
}

// adam_eps: 1e-4 for True<fp16> (the Trainer rejects an eps that rounds to 0 in fp16).
template <class Policy>
void train_identical(amp::GradCompression compression, int64_t steps, double adam_eps = 1e-8) {
  auto pg = init();
  torch::manual_seed(static_cast<uint64_t>(pg.rank()));  // different initial weights: the broadcast fixes them
  auto net = make_net();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2).eps(adam_eps));
  amp::Trainer<Policy, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
  amp::DataParallel dp(pg, trainer, amp::DataParallelOptions().compression(compression));
  check(trainer.stepper().gradient_sync() == &dp, "DataParallel did not install itself");
  const torch::Tensor p0 = net->parameters().front();  // True<D>: the batches in D too
  const torch::Tensor initial = p0.detach().clone();   // rank 0's, after the broadcast
  for (int64_t s = 0; s < steps; ++s) {
    auto [x, y] = batch(s, pg.rank(), pg.world_size(), 8);
    x = x.to(p0.scalar_type()), y = y.to(p0.scalar_type());
    // (p - y)^2's mean: LibTorch 1.13 has no CPU mse_loss for bf16.
    auto r = trainer.step([&](auto&) { return (net->forward(x) - y).pow(2).mean(); });
    // fp16 with a loss scale of 65536 skips its first steps (scale backs off), as torch's GradScaler.
    check(!r.skipped() || amp::detail::uses_loss_scaling_v<typename amp::Trainer<Policy, amp::CPU>::scaler_type>,
          "step " + std::to_string(s) + " skipped");
  }
  check(dp.allreduces() == steps * dp.buckets(),
        "all-reduces " + std::to_string(dp.allreduces()) + " != steps * buckets");
  check(!torch::equal(initial, p0.detach()), "the first parameter did not change");
  check_identical(dp, trainer, trainer.precision_name);
  std::cout << "PASS " << test_case::name << " " << trainer.precision_name << " world " << pg.world_size()
            << " buckets " << dp.buckets() << " all-reduces " << dp.allreduces() << " (" << p0.scalar_type()
            << " gradients sent as " << pg.wire_dtype(p0) << ")" << std::endl;
}

// Gradients compressed to fp16 or bf16 on the wire: trained where this
// build's Gloo takes the dtype, else DataParallel's amp: error (the check
// that throws it is the one that asks ProcessGroup::gloo_takes).
void compress(amp::GradCompression compression) {
  const bool half = compression == amp::GradCompression::kFp16;
  try {
    train_identical<amp::True<amp::fp32>>(compression, 10);
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    const std::string expect = std::string("amp: DataParallelOptions::compression(") + (half ? "kFp16" : "kBf16") +
                               ") on CPU needs a Gloo that takes " + (half ? "Half" : "BFloat16");
    check(msg.find(expect) == 0, "message: " + msg);
    // What it says this Gloo takes instead follows the same check (ProcessGroup::gloo_takes).
    const bool other_named = msg.find(half ? "BFloat16 only" : "Half only") != std::string::npos;
    check(other_named == (msg.find(half ? " or kBf16" : " or kFp16") != std::string::npos) &&
              (other_named || msg.find("takes neither") != std::string::npos),
          "message: " + msg);
    std::cout << "PASS " << test_case::name << " (rejected: " << msg << ")" << std::endl;
  }
}

// True<D> (parameters, gradients and Adam's state in D) across processes;
// where this LibTorch cannot train D on CPU (fp16 before 2.3) it says so.
template <class D>
void train_true(int64_t steps) {
  using P = amp::True<D>;
  if constexpr (amp::is_supported_v<P, amp::CPU>) {
    train_identical<P>(amp::GradCompression::kNone, steps, 1e-4);
  } else {
    std::cout << "PASS " << test_case::name << " (skipped: LibTorch " << TORCH_VERSION << " cannot train "
              << amp::policy_traits<P>::name << " on CPU; half_grads covers its all-reduce)" << std::endl;
  }
}

// Gradients in bf16 and in fp16 through DataParallel on every LibTorch line
// (a Stepper and an elementwise model: 1.13 has no CPU fp16 matmul), SGD
// with momentum in the same dtype: the first average is the ranks' mean, and
// every rank ends bit-identical.
void half_grads() {
  auto pg = init();
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    torch::manual_seed(static_cast<uint64_t>(pg.rank()));
    torch::Tensor w = (torch::randn({16, 4}) * 0.1).to(dtype).requires_grad_();
    torch::Tensor b = torch::zeros({4}).to(dtype).requires_grad_();
    torch::optim::SGD opt({w, b}, torch::optim::SGDOptions(0.05).momentum(0.9));
    // The Stepper takes the CPU fused SGD for 16-bit parameters only where
    // ATen's kernel updates them (pytorch#191763), by itself.
    amp::Stepper<amp::NoScaler> stepper(opt);
    const bool fused = amp::detail::compat::has_fused_op(amp::detail::compat::FusedOp::kSgd, c10::DeviceType::CPU) &&
                       amp::detail::compat::kCpuFusedSgdUpdatesHalfTypes;
    if (stepper.fused() != fused) fail("the Stepper's fused choice for 16-bit SGD is not compat.h's");
    std::vector<torch::Tensor> params{w, b};
    amp::DataParallel dp(pg, params);
    stepper.set_gradient_sync(&dp);
    const torch::Tensor w0 = w.detach().clone();  // rank 0's, after the broadcast
    for (int64_t s = 0; s < 10; ++s) {
      auto [x, y] = batch(s, pg.rank(), pg.world_size(), 8);
      x = x.to(dtype), y = y.to(dtype);
      torch::Tensor pred = (x.unsqueeze(2) * w).sum(1) + b;  // x @ w, elementwise
      torch::Tensor loss = (pred - y).pow(2).mean();
      if (s == 0) {
        // The average: every rank's own gradient (DataParallel's hook ignores
        // this backward), summed in fp32, halved, rounded once to dtype.
        const torch::Tensor mine = torch::autograd::grad({loss}, {w}, {}, /*retain_graph=*/true)[0];
        torch::Tensor sum = torch::zeros({16, 4});
        for (const auto& g : pg.allgather(mine, "test gather")) sum += g.to(torch::kFloat);
        stepper.step(loss);
        check(torch::equal(w.grad(), (sum / pg.world_size()).to(dtype)),
              std::string(c10::toString(dtype)) + ": the averaged gradient differs from the mean of the ranks'");
        continue;
      }
      stepper.step(loss);
    }
    check(dp.allreduces() == 10 * dp.buckets(), "all-reduces " + std::to_string(dp.allreduces()));
    const torch::Tensor bits = torch::cat({w.detach().reshape({-1}), b.detach().reshape({-1})}).to(torch::kFloat);
    auto all = pg.allgather(bits, "test gather");
    for (size_t r = 1; r < all.size(); ++r)
      check(torch::equal(all[0], all[r]), std::string(c10::toString(dtype)) + ": ranks differ (bitwise)");
    check(!torch::equal(w0, w.detach()), "w did not change");
    std::cout << "half_grads: " << dtype << " gradients sent as " << pg.wire_dtype(w) << ", ranks identical after 10 "
              << "steps" << std::endl;
  }
  std::cout << "PASS " << test_case::name << std::endl;
}

// 2 ranks with batch B each == 1 process with batch 2B, to fp32 rounding.
void parity() {
  auto pg = init();
  torch::manual_seed(7);
  auto net = make_net(), ref = make_net();
  {
    torch::NoGradGuard g;
    for (size_t i = 0; i < net->parameters().size(); ++i) ref->parameters()[i].copy_(net->parameters()[i]);
  }
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::Trainer<amp::True<amp::fp32>, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
  amp::DataParallel dp(pg, trainer);
  const int64_t B = 16, steps = 30;
  for (int64_t s = 0; s < steps; ++s) {
    auto [x, y] = batch(s, pg.rank(), pg.world_size(), B);
    trainer.step([&](auto&) { return torch::mse_loss(net->forward(x), y); });
    auto [gx, gy] = batch(s, 0, 1, B * pg.world_size());
    ref_opt.zero_grad();
    torch::mse_loss(ref->forward(gx), gy).backward();
    ref_opt.step();
  }
  double max_diff = 0, max_abs = 0;
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    max_diff = std::max(max_diff, (net->parameters()[i] - ref->parameters()[i]).abs().max().item<double>());
    max_abs = std::max(max_abs, ref->parameters()[i].abs().max().item<double>());
  }
  std::cout << "parity: max |dp - single| = " << max_diff << " (max |param| " << max_abs << ") after " << steps
            << " steps" << std::endl;
  check(max_diff <= 1e-5 * std::max(1.0, max_abs), "data-parallel differs from one process with the global batch");
  std::cout << "PASS " << test_case::name << std::endl;
}

// An inf on the last rank only: every rank skips and backs off together.
// Random inf/NaN: 240 steps, a third poisoned (the plan drawn from one seed on
// every rank): inf, -inf or NaN in the loss or in one gradient element, on one
// rank or on all. Every rank skips exactly the poisoned steps, a skipped step
// leaves the parameters bitwise, the scale follows torch's rule (backoff on a
// found inf, growth after growth_interval clean steps), the ranks end equal.
void inf_one_rank() {
  auto pg = init();
  torch::manual_seed(3);
  auto net = make_net();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  amp::Stepper<amp::DynamicScaler> stepper(
      opt, {}, amp::DynamicScaler(amp::DynamicScalerOptions().init_scale(1024.0).growth_interval(3)));
  std::vector<torch::Tensor> params = net->parameters();
  // Hooks registered before DataParallel's run first: the poison reaches the reduction.
  size_t poison_param = params.size();  // == size: none this step
  double poison_value = 0;
  for (size_t i = 0; i < params.size(); ++i)
    params[i].register_hook([i, &poison_param, &poison_value](torch::Tensor g) {
      if (i != poison_param) return g;
      g = g.clone();
      g.view(-1)[0] = poison_value;
      return g;
    });
  amp::DataParallel dp(pg, params);
  stepper.set_gradient_sync(&dp);
  std::mt19937 plan(7);
  const double poisons[] = {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                            std::numeric_limits<double>::quiet_NaN()};
  double scale = 1024.0;  // torch's rule, on the side
  int64_t tracker = 0, skipped = 0;
  for (int64_t s = 0; s < 240; ++s) {
    const bool poisoned = s >= 2 && plan() % 3 == 0;
    const double value = poisons[plan() % 3];
    const bool in_loss = plan() % 2 == 0;
    const int64_t on_rank = static_cast<int64_t>(plan() % static_cast<uint32_t>(pg.world_size() + 1));  // == N: all
    const size_t param = plan() % params.size();
    const bool here = poisoned && (on_rank == pg.world_size() || on_rank == pg.rank());
    auto [x, y] = batch(s % 16, pg.rank(), pg.world_size(), 8);
    std::vector<torch::Tensor> before;
    for (const auto& p : params) before.push_back(p.detach().clone());
    torch::Tensor loss = torch::mse_loss(net->forward(x), y);
    if (here && in_loss) loss = loss * value;
    poison_param = here && !in_loss ? param : params.size();
    poison_value = value;
    auto r = stepper.step(loss);
    poison_param = params.size();
    check(r.skipped() == poisoned, "step " + std::to_string(s) + (r.skipped() ? " skipped" : " not skipped"));
    if (poisoned) {
      ++skipped;
      for (size_t i = 0; i < params.size(); ++i)
        check(torch::equal(before[i], params[i]), "a skipped step changed parameter " + std::to_string(i));
      scale *= 0.5;
      tracker = 0;
    } else if (++tracker == 3) {
      scale *= 2.0;
      tracker = 0;
    }
    check(stepper.scaler().get_scale() == scale, "step " + std::to_string(s) + ": scale " +
                                                     std::to_string(stepper.scaler().get_scale()) + ", torch's rule " +
                                                     std::to_string(scale));
  }
  check(skipped > 40, "too few poisoned steps: " + std::to_string(skipped));
  std::vector<torch::Tensor> bits;
  for (const auto& p : params) bits.push_back(p.detach().reshape({-1}));
  bits.push_back(torch::full({1}, scale, torch::kFloat));
  auto all = pg.allgather(torch::cat(bits), "test gather");
  for (size_t r = 1; r < all.size(); ++r) check(torch::equal(all[0], all[r]), "ranks differ after the skips");
  std::cout << "PASS " << test_case::name << " " << skipped << " of 240 steps skipped, scale 1024 -> " << scale
            << std::endl;
}

// Fabric with two models and one DataParallel over both: every rank ends
// bit-identical; with loss scaling (fp16 on CPU, LibTorch >= 2.3) an inf in
// D's loss on the last rank skips D on every rank, G steps everywhere, and
// the scale backs off once.
template <class Policy>
void precision_two_models() {
  auto pg = init();
  torch::manual_seed(static_cast<uint64_t>(pg.rank()));  // different weights: the broadcast fixes them
  auto gen = make_net(), disc = make_net(8);             // G: 16 -> 4; D: 16 -> 4
  torch::optim::AdamW opt_g(gen->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::Adam opt_d(disc->parameters(), torch::optim::AdamOptions(1e-2));
  constexpr bool scaled = amp::policy_traits<Policy>::uses_loss_scaling;
  auto scaler = [] {  // a low scale: fp16 at 65536 overflows by itself on its first steps
    if constexpr (scaled)
      return amp::DynamicScaler(amp::DynamicScalerOptions().init_scale(256.0));
    else
      return amp::NoScaler();
  }();
  amp::Fabric<Policy, amp::CPU> fabric(amp::FabricOptions(), std::move(scaler));
  fabric.setup(gen, opt_g);
  fabric.setup(disc, opt_d);
  amp::DataParallel dp(pg, fabric.parameters(), fabric.buffers(), amp::DataParallelOptions(), fabric.parameter_names());
  fabric.set_gradient_sync(&dp);
  double scale_before = 0;
  for (int64_t s = 0; s < 6; ++s) {
    auto [x, y] = batch(s, pg.rank(), pg.world_size(), 8);
    const bool poison = scaled && s == 3 && pg.rank() == pg.world_size() - 1;
    const auto d0 = disc->parameters().front().detach().clone(), g0 = gen->parameters().front().detach().clone();
    if (s == 3) scale_before = fabric.scaler().get_scale();
    opt_d.zero_grad();
    // D fits G's (detached) output; G fits y and D's (detached) output.
    auto loss_d = fabric.forward([&](auto&) { return (disc->forward(x) - gen->forward(x).detach()).pow(2).mean(); });
    fabric.backward(poison ? loss_d * std::numeric_limits<float>::infinity() : loss_d);
    fabric.optimizer_step(opt_d);
    opt_g.zero_grad();
    fabric.backward(fabric.forward([&](auto&) {
      const auto g = gen->forward(x);
      return (g - y).pow(2).mean() + (g - disc->forward(x).detach()).pow(2).mean();
    }));
    fabric.optimizer_step(opt_g);
    fabric.update();
    if (scaled && s == 3) {
      check(torch::equal(d0, disc->parameters().front()), "D stepped despite the inf on the last rank");
      check(!torch::equal(g0, gen->parameters().front()), "G did not step");
      check(fabric.scaler().get_scale() == scale_before * 0.5, "the scale did not back off once");
    }
  }
  std::vector<torch::Tensor> bits;
  for (const auto& p : fabric.parameters()) bits.push_back(p.detach().reshape({-1}));
  bits.push_back(torch::full({1}, fabric.scaler().get_scale(), torch::kFloat));
  auto all = pg.allgather(torch::cat(bits), "test gather");
  for (size_t r = 1; r < all.size(); ++r) check(torch::equal(all[0], all[r]), "ranks differ");
  std::cout << "PASS " << test_case::name << " " << fabric.precision_name << (scaled ? " with an inf on one rank" : "")
            << std::endl;
}

void precision() {
  if constexpr (amp::is_supported_v<amp::Mixed<amp::fp16, amp::DynamicScaler>, amp::CPU>) {
    precision_two_models<amp::Mixed<amp::fp16, amp::DynamicScaler>>();
  } else {
    precision_two_models<amp::Mixed<amp::bf16, amp::NoScaler>>();
  }
}

// Accumulation: no all-reduce on non-boundary micro-batches, one per bucket at the boundary.
void accumulate() {
  auto pg = init();
  // Hidden 65536: over 1 MiB before the last gradient, so several buckets after the first step on
  // every line (LibTorch 1.13's DDP closes the first rebuilt bucket at 1 MiB whatever the cap).
  auto net = make_net(65536);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(
      net, opt, amp::TrainerOptions().progress(false).step(amp::StepOptions().accumulation_steps(3)));
  amp::DataParallel dp(pg, trainer, amp::DataParallelOptions().bucket_cap_mb(1.0 / 1024));  // 1 KiB buckets
  check(dp.buckets() == 1, "the first step's layout (DDP's): 1 bucket, got " + std::to_string(dp.buckets()));
  std::string per_step;
  for (int64_t s = 0; s < 12; ++s) {
    const int64_t before = dp.allreduces(), buckets = dp.buckets();  // this step's layout
    auto [x, y] = batch(s, pg.rank(), pg.world_size(), 8);
    auto r = trainer.step([&](auto&) { return torch::mse_loss(net->forward(x), y); });
    const int64_t issued = dp.allreduces() - before;
    per_step += std::to_string(issued) + " ";
    check(issued == (r.optimizer_step ? buckets : 0),
          "micro-batch " + std::to_string(s) + " issued " + std::to_string(issued) + " all-reduces");
  }
  check(dp.buckets() >= 2, "expected several 1 KiB buckets after the first step, got " + std::to_string(dp.buckets()));
  check(trainer.steps() == 4, "expected 4 optimizer steps");
  check_identical(dp, trainer, "accumulation");
  std::cout << "PASS " << test_case::name << " buckets " << dp.buckets() << " all-reduces per micro-batch: " << per_step
            << std::endl;
}

void mismatch() {
  auto pg = init();
  auto net = make_net(pg.rank() == 1 ? 33 : 32);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01));
  amp::Trainer<amp::True<amp::fp32>, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
  try {
    amp::DataParallel dp(pg, trainer);
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    std::cout << "error: " << msg << std::endl;
    check(msg.find("amp: DataParallel: parameter '0.weight' is Float[33, 16] on rank 1 but Float[32, 16] on rank 0") !=
              std::string::npos,
          "unexpected message");
    std::cout << "PASS " << test_case::name << std::endl;
    return;
  }
  fail("no error for different models");
}

// Trains `steps`, checkpointing each step (rank 0 writes); with a victim, that
// rank dies (SIGKILL) or stops (SIGSTOP) at step `at`: the others must fail
// with an amp: error within the timeout.
void train_and_die(const std::string& path, int64_t steps, const std::string& how, int64_t at) {
  auto pg = init();
  auto net = make_net();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Trainer<amp::True<amp::fp32>, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
  amp::DataParallel dp(pg, trainer);
  const auto start_fault = std::chrono::steady_clock::now();
  auto t0 = start_fault;
  try {
    for (int64_t s = 0; s < steps; ++s) {
      if (s == at && pg.rank() == pg.world_size() - 1) {
        std::cout << "rank " << pg.rank() << " " << how << " at step " << s << std::endl;
        std::raise(how == "kill" ? SIGKILL : SIGSTOP);
      }
      auto [x, y] = batch(s, pg.rank(), pg.world_size(), 8);
      t0 = std::chrono::steady_clock::now();
      trainer.step([&](auto&) { return torch::mse_loss(net->forward(x), y); });
      amp::save_on_rank0(pg, trainer, path);
    }
  } catch (const c10::Error& e) {
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cout << "peer-failure error after " << secs << " s (timeout " << timeout().count() / 1000.0
              << " s): " << e.what_without_backtrace() << std::endl;
    std::exit(3);
  }
  check_identical(dp, trainer, "after " + std::to_string(steps) + " steps");
  std::cout << "PASS " << test_case::name << " saved " << path << " at step " << trainer.steps() << std::endl;
}

// Any world size: load a checkpoint, check its step, train on, stay identical.
void resume(const std::string& path, int64_t expect_steps) {
  auto pg = init();
  auto net = make_net();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Trainer<amp::True<amp::fp32>, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
  amp::DataParallel dp(pg, trainer);
  trainer.load(path);
  check(trainer.steps() == expect_steps,
        "loaded step " + std::to_string(trainer.steps()) + ", expected " + std::to_string(expect_steps));
  for (int64_t s = 0; s < 3; ++s) {
    auto [x, y] = batch(100 + s, pg.rank(), pg.world_size(), 8);
    trainer.step([&](auto&) { return torch::mse_loss(net->forward(x), y); });
  }
  check_identical(dp, trainer, "after resuming");
  std::cout << "PASS " << test_case::name << " world " << pg.world_size() << " resumed at step " << expect_steps
            << ", now " << trainer.steps() << std::endl;
}

// Rank 0's checkpoint holds every rank's random generators, each restored on
// its own rank: steps that draw from each rank's own stream (inputs, dropout)
// resume bitwise. Without the per-rank entries every rank would get rank 0's.
// It also holds DataParallel's rebuilt bucket layout: at 3 processes a
// resumed run in the first step's layout sums in another order (bits differ).
void rng_resume(const std::string& path) {
  auto pg = init();
  struct Run {
    std::vector<double> losses;  // the steps after the checkpoint (4, 5, 6)
    std::vector<torch::Tensor> params;
    std::vector<std::vector<size_t>> layout;  // at the save / after the load
  };
  auto run = [&](bool resume) {
    torch::manual_seed(resume ? 77 : 0);  // a resumed process starts from other weights and streams
    auto net = make_net();
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05));
    amp::Trainer<amp::True<amp::fp32>, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
    amp::DataParallel dp(pg, trainer);
    Run out;
    if (resume) {
      trainer.load(path);
      out.layout = dp.bucket_layout();
    } else {
      torch::manual_seed(500 + static_cast<uint64_t>(pg.rank()));  // each rank its own stream
    }
    while (trainer.steps() < 6) {
      const torch::Tensor x = torch::randn({8, 16}), y = x.narrow(1, 0, 4) * 2;
      auto r = trainer.step([&](auto&) { return (torch::dropout(net->forward(x), 0.3, true) - y).pow(2).mean(); });
      if (!resume && trainer.steps() == 3) {
        amp::save_on_rank0(pg, trainer, path);
        out.layout = dp.bucket_layout();
      }
      if (trainer.steps() > 3) out.losses.push_back(r.loss_value());
    }
    for (const auto& p : net->parameters()) out.params.push_back(p.detach().clone());
    return out;
  };
  const Run straight = run(false), resumed = run(true);
  check(straight.layout != std::vector<std::vector<size_t>>{{0, 1, 2, 3}},
        "the rebuilt layout is the first step's: the resume tells nothing about the layout");
  check(resumed.layout == straight.layout, "the resumed run's bucket layout is not the uninterrupted run's");
  check(straight.losses == resumed.losses, "the resumed losses differ from the uninterrupted run's");
  for (size_t i = 0; i < straight.params.size(); ++i)
    check(torch::equal(straight.params[i], resumed.params[i]), "parameter " + std::to_string(i) + " differs");
  std::cout << "PASS " << test_case::name << " world " << pg.world_size() << ": 3 steps after the resume bitwise"
            << std::endl;
}

// No launcher: the rendezvous' errors (the caller sets the environment).
void rendezvous_error(const std::string& expect) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    init();
  } catch (const c10::Error& e) {
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string msg = e.what_without_backtrace();
    std::cout << "error after " << secs << " s: " << msg.substr(0, msg.find('\n')) << std::endl;
    check(msg.rfind("amp: ", 0) == 0 && msg.find(expect) != std::string::npos, "expected '" + expect + "'");
    check(secs < timeout().count() / 1000.0 + 5, "took longer than the timeout");
    std::cout << "PASS " << test_case::name << std::endl;
    return;
  }
  fail("no error");
}

// DataParallel::fit: every rank trains on its shard of 11 batches (5 steps
// each, the 11th dropped), and the History's losses are the average over the
// ranks, identical on every rank.
// Float8 delayed scaling over two ranks with different data: the amaxes are
// all-reduced (max) each step, so the scales and histories, and with them
// the parameters, stay identical on every rank.
void float8_delayed() {
#if AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL
  auto pg = init();
  torch::manual_seed(static_cast<uint64_t>(pg.rank()));
  auto net = make_net();  // Linear(16, 32) runs in float8, Linear(32, 4) in bf16
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  using P = amp::Float8<amp::Delayed<4, 0>>;
  amp::Trainer<P, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
  amp::DataParallel dp(pg, trainer);
  for (int64_t s = 0; s < 6; ++s) {
    auto [x, y] = batch(s, pg.rank(), pg.world_size(), 8);
    trainer.step([&](auto&) { return (net->forward(x).to(torch::kFloat) - y).pow(2).mean(); });
  }
  std::vector<torch::Tensor> state;
  for (const auto& item : trainer.float8_state().scaling().state_dict()) state.push_back(item.value().reshape({-1}));
  check(state.size() == 4, "tracked " + std::to_string(state.size() / 4) + " linears, expected 1");
  const torch::Tensor mine = torch::cat(state);
  check(torch::count_nonzero(mine.narrow(0, 0, 8)).item<int64_t>() > 0, "the amax history is empty");
  const auto all = pg.allgather(mine, "test gather");
  for (size_t r = 1; r < all.size(); ++r)
    check(torch::equal(all[0], all[r]), "float8 state of rank " + std::to_string(r) + " differs from rank 0's");
  check_identical(dp, trainer, trainer.precision_name);
  std::cout << "PASS float8 " << trainer.precision_name << " world " << pg.world_size() << std::endl;
#else
  std::cout << "PASS float8 (skipped: Float8 on CPU needs LibTorch 2.8+)" << std::endl;
#endif
}

// Float8 rowwise (torchao's ROWWISE) under DataParallel: no recipe state to
// reduce; the averaged gradients keep the parameters identical on every rank.
void float8_rowwise() {
#if AMP_DETAIL_HAS_CPU_ROWWISE_FLOAT8
  auto pg = init();
  torch::manual_seed(static_cast<uint64_t>(pg.rank()));
  auto net = make_net();  // Linear(16, 32) runs in float8, Linear(32, 4) in bf16
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Trainer<amp::Float8<amp::Rowwise>, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
  amp::DataParallel dp(pg, trainer);
  const auto before = net->parameters()[0].clone();
  for (int64_t s = 0; s < 6; ++s) {
    auto [x, y] = batch(s, pg.rank(), pg.world_size(), 8);
    trainer.step([&](auto&) { return (net->forward(x).to(torch::kFloat) - y).pow(2).mean(); });
  }
  check(!torch::equal(before, net->parameters()[0]), "the float8 layer did not train");
  check_identical(dp, trainer, trainer.precision_name);
  std::cout << "PASS float8_rowwise " << trainer.precision_name << " world " << pg.world_size() << std::endl;
#else
  std::cout << "PASS float8_rowwise (skipped: rowwise scales on CPU need LibTorch 2.14+)" << std::endl;
#endif
}

void fit_shards() {
  amp::ProcessGroup pg = init();
  torch::manual_seed(7);
  auto net = make_net();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05));
  amp::Trainer<amp::True<amp::fp32>, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
  amp::DataParallel dp(pg, trainer);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int64_t i = 0; i < 11; ++i) batches.push_back(batch(i, 0, 1, 8));
  amp::History h = amp::fit_sharded(pg, trainer, batches, [&](auto&, const std::pair<torch::Tensor, torch::Tensor>& b) {
    return torch::mse_loss(net->forward(b.first), b.second);
  });
  const int64_t world = pg.world_size();
  check(static_cast<int64_t>(h.steps.size()) == 11 / world, "steps " + std::to_string(h.steps.size()));
  torch::Tensor losses = torch::empty({static_cast<int64_t>(h.steps.size())}, torch::kDouble);
  for (size_t i = 0; i < h.steps.size(); ++i) losses[static_cast<int64_t>(i)] = h.steps[i].loss;
  const auto gathered = pg.allgather(losses, "test gather");
  for (const auto& g : gathered) check(torch::equal(g, gathered[0]), "averaged losses differ between ranks");
  std::cout << "PASS fit" << std::endl;
}

// amp::checkpoint under DataParallel: three copies side by side in one
// process group, bf16-mixed AdamW, two residual blocks with dropout (each
// step's masks drawn from the same seed in every copy): A plain, B with its
// blocks checkpointed, C checkpointed with ShardedOptimizer. Every loss and
// parameter bitwise A's; each of B's parameter hooks fires once per step.
struct CkptNetImpl : torch::nn::Module {
  explicit CkptNetImpl(bool checkpointed) : checkpointed(checkpointed) {
    torch::manual_seed(7);
    in = register_module("in", torch::nn::Linear(16, 32));
    for (int i = 0; i < 2; ++i)
      blocks.push_back(register_module("block" + std::to_string(i),
                                       torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::GELU(),
                                                             torch::nn::Dropout(0.1), torch::nn::Linear(64, 32))));
    out = register_module("out", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = in(x);
    for (auto& b : blocks) {
      auto f = [&b](const std::vector<torch::Tensor>& v) { return b->forward(v[0]); };
      h = h + (checkpointed ? amp::checkpoint(f, {h}) : f({h}));
    }
    return out(h);
  }
  bool checkpointed;
  torch::nn::Linear in{nullptr}, out{nullptr};
  std::vector<torch::nn::Sequential> blocks;
};
TORCH_MODULE(CkptNet);

void checkpointed_blocks() {
  using P = amp::Mixed<amp::bf16, amp::NoScaler>;
  auto pg = init();
  CkptNet a(false), b(true), c(true);
  const auto options = torch::optim::AdamWOptions(1e-2);
  torch::optim::AdamW opt_a(a->parameters(), options), opt_b(b->parameters(), options);
  amp::ShardedOptimizer<torch::optim::AdamW> opt_c(pg, c->parameters(), options);
  const auto to = amp::TrainerOptions().progress(false);
  amp::Trainer<P, amp::CPU> ta(a, opt_a, to), tb(b, opt_b, to), tc(c, opt_c, to);
  amp::DataParallel dp_a(pg, ta), dp_b(pg, tb), dp_c(pg, tc);
  std::vector<int64_t> fired(b->parameters().size(), 0);
  for (size_t j = 0; j < fired.size(); ++j)
    b->parameters()[j].register_hook([&fired, j](const torch::Tensor&) { ++fired[j]; });
  const int64_t steps = 20;
  for (int64_t s = 0; s < steps; ++s) {
    auto [x, y] = batch(s, pg.rank(), pg.world_size(), 8);
    auto step = [&, x = x, y = y](auto& t, CkptNet& net) {
      torch::manual_seed(500 + static_cast<uint64_t>(s));  // the same dropout masks in A, B and C
      return t.step([&](auto&) { return (net->forward(x).to(torch::kFloat) - y).pow(2).mean(); }).loss_value();
    };
    const double la = step(ta, a), lb = step(tb, b), lc = step(tc, c);
    check(la == lb && la == lc, "step " + std::to_string(s) + ": the losses differ");
    for (size_t j = 0; j < fired.size(); ++j)
      check(fired[j] == s + 1, "parameter " + std::to_string(j) + "'s hook fired " + std::to_string(fired[j]) +
                                   " times in " + std::to_string(s + 1) + " steps");
  }
  for (size_t j = 0; j < a->parameters().size(); ++j) {
    check(torch::equal(a->parameters()[j], b->parameters()[j]),
          "parameter " + std::to_string(j) + ": B differs from A");
    check(torch::equal(a->parameters()[j], c->parameters()[j]),
          "parameter " + std::to_string(j) + ": C differs from A");
  }
  check(dp_b.allreduces() == dp_a.allreduces() && dp_b.bucket_layout() == dp_a.bucket_layout(),
        "the checkpointed copy's buckets differ from the plain one's");
  check_identical(dp_b, tb, "checkpointed");
  std::cout << "PASS " << test_case::name << " world " << pg.world_size() << ": " << steps
            << " steps, checkpointed (DataParallel and ShardedOptimizer) == plain, bitwise" << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  std::vector<std::string> a(argv + 1, argv + argc);
  if (a.empty()) fail("usage: distributed_test CASE [ARGS]");
  test_case::name = a[0];
  try {
    if (test_case::name == "fp32")
      train_identical<amp::True<amp::fp32>>(amp::GradCompression::kNone, 20);
    else if (test_case::name == "bf16")
      train_identical<amp::Mixed<amp::bf16, amp::NoScaler>>(amp::GradCompression::kNone, 20);
    else if (test_case::name == "fp16") {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
      train_identical<amp::Mixed<amp::fp16, amp::DynamicScaler>>(amp::GradCompression::kNone, 20);
#else
      std::cout << "PASS fp16 (skipped: no CPU fp16 autocast before LibTorch 2.3)" << std::endl;
#endif
    } else if (test_case::name == "compress_fp16" || test_case::name == "compress_bf16") {
      compress(test_case::name == "compress_fp16" ? amp::GradCompression::kFp16 : amp::GradCompression::kBf16);
    } else if (test_case::name == "true_bf16")
      train_true<amp::bf16>(20);
    else if (test_case::name == "true_fp16")
      train_true<amp::fp16>(20);
    else if (test_case::name == "half_grads")
      half_grads();
    else if (test_case::name == "parity")
      parity();
    else if (test_case::name == "inf")
      inf_one_rank();
    else if (test_case::name == "accumulate")
      accumulate();
    else if (test_case::name == "precision")
      precision();
    else if (test_case::name == "mismatch")
      mismatch();
    else if (test_case::name == "fit")
      fit_shards();
    else if (test_case::name == "checkpoint")
      checkpointed_blocks();
    else if (test_case::name == "float8_rowwise")
      float8_rowwise();
    else if (test_case::name == "float8")
      float8_delayed();
    else if (test_case::name == "train" && a.size() == 3)
      train_and_die(a[1], std::stoll(a[2]), "", -1);
    else if (test_case::name == "die" && a.size() == 5)
      train_and_die(a[1], std::stoll(a[2]), a[3], std::stoll(a[4]));
    else if (test_case::name == "rng_resume" && a.size() == 2)
      rng_resume(a[1]);
    else if (test_case::name == "resume" && a.size() == 3)
      resume(a[1], std::stoll(a[2]));
    else if (test_case::name == "rendezvous_error" && a.size() == 2)
      rendezvous_error(a[1]);
    else
      fail("unknown case or arguments");
  } catch (const std::exception& e) {
    fail(std::string("exception: ") + e.what());
  }
  return 0;
}
