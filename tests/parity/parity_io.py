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
