"""tests/parity/parity_twin.py: the Python half of the parity check.

    python3 parity_twin.py OUT_DIR [cuda|cpu]     (after `parity OUT_DIR [cuda|cpu]`)

Runs the steps of tests/parity/parity.cc with Python's torch.amp (autocast,
GradScaler; SGD(foreach=False) where C++ runs LibTorch's own SGD step, the
per-tensor loop it is; fused=True optimizers where C++ takes the fused path)
and compares every step's loss and loss scale and the final parameters with
the C++ run bit for bit. Fails unless the C++ half ran the runs this torch
and device call for, and every scaled run both backed off and grew its scale
(so skipped steps were compared). On cuda, also writes a GradScaler
state_dict with torch.save for the Python -> C++ direction. Exit 1 on any
difference.
"""
import inspect
import struct
import sys
from typing import Callable, NamedTuple, Optional

import torch

from parity_io import bits, make_mlp  # noqa: E402

STEPS = 300


class Run(NamedTuple):
    dtype: torch.dtype  # autocast's, or the model's in a True run
    true: bool  # Lightning's "bf16-true"/"64-true": the model in that dtype, no autocast
    init_scale: Optional[float]  # a GradScaler's, or None: no loss scaling
    make_opt: Callable
    max_norm: Optional[float]  # clip_grad_norm_ after unscale_, or None
    fused: bool  # run only where the LibTorch has fused kernels for the device
    gan: bool = False  # the discriminator, called on a real and a fake half per step (parity.cc's gan_run)


def sgd(**kw):
    return lambda p: torch.optim.SGD(p, **kw)


def adam(**kw):
    return lambda p: torch.optim.Adam(p, lr=1e-3, fused=True, **kw)


RUNS = {
    # The optimizer's own step() in C++ (TrainerOptions().fused(false)): SGD(foreach=False) is the same ops.
    "trainer-bf16-mixed-sgd-clip-unfused": Run(
        torch.bfloat16, False, None, sgd(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4, foreach=False),
        1.0, False),
    "trainer-64-true-sgd-unfused": Run(torch.float64, True, None, sgd(lr=0.01, momentum=0.9, foreach=False), None,
                                       False),
    # nn.Linear under autocast casts each weight once per step; C++ matches with amp's linear routing.
    "gan-d-bf16-mixed-sgd-unfused": Run(torch.bfloat16, False, None, sgd(lr=0.01, momentum=0.9, foreach=False),
                                        None, False, gan=True),
    # The same loop under a bare amp::Autocast guard and LibTorch's own SGD step (no Trainer).
    "gan-d-bf16-autocast-sgd-unfused": Run(torch.bfloat16, False, None, sgd(lr=0.01, momentum=0.9, foreach=False),
                                           None, False, gan=True),
    # The fused path.
    "recipe-16-mixed": Run(torch.float16, False, 65536.0, sgd(lr=0.05, momentum=0.9, foreach=False), None, True),
    "trainer-16-mixed": Run(torch.float16, False, 65536.0, adam(), None, True),
    "trainer-bf16-mixed": Run(torch.bfloat16, False, None, adam(), None, True),
    "trainer-16-mixed-adamw-clip": Run(
        torch.float16, False, 65536.0,
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, amsgrad=True, fused=True), 1.0, True),
    "trainer-16-mixed-sgd": Run(
        torch.float16, False, 1024.0, sgd(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4, fused=True),
        None, True),
    "trainer-bf16-true": Run(torch.bfloat16, True, None, adam(), None, True),
    "trainer-64-true": Run(torch.float64, True, None, adam(), None, True),
    "gan-d-bf16-mixed": Run(torch.bfloat16, False, None, adam(), None, True, gan=True),
}


class GanRun(NamedTuple):  # tests/parity/parity.cc precision_run: two models, two optimizers, one scaler
    dtype: torch.dtype  # autocast's
    init_scale: Optional[float]  # the one GradScaler's, or None: no loss scaling
    make_opt_g: Callable
    make_opt_d: Callable
    fused: bool  # run only where the LibTorch has fused kernels for the device
    poison: bool  # inf injected into D's and G's losses at chosen iterations


GAN_RUNS = {
    "precision-bf16-mixed-gan-unfused": GanRun(
        torch.bfloat16, None, sgd(lr=0.02, momentum=0.5, foreach=False),
        sgd(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4, foreach=False), False, False),
    "precision-16-mixed-gan": GanRun(
        torch.float16, 1024.0, lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True),
        lambda p: torch.optim.Adam(p, lr=2e-4, betas=(0.5, 0.999), fused=True), True, True),
}


