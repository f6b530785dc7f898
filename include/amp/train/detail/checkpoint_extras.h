// amp/train/detail/checkpoint_extras.h: the entries Trainer and Fabric keep in
// a checkpoint beside the models, optimizers, scaler and counters: a Float8
// recipe's state, the user's (UserState), the GradientSync's and the random
// generators'.
//
//   detail::write_extras(archive, float8_, user_state_, sync, options_.rng_state());
//   auto install = detail::read_extras(archive, float8_, user_state_, sync, options_.rng_state());
//   ... the models and optimizers ...
//   install();
#pragma once

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <functional>
#include <optional>
#include <utility>

#include "amp/train/cross_process.h"
#include "amp/train/rng_state.h"
#include "amp/train/gradient_sync.h"
#include "amp/train/user_state.h"

namespace amp {
namespace detail {

template <class Float8State>
void write_extras(torch::serialize::OutputArchive& archive, const Float8State& float8, const UserState& user,
                  const GradientSync* sync, bool rng_state) {
  float8.write(archive);
  user.write(archive);
  write_sync_state(archive, sync);
  if (rng_state) write_rng(archive, sync);
}

// Checks the user's, the GradientSync's and the generators' entries (an amp:
// error before anything changes) and returns what installs them and reads the
// Float8 state, to call once the models and optimizers have loaded; it returns
// whether it restored the generators. `archive`, `float8` and `user` must
// outlive the call.
template <class Float8State>
std::function<bool()> read_extras(torch::serialize::InputArchive& archive, Float8State& float8, const UserState& user,
                                  GradientSync* sync, bool rng_state) {
  UserState::Pending pending = user.check(archive);
  std::function<void()> install_sync = read_sync_state(archive, sync);
  std::optional<RngStates> rng;
  if (rng_state) rng = read_rng(archive, rng_prefix(sync));
  return
      [&archive, &float8, pending = std::move(pending), install_sync = std::move(install_sync), rng = std::move(rng)] {
        float8.read(archive);
        pending.apply();
        install_sync();
        if (rng) restore_rng(*rng);
        return rng.has_value();
      };
}

}  // namespace detail
}  // namespace amp
