// Compile-fail test: a nested autocast to bf16 inside a Mixed<fp16, ...> region (CUDA).
// expect: amp: a nested autocast to bf16 inside a Mixed<fp16
// Passing twin (built without AMP_SHOULD_FAIL): autocast<fp16> compiles.
#include "amp/precision/region.h"

at::Tensor forward(const at::Tensor& x, const at::Tensor& w) {
  amp::Region<amp::Mixed<amp::fp16, amp::DynamicScaler>, amp::CUDA> region;
  auto f = [&] { return at::matmul(x, w); };
#ifdef AMP_SHOULD_FAIL
  return region.autocast<amp::bf16>(f);
#else
  return region.autocast<amp::fp16>(f);
#endif
}
