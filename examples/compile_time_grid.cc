// examples/compile_time_grid.cc: one generic experiment, run under a
// compile-time list of policies. The grid is a Boost.Hana list; the body is
// instantiated once per policy, and an invalid policy never compiles.
#include <torch/torch.h>

#include <amp/amp.h>

#include <iostream>

namespace hana = boost::hana;

template <class Policy>
double experiment() {
  torch::manual_seed(0);
  auto model = torch::nn::Linear(16, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  amp::Trainer<Policy, amp::CPU> trainer(model, optimizer, amp::TrainerOptions().progress(false));
  using Region = typename amp::Trainer<Policy, amp::CPU>::region_type;
  auto x = torch::randn({128, 16}).to(Region::param_dtype);
  auto y = x.sum(1, true);
  double loss = 0;
  for (int i = 0; i < 50; ++i) loss = trainer.step([&](Region&) { return torch::mse_loss(model(x), y); }).loss_value();
  return loss;
}

int main() {
  // Our own grid: any hana::tuple_t of policies...
  constexpr auto grid = hana::tuple_t<amp::True<amp::fp32>, amp::Mixed<amp::bf16, amp::NoScaler>, amp::True<amp::fp64>>;
  static_assert(hana::all_of(
      grid, [](auto p) { return hana::bool_c<amp::is_supported_v<typename decltype(p)::type, amp::CPU>>; }));
  amp::for_each_policy(grid, [](auto p) {
    using P = typename decltype(p)::type;
    std::cout << amp::policy_traits<P>::name << ": final loss " << experiment<P>() << "\n";
  });

  // ...or every policy this LibTorch supports on the CPU, computed at compile time.
  std::cout << "supported on cpu:";
  amp::for_each_policy(amp::supported_policies<amp::CPU>,
                       [](auto p) { std::cout << " " << amp::policy_traits<typename decltype(p)::type>::name; });
  std::cout << "\n";

  // Uncomment to see the static rule:
  // experiment<amp::Mixed<amp::fp16, amp::NoScaler>>();
  //   error: static assertion failed: amp: Mixed<fp16, NoScaler> would let fp16 gradients underflow;
  //          use amp::Mixed<amp::fp16, amp::DynamicScaler> or amp::Mixed<amp::bf16, amp::NoScaler>
  return 0;
}