def has_fused(device):  # as parity.cc decides: CUDA, or CPU from torch 2.4
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return device == "cuda" or (major, minor) >= (2, 4)


def make_model(device):  # as parity.cc's make_model
    return make_mlp(seed=0, hidden=256, out=10).to(device)


def make_discriminator(device):  # as parity.cc's make_discriminator
    return make_mlp(seed=2, hidden=256, out=1).to(device)


def data(device):
    torch.manual_seed(1)
    x = (torch.randn(STEPS, 128, 64) * 4).to(device)
    y = torch.randint(0, 10, (STEPS, 128)).to(device)
    return x, y


def run(name, device, x, y):
    r = RUNS[name]
    if r.gan:
        model = make_discriminator(device)
    else:
        model = make_model(device).to(r.dtype) if r.true else make_model(device)
    opt = r.make_opt(model.parameters())
    # No GradScaler at all when unscaled: torch 1.13 has no torch.amp.GradScaler.
    scaler = None if r.init_scale is None else torch.amp.GradScaler(device, init_scale=r.init_scale, growth_interval=20)
    clip = torch.nn.utils.clip_grad_norm_
    # foreach=False where clip_grad_norm_ has it (2.0+): amp clips tensor by tensor, as LibTorch's C++ one does.
    clip_kw = {"foreach": False} if "foreach" in inspect.signature(clip).parameters else {}
    rows = []
    for i in range(STEPS):
        opt.zero_grad()
        if r.gan:
            with torch.autocast(device, dtype=r.dtype):
                real, fake = model(x[i][:64]), model(x[i][64:])
                loss = torch.relu(torch.rsub(real, 1)).mean() + torch.relu(torch.add(fake, 1)).mean()
        elif r.true:
            loss = torch.nn.functional.cross_entropy(model(x[i].to(r.dtype)), y[i])
        else:
            with torch.autocast(device, dtype=r.dtype):
                loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
        if scaler is None:
            loss.backward()
            if r.max_norm is not None:
                clip(model.parameters(), r.max_norm, **clip_kw)
            opt.step()
        else:
            scaler.scale(loss).backward()
            if r.max_norm is not None:
                scaler.unscale_(opt)
                clip(model.parameters(), r.max_norm, **clip_kw)
            scaler.step(opt)
            scaler.update()
        rows.append((name, i, bits(loss.item()), bits(scaler.get_scale() if scaler else 1.0)))
    return rows, [p.detach().cpu() for p in model.parameters()]


class Mlp(torch.nn.Module):
    """parity.cc's Mlp: F.linear, as the C++ half's torch::linear."""

    def __init__(self, i, h, o):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(h, i) * 0.1)
        self.b1 = torch.nn.Parameter(torch.randn(h) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(o, h) * 0.1)
        self.b2 = torch.nn.Parameter(torch.randn(o) * 0.1)

    def forward(self, x):
        f = torch.nn.functional
        return f.linear(f.leaky_relu(f.linear(x, self.w1, self.b1), 0.2), self.w2, self.b2)


def run_gan(name, device):
    """torch's AMP recipe for several optimizers: one GradScaler, scaler.step per optimizer, one update."""
    r = GAN_RUNS[name]
    torch.manual_seed(2)
    gen, disc = Mlp(16, 64, 32).to(device), Mlp(32, 64, 1).to(device)
    torch.manual_seed(4)
    z = torch.randn(STEPS, 64, 16).to(device)
    real = (torch.randn(STEPS, 64, 32) * 0.5 + 1.0).to(device)
    opt_g, opt_d = r.make_opt_g(gen.parameters()), r.make_opt_d(disc.parameters())
    scaler = None if r.init_scale is None else torch.amp.GradScaler(device, init_scale=r.init_scale, growth_interval=20)
    clip = torch.nn.utils.clip_grad_norm_
    clip_kw = {"foreach": False} if "foreach" in inspect.signature(clip).parameters else {}
    inf = float("inf")

    def bce(logits, target):
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))

    def backward(loss, poisoned):
        loss = loss * inf if poisoned else loss
        (loss if scaler is None else scaler.scale(loss)).backward()

    def step(opt, clip_params=None):
        if scaler is None:
            if clip_params is not None:
                clip(clip_params, 1.0, **clip_kw)
            opt.step()
        else:
            if clip_params is not None:
                scaler.unscale_(opt)
                clip(clip_params, 1.0, **clip_kw)
            scaler.step(opt)

    rows = []
    for i in range(STEPS):
        opt_d.zero_grad()
        with torch.autocast(device, dtype=r.dtype):
            loss_d = bce(disc(real[i]), 1.0) + bce(disc(gen(z[i]).detach()), 0.0)
        backward(loss_d, r.poison and i % 50 == 10)
        step(opt_d)
        opt_g.zero_grad()
        with torch.autocast(device, dtype=r.dtype):
            loss_g = bce(disc(gen(z[i])), 1.0)
        backward(loss_g, r.poison and i % 50 == 35)
        step(opt_g, gen.parameters())
        if scaler is not None:
            scaler.update()
        scale = bits(scaler.get_scale() if scaler else 1.0)
        rows += [(name, 2 * i, bits(loss_d.item()), scale), (name, 2 * i + 1, bits(loss_g.item()), scale)]
    return rows, [p.detach().cpu() for p in list(gen.parameters()) + list(disc.parameters())]


