"""The Python half of the float8 parity check (tests/parity/float8_parity.cc).

    float8_twin.py OUT_DIR

The same recipe written in plain torch: torchao.float8's tensorwise dynamic
scaling (float8_utils.py's amax_to_scale and to_fp8_saturated), or Transformer
Engine's delayed scaling (its default fused kernel's update, delayed_scaling.cu,
with "max"), e4m3 for inputs and weights, e5m2 for output
gradients, torch._scaled_mm in a torch.autograd.Function (called with autocast
excluded, where torchao calls it), the rest under torch.autocast("cpu", bfloat16).
oneDNN is off on both sides, so every CPU takes _scaled_mm's emulated path
(with AMX-INT8 and oneDNN on it would take mkldnn_scaled_mm instead).
Trains what the C++ half trained and compares losses and final parameters
bit for bit. Exits 1 on any difference.
"""
import struct
import sys

import torch
import torch.nn.functional as F

from parity_io import bits, make_mlp  # noqa: E402

STEPS = 100
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12


def amax_to_scale(amax, f8):  # torchao: fp64, floored at EPS, stored as fp32
    return (torch.finfo(f8).max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)


def to_fp8_saturated(x, scale, f8):
    m = torch.finfo(f8).max
    return (x.to(torch.float32) * scale).clamp(min=-m, max=m).to(f8)


def where_torchao_calls_scaled_mm():
    """torchao reaches torch._scaled_mm from Float8TrainingTensor's
    __torch_dispatch__ for aten.mm, inside mm's autocast kernel, which has
    excluded the autocast key (autocast_mode.h's WrapFunction_). The CPU
    emulation's fp32 matmul therefore runs in fp32, not bf16."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def scaled_mm(a8, b8, sa, sb, out):
    with where_torchao_calls_scaled_mm():
        return torch._scaled_mm(a8, b8, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=out)


def pad_rows_to_16(t):
    rows = t.shape[0]
    padded = (rows + 15) // 16 * 16
    if padded == rows:
        return t
    out = torch.zeros((padded,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    out[:rows].copy_(t)
    return out


def scale_for(t, f8, history, scale, role):
    amax = t.abs().max()
    if history is None:  # tensorwise: from this tensor's own amax
        return amax_to_scale(amax, f8)
    slot = history[0, role]  # delayed: the amax kept (the step's largest), the scale from earlier steps
    slot.copy_(torch.maximum(slot, amax))
    return scale[role].clone()


class Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, slots):
        fh, fs = (slots["fwd_history"], slots["fwd_scale"]) if slots else (None, None)
        sx = scale_for(x, E4M3, fh, fs, 0)
        sw = scale_for(w, E4M3, fh, fs, 1)
        x8, w8 = to_fp8_saturated(x, sx, E4M3), to_fp8_saturated(w, sw, E4M3)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.w_dtype = w.dtype
        ctx.slots = slots
        return scaled_mm(x8, w8.t(), sx, sw, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x8, sx, w8, sw = ctx.saved_tensors
        dy = grad.contiguous()
        s = ctx.slots
        sg = scale_for(dy, E5M2, s["bwd_history"] if s else None, s["bwd_scale"] if s else None, 0)
        g8 = to_fp8_saturated(dy, sg, E5M2)
        dx = scaled_mm(g8, w8.t().contiguous().t(), sg, sw, dy.dtype)
        g8p, x8p = pad_rows_to_16(g8), pad_rows_to_16(x8)
        dw = scaled_mm(g8p.t().contiguous(), x8p.t().contiguous().t(), sg, sx, dy.dtype)
        return dx, dw.to(ctx.w_dtype), None


def fmaxf(a, b):  # CUDA's fmaxf: a NaN operand yields the other one
    return b if a != a else a if b != b else max(a, b)


def delayed_update(history, scale, fp8_max, margin):
    """Transformer Engine's default update, its fused CUDA kernel
    (common/recipe/delayed_scaling.cu, kernel_bulk, amax_compute_algo "max"),
    one thread block per role, written out as a loop."""
    f32 = torch.float32
    scaled_max = torch.tensor(fp8_max, dtype=f32) * torch.tensor(2.0, dtype=f32) ** -margin
    new_scale = scale.clone()
    length = history.shape[0]
    for r in range(history.shape[1]):
        col = history[:, r].clone()
        last_amax = col[0].item()
        amax = 0.0
        if last_amax != 0.0:
            for i in range(length):
                a = col[i + 1] if i < length - 1 else col[0]
                amax = fmaxf(amax, a.item())
                history[i, r] = a if i > 0 else 0.0
        amax_t = torch.tensor(amax, dtype=f32)
        s = scaled_max / amax_t if (torch.isfinite(amax_t) and amax > 0) else scale[r]
        if torch.isinf(s):
            s = torch.tensor(torch.finfo(f32).max, dtype=f32)
        new_scale[r] = s
    return new_scale


def delayed_update_vectorized(history, scale, fp8_max, margin):
    """delayed_update's arithmetic as tensor ops, without host syncs (the
    benchmark's twin, bench/float8_ffn_twin.py)."""
    f32 = torch.float32
    rolls = history[0] != 0
    amax = torch.where(torch.isnan(history), torch.zeros_like(history), history).max(dim=0).values
    sf = torch.tensor(fp8_max * 2.0 ** -margin, dtype=f32, device=history.device) / amax
    sf = torch.where(rolls & (amax > 0) & torch.isfinite(amax), sf, scale)
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, torch.finfo(f32).max), sf)
    rolled = torch.roll(history, -1, 0)
    rolled[0] = 0
    history.copy_(torch.where(rolls, rolled, history))
    return sf


