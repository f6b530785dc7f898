// amp/distributed/fully_shard_checkpoint.h: checkpoints of a Trainer that
// trains under FullyShard, in two formats, written and read by every rank
// together.
//
//   trainer.stepper().set_gradient_sync(&fsdp);    // the Trainer's model is FullyShard's root
//   amp::save_fully_sharded(trainer, "ckpt.pt");   // consolidated: rank 0 writes one Trainer checkpoint
//   amp::save_fully_sharded(trainer, "ckpt.pt", amp::FullyShardCheckpoint::kSharded);
//   amp::load_fully_sharded(trainer, "ckpt.pt");   // either format, this or another world size
//
// Consolidated: every rank's shards are all-gathered (fp32, unpadded), and so
// is each parameter's optimizer state, field by field (a state tensor of its
// shard's shape is concatenated along dim 0; any other field must be equal on
// every rank and is written once); rank 0 writes the archive Trainer::save
// writes for the unsharded model (amp/train/checkpoint.h), with every rank's
// random generators under "amp/rng/rank<r>/" as DataParallel's, atomically. A
// plain Trainer in one process loads it; FullyShard at any world size loads it
// into its shards.
//
// Sharded: each rank writes its own Trainer archive, whose model entries are
// its unpadded shards and whose optimizer holds its shards' state, to
// "<path>.<id>.rank<r>" (atomically; <id>: 16 hex digits, new per save), then
// rank 0 writes the manifest at `path` (atomically, last, once every rank's
// file is written): the world size, the id, each file's name, size and CRC-32
// and the model's parameter names and shapes. The previous save's files are
// removed after the new manifest is in place, so `path` always names a
// complete set. A load checks the manifest and each file it reads (size,
// CRC-32, id, rank) before anything changes; at the saved world size each
// rank reads its own file, at another every rank reads every file and takes
// its rows (re-sharding needs elementwise optimizer state).
//
// A load is all or nothing on every rank: each rank checks and prepares, the
// ranks agree, each loads through Trainer::load_state (its own roll-back), the
// ranks agree again (a rank that loaded rolls back when another failed), and
// only then are the shards assigned. Every collective is bounded by the
// process group's timeout. docs/checkpoints.md: the formats.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "amp/detail/atomic_file.h"
#include "amp/detail/checked_archive.h"
#include "amp/detail/zip_check.h"
#include "amp/distributed/detail/data_parallel_impl.h"
#include "amp/distributed/detail/shard_layout.h"
#include "amp/distributed/fully_shard.h"
#include "amp/distributed/process_group.h"
#include "amp/distributed/sharded_optimizer.h"
#include "amp/train/checkpoint.h"
#include "amp/train/cross_process.h"
#include "amp/train/gradient_sync.h"
#include "amp/train/rng_state.h"

