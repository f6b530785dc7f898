// Compile-fail test: trainer.capture() with only amp/train/trainer.h included
// (a Trainer user who never captures does not compile the capture code).
// expect: amp: trainer.capture() needs the capture code: #include <amp/capture/captured_step.h>
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/train/trainer.h>
#ifndef AMP_SHOULD_FAIL
#include <amp/capture/captured_step.h>  // the passing twin includes it
#endif
#include <torch/torch.h>

#include <utility>

using Batch = std::pair<torch::Tensor, torch::Tensor>;

void on_cuda(amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CUDA>& trainer, torch::nn::Linear& model,
             const Batch& example) {
  auto step =
      trainer.capture([&](auto&, const Batch& b) { return torch::mse_loss(model(b.first), b.second); }, example);
  step(example);
}

int main() { return 0; }
