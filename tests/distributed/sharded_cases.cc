// amp::ShardedOptimizer (ZeRO-1) across processes, run through tools/launch by
// distributed_test.sh's "sharded" group (one case per launch). Each rank
// prints "PASS <case>" or "FAIL <case>: why" and exits 0 / 1.
//
// The parity cases train two copies of a model side by side in one process
// group: A with a plain optimizer, B with ShardedOptimizer of the same class,
// both under DataParallel, and require every loss and every parameter to be
// bitwise equal (and B's ranks to agree).
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "amp/detail/compat_float8.h"
#include "amp/distributed.h"
#include "process_case.h"
#include "amp/optim/low_bit_adam.h"
#include "amp/optim/state_bytes.h"
#include "amp/scaler/dynamic_scaler.h"
#include "amp/train/fabric.h"
#include "amp/train/trainer.h"

namespace {

using test_case::check;
using test_case::fail;
using test_case::init;
using test_case::timeout;

// Ten parameters of several sizes (so that 2, 3 and 4 ranks all own some).
torch::nn::Sequential make_net(int64_t hidden = 32) {
  torch::nn::Sequential net(torch::nn::Linear(16, hidden), torch::nn::ReLU());
  for (int i = 0; i < 3; ++i) {
    net->push_back(torch::nn::Linear(hidden, hidden));
    net->push_back(torch::nn::ReLU());
  }
  net->push_back(torch::nn::Linear(hidden, 4));
  return net;
}

// This rank's part of step `step`'s global batch of 24 (24 divides by 1, 2, 3 and 4).
std::pair<torch::Tensor, torch::Tensor> batch(int64_t step, int rank, int world) {
  torch::manual_seed(1000 + static_cast<uint64_t>(step));
  const torch::Tensor x = torch::randn({24, 16});
  const torch::Tensor y = x.narrow(1, 0, 4) * 2 - x.narrow(1, 4, 4);
  const int64_t n = 24 / world;
  return {x.narrow(0, rank * n, n), y.narrow(0, rank * n, n)};
}

torch::Tensor bits(const torch::Tensor& t) {
  return t.detach().to(torch::kFloat).contiguous().view(torch::kInt).reshape({-1}).to(torch::kLong);
}
torch::Tensor param_bits(const torch::nn::Module& m) {
  std::vector<torch::Tensor> all;
  for (const auto& p : m.parameters()) all.push_back(bits(p));
  return torch::cat(all);
}

void same_on_every_rank(const amp::ProcessGroup& pg, const torch::Tensor& mine, const std::string& what) {
  const auto all = pg.allgather(mine, "test gather");
  for (size_t r = 1; r < all.size(); ++r)
    check(torch::equal(all[0], all[r]), what + ": rank " + std::to_string(r) + " differs from rank 0");
}

// A and B side by side: `steps` steps, every loss and the final parameters
// bitwise equal; an inf in the last rank's loss at step 2 when `poison`.
template <class Policy, class Opt, class Options>
void twin(const Options& options, int64_t steps, bool poison, double max_grad_norm = 0.5) {
  auto pg = init();
  torch::manual_seed(7);
  auto a = make_net();
  torch::manual_seed(7);
  auto b = make_net();
  Opt opt_a(a->parameters(), options);
  amp::ShardedOptimizer<Opt> opt_b(pg, b->parameters(), options);
  const auto to = amp::TrainerOptions().progress(false).step(amp::StepOptions().max_grad_norm(max_grad_norm));
  amp::Trainer<Policy, amp::CPU> ta(a, opt_a, to), tb(b, opt_b, to);
  amp::DataParallel dp_a(pg, ta), dp_b(pg, tb);
  int64_t skipped = 0;
  for (int64_t s = 0; s < steps; ++s) {
    auto [x, y] = batch(s, pg.rank(), pg.world_size());
    const bool inf = poison && s == 2 && pg.rank() == pg.world_size() - 1;
    auto loss = [&](torch::nn::Sequential& net) {
      return [&, inf](auto&) {
        torch::Tensor l = (net->forward(x).to(torch::kFloat) - y).pow(2).mean();
        return inf ? l * std::numeric_limits<float>::infinity() : l;
      };
    };
    const auto ra = ta.step(loss(a));
    const auto rb = tb.step(loss(b));
    check(torch::equal(bits(ra.loss), bits(rb.loss)), "step " + std::to_string(s) + ": losses differ");
    check(ra.skipped() == rb.skipped(), "step " + std::to_string(s) + ": one skipped, the other not");
    skipped += rb.skipped() ? 1 : 0;
  }
  check(!poison || skipped >= 1, "the inf on the last rank skipped no step");
  check(torch::equal(param_bits(*a), param_bits(*b)), "the parameters differ from unsharded DataParallel");
  check(ta.scaler().get_scale() == tb.scaler().get_scale(), "the scales differ");
  same_on_every_rank(pg, param_bits(*b), "sharded parameters");
  check(opt_b.shard_numel() < amp::parameter_count(opt_b) || pg.world_size() == 1, "rank steps every parameter");
  // Inner's fused kernels where they serve Opt (LibTorch 2.4+ on CPU), as for the plain optimizer.
  check(opt_b.local_fused() == (amp::detail::fused_kind(opt_a, c10::DeviceType::CPU) != amp::FusedKind::kNone),
        "the local step's path");
  std::cout << "PASS " << test_case::name << " " << tb.precision_name << " world " << pg.world_size() << " skipped "
            << skipped << " path '" << tb.optimizer_path() << "', local step "
            << (opt_b.local_fused() ? "fused" : "unfused") << std::endl;
}

// The scaler on every line (fp32 gradients, Stepper<DynamicScaler>): an inf
// on one rank skips the step on every rank, in A and B alike.
template <class Opt, class Options>
void scaler_twin(const Options& options) {
  auto pg = init();
  torch::manual_seed(7);
  auto a = make_net();
  torch::manual_seed(7);
  auto b = make_net();
  Opt opt_a(a->parameters(), options);
  amp::ShardedOptimizer<Opt> opt_b(pg, b->parameters(), options);
  const auto so = amp::StepOptions().max_grad_norm(1.0);
  amp::Stepper<amp::DynamicScaler> sa(opt_a, so), sb(opt_b, so);
  auto pa = a->parameters(), pb = b->parameters();
  amp::DataParallel dp_a(pg, pa), dp_b(pg, pb);
  sa.set_gradient_sync(&dp_a);
  sb.set_gradient_sync(&dp_b);
  const double scale0 = sb.scaler().get_scale();
  for (int64_t s = 0; s < 6; ++s) {
    auto [x, y] = batch(s, pg.rank(), pg.world_size());
    const bool inf = s == 2 && pg.rank() == pg.world_size() - 1;
    auto loss = [&](torch::nn::Sequential& net) {
      torch::Tensor l = torch::mse_loss(net->forward(x), y);
      return inf ? l * std::numeric_limits<float>::infinity() : l;
    };
    const auto ra = sa.step(loss(a));
    const auto rb = sb.step(loss(b));
    check(rb.skipped() == (s == 2) && ra.skipped() == rb.skipped(), "step " + std::to_string(s) + ": skip decision");
  }
  check(sb.scaler().get_scale() == scale0 * 0.5, "the scale did not back off once");
  check(torch::equal(param_bits(*a), param_bits(*b)), "the parameters differ from unsharded DataParallel");
  same_on_every_rank(pg, param_bits(*b), "sharded parameters");
  std::cout << "PASS " << test_case::name << " world " << pg.world_size() << " path '" << sb.optimizer_path() << "'"
            << std::endl;
}

// Several models under one scaler (amp::Fabric), each with a sharded optimizer.
void precision() {
  auto pg = init();
  using P = amp::Mixed<amp::bf16, amp::NoScaler>;
  auto run = [&](bool sharded) {
    torch::manual_seed(11);
    auto gen = make_net(), disc = make_net(8);
    std::unique_ptr<torch::optim::Optimizer> og, od;
    if (sharded) {
      og = std::make_unique<amp::ShardedOptimizer<torch::optim::AdamW>>(pg, gen->parameters(),
                                                                        torch::optim::AdamWOptions(1e-2));
      od = std::make_unique<amp::ShardedOptimizer<torch::optim::SGD>>(pg, disc->parameters(),
                                                                      torch::optim::SGDOptions(0.05).momentum(0.9));
    } else {
      og = std::make_unique<torch::optim::AdamW>(gen->parameters(), torch::optim::AdamWOptions(1e-2));
      od = std::make_unique<torch::optim::SGD>(disc->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    }
    amp::Fabric<P, amp::CPU> fabric;
    fabric.setup(gen, *og);
    fabric.setup(disc, *od);
    amp::DataParallel dp(pg, fabric.parameters(), fabric.buffers(), amp::DataParallelOptions(),
                         fabric.parameter_names());
    fabric.set_gradient_sync(&dp);
    for (int64_t s = 0; s < 6; ++s) {
      auto [x, y] = batch(s, pg.rank(), pg.world_size());
      od->zero_grad();
      fabric.backward(
          fabric.forward([&](auto&) { return (disc->forward(x) - gen->forward(x).detach()).pow(2).mean(); }));
      fabric.optimizer_step(*od);
      og->zero_grad();
      fabric.backward(fabric.forward([&](auto&) { return (gen->forward(x) - y).pow(2).mean(); }));
      fabric.optimizer_step(*og);
      fabric.update();
    }
    return torch::cat({param_bits(*gen), param_bits(*disc)});
  };
  const torch::Tensor plain = run(false), sharded = run(true);
  check(torch::equal(plain, sharded), "Fabric's models differ from unsharded DataParallel");
  same_on_every_rank(pg, sharded, "sharded parameters");
  std::cout << "PASS " << test_case::name << " world " << pg.world_size() << std::endl;
}

// The training state per rank, counted: weights and gradients in full,
// AdamW's two fp32 moments for this rank's parameters only.
void memory() {
  auto pg = init();
  torch::manual_seed(7);
  auto a = make_net(64), b = make_net(64);
  torch::optim::AdamW opt_a(a->parameters(), torch::optim::AdamWOptions(1e-3));
  amp::ShardedOptimizer<torch::optim::AdamW> opt_b(pg, b->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto to = amp::TrainerOptions().progress(false);
  amp::Trainer<amp::True<amp::fp32>, amp::CPU> ta(a, opt_a, to), tb(b, opt_b, to);
  amp::DataParallel dp_a(pg, ta), dp_b(pg, tb);
  auto [x, y] = batch(0, pg.rank(), pg.world_size());
  ta.step([&](auto&) { return torch::mse_loss(a->forward(x), y); });
  tb.step([&](auto&) { return torch::mse_loss(b->forward(x), y); });
  const int64_t n = amp::parameter_count(opt_a);
  const int64_t full = amp::optimizer_state_bytes(opt_a);
  const int64_t mine = amp::optimizer_state_bytes(opt_b.local());
  check(full == 8 * n, "unsharded AdamW state " + std::to_string(full) + " bytes, expected 8 per parameter");
  check(mine == 8 * opt_b.shard_numel(), "this rank's state " + std::to_string(mine) + " bytes for " +
                                             std::to_string(opt_b.shard_numel()) + " elements");
  int64_t weights = 0, grads = 0, largest = 0;
  for (const auto& p : b->parameters()) {
    weights += p.numel() * static_cast<int64_t>(p.element_size());
    grads += p.grad().numel() * static_cast<int64_t>(p.grad().element_size());
    largest = std::max(largest, 8 * p.numel());
  }
  check(weights == 4 * n && grads == 4 * n, "weights and gradients are not 4 bytes per parameter each");
  const auto all = pg.allgather(torch::full({1}, mine, torch::kLong), "test gather");
  int64_t total = 0;
  for (const auto& t : all) {
    const int64_t r = t.item<int64_t>();
    total += r;
    // 1/N of the state, to within the largest parameter's state (whole parameters are assigned).
    check(std::abs(r * pg.world_size() - full) <= largest * pg.world_size(),
          "a rank holds " + std::to_string(r) + " of " + std::to_string(full) + " state bytes");
  }
  check(total == full, "the ranks' states add up to " + std::to_string(total) + ", not " + std::to_string(full));
  std::printf(
      "PASS %s world %d: %lld parameters; per rank %.3f bytes/parameter (weights 4 + gradients 4 + state %.3f; "
      "unsharded 16); parameter all-gather %lld bytes per rank per step\n",
      test_case::name.c_str(), pg.world_size(), static_cast<long long>(n),
      8.0 + static_cast<double>(mine) / static_cast<double>(n), static_cast<double>(mine) / n,
      static_cast<long long>(opt_b.gathered_bytes()));
  std::fflush(stdout);
}

// A checkpointed run: `mode` "sharded" or "plain" AdamW (two param groups,
// weights and biases, when `two_groups`) under DataParallel.
template <class Body>
void with_trainer(const amp::ProcessGroup& pg, const std::string& mode, bool two_groups, Body&& body) {
  torch::manual_seed(5);
  auto net = make_net();
  const auto options = torch::optim::AdamWOptions(1e-2);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (two_groups) {
    std::vector<torch::Tensor> weights, biases;
    for (const auto& p : net->parameters()) (p.dim() == 2 ? weights : biases).push_back(p);
    groups.emplace_back(weights);
    groups.emplace_back(biases);
  } else {
    groups.emplace_back(net->parameters());
  }
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (mode == "sharded")
    opt = std::make_unique<amp::ShardedOptimizer<torch::optim::AdamW>>(pg, groups, options);
  else
    opt = std::make_unique<torch::optim::AdamW>(groups, options);
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(net, *opt,
                                                                       amp::TrainerOptions().progress(false));
  amp::DataParallel dp(pg, trainer);
  body(net, trainer);
}

template <class Trainer>
void train_steps(const amp::ProcessGroup& pg, torch::nn::Sequential& net, Trainer& trainer, int64_t k) {
  for (int64_t i = 0; i < k; ++i) {
    auto [x, y] = batch(trainer.steps(), pg.rank(), pg.world_size());
    trainer.step([&](auto&) { return (net->forward(x).to(torch::kFloat) - y).pow(2).mean(); });
  }
}

// k steps, a checkpoint at `path`, k more steps; rank 0 records the
// parameters after them (`path`.final) and the world size (`path`.world),
// which ckpt_resume compares with.
template <class Trainer>
void train_save_train(const amp::ProcessGroup& pg, torch::nn::Sequential& net, Trainer& trainer,
                      const std::string& path, int64_t k) {
  train_steps(pg, net, trainer, k);
  amp::save_on_rank0(pg, trainer, path);
  train_steps(pg, net, trainer, k);
  if (pg.rank() == 0) {
    torch::save(param_bits(*net), path + ".final");
    std::ofstream(path + ".world") << pg.world_size();
  }
  pg.barrier();
}

void ckpt_train(const std::string& path, int64_t k, const std::string& mode) {
  auto pg = init();
  with_trainer(pg, mode, false,
               [&](torch::nn::Sequential& net, auto& trainer) { train_save_train(pg, net, trainer, path, k); });
  std::cout << "PASS " << test_case::name << " " << mode << " world " << pg.world_size() << std::endl;
}

// The AdamW state of `net`'s parameters that `opt` holds equals, bitwise,
// what a plain AdamW reads from `path`; returns how many it holds.
int64_t state_as_in(const std::string& path, torch::nn::Sequential& net, const torch::optim::Optimizer& opt) {
  torch::manual_seed(5);
  auto ref_net = make_net();
  torch::optim::AdamW ref_opt(ref_net->parameters(), torch::optim::AdamWOptions(1e-2));
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> ref(ref_net, ref_opt,
                                                                   amp::TrainerOptions().progress(false));
  ref.load(path);
  check(torch::equal(param_bits(*net), param_bits(*ref_net)), "the loaded parameters differ from the checkpoint's");
  const auto params = net->parameters(), ref_params = ref_net->parameters();
  int64_t held = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = opt.state().find(amp::detail::compat::optim_state_key(params[i].unsafeGetTensorImpl()));
    if (it == opt.state().end()) continue;
    auto ref_it = ref_opt.state().find(amp::detail::compat::optim_state_key(ref_params[i].unsafeGetTensorImpl()));
    check(ref_it != ref_opt.state().end(), "parameter " + std::to_string(i) + " has state the checkpoint lacks");
    const auto& s = dynamic_cast<const torch::optim::AdamWParamState&>(*it->second);
    const auto& r = dynamic_cast<const torch::optim::AdamWParamState&>(*ref_it->second);
    check(s.step() == r.step() && torch::equal(bits(s.exp_avg()), bits(r.exp_avg())) &&
              torch::equal(bits(s.exp_avg_sq()), bits(r.exp_avg_sq())),
          "parameter " + std::to_string(i) + "'s state differs from the checkpoint's");
    ++held;
  }
  return held;
}

// Resumes `path` with `mode` at this world size: every parameter and the
// state this rank holds equal the checkpoint's bitwise; after k more steps
// the parameters equal the uninterrupted run's bitwise at its world size
// (at another, the average over another number of ranks rounds otherwise).
void ckpt_resume(const std::string& path, int64_t k, const std::string& mode) {
  auto pg = init();
  int saved_world = 0;
  std::ifstream(path + ".world") >> saved_world;
  torch::Tensor expect;
  torch::load(expect, path + ".final");
  with_trainer(pg, mode, false, [&](torch::nn::Sequential& net, auto& trainer) {
    trainer.load(path);
    check(trainer.steps() == k, "loaded step " + std::to_string(trainer.steps()));
    const torch::optim::Optimizer* holder = &trainer.optimizer();
    size_t expected = net->parameters().size();
    if (auto* s = dynamic_cast<amp::ShardedOptimizer<torch::optim::AdamW>*>(&trainer.optimizer())) {
      holder = &s->local();
      expected = s->local().param_groups().front().params().size();
    }
    const int64_t held = state_as_in(path, net, *holder);
    check(held == static_cast<int64_t>(expected), "holds the state of " + std::to_string(held) + " parameters");
    train_steps(pg, net, trainer, k);
    const torch::Tensor got = param_bits(*net);
    if (saved_world == pg.world_size())
      check(torch::equal(got, expect), "resumed parameters differ from the uninterrupted run (bitwise)");
    same_on_every_rank(pg, got, "resumed parameters");
  });
  std::cout << "PASS " << test_case::name << " " << mode << " world " << pg.world_size() << " from world "
            << saved_world << (saved_world == pg.world_size() ? ": state and next steps bitwise" : ": state bitwise")
            << std::endl;
}

// Another model's checkpoint: an amp: error, and the trainer as it was.
void bad_load(const std::string& path) {
  auto pg = init();
  with_trainer(pg, "sharded", true, [&](torch::nn::Sequential& net, auto& trainer) {
    train_steps(pg, net, trainer, 2);
    auto& opt = dynamic_cast<amp::ShardedOptimizer<torch::optim::AdamW>&>(trainer.optimizer());
    std::ostringstream before;
    trainer.save_state(before);
    const torch::Tensor params = param_bits(*net);
    const int64_t state = amp::optimizer_state_bytes(opt.local());
    std::string msg;
    try {
      trainer.load(path);
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    check(msg.rfind("amp: checkpoint", 0) == 0, "expected an amp: error, got '" + msg + "'");
    check(torch::equal(params, param_bits(*net)), "the parameters changed");
    check(state == amp::optimizer_state_bytes(opt.local()) && state > 0, "the local state changed");
    std::ostringstream after;
    trainer.save_state(after);
    check(before.str() == after.str(), "the trainer's state changed");
    train_steps(pg, net, trainer, 1);
    std::cout << "PASS " << test_case::name << " (" << msg.substr(0, msg.find('\n')).substr(0, 120) << "...)"
              << std::endl;
  });
}

// trainer.save() on rank 0 alone: a bounded amp: error that names
// save_on_rank0, and no file.
void lonely_save(const std::string& path) {
  auto pg = init();
  with_trainer(pg, "sharded", false, [&](torch::nn::Sequential& net, auto& trainer) {
    train_steps(pg, net, trainer, 1);
    if (pg.rank() != 0) {
      std::this_thread::sleep_for(timeout() + std::chrono::seconds(2));
      std::cout << "PASS " << test_case::name << std::endl;
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::string msg;
    try {
      trainer.save(path);
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    check(msg.find("amp: ShardedOptimizer's state gather") != std::string::npos &&
              msg.find("save_on_rank0") != std::string::npos,
          "message: '" + msg + "'");
    check(secs < timeout().count() / 1000.0 + 2.0, "took " + std::to_string(secs) + " s");
    check(!std::ifstream(path).good(), "a file was written");
    std::cout << "PASS " << test_case::name << " after " << secs << " s" << std::endl;
  });
}

// fit_sharded with a sharded trainer: the same History and parameters as unsharded.
void fit() {
  auto pg = init();
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int64_t s = 0; s < 9; ++s) batches.push_back(batch(s, 0, 1));
  auto run = [&](bool sharded) {
    torch::manual_seed(7);
    auto net = make_net();
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (sharded)
      opt = std::make_unique<amp::ShardedOptimizer<torch::optim::Adam>>(pg, net->parameters(),
                                                                        torch::optim::AdamOptions(1e-2));
    else
      opt = std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-2));
    amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(net, *opt,
                                                                         amp::TrainerOptions().progress(false));
    amp::DataParallel dp(pg, trainer);
    const amp::History h = amp::fit_sharded(pg, trainer, batches, [&](auto&, const auto& b) {
      return (net->forward(b.first).to(torch::kFloat) - b.second).pow(2).mean();
    });
    std::vector<double> losses;
    for (const auto& m : h.steps) losses.push_back(m.loss);
    return std::make_pair(losses, param_bits(*net));
  };
  const auto plain = run(false), sharded = run(true);
  check(!plain.first.empty() && plain.first == sharded.first, "the histories' losses differ");
  check(torch::equal(plain.second, sharded.second), "the parameters differ from unsharded DataParallel");
  std::cout << "PASS " << test_case::name << " world " << pg.world_size() << " steps " << plain.first.size()
            << std::endl;
}

// An Inner whose step() stops or kills the last rank at its 3rd step: after
// the gradient all-reduce, before the parameter all-gather, which the
// survivors wait in.
int64_t g_die_steps = 0;
std::string g_die_how;
struct DyingSGD : torch::optim::SGD {
  DyingSGD(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::SGDOptions o)
      : torch::optim::SGD(std::move(groups), o) {}
  torch::Tensor step(LossClosure closure = nullptr) override {
    if (++g_die_steps == 3 && test_case::rank == std::atoi(std::getenv("WORLD_SIZE")) - 1) {
      std::cout << "rank " << test_case::rank << " " << g_die_how << " in its local step" << std::endl;
      std::raise(g_die_how == "kill" ? SIGKILL : SIGSTOP);
    }
    return torch::optim::SGD::step(closure);
  }
};

void die_in_gather(const std::string& how) {
  g_die_how = how;
  auto pg = init();
  auto net = make_net();
  amp::ShardedOptimizer<DyingSGD> opt(pg, net->parameters(), torch::optim::SGDOptions(0.05));
  amp::Trainer<amp::True<amp::fp32>, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
  amp::DataParallel dp(pg, trainer);
  auto t0 = std::chrono::steady_clock::now();
  try {
    for (int64_t s = 0; s < 6; ++s) {
      auto [x, y] = batch(s, pg.rank(), pg.world_size());
      t0 = std::chrono::steady_clock::now();
      trainer.step([&](auto&) { return torch::mse_loss(net->forward(x), y); });
    }
  } catch (const c10::Error& e) {
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string msg = e.what_without_backtrace();
    check(msg.rfind("amp: ShardedOptimizer's parameter all-gather", 0) == 0, "message: " + msg);
    check(secs < timeout().count() / 1000.0 + 0.5, "took " + std::to_string(secs) + " s");
    std::cout << "PASS " << test_case::name << " after " << secs << " s: " << msg.substr(0, msg.find('\n'))
              << std::endl;
    std::exit(3);  // a failed rank: tools/launch ends the stopped one
  }
  fail("no error");
}

// A peer killed or stopped where it should join a checkpoint's gather
// (save_on_rank0 of a ShardedOptimizer's state): as ckpt_train (a checkpoint
// at step k, the uninterrupted run's parameters at 2k), then a second save to
// the same path that the last rank never joins. Both survivors get the amp:
// error within the timeout; the first checkpoint is still there, byte for
// byte, and no temporary file is left beside it (ckpt_resume then continues
// from it bitwise).
void die_in_save(const std::string& path, int64_t k, const std::string& how) {
  auto pg = init();
  with_trainer(pg, "sharded", false, [&](torch::nn::Sequential& net, auto& trainer) {
    train_save_train(pg, net, trainer, path, k);
    auto bytes = [&] { return test_case::file_bytes(path); };
    const std::string before = bytes();
    check(!before.empty(), "no first checkpoint");
    if (pg.rank() == pg.world_size() - 1) {
      std::cout << "rank " << pg.rank() << " " << how << " before the checkpoint's gather" << std::endl;
      std::raise(how == "kill" ? SIGKILL : SIGSTOP);
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::string msg;
    try {
      amp::save_on_rank0(pg, trainer, path);
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    check(msg.rfind("amp: ", 0) == 0, "expected an amp: error, got '" + msg + "'");
    check(secs < timeout().count() / 1000.0 + 0.5, "took " + std::to_string(secs) + " s");
    check(bytes() == before, "the first checkpoint changed");
    test_case::check_no_temp_file(path);
    std::cout << "PASS " << test_case::name << " after " << secs
              << " s: " << msg.substr(0, msg.find('\n')).substr(0, 120) << std::endl;
    std::exit(3);  // a failed rank: tools/launch ends the stopped one
  });
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  std::vector<std::string> a(argv + 1, argv + argc);
  if (a.empty()) fail("usage: sharded_test CASE [ARGS]");
  test_case::name = a[0];
  using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;
  try {
    if (test_case::name == "sgd")
      twin<Bf16, torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9), 12, false);
    else if (test_case::name == "adam")
      twin<Bf16, torch::optim::Adam>(torch::optim::AdamOptions(1e-2), 12, false);
    else if (test_case::name == "adamw")
      twin<Bf16, torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2), 12, false);
    else if (test_case::name == "adamw8bit")
      twin<Bf16, amp::AdamW8bit>(torch::optim::AdamWOptions(1e-2), 12, false);
    else if (test_case::name == "fp16_inf") {
      using Fp16 = amp::Mixed<amp::fp16, amp::DynamicScaler>;
      if constexpr (amp::is_supported_v<Fp16, amp::CPU>) {
        twin<Fp16, torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2), 12, true);
      } else {
        std::cout << "PASS fp16_inf (16-mixed on CPU needs LibTorch 2.3+; scaler_* cover the scaler here)" << std::endl;
      }
    } else if (test_case::name == "float8") {
#if AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL
      // Delayed scaling's amaxes all-reduced through each DataParallel, as before.
      twin<amp::Float8<amp::Delayed<4, 0>>, torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2), 8, false);
