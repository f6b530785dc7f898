// examples/low_bit_transformer.cc: the quality check of amp's low-bit Adam
// optimizers (amp/optim/low_bit_adam.h) on a small transformer: does a model
// trained with 8-bit, 4-bit or fp8 optimizer states reach the loss of one
// trained with LibTorch's AdamW, and how many bytes of state per parameter
// does each keep?
//
//   bazel run //examples:low_bit_transformer [-- --steps=N] [-- --seed=S] [-- --checkpoint]   # N: 400, S: 0
//   bazel run //examples:low_bit_transformer -- --precision=mxfp8-rceil --precision=nvfp4   # vs bf16-mixed
//
// The model: a token embedding (vocabulary 64, width 128), learned positions
// (32), two pre-norm blocks (LayerNorm, 4-head causal self-attention,
// LayerNorm, a 128-512-128 GELU FFN), a final LayerNorm and a linear head:
// about 0.4M parameters, whose large tensors (numel >= 4096, a multiple of the
// block size) all get quantized states. The task is synthetic and learnable,
// generated once from a fixed seed: sequences in which the next token is a
// fixed random table's entry for the two tokens before it with probability
// 0.9, else uniform (so attention must look one token back), and the loss is
// the cross-entropy of next-token prediction. Its floor, the task's entropy,
// is 0.84 nats (0.73 per prediction; ln 64 for the first, of a uniform
// token); 400 steps learn part of the 4096-entry table, so the comparison is
// of how fast each optimizer learns, not only of where it ends.
// --seed=S (0 by default) draws another task (table and sequences from the
// seed 1234 + S) and other initial weights (seed S): the spread over seeds
// is the noise a loss difference is read against. NVFP4<true>'s rounding
// generator is the Trainer's own (seeded with 0) whatever S is.
// --batch=B (32 by default) trains on batches of B sequences from a data set
// of 128 batches (so every B cycles it about 3 times in 400 steps).
//
// Every optimizer (AdamW, AdamW8bit, AdamW4bit, and AdamWFp8 on LibTorch >=
// 2.1) trains the same initial weights on the same batches with
// AdamWOptions(1e-3).weight_decay(0.01) under amp::Trainer<Mixed<bf16,
// NoScaler>, CPU>, batch 32 (--batch). Per optimizer it prints the final loss (the mean
// training loss of the last 20 steps), its difference from AdamW's, and the
// optimizer's state bytes per parameter (amp::optimizer_state_bytes: AdamW's
// 8, the low-bit ones' quantized states plus the fp32 states of the tensors
// too small to quantize), the activation bytes of a step (amp::ActivationMeter:
// what the forward keeps for backward, counted exactly: activations, the
// loss, and autocast's bf16 copies of the weights), and the time of a step
// with its difference from AdamW's. The two halves of the training memory:
// optimizer state and activations. The optimizers train in lockstep (each
// takes its step in turn), so the times compare steps taken under the same
// machine load. --checkpoint trains a second copy of each model, its blocks
// checkpointed (amp::checkpoint), and prints its line after the plain one:
// fewer activation bytes, the same losses bit for bit, a longer step (the
// blocks' forwards run again in backward). About a minute of CPU time at 400
// steps; on a busy machine OMP_NUM_THREADS=1 can be several times faster than
// 2 spinning threads. The test runs 30 steps with --checkpoint. The exit
// status is 1 when a loss is not finite (or the checkpointed run's losses
// differ from the plain one's), 2 for a bad argument.
// --precision=NAME (repeatable; mxfp8-rceil, mxfp8-floor, nvfp4, nvfp4-sr, or
// any other string amp::dispatch_precision knows) instead trains AdamW under
// amp::Trainer<P, CPU> for that policy (Float8<MXFP8<...>> and
// Float8<NVFP4<...>>: every linear in the block-scaled recipe, emulated, on
// LibTorch 2.1+) and compares each final loss with bf16-mixed's
// (docs/float8.md has the numbers); a name this LibTorch cannot run is exit
// status 2, before any training.
#include <amp/amp.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kVocab = 64, kWidth = 128, kSeq = 32, kHeads = 4, kHidden = 512, kBlocks = 2;
constexpr int64_t kBatches = 128;  // the data set: 128 batches of --batch (32) sequences, cycled
constexpr int kLastSteps = 20;     // the final loss: the mean of the last 20 steps

