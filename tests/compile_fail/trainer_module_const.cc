// Compile-fail test: a Trainer given a const Module (training changes it).
// expect: amp: pass the model as a ModuleHolder (e.g. torch::nn::Linear), a std::shared_ptr<Module>, or a
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/amp.h>
#include <torch/torch.h>

struct Net : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return x; }
};

using P = amp::Fabric<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>;

// The passing twin: the same model, not const.
void passing(P& fabric, Net& model) { fabric.setup(model); }

#ifdef AMP_SHOULD_FAIL
void failing(P& fabric, const Net& model) { fabric.setup(model); }
#endif

int main() { return 0; }