namespace amp {

// The two formats of save_fully_sharded (load_fully_sharded reads either).
enum class FullyShardCheckpoint {
  kConsolidated,  // one file, a plain Trainer checkpoint of the whole model: rank 0 writes it
  kSharded,       // a file per rank and a manifest: each rank writes its shards
};

namespace detail {

using ArchivePath = std::vector<std::string>;
using TensorSubstitute = std::function<std::optional<at::Tensor>(const ArchivePath&)>;

// Copies `in` into `out` entry by entry (sub-archives recursively); a tensor
// is replaced by substitute(its path) where that returns one.
inline void copy_archive(torch::serialize::InputArchive& in, torch::serialize::OutputArchive& out, ArchivePath& path,
                         const TensorSubstitute& substitute) {
  for (const std::string& key : in.keys()) {
    path.push_back(key);
    torch::serialize::InputArchive sub;
    if (in.try_read(key, sub)) {
      torch::serialize::OutputArchive copy(out.compilation_unit());
      copy_archive(sub, copy, path, substitute);
      out.write(key, copy);
    } else {
      c10::IValue v;
      in.read(key, v);
      if (v.isTensor()) {
        const std::optional<at::Tensor> t = substitute(path);
        out.write(key, t ? *t : v.toTensor(), /*is_buffer=*/true);
      } else {
        out.write(key, v);
      }
    }
    path.pop_back();
  }
}

inline std::string archive_bytes(torch::serialize::OutputArchive& archive) {
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

inline std::string join(const std::vector<std::string>& parts, size_t begin, size_t end, char sep) {
  std::string out;
  for (size_t i = begin; i < end; ++i) out += (i > begin ? std::string(1, sep) : std::string()) + parts[i];
  return out;
}

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

// The optimizer archive's state keys, by parameter index: its param_groups'
// lists, position by position against the optimizer's (`positions`).
inline std::map<std::string, size_t> state_keys(torch::serialize::InputArchive& optim,
                                                const std::vector<std::vector<size_t>>& positions,
                                                const std::string& source) {
  auto fail = [&](const std::string& why) {
    TORCH_CHECK(false, "amp: ", source, ": its optimizer ", why,
                ": it was written for another optimizer or model, or is damaged");
  };
  torch::serialize::InputArchive groups;
  at::Tensor count;
  if (!optim.try_read("param_groups", groups) || !groups.try_read("param_groups/size", count) || count.numel() != 1)
    fail("has no parameter groups");
  if (count.item<int64_t>() != static_cast<int64_t>(positions.size()))
    fail("has " + std::to_string(count.item<int64_t>()) + " parameter groups where this one has " +
         std::to_string(positions.size()));
  std::map<std::string, size_t> keys;
  for (size_t g = 0; g < positions.size(); ++g) {
    torch::serialize::InputArchive group;
    at::Tensor n;
    if (!groups.try_read("param_groups/" + std::to_string(g), group) || !group.try_read("params/size", n) ||
        n.numel() != 1 || n.item<int64_t>() != static_cast<int64_t>(positions[g].size()))
      fail("has another number of parameters in group " + std::to_string(g));
    for (size_t j = 0; j < positions[g].size(); ++j) {
      c10::IValue key;
      if (!group.try_read("params/" + std::to_string(j), key) || !key.isString())
        fail("lacks parameter " + std::to_string(j) + " of group " + std::to_string(g));
      keys[key.toStringRef()] = positions[g][j];
    }
  }
  return keys;
}

// A parameter's optimizer state in an archive: field name -> value.
using StateFields = std::map<std::string, c10::IValue>;

// Each parameter's state fields in `optim` (an optimizer's archive), by index.
inline std::map<size_t, StateFields> read_state_fields(torch::serialize::InputArchive& optim,
                                                       const std::map<std::string, size_t>& keys,
                                                       const std::string& source) {
  std::map<size_t, StateFields> out;
  torch::serialize::InputArchive state;
  if (!optim.try_read("state", state)) return out;
  for (const std::string& key : state.keys()) {
    auto it = keys.find(key);
    TORCH_CHECK(it != keys.end(), "amp: ", source, ": its optimizer holds state for '", key,
                "', which none of its parameter groups lists: it is damaged");
    torch::serialize::InputArchive fields;
    TORCH_CHECK(state.try_read(key, fields), "amp: ", source, ": its optimizer state '", key, "' is damaged");
    StateFields f;
    for (const std::string& name : fields.keys()) {
      c10::IValue v;
      fields.read(name, v);
      f[name] = v;
    }
    out[it->second] = std::move(f);
  }
  return out;
}

// Whether a state field is elementwise with a tensor of `shape` (sharded with it).
inline bool elementwise(const c10::IValue& v, at::IntArrayRef shape) {
  return v.isTensor() && v.toTensor().defined() && v.toTensor().dim() >= 1 && v.toTensor().sizes() == shape;
}

// The tensor under `name` ("blocks.0.fc1.weight") in a model archive.
inline std::optional<at::Tensor> read_model_entry(torch::serialize::InputArchive& model, const std::string& name) {
  std::vector<std::string> parts;
  std::stringstream ss(name);
  for (std::string part; std::getline(ss, part, '.');) parts.push_back(part);
  std::vector<torch::serialize::InputArchive> chain(parts.size());
  torch::serialize::InputArchive* here = &model;
  for (size_t k = 0; k + 1 < parts.size(); ++k) {
    if (!here->try_read(parts[k], chain[k])) return std::nullopt;
    here = &chain[k];
  }
  at::Tensor t;
  if (!here->try_read(parts.back(), t)) return std::nullopt;
  return t;
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

// The Trainer's archive as it writes it now (its model entries empty, its
// optimizer this rank's), with `view` installed.
template <class T>
std::string trainer_archive(T& trainer, FullyShardArchiveSync& view) {
  SyncSwap<T> swap(trainer, &view);
  std::ostringstream out;
  trainer.save_state(out);
  return out.str();
}

inline std::string crc_hex(const std::string& bytes) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08x", static_cast<unsigned>(crc32(0, bytes.data(), bytes.size())));
  return buf;
}

// A parameter's state fields as one line: elementwise ones (with `shape`) by
// dtype, others by value (tensors by dtype, shape and CRC-32).
inline std::string describe_fields(const StateFields& fields, at::IntArrayRef shape) {
  std::string s;
  for (const auto& kv : fields) {
    s += kv.first + "=";
    if (elementwise(kv.second, shape)) {
      s += "E" + std::string(c10::toString(kv.second.toTensor().scalar_type()));
    } else if (kv.second.isTensor() && kv.second.toTensor().defined()) {
      const at::Tensor t = kv.second.toTensor().contiguous().to(at::kCPU);
      s += "T" + std::string(c10::toString(t.scalar_type())) + c10::str(t.sizes()) +
           crc_hex(std::string(static_cast<const char*>(t.data_ptr()), t.nbytes()));
    } else {
      std::ostringstream v;
      v << kv.second;
      s += "V" + v.str();
    }
    s += ",";
  }
  return s;
}

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

// ---- consolidated ----

inline std::string crc_hex_of(int64_t crc) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08x", static_cast<unsigned>(crc));
  return buf;
}

// A model entry of `source` for parameter `name`: there, fp32, of `shape`.
inline void check_entry(const std::optional<at::Tensor>& t, at::IntArrayRef shape, const std::string& source,
                        const std::string& name) {
  TORCH_CHECK(t && t->defined(), "amp: ", source, " has no 'model/", name,
              "' for this model: it was written for another model, or is damaged");
  TORCH_CHECK(t->sizes() == shape && t->scalar_type() == at::kFloat, "amp: ", source, "'s 'model/", name, "' is ",
              t->toString(), c10::str(t->sizes()), " but this model's is Float", c10::str(shape),
              ": it was written for another model, or is damaged");
}

template <class T>
void save_consolidated(T& trainer, ShardedModel& m, const std::string& path) {
  const ProcessGroup& pg = m.pg();
  const std::string what = "save_fully_sharded('" + path + "')";
  trainer.stepper().sync_optimizer_state();
  const std::vector<RngStates> rngs = allgather_rng(pg, capture_rng());
  std::string bytes, schema;
  torch::serialize::InputArchive archive;
  std::map<std::string, size_t> keys;
  std::map<size_t, StateFields> fields;
  std::string error = error_of([&] {
    FullyShardArchiveSync view(m.rank, m.rank == 0 ? rngs : std::vector<RngStates>{}, "");
    bytes = trainer_archive(trainer, view);
    archive = read_archive(bytes, pg.device(), "the Trainer's state", "its save_state()");
    torch::serialize::InputArchive optim;
    archive.read("optimizer", optim);
    keys = state_keys(optim, m.positions, "the Trainer's state");
    fields = read_state_fields(optim, keys, "the Trainer's state");
    for (const auto& kv : fields)
      schema += m.names[kv.first] + "{" + describe_fields(kv.second, m.layouts[kv.first].shard_shape(m.rank)) + "}";
  });
  agree(pg, error, what);
  const std::vector<std::string> schemas =
      m.world == 1 ? std::vector<std::string>{schema} : allgather_bytes(pg, schema, what + "'s state check");
  for (size_t r = 1; r < schemas.size(); ++r)
    TORCH_CHECK(schemas[r] == schemas[0], "amp: ", what, ": the optimizer's state differs between rank 0 and rank ", r,
                " in more than elementwise tensors of each shard's shape (rank 0: ", schemas[0].substr(0, 200),
                " ...; rank ", r, ": ", schemas[r].substr(0, 200),
                " ...), so it has no consolidated form; save FullyShardCheckpoint::kSharded and resume at this world "
                "size");
  // Every parameter, then each elementwise state field, whole on every rank (rank 0 keeps them).
  std::vector<at::Tensor> whole(m.names.size());
  std::map<std::pair<size_t, std::string>, at::Tensor> whole_state;
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < m.names.size(); ++i) {
      at::Tensor t = gather_rows(pg, m.layouts[i], m.shards[i].detach(), what + "'s parameter gather");
      if (m.rank == 0) whole[i] = t;
    }
    for (const auto& kv : fields)
      for (const auto& f : kv.second) {
        if (!elementwise(f.second, m.layouts[kv.first].shard_shape(m.rank))) continue;
        at::Tensor t =
            gather_rows(pg, m.layouts[kv.first], f.second.toTensor().contiguous(), what + "'s optimizer state gather");
        if (m.rank == 0) whole_state[{kv.first, f.first}] = t;
      }
  }
  error.clear();
  if (m.rank == 0) {
    error = error_of([&] {
      torch::serialize::OutputArchive out;
      ArchivePath p;
      copy_archive(archive, out, p, [&](const ArchivePath& e) -> std::optional<at::Tensor> {
        if (e.size() >= 2 && e[0] == "model") {
          auto it = m.by_name.find(join(e, 1, e.size(), '.'));
          if (it != m.by_name.end()) return whole[it->second];
        }
        if (e.size() == 4 && e[0] == "optimizer" && e[1] == "state") {
          auto k = keys.find(e[2]);
          if (k != keys.end()) {
            auto s = whole_state.find({k->second, e[3]});
            if (s != whole_state.end()) return s->second;
          }
        }
        return std::nullopt;
      });
      atomic_write(path, [&](const std::string& tmp) { out.save_to(tmp); });
    });
  }
  // Rank 0's result on every rank.
  at::Tensor ok = at::full({1}, error.empty() ? 1 : 0, at::kInt);
  if (m.world > 1) pg.broadcast(ok, 0, what + "'s status");
  TORCH_CHECK(error.empty(), error);
  TORCH_CHECK(ok.item<int>() == 1, "amp: rank 0 could not write the consolidated checkpoint '", path, "'");
}

