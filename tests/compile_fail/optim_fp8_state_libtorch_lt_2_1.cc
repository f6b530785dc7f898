// Compile-fail test: fp8 optimizer states before LibTorch 2.1, which has no
// float8_e4m3fn (built only against such a LibTorch: the _libtorch_lt_2_1
// suffix tells Bazel and CMake).
// expect: amp: fp8 optimizer states need LibTorch 2.1 or newer (float8_e4m3fn); use amp::AdamW8bit
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/optim/low_bit_adam.h>

#include <vector>

int main() {
  std::vector<at::Tensor> params;
  // The passing twin: the 8-bit states, the same bytes per parameter.
  amp::AdamW8bit eight(params);
#ifdef AMP_SHOULD_FAIL
  amp::AdamWFp8 fp8(params);
#endif
  return 0;
}
