// Compile-fail test: ShardedOptimizer<Inner> of a type that is not a LibTorch optimizer.
// expect: amp: ShardedOptimizer<Inner> needs a torch::optim::Optimizer class
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/distributed.h>
#include <torch/torch.h>

// The passing twin: an optimizer class.
void passing(amp::ProcessGroup pg, std::vector<torch::Tensor> params) {
  amp::ShardedOptimizer<torch::optim::SGD> opt(pg, params, torch::optim::SGDOptions(0.1));
}

#ifdef AMP_SHOULD_FAIL
void failing(amp::ProcessGroup pg, std::vector<torch::Tensor> params) {
  amp::ShardedOptimizer<torch::optim::SGDOptions> opt(pg, params, torch::optim::SGDOptions(0.1));
}
#endif

int main() { return 0; }
