// examples/precision_sweep.cc: the main job (`tools/dev demo`).
//
//   precision_sweep                         # every policy the device supports
//   precision_sweep --block-scaled          # with the emulated MXFP8 and NVFP4 recipes (slow)
//   precision_sweep --precision=bf16-mixed  # one, by its Lightning string
//   precision_sweep --device=cpu --steps=300 --csv=out/sweep.csv --plot=out/sweep.png
//
// Trains the same MLP on an embedded synthetic classification task (a fixed
// random nonlinear teacher; no download) under every policy of
// amp::supported_policies<Device> — the compile-time Hana list, so a policy
// added to the library adds a row; the block-scaled Float8 recipes, which
// run emulated at several to tens of bf16 steps a step, only with
// --block-scaled — and prints a comparison table. Then
// (unless --precision or --no-ladder) the memory ladder: a residual MLP
// (demo_task.h) under ten configurations (32-true AdamW; bf16-mixed AdamW,
// AdamW8bit, AdamW4bit; bf16-true AdamW8bit with stochastic rounding; each
// also with amp::checkpoint around its blocks), with the exact bytes per
// parameter of its parameters, gradients, optimizer state and what a step's
// forward keeps for backward, its steps/s and final loss
// (docs/maintainers.md#the-demo has the formulas).
//
// Timing: each policy first runs --warmup untimed steps on a throwaway model
// of the same shape (CUDA context, cuBLAS handles, kernel choice, allocator
// growth), then the timed run from the same initial weights as every other
// policy, bracketed by device synchronizations on CUDA. A run that ends with
// a non-finite loss or weights is reported as diverged and is never the speed
// baseline; one that throws is reported as failed (exit status 1) and the
// others still run. 16-true uses AdamW eps 1e-4 (1e-8 is 0 in fp16).
// Default size: hidden 1024, batch 256 on CPU (quick); hidden 4096, batch 4096
// on CUDA (enough matmul work for tensor cores to show).
//
// Outputs: per-step metrics (--csv), a per-policy summary and the ladder next
// to it (sweep.csv -> sweep.summary.csv, sweep.ladder.csv), and a gnuplot PNG
// (--plot) drawn from them (write_plot says which panels).
//
// --optimizer picks the optimizer of every run: adamw (default, LibTorch's
// torch::optim::AdamW) or amp's low-bit AdamW with the same options and
// 8-bit, 4-bit or fp8 optimizer states (adamw8bit, adamw4bit, adamwfp8; fp8
// needs LibTorch 2.1 or newer); --bf16-stochastic-round rounds a low-bit
// optimizer's update to bf16 parameters stochastically (for bf16-true). The
// table's "state B/param" column (state_bytes_per_param in the summary CSV)
// is the optimizer's state bytes per parameter after training: AdamW's is 8.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <amp/amp.h>

#include "demo_task.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if defined(AMP_LIBTORCH_HAS_CUDA) && __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define AMP_SWEEP_CUDA_MEMORY 1
#endif

namespace {

namespace hana = boost::hana;

struct Config {
  std::string precision;  // empty: all supported
  std::string device;
  int64_t steps = 150;
  int64_t warmup = 5;
  int64_t batch_size = 256;  // 4096 on CUDA unless --batch-size
  int64_t seed = 42;
  int64_t hidden = 1024;  // 4096 on CUDA unless --hidden
  std::string csv, plot;
  std::string optimizer = "adamw";     // adamw, adamw8bit, adamw4bit, adamwfp8
  bool bf16_stochastic_round = false;  // the low-bit optimizers' LowBitOptions
  bool ladder = true;                  // the memory ladder after the sweep (not with --precision)
  bool block_scaled = false;           // the emulated block-scaled Float8 recipes in the sweep
  std::vector<std::string> not_run;    // the sweep's policies left out without --block-scaled
  int64_t ladder_steps = 40;           // timed steps per ladder configuration
  int64_t ffn = 1024;                  // the ladder model's block width (demo::ResidualMlp)
};

using demo::Task;

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(Task::kIn, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, Task::kClasses))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

// Peak memory of one run: the CUDA caching allocator's peak on CUDA; on CPU
// the process's peak RSS (VmHWM), reset before each run via clear_refs.
void reset_peak_memory(bool cuda) {
#ifdef AMP_SWEEP_CUDA_MEMORY
  if (cuda) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(0);
    return;
  }
#endif
  (void)cuda;
  std::ofstream("/proc/self/clear_refs") << "5";
}
double peak_memory_mib(bool cuda) {
#ifdef AMP_SWEEP_CUDA_MEMORY
  if (cuda) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    return stats.allocated_bytes[0].peak / (1024.0 * 1024.0);
  }
#endif
  (void)cuda;
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  return 0.0;
}

struct Row {
  std::string name;
  double final_loss = 0, accuracy = 0, steps_per_s = 0, peak_mib = 0, scale = 1;
  double state_bytes_per_param = 0;  // the optimizer's state bytes / parameters, after training
  int64_t skipped = 0;
  bool scaled = false;
  bool diverged = false;  // non-finite loss in the last steps, or non-finite weights
  double eps = 1e-8;      // AdamW's
  std::string error;      // the run threw: shown as failed, left out of the CSVs and the plot
  amp::History history;
};

using Batch = std::pair<torch::Tensor, torch::Tensor>;

