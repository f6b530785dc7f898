// amp/scaler/state_dict.h: reading and making scaler state dicts.
//
//   amp::StateDict s = amp::empty_state_dict();
//   double scale = amp::detail::state_double(s, "scale");          // "amp: ..." if missing or not a number
//   amp::StateDict t = amp::detail::typed_state_dict(generic);      // from a Python torch.save file
//
// Python's torch.save(scaler.state_dict()) file loads in LibTorch as a
// Dict<Any, Any> (torch::pickle_load(bytes).toGenericDict()); typed_state_dict
// checks its keys and makes the Dict<str, IValue> the scalers take.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

#include "amp/core/scaler_concept.h"

namespace amp {

// An empty StateDict (Dict<str, IValue> has no default constructor).
inline StateDict empty_state_dict() {
  return c10::impl::toTypedDict<std::string, c10::IValue>(
      c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
}

namespace detail {

// Reads a number from a scaler state dict; Python writes floats and ints.
inline double state_double(const StateDict& state, const char* key) {
  TORCH_CHECK(state.contains(key), "amp: the scaler state dict has no key '", key, "'");
  const c10::IValue value = state.at(key);
  if (value.isInt()) {
    return static_cast<double>(value.toInt());
  }
  TORCH_CHECK(value.isDouble(), "amp: the scaler state dict's '", key, "' must be a float, got ", value.tagKind());
  return value.toDouble();
}

inline int64_t state_int(const StateDict& state, const char* key) {
  TORCH_CHECK(state.contains(key), "amp: the scaler state dict has no key '", key, "'");
  const c10::IValue value = state.at(key);
  TORCH_CHECK(value.isInt(), "amp: the scaler state dict's '", key, "' must be an int, got ", value.tagKind());
  return value.toInt();
}

// A Dict<Any, Any> (what torch::pickle_load gives for a dict that Python
// pickled) as a StateDict; every key must be a string.
inline StateDict typed_state_dict(const c10::impl::GenericDict& generic) {
  StateDict state = empty_state_dict();
  for (const auto& entry : generic) {
    TORCH_CHECK(entry.key().isString(), "amp: a scaler state dict's keys are strings, but this one has a key of type ",
                entry.key().tagKind(), "; pass the dict that GradScaler.state_dict() returned (torch.save in Python, ",
                "torch::pickle_load(bytes).toGenericDict() in C++)");
    state.insert(entry.key().toStringRef(), entry.value());
  }
  return state;
}

}  // namespace detail
}  // namespace amp
