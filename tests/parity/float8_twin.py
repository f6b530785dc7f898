"""The Python half of the float8 parity check (tests/parity/float8_parity.cc).

    float8_twin.py OUT_DIR

The same recipe written in plain torch: torchao.float8's tensorwise dynamic
scaling (float8_utils.py's amax_to_scale and to_fp8_saturated), e4m3 for
inputs and weights, e5m2 for output gradients, torch._scaled_mm in a
torch.autograd.Function, the rest under torch.autocast("cpu", bfloat16).
Trains what the C++ half trained and compares losses and final parameters
bit for bit. Exits 1 on any difference.
"""
import struct
import sys

import torch
import torch.nn.functional as F

STEPS = 100
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12


def bits(x):
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def amax_to_scale(amax, f8):  # torchao: fp64, floored at EPS, stored as fp32
    return (torch.finfo(f8).max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)


def to_fp8_saturated(x, scale, f8):
    m = torch.finfo(f8).max
    return (x.to(torch.float32) * scale).clamp(min=-m, max=m).to(f8)


def scaled_mm(a8, b8, sa, sb, out):
    return torch._scaled_mm(a8, b8, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=out)


def pad_rows_to_16(t):
    rows = t.shape[0]
    padded = (rows + 15) // 16 * 16
    if padded == rows:
        return t
    out = torch.zeros((padded,) + tuple(t.shape[1:]), dtype=t.dtype)
    out[:rows].copy_(t)
    return out


class TensorwiseMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        sx = amax_to_scale(x.abs().max(), E4M3)
        sw = amax_to_scale(w.abs().max(), E4M3)
        x8, w8 = to_fp8_saturated(x, sx, E4M3), to_fp8_saturated(w, sw, E4M3)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.w_dtype = w.dtype
        return scaled_mm(x8, w8.t(), sx, sw, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x8, sx, w8, sw = ctx.saved_tensors
        dy = grad.contiguous()
        sg = amax_to_scale(dy.abs().max(), E5M2)
        g8 = to_fp8_saturated(dy, sg, E5M2)
        dx = scaled_mm(g8, w8.t().contiguous().t(), sg, sw, dy.dtype)
        g8p, x8p = pad_rows_to_16(g8), pad_rows_to_16(x8)
        dw = scaled_mm(g8p.t().contiguous(), x8p.t().contiguous().t(), sg, sx, dy.dtype)
        return dx, dw.to(ctx.w_dtype)


def fits(w):
    return w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0


def fp8_linear(input, weight, bias):
    if not fits(weight):
        return F.linear(input, weight, bias)
    x = input.to(torch.bfloat16)
    y = TensorwiseMatmul.apply(x.reshape(-1, x.shape[-1]), weight)
    y = y.reshape(tuple(input.shape[:-1]) + (weight.shape[0],))
    if bias is not None:
        y = y + bias.to(torch.bfloat16)
    return y


def make_mlp():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                            torch.nn.ReLU(), torch.nn.Linear(128, 10))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
    return m


def forward(model, x):
    for layer in model:
        x = fp8_linear(x, layer.weight, layer.bias) if isinstance(layer, torch.nn.Linear) else layer(x)
    return x


def run_mlp():
    model = make_mlp()
    torch.manual_seed(1)
    x = torch.randn(STEPS, 24, 64) * 4
    y = torch.randint(0, 10, (STEPS, 24))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    losses = []
    for i in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(forward(model, x[i]), y[i])
        loss.backward()
        opt.step()
        losses.append(bits(loss.item()))
    return losses, [p.detach() for p in model.parameters()]


RUNS = {"fp8-tensorwise-mlp": run_mlp}


def main(out):
    print(f"float8_twin: torch {torch.__version__} on cpu")
    cpp = {}
    for line in open(f"{out}/cpp_steps.txt"):
        name, i, loss = line.split()
        cpp.setdefault(name, {})[int(i)] = int(loss)
    if sorted(cpp) != sorted(RUNS):
        print(f"FAIL the C++ half ran {sorted(cpp)}, expected {sorted(RUNS)}")
        return 1
    failures = 0
    for name, run in RUNS.items():
        losses, params = run()
        diff = [i for i, b in enumerate(losses) if cpp[name].get(i) != b]
        cpp_params = torch.load(f"{out}/cpp_{name}.pt", weights_only=False)
        same = len(cpp_params) == len(params) and all(torch.equal(a, b) for a, b in zip(cpp_params, params))
        first = struct.unpack("<f", struct.pack("<I", losses[0]))[0]
        last = struct.unpack("<f", struct.pack("<I", losses[-1]))[0]
        ok = not diff and same and len(cpp[name]) == STEPS
        failures += 0 if ok else 1
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {STEPS} steps, losses "
              f"{'bitwise equal' if not diff else f'differ at steps {diff[:5]}'} ({first:.4f} -> {last:.4f}); "
              f"final parameters {'bitwise equal' if same else 'DIFFER'}")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: float8_twin.py OUT_DIR")
    sys.exit(main(sys.argv[1]))