// The model, optimizer and trainer options every run (timed or warm-up) uses.
Mlp make_model(const Config& cfg, torch::Device device) {
  Mlp model(cfg.hidden);
  model->to(device);
  return model;
}
// With fp16 parameters Adam's state is fp16 too, where torch's eps 1e-8 is 0
// (the Trainer refuses it): use the smallest safe one there.
double adam_eps(c10::ScalarType param_dtype) { return param_dtype == torch::kHalf ? 1e-4 : 1e-8; }
torch::optim::AdamWOptions optimizer_options(double eps) {
  return torch::optim::AdamWOptions(1e-3).weight_decay(0.0).eps(eps);
}
// --optimizer's class name, as the table and the plot show it.
std::string optimizer_name(const Config& cfg) {
  if (cfg.optimizer == "adamw8bit") return "AdamW8bit";
  if (cfg.optimizer == "adamw4bit") return "AdamW4bit";
  if (cfg.optimizer == "adamwfp8") return "AdamWFp8";
  return "AdamW";
}
// The optimizer of every run, timed or warm-up: --optimizer's, with the same
// AdamW options whatever its state format.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Config& cfg, Mlp& model, double eps) {
  const auto low_bit = amp::LowBitOptions().bf16_stochastic_round(cfg.bf16_stochastic_round);
  if (cfg.optimizer == "adamw")
    return std::make_unique<torch::optim::AdamW>(model->parameters(), optimizer_options(eps));
  if (cfg.optimizer == "adamw8bit")
    return std::make_unique<amp::AdamW8bit>(model->parameters(), optimizer_options(eps), low_bit);
  if (cfg.optimizer == "adamw4bit")
    return std::make_unique<amp::AdamW4bit>(model->parameters(), optimizer_options(eps), low_bit);
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
  if (cfg.optimizer == "adamwfp8")
    return std::make_unique<amp::AdamWFp8>(model->parameters(), optimizer_options(eps), low_bit);
#endif
  throw std::invalid_argument("amp: --optimizer=" + cfg.optimizer + " is not available in this build");
}
amp::TrainerOptions trainer_options() { return amp::TrainerOptions().step(amp::StepOptions().max_grad_norm(1.0)); }
torch::Tensor loss_of(Mlp& model, const Batch& batch) {
  return torch::cross_entropy_loss(model(batch.first), batch.second);
}

template <class P, class Device>
Row run_policy(const Config& cfg, const Task& task, torch::Device device) {
  using Trainer = amp::Trainer<P, Device>;
  using Region = typename Trainer::region_type;
  const bool cuda = device.is_cuda();
  Row row;
  row.name = amp::policy_traits<P>::name;
  row.scaled = amp::policy_traits<P>::uses_loss_scaling;
  row.eps = adam_eps(Region::param_dtype);

  // Batches in the policy's parameter dtype (True<bf16> trains on bf16 inputs).
  const auto in_dtype = Region::param_dtype;
  std::vector<Batch> batches;
  const int64_t n = task.train_x.size(0);
  for (int64_t i = 0; i + cfg.batch_size <= n; i += cfg.batch_size)
    batches.emplace_back(task.train_x.narrow(0, i, cfg.batch_size).to(device, in_dtype),
                         task.train_y.narrow(0, i, cfg.batch_size).to(device));
  const int64_t epochs = (cfg.steps + static_cast<int64_t>(batches.size()) - 1) / static_cast<int64_t>(batches.size());

  // Untimed warm-up on a throwaway model of the same shapes and policy: the
  // timed run below pays no first-call costs and still starts from the seed.
  if (cfg.warmup > 0) {
    Mlp model = make_model(cfg, device);
    auto optimizer = make_optimizer(cfg, model, row.eps);
    Trainer trainer(model, *optimizer, trainer_options().progress(false));  // the timed run says its optimizer path
    for (int64_t i = 0; i < cfg.warmup; ++i)
      trainer.step([&](Region&) { return loss_of(model, batches[static_cast<size_t>(i) % batches.size()]); });
    if (cuda) torch::cuda::synchronize();
  }

  torch::manual_seed(cfg.seed);  // same initial weights for every policy
  Mlp model = make_model(cfg, device);
  auto optimizer = make_optimizer(cfg, model, row.eps);
  Trainer trainer(model, *optimizer, trainer_options());

  if (cuda) torch::cuda::synchronize();
  reset_peak_memory(cuda);
  const auto t0 = std::chrono::steady_clock::now();
  row.history = trainer.fit(
      batches, [&](Region&, const Batch& batch) { return loss_of(model, batch); },
      amp::FitOptions().max_epochs(epochs).max_steps(cfg.steps).log_every(50));
  if (cuda) torch::cuda::synchronize();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  row.peak_mib = peak_memory_mib(cuda);
  row.steps_per_s = static_cast<double>(row.history.steps.size()) / secs;
  row.skipped = row.history.skipped();
  row.scale = trainer.scaler().get_scale();
  row.state_bytes_per_param = static_cast<double>(amp::optimizer_state_bytes(*optimizer)) /
                              static_cast<double>(amp::parameter_count(*optimizer));
  // Mean loss of the last 10 steps: less noisy than the last batch alone, and
  // non-finite if any of them is.
  const auto& h = row.history.steps;
  const size_t tail = std::min<size_t>(10, h.size());
  for (size_t i = h.size() - tail; i < h.size(); ++i) row.final_loss += h[i].loss / static_cast<double>(tail);
  row.diverged = !std::isfinite(row.final_loss);
  for (const auto& p : model->parameters())
    row.diverged = row.diverged || !torch::isfinite(p).all().template item<bool>();

  // In the policy's precision, as it would be deployed (Trainer::evaluate: its
  // region, no autograd, eval mode; a Float8<Delayed> policy's scales).
  row.accuracy = trainer.evaluate([&](Region&) {
    auto logits = model(task.test_x.to(device, in_dtype));
    return logits.argmax(1).eq(task.test_y.to(device)).to(torch::kFloat).mean().template item<double>();
  });
  return row;
}

// The speed baseline: 32-true, when it ran and did not diverge.
const Row* baseline(const std::vector<Row>& rows) {
  for (const auto& r : rows)
    if (r.name == "32-true" && !r.diverged && r.error.empty()) return &r;
  return nullptr;
}

// The optimizer in the table's and the plot's title, where it is not the default AdamW.
std::string optimizer_note(const Config& cfg) {
  if (cfg.optimizer == "adamw") return "";
  return "; " + optimizer_name(cfg) + (cfg.bf16_stochastic_round ? " with bf16 stochastic rounding" : "");
}

