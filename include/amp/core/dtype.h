// amp/core/dtype.h: dtype tags (fp16, bf16, fp32, fp64, tf32) and their traits.
//
//   using D = amp::bf16;
//   static_assert(amp::scalar_type_v<D> == c10::ScalarType::BFloat16);
//   std::cout << amp::dtype_traits<D>::name;   // "bf16"
//
// Tags are empty types so that a precision can be a template argument.
// tf32 is not a storage type: it is fp32 storage with TensorFloat-32 math on
// tensor-core GPUs, so its scalar_type is Float.
#pragma once

#include <c10/core/ScalarType.h>

#include <tuple>
#include <type_traits>

namespace amp {

struct fp16 {};
struct bf16 {};
struct fp32 {};
struct fp64 {};
struct tf32 {};

// Primary template is left undefined: only the tags above have traits.
template <class D>
struct dtype_traits;

template <>
struct dtype_traits<fp16> {
  static constexpr c10::ScalarType scalar_type = c10::ScalarType::Half;
  static constexpr const char* name = "fp16";
  static constexpr int bits = 16;
};
template <>
struct dtype_traits<bf16> {
  static constexpr c10::ScalarType scalar_type = c10::ScalarType::BFloat16;
  static constexpr const char* name = "bf16";
  static constexpr int bits = 16;
};
template <>
struct dtype_traits<fp32> {
  static constexpr c10::ScalarType scalar_type = c10::ScalarType::Float;
  static constexpr const char* name = "fp32";
  static constexpr int bits = 32;
};
template <>
struct dtype_traits<fp64> {
  static constexpr c10::ScalarType scalar_type = c10::ScalarType::Double;
  static constexpr const char* name = "fp64";
  static constexpr int bits = 64;
};
template <>
struct dtype_traits<tf32> {
  static constexpr c10::ScalarType scalar_type = c10::ScalarType::Float;  // storage
  static constexpr const char* name = "tf32";
  static constexpr int bits = 32;
};

namespace detail {
template <class D, class = void>
struct is_dtype_impl : std::false_type {};
template <class D>
struct is_dtype_impl<D, std::void_t<decltype(dtype_traits<D>::scalar_type)>> : std::true_type {};
// True for the dtype tags above (and any tag given a dtype_traits specialization).
template <class D>
inline constexpr bool is_dtype_v = is_dtype_impl<D>::value;

// The 16-bit floating tags autocast can compute in.
template <class D>
inline constexpr bool is_half_precision_v = std::is_same_v<D, fp16> || std::is_same_v<D, bf16>;
}  // namespace detail

// A dtype tag's c10::ScalarType.
template <class D>
inline constexpr c10::ScalarType scalar_type_v = dtype_traits<D>::scalar_type;

namespace detail {
// The storage dtypes, for run-time lookups by c10::ScalarType (tf32 is fp32 storage).
using storage_dtypes = std::tuple<fp16, bf16, fp32, fp64>;

template <class... Ds>
constexpr const char* dtype_name_in(c10::ScalarType t, std::tuple<Ds...>*) {
  const char* name = nullptr;
  ((t == dtype_traits<Ds>::scalar_type ? (name = dtype_traits<Ds>::name, true) : false) || ...);
  return name;
}
template <class... Ds>
constexpr bool is_half_precision_in(c10::ScalarType t, std::tuple<Ds...>*) {
  return ((t == dtype_traits<Ds>::scalar_type && is_half_precision_v<Ds>) || ...);
}

// amp's name of a storage dtype ("fp16", "bf16", "fp32", "fp64"), or c10's for others.
constexpr const char* dtype_name(c10::ScalarType t) {
  const char* name = dtype_name_in(t, static_cast<storage_dtypes*>(nullptr));
  return name != nullptr ? name : c10::toString(t);
}

// is_half_precision_v at run time.
constexpr bool is_half_precision(c10::ScalarType t) {
  return is_half_precision_in(t, static_cast<storage_dtypes*>(nullptr));
}
}  // namespace detail

}  // namespace amp
