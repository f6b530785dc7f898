// examples/precision_sweep.cc: the main job (`tools/dev demo`).
//
//   precision_sweep                         # every policy the device supports
//   precision_sweep --precision=bf16-mixed  # one, by its Lightning string
//   precision_sweep --device=cpu --steps=300 --csv=out/sweep.csv --plot=out/sweep.png
//
// Trains the same MLP on an embedded synthetic classification task (a fixed
// random nonlinear teacher; no download) under every policy of
// amp::supported_policies<Device> — the compile-time Hana list, so a policy
// added to the library adds a row — and prints a comparison table. Per-step
// metrics go to a CSV; gnuplot renders the loss curves (and the loss scale of
// scaled policies) to a PNG.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <amp/amp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
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
  int64_t batch_size = 256;
  int64_t seed = 42;
  int64_t hidden = 1024;
  std::string csv, plot;
};

// The synthetic task: inputs x ~ N(0, 1) in 256 dims, labels = argmax of a
// random 2-layer tanh teacher over 16 classes. Learnable, but only with enough
// matmul work that the compute dtype matters.
struct Task {
  static constexpr int64_t kIn = 256, kClasses = 16;
  torch::Tensor train_x, train_y, test_x, test_y;
  Task(int64_t n_train, int64_t n_test, uint64_t seed) {
    torch::manual_seed(seed);
    auto w1 = torch::randn({kIn, 128}) / std::sqrt(double(kIn));
    auto w2 = torch::randn({128, kClasses}) / std::sqrt(128.0);
    auto label = [&](const torch::Tensor& x) { return torch::tanh(x.matmul(w1)).matmul(w2).argmax(1); };
    train_x = torch::randn({n_train, kIn});
    train_y = label(train_x);
    test_x = torch::randn({n_test, kIn});
    test_y = label(test_x);
  }
};

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
  int64_t skipped = 0;
  bool scaled = false;
  amp::History history;
};

template <class P, class Device>
Row run_policy(const Config& cfg, const Task& task, torch::Device device) {
  using Trainer = amp::Trainer<P, Device>;
  using Region = typename Trainer::region_type;
  const bool cuda = device.is_cuda();
  Row row;
  row.name = amp::policy_traits<P>::name;
  row.scaled = amp::policy_traits<P>::uses_loss_scaling;

  torch::manual_seed(cfg.seed);  // same initial weights for every policy
  Mlp model(cfg.hidden);
  model->to(device);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.0));
  Trainer trainer(model, optimizer, amp::TrainerOptions().max_grad_norm(1.0));

  // Batches in the policy's parameter dtype (True<bf16> trains on bf16 inputs).
  const auto in_dtype = Region::param_dtype;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  const int64_t n = task.train_x.size(0);
  for (int64_t i = 0; i + cfg.batch_size <= n; i += cfg.batch_size)
    batches.emplace_back(task.train_x.narrow(0, i, cfg.batch_size).to(device, in_dtype),
                         task.train_y.narrow(0, i, cfg.batch_size).to(device));
  const int64_t epochs = (cfg.steps + static_cast<int64_t>(batches.size()) - 1) / static_cast<int64_t>(batches.size());

  if (cuda) torch::cuda::synchronize();
  reset_peak_memory(cuda);
  const auto t0 = std::chrono::steady_clock::now();
  row.history = trainer.fit(
      batches,
      [&](Region&, const std::pair<torch::Tensor, torch::Tensor>& batch) {
        return torch::cross_entropy_loss(model(batch.first), batch.second);
      },
      amp::FitOptions().epochs(epochs).max_steps(cfg.steps).log_every(50));
  if (cuda) torch::cuda::synchronize();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  row.peak_mib = peak_memory_mib(cuda);
  row.steps_per_s = static_cast<double>(row.history.steps.size()) / secs;
  row.skipped = row.history.skipped();
  row.scale = trainer.scaler().get_scale();
  // Mean loss of the last 10 steps: less noisy than the last batch alone.
  const auto& h = row.history.steps;
  const size_t tail = std::min<size_t>(10, h.size());
  for (size_t i = h.size() - tail; i < h.size(); ++i) row.final_loss += h[i].loss / static_cast<double>(tail);

  torch::NoGradGuard no_grad;
  model->eval();
  Region region;  // evaluate in the policy's precision, as it would be deployed
  auto logits = model(task.test_x.to(device, in_dtype));
  row.accuracy = logits.argmax(1).eq(task.test_y.to(device)).to(torch::kFloat).mean().template item<double>();
  return row;
}

