"""The Python half of the low-bit optimizer parity check (tests/parity/low_bit_parity.cc).

    low_bit_twin.py OUT_DIR

torchao's low-bit Adam (torchao/optim/adam.py: _AdamBase.step and
single_param_adam; quant_utils.py: create_dynamic_map, scale_tensor,
quantize_8bit_with_qmap, quantize_4bit_with_qmap, dequant_with_qmap,
_fp32_to_bf16_sr; subclass_8bit.py, subclass_4bit.py, subclass_fp8.py: the
maps, block sizes, copy_ and dequantize) written in plain torch, eager mode,
with the states as plain (codes, scale) pairs instead of tensor subclasses, so
that it runs on every torch the C++ half runs on. amsgrad dequantizes the
max state as the other moments (torchao's subclasses implement no maximum).
Trains what the C++ half trained, under torch.autocast / model.to(dtype) /
torch.amp.GradScaler as each run says, and compares losses, scales, final
parameters and final states (codes and scales) bit for bit. Exits 1 on any
difference.
"""
import math
import sys

import torch

from parity_io import backward_and_step, bits, first_difference, make_mlp, read_steps  # noqa: E402

STEPS = 100


# --- torchao/optim/quant_utils.py -------------------------------------------

def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    data = []
    non_sign_bits = total_bits - (1 if signed else 1)
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(
            2 ** (i + non_sign_bits - max_exponent_bits) + 1
            if signed
            else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1,
        )
        boundaries = torch.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    assert len(data) == 2**total_bits
    data.sort()
    return data


def scale_tensor(input, block_size):
    shape = input.shape
    input = input.view(-1, block_size)
    scale = input.abs().amax(-1).clip(1e-12)
    input = input / scale.view(-1, 1)
    return input.view(shape), scale


def quantize_8bit_with_qmap(input, qmap):
    codes = torch.where(input >= qmap[128], 128, 0)
    codes += torch.where(input >= qmap[codes + 64], 64, 0)
    codes += torch.where(input >= qmap[codes + 32], 32, 0)
    codes += torch.where(input >= qmap[codes + 16], 16, 0)
    codes += torch.where(input >= qmap[codes + 8], 8, 0)
    codes += torch.where(input >= qmap[codes + 4], 4, 0)
    codes += torch.where(input >= qmap[codes + 2], 2, 0)
    codes += torch.where(input >= qmap[codes + 1], 1, 0)
    codes_up = (codes + 1).clip(max=255)
    val_down = qmap[codes]
    val_up = qmap[codes_up]
    residual = input - val_down
    codes = torch.where(residual >= (val_up - val_down) * 0.5, codes_up, codes)
    return codes.to(torch.uint8)


def quantize_4bit_with_qmap(input, qmap):
    codes = torch.where(input >= qmap[8], 8, 0)
    codes += torch.where(input >= qmap[codes + 4], 4, 0)
    codes += torch.where(input >= qmap[codes + 2], 2, 0)
    codes += torch.where(input >= qmap[codes + 1], 1, 0)
    codes_up = (codes + 1).clip(max=15)
    val_down = qmap[codes]
    val_up = qmap[codes_up]
    residual = input - val_down
    codes = torch.where(residual >= (val_up - val_down) * 0.5, codes_up, codes)
    return codes.to(torch.uint8)


def dequant_with_qmap(codes, qmap, scale):
    # torchao indexes with codes.int(); torch 1.13 takes only long indices (the same entries)
    out = qmap[codes.long()].view(scale.shape[0], -1) * scale.view(-1, 1)
    return out.view(codes.shape)


def _fp32_to_bf16_sr(x_f32):
    rand_16bit = torch.randint(0, 1 << 16, x_f32.shape, device=x_f32.device, dtype=torch.int32)
    x_f32_bits = x_f32.view(torch.int32)
    x_fraction = x_f32_bits & 0xFFFF
    x_bf16_towards_zero = x_f32_bits & 0xFFFF0000
    x_f32_bits = torch.where(rand_16bit < x_fraction, x_bf16_towards_zero + 0x10000, x_bf16_towards_zero)
    return x_f32_bits.view(torch.float32).bfloat16()


# --- the states (subclass_8bit.py, subclass_4bit.py, subclass_fp8.py) --------