#else
      std::cout << "PASS float8 (Float8 on CPU needs LibTorch 2.8+)" << std::endl;
#endif
    } else if (test_case::name == "scaler_sgd")
      scaler_twin<torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9));
    else if (test_case::name == "scaler_adamw")
      scaler_twin<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2));
    else if (test_case::name == "precision")
      precision();
    else if (test_case::name == "fit")
      fit();
    else if (test_case::name == "die_in_gather" && a.size() == 2)
      die_in_gather(a[1]);
    else if (test_case::name == "die_in_save" && a.size() == 4)
      die_in_save(a[1], std::stoll(a[2]), a[3]);
    else if (test_case::name == "memory")
      memory();
    else if (test_case::name == "ckpt_train" && a.size() == 4)
      ckpt_train(a[1], std::stoll(a[2]), a[3]);
    else if (test_case::name == "ckpt_resume" && a.size() == 4)
      ckpt_resume(a[1], std::stoll(a[2]), a[3]);
    else if (test_case::name == "bad_load" && a.size() == 2)
      bad_load(a[1]);
    else if (test_case::name == "lonely_save" && a.size() == 2)
      lonely_save(a[1]);
    else
      fail("unknown case or arguments");
  } catch (const std::exception& e) {
    fail(std::string("exception: ") + e.what());
  }
  return 0;
}