void print_table(const std::vector<Row>& rows, const Config& cfg) {
  const Row* base = baseline(rows);
  std::cout << "\nprecision sweep on " << cfg.device << " (LibTorch " << TORCH_VERSION_MAJOR << "."
            << TORCH_VERSION_MINOR << "; MLP " << Task::kIn << "-" << cfg.hidden << "-" << cfg.hidden << "-"
            << Task::kClasses << ", batch " << cfg.batch_size << optimizer_note(cfg) << ")\n";
  std::cout << std::left << std::setw(17) << "precision" << std::right << std::setw(11) << "final loss" << std::setw(10)
            << "accuracy" << std::setw(9) << "steps/s" << std::setw(10) << "speedup" << std::setw(13) << "peak memory"
            << std::setw(9) << "skipped" << std::setw(12) << "loss scale" << std::setw(15) << "state B/param"
            << "\n";
  std::cout << std::string(106, '-') << "\n";
  std::ostringstream notes;
  bool any_diverged = false;
  for (const auto& r : rows) {
    if (!r.error.empty()) {
      std::cout << std::left << std::setw(17) << r.name << std::right << std::setw(11) << "failed" << std::setw(10)
                << "-" << std::setw(9) << "-" << std::setw(10) << "-" << std::setw(13) << "-" << std::setw(9) << "-"
                << std::setw(12) << "-" << std::setw(15) << "-"
                << "\n";
      notes << "(failed: " << r.name << ": " << r.error << ")\n";
      continue;
    }
    any_diverged = any_diverged || r.diverged;
    if (r.eps != 1e-8)
      notes << "(" << r.name << ": " << optimizer_name(cfg) << " eps " << r.eps
            << ", since torch's 1e-8 is 0 in fp16)\n";
    std::ostringstream loss, acc, speed, mem, scale;
    if (r.diverged) {
      loss << "diverged";
      acc << "-";
      speed << "-";
    } else {
      loss << std::fixed << std::setprecision(4) << r.final_loss;
      acc << std::fixed << std::setprecision(1) << 100.0 * r.accuracy << "%";
      if (base)
        speed << std::fixed << std::setprecision(2) << r.steps_per_s / base->steps_per_s << "x";
      else
        speed << "n/a";
    }
    mem << std::fixed << std::setprecision(0) << r.peak_mib << " MiB";
    if (r.scaled)
      scale << r.scale;
    else
      scale << "-";
    std::cout << std::left << std::setw(17) << r.name << std::right << std::setw(11) << loss.str() << std::setw(10)
              << acc.str() << std::setw(9) << std::fixed << std::setprecision(2) << r.steps_per_s << std::setw(10)
              << speed.str() << std::setw(13) << mem.str() << std::setw(9) << r.skipped << std::setw(12) << scale.str()
              << std::setw(15) << std::fixed << std::setprecision(2) << r.state_bytes_per_param << "\n";
  }
  std::cout << "(steps/s: " << cfg.steps << " timed steps after " << cfg.warmup << " untimed warm-up steps"
            << (cfg.device == "cuda" ? ", CUDA synchronized around the timing" : "") << "; speedup: "
            << (base ? "steps/s relative to 32-true in this run" : "n/a, 32-true did not run or diverged")
            << "; peak memory: "
            << (cfg.device == "cuda" ? "CUDA allocator peak, the training batches on the device included"
                                     : "process peak RSS during the run")
            << "; state B/param: bytes of " << optimizer_name(cfg)
            << "'s state tensors per parameter after training)\n";
  if (any_diverged)
    std::cout << "(diverged: NaN/inf in the last 10 losses or in the weights; its loss, accuracy and speedup mean "
                 "nothing, and it is never the speed baseline)\n";
  std::cout << notes.str();
  if (!cfg.not_run.empty()) {
    std::cout << "(not run:";
    for (const auto& n : cfg.not_run) std::cout << " " << n;
    std::cout << ": the block-scaled recipes run emulated, each GEMM operand quantized and dequantized, several to "
                 "tens of bf16 steps a step; --block-scaled adds them, --precision=NAME runs one)\n";
  }
}

void write_csv(const std::vector<Row>& rows, const std::string& path) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("amp: cannot write --csv file " + path);
  out << "precision,step,epoch,loss,scale,skipped,seconds\n";
  for (const auto& r : rows)
    for (const auto& s : r.history.steps)
      out << r.name << "," << s.step << "," << s.epoch << "," << s.loss << "," << s.scale << "," << s.skipped << ","
          << s.seconds << "\n";
  std::cout << "per-step metrics: " << path << "\n";
}

// out/sweep.csv -> out/sweep.summary.csv (what = "summary"), out/sweep.ladder.csv (what = "ladder")
std::string sibling_path(const std::string& csv, const std::string& what) {
  const std::string ext = ".csv";
  const bool has_ext = csv.size() > ext.size() && csv.compare(csv.size() - ext.size(), ext.size(), ext) == 0;
  return (has_ext ? csv.substr(0, csv.size() - ext.size()) : csv) + "." + what + ".csv";
}

// One line per policy; speedup is empty where there is no baseline or the run diverged.
void write_summary(const std::vector<Row>& rows, const std::string& path) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("amp: cannot write summary file " + path);
  const Row* base = baseline(rows);
  out << "precision,final_loss,accuracy,steps_per_s,speedup,peak_mib,skipped,scale,diverged,state_bytes_per_param\n";
  for (const auto& r : rows) {
    out << r.name << "," << r.final_loss << "," << r.accuracy << "," << r.steps_per_s << ",";
    if (base && !r.diverged) out << r.steps_per_s / base->steps_per_s;
    out << "," << r.peak_mib << "," << r.skipped << "," << r.scale << "," << (r.diverged ? 1 : 0) << ","
        << r.state_bytes_per_param << "\n";
  }
  std::cout << "per-policy summary: " << path << "\n";
}

// The memory ladder: the same task, a residual MLP with blocks
// (demo::ResidualMlp), trained under each configuration, with every byte of
// its training state counted per parameter: the parameters and gradients
// (their tensors), the optimizer state (amp::optimizer_state_bytes), and
// what a training step's forward keeps for backward (amp::ActivationMeter),
// split into the bytes per sample and the bytes that do not grow with the
// batch (autocast's bf16 copies of the weights, the loss).
struct LadderRow {
  std::string name, policy, optimizer;  // "bf16-mixed AdamW8bit +ckpt", "bf16-mixed", "AdamW8bit"
  bool checkpointed = false;
  int64_t parameters = 0, batch = 0;
  int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0;
  int64_t fixed_bytes = 0;                  // forward bytes kept whatever the batch
  int64_t activation_bytes_per_sample = 0;  // forward bytes kept per sample
  double steps_per_s = 0, final_loss = 0;
  std::string error;  // the run threw: shown as failed, left out of the CSV and the plot