class State8bit:
    def __init__(self, p, signed, block_size):
        self.codes = torch.zeros(p.shape, dtype=torch.uint8)
        self.scale = torch.zeros(self.codes.numel() // block_size)
        self.qmap = torch.tensor(create_dynamic_map(signed), dtype=torch.float32)
        self.block_size = block_size

    def float(self):
        return dequant_with_qmap(self.codes, self.qmap, self.scale)

    def copy_(self, src):
        scaled_src, scale = scale_tensor(src, self.block_size)
        self.codes.copy_(quantize_8bit_with_qmap(scaled_src, self.qmap))
        self.scale.copy_(scale)

    def tensors(self):
        return [self.codes.view(-1), self.scale]


class State4bit:
    def __init__(self, p, signed, block_size):
        n = p.numel()
        self.shape = p.shape
        self.codes = torch.zeros(n // 2, dtype=torch.uint8)
        self.scale = torch.zeros(n // block_size)
        qmap = create_dynamic_map(True, 3, 4) if signed else torch.linspace(0, 1, 17)[1:].tolist()
        self.qmap = torch.tensor(qmap, dtype=torch.float32)
        self.block_size = block_size

    def float(self):
        codes = torch.stack([self.codes >> 4, self.codes & 0b1111], dim=-1)
        return dequant_with_qmap(codes, self.qmap, self.scale).view(self.shape)

    def copy_(self, src):
        scaled_src, scale = scale_tensor(src.view(-1), self.block_size)
        codes = quantize_4bit_with_qmap(scaled_src, self.qmap)
        self.codes.copy_((codes[::2] << 4) | codes[1::2])
        self.scale.copy_(scale)

    def tensors(self):
        return [self.codes, self.scale]


class StateFp8:
    def __init__(self, p, signed, block_size):
        self.codes = torch.zeros(p.shape, dtype=torch.float8_e4m3fn)
        self.scale = torch.zeros(self.codes.numel() // block_size)
        self.block_size = block_size

    def float(self):
        float_data = self.codes.float()
        float_data = float_data.view(-1, self.block_size) * self.scale.view(-1, 1)
        return float_data.view(self.codes.shape)

    def copy_(self, src):
        shape = src.shape
        input = src.view(-1, self.block_size)
        scale = input.abs().amax(-1).clip(1e-12) / torch.finfo(torch.float8_e4m3fn).max
        input = input / scale.view(-1, 1)
        codes = input.to(torch.float8_e4m3fn).view(-1)
        self.codes.copy_(codes.view(shape))
        self.scale.copy_(scale)

    def tensors(self):
        return [self.codes.view(-1).view(torch.uint8), self.scale]


# --- torchao/optim/adam.py ----------------------------------------------------

def single_param_adam(p, grad, step, exp_avg, exp_avg_sq, max_exp_avg_sq, lr, beta1, beta2, weight_decay, eps,
                      IS_ADAMW, BF16_STOCHASTIC_ROUND):
    p_f32 = p.float()
    grad_f32 = grad.float()
    if IS_ADAMW:
        p_f32 = p_f32 - lr * weight_decay * p_f32
    else:
        grad_f32 = grad_f32 + weight_decay * p_f32
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    exp_avg_f32 = exp_avg.float().lerp(grad_f32, 1 - beta1)
    exp_avg_sq_f32 = exp_avg_sq.float().lerp(grad_f32.square(), 1 - beta2)
    exp_avg.copy_(exp_avg_f32)
    exp_avg_sq.copy_(exp_avg_sq_f32)
    if max_exp_avg_sq is not None:
        max_exp_avg_sq_f32 = torch.maximum(max_exp_avg_sq.float(), exp_avg_sq_f32)
        max_exp_avg_sq.copy_(max_exp_avg_sq_f32)
        denom = (max_exp_avg_sq_f32.sqrt() / bias_correction2.sqrt()) + eps
    else:
        denom = (exp_avg_sq_f32.sqrt() / bias_correction2.sqrt()) + eps
    p_f32 = p_f32 - lr * (exp_avg_f32 / bias_correction1) / denom
    if BF16_STOCHASTIC_ROUND:
        p.copy_(_fp32_to_bf16_sr(p_f32))
    else:
        p.copy_(p_f32)


class LowBitAdam(torch.optim.Optimizer):
    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 state_cls, block_size, bf16_stochastic_round=False, is_adamw=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))
        self.state_cls = state_cls
        self.block_size = block_size
        self.bf16_stochastic_round = bf16_stochastic_round
        self.is_adamw = is_adamw
        for group in self.param_groups:  # add_param_group: "convert LR to a tensor"
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)

    def _new_buffer(self, p, signed):
        # follow bitsandbytes, only quantize tensors >= 4096 values
        if p.numel() >= 4096 and p.numel() % self.block_size == 0:
            return self.state_cls(p, signed, self.block_size)
        return torch.zeros_like(p)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = self._new_buffer(p, True)
                    state["exp_avg_sq"] = self._new_buffer(p, False)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = self._new_buffer(p, False)
                state["step"] += 1
                single_param_adam(p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                                  state.get("max_exp_avg_sq", None), group["lr"], group["betas"][0],
                                  group["betas"][1], group["weight_decay"], group["eps"], self.is_adamw,
                                  self.bf16_stochastic_round and p.dtype is torch.bfloat16)


def state_tensors(opt, model):
    out = []
    for p in model.parameters():
        s = opt.state[p]
        out.append(s["step"])
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in s:
                out += [s[key]] if isinstance(s[key], torch.Tensor) else s[key].tensors()
    return out


# --- the runs -----------------------------------------------------------------

def has_fp8():
    return hasattr(torch, "float8_e4m3fn")


def has_cpu_fp16():  # as amp's compat: CPU fp16 autocast and GradScaler kernels from 2.3
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 3)


