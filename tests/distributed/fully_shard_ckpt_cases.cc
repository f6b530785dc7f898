// Checkpoints of a Trainer under amp::FullyShard (amp/distributed/fully_shard_checkpoint.h),
// run through tools/launch by distributed_test.sh's "fully_shard_ckpt" group
// (one case per launch). Each rank prints "PASS <case>" or "FAIL <case>: why".
//
//   train PATH K KIND    K steps, save_fully_sharded(KIND: consolidated | sharded),
//                        K more; each rank records its shards' and its AdamW
//                        state's bits (PATH.final.<rank>), rank 0 the world size
//   resume PATH K        fresh processes load PATH; a consolidated file is also
//                        loaded by a plain Trainer (the unsharded model, one
//                        process): this rank's shards and state must be its rows
//                        of it, bitwise; after K more steps, at the saved world
//                        size, every shard and the state bitwise the uninterrupted run's
//   bad DIR              checkpoints that do not fit (another model or policy; a missing,
//                        damaged or stale rank file): an amp: error naming the file on
//                        every rank, nothing changed
//   die PATH K KIND HOW  as train, then a second save the last rank never joins
//                        (killed or stopped): the survivors' amp: error within the
//                        timeout, the first checkpoint byte for byte, no temporary file
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "amp/detail/compat.h"
#include "amp/distributed.h"
#include "amp/distributed/fully_shard_checkpoint.h"
#include "amp/train/trainer.h"
#include "process_case.h"
#include "tests/parity/fsdp_model.h"

namespace {

using test_case::check;
using test_case::fail;
using test_case::init;
using Policy = amp::True<amp::fp32>;
using TrainerT = amp::Trainer<Policy, amp::CPU>;

amp::FullyShardCheckpoint kind_of(const std::string& s) {
  if (s == "consolidated") return amp::FullyShardCheckpoint::kConsolidated;
  if (s == "sharded") return amp::FullyShardCheckpoint::kSharded;
  fail("unknown kind " + s);
}

torch::Tensor bits(const torch::Tensor& t) {
  return t.detach().to(torch::kFloat).contiguous().view(torch::kInt).reshape({-1}).to(torch::kLong);
}

const torch::optim::AdamWParamState* adamw_state(const torch::optim::Optimizer& opt, const torch::Tensor& p) {
  auto it = opt.state().find(amp::detail::compat::optim_state_key(p.unsafeGetTensorImpl()));
  if (it == opt.state().end()) return nullptr;
  return &dynamic_cast<const torch::optim::AdamWParamState&>(*it->second);
}

// A FullyShard run: the model, its shards' optimizer and the Trainer.
struct Run {
  amp::ProcessGroup pg;
  fsdp_model::Net net;
  std::unique_ptr<amp::FullyShard> fsdp;
  std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<TrainerT> trainer;
  fsdp_model::Data data;