  double per_param(int64_t bytes) const { return static_cast<double>(bytes) / static_cast<double>(parameters); }
  int64_t activation_bytes() const { return activation_bytes_per_sample * batch; }
  double total_per_param() const {
    return per_param(param_bytes + grad_bytes + optimizer_bytes + fixed_bytes + activation_bytes());
  }
};

template <class Optimizer>
std::unique_ptr<torch::optim::Optimizer> make_ladder_optimizer(demo::ResidualMlp& model, bool stochastic_round) {
  const auto options = torch::optim::AdamWOptions(1e-3).weight_decay(0.0);
  if constexpr (std::is_same_v<Optimizer, torch::optim::AdamW>) {
    (void)stochastic_round;
    return std::make_unique<Optimizer>(model->parameters(), options);
  } else {
    return std::make_unique<Optimizer>(model->parameters(), options,
                                       amp::LowBitOptions().bf16_stochastic_round(stochastic_round));
  }
}

template <class P, class Device, class Optimizer>
LadderRow run_ladder(const Config& cfg, const Task& task, torch::Device device, const std::string& optimizer,
                     bool stochastic_round, bool checkpointed) {
  using Trainer = amp::Trainer<P, Device>;
  using Region = typename Trainer::region_type;
  LadderRow row;
  row.policy = amp::policy_traits<P>::name;
  row.optimizer = optimizer + (stochastic_round ? "+SR" : "");
  row.checkpointed = checkpointed;
  row.name = row.policy + " " + row.optimizer + (checkpointed ? " +ckpt" : "");
  row.batch = cfg.batch_size;

  const auto in_dtype = Region::param_dtype;
  std::vector<Batch> batches;
  const int64_t n = task.train_x.size(0);
  for (int64_t i = 0; i + cfg.batch_size <= n; i += cfg.batch_size)
    batches.emplace_back(task.train_x.narrow(0, i, cfg.batch_size).to(device, in_dtype),
                         task.train_y.narrow(0, i, cfg.batch_size).to(device));
  auto make_model = [&] {
    demo::ResidualMlp model(cfg.ffn);
    model->checkpointed = checkpointed;
    model->to(device);
    return model;
  };
  const auto options = amp::TrainerOptions().progress(false).step(amp::StepOptions().max_grad_norm(1.0));
  auto loss_of = [](demo::ResidualMlp& model, const Batch& b) {
    return torch::cross_entropy_loss(model(b.first), b.second);
  };

  // Untimed, on a throwaway model: two training steps, at batch B and 2B,
  // each forward under a meter. Kept bytes = fixed + B * per sample, so the
  // two give both (the graph is the same at every batch size).
  {
    demo::ResidualMlp model = make_model();
    auto opt = make_ladder_optimizer<Optimizer>(model, stochastic_round);
    Trainer trainer(model, *opt, options);
    const Batch& a = batches[0];
    const Batch& b = batches[1 % batches.size()];
    const Batch twice(torch::cat({a.first, b.first}), torch::cat({a.second, b.second}));
    int64_t kept[2] = {0, 0};
    for (int i = 0; i < 2; ++i)
      trainer.step([&](Region&) {
        amp::ActivationMeter meter(device);
        auto loss = loss_of(model, i == 0 ? a : twice);
        kept[i] = meter.bytes();
        return loss;
      });
    row.activation_bytes_per_sample = (kept[1] - kept[0]) / cfg.batch_size;
    row.fixed_bytes = kept[0] - row.activation_bytes_per_sample * cfg.batch_size;
  }

  torch::manual_seed(cfg.seed);  // the same initial weights for every configuration
  demo::ResidualMlp model = make_model();
  auto opt = make_ladder_optimizer<Optimizer>(model, stochastic_round);
  Trainer trainer(model, *opt, options);
  std::vector<torch::Tensor> losses;
  if (device.is_cuda()) torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < cfg.ladder_steps; ++s)
    losses.push_back(
        trainer.step([&](Region&) { return loss_of(model, batches[static_cast<size_t>(s) % batches.size()]); }).loss);
  if (device.is_cuda()) torch::cuda::synchronize();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  row.steps_per_s = static_cast<double>(cfg.ladder_steps) / secs;
  const size_t tail = std::min<size_t>(10, losses.size());
  for (size_t i = losses.size() - tail; i < losses.size(); ++i)
    row.final_loss += losses[i].item<double>() / static_cast<double>(tail);

  const auto params = model->parameters();
  row.parameters = amp::parameter_count(*opt);
  row.param_bytes = demo::tensor_bytes(params);
  row.grad_bytes = demo::gradient_bytes(params);
  row.optimizer_bytes = amp::optimizer_state_bytes(*opt);
  return row;
}

template <class P, class Device, class Optimizer>
LadderRow try_ladder(const Config& cfg, const Task& task, torch::Device device, const std::string& optimizer,
                     bool stochastic_round, bool checkpointed) {
  try {
    return run_ladder<P, Device, Optimizer>(cfg, task, device, optimizer, stochastic_round, checkpointed);
  } catch (const std::exception& e) {
    LadderRow row;
    row.name = std::string(amp::policy_traits<P>::name) + " " + optimizer + (stochastic_round ? "+SR" : "") +
               (checkpointed ? " +ckpt" : "");
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    row.error = c10_error ? c10_error->what_without_backtrace() : e.what();
    std::cerr << row.name << " failed: " << row.error << "\n";
    return row;
  }
}

