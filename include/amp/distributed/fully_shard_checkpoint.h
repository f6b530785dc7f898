// amp/distributed/fully_shard_checkpoint.h: checkpoints of a Trainer that
// trains under FullyShard, in two formats, written and read by every rank
// together.
//
//   trainer.stepper().set_gradient_sync(&fsdp);    // the Trainer's model is FullyShard's root
//   amp::save_fully_sharded(trainer, "ckpt.pt");   // consolidated: rank 0 writes one Trainer checkpoint
//   amp::save_fully_sharded(trainer, "ckpt.pt", amp::FullyShardCheckpoint::kSharded);
//   amp::load_fully_sharded(trainer, "ckpt.pt");   // either format, this or another world size
//
// The formats: detail/consolidated_checkpoint.h (one plain Trainer file) and
// detail/sharded_checkpoint.h (a file per rank and a manifest with each file's
// size and CRC-32, detail/shard_manifest.h); a load is all or nothing on every
// rank (detail/rank_agreement.h). docs/checkpoints.md: the formats.
#pragma once

#include <ATen/ATen.h>
#include <torch/serialize/input-archive.h>

#include <string>

#include "amp/detail/checked_archive.h"
#include "amp/distributed/detail/consolidated_checkpoint.h"
#include "amp/distributed/detail/rank_agreement.h"
#include "amp/distributed/detail/shard_manifest.h"
#include "amp/distributed/detail/sharded_checkpoint.h"
#include "amp/distributed/detail/sharded_trainer.h"

namespace amp {

// The two formats of save_fully_sharded (load_fully_sharded reads either).
enum class FullyShardCheckpoint {
  kConsolidated,  // one file, a plain Trainer checkpoint of the whole model: rank 0 writes it
  kSharded,       // a file per rank and a manifest: each rank writes its shards
};

// Saves `trainer` (whose Stepper has a FullyShard installed and whose model is
// its root) to `path`: kConsolidated, one Trainer checkpoint of the whole
// model that rank 0 writes; kSharded, a file per rank and a manifest. Call on
// every rank, between steps; every rank returns once the checkpoint is complete, or throws the same amp: error. The
// previous checkpoint at `path` stays until the new one is complete.
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
