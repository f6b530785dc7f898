// examples/existing_loop.cc: an ordinary LibTorch loop made mixed-precision
// with the fewest changed lines — the C++ twin of the recipe in torch's AMP
// docs (autocast around the forward, GradScaler's scale/step/update), with
// gradient clipping and gradient accumulation. The lines marked `// amp` are
// the only ones a plain fp32 loop does not have.
//
// On CUDA it trains in fp16 with loss scaling; on CPU in bf16 (fp16 autocast
// on CPU needs LibTorch 2.3), where the scaler is disabled — bf16 needs none —
// and is a pass-through, exactly as torch's `GradScaler(enabled=False)`.
#include <torch/torch.h>

#include <amp/precision/autocast.h>
#include <amp/scaler/dynamic_scaler.h>

#include <iostream>

template <class Dtype, class Device>
double train(torch::Device device, bool use_scaler) {
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(32, 128), torch::nn::ReLU(), torch::nn::Linear(128, 4));
  model->to(device);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::GradScaler scaler(amp::DynamicScalerOptions().enabled(use_scaler));  // amp

  auto x = torch::randn({512, 32}, device);
  auto y = x.narrow(1, 0, 4).argmax(1);
  const int64_t accumulation = 2, micro = 128;
  double loss_value = 0;
  for (int step = 0; step < 100; ++step) {
    optimizer.zero_grad();
    for (int64_t m = 0; m < accumulation; ++m) {
      const int64_t begin = ((step * accumulation + m) * micro) % 512;
      torch::Tensor loss;
      {
        amp::Autocast<Dtype, Device> autocast;  // amp: `with torch.autocast(...)`
        auto out = model->forward(x.narrow(0, begin, micro));
        loss = torch::cross_entropy_loss(out, y.narrow(0, begin, micro)) / static_cast<double>(accumulation);
      }
      scaler.scale(loss).backward();  // amp: was loss.backward()
      loss_value = loss.item<double>() * accumulation;
    }
    scaler.unscale_(optimizer);  // amp: clip the true gradients
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    scaler.step(optimizer);  // amp: was optimizer.step(); skips the step on inf/NaN
    scaler.update();         // amp
    if (step % 25 == 0)
      std::cout << "step " << step << " loss " << loss_value << " scale " << scaler.get_scale() << "\n";
  }
  return loss_value;
}

int main() {
  double final_loss;
  if (torch::cuda::is_available()) {
    final_loss = train<amp::fp16, amp::CUDA>(torch::kCUDA, /*use_scaler=*/true);
  } else {
    final_loss = train<amp::bf16, amp::CPU>(torch::kCPU, /*use_scaler=*/false);
  }
  std::cout << "final loss " << final_loss << "\n";
  return final_loss < 0.5 ? 0 : 1;  // the test that runs this example checks that it learned
}