// The ladder's configurations, each followed by itself with checkpointed blocks.
template <class Device>
std::vector<LadderRow> ladder(const Config& cfg, const Task& task, torch::Device device) {
  using F32 = amp::True<amp::fp32>;
  using BF16Mixed = amp::Mixed<amp::bf16, amp::NoScaler>;
  using BF16True = amp::True<amp::bf16>;
  std::vector<LadderRow> rows;
  auto both = [&](auto run) {
    for (bool checkpointed : {false, true}) rows.push_back(run(checkpointed));
  };
  std::cerr << "== memory ladder\n";
  both([&](bool c) { return try_ladder<F32, Device, torch::optim::AdamW>(cfg, task, device, "AdamW", false, c); });
  both(
      [&](bool c) { return try_ladder<BF16Mixed, Device, torch::optim::AdamW>(cfg, task, device, "AdamW", false, c); });
  both([&](bool c) { return try_ladder<BF16Mixed, Device, amp::AdamW8bit>(cfg, task, device, "AdamW8bit", false, c); });
  both([&](bool c) { return try_ladder<BF16Mixed, Device, amp::AdamW4bit>(cfg, task, device, "AdamW4bit", false, c); });
  both([&](bool c) { return try_ladder<BF16True, Device, amp::AdamW8bit>(cfg, task, device, "AdamW8bit", true, c); });
  return rows;
}

void print_ladder(const std::vector<LadderRow>& rows, const Config& cfg) {
  int64_t parameters = 0;
  for (const auto& r : rows) parameters = std::max(parameters, r.parameters);
  std::cout << "\nmemory ladder on " << cfg.device << ": training-state bytes per parameter, counted exactly (residual "
            << "MLP " << Task::kIn << "-[" << cfg.ffn << "-" << Task::kIn << "]x" << demo::ResidualMlpImpl::kBlocks
            << "-" << Task::kClasses << ", no biases, " << parameters << " parameters; batch " << cfg.batch_size << "; "
            << cfg.ladder_steps << " timed steps)\n";
  std::cout << std::left << std::setw(30) << "configuration" << std::right << std::setw(8) << "params" << std::setw(8)
            << "grads" << std::setw(11) << "optimizer" << std::setw(8) << "fixed" << std::setw(13) << "activations"
            << std::setw(9) << "total" << std::setw(14) << "act B/sample" << std::setw(9) << "steps/s" << std::setw(12)
            << "final loss"
            << "\n";
  std::cout << std::string(122, '-') << "\n";
  for (const auto& r : rows) {
    std::cout << std::left << std::setw(30) << r.name << std::right;
    if (!r.error.empty()) {
      std::cout << std::setw(8) << "failed"
                << "\n";
      continue;
    }
    std::cout << std::fixed << std::setprecision(3) << std::setw(8) << r.per_param(r.param_bytes) << std::setw(8)
              << r.per_param(r.grad_bytes) << std::setw(11) << r.per_param(r.optimizer_bytes) << std::setw(8)
              << r.per_param(r.fixed_bytes) << std::setw(13) << r.per_param(r.activation_bytes()) << std::setw(9)
              << r.total_per_param() << std::setw(14) << r.activation_bytes_per_sample << std::setprecision(2)
              << std::setw(9) << r.steps_per_s << std::setprecision(4) << std::setw(12) << r.final_loss << "\n";
  }
  std::cout << "(bytes per parameter: params and grads are the tensors' bytes; optimizer: amp::optimizer_state_bytes; "
               "fixed: what a step's forward keeps whatever the batch (autocast's bf16 weight copies, the loss); "
               "activations: what it keeps per sample (amp::ActivationMeter, act B/sample) times the batch of "
            << cfg.batch_size
            << "; SR: bf16 stochastic rounding; +ckpt: amp::checkpoint around each block. The formulas: "
               "docs/maintainers.md#the-demo)\n";
  for (const auto& r : rows)
    if (!r.error.empty()) std::cout << "(failed: " << r.name << ": " << r.error << ")\n";
}

// out/sweep.csv -> out/sweep.ladder.csv: one line per configuration, the bytes
// (integers) and the same per parameter (what the plot stacks).
void write_ladder(const std::vector<LadderRow>& rows, const std::string& path) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("amp: cannot write ladder file " + path);
  out << "configuration,policy,optimizer,checkpointed,parameters,batch,param_bytes,grad_bytes,optimizer_bytes,"
         "fixed_bytes,activation_bytes_per_sample,params_bpp,grads_bpp,optimizer_bpp,fixed_bpp,activations_bpp,"
         "total_bpp,steps_per_s,final_loss\n";
  out << std::setprecision(10);
  for (const auto& r : rows)
    out << r.name << "," << r.policy << "," << r.optimizer << "," << (r.checkpointed ? 1 : 0) << "," << r.parameters
        << "," << r.batch << "," << r.param_bytes << "," << r.grad_bytes << "," << r.optimizer_bytes << ","
        << r.fixed_bytes << "," << r.activation_bytes_per_sample << "," << r.per_param(r.param_bytes) << ","
        << r.per_param(r.grad_bytes) << "," << r.per_param(r.optimizer_bytes) << "," << r.per_param(r.fixed_bytes)
        << "," << r.per_param(r.activation_bytes()) << "," << r.total_per_param() << "," << r.steps_per_s << ","
        << r.final_loss << "\n";
  std::cout << "memory ladder: " << path << "\n";
}

