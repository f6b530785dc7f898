"""What the Python twins share (the C++ halves share tests/parity/parity_io.h)."""
import os
import struct
import subprocess
import sys
import time

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


# --- the multi-process twins (ddp_twin.py, fsdp_twin.py) ---------------------------

def timeout_s():
    """The C++ halves' collective timeout (AMP_DP_TIMEOUT_MS), in seconds."""
    return int(os.environ.get("AMP_DP_TIMEOUT_MS", "120000")) / 1000.0


def launch_workers(script, out, world, what, env=None):
    """`script --worker OUT WORLD RANK STORE` in `world` processes; all must exit 0 within the
    deadline (the rest are killed on a failure). Returns 0, or the failing status after saying so."""
    store = f"{out}/py_store_w{world}"
    if os.path.exists(store):
        os.remove(store)
    # Gloo on the loopback interface (as amp's 127.0.0.1): no hostname lookup, nothing off the machine.
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
               **(env or {}))
    procs = [subprocess.Popen([sys.executable, script, "--worker", out, str(world), str(r), store], env=env)
             for r in range(world)]
    deadline = time.monotonic() + 4 * timeout_s() + 300
    status = 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            status = failed[0] if failed else 124
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    status = status or next((p.returncode for p in procs if p.returncode), 0)
    if status:
        print(f"FAIL world {world}: a Python {what} process failed or timed out (status {status})")
    return status


def read_rank_steps(path):
    """One rank's "name step a_bits b_bits" lines as {name: [(name, step, a, b), ...]}."""
    steps = {}
    for line in open(path):
        name, i, a, b = line.split()
        steps.setdefault(name, []).append((name, int(i), int(a), int(b)))
    return steps


def same_bits(a, b):
    """The same shape, dtype and bytes."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.numel() == 0 or torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                                         b.reshape(-1).contiguous().view(torch.uint8))
