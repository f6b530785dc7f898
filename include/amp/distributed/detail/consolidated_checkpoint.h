// amp/distributed/detail/consolidated_checkpoint.h: FullyShard's consolidated
// checkpoint, one plain Trainer checkpoint of the whole model. Every rank's
// shards are all-gathered (fp32, unpadded), and so is each parameter's
// optimizer state, field by field (a state tensor of its shard's shape is
// concatenated along dim 0; any other field must be equal on every rank and is
// written once); rank 0 writes the archive Trainer::save writes for the
// unsharded model (amp/train/checkpoint.h), with every rank's random
// generators under "amp/rng/rank<r>/" as DataParallel's, atomically. A plain
// Trainer in one process loads it; FullyShard at any world size loads it into
// its shards.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/detail/atomic_file.h"
#include "amp/detail/checked_archive.h"
#include "amp/distributed/detail/checkpoint_entries.h"
#include "amp/distributed/detail/data_parallel_impl.h"
#include "amp/distributed/detail/rank_agreement.h"
#include "amp/distributed/detail/sharded_trainer.h"
#include "amp/distributed/process_group.h"
#include "amp/train/checkpoint.h"
#include "amp/train/rng_state.h"

namespace amp::detail {

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

}  // namespace amp::detail
