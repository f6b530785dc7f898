// Compile-fail test: capture() on amp::CPU.
// expect: amp: capture() records the training step in a CUDA graph, which exists only on amp::CUDA
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/amp.h>
#include <torch/torch.h>

#include <utility>

using Batch = std::pair<torch::Tensor, torch::Tensor>;

// The passing twin: the same call on amp::CUDA (compiled, never run here).
void on_cuda(amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CUDA>& trainer, torch::nn::Linear& model,
             const Batch& example) {
  auto step =
      trainer.capture([&](auto&, const Batch& b) { return torch::mse_loss(model(b.first), b.second); }, example);
  step(example);
}

#ifdef AMP_SHOULD_FAIL
void on_cpu(amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>& trainer, torch::nn::Linear& model,
            const Batch& example) {
  auto step =
      trainer.capture([&](auto&, const Batch& b) { return torch::mse_loss(model(b.first), b.second); }, example);
  step(example);
}
#endif

int main() { return 0; }
