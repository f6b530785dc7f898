// amp/distributed/detail/sharded_checkpoint.h: FullyShard's sharded
// checkpoint. Each rank writes its own Trainer archive, whose model entries
// are its unpadded shards and whose optimizer holds its shards' state
// (atomically), then rank 0 writes the manifest at the path (atomically, last,
// once every rank's file is written; shard_manifest.h). The previous save's
// files are removed after the new manifest is in place, so the path always
// names a complete set. A load checks the manifest and each file it reads
// before anything changes; at the saved world size each rank reads its own
// file, at another every rank reads every file and takes its rows (re-sharding
// needs elementwise optimizer state).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/detail/atomic_file.h"
#include "amp/detail/checked_archive.h"
#include "amp/detail/zip_bytes.h"
#include "amp/distributed/detail/checkpoint_entries.h"
#include "amp/distributed/detail/rank_agreement.h"
#include "amp/distributed/detail/shard_layout.h"
#include "amp/distributed/detail/shard_manifest.h"
#include "amp/distributed/detail/sharded_trainer.h"
#include "amp/distributed/process_group.h"
#include "amp/distributed/sharded_optimizer.h"

namespace amp::detail {

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
  // The save's id: rank 0's, on every rank.
  std::string id = m.rank == 0 ? new_save_id() : std::string(16, '0');
  if (m.world > 1) id = allgather_bytes(pg, id, what + "'s id")[0];
  const std::string name = rank_file_name(path, id, m.rank);
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
      write_manifest(path, id, std::decay_t<T>::precision_name, m.summary(), records);
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

}  // namespace amp::detail