  explicit Run(amp::ProcessGroup g, int64_t steps) : pg(std::move(g)), data(pg.rank(), steps) {
    fsdp = std::make_unique<amp::FullyShard>(pg, *net, net->units);
    net->fsdp = fsdp.get();
    opt = std::make_unique<torch::optim::AdamW>(fsdp->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    trainer = std::make_unique<TrainerT>(net, *opt, amp::TrainerOptions().progress(false));
    trainer->stepper().set_gradient_sync(fsdp.get());
  }

  // k steps; the input gets noise from this rank's generator (so resuming must restore it).
  void train(int64_t k) {
    for (int64_t i = 0; i < k; ++i) {
      const int64_t s = trainer->steps();
      trainer->step([&](auto&) {
        const auto x = data.x[s] + 0.01 * torch::randn_like(data.x[s]);
        return fsdp_model::loss_of(fsdp->forward(net, x), data.y[s]);
      });
    }
  }

  // This rank's shards and their AdamW state, as bits.
  torch::Tensor state_bits() const {
    std::vector<torch::Tensor> all;
    for (const auto& p : fsdp->parameters()) {
      all.push_back(bits(p));
      const auto* s = adamw_state(*opt, p);
      check(s != nullptr, "a shard without optimizer state");
      all.push_back(torch::full({1}, s->step(), torch::kLong));
      all.push_back(bits(s->exp_avg()));
      all.push_back(bits(s->exp_avg_sq()));
    }
    return torch::cat(all);
  }
};

// k steps, a checkpoint at `path`, k more; each rank records its shards and
// state at the save and after (and its generator at the save), rank 0 the
// world size and the kind: what resume compares with.
void train_save_train(Run& run, const std::string& path, int64_t k, const std::string& kind) {
  run.train(k);
  amp::save_fully_sharded(*run.trainer, path, kind_of(kind));
  const std::string rank = std::to_string(run.pg.rank());
  torch::save(run.state_bits(), path + ".at_save." + rank);
  torch::save(amp::detail::cpu_rng_state(), path + ".rng." + rank);
  run.train(k);
  torch::save(run.state_bits(), path + ".final." + rank);
  if (run.pg.rank() == 0) {
    std::ofstream(path + ".world") << run.pg.world_size();
    std::ofstream(path + ".kind") << kind;
  }
  run.pg.barrier();
}

void train(const std::string& path, int64_t k, const std::string& kind) {
  Run run(init(), 2 * k);
  train_save_train(run, path, k, kind);
  std::cout << "PASS train " << kind << " world " << run.pg.world_size() << std::endl;
}

// A plain Trainer (the unsharded model, this process alone) loads a
// consolidated checkpoint; this rank's shards and state are its rows of it.
void check_against_plain(const std::string& path, Run& run, int64_t k) {
  const torch::Tensor generator = amp::detail::cpu_rng_state();  // the plain model and load() set it
  struct Restore {
    torch::Tensor state;
    ~Restore() { amp::detail::set_state_of(at::detail::getDefaultCPUGenerator(), state); }
  } restore{generator};
  fsdp_model::Net plain;
  torch::optim::AdamW plain_opt(plain->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  TrainerT plain_trainer(plain, plain_opt, amp::TrainerOptions().progress(false));
  plain_trainer.load(path);
  check(plain_trainer.steps() == k, "the plain Trainer loaded step " + std::to_string(plain_trainer.steps()));
  const auto whole = plain->parameters();
  const auto shards = run.fsdp->parameters();
  const int rank = run.pg.rank(), world = run.pg.world_size();
  for (size_t i = 0; i < whole.size(); ++i) {
    const int64_t rows = whole[i].size(0), chunk = (rows + world - 1) / world;
    const int64_t begin = std::min(rows, rank * chunk), n = std::max<int64_t>(0, std::min(chunk, rows - begin));
    auto mine = [&](const torch::Tensor& t) { return bits(t.narrow(0, begin, n)); };
    check(torch::equal(mine(whole[i]), bits(shards[i])),
          "shard " + run.fsdp->names()[i] + " differs from the plain load");
    const auto* a = adamw_state(plain_opt, whole[i]);
    const auto* b = adamw_state(*run.opt, shards[i]);
    check(a != nullptr && b != nullptr, "state missing for " + run.fsdp->names()[i]);
    check(a->step() == b->step() && torch::equal(mine(a->exp_avg()), bits(b->exp_avg())) &&
              torch::equal(mine(a->exp_avg_sq()), bits(b->exp_avg_sq())),
          "the optimizer state of " + run.fsdp->names()[i] + " differs from the plain load");
  }
}

void resume(const std::string& path, int64_t k) {
  Run run(init(), 2 * k);
  int saved_world = 0;
  std::ifstream(path + ".world") >> saved_world;
  amp::load_fully_sharded(*run.trainer, path);
  check(run.trainer->steps() == k, "loaded step " + std::to_string(run.trainer->steps()));
  if (saved_world == run.pg.world_size()) {
    torch::Tensor at_save, rng;
    torch::load(at_save, path + ".at_save." + std::to_string(run.pg.rank()));
    torch::load(rng, path + ".rng." + std::to_string(run.pg.rank()));
    check(torch::equal(run.state_bits(), at_save), "the loaded shards or state differ from the saved run's");
    check(torch::equal(amp::detail::cpu_rng_state(), rng), "the loaded generator differs from the saved run's");
  }
  std::string kind;
  std::ifstream(path + ".kind") >> kind;
  if (kind == "consolidated") check_against_plain(path, run, k);
  run.train(k);
  const bool same = saved_world == run.pg.world_size();
  if (same) {
    torch::Tensor expect;
    torch::load(expect, path + ".final." + std::to_string(run.pg.rank()));
    check(torch::equal(run.state_bits(), expect),
          "the shards or their optimizer state differ from the uninterrupted run's (bitwise)");
  }
  std::cout << "PASS resume world " << run.pg.world_size() << " from world " << saved_world
            << (same ? ": every shard and its state bitwise after the next steps" : ": loaded and trained on")
            << std::endl;
}

// The message of f()'s amp: error ("" when it does not throw).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// A Trainer of `Policy` over a one-Linear model (another model than Run's), saved collectively at `path`.
template <class P>
void save_other(const amp::ProcessGroup& pg, const std::string& path, amp::FullyShardCheckpoint kind, bool same_net) {
  fsdp_model::Net net;
  torch::nn::Linear lin(5, 3);
  std::unique_ptr<amp::FullyShard> fsdp =
      same_net ? std::make_unique<amp::FullyShard>(pg, *net, net->units)
               : std::make_unique<amp::FullyShard>(pg, *lin, std::vector<std::shared_ptr<torch::nn::Module>>{});
  torch::optim::AdamW opt(fsdp->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  std::unique_ptr<amp::Trainer<P, amp::CPU>> trainer =
      same_net ? std::make_unique<amp::Trainer<P, amp::CPU>>(net, opt, amp::TrainerOptions().progress(false))
               : std::make_unique<amp::Trainer<P, amp::CPU>>(lin, opt, amp::TrainerOptions().progress(false));
  trainer->stepper().set_gradient_sync(fsdp.get());
  amp::save_fully_sharded(*trainer, path, kind);
}

// Checkpoints that do not fit: every rank gets an amp: error naming the
// file, and nothing changes (the shards, their state, the step; it trains on).
void bad(const std::string& dir) {
  Run run(init(), 4);
  const int rank = run.pg.rank();
  run.train(2);
  const std::string set = dir + "/set.pt", other_set = dir + "/other_set.pt", other = dir + "/other.pt",
                    bf16 = dir + "/bf16.pt";
  amp::save_fully_sharded(*run.trainer, set, amp::FullyShardCheckpoint::kSharded);
  amp::save_fully_sharded(*run.trainer, set, amp::FullyShardCheckpoint::kSharded);  // the first set's files go
  int64_t rank_files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    rank_files += e.path().string().rfind(set + ".", 0) == 0 && e.path().string().find(".rank") != std::string::npos;
  check(rank_files == run.pg.world_size(),
        std::to_string(rank_files) + " rank files beside the manifest after two saves");
  const torch::Tensor before = run.state_bits();
  // Rank 1's file of the set, as the manifest names it.
  std::string rank1;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string n = e.path().string();
    if (n.rfind(set + ".", 0) == 0 && n.size() > 6 && n.compare(n.size() - 6, 6, ".rank1") == 0) rank1 = n;
  }
  check(!rank1.empty(), "no rank 1 file beside the manifest");
  auto expect = [&](const std::string& what, const std::string& file, const std::string& needle) {
    const std::string msg = error_of([&] { amp::load_fully_sharded(*run.trainer, file); });
    check(msg.rfind("amp: ", 0) == 0 && msg.find(needle) != std::string::npos,
          what + ": expected an amp: error naming '" + needle + "', got '" + msg + "'");
    check(torch::equal(run.state_bits(), before) && run.trainer->steps() == 2, what + ": the trainer changed");
    if (rank == 0) std::cout << what << ": " << msg.substr(0, msg.find('\n')).substr(0, 160) << std::endl;
  };
  const std::string good = test_case::file_bytes(rank1);
  auto put = [&](const std::string& bytes) {
    run.pg.barrier();
    if (rank == 1) std::ofstream(rank1, std::ios::binary) << bytes;
    run.pg.barrier();
  };
  // Missing, damaged and stale (another save's) rank files.
  run.pg.barrier();
  if (rank == 1) std::filesystem::rename(rank1, rank1 + ".away");
  run.pg.barrier();
  expect("missing", set, rank1);
  run.pg.barrier();
  if (rank == 1) std::filesystem::rename(rank1 + ".away", rank1);
  std::string damaged = good;
  damaged[damaged.size() / 2] = static_cast<char>(damaged[damaged.size() / 2] ^ 0x10);
  put(damaged);
  expect("damaged", set, rank1);
  amp::save_fully_sharded(*run.trainer, other_set, amp::FullyShardCheckpoint::kSharded);
  std::string stale;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string n = e.path().string();
    if (n.rfind(other_set + ".", 0) == 0 && n.compare(n.size() - 6, 6, ".rank1") == 0) stale = test_case::file_bytes(n);
  }
  put(stale);
  expect("stale", set, rank1);
  put(good);
  // Another model, sharded and consolidated; another policy.
  save_other<Policy>(run.pg, other_set, amp::FullyShardCheckpoint::kSharded, false);
  expect("another model (sharded)", other_set, other_set);
  save_other<Policy>(run.pg, other, amp::FullyShardCheckpoint::kConsolidated, false);
  expect("another model (consolidated)", other, other);
  save_other<amp::Mixed<amp::bf16, amp::NoScaler>>(run.pg, bf16, amp::FullyShardCheckpoint::kConsolidated, true);
  expect("another policy", bf16, "bf16-mixed");
  // The set as it was still loads, and training goes on.
  amp::load_fully_sharded(*run.trainer, set);
  check(torch::equal(run.state_bits(), before), "the set does not load back");
  run.train(1);
  check(run.trainer->steps() == 3 && !torch::equal(run.state_bits().narrow(0, 0, before.numel()), before),
        "no training after the failed loads");
  std::cout << "PASS bad" << std::endl;
}

// As train (a checkpoint at step k, the uninterrupted run recorded at 2k),
// then a second save to the same path that the last rank never joins (killed
// or stopped): both survivors get an amp: error within the timeout, the first
// checkpoint is there byte for byte (every file of a sharded set), and no
// temporary file is left; resume then continues from it bitwise.
void die(const std::string& path, int64_t k, const std::string& kind, const std::string& how) {
  Run run(init(), 2 * k);
  train_save_train(run, path, k, kind);
  const std::string dir = path.substr(0, path.find_last_of('/') + 1);
  auto snapshot = [&] {
    std::map<std::string, std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      const std::string n = e.path().string();
      if (n == path || n.rfind(path + ".", 0) == 0) files[n] = test_case::file_bytes(n);
    }
    return files;
  };
  const auto before = snapshot();
  if (run.pg.rank() == run.pg.world_size() - 1) {
    std::cout << "rank " << run.pg.rank() << " " << how << " before the checkpoint" << std::endl;
    std::raise(how == "kill" ? SIGKILL : SIGSTOP);
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = error_of([&] { amp::save_fully_sharded(*run.trainer, path, kind_of(kind)); });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  check(msg.rfind("amp: ", 0) == 0, "expected an amp: error, got '" + msg + "'");
  check(secs < test_case::timeout().count() / 1000.0 + 0.5, "took " + std::to_string(secs) + " s");
  check(snapshot() == before, "the first checkpoint's files changed");
  test_case::check_no_temp_file(path);
  std::cout << "PASS die after " << secs << " s: " << msg.substr(0, msg.find('\n')).substr(0, 120) << std::endl;
  std::exit(3);  // a failed rank: tools/launch ends the stopped one
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  std::vector<std::string> a(argv + 1, argv + argc);
  if (a.empty()) fail("usage: fully_shard_ckpt_cases CASE ARGS");
  test_case::name = a[0];
  try {
    if (a[0] == "train" && a.size() == 4) {
      train(a[1], std::stoll(a[2]), a[3]);
    } else if (a[0] == "resume" && a.size() == 3) {
      resume(a[1], std::stoll(a[2]));
    } else if (a[0] == "bad" && a.size() == 2) {
      bad(a[1]);
    } else if (a[0] == "die" && a.size() == 5) {
      die(a[1], std::stoll(a[2]), a[3], a[4]);
    } else {
      fail("unknown case or arguments");
    }
  } catch (const std::exception& e) {
    fail(std::string("exception: ") + e.what());
  }
  return 0;
}
