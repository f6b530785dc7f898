// amp/detail/thread_state_guard.h: the RAII guard of a thread_local state and
// of the TLS-included dispatch key that sends this thread's ops to the
// kernels reading it (StrictCasts, linear routing, saved ops).
//
//   ThreadStateGuard<StrictCastsState, kStrictCastsKey> guard(strict_casts_state(), next, /*included=*/on);
//
// The constructor saves the state and the key's "included" bit, then sets
// both; the destructor puts the bit back, then the state (through Restore, for
// a guard that leaves some fields as the inner scope set them). Nested guards
// on one thread restore in reverse order, as c10's own TLS guards do.
#pragma once

#include <c10/core/DispatchKey.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace amp {
namespace detail {

// Restores the whole state.
template <class State>
struct AssignState {
  void operator()(State& now, const State& prev) const { now = prev; }
};

// Key == c10::DispatchKey::Undefined: a state without a key of its own.
template <class State, c10::DispatchKey Key = c10::DispatchKey::Undefined, class Restore = AssignState<State>>
class ThreadStateGuard {
 public:
  // `current`: this thread's state (a function-local thread_local); it
  // becomes `next`, and the key included when `included`.
  ThreadStateGuard(State& current, const State& next, bool included = false)
      : current_(current), prev_(current), prev_included_(key_included()) {
    current_ = next;
    if constexpr (kHasKey) c10::impl::tls_set_dispatch_key_included(Key, included);
  }
  ~ThreadStateGuard() {
    if constexpr (kHasKey) c10::impl::tls_set_dispatch_key_included(Key, prev_included_);
    Restore{}(current_, prev_);
  }
  ThreadStateGuard(const ThreadStateGuard&) = delete;
  ThreadStateGuard& operator=(const ThreadStateGuard&) = delete;
  ThreadStateGuard(ThreadStateGuard&&) = delete;
  ThreadStateGuard& operator=(ThreadStateGuard&&) = delete;

 private:
  static constexpr bool kHasKey = Key != c10::DispatchKey::Undefined;
  static bool key_included() {
    if constexpr (kHasKey) {
      return c10::impl::tls_is_dispatch_key_included(Key);
    } else {
      return false;
    }
  }

  State& current_;
  State prev_;
  bool prev_included_;
};

}  // namespace detail
}  // namespace amp
