// Checkpoints carry the random generators (TrainerOptions/FabricOptions::rng_state):
// a small transformer with dropout, its batches drawn with torch::randint from
// the global generator (nanoGPT's shape), saved at step k and resumed in a
// fresh process, takes the same steps bit for bit as the uninterrupted run:
// through Trainer, through Fabric, and through fit() resumed in the middle
// of an epoch with a shuffling sampler. With the entry turned off in the
// resumed process the steps differ: the comparison can fail.
//
// The resumed half runs in a child process: this binary started again with
// AMP_RNG_CHILD set, which a static initializer sees before the tests run.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "amp/amp.h"
#include "../error_of.h"
#include "../tmp_path.h"

extern char** environ;

namespace rng_resume_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

namespace fs = std::filesystem;
using Policy = amp::Mixed<amp::bf16, amp::NoScaler>;
constexpr int64_t kVocab = 16, kDim = 32, kContext = 8, kBatch = 4;

// One pre-norm block with hand-written causal attention and dropout.
struct TinyGpt : torch::nn::Module {
  TinyGpt() {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    qkv = register_module("qkv", torch::nn::Linear(kDim, 3 * kDim));
    proj = register_module("proj", torch::nn::Linear(kDim, kDim));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    fc = register_module("fc", torch::nn::Linear(kDim, 2 * kDim));
    out = register_module("out", torch::nn::Linear(2 * kDim, kDim));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
    drop = register_module("drop", torch::nn::Dropout(0.2));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    torch::Tensor x = emb(idx);
    auto parts = qkv(ln1(x)).chunk(3, -1);
    torch::Tensor att = parts[0].matmul(parts[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(kDim));
    const torch::Tensor mask = torch::ones({kContext, kContext}, torch::kBool).triu(1);
    att = drop(torch::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1));
    x = x + drop(proj(att.matmul(parts[2])));
    x = x + drop(out(torch::gelu(fc(ln2(x)))));
    return head(x);
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr}, head{nullptr};
  torch::nn::Dropout drop{nullptr};
};

torch::Tensor loss_of(TinyGpt& model, const torch::Tensor& tokens) {
  const torch::Tensor x = tokens.narrow(1, 0, kContext), y = tokens.narrow(1, 1, kContext);
  return torch::cross_entropy_loss(model.forward(x).reshape({-1, kVocab}).to(torch::kFloat32), y.reshape({-1}));
}

// A random batch from the global generator, as nanoGPT's get_batch does.
torch::Tensor random_batch() { return torch::randint(kVocab, {kBatch, kContext + 1}); }

struct Record {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;
};

void add_params(Record& r, TinyGpt& model) {
  for (const auto& p : model.parameters()) r.params.push_back(p.detach().clone());
}

void save_record(const Record& r, const std::string& path) {
  std::vector<torch::Tensor> all = r.params;
  all.push_back(torch::tensor(r.losses, torch::kDouble));
  torch::save(all, path);
}

Record load_record(const std::string& path) {
  std::vector<torch::Tensor> all;
  torch::load(all, path);
  Record r;
  const torch::Tensor losses = all.back();
  all.pop_back();
  r.params = all;
  for (int64_t i = 0; i < losses.numel(); ++i) r.losses.push_back(losses[i].item<double>());
  return r;
}

bool same(const Record& a, const Record& b) {
  if (a.losses != b.losses || a.params.size() != b.params.size()) return false;
  for (size_t i = 0; i < a.params.size(); ++i)
    if (!torch::equal(a.params[i], b.params[i])) return false;
  return true;
}

// --- the three ways to train, each from `first` to `last` step (1-based) ----

// Trainer and a loop of step() calls. Resumes from `load` when given, saves at `save_at`.
Record trainer_run(int64_t last, const std::string& load, int64_t save_at, const std::string& save, bool rng) {
  torch::manual_seed(load.empty() ? 0 : 123);  // a resumed process starts from other weights and generator
  TinyGpt model;                               // LibTorch's `Net model;`, held without ownership
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
  amp::Trainer<Policy, amp::CPU> trainer(model, opt, amp::TrainerOptions().progress(false).rng_state(rng));
  if (!load.empty()) trainer.load(load);
  Record r;
  while (trainer.steps() < last) {
    const torch::Tensor batch = random_batch();
    r.losses.push_back(trainer.step([&](auto&) { return loss_of(model, batch); }).loss_value());
    if (trainer.steps() == save_at) trainer.save(save);
  }
  add_params(r, model);
  return r;
}