// Renders the CSVs with gnuplot: (a) loss per step and (b) loss per
// cumulative wall-clock second of the timed steps, both log scale; (c)
// steps/s per policy; with the ladder, (d) steps/s against training-state
// bytes per parameter for every ladder configuration and (e) those bytes
// stacked (parameters, gradients, optimizer state, fixed, activations),
// else (d) the process's peak memory per policy; (f) the loss scale, when a
// scaled policy ran.
void write_plot(const std::vector<Row>& rows, const std::vector<LadderRow>& ladder_rows, const Config& cfg,
                const std::string& summary, const std::string& ladder_csv) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::cerr << "gnuplot not found (apt-get install gnuplot-nox); no plot written\n";
    return;
  }
  bool any_scaled = false;
  for (const auto& r : rows) any_scaled = any_scaled || r.scaled;
  const bool with_ladder = !ladder_rows.empty();
  const std::string& csv = cfg.csv;
  const std::string& png = cfg.plot;
  const std::string script_path = png + ".gp";
  std::ofstream gp(script_path);
  // Panels in rows under the title band; the loss-scale row is the lowest.
  std::vector<double> heights = with_ladder ? std::vector<double>{0.34, 0.30, 0.32} : std::vector<double>{0.48, 0.48};
  if (any_scaled) {
    for (auto& h : heights) h *= with_ladder ? 0.82 : 0.74;
    heights.push_back(0.96 - std::accumulate(heights.begin(), heights.end(), 0.0));
  }
  const int height = (with_ladder ? 1300 : 820) + (any_scaled ? 330 : 0);
  gp << "set datafile separator ','\nset key autotitle columnhead\n"
     << "set terminal pngcairo size 1200," << height << " noenhanced font ',10'\n"
     << "set output '" << png << "'\n"
     << "set multiplot title 'amp precision sweep on " << cfg.device << ": MLP " << Task::kIn << "-" << cfg.hidden
     << "-" << cfg.hidden << "-" << Task::kClasses << ", batch " << cfg.batch_size << optimizer_note(cfg) << ", "
     << cfg.steps << " timed steps after " << cfg.warmup << " warm-up steps per policy"
     << (with_ladder ? "; memory ladder: residual MLP, " + std::to_string(ladder_rows.front().parameters) +
                           " parameters, " + std::to_string(cfg.ladder_steps) + " steps each"
                     : "")
     << "'\n"
     << "set grid\n";
  auto place = [&](double x, size_t row, double w) {
    double y = 0.96;
    for (size_t i = 0; i <= row; ++i) y -= heights[i];
    gp << "set origin " << x << "," << y << "\nset size " << w << "," << heights[row] << "\n";
  };
  auto title_of = [](const Row& r) { return r.name + (r.diverged ? " (diverged)" : ""); };
  auto style_of = [](size_t i, const Row& r) {
    return " lt " + std::to_string(i + 1) + (r.diverged ? " dt 2" : "") + " lw 1.5";
  };
  auto is = [&](const Row& r) { return "strcol(1) eq '" + r.name + "'"; };

  // (a) and (b): the loss curves, against the step and against the clock.
  gp << "set logscale y\nset autoscale yfix\nset key top right opaque box\nset ylabel 'training loss (log)'\nset ytics "
        "(";
  for (int e = -4; e <= 2; ++e)  // several tics per decade: a short loss range still gets some
    for (double m : {1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.0})
      gp << (e == -4 && m == 1.0 ? "" : ", ") << m * std::pow(10.0, e);
  gp << ")\n";
  place(0, 0, 0.5);
  gp << "set title '(a) loss per optimizer step: what a step learns'\nset xlabel 'optimizer step'\nplot ";
  for (size_t i = 0; i < rows.size(); ++i)
    gp << (i ? ", " : "") << "'" << csv << "' using 2:(" << is(rows[i]) << " ? $4 : 1/0) with lines"
       << style_of(i, rows[i]) << " title '" << title_of(rows[i]) << "'";
  gp << "\n";
  place(0.5, 0, 0.5);
  for (size_t i = 0; i < rows.size(); ++i) gp << "t" << i << " = 0\n";  // cumulative seconds per policy
  gp << "set title '(b) loss per wall-clock second (faster policies get there sooner)'\n"
        "set xlabel 'seconds (cumulative, timed steps only)'\nplot ";
  for (size_t i = 0; i < rows.size(); ++i)
    gp << (i ? ", " : "") << "'" << csv << "' using (" << is(rows[i]) << " ? (t" << i << " = t" << i
       << " + $7) : 1/0):4 with lines" << style_of(i, rows[i]) << " title '" << title_of(rows[i]) << "'";
  gp << "\n";

  // (c) (and (d) without the ladder): one bar per policy, coloured like its curve, labelled with its value.
  gp << "unset logscale y\nset ytics autofreq\nset autoscale y\nset yrange [0:*]\nset offsets 0, 0, graph 0.2, "
        "0\nunset key\n"
        "set style fill solid 0.6 border -1\nset xlabel ''\nset xrange [-0.6:"
     << rows.size() - 0.4
     << "]\n"
        "set grid noxtics\n"
     << (rows.size() > 4 ? "set xtics rotate by 25 right\n" : "");
  const std::string xtic = "xtic($9 > 0 ? strcol(1).' (diverged)' : strcol(1))";
  place(0, 1, 0.5);
  gp << "set title '(c) throughput of each policy" << (baseline(rows) ? " (under each value: speedup vs 32-true)" : "")
     << "'\n"
     << "set ylabel 'steps/s'\n"
     << "plot '" << summary << "' using 0:4:(0.6):($0 + 1):" << xtic << " with boxes lc variable, "
     << "'' using 0:4:(valid(5) ? sprintf(\"%.3g\\n%.2fx\", $4, $5) : sprintf('%.3g', $4)) with labels "
        "offset 0,"
     << (baseline(rows) ? "1.8" : "0.8") << "\n";
  if (!with_ladder) {
    place(0.5, 1, 0.5);
    gp << "set title '(d) peak memory ("
       << (cfg.device == "cuda" ? "CUDA allocator, training batches included"
                                : "process peak RSS: allocator and OS, not precision")
       << ")'\n"
       << "set ylabel 'MiB'\n"
       << "plot '" << summary << "' using 0:6:(0.6):($0 + 1):" << xtic << " with boxes lc variable, "
       << "'' using 0:6:(sprintf('%.0f', $6)) with labels offset 0,0.8\n";
  } else {
    // (d): steps/s against total bytes per parameter; each configuration and
    // its checkpointed twin joined by a line (same colour).
    place(0.5, 1, 0.5);
    gp << "unset offsets\nset autoscale\nset xrange [0:*]\nset yrange [0:*]\nset offsets graph 0.02, graph 0.25, "
          "graph 0.5, 0\nset grid xtics ytics\nset xtics autofreq norotate\n"
          "set key top left horizontal maxrows 3 opaque box font ',8'\n"
          "set title '(d) speed against memory: every ladder configuration (filled: blocks checkpointed)'\n"
          "set xlabel 'training-state bytes per parameter (total of (e))'\nset ylabel 'steps/s'\nplot ";
    bool first = true;
    for (size_t i = 0, k = 0; i < ladder_rows.size(); ++i) {
      if (ladder_rows[i].checkpointed) continue;
      const std::string label = ladder_rows[i].policy + " " + ladder_rows[i].optimizer;
      size_t twin = i;  // the row of the same configuration with checkpointed blocks
      for (size_t j = 0; j < ladder_rows.size(); ++j)
        if (ladder_rows[j].checkpointed && ladder_rows[j].policy == ladder_rows[i].policy &&
            ladder_rows[j].optimizer == ladder_rows[i].optimizer)
          twin = j;
      const std::string lt = " lt " + std::to_string(++k);
      gp << (first ? "" : ", ") << "'" << ladder_csv << "' every ::" << i << "::" << i
         << " using 17:18 with points pt 6 ps 1.6" << lt << " title '" << label << "'";
      if (twin != i)
        gp << ", '" << ladder_csv << "' every ::" << twin << "::" << twin << " using 17:18 with points pt 7 ps 1.6"
           << lt << " notitle, '" << ladder_csv << "' every " << (std::max(i, twin) - std::min(i, twin))
           << "::" << std::min(i, twin) << "::" << std::max(i, twin) << " using 17:18 with lines dt 3" << lt
           << " notitle";
      first = false;
    }
    gp << "\n";
    // (e): the bytes per parameter, stacked.
    place(0, 2, 1.0);
    gp << "unset offsets\nset autoscale\nset yrange [0:*]\nset offsets 0, 0, graph 0.12, 0\nset grid noxtics ytics\n"
          "set style data histograms\nset style histogram rowstacked\nset style fill solid 0.75 border -1\n"
          "set boxwidth 0.7\nset xtics rotate by 20 right font ',9'\nset key top right horizontal maxrows 2 opaque box "
          "font ',9'\n"
          "set xlabel ''\nset ylabel 'bytes per parameter'\n"
          "set title '(e) training-state bytes per parameter, counted exactly (activations: amp::ActivationMeter, "
          "at batch "
       << cfg.batch_size << ")'\n"
       << "plot '" << ladder_csv << "' using 12:xtic(1) title 'parameters', '' using 13 title 'gradients', "
       << "'' using 14 title 'optimizer state', '' using 15 title 'fixed: autocast weight copies, loss', "
       << "'' using 16 title 'activations kept for backward', "
       << "'' using 0:17:(sprintf('%.2f', $17)) with labels offset 0,0.7 notitle\n";
    gp << "unset style data\nset style data lines\n";
  }

  // (f): the loss scale of scaled policies.
  if (any_scaled) {
    gp << "unset offsets\nset autoscale\nset grid xtics ytics\nset xtics autofreq norotate font ',10'\n"
          "set logscale y 2\nset key top right vertical maxrows auto opaque box font ',10'\n"
          "set xlabel 'optimizer step'\nset ylabel 'loss scale "
          "(log2)'\n";
    place(0, heights.size() - 1, 1.0);
    gp << "set title '(" << (with_ladder ? "f" : "e")
       << ") loss scale (scaled policies; each drop is a skipped step)'\nplot ";
    bool first = true;
    for (size_t i = 0; i < rows.size(); ++i)
      if (rows[i].scaled) {
        gp << (first ? "" : ", ") << "'" << csv << "' using 2:(" << is(rows[i]) << " ? $5 : 1/0) with steps"
           << style_of(i, rows[i]) << " title '" << title_of(rows[i]) << "'";
        first = false;
      }
    gp << "\n";
  }
  gp << "unset multiplot\n";
  gp.close();
  // pngcairo is in gnuplot-nox's build; fall back to the plain png terminal.
  std::string cmd = "gnuplot '" + script_path + "' 2>/dev/null";
  if (std::system(cmd.c_str()) != 0) {
    std::string fallback = "sed -i 's/pngcairo/png/' '" + script_path + "' && gnuplot '" + script_path + "'";
    if (std::system(fallback.c_str()) != 0) {
      std::cerr << "gnuplot failed; script left at " << script_path << "\n";
      return;
    }
  }
  std::cout << "plot: " << png << "\n";
}
// A policy that throws becomes a failed row; the others still run.
template <class P, class Device>
Row try_policy(const Config& cfg, const Task& task, torch::Device device) {
  try {
    return run_policy<P, Device>(cfg, task, device);
  } catch (const std::exception& e) {
    Row row;
    row.name = amp::policy_traits<P>::name;
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    row.error = c10_error ? c10_error->what_without_backtrace() : e.what();
    std::cerr << row.name << " failed: " << row.error << "\n";
    return row;
  }
}

