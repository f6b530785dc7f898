// tests/parity/block_scaled_parity.cc: the C++ half of the block-scaled
// quantizers' parity check (amp/float8/mxfp8.h, amp/float8/nvfp4.h).
//
//   block_scaled_parity OUT_DIR
//
// Quantizes edge values and random blocks with amp and writes the inputs and
// the results as bytes (torch.load-able lists) for block_scaled_twin.py, which
// computes the same with torchao's and Transformer Engine's functions written
// out in Python (torchao is not installed) and compares bit for bit:
//   OUT/inputs.pt  [mx fp32 [B, 32*J], nvfp4 fp32 [M, K] cases..., rht fp32]
//   OUT/cpp_mx.pt  per input dtype (fp32, bf16), element dtype (e4m3, e5m2),
//                  scale mode (FLOOR, RCEIL, CEIL, EVEN): the codes, the
//                  scale bytes, from_mx to fp32 and to bf16 (as int32/int16)
//   OUT/cpp_nvfp4.pt per case, input dtype, tiles (1x16, 16x16): codes,
//                  scale bytes, global amax, from_nvfp4 to fp32; then the
//                  Hadamard transform (rht16) of fp32 and bf16 inputs and
//                  NVFP4 of the transformed transpose (TE's wgrad operand)
//   OUT/cpp_train.pt per run, an MLP (64-128-128-10, batch 32) trained 30
//                  steps in fp32 with its first two linears in MXFP8
//                  (amp/float8/mxfp8_linear.h: torchao's emulated
//                  MXFP8Linear), SGD with momentum: RCEIL, FLOOR, RCEIL with
//                  a high-precision wgrad; the losses (bits) and the final
//                  parameters
//   OUT/cpp_swizzle.pt per scale matrix (random bytes of shapes around
//                  cuBLAS's 128x4 tile, then an MXFP8 and an NVFP4 tensor's
//                  real scales): the input bytes, then to_blocked
//                  (amp/float8/block_scaled_mm.h) of it as bytes, as e4m3 and,
//                  from LibTorch 2.8, as e8m0, each output as bytes
//   OUT/cpp_blocks.pt per policy (Float8<MXFP8<>>, Float8<MXFP8<kFloor>>,
//                  Float8<NVFP4<>>), a 2-block transformer trained 50 steps
//                  by amp::Trainer (bf16 autocast, every linear but the head
//                  block-scaled), SGD with momentum: the losses (bits) and
//                  the final parameters
// Needs the float8 dtypes (LibTorch 2.1+): before, it writes nothing and says so.
#include <torch/torch.h>

#include "parity_io.h"
#include <amp/amp.h>
#include <amp/float8/block_scaled_mm.h>
#include <amp/float8/mxfp8.h>
#include <amp/float8/mxfp8_linear.h>
#include <amp/float8/nvfp4.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace {

#if AMP_DETAIL_HAS_FLOAT8_DTYPE
namespace f8 = amp::float8::detail;
using amp_parity::save;

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A block of 32 whose amax is `amax` (its sign alternating), the rest
// `fill` times descending fractions of it, so each block has one amax.
std::vector<float> block(float amax, float fill = 0.5f) {
  std::vector<float> b(32);
  for (int i = 0; i < 32; ++i) b[i] = (i == 0) ? amax : fill * amax * (1.0f - static_cast<float>(i) / 64.0f);
  for (int i = 0; i < 32; i += 3) b[i] = -b[i];
  return b;
}