// Fabric: forward, backward, step, update by hand.
Record precision_run(int64_t last, const std::string& load, int64_t save_at, const std::string& save, bool rng) {
  torch::manual_seed(load.empty() ? 0 : 123);
  TinyGpt model;
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
  amp::Fabric<Policy, amp::CPU> fabric(amp::FabricOptions().rng_state(rng));
  fabric.setup(model, opt);
  if (!load.empty()) fabric.load(load);
  Record r;
  while (fabric.steps() < last) {
    const torch::Tensor batch = random_batch();
    opt.zero_grad();
    const torch::Tensor loss = fabric.forward([&](auto&) { return loss_of(model, batch); });
    fabric.backward(loss);
    fabric.optimizer_step(opt);
    fabric.update();
    r.losses.push_back(loss.item<double>());
    if (fabric.steps() == save_at) fabric.save(save);
  }
  add_params(r, model);
  return r;
}

struct Sequences : torch::data::datasets::Dataset<Sequences> {
  torch::Tensor data;
  Sequences() {
    torch::manual_seed(7);
    data = torch::randint(kVocab, {64, kContext + 1});
  }
  torch::data::Example<> get(size_t i) override {
    return {data[static_cast<int64_t>(i)], data[static_cast<int64_t>(i)]};
  }
  c10::optional<size_t> size() const override { return 64; }
};

// fit() over a DataLoader with a RandomSampler (8 batches an epoch), two epochs.
Record fit_run(int64_t last, const std::string& load, int64_t save_at, const std::string& save, bool rng) {
  Sequences dataset;
  torch::manual_seed(load.empty() ? 0 : 123);
  TinyGpt model;
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
  amp::Trainer<Policy, amp::CPU> trainer(model, opt, amp::TrainerOptions().progress(false).rng_state(rng));
  if (!load.empty()) trainer.load(load);
  auto loader = torch::data::make_data_loader<torch::data::samplers::RandomSampler>(
      dataset.map(torch::data::transforms::Stack<>()), torch::data::DataLoaderOptions().batch_size(8));
  amp::FitOptions fo = amp::FitOptions().max_epochs(2).max_steps(last);
  if (save_at > 0) fo.checkpoint_every(save_at).checkpoint_path(save);
  amp::History h = trainer.fit(
      loader, [&](auto&, auto& batch) { return loss_of(model, batch.data); }, fo);
  Record r;
  for (const auto& s : h.steps) r.losses.push_back(s.loss);
  add_params(r, model);
  return r;
}

using Run = Record (*)(int64_t, const std::string&, int64_t, const std::string&, bool);

Run run_of(const std::string& mode) {
  if (mode == "trainer") return trainer_run;
  if (mode == "precision") return precision_run;
  return fit_run;
}

// The child: AMP_RNG_CHILD=mode:last:rng(0|1):checkpoint:out. Resumes and writes its record.
const bool kChildRan = [] {
  const char* spec = std::getenv("AMP_RNG_CHILD");
  if (spec == nullptr) return false;
  std::vector<std::string> f;
  std::string s = spec;
  for (size_t pos; (pos = s.find(':')) != std::string::npos; s.erase(0, pos + 1)) f.push_back(s.substr(0, pos));
  f.push_back(s);
  save_record(run_of(f[0])(std::stoll(f[1]), f[3], 0, "", f[2] == "1"), f[4]);
  std::exit(0);
}();

using ::amp_test::tmp_path;

// Runs this binary as the child and returns what it wrote.
Record resume_in_child(const std::string& mode, int64_t last, bool rng, const std::string& ckpt) {
  const std::string out = tmp_path(mode + (rng ? "_on" : "_off") + ".out");
  std::string self = fs::read_symlink("/proc/self/exe").string();
  std::string env =
      "AMP_RNG_CHILD=" + mode + ":" + std::to_string(last) + ":" + (rng ? "1" : "0") + ":" + ckpt + ":" + out;
  std::vector<char*> envp;
  for (char** e = environ; *e; ++e) envp.push_back(*e);
  envp.push_back(env.data());
  envp.push_back(nullptr);
  char* argv[] = {self.data(), nullptr};
  pid_t pid;
  EXPECT_EQ(posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv, envp.data()), 0);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the resumed process failed (" << mode << ")";
  return load_record(out);
}

