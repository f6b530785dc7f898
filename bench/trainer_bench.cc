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
// a large MLP (2048-8192-2048, batch 512, Adam).
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
void hand_step(torch::nn::Sequential& model, torch::optim::Optimizer& opt, typename amp::policy_traits<P>::scaler_type& scaler,
               const torch::Tensor& x, const torch::Tensor& y) {
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
void BM_Mlp(benchmark::State& state) {
  auto model = make_mlp(2048, 8192, 2048);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-4));
  amp::Trainer<P, amp::CPU> trainer(model, opt, amp::TrainerOptions().progress(false));
  using Param = typename amp::policy_traits<P>::param_type;
  auto x = torch::randn({512, 2048}).to(amp::scalar_type_v<Param>);
  auto y = torch::randn({512, 2048}).to(amp::scalar_type_v<Param>);
  trainer.step([&](auto&) { return torch::mse_loss(model->forward(x), y); });  // warm-up
  reset_peak_rss();
  for (auto _ : state) trainer.step([&](auto&) { return torch::mse_loss(model->forward(x), y); });
  state.counters["steps_per_s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["peak_rss_MiB"] = peak_rss_mib();
  state.SetLabel(amp::policy_traits<P>::name);
}

using Fp32 = amp::True<amp::fp32>;
using Bf16Mixed = amp::Mixed<amp::bf16, amp::NoScaler>;

BENCHMARK_TEMPLATE(BM_TrainerVsHandLoop, Fp32)->Arg(512)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(2.0);
BENCHMARK_TEMPLATE(BM_TrainerVsHandLoop, Bf16Mixed)->Arg(512)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(2.0);
BENCHMARK_TEMPLATE(BM_Mlp, Fp32)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(4);
BENCHMARK_TEMPLATE(BM_Mlp, Bf16Mixed)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(4);

}  // namespace
