// Compile-fail test: a nested "autocast to fp32" inside a Mixed region; the fp32 island
// is region.full_precision.
// expect: amp: a nested autocast to fp32/fp64/tf32 inside a Mixed<
// Passing twin (built without AMP_SHOULD_FAIL): the same computation through full_precision.
#include "amp/precision/region.h"

at::Tensor forward(const at::Tensor& x, const at::Tensor& w) {
  amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> region;
  auto f = [](const at::Tensor& a, const at::Tensor& b) { return at::matmul(a, b); };
#ifdef AMP_SHOULD_FAIL
  return region.autocast<amp::fp32>(f, x, w);
#else
  return region.full_precision(f, x, w);
#endif
}