// The MX edge values, one block of 32 a row: 0, subnormals, powers of two,
// the amax on each side of every scale boundary, inf, NaN, the extremes.
at::Tensor mx_edges() {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float fmax = std::numeric_limits<float>::max();
  std::vector<std::vector<float>> rows;
  rows.push_back(std::vector<float>(32, 0.0f));
  rows.push_back(std::vector<float>(32, -0.0f));
  for (uint32_t sub : {0x00000001u, 0x00000100u, 0x003FFFFFu, 0x00400000u, 0x00400001u, 0x007FFFFFu})
    rows.push_back(block(from_bits(sub), 1.0f));
  for (int k = -149; k <= 127; k += 2) rows.push_back(block(std::ldexp(1.0f, k)));
  for (float m : {448.0f, 57344.0f, 6.0f}) {
    for (int k : {-140, -127, -126, -100, -20, -9, -1, 0, 1, 8, 20, 100, 110, 119}) {
      const float a = std::ldexp(m, k);
      if (!std::isfinite(a) || a == 0.0f) continue;
      for (float v : {a, std::nextafter(a, 0.0f), std::nextafter(a, inf)}) rows.push_back(block(v));
    }
  }
  for (float v : {255.0f, 256.0f, 257.0f, 447.0f, 449.0f, 464.0f,  479.0f,   480.0f, 500.0f, 511.9f,
                  512.0f, 1.0f,   1.5f,   1.75f,  1.875f, 1.9375f, 1.96875f, 1.99f,  2.0f,   3.0f})
    rows.push_back(block(v, 0.99f));
  for (float v : {fmax, std::nextafter(fmax, 0.0f), from_bits(0x7F780000u), from_bits(0x7F77FFFFu),
                  from_bits(0x7F700000u), fmax / 448.0f, fmax / 57344.0f})
    rows.push_back(block(v, 0.999f));
  for (float special : {inf, -inf, nan}) {
    std::vector<float> b = block(3.0f);
    b[7] = special;
    rows.push_back(b);
  }
  std::vector<float> flat;
  for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
  return torch::tensor(flat).view({-1, 64});  // two blocks a row: the last dimension has several
}

// Random blocks over a wide range of magnitudes, one exponent a block.
at::Tensor mx_random() {
  torch::manual_seed(7);
  const at::Tensor x = torch::randn({96, 4, 32});
  const at::Tensor e = torch::randint(-40, 40, {96, 4, 1}).to(torch::kFloat);
  return (x * torch::exp2(e)).view({96, 128});
}

// NVFP4 inputs [M, K], K a multiple of 16: random, with edge values, all
// zeros, an inf, a NaN, subnormals, rows not a multiple of 16 (16x16 tiles pad).
std::vector<at::Tensor> nvfp4_cases() {
  torch::manual_seed(11);
  std::vector<at::Tensor> cases;
  cases.push_back(torch::randn({32, 64}));
  at::Tensor wide =
      torch::randn({48, 64}) *
      torch::exp2(torch::randint(-20, 20, {48, 4, 1}).to(torch::kFloat)).expand({48, 4, 16}).reshape({48, 64});
  cases.push_back(wide);
  at::Tensor grid = torch::tensor(
      {0.0f, 0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.5f, 1.75f, 2.0f, 2.5f, 3.0f, 3.5f, 4.0f, 5.0f, 6.0f, -0.0f});
  at::Tensor ties = torch::cat({grid, -grid, grid * 0.999f, grid * 1.001f}).view({4, 16});
  cases.push_back(torch::cat({ties, ties * 1000.0f, ties * 1e-30f, ties * 448.0f}, 0).repeat({4, 2}));
  cases.push_back(torch::zeros({16, 32}));
  at::Tensor with_inf = torch::randn({16, 32});
  with_inf[3][5] = std::numeric_limits<float>::infinity();
  cases.push_back(with_inf);
  at::Tensor with_nan = torch::randn({16, 32});
  with_nan[9][30] = std::numeric_limits<float>::quiet_NaN();
  cases.push_back(with_nan);
  cases.push_back(torch::randn({16, 32}) * 1e-39f);
  cases.push_back(torch::randn({20, 48}));
  return cases;
}

at::Tensor bytes(const at::Tensor& t) { return t.contiguous().view(torch::kByte); }

// 30 SGD steps of parity_io's MLP in fp32, the two hidden linears in MXFP8,
// the 10-class head (not a multiple of 32) plain: losses then parameters.
std::vector<at::Tensor> train(f8::MxScale mode, bool wgrad_hp) {
  constexpr int kSteps = 30;
  torch::nn::Sequential model = amp_parity::make_mlp();
  torch::manual_seed(1);
  const at::Tensor x = torch::randn({kSteps, 32, 64}) * 4;
  const at::Tensor y = torch::randint(0, 10, {kSteps, 32}, torch::kLong);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  std::vector<torch::nn::Linear> fc;
  for (const auto& m : model->children())
    if (auto l = std::dynamic_pointer_cast<torch::nn::LinearImpl>(m)) fc.emplace_back(l);
  std::vector<float> losses;
  for (int i = 0; i < kSteps; ++i) {
    opt.zero_grad();
    at::Tensor h = torch::relu(f8::mxfp8_linear(x[i], fc[0]->weight, fc[0]->bias, mode, wgrad_hp));
    h = torch::relu(f8::mxfp8_linear(h, fc[1]->weight, fc[1]->bias, mode, wgrad_hp));
    const at::Tensor loss = torch::nn::functional::cross_entropy(at::linear(h, fc[2]->weight, fc[2]->bias), y[i]);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<float>());
  }
  std::vector<at::Tensor> out{torch::tensor(losses).view(torch::kInt)};
  for (const auto& p : model->parameters()) out.push_back(p.detach().view(torch::kInt));
  return out;
}