template <class T>
void load_consolidated(ShardedModel& m, const std::string& path, torch::serialize::InputArchive& file,
                       PreparedLoad& p) {
  const std::string source = "checkpoint '" + path + "'";
  check_header(file, path, std::decay_t<T>::precision_name, "Trainer");
  torch::serialize::InputArchive model, optim;
  TORCH_CHECK(file.try_read("model", model) && file.try_read("optimizer", optim), "amp: ", source,
              " has no model or optimizer: it is damaged");
  for (size_t i = 0; i < m.names.size(); ++i) {
    std::optional<at::Tensor> t = read_model_entry(model, m.names[i]);
    check_entry(t, m.layouts[i].shape, source, m.names[i]);
    p.rows.push_back(rows_of(*t, m.layouts[i], m.rank));
  }
  const std::map<std::string, size_t> keys = state_keys(optim, m.positions, source);
  // The state fields of each parameter's whole shape become this rank's rows.
  const std::map<size_t, StateFields> fields = read_state_fields(optim, keys, source);
  p.archive = rewrite_for_load(file, m, keys, [&](size_t i, const std::string& field) -> std::optional<at::Tensor> {
    auto f = fields.find(i);
    if (f == fields.end()) return std::nullopt;
    auto v = f->second.find(field);
    if (v == f->second.end() || !elementwise(v->second, m.layouts[i].shape)) return std::nullopt;
    return rows_of(v->second.toTensor(), m.layouts[i], m.rank);
  });
  p.rng_prefix = rng_prefix_in(file, m.rank, m.world);
}

