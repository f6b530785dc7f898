// amp/train/cross_process.h: what training on several processes
// changes beside the gradients (GradientSync), one interface per concern:
// Float8 delayed scaling's amaxes agreed across processes (AmaxReduce), and
// checkpoints that hold every process's generators and the sync's own state
// (CheckpointParticipant). DataParallel implements both beside its
// GradientSync; Trainer and Fabric find them on the GradientSync installed
// (a cross-cast). Without one, or with a GradientSync that has neither, each
// is what one process needs: nothing to reduce, this process's generators.
//
//   float8_.update(detail::reduce_max_with(sync));
//   detail::write_rng(archive, sync);  ...  detail::read_rng(archive, detail::rng_prefix(sync));
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <functional>
#include <string>

#include "amp/train/gradient_sync.h"
#include "amp/train/rng_state.h"

namespace amp {
namespace detail {

class AmaxReduce {
 public:
  virtual ~AmaxReduce() = default;
  // t's elementwise largest over the processes, in place (once per optimizer step).
  virtual void reduce_max(at::Tensor& t) = 0;
};

class CheckpointParticipant {
 public:
  virtual ~CheckpointParticipant() = default;
  // The random generators' entries a checkpoint holds (every process's), and
  // the prefix under which this process finds its own on load.
  virtual void write_rng(torch::serialize::OutputArchive& archive) const = 0;
  virtual std::string rng_prefix() const = 0;
  // Entries of its own that a resumed run needs in order to go on as the
  // uninterrupted one (DataParallel: its rebuilt bucket layout).
  // read_state() checks the archive's (an amp: error changes nothing) and
  // returns what installs them, which load() calls once the rest has loaded.
  virtual void write_state(torch::serialize::OutputArchive& archive) const = 0;
  virtual std::function<void()> read_state(torch::serialize::InputArchive& archive) = 0;
};

inline const CheckpointParticipant* participant(const GradientSync* sync) {
  return dynamic_cast<const CheckpointParticipant*>(sync);
}
inline CheckpointParticipant* participant(GradientSync* sync) { return dynamic_cast<CheckpointParticipant*>(sync); }

// This process's generators into a checkpoint (every process's through a participant).
inline void write_rng(torch::serialize::OutputArchive& archive, const GradientSync* sync) {
  if (const CheckpointParticipant* p = participant(sync)) {
    p->write_rng(archive);
  } else {
    write_rng(archive, capture_rng(), "amp/rng/");
  }
}
inline std::string rng_prefix(const GradientSync* sync) {
  const CheckpointParticipant* p = participant(sync);
  return p != nullptr ? p->rng_prefix() : "amp/rng/";
}
// A participant's own checkpoint entries (none without one); reading checks
// them and returns what installs them.
inline void write_sync_state(torch::serialize::OutputArchive& archive, const GradientSync* sync) {
  if (const CheckpointParticipant* p = participant(sync)) p->write_state(archive);
}
inline std::function<void()> read_sync_state(torch::serialize::InputArchive& archive, GradientSync* sync) {
  CheckpointParticipant* p = participant(sync);
  if (p == nullptr) return [] {};
  return p->read_state(archive);
}

// A Float8 recipe's reduce_max (amaxes, in place): across the processes
// where the GradientSync reduces, nothing for one process.
inline auto reduce_max_with(GradientSync* sync) {
  return [reduce = dynamic_cast<AmaxReduce*>(sync)](at::Tensor& t) {
    if (reduce != nullptr) reduce->reduce_max(t);
  };
}

}  // namespace detail
}  // namespace amp