// One pre-norm block: x + attention(norm(x)), then x + ffn(norm(x)).
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    using namespace torch::nn;
    norm1 = register_module("norm1", LayerNorm(LayerNormOptions({kWidth})));
    attention = register_module("attention", MultiheadAttention(MultiheadAttentionOptions(kWidth, kHeads)));
    norm2 = register_module("norm2", LayerNorm(LayerNormOptions({kWidth})));
    ffn = register_module("ffn", Sequential(Linear(kWidth, kHidden), GELU(), Linear(kHidden, kWidth)));
  }
  // x: [seq, batch, width] (MultiheadAttention's layout); mask: [seq, seq], additive.
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask) {
    const auto h = norm1->forward(x);
    x = x + std::get<0>(attention->forward(h, h, h, /*key_padding_mask=*/{}, /*need_weights=*/false, mask));
    return x + ffn->forward(norm2->forward(x));
  }
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::MultiheadAttention attention{nullptr};
  torch::nn::Sequential ffn{nullptr};
};
TORCH_MODULE(Block);

struct TransformerImpl : torch::nn::Module {
  TransformerImpl() {
    using namespace torch::nn;
    tokens = register_module("tokens", Embedding(kVocab, kWidth));
    positions = register_parameter("positions", torch::randn({kSeq, kWidth}) * 0.02);
    for (int64_t i = 0; i < kBlocks; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block()));
    norm = register_module("norm", LayerNorm(LayerNormOptions({kWidth})));
    head = register_module("head", Linear(kWidth, kVocab));
    // Causal: position i attends to positions <= i (-inf above the diagonal).
    causal = register_buffer("causal", torch::full({kSeq, kSeq}, -std::numeric_limits<float>::infinity()).triu(1));
  }
  // tokens: [batch, seq] -> logits [batch, seq, vocab]. With checkpointed,
  // each block keeps only its input for backward and runs again there.
  torch::Tensor forward(const torch::Tensor& input) {
    auto x = (tokens->forward(input) + positions).transpose(0, 1);  // [seq, batch, width]
    for (auto& block : blocks) {
      auto run = [&](const std::vector<torch::Tensor>& in) { return block->forward(in[0], causal); };
      x = checkpointed ? amp::checkpoint(run, {x}) : run({x});
    }
    return head->forward(norm->forward(x)).transpose(0, 1);
  }
  bool checkpointed = false;
  torch::nn::Embedding tokens{nullptr};
  torch::Tensor positions, causal;
  std::vector<Block> blocks;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Transformer);

// kBatches · batch sequences of kSeq + 1 tokens: token t is table[token t-2,
// token t-1] with probability 0.9, else uniform; the first two are uniform.
// From the seed 1234 + seed (--seed).
torch::Tensor make_data(uint64_t seed, int64_t batch) {
  torch::manual_seed(1234 + seed);
  const int64_t sequences = kBatches * batch;
  const auto table = torch::randint(0, kVocab, {kVocab * kVocab}, torch::kLong);
  std::vector<torch::Tensor> columns{torch::randint(0, kVocab, {sequences}, torch::kLong),
                                     torch::randint(0, kVocab, {sequences}, torch::kLong)};
  for (int64_t t = 2; t <= kSeq; ++t) {
    const auto rule = table.index_select(0, columns[t - 2] * kVocab + columns[t - 1]);
    const auto noise = torch::randint(0, kVocab, {sequences}, torch::kLong);
    columns.push_back(torch::where(torch::rand({sequences}) < 0.9, rule, noise));
  }
  return torch::stack(columns, 1);  // [kBatches · batch, kSeq + 1]
}

struct Result {
  double loss = 0;               // mean training loss of the last kLastSteps steps
  double bytes_per_param = 0;    // optimizer state bytes / parameters
  double ms_per_step = 0;        // wall clock of a whole training step, the first kLastSteps aside
  int64_t activation_bytes = 0;  // what the last step's forward kept for backward
  std::vector<double> losses;    // every step's
};