// ---- sharded ----

inline constexpr int64_t kShardedManifestFormat = 1;

inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "amp: could not open '", path, "'");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
}

// A sharded checkpoint's manifest, read and checked.
struct Manifest {
  std::string id, precision, model;
  int world = 0;
  std::vector<std::string> files;  // paths (the manifest's directory + the names it holds)
  std::vector<int64_t> sizes, crcs;
};

inline bool is_manifest(torch::serialize::InputArchive& archive) {
  c10::IValue v;
  return archive.try_read("amp/fully_shard/manifest", v);
}

inline Manifest read_manifest(torch::serialize::InputArchive& archive, const std::string& path) {
  Manifest mf;
  auto get = [&](const std::string& key) {
    c10::IValue v;
    TORCH_CHECK(archive.try_read(key, v), "amp: the sharded checkpoint '", path, "' has no '", key, "': it is damaged");
    return v;
  };
  const c10::IValue format = get("amp/fully_shard/manifest");
  TORCH_CHECK(format.isInt() && format.toInt() == kShardedManifestFormat, "amp: the sharded checkpoint '", path,
              "' has format ", format, ", this amp reads format ", kShardedManifestFormat);
  const c10::IValue id = get("amp/fully_shard/id"), precision = get("amp/fully_shard/precision"),
                    model = get("amp/fully_shard/model"), world = get("amp/fully_shard/world");
  TORCH_CHECK(id.isString() && precision.isString() && model.isString() && world.isInt() && world.toInt() >= 1,
              "amp: the sharded checkpoint '", path, "' is damaged (its id, precision, model or world size)");
  mf.id = id.toStringRef();
  mf.precision = precision.toStringRef();
  mf.model = model.toStringRef();
  mf.world = static_cast<int>(world.toInt());
  for (int r = 0; r < mf.world; ++r) {
    const std::string n = std::to_string(r);
    const c10::IValue file = get("amp/fully_shard/file" + n), size = get("amp/fully_shard/size" + n),
                      crc = get("amp/fully_shard/crc" + n);
    TORCH_CHECK(file.isString() && size.isInt() && crc.isInt() && file.toStringRef().find('/') == std::string::npos,
                "amp: the sharded checkpoint '", path, "' is damaged (rank ", r, "'s file entry)");
    mf.files.push_back(directory_of(path) + file.toStringRef());
    mf.sizes.push_back(size.toInt());
    mf.crcs.push_back(crc.toInt());
  }
  return mf;
}

