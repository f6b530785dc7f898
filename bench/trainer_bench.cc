// bench/trainer_bench.cc: what the Trainer costs over a hand-written LibTorch
// loop doing the same work, and what bf16-mixed buys over fp32 on this CPU.
//
//   bazel run -c opt //bench:trainer_bench
//
// BM_TrainerVsHandLoop/<policy>: each iteration runs one step of a
// hand-written loop (the same autocast guard, the same scaler calls, the same
// optimizer) and one Trainer step on an identical model, interleaved so both
// see the same machine state. Counters: hand_ms, trainer_ms and their ratio.
// BM_Mlp/<policy>: steps/s and the process's peak RSS during the benchmark for
// a large MLP (2048-8192-2048, batch 512, Adam): 32-true, bf16-mixed, and
// 16-mixed where the CPU has it (LibTorch 2.3+; no native fp16 arithmetic on
// most CPUs, so slower than 32-true).
// BM_StepperVsHandScaler: the same for the loss-scaling path (DynamicScaler).
// BM_StrictCasts: the precision sweep's model and step (MLP 256-1024-1024-16,
// batch 256, AdamW, clipping) under bf16-mixed, with strict casts kThrow and
// kOff, interleaved; counters on_ms, off_ms and on_over_off.
// BM_StrictCastsSmallOps: the same on 40 tiny element-wise ops (the worst case).
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <amp/amp.h>

#include <chrono>
#include <fstream>
#include <string>

namespace {

using Clock = std::chrono::steady_clock;

torch::nn::Sequential make_mlp(int64_t in, int64_t hidden, int64_t out) {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::ReLU(), torch::nn::Linear(hidden, out));
}

void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }
double peak_rss_mib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return 0.0;
}

// The hand-written step a careful user would write for policy P.
template <class P>
void hand_step(torch::nn::Sequential& model, torch::optim::Optimizer& opt,
               typename amp::policy_traits<P>::scaler_type& scaler, const torch::Tensor& x, const torch::Tensor& y) {
  opt.zero_grad();
  torch::Tensor loss;
  if constexpr (amp::policy_traits<P>::uses_autocast) {
    amp::Autocast<typename amp::policy_traits<P>::compute_type, amp::CPU> guard;
    loss = torch::mse_loss(model->forward(x), y);
  } else {
    loss = torch::mse_loss(model->forward(x), y);
  }
  scaler.scale(loss).backward();
  scaler.step(opt);
  scaler.update();
}

template <class P>
void BM_TrainerVsHandLoop(benchmark::State& state) {
  const int64_t width = state.range(0);
  auto hand_model = make_mlp(width, 4 * width, width);
  auto amp_model = make_mlp(width, 4 * width, width);
  using Param = typename amp::policy_traits<P>::param_type;
  hand_model->to(amp::scalar_type_v<Param>);
  torch::optim::Adam hand_opt(hand_model->parameters(), torch::optim::AdamOptions(1e-4));
  torch::optim::Adam amp_opt(amp_model->parameters(), torch::optim::AdamOptions(1e-4));
  typename amp::policy_traits<P>::scaler_type hand_scaler;
  amp::Trainer<P, amp::CPU> trainer(amp_model, amp_opt, amp::TrainerOptions().progress(false));
  auto x = torch::randn({256, width}).to(amp::scalar_type_v<Param>);
  auto y = torch::randn({256, width}).to(amp::scalar_type_v<Param>);
  for (int i = 0; i < 3; ++i) {  // warm-up: allocator, oneDNN primitives, Adam state
    hand_step<P>(hand_model, hand_opt, hand_scaler, x, y);
    trainer.step([&](auto&) { return torch::mse_loss(amp_model->forward(x), y); });
  }
  double hand = 0, ours = 0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    hand_step<P>(hand_model, hand_opt, hand_scaler, x, y);
    auto t1 = Clock::now();
    trainer.step([&](auto&) { return torch::mse_loss(amp_model->forward(x), y); });
    auto t2 = Clock::now();
    hand += std::chrono::duration<double>(t1 - t0).count();
    ours += std::chrono::duration<double>(t2 - t1).count();
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["hand_ms"] = 1e3 * hand / n;
  state.counters["trainer_ms"] = 1e3 * ours / n;
  state.counters["trainer_over_hand"] = ours / hand;
  state.SetLabel(amp::policy_traits<P>::name);
}

