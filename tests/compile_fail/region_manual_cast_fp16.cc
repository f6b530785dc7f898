// Compile-fail test: a manual cast to the compute dtype inside a Mixed<fp16, ...> region
// (on CUDA: compiles without a GPU, and CPU fp16 autocast needs LibTorch 2.3).
// expect: amp: manual fp16 casts inside a Mixed<fp16
// Passing twin (built without AMP_SHOULD_FAIL): a cast to fp32 is fine.
#include "amp/precision/region.h"

at::Tensor forward(const at::Tensor& x) {
  amp::Region<amp::Mixed<amp::fp16, amp::DynamicScaler>, amp::CUDA> region;
#ifdef AMP_SHOULD_FAIL
  return region.cast<amp::fp16>(x);
#else
  return region.cast<amp::fp32>(x);
#endif
}