// Rank r's file of the set: its size and CRC-32 as the manifest says, its
// id, rank and world size the manifest's.
inline torch::serialize::InputArchive open_rank_file(const Manifest& mf, int r, const std::string& path,
                                                     const c10::Device& device) {
  const std::string& file = mf.files[static_cast<size_t>(r)];
  std::ifstream probe(file, std::ios::binary);
  TORCH_CHECK(probe.good(), "amp: the sharded checkpoint '", path, "' lacks rank ", r, "'s file '", file,
              "'; it was removed, or the set was not copied whole");
  probe.close();
  const std::string bytes = file_bytes(file);
  TORCH_CHECK(static_cast<int64_t>(bytes.size()) == mf.sizes[static_cast<size_t>(r)] &&
                  static_cast<int64_t>(crc32(0, bytes.data(), bytes.size())) == mf.crcs[static_cast<size_t>(r)],
              "amp: rank ", r, "'s file '", file, "' of the sharded checkpoint '", path,
              "' does not match the manifest (", bytes.size(), " bytes, CRC-32 ", crc_hex(bytes),
              "; the manifest says ", mf.sizes[static_cast<size_t>(r)], " bytes, ",
              crc_hex_of(mf.crcs[static_cast<size_t>(r)]), "): it is damaged or from another save");
  torch::serialize::InputArchive a = read_archive(bytes, device, "checkpoint '" + file + "'",
                                                  "rank " + std::to_string(r) + "'s file of a sharded checkpoint");
  c10::IValue id, rank, world;
  TORCH_CHECK(a.try_read("amp/fully_shard/id", id) && a.try_read("amp/fully_shard/rank", rank) &&
                  a.try_read("amp/fully_shard/world", world) && id.isString() && id.toStringRef() == mf.id &&
                  rank.isInt() && rank.toInt() == r && world.isInt() && world.toInt() == mf.world,
              "amp: '", file, "' is not rank ", r, "'s file of the save that the sharded checkpoint '", path,
              "' names (id ", mf.id, "): a file from another save");
  return a;
}

