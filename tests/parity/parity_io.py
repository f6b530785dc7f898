"""What the Python twins share (the C++ halves share tests/parity/parity_io.h)."""
import struct

import torch


def bits(x):
    """A float's fp32 bits, as the C++ halves log them."""
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def make_mlp(seed=0, hidden=128, out=10):
    """64-hidden-hidden-out with ReLUs, weights randn * 0.05 drawn after manual_seed(seed) (the
    modules' own init differs between C++ and Python): parity_io.h's make_mlp with the defaults,
    parity.cc's make_model and make_discriminator with theirs."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                            torch.nn.ReLU(), torch.nn.Linear(hidden, out))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
    return m


def init(model):
    """The transformer twins' weights, as parity_io.h's init(): after manual_seed(0), in parameter
    order, LayerNorm weights 1 + 0.05 randn, the rest 0.05 randn."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "ln" in name and name.endswith("weight")
            p.copy_(torch.randn(p.shape) * 0.05 + (1.0 if norm else 0.0))


def backward_and_step(loss, opt, scaler):
    """torch.amp's recipe after the forward: scaled backward, step, update
    (plain backward and step without a scaler); returns the scale after it."""
    if scaler is None:
        loss.backward()
        opt.step()
        return 1.0
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale()


def read_steps(out, expected):
    """The C++ half's OUT/cpp_steps.txt ("name step loss_bits scale_bits" lines) as
    {name: [(name, step, loss, scale), ...]}, or None after saying why when its
    runs are not `expected`."""
    cpp = {}
    for line in open(f"{out}/cpp_steps.txt"):
        name, i, loss, scale = line.split()
        cpp.setdefault(name, []).append((name, int(i), int(loss), int(scale)))
    if set(cpp) != set(expected):
        print(f"FAIL the C++ half ran {sorted(cpp)}, expected {sorted(expected)}")
        return None
    return cpp


def first_difference(rows, cpp_rows):
    """The first step whose row differs (None: every step equal)."""
    first = next((i for i, (a, b) in enumerate(zip(rows, cpp_rows)) if a != b), None)
    return first if first is not None or len(rows) == len(cpp_rows) else min(len(rows), len(cpp_rows))
