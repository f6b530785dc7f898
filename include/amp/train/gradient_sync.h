// amp/train/gradient_sync.h: GradientSync, the hook around the backward pass
// for training on more than one process (amp/distributed.h's DataParallel
// implements it with c10d).
//
//   trainer.stepper().set_gradient_sync(&sync);   // or fabric.set_gradient_sync(&sync)
//
// The Stepper (so a Trainer) and Fabric call begin_backward(boundary) before
// each micro-batch's backward (boundary: this micro-batch ends an
// accumulation cycle, so gradients are averaged across processes; otherwise
// they only accumulate locally, DDP's no_sync), and finish_backward() after
// the boundary backward, before unscale/clip/step: it waits until every
// gradient holds the average over all processes. Since every process then
// unscales and checks the same gradients, they all make the same skip
// decision and keep the same scale. What else several processes change
// (Float8's amaxes, checkpoints' generators) is not this hook's concern:
// amp/train/cross_process.h.
#pragma once

#include <c10/util/Exception.h>

namespace amp {

class GradientSync {
 public:
  virtual ~GradientSync() = default;
  virtual void begin_backward(bool boundary) = 0;
  virtual void finish_backward() = 0;
  // True where each process holds only a shard of the parameters and their
  // gradients (FullyShard): the Stepper's own clipping, a loss scaler's
  // per-process skip decision and a Trainer's or Fabric's save() would then
  // see one shard, so they refuse it with an amp: error.
  virtual bool shards_parameters() const { return false; }
};

namespace detail {
// The amp: error for what a GradientSync that shards parameters cannot serve (`what`), or nothing.
inline void check_not_sharded(const GradientSync* sync, const char* what, const char* instead) {
  TORCH_CHECK(sync == nullptr || !sync->shards_parameters(), "amp: ", what,
              " would see only this process's shards under FullyShard; ", instead);
}
}  // namespace detail

}  // namespace amp