def main(out, device):
    x, y = data(device)
    m = make_model(device)
    w = next(m.parameters())
    print(f"python: torch {torch.__version__} on {device}: inputs x.sum {x.sum().item():g} y.sum {y.sum().item()} "
          f"w0[0,0] {w.view(-1)[0].item():g} w.sum {w.sum().item():g}")
    cpp = {}
    for line in open(f"{out}/cpp_steps.txt"):
        run_name, i, loss, scale = line.split()
        cpp[(run_name, int(i))] = (int(loss), int(scale))
    expected = [name for name, r in {**RUNS, **GAN_RUNS}.items() if not r.fused or has_fused(device)]
    ran = sorted({name for name, _ in cpp})
    if ran != sorted(expected):
        print(f"FAIL the C++ half ran {ran}, expected {sorted(expected)} for torch {torch.__version__} on {device}")
        return 1
    failures = 0
    for name in expected:
        rows, params = run_gan(name, device) if name in GAN_RUNS else run(name, device, x, y)
        scaled = (GAN_RUNS[name] if name in GAN_RUNS else RUNS[name]).init_scale is not None
        diff_steps = [r[1] for r in rows if cpp.get((r[0], r[1])) != (r[2], r[3])]
        cpp_params = torch.load(f"{out}/cpp_{name}.pt", weights_only=False)
        same_params = len(cpp_params) == len(params) and all(torch.equal(a, b) for a, b in zip(cpp_params, params))
        scales = [struct.unpack("<f", struct.pack("<I", r[3]))[0] for r in rows]
        backoffs = sum(1 for a, b in zip(scales, scales[1:]) if b < a)
        growths = sum(1 for a, b in zip(scales, scales[1:]) if b > a)
        if diff_steps:
            i = diff_steps[0]
            c = cpp.get((name, i))
            print(f"  first difference at step {i}: python loss/scale bits {rows[i][2]:#x}/{rows[i][3]:#x}, "
                  f"C++ {c[0]:#x}/{c[1]:#x}" if c else f"  step {i} missing in the C++ log")
        exercised = not scaled or (backoffs > 0 and growths > 0)
        ok = not diff_steps and same_params and exercised
        failures += 0 if ok else 1
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {STEPS} steps, losses and scales "
              f"{'bitwise equal' if not diff_steps else f'differ at steps {diff_steps[:5]}'}; "
              f"final parameters {'bitwise equal' if same_params else 'DIFFER'}; "
              + (f"scale backed off {backoffs}x, grew {growths}x, final {scales[-1]:g}"
                 + ("" if exercised else " (a scaled run must both back off and grow)") if scaled else "unscaled"))
    if device == "cuda":
        # Python -> C++: a GradScaler state as torch.save writes it (read by tests/scaler/scaler_test.cc's twin file).
        s = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_factor=3.0, growth_interval=7)
        w = torch.zeros(2, device="cuda", requires_grad=True)
        o = torch.optim.SGD([w], lr=0.1)
        s.scale((w * float("inf")).sum()).backward()
        s.step(o)
        s.update()
        torch.save(s.state_dict(), f"{out}/python_grad_scaler.pt")
        print("wrote", f"{out}/python_grad_scaler.pt", s.state_dict())
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] not in ("cuda", "cpu")):
        sys.exit("usage: parity_twin.py OUT_DIR [cuda|cpu]")
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else "cuda"))