def runs():
    r = {
        "adamw8bit-32-true": dict(state="8bit", adamw=True, wd=1e-2, amsgrad=False, policy="32-true"),
        "adam8bit-amsgrad-32-true": dict(state="8bit", adamw=False, wd=1e-2, amsgrad=True, policy="32-true"),
        "adamw4bit-bf16-mixed": dict(state="4bit", adamw=True, wd=1e-2, amsgrad=False, policy="bf16-mixed"),
        "adamw8bit-bf16-true-sr": dict(state="8bit", adamw=True, wd=1e-2, amsgrad=False, policy="bf16-true", sr=True),
    }
    if has_fp8():
        r["adamwfp8-bf16-mixed"] = dict(state="fp8", adamw=True, wd=1e-2, amsgrad=False, policy="bf16-mixed")
    if has_cpu_fp16():
        r["adamw8bit-16-mixed-inf"] = dict(state="8bit", adamw=True, wd=1e-2, amsgrad=False, policy="16-mixed")
    return r


def data():
    torch.manual_seed(1)
    x = torch.randn(STEPS, 64, 64) * 2
    y = torch.randint(0, 10, (STEPS, 64))
    return x, y


def run(name, r, x, y):
    model = make_mlp()
    if r["policy"] == "bf16-true":
        model = model.to(torch.bfloat16)
    state_cls = {"8bit": State8bit, "4bit": State4bit, "fp8": StateFp8 if has_fp8() else None}[r["state"]]
    opt = LowBitAdam(model.parameters(), 2e-3, weight_decay=r["wd"], amsgrad=r["amsgrad"], state_cls=state_cls,
                     block_size=128 if r["state"] == "4bit" else 256, bf16_stochastic_round=r.get("sr", False),
                     is_adamw=r["adamw"])
    scaler = torch.amp.GradScaler("cpu", growth_interval=10) if r["policy"] == "16-mixed" else None
    dtype = next(model.parameters()).dtype
    torch.manual_seed(7)
    rows = []
    for i in range(STEPS):
        opt.zero_grad()
        poison = name.endswith("-inf") and i in (3, 4, 40)
        if r["policy"] in ("bf16-mixed", "16-mixed"):
            ac = torch.bfloat16 if r["policy"] == "bf16-mixed" else torch.float16
            with torch.autocast("cpu", dtype=ac):
                loss = torch.nn.functional.cross_entropy(model(x[i].to(dtype)).float(), y[i])
        else:
            loss = torch.nn.functional.cross_entropy(model(x[i].to(dtype)).float(), y[i])
        if poison:
            loss = loss * math.inf
        scale = backward_and_step(loss, opt, scaler)
        rows.append((name, i, bits(loss.item()), bits(scale)))
    return rows, [p.detach() for p in model.parameters()], state_tensors(opt, model)


def same(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def main(out):
    print(f"low_bit_twin: torch {torch.__version__} on cpu")
    expected = runs()
    cpp = read_steps(out, expected)
    if cpp is None:
        return 1
    x, y = data()
    failed = 0
    for name, r in expected.items():
        rows, params, states = run(name, r, x, y)
        cpp_params = torch.load(f"{out}/{name}.params.pt", weights_only=False)
        cpp_states = torch.load(f"{out}/{name}.states.pt", weights_only=False)
        first = first_difference(rows, cpp[name])
        same_steps = first is None
        same_params = len(params) == len(cpp_params) and all(same(a, b) for a, b in zip(params, cpp_params))
        same_states = len(states) == len(cpp_states) and all(same(a, b) for a, b in zip(states, cpp_states))
        skips = sum(1 for i in range(1, STEPS) if rows[i][3] < rows[i - 1][3])
        ok = same_steps and same_params and same_states
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {STEPS} steps ({skips} backoffs), losses and scales "
              f"{'bitwise equal' if same_steps else f'differ from step {first}'}, parameters "
              f"{'bitwise equal' if same_params else 'DIFFER'}, states (codes, scales) "
              f"{'bitwise equal' if same_states else 'DIFFER'}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: low_bit_twin.py OUT_DIR")
    sys.exit(main(sys.argv[1]))