template <class P>
void mlp_steps(benchmark::State& state) {
  auto model = make_mlp(2048, 8192, 2048);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-4));
  amp::Trainer<P, amp::CPU> trainer(model, opt, amp::TrainerOptions().progress(false));
  using Param = typename amp::policy_traits<P>::param_type;
  auto x = torch::randn({512, 2048}).to(amp::scalar_type_v<Param>);
  auto y = torch::randn({512, 2048}).to(amp::scalar_type_v<Param>);
  trainer.step([&](auto&) { return torch::mse_loss(model->forward(x), y); });  // warm-up
  reset_peak_rss();
  for (auto _ : state) trainer.step([&](auto&) { return torch::mse_loss(model->forward(x), y); });
  state.counters["steps_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["peak_rss_MiB"] = peak_rss_mib();
  state.SetLabel(amp::policy_traits<P>::name);
}

// 16-mixed exists on CPU from LibTorch 2.3; before, the row says so.
template <class P>
void BM_Mlp(benchmark::State& state) {
  if constexpr (amp::is_supported_v<P, amp::CPU>)
    mlp_steps<P>(state);
  else
    state.SkipWithError("this LibTorch has no CPU fp16 autocast (2.3+)");
}

// The loss-scaling path (no CPU fp16 autocast on LibTorch < 2.3, so on fp32
// gradients): torch's GradScaler recipe by hand vs amp::Stepper<DynamicScaler>,
// the component Trainer runs after the forward.
void BM_StepperVsHandScaler(benchmark::State& state) {
  const int64_t width = state.range(0);
  auto hand_model = make_mlp(width, 4 * width, width);
  auto amp_model = make_mlp(width, 4 * width, width);
  torch::optim::Adam hand_opt(hand_model->parameters(), torch::optim::AdamOptions(1e-4));
  torch::optim::Adam amp_opt(amp_model->parameters(), torch::optim::AdamOptions(1e-4));
  amp::DynamicScaler hand_scaler;
  amp::Stepper<amp::DynamicScaler> stepper(amp_opt);
  const auto x = torch::randn({256, width});
  const auto y = torch::randn({256, width});
  auto hand = [&] {
    hand_opt.zero_grad();
    auto loss = torch::mse_loss(hand_model->forward(x), y);
    hand_scaler.scale(loss).backward();
    hand_scaler.step(hand_opt);
    hand_scaler.update();
  };
  auto ours = [&] { stepper.step(torch::mse_loss(amp_model->forward(x), y)); };
  for (int i = 0; i < 3; ++i) {
    hand();
    ours();
  }
  double t_hand = 0, t_ours = 0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    hand();
    auto t1 = Clock::now();
    ours();
    auto t2 = Clock::now();
    t_hand += std::chrono::duration<double>(t1 - t0).count();
    t_ours += std::chrono::duration<double>(t2 - t1).count();
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["hand_ms"] = 1e3 * t_hand / n;
  state.counters["stepper_ms"] = 1e3 * t_ours / n;
  state.counters["stepper_over_hand"] = t_ours / t_hand;
}

