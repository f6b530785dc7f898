// amp/distributed/detail/sharded_trainer.h: a Trainer under FullyShard as its
// checkpoints see it: its shards, names and layouts, checked against the
// Trainer's model and optimizer (ShardedModel); the stand-in for FullyShard
// while the Trainer writes or reads its archive; and rows between shards and
// whole tensors.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "amp/distributed/detail/checkpoint_entries.h"
#include "amp/distributed/detail/shard_layout.h"
#include "amp/distributed/fully_shard.h"
#include "amp/distributed/process_group.h"
#include "amp/train/cross_process.h"
#include "amp/train/gradient_sync.h"
#include "amp/train/rng_state.h"

namespace amp::detail {

// Stands in for the FullyShard in the Trainer's Stepper while the Trainer
// writes or reads its archive: its save is then allowed (the caller has made
// the archive whole or per rank), it holds every rank's generators (gathered)
// or this rank's, and a load restores this rank's from `prefix`.
class FullyShardArchiveSync : public GradientSync, public CheckpointParticipant {
 public:
  FullyShardArchiveSync(int rank, std::vector<RngStates> gathered, std::string prefix)
      : rank_(rank), gathered_(std::move(gathered)), prefix_(std::move(prefix)) {}
  void begin_backward(bool /*boundary*/) override {
    TORCH_CHECK(false, "amp: internal error: a backward ran inside a FullyShard checkpoint");
  }
  void finish_backward() override {}
  void write_rng(torch::serialize::OutputArchive& archive) const override {
    const std::vector<RngStates> all = gathered_.empty() ? std::vector<RngStates>{capture_rng()} : gathered_;
    const int first = gathered_.empty() ? rank_ : 0;
    for (size_t r = 0; r < all.size(); ++r) {
      const int rank = first + static_cast<int>(r);
      detail::write_rng(archive, all[r], "amp/rng/rank" + std::to_string(rank) + "/");
      if (rank == 0) detail::write_rng(archive, all[r], "amp/rng/");
    }
  }
  std::string rng_prefix() const override { return prefix_; }
  void write_state(torch::serialize::OutputArchive& /*archive*/) const override {}
  std::function<void()> read_state(torch::serialize::InputArchive& /*archive*/) override {
    return [] {};
  }

 private:
  int rank_;
  std::vector<RngStates> gathered_;
  std::string prefix_;
};

// What the checkpoint functions know of the FullyShard, the Trainer's model
// and its optimizer, checked.
struct ShardedModel {
  FullyShard* fsdp = nullptr;
  int rank = 0, world = 1;
  std::vector<std::string> names;
  std::vector<ShardLayout> layouts;
  std::vector<at::Tensor> shards;
  std::map<std::string, size_t> by_name;
  std::vector<std::vector<size_t>> positions;  // the optimizer's param groups, as indices of the above
  std::vector<at::Tensor> module_params;       // the model's own tensors (empty at rest), by index

  const ProcessGroup& pg() const { return fsdp->process_group(); }
  // "name:[shape];..." of every parameter: a manifest's model.
  std::string summary() const {
    std::string s;
    for (size_t i = 0; i < names.size(); ++i) s += names[i] + ":" + c10::str(at::IntArrayRef(layouts[i].shape)) + ";";
    return s;
  }
};

template <class T>
ShardedModel sharded_model(T& trainer, const char* who) {
  ShardedModel m;
  m.fsdp = dynamic_cast<FullyShard*>(trainer.stepper().gradient_sync());
  TORCH_CHECK(m.fsdp != nullptr, "amp: ", who,
              " needs a Trainer whose Stepper has the FullyShard installed "
              "(trainer.stepper().set_gradient_sync(&fsdp)); a Trainer without one saves with trainer.save(path)");
  TORCH_CHECK(trainer.stepper().micro_step() == 0, "amp: ", who,
              " was called in the middle of gradient accumulation (micro-batch ", trainer.stepper().micro_step(),
              "); call it after the step that completes the accumulation");
  TORCH_CHECK(m.fsdp->unsharded_bytes() == 0, "amp: ", who,
              " was called while FullyShard holds gathered parameters (inside a forward or backward); call it "
              "between steps");
  m.rank = m.fsdp->process_group().rank();
  m.world = m.fsdp->process_group().world_size();
  m.names = m.fsdp->names();
  m.shards = m.fsdp->parameters();
  for (const auto& shape : m.fsdp->shapes()) m.layouts.emplace_back(shape, m.world);
  for (size_t i = 0; i < m.names.size(); ++i) m.by_name[m.names[i]] = i;
  const auto named = trainer.module().named_parameters(/*recurse=*/true);
  bool same = named.size() == m.names.size();
  for (size_t i = 0; same && i < m.names.size(); ++i) same = named[i].key() == m.names[i];
  TORCH_CHECK(same, "amp: ", who,
              ": the Trainer's model is not the root module given to FullyShard (other parameter names); "
              "construct the Trainer with that root");
  for (const auto& item : named) m.module_params.push_back(item.value());
  std::map<const void*, size_t> by_impl;
  for (size_t i = 0; i < m.shards.size(); ++i) by_impl[m.shards[i].unsafeGetTensorImpl()] = i;
  const auto& groups = trainer.optimizer().param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    m.positions.emplace_back();
    for (size_t j = 0; j < groups[g].params().size(); ++j) {
      auto it = by_impl.find(groups[g].params()[j].unsafeGetTensorImpl());
      TORCH_CHECK(it != by_impl.end(), "amp: ", who, ": parameter ", j, " of the optimizer's group ", g,
                  " is not one of FullyShard's shards; build the optimizer from fsdp.parameters()");
      m.positions.back().push_back(it->second);
    }
  }
  return m;
}

