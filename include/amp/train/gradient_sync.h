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

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <functional>
#include <type_traits>
#include <utility>

namespace amp {

class GradientSync {
 public:
  virtual ~GradientSync() = default;
  virtual void begin_backward(bool boundary) = 0;
  virtual void finish_backward() = 0;
  // True where each process holds only a shard of the parameters and their
  // gradients (FullyShard): the Stepper's own clipping and a Trainer's or
  // Fabric's save() would then see one shard, so they refuse it with an amp:
  // error; a loss scaler's found-inf flags go through all_reduce_found_inf.
  virtual bool shards_parameters() const { return false; }
  // Where shards_parameters(): sums a loss scaler's found-inf flag (fp32)
  // over the processes in place, so that every process makes one skip
  // decision (torch's ShardedGradScaler). Otherwise every process already
  // checks the same averaged gradients: nothing to do.
  virtual void all_reduce_found_inf(at::Tensor& /*found_inf*/) {}
};

namespace detail {
// The amp: error for what a GradientSync that shards parameters cannot serve (`what`), or nothing.
inline void check_not_sharded(const GradientSync* sync, const char* what, const char* instead) {
  TORCH_CHECK(sync == nullptr || !sync->shards_parameters(), "amp: ", what,
              " would see only this process's shards under FullyShard; ", instead);
}

template <class S, class = void>
struct has_found_inf_sync : std::false_type {};
template <class S>
struct has_found_inf_sync<
    S, std::void_t<decltype(std::declval<S&>().set_found_inf_sync(std::function<void(at::Tensor&)>()))>>
    : std::true_type {};

// A Stepper's or Fabric's set_gradient_sync, for its loss scaler: under a
// GradientSync that shards parameters, the scaler's found-inf flags go
// through sync->all_reduce_found_inf (one skip decision on every process);
// otherwise (or with sync nullptr) no such step. A scaler without
// set_found_inf_sync (a user's own) is refused under a sharding one.
template <class Scaler>
void connect_found_inf(Scaler& scaler, GradientSync* sync) {
  const bool sharded = sync != nullptr && sync->shards_parameters();
  if constexpr (has_found_inf_sync<Scaler>::value) {
    if (sharded)
      scaler.set_found_inf_sync([sync](at::Tensor& found_inf) { sync->all_reduce_found_inf(found_inf); });
    else
      scaler.set_found_inf_sync(nullptr);
  } else {
    check_not_sharded(sync, "a loss scaler's skip decision",
                      "use amp::DynamicScaler or amp::StaticScaler, whose found-inf flags are all-reduced "
                      "(set_found_inf_sync), or train with bf16 or fp32");
  }
}
}  // namespace detail

}  // namespace amp