// MXFP8 and NVFP4 (amp/float8/block_scaled.h): emulated on every device.
template <class P>
constexpr bool is_block_scaled() {
  if constexpr (amp::detail::is_float8_v<P>)
    return amp::detail::is_block_scaled_recipe_v<typename amp::policy_traits<P>::recipe_type>;
  else
    return false;
}

template <class Device>
std::vector<Row> sweep(Config& cfg, const Task& task, torch::Device device) {
  std::vector<Row> rows;
  if (cfg.precision.empty()) {
    amp::for_each_policy(amp::supported_policies<Device>, [&](auto p) {
      using P = typename decltype(p)::type;
      if (is_block_scaled<P>() && !cfg.block_scaled) {
        std::cerr << "== " << amp::policy_traits<P>::name << " skipped: emulated; --block-scaled adds it\n";
        cfg.not_run.push_back(amp::policy_traits<P>::name);
        return;
      }
      if (cfg.optimizer != "adamw" && std::is_same_v<typename amp::policy_traits<P>::param_type, amp::fp64>) {
        std::cerr << "== " << amp::policy_traits<P>::name << " skipped: --optimizer=" << cfg.optimizer
                  << " steps fp32, bf16 and fp16 parameters\n";
        return;
      }
      std::cerr << "== " << amp::policy_traits<P>::name << "\n";
      rows.push_back(try_policy<P, Device>(cfg, task, device));
    });
  } else {
    rows.push_back(amp::dispatch_precision<Device>(
        cfg.precision, [&](auto p) { return try_policy<typename decltype(p)::type, Device>(cfg, task, device); }));
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  cfg.device = torch::cuda::is_available() ? "cuda" : "cpu";
  CLI::App app{"amp precision sweep: one model, every precision policy, one table"};
  std::string valid;
  amp::for_each_policy([&](auto p) {
    valid += std::string(valid.empty() ? "" : ", ") + amp::policy_traits<typename decltype(p)::type>::name;
  });
  app.add_option("--precision", cfg.precision,
                 "run one policy by its precision string (" + valid + "; legacy 64, 32, 16, bf16)");
  app.add_option("--device", cfg.device, "cpu or cuda (default: cuda when available)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--steps", cfg.steps, "timed optimizer steps per policy")->check(CLI::PositiveNumber);
  app.add_option("--warmup", cfg.warmup, "untimed warm-up steps per policy, on a throwaway model (default 5)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  auto* batch_opt = app.add_option("--batch-size", cfg.batch_size, "batch size (default: 256 on CPU, 4096 on CUDA)")
                        ->check(CLI::PositiveNumber);
  auto* hidden_opt =
      app.add_option("--hidden", cfg.hidden, "hidden width of the MLP (default: 1024 on CPU, 4096 on CUDA)")
          ->check(CLI::PositiveNumber);
  app.add_option("--seed", cfg.seed, "seed of the data and of the initial weights");
  app.add_option(
      "--csv", cfg.csv,
      "write per-step metrics (precision,step,epoch,loss,scale,skipped,seconds) here, and per-policy results "
      "next to it (sweep.csv -> sweep.summary.csv)");
  app.add_option("--plot", cfg.plot, "render loss, throughput, memory and loss-scale panels to this PNG with gnuplot");
  app.add_option("--optimizer", cfg.optimizer,
                 "optimizer of every run: adamw (default, torch::optim::AdamW), or amp's AdamW with 8-bit, 4-bit "
                 "or fp8 states: adamw8bit, adamw4bit, adamwfp8 (LibTorch >= 2.1)")
      ->check(CLI::IsMember({"adamw", "adamw8bit", "adamw4bit", "adamwfp8"}));
  app.add_flag("--bf16-stochastic-round", cfg.bf16_stochastic_round,
               "low-bit optimizers: round the update to bf16 parameters stochastically (bf16-true)");
  app.add_flag("--block-scaled", cfg.block_scaled,
               "sweep the block-scaled Float8 recipes too (mxfp8-rceil, nvfp4; LibTorch >= 2.1): emulated, each "
               "step costs several (MXFP8) to tens (NVFP4) of bf16 steps, so the default sweep leaves them out");
  app.add_flag("--ladder,!--no-ladder", cfg.ladder,
               "after the sweep, the memory ladder: exact training-state bytes per parameter of 10 configurations "
               "(default on; left out with --precision)");
  app.add_option("--ladder-steps", cfg.ladder_steps, "timed steps per ladder configuration (default 40)")
      ->check(CLI::PositiveNumber);
  app.add_option("--ffn", cfg.ffn, "block width of the ladder's residual MLP (default 1024)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (cfg.optimizer == "adamwfp8" && !AMP_DETAIL_HAS_FLOAT8_DTYPE) {
    std::cerr << "amp: --optimizer=adamwfp8 needs fp8 dtypes (float8_e4m3fn, LibTorch 2.1 or newer), but this is "
                 "LibTorch "
              << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR
              << "; use --optimizer=adamw8bit (the same state bytes per parameter)\n";
    return 2;
  }
  if (cfg.bf16_stochastic_round && cfg.optimizer == "adamw") {
    std::cerr << "amp: --bf16-stochastic-round is an option of the low-bit optimizers (--optimizer=adamw8bit, "
                 "adamw4bit or adamwfp8); torch::optim::AdamW has none\n";
    return 2;
  }
  // On CUDA a model big enough for tensor cores to show (on an H100 a batch of
  // 1024 is still bound by launches and per-step syncs), unless the user chose.
  if (cfg.device == "cuda") {
    if (batch_opt->count() == 0) cfg.batch_size = 4096;
    if (hidden_opt->count() == 0) cfg.hidden = 4096;
  }

  try {
    if (!cfg.plot.empty() && cfg.csv.empty()) cfg.csv = cfg.plot + ".csv";
    // Enough data that each sample is seen once or a few times: the accuracy
    // measures learning, not memorisation (capped to keep the demo's memory
    // small: 38400 samples by default on CPU, 262144 on CUDA).
    const int64_t n_train = std::max(cfg.batch_size, std::min<int64_t>(cfg.batch_size * cfg.steps, 262144));
    Task task(n_train, 2048, static_cast<uint64_t>(cfg.seed));
    std::vector<Row> rows;
    std::vector<LadderRow> ladder_rows;
    const bool with_ladder = cfg.ladder && cfg.precision.empty();
    if (cfg.device == "cuda") {
      if (!torch::cuda::is_available()) {
        std::cerr << "amp: --device=cuda but LibTorch sees no CUDA device; use --device=cpu\n";
        return 2;
      }
      rows = sweep<amp::CUDA>(cfg, task, torch::Device(torch::kCUDA));
      if (with_ladder) ladder_rows = ladder<amp::CUDA>(cfg, task, torch::Device(torch::kCUDA));
    } else {
      rows = sweep<amp::CPU>(cfg, task, torch::Device(torch::kCPU));
      if (with_ladder) ladder_rows = ladder<amp::CPU>(cfg, task, torch::Device(torch::kCPU));
    }
    print_table(rows, cfg);
    if (with_ladder) print_ladder(ladder_rows, cfg);
    std::vector<Row> ran;
    for (auto& r : rows)
      if (r.error.empty()) ran.push_back(std::move(r));
    std::vector<LadderRow> ladder_ran;
    for (auto& r : ladder_rows)
      if (r.error.empty()) ladder_ran.push_back(std::move(r));
    if (!cfg.csv.empty()) {
      write_csv(ran, cfg.csv);
      write_summary(ran, sibling_path(cfg.csv, "summary"));
      if (with_ladder) write_ladder(ladder_ran, sibling_path(cfg.csv, "ladder"));
    }
    if (!cfg.plot.empty() && !ran.empty())
      write_plot(ran, ladder_ran, cfg, sibling_path(cfg.csv, "summary"), sibling_path(cfg.csv, "ladder"));
    // A run failed: the tables say which and why.
    if (ran.size() != rows.size() || ladder_ran.size() != ladder_rows.size()) return 1;
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  return 0;
}
