// Compile-fail test: a nested autocast to another 16-bit dtype inside a Mixed<bf16, ...> region.
// expect: amp: a nested autocast to fp16 inside a Mixed<bf16
// Passing twin (built without AMP_SHOULD_FAIL): autocast<bf16> (the region's own dtype) is a no-op and compiles.
#include "amp/precision/region.h"

at::Tensor forward(const at::Tensor& x, const at::Tensor& w) {
  amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> region;
  auto f = [&] { return at::matmul(x, w); };
#ifdef AMP_SHOULD_FAIL
  return region.autocast<amp::fp16>(f);
#else
  return region.autocast<amp::bf16>(f);
#endif
}
