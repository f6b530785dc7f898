// Compile-fail test: autocast inside a True<fp64> region (True regions do not autocast).
// expect: amp: True<> regions do not autocast
// Passing twin (built without AMP_SHOULD_FAIL): casting inputs to the model's dtype.
#include "amp/precision/region.h"

at::Tensor forward(const at::Tensor& x, const at::Tensor& w) {
  amp::Region<amp::True<amp::fp64>, amp::CPU> region;
#ifdef AMP_SHOULD_FAIL
  return region.autocast<amp::bf16>([&] { return at::matmul(x, w); });
#else
  return at::matmul(region.cast<amp::fp64>(x), region.cast<amp::fp64>(w));
#endif
}
