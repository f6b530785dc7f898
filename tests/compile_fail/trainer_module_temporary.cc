// Compile-fail test: a Trainer given a temporary Module (nothing would keep
// it alive: a Module& is held without ownership unless a shared_ptr owns it).
// expect: amp: pass the model as a ModuleHolder (e.g. torch::nn::Linear), a std::shared_ptr<Module>, or a
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/amp.h>
#include <torch/torch.h>

#include <memory>

struct Net : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return x; }
};

using T = amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>;

// The passing twins: a shared_ptr, a Module& that lives in one, and a
// `Net model;` (held without ownership).
void passing(torch::optim::Optimizer& optimizer) {
  auto net = std::make_shared<Net>();
  T by_pointer(net, optimizer);
  T by_reference(*net, optimizer);
  Net on_stack;
  T by_stack_reference(on_stack, optimizer);
}

#ifdef AMP_SHOULD_FAIL
void failing(torch::optim::Optimizer& optimizer) { T t(Net(), optimizer); }
#endif

int main() { return 0; }