// Every rank's rows of a tensor laid out as `l` (this rank's: `mine`), whole.
inline at::Tensor gather_rows(const ProcessGroup& pg, const ShardLayout& l, const at::Tensor& mine,
                              const std::string& what) {
  const int world = pg.world_size();
  at::Tensor padded = at::zeros({l.padded_numel()}, mine.options());
  if (mine.numel() > 0) padded.narrow(0, 0, mine.numel()).copy_(mine.reshape({-1}));
  at::Tensor all = padded;
  if (world > 1) {
    all = at::empty({world * l.padded_numel()}, padded.options());
    pg.allgather_into(all, padded, what);
  }
  at::Tensor whole = at::empty({l.numel()}, padded.options());
  for (int r = 0; r < world; ++r) {
    const int64_t n = l.rows_of(r) * l.inner;
    if (n > 0) whole.narrow(0, r * l.chunk * l.inner, n).copy_(all.narrow(0, r * l.padded_numel(), n));
  }
  return whole.view(l.shape);
}

// Rank r's rows of a whole tensor laid out as `l`, a copy.
inline at::Tensor rows_of(const at::Tensor& whole, const ShardLayout& l, int r) {
  const int64_t n = l.rows_of(r);
  return whole.narrow(0, std::min(r * l.chunk, l.rows), n).clone();
}

// The Trainer's Stepper holds `view` instead of the FullyShard while it lives.
template <class T>
struct SyncSwap {
  SyncSwap(T& t, GradientSync* view) : trainer(t), before(t.stepper().gradient_sync()) {
    trainer.stepper().set_gradient_sync(view);
  }
  ~SyncSwap() { trainer.stepper().set_gradient_sync(before); }
  SyncSwap(const SyncSwap&) = delete;
  SyncSwap& operator=(const SyncSwap&) = delete;
  T& trainer;
  GradientSync* before;
};

// The Trainer's archive as it writes it now (its model entries empty, its
// optimizer this rank's), with `view` installed.
template <class T>
std::string trainer_archive(T& trainer, FullyShardArchiveSync& view) {
  SyncSwap<T> swap(trainer, &view);
  std::ostringstream out;
  trainer.save_state(out);
  return out.str();
}

// The archive for the Trainer from `base` (a Trainer archive): FullyShard's
// model entries replaced by the model's own tensors, and each optimizer state
// field that `state_rows` gives (parameter index, field) replaced by it.
inline std::string rewrite_for_load(
    torch::serialize::InputArchive& base, const ShardedModel& m, const std::map<std::string, size_t>& keys,
    const std::function<std::optional<at::Tensor>(size_t, const std::string&)>& state_rows) {
  torch::serialize::OutputArchive out;
  ArchivePath path;
  copy_archive(base, out, path, [&](const ArchivePath& p) -> std::optional<at::Tensor> {
    if (p.size() >= 2 && p[0] == "model") {
      auto it = m.by_name.find(join(p, 1, p.size(), '.'));
      if (it != m.by_name.end()) return m.module_params[it->second];
    }
    if (p.size() == 4 && p[0] == "optimizer" && p[1] == "state") {
      auto it = keys.find(p[2]);
      if (it != keys.end()) return state_rows(it->second, p[3]);
    }
    return std::nullopt;
  });
  return archive_bytes(out);
}

// Where rank `rank` finds its generators in `archive`: its own entries, else
// (a one-process checkpoint loaded by one process) the plain ones.
inline std::string rng_prefix_in(torch::serialize::InputArchive& archive, int rank, int world) {
  const std::string own = "amp/rng/rank" + std::to_string(rank) + "/";
  at::Tensor t;
  if (archive.try_read(own + "cpu", t, /*is_buffer=*/true) || world > 1) return own;
  return "amp/rng/";
}

}  // namespace amp::detail