class Delayed:
    def __init__(self, model, length, margin=0, update=delayed_update):
        self.margin, self.update_fn = margin, update
        self.slots = {}  # id(weight) -> state, in named_modules order
        for _, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and fits(m.weight):
                on = {"device": m.weight.device}
                self.slots[id(m.weight)] = {"fwd_history": torch.zeros(length, 2, **on), "fwd_scale": torch.ones(2, **on),
                                            "bwd_history": torch.zeros(length, 1, **on), "bwd_scale": torch.ones(1, **on)}

    def update(self):
        for s in self.slots.values():
            s["fwd_scale"].copy_(self.update_fn(s["fwd_history"], s["fwd_scale"], torch.finfo(E4M3).max, self.margin))
            s["bwd_scale"].copy_(self.update_fn(s["bwd_history"], s["bwd_scale"], torch.finfo(E5M2).max, self.margin))

    def state(self):
        return [t for s in self.slots.values() for t in (s["fwd_history"], s["fwd_scale"], s["bwd_history"],
                                                           s["bwd_scale"])]


# --- torchao's rowwise recipes, transliterated from torchao/float8 (config.py's
# from_recipe_name, float8_linear.py's matmul_with_hp_or_float8_args,
# float8_ops.py's preprocess_addmm and addmm_float8_unwrapped,
# float8_utils.py's amax_to_scale), with pad_inner_dim=True. ---

class F8:  # a Float8TrainingTensor: data, scale, axiswise_dim
    def __init__(self, data, scale, axiswise_dim):
        self.data, self.scale, self.axiswise_dim = data, scale, axiswise_dim

    def t(self):
        return F8(self.data.t(), self.scale.t() if self.axiswise_dim is not None else self.scale,
                  None if self.axiswise_dim is None else (1 - self.axiswise_dim % 2))


def to_f8(hp, axiswise_dim):  # hp_tensor_to_float8_dynamic, e4m3, round_scales_to_power_of_2
    amax = torch.max(torch.abs(hp)) if axiswise_dim is None else torch.amax(torch.abs(hp), dim=axiswise_dim,
                                                                           keepdim=True)
    scale = amax_to_scale(amax, E4M3)
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    return F8(to_fp8_saturated(hp, scale, E4M3), scale, axiswise_dim)


def pad_dim(t, dim):  # pad_tensor_for_matmul: zeros up to a multiple of 16
    size = t.shape[dim]
    padded = (size + 15) // 16 * 16
    if padded == size:
        return t
    shape = list(t.shape)
    shape[dim] = padded - size
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype)], dim=dim)


def f8_mm(a, b, out_dtype, use_fast_accum):
    a_data, b_data = pad_dim(a.data, 1), pad_dim(b.data, 0)
    if not a_data.is_contiguous():
        a_data = a_data.contiguous()
    if b_data.is_contiguous():
        b_data = b_data.t().contiguous().t()
    a_scale, b_scale = a.scale, b.scale
    if a.axiswise_dim is not None and b.axiswise_dim is None:
        b_scale = b_scale.repeat(b_data.shape[1]).reshape(1, -1)
    a_inv, b_inv = a_scale.reciprocal(), b_scale.reciprocal()
    post = None
    rowwise = a_scale.shape == (a_data.shape[0], 1) and b_scale.shape == (1, b_data.shape[1])
    if rowwise and not use_fast_accum:
        post = a_inv * b_inv
        a_inv = a_inv.new_ones(())
        b_inv = a_inv.new_ones(())
    with where_torchao_calls_scaled_mm():
        out = torch._scaled_mm(a_data, b_data, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype,
                               use_fast_accum=use_fast_accum)
    if post is not None:
        out *= post
    return out