void BM_StrictCasts(benchmark::State& state) {
  using P = amp::Mixed<amp::bf16, amp::NoScaler>;
  auto make = [] {
    torch::manual_seed(0);
    return torch::nn::Sequential(torch::nn::Linear(256, 1024), torch::nn::ReLU(), torch::nn::Linear(1024, 1024),
                                 torch::nn::ReLU(), torch::nn::Linear(1024, 16));
  };
  auto on_model = make(), off_model = make();
  torch::optim::AdamW on_opt(on_model->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW off_opt(off_model->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto options = amp::TrainerOptions().step(amp::StepOptions().max_grad_norm(1.0)).progress(false);
  amp::Trainer<P, amp::CPU> on(
      on_model, on_opt,
      amp::TrainerOptions(options).region(amp::RegionOptions().strict_casts(amp::StrictCasts::kThrow)));
  amp::Trainer<P, amp::CPU> off(
      off_model, off_opt,
      amp::TrainerOptions(options).region(amp::RegionOptions().strict_casts(amp::StrictCasts::kOff)));
  const auto x = torch::randn({256, 256});
  const auto y = torch::randint(0, 16, {256});
  auto step = [&](amp::Trainer<P, amp::CPU>& t, torch::nn::Sequential& m) {
    t.step([&](auto&) { return torch::cross_entropy_loss(m->forward(x), y); });
  };
  for (int i = 0; i < 3; ++i) {
    step(on, on_model);
    step(off, off_model);
  }
  double t_on = 0, t_off = 0;
  bool on_first = true;
  for (auto _ : state) {
    // Alternate which goes first, so neither always runs on a warmer cache.
    auto t0 = Clock::now();
    on_first ? step(on, on_model) : step(off, off_model);
    auto t1 = Clock::now();
    on_first ? step(off, off_model) : step(on, on_model);
    auto t2 = Clock::now();
    (on_first ? t_on : t_off) += std::chrono::duration<double>(t1 - t0).count();
    (on_first ? t_off : t_on) += std::chrono::duration<double>(t2 - t1).count();
    on_first = !on_first;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["on_ms"] = 1e3 * t_on / n;
  state.counters["off_ms"] = 1e3 * t_off / n;
  state.counters["on_over_off"] = t_on / t_off;
}

// The worst case for strict casts: many tiny ops, each of which the fallback
// boxes once. 40 element-wise ops on 64 floats inside a bf16-mixed region,
// kThrow vs kOff interleaved; counter ns_per_op is the added cost of one op.
void BM_StrictCastsSmallOps(benchmark::State& state) {
  using R = amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>;
  const auto a = torch::randn({64});
  constexpr int kOps = 40;
  auto ops = [&] {
    torch::Tensor t = a;
    for (int i = 0; i < kOps / 4; ++i) t = torch::relu(t * 0.5 + a).sub(a);
    benchmark::DoNotOptimize(t);
  };
  double t_on = 0, t_off = 0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    {
      R region(amp::RegionOptions().strict_casts(amp::StrictCasts::kThrow));
      ops();
    }
    auto t1 = Clock::now();
    {
      R region(amp::RegionOptions().strict_casts(amp::StrictCasts::kOff));
      ops();
    }
    auto t2 = Clock::now();
    t_on += std::chrono::duration<double>(t1 - t0).count();
    t_off += std::chrono::duration<double>(t2 - t1).count();
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["on_us"] = 1e6 * t_on / n;
  state.counters["off_us"] = 1e6 * t_off / n;
  state.counters["on_over_off"] = t_on / t_off;
  state.counters["ns_per_op"] = 1e9 * (t_on - t_off) / (n * kOps);
}

using Fp32 = amp::True<amp::fp32>;
using Bf16Mixed = amp::Mixed<amp::bf16, amp::NoScaler>;
using Fp16Mixed = amp::Mixed<amp::fp16, amp::DynamicScaler>;

BENCHMARK_TEMPLATE(BM_TrainerVsHandLoop, Fp32)->Arg(512)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(2.0);
BENCHMARK_TEMPLATE(BM_TrainerVsHandLoop, Bf16Mixed)
    ->Arg(512)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);
BENCHMARK(BM_StepperVsHandScaler)->Arg(512)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(2.0);
BENCHMARK(BM_StrictCasts)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(5.0);
BENCHMARK(BM_StrictCastsSmallOps)->UseRealTime()->Unit(benchmark::kMicrosecond)->MinTime(2.0);
BENCHMARK_TEMPLATE(BM_Mlp, Fp32)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(4);
BENCHMARK_TEMPLATE(BM_Mlp, Bf16Mixed)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(4);
BENCHMARK_TEMPLATE(BM_Mlp, Fp16Mixed)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(4);

}  // namespace
