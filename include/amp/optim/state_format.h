// amp/optim/state_format.h: StateFormat, how a low-bit optimizer keeps a
// moment (amp/optim/quantized_state.h), and its name.
#pragma once

namespace amp {

// How a moment is stored. kFloat: a plain tensor of the parameter's dtype
// (tensors below the quantization threshold). kInt8: one uint8 code per
// element into bitsandbytes' dynamic map; kInt4: two 4-bit codes per byte
// (torchao's 4-bit maps); kFp8: float8_e4m3fn (LibTorch 2.1+). Every
// quantized format keeps one fp32 absmax scale per block.
enum class StateFormat { kFloat, kInt8, kInt4, kFp8 };

namespace detail {
inline const char* state_format_name(StateFormat f) {
  switch (f) {
    case StateFormat::kInt8:
      return "8-bit";
    case StateFormat::kInt4:
      return "4-bit";
    case StateFormat::kFp8:
      return "fp8";
    case StateFormat::kFloat:
      break;
  }
  return "float";
}
}  // namespace detail

}  // namespace amp
