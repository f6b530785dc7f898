// amp/distributed/detail/rank_agreement.h: FullyShard's checkpoints agree
// across ranks. agree() throws on every rank when one failed; a load is all or
// nothing: each rank checks and prepares (PreparedLoad), the ranks agree, each
// loads through Trainer::load_state (its own roll-back), the ranks agree again
// (a rank that loaded rolls back when another failed), and only then are the
// shards assigned. Every collective is bounded by the process group's timeout.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <exception>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "amp/distributed/detail/sharded_trainer.h"
#include "amp/distributed/process_group.h"
#include "amp/distributed/sharded_optimizer.h"
#include "amp/train/gradient_sync.h"

namespace amp::detail {

// Throws on every rank if any rank's `error` is not empty (the first such
// rank's message; another rank's named). A collective.
inline void agree(const ProcessGroup& pg, const std::string& error, const std::string& what) {
  const std::vector<std::string> all =
      pg.world_size() == 1 ? std::vector<std::string>{error} : allgather_bytes(pg, error, what);
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    if (static_cast<int>(r) == pg.rank()) TORCH_CHECK(false, all[r]);
    const std::string msg = all[r].rfind("amp: ", 0) == 0 ? all[r].substr(5) : all[r];
    TORCH_CHECK(false, "amp: ", what, " failed on rank ", r, ": ", msg);
  }
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return std::string("amp: ") + e.what();
  }
  return std::string();
}

// Module::load set_()s each parameter to the archive's tensor, which also
// drops the parameter's gradient accumulator (where FullyShard's hooks are):
// the model's own tensors (empty, FullyShard-managed) get their storage and
// their accumulator back afterwards.
template <class P>
std::weak_ptr<P> weak_of(const std::shared_ptr<P>& p) {  // LibTorch up to 2.x
  return p;
}
template <class P>
c10::weak_intrusive_ptr<P> weak_of(const c10::intrusive_ptr<P>& p) {  // LibTorch 2.14
  return c10::weak_intrusive_ptr<P>(p);
}
struct KeepModuleParams {
  using Accumulator = decltype(torch::autograd::impl::try_get_grad_accumulator(std::declval<const at::Tensor&>()));
  explicit KeepModuleParams(const std::vector<at::Tensor>& params) {
    for (const auto& p : params)
      kept.push_back(Kept{p, p.variable_data(), torch::autograd::impl::try_get_grad_accumulator(p)});
  }
  ~KeepModuleParams() {
    at::NoGradGuard no_grad;
    for (auto& k : kept) {
      k.param.set_(k.storage);
      if (k.accumulator) torch::autograd::impl::set_grad_accumulator(k.param, weak_of(k.accumulator));
    }
  }
  KeepModuleParams(const KeepModuleParams&) = delete;
  KeepModuleParams& operator=(const KeepModuleParams&) = delete;
  struct Kept {
    at::Tensor param, storage;
    Accumulator accumulator;
  };
  std::vector<Kept> kept;
};

// This rank's part of a load, prepared and checked: the archive the Trainer
// loads (model entries its own empty tensors, optimizer state this rank's
// rows), where its generators are, and each shard's new values.
struct PreparedLoad {
  std::string archive;
  std::string rng_prefix;
  std::vector<at::Tensor> rows;
};

// Loads `p` on every rank, all or nothing (see the banner).
template <class T>
void apply_prepared(T& trainer, ShardedModel& m, const std::string& prepare_error, PreparedLoad& p,
                    const std::string& what) {
  const ProcessGroup& pg = m.pg();
  agree(pg, prepare_error, what);
  const std::string own = "amp/rng/rank" + std::to_string(m.rank) + "/";
  std::string before;
  std::string error = error_of([&] {
    FullyShardArchiveSync snapshot_view(m.rank, {}, own);
    before = trainer_archive(trainer, snapshot_view);
    FullyShardArchiveSync view(m.rank, {}, p.rng_prefix);
    SyncSwap<T> swap(trainer, &view);
    KeepModuleParams keep(m.module_params);
    std::istringstream in(p.archive);
    trainer.load_state(in);
  });
  // Trainer::load_state reads the prepared archive, not the file: its refusal names the file here.
  if (!error.empty()) error = "amp: " + what + ": " + (error.rfind("amp: ", 0) == 0 ? error.substr(5) : error);
  try {
    agree(pg, error, what);
  } catch (...) {
    if (error.empty() && !before.empty()) {  // this rank loaded, another did not: back to before
      FullyShardArchiveSync view(m.rank, {}, own);
      SyncSwap<T> swap(trainer, &view);
      KeepModuleParams keep(m.module_params);
      std::istringstream in(before);
      trainer.load_state(in);
    }
    throw;
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < m.shards.size(); ++i) m.shards[i].copy_(p.rows[i]);
}

}  // namespace amp::detail