// Every rank's file, or this rank's alone at the saved world size, into `p`.
template <class T>
void load_sharded(ShardedModel& m, const std::string& path, torch::serialize::InputArchive& manifest, PreparedLoad& p) {
  const Manifest mf = read_manifest(manifest, path);
  const std::string precision = std::decay_t<T>::precision_name;
  TORCH_CHECK(mf.precision == precision, "amp: the sharded checkpoint '", path, "' was saved under precision \"",
              mf.precision, "\" but this Trainer's policy is \"", precision,
              "\"; load it into a Trainer of that policy");
  TORCH_CHECK(mf.model == m.summary(), "amp: the sharded checkpoint '", path,
              "' was written for another model (its parameter names and shapes differ from this one's)");
  const c10::Device device = m.pg().device();
  const int base_rank = m.rank < mf.world ? m.rank : 0;
  std::vector<torch::serialize::InputArchive> files(static_cast<size_t>(mf.world));
  const bool same = mf.world == m.world;
  for (int r = 0; r < mf.world; ++r)
    if (!same || r == base_rank) files[static_cast<size_t>(r)] = open_rank_file(mf, r, path, device);
  torch::serialize::InputArchive& base = files[static_cast<size_t>(base_rank)];
  std::vector<ShardLayout> saved;
  for (const auto& l : m.layouts) saved.emplace_back(l.shape, mf.world);
  // Each file's model and optimizer state.
  std::vector<std::map<size_t, StateFields>> fields(files.size());
  std::vector<std::map<std::string, size_t>> keys(files.size());
  std::vector<std::vector<at::Tensor>> shards(files.size());
  for (int r = 0; r < mf.world; ++r) {
    if (same && r != base_rank) continue;
    const auto k = static_cast<size_t>(r);
    const std::string source = "checkpoint '" + mf.files[k] + "'";
    torch::serialize::InputArchive model, optim;
    TORCH_CHECK(files[k].try_read("model", model) && files[k].try_read("optimizer", optim), "amp: ", source,
                " has no model or optimizer: it is damaged");
    for (size_t i = 0; i < m.names.size(); ++i) {
      std::optional<at::Tensor> t = read_model_entry(model, m.names[i]);
      check_entry(t, saved[i].shard_shape(r), source, m.names[i]);
      shards[k].push_back(*t);
    }
    keys[k] = state_keys(optim, m.positions, source);
    fields[k] = read_state_fields(optim, keys[k], source);
  }
  const auto b = static_cast<size_t>(base_rank);
  if (same) {
    for (size_t i = 0; i < m.names.size(); ++i) p.rows.push_back(shards[b][i].clone());
    p.archive = rewrite_for_load(base, m, keys[b], [](size_t, const std::string&) { return std::nullopt; });
  } else {
    auto whole = [&](const std::function<at::Tensor(size_t)>& part) {
      std::vector<at::Tensor> parts;
      for (size_t r = 0; r < files.size(); ++r) parts.push_back(part(r));
      return at::cat(parts, 0);
    };
    for (size_t i = 0; i < m.names.size(); ++i)
      p.rows.push_back(rows_of(whole([&](size_t r) { return shards[r][i]; }), m.layouts[i], m.rank));
    std::map<std::pair<size_t, std::string>, at::Tensor> state_rows;
    for (const auto& kv : fields[b]) {
      const size_t i = kv.first;
      for (const auto& f : kv.second) {
        if (!elementwise(f.second, saved[i].shard_shape(base_rank))) continue;
        state_rows[{i, f.first}] =
            rows_of(whole([&](size_t r) {
                      auto s = fields[r].find(i);
                      const c10::IValue* v = nullptr;
                      if (s != fields[r].end()) {
                        auto it = s->second.find(f.first);
                        if (it != s->second.end()) v = &it->second;
                      }
                      TORCH_CHECK(v != nullptr && elementwise(*v, saved[i].shard_shape(static_cast<int>(r))),
                                  "amp: the optimizer state '", f.first, "' of '", m.names[i], "' in '", mf.files[r],
                                  "' is not elementwise with its shard, so the set cannot "
                                  "be re-sharded; load it at its world size, ",
                                  mf.world);
                      return v->toTensor();
                    }),
                    m.layouts[i], m.rank);
      }
    }
    p.archive =
        rewrite_for_load(base, m, keys[b], [&](size_t i, const std::string& field) -> std::optional<at::Tensor> {
          auto it = state_rows.find({i, field});
          if (it == state_rows.end()) return std::nullopt;
          return it->second;
        });
  }
  p.rng_prefix = "amp/rng/rank" + std::to_string(m.rank) + "/";
}

