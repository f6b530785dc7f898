// Compile-fail test: ShardedOptimizer of LBFGS, a closure-based optimizer.
// expect: amp: ShardedOptimizer does not shard LBFGS
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/distributed.h>
#include <torch/torch.h>

// The passing twin: an optimizer that steps without a closure.
void passing(amp::ProcessGroup pg, std::vector<torch::Tensor> params) {
  amp::ShardedOptimizer<torch::optim::Adam> opt(pg, params, torch::optim::AdamOptions(0.1));
}

#ifdef AMP_SHOULD_FAIL
void failing(amp::ProcessGroup pg, std::vector<torch::Tensor> params) {
  amp::ShardedOptimizer<torch::optim::LBFGS> opt(pg, params, torch::optim::LBFGSOptions(0.1));
}
#endif

int main() { return 0; }