// Every optimizer's training, in lockstep: at each step each run takes its
// step in turn (starting from the next run each time), so that every step time sees the same machine (a busy or
// throttled stretch slows all of them alike; run one after another, the
// ratios moved by several percent between runs). Each optimizer trains a
// plain model and, with `checkpoint`, a second copy (the same initial weights
// and batches) whose blocks are checkpointed. Result [2k] is optimizer k's
// plain run, [2k + 1] its checkpointed one.
using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;
template <class Policy = amp::Mixed<amp::bf16, amp::NoScaler>>
std::vector<Result> train(const torch::Tensor& data, int steps, bool checkpoint,
                          const std::vector<MakeOptimizer>& optimizers, uint64_t seed) {
  struct Run {
    Transformer model{nullptr};
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    std::unique_ptr<amp::Trainer<Policy, amp::CPU>> trainer;
    Result result;
    double ms = 0;
  };
  std::vector<Run> runs(optimizers.size() * 2);
  for (size_t i = 0; i < runs.size(); ++i) {
    if (i % 2 == 1 && !checkpoint) continue;
    torch::manual_seed(seed);  // the same initial weights for every optimizer and both runs
    Run& r = runs[i];
    r.model = Transformer();
    r.model->checkpointed = i % 2 == 1;
    r.optimizer = optimizers[i / 2](r.model->parameters());
    r.trainer =
        std::make_unique<amp::Trainer<Policy, amp::CPU>>(r.model, *r.optimizer, amp::TrainerOptions().progress(false));
  }
  const int64_t warmup = steps > 2 * kLastSteps ? kLastSteps : 0;
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t size = data.size(0) / kBatches;
    const auto batch = data.narrow(0, (step % kBatches) * size, size);
    const auto input = batch.narrow(1, 0, kSeq), target = batch.narrow(1, 1, kSeq);
    for (size_t k = 0; k < runs.size(); ++k) {  // each step from another run: no run is always first
      Run& r = runs[(k + static_cast<size_t>(step)) % runs.size()];
      if (!r.trainer) continue;
      auto loss = [&](auto& /*region*/) {
        amp::ActivationMeter meter;  // from here, what the forward allocates and keeps
        auto l =
            torch::nn::functional::cross_entropy(r.model->forward(input).reshape({-1, kVocab}), target.reshape({-1}));
        r.result.activation_bytes = meter.bytes();
        return l;
      };
      const auto start = std::chrono::steady_clock::now();
      r.result.losses.push_back(r.trainer->step(loss).loss_value());
      if (step >= warmup)
        r.ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    }
  }
  std::vector<Result> out;
  for (Run& r : runs) {
    if (!r.trainer) {
      out.emplace_back();
      continue;
    }
    const auto& losses = r.result.losses;
    const auto last = std::min<size_t>(losses.size(), kLastSteps);
    double sum = 0;
    for (size_t i = losses.size() - last; i < losses.size(); ++i) sum += losses[i];
    r.result.loss = sum / static_cast<double>(last);
    r.result.bytes_per_param =
        static_cast<double>(amp::optimizer_state_bytes(*r.optimizer)) / amp::parameter_count(*r.optimizer);
    r.result.ms_per_step = r.ms / static_cast<double>(steps - warmup);
    out.push_back(std::move(r.result));
  }
  return out;
}

template <class Optimizer>
MakeOptimizer make() {
  return [](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<Optimizer>(std::move(params), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  };
}

}  // namespace

// AdamW under the policy named `name` (amp::dispatch_precision's strings:
// the block-scaled recipes, or any other policy this LibTorch runs on the CPU).
std::vector<Result> train_precision(const std::string& name, const torch::Tensor& data, int steps, uint64_t seed) {
  const std::vector<MakeOptimizer> adamw{make<torch::optim::AdamW>()};
  return amp::dispatch_precision<amp::CPU>(
      name, [&](auto policy) { return train<typename decltype(policy)::type>(data, steps, false, adamw, seed); });
}

// The integer V of `arg` = "FLAG=V" when it lies in [lo, hi]; else the error
// printed and nullopt.
std::optional<long> flag_value(const std::string& arg, const char* flag, long lo, long hi) {
  const char* text = arg.c_str() + std::strlen(flag) + 1;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || value < lo || value > hi) {
    std::fprintf(stderr, "amp: low_bit_transformer's %s must be an integer in [%ld, %ld], not \"%s\"\n", flag, lo, hi,
                 text);
    return std::nullopt;
  }
  return value;
}