inline std::string new_save_id() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                     static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

template <class T>
void save_sharded(T& trainer, ShardedModel& m, const std::string& path) {
  const ProcessGroup& pg = m.pg();
  const std::string what = "save_fully_sharded('" + path + "', kSharded)";
  trainer.stepper().sync_optimizer_state();
  // The save's id: rank 0's, on every rank (16 hex digits as two int64 halves).
  std::string id = m.rank == 0 ? new_save_id() : std::string(16, '0');
  if (m.world > 1) id = allgather_bytes(pg, id, what + "'s id")[0];
  const std::string name = path.substr(directory_of(path).size()) + "." + id + ".rank" + std::to_string(m.rank);
  const std::string file = directory_of(path) + name;
  bool written = false;
  std::string record;
  const std::string error = error_of([&] {
    FullyShardArchiveSync view(m.rank, {}, "");
    const std::string bytes = trainer_archive(trainer, view);
    torch::serialize::InputArchive archive =
        read_archive(bytes, pg.device(), "the Trainer's state", "its save_state()");
    torch::serialize::OutputArchive out;
    ArchivePath entry;
    copy_archive(archive, out, entry, [&](const ArchivePath& e) -> std::optional<at::Tensor> {
      if (e.size() >= 2 && e[0] == "model") {
        auto it = m.by_name.find(join(e, 1, e.size(), '.'));
        if (it != m.by_name.end()) return m.shards[it->second].detach();
      }
      return std::nullopt;
    });
    out.write("amp/fully_shard/id", c10::IValue(id));
    out.write("amp/fully_shard/rank", c10::IValue(static_cast<int64_t>(m.rank)));
    out.write("amp/fully_shard/world", c10::IValue(static_cast<int64_t>(m.world)));
    const std::string data = archive_bytes(out);
    atomic_write(file, [&](const std::string& tmp) {
      std::ofstream f(tmp, std::ios::binary);
      f.write(data.data(), static_cast<std::streamsize>(data.size()));
      f.close();
      TORCH_CHECK(f.good(), "amp: could not write '", tmp, "'");
    });
    written = true;
    record = std::to_string(data.size()) + " " + std::to_string(crc32(0, data.data(), data.size()));
  });
  auto drop_mine = [&] {
    if (written) std::remove(file.c_str());
  };
  try {
    agree(pg, error, what);
  } catch (...) {
    drop_mine();
    throw;
  }
  const std::vector<std::string> records =
      m.world == 1 ? std::vector<std::string>{record} : allgather_bytes(pg, record, what + "'s file records");
  // Rank 0: the manifest, last, once every rank's file is in place.
  std::string status;
  std::vector<std::string> old_files;
  if (m.rank == 0) {
    status = error_of([&] {
      {
        const std::string previous = error_of([&] {
          torch::serialize::InputArchive old = read_archive(path, pg.device(), "the previous checkpoint");
          if (is_manifest(old)) old_files = read_manifest(old, path).files;
        });
        (void)previous;  // none, or not a sharded one: nothing to remove
      }
      torch::serialize::OutputArchive mfa;
      mfa.write("amp/fully_shard/manifest", c10::IValue(kShardedManifestFormat));
      mfa.write("amp/fully_shard/id", c10::IValue(id));
      mfa.write("amp/fully_shard/precision", c10::IValue(std::string(std::decay_t<T>::precision_name)));
      mfa.write("amp/fully_shard/model", c10::IValue(m.summary()));
      mfa.write("amp/fully_shard/world", c10::IValue(static_cast<int64_t>(m.world)));
      const std::string base = path.substr(directory_of(path).size());
      for (int r = 0; r < m.world; ++r) {
        std::istringstream in(records[static_cast<size_t>(r)]);
        int64_t size = -1, crc = -1;
        in >> size >> crc;
        const std::string n = std::to_string(r);
        mfa.write("amp/fully_shard/file" + n, c10::IValue(base + "." + id + ".rank" + n));
        mfa.write("amp/fully_shard/size" + n, c10::IValue(size));
        mfa.write("amp/fully_shard/crc" + n, c10::IValue(crc));
      }
      atomic_write(path, [&](const std::string& tmp) { mfa.save_to(tmp); });
      // The previous save's files, now that the manifest names the new ones.
      for (const auto& f : old_files)
        if (f.find("." + id + ".rank") == std::string::npos) std::remove(f.c_str());
    });
  }
  at::Tensor ok = at::full({1}, status.empty() ? 1 : 0, at::kInt);
  if (m.world > 1) pg.broadcast(ok, 0, what + "'s manifest status");
  if (ok.item<int>() != 1) {
    drop_mine();
    TORCH_CHECK(status.empty(), status);
    TORCH_CHECK(false, "amp: rank 0 could not write the manifest of the sharded checkpoint '", path, "'");
  }
}

}  // namespace detail

