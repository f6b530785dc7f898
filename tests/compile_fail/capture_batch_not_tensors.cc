// Compile-fail test: a captured step's batch holding a non-tensor value.
// expect: amp: a captured step's batch may hold only tensors
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/capture/detail/static_batch.h>

#include <tuple>
#include <utility>
#include <vector>

// The passing twin: tensors in a pair, a tuple and a vector.
void tensors_only(const std::tuple<at::Tensor, std::vector<at::Tensor>>& batch) {
  amp::detail::StaticBatch<std::tuple<at::Tensor, std::vector<at::Tensor>>> inputs(batch, c10::Device("cpu"));
  inputs.check(batch);
}

#ifdef AMP_SHOULD_FAIL
void with_an_int(const std::pair<at::Tensor, int>& batch) {
  amp::detail::StaticBatch<std::pair<at::Tensor, int>> inputs(batch, c10::Device("cpu"));
}
#endif

int main() { return 0; }