int main(int argc, char** argv) {
  int steps = 400;
  uint64_t seed = 0;
  int64_t batch = 32;
  bool checkpoint = false;
  std::vector<std::string> precisions;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--checkpoint") {
      checkpoint = true;
    } else if (arg.rfind("--precision=", 0) == 0) {
      precisions.push_back(arg.substr(12));
    } else if (arg.rfind("--steps=", 0) == 0) {
      const auto value = flag_value(arg, "--steps", 1, 1000000);
      if (!value) return 2;
      steps = static_cast<int>(*value);
    } else if (arg.rfind("--seed=", 0) == 0) {
      const auto value = flag_value(arg, "--seed", 0, 1000000);
      if (!value) return 2;
      seed = static_cast<uint64_t>(*value);
    } else if (arg.rfind("--batch=", 0) == 0) {
      const auto value = flag_value(arg, "--batch", 1, 4096);
      if (!value) return 2;
      batch = *value;
    } else {
      std::fprintf(stderr,
                   "amp: low_bit_transformer: unknown argument \"%s\" (usage: low_bit_transformer [--steps=N] "
                   "[--seed=S] [--batch=B] [--checkpoint] [--precision=NAME])\n",
                   arg.c_str());
      return 2;
    }
  }

  for (const std::string& name : precisions) {  // every name checked before any training
    try {
      amp::dispatch_precision<amp::CPU>(name, [](auto) {});
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "%s (low_bit_transformer's --precision)\n", e.what_without_backtrace());
      return 2;
    }
  }
  const auto data = make_data(seed, batch);
  int64_t params = 0;
  for (const auto& p : Transformer()->parameters()) params += p.numel();
  std::printf("low_bit_transformer: LibTorch %d.%d, %lld parameters, %d steps, batch %lld, seed %llu%s\n",
              TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, static_cast<long long>(params), steps,
              static_cast<long long>(batch), static_cast<unsigned long long>(seed),
              checkpoint ? ", each also with its blocks checkpointed" : "");
  std::fflush(stdout);

  if (!precisions.empty()) {
    const std::vector<Result> adamw = train(data, steps, false, {make<torch::optim::AdamW>()}, seed);
    bool ok = true;
    std::printf("low_bit_transformer: AdamW bf16-mixed final loss %.4f, %lld activation bytes/step, %.2f ms/step\n",
                adamw[0].loss, static_cast<long long>(adamw[0].activation_bytes), adamw[0].ms_per_step);
    for (const std::string& name : precisions) {
      const std::vector<Result> r = train_precision(name, data, steps, seed);
      ok = ok && std::isfinite(r[0].loss);
      std::printf(
          "low_bit_transformer: AdamW %s final loss %.4f (%+.2f%% vs bf16-mixed), %lld activation "
          "bytes/step, %.2f ms/step\n",
          name.c_str(), r[0].loss, (r[0].loss / adamw[0].loss - 1) * 100, static_cast<long long>(r[0].activation_bytes),
          r[0].ms_per_step);
      std::fflush(stdout);
    }
    return ok ? 0 : 1;
  }
  std::vector<const char*> names{"AdamW", "AdamW8bit", "AdamW4bit"};
  std::vector<MakeOptimizer> optimizers{make<torch::optim::AdamW>(), make<amp::AdamW8bit>(), make<amp::AdamW4bit>()};
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
  names.push_back("AdamWFp8");
  optimizers.push_back(make<amp::AdamWFp8>());
#endif
  const std::vector<Result> results = train(data, steps, checkpoint, optimizers, seed);
  const Result& adamw = results[0];
  bool ok = true;
  for (size_t k = 0; k < names.size(); ++k) {
    for (size_t i = 0; i < (checkpoint ? 2u : 1u); ++i) {
      const Result& r = results[2 * k + i];
      const Result& plain = results[2 * k];
      ok = ok && std::isfinite(r.loss);
      std::printf(
          "low_bit_transformer: %s%s final loss %.4f (%+.1f%% vs AdamW), %.2f state bytes/param, %lld "
          "activation bytes/step, %.2f ms/step (%+.1f%% vs AdamW)",
          names[k], i == 1 ? " checkpointed" : "", r.loss, (r.loss / adamw.loss - 1) * 100, r.bytes_per_param,
          static_cast<long long>(r.activation_bytes), r.ms_per_step,
          (r.ms_per_step / results[i].ms_per_step - 1) * 100);
      if (i == 1) {
        const bool same = r.losses == plain.losses;  // checkpointing changes no bit
        ok = ok && same;
        std::printf(" (%.2fx the activations, %.2fx the time; losses %s)",
                    static_cast<double>(r.activation_bytes) / static_cast<double>(plain.activation_bytes),
                    r.ms_per_step / plain.ms_per_step, same ? "bitwise equal" : "DIFFER");
      }
      std::printf("\n");
    }
  }
  std::fflush(stdout);
  return ok ? 0 : 1;
}