// Uninterrupted 1..last against 1..k + a fresh process's k+1..last.
void expect_bitwise_resume(const std::string& mode, int64_t k, int64_t last) {
  const Record whole = run_of(mode)(last, "", 0, "", true);
  const std::string ckpt = tmp_path(mode + ".pt");
  const Record first = run_of(mode)(k, "", k, ckpt, true);
  ASSERT_EQ(first.losses.size(), static_cast<size_t>(k));
  Record tail{std::vector<double>(whole.losses.begin() + k, whole.losses.end()), whole.params};

  const Record resumed = resume_in_child(mode, last, /*rng=*/true, ckpt);
  EXPECT_EQ(resumed.losses, tail.losses) << mode << ": the resumed steps differ from the uninterrupted run";
  EXPECT_TRUE(same(resumed, tail)) << mode << ": the resumed parameters differ";

  // The same resume with the generators left as the fresh process has them.
  const Record without = resume_in_child(mode, last, /*rng=*/false, ckpt);
  EXPECT_EQ(without.losses.size(), tail.losses.size());
  EXPECT_NE(without.losses, tail.losses) << mode << ": without the generators' entry the resume should differ";
}

TEST(RngResume, TrainerStepLoopWithDropoutAndRandomBatchesResumesBitwise) { expect_bitwise_resume("trainer", 4, 9); }

TEST(RngResume, PrecisionResumesBitwise) { expect_bitwise_resume("precision", 4, 9); }

TEST(RngResume, FitResumedMidEpochWithAShufflingSamplerResumesBitwise) { expect_bitwise_resume("fit", 5, 16); }

// A checkpoint without the entry (amp 0.1's) loads and leaves the generator as it is.
TEST(RngResume, ACheckpointWithoutGeneratorsLoadsAndKeepsTheGenerator) {
  const std::string path = tmp_path("no_rng.pt");
  trainer_run(2, "", 2, path, /*rng=*/false);
  torch::manual_seed(5);
  const torch::Tensor before = torch::randn({4});
  torch::manual_seed(5);
  TinyGpt model;
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
  amp::Trainer<Policy, amp::CPU> trainer(model, opt, amp::TrainerOptions().progress(false));
  torch::manual_seed(5);
  trainer.load(path);
  EXPECT_EQ(trainer.steps(), 2);
  EXPECT_TRUE(torch::equal(torch::randn({4}), before));
}

// A bad generator entry is refused and nothing changes: weights, steps, generator.
TEST(RngResume, ABadGeneratorEntryIsRefusedAndNothingChanges) {
  const std::string bad = tmp_path("bad_rng.pt");
  {
    // Another model's weights and 3 steps, with a CPU generator entry of the wrong size.
    torch::manual_seed(1);
    TinyGpt other;
    torch::optim::AdamW opt(other.parameters(), torch::optim::AdamWOptions(1e-2));
    amp::NoScaler scaler;
    torch::serialize::OutputArchive archive = amp::detail::checkpoint_archive(
        amp::policy_traits<Policy>::name, amp::detail::CheckpointCounters{3, 0, 0}, other, opt, scaler);
    archive.write("amp/rng/cpu", torch::zeros({7}, torch::kByte), /*is_buffer=*/true);
    archive.write("amp/rng/cuda_count", c10::IValue(int64_t{0}));
    archive.save_to(bad);
  }
  torch::manual_seed(0);
  TinyGpt model;
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
  amp::Trainer<Policy, amp::CPU> trainer(model, opt, amp::TrainerOptions().progress(false));
  const torch::Tensor w = model.head->weight.detach().clone();
  torch::manual_seed(9);
  const torch::Tensor expect_next = torch::randn({4});
  torch::manual_seed(9);
  const std::string msg = amp_test::error_of([&] { trainer.load(bad); });
  EXPECT_NE(msg.find("amp: the checkpoint's random-generator entry 'amp/rng/cpu' is not a generator state"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("rng_state(false)"), std::string::npos) << msg;
  EXPECT_TRUE(torch::equal(model.head->weight, w));
  EXPECT_EQ(trainer.steps(), 0);
  EXPECT_TRUE(torch::equal(torch::randn({4}), expect_next));

  // Turned off, the same file loads (the entry is not read).
  amp::Trainer<Policy, amp::CPU> lenient(model, opt, amp::TrainerOptions().progress(false).rng_state(false));
  lenient.load(bad);
  EXPECT_EQ(lenient.steps(), 3);
}

}  // namespace
}  // namespace rng_resume_test