class RowwiseMatmul(torch.autograd.Function):  # input_hp [M, K] bf16, weight_hp_t [K, N] fp32
    @staticmethod
    def forward(ctx, input_hp, weight_hp_t, gw_hp):
        ctx.save_for_backward(input_hp, weight_hp_t)
        ctx.gw_hp = gw_hp
        x = to_f8(input_hp, -1)
        w = to_f8(weight_hp_t, 0)
        return f8_mm(x, w, input_hp.dtype, use_fast_accum=True)  # gemm_config_output: fast accumulation

    @staticmethod
    def backward(ctx, grad_output):
        input_hp, weight_hp_t = ctx.saved_tensors
        go = to_f8(grad_output, -1)
        w = to_f8(weight_hp_t, None if ctx.gw_hp else -1)  # cast_config_weight_for_grad_input
        grad_input = f8_mm(go, w.t(), grad_output.dtype, use_fast_accum=False)
        if ctx.gw_hp:  # ScalingType.DISABLED for both operands of grad_weight
            grad_weight = torch.mm(grad_output.t(), input_hp)
        else:
            grad_weight = f8_mm(to_f8(grad_output, 0).t(), to_f8(input_hp, 0), grad_output.dtype,
                                use_fast_accum=False)
        return grad_input, grad_weight.t(), None


def rowwise_linear(input, weight, bias, gw_hp):
    if not fits(weight):
        return F.linear(input, weight, bias)
    x = input.to(torch.bfloat16)
    y = RowwiseMatmul.apply(x.reshape(-1, x.shape[-1]), weight.t(), gw_hp)
    y = y.reshape(tuple(input.shape[:-1]) + (weight.shape[0],))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def fits(w):
    return w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0


def fp8_linear(input, weight, bias, delayed=None):
    if not fits(weight):
        return F.linear(input, weight, bias)
    x = input.to(torch.bfloat16)
    y = Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, delayed.slots[id(weight)] if delayed else None)
    y = y.reshape(tuple(input.shape[:-1]) + (weight.shape[0],))
    if bias is not None:
        y = y + bias.to(torch.bfloat16)
    return y


def linear_for(recipe, fp8):  # the linear of a run: (input, module) -> output
    if recipe in ("rowwise", "rowwise-gw-hp"):
        return lambda t, m: rowwise_linear(t, m.weight, m.bias, recipe == "rowwise-gw-hp")
    return lambda t, m: fp8_linear(t, m.weight, m.bias, fp8)


def forward(model, x, lin):
    for layer in model:
        x = lin(x, layer) if isinstance(layer, torch.nn.Linear) else layer(x)
    return x


def train(model, fp8, x, y, forward):
    """SGD with momentum, 100 steps, the forward under bf16 autocast; delayed scaling updated after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    losses = []
    for i in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(forward(x[i]), y[i])
        loss.backward()
        opt.step()
        if fp8:
            fp8.update()
        losses.append(bits(loss.item()))
    return losses, [p.detach() for p in model.parameters()], fp8.state() if fp8 else None


def run_mlp(recipe):
    model = make_mlp()
    fp8 = Delayed(model, 16) if recipe == "delayed" else None
    torch.manual_seed(1)
    x = torch.randn(STEPS, 24, 64) * 4
    y = torch.randint(0, 10, (STEPS, 24))
    lin = linear_for(recipe, fp8)
    return train(model, fp8, x, y, lambda xi: forward(model, xi, lin))


class Block(torch.nn.Module):
    """float8_parity.cc's BlockImpl, op for op."""

    def __init__(self, classes=10, head=None):
        super().__init__()
        self.head_mode = head  # None: as the other linears; "bf16": plain autocast; "fp32": autocast off
        self.ln1 = torch.nn.LayerNorm(64)
        self.qkv = torch.nn.Linear(64, 192)
        self.proj = torch.nn.Linear(64, 64)
        self.ln2 = torch.nn.LayerNorm(64)
        self.fc1 = torch.nn.Linear(64, 256)
        self.fc2 = torch.nn.Linear(256, 64)
        self.head = torch.nn.Linear(64, classes)

    def forward(self, x, linear):
        lin = lambda m, t: linear(t, m)
        b, t = x.shape[0], x.shape[1]
        parts = lin(self.qkv, self.ln1(x)).reshape(b, t, 3, 4, 16).permute(2, 0, 3, 1, 4)
        q, k, v = parts[0], parts[1], parts[2]
        att = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / 4.0, -1)
        o = torch.matmul(att, v).permute(0, 2, 1, 3).reshape(b, t, 64)
        h = x + lin(self.proj, o)
        h = h + lin(self.fc2, F.gelu(lin(self.fc1, self.ln2(h))))
        if self.head_mode == "bf16":
            return self.head(h.mean(1))
        if self.head_mode == "fp32":
            with torch.autocast("cpu", enabled=False):
                return self.head(h.mean(1).float())
        return lin(self.head, h.mean(1))


