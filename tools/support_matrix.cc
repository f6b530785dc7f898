// tools/support_matrix.cc: prints the policy table and the support matrix as
// the traits compute them for the LibTorch this is built against. The README's
// support matrix is this output; //tools:readme_test checks that it still matches.
#include <amp/amp.h>

#include <iostream>
#include <string>

namespace {
template <class D>
std::string dtype_name() {
  return amp::dtype_traits<D>::name;
}
template <class R>
std::string recipe_name() {
  if constexpr (std::is_same_v<R, amp::Tensorwise>)
    return "Tensorwise";
  else if constexpr (std::is_same_v<R, amp::Rowwise>)
    return "Rowwise";
  else if constexpr (std::is_same_v<R, amp::RowwiseWithGwHp>)
    return "RowwiseWithGwHp";
  else if constexpr (std::is_same_v<R, amp::MXFP8<amp::MxScaleMode::kRceil>>)
    return "MXFP8<kRceil>";
  else if constexpr (std::is_same_v<R, amp::MXFP8<amp::MxScaleMode::kFloor>>)
    return "MXFP8<kFloor>";
  else if constexpr (std::is_same_v<R, amp::NVFP4<false>>)
    return "NVFP4<false>";
  else if constexpr (std::is_same_v<R, amp::NVFP4<true>>)
    return "NVFP4<true>";
  else
    return "Delayed<" + std::to_string(R::history_length) + ", " + std::to_string(R::margin) + ">";
}
template <class P>
std::string type_name() {
  using T = amp::policy_traits<P>;
  if constexpr (amp::detail::is_float8_v<P>)
    return "`Float8<" + recipe_name<typename T::recipe_type>() + ">`";
  else if constexpr (amp::detail::is_mixed_v<P>)
    return "`Mixed<" + dtype_name<typename T::compute_type>() + ", " +
           std::string(amp::detail::builtin_scaler<typename T::scaler_type>::name) + ">`";
  else
    return "`True<" + dtype_name<typename T::compute_type>() + ">`";
}
// What a Float8 policy's linears compute in: the block-scaled formats by name.
template <class R>
struct linears {
  static constexpr const char* name = "fp8";
};
template <amp::MxScaleMode Mode>
struct linears<amp::MXFP8<Mode>> {
  static constexpr const char* name = "MXFP8";
};
template <bool SR>
struct linears<amp::NVFP4<SR>> {
  static constexpr const char* name = "NVFP4";
};
// The compute column. tf32 is fp32 storage with TensorFloat-32 matmul/conv math.
template <class P>
std::string compute_of() {
  using T = amp::policy_traits<P>;
  if constexpr (amp::detail::is_float8_v<P>)
    return std::string(linears<typename T::recipe_type>::name) + " linears, bf16 (autocast)";
  else if constexpr (std::is_same_v<typename T::compute_type, amp::tf32>)
    return "tf32 (matmul/conv)";
  else
    return dtype_name<typename T::compute_type>() + (T::uses_autocast ? " (autocast)" : "");
}
}  // namespace

int main() {
  std::cout << "| policy | precision string | parameters | compute | scaler | CPU | CUDA |\n";
  std::cout << "|---|---|---|---|---|---|---|\n";
  amp::for_each_policy([](auto p) {
    using P = typename decltype(p)::type;
    using T = amp::policy_traits<P>;
    const std::string params =
        std::is_same_v<typename T::param_type, amp::tf32> ? "fp32" : dtype_name<typename T::param_type>();
    const std::string compute = compute_of<P>();
    std::cout << "| " << type_name<P>() << " | `" << T::name << "` | " << params << " | " << compute << " | "
              << std::string(amp::detail::builtin_scaler<typename T::scaler_type>::name) << " | "
              << (amp::is_supported_v<P, amp::CPU> ? "yes" : "no") << " | "
              << (amp::is_supported_v<P, amp::CUDA> ? "yes" : "no") << " |\n";
  });
  std::cout << "\n(computed for LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << ")\n";
  return 0;
}