// A pre-norm transformer block (4 heads of 16) and two of them with a head:
// every linear's dimensions multiples of 32 but the head's (10 classes).
struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})))),
        qkv(register_module("qkv", torch::nn::Linear(64, 192))),
        proj(register_module("proj", torch::nn::Linear(64, 64))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})))),
        fc1(register_module("fc1", torch::nn::Linear(64, 256))),
        fc2(register_module("fc2", torch::nn::Linear(256, 64))) {}
  torch::Tensor forward(const torch::Tensor& x) {  // [B, T, 64]
    const int64_t b = x.size(0), t = x.size(1);
    const auto parts = qkv(ln1(x)).reshape({b, t, 3, 4, 16}).permute({2, 0, 3, 1, 4});
    const auto q = parts[0], k = parts[1], v = parts[2];
    const auto att = torch::softmax(torch::matmul(q, k.transpose(-2, -1)) / 4.0, -1);
    const auto o = torch::matmul(att, v).permute({0, 2, 1, 3}).reshape({b, t, 64});
    auto h = x + proj(o);
    return h + fc2(torch::gelu(fc1(ln2(h))));
  }
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct TwoBlocksImpl : torch::nn::Module {
  TwoBlocksImpl()
      : b0(register_module("b0", Block())),
        b1(register_module("b1", Block())),
        head(register_module("head", torch::nn::Linear(64, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(b1(b0(x)).mean(1)); }
  Block b0, b1;
  torch::nn::Linear head;
};
TORCH_MODULE(TwoBlocks);

constexpr int kBlockSteps = 50;

template <class Policy>
std::vector<at::Tensor> train_blocks() {
  TwoBlocks model;
  amp_parity::init(*model);  // LayerNorm weights 1 + 0.05 randn, the rest 0.05 randn, after manual_seed(0)
  torch::manual_seed(1);
  const auto x = torch::randn({kBlockSteps, 4, 8, 64});
  const auto y = torch::randint(0, 10, {kBlockSteps, 4}, torch::kLong);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::Trainer<Policy, amp::CPU> trainer(model, opt,
                                         amp::TrainerOptions().progress(false).step(amp::StepOptions().fused(false)));
  std::vector<float> losses;
  for (int i = 0; i < kBlockSteps; ++i)
    losses.push_back(static_cast<float>(
        trainer.step([&](auto&) { return torch::nn::functional::cross_entropy(model->forward(x[i]), y[i]); })
            .loss_value()));
  std::vector<at::Tensor> out{torch::tensor(losses).view(torch::kInt)};
  for (const auto& p : model->parameters()) out.push_back(p.detach().view(torch::kInt));
  return out;
}

void run(const std::string& out) {
  const at::Tensor edges = mx_edges(), random = mx_random();
  std::vector<at::Tensor> inputs{edges, random};
  const std::vector<at::Tensor> nv = nvfp4_cases();
  inputs.insert(inputs.end(), nv.begin(), nv.end());
  torch::manual_seed(13);
  const at::Tensor rht_in = torch::randn({32, 48}) * 3;
  inputs.push_back(rht_in);
  save(out + "/inputs.pt", inputs);

  std::vector<at::Tensor> mx;
  for (const at::Tensor& x : {edges, random}) {
    for (at::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
      for (at::ScalarType elem : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
        for (f8::MxScale mode : {f8::MxScale::kFloor, f8::MxScale::kRceil, f8::MxScale::kCeil, f8::MxScale::kEven}) {
          const f8::MxBlocks q = f8::to_mx(x.to(dtype), mode, elem);
          mx.push_back(bytes(q.data));
          mx.push_back(bytes(q.scale));
          mx.push_back(f8::from_mx(q, torch::kFloat).view(torch::kInt));
          mx.push_back(f8::from_mx(q, torch::kBFloat16).view(torch::kShort));
        }
      }
    }
  }
  save(out + "/cpp_mx.pt", mx);

  std::vector<at::Tensor> nvfp4;
  for (const at::Tensor& x : nv) {
    for (at::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
      for (bool tiles : {false, true}) {
        const f8::Nvfp4Blocks q = f8::to_nvfp4(x.to(dtype), tiles);
        nvfp4.push_back(bytes(q.data));
        nvfp4.push_back(bytes(q.scale));
        nvfp4.push_back(q.global_amax.view(torch::kInt));
        nvfp4.push_back(f8::from_nvfp4(q, torch::kFloat).view(torch::kInt));
      }
    }
  }
  for (at::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
    const at::Tensor x = rht_in.to(dtype);
    const at::Tensor r = f8::rht16(x);
    nvfp4.push_back(dtype == torch::kFloat ? r.view(torch::kInt) : r.view(torch::kShort));
    const f8::Nvfp4Blocks q = f8::to_nvfp4(f8::rht16(x.t().contiguous()));
    nvfp4.push_back(bytes(q.data));
    nvfp4.push_back(bytes(q.scale));
    nvfp4.push_back(q.global_amax.view(torch::kInt));
  }
  save(out + "/cpp_nvfp4.pt", nvfp4);
  std::vector<at::Tensor> swizzled;
  torch::manual_seed(17);
  std::vector<at::Tensor> scales;
  for (const auto& [rows, cols] :
       {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {128, 4}, {130, 9}, {257, 12}, {64, 2}, {256, 8}, {5, 130}})
    scales.push_back(torch::randint(0, 256, {rows, cols}, torch::kByte));
  scales.push_back(bytes(f8::to_mx(torch::randn({200, 320}), f8::MxScale::kRceil).scale));
  scales.push_back(bytes(f8::to_nvfp4(torch::randn({48, 96})).scale));
  for (const at::Tensor& s : scales) {
    swizzled.push_back(s);
    swizzled.push_back(bytes(f8::to_blocked(s)));
    swizzled.push_back(bytes(f8::to_blocked(s.view(at::kFloat8_e4m3fn))));
#if AMP_DETAIL_HAS_BLOCK_SCALED_DTYPES
    swizzled.push_back(bytes(f8::to_blocked(f8::as_e8m0(s))));
#endif
  }
  save(out + "/cpp_swizzle.pt", swizzled);
  std::vector<at::Tensor> trained;
  for (const auto& [mode, hp] : {std::pair{f8::MxScale::kRceil, false}, std::pair{f8::MxScale::kFloor, false},
                                 std::pair{f8::MxScale::kRceil, true}}) {
    const std::vector<at::Tensor> r = train(mode, hp);
    trained.insert(trained.end(), r.begin(), r.end());
  }
  save(out + "/cpp_train.pt", trained);
  std::vector<at::Tensor> blocks;
  for (const auto& r :
       {train_blocks<amp::Float8<amp::MXFP8<>>>(), train_blocks<amp::Float8<amp::MXFP8<amp::MxScaleMode::kFloor>>>(),
        train_blocks<amp::Float8<amp::NVFP4<>>>()})
    blocks.insert(blocks.end(), r.begin(), r.end());
  save(out + "/cpp_blocks.pt", blocks);
  std::cout << "block_scaled_parity: " << edges.size(0) * 2 << " edge blocks, " << random.numel() / 32
            << " random blocks x 16 MXFP8 variants; " << nv.size() << " NVFP4 cases x 4; Hadamard x 2; "
            << scales.size() << " swizzled scale matrices; 3 MXFP8 training runs; 3 two-block transformer runs of "
            << kBlockSteps << " steps written\n";
}
#endif

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: block_scaled_parity OUT_DIR\n";
    return 2;
  }
  std::cout << "block_scaled_parity: LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << " on cpu\n";
  const std::string out = argv[1];
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
  run(out);
#else
  (void)out;
  std::cout << "skipped: MXFP8 and NVFP4 need the float8 dtypes (LibTorch 2.1+)\n";
#endif
  return 0;
}
