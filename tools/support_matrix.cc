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
}  // namespace

int main() {
  std::cout << "| policy | precision string | parameters | compute | scaler | CPU | CUDA |\n";
  std::cout << "|---|---|---|---|---|---|---|\n";
  amp::for_each_policy([](auto p) {
    using P = typename decltype(p)::type;
    using T = amp::policy_traits<P>;
    // tf32 is fp32 storage with TensorFloat-32 matmul/conv math.
    const std::string params =
        std::is_same_v<typename T::param_type, amp::tf32> ? "fp32" : dtype_name<typename T::param_type>();
    const std::string compute = amp::detail::is_float8_v<P>                           ? "fp8 linears, bf16 (autocast)"
                                : std::is_same_v<typename T::compute_type, amp::tf32> ? "tf32 (matmul/conv)"
                                : T::uses_autocast ? dtype_name<typename T::compute_type>() + " (autocast)"
                                                   : dtype_name<typename T::compute_type>();
    std::cout << "| " << type_name<P>() << " | `" << T::name << "` | " << params << " | " << compute << " | "
              << std::string(amp::detail::builtin_scaler<typename T::scaler_type>::name) << " | "
              << (amp::is_supported_v<P, amp::CPU> ? "yes" : "no") << " | "
              << (amp::is_supported_v<P, amp::CUDA> ? "yes" : "no") << " |\n";
  });
  std::cout << "\n(computed for LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << ")\n";
  return 0;
}
