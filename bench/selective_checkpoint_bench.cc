// bench/selective_checkpoint_bench.cc: what amp::checkpoint costs in time, full
// and selective (CheckpointOptions::save_matmuls), and what the selective
// policy's matmul kernels cost the program when no checkpoint is running.
//
//   bazel run -c opt //bench:selective_checkpoint_bench
//
// BM_TransformerStep: 4 pre-LN transformer blocks (one attention head,
// d = 256, MLP 4d; batch 8 x 128 tokens), bf16 Region on CPU, backward and
// SGD, with each block run plainly, checkpointed (every op recomputed in
// backward) and checkpointed saving the matmuls (mm, addmm, bmm, baddbmm:
// only the rest recomputed), interleaved. Counters: none_ms, full_ms,
// selective_ms (wall), full_over_none, selective_over_none (process CPU time,
// which a busy machine disturbs less; with OMP_NUM_THREADS=1 no thread
// spins), and saved_mib: the matmul outputs the selective forward keeps until
// backward (all 4 blocks).
//
// BM_MatmulKernelOff: the CPU ns per at::mm call (2x2, the dispatcher's cost
// shows; best of 5 x 100000) before and after the selective policy's kernels are registered on
// ADInplaceOrView, with no checkpoint running: the price every matmul of the
// process pays once one selective checkpoint ran. Run it first (alone: the
// other benchmark registers the kernels).
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <amp/amp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <cstdint>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;
constexpr int64_t kB = 8, kT = 128, kD = 256, kLayers = 4;

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})))),
        qkv(register_module("qkv", torch::nn::Linear(kD, 3 * kD))),
        proj(register_module("proj", torch::nn::Linear(kD, kD))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})))),
        fc1(register_module("fc1", torch::nn::Linear(kD, 4 * kD))),
        fc2(register_module("fc2", torch::nn::Linear(4 * kD, kD))),
        drop(register_module("drop", torch::nn::Dropout(0.1))) {}
  torch::Tensor forward(const torch::Tensor& x) {  // [B*T, D]
    const auto parts = qkv(ln1(x)).view({kB, kT, 3 * kD}).chunk(3, -1);
    const torch::Tensor att =
        drop(torch::softmax(torch::matmul(parts[0], parts[1].transpose(1, 2)) / std::sqrt(double(kD)), -1));
    const torch::Tensor h = x + drop(proj(torch::matmul(att, parts[2]).reshape({kB * kT, kD})));
    return h + drop(fc2(torch::gelu(fc1(ln2(h)))));
  }
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Block);

enum class Mode { kNone, kFull, kSelective };

struct Model {
  std::vector<Block> blocks;
  torch::nn::Linear head{kD, 16};
  std::vector<torch::Tensor> params;
  Model() {
    torch::manual_seed(0);
    for (int i = 0; i < kLayers; ++i) blocks.emplace_back();
    for (auto& b : blocks)
      for (auto& p : b->parameters()) params.push_back(p);
    for (auto& p : head->parameters()) params.push_back(p);
  }
  // One training step; returns the bytes of the matmul outputs saved for backward.
  int64_t step(const torch::Tensor& x, const torch::Tensor& y, Mode mode) {
    int64_t saved = 0;
    torch::Tensor loss;
    {
      amp::Region<Bf16, amp::CPU> region;
      torch::Tensor h = x;
      for (auto& b : blocks) {
        h = mode == Mode::kNone
                ? b(h)
                : amp::checkpoint(b, h, amp::CheckpointOptions().save_matmuls(mode == Mode::kSelective));
        if (mode == Mode::kSelective)
          saved += dynamic_cast<const amp::detail::CheckpointNode&>(*h.grad_fn()).saved_ops()->bytes();
      }
      loss = torch::cross_entropy_loss(head(h).to(torch::kFloat), y);
    }
    loss.backward();
    torch::NoGradGuard no_grad;
    for (auto& p : params) {
      p.add_(p.grad(), -1e-3);
      p.grad().zero_();
    }
    return saved;
  }
};

void BM_TransformerStep(benchmark::State& state) {
  Model none, full, selective;
  const torch::Tensor x = torch::randn({kB * kT, kD}), y = torch::randint(0, 16, {kB * kT});
  none.step(x, y, Mode::kNone);  // warm-up
  full.step(x, y, Mode::kFull);
  selective.step(x, y, Mode::kSelective);
  double t[3] = {0, 0, 0}, cpu[3] = {0, 0, 0};
  int64_t saved = 0;
  int turn = 0;
  for (auto _ : state) {
    for (int k = 0; k < 3; ++k) {  // a rotating order, so that none runs always first
      const int m = (k + turn) % 3;
      const auto t0 = Clock::now();
      const std::clock_t c0 = std::clock();
      const int64_t s = (m == 0 ? none : m == 1 ? full : selective).step(x, y, static_cast<Mode>(m));
      cpu[m] += static_cast<double>(std::clock() - c0);
      t[m] += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (m == 2) saved = s;
    }
    ++turn;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["none_ms"] = t[0] / n;
  state.counters["full_ms"] = t[1] / n;
  state.counters["selective_ms"] = t[2] / n;
  state.counters["full_over_none"] = cpu[1] / cpu[0];
  state.counters["selective_over_none"] = cpu[2] / cpu[0];
  state.counters["saved_mib"] = static_cast<double>(saved) / (1 << 20);
}

double ns_per_mm(int calls) {
  const torch::Tensor a = torch::randn({2, 2}), b = torch::randn({2, 2});
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const std::clock_t c0 = std::clock();  // CPU time: a busy machine disturbs it less
    for (int i = 0; i < calls; ++i) benchmark::DoNotOptimize(torch::mm(a, b));
    best = std::min(best, static_cast<double>(std::clock() - c0) * 1e9 / CLOCKS_PER_SEC / calls);
  }
  return best;
}

void BM_MatmulKernelOff(benchmark::State& state) {
  const auto mm = c10::Dispatcher::singleton().findSchema({"aten::mm", ""});
  if (mm->hasKernelForDispatchKey(c10::DispatchKey::ADInplaceOrView)) {
    state.SkipWithError("the kernels are registered already: run this benchmark first or alone");
    return;
  }
  double before = 0, after = 0;
  for (auto _ : state) {
    before = ns_per_mm(100000);
    amp::detail::register_saved_op_kernels();
    after = ns_per_mm(100000);
  }
  state.counters["before_ns"] = before;
  state.counters["after_ns"] = after;
  state.counters["added_ns"] = after - before;
}

BENCHMARK(BM_MatmulKernelOff)->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TransformerStep)->Iterations(10)->Unit(benchmark::kMillisecond);

}  // namespace