def run_block(recipe, classes=10, head=None):
    torch.manual_seed(0)
    model = Block(classes, head)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("ln"):
                p.copy_(torch.randn(p.shape) * 0.05)
    fp8 = Delayed(model, 16) if recipe == "delayed" else None
    torch.manual_seed(1)
    x = torch.randn(STEPS, 5, 8, 64)
    y = torch.randint(0, 10, (STEPS, 5))
    lin = linear_for(recipe, fp8)
    return train(model, fp8, x, y, lambda xi: model(xi, lin))


RECIPES = ("tensorwise", "delayed", "rowwise", "rowwise-gw-hp")
RUNS = {f"fp8-{r}-{m}": (lambda r=r, run=run: run(r)) for r in RECIPES for m, run in (("mlp", run_mlp),
                                                                                         ("block", run_block))}
# The precision map keeps a head that fits float8 out of it (C++: PrecisionMap().path("head", ...)).
RUNS["fp8-tensorwise-block-head-not-fp8"] = lambda: run_block("tensorwise", 16, "bf16")
RUNS["fp8-tensorwise-block-head-fp32"] = lambda: run_block("tensorwise", 16, "fp32")


def vectorized_update_is_the_loop():
    """The benchmark's vectorized update against the kernel loop, on histories
    with a zero step, inf, NaN, a tiny amax and ordinary ones."""
    inf, nan = float("inf"), float("nan")
    h = torch.tensor([[0.0, inf, nan, 1e-40, 3.0, 0.0], [5.0, 1.0, 1.0, 0.0, 2.0, 0.0], [1.0, 2.0, 0.5, 0.0, 7.0, 0.0]])
    scale = torch.tensor([3.0, 7.0, 7.0, 1.0, 1.0, 2.0])
    h1, h2 = h.clone(), h.clone()
    s1, s2 = delayed_update(h1, scale, 448.0, 1), delayed_update_vectorized(h2, scale, 448.0, 1)
    return torch.equal(s1, s2) and torch.equal(torch.nan_to_num(h1), torch.nan_to_num(h2))


def main(out):
    print(f"float8_twin: torch {torch.__version__} on cpu")
    torch.backends.mkldnn.enabled = False  # the C++ half: at::globalContext().setUserEnabledMkldnn(false)
    if not vectorized_update_is_the_loop():
        print("FAIL the vectorized delayed update (the benchmark's) differs from the kernel loop")
        return 1
    cpp = {}
    for line in open(f"{out}/cpp_steps.txt"):
        name, i, loss = line.split()
        cpp.setdefault(name, {})[int(i)] = int(loss)
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    expected = sorted(n for n in RUNS if "rowwise" not in n or (major, minor) >= (2, 14))  # CPU rowwise: 2.14
    if sorted(cpp) != expected:
        print(f"FAIL the C++ half ran {sorted(cpp)}, expected {expected}")
        return 1
    failures = 0
    for name, run in RUNS.items():
        if name not in expected:
            print(f"skip {name}: CPU rowwise scales need torch 2.14")
            continue
        losses, params, state = run()
        diff = [i for i, b in enumerate(losses) if cpp[name].get(i) != b]
        cpp_params = torch.load(f"{out}/cpp_{name}.pt", weights_only=False)
        same = len(cpp_params) == len(params) and all(torch.equal(a, b) for a, b in zip(cpp_params, params))
        if state is not None:  # the amax histories and scales too
            cpp_state = torch.load(f"{out}/cpp_{name}_fp8.pt", weights_only=False)
            same_state = len(cpp_state) == len(state) and all(torch.equal(a, b) for a, b in zip(cpp_state, state))
            moved = all(not torch.equal(s, torch.ones_like(s)) for s in state[1::2])  # every scale left 1
            print(f"     {name}: amax histories and scales {'bitwise equal' if same_state else 'DIFFER'}"
                  f"{'' if moved else ' (a scale never moved from 1)'}")
            same = same and same_state and moved
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
