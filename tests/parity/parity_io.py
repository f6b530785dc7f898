"""What the Python twins share (the C++ halves share tests/parity/parity_io.h)."""
import struct

import torch


def bits(x):
    """A float's fp32 bits, as the C++ halves log them."""
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def make_mlp():
    """parity_io.h's make_mlp: 64-128-128-10 with ReLUs, weights randn * 0.05 from seed 0."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                            torch.nn.ReLU(), torch.nn.Linear(128, 10))
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