void print_table(const std::vector<Row>& rows, const std::string& device) {
  double base = 0;
  for (const auto& r : rows)
    if (r.name == "32-true") base = r.steps_per_s;
  std::cout << "\nprecision sweep on " << device << " (LibTorch " << amp::kLibTorchMajor << "." << amp::kLibTorchMinor
            << ")\n";
  std::cout << std::left << std::setw(17) << "precision" << std::right << std::setw(11) << "final loss" << std::setw(10)
            << "accuracy" << std::setw(9) << "steps/s" << std::setw(10) << "speedup" << std::setw(13) << "peak memory"
            << std::setw(9) << "skipped" << std::setw(12) << "loss scale" << "\n";
  std::cout << std::string(91, '-') << "\n";
  for (const auto& r : rows) {
    std::ostringstream speed;
    if (base > 0)
      speed << std::fixed << std::setprecision(2) << r.steps_per_s / base << "x";
    else
      speed << "n/a";
    std::ostringstream mem;
    mem << std::fixed << std::setprecision(0) << r.peak_mib << " MiB";
    std::ostringstream scale;
    if (r.scaled)
      scale << r.scale;
    else
      scale << "-";
    std::cout << std::left << std::setw(17) << r.name << std::right << std::fixed << std::setprecision(4) << std::setw(11)
              << r.final_loss << std::setw(9) << std::setprecision(1) << 100.0 * r.accuracy << "%" << std::setw(9)
              << std::setprecision(2) << r.steps_per_s << std::setw(10) << speed.str() << std::setw(13) << mem.str()
              << std::setw(9) << r.skipped << std::setw(12) << scale.str() << "\n";
  }
  std::cout << "(speedup: steps/s relative to 32-true in this run; peak memory: "
            << (device == "cuda" ? "CUDA allocator peak" : "process peak RSS during the run") << ")\n";
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

// Renders the CSV with gnuplot: loss per policy (log scale), and the loss
// scale of scaled policies when any ran.
void write_plot(const std::vector<Row>& rows, const std::string& csv, const std::string& png) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::cerr << "gnuplot not found (apt-get install gnuplot-nox); no plot written\n";
    return;
  }
  bool any_scaled = false;
  for (const auto& r : rows) any_scaled = any_scaled || r.scaled;
  const std::string script_path = png + ".gp";
  std::ofstream gp(script_path);
  gp << "set datafile separator ','\nset terminal pngcairo size 1000," << (any_scaled ? 800 : 500)
     << " noenhanced\nset output '" << png << "'\n";
  if (any_scaled) gp << "set multiplot layout 2,1\n";
  gp << "set title 'amp precision sweep: training loss'\nset xlabel 'optimizer step'\nset ylabel 'loss'\n"
        "set logscale y\nset key outside right\nset grid\nplot ";
  for (size_t i = 0; i < rows.size(); ++i)
    gp << (i ? ", " : "") << "'" << csv << "' using 2:(strcol(1) eq '" << rows[i].name << "' ? $4 : 1/0) with lines lw 2 title '"
       << rows[i].name << "'";
  gp << "\n";
  if (any_scaled) {
    gp << "set title 'loss scale (scaled policies)'\nset ylabel 'scale'\nset logscale y 2\nplot ";
    bool first = true;
    for (const auto& r : rows)
      if (r.scaled) {
        gp << (first ? "" : ", ") << "'" << csv << "' using 2:(strcol(1) eq '" << r.name << "' ? $5 : 1/0) with steps lw 2 title '"
           << r.name << "'";
        first = false;
      }
    gp << "\nunset multiplot\n";
  }
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

template <class Device>
std::vector<Row> sweep(const Config& cfg, const Task& task, torch::Device device) {
  std::vector<Row> rows;
  if (cfg.precision.empty()) {
    amp::for_each_policy(amp::supported_policies<Device>, [&](auto p) {
      using P = typename decltype(p)::type;
      std::cerr << "== " << amp::policy_traits<P>::name << "\n";
      rows.push_back(run_policy<P, Device>(cfg, task, device));
    });
  } else {
    rows.push_back(amp::dispatch_precision<Device>(cfg.precision, [&](auto p) {
      return run_policy<typename decltype(p)::type, Device>(cfg, task, device);
    }));
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  cfg.device = torch::cuda::is_available() ? "cuda" : "cpu";
  CLI::App app{"amp precision sweep: one model, every precision policy, one table"};
  std::string valid;
  amp::for_each_policy([&](auto p) { valid += std::string(valid.empty() ? "" : ", ") + amp::policy_traits<typename decltype(p)::type>::name; });
  app.add_option("--precision", cfg.precision, "run one policy by its precision string (" + valid + "; legacy 64, 32, 16, bf16)");
  app.add_option("--device", cfg.device, "cpu or cuda (default: cuda when available)")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--steps", cfg.steps, "optimizer steps per policy")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", cfg.batch_size, "batch size")->check(CLI::PositiveNumber);
  app.add_option("--hidden", cfg.hidden, "hidden width of the MLP")->check(CLI::PositiveNumber);
  app.add_option("--seed", cfg.seed, "seed of the data and of the initial weights");
  app.add_option("--csv", cfg.csv, "write per-step metrics (precision,step,epoch,loss,scale,skipped,seconds) here");
  app.add_option("--plot", cfg.plot, "render loss (and loss-scale) curves to this PNG with gnuplot (needs --csv)");
  CLI11_PARSE(app, argc, argv);

  try {
    if (!cfg.plot.empty() && cfg.csv.empty()) cfg.csv = cfg.plot + ".csv";
    // Enough data that each sample is seen about once: the accuracy measures
    // learning, not memorisation (capped to keep the demo's memory small).
    const int64_t n_train = std::min<int64_t>(cfg.batch_size * cfg.steps, 65536);
    Task task(n_train, 2048, static_cast<uint64_t>(cfg.seed));
    std::vector<Row> rows;
    if (cfg.device == "cuda") {
      if (!torch::cuda::is_available()) {
        std::cerr << "amp: --device=cuda but LibTorch sees no CUDA device; use --device=cpu\n";
        return 2;
      }
      rows = sweep<amp::CUDA>(cfg, task, torch::Device(torch::kCUDA));
    } else {
      rows = sweep<amp::CPU>(cfg, task, torch::Device(torch::kCPU));
    }
    print_table(rows, cfg.device);
    if (!cfg.csv.empty()) write_csv(rows, cfg.csv);
    if (!cfg.plot.empty()) write_plot(rows, cfg.csv, cfg.plot);
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  return 0;
}