// Saves `trainer` (whose Stepper has a FullyShard installed and whose model is
// its root) to `path`: kConsolidated, one Trainer checkpoint of the whole
// model that rank 0 writes; kSharded, a file per rank and a manifest (see the
// banner). Call on every rank, between steps; every rank returns once the
// checkpoint is complete, or throws the same amp: error. The previous
// checkpoint at `path` stays until the new one is complete.
template <class T>
void save_fully_sharded(T& trainer, const std::string& path,
                        FullyShardCheckpoint kind = FullyShardCheckpoint::kConsolidated) {
  detail::ShardedModel m = detail::sharded_model(trainer, "save_fully_sharded");
  if (kind == FullyShardCheckpoint::kConsolidated)
    detail::save_consolidated(trainer, m, path);
  else
    detail::save_sharded(trainer, m, path);
}

// Loads a checkpoint of either format (or one a plain Trainer wrote) into
// `trainer`'s shards, at the world size it was written at or another. Call on
// every rank; on any failure (another model or policy, a missing, damaged or
// stale file, a rank that cannot load) every rank throws an amp: error and
// nothing has changed.
template <class T>
void load_fully_sharded(T& trainer, const std::string& path) {
  detail::ShardedModel m = detail::sharded_model(trainer, "load_fully_sharded");
  detail::PreparedLoad p;
  const std::string error = detail::error_of([&] {
    torch::serialize::InputArchive file =
        detail::read_archive(path, m.pg().device(), "a checkpoint written by amp::save_fully_sharded");
    if (detail::is_manifest(file))
      detail::load_sharded<T>(m, path, file, p);
    else
      detail::load_consolidated<T>(m, path, file, p);
  });
  detail::apply_prepared(trainer, m, error, p, "load_fully_sharded('" + path + "')");
}

}  // namespace amp
